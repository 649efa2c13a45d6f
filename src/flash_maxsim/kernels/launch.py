"""Host side of the Triton kernels: tile choice and launches, on already validated canonical inputs.

Canonical inputs (see ``flash_maxsim._layout``):
- ``queries`` ``[Nq, Lq, d]``; ``queries_mask`` ``[Nq, Lq]`` uint8 or None;
- ``documents`` either padded ``[T, Ld, d]`` (``offsets`` None) or packed ``[sum Ld_t, d]`` with int64
  ``offsets`` ``[T + 1]``; ``documents_mask`` ``[T, Ld]`` / ``[sum Ld_t]`` uint8 or None;
- ``candidates`` = 0: every query against every document, scores ``[Nq, T]``;
  ``candidates`` = K > 0: documents ``t = q*K + k`` belong to query ``q``, scores ``[Nq, K]``.

Memory: scores ``[Nq, C]`` fp32, plus ``[n_splits, Nq, C]`` partial sums when a query is longer than one
tile (deterministic two-stage sum), plus, only when a gradient will be taken, ``aux`` ``[Nq, C, Lq]``
(arg-max int16, int32 for documents over 32767 tokens, or fp32 log-sum-exp); on the int8 compute-bound grid the
queries quantised before the launch (``[Nq, Lq, d]`` int8 and ``[Nq, Lq]`` fp32, through fp32 temporaries of the
queries' size). Nothing scales with Lq*Ld.
"""

import math

import torch
import triton

from . import _launcher
from .._layout import aux_dtype
from .backward import (maxsim_bwd_dd_binned_kernel, maxsim_bwd_dd_dense_kernel, maxsim_bwd_dd_sparse_kernel,
                       maxsim_bwd_dq_gather_kernel, maxsim_bwd_dq_kernel, maxsim_bwd_fused_kernel)
from .forward import INTERPRETED, maxsim_combine_slices_kernel, maxsim_fwd_kernel
from .forward_token_rows import maxsim_fwd_token_rows_kernel


def interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when first imported)."""
    return INTERPRETED


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: that is a @jit function, and calling it from Python costs ~10 us per call
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _on_cuda_cores(dtype: torch.dtype) -> bool:
    """fp32 inputs at "highest": full-fp32 products, which run on CUDA cores (FMA), not tensor cores. (The
    "ieee" precision name alone does not say this: fp16/bf16 products are "ieee" too, on tensor cores.)"""
    return dtype == torch.float32 and _precision(dtype) == "ieee"


def feature_tiling_for(d: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_D, D_CHUNKS) for inputs of this dtype, forward and backward alike."""
    if _on_cuda_cores(dtype):
        # FMA operand tiles live in registers: 32-wide feature chunks keep them there (128-wide ones spill:
        # run 7, PyLate fp32 scoring 66 ms vs PyTorch's 8 ms). Device run 7 also gave these to bf16 by mistake.
        block_d = min(32, max(16, _pow2(d)))
    else:
        block_d = max(16, _pow2(d)) if d <= 256 else 128
    return block_d, _cdiv(d, block_d)


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


# Tile choices, overridable for tuning sweeps (benchmarks/kernel_check.py --sweep): name -> value.
FORWARD_OVERRIDES: dict = {}


def _triton_at_least(version: str, major: int, minor: int) -> bool:
    """Whether a Triton version string ("3.9.0", "3.10.0+git1234") is ``major.minor`` or later."""
    try:
        found = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return True                     # a build not numbered so: assume a recent one
    return found >= (major, minor)


# From Triton 3.9 the int8 token-rows kernel's loop needs 75 registers where 3.6-3.8 fit it in 64 (offline sm_90:
# capped at 64 it spills 56 stack bytes, with local loads in every tile): 6 programs per SM, uncapped, there
TOKEN_ROWS_INT8_NEEDS_75_REGISTERS = _triton_at_least(triton.__version__, 3, 9)

# From Triton 3.8 tl.reduce / tl.max reduce a thread's values as a balanced tree (3.6-3.7: a chain); the fp8
# compute-bound grid's 8 partial maxima per row folded in a fixed chain (CHAINED_MAX) are faster there (session 43)
REDUCE_IS_A_TREE = _triton_at_least(triton.__version__, 3, 8)


def _row_tiling(Nq, Lq, paired, rows):
    tokb = min(max(16, _pow2(Lq)), rows)
    qpb = 1 if paired else max(1, min(_pow2(Nq), rows // tokb))
    return tokb, qpb


def _programs(Nq, C, Lq, paired, tokb, qpb):
    """Programs of one document slice each: (query block, column, query-token split) triples."""
    return (1 if paired else _cdiv(Nq, qpb)) * C * _cdiv(Lq, tokb)


def _tiling_of_256_rows(Nq, C, Lq, paired, programs_per_sm):
    """(TOKB, QPB) of 256-row tiles where the queries fill all 256 rows and leave at least ``programs_per_sm``
    programs per SM; None otherwise."""
    tokb, qpb = _row_tiling(Nq, Lq, paired, 256)
    if tokb * qpb == 256 and _programs(Nq, C, Lq, paired, tokb, qpb) >= programs_per_sm * _sm_count():
        return tokb, qpb
    return None


# the 256-row tiles' one-document-per-program choices, which forward_config's peeled runs (PEELED_RUNS) replace;
# _forward_plan restores them where the peeled runs' loop cannot run (benchmarks and tests start from them too)
ONE_DOCUMENT_PER_PROGRAM = dict(PROGRAMS_PER_SM=0, PEEL_EACH_DOC=False, MAXNREG=0, TAIL_N=0, PEELED_RUNS=False,
                                TMA_DOCS=False)


def forward_config(Nq, C, Lq, max_len, d, paired, save_aux, dtype=torch.bfloat16, products=None, smooth=False):
    """The forward's tiling and grid choices. ``products``: ``"int8"`` / ``"fp8"`` for 8-bit products
    (eight_bit_products), None otherwise; ``smooth``: the smooth max."""
    tokb, qpb = _row_tiling(Nq, Lq, paired, FORWARD_OVERRIDES.get("ROWS", 128))
    block_d, d_chunks = feature_tiling_for(d, dtype)
    # fp8 products are tiled as int8 ones were measured (fp8's own choices unmeasured: session 17)
    eight_bit = products is not None
    if eight_bit:
        # 8-bit tensor-core products reduce over at least 32 features (Triton refuses a narrower 8-bit tl.dot
        # on the GPU; the interpreter does not check): d < 32 is zero-padded to 32 by the masked loads
        block_d, d_chunks = max(block_d, 32), 1
    # measured on H200 (docs/perf-notes.md, runs 2 and 6): 4 warps; 3 stages since the peeled last tile (run 6:
    # 512x1024 0.222 vs 0.267 ms, d=384 0.376 vs 0.416), 2 for d < 128 (d=96: 0.092 vs 0.097);
    # 128-token tiles when d > 256 (feature axis chunked)
    cfg = dict(TOKB=tokb, QPB=qpb, BLOCK_N=64 if d <= 256 else 128, BLOCK_D=block_d, D_CHUNKS=d_chunks,
               num_warps=4, num_stages=3 if d >= 128 and not save_aux else 2, DSPLIT=1, PEEL_TAIL=True,
               DOCS=1, PROGRAMS_PER_SM=0, WHOLE_TILE_MASKS=False, MAXNREG=0, PREFETCH_TOKENS=False,
               QUANTIZE_FIRST=False, TMA_DOCS=False, BITCAST_SUMS=False, ROW_PARTIALS=1, TAIL_N=0,
               PEEL_EACH_DOC=False, TMA_ONE_DOC=False, CHAINED_MAX=False)
    if _on_cuda_cores(dtype):
        # 2 stages; and the default 4 warps (run 7/9 sweeps, PyLate-shaped 64x512 32x180: 4 warps 2.50 ms vs
        # 8 warps 4.1; 1x20k 4.2 vs 4.5), without the 256-row tiles below
        cfg["num_stages"] = 2
    elif "ROWS" not in FORWARD_OVERRIDES and not save_aux and d <= 256:
        # compute-bound scoring (many query-token rows, many documents): 256-row tiles on 8 warps read each
        # document tile once for twice the rows (run 6: 1x10k 1024x1024 4.75 vs 5.29 ms, 64x1k 0.353 vs 0.381)
        rows256 = _tiling_of_256_rows(Nq, C, Lq, paired, 8)
        if rows256 is not None:
            if eight_bit:
                # integer products: 128 rows x 128-token tiles on 4 warps instead (session 5, 1x10k 1024x1024:
                # 5.89 vs 7.95 ms with 256 rows x 64 tokens), several documents per program so that each program
                # quantises its query rows once for all of them (session 7, run 12, 4 documents: 4.75 vs 5.95 ms);
                # as many as make 16 programs per SM (session 9, device call 1: 4.31 ms; 8: 4.36, 4: 4.45, 2: 4.58,
                # 4 documents per program: 4.70)
                # Session 11 (ab_forward, 1x10k 1024x1024 against 3.43 ms): the run's per-token scales (and mask)
                # loaded a tile ahead (3.32; not on the streaming grid below: 1x10k 32x1030 0.3248 vs 0.3221); the
                # queries quantised before the launch, so that the tensor cores read the query tile from shared memory
                # (ncu: 8% of the warps' time went to its per-tile reload into registers) in 165 registers, and 3
                # programs per SM (3.00; 2 per SM 3.37): 8 waves of 3; whole document tiles copied by TMA (2.93 vs
                # 3.04: no per-thread copy addresses, ~45 of ~600 instructions per tile)
                cfg.update(BLOCK_N=128, PROGRAMS_PER_SM=24, MAXNREG=168, PREFETCH_TOKENS=True, QUANTIZE_FIRST=True,
                           TMA_DOCS=True)
                if products == "fp8":
                    # partial maxima per row across a document's tiles (kernels/forward.py, _fold_row_partials:
                    # session 18, device call 2, ab_forward: 1x10k 1024x1024 2.652 vs 2.743 ms). Not int8's bit-cast
                    # sums at this grid's 168-register cap: a spill in the loop, 2.640 vs 2.527 (call 1).
                    # From Triton 3.8, folded in a fixed chain (_column_chains; session 43, H100, ab_forward, 3, 7
                    # and 7 interleaved rounds under Triton 3.9: 2.557 / 2.641 / 2.629 vs 2.668 / 2.695 / 2.720 ms).
                    # Under 3.6, where tl.reduce already folds them in that order, 2.640 / 2.683 vs 2.653 / 2.633:
                    # no gain
                    cfg.update(ROW_PARTIALS=8, CHAINED_MAX=REDUCE_IS_A_TREE)
                if max_len % 128 == 0 and products == "int8":
                    # documents of whole tiles: the int32 sums read as fp32 bits, not converted (session 16, device
                    # call 1, ab_forward: 1x10k 1024x1024 2.485 vs 2.891 ms). Straddling runs keep the conversion
                    # (offline sm_90: 1520 vs 1415 instructions per tile, with spills)
                    # Their tile max folded in a fixed chain (_tile_max_dropping_nan; session 43, H100, ab_forward,
                    # 5, 7 and 7 interleaved rounds: Triton 3.6 2.511 / 2.509 / 2.523 vs 2.558 / 2.566 / 2.601 ms;
                    # Triton 3.9 2.653 / 2.657 / 2.678 vs 2.646 / 2.664 / 2.702, within 1%)
                    # On 3 stages: each tile's copy is issued late in the tile before it (Triton 3.8+: at its end;
                    # 3.6: three quarters in), and on 2 stages the wait for it took 17% of the stall samples under
                    # 3.9 (ncu, session 44; 5% under 3.6). Session 44, H100, ab_forward, 7 interleaved
                    # rounds, 3 stages against 2: Triton 3.6 2.477 vs 2.569 ms, 3.9 2.571 vs 2.757 (faster in 7 of 7
                    # passes each); sustained at the power cap (energy_probe) 2.561 vs 2.629 ms, 1.80 vs 1.89 J.
                    # (Session 16's kernel was the other way round: 2.530 vs 2.485.) 4 stages: 2.704 / 2.757
                    cfg.update(BITCAST_SUMS=True, num_stages=3, CHAINED_MAX=True)
            else:
                # whole tiles keep the token-range mask on their loads here, in the loop over one document's tiles
                # (session 10, run 22: unmasked, 1x1k 512x1024 0.245 vs 0.232 ms, 1024x1024 0.475 vs 0.458, 1x10k
                # 1024x1024 4.65 vs 4.55; 64x1k 32x300 0.343 vs 0.347). Runs of several documents (below) load
                # whole tiles unmasked, as they were measured (run 22, ab3 / ab4)
                # Partial maxima per row across a document's tiles (_fold_row_partials: no shuffle per tile in the
                # wgmma accumulator's layout; session 18, device call 2, ab_forward against without: 1x1k 512x1024
                # 0.211 vs 0.223 ms, 1024x1024 0.417 vs 0.433, 1x10k 1024x1024 4.09 vs 4.22, 64x1k 32x300 0.346 vs
                # 0.349)
                tokb, qpb = rows256
                cfg.update(TOKB=tokb, QPB=qpb, num_warps=8, WHOLE_TILE_MASKS=True, ROW_PARTIALS=8)
                if max_len % cfg["BLOCK_N"] != 0:
                    # documents that end inside a tile (64x1k 32x300): about 2 programs per SM, each a share of the
                    # documents, a loop per document with its last tile peeled in 16-token tiles, the query tile
                    # loaded once per program, at 128 registers (session 20, ab_forward, 5 and 7 interleaved rounds:
                    # 0.3065 / 0.3093 vs 0.3440 / 0.3423 ms; 32-token tail 0.3150, 4 per SM 0.3187, 3 per SM 0.3491,
                    # registers uncapped 0.4406, the 16-token tail with one document per program 0.3490). Only
                    # where that loop runs (_forward_plan: PEELED_RUNS). The whole tiles copied by TMA (session 21,
                    # 7 interleaved rounds: 0.2905 vs 0.3066 ms, then 0.2878 against session 20's 0.3038; offline
                    # sm_90: 177 instructions per whole tile against 236, no per-thread copy addresses)
                    cfg.update(PROGRAMS_PER_SM=2, PEEL_EACH_DOC=True, MAXNREG=128, TAIL_N=16, PEELED_RUNS=True,
                               TMA_DOCS=True)
    elif ("ROWS" not in FORWARD_OVERRIDES and save_aux and dtype in (torch.bfloat16, torch.float16) and d <= 128
          and max_len >= 512):
        # the training forward (arg-max or log-sum-exp saved) on long documents: 256-row tiles on 8 warps, 3 stages,
        # the peeled tail in 16-token tiles (session 21, ab_forward, two calls of 5 interleaved rounds against 128 rows
        # on 4 warps, 2 stages: ColPali B64 32x1030 0.0884 / 0.0894 vs 0.0984 / 0.0980 ms, B256 1.186 / 1.205 vs
        # 1.245 / 1.252, smooth max B128 0.321 / 0.321 vs 0.352 / 0.351). Not on 300-token documents (4 whole tiles:
        # B128 0.1304 / 0.1299 vs 0.1270 / 0.1275, B64 + 7 negatives 0.2448 / 0.2439 vs 0.2428 / 0.2421); the 512
        # between is unmeasured. Neither 128 rows on 8 warps, 64-row tiles, 256 rows on 16 warps nor 4 stages was
        # faster on any of these (1.1-1.6x), nor two options measured and dropped: several documents per program,
        # and each tile's products issued before the previous tile's fold (docs/perf-notes.md, session 21)
        rows256 = _tiling_of_256_rows(Nq, C, Lq, paired, 2)
        if rows256 is not None:
            tokb, qpb = rows256
            cfg.update(TOKB=tokb, QPB=qpb, num_warps=8, num_stages=3, TAIL_N=16)
    if (save_aux and not smooth and dtype in (torch.bfloat16, torch.float16) and d <= 128
            and cfg["TOKB"] * cfg["QPB"] >= 128):
        # the training forward's hard max: 8 partial (max, arg-max) pairs per row, folded with no reduction or
        # shuffle per tile (kernels/forward.py, _fold_arg_partials; offline sm_90, B64 + 7 negatives: 340
        # instructions per whole tile against 396), whole tiles copied by TMA (session 22, ab_forward, 7 interleaved
        # rounds against aca5130: B128 32x300 0.1183 vs 0.1269 ms, B64 + 7 negatives 0.2212 vs 0.2406, ColPali B64
        # 0.0804 vs 0.0898, B256 1.067 vs 1.216; the pairs alone 0.955-0.922x, TMA alone 1.00-1.21x; 3 stages, 8
        # warps or 256 rows on 300-token documents no faster). Not the smooth max (TMA alone 1.03-1.04x there), nor
        # tiles of fewer than 128 rows, whose mma.sync layout may split a row's columns across warps
        cfg.update(ROW_PARTIALS=8, TMA_ONE_DOC=True)
    # few (query block, document) pairs with long documents: split the document's tokens over programs
    programs = _programs(Nq, C, Lq, paired, tokb, qpb)
    if not save_aux and programs < 2 * _sm_count() and max_len >= 1024:
        # about 2 programs per SM, rounded down, at least 2 slices (session 10, run 22: 16x32 32x8192, 128 pairs,
        # 2 slices 0.066 ms vs 3 (rounded up) 0.072)
        cfg["DSPLIT"] = max(1, min(max(2, 2 * _sm_count() // programs), max_len // 512))
        cfg["num_warps"] = 8
        if tokb * qpb >= 128:
            # partial maxima per row (as above; session 18, call 2: 16x32 32x8192 0.0635 vs 0.0659 ms). Not for
            # 32-row tiles, whose mma.sync layout splits the columns across warps, so that the partials' max crosses
            # warps through shared memory (offline sm_90: 1x1k 32x300 on 4 warps 263 -> 294 instructions per tile;
            # 0.0397 vs 0.0323 ms)
            cfg["ROW_PARTIALS"] = 8
    if not save_aux and (Lq if paired else Nq * Lq) <= 32 and d <= 256:
        # bandwidth-bound (each document token meets at most 32 query tokens): one loop with a masked last
        # tile streams better than a peeled one (session 3, interleaved with both peers: 1x10k 32x300 0.1845
        # vs 0.1908 ms, peers 0.186; 32x1030 0.603 vs 0.608; d=96 0.089 vs 0.092). d=384 (128-token tiles, chunked
        # features) streams better peeled: 0.377 vs 0.385
        cfg["PEEL_TAIL"] = False
        streamed_tokens = (Nq * C if paired else C) * max_len
        if cfg["DSPLIT"] == 1 and streamed_tokens >= 2**19:
            # 2 warps: more programs resident per SM to keep loads in flight (session 7, run 12, bf16 vs 4 warps:
            # 1x10k 32x300 0.1806 vs 0.1820 ms, 32x1030 0.5816 vs 0.5835 and masked 0.602 vs 0.642, 1x1k
            # 32x1024 0.0746 vs 0.0762, d=96 0.0817 vs 0.0896). Not below ~0.5M streamed tokens (1x1k 32x300:
            # 0.0501 vs 0.0457) and not for d > 256 (d=384: 0.49 vs 0.37)
            cfg["num_warps"] = 2
            if (dtype in (torch.bfloat16, torch.float16) and not eight_bit and cfg["D_CHUNKS"] == 1
                    and d < cfg["BLOCK_D"] and max_len % cfg["BLOCK_N"] != 0):
                # features padded to the tile (d=96 in 128): runs of documents (no partial tile per document) at 8
                # programs per SM in 128 registers (session 13, 1x5k 31x257 d=96 against 0.0817 ms: 0.0804; 16 per
                # SM 0.0865, no register cap 0.0827), whole tiles copied by TMA, which zero-fills the features past
                # d (session 13: 0.0791; session 14: 0.0782 vs 0.0807), now that the direct launch encodes the
                # descriptor once per index (kernels/_launcher.py: ~2 us of host time per call, was ~15)
                cfg.update(PROGRAMS_PER_SM=8, MAXNREG=128, TMA_DOCS=True)
        if eight_bit:
            # several documents per program: the query tile loaded and quantised once for all of them (session 5,
            # 4 per program: 1x10k 32x300 0.125 vs 0.156 ms, 32x1030 0.361 vs 0.394), as many as make 8 programs
            # per SM, one equal share each (session 9, device call 1, 2 warps: 0.1123 and 0.3346 ms against 0.1277
            # and 0.3531 with 4 per program; 16 per SM 0.1175 / 0.3393, 4 per SM 0.1311 / 0.3979). Not for bf16
            # documents, whose rows were as fast or faster with one document per program (same call: 1x10k 32x300
            # 0.1812 vs 0.1836 at best, 32x1030 0.5795 vs 0.5908; session 5 with 4 per program: 0.190 vs 0.185).
            # Below 8 x SMs documents this leaves one document per program
            cfg["PROGRAMS_PER_SM"] = 8
            # at most 128 registers: 8 programs of 2 warps per SM. The run of documents whose tiles straddle two
            # documents takes 160 otherwise (6 per SM), and is slower than a loop per document at 6 per SM but
            # faster at 8 (session 10, run 22: 1x10k 32x300 0.1121 vs 0.1136 ms, 32x1030 0.3295 vs 0.3394).
            # Not TMA copies (session 12: 0.1112 vs 0.1121; session 14, with the descriptor encoded once: 0.1104 vs
            # 0.1093) nor deeper pipelines or 128-token tiles (fewer programs per SM: 5-32% slower)
            cfg["MAXNREG"] = 128
            # where the documents form runs (_forward_plan), the token-rows kernel (kernels/forward_token_rows.py:
            # document tokens as the rows of 64- or 128-token wgmma tiles read by TMA, int8 or fp8 straight from
            # shared memory; offline sm_90, 32x300: 64 / 123 registers, no spills). Session 28, device calls 1-3,
            # ab_forward, 5-7 interleaved rounds against the tile kernel: int8 64-token tiles, 8 programs per SM at 64
            # registers, 1x10k 32x300 0.1060 / 0.1065 vs 0.1098 ms, 32x1030 0.3185 / 0.3192 vs 0.3280 / 0.3243 (4-7
            # per SM, 3 stages, 128-token tiles: 0.1072-0.1334 and 0.3208-0.4117); fp8 128-token tiles on one
            # warpgroup, 4 per SM, 0.1083 / 0.1083 vs 0.1288 / 0.1286, 0.3241 / 0.3243 vs 0.3827 / 0.3850 (64-token
            # tiles 0.1085-0.1377, 0.3265-0.4265). Only with TMA (Hopper): unmeasured elsewhere
            cfg.update(TOKEN_ROWS=True, TOKEN_ROWS_TMA=True, TOKEN_ROWS_STAGES=2, TOKEN_ROWS_WARPS=4)
            if products == "fp8":
                cfg.update(TOKEN_ROWS_BLOCK_N=128, TOKEN_ROWS_PROGRAMS_PER_SM=4, TOKEN_ROWS_MAXNREG=0)
            elif TOKEN_ROWS_INT8_NEEDS_75_REGISTERS:
                # session 41, run56 call 2 (H100, Triton 3.9, ab_forward, 5 rounds): 1x10k 32x300 0.1418 ms
                # against 0.1568 at 8 per SM and 64 registers (7 per SM at 72: 0.1439), 32x1030 0.4445 against
                # 0.4740 (0.4448); Triton 3.6's 8 per SM at 64, same call: 0.1425 and 0.4434 (its 6 per SM: 0.1424,
                # 0.4436)
                cfg.update(TOKEN_ROWS_BLOCK_N=64, TOKEN_ROWS_PROGRAMS_PER_SM=6, TOKEN_ROWS_MAXNREG=0)
            else:
                cfg.update(TOKEN_ROWS_BLOCK_N=64, TOKEN_ROWS_PROGRAMS_PER_SM=8, TOKEN_ROWS_MAXNREG=64)
            if products == "fp8" and cfg["num_warps"] == 2:
                # fp8 x fp8 products on 32-row tiles are mma.sync f16 after converting each document tile in
                # registers: one warp per program, registers uncapped (246), issues fewer instructions per token
                # (offline sm_90, 32x300: 1181 warp instructions per 64 tokens against 1604 on 2 warps at 128). Session
                # 18, device call 10, ab_forward: 1x10k 32x300 0.1273 vs 0.1343 ms, 32x1030 0.3933 vs 0.3986. Not
                # int8 (0.1136 vs 0.1108), nor one warp at 128 registers (0.1589) or 12-16 programs per SM on 2
                # stages (0.18-0.25)
                cfg.update(num_warps=1, MAXNREG=0)
    if (dtype in (torch.bfloat16, torch.float16) and not eight_bit and not save_aux and cfg["DSPLIT"] == 1
            and (max_len % cfg["BLOCK_N"] == 0 or cfg["D_CHUNKS"] > 1)):
        # 16-bit documents of whole tiles (or chunked features): runs of several documents, 2 programs per SM
        # (session 10, run 22, against one document per program: 1x1k 32x1024 0.0728 vs 0.0745 ms, 128x1024 0.0758
        # vs 0.0795, 512x1024 0.217 vs 0.229, 1024x1024 0.430 vs 0.440, 1x10k 1024x1024 4.15 vs 4.43, d=384 0.324
        # vs 0.375; 4 per SM within 1% except 128x1024, 0.0778). Not where tiles would straddle documents: 1x10k
        # 32x300 0.189 vs 0.181, 32x1030 0.603 vs 0.579, d=96 0.115 vs 0.082
        cfg["PROGRAMS_PER_SM"] = 2
        if tokb * qpb == 128 and cfg["num_warps"] == 4:
            # 128-row programs on 8 warps (session 13, 1x1k 128x1024 in 7 interleaved rounds: 0.0749 against 0.0764
            # ms; 4 stages 0.0747), whole tiles copied by TMA (session 13: 0.0743; session 14: 0.0748 vs 0.0753 on
            # 8 warps without), now that the descriptor is encoded once per index. Not the 32-row runs (1x1k
            # 32x1024: 0.0732 vs 0.0730)
            cfg.update(num_warps=8, TMA_DOCS=True)
    cfg.update({k: v for k, v in FORWARD_OVERRIDES.items() if k != "ROWS"})
    return cfg


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


def eight_bit_products(documents: torch.Tensor, document_scales, d: int, save_aux: bool):
    """``"int8"`` or ``"fp8"`` where quantized documents are scored with 8-bit x 8-bit tensor-core products, each
    query token quantised like a document token (in the kernel, or just before it), rather than converted to the
    queries' dtype in registers; None otherwise. Only with the whole feature axis in one tile (d <= 256), scoring
    only. int8: faster on every row measured (docs/perf-notes.md, session 5: 1x10k 32x300 0.125 vs 0.170 ms, 32x1030
    0.361 vs 0.507, 1024x1024 5.89 vs 7.13), within the fidelity budget
    (benchmarks/results/quantized-query-fidelity.json). fp8: Hopper's fp8 tensor cores (session 17).
    ``FORWARD_OVERRIDES["INT8_PRODUCTS"]`` / ``["FP8_PRODUCTS"] = False`` switch back to the conversion."""
    if document_scales is None or d > 256 or save_aux:
        return None
    if documents.dtype == torch.int8 and FORWARD_OVERRIDES.get("INT8_PRODUCTS", True):
        return "int8"
    if documents.dtype == getattr(torch, "float8_e4m3fn", None) and FORWARD_OVERRIDES.get("FP8_PRODUCTS", True):
        return "fp8"
    return None


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
    cfg = forward_config(Nq, C, Lq, max_len, d, bool(candidates), save_aux,
                         torch.bfloat16 if quantize_q else queries.dtype, products, smooth)
    # or quantised before the launch (forward() does it), read by the kernel as contiguous 8-bit values
    q_quantized = quantize_q and bool(cfg["QUANTIZE_FIRST"])
    q_strides = _contiguous_strides((Nq, Lq, d)) if q_quantized else queries.stride()
    tokb, qpb, n_ds = cfg["TOKB"], cfg["QPB"], cfg["DSPLIT"]
    if save_aux:
        n_ds = 1
    n_splits = _cdiv(Lq, tokb)
    n_qblocks = 1 if candidates else _cdiv(Nq, qpb)
    if n_ds > 1:
        tokens_per_ds = _cdiv(_cdiv(max_len, n_ds), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
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
            docs = cfg["DOCS"]
            if cfg["PROGRAMS_PER_SM"]:
                # a grid of about PROGRAMS_PER_SM programs per SM, each scoring an equal share of the documents
                docs = max(1, _cdiv(T * n_qblocks * n_splits, cfg["PROGRAMS_PER_SM"] * _sm_count()))
        # several documents per program that lie end to end (and each fill a tile at least): one run of tokens.
        # Tiles that straddle two documents only where Triton 3.6 compiles them: 32 rows, or 128-token tiles of up
        # to 128 rows (its pipeliner fails on 64-token tiles of 64, 128 or 256 rows: run 22 and session 11's
        # benchmarks/probe_runs.py)
        flat = (docs > 1 and Ld >= cfg["BLOCK_N"] and sdt == Ld * sdl
                and (sdmt == Ld * sdml or (document_scales is None and documents_mask is None))
                and (Ld % cfg["BLOCK_N"] == 0 or tokb * qpb <= 32 or (cfg["BLOCK_N"] >= 128 and tokb * qpb <= 128))
                and bool(cfg.get("FLAT_RUN", True)))
        return docs, flat

    docs, flat_run = runs_of(cfg)
    # the 8-bit streaming grid (forward_config's TOKEN_ROWS) with document tokens as the tile's rows
    # (kernels/forward_token_rows.py): the hard max over runs of documents of one block of at most 32 query rows,
    # quantised in the kernel, in its own tiles and grid; the tile kernel wherever its runs do not form
    token_rows = False
    if (cfg.get("TOKEN_ROWS") and products is not None and not smooth and not save_aux and n_ds == 1
            and n_splits == 1 and n_qblocks == 1 and tokb * qpb <= 32 and not q_quantized
            and (not cfg.get("TOKEN_ROWS_TMA") or _tensor_descriptors(queries))):
        tr_cfg = dict(cfg, BLOCK_N=cfg.get("TOKEN_ROWS_BLOCK_N", cfg["BLOCK_N"]),
                      PROGRAMS_PER_SM=cfg.get("TOKEN_ROWS_PROGRAMS_PER_SM", cfg["PROGRAMS_PER_SM"]))
        tr_docs, tr_flat = runs_of(tr_cfg)
        if tr_flat:
            cfg, docs, flat_run, token_rows = tr_cfg, tr_docs, True, True
    if cfg.get("PEELED_RUNS") and (docs == 1 or flat_run):
        # forward_config's several peeled documents per program, in a layout of one document per program (ragged,
        # per-query candidates, a token split) or of one run of tokens: the one-document defaults, as measured
        # (an explicit override of one of these stays)
        cfg = dict(cfg, **{k: v for k, v in ONE_DOCUMENT_PER_PROGRAM.items() if k not in FORWARD_OVERRIDES})
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
    # (kernels/forward.py), instead of one loop over all their tiles, each tested per element; an option
    each_peeled = docs > 1 and not flat_run and bool(cfg["PEEL_TAIL"]) and bool(cfg["PEEL_EACH_DOC"])
    # the loop per document copies its whole tiles by TMA too (the peeled runs' default since session 21), where the
    # documents lie end to end, each one's tokens rows of the descriptor
    # and one padded document per program, where TMA_ONE_DOC (the training forward's hard max)
    one_doc = docs == 1 and offsets is None and Ld > 0 and sdt == Ld * sdl and bool(cfg["TMA_ONE_DOC"])
    several = (flat_run or (each_peeled and sdt == Ld * sdl)) and bool(cfg["TMA_DOCS"])
    if token_rows:
        several = bool(cfg.get("TOKEN_ROWS_TMA", False))
    plan.kernel = maxsim_fwd_token_rows_kernel if token_rows else maxsim_fwd_kernel
    tma_docs = ((several or one_doc) and sdd == 1
                and (sdl * documents.element_size()) % 16 == 0 and documents.data_ptr() % 16 == 0
                and cfg["D_CHUNKS"] == 1 and T * Ld < 2**31 and _tensor_descriptors(queries))
    plan.scalars = (
        # the documents' tensor descriptor (TMA_DOCS): the direct launch encodes it once per documents' address
        _launcher.TensorDesc(1, (T * Ld, d), (sdl, 1), (cfg["BLOCK_N"], cfg["BLOCK_D"])) if tma_docs else None,
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
        QPB=qpb, TOKB=tokb, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], D_CHUNKS=cfg["D_CHUNKS"],
        # bf16 tl.dot, and fp8 conversions and tl.dot, are not exact under the interpreter: fp32 there
        UPCAST=interpreting() and (queries.dtype == torch.bfloat16 or products == "fp8"),
        PRECISION=cfg.get("PRECISION", _precision(queries.dtype)),
        PEEL_TAIL=cfg["PEEL_TAIL"], MULTI_DOC=docs > 1, FLAT_RUN=flat_run,
        STRADDLE=flat_run and Ld % cfg["BLOCK_N"] != 0,
        # d = BLOCK_D: no feature mask (chunked features keep theirs: d=384 with 190 registers instead of 138 was
        # slower, run 22)
        EVEN_D=cfg["D_CHUNKS"] == 1 and d == cfg["BLOCK_D"],
        WHOLE_TILE_MASKS=cfg["WHOLE_TILE_MASKS"],
        PREFETCH_TOKENS=flat_run and (document_scales is not None or documents_mask is not None)
        and bool(cfg["PREFETCH_TOKENS"]),
        Q_QUANTIZED=q_quantized, TMA_DOCS=tma_docs,
        # int8 x int8 sums read as fp32 bits, not converted (kernels/forward.py, _tile_similarities): the hard max
        # over runs of documents
        BITCAST_SUMS=flat_run and products == "int8" and not smooth and bool(cfg["BITCAST_SUMS"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    # tests only: False runs the bit-cast pass alone, without the exact second pass where it falls short
    plan.meta["BITCAST_REDO"] = bool(cfg.get("BITCAST_REDO", True))
    # partial maxima per row (kernels/forward.py, _fold_row_partials): the hard max without arg-max, except in runs
    # of documents whose tiles straddle two documents; with the arg-max (the training forward), 8 partial (max,
    # arg-max) pairs per row (_fold_arg_partials) on tiles of 16 to 64 tokens
    partials = int(cfg["ROW_PARTIALS"])
    if save_aux:
        partials = partials if partials == 8 and cfg["BLOCK_N"] in (16, 32, 64) else 1
    plan.meta["ROW_PARTIALS"] = partials if not smooth and not plan.meta["STRADDLE"] else 1
    if each_peeled:
        plan.meta["PEEL_EACH_DOC"] = True
    # the peeled tail in narrower tiles (kernels/forward.py, _fold_document), where a loop per document peels it:
    # tail tiles of at least 16 tokens (tl.dot's least) that divide the whole ones, documents that can end inside a
    # tile; an option, passed only when taken, so that other kernels stay as they were
    tail_n = int(cfg["TAIL_N"])
    if (tail_n and cfg["PEEL_TAIL"] and (docs == 1 or each_peeled) and 16 <= tail_n < cfg["BLOCK_N"]
            and cfg["BLOCK_N"] % tail_n == 0 and (max_len % cfg["BLOCK_N"] != 0 or offsets is not None)):
        plan.meta["TAIL_N"] = tail_n
    # the hard max's tile max (the bit-cast sums' one max per row, or 8 partial maxima per row) folded in a fixed
    # chain under every Triton (kernels/forward.py, _column_chains), not in tl.max's order (a tree from Triton 3.8),
    # over runs of documents (the int8 and fp8 compute-bound grids' defaults above); passed only when taken
    folds = plan.meta["ROW_PARTIALS"] == 8 or (plan.meta["BITCAST_SUMS"] and plan.meta["ROW_PARTIALS"] == 1)
    if cfg["CHAINED_MAX"] and flat_run and not save_aux and folds:
        plan.meta["CHAINED_MAX"] = True
    if cfg["MAXNREG"]:
        plan.meta["maxnreg"] = cfg["MAXNREG"]
    if token_rows:
        # its own few constexprs; tiles of BLOCK_N tokens on a warpgroup (Hopper's 8-bit products take 64 rows)
        meta = plan.meta
        plan.meta = {k: meta[k] for k in ("HAS_QMASK", "HAS_DMASK", "ZERO_MASKED", "QPB", "TOKB", "BLOCK_N",
                                          "BLOCK_D", "UPCAST", "EVEN_D", "STRADDLE", "TMA_DOCS")}
        plan.meta.update(num_warps=int(cfg.get("TOKEN_ROWS_WARPS", 4)),
                         num_stages=int(cfg.get("TOKEN_ROWS_STAGES", 2)))
        if cfg.get("TOKEN_ROWS_MAXNREG"):
            plan.meta["maxnreg"] = int(cfg["TOKEN_ROWS_MAXNREG"])
    plan.meta_key = tuple(plan.meta.items())
    plan.combine = _combine_plan(n_ds, Nq, C, Lq, smooth_tau) if row_out else None
    return plan


# the target's compute capability where no GPU answers (benchmarks/offline_compile.py sets it); None: ask the device
CAPABILITY_OVERRIDE = None


def _tensor_descriptors(queries) -> bool:
    """Whether this Triton has host tensor descriptors and the device bulk copies (TMA: compute capability 9+;
    the interpreter emulates them)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    if interpreting():
        return True
    if CAPABILITY_OVERRIDE is not None:
        return CAPABILITY_OVERRIDE >= (9, 0)
    return queries.is_cuda and torch.cuda.get_device_capability(queries.device) >= (9, 0)


def _cached_plan(plans: dict, key, build, *args):
    """``plans[key]``, built by ``build(*args)`` on a miss (the cache emptied when it holds _MAX_PLANS)."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[key] = build(*args)
    return plan


def forward(queries, documents, queries_mask, documents_mask, offsets, candidates, zero_masked, smooth_tau,
            save_aux, max_len=None, document_scales=None):
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
           tuple(FORWARD_OVERRIDES.items()) if FORWARD_OVERRIDES else None)
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
        from ..quantization import quantize_tokens
        queries, query_scales = quantize_tokens(queries, plan.products)
    tensors = (queries, documents,
               queries_mask if queries_mask is not None else dummy,
               documents_mask if documents_mask is not None else dummy,
               offsets if offsets is not None else dummy,
               scores, aux if aux is not None else dummy,
               document_scales if document_scales is not None else dummy,
               query_scales if query_scales is not None else dummy)
    _launcher.launch(plan.kernel, plan.grid, tensors, plan.scalars, plan.meta, plan.meta_key, plan)
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
    _launcher.launch(maxsim_combine_slices_kernel, grid, (row_max, row_sum if row_sum is not None else row_max, out),
                     scalars, meta, meta_key)
    return out


def _dq_column_splits(programs: int, C: int, partial_bytes: int, budget_bytes: int, per_sm: int = 4) -> int:
    """Split the column loop so that the dQ grid has ``per_sm`` programs per SM. Partial sums cost
    ``splits * partial_bytes`` (fp32 Nq*Lq*d each), kept within ``budget_bytes``; summed in a fixed order."""
    target = per_sm * _sm_count()
    splits = 1
    while programs * splits < target and C // (splits * 2) >= 8 and (splits * 2) * partial_bytes <= budget_bytes:
        splits *= 2
    return splits


# Backward choices, overridable for tuning sweeps: DD_METHOD "dense" | "binned" | "sparse" (hard max only);
# DD_BLOCK_N, DD_WARPS, DD_STAGES, DD_CHUNK, G_SPLIT (the dense and binned dD's block kernels), DD_MAXNREG (the
# binned dD's register cap, BINNED_DD_MAXNREG by default; 0 = none); DQ_METHOD "rows" |
# "gather" (hard max only; the launch of dQ's programs beside the dense dD's always takes "rows"), DQ_ROWS, DQ_COLS
# (the gather's tile), DQ_WARPS, DQ_STAGES; DQ_PARTIAL_BYTES (memory cap of the dQ column splits' fp32 partial
# sums; 0 = no split); RELOAD_TILE (the smooth max's gradients load each streamed tile twice, once per product, as
# before session 19: an A/B).
BACKWARD_OVERRIDES: dict = {}

# The hard-max dQ in its own launch is a gather of DQ_GATHER_ROWS query rows x as many columns as keep its fp32 sums
# at DQ_GATHER_ELEMENTS (64 registers a thread on 4 warps) per step (maxsim_bwd_dq_gather_kernel). Session 23,
# device call 3, CUDA graphs, against the row-at-a-time kernel (one program of 254 registers per SM): dQ alone
# ColBERT B64 + 7 negatives 0.051 vs 0.100 ms, B128 0.024 vs 0.055, ColPali B64 0.016 vs 0.088, B256 0.087 vs 0.186
# (run44/call3_ab_bwd_graph.txt); 8 rows x 8 columns beat 4 x 16, 16 x 4 and 8 x 16 on 8 warps there, and 2 x 32 in
# call 2 (eager launches, run44/call2_ab_bwd.txt)
DQ_GATHER_ROWS = 8
DQ_GATHER_ELEMENTS = 8192

# "binned" dD (kernels/backward.py, maxsim_bwd_dd_binned_kernel): one program of 4 warps per block of
# BINNED_DD_BLOCK_N tokens of a document picks that block's entries out of the document's arg-max entries, all held
# in its registers (at most BINNED_DD_MAX_ENTRIES: more entries per document, in-batch Nq * Lq > 8192, take the
# dense kernel), then multiplies their one-hot by the gathered query rows. Where it is the default (session 23,
# device call 3, CUDA graphs, dQ and dD; run44/call3_ab_bwd_graph.txt): documents of BINNED_DD_MIN_TOKENS or more
# (ColPali 32x1030 B64 0.042 vs 0.122 ms, B256 0.407 vs 0.612, against session 16's sorted dD, itself 4x faster than
# the dense one there) or of BINNED_DD_MIN_ENTRIES arg-max entries or more (ColBERT B64 + 7 negatives, 512 documents
# of 2048 entries: 0.156 vs 0.235 against the sorted dD; B128, 128 documents of 4096: 0.087 vs 0.169 against the
# dense dD fused with dQ). Below that the dense one, fused with dQ in one launch, is faster: KD 64 x 64 candidates
# (32 entries each) 1.06-1.14x slower binned (session 23, call 2; 0.270 vs 0.120 ms for the sorted dD in session 17)
BINNED_DD_MAX_ENTRIES = 8192
BINNED_DD_BLOCK_N = 64
BINNED_DD_MIN_TOKENS = 1024
BINNED_DD_MIN_ENTRIES = 1024
# its registers capped at 128 (167 uncapped): 4 programs of 4 warps per SM instead of 3, for a kernel that waits on
# latency (run 44 `ncu`: 0.5 instructions issued per cycle and scheduler), at the cost of a small spill (offline
# sm_90: 136 B of stack at B64 + 7 negatives, 224 at B256; 536 instructions per chunk loop against 516). Session 24,
# run45/call2_ab_dd_cap.txt, CUDA graphs, 5 rounds, dD alone: B64 + 7 negatives 0.105 vs 0.112 ms, ColPali B256
# 0.262 vs 0.333 (backward 0.153 vs 0.159, 0.346 vs 0.415). Sessions 25-26 swept 14 shapes
# (run46/call2_dd_cap_sweep.txt): 0.79-0.96 of the uncapped dD on 10, within 1.5% on 2, 1.046 at B32 x 300 and
# 1.038 at B128 x 300 (+0.6 and +2.4 us; grids of 1 and 2 waves either way). A rule by waves would mispredict B32
# and B64 x 1030 (0.96, 0.95 capped), so the cap holds for every shape; 96 registers was slower on 13 of the 14
BINNED_DD_MAXNREG = 128


def default_dd_method(longest: int, entries_per_document: int) -> str:
    """The hard max's dD kernel when no override picks one: "binned" or "dense" (the measurements above)."""
    if longest >= BINNED_DD_MIN_TOKENS or entries_per_document >= BINNED_DD_MIN_ENTRIES:
        return "binned"
    return "dense"


_SM_COUNT = {}


def _sm_count() -> int:
    if not torch.cuda.is_available():
        return 4
    dev = torch.cuda.current_device()
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SM_COUNT[dev]


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
    step's launch cost). The tensors, and the strides of the outputs allocated per call, are added at launch."""
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
    plan = _BackwardPlan()
    plan.inv_tau_log2e = math.log2(math.e) / float(smooth_tau) if smooth else 1.0
    upcast = interpreting() and queries.dtype == torch.bfloat16
    precision = _precision(queries.dtype)
    block_d, d_chunks = feature_tiling_for(d, queries.dtype)
    plan.block_d = block_d
    tokb, qpb = _row_tiling(Nq, Lq, bool(candidates), 128)
    block_n = 64 if d <= 256 else 32
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
                 HAS_DMASK=documents_mask is not None, SMOOTH=smooth,
                 QPB=qpb, TOKB=tokb, BLOCK_D=block_d, D_CHUNKS=d_chunks, UPCAST=upcast, PRECISION=precision)
    if smooth and BACKWARD_OVERRIDES.get("RELOAD_TILE"):
        # the smooth max's gradients (dQ, dense dD) load each streamed tile twice, once per product, as before
        # session 19 (an A/B option, to be removed once measured)
        flags["RELOAD_TILE"] = True
    n_entries = Lq if candidates else Nq * Lq          # arg-max entries per document
    longest = Ld if offsets is None else max_len
    default_dd = default_dd_method(longest, n_entries)
    dd_method = ("dense" if smooth else BACKWARD_OVERRIDES.get("DD_METHOD", default_dd)) if need_dd else None
    e_pow2 = _pow2(max(n_entries, 16))                  # the binned dD's entry ids per document
    if dd_method == "binned" and not (d_chunks == 1 and e_pow2 <= BINNED_DD_MAX_ENTRIES):
        # the binning holds a document's entries in registers
        dd_method = "dense"
    dq_warps = BACKWARD_OVERRIDES.get("DQ_WARPS", 4)
    # dense dD: smooth max recomputes every similarity tile, so 128-token blocks on 8 warps halve the query-row
    # re-reads (session 3 sweep, ColPali smooth B128: 2.30 vs 2.50 ms); hard max keeps 64 on 4 warps
    wide = smooth and d <= 256 and not _on_cuda_cores(queries.dtype)
    dd_block_n = BACKWARD_OVERRIDES.get("DD_BLOCK_N", 128 if wide else block_n)
    dd_warps = BACKWARD_OVERRIDES.get("DD_WARPS", 8 if wide else 4)
    # both gradients in one launch, the first programs dQ's and the rest dD's (one launch less per step: the small
    # steps are host-bound): hard max, where both kernels' tiles agree (session 9, device call 1, interleaved with
    # both peers: ColBERT B128 0.410 vs 0.556 ms as two launches; GPU time from a CUDA graph 0.302 vs 0.344)
    fused = bool(need_dq and dd_method == "dense" and not smooth and dd_block_n == block_n and dd_warps == dq_warps
                 and BACKWARD_OVERRIDES.get("FUSED", True))
    plan.fused = fused
    plan.n_cs = 0
    plan.dq_method = None
    if need_dq:
        dq_method = "rows" if (fused or smooth) else BACKWARD_OVERRIDES.get("DQ_METHOD", "gather")
        if dq_method not in ("rows", "gather"):
            raise ValueError(f"BACKWARD_OVERRIDES['DQ_METHOD'] must be 'rows' or 'gather', got {dq_method!r}")
        plan.dq_method = dq_method
        if dq_method == "gather":
            # features in one slice up to 256 (no tensor-core tiling here), else slices of 128
            gather_d = max(16, _pow2(d)) if d <= 256 else 128
            g_chunks = _cdiv(d, gather_d)
            g_rows = BACKWARD_OVERRIDES.get("DQ_ROWS", DQ_GATHER_ROWS)
            g_cols = BACKWARD_OVERRIDES.get("DQ_COLS", max(1, DQ_GATHER_ELEMENTS // (g_rows * gather_d)))
            n_rblocks = _cdiv(Nq * Lq, g_rows)
            base_programs = n_rblocks * g_chunks
        else:
            n_splits = _cdiv(Lq, tokb)
            n_qblocks = Nq if candidates else _cdiv(Nq, qpb)
            base_programs = n_qblocks * n_splits * d_chunks
        # partial sums may use as much memory as the queries' fp32 gradient itself, and at least 8 MiB
        partial = Nq * Lq * d * 4
        # no split over at most 64 columns: the unsplit loop is short, and the split's partial sums, their sum and
        # cast cost more host time than they save GPU time in the host-bound steps such sizes make (session 8,
        # run 18, interleaved with both peers twice: ColPali B64 8% and 9% faster unsplit, KD 6% faster and 1%
        # slower; B64 + 7 negatives, 512 columns, 41% and 65% slower unsplit)
        budget = 0 if C <= 64 else max(8 << 20, partial)
        if fused:
            # in the launch of the dD programs, dQ's run beside them: split only long column loops (session 9,
            # device call 1, steps eager / GPU time: ColBERT B128 0.410 / 0.302 ms unsplit vs 0.500 / 0.309 split;
            # ColPali B256 3.171 ms 71 MB vs 3.182 ms 83 MB; B64 + 7 negatives, 512 columns, 0.889 / 0.879 unsplit vs
            # 0.623 / 0.609 split)
            budget = 0 if C <= 256 else budget
        # the gather's programs keep 64 document rows in flight each: 2 per SM before splitting the columns
        n_cs = _dq_column_splits(base_programs, C, partial, BACKWARD_OVERRIDES.get("DQ_PARTIAL_BYTES", budget),
                                 2 if dq_method == "gather" else 4)
        cols_per_split = _cdiv(C, n_cs)
        plan.n_cs = n_cs = _cdiv(C, cols_per_split)
        plan.dq_grid = (base_programs * n_cs,)
        if dq_method == "gather":
            plan.dq_scalars = (Nq, Lq, d, Ld, C, max(candidates, 1), n_rblocks, cols_per_split,
                               grad.stride(0), grad.stride(1), sdt, sdl, sdd, aux.stride(0), aux.stride(1),
                               aux.stride(2))
            plan.dq_meta = dict(PAIRED=bool(candidates), RAGGED=offsets is not None, ROWS=g_rows, COLS=g_cols,
                                BLOCK_D=gather_d, D_CHUNKS=g_chunks, num_warps=dq_warps,
                                num_stages=BACKWARD_OVERRIDES.get("DQ_STAGES", 1))
        else:
            dq_sizes = (Nq, Lq, d, Ld, C, max(candidates, 1), n_qblocks, n_splits, n_cs, cols_per_split)
            plan.dq_scalars = (*dq_sizes, *strides)
            plan.dq_meta = dict(flags, BLOCK_N=block_n, num_warps=dq_warps,
                                num_stages=BACKWARD_OVERRIDES.get("DQ_STAGES", 2))
        plan.dq_meta_key = tuple(plan.dq_meta.items())
    plan.dd_method = dd_method
    # hard max, 16-bit inputs, fp32 gradients asked for: the upstream gradient multiplied as two 16-bit parts, whole
    # (both dD kernels). By default it is rounded to the inputs' dtype, as PyTorch's own 16-bit autograd rounds it:
    # the split doubles the tensor-core work (session 8, run 17: ColPali B256 dD 3.02 vs 1.82 ms)
    g_split = bool(BACKWARD_OVERRIDES.get("G_SPLIT", grad_dtype == torch.float32 and not smooth and not upcast
                                          and queries.dtype in (torch.float16, torch.bfloat16)))
    if need_dd:
        if dd_method == "dense":
            # 1 stage (no software pipelining): session 8, run 16, dD alone, hard max B128 32x300 0.175 vs
            # 0.211 ms, B64 + 7 negatives 0.292 vs 0.342, ColPali B64 0.142 vs 0.170, B256 1.82 vs 2.23, KD 0.104 vs
            # 0.114; smooth ColPali B128 0.969 vs 1.047
            # padded documents: blocks over all Ld rows, so that every row of dD is written (it is allocated empty)
            n_nblocks = _cdiv(Ld if offsets is None else max_len, dd_block_n)
            plan.dd_grid = (T * n_nblocks * d_chunks,)
            plan.dd_scalars = (Nq, Lq, d, Ld, max(candidates, 1), n_nblocks, *strides)
            plan.dd_meta = dict(flags, BLOCK_N=dd_block_n, num_warps=dd_warps,
                                num_stages=BACKWARD_OVERRIDES.get("DD_STAGES", 1), G_SPLIT=g_split)
            plan.dd_meta_key = tuple(plan.dd_meta.items())
        elif dd_method == "binned":
            binned_block_n = BACKWARD_OVERRIDES.get("DD_BLOCK_N", BINNED_DD_BLOCK_N)
            n_blocks = _cdiv(longest, binned_block_n)
            plan.binned_shape = (T, e_pow2)
            plan.dd_grid = (T * n_blocks,)
            plan.dd_scalars = (Lq, d, Ld, max(candidates, 1), n_entries, n_blocks, grad.stride(0), grad.stride(1),
                               queries.stride(0), queries.stride(1), queries.stride(2),
                               aux.stride(0), aux.stride(1), aux.stride(2))
            plan.dd_meta = dict(PAIRED=bool(candidates), RAGGED=offsets is not None, BLOCK_N=binned_block_n,
                                BLOCK_D=block_d, CHUNK=BACKWARD_OVERRIDES.get("DD_CHUNK", 64), E_POW2=e_pow2,
                                UPCAST=upcast, PRECISION=precision, G_SPLIT=g_split,
                                num_warps=BACKWARD_OVERRIDES.get("DD_WARPS", 4),
                                num_stages=BACKWARD_OVERRIDES.get("DD_STAGES", 1))
            maxnreg = BACKWARD_OVERRIDES.get("DD_MAXNREG", BINNED_DD_MAXNREG)
            if maxnreg:
                plan.dd_meta["maxnreg"] = maxnreg
            plan.dd_meta_key = tuple(plan.dd_meta.items())
        elif dd_method != "sparse":
            raise ValueError("BACKWARD_OVERRIDES['DD_METHOD'] must be 'dense', 'binned' or 'sparse', "
                             f"got {dd_method!r}")
    if fused:
        plan.fused_grid = (plan.dq_grid[0] + plan.dd_grid[0],)
        plan.fused_scalars = (*dq_sizes, n_nblocks, plan.dq_grid[0], *strides)
        plan.fused_meta = dict(plan.dd_meta, num_stages=BACKWARD_OVERRIDES.get("FUSED_STAGES", 1))
        plan.fused_meta_key = tuple(plan.fused_meta.items())
    return plan


def _dq_outputs(n_cs, queries, dtype):
    """(dQ, what the dQ programs write): with one column split they write dQ itself (through a [1, Nq, Lq, d]
    view); with more, the splits' fp32 partial sums [n_cs, Nq, Lq, d], and dQ is None until ``_summed_dq``."""
    if n_cs == 1:
        dq = torch.empty(queries.shape, dtype=dtype, device=queries.device)
        return dq, dq.unsqueeze(0)
    return None, torch.empty((n_cs, *queries.shape), dtype=torch.float32, device=queries.device)


def _summed_dq(dq, target, dtype):
    """dQ written in place, or the column splits' partial sums added in a fixed order."""
    return dq if dq is not None else target.sum(0).to(dtype)


def _dense_dd_output(documents, offsets, dtype):
    """dD for the dense kernel, and the output strides it takes ([T, Ld, d] padded; packed rows with a zero
    document stride). The kernel writes every row of every padded document (zeros where nothing flows); packed
    values may hold rows past offsets[-1] when the caller supplied max_length (offsets then go unchecked), so
    those are zero-filled."""
    dd = (torch.empty if offsets is None else torch.zeros)(documents.shape, dtype=dtype, device=documents.device)
    return dd, (dd.stride() if offsets is None else (0, dd.stride(0), dd.stride(1)))


def backward(grad, queries, documents, queries_mask, documents_mask, offsets, max_len, aux, candidates,
             smooth_tau, need_dq, need_dd, grad_dtype=None):
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
           tuple(BACKWARD_OVERRIDES.items()) if BACKWARD_OVERRIDES else None)
    plan = _cached_plan(_BACKWARD_PLANS, key, _backward_plan, grad, queries, documents, queries_mask,
                        documents_mask, offsets, max_len, aux, candidates, smooth_tau, need_dq, need_dd, grad_dtype)
    dummy = _dummy(queries)
    qmask = queries_mask if queries_mask is not None else dummy
    dmask = documents_mask if documents_mask is not None else dummy
    offs = offsets if offsets is not None else dummy
    dq = dd = None
    dq_dtype, dd_dtype = grad_dtype or queries.dtype, grad_dtype or documents.dtype

    if plan.fused:
        dq, target = _dq_outputs(plan.n_cs, queries, dq_dtype)
        dd, out_strides = _dense_dd_output(documents, offsets, dd_dtype)
        _launcher.launch(maxsim_bwd_fused_kernel, plan.fused_grid,
                         (grad, queries, documents, qmask, dmask, offs, aux, target, dd),
                         (*plan.fused_scalars, *target.stride(), *out_strides, plan.inv_tau_log2e), plan.fused_meta,
                         plan.fused_meta_key)
        return _summed_dq(dq, target, dq_dtype), dd

    if need_dq:
        dq, target = _dq_outputs(plan.n_cs, queries, dq_dtype)
        if plan.dq_method == "gather":
            _launcher.launch(maxsim_bwd_dq_gather_kernel, plan.dq_grid, (grad, documents, offs, aux, target),
                             (*plan.dq_scalars, *target.stride()), plan.dq_meta, plan.dq_meta_key)
        else:
            _launcher.launch(maxsim_bwd_dq_kernel, plan.dq_grid,
                             (grad, queries, documents, qmask, dmask, offs, aux, target),
                             (*plan.dq_scalars, *target.stride(), plan.inv_tau_log2e), plan.dq_meta,
                             plan.dq_meta_key)
        dq = _summed_dq(dq, target, dq_dtype)
        del target      # the partial sums are freed before dD is allocated, not at return: they would add to its peak

    if need_dd:
        if plan.dd_method == "dense":
            dd, out_strides = _dense_dd_output(documents, offsets, dd_dtype)
            if plan.dd_grid[0] > 0:
                _launcher.launch(maxsim_bwd_dd_dense_kernel, plan.dd_grid,
                                 (grad, queries, documents, qmask, dmask, offs, aux, dd),
                                 (*plan.dd_scalars, *out_strides, plan.inv_tau_log2e), plan.dd_meta, plan.dd_meta_key)
        elif plan.dd_method == "binned":
            dd, out_strides = _dense_dd_output(documents, offsets, dd_dtype)
            if plan.dd_grid[0] > 0:
                # each document's entry ids grouped by block of tokens: documents x E_POW2 int16 (E_POW2 = the
                # entries per document rounded up to a power of two, at most BINNED_DD_MAX_ENTRIES)
                binned = torch.empty(plan.binned_shape, dtype=torch.int16, device=device)
                _launcher.launch(maxsim_bwd_dd_binned_kernel, plan.dd_grid,
                                 (grad, queries, offs, aux, binned, dd),
                                 (*plan.dd_scalars, *out_strides), plan.dd_meta, plan.dd_meta_key)
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
                _launcher.launch(
                    maxsim_bwd_dd_sparse_kernel, grid,
                    (grad, queries, perm, row_start, flat),
                    (n_rows, queries.shape[1], C, d, grad.stride(0), grad.stride(1),
                     queries.stride(0), queries.stride(1), queries.stride(2), flat.stride(0), flat.stride(1)),
                    dict(ROWS=rows_per_program, BLOCK_D=bd, num_warps=4))
    return dq, dd
