"""Host side of the Triton kernels: tile choice and launches, on already validated canonical inputs.

Canonical inputs (see ``flash_maxsim._layout``):
- ``queries`` ``[Nq, Lq, d]``; ``queries_mask`` ``[Nq, Lq]`` uint8 or None;
- ``documents`` either padded ``[T, Ld, d]`` (``offsets`` None) or packed ``[sum Ld_t, d]`` with int64
  ``offsets`` ``[T + 1]``; ``documents_mask`` ``[T, Ld]`` / ``[sum Ld_t]`` uint8 or None;
- ``candidates`` = 0: every query against every document, scores ``[Nq, T]``;
  ``candidates`` = K > 0: documents ``t = q*K + k`` belong to query ``q``, scores ``[Nq, K]``.

Memory: scores ``[Nq, C]`` fp32, plus ``[n_splits, Nq, C]`` partial sums when a query is longer than one
tile (deterministic two-stage sum), plus, only when a gradient will be taken, ``aux`` ``[Nq, C, Lq]``
(int32 arg-max or fp32 log-sum-exp). Nothing scales with Lq*Ld.
"""

import math

import torch
import triton

from .backward import maxsim_bwd_dd_kernel, maxsim_bwd_dq_kernel
from .forward import maxsim_fwd_kernel


def interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when first imported)."""
    return type(maxsim_fwd_kernel).__name__ == "InterpretedFunction"


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _feature_tiling(d: int) -> tuple[int, int]:
    block_d = max(16, _pow2(d)) if d <= 256 else 128
    return block_d, triton.cdiv(d, block_d)


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


def _dummy(device):
    return torch.empty(1, dtype=torch.uint8, device=device)


def forward(queries, documents, queries_mask, documents_mask, offsets, candidates, zero_masked, smooth_tau,
            save_aux):
    Nq, Lq, d = queries.shape
    T = documents.shape[0] if offsets is None else offsets.shape[0] - 1
    Ld = documents.shape[1] if offsets is None else 0
    C = candidates if candidates else T
    device = queries.device
    smooth = smooth_tau is not None

    tokb = min(max(16, _pow2(Lq)), 128)
    n_splits = triton.cdiv(Lq, tokb)
    qpb = 1 if candidates else max(1, min(_pow2(Nq), 128 // tokb))
    n_qblocks = 1 if candidates else triton.cdiv(Nq, qpb)
    block_d, d_chunks = _feature_tiling(d)
    block_n = 64 if d <= 256 else 32

    scores = torch.empty((n_splits, Nq, C), dtype=torch.float32, device=device)
    if save_aux:
        aux = torch.empty((Nq, C, Lq), dtype=torch.float32 if smooth else torch.int32, device=device)
    else:
        aux = torch.empty((0, 0, 0), dtype=torch.int32, device=device)

    dummy = _dummy(device)
    sdt, sdl, sdd = _doc_strides(documents, offsets)
    sqmn, sqml = (queries_mask.stride(0), queries_mask.stride(1)) if queries_mask is not None else (0, 0)
    sdmt, sdml = _mask_strides(documents_mask, offsets)
    tau = float(smooth_tau) if smooth else 1.0
    upcast = interpreting() and queries.dtype == torch.bfloat16
    grid = (T * n_qblocks * n_splits,)
    maxsim_fwd_kernel[grid](
        queries, documents,
        queries_mask if queries_mask is not None else dummy,
        documents_mask if documents_mask is not None else dummy,
        offsets if offsets is not None else dummy,
        scores, aux,
        Nq, Lq, d, Ld, max(candidates, 1),
        n_qblocks, n_splits,
        queries.stride(0), queries.stride(1), queries.stride(2),
        sdt, sdl, sdd,
        sqmn, sqml,
        sdmt, sdml,
        scores.stride(0), scores.stride(1), scores.stride(2),
        *(aux.stride() if save_aux else (0, 0, 0)),
        tau, math.log2(math.e) / tau,
        PAIRED=bool(candidates), RAGGED=offsets is not None, HAS_QMASK=queries_mask is not None,
        HAS_DMASK=documents_mask is not None, ZERO_MASKED=bool(zero_masked), SMOOTH=smooth, SAVE_AUX=bool(save_aux),
        QPB=qpb, TOKB=tokb, BLOCK_N=block_n, BLOCK_D=block_d, D_CHUNKS=d_chunks,
        UPCAST=upcast, PRECISION=_precision(queries.dtype),
        num_warps=4, num_stages=2,
    )
    out = scores[0] if n_splits == 1 else scores.sum(0)
    return out, aux


def backward(grad, queries, documents, queries_mask, documents_mask, offsets, max_len, aux, candidates,
             smooth_tau, need_dq, need_dd, grad_dtype=None):
    """``max_len``: the longest document (ragged) or Ld (padded); sizes the dD grid without a host sync."""
    Nq, Lq, d = queries.shape
    T = documents.shape[0] if offsets is None else offsets.shape[0] - 1
    Ld = documents.shape[1] if offsets is None else 0
    C = candidates if candidates else T
    device = queries.device
    smooth = smooth_tau is not None
    inv_tau_log2e = math.log2(math.e) / float(smooth_tau) if smooth else 1.0
    upcast = interpreting() and queries.dtype == torch.bfloat16
    precision = _precision(queries.dtype)
    block_d, d_chunks = _feature_tiling(d)
    tokb = min(max(16, _pow2(Lq)), 128)
    block_n = 64 if d <= 256 else 32
    dummy = _dummy(device)
    sdt, sdl, sdd = _doc_strides(documents, offsets)
    sdmt, sdml = _mask_strides(documents_mask, offsets)
    grad = grad.float()
    dq = dd = None

    if need_dq:
        dq = torch.empty(queries.shape, dtype=grad_dtype or queries.dtype, device=device)
        n_splits = triton.cdiv(Lq, tokb)
        grid = (Nq * n_splits * d_chunks,)
        maxsim_bwd_dq_kernel[grid](
            grad, queries, documents,
            documents_mask if documents_mask is not None else dummy,
            offsets if offsets is not None else dummy,
            aux, dq,
            Nq, Lq, d, Ld, C, max(candidates, 1),
            n_splits,
            grad.stride(0), grad.stride(1),
            queries.stride(0), queries.stride(1), queries.stride(2),
            sdt, sdl, sdd,
            sdmt, sdml,
            aux.stride(0), aux.stride(1), aux.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            inv_tau_log2e,
            PAIRED=bool(candidates), RAGGED=offsets is not None, HAS_DMASK=documents_mask is not None,
            SMOOTH=smooth, TOKB=tokb, BLOCK_N=block_n, BLOCK_D=block_d, D_CHUNKS=d_chunks,
            UPCAST=upcast, PRECISION=precision, num_warps=4, num_stages=2,
        )

    if need_dd:
        dd = torch.empty(documents.shape, dtype=grad_dtype or documents.dtype, device=device)
        n_nblocks = triton.cdiv(max_len, block_n)
        grid = (T * n_nblocks * d_chunks,)
        if offsets is None:
            sodt, sodl, sodd = dd.stride()
        else:
            sodt, sodl, sodd = 0, dd.stride(0), dd.stride(1)
        if grid[0] > 0:
            maxsim_bwd_dd_kernel[grid](
                grad, queries, documents,
                queries_mask if queries_mask is not None else dummy,
                documents_mask if documents_mask is not None else dummy,
                offsets if offsets is not None else dummy,
                aux, dd,
                Nq, Lq, d, Ld, max(candidates, 1),
                n_nblocks, max_len,
                grad.stride(0), grad.stride(1),
                queries.stride(0), queries.stride(1), queries.stride(2),
                sdt, sdl, sdd,
                *((queries_mask.stride(0), queries_mask.stride(1)) if queries_mask is not None else (0, 0)),
                sdmt, sdml,
                aux.stride(0), aux.stride(1), aux.stride(2),
                sodt, sodl, sodd,
                inv_tau_log2e,
                PAIRED=bool(candidates), RAGGED=offsets is not None, HAS_QMASK=queries_mask is not None,
                HAS_DMASK=documents_mask is not None, SMOOTH=smooth,
                TOKB=tokb, BLOCK_N=block_n, BLOCK_D=block_d, D_CHUNKS=d_chunks,
                UPCAST=upcast, PRECISION=precision, num_warps=4, num_stages=2,
            )
        else:
            dd.zero_()
    return dq, dd
