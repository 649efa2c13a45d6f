"""Fused MaxSim backward kernels (deterministic: every output element is written by exactly one program,
accumulating in a fixed order in fp32; no atomics).

Given the upstream gradient ``G[q, col]`` and the forward's per-row auxiliary value:
- hard max, ``AUX[q, col, i]`` = first arg-max token ``j`` (-1: no gradient)
    dQ[q, i]   = sum_col G[q, col] * D[doc(q, col), j]
    dD[t, j]   = sum_{q, i : AUX = j} G[q, col(t)] * Q[q, i]
- smooth max, ``AUX[q, col, i]`` = row log-sum-exp (+inf: no gradient); ``P = exp((S - AUX) / tau)`` is
  recomputed tile by tile from ``S = Q D^T`` (flash-attention style):
    dQ[q]      = sum_col G[q, col] * P[q, col] @ D[doc]
    dD[t]      = sum_q  G[q, col(t)] * P[q, col]^T @ Q[q]
Masked (constant) similarities get no gradient in either mode.
"""

import triton
import triton.language as tl

from .forward import _similarity_tile


@triton.jit
def maxsim_bwd_dq_kernel(
    G, Q, D, DMASK, OFFSETS, AUX, DQ,
    Nq, Lq, d, Ld, C, K,
    n_splits,
    stride_gn, stride_gc,
    stride_qn, stride_ql, stride_qd,
    stride_dt, stride_dl, stride_dd,
    stride_dmt, stride_dml,
    stride_an, stride_ac, stride_al,
    stride_oqn, stride_oql, stride_oqd,
    inv_tau_log2e,
    PAIRED: tl.constexpr, RAGGED: tl.constexpr, HAS_DMASK: tl.constexpr, SMOOTH: tl.constexpr,
    TOKB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    # program: one query, TOKB of its tokens, one BLOCK_D slice of the gradient's feature axis
    pid = tl.program_id(0).to(tl.int64)
    per_query = n_splits * D_CHUNKS
    q = pid // per_query
    rem = pid % per_query
    split = rem // D_CHUNKS
    kc = rem % D_CHUNKS

    tok = split * TOKB + tl.arange(0, TOKB)
    row_ok = tok < Lq
    cols = kc * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < d
    q_row_off = q * stride_qn + tok * stride_ql
    d_cols0 = tl.arange(0, BLOCK_D)

    q_tile = tl.zeros((TOKB, BLOCK_D), dtype=tl.float32)
    if SMOOTH:
        if D_CHUNKS == 1:
            q_tile = tl.load(Q + q_row_off[:, None] + d_cols0[None, :].to(tl.int64) * stride_qd,
                             mask=row_ok[:, None] & (d_cols0[None, :] < d), other=0.0)
            if UPCAST:
                q_tile = q_tile.to(tl.float32)

    acc = tl.zeros((TOKB, BLOCK_D), dtype=tl.float32)
    for c in range(0, C):
        if PAIRED:
            t = q * K + c
        else:
            t = c
        g = tl.load(G + q * stride_gn + c * stride_gc).to(tl.float32)
        if RAGGED:
            start = tl.load(OFFSETS + t).to(tl.int64)
            dlen = tl.load(OFFSETS + t + 1).to(tl.int64) - start
            d_base = start * stride_dl
            m_base = start * stride_dml
        else:
            dlen = Ld
            d_base = t * stride_dt
            m_base = t * stride_dmt
        aux_ptr = AUX + q * stride_an + c * stride_ac + tok * stride_al
        if SMOOTH:
            lse = tl.load(aux_ptr, mask=row_ok, other=float("inf"))
            part = tl.zeros((TOKB, BLOCK_D), dtype=tl.float32)
            for n0 in range(0, dlen, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                in_range = n < dlen
                d_row_off = d_base + n * stride_dl
                s = _similarity_tile(q_tile, Q, q_row_off, row_ok, D, d_row_off, in_range, d_cols0,
                                     stride_qd, stride_dd, d, BLOCK_D, D_CHUNKS, UPCAST, PRECISION)
                if HAS_DMASK:
                    dm = tl.load(DMASK + m_base + n * stride_dml, mask=in_range, other=0)
                    valid = in_range & (dm != 0)
                else:
                    valid = in_range
                p = tl.exp2((s - lse[:, None]) * inv_tau_log2e)
                p = tl.where(valid[None, :], p, 0.0)
                d_tile = tl.load(D + d_row_off[:, None] + cols[None, :].to(tl.int64) * stride_dd,
                                 mask=in_range[:, None] & col_ok[None, :], other=0.0)
                if UPCAST:
                    part += tl.dot(p, d_tile.to(tl.float32), input_precision=PRECISION)
                else:
                    part += tl.dot(p.to(d_tile.dtype), d_tile, input_precision=PRECISION)
            acc += g * part
        else:
            j = tl.load(aux_ptr, mask=row_ok, other=-1)
            hit = j >= 0
            rows = tl.load(D + d_base + j.to(tl.int64)[:, None] * stride_dl + cols[None, :].to(tl.int64) * stride_dd,
                           mask=hit[:, None] & col_ok[None, :], other=0.0)
            acc += g * rows.to(tl.float32)

    tl.store(DQ + q * stride_oqn + tok[:, None] * stride_oql + cols[None, :] * stride_oqd,
             acc.to(DQ.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def maxsim_bwd_dd_kernel(
    G, Q, D, QMASK, DMASK, OFFSETS, AUX, DD,
    Nq, Lq, d, Ld, K,
    n_nblocks, max_len,
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
    TOKB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    # program: one document, BLOCK_N of its tokens, one BLOCK_D slice of the feature axis; loops over queries
    pid = tl.program_id(0).to(tl.int64)
    per_doc = n_nblocks * D_CHUNKS
    t = pid // per_doc
    rem = pid % per_doc
    nb = rem // D_CHUNKS
    kc = rem % D_CHUNKS

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
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
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
        q_lo = t // K
        q_hi = q_lo + 1
        c = t % K
    else:
        q_lo = 0
        q_hi = Nq
        c = t

    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if nb * BLOCK_N < dlen:
        for q in range(q_lo, q_hi):
            g = tl.load(G + q * stride_gn + c * stride_gc).to(tl.float32)
            for l0 in range(0, Lq, TOKB):
                tok = l0 + tl.arange(0, TOKB)
                row_ok = tok < Lq
                if HAS_QMASK:
                    qm = tl.load(QMASK + q * stride_qmn + tok * stride_qml, mask=row_ok, other=0)
                    row_ok = row_ok & (qm != 0)
                q_row_off = q * stride_qn + tok * stride_ql
                aux_ptr = AUX + q * stride_an + c * stride_ac + tok * stride_al
                q_rows = tl.load(Q + q_row_off[:, None] + cols[None, :].to(tl.int64) * stride_qd,
                                 mask=row_ok[:, None] & col_ok[None, :], other=0.0)
                if UPCAST:
                    q_rows = q_rows.to(tl.float32)
                if SMOOTH:
                    lse = tl.load(aux_ptr, mask=row_ok, other=float("inf"))
                    # S^T tile [BLOCK_N, TOKB]
                    st = _similarity_tile(d_tile, D, d_row_off, in_range, Q, q_row_off, row_ok, d_cols0,
                                          stride_dd, stride_qd, d, BLOCK_D, D_CHUNKS, UPCAST, PRECISION)
                    pt = tl.exp2((st - lse[None, :]) * inv_tau_log2e)
                    pt = tl.where(valid[:, None] & row_ok[None, :], pt, 0.0)
                else:
                    j = tl.load(aux_ptr, mask=row_ok, other=-1)
                    pt = tl.where((j[None, :] == n[:, None]) & valid[:, None], 1.0, 0.0)
                acc += g * tl.dot(pt.to(q_rows.dtype), q_rows, input_precision=PRECISION)

    tl.store(DD + o_base + n[:, None] * stride_odl + cols[None, :] * stride_odd,
             acc.to(DD.dtype.element_ty), mask=in_range[:, None] & col_ok[None, :])
