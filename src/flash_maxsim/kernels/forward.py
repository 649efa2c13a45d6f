"""Fused MaxSim forward kernel.

One program scores a tile of query-token rows against one document (or ``docs_per_program`` padded documents,
one after the other, when ``MULTI_DOC``; with ``FLAT_RUN`` they lie end to end in memory and stream as one run of
tokens whose tiles may straddle two documents). The rows are ``QPB`` queries times
``TOKB`` tokens (``TOKB`` a power of two >= Lq, or a slice of a long query, see ``split``). The program streams
the document ``BLOCK_N`` tokens at a time, computes the similarity tile ``S = Q_rows @ D_tile^T`` in registers
(tensor cores through ``tl.dot``), applies the masks and folds the tile into a running max (hard) or a running
log-sum-exp (smooth). Nothing of size rows x Ld leaves the chip.

int8 x int8 products may skip the int-to-float conversion of their sums (``BITCAST_SUMS``, see
``_tile_similarities``): the hard max over runs of documents, with an exact second pass where that falls short.

Writes, per program and document, ``QPB`` partial scores (one per query) into ``OUT[split, q, col]`` and, when
the caller will differentiate, one auxiliary value per row into ``AUX[q, col, token]``: the index of the first arg-max
document token (-1: no gradient) or the row's log-sum-exp (+inf: no gradient).
"""

import triton
import triton.language as tl


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_int(a, b):
    return tl.minimum(a, b)


@triton.jit
def _document_tile(d_ptrs, token_ok, d_cols, d, D_DESC, tma_row, MASK_TOKENS: tl.constexpr, EVEN_D: tl.constexpr,
                   TMA: tl.constexpr):
    """One tile of document values, [tokens, features] at ``d_ptrs`` (one feature chunk): ``TMA``, a whole tile
    copied from the descriptor ``D_DESC``, rows ``tma_row + [0, tokens)`` (features past d arrive as zeros);
    ``MASK_TOKENS``, the tokens ``token_ok`` only (0 elsewhere); ``EVEN_D``, d == the tile's width (no feature
    mask)."""
    if TMA:
        # int32 coordinates (a no-op where the caller passes them so)
        return D_DESC.load([tma_row.to(tl.int32), 0])
    elif MASK_TOKENS:
        return tl.load(d_ptrs, mask=token_ok[:, None] & (d_cols[None, :] < d), other=0.0)
    elif EVEN_D:
        return tl.load(d_ptrs)
    else:
        return tl.load(d_ptrs, mask=(d_cols < d)[None, :], other=0.0)


@triton.jit
def _doc_location(OFFSETS, t, stride_dt, stride_dl, stride_dmt, stride_dml, Ld, RAGGED: tl.constexpr):
    """(first-row offset into D, first-row offset into the mask, length) of document t."""
    if RAGGED:
        start = tl.load(OFFSETS + t).to(tl.int64)
        dlen = tl.load(OFFSETS + t + 1).to(tl.int64) - start
        return start * stride_dl, start * stride_dml, dlen
    else:
        return t * stride_dt, t * stride_dmt, Ld


@triton.jit
def _similarity_tile(
    q_tile, Q, q_row_off, row_ok, D, d_row_off, col_ok, d_cols0,
    stride_qd, stride_dd, d,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    INT_DOT: tl.constexpr, PARTIAL: tl.constexpr, EVEN_D: tl.constexpr, WHOLE_TILE_MASKS: tl.constexpr = False,
    D_DESC=None, tma_row=0, TMA: tl.constexpr = False, BITCAST_SUMS: tl.constexpr = False,
):
    """S[rows, cols] = <q_row, d_col>, fp32 accumulation (``INT_DOT``, one d-chunk only, 8-bit products: int8 x int8
    summed exactly in int32, then converted, |sum| <= 127^2 d < 2^24 for d <= 1040, so the conversion is exact too;
    fp8 x fp8 summed in fp32; under the interpreter fp8 values come as fp32 numbers, multiplied as such). With
    one d-chunk the query tile is already loaded. ``col_ok`` is read only when ``PARTIAL`` (a whole tile's tokens
    all exist) or ``WHOLE_TILE_MASKS`` (masked loads anyway: faster for some tiles); ``EVEN_D``: d == BLOCK_D, no
    feature mask (one d-chunk only). ``TMA`` (a whole tile): the tile is rows ``tma_row + [0, BLOCK_N)`` of the
    documents' ``[tokens, d]`` tensor descriptor ``D_DESC`` (a bulk copy: no per-thread addresses; the features past
    d, when d < BLOCK_D, arrive as zeros). ``BITCAST_SUMS`` (``INT_DOT``): the int32 sums are returned as the fp32
    numbers their bits spell, ``sum * 2^-149`` where ``0 <= sum < 2^23`` (denormals; NaN or -inf where the sum is
    negative), not converted: see ``_tile_similarities``."""
    if D_CHUNKS == 1:
        d_tile = _document_tile(D + d_row_off[:, None] + d_cols0[None, :].to(tl.int64) * stride_dd, col_ok, d_cols0,
                                d, D_DESC, tma_row, PARTIAL or WHOLE_TILE_MASKS, EVEN_D, TMA)
        # int8 / fp8 documents convert exactly to the queries' dtype (a no-op for float documents and for 8-bit
        # products)
        d_tile = d_tile.to(q_tile.dtype)
        if INT_DOT and BITCAST_SUMS and q_tile.dtype == tl.int8:
            s = tl.dot(q_tile, tl.trans(d_tile), out_dtype=tl.int32).to(tl.float32, bitcast=True)
        elif INT_DOT and q_tile.dtype == tl.int8:
            s = tl.dot(q_tile, tl.trans(d_tile), out_dtype=tl.int32).to(tl.float32)
        elif INT_DOT and q_tile.dtype == tl.float8e4nv:
            # fp8 x fp8 products summed in fp32 (on Hopper with its fp8 tensor cores' own accumulation, ~2^-14 of
            # the largest product's magnitude per sum: docs/semantics.md)
            s = tl.dot(q_tile, tl.trans(d_tile), out_dtype=tl.float32)
        else:
            s = tl.dot(q_tile, tl.trans(d_tile), input_precision=PRECISION)
    else:
        s = tl.zeros((q_row_off.shape[0], d_row_off.shape[0]), dtype=tl.float32)
        for kc in range(D_CHUNKS):
            cols = kc * BLOCK_D + d_cols0
            q_ptrs = Q + q_row_off[:, None] + cols[None, :].to(tl.int64) * stride_qd
            d_ptrs = D + d_row_off[:, None] + cols[None, :].to(tl.int64) * stride_dd
            qk = tl.load(q_ptrs, mask=row_ok[:, None] & (cols[None, :] < d), other=0.0)
            if PARTIAL or WHOLE_TILE_MASKS:
                dk = tl.load(d_ptrs, mask=col_ok[:, None] & (cols[None, :] < d), other=0.0)
            else:
                dk = tl.load(d_ptrs, mask=(cols < d)[None, :], other=0.0)
            if UPCAST:
                qk = qk.to(tl.float32)
            dk = dk.to(qk.dtype)
            s += tl.dot(qk, tl.trans(dk), input_precision=PRECISION)
    return s


# whether Triton's CPU interpreter runs these kernels (TRITON_INTERPRET=1 when they were first imported: each jit
# function is then an InterpretedFunction); the one test of it (launch.interpreting() returns this)
INTERPRETED = type(_max_propagating_nan).__name__ == "InterpretedFunction"


if INTERPRETED:
    @triton.jit
    def _scales_as_fp32(sc):
        """The documents' scales (bf16 or fp32) in fp32: Triton's interpreter runs no PTX."""
        return sc.to(tl.float32)
else:
    @triton.jit
    def _scales_as_fp32(sc):
        """The documents' scales (bf16 or fp32) in fp32. A bf16 scale converts by inline PTX, which Triton's layout
        pass does not move: a cast it would carry past the scales' move into the products' layout, onto each
        thread's replicated copies (offline sm_90, Triton 3.6: int8 1024x1024 589 instructions per tile against
        546 here and 545 with fp32 scales; int8 32x300 534 / 525 / 524)."""
        if sc.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise("cvt.f32.bf16 $0, $1;", "=r,h", [sc], dtype=tl.float32,
                                             is_pure=False, pack=1)
        return sc.to(tl.float32)


@triton.jit
def _round_to_e4m3(y):
    """``y`` (|y| <= 448) rounded half to even to the nearest e4m3 value, as fp32 (then exactly convertible): 3
    mantissa bits from 2^-6 up (the fp32 bits, half an ulp minus one and the kept last bit added, the 20 bits below
    cleared), multiples of 2^-9 below (the subnormals: the 1.5 * 2^14 trick). As PyTorch's conversion to
    float8_e4m3fn rounds; done in fp32 arithmetic because Triton's interpreter does not round that conversion so."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (y + 24576.0) - 24576.0
    y = tl.where(tl.abs(y) < 0.015625, subnormal, normal)
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def _quantized_query_tile(q_tile, row_ok, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """8-bit products (int8 or fp8 documents, one d-chunk): each query row of the loaded tile quantised exactly as
    quantization.quantize_tokens does it (scale = amax / QMAX, IEEE division, then round half to even), so that
    the score is that of the dequantised query. Returns the values (fp32 numbers under the interpreter's fp8,
    ``UPCAST``) and the row scales (1 on rows that do not count)."""
    qf = q_tile.to(tl.float32)
    amax = tl.reduce(tl.abs(qf), 1, _max_propagating_nan)
    q_scale = tl.math.div_rn(amax, tl.full((q_tile.shape[0],), 448.0 if FP8 else 127.0, tl.float32))
    # a NaN or infinite query token scores NaN, as its dequantised form (scale NaN or inf) does on the CPU
    q_scale = tl.where(amax < float("inf"), q_scale, float("nan"))
    y = tl.math.div_rn(qf, tl.where(q_scale > 0, q_scale, 1.0)[:, None])
    if FP8:
        values = _round_to_e4m3(y)
        if not UPCAST:
            values = values.to(tl.float8e4nv)
    else:
        # to an integer through the 1.5 * 2^23 trick, valid for |y| <= 127
        y = (y + 12582912.0) - 12582912.0
        values = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)
    return values, tl.where(row_ok, q_scale, 1.0)


@triton.jit
def _token_values(PTR, m_base, n, stride_dml, in_range, PARTIAL: tl.constexpr, loaded, PRELOADED: tl.constexpr):
    """One value per document token for the tokens ``n`` (the scales of quantized documents, or the documents'
    mask; both in the mask's layout): 0 past the slice's end when ``PARTIAL``; ``loaded`` when the caller loaded
    them ahead (``PRELOADED``)."""
    if PARTIAL:
        v = tl.load(PTR + m_base + n * stride_dml, mask=in_range, other=0)
    elif PRELOADED:
        v = loaded
    else:
        v = tl.load(PTR + m_base + n * stride_dml)
    return v


@triton.jit
def _tile_similarities(
    n, n_hi, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES, m_base, q_scale,
    stride_qd, stride_dl, stride_dd, stride_dml, d,
    PARTIAL: tl.constexpr, HAS_SCALES: tl.constexpr, QUANTIZE_Q: tl.constexpr, HAS_DMASK: tl.constexpr,
    ZERO_MASKED: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr, WHOLE_TILE_MASKS: tl.constexpr = False,
    sc_loaded=None, dm_loaded=None, PRELOADED: tl.constexpr = False, D_DESC=None, tma_row=0,
    TMA: tl.constexpr = False, BITCAST_SUMS: tl.constexpr = False,
):
    """The similarities of every row with the document tokens ``n`` (scaled, masked: -inf where a token does not
    count), and the tokens' scales (quantized documents; else a placeholder). ``PARTIAL``: the tile may run past the
    slice's end ``n_hi`` (only the last one); whole tiles skip that per-element test, in the loads too.
    ``PRELOADED`` (whole tiles only): the tokens' scales and mask values were loaded by the caller (``sc_loaded``,
    ``dm_loaded``), a tile ahead.

    ``BITCAST_SUMS`` (int8 x int8 products, hard max): similarity (i, j) is ``sum_ij * 2^-149 * (scale_j * 2^100)``,
    the int32 sum's bits read as an fp32 denormal times the boosted scale, which is ``round(scale_j * sum_ij) *
    2^-49`` exactly where ``sum_ij >= 0`` and ``scale_j`` is 0 or in [2^-77, 2^28) (the product is a normal number:
    one rounding, scaled by a power of two), and NaN or -inf where ``sum_ij < 0``. A max that drops NaN then gives
    each row's largest non-negative similarity times 2^-49 for one instruction per similarity (a multiply) instead
    of two (a conversion and a multiply): the caller restores the 2^49, and redoes exactly whatever this cannot
    hold (a row with no non-negative similarity in a document, a scale outside the range)."""
    in_range = n < n_hi
    if HAS_SCALES and QUANTIZE_Q:
        # int8 x int8 products: the scales are loaded before the products, so that their latency overlaps the wait
        # for the document tile and the products (the pipeliner issues ahead only the loads that feed tl.dot; loaded
        # after them, 38% of the int8 streaming grid's stall samples waited on the scales, H200, Triton 3.6). Not for
        # converted documents (slower) nor for the mask values (they raise the masked kernels' registers)
        sc = _token_values(SCALES, m_base, n, stride_dml, in_range, PARTIAL, sc_loaded, PRELOADED)
    s = _similarity_tile(q_tile, Q, q_row_off, row_ok, D, d_base + n * stride_dl, in_range, d_cols0,
                         stride_qd, stride_dd, d, BLOCK_D, D_CHUNKS, UPCAST, PRECISION, QUANTIZE_Q, PARTIAL, EVEN_D,
                         WHOLE_TILE_MASKS, D_DESC, tma_row, TMA, BITCAST_SUMS)
    if HAS_SCALES:
        # quantized documents: scales share the mask's layout (per document token)
        if not QUANTIZE_Q:
            sc = _token_values(SCALES, m_base, n, stride_dml, in_range, PARTIAL, sc_loaded, PRELOADED)
        # bf16 (the index's) or fp32 scales, exactly fp32 either way; converted here, after the products, not at
        # the load: an instruction there would wait for the load's data before the products are issued (fp8 1x10k
        # 32x300: 11% slower so, H200, Triton 3.6)
        sc = _scales_as_fp32(sc)
        if BITCAST_SUMS:
            # 2^100: a power of two, so the boost is exact; taken on the scales (one per token), not per similarity
            s = s * (sc * 1.2676506002282294e30)[None, :]
        else:
            s = s * sc[None, :]
    else:
        sc = in_range       # no scales: a placeholder the callers ignore
    if QUANTIZE_Q and SMOOTH:
        # quantized queries: the hard max applies the (non-negative) row scale once at the end; the smooth max
        # needs the true similarities in its exponentials
        s = s * q_scale[:, None]
    if HAS_DMASK:
        dm = _token_values(DMASK, m_base, n, stride_dml, in_range, PARTIAL, dm_loaded, PRELOADED)
        if PARTIAL:
            valid = in_range & (dm != 0)
            if ZERO_MASKED:
                # masked tokens inside the document count as similarity 0; tokens past its end do not exist
                s = tl.where(valid[None, :], s, tl.where(in_range[None, :], 0.0, float("-inf")))
            else:
                s = tl.where(valid[None, :], s, float("-inf"))
        else:
            valid = dm != 0
            if ZERO_MASKED:
                s = tl.where(valid[None, :], s, 0.0)
            else:
                s = tl.where(valid[None, :], s, float("-inf"))
    elif PARTIAL:
        s = tl.where(in_range[None, :], s, float("-inf"))
    return s, sc


@triton.jit
def _groups4(x):
    """The 4 column groups of ``x`` ([rows, 8, 4]: group on the last axis) as 4 tensors [rows, 8]."""
    lo, hi = tl.split(tl.reshape(x, (x.shape[0], 8, 2, 2)))     # groups {0, 2} and {1, 3}
    v0, v2 = tl.split(lo)
    v1, v3 = tl.split(hi)
    return v0, v1, v2, v3


@triton.jit
def _max2(a, b, PROPAGATE_NAN: tl.constexpr):
    """max(a, b): NaN propagating, or maxNum (NaN dropped); one instruction either way."""
    if PROPAGATE_NAN:
        return _max_propagating_nan(a, b)
    else:
        return tl.maximum(a, b)


@triton.jit
def _chain4(x, PROPAGATE_NAN: tl.constexpr = False):
    """The 4 groups of ``x`` ([rows, 8, 4]) folded into one [rows, 8] one after another."""
    v0, v1, v2, v3 = _groups4(x)
    return _max2(_max2(_max2(v0, v1, PROPAGATE_NAN), v2, PROPAGATE_NAN), v3, PROPAGATE_NAN)


@triton.jit
def _max_chain4(part, x, PROPAGATE_NAN: tl.constexpr = False):
    """``part`` ([rows, 8]) folded with the 4 groups of ``x`` ([rows, 8, 4]) one after another."""
    v0, v1, v2, v3 = _groups4(x)
    return _max2(_max2(_max2(_max2(part, v0, PROPAGATE_NAN), v1, PROPAGATE_NAN), v2, PROPAGATE_NAN), v3,
                 PROPAGATE_NAN)


@triton.jit
def _column_chains(s, BLOCK_N: tl.constexpr, PROPAGATE_NAN: tl.constexpr):
    """The tile ``s``'s 8 partial maxima per row ([rows, 8]; partial w over the columns 8g + w), its column groups
    g = 0, 1, ... folded one after another: one chain per row and column pair of a thread under every Triton.
    ``tl.max`` / ``tl.reduce`` reduce within a thread as a chain under Triton 3.6-3.7 and as a balanced tree from
    3.8: the one difference found between the int8 compute-bound kernel's loops under 3.6 and 3.8+ (same
    instructions, other order), which run 5.5% apart (H100). The reshapes and splits move
    no data where a warp holds whole rows of the tile (the tensor cores' accumulator layouts of 64 rows and more);
    callers take it for tiles of 64 rows and more and 32 to 128 columns only."""
    G: tl.constexpr = BLOCK_N // 8
    parts = tl.permute(tl.reshape(s, (s.shape[0], G, 8)), (0, 2, 1))     # [rows, 8, G]: groups last
    if G == 4:
        part = _chain4(parts, PROPAGATE_NAN)
    elif G == 8:
        even, odd = tl.split(tl.reshape(parts, (s.shape[0], 8, 4, 2)))       # groups 2k and 2k + 1
        part = _max_chain4(_chain4(even, PROPAGATE_NAN), odd, PROPAGATE_NAN)
    else:
        even, odd = tl.split(tl.reshape(parts, (s.shape[0], 8, 8, 2)))
        e0, e1 = tl.split(tl.reshape(even, (s.shape[0], 8, 4, 2)))           # groups 4k, 4k + 2
        o0, o1 = tl.split(tl.reshape(odd, (s.shape[0], 8, 4, 2)))            # groups 4k + 1, 4k + 3
        part = _max_chain4(_max_chain4(_max_chain4(_chain4(e0, PROPAGATE_NAN), e1, PROPAGATE_NAN), o0,
                                       PROPAGATE_NAN), o1, PROPAGATE_NAN)
    return part


@triton.jit
def _tile_max_dropping_nan(s, BLOCK_N: tl.constexpr):
    """Each row's max over the tile ``s`` (maxNum: NaN dropped) from its chained partial maxima
    (``_column_chains``) on tiles of 64 rows and more and 32 to 128 columns; otherwise ``tl.max``."""
    if s.shape[0] >= 64 and BLOCK_N >= 32 and BLOCK_N <= 128:
        return tl.max(_column_chains(s, BLOCK_N, False), 1)
    else:
        return tl.max(s, 1)


@triton.jit
def _fold_similarities(m, acc, arg, s, n0, inv_tau_log2e, SMOOTH: tl.constexpr, SAVE_AUX: tl.constexpr,
                       BLOCK_N: tl.constexpr, DROP_NAN: tl.constexpr = False, CHAINED_MAX: tl.constexpr = False):
    """Folds a tile of similarities (tokens ``n0 + [0, BLOCK_N)``) into each row's running max, or running
    log-sum-exp (``m``, ``acc``), and first arg-max (``arg``, with ``SAVE_AUX``). ``DROP_NAN`` (hard max, bit-cast
    sums): the max ignores NaN (the negative sums), as IEEE maxNum does, for the same one instruction;
    ``CHAINED_MAX`` (with ``DROP_NAN``): the tile's max folded in a fixed chain (``_tile_max_dropping_nan``)."""
    if DROP_NAN:
        if CHAINED_MAX:
            m = tl.maximum(m, _tile_max_dropping_nan(s, BLOCK_N))
        else:
            m = tl.maximum(m, tl.max(s, 1))
        return m, acc, arg
    tile_max = tl.reduce(s, 1, _max_propagating_nan)
    if SMOOTH:
        m_new = _max_propagating_nan(m, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m - m_safe) * inv_tau_log2e)
        p = tl.exp2((s - m_safe[:, None]) * inv_tau_log2e)
        acc = acc * alpha + tl.sum(p, 1)
        m = m_new
    else:
        if SAVE_AUX:
            # first arg-max inside the tile, as a 32-bit offset into the tile (the token offsets n are 64-bit:
            # selecting and reducing those costs twice the instructions); strict '>' across tiles keeps the
            # earliest on ties
            local = tl.arange(0, BLOCK_N)
            first = tl.reduce(tl.where(s == tile_max[:, None], local[None, :], BLOCK_N), 1, _min_int)
            arg = tl.where(tile_max > m, (first + n0).to(tl.int32), arg)
        m = _max_propagating_nan(m, tile_max)
    return m, acc, arg


@triton.jit
def _fold_row_partials(m, s, BLOCK_N: tl.constexpr, ROW_PARTIALS: tl.constexpr, DROP_NAN: tl.constexpr,
                       CHAINED_MAX: tl.constexpr = False):
    """The hard max (no arg-max) with ``ROW_PARTIALS`` partial maxima per row in ``m`` ([rows, ROW_PARTIALS]):
    partial w is the max over the columns j = ROW_PARTIALS * g + w of the tiles folded so far. With 8, a thread of
    the tensor cores' accumulator layout holds two adjacent columns of every 8, so where a warp holds whole rows of
    the tile (wgmma) a tile folds in with no shuffle, and ``_rows_max`` takes the max across a row's threads once per
    document instead of once per tile (sm_90: 8 shuffles and 4 maxima fewer per 128 x 128 tile). Where warps split the columns (32-row mma.sync tiles on several warps) the max over g crosses warps,
    through shared memory: slower, not used there. With 4, partial w is over the column pairs 8g + 2w + {0, 1}: one
    partial per thread of a quad, so no more registers than one max per row (the 8 partials spill at the int8
    compute-bound grid's register cap); an option (no faster than 8).
    ``CHAINED_MAX`` (8 partials, 64 rows and more, 32 to 128 columns): the tile's partials folded in a fixed chain
    (``_column_chains``)."""
    if ROW_PARTIALS == 8 and CHAINED_MAX and s.shape[0] >= 64 and BLOCK_N >= 32 and BLOCK_N <= 128:
        m = _max2(m, _column_chains(s, BLOCK_N, not DROP_NAN), not DROP_NAN)
    elif ROW_PARTIALS == 4:
        pairs = tl.reshape(s, (s.shape[0], BLOCK_N // 8, 4, 2))
        if DROP_NAN:
            m = tl.maximum(m, tl.max(tl.max(pairs, 3), 1))
        else:
            m = _max_propagating_nan(m, tl.reduce(tl.reduce(pairs, 3, _max_propagating_nan), 1,
                                                  _max_propagating_nan))
    else:
        parts = tl.reshape(s, (s.shape[0], BLOCK_N // ROW_PARTIALS, ROW_PARTIALS))
        if DROP_NAN:
            m = tl.maximum(m, tl.max(parts, 1))
        else:
            m = _max_propagating_nan(m, tl.reduce(parts, 1, _max_propagating_nan))
    return m


@triton.jit
def _arg_step(m, arg, v, idx):
    """One column of each partial folded into its running max ``m`` (NaN propagating) and first arg-max ``arg``:
    strict '>' on columns taken in increasing token order keeps the earliest on ties; a NaN freezes ``arg``."""
    arg = tl.where(v > m, idx, arg)
    m = _max_propagating_nan(m, v)
    return m, arg


@triton.jit
def _arg_steps4(m, arg, v0, v1, v2, v3, idx):
    """Four consecutive groups (tokens ``idx + [0, 32)``, 8 per group) folded in order by ``_arg_step``."""
    m, arg = _arg_step(m, arg, v0, idx)
    m, arg = _arg_step(m, arg, v1, idx + 8)
    m, arg = _arg_step(m, arg, v2, idx + 16)
    m, arg = _arg_step(m, arg, v3, idx + 24)
    return m, arg


@triton.jit
def _fold_arg_partials(m, arg, s, n0, BLOCK_N: tl.constexpr):
    """The hard max with its first arg-max, in 8 partial (max, arg-max) pairs per row (``m``, ``arg``: [rows, 8]):
    partial w holds the max over the columns j = 8g + w of the tiles folded so far and the first token holding it.
    The tile's columns are folded group by group (g = 0, 1, ...: increasing tokens), each a compare, a max and a
    select per similarity, with no reduction and no shuffle per tile (the tile max, its compare and the index
    min-reduction they replace); ``_rows_max_arg`` joins the partials once per document. Within a thread
    of the tensor cores' accumulator layout the groups of its columns are registers (as for ``_fold_row_partials``),
    so the permute and splits below move no data. ``BLOCK_N`` of 16, 32 or 64 tokens."""
    G: tl.constexpr = BLOCK_N // 8
    tl.static_assert(G == 2 or G == 4 or G == 8)
    # (rows, G, 8) -> (rows, 8, G): each partial's groups on the last axis, split off one bit at a time
    parts = tl.permute(tl.reshape(s, (s.shape[0], G, 8)), (0, 2, 1))
    idx = (tl.arange(0, 8)[None, :] + n0).to(tl.int32)
    if G == 2:
        v0, v1 = tl.split(parts)
        m, arg = _arg_step(m, arg, v0, idx)
        m, arg = _arg_step(m, arg, v1, idx + 8)
    elif G == 4:
        v0, v1, v2, v3 = _groups4(parts)
        m, arg = _arg_steps4(m, arg, v0, v1, v2, v3, idx)
    else:
        even, odd = tl.split(tl.reshape(parts, (s.shape[0], 8, 4, 2)))       # groups 2k and 2k + 1
        v0, v2, v4, v6 = _groups4(even)
        v1, v3, v5, v7 = _groups4(odd)
        m, arg = _arg_steps4(m, arg, v0, v1, v2, v3, idx)
        m, arg = _arg_steps4(m, arg, v4, v5, v6, v7, idx + 32)
    return m, arg


@triton.jit
def _rows_max_arg(m, arg):
    """Each row's max and first arg-max from its partial pairs (``_fold_arg_partials``): the smallest token among
    the partials that hold the max (-1 where none does: a row of NaN, whose arg-max is no token)."""
    m_row = tl.reduce(m, 1, _max_propagating_nan)
    first = tl.min(tl.where(m == m_row[:, None], arg, 2147483647), 1)
    return m_row, tl.where(first == 2147483647, -1, first)


@triton.jit
def _rows_max(m, ROW_PARTIALS: tl.constexpr, DROP_NAN: tl.constexpr):
    """Each row's running max from its ``ROW_PARTIALS`` partial maxima (``_fold_row_partials``), or ``m`` itself."""
    if ROW_PARTIALS > 1:
        if DROP_NAN:
            m = tl.max(m, 1)
        else:
            m = tl.reduce(m, 1, _max_propagating_nan)
    return m


@triton.jit
def _running_max_init(BLOCK_M: tl.constexpr, ROW_PARTIALS: tl.constexpr):
    """The running max before any token: one value per row, or ``ROW_PARTIALS`` partial ones."""
    if ROW_PARTIALS > 1:
        m = tl.full((BLOCK_M, ROW_PARTIALS), float("-inf"), dtype=tl.float32)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    return m


@triton.jit
def _fold_tile(
    m, acc, arg, n0, n, n_hi, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES, m_base, q_scale,
    stride_qd, stride_dl, stride_dd, stride_dml, d, inv_tau_log2e,
    PARTIAL: tl.constexpr, HAS_SCALES: tl.constexpr, QUANTIZE_Q: tl.constexpr, HAS_DMASK: tl.constexpr,
    ZERO_MASKED: tl.constexpr, SMOOTH: tl.constexpr, SAVE_AUX: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, WHOLE_TILE_MASKS: tl.constexpr = False, ROW_PARTIALS: tl.constexpr = 1,
    D_DESC=None, tma_row=0, TMA: tl.constexpr = False,
):
    """Folds the document tokens ``n = n0 + [0, BLOCK_N)`` into the running state of every row (``m`` as
    ``_fold_row_partials`` keeps it when ``ROW_PARTIALS`` > 1); ``TMA``: a whole tile, rows ``tma_row + [0,
    BLOCK_N)`` of the descriptor ``D_DESC`` (``_similarity_tile``)."""
    s, _ = _tile_similarities(n, n_hi, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES, m_base,
                              q_scale, stride_qd, stride_dl, stride_dd, stride_dml, d, PARTIAL, HAS_SCALES, QUANTIZE_Q,
                              HAS_DMASK, ZERO_MASKED, SMOOTH, BLOCK_D, D_CHUNKS, UPCAST, PRECISION, EVEN_D,
                              WHOLE_TILE_MASKS, None, None, False, D_DESC, tma_row, TMA)
    if ROW_PARTIALS > 1 and SAVE_AUX:
        tl.static_assert(not SMOOTH and ROW_PARTIALS == 8)
        m, arg = _fold_arg_partials(m, arg, s, n0, BLOCK_N)
    elif ROW_PARTIALS > 1:
        tl.static_assert(not SMOOTH)
        m = _fold_row_partials(m, s, BLOCK_N, ROW_PARTIALS, False)
    else:
        m, acc, arg = _fold_similarities(m, acc, arg, s, n0, inv_tau_log2e, SMOOTH, SAVE_AUX, BLOCK_N)
    return m, acc, arg


@triton.jit
def _fold_document(
    m, acc, arg, n_lo, n_hi, cols, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES, m_base, q_scale,
    stride_qd, stride_dl, stride_dd, stride_dml, d, inv_tau_log2e,
    HAS_SCALES: tl.constexpr, QUANTIZE_Q: tl.constexpr, HAS_DMASK: tl.constexpr, ZERO_MASKED: tl.constexpr,
    SMOOTH: tl.constexpr, SAVE_AUX: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    WHOLE_TILE_MASKS: tl.constexpr, ROW_PARTIALS: tl.constexpr, PEEL_TAIL: tl.constexpr, TAIL_N: tl.constexpr,
    D_DESC=None, doc_row=0, TMA: tl.constexpr = False,
):
    """Folds one document's tokens ``[n_lo, n_hi)`` (``cols``: ``tl.arange(0, BLOCK_N)``, 64-bit where offsets
    times strides may pass 2^31) into the running state: with ``PEEL_TAIL`` its whole tiles first, without the
    per-element range test, then the one partial tile at the end, if any; in ``TAIL_N``-token tiles when set (a
    divisor of BLOCK_N: a 300-token document's last 44 tokens take 48 columns of products instead of 64). ``TMA``:
    the whole tiles copied from the descriptor ``D_DESC``, the document's token ``n`` being its row ``doc_row + n``."""
    if PEEL_TAIL:
        n_full = n_lo + (tl.maximum(n_hi - n_lo, 0) // BLOCK_N) * BLOCK_N
    else:
        n_full = n_lo
    for n0 in range(n_lo, n_full, BLOCK_N):
        m, acc, arg = _fold_tile(
            m, acc, arg, n0, n0 + cols, n_hi, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES,
            m_base, q_scale, stride_qd, stride_dl, stride_dd, stride_dml, d, inv_tau_log2e,
            False, HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, SAVE_AUX, BLOCK_D, D_CHUNKS, UPCAST,
            PRECISION, BLOCK_N, EVEN_D, WHOLE_TILE_MASKS, ROW_PARTIALS, D_DESC, doc_row + n0, TMA)
    TAIL: tl.constexpr = TAIL_N if TAIL_N > 0 else BLOCK_N
    if TAIL_N > 0:
        tail_cols = tl.arange(0, TAIL_N).to(cols.dtype)
    else:
        # ``cols`` itself: a second arange changes the compiled code of the streaming kernels, whose one loop this is
        tail_cols = cols
    for n0 in range(n_full, n_hi, TAIL):
        m, acc, arg = _fold_tile(
            m, acc, arg, n0, n0 + tail_cols, n_hi, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES,
            m_base, q_scale, stride_qd, stride_dl, stride_dd, stride_dml, d, inv_tau_log2e,
            True, HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, SAVE_AUX, BLOCK_D, D_CHUNKS, UPCAST,
            PRECISION, TAIL, EVEN_D, False, ROW_PARTIALS)
    return m, acc, arg


@triton.jit
def _store_document_scores(OUT, m, acc, row_ok, q_scale, tau, q0, Nq, col, split, stride_os, stride_on, stride_oc,
                           QUANTIZE_Q: tl.constexpr, SMOOTH: tl.constexpr, QPB: tl.constexpr, TOKB: tl.constexpr,
                           ROW_PARTIALS: tl.constexpr):
    """A program's document ``col`` done (several per program): its scores stored, and a fresh running state
    (``m``, ``acc``) returned for the next one."""
    _, row_val, _ = _row_values(_rows_max(m, ROW_PARTIALS, False), acc, q_scale, tau, QUANTIZE_Q, SMOOTH)
    _store_query_scores(OUT, row_val, row_ok, q0, Nq, col, split, stride_os, stride_on, stride_oc, QPB, TOKB)
    return _running_max_init(QPB * TOKB, ROW_PARTIALS), tl.zeros((QPB * TOKB,), dtype=tl.float32)


@triton.jit
def _exact_scales(sc):
    """Per token: whether bit-cast sums scaled by this scale are exact (``_tile_similarities``): 0, or in
    [2^-77, 2^28) (not NaN, infinite, negative, or so small or large that a product leaves fp32's normal range)."""
    return (sc == 0.0) | ((sc >= 6.617444900424222e-24) & (sc < 268435456.0))


@triton.jit
def _fold_run_tile(
    m, acc, arg, tj, doc_end, n0, n, run_len, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES,
    m_base, q_scale, q0, Nq, split, OUT, Ld, tau,
    stride_qd, stride_dl, stride_dd, stride_dml, d, inv_tau_log2e, stride_os, stride_on, stride_oc,
    PARTIAL: tl.constexpr, HAS_SCALES: tl.constexpr, QUANTIZE_Q: tl.constexpr, HAS_DMASK: tl.constexpr,
    ZERO_MASKED: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, QPB: tl.constexpr, TOKB: tl.constexpr, STRADDLE: tl.constexpr,
    sc_loaded, dm_loaded, PRELOADED: tl.constexpr, D_DESC, tma_row, TMA: tl.constexpr,
    miss, bad, BITCAST_SUMS: tl.constexpr, ROW_PARTIALS: tl.constexpr = 1, CHAINED_MAX: tl.constexpr = False,
):
    """One tile ``n0 + [0, BLOCK_N)`` of a run of documents laid end to end (document ``tj`` ends at run offset
    ``doc_end``; documents hold at least BLOCK_N tokens, so a tile meets at most one end): its columns up to the
    end close document ``tj`` (its score is written), the rest open the next one. Not ``STRADDLE``: documents
    of whole tiles, whose ends fall on tile ends. ``PRELOADED``: the tile's scales / mask values are given.
    ``BITCAST_SUMS``: ``miss`` (per row) and ``bad`` (per token column) are set where the bit-cast similarities
    cannot hold the exact score: a row whose document had no non-negative similarity, a scale out of range."""
    s, sc = _tile_similarities(n, run_len, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES, m_base,
                               q_scale, stride_qd, stride_dl, stride_dd, stride_dml, d, PARTIAL, HAS_SCALES,
                               QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, BLOCK_D, D_CHUNKS, UPCAST, PRECISION,
                               EVEN_D, False, sc_loaded, dm_loaded, PRELOADED, D_DESC, tma_row, TMA, BITCAST_SUMS)
    if BITCAST_SUMS:
        bad = tl.where(_exact_scales(sc), bad, 1)
    in_doc = (doc_end - n0).to(tl.int32)      # tokens of this tile that belong to document tj (>= 1)
    # documents of whole tiles: every tile lies in one document (a compile-time True: no runtime branch)
    in_one_doc = True
    if STRADDLE:
        in_one_doc = in_doc >= BLOCK_N
    if ROW_PARTIALS > 1:
        # partial maxima per row (_fold_row_partials): documents of whole tiles only
        tl.static_assert(not STRADDLE and not SMOOTH)
        m = _fold_row_partials(m, s, BLOCK_N, ROW_PARTIALS, BITCAST_SUMS, CHAINED_MAX)
        ends = in_doc == BLOCK_N
        m_next = tl.full(m.shape, float("-inf"), dtype=tl.float32)
        acc_next = acc
    elif in_one_doc:
        m, acc, arg = _fold_similarities(m, acc, arg, s, n0, inv_tau_log2e, SMOOTH, False, BLOCK_N, BITCAST_SUMS,
                                         CHAINED_MAX)
        ends = in_doc == BLOCK_N
        m_next = tl.full(m.shape, float("-inf"), dtype=tl.float32)
        acc_next = tl.zeros(acc.shape, dtype=tl.float32)
    else:
        # both parts folded before the score is written
        first = (tl.arange(0, BLOCK_N) < in_doc)[None, :]
        m, acc, arg = _fold_similarities(m, acc, arg, tl.where(first, s, float("-inf")), n0, inv_tau_log2e,
                                         SMOOTH, False, BLOCK_N, BITCAST_SUMS, CHAINED_MAX)
        m_next, acc_next, arg = _fold_similarities(tl.full(m.shape, float("-inf"), dtype=tl.float32),
                                                   tl.zeros(acc.shape, dtype=tl.float32), arg,
                                                   tl.where(first, float("-inf"), s), n0, inv_tau_log2e,
                                                   SMOOTH, False, BLOCK_N, BITCAST_SUMS, CHAINED_MAX)
        ends = True
    if ends:
        m_rows = _rows_max(m, ROW_PARTIALS, BITCAST_SUMS)
        if BITCAST_SUMS:
            miss = tl.where(m_rows == float("-inf"), 1, miss)
        _, row_val, _ = _row_values(m_rows, acc, q_scale, tau, QUANTIZE_Q, SMOOTH)
        _store_query_scores(OUT, row_val, row_ok, q0, Nq, tj, split, stride_os, stride_on, stride_oc, QPB, TOKB)
        m = m_next
        acc = acc_next
        tj += 1
        doc_end += Ld
    return m, acc, arg, tj, doc_end, miss, bad


@triton.jit
def _row_values(m, acc, q_scale, tau, QUANTIZE_Q: tl.constexpr, SMOOTH: tl.constexpr):
    """Each row's final max or smooth max (0 where no document token was valid), whether it had a valid token,
    and the running max with the quantised query's row scale applied (hard max)."""
    if QUANTIZE_Q and not SMOOTH:
        m = tl.where(m == float("-inf"), m, m * q_scale)
    if SMOOTH:
        # a NaN similarity makes the running sum NaN: the row's value is NaN (acc > 0 alone would make it 0)
        has_any = (acc > 0.0) | (acc != acc)
        row_val = tl.where(has_any, tl.where(m == float("-inf"), 0.0, m) + tau * tl.log(acc), 0.0)
    else:
        has_any = m != float("-inf")
        row_val = tl.where(has_any, m, 0.0)
    return m, row_val, has_any


@triton.jit
def _store_query_scores(OUT, row_val, row_ok, q0, Nq, col, split, stride_os, stride_on, stride_oc,
                        QPB: tl.constexpr, TOKB: tl.constexpr):
    """The score of each query ``q0 + j`` (j < QPB), the sum of its valid rows, into ``OUT[split, q, col]``."""
    per_query = tl.sum(tl.reshape(tl.where(row_ok, row_val, 0.0), (QPB, TOKB)), 1)
    qs = q0 + tl.arange(0, QPB)
    tl.store(OUT + split * stride_os + qs * stride_on + col * stride_oc, per_query, mask=qs < Nq)


@triton.jit
def _score_run(
    t, docs_per_program, n_here, Ld, q_tile, Q, q_row_off, row_ok, D, DMASK, SCALES, q_scale, q0, Nq, split, OUT,
    tau, stride_qd, stride_dt, stride_dl, stride_dd, stride_dmt, stride_dml, d, inv_tau_log2e,
    stride_os, stride_on, stride_oc, D_DESC, miss,
    HAS_SCALES: tl.constexpr, QUANTIZE_Q: tl.constexpr, HAS_DMASK: tl.constexpr, ZERO_MASKED: tl.constexpr,
    SMOOTH: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, QPB: tl.constexpr, TOKB: tl.constexpr,
    STRADDLE: tl.constexpr, PREFETCH_TOKENS: tl.constexpr, TMA_DOCS: tl.constexpr, BITCAST_SUMS: tl.constexpr,
    LOOP_STAGES: tl.constexpr, ROW_PARTIALS: tl.constexpr = 1, CHAINED_MAX: tl.constexpr = False,
):
    """Scores the ``n_here`` documents of program group ``t`` (padded, end to end in memory, each at least one tile
    long) as one run of tokens, in tiles that may straddle two documents (``FLAT_RUN``). Tile i starts at token
    i * BLOCK_N of the run (the loads of later tiles are issued ahead; no division, no wasted partial tile per
    document); only the run's last tile can be partial. Returns ``miss`` and ``bad`` (``_fold_run_tile``).
    ``LOOP_STAGES``: the loop's software-pipelining stages (None: the kernel's; 1 for the bit-cast sums' rare second
    pass, so that it takes no shared memory of its own beside the first pass's buffers)."""
    BLOCK_M: tl.constexpr = QPB * TOKB
    cols64 = tl.arange(0, BLOCK_N).to(tl.int64)    # token offsets times strides may pass 2^31
    m = _running_max_init(BLOCK_M, ROW_PARTIALS)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)     # smooth: running sum of exp
    arg = tl.full((BLOCK_M,), -1, dtype=tl.int32)
    bad = tl.zeros((BLOCK_N,), dtype=tl.int32)
    tj = t * docs_per_program
    run_d = tj * stride_dt
    run_row = tj * Ld                  # the run's first row of the [tokens, d] descriptor (TMA_DOCS)
    run_m = tj * stride_dmt
    zero64 = t * 0                 # int64: a run's token offsets may pass 2^31
    run_len = (zero64 + n_here) * Ld
    doc_end = zero64 + Ld
    n_whole = (run_len // BLOCK_N).to(tl.int32)
    # the per-token scales / mask values of each whole tile are loaded a tile ahead: the pipeliner issues
    # the document tiles' loads early but not these, whose latency the tile's products did not cover
    # in the scales' own dtype (bf16 or fp32), converted where they are used (_tile_similarities)
    sc_next = tl.zeros((BLOCK_N,), dtype=SCALES.dtype.element_ty)
    dm_next = tl.zeros((BLOCK_N,), dtype=tl.uint8)
    if PREFETCH_TOKENS:
        if HAS_SCALES:
            sc_next = tl.load(SCALES + run_m + cols64 * stride_dml)
        if HAS_DMASK:
            dm_next = tl.load(DMASK + run_m + cols64 * stride_dml)
    for i in tl.range(0, n_whole, num_stages=LOOP_STAGES):
        n0 = (zero64 + i) * BLOCK_N
        sc_tile = sc_next
        dm_tile = dm_next
        if PREFETCH_TOKENS:
            # the next whole tile's (this one's again after the last: a valid address, never used)
            n_next = (zero64 + tl.minimum(i + 1, n_whole - 1)) * BLOCK_N + cols64
            if HAS_SCALES:
                sc_next = tl.load(SCALES + run_m + n_next * stride_dml)
            if HAS_DMASK:
                dm_next = tl.load(DMASK + run_m + n_next * stride_dml)
        m, acc, arg, tj, doc_end, miss, bad = _fold_run_tile(
            m, acc, arg, tj, doc_end, n0, n0 + cols64, run_len, q_tile, Q, q_row_off, row_ok, D, run_d,
            tl.arange(0, BLOCK_D), DMASK, SCALES, run_m, q_scale, q0, Nq, split, OUT, Ld, tau, stride_qd,
            stride_dl, stride_dd, stride_dml, d, inv_tau_log2e, stride_os, stride_on, stride_oc,
            False, HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, BLOCK_D, D_CHUNKS, UPCAST,
            PRECISION, BLOCK_N, EVEN_D, QPB, TOKB, STRADDLE, sc_tile, dm_tile, PREFETCH_TOKENS,
            D_DESC, (run_row + n0).to(tl.int32), TMA_DOCS, miss, bad, BITCAST_SUMS, ROW_PARTIALS, CHAINED_MAX)
    if STRADDLE and n_whole * BLOCK_N < run_len:
        n0 = (zero64 + n_whole) * BLOCK_N
        m, acc, arg, tj, doc_end, miss, bad = _fold_run_tile(
            m, acc, arg, tj, doc_end, n0, n0 + cols64, run_len, q_tile, Q, q_row_off, row_ok, D, run_d,
            tl.arange(0, BLOCK_D), DMASK, SCALES, run_m, q_scale, q0, Nq, split, OUT, Ld, tau, stride_qd,
            stride_dl, stride_dd, stride_dml, d, inv_tau_log2e, stride_os, stride_on, stride_oc,
            True, HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, BLOCK_D, D_CHUNKS, UPCAST,
            PRECISION, BLOCK_N, EVEN_D, QPB, TOKB, STRADDLE, sc_next, dm_next, False, D_DESC, 0, False,
            miss, bad, BITCAST_SUMS, 1, CHAINED_MAX)
    return miss, bad


@triton.jit
def maxsim_fwd_kernel(
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
    HAS_SCALES: tl.constexpr, QUANTIZE_Q: tl.constexpr, ROW_OUT: tl.constexpr, PAIRED: tl.constexpr, RAGGED: tl.constexpr, HAS_QMASK: tl.constexpr, HAS_DMASK: tl.constexpr,
    ZERO_MASKED: tl.constexpr, SMOOTH: tl.constexpr, SAVE_AUX: tl.constexpr,
    QPB: tl.constexpr, TOKB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PEEL_TAIL: tl.constexpr,
    MULTI_DOC: tl.constexpr, FLAT_RUN: tl.constexpr, STRADDLE: tl.constexpr, EVEN_D: tl.constexpr,
    WHOLE_TILE_MASKS: tl.constexpr, PREFETCH_TOKENS: tl.constexpr, Q_QUANTIZED: tl.constexpr,
    TMA_DOCS: tl.constexpr, BITCAST_SUMS: tl.constexpr = False, BITCAST_REDO: tl.constexpr = True,
    ROW_PARTIALS: tl.constexpr = 1, TAIL_N: tl.constexpr = 0, PEEL_EACH_DOC: tl.constexpr = False,
    CHAINED_MAX: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = QPB * TOKB
    pid = tl.program_id(0).to(tl.int64)
    ds = pid % n_dsplits                     # slice of the document's tokens (ROW_OUT only)
    rest = pid // n_dsplits
    split = rest % n_splits
    rest = rest // n_splits
    qb = rest % n_qblocks
    t = rest // n_qblocks                    # document index (flattened candidates when PAIRED)

    rows = tl.arange(0, BLOCK_M)
    if PAIRED:
        q0 = t // K
        col = t % K
    else:
        q0 = qb * QPB
        col = t
    qidx = q0 + rows // TOKB
    tok = split * TOKB + rows % TOKB
    row_ok = (qidx < Nq) & (tok < Lq)
    if HAS_QMASK:
        qm = tl.load(QMASK + qidx * stride_qmn + tok * stride_qml, mask=row_ok, other=0)
        row_ok = row_ok & (qm != 0)
    q_row_off = qidx * stride_qn + tok * stride_ql

    d_base, m_base, dlen = _doc_location(OFFSETS, t, stride_dt, stride_dl, stride_dmt, stride_dml, Ld, RAGGED)

    d_cols0 = tl.arange(0, BLOCK_D)
    q_tile = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if D_CHUNKS == 1:
        q_tile = tl.load(Q + q_row_off[:, None] + d_cols0[None, :].to(tl.int64) * stride_qd,
                         mask=row_ok[:, None] & (d_cols0[None, :] < d), other=0.0)
        if UPCAST:
            q_tile = q_tile.to(tl.float32)
    q_scale = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    if Q_QUANTIZED:
        # 8-bit products on queries quantised before the launch (quantization.quantize_tokens): Q holds their int8
        # or fp8 values, QSCALES their scales, contiguous [Nq, Lq]. A loaded (not computed) query tile is the tensor
        # cores' operand straight from shared memory, not reloaded into registers for every document tile. Under
        # the interpreter (UPCAST) fp8 values are multiplied as fp32 numbers: its fp8 tl.dot is not exact
        if Q.dtype.element_ty == tl.int8:
            q_tile = q_tile.to(tl.int8)
        elif not UPCAST:
            q_tile = q_tile.to(Q.dtype.element_ty)
        q_scale = tl.load(QSCALES + qidx.to(tl.int64) * Lq + tok, mask=row_ok, other=1.0)
        # a NaN or infinite query token scores NaN, as the in-kernel quantisation below makes it
        q_scale = tl.where(q_scale < float("inf"), q_scale, float("nan"))
        q_scale = tl.where(row_ok, q_scale, 1.0)
    elif QUANTIZE_Q:
        q_tile, q_scale = _quantized_query_tile(q_tile, row_ok, D.dtype.element_ty == tl.float8e4nv, UPCAST)

    m = _running_max_init(BLOCK_M, ROW_PARTIALS)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)     # smooth: running sum of exp
    # hard max: first arg-max so far (per partial: _fold_arg_partials)
    if SAVE_AUX and ROW_PARTIALS > 1:
        arg = tl.full((BLOCK_M, ROW_PARTIALS), -1, dtype=tl.int32)
    else:
        arg = tl.full((BLOCK_M,), -1, dtype=tl.int32)

    ncols = tl.arange(0, BLOCK_N)
    if MULTI_DOC:
        # docs_per_program padded documents per program (bandwidth-bound scoring): one loop over all their tiles,
        # so that loads stream on across document boundaries and the query tile is loaded (and quantised) once
        cols64 = ncols.to(tl.int64)        # token offsets times strides may pass 2^31 (a transposed index)
        # the last program's group may hold fewer documents
        n_here = tl.minimum(n_docs - t * docs_per_program, docs_per_program).to(tl.int32)
        if FLAT_RUN:
            run_scale = q_scale
            miss = tl.zeros((BLOCK_M,), dtype=tl.int32)
            if BITCAST_SUMS:
                # bit-cast sums (int8 x int8, hard max): every row's max comes out times 2^-49, so the row scale is
                # boosted by 2^49 (exact; a scale at or above 2^79 would overflow: its rows are redone)
                run_scale = q_scale * 562949953421312.0
                miss = tl.where(row_ok & (q_scale >= 6.044629098073146e23) & (q_scale < float("inf")), 1, 0)
            miss, bad = _score_run(
                t, docs_per_program, n_here, Ld, q_tile, Q, q_row_off, row_ok, D, DMASK, SCALES, run_scale, q0, Nq,
                split, OUT, tau, stride_qd, stride_dt, stride_dl, stride_dd, stride_dmt, stride_dml, d,
                inv_tau_log2e, stride_os, stride_on, stride_oc, D_DESC, miss,
                HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, BLOCK_D, D_CHUNKS, UPCAST, PRECISION,
                BLOCK_N, EVEN_D, QPB, TOKB, STRADDLE, PREFETCH_TOKENS, TMA_DOCS, BITCAST_SUMS, None, ROW_PARTIALS,
                CHAINED_MAX)
            if BITCAST_SUMS and BITCAST_REDO:
                # what the bit-cast sums could not hold (in practice: a document with no valid token, whose rows
                # stay at -inf): the program's documents again, with converted sums, overwriting their scores
                if tl.max(tl.where(row_ok, miss, 0), 0) + tl.max(bad, 0) > 0:
                    tl.debug_barrier()
                    _score_run(
                        t, docs_per_program, n_here, Ld, q_tile, Q, q_row_off, row_ok, D, DMASK, SCALES, q_scale,
                        q0, Nq, split, OUT, tau, stride_qd, stride_dt, stride_dl, stride_dd, stride_dmt, stride_dml,
                        d, inv_tau_log2e, stride_os, stride_on, stride_oc, D_DESC, miss,
                        HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, BLOCK_D, D_CHUNKS, UPCAST, PRECISION,
                        BLOCK_N, EVEN_D, QPB, TOKB, STRADDLE, False, False, False, 1)
        elif PEEL_EACH_DOC:
            # a loop per document: its whole tiles without the per-element range test, then its partial last tile;
            # the query tile loaded once for all the program's documents (one document per program reloads it:
            # 64 KB per 77 KB of document at 64 queries x 32 tokens, 256 rows)
            for j in range(0, n_here):
                tj = t * docs_per_program + j
                m, acc, arg = _fold_document(
                    m, acc, arg, 0, Ld, cols64, q_tile, Q, q_row_off, row_ok, D, tj * stride_dt, d_cols0, DMASK,
                    SCALES, tj * stride_dmt, q_scale, stride_qd, stride_dl, stride_dd, stride_dml, d, inv_tau_log2e,
                    HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, False, BLOCK_D, D_CHUNKS, UPCAST,
                    PRECISION, BLOCK_N, EVEN_D, WHOLE_TILE_MASKS, ROW_PARTIALS, True, TAIL_N, D_DESC, tj * Ld,
                    TMA_DOCS)
                m, acc = _store_document_scores(OUT, m, acc, row_ok, q_scale, tau, q0, Nq, tj, split, stride_os,
                                                stride_on, stride_oc, QUANTIZE_Q, SMOOTH, QPB, TOKB, ROW_PARTIALS)
        else:
            tiles = tl.cdiv(Ld, BLOCK_N)
            for i in range(0, n_here * tiles):
                j = i // tiles
                n0 = (i - j * tiles) * BLOCK_N
                tj = t * docs_per_program + j
                m, acc, arg = _fold_tile(
                    m, acc, arg, n0, n0 + cols64, Ld, q_tile, Q, q_row_off, row_ok, D, tj * stride_dt, d_cols0,
                    DMASK, SCALES, tj * stride_dmt, q_scale, stride_qd, stride_dl, stride_dd, stride_dml, d,
                    inv_tau_log2e, True, HAS_SCALES, QUANTIZE_Q, HAS_DMASK, ZERO_MASKED, SMOOTH, False, BLOCK_D,
                    D_CHUNKS, UPCAST, PRECISION, BLOCK_N, EVEN_D, False, ROW_PARTIALS)
                if n0 + BLOCK_N >= Ld:
                    # the document's last tile: its score, then a fresh state for the next one
                    m, acc = _store_document_scores(OUT, m, acc, row_ok, q_scale, tau, q0, Nq, tj, split, stride_os,
                                                    stride_on, stride_oc, QUANTIZE_Q, SMOOTH, QPB, TOKB, ROW_PARTIALS)
    else:
        n_lo = ds * tokens_per_dsplit
        n_hi = tl.minimum(n_lo + tokens_per_dsplit, dlen)
        m, acc, arg = _fold_document(
            m, acc, arg, n_lo, n_hi, ncols, q_tile, Q, q_row_off, row_ok, D, d_base, d_cols0, DMASK, SCALES, m_base,
            q_scale, stride_qd, stride_dl, stride_dd, stride_dml, d, inv_tau_log2e, HAS_SCALES, QUANTIZE_Q,
            HAS_DMASK, ZERO_MASKED, SMOOTH, SAVE_AUX, BLOCK_D, D_CHUNKS, UPCAST, PRECISION, BLOCK_N, EVEN_D,
            WHOLE_TILE_MASKS, ROW_PARTIALS, PEEL_TAIL, TAIL_N, D_DESC, t * Ld, TMA_DOCS)
        if SAVE_AUX and ROW_PARTIALS > 1:
            m, arg = _rows_max_arg(m, arg)
        else:
            m = _rows_max(m, ROW_PARTIALS, False)

        m, row_val, has_any = _row_values(m, acc, q_scale, tau, QUANTIZE_Q, SMOOTH)
        if ROW_OUT:
            # per-row partial state of this token slice, combined on the host side (hard: max; smooth: m and sum)
            rptr = OUT + ds * stride_rs + qidx * stride_rn + col * stride_rc + tok * stride_rl
            rmask = (qidx < Nq) & (tok < Lq)
            tl.store(rptr, tl.where(row_ok, m, float("-inf")), mask=rmask)
            if SMOOTH:
                tl.store(AUX + ds * stride_rs + qidx * stride_rn + col * stride_rc + tok * stride_rl,
                         tl.where(row_ok, acc, 0.0), mask=rmask)
        else:
            if SMOOTH:
                aux = tl.where(has_any & row_ok, row_val, float("inf"))
            else:
                if SAVE_AUX:
                    if ZERO_MASKED:
                        if HAS_DMASK:
                            # the max may sit on a masked (constant-zero) token: no gradient flows there
                            hit = tl.load(DMASK + m_base + arg.to(tl.int64) * stride_dml, mask=row_ok & (arg >= 0),
                                          other=0)
                            arg = tl.where(hit != 0, arg, -1)
                    aux = tl.where(row_ok, arg, -1)
            _store_query_scores(OUT, row_val, row_ok, q0, Nq, col, split, stride_os, stride_on, stride_oc, QPB, TOKB)
            if SAVE_AUX:
                tl.store(AUX + qidx * stride_an + col * stride_ac + tok * stride_al, aux,
                         mask=(qidx < Nq) & (tok < Lq))


@triton.jit
def maxsim_combine_slices_kernel(
    ROW_MAX, ROW_SUM, OUT,
    n_ds, Nq, C, Lq, n_cblocks,
    tau, inv_tau_log2e,
    SMOOTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Scores from the per-row states of a document split over ``n_ds`` token slices (``maxsim_fwd_kernel`` with
    ``ROW_OUT``): ``ROW_MAX`` (and ``ROW_SUM``, smooth) contiguous ``[n_ds, Nq, C, Lq]`` -> ``OUT`` ``[Nq, C]``.
    Per row: the max over slices (smooth: the log-sum-exp of the slices' partial sums), 0 where no token was
    valid; summed over the query's rows in a fixed order. Masked query rows hold -inf (and 0) already."""
    pid = tl.program_id(0).to(tl.int64)
    q = pid // n_cblocks
    cols = (pid % n_cblocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    slice_stride = Nq * C * Lq       # 32-bit is enough: documents are split only below 2 programs per SM (< 2^17 rows)
    score = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for l0 in range(0, Lq, BLOCK_L):
        toks = l0 + tl.arange(0, BLOCK_L)
        ok = col_ok[:, None] & (toks < Lq)[None, :]
        offs = q * C * Lq + cols[:, None] * Lq + toks[None, :]
        m = tl.full((BLOCK_C, BLOCK_L), float("-inf"), dtype=tl.float32)
        for s in range(n_ds):
            m = _max_propagating_nan(m, tl.load(ROW_MAX + s * slice_stride + offs, mask=ok, other=float("-inf")))
        if SMOOTH:
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            total = tl.zeros((BLOCK_C, BLOCK_L), dtype=tl.float32)
            for s in range(n_ds):
                rm = tl.load(ROW_MAX + s * slice_stride + offs, mask=ok, other=float("-inf"))
                rs = tl.load(ROW_SUM + s * slice_stride + offs, mask=ok, other=0.0)
                total += rs * tl.exp2((rm - m_safe) * inv_tau_log2e)
            val = tl.where((total > 0.0) | (total != total), m_safe + tau * tl.log(total), 0.0)
        else:
            val = tl.where(m == float("-inf"), 0.0, m)
        score += tl.sum(tl.where(ok, val, 0.0), 1)
    tl.store(OUT + q * C + cols, score, mask=col_ok)
