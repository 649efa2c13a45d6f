"""One medium case of every kernel path, for `compute-sanitizer --tool memcheck` on a GPU: forward + backward
(hard/smooth, masks, in-batch, per-query candidates, ragged/packed, long query split, document-token split) and
quantized scoring (int8 and fp8, with 8-bit products or converted). Paths that these sizes would not pick are forced
by tile overrides (kernels/tuning.py). Prints one line per case; exit 1 on a wrong result.

    compute-sanitizer --tool memcheck python tools/sanitizer_case.py
"""

import sys

import torch

import flash_maxsim as fm
from flash_maxsim import reference
from flash_maxsim.kernels.tuning import override_backward
from flash_maxsim.kernels.tuning import override_forward


def main():
    dev = "cuda"
    torch.manual_seed(0)
    ok = True

    def check(name, got, want, tol):
        nonlocal ok
        err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        ok &= err <= tol
        print(f"{'ok ' if err <= tol else 'BAD'} {name}: rel err {err:.1e}", flush=True)

    bf = torch.bfloat16
    q = torch.randn(6, 40, 96, device=dev, dtype=bf, requires_grad=True)
    d = torch.randn(9, 333, 96, device=dev, dtype=bf, requires_grad=True)
    qm = torch.rand(6, 40, device=dev) > 0.2
    dm = torch.rand(9, 333, device=dev) > 0.3
    for tau in (None, 0.1):
        for masked in ("exclude", "zero"):
            out = fm.maxsim(q, d, qm, dm, masked=masked, smooth_tau=tau)
            out.sum().backward()
            check(f"in-batch {masked} tau={tau}", out, reference.maxsim(q.detach(), d.detach(), qm, dm, masked=masked,
                                                                         smooth_tau=tau), 1e-5)
    # the smooth max without masks: its gradients load each streamed tile once for both products
    q128 = torch.randn(6, 32, 128, device=dev, dtype=bf, requires_grad=True)
    d128 = torch.randn(9, 333, 128, device=dev, dtype=bf, requires_grad=True)
    out = fm.maxsim(q128, d128, smooth_tau=0.1)
    (out * torch.linspace(-1, 1, out.numel(), device=dev).view(out.shape)).sum().backward()
    check("in-batch smooth, no masks", out, reference.maxsim(q128.detach(), d128.detach(), smooth_tau=0.1), 1e-5)
    # the training forward's hard max (partial (max, arg-max) pairs, whole tiles copied by TMA; the masked in-batch
    # cases above take them too, at d=96)
    out = fm.maxsim(q128, d128)
    (out * torch.linspace(-1, 1, out.numel(), device=dev).view(out.shape)).sum().backward()
    check("in-batch hard, no masks", out, reference.maxsim(q128.detach(), d128.detach()), 1e-5)
    # the training forward's default on long documents (256-row tiles, 3 stages, 16-token tail tiles; 8 query blocks
    # x 40 documents of 530 tokens), masked, hard (masked as zero) and smooth, with both gradients
    q_long = torch.randn(64, 32, 128, device=dev, dtype=bf, requires_grad=True)
    d_long = torch.randn(40, 530, 128, device=dev, dtype=bf, requires_grad=True)
    qm_long, dm_long = torch.rand(64, 32, device=dev) > 0.2, torch.rand(40, 530, device=dev) > 0.3
    dm_long[7] = False
    for masked, tau in (("zero", None), ("exclude", 0.1)):
        out = fm.maxsim(q_long, d_long, qm_long, dm_long, masked=masked, smooth_tau=tau)
        (out * torch.linspace(-1, 1, out.numel(), device=dev).view(out.shape)).sum().backward()
        check(f"training forward, long documents, {masked} tau={tau}", out,
              reference.maxsim(q_long.detach(), d_long.detach(), qm_long, dm_long, masked=masked, smooth_tau=tau),
              1e-5)
    cand = torch.randn(6, 3, 70, 96, device=dev, dtype=bf, requires_grad=True)
    out = fm.maxsim(q, cand, qm)
    out.sum().backward()
    check("candidates", out, reference.maxsim(q.detach(), cand.detach(), qm), 1e-5)
    ragged = [torch.randn(n, 96, device=dev, dtype=bf) for n in (1, 0, 500, 63, 64, 65)]
    packed = fm.pack(ragged)
    vals = packed.values.detach().requires_grad_()
    out = fm.maxsim(q, fm.PackedDocuments(vals, packed.offsets, packed.max_length), smooth_tau=0.2)
    out.sum().backward()
    check("packed smooth", out, reference.maxsim(q.detach(), ragged, smooth_tau=0.2), 1e-5)
    # the binned hard-max dD and the dQ gather (the defaults for documents of 1024 tokens or 1024 arg-max entries or
    # more): in-batch with masks (d = 96 padded to 128 features), per-query candidates, packed documents with an
    # empty one; both gradients against the dense dD's launch with the row-at-a-time dQ
    for name, docs, mask in (("in-batch", d, dm), ("candidates", cand, None), ("packed", vals, None)):
        grads = []
        for method in ({"DD_METHOD": "dense", "FUSED": False, "DQ_METHOD": "rows"},
                       {"DD_METHOD": "binned", "DQ_METHOD": "gather"}):
            leaf, q_leaf = docs.detach().requires_grad_(), q.detach().requires_grad_()
            arg = fm.PackedDocuments(leaf, packed.offsets, packed.max_length) if name == "packed" else leaf
            with override_backward(**method):
                out = fm.maxsim(q_leaf, arg, qm, mask)
                (out * torch.linspace(-1, 1, out.numel(), device=dev).view(out.shape)).sum().backward()
            grads.append((leaf.grad.double(), q_leaf.grad.double()))
        check(f"binned dD, {name}", grads[1][0], grads[0][0], 1e-2)
        check(f"dQ gather, {name}", grads[1][1], grads[0][1], 1e-2)
    long_q = torch.randn(2, 300, 128, device=dev, dtype=bf, requires_grad=True)
    out = fm.maxsim(long_q, torch.randn(3, 129, 128, device=dev, dtype=bf))
    out.sum().backward()
    with torch.no_grad():
        few = torch.randn(2, 2, 4000, 128, device=dev, dtype=bf)
        q2 = torch.randn(2, 32, 128, device=dev, dtype=bf)
        check("document-token split", fm.maxsim(q2, few[0]), reference.maxsim(q2, few[0]), 1e-5)
        check("document-token split smooth", fm.maxsim(q2, few[0], smooth_tau=0.1),
              reference.maxsim(q2, few[0], smooth_tau=0.1), 1e-5)
        # runs of several documents per program (the default for 16-bit documents of whole tiles or chunked
        # features): whole 64-token tiles with a mask, smooth; d = 384 (3 feature chunks) whose 128-token tiles
        # straddle 180-token documents
        runs = torch.randn(11, 256, 128, device=dev, dtype=bf)
        runs_mask = torch.rand(11, 256, device=dev) > 0.3
        wide_q, wide = torch.randn(1, 32, 384, device=dev, dtype=bf), torch.randn(11, 180, 384, device=dev, dtype=bf)
        with override_forward(DOCS=4, PROGRAMS_PER_SM=0):
            got_runs = fm.maxsim(q2, runs, None, runs_mask, smooth_tau=0.1)
            got_wide = fm.maxsim(wide_q, wide)
        check("runs of documents, whole tiles, smooth", got_runs,
              reference.maxsim(q2, runs, None, runs_mask, smooth_tau=0.1), 1e-5)
        check("runs of documents, d=384 straddling", got_wide, reference.maxsim(wide_q, wide), 1e-5)
        # partial row maxima (the default of 256-row tiles, 128-row token splits and the fp8 compute-bound grid) in
        # 256-row programs: one document per program with its peeled last tile, runs of whole tiles (masked), a
        # token split
        q256 = torch.randn(8, 32, 128, device=dev, dtype=bf)
        with override_forward(ROW_PARTIALS=8, ROWS=256, num_warps=8, DOCS=1, PROGRAMS_PER_SM=0):
            got_one = fm.maxsim(q256, wide[:, :, :128].contiguous())
            got_split = fm.maxsim(q256, few[0])
        with override_forward(ROW_PARTIALS=8, ROWS=256, num_warps=8, DOCS=4, PROGRAMS_PER_SM=0):
            got_runs = fm.maxsim(q256, runs, None, runs_mask)
        check("partial row maxima, one document per program", got_one,
              reference.maxsim(q256, wide[:, :, :128]), 1e-5)
        check("partial row maxima, token split", got_split, reference.maxsim(q256, few[0]), 1e-5)
        check("partial row maxima, runs of whole tiles", got_runs, reference.maxsim(q256, runs, None, runs_mask),
              1e-5)
        # options off by default: the peeled tail in 16-token tiles (one document per program, padded and masked,
        # and packed), several documents per program each with its own peeled tail
        narrow_docs = wide[:, :, :128].contiguous()
        narrow_mask = torch.rand(11, 180, device=dev) > 0.3
        with override_forward(TAIL_N=16, ROW_PARTIALS=8, ROWS=256, num_warps=8, DOCS=1, PROGRAMS_PER_SM=0):
            got_tail = fm.maxsim(q256, narrow_docs, None, narrow_mask, masked="zero")
            got_tail_ragged = fm.maxsim(q.detach(), packed)
        check("16-token tail, masked as zero", got_tail,
              reference.maxsim(q256, narrow_docs, None, narrow_mask, masked="zero"), 1e-5)
        check("16-token tail, packed", got_tail_ragged, reference.maxsim(q.detach(), ragged), 1e-5)
        with override_forward(ROW_PARTIALS=8, ROWS=256, num_warps=8, DOCS=3, PROGRAMS_PER_SM=0, PEEL_EACH_DOC=True,
                               MAXNREG=128):
            got_each = fm.maxsim(q256, narrow_docs, None, narrow_mask)
        check("several documents, each peeled", got_each, reference.maxsim(q256, narrow_docs, None, narrow_mask),
              1e-5)
        # the default for 256-row tiles of documents that end inside a tile (enough pairs for them: 8 query blocks x
        # 150 documents): a share of the documents per program, each peeled, 16-token tails, whole tiles copied by
        # TMA, masked too
        q64 = torch.randn(64, 32, 128, device=dev, dtype=bf)
        docs150 = torch.randn(150, 300, 128, device=dev, dtype=bf)
        mask150 = torch.rand(150, 300, device=dev) > 0.3
        check("peeled runs (default), 64x150 32x300", fm.maxsim(q64, docs150), reference.maxsim(q64, docs150), 1e-5)
        check("peeled runs (default), masked", fm.maxsim(q64, docs150, None, mask150),
              reference.maxsim(q64, docs150, None, mask150), 1e-5)
        # d = 96 (features padded to 128) in runs whose tiles straddle documents, whole tiles copied by TMA with
        # the padded features zero-filled (the default for such streaming rows), or by the threads; twice each, the
        # second call through the cached launch (the descriptor encoded once)
        q96, d96 = torch.randn(1, 31, 96, device=dev, dtype=bf), torch.randn(11, 257, 96, device=dev, dtype=bf)
        for tma in (True, False):
            with override_forward(DOCS=4, PROGRAMS_PER_SM=0, TMA_DOCS=tma, MAXNREG=128):
                for _ in range(2):
                    got96 = fm.maxsim(q96, d96)
            check(f"runs of documents, d=96 {'by TMA' if tma else 'copied by the threads'}", got96,
                  reference.maxsim(q96, d96), 1e-5)
        # 128 query rows against runs of whole tiles: 8 warps, TMA copies (the default there) or the threads', masked
        q128, qm128 = torch.randn(1, 128, 128, device=dev, dtype=bf), torch.rand(1, 128, device=dev) > 0.2
        for tma in (True, False):
            with override_forward(DOCS=4, PROGRAMS_PER_SM=0, TMA_DOCS=tma):
                for _ in range(2):
                    got128 = fm.maxsim(q128, runs, qm128, runs_mask)
            check(f"runs of documents, 128 rows on 8 warps {'by TMA' if tma else 'copied by the threads'}", got128,
                  reference.maxsim(q128, runs, qm128, runs_mask), 1e-5)
        qd = fm.quantize(d.detach(), dm)
        # int8 x int8 products, the query quantised in the kernel (the default at d <= 256), then the conversion path
        from flash_maxsim.quantization import queries_as_scored
        check("int8 x int8", fm.maxsim(q.detach(), qd, qm),
              reference.maxsim(queries_as_scored(q.detach(), qd).double(), qd.dequantize(torch.float64), qm, dm), 1e-5)
        with override_forward(INT8_PRODUCTS=False):
            got = fm.maxsim(q.detach(), qd, qm)
        check("int8 converted", got, reference.maxsim(q.detach(), qd.dequantize(torch.float64), qm, dm), 1e-5)
        # 4 documents per program (forced: the default's grid of 8 programs per SM leaves one document per program
        # at this size): the bandwidth-bound
        # grid, and the compute-bound one with the query's tokens split over programs (300 tokens, 3 splits of
        # 128 rows; 11 documents: programs of 4, 4 and 3) at d = 16 (features zero-padded to 32)
        index = fm.quantize(torch.randn(11, 300, 128, device=dev, dtype=bf))
        narrow = fm.quantize(torch.randn(11, 70, 16, device=dev, dtype=bf))
        long_q16 = torch.randn(2, 300, 16, device=dev, dtype=bf)
        # whole 64-token tiles with a mask: the loop over one contiguous run of tokens (FLAT_RUN)
        whole_mask = torch.rand(11, 256, device=dev) > 0.3
        whole = fm.quantize(torch.randn(11, 256, 128, device=dev, dtype=bf), whole_mask)
        with override_forward(DOCS=4, PROGRAMS_PER_SM=0):
            grouped, grouped_split = fm.maxsim(q2[:1], index), fm.maxsim(long_q16, narrow)
            grouped_whole = fm.maxsim(q2[:1], whole)
        check("int8 grouped", grouped,
              reference.maxsim(queries_as_scored(q2[:1], index).double(), index.dequantize(torch.float64)), 1e-5)
        check("int8 grouped, whole tiles", grouped_whole,
              reference.maxsim(queries_as_scored(q2[:1], whole).double(), whole.dequantize(torch.float64), None,
                               whole_mask), 1e-5)
        check("int8 grouped, query split", grouped_split,
              reference.maxsim(queries_as_scored(long_q16, narrow).double(), narrow.dequantize(torch.float64)), 1e-5)
        # the token-rows kernel (the 8-bit streaming default on Hopper, forced into runs of 4 documents here): int8
        # 64-token tiles straddling 300-token documents, masked whole tiles as zero; fp8 128-token tiles straddling
        index8 = fm.quantize(torch.randn(11, 300, 128, device=dev, dtype=bf), dtype="fp8")
        with override_forward(DOCS=4, TOKEN_ROWS_PROGRAMS_PER_SM=0):
            rows_straddling, rows_whole = fm.maxsim(q2[:1], index), fm.maxsim(q2[:1], whole, masked="zero")
            rows_fp8 = fm.maxsim(q2[:1], index8)
        check("int8 token rows, straddling", rows_straddling,
              reference.maxsim(queries_as_scored(q2[:1], index).double(), index.dequantize(torch.float64)), 1e-5)
        check("int8 token rows, whole tiles masked as zero", rows_whole,
              reference.maxsim(queries_as_scored(q2[:1], whole).double(), whole.dequantize(torch.float64), None,
                               whole_mask, masked="zero"), 1e-5)
        check("fp8 token rows, 128-token tiles straddling", rows_fp8,
              reference.maxsim(queries_as_scored(q2[:1], index8).double(), index8.dequantize(torch.float64)), 1e-4)
        # the compute-bound grid's choices (forced at this size): queries quantised before the launch, runs of
        # 128-token tiles (whole, masked, copied by TMA; and straddling documents) with scales and mask loaded a
        # tile ahead, 168 registers
        long_q, long_qm = torch.randn(2, 200, 128, device=dev, dtype=bf), torch.rand(2, 200, device=dev) > 0.2
        compute_grid = dict(DOCS=4, PROGRAMS_PER_SM=0, BLOCK_N=128, QUANTIZE_FIRST=True, PREFETCH_TOKENS=True,
                            MAXNREG=168, TMA_DOCS=True)
        with override_forward(**compute_grid):
            compute_whole, compute_straddling = fm.maxsim(long_q, whole, long_qm), fm.maxsim(long_q, index, long_qm)
        check("int8 compute-bound grid, whole tiles", compute_whole,
              reference.maxsim(queries_as_scored(long_q, whole).double(), whole.dequantize(torch.float64), long_qm,
                               whole_mask), 1e-5)
        check("int8 compute-bound grid, straddling tiles", compute_straddling,
              reference.maxsim(queries_as_scored(long_q, index).double(), index.dequantize(torch.float64), long_qm),
              1e-5)
        # the same grid with the sums read as fp32 bits: the first pass alone (bit for bit the converted sums'), and
        # with its exact second pass (a document against which a query token's every sum is negative)
        negative = torch.randn(11, 300, 128, device=dev, dtype=bf)
        negative[5] = -negative[5].abs()
        neg_q = long_q.clone()
        neg_q[0, 7] = neg_q[0, 7].abs()
        neg_index = fm.quantize(negative)
        with override_forward(**compute_grid, BITCAST_SUMS=True):
            bitcast_whole, bitcast_redo = fm.maxsim(long_q, whole, long_qm), fm.maxsim(neg_q, neg_index, long_qm)
        # and their tile max folded in a fixed chain (CHAINED_MAX)
        with override_forward(**compute_grid, BITCAST_SUMS=True, CHAINED_MAX=True):
            chained_whole = fm.maxsim(long_q, whole, long_qm)
        check("int8 compute-bound grid, bit-cast sums", bitcast_whole, compute_whole.double(), 0.0)
        check("int8 compute-bound grid, bit-cast sums, chained tile max", chained_whole, compute_whole.double(), 0.0)
        check("int8 compute-bound grid, bit-cast sums redone", bitcast_redo,
              reference.maxsim(queries_as_scored(neg_q, neg_index).double(), neg_index.dequantize(torch.float64),
                               long_qm), 1e-5)
        if torch.cuda.get_device_capability() >= (8, 9):
            # fp8 x fp8 products: the query quantised to e4m3 in the kernel, one document per program
            # and runs of documents, and the compute-bound grid (queries quantised before the launch, TMA); the
            # norm-relative tolerance allows for Hopper's fp8 accumulation (docs/semantics.md)
            fp8_index, fp8_whole = fm.quantize(d.detach(), dm, dtype="fp8"), fm.quantize(whole.dequantize(bf),
                                                                                       whole_mask, dtype="fp8")
            check("fp8 x fp8", fm.maxsim(q.detach(), fp8_index, qm),
                  reference.maxsim(queries_as_scored(q.detach(), fp8_index).double(),
                                   fp8_index.dequantize(torch.float64), qm, dm), 1e-3)
            with override_forward(DOCS=4, PROGRAMS_PER_SM=0):
                got = fm.maxsim(q2[:1], fp8_whole)
            check("fp8 grouped, whole tiles", got,
                  reference.maxsim(queries_as_scored(q2[:1], fp8_whole).double(), fp8_whole.dequantize(torch.float64),
                                   None, whole_mask), 1e-3)
            # the streaming grid's one-warp programs with uncapped registers (the fp8 default there): runs whose
            # tiles straddle 300-token documents
            fp8_runs = fm.quantize(index.dequantize(bf), dtype="fp8")
            with override_forward(DOCS=4, PROGRAMS_PER_SM=0, num_warps=1, MAXNREG=0):
                got = fm.maxsim(q2[:1], fp8_runs)
            check("fp8 grouped, one warp per program", got,
                  reference.maxsim(queries_as_scored(q2[:1], fp8_runs).double(), fp8_runs.dequantize(torch.float64)),
                  1e-3)
            with override_forward(**compute_grid, ROW_PARTIALS=8):
                got = fm.maxsim(long_q, fp8_whole, long_qm)
            # its 8 partial maxima per row folded in a fixed chain (CHAINED_MAX): a max in another order
            with override_forward(**compute_grid, ROW_PARTIALS=8, CHAINED_MAX=True):
                chained = fm.maxsim(long_q, fp8_whole, long_qm)
            check("fp8 compute-bound grid, whole tiles", got,
                  reference.maxsim(queries_as_scored(long_q, fp8_whole).double(), fp8_whole.dequantize(torch.float64),
                                   long_qm, whole_mask), 1e-3)
            check("fp8 compute-bound grid, chained partial maxima", chained, got.double(), 0.0)
    torch.cuda.synchronize()
    print("sanitizer case:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
