"""Experiment (session 29, not used by the package): the int8 x int8 compute-bound forward as a tensor-dense,
warp-specialised Gluon kernel, timed and metered against the package's Triton kernel on the same inputs:

    python benchmarks/gluon_pingpong_probe.py [--rounds 3] [--docs 10000]

Why (docs/perf-notes.md, session 29): int8 1x10k 1024x1024 runs at the board's power cap, where a call's time is its
energy over the power. The package's kernel spends 1.84 J per call; cuBLAS's e4m3 GEMM of the same multiply-adds
1.44 J, by keeping the tensor cores busy enough that the cap holds it at a lower clock (and voltage). This probe asks
whether MaxSim can be as dense: FlashAttention-3's layout of a program.

- One program per SM scores 128 query rows against a run of whole documents (runs of documents laid end to end).
- A producer warp copies each 256-token document tile by TMA into a ring of ``NBUF`` shared-memory buffers, with the
  tile's token scales (fp32, boosted by 2^100 once per call: the bit-cast sums of ``forward._tile_similarities``)
  beside it, and the two 64-row halves of the query tile once.
- Two consumer warpgroups (the default partition and a worker) each own 64 query rows: an m64n256k32 product chain
  per tile (128 accumulator registers), then the bit-cast similarities times the scales, and each row's running max.
- Ping-pong: a consumer issues its products only after the other issued its own for the previous tile (two turn
  mbarriers), so one's products run while the other reduces, and the two never convoy.
- A buffer is refilled after both consumers waited for their products on it (an ``empty`` barrier of count 2).

Same function as ``maxsim_fwd_kernel`` with ``Q_QUANTIZED`` and ``BITCAST_SUMS`` for this case (hard max, unmasked,
every row with a non-negative similarity in each document, scales in range): scores checked against the package's.

Outcome (docs/perf-notes.md, session 29; ``benchmarks/results/run49/call6_*`` to ``call9_*``): scores equal to the
package's in every round, but slower: 1x10k 1024x1024 2.747 against 2.480 ms (ping-pong, 4 buffers; without the
turn barriers 2.784 / 2.914), 1x1k 0.3120 against 0.3016, and no less energy (1.91 against 1.90 J per call, 2.81
against 2.64 ms sustained, at 1918 MHz: under the cap, so not tensor-dense). ``ncu`` of the 1x1k call: the tensor
pipe busy 45.5%, issue slots 33%, 3 warps per scheduler with 0.53 eligible, 34% of the stall cycles at the
partitions' barriers (each mbarrier arrive is preceded by a barrier of the partition's warps, 7 per tile).
``TREE`` (each row's max as a tree of in-thread maxima instead of one chain) was slower still (2.969). Per
instruction (``call10_*``): the products are never waited for; the consumers are bound by their own instructions,
the scales' 32 ``LDS.64`` per tile (MIO queue) and ~300 of reduction, from two warps per sub-partition.
``OWN_SCALES`` (each consumer loads its tile's scales a tile ahead and moves them into the accumulator's column
layout by ``convert_layout``: 16 ``LDSM`` instead of 32 ``LDS.64``; ``call11_*``): 2.776 with the turn barriers,
2.746 without, against 2.465: the scales' loads were not the bound either.

Left as measured (the numbers above are this code's): the explicit ``gl.thread_barrier()`` before the producer's
expect and the consumers' ``empty`` arrive repeat the partition barrier Triton already puts before each arrive, and
with ``OWN_SCALES`` the producer still loads the scales it no longer stores.
"""

import argparse
import statistics
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS_PER_CONSUMER = 64
TILE = 256          # document tokens per product
BOOST = 2.0 ** 100  # the bit-cast sums' scale boost (forward._tile_similarities)


@gluon.jit
def _halves_max(x, N: gl.constexpr):
    """[64, N] -> [64, N // 2]: the element-wise max of columns j and j + N / 2, which the accumulator's layout
    keeps in one thread (the top bit of a column index is a register bit for N >= 16): one independent max per
    pair, no data movement."""
    a, b = gl.split(gl.permute(gl.reshape(x, [64, 2, N // 2]), [0, 2, 1]))
    return gl.maximum(a, b)


@gluon.jit
def _rows_max_tree(s, rows_l: gl.constexpr):
    """Each row's max over a [64, 256] tile, as a tree of in-thread maxima (6 levels of independent instructions)
    before the shuffles across a row's four threads: a row's 64 values in one thread reduced one after another
    are a chain of dependent maxima, whose latency one warp per scheduler cannot hide."""
    x = _halves_max(s, 256)
    x = _halves_max(x, 128)
    x = _halves_max(x, 64)
    x = _halves_max(x, 32)
    x = _halves_max(x, 16)
    a, b = gl.split(gl.reshape(x, [64, 4, 2]))
    # the same rows in the same threads, named by the accumulator's slice layout (a conversion that moves nothing)
    return gl.convert_layout(gl.max(gl.maximum(a, b), 1), rows_l)


@gluon.jit
def _producer(Q_DESC, D_DESC, SCALES, OUT, q_smem, d_smem, sc_smem, ready, empty, q_ready, turn,
              run_row, run_tok, n_tiles, tj0, split, QSCALES, Lq, q_tok0,
              stride_os, stride_oc, NBUF: gl.constexpr, TILES_PER_DOC: gl.constexpr, PINGPONG: gl.constexpr,
              TREE: gl.constexpr, OWN_SCALES: gl.constexpr):
    """One warp: the query tile's two halves once, then each document tile and its 256 scales into the ring. A
    worker partition: its parameters are the other worker's (``_consumer1``), as Gluon requires."""
    mbarrier.expect(q_ready, 2 * Q_DESC.block_type.nbytes)
    tma.async_copy_global_to_shared(Q_DESC, [q_tok0, 0], q_ready, q_smem.index(0))
    tma.async_copy_global_to_shared(Q_DESC, [q_tok0 + 64, 0], q_ready, q_smem.index(1))
    sc_l: gl.constexpr = gl.BlockedLayout([8], [32], [1], [0])
    cols = gl.arange(0, 256, layout=sc_l)
    # the scales are loaded two tiles ahead: a load's latency (~1 us) per tile in this one warp's path was the
    # whole loop's bound in the first version (every tile's store waited for its load)
    sc_next = gl.load(SCALES + run_tok + cols)
    sc_after = gl.load(SCALES + run_tok + gl.minimum(1, n_tiles - 1) * 256 + cols)
    for i in range(n_tiles):
        b = i % NBUF
        sc = sc_next
        sc_next = sc_after
        sc_after = gl.load(SCALES + run_tok + gl.minimum(i + 2, n_tiles - 1) * 256 + cols)
        # both consumers' products on buffer b (tile i - NBUF) are done; a fresh barrier passes phase 1 at once
        mbarrier.wait(empty.index(b), ((i // NBUF) & 1) ^ 1)
        if not OWN_SCALES:
            sc_smem.index(b).store(sc)
        # every lane's stores done before the one thread's arrive that comes with expect (release: the consumers'
        # wait then sees them)
        gl.thread_barrier()
        mbarrier.expect(ready.index(b), D_DESC.block_type.nbytes)
        tma.async_copy_global_to_shared(D_DESC, [run_row + i * 256, 0], ready.index(b), d_smem.index(b))


@gluon.jit
def _consume(Q_DESC, D_DESC, SCALES, OUT, q_smem, d_smem, sc_smem, ready, empty, q_ready, turn,
             run_row, run_tok, n_tiles, tj0, split, QSCALES, Lq, q_tok0,
             stride_os, stride_oc, NBUF: gl.constexpr, TILES_PER_DOC: gl.constexpr, PINGPONG: gl.constexpr,
             TREE: gl.constexpr, OWN_SCALES: gl.constexpr, C: gl.constexpr):
    """Consumer ``C`` (0 or 1): query rows ``64 C + [0, 64)`` of the program's block against every tile."""
    # int8 warpgroup products of 128 tokens (Triton 3.6 refuses an s8 instruction of 256): two per k-step
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    rtok = q_tok0 + C * 64 + gl.arange(0, 64, layout=rows_l)
    row_ok = rtok < Lq
    q_scale = gl.load(QSCALES + rtok, mask=row_ok, other=1.0)
    q_scale = gl.where(q_scale < float("inf"), q_scale, float("nan"))
    # bit-cast maxima come out times 2^-49 (exact)
    q_scale = gl.where(row_ok, q_scale, 1.0) * 562949953421312.0
    zero = gl.zeros([64, 256], gl.int32, layout=mma)
    m = gl.full([64], float("-inf"), gl.float32, layout=rows_l)
    mbarrier.wait(q_ready, 0)
    a = q_smem.index(C)
    tj = tj0
    out = OUT + (2 * split + C) * stride_os
    # OWN_SCALES: each consumer loads the tile's 256 scales itself, two per thread and a tile ahead, and moves them
    # into the accumulator's column layout with convert_layout (the compiler's vectorised shared-memory exchange,
    # as the package's kernel does: 8 LDS.128 for 32 columns) instead of 32 LDS.64 from the producer's copy
    sc_blk_l: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    sc_cols = gl.arange(0, 256, layout=sc_blk_l)
    if OWN_SCALES:
        sc_next = gl.load(SCALES + run_tok + sc_cols)
    else:
        sc_next = gl.zeros([256], gl.float32, layout=sc_blk_l)
    for i in range(n_tiles):
        b = i % NBUF
        mbarrier.wait(ready.index(b), (i // NBUF) & 1)
        # my turn: the other consumer issued its products for the tile before (consumer 0 goes first)
        if PINGPONG:
            if C == 0:
                mbarrier.wait(turn.index(0), (i & 1) ^ 1)
            else:
                mbarrier.wait(turn.index(1), i & 1)
        acc = warpgroup_mma(a, d_smem.index(b).permute((1, 0)), zero, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - C), count=1)
        if OWN_SCALES:
            sc = gl.convert_layout(sc_next, cols_l)
            sc_next = gl.load(SCALES + run_tok + gl.minimum(i + 1, n_tiles - 1) * 256 + sc_cols)
        else:
            sc = sc_smem.index(b).load(cols_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # every warp's scale loads and products on buffer b done before the one thread's arrive frees it
        gl.thread_barrier()
        mbarrier.arrive(empty.index(b), count=1)
        s = acc.to(gl.float32, bitcast=True) * gl.expand_dims(sc, 0)
        if TREE:
            m = gl.maximum(m, _rows_max_tree(s, rows_l))
        else:
            m = gl.maximum(m, gl.max(s, 1))
        if (i + 1) % TILES_PER_DOC == 0:
            v = gl.where(m == float("-inf"), m, m * q_scale)
            v = gl.where(row_ok & (v != float("-inf")), v, 0.0)
            gl.store(out + tj * stride_oc, gl.sum(v, 0))
            tj += 1
            m = gl.full([64], float("-inf"), gl.float32, layout=rows_l)


@gluon.jit
def _consumer1(Q_DESC, D_DESC, SCALES, OUT, q_smem, d_smem, sc_smem, ready, empty, q_ready, turn,
               run_row, run_tok, n_tiles, tj0, split, QSCALES, Lq, q_tok0,
               stride_os, stride_oc, NBUF: gl.constexpr, TILES_PER_DOC: gl.constexpr, PINGPONG: gl.constexpr,
               TREE: gl.constexpr, OWN_SCALES: gl.constexpr):
    _consume(Q_DESC, D_DESC, SCALES, OUT, q_smem, d_smem, sc_smem, ready, empty, q_ready, turn,
             run_row, run_tok, n_tiles, tj0, split, QSCALES, Lq, q_tok0,
             stride_os, stride_oc, NBUF, TILES_PER_DOC, PINGPONG, TREE, OWN_SCALES, 1)


@gluon.jit
def maxsim_int8_pingpong_kernel(Q_DESC, D_DESC, SCALES, QSCALES, OUT, Lq, Ld, n_docs, docs_per_program, n_splits,
                                stride_os, stride_oc, NBUF: gl.constexpr, TILES_PER_DOC: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr = True,
                                TREE: gl.constexpr = False, OWN_SCALES: gl.constexpr = False):
    pid = gl.program_id(0)
    split = pid % n_splits                       # the program's 128 query rows (one query: Nq = 1)
    t = pid // n_splits                          # its group of documents
    tj0 = t * docs_per_program
    n_docs_here = gl.minimum(n_docs - tj0, docs_per_program)
    n_tiles = n_docs_here * TILES_PER_DOC
    run_row = tj0 * Ld                           # the run's first row of the [tokens, d] descriptor
    run_tok = tj0.to(gl.int64) * Ld
    q_tok0 = split * 128                         # one query: its token rows are the descriptor's rows too

    q_smem = gl.allocate_shared_memory(gl.int8, [2, 64, 128], Q_DESC.layout)
    d_smem = gl.allocate_shared_memory(gl.int8, [NBUF, 256, 128], D_DESC.layout)
    sc_smem = gl.allocate_shared_memory(gl.float32, [NBUF, 256], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NBUF):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.init(q_ready, count=1)

    args = (Q_DESC, D_DESC, SCALES, OUT, q_smem, d_smem, sc_smem, ready, empty, q_ready, turn,
            run_row, run_tok, n_tiles, tj0, split, QSCALES, Lq, q_tok0,
            stride_os, stride_oc, NBUF, TILES_PER_DOC, PINGPONG, TREE, OWN_SCALES)
    # the default partition is consumer 0 (its function may take other arguments than the workers', which share one
    # signature)
    gl.warp_specialize([(_consume, args + (0,)), (_consumer1, args), (_producer, args)], [4, 1],
                       [CONSUMER_REGS, 40])


def pingpong_scores(qv, qs, dv, ds_boosted, programs_per_sm=1, nbuf=3, consumer_regs=232, maxnreg=168,
                    pingpong=True, tree=False, own_scales=False):
    """Scores [1, T] of one int8 query (values ``qv`` [1, Lq, d], scales ``qs``) against int8 documents ``dv``
    [T, Ld, d] whose fp32 token scales times 2^100 are ``ds_boosted`` [T, Ld]; Lq a multiple of 128, Ld of 256."""
    Nq, Lq, d = qv.shape
    T, Ld, _ = dv.shape
    assert Nq == 1 and d == 128 and Lq % 128 == 0 and Ld % TILE == 0
    n_splits = Lq // 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    docs = max(1, triton.cdiv(T * n_splits, 8 * programs_per_sm * sms))   # ~8 waves
    groups = triton.cdiv(T, docs)
    out = torch.empty(2 * n_splits, 1, T, device=qv.device, dtype=torch.float32)
    q_layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.int8)
    d_layout = gl.NVMMASharedLayout.get_default_for([TILE, 128], gl.int8)
    q_desc = TensorDescriptor(qv.view(Lq, d), [Lq, d], [d, 1], [64, d], q_layout)
    d_desc = TensorDescriptor(dv.view(T * Ld, d), [T * Ld, d], [d, 1], [TILE, d], d_layout)
    maxsim_int8_pingpong_kernel[(groups * n_splits,)](
        q_desc, d_desc, ds_boosted, qs.view(-1), out, Lq, Ld, T, docs, n_splits, out.stride(0), out.stride(2),
        NBUF=nbuf, TILES_PER_DOC=Ld // TILE, CONSUMER_REGS=consumer_regs, PINGPONG=pingpong, TREE=tree, OWN_SCALES=own_scales,
        num_warps=4,
        maxnreg=maxnreg)
    return out.sum(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--docs", type=int, default=10000)
    args = ap.parse_args(argv)
    import flash_maxsim as fm
    from ab_forward import forward_scores, ranked_line, time_interleaved
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch
    from flash_maxsim.quantization import quantize_tokens
    torch.manual_seed(0)
    for B in (1000, args.docs):
        q = torch.randn(1, 1024, 128, device="cuda", dtype=torch.bfloat16)
        docs = torch.randn(B, 1024, 128, device="cuda", dtype=torch.bfloat16)
        p = _layout.canonicalize(q, fm.quantize(docs, dtype="int8"), None, None, masked="exclude", smooth_tau=None)
        del docs
        want = forward_scores(launch, p)
        qv, qs = quantize_tokens(p.queries)
        boosted = p.document_scales.float() * BOOST
        entries = [("triton (package)", lambda: forward_scores(launch, p), None)]
        for nbuf, pingpong, own in ((4, True, False), (4, True, True), (4, False, True)):
            entries.append((f"consumers nbuf={nbuf} pingpong={pingpong} own_scales={own}",
                            lambda nbuf=nbuf, pp=pingpong, own=own: pingpong_scores(
                                qv, qs, p.documents, boosted, nbuf=nbuf, pingpong=pp, own_scales=own), None))
        times = time_interleaved(entries, want, args.rounds)
        print(f"pingpong 1x{B} 1024x1024: {ranked_line(times, 'triton (package)')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
