"""Host side of the Triton kernels: launch plans and launches, on already validated canonical inputs.

Canonical inputs (see ``flash_maxsim._layout``):
- ``queries`` ``[Nq, Lq, d]``; ``queries_mask`` ``[Nq, Lq]`` uint8 or None;
- ``documents`` either padded ``[T, Ld, d]`` (``offsets`` None) or packed ``[sum Ld_t, d]`` with int64
  ``offsets`` ``[T + 1]``; ``documents_mask`` ``[T, Ld]`` / ``[sum Ld_t]`` uint8 or None;
- ``candidates`` = 0: every query against every document, scores ``[Nq, T]``;
  ``candidates`` = K > 0: documents ``t = q*K + k`` belong to query ``q``, scores ``[Nq, K]``.

The tiles come from ``kernels/tuning.py`` (the policy); a plan turns them and the inputs' layout into a launch's
grid, arguments and kernel flags, cached per shape, stride, dtype and flag key, so that a repeated call (a serving
loop, a training step) spends its host time on the launch alone.

Memory: scores ``[Nq, C]`` fp32, plus ``[n_splits, Nq, C]`` partial sums when a query is longer than one
tile (deterministic two-stage sum), plus, only when a gradient will be taken, ``aux`` ``[Nq, C, Lq]``
(arg-max int16, int32 for documents over 32767 tokens, or fp32 log-sum-exp); on the int8 compute-bound grid the
queries quantised before the launch (``[Nq, Lq, d]`` int8 and ``[Nq, Lq]`` fp32, through fp32 temporaries of the
queries' size). Nothing scales with Lq*Ld.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import direct_launch, tuning
from .._types import aux_dtype
from .backward import (maxsim_bwd_dd_binned_kernel, maxsim_bwd_dd_sparse_kernel, maxsim_bwd_dq_gather_kernel,
                       maxsim_bwd_kernel)
from .forward import INTERPRETED, maxsim_combine_slices_kernel, maxsim_fwd_kernel
from .forward_token_rows import maxsim_fwd_token_rows_kernel
from .tuning import cdiv as _cdiv
from .tuning import eight_bit_products
from .tuning import pow2 as _pow2

__all__ = ["forward", "backward", "eight_bit_products", "interpreting"]


def interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when first imported)."""
    return INTERPRETED


def _doc_strides(documents, offsets):
    if offsets is None:
        return documents.stride(0), documents.stride(1), documents.stride(2)
    return 0, documents.stride(0), documents.stride(1)


def _mask_strides(mask, offsets):
    if mask is None:
        return 0, 0
    if offsets is None:
        return mask.stride(0), mask.stride(1)
    return 0, mask.stride(0)


def _dummy(queries):
    """The stand-in for absent optional pointers (never read: their HAS_* flag is off). The queries tensor
    itself: a launch allocates nothing for it, and it stays valid under CUDA-graph capture."""
    return queries


def _cached_plan(plans: dict, key, build, *args):
    """``plans[key]``, built by ``build(*args)`` on a miss (the cache emptied when it holds _MAX_PLANS)."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[key] = build(*args)
    return plan


class _ForwardPlan:
    """Everything about one forward launch that depends only on shapes, strides, dtypes and flags."""

    __slots__ = ("grid", "scalars", "meta", "meta_key", "scores_shape", "aux_shape", "aux_dtype", "row_out",
                 "n_splits", "docs", "combine", "products", "kernel")


# (shapes, strides, dtypes, flags) -> _ForwardPlan. Building a plan costs ~30 us of Python; a scoring call in a
# serving loop repeats the same key, so the host time of a small (launch-bound) call is mostly the kernel launch.
_FORWARD_PLANS: dict = {}
_MAX_PLANS = 4096


def _contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _forward_plan(queries, documents, queries_mask, documents_mask, offsets, candidates, zero_masked, smooth_tau,
                  save_aux, max_len, document_scales):
    Nq, Lq, d = queries.shape
    T = documents.shape[0] if offsets is None else offsets.shape[0] - 1
    Ld = documents.shape[1] if offsets is None else 0
    C = candidates if candidates else T
    smooth = smooth_tau is not None
    if document_scales is not None and queries.is_cuda and documents.dtype != torch.int8 \
            and torch.cuda.get_device_capability(queries.device) < (8, 9):
        raise TypeError("fp8 documents need a GPU with native fp8 (compute capability >= 8.9); use dtype='int8'")
    products = eight_bit_products(documents, document_scales, d, save_aux)
    quantize_q = products is not None
    # queries quantised in the kernel: tiled like bf16 ones (both on tensor cores)
    cfg = tuning.forward_config(Nq, C, Lq, max_len, d, bool(candidates), save_aux,
                                torch.bfloat16 if quantize_q else queries.dtype, products, smooth)
    # or quantised before the launch (forward() does it), read by the kernel as contiguous 8-bit values
    q_quantized = quantize_q and bool(cfg.QUANTIZE_FIRST)
    q_strides = _contiguous_strides((Nq, Lq, d)) if q_quantized else queries.stride()
    tokb, qpb, n_ds = cfg.TOKB, cfg.QPB, cfg.DSPLIT
    if save_aux:
        n_ds = 1
    n_splits = _cdiv(Lq, tokb)
    n_qblocks = 1 if candidates else _cdiv(Nq, qpb)
    if n_ds > 1:
        tokens_per_ds = _cdiv(_cdiv(max_len, n_ds), cfg.BLOCK_N) * cfg.BLOCK_N
        n_ds = _cdiv(max_len, tokens_per_ds)
    else:
        tokens_per_ds = 2**31 - 1      # one slice: the whole document, whatever its length
    # several documents per program: padded in-batch documents, scoring only, one slice per document
    sdt, sdl, sdd = _doc_strides(documents, offsets)
    # quantized documents: the scales are read with the mask's strides (both made contiguous by the caller)
    sdmt, sdml = _mask_strides(document_scales if document_scales is not None else documents_mask, offsets)

    def runs_of(cfg):
        """(documents per program, whether they form one run of tokens) under the tile choices ``cfg``."""
        docs = 1
        if not (candidates or offsets is not None or save_aux or n_ds > 1 or Ld == 0):
            docs = cfg.DOCS
            if cfg.PROGRAMS_PER_SM:
                # a grid of about PROGRAMS_PER_SM programs per SM, each scoring an equal share of the documents
                docs = max(1, _cdiv(T * n_qblocks * n_splits, cfg.PROGRAMS_PER_SM * tuning.sm_count()))
        # several documents per program that lie end to end (and each fill a tile at least): one run of tokens.
        # Tiles that straddle two documents only where Triton 3.6 compiles them: 32 rows, or 128-token tiles of up
        # to 128 rows (its pipeliner fails on 64-token tiles of 64, 128 or 256 rows)
        flat = (docs > 1 and Ld >= cfg.BLOCK_N and sdt == Ld * sdl
                and (sdmt == Ld * sdml or (document_scales is None and documents_mask is None))
                and (Ld % cfg.BLOCK_N == 0 or tokb * qpb <= 32 or (cfg.BLOCK_N >= 128 and tokb * qpb <= 128))
                and bool(cfg.FLAT_RUN))
        return docs, flat

    docs, flat_run = runs_of(cfg)
    # the 8-bit streaming grid (TOKEN_ROWS) with document tokens as the tile's rows (kernels/forward_token_rows.py):
    # the hard max over runs of documents of one block of at most 32 query rows, quantised in the kernel, in its own
    # tiles and grid; the tile kernel wherever its runs do not form
    token_rows = False
    if (cfg.TOKEN_ROWS and products is not None and not smooth and not save_aux and n_ds == 1
            and n_splits == 1 and n_qblocks == 1 and tokb * qpb <= 32 and not q_quantized
            and (not cfg.TOKEN_ROWS_TMA or tuning.has_tma(queries))):
        tr_cfg = cfg.for_token_rows()
        tr_docs, tr_flat = runs_of(tr_cfg)
        if tr_flat:
            cfg, docs, flat_run, token_rows = tr_cfg, tr_docs, True, True
    if cfg.PEELED_RUNS and (docs == 1 or flat_run):
        # the peeled runs in a layout of one document per program (ragged, per-query candidates, a token split) or
        # of one run of tokens: the one-document choices
        cfg = cfg.one_document_per_program()
        docs, flat_run = 1, False
    plan = _ForwardPlan()
    plan.products = products
    plan.row_out = row_out = n_ds > 1
    plan.n_splits = n_splits
    plan.docs = docs
    if row_out:
        # per-row states of each document-token slice, combined by _combine_token_slices
        plan.scores_shape = (n_ds, Nq, C, Lq)
        plan.aux_shape = (n_ds, Nq, C, Lq) if smooth else None
        plan.aux_dtype = torch.float32
        so = sa = (0, 0, 0)
        sr = _contiguous_strides(plan.scores_shape)
    else:
        plan.scores_shape = (Nq, C) if n_splits == 1 else (n_splits, Nq, C)
        plan.aux_shape = (Nq, C, Lq) if save_aux else None
        plan.aux_dtype = aux_dtype(smooth_tau, max_len)
        so = (0,) + _contiguous_strides(plan.scores_shape) if n_splits == 1 else _contiguous_strides(plan.scores_shape)
        sa = _contiguous_strides(plan.aux_shape) if save_aux else (0, 0, 0)
        sr = (0, 0, 0, 0)
    sqmn, sqml = (queries_mask.stride(0), queries_mask.stride(1)) if queries_mask is not None else (0, 0)
    tau = float(smooth_tau) if smooth else 1.0
    plan.grid = (_cdiv(T, docs) * n_qblocks * n_splits * n_ds,)
    # the whole tiles of a run of documents (tiles that straddle two documents included: a tile is BLOCK_N
    # consecutive rows) copied by the tensor memory accelerator (Hopper; the interpreter runs descriptors too): a
    # [tokens, d] descriptor with a 16-byte aligned base and rows (the base's alignment is in the plan's key), int32
    # row coordinates, blocks of [BLOCK_N, BLOCK_D] (features past d arrive as zeros); the run's partial last tile
    # keeps the per-thread copies
    # several documents per program, not one run of tokens: a loop per document with its last tile peeled
    # (kernels/forward.py), instead of one loop over all their tiles, each tested per element
    each_peeled = docs > 1 and not flat_run and bool(cfg.PEEL_TAIL) and bool(cfg.PEEL_EACH_DOC)
    # the loop per document copies its whole tiles by TMA too, where the documents lie end to end, each one's tokens
    # rows of the descriptor; and one padded document per program, where TMA_ONE_DOC (the training forward's hard max)
    one_doc = docs == 1 and offsets is None and Ld > 0 and sdt == Ld * sdl and bool(cfg.TMA_ONE_DOC)
    several = (flat_run or (each_peeled and sdt == Ld * sdl)) and bool(cfg.TMA_DOCS)
    if token_rows:
        several = bool(cfg.TOKEN_ROWS_TMA)
    plan.kernel = maxsim_fwd_token_rows_kernel if token_rows else maxsim_fwd_kernel
    tma_docs = ((several or one_doc) and sdd == 1
                and (sdl * documents.element_size()) % 16 == 0 and documents.data_ptr() % 16 == 0
                and cfg.D_CHUNKS == 1 and T * Ld < 2**31 and tuning.has_tma(queries))
    plan.scalars = (
        # the documents' tensor descriptor (TMA_DOCS): the direct launch encodes it once per documents' address
        direct_launch.TensorDesc(1, (T * Ld, d), (sdl, 1), (cfg.BLOCK_N, cfg.BLOCK_D)) if tma_docs else None,
        Nq, Lq, d, Ld, max(candidates, 1), T, docs,
        n_qblocks, n_splits, n_ds, tokens_per_ds,
        *q_strides,
        sdt, sdl, sdd,
        sqmn, sqml,
        sdmt, sdml,
        *so, *sa, *sr,
        tau, math.log2(math.e) / tau,
    )
    plan.meta = dict(
        HAS_SCALES=document_scales is not None, QUANTIZE_Q=quantize_q, ROW_OUT=row_out, PAIRED=bool(candidates),
        RAGGED=offsets is not None, HAS_QMASK=queries_mask is not None, HAS_DMASK=documents_mask is not None,
        ZERO_MASKED=bool(zero_masked), SMOOTH=smooth, SAVE_AUX=bool(save_aux) and not row_out,
        QPB=qpb, TOKB=tokb, BLOCK_N=cfg.BLOCK_N, BLOCK_D=cfg.BLOCK_D, D_CHUNKS=cfg.D_CHUNKS,
        # bf16 tl.dot, and fp8 conversions and tl.dot, are not exact under the interpreter: fp32 there
        UPCAST=interpreting() and (queries.dtype == torch.bfloat16 or products == "fp8"),
        PRECISION=cfg.PRECISION if cfg.PRECISION is not None else tuning.precision(queries.dtype),
        PEEL_TAIL=cfg.PEEL_TAIL, MULTI_DOC=docs > 1, FLAT_RUN=flat_run,
        STRADDLE=flat_run and Ld % cfg.BLOCK_N != 0,
        # d = BLOCK_D: no feature mask (chunked features keep theirs: without it d=384 took 190 registers instead of
        # 138, and was slower)
        EVEN_D=cfg.D_CHUNKS == 1 and d == cfg.BLOCK_D,
        WHOLE_TILE_MASKS=cfg.WHOLE_TILE_MASKS,
        PREFETCH_TOKENS=flat_run and (document_scales is not None or documents_mask is not None)
        and bool(cfg.PREFETCH_TOKENS),
        Q_QUANTIZED=q_quantized, TMA_DOCS=tma_docs,
        # int8 x int8 sums read as fp32 bits, not converted (kernels/forward.py, _tile_similarities): the hard max
        # over runs of documents
        BITCAST_SUMS=flat_run and products == "int8" and not smooth and bool(cfg.BITCAST_SUMS),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # tests only: False runs the bit-cast pass alone, without the exact second pass where it falls short
    plan.meta["BITCAST_REDO"] = bool(cfg.BITCAST_REDO)
    # partial maxima per row (kernels/forward.py, _fold_row_partials): the hard max without arg-max, except in runs
    # of documents whose tiles straddle two documents; with the arg-max (the training forward), 8 partial (max,
    # arg-max) pairs per row (_fold_arg_partials) on tiles of 16 to 64 tokens
    partials = int(cfg.ROW_PARTIALS)
    if save_aux:
        partials = partials if partials == 8 and cfg.BLOCK_N in (16, 32, 64) else 1
    plan.meta["ROW_PARTIALS"] = partials if not smooth and not plan.meta["STRADDLE"] else 1
    if each_peeled:
        plan.meta["PEEL_EACH_DOC"] = True
    # the peeled tail in narrower tiles (kernels/forward.py, _fold_document), where a loop per document peels it:
    # tail tiles of at least 16 tokens (tl.dot's least) that divide the whole ones, documents that can end inside a
    # tile; an option, passed only when taken, so that other kernels stay as they were
    tail_n = int(cfg.TAIL_N)
    if (tail_n and cfg.PEEL_TAIL and (docs == 1 or each_peeled) and 16 <= tail_n < cfg.BLOCK_N
            and cfg.BLOCK_N % tail_n == 0 and (max_len % cfg.BLOCK_N != 0 or offsets is not None)):
        plan.meta["TAIL_N"] = tail_n
    # the hard max's tile max (the bit-cast sums' one max per row, or 8 partial maxima per row) folded in a fixed
    # chain under every Triton (kernels/forward.py, _column_chains), not in tl.max's order (a tree from Triton 3.8),
    # over runs of documents (the int8 and fp8 compute-bound grids' defaults); passed only when taken
    folds = plan.meta["ROW_PARTIALS"] == 8 or (plan.meta["BITCAST_SUMS"] and plan.meta["ROW_PARTIALS"] == 1)
    if cfg.CHAINED_MAX and flat_run and not save_aux and folds:
        plan.meta["CHAINED_MAX"] = True
    if cfg.MAXNREG:
        plan.meta["maxnreg"] = cfg.MAXNREG
    if token_rows:
        # its own few constexprs; tiles of BLOCK_N tokens on a warpgroup (Hopper's 8-bit products take 64 rows)
        meta = plan.meta
        plan.meta = {k: meta[k] for k in ("HAS_QMASK", "HAS_DMASK", "ZERO_MASKED", "QPB", "TOKB", "BLOCK_N",
                                          "BLOCK_D", "UPCAST", "EVEN_D", "STRADDLE", "TMA_DOCS")}
        plan.meta.update(num_warps=int(cfg.TOKEN_ROWS_WARPS), num_stages=int(cfg.TOKEN_ROWS_STAGES))
        if cfg.TOKEN_ROWS_MAXNREG:
            plan.meta["maxnreg"] = int(cfg.TOKEN_ROWS_MAXNREG)
    plan.meta_key = tuple(plan.meta.items())
    plan.combine = _combine_plan(n_ds, Nq, C, Lq, smooth_tau) if row_out else None
    return plan


def forward(queries: Tensor, documents: Tensor, queries_mask: Optional[Tensor], documents_mask: Optional[Tensor],
            offsets: Optional[Tensor], candidates: int, zero_masked: bool, smooth_tau: Optional[float],
            save_aux: bool, max_len: Optional[int] = None,
            document_scales: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Scores ``[Nq, C]`` fp32 and ``aux`` (``[Nq, C, Lq]`` when ``save_aux``, else None)."""
    device = queries.device
    if max_len is None:
        max_len = documents.shape[1]
    if document_scales is not None:
        document_scales = document_scales.contiguous()
        if documents_mask is not None:
            documents_mask = documents_mask.contiguous()
    key = (queries.shape, queries.stride(), queries.dtype, documents.shape, documents.stride(), documents.dtype,
           None if queries_mask is None else queries_mask.stride(),
           None if documents_mask is None else documents_mask.stride(),
           None if offsets is None else offsets.shape[0],
           # the scales' dtype too (bf16 or fp32): the plan stands for every tensor's dtype in the launcher's key
           None if document_scales is None else document_scales.dtype,
           # whether TMA can read the documents (a 16-byte aligned base)
           documents.data_ptr() % 16 == 0,
           candidates, zero_masked, smooth_tau, save_aux, max_len, device,
           queries.dtype == torch.float32 and torch.get_float32_matmul_precision(),
           tuning.FORWARD_OVERRIDES.key)
    plan = _cached_plan(_FORWARD_PLANS, key, _forward_plan, queries, documents, queries_mask, documents_mask,
                        offsets, candidates, zero_masked, smooth_tau, save_aux, max_len, document_scales)
    scores = torch.empty(plan.scores_shape, dtype=torch.float32, device=device)
    dummy = _dummy(queries)
    # no aux tensor when the kernel writes none (an allocation costs ~3 us of host time, a tenth of a small
    # scoring call's)
    aux = torch.empty(plan.aux_shape, dtype=plan.aux_dtype, device=device) if plan.aux_shape is not None else None
    query_scales = None
    if plan.meta.get("Q_QUANTIZED"):
        # the compute-bound 8-bit grid: a few small PyTorch launches (tens of us) before a kernel of milliseconds
        from .._types import quantize_tokens
        queries, query_scales = quantize_tokens(queries, plan.products)
    tensors = (queries, documents,
               queries_mask if queries_mask is not None else dummy,
               documents_mask if documents_mask is not None else dummy,
               offsets if offsets is not None else dummy,
               scores, aux if aux is not None else dummy,
               document_scales if document_scales is not None else dummy,
               query_scales if query_scales is not None else dummy)
    direct_launch.launch(plan.kernel, plan.grid, tensors, plan.scalars, plan.meta, plan.meta_key, plan)
    if plan.row_out:
        return _combine_token_slices(scores, aux, plan.combine), None
    return (scores if plan.n_splits == 1 else scores.sum(0)), aux


def _combine_plan(n_ds, Nq, C, Lq, smooth_tau):
    """(grid, scalars, meta, meta key) of the combine launch for per-row states [n_ds, Nq, C, Lq], planned with
    the forward's (a small scoring call is host-bound: nothing here is recomputed per call)."""
    block_l = min(_pow2(Lq), 128)
    block_c = max(16, min(_pow2(C), 2048 // block_l))
    n_cblocks = _cdiv(C, block_c)
    tau = float(smooth_tau) if smooth_tau is not None else 1.0
    meta = dict(SMOOTH=smooth_tau is not None, BLOCK_C=block_c, BLOCK_L=block_l, num_warps=4)
    return (Nq * n_cblocks,), (n_ds, Nq, C, Lq, n_cblocks, tau, math.log2(math.e) / tau), meta, tuple(meta.items())


def _combine_token_slices(row_max, row_sum, combine):
    """Per-row states of the document-token slices [n_ds, Nq, C, Lq] -> scores [Nq, C], in one launch (fixed
    order; ``combine`` from _combine_plan). Masked query rows hold -inf (and a sum of 0): the forward kernel writes
    them so."""
    grid, scalars, meta, meta_key = combine
    out = torch.empty(scalars[1:3], dtype=torch.float32, device=row_max.device)
    direct_launch.launch(maxsim_combine_slices_kernel, grid,
                         (row_max, row_sum if row_sum is not None else row_max, out), scalars, meta, meta_key)
    return out


def _sorted_entries(aux, documents, offsets, candidates):
    """Hard-max entries grouped by destination document row, for the sparse dD kernel.

    Entry e = (q*C + col)*Lq + i (the flat index into aux) goes to row ``first_row(doc(q, col)) + aux[e]``.
    A stable sort keeps entries of one row in increasing e, so the summation order is fixed (deterministic).
    Returns (perm [entries] int64, row_start [n_rows + 1] int64, n_rows)."""
    Nq, C, Lq = aux.shape
    device = aux.device
    if offsets is None:
        T, Ld = documents.shape[0], documents.shape[1]
        n_rows = T * Ld
    else:
        n_rows = documents.shape[0]
    cols = torch.arange(C, device=device, dtype=torch.int64)
    if candidates:
        t = torch.arange(Nq, device=device, dtype=torch.int64)[:, None] * candidates + cols[None, :]
    else:
        t = cols[None, :].expand(Nq, C)
    key_dtype = torch.int32 if n_rows < 2**31 - 1 else torch.int64
    first_row = (t * Ld if offsets is None else offsets[t]).to(key_dtype)
    key = torch.where(aux >= 0, first_row[:, :, None] + aux.to(key_dtype), n_rows).reshape(-1)
    sorted_key, perm = torch.sort(key, stable=True)
    del key
    row_start = torch.searchsorted(sorted_key, torch.arange(n_rows + 1, device=device, dtype=key_dtype))
    return perm, row_start, n_rows


class _BackwardPlan:
    """Everything a backward's launches take that is fixed by shapes, strides, dtypes, flags and tuning
    choices (cached per key like the forward's plan: building it is ~35 us of Python, several times a small
    step's launch cost), the strides of the outputs allocated per call included (they are contiguous): each
    launch's scalars are one tuple of the plan, and only the tensors are added at launch."""
    __slots__ = ("n_cs", "dq_method", "dq_grid", "dq_scalars", "dq_meta", "dq_meta_key", "dd_method", "dd_grid",
                 "dd_scalars", "dd_meta", "dd_meta_key", "block_d", "inv_tau_log2e", "fused", "fused_grid",
                 "fused_scalars", "fused_meta", "fused_meta_key", "binned_shape")


_BACKWARD_PLANS: dict = {}


def _backward_plan(grad, queries, documents, queries_mask, documents_mask, offsets, max_len, aux, candidates,
                   smooth_tau, need_dq, need_dd, grad_dtype):
    Nq, Lq, d = queries.shape
    T = documents.shape[0] if offsets is None else offsets.shape[0] - 1
    Ld = documents.shape[1] if offsets is None else 0
    C = candidates if candidates else T
    smooth = smooth_tau is not None
    upcast = interpreting() and queries.dtype == torch.bfloat16
    cfg = tuning.backward_config(Nq, C, Lq, d, Ld if offsets is None else max_len, bool(candidates), queries.dtype,
                                 smooth, need_dq, need_dd, grad_dtype, upcast)
    plan = _BackwardPlan()
    plan.inv_tau_log2e = math.log2(math.e) / float(smooth_tau) if smooth else 1.0
    plan.block_d = cfg.BLOCK_D
    sdt, sdl, sdd = _doc_strides(documents, offsets)
    sdmt, sdml = _mask_strides(documents_mask, offsets)
    sqmn, sqml = (queries_mask.stride(0), queries_mask.stride(1)) if queries_mask is not None else (0, 0)
    # what both kernels take after their own sizes, and their common flags
    strides = (grad.stride(0), grad.stride(1),
               queries.stride(0), queries.stride(1), queries.stride(2),
               sdt, sdl, sdd,
               sqmn, sqml,
               sdmt, sdml,
               aux.stride(0), aux.stride(1), aux.stride(2))
    flags = dict(PAIRED=bool(candidates), RAGGED=offsets is not None, HAS_QMASK=queries_mask is not None,
                 HAS_DMASK=documents_mask is not None, SMOOTH=smooth, QPB=cfg.QPB, TOKB=cfg.TOKB,
                 BLOCK_D=cfg.BLOCK_D, D_CHUNKS=cfg.D_CHUNKS, UPCAST=upcast, PRECISION=tuning.precision(queries.dtype))
    if cfg.RELOAD_TILE:
        flags["RELOAD_TILE"] = True
    plan.fused = fused = cfg.FUSED
    plan.n_cs = 0
    plan.dq_method = cfg.DQ_METHOD
    # the outputs' strides: dQ's programs write dQ [Nq, Lq, d] (as a [1, Nq, Lq, d] tensor) or the column splits'
    # partial sums [n_cs, Nq, Lq, d]; dD's write dD, [T, Ld, d] padded, packed rows with a zero document stride
    dd_strides = _contiguous_strides(documents.shape) if offsets is None else \
        (0,) + _contiguous_strides(documents.shape)
    if need_dq:
        plan.n_cs = n_cs = cfg.DQ_COLUMN_SPLITS
        dq_strides = _contiguous_strides((n_cs, Nq, Lq, d))
        cols_per_split = _cdiv(C, n_cs)
        if cfg.DQ_METHOD == "gather":
            n_rblocks = _cdiv(Nq * Lq, cfg.DQ_ROWS)
            plan.dq_grid = (n_rblocks * cfg.DQ_D_CHUNKS * n_cs,)
            plan.dq_scalars = (Nq, Lq, d, Ld, C, max(candidates, 1), n_rblocks, cols_per_split,
                               grad.stride(0), grad.stride(1), sdt, sdl, sdd, aux.stride(0), aux.stride(1),
                               aux.stride(2), *dq_strides)
            plan.dq_meta = dict(PAIRED=bool(candidates), RAGGED=offsets is not None, ROWS=cfg.DQ_ROWS,
                                COLS=cfg.DQ_COLS, BLOCK_D=cfg.DQ_BLOCK_D, D_CHUNKS=cfg.DQ_D_CHUNKS,
                                num_warps=cfg.DQ_WARPS, num_stages=cfg.DQ_STAGES)
        else:
            n_splits = _cdiv(Lq, cfg.TOKB)
            n_qblocks = Nq if candidates else _cdiv(Nq, cfg.QPB)
            plan.dq_grid = (n_qblocks * n_splits * cfg.D_CHUNKS * n_cs,)
            dq_sizes = (Nq, Lq, d, Ld, C, max(candidates, 1), n_qblocks, n_splits, n_cs, cols_per_split)
            # maxsim_bwd_kernel's arguments up to dQ's output strides (dD's sizes: 0, not read)
            plan.dq_scalars = (*dq_sizes, 0, 0, *strides, *dq_strides, 0, 0, 0, plan.inv_tau_log2e)
            plan.dq_meta = dict(flags, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.DQ_WARPS, num_stages=cfg.DQ_STAGES,
                                G_SPLIT=False, PROGRAMS="dq")
        plan.dq_meta_key = tuple(plan.dq_meta.items())
    plan.dd_method = cfg.DD_METHOD
    if cfg.DD_METHOD == "dense":
        # padded documents: blocks over all Ld rows, so that every row of dD is written (it is allocated empty)
        n_nblocks = _cdiv(Ld if offsets is None else max_len, cfg.DD_BLOCK_N)
        plan.dd_grid = (T * n_nblocks * cfg.D_CHUNKS,)
        # maxsim_bwd_kernel's arguments up to dD's output strides (dQ's sizes and strides: 0, not read)
        plan.dd_scalars = (Nq, Lq, d, Ld, 0, max(candidates, 1), 0, 0, 0, 0, n_nblocks, 0, *strides, 0, 0, 0, 0,
                           *dd_strides, plan.inv_tau_log2e)
        plan.dd_meta = dict(flags, BLOCK_N=cfg.DD_BLOCK_N, num_warps=cfg.DD_WARPS, num_stages=cfg.DD_STAGES,
                            G_SPLIT=cfg.G_SPLIT, PROGRAMS="dd")
        plan.dd_meta_key = tuple(plan.dd_meta.items())
    elif cfg.DD_METHOD == "binned":
        n_entries = Lq if candidates else Nq * Lq          # arg-max entries per document
        e_pow2 = _pow2(max(n_entries, 16))                  # entry ids per document, in registers
        n_blocks = _cdiv(Ld if offsets is None else max_len, cfg.DD_BLOCK_N)
        plan.binned_shape = (T, e_pow2)
        plan.dd_grid = (T * n_blocks,)
        plan.dd_scalars = (Lq, d, Ld, max(candidates, 1), n_entries, n_blocks, grad.stride(0), grad.stride(1),
                           queries.stride(0), queries.stride(1), queries.stride(2),
                           aux.stride(0), aux.stride(1), aux.stride(2), *dd_strides)
        plan.dd_meta = dict(PAIRED=bool(candidates), RAGGED=offsets is not None, BLOCK_N=cfg.DD_BLOCK_N,
                            BLOCK_D=cfg.BLOCK_D, CHUNK=cfg.DD_CHUNK, E_POW2=e_pow2, UPCAST=upcast,
                            PRECISION=tuning.precision(queries.dtype), G_SPLIT=cfg.G_SPLIT, num_warps=cfg.DD_WARPS,
                            num_stages=cfg.DD_STAGES)
        if cfg.DD_MAXNREG:
            plan.dd_meta["maxnreg"] = cfg.DD_MAXNREG
        plan.dd_meta_key = tuple(plan.dd_meta.items())
    if fused:
        plan.fused_grid = (plan.dq_grid[0] + plan.dd_grid[0],)
        plan.fused_scalars = (*dq_sizes, n_nblocks, plan.dq_grid[0], *strides, *dq_strides, *dd_strides,
                              plan.inv_tau_log2e)
        plan.fused_meta = dict(plan.dd_meta, num_stages=cfg.FUSED_STAGES, PROGRAMS="both")
        plan.fused_meta_key = tuple(plan.fused_meta.items())
    return plan


def _dq_outputs(n_cs, queries, dtype, device):
    """(dQ, what the dQ programs write): with one column split they write dQ itself (with the strides of a
    [1, Nq, Lq, d] tensor, from the plan); with more, the splits' fp32 partial sums [n_cs, Nq, Lq, d], and dQ is
    None until ``_summed_dq``."""
    if n_cs == 1:
        dq = torch.empty(queries.shape, dtype=dtype, device=device)
        return dq, dq
    return None, torch.empty((n_cs, *queries.shape), dtype=torch.float32, device=device)


def _summed_dq(dq, target, dtype):
    """dQ written in place, or the column splits' partial sums added in a fixed order."""
    return dq if dq is not None else target.sum(0).to(dtype)


def _dense_dd_output(documents, offsets, dtype, device):
    """dD for the dense and binned kernels (contiguous: the plan holds its strides). The kernels write every row
    of every padded document (zeros where nothing flows); packed values may hold rows past offsets[-1] when the
    caller supplied max_length (offsets then go unchecked), so those are zero-filled."""
    return (torch.empty if offsets is None else torch.zeros)(documents.shape, dtype=dtype, device=device)


def backward(grad: Tensor, queries: Tensor, documents: Tensor, queries_mask: Optional[Tensor],
             documents_mask: Optional[Tensor], offsets: Optional[Tensor], max_len: int, aux: Tensor,
             candidates: int, smooth_tau: Optional[float], need_dq: bool, need_dd: bool,
             grad_dtype: Optional[torch.dtype] = None) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``max_len``: the longest document (ragged) or Ld (padded); sizes the dD grid without a host sync.

    Launches: the hard max with both gradients, one (dQ's programs and dD's in the same grid); otherwise one per
    gradient asked for.

    Extra memory: dQ partial sums (n_csplits * Nq * Lq * d fp32, n_csplits <= 16, only when the grid would
    otherwise be small; beside dD in the single launch, freed before it otherwise); hard-max dD with
    DD_METHOD="binned" (the default where default_dd_method picks it): each document's entry ids grouped by block,
    documents x E_POW2 int16 (E_POW2 = the entries per document, Nq * Lq in-batch or Lq per candidate, rounded up to
    a power of two; ColPali B256: 4 MiB); with DD_METHOD="sparse": the sorted entry list (~16 bytes per Nq*C*Lq
    entry, plus the sort's own buffers)."""
    device = queries.device
    grad = grad.float()
    key = (grad.shape, grad.stride(), queries.shape, queries.stride(), queries.dtype, documents.shape,
           documents.stride(), documents.dtype,
           None if queries_mask is None else queries_mask.stride(),
           None if documents_mask is None else documents_mask.stride(),
           None if offsets is None else offsets.shape[0], max_len, aux.shape, aux.stride(), candidates, smooth_tau,
           need_dq, need_dd, grad_dtype, device,
           queries.dtype == torch.float32 and torch.get_float32_matmul_precision(),
           tuning.BACKWARD_OVERRIDES.key)
    plan = _cached_plan(_BACKWARD_PLANS, key, _backward_plan, grad, queries, documents, queries_mask,
                        documents_mask, offsets, max_len, aux, candidates, smooth_tau, need_dq, need_dd, grad_dtype)
    dummy = _dummy(queries)
    qmask = queries_mask if queries_mask is not None else dummy
    dmask = documents_mask if documents_mask is not None else dummy
    offs = offsets if offsets is not None else dummy
    dq = dd = None
    dq_dtype, dd_dtype = grad_dtype or queries.dtype, grad_dtype or documents.dtype

    if plan.fused:
        dq, target = _dq_outputs(plan.n_cs, queries, dq_dtype, device)
        dd = _dense_dd_output(documents, offsets, dd_dtype, device)
        direct_launch.launch(maxsim_bwd_kernel, plan.fused_grid,
                             (grad, queries, documents, qmask, dmask, offs, aux, target, dd), plan.fused_scalars,
                             plan.fused_meta, plan.fused_meta_key)
        return _summed_dq(dq, target, dq_dtype), dd

    if need_dq:
        dq, target = _dq_outputs(plan.n_cs, queries, dq_dtype, device)
        if plan.dq_method == "gather":
            direct_launch.launch(maxsim_bwd_dq_gather_kernel, plan.dq_grid, (grad, documents, offs, aux, target),
                                 plan.dq_scalars, plan.dq_meta, plan.dq_meta_key)
        else:
            direct_launch.launch(maxsim_bwd_kernel, plan.dq_grid,
                                 (grad, queries, documents, qmask, dmask, offs, aux, target, dummy),
                                 plan.dq_scalars, plan.dq_meta, plan.dq_meta_key)
        dq = _summed_dq(dq, target, dq_dtype)
        del target      # the partial sums are freed before dD is allocated, not at return: they would add to its peak

    if need_dd:
        if plan.dd_method == "dense":
            dd = _dense_dd_output(documents, offsets, dd_dtype, device)
            if plan.dd_grid[0] > 0:
                direct_launch.launch(maxsim_bwd_kernel, plan.dd_grid,
                                     (grad, queries, documents, qmask, dmask, offs, aux, dummy, dd),
                                     plan.dd_scalars, plan.dd_meta, plan.dd_meta_key)
        elif plan.dd_method == "binned":
            dd = _dense_dd_output(documents, offsets, dd_dtype, device)
            if plan.dd_grid[0] > 0:
                # each document's entry ids grouped by block of tokens: documents x E_POW2 int16 (E_POW2 = the
                # entries per document rounded up to a power of two, at most BINNED_DD_MAX_ENTRIES)
                binned = torch.empty(plan.binned_shape, dtype=torch.int16, device=device)
                direct_launch.launch(maxsim_bwd_dd_binned_kernel, plan.dd_grid,
                                     (grad, queries, offs, aux, binned, dd), plan.dd_scalars, plan.dd_meta,
                                     plan.dd_meta_key)
        else:
            dd = torch.zeros(documents.shape, dtype=dd_dtype, device=device)
            if aux.numel() == 0:
                return dq, dd
            d = queries.shape[2]
            C = aux.shape[1]
            perm, row_start, n_rows = _sorted_entries(aux, documents, offsets, candidates)
            flat = dd.view(-1, d)
            rows_per_program = 16
            bd = min(plan.block_d, 128)
            grid = (_cdiv(n_rows, rows_per_program) * _cdiv(d, bd),)
            if grid[0] > 0:
                direct_launch.launch(
                    maxsim_bwd_dd_sparse_kernel, grid,
                    (grad, queries, perm, row_start, flat),
                    (n_rows, queries.shape[1], C, d, grad.stride(0), grad.stride(1),
                     queries.stride(0), queries.stride(1), queries.stride(2), flat.stride(0), flat.stride(1)),
                    dict(ROWS=rows_per_program, BLOCK_D=bd, num_warps=4))
    return dq, dd
