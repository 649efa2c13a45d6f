"""Fused MaxSim backward kernels. Deterministic: every output element is produced by one program summing in a
fixed order in fp32 (partial sums over column splits are added afterwards in a fixed order); no atomics.

Given the upstream gradient ``G[q, col]`` and the forward's per-row auxiliary value:
- hard max, ``AUX[q, col, i]`` = first arg-max token ``j`` (-1: no gradient)
    dQ[q, i] = sum_col G[q, col] * D[doc(q, col), j]      (a gather: several columns per step where dQ has its
               own launch, maxsim_bwd_dq_gather_kernel; a row at a time beside the dense dD, _dq_program)
    dD[t]    = sum_q (onehot_j * G[q, col])^T @ Q[q]     (tensor cores: _dd_dense_program, few entries)
             or, each block of a document's tokens' one-hot over its own entries only, picked out of the
               document's in its program (maxsim_bwd_dd_binned_kernel; the default for documents of many entries)
             or, entries pre-sorted by destination row, a gather per row   (maxsim_bwd_dd_sparse_kernel, opt-in)
  The one-hot weights G go to the tensor cores in the inputs' dtype (rounded to it, as PyTorch's 16-bit autograd
  rounds the gradient); with fp32 gradients asked for, as two 16-bit parts (hi + lo): G kept whole.
- smooth max, ``AUX[q, col, i]`` = row log-sum-exp (+inf: no gradient); ``P = exp((S - AUX) / tau)`` is
  recomputed tile by tile from ``S = Q D^T`` (flash-attention style):
    dQ[q]  = sum_col P[q, col] * G[q, col] @ D[doc]                           (_dq_program)
    dD[t]  = sum_q (P[q, col] * G[q, col])^T @ Q[q]                           (_dd_dense_program)
  ``P * G`` is rounded to the input dtype before the tensor-core product, as flash attention rounds ``P``.
Masked (constant) similarities get no gradient in either mode.

The row-at-a-time dQ and the dense dD are ``_*_program(pid, ...)`` functions, run by ``maxsim_bwd_kernel`` alone or
both in one grid (one launch for both gradients of the hard max, whose tiles agree).
"""

import triton
import triton.language as tl

from .forward import _doc_location, _similarity_tile


@triton.jit
def _dq_program(
    pid, G, Q, D, QMASK, DMASK, OFFSETS, AUX, DQ,
    Nq, Lq, d, Ld, C, K,
    n_qblocks, n_splits, n_csplits, cols_per_split,
    stride_gn, stride_gc,
    stride_qn, stride_ql, stride_qd,
    stride_dt, stride_dl, stride_dd,
    stride_qmn, stride_qml,
    stride_dmt, stride_dml,
    stride_an, stride_ac, stride_al,
    stride_os, stride_on, stride_ol, stride_od,
    inv_tau_log2e,
    PAIRED: tl.constexpr, RAGGED: tl.constexpr, HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr,
    SMOOTH: tl.constexpr,
    QPB: tl.constexpr, TOKB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, RELOAD_TILE: tl.constexpr = False,
):
    # program pid: QPB queries x TOKB tokens (one query when PAIRED), a range of columns, one BLOCK_D feature slice
    BLOCK_M: tl.constexpr = QPB * TOKB
    kc = pid % D_CHUNKS
    rest = pid // D_CHUNKS
    cs = rest % n_csplits
    rest = rest // n_csplits
    split = rest % n_splits
    qb = rest // n_splits

    rows = tl.arange(0, BLOCK_M)
    qidx = qb * QPB + rows // TOKB
    tok = split * TOKB + rows % TOKB
    row_ok = (qidx < Nq) & (tok < Lq)
    cols = kc * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < d
    q_row_off = qidx * stride_qn + tok * stride_ql
    d_cols0 = tl.arange(0, BLOCK_D)
    c_lo = cs * cols_per_split
    c_hi = tl.minimum(c_lo + cols_per_split, C)

    q_tile = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if SMOOTH:
        if HAS_QMASK:
            qm = tl.load(QMASK + qidx * stride_qmn + tok * stride_qml, mask=row_ok, other=0)
            q_live = row_ok & (qm != 0)
        else:
            q_live = row_ok
        if D_CHUNKS == 1:
            q_tile = tl.load(Q + q_row_off[:, None] + d_cols0[None, :].to(tl.int64) * stride_qd,
                             mask=q_live[:, None] & (d_cols0[None, :] < d), other=0.0)
            if UPCAST:
                q_tile = q_tile.to(tl.float32)

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for c in range(c_lo, c_hi):
        g = tl.load(G + qidx * stride_gn + c * stride_gc, mask=row_ok, other=0.0).to(tl.float32)
        aux_ptr = AUX + qidx * stride_an + c * stride_ac + tok * stride_al
        if PAIRED:
            t = qb * K + c          # QPB == 1: every row belongs to query qb
        else:
            t = c
        d_base, m_base, dlen = _doc_location(OFFSETS, t, stride_dt, stride_dl, stride_dmt, stride_dml, Ld, RAGGED)
        if SMOOTH:
            lse = tl.load(aux_ptr, mask=row_ok, other=float("inf"))
            for n0 in range(0, dlen, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                in_range = n < dlen
                d_row_off = d_base + n * stride_dl
                if D_CHUNKS == 1 and not HAS_DMASK and not RELOAD_TILE:
                    # one load of the document tile for both products, S = Q D^T and P D (loaded twice, it takes
                    # 16 KB more per 64 tokens and a second pipeline buffer). Not with a documents' mask: its values
                    # would then gate the load a stage ahead (sm_90: ~40 more spills and reloads per tile at the
                    # 255-register limit)
                    valid = in_range
                    d_tile = tl.load(D + d_row_off[:, None] + d_cols0[None, :].to(tl.int64) * stride_dd,
                                     mask=valid[:, None] & (d_cols0[None, :] < d), other=0.0)
                    if UPCAST:
                        d_tile = d_tile.to(tl.float32)
                    s = tl.dot(q_tile, tl.trans(d_tile), input_precision=PRECISION)
                    p = tl.exp2((s - lse[:, None]) * inv_tau_log2e) * g[:, None]
                    p = tl.where(valid[None, :], p, 0.0)
                else:
                    s = _similarity_tile(q_tile, Q, q_row_off, q_live, D, d_row_off, in_range, d_cols0,
                                         stride_qd, stride_dd, d, BLOCK_D, D_CHUNKS, UPCAST, PRECISION, False, True,
                                         False)
                    if HAS_DMASK:
                        dm = tl.load(DMASK + m_base + n * stride_dml, mask=in_range, other=0)
                        valid = in_range & (dm != 0)
                    else:
                        valid = in_range
                    # (the weights before the second load: this order is the masked kernel's code as measured)
                    p = tl.exp2((s - lse[:, None]) * inv_tau_log2e) * g[:, None]
                    p = tl.where(valid[None, :], p, 0.0)
                    # masked tokens load as 0 (P is 0 there; 0 * NaN would leak a stored NaN); chunked features:
                    # this program's slice of them
                    d_tile = tl.load(D + d_row_off[:, None] + cols[None, :].to(tl.int64) * stride_dd,
                                     mask=valid[:, None] & col_ok[None, :], other=0.0)
                    if UPCAST:
                        d_tile = d_tile.to(tl.float32)
                acc += tl.dot(p.to(d_tile.dtype), d_tile, input_precision=PRECISION)
        else:
            j = tl.load(aux_ptr, mask=row_ok, other=-1)
            hit = j >= 0
            drows = tl.load(D + d_base + j.to(tl.int64)[:, None] * stride_dl + cols[None, :].to(tl.int64) * stride_dd,
                            mask=hit[:, None] & col_ok[None, :], other=0.0)
            acc += g[:, None] * drows.to(tl.float32)

    tl.store(DQ + cs * stride_os + qidx[:, None] * stride_on + tok[:, None] * stride_ol + cols[None, :] * stride_od,
             acc.to(DQ.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def maxsim_bwd_dd_sparse_kernel(
    G, Q, PERM, ROW_START, DD,
    n_rows, Lq, C, d,
    stride_gn, stride_gc,
    stride_qn, stride_ql, stride_qd,
    stride_ddr, stride_ddd,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Hard-max dD. ``PERM`` lists entry ids e = (q*C + col)*Lq + i grouped by destination row (stable order);
    row r's contributors are PERM[ROW_START[r]:ROW_START[r+1]]."""
    pid = tl.program_id(0).to(tl.int64)
    n_dchunks = tl.cdiv(d, BLOCK_D)
    rb = pid // n_dchunks
    kc = pid % n_dchunks
    r = rb * ROWS + tl.arange(0, ROWS)
    r_ok = r < n_rows
    cols = kc * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < d
    start = tl.load(ROW_START + r, mask=r_ok, other=0)
    count = tl.load(ROW_START + r + 1, mask=r_ok, other=0) - start
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for k in range(0, tl.max(count, 0)):
        live = k < count
        e = tl.load(PERM + start + k, mask=live, other=0).to(tl.int64)
        i = e % Lq
        qc = e // Lq
        col = qc % C
        q = qc // C
        g = tl.load(G + q * stride_gn + col * stride_gc, mask=live, other=0.0).to(tl.float32)
        qrow = tl.load(Q + q[:, None] * stride_qn + i[:, None] * stride_ql + cols[None, :].to(tl.int64) * stride_qd,
                       mask=live[:, None] & col_ok[None, :], other=0.0)
        acc += g[:, None] * qrow.to(tl.float32)
    tl.store(DD + r[:, None] * stride_ddr + cols[None, :] * stride_ddd, acc.to(DD.dtype.element_ty),
             mask=r_ok[:, None] & col_ok[None, :])


@triton.jit
def maxsim_bwd_dq_gather_kernel(
    G, D, OFFSETS, AUX, DQ,
    Nq, Lq, d, Ld, C, K, n_rblocks, cols_per_split,
    stride_gn, stride_gc,
    stride_dt, stride_dl, stride_dd,
    stride_an, stride_ac, stride_al,
    stride_os, stride_on, stride_ol, stride_od,
    PAIRED: tl.constexpr, RAGGED: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr,
):
    """Hard-max dQ as a gather, COLS columns at a time: program pid sums ``G[q, col] * D[doc(q, col), j]`` over a
    range of columns for ROWS query rows ``(q, i)`` (flat ``q * Lq + i``) and one BLOCK_D slice of the features,
    ROWS * COLS document rows gathered per step (the row-at-a-time loop of ``_dq_program`` keeps ~one gather per
    row in flight: latency-bound). Each (row, column slot) keeps its own fp32 sum, added across slots once at the
    end: a fixed order (deterministic). The next step's arg-max and gradient are loaded a step ahead, so each
    step waits on one load latency, not two."""
    pid = tl.program_id(0).to(tl.int64)
    kc = pid % D_CHUNKS
    rest = pid // D_CHUNKS
    rb = rest % n_rblocks
    cs = rest // n_rblocks
    r = rb * ROWS + tl.arange(0, ROWS)
    row_ok = r < Nq * Lq
    q = r // Lq
    i = r % Lq
    feats = kc * BLOCK_D + tl.arange(0, BLOCK_D)
    f_ok = feats < d
    c_lo = cs * cols_per_split
    c_hi = tl.minimum(c_lo + cols_per_split, C)
    slots = tl.arange(0, COLS)
    g_row = G + q[:, None] * stride_gn
    a_row = AUX + q[:, None] * stride_an + i[:, None] * stride_al

    c = c_lo + slots
    ok = row_ok[:, None] & (c < c_hi)[None, :]
    g = tl.load(g_row + c[None, :] * stride_gc, mask=ok, other=0.0).to(tl.float32)
    j = tl.load(a_row + c[None, :] * stride_ac, mask=ok, other=-1)
    acc = tl.zeros((ROWS, COLS, BLOCK_D), dtype=tl.float32)
    for c0 in range(c_lo, c_hi, COLS):
        # the document rows of this step, and the arg-max and gradient of the next one
        if PAIRED:
            t = q[:, None] * K + (c0 + slots)[None, :]
        else:
            t = (c0 + slots)[None, :] + q[:, None] * 0
        if RAGGED:
            d_base = tl.load(OFFSETS + t, mask=ok, other=0) * stride_dl
        else:
            d_base = t * stride_dt
        hit = j >= 0
        rows = tl.load(D + (d_base + j.to(tl.int64) * stride_dl)[:, :, None] + feats[None, None, :] * stride_dd,
                       mask=hit[:, :, None] & f_ok[None, None, :], other=0.0)
        c_next = c0 + COLS + slots
        ok = row_ok[:, None] & (c_next < c_hi)[None, :]
        g_next = tl.load(g_row + c_next[None, :] * stride_gc, mask=ok, other=0.0).to(tl.float32)
        j = tl.load(a_row + c_next[None, :] * stride_ac, mask=ok, other=-1)
        acc += g[:, :, None] * rows.to(tl.float32)
        g = g_next
    out = tl.sum(acc, axis=1)
    tl.store(DQ + cs * stride_os + q[:, None] * stride_on + i[:, None] * stride_ol + feats[None, :] * stride_od,
             out.to(DQ.dtype.element_ty), mask=row_ok[:, None] & f_ok[None, :])


@triton.jit
def _accumulate_weighted_rows(acc, pt, q_rows, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                              G_SPLIT: tl.constexpr):
    """``acc += pt @ q_rows`` on the tensor cores, the weights ``pt`` (fp32) rounded to the rows' dtype, or, with
    ``G_SPLIT`` (fp32 gradients), multiplied as two parts of it (hi + lo: ~16 bits, not rounded to the dtype)."""
    if UPCAST:
        acc += tl.dot(pt, q_rows.to(tl.float32), input_precision=PRECISION)
    else:
        pt_hi = pt.to(q_rows.dtype)
        acc += tl.dot(pt_hi, q_rows, input_precision=PRECISION)
        if G_SPLIT:
            acc += tl.dot((pt - pt_hi.to(tl.float32)).to(q_rows.dtype), q_rows, input_precision=PRECISION)
    return acc


@triton.jit
def _query_and_column(t, K, PAIRED: tl.constexpr):
    """(the query a document meets, its column of the scores): per-query candidate ``t`` meets query ``t // K`` in
    column ``t % K``; an in-batch document is column ``t`` (of every query: 0 here, entries carry their query)."""
    if PAIRED:
        return t // K, t % K
    return t * 0, t


@triton.jit
def _entry_row(e, q_of_doc, Lq, PAIRED: tl.constexpr):
    """(query, query token) of arg-max entries ``e`` of a document: ``q * Lq + i`` in-batch, ``i`` of the one query
    ``q_of_doc`` that a per-query candidate meets."""
    if PAIRED:
        return q_of_doc + e * 0, e
    return (e // Lq).to(tl.int64), e % Lq


@triton.jit
def maxsim_bwd_dd_binned_kernel(
    G, Q, OFFSETS, AUX, BINNED, DD,
    Lq, d, Ld, K, n_entries, n_blocks,
    stride_gn, stride_gc,
    stride_qn, stride_ql, stride_qd,
    stride_an, stride_ac, stride_al,
    stride_odt, stride_odl, stride_odd,
    PAIRED: tl.constexpr, RAGGED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr, E_POW2: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, G_SPLIT: tl.constexpr,
):
    """Hard-max dD in one launch, one program per (document ``t``, block ``b`` of BLOCK_N tokens): the program
    reads all of the document's arg-max entries (entry ``e`` is ``q * Lq + i``; ``i`` when ``PAIRED``), keeps
    those whose token falls in its block, in increasing ``e`` (a prefix sum gives each its place), and writes their
    ids ``e`` (int16) to its own range of ``BINNED[t]`` (after the ids of the document's earlier blocks: the ranges
    of a document's blocks do not overlap). After a barrier it multiplies the block's one-hot over CHUNK of those
    entries at a time by their gathered query rows on the tensor cores: about ``n_entries`` rows of work per
    document, where the dense kernel multiplies each block by all of them. Each entry's token is gathered again,
    beside its gradient and query row (no longer a chain of dependent loads than keys carrying the token, for half
    their scratch: ColPali B256 4 MiB). No sort of the entries in a launch of its own (the sparse dD's: 241 us of
    ColPali B256's backward on an H200). Fixed order: deterministic. Every row of every block inside the document is
    written."""
    pid = tl.program_id(0)
    t = (pid // n_blocks).to(tl.int64)
    b = pid % n_blocks
    q_of_doc, col = _query_and_column(t, K, PAIRED)
    o_base, _, dlen = _doc_location(OFFSETS, t, stride_odt, stride_odl, 0, 0, Ld, RAGGED)
    if b * BLOCK_N < dlen:
        lo = b * BLOCK_N
        e = tl.arange(0, E_POW2)
        q, i = _entry_row(e, q_of_doc, Lq, PAIRED)
        j = tl.load(AUX + q * stride_an + col * stride_ac + i * stride_al, mask=e < n_entries, other=-1).to(tl.int32)
        mine = ((j >= lo) & (j < lo + BLOCK_N)).to(tl.int32)
        start = tl.sum(((j >= 0) & (j < lo)).to(tl.int32), axis=0)
        count = tl.sum(mine, axis=0)
        place = start + tl.cumsum(mine, 0) - 1
        tl.store(BINNED + t * E_POW2 + place, e.to(BINNED.dtype.element_ty), mask=mine != 0)
        # the ids were written by other threads of this program: a CTA barrier makes them visible
        tl.debug_barrier()
        local = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < d
        ks = tl.arange(0, CHUNK)
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        for k0 in range(0, count, CHUNK):
            ok = k0 + ks < count
            ek = tl.load(BINNED + t * E_POW2 + start + k0 + ks, mask=ok, other=0).to(tl.int32)
            qk, ik = _entry_row(ek, q_of_doc, Lq, PAIRED)
            # int64: row offsets into a queries view sliced from a tensor of over 2^31 elements pass int32
            qk, ik = qk.to(tl.int64), ik.to(tl.int64)
            # past the block's entries: token -1, which matches no row of the block
            jk = tl.load(AUX + qk * stride_an + col * stride_ac + ik * stride_al, mask=ok, other=-1).to(tl.int32)
            g = tl.load(G + qk * stride_gn + col * stride_gc, mask=ok, other=0.0).to(tl.float32)
            q_rows = tl.load(Q + qk[:, None] * stride_qn + ik[:, None] * stride_ql
                             + cols[None, :].to(tl.int64) * stride_qd,
                             mask=ok[:, None] & col_ok[None, :], other=0.0)
            pt = tl.where((jk - lo)[None, :] == local[:, None], g[None, :], 0.0)
            acc = _accumulate_weighted_rows(acc, pt, q_rows, UPCAST, PRECISION, G_SPLIT)
        n = lo + local
        tl.store(DD + o_base + n[:, None].to(tl.int64) * stride_odl + cols[None, :] * stride_odd,
                 acc.to(DD.dtype.element_ty), mask=(n < dlen)[:, None] & col_ok[None, :])


@triton.jit
def _dd_dense_program(
    pid, G, Q, D, QMASK, DMASK, OFFSETS, AUX, DD,
    Nq, Lq, d, Ld, K,
    n_nblocks,
    stride_gn, stride_gc,
    stride_qn, stride_ql, stride_qd,
    stride_dt, stride_dl, stride_dd,
    stride_qmn, stride_qml,
    stride_dmt, stride_dml,
    stride_an, stride_ac, stride_al,
    stride_odt, stride_odl, stride_odd,
    inv_tau_log2e,
    PAIRED: tl.constexpr, RAGGED: tl.constexpr, HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr,
    SMOOTH: tl.constexpr,
    QPB: tl.constexpr, TOKB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, G_SPLIT: tl.constexpr, RELOAD_TILE: tl.constexpr = False,
):
    # program pid: one document, BLOCK_N of its tokens, one BLOCK_D feature slice; loops over blocks of query rows.
    # dD_tile += (W * G)^T @ Q_rows with W = P (smooth) or the one-hot of the arg-max (hard), on tensor cores.
    BLOCK_M: tl.constexpr = QPB * TOKB
    kc = pid % D_CHUNKS
    rest = pid // D_CHUNKS
    nb = rest % n_nblocks
    t = rest // n_nblocks

    if RAGGED:
        start = tl.load(OFFSETS + t).to(tl.int64)
        dlen = tl.load(OFFSETS + t + 1).to(tl.int64) - start
        d_base = start * stride_dl
        m_base = start * stride_dml
        o_base = start * stride_odl
    else:
        dlen = Ld
        d_base = t * stride_dt
        m_base = t * stride_dmt
        o_base = t * stride_odt
    local = tl.arange(0, BLOCK_N)
    n_lo32 = (nb * BLOCK_N).to(tl.int32)
    n = nb * BLOCK_N + local
    in_range = n < dlen
    cols = kc * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < d
    d_row_off = d_base + n * stride_dl
    d_cols0 = tl.arange(0, BLOCK_D)
    if HAS_DMASK:
        dm = tl.load(DMASK + m_base + n * stride_dml, mask=in_range, other=0)
        valid = in_range & (dm != 0)
    else:
        valid = in_range

    d_tile = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if SMOOTH:
        if D_CHUNKS == 1:
            d_tile = tl.load(D + d_row_off[:, None] + d_cols0[None, :].to(tl.int64) * stride_dd,
                             mask=in_range[:, None] & (d_cols0[None, :] < d), other=0.0)
            if UPCAST:
                d_tile = d_tile.to(tl.float32)

    if PAIRED:
        q_first = t // K
        q_last = q_first + 1
        col = t % K
    else:
        q_first = 0
        q_last = Nq
        col = t

    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if nb * BLOCK_N < dlen:
        for q0 in range(q_first, q_last, QPB):
            qidx = q0 + rows // TOKB
            for l0 in range(0, Lq, TOKB):
                tok = l0 + rows % TOKB
                row_ok = (qidx < q_last) & (tok < Lq)
                if HAS_QMASK:
                    qm = tl.load(QMASK + qidx * stride_qmn + tok * stride_qml, mask=row_ok, other=0)
                    row_ok = row_ok & (qm != 0)
                q_row_off = qidx * stride_qn + tok * stride_ql
                aux_ptr = AUX + qidx * stride_an + col * stride_ac + tok * stride_al
                g = tl.load(G + qidx * stride_gn + col * stride_gc, mask=row_ok, other=0.0).to(tl.float32)
                # the smooth max's query rows loaded once for both products, S^T = D Q^T and P^T Q (loaded twice,
                # they take 32 KB more per 128 rows), where the features are not chunked
                rows_once: tl.constexpr = SMOOTH and D_CHUNKS == 1 and not RELOAD_TILE
                if rows_once:
                    q_rows = tl.load(Q + q_row_off[:, None] + d_cols0[None, :].to(tl.int64) * stride_qd,
                                     mask=row_ok[:, None] & (d_cols0[None, :] < d), other=0.0)
                if SMOOTH:
                    lse = tl.load(aux_ptr, mask=row_ok, other=float("inf"))
                    if rows_once:
                        st = tl.dot(d_tile, tl.trans(q_rows.to(d_tile.dtype)), input_precision=PRECISION)
                    else:
                        # S^T tile [BLOCK_N, BLOCK_M] over all the features (chunked: this program's slice below)
                        st = _similarity_tile(d_tile, D, d_row_off, in_range, Q, q_row_off, row_ok, d_cols0,
                                              stride_dd, stride_qd, d, BLOCK_D, D_CHUNKS, UPCAST, PRECISION, False,
                                              True, False)
                    pt = tl.exp2((st - lse[None, :]) * inv_tau_log2e) * g[None, :]
                    pt = tl.where(valid[:, None] & row_ok[None, :], pt, 0.0)
                else:
                    j = tl.load(aux_ptr, mask=row_ok, other=-1)      # -1 (no gradient) matches no token
                    # 32-bit offsets into the block (n is 64-bit: twice the compare instructions)
                    pt = tl.where((j.to(tl.int32) - n_lo32)[None, :] == local[:, None], g[None, :], 0.0)
                if not rows_once:
                    q_rows = tl.load(Q + q_row_off[:, None] + cols[None, :].to(tl.int64) * stride_qd,
                                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
                acc = _accumulate_weighted_rows(acc, pt, q_rows, UPCAST, PRECISION, G_SPLIT)

    tl.store(DD + o_base + n[:, None] * stride_odl + cols[None, :] * stride_odd,
             acc.to(DD.dtype.element_ty), mask=in_range[:, None] & col_ok[None, :])


# The kernel below spells out the parameters of both programs, and calls them with each: a @triton.jit function's
# parameters are those of its own ``def`` (Triton 3.2-3.9 bind a kernel's arguments by that signature, and take no
# ``*args`` in a kernel), so one parameter list cannot serve a kernel and the functions it calls.
@triton.jit
def maxsim_bwd_kernel(
    G, Q, D, QMASK, DMASK, OFFSETS, AUX, DQ, DD,
    Nq, Lq, d, Ld, C, K,
    n_qblocks, n_splits, n_csplits, cols_per_split, n_nblocks, n_dq_programs,
    stride_gn, stride_gc,
    stride_qn, stride_ql, stride_qd,
    stride_dt, stride_dl, stride_dd,
    stride_qmn, stride_qml,
    stride_dmt, stride_dml,
    stride_an, stride_ac, stride_al,
    stride_os, stride_on, stride_ol, stride_od,
    stride_odt, stride_odl, stride_odd,
    inv_tau_log2e,
    PAIRED: tl.constexpr, RAGGED: tl.constexpr, HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr,
    SMOOTH: tl.constexpr,
    QPB: tl.constexpr, TOKB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, G_SPLIT: tl.constexpr, RELOAD_TILE: tl.constexpr = False,
    PROGRAMS: tl.constexpr = "both",
):
    """dQ a row tile at a time (``_dq_program``; ``PROGRAMS="dq"``), the dense dD (``_dd_dense_program``;
    ``"dd"``), or both in one launch (``"both"``: the first ``n_dq_programs`` programs are dQ's, the rest dD's, with
    the same tiles; one launch less per step, where the host bounds a small step). The arguments of the programs
    not launched are not read."""
    pid = tl.program_id(0).to(tl.int64)
    if PROGRAMS == "dq":
        dq_program = True
    elif PROGRAMS == "dd":
        dq_program = False
    else:
        dq_program = pid < n_dq_programs
    if dq_program:
        _dq_program(pid, G, Q, D, QMASK, DMASK, OFFSETS, AUX, DQ,
                    Nq, Lq, d, Ld, C, K, n_qblocks, n_splits, n_csplits, cols_per_split,
                    stride_gn, stride_gc, stride_qn, stride_ql, stride_qd, stride_dt, stride_dl, stride_dd,
                    stride_qmn, stride_qml, stride_dmt, stride_dml, stride_an, stride_ac, stride_al,
                    stride_os, stride_on, stride_ol, stride_od, inv_tau_log2e,
                    PAIRED, RAGGED, HAS_QMASK, HAS_DMASK, SMOOTH, QPB, TOKB, BLOCK_N, BLOCK_D, D_CHUNKS, UPCAST,
                    PRECISION, RELOAD_TILE)
    else:
        if PROGRAMS == "both":
            pid = pid - n_dq_programs
        _dd_dense_program(pid, G, Q, D, QMASK, DMASK, OFFSETS, AUX, DD,
                          Nq, Lq, d, Ld, K, n_nblocks,
                          stride_gn, stride_gc, stride_qn, stride_ql, stride_qd, stride_dt, stride_dl, stride_dd,
                          stride_qmn, stride_qml, stride_dmt, stride_dml, stride_an, stride_ac, stride_al,
                          stride_odt, stride_odl, stride_odd, inv_tau_log2e,
                          PAIRED, RAGGED, HAS_QMASK, HAS_DMASK, SMOOTH, QPB, TOKB, BLOCK_N, BLOCK_D, D_CHUNKS,
                          UPCAST, PRECISION, G_SPLIT, RELOAD_TILE)
