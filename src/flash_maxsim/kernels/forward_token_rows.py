"""The 8-bit streaming forward with the similarity tile transposed: document tokens as its rows.

Where a compressed (int8 / fp8) index streams past a few query rows (at most 32: one query, bandwidth-bound),
``maxsim_fwd_kernel`` multiplies the 32 query rows by each 64-token document tile on ``mma.sync`` (32 rows are too
few for Hopper's warpgroup products, which take 64), and fp8 tiles are converted to fp16 in registers first.
Here the tile is ``S^T = D_tile @ Q^T``: the tile's 64 document tokens are the products' rows (the M of a
warpgroup product on Hopper, int8 or fp8 read straight from shared memory) and the query rows its columns. Each
thread keeps an element-wise running max of its part of the tile over a document's tiles (document tokens are
interchangeable under the max), so a tile costs a conversion (int8), a multiply by the token's scale (one per
row: a thread needs two) and a max per similarity, and the max across tokens (across threads and warps) is
taken once per document, when its score is written.

Scores the same function as ``maxsim_fwd_kernel`` with 8-bit products on runs of documents (``FLAT_RUN``: padded
documents end to end, each at least one tile long, several per program, tiles that may straddle two documents),
hard max, both masked modes, bit for bit: the same int32 or fp32 sums, the same scaling, the same maxima and the
same sum over a query's rows (``_store_query_scores``).
"""

import triton
import triton.language as tl

from .forward import (_document_tile, _max_propagating_nan, _quantized_query_tile, _scales_as_fp32,
                      _store_query_scores, _token_values)


@triton.jit
def _token_rows_tile(D, run_d, run_m, n, run_len, q_cols, DMASK, SCALES, d_cols, stride_dl, stride_dd, stride_dml, d,
                     D_DESC, tma_row, PARTIAL: tl.constexpr, HAS_DMASK: tl.constexpr, ZERO_MASKED: tl.constexpr,
                     EVEN_D: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr):
    """``S^T[token, row]`` for the run's tokens ``n``: the 8-bit products' sums times the token's scale, masked
    (-inf where a token does not count; 0 for a masked token in ``ZERO_MASKED`` mode). ``PARTIAL``: the run's last
    tile, which may pass its end ``run_len``. ``TMA``: a whole tile copied from the descriptor, rows ``tma_row +
    [0, BLOCK_N)``. ``q_cols``: the quantized query tile transposed, [features, rows]."""
    in_range = n < run_len
    # the scales are loaded before the products, so that their latency overlaps the products' (kernels/forward.py)
    sc = _token_values(SCALES, run_m, n, stride_dml, in_range, PARTIAL, None, False)
    d_tile = _document_tile(D + run_d + n[:, None] * stride_dl + d_cols[None, :].to(tl.int64) * stride_dd, in_range,
                            d_cols, d, D_DESC, tma_row, PARTIAL, EVEN_D, TMA)
    if q_cols.dtype == tl.int8:
        # exact int32 sums, exactly converted (|sum| <= 127^2 d < 2^24)
        s = tl.dot(d_tile, q_cols, out_dtype=tl.int32).to(tl.float32)
    elif UPCAST:
        # the interpreter's fp8 conversions and products are not exact: the values as fp32 numbers
        s = tl.dot(d_tile.to(tl.float32), q_cols, input_precision="ieee")
    else:
        s = tl.dot(d_tile, q_cols, out_dtype=tl.float32)
    s = s * _scales_as_fp32(sc)[:, None]
    if HAS_DMASK:
        dm = _token_values(DMASK, run_m, n, stride_dml, in_range, PARTIAL, None, False)
        if ZERO_MASKED:
            s = tl.where((dm != 0)[:, None], s, 0.0)
        else:
            s = tl.where((dm != 0)[:, None], s, float("-inf"))
    if PARTIAL:
        s = tl.where(in_range[:, None], s, float("-inf"))
    return s


@triton.jit
def _close_document(OUT, m, row_ok, q_scale, Nq, tj, stride_on, stride_oc, QPB: tl.constexpr, TOKB: tl.constexpr):
    """Document ``tj`` done: each query row's max over the running maxima of the tile's token rows (NaN
    propagating), times the row's query scale, 0 where no token counted, summed per query."""
    m_rows = tl.reduce(m, 0, _max_propagating_nan)
    has_any = m_rows != float("-inf")
    row_val = tl.where(has_any, m_rows * q_scale, 0.0)
    _store_query_scores(OUT, row_val, row_ok, 0, Nq, tj, 0, 0, stride_on, stride_oc, QPB, TOKB)


@triton.jit
def _fold_token_rows_tile(m, s, tj, doc_end, n0, OUT, row_ok, q_scale, Nq, Ld, stride_on, stride_oc,
                          BLOCK_N: tl.constexpr, QPB: tl.constexpr, TOKB: tl.constexpr, STRADDLE: tl.constexpr):
    """One tile (tokens ``n0 + [0, BLOCK_N)`` of the run) folded into the running maxima ``m`` ([BLOCK_N, rows]):
    its tokens up to document ``tj``'s end (run offset ``doc_end``) close that document (its scores are written),
    the rest open the next one (``STRADDLE``: documents that end inside a tile; they hold at least BLOCK_N tokens,
    so a tile meets at most one end)."""
    in_doc = (doc_end - n0).to(tl.int32)       # tokens of this tile that belong to document tj (>= 1)
    in_one_doc = True
    if STRADDLE:
        in_one_doc = in_doc >= BLOCK_N
    if in_one_doc:
        m = _max_propagating_nan(m, s)
        m_next = tl.full(m.shape, float("-inf"), dtype=tl.float32)
        ends = in_doc == BLOCK_N
    else:
        first = (tl.arange(0, BLOCK_N) < in_doc)[:, None]
        m = _max_propagating_nan(m, tl.where(first, s, float("-inf")))
        m_next = tl.where(first, float("-inf"), s)
        ends = True
    if ends:
        _close_document(OUT, m, row_ok, q_scale, Nq, tj, stride_on, stride_oc, QPB, TOKB)
        m = m_next
        tj += 1
        doc_end += Ld
    return m, tj, doc_end


@triton.jit
def maxsim_fwd_token_rows_kernel(
    Q, D, QMASK, DMASK, OFFSETS, OUT, AUX, SCALES, QSCALES, D_DESC,
    Nq, Lq, d, Ld, K, n_docs, docs_per_program,
    n_qblocks, n_splits, n_dsplits, tokens_per_dsplit,
    stride_qn, stride_ql, stride_qd,
    stride_dt, stride_dl, stride_dd,
    stride_qmn, stride_qml,
    stride_dmt, stride_dml,
    stride_os, stride_on, stride_oc,
    stride_an, stride_ac, stride_al,
    stride_rs, stride_rn, stride_rc, stride_rl,
    tau, inv_tau_log2e,
    HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr, ZERO_MASKED: tl.constexpr,
    QPB: tl.constexpr, TOKB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr, STRADDLE: tl.constexpr, TMA_DOCS: tl.constexpr,
):
    """``maxsim_fwd_kernel``'s arguments (the launch plan's, most unused here: one block of query rows, no split,
    the hard max over runs of documents with 8-bit products; spelled out again, as Triton binds a kernel's arguments
    by its own signature); program ``t`` scores documents ``t * docs_per_program + [0, n_here)``."""
    BLOCK_M: tl.constexpr = QPB * TOKB
    t = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    # int64: a queries view sliced from a tensor of over 2^31 elements has offsets past int32
    qidx = (rows // TOKB).to(tl.int64)
    tok = (rows % TOKB).to(tl.int64)
    row_ok = (qidx < Nq) & (tok < Lq)
    if HAS_QMASK:
        qm = tl.load(QMASK + qidx * stride_qmn + tok * stride_qml, mask=row_ok, other=0)
        row_ok = row_ok & (qm != 0)
    d_cols = tl.arange(0, BLOCK_D)
    q_tile = tl.load(Q + (qidx * stride_qn + tok * stride_ql)[:, None] + d_cols[None, :].to(tl.int64) * stride_qd,
                     mask=row_ok[:, None] & (d_cols[None, :] < d), other=0.0)
    q_tile, q_scale = _quantized_query_tile(q_tile, row_ok, D.dtype.element_ty == tl.float8e4nv, UPCAST)
    # transposed here, once: from Triton 3.9 a transpose inside the loop keeps the query's shared-memory copy (the
    # products' operand) there too, stored again every tile from registers it spills (offline sm_90, 32x300: 4
    # stores, a barrier and 4 local loads per tile, 88 stack bytes; Triton 3.6 hoisted it either way, same PTX)
    q_cols = tl.trans(q_tile)

    n_here = tl.minimum(n_docs - t * docs_per_program, docs_per_program).to(tl.int32)
    tj = t * docs_per_program
    run_d = tj * stride_dt
    run_m = tj * stride_dmt
    run_row = tj * Ld                  # the run's first row of the [tokens, d] descriptor (TMA_DOCS)
    zero64 = t * 0                     # int64: a run's token offsets may pass 2^31
    run_len = (zero64 + n_here) * Ld
    doc_end = zero64 + Ld
    n_whole = (run_len // BLOCK_N).to(tl.int32)
    cols64 = tl.arange(0, BLOCK_N).to(tl.int64)
    m = tl.full((BLOCK_N, BLOCK_M), float("-inf"), dtype=tl.float32)
    for i in range(0, n_whole):
        n0 = (zero64 + i) * BLOCK_N
        s = _token_rows_tile(D, run_d, run_m, n0 + cols64, run_len, q_cols, DMASK, SCALES, d_cols, stride_dl,
                             stride_dd, stride_dml, d, D_DESC, (run_row + n0).to(tl.int32), False, HAS_DMASK,
                             ZERO_MASKED, EVEN_D, UPCAST, TMA_DOCS)
        m, tj, doc_end = _fold_token_rows_tile(m, s, tj, doc_end, n0, OUT, row_ok, q_scale, Nq, Ld, stride_on,
                                               stride_oc, BLOCK_N, QPB, TOKB, STRADDLE)
    if STRADDLE and n_whole * BLOCK_N < run_len:
        n0 = (zero64 + n_whole) * BLOCK_N
        s = _token_rows_tile(D, run_d, run_m, n0 + cols64, run_len, q_cols, DMASK, SCALES, d_cols, stride_dl,
                             stride_dd, stride_dml, d, D_DESC, 0, True, HAS_DMASK, ZERO_MASKED, EVEN_D, UPCAST, False)
        _fold_token_rows_tile(m, s, tj, doc_end, n0, OUT, row_ok, q_scale, Nq, Ld, stride_on, stride_oc, BLOCK_N,
                              QPB, TOKB, STRADDLE)
