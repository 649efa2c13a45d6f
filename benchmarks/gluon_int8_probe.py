"""Experiment (session 13, not used by the package): the int8 x int8 compute-bound forward written in Gluon, so that
each program keeps a tensor-core product in flight while it reduces another, timed against the package's Triton
kernel on the same inputs. One device run (Hopper, a Triton with ``triton.experimental.gluon``, e.g. 3.6):

    python benchmarks/gluon_int8_probe.py [--rows 2] [--rounds 5]

Why: in ``maxsim_fwd_kernel`` each warp issues a tile's products and waits for them at once (session 12's count:
~554 cycles of products and ~620 of reduction per 128x128 tile and SM, the time about their sum). Triton gives no
control over that wait; Gluon does. A document tile of 2 * HALF tokens arrives by TMA into a ring of NBUF
shared-memory buffers; half h of it is multiplied (``warpgroup_mma(..., is_async=True)``) while the half before it
is reduced, with two accumulators that alternate. ptxas keeps the products asynchronous only when, between a
product's issue and its wait, no instruction reads another product's accumulator that is re-issued in that window:
with two products in flight it serialised every one (warning C7514), so one is in flight at a time.
``SEPARATE_ACC`` passes ``use_acc`` as a predicate the compiler cannot prove false (it is), so the accumulators
keep separate registers (otherwise ptxas converts the finished one before issuing the next product into the same
registers). Same function as ``maxsim_fwd_kernel`` with ``Q_QUANTIZED`` (hard max, per-token scales, NaN
propagated, optional query mask): documents in runs of whole tiles, one query per row block, no document mask.

Outcome (docs/perf-notes.md, session 13; ``benchmarks/results/run31/probe*.txt``, ``ncu_*``): scores equal to the
Triton kernel's; 1x10k 1024x1024 3.00-3.31 ms against 2.89-2.99 in every configuration (1x1k: up to 11% faster).
Session 29 (``BITCAST``: the int32 sums read as fp32 bits, as the package's kernel has since session 16;
``run49/call1_gluon_bitcast_probe.txt``): 1x10k 2.831 against 2.586 ms, 1x1k 0.283 against 0.300. The row runs at
the board's power cap, where time follows energy per call (``energy_probe.py``: this kernel 2.0 J, the package's
1.84, this kernel reducing 1 tile in 8, ``FOLD_EVERY=8``, a floor with wrong scores, 1.78).
Session 30 (``A_REGS``: the query tile as the products' A operand in registers, wgmma's RS form, so that each
product reads only the document tile from shared memory; ``run50/call1_energy_rs.txt``): the floor 1.64 against
1.76 J per call (2.38 against 2.53 ms sustained); the scorer 2.11 against 1.92 J, its 195 registers leaving 2
programs per SM instead of 3.
"""

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _max_propagating_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _fold_half(acc, sc, m):
    """Each row's running max with this half's similarities: int32 products -> fp32 (exact: |sum| < 2^24),
    times each document token's scale; the query row's scale is applied once at the document's end."""
    s = acc.to(gl.float32) * gl.expand_dims(sc, 0)
    return _max_propagating_nan(m, gl.reduce(s, 1, _max_propagating_nan))


@gluon.jit
def _fold_half_bitcast(acc, sc, m):
    """``_fold_half`` with the int32 sums read as fp32 bits (``forward._tile_similarities``' BITCAST_SUMS): each
    similarity times 2^-49 where the sum is non-negative, NaN or -inf where negative, dropped by the max; ``sc``
    holds the scales times 2^100, the caller restores the 2^49."""
    s = acc.to(gl.float32, bitcast=True) * gl.expand_dims(sc, 0)
    return gl.maximum(m, gl.max(s, 1))


@gluon.jit
def _half_scales(SCALES, base, layout: gl.constexpr, HALF: gl.constexpr, BITCAST: gl.constexpr = False):
    sc = gl.load(SCALES + base + gl.arange(0, HALF, layout=layout))
    if BITCAST and SCALES.dtype.element_ty != gl.float32:
        # fp32 scales arrive boosted already (``gluon_scores(prescaled=True)``: one pass over the scales per call)
        sc = sc.to(gl.float32) * 1.2676506002282294e30
    return sc


@gluon.jit
def _fold(acc, sc, m, BITCAST: gl.constexpr):
    if BITCAST:
        m = _fold_half_bitcast(acc, sc, m)
    else:
        m = _fold_half(acc, sc, m)
    return m


@gluon.jit
def maxsim_fwd_int8_hopper_kernel(
    Q, QSCALES, QMASK, D_DESC, SCALES, OUT,
    Nq, Lq, Ld, n_docs, docs_per_program, n_splits,
    stride_qmn, stride_qml, stride_os, stride_on, stride_oc,
    HAS_QMASK: gl.constexpr, BLOCK_D: gl.constexpr, NBUF: gl.constexpr, NUM_WARPS: gl.constexpr,
    SEPARATE_ACC: gl.constexpr = False, BM: gl.constexpr = 128, HALF: gl.constexpr = 64,
    BITCAST: gl.constexpr = False, FOLD_EVERY: gl.constexpr = 1, A_REGS: gl.constexpr = False,
):
    TILE: gl.constexpr = 2 * HALF
    # accumulator of one product: 128 rows x 64 tokens over 1 or 2 warpgroups (4 or 8 warps)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, HALF, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    q_load_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BLOCK_D, BLOCK_D // 16], [NUM_WARPS, 1],
                                               [1, 0])

    pid = gl.program_id(0).to(gl.int64)
    split = pid % n_splits
    rest = pid // n_splits
    q0 = rest % Nq
    t = rest // Nq                                  # the program's group of documents
    n_here = gl.minimum(n_docs - t * docs_per_program, docs_per_program).to(gl.int32)
    tiles_per_doc = Ld // TILE
    n_tiles = n_here * tiles_per_doc
    run_row = (t * docs_per_program * Ld).to(gl.int32)   # the run's first row of the [tokens, d] descriptor
    run_tok = t * docs_per_program * Ld                  # int64: offset of the run's scales

    # the query tile (int8, quantised before the launch) into shared memory, the tensor cores' A operand
    qr = gl.arange(0, BM, layout=gl.SliceLayout(1, q_load_l))
    qc = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, q_load_l))
    qtok = split * BM + qr
    q_ok = qtok < Lq
    if HAS_QMASK:
        q_ok = q_ok & (gl.load(QMASK + q0 * stride_qmn + qtok * stride_qml, mask=q_ok, other=0) != 0)
    q_vals = gl.load(Q + (q0 * Lq + qtok)[:, None] * BLOCK_D + qc[None, :], mask=q_ok[:, None], other=0)
    q_smem = gl.allocate_shared_memory(gl.int8, [BM, BLOCK_D], gl.NVMMASharedLayout.get_default_for([BM, BLOCK_D],
                                       gl.int8), q_vals)
    fence_async_shared()
    if A_REGS:
        # the query tile as the products' A operand in registers (wgmma's RS form: only the document tile is read
        # from shared memory by each product)
        a_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4))
    else:
        a_op = q_smem

    # the rows' validity and scales in the accumulator's row layout
    rtok = split * BM + gl.arange(0, BM, layout=rows_l)
    row_ok = rtok < Lq
    if HAS_QMASK:
        row_ok = row_ok & (gl.load(QMASK + q0 * stride_qmn + rtok * stride_qml, mask=row_ok, other=0) != 0)
    q_scale = gl.load(QSCALES + q0 * Lq + rtok, mask=row_ok, other=1.0)
    # a NaN or infinite query token scores NaN (as maxsim_fwd_kernel)
    q_scale = gl.where(q_scale < float("inf"), q_scale, float("nan"))
    q_scale = gl.where(row_ok, q_scale, 1.0)
    if BITCAST:
        # the bit-cast maxima come out times 2^-49 (exact: a power of two)
        q_scale = q_scale * 562949953421312.0

    d_smem = gl.allocate_shared_memory(gl.int8, [NBUF, TILE, BLOCK_D], D_DESC.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NBUF):
        mbarrier.init(ready.index(j), count=1)
    for j in gl.static_range(NBUF):
        if j < n_tiles:
            mbarrier.expect(ready.index(j), D_DESC.block_type.nbytes)
            tma.async_copy_global_to_shared(D_DESC, [run_row + j * TILE, 0], ready.index(j), d_smem.index(j))

    m = gl.full([BM], float("-inf"), gl.float32, layout=rows_l)
    zero = gl.zeros([BM, HALF], gl.int32, layout=mma)
    # One product in flight while the warps reduce the other half's: ptxas keeps products asynchronous only when no
    # instruction reads an accumulator between a product's issue and its wait other than the one product's own
    # (a second product in flight while reducing made it serialise every product: warning C7514)
    sc0 = _half_scales(SCALES, run_tok, cols_l, HALF, BITCAST)
    sc1 = _half_scales(SCALES, run_tok + HALF, cols_l, HALF, BITCAST)
    mbarrier.wait(ready.index(0), 0)
    acc0 = warpgroup_mma(a_op, d_smem.index(0).slice(0, HALF).permute((1, 0)), zero, use_acc=False, is_async=True)
    acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
    acc1 = zero
    # SEPARATE_ACC: a predicate the compiler cannot prove false (it is) for use_acc, so that each product's old
    # accumulator stays a live input and the two accumulators keep separate registers
    keep = False
    if SEPARATE_ACC:
        keep = n_tiles < 0
    tj = t * docs_per_program
    out = OUT + split * stride_os + q0 * stride_on
    for i in range(n_tiles - 1):
        b = i % NBUF
        # tile i's second half in flight while its first half is reduced
        acc1 = warpgroup_mma(a_op, d_smem.index(b).slice(HALF, HALF).permute((1, 0)), acc1, use_acc=keep,
                             is_async=True)
        if FOLD_EVERY == 1 or i % FOLD_EVERY == 0:
            m = _fold(acc0, sc0, m, BITCAST)
        nxt = run_tok + (i + 1) * TILE
        sc0 = _half_scales(SCALES, nxt, cols_l, HALF, BITCAST)
        acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
        # every warp's products of tile i are done: its buffer takes tile i + NBUF
        gl.thread_barrier()
        if i + NBUF < n_tiles:
            mbarrier.expect(ready.index(b), D_DESC.block_type.nbytes)
            tma.async_copy_global_to_shared(D_DESC, [run_row + (i + NBUF) * TILE, 0], ready.index(b),
                                            d_smem.index(b))
        # the next tile's first half in flight while this tile's second half is reduced
        nb = (i + 1) % NBUF
        mbarrier.wait(ready.index(nb), ((i + 1) // NBUF) & 1)
        acc0 = warpgroup_mma(a_op, d_smem.index(nb).slice(0, HALF).permute((1, 0)), acc0, use_acc=keep,
                             is_async=True)
        if FOLD_EVERY == 1 or i % FOLD_EVERY == 0:
            m = _fold(acc1, sc1, m, BITCAST)
        sc1 = _half_scales(SCALES, nxt + HALF, cols_l, HALF, BITCAST)
        if (i + 1) % tiles_per_doc == 0:
            # the document's last tile: its score, then a fresh running max
            _store_score(out, tj, stride_oc, m, q_scale, row_ok)
            tj += 1
            m = gl.full([BM], float("-inf"), gl.float32, layout=rows_l)
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
    # the last tile
    b = (n_tiles - 1) % NBUF
    acc1 = warpgroup_mma(a_op, d_smem.index(b).slice(HALF, HALF).permute((1, 0)), acc1, use_acc=keep,
                         is_async=True)
    m = _fold(acc0, sc0, m, BITCAST)
    acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
    m = _fold(acc1, sc1, m, BITCAST)
    _store_score(out, tj, stride_oc, m, q_scale, row_ok)
    for j in gl.static_range(NBUF):
        mbarrier.invalidate(ready.index(j))


@gluon.jit
def _store_score(out, tj, stride_oc, m, q_scale, row_ok):
    """The block's partial score of one document: the sum of its valid rows' max similarities (0 where a row met
    no token), each scaled by its query token's scale (as ``forward._row_values`` with QUANTIZE_Q)."""
    m = gl.where(m == float("-inf"), m, m * q_scale)
    val = gl.where(row_ok & (m != float("-inf")), m, 0.0)
    gl.store(out + tj * stride_oc, gl.sum(val, 0))


def gluon_scores(qv, qs, dv, ds, pps, nbuf, maxnreg=None, nw=4, sep=False, bm=128, half=64, bitcast=False,
                 prescaled=False, fold_every=1, a_regs=False):
    """Scores [Nq, T] of int8 queries (values ``qv``, scales ``qs``) against int8 documents ``dv`` [T, Ld, d] with
    scales ``ds`` (Ld a multiple of 2 * half), on a grid sized for ``pps`` programs per SM."""
    Nq, Lq, d = qv.shape
    T, Ld, _ = dv.shape
    n_splits = triton.cdiv(Lq, bm)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    docs = max(1, triton.cdiv(T * Nq * n_splits, pps * sms))
    groups = triton.cdiv(T, docs)
    out = torch.empty(n_splits, Nq, T, device=qv.device, dtype=torch.float32)
    desc = TensorDescriptor(dv.view(T * Ld, d), [T * Ld, d], [d, 1], [2 * half, d],
                            gl.NVMMASharedLayout.get_default_for([2 * half, d], gl.int8))
    if prescaled:
        ds = ds.float() * 2.0**100
    kw = dict(HAS_QMASK=False, BLOCK_D=d, NBUF=nbuf, NUM_WARPS=nw, num_warps=nw, SEPARATE_ACC=sep, BM=bm, HALF=half,
              BITCAST=bitcast, FOLD_EVERY=fold_every, A_REGS=a_regs)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    maxsim_fwd_int8_hopper_kernel[(groups * Nq * n_splits,)](
        qv, qs, qv, desc, ds, out, Nq, Lq, Ld, T, docs, n_splits, 0, 0, out.stride(0), out.stride(1), out.stride(2),
        **kw)
    return out.sum(0)


# (pps: programs per SM that size the grid, nbuf, maxnreg, warps, separate accumulators, rows per program, HALF,
# bit-cast sums). Session 13's six (converted sums) were all slower than the Triton kernel then; session 29 times the
# bit-cast sums (the package's default on this grid since session 16) in the same structure
VARIANTS = [(24, 3, None, 4, False, 128, 64, True), (24, 3, 168, 4, True, 128, 64, True),
            (16, 3, None, 4, True, 128, 64, True), (24, 2, None, 4, False, 128, 64, True),
            (24, 4, None, 4, False, 128, 64, True), (40, 3, None, 4, False, 64, 64, True),
            (24, 3, None, 4, False, 128, 64, True, True), (24, 3, None, 4, False, 128, 64, False)]
ROWS = [(1, 10000, 1024, 1024), (1, 1000, 1024, 1024), (4, 2000, 256, 1024)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=len(ROWS), help="the first N rows of ROWS")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import flash_maxsim as fm
    from ab_forward import forward_scores, ranked_line, time_interleaved
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch
    from flash_maxsim.quantization import quantize_tokens
    torch.manual_seed(0)
    for Nq, B, Lq, Ld in ROWS[:args.rows]:
        q = torch.randn(Nq, Lq, 128, device="cuda", dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, 128, device="cuda", dtype=torch.bfloat16)
        p = _layout.canonicalize(q, fm.quantize(docs, dtype="int8"), None, None, masked="exclude", smooth_tau=None)
        want = forward_scores(launch, p)
        qv, qs = quantize_tokens(p.queries)
        dv, ds = p.documents, p.document_scales.contiguous()
        entries = [("triton (package)", lambda: forward_scores(launch, p), None)]
        for v in VARIANTS:
            name = "gluon pps={} nbuf={} maxnreg={} warps={} sep={} bm={} half={} bitcast={}".format(*v[:8])
            if len(v) > 8:
                name += " prescaled"
            entries.append((name, lambda v=v: gluon_scores(qv, qs, dv, ds, *v), None))
        times = time_interleaved(entries, want, args.rounds)
        print(f"probe {Nq}x{B} {Lq}x{Ld}: {ranked_line(times, 'triton (package)')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
