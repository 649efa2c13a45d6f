"""Kernel developer's round on the GPU: correctness of every kernel variant against the float64 reference, then
forward and training-step timings against eager PyTorch, and optional sweeps of tile variants (kernels/tuning.py's
overrides). One call does a whole round.

    python tools/kernel_check.py [--quick] [--json OUT.json] [--fwd-sweep] [--sweep] [--int8] [--host] ...

Not the published benchmark (that is benchmarks/bench.py, with peers and the roofline). The options that time the
peers import benchmarks/_peers.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

import flash_maxsim as fm
from flash_maxsim import reference
from flash_maxsim.kernels import tuning

# the peers' adapters (benchmarks/_peers.py), for the options that time them
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_case(name, q, d, qm, dm, masked, tau, tol, grad=True):
    q = q.detach().requires_grad_(grad)
    dd = d if isinstance(d, list) else d.detach().requires_grad_(grad)
    out = fm.maxsim(q, dd, qm, dm, masked=masked, smooth_tau=tau)
    q64 = q.detach().double().requires_grad_(grad)
    d64 = [x.detach().double() for x in d] if isinstance(d, list) else d.detach().double().requires_grad_(grad)
    # the reference takes float64 through its own code path (it never calls the kernels)
    ref = reference.maxsim(q64, d64, qm, dm, masked=masked, smooth_tau=tau)
    errs = {"fwd": rel_err(out, ref)}
    if grad and not isinstance(d, list):
        g = torch.randn_like(out)
        (out * g).sum().backward()
        (ref * g.double()).sum().backward()
        errs["dq"] = rel_err(q.grad, q64.grad)
        errs["dd"] = rel_err(dd.grad, d64.grad)
    ok = all(v <= tol for v in errs.values())
    print(f"{'ok ' if ok else 'BAD'} {name:60s} " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()), flush=True)
    return ok


def correctness(dev, full):
    torch.manual_seed(0)
    oks = []
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 5e-5}
    torch.set_float32_matmul_precision("highest")
    shapes = ((3, 5, 32, 300, 128), (2, 3, 1, 17, 96), (4, 6, 20, 70, 64), (1, 2, 1024, 257, 128),
              (2, 3, 13, 40, 384), (2, 2, 7, 33, 1024), (2, 40, 32, 50, 128), (16, 32, 32, 3000, 128))
    if not full:
        shapes = shapes[:1] + shapes[6:7]
    for dt in ((torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,)):
        for masked in ("exclude", "zero"):
            for tau in (None, 0.1):
                for (Nq, B, Lq, Ld, d) in shapes:
                    q = torch.randn(Nq, Lq, d, device=dev, dtype=dt)
                    docs = torch.randn(B, Ld, d, device=dev, dtype=dt)
                    qm = torch.rand(Nq, Lq, device=dev) > 0.2
                    dm = torch.rand(B, Ld, device=dev) > 0.3
                    dm[0] = False
                    oks.append(check_case(f"{dt} {masked} tau={tau} inbatch {Nq}x{B} {Lq}x{Ld} d={d}",
                                          q, docs, qm, dm, masked, tau, tol[dt]))
                K = 3
                q = torch.randn(4, 24, 128, device=dev, dtype=dt)
                docs = torch.randn(4, K, 90, 128, device=dev, dtype=dt)
                dm = torch.rand(4, K, 90, device=dev) > 0.3
                oks.append(check_case(f"{dt} {masked} tau=None paired 4x{K}", q, docs, None, dm, masked, None,
                                      tol[dt]))
                oks.append(check_case(f"{dt} {masked} tau=0.1 paired 4x{K}", q, docs, None, dm, masked, 0.1, tol[dt]))
                ragged = [torch.randn(n, 128, device=dev, dtype=dt) for n in (5, 300, 0, 77, 1)]
                oks.append(check_case(f"{dt} {masked} ragged list", q, ragged, None, None, masked, None, tol[dt]))
                packed = fm.pack([torch.randn(n, 96, device=dev, dtype=dt) for n in (65, 3, 129)])
                vals = packed.values.detach().requires_grad_()
                qq = torch.randn(3, 9, 96, device=dev, dtype=dt, requires_grad=True)
                out = fm.maxsim(qq, fm.PackedDocuments(vals, packed.offsets, packed.max_length), masked=masked,
                                smooth_tau=0.2)
                ref_in = fm.PackedDocuments(vals.detach().double().requires_grad_(), packed.offsets)
                q64 = qq.detach().double().requires_grad_()
                ref = reference.maxsim(q64, (ref_in.values, ref_in.offsets), masked=masked, smooth_tau=0.2)
                g = torch.randn_like(out)
                (out * g).sum().backward(); (ref * g.double()).sum().backward()
                e = (rel_err(out, ref), rel_err(qq.grad, q64.grad), rel_err(vals.grad, ref_in.values.grad))
                ok = max(e) <= tol[dt]
                print(f"{'ok ' if ok else 'BAD'} {str(dt) + ' ' + masked + ' packed smooth':60s} fwd={e[0]:.1e} "
                      f"dq={e[1]:.1e} dd={e[2]:.1e}")
                oks.append(ok)
    torch.set_float32_matmul_precision("highest")
    return all(oks)


def bench(fn, reps=50):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")


def peak_mb(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


FORWARD_SHAPES = [  # (Nq, B, Lq, Ld, d)
    (1, 1000, 32, 300, 128), (1, 10000, 32, 300, 128), (1, 1000, 32, 1024, 128), (1, 10000, 32, 1030, 128),
    (1, 1000, 128, 1024, 128), (1, 1000, 512, 1024, 128), (1, 1000, 1024, 1024, 128),
    (1, 10000, 1024, 1024, 128), (64, 1000, 32, 300, 128), (16, 32, 32, 8192, 128), (1, 10000, 32, 180, 384),
    (1, 5000, 31, 257, 96),
]


# forward tile variants (tuning.override_forward's fields), each against the default ({})
SWEEP = [{}, {"num_warps": 8}, {"BLOCK_N": 128}, {"BLOCK_N": 32}, {"num_stages": 3}, {"num_stages": 4},
         {"BLOCK_N": 128, "num_warps": 8}, {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
         {"ROWS": 256, "num_warps": 8}, {"ROWS": 256, "BLOCK_N": 128, "num_warps": 8}, {"ROWS": 64},
         {"PEEL_TAIL": False}, {"ROWS": 256, "num_warps": 8, "PEEL_TAIL": False}]


def forward_sweep(fn, variants):
    """(median ms, variant) of ``fn`` under each forward override variant; one that does not compile or fit is
    recorded as inf with its error instead of stopping the sweep."""
    res = []
    for v in variants:
        with tuning.override_forward(**v):
            try:
                res.append((bench(fn), v))
            except Exception as e:
                res.append((float("inf"), {**v, "error": type(e).__name__}))
    return res


def _variant(variant):
    """A context of the forward and backward overrides of ``variant`` ({"fwd": {...}, "bwd": {...}}; None: none)."""
    stack = contextlib.ExitStack()
    stack.enter_context(tuning.override_forward(**(variant or {}).get("fwd", {})))
    stack.enter_context(tuning.override_backward(**(variant or {}).get("bwd", {})))
    return stack


BANDWIDTH_ROWS = [(1, 1000, 32, 300, 128), (1, 10000, 32, 300, 128), (1, 10000, 32, 1030, 128),
                  (1, 1000, 32, 1024, 128), (1, 10000, 32, 180, 384), (1, 5000, 31, 257, 96)]
# one query streaming many documents: documents per program; tiles, warps and stages; warps alone
BANDWIDTH_SWEEP = [{}, {"DOCS": 2}, {"DOCS": 4}]
BANDWIDTH_SWEEP_WIDE = BANDWIDTH_SWEEP + [
    {"num_warps": 2}, {"BLOCK_N": 32}, {"BLOCK_N": 32, "num_warps": 2},
    {"BLOCK_N": 32, "num_stages": 4}, {"BLOCK_N": 32, "num_warps": 2, "num_stages": 4}, {"num_stages": 4},
    {"num_stages": 2}, {"BLOCK_N": 128}, {"BLOCK_N": 128, "num_warps": 8}, {"PEEL_TAIL": True}]
BANDWIDTH_SWEEP_WARPS = [{"num_warps": 4}, {"num_warps": 2}, {"num_warps": 2, "num_stages": 4},
                         {"num_warps": 2, "BLOCK_N": 32}, {"num_warps": 2, "DOCS": 2}]
BANDWIDTH_VARIANTS = {"default": BANDWIDTH_SWEEP, "wide": BANDWIDTH_SWEEP_WIDE, "warps": BANDWIDTH_SWEEP_WARPS}


def bandwidth_rows(dev, rounds=3, only="", variants="default"):
    """The one-query, bandwidth-bound rows: tile variants and both peers' forward, timed in interleaved rounds so
    that clock drift hits every entry alike; median of the rounds' medians."""
    import statistics

    from _peers import PEER_KEYS, load_peers
    peers, _ = load_peers(PEER_KEYS)
    variants = BANDWIDTH_VARIANTS[variants]
    for Nq, B, Lq, Ld, d in BANDWIDTH_ROWS:
        if only and only != f"{Lq}x{Ld}":
            continue
        q = torch.randn(Nq, Lq, d, device=dev, dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, d, device=dev, dtype=torch.bfloat16)
        # right padding, as real batches have: what a per-tile mask load costs on top of the vectors
        lengths = torch.randint(Ld // 2, Ld + 1, (B, 1), device=dev)
        mask = torch.arange(Ld, device=dev)[None, :] < lengths
        entries = {}
        for _ in range(rounds):
            for t, v in forward_sweep(lambda: fm.maxsim(q, docs), variants):
                entries.setdefault(f"ours {v}", []).append(t)
            for t, v in forward_sweep(lambda: fm.maxsim(q, docs, documents_mask=mask), variants):
                entries.setdefault(f"ours masked {v}", []).append(t)
            for peer in peers:
                for name, fn in peer.forward_variants(q, docs):
                    entries.setdefault(f"{peer.label} {name}", []).append(bench(lambda: fn(q, docs)))
        floor = (q.numel() + docs.numel()) * 2 / 4.2e12 * 1e3
        ranked = sorted((statistics.median(v), k) for k, v in entries.items())
        print(f"bandwidth {Nq}x{B} {Lq}x{Ld} d={d} (floor at 4.2 TB/s {floor:.3f} ms): "
              + "  ".join(f"{t:.4f}:{k}" for t, k in ranked), flush=True)
        del q, docs


# grids sized to PROGRAMS_PER_SM programs per SM, each scoring an equal share of the documents in one loop
# (persistent-style), on every forward row and the int8 rows
PERSIST_SWEEP = [{}, {"PROGRAMS_PER_SM": 1}, {"PROGRAMS_PER_SM": 2}, {"PROGRAMS_PER_SM": 4},
                 {"PROGRAMS_PER_SM": 8}, {"PROGRAMS_PER_SM": 16}]
INT8_ROWS = [(1, 10000, 32, 300), (1, 10000, 32, 1030), (1, 10000, 1024, 1024)]


# the int8 grids: tiles, warps, stages, grid sizes
INT8_TILE_SWEEP = [{}, {"PROGRAMS_PER_SM": 6}, {"PROGRAMS_PER_SM": 12}, {"PROGRAMS_PER_SM": 32}, {"num_stages": 2},
                   {"num_stages": 4}, {"BLOCK_N": 64}, {"BLOCK_N": 128}, {"num_warps": 4}, {"num_warps": 8},
                   {"ROWS": 64, "BLOCK_N": 128, "PROGRAMS_PER_SM": 16}]


def persist_rows(dev, rounds=3, variants=None, int8_only=False):
    """``variants`` (PERSIST_SWEEP) on every forward row (bf16) and the int8 rows, interleaved round by round;
    medians."""
    import statistics
    variants = variants or PERSIST_SWEEP
    cases = []
    for Nq, B, Lq, Ld, d in ([] if int8_only else FORWARD_SHAPES):
        q = torch.randn(Nq, Lq, d, device=dev, dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, d, device=dev, dtype=torch.bfloat16)
        cases.append((f"bf16 {Nq}x{B} {Lq}x{Ld} d={d}", lambda q=q, docs=docs: fm.maxsim(q, docs)))
    for Nq, B, Lq, Ld in INT8_ROWS:
        q = torch.randn(Nq, Lq, 128, device=dev, dtype=torch.bfloat16)
        index = fm.quantize(torch.randn(B, Ld, 128, device=dev, dtype=torch.bfloat16))
        cases.append((f"int8 {Nq}x{B} {Lq}x{Ld}", lambda q=q, index=index: fm.maxsim(q, index)))
    for name, fn in cases:
        times = {}
        for _ in range(rounds):
            for t, v in forward_sweep(fn, variants):
                times.setdefault(str(v), []).append(t)
        ranked = sorted((statistics.median(v), k) for k, v in times.items())
        print(f"persist {name}: " + "  ".join(f"{t:.4f}:{k}" for t, k in ranked), flush=True)


def forward_table(dev, quick, sweep):
    rows = []
    for Nq, B, Lq, Ld, d in FORWARD_SHAPES:
        q = torch.randn(Nq, Lq, d, device=dev, dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, d, device=dev, dtype=torch.bfloat16)
        if sweep:
            variants = SWEEP + ([{"BLOCK_D": 512, "D_CHUNKS": 1, "BLOCK_N": 32},
                                 {"BLOCK_D": 512, "D_CHUNKS": 1, "BLOCK_N": 16}] if d > 256 else [])
            res = forward_sweep(lambda: fm.maxsim(q, docs), variants)
            print(f"sweep {Nq}x{B} {Lq}x{Ld} d={d}: "
                  + "  ".join(f"{t:.3f}:{v}" for t, v in sorted(res, key=lambda r: r[0])[:4]), flush=True)
        ours = bench(lambda: fm.maxsim(q, docs))
        sim_bytes = Nq * B * Lq * Ld * 2
        eager = bench(lambda: torch.einsum("qid,bjd->qbij", q, docs).amax(-1).sum(-1)) \
            if sim_bytes < 24e9 and not quick else float("nan")
        flops = 2 * Nq * B * Lq * Ld * d
        nbytes = (q.numel() + docs.numel()) * 2
        rows.append(dict(shape=f"{Nq}x{B} {Lq}x{Ld} d={d}", ours_ms=ours, eager_ms=eager,
                         tflops=flops / ours / 1e9, tbps=nbytes / ours / 1e9))
        r = rows[-1]
        print(f"{r['shape']:28s} ours {ours:8.3f} ms  eager {eager:8.3f} ms  {r['tflops']:6.1f} TFLOP/s  "
              f"{r['tbps']:5.2f} TB/s", flush=True)
        del q, docs
    return rows


# training-step variants ({"fwd": forward overrides, "bwd": backward overrides}): dQ and dD in one launch or two,
# its stages, no dQ column split; the binned dD's stages and blocks; the smooth max's tiles loaded twice
# (RELOAD_TILE); the arg-max forward's tiles
TRAIN_SWEEP = [{}, {"bwd": {"DD_METHOD": "dense"}}, {"bwd": {"DD_METHOD": "dense", "FUSED": False}},
               {"bwd": {"DD_METHOD": "dense", "FUSED_STAGES": 2}}, {"bwd": {"DQ_PARTIAL_BYTES": 0}},
               {"bwd": {"DD_METHOD": "binned"}}, {"bwd": {"DD_METHOD": "binned", "DD_STAGES": 2}},
               {"bwd": {"DD_METHOD": "binned", "DD_BLOCK_N": 128, "DD_WARPS": 8}},
               {"bwd": {"RELOAD_TILE": True}},
               {"fwd": {"num_stages": 3}}, {"fwd": {"ROWS": 256, "num_warps": 8}}, {"fwd": {"num_warps": 8}},
               {"fwd": {"BLOCK_N": 128}}]


def training_problem(dev, Nq, B, Lq, Ld, K):
    """bf16 leaves (queries [Nq, Lq, 128]; documents [B, Ld, 128], or [Nq, K, Ld, 128] per-query candidates when K)
    and the step's loss of the scores: in-batch cross-entropy, or KL to a random teacher for candidates."""
    q = torch.randn(Nq, Lq, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    docs = torch.randn(*((Nq, K, Ld, 128) if K else (B, Ld, 128)), device=dev, dtype=torch.bfloat16,
                       requires_grad=True)
    labels = torch.arange(Nq, device=dev) % B
    target = torch.softmax(torch.randn(Nq, K or B, device=dev), -1)

    def loss_of(scores):
        if K:
            return torch.nn.functional.kl_div(torch.log_softmax(scores, -1), target, reduction="batchmean")
        return torch.nn.functional.cross_entropy(scores, labels)
    return q, docs, loss_of


def train_table(dev, sweep=False, only=""):
    from flash_maxsim.kernels import launch
    rows = []
    cases = [("colbert inbatch B128 32x300", 128, 128, 32, 300, None, 0),
             ("colbert B64+7neg 32x300", 64, 512, 32, 300, None, 0),
             ("colpali inbatch B64 32x1030", 64, 64, 32, 1030, None, 0),
             ("colpali inbatch B256 32x1030", 256, 256, 32, 1030, None, 0),
             ("colpali smooth B128 32x1030", 128, 128, 32, 1030, 0.1, 0),
             ("KD 64q x 64cand 32x300", 64, 64, 32, 300, None, 64)]
    wanted = [w for w in only.split(",") if w]
    for name, Nq, B, Lq, Ld, tau, K in cases:
        if wanted and not any(w in name for w in wanted):
            continue
        q, docs, loss_of = training_problem(dev, Nq, B, Lq, Ld, K)

        def ours():
            loss_of(fm.maxsim(q, docs, smooth_tau=tau)).backward()

        def eager():
            if K:
                s = torch.einsum("qid,qkjd->qkij", q, docs)
            else:
                s = torch.einsum("qid,bjd->qbij", q, docs)
            agg = s.amax(-1) if tau is None else tau * torch.logsumexp(s.float() / tau, -1)
            loss_of(agg.float().sum(-1)).backward()

        if sweep:
            # the dD launch alone too (small steps are host-bound: their step time hides the kernel's)
            from flash_maxsim import _layout
            p = _layout.canonicalize(q.detach(), docs.detach(), smooth_tau=tau)
            _, aux = launch.forward(p.queries, p.documents, None, None, None, p.candidates, False, tau, True,
                                    p.max_length)
            g = torch.randn(Nq, K or B, device=dev)

            def dd_only():
                launch.backward(g, p.queries, p.documents, None, None, None, p.max_length, aux, p.candidates, tau,
                                False, True)

            def backward_only():
                launch.backward(g, p.queries, p.documents, None, None, None, p.max_length, aux, p.candidates, tau,
                                True, True)
            res = []
            for v in TRAIN_SWEEP:
                with _variant(v):
                    res.append((bench(ours), peak_mb(ours), bench(dd_only), bench(backward_only), v))
            print(f"train-sweep {name}: " + "  ".join(f"step {t:.3f}ms/{m:.0f}MB dD {dd:.3f}ms bwd {bw:.3f}ms:{v}"
                                                      for t, m, dd, bw, v in res), flush=True)
            del aux
        row = dict(case=name, ours_ms=bench(ours), ours_mb=peak_mb(ours))
        try:
            row["eager_ms"], row["eager_mb"] = bench(eager), peak_mb(eager)
        except torch.OutOfMemoryError:
            row["eager_ms"] = row["eager_mb"] = float("nan")
        q.grad = None
        docs.grad = None
        rows.append(row)
        print(f"{name:32s} ours {row['ours_ms']:7.3f} ms {row['ours_mb']:8.1f} MB   eager {row['eager_ms']:7.3f} ms "
              f"{row['eager_mb']:9.1f} MB", flush=True)
        del q, docs
        torch.cuda.empty_cache()
    return rows


TRAIN_AB = [{}, {"bwd": {"FUSED": False}}, {"bwd": {"FUSED": True}},
            {"bwd": {"FUSED": True, "DQ_PARTIAL_BYTES": 0}}, {"bwd": {"DD_METHOD": "binned"}}]
# the forward that saves the arg-max for the backward: 256-row programs on 8 warps (what the compute-bound
# inference rows use), 3 stages
TRAIN_AB_FWD = [{}, {"fwd": {"ROWS": 256, "num_warps": 8}}, {"fwd": {"num_stages": 3}},
                {"fwd": {"ROWS": 256, "num_warps": 8, "num_stages": 3}}, {"fwd": {"num_warps": 8}}]


def train_ab(dev, rounds=7, variants=None):
    """The small (host-bound) training steps, ours under each variant (TRAIN_AB: {"fwd": forward overrides, "bwd":
    backward overrides}) and both peers', interleaved round by round so that the host's drift hits all alike;
    medians. Each variant's scores and gradients are compared with the default's first."""
    import statistics
    from _peers import PEER_KEYS, load_peers
    variants = TRAIN_AB if variants is None else variants
    peers = load_peers(PEER_KEYS)[0]
    for name, Nq, B, Ld, K in (("colbert B128 32x300", 128, 128, 300, 0), ("colpali B64 32x1030", 64, 64, 1030, 0),
                               ("colbert B64+7neg 32x300", 64, 512, 300, 0), ("KD 64x64 32x300", 64, 64, 300, 64)):
        q, docs, loss_of = training_problem(dev, Nq, B, 32, Ld, K)
        # label -> (our overrides, or None for a peer; the step)
        steps = {f"ours {v}": (v, lambda: loss_of(fm.maxsim(q, docs)).backward()) for v in variants}
        for peer in peers:
            fn = peer.train_scores("kd" if K else "in-batch", None)
            if fn is not None:
                steps[peer.label] = (None, lambda fn=fn: loss_of(fn(q, docs)).backward())
        first = None
        for label, (variant, _) in steps.items():
            if variant is None:
                continue
            q.grad = docs.grad = None
            with _variant(variant):
                s = fm.maxsim(q, docs)
                loss_of(s).backward()
            out = (s.detach().float(), q.grad.float(), docs.grad.float())
            s = None        # a live autograd graph keeps the leaves' AccumulateGrad nodes, which breaks a capture
            first = first or out
            print(f"train-check {name} {label}: max |d scores| {float((out[0] - first[0]).abs().max()):.2e}, "
                  f"max |d grads| {max(float((a - b).abs().max()) for a, b in zip(out[1:], first[1:])):.2e}",
                  flush=True)
        q.grad = docs.grad = None
        times = {k: [] for k in steps}
        for _ in range(rounds):
            for label, (variant, fn) in steps.items():
                with _variant(variant):
                    times[label].append(bench(fn))
        # every step (ours under each variant, the peers') captured in a CUDA graph and replayed: the GPU's time
        # without the host's launches
        from ab_backward import graphed   # a sibling tool: warm-up on a side stream, then capture
        replays = {}
        for label, (variant, fn) in steps.items():
            try:
                with _variant(variant):
                    graph = graphed(fn)
                replays[label] = bench(graph.replay)
            except Exception as exc:     # a peer whose step does not capture: say so
                replays[label] = f"no graph ({type(exc).__name__})"
            q.grad = docs.grad = None
        print(f"train-graph {name}: " + "  ".join(f"{v if isinstance(v, str) else f'{v:.3f}'}:{k}"
                                                  for k, v in replays.items()), flush=True)
        print(f"train-ab {name}: " + "  ".join(f"{statistics.median(t):.3f}:{k}" for k, t in times.items()),
              flush=True)
        del q, docs


FP32_SWEEP = [{}, {"BLOCK_D": 128, "D_CHUNKS": 1, "num_warps": 4, "num_stages": 3},
              {"num_warps": 4}, {"BLOCK_D": 16, "D_CHUNKS": 8}, {"BLOCK_N": 32}, {"ROWS": 64},
              {"BLOCK_N": 32, "ROWS": 64, "num_warps": 4}, {"PRECISION": "tf32x3"}]


def fp32_table(dev):
    """fp32 inputs at float32_matmul_precision("highest") (CUDA-core products): tile choices against PyTorch."""
    torch.set_float32_matmul_precision("highest")
    for Nq, B, Lq, Ld, d in [(64, 512, 32, 180, 128), (1, 20000, 32, 166, 128), (8, 64, 32, 300, 96)]:
        q = torch.randn(Nq, Lq, d, device=dev)
        docs = torch.randn(B, Ld, d, device=dev)
        eager = bench(lambda: torch.einsum("qid,bjd->qbij", q, docs).amax(-1).sum(-1))
        res = forward_sweep(lambda: fm.maxsim(q, docs), FP32_SWEEP)
        print(f"fp32 {Nq}x{B} {Lq}x{Ld} d={d}: torch {eager:.3f} ms; " + "  ".join(f"{t:.3f}:{v}" for t, v in res),
              flush=True)


# the int8 documents converted to the queries' dtype in registers instead of int8 x int8 products
_CONVERT = {"INT8_PRODUCTS": False}
# a fixed number of documents per program instead of PROGRAMS_PER_SM's grid
_FIXED = {"PROGRAMS_PER_SM": 0}
INT8_SWEEP = [{}, _CONVERT, {**_CONVERT, "BLOCK_N": 128, "num_stages": 4},
              {**_FIXED, "DOCS": 1}, {**_FIXED, "DOCS": 2}, {"ROWS": 256, "num_warps": 8}, {"BLOCK_N": 64},
              {"num_stages": 4},
              {"num_warps": 2}, {**_FIXED, "num_warps": 2, "DOCS": 1}, {**_FIXED, "num_warps": 2, "DOCS": 2},
              {**_FIXED, "DOCS": 4}, {**_FIXED, "DOCS": 2, "num_stages": 4}, {**_FIXED, "DOCS": 2, "num_warps": 8}]


def compiled_report(kernel, names=("QUANTIZE_Q", "HAS_SCALES", "HAS_DMASK", "TOKB", "QPB", "BLOCK_N", "MULTI_DOC")):
    """What the compiler made of each specialisation of ``kernel`` compiled so far: registers, spills, and which
    tensor-core instructions its PTX uses (Hopper's asynchronous wgmma or the older synchronous mma)."""
    from flash_maxsim.kernels.direct_launch import compiled_kernels
    for ck in compiled_kernels(kernel):
        try:
            ptx = ck.asm.get("ptx", "")
            consts = getattr(ck.src, "constants", {})
            named = {kernel.arg_names[k[0] if isinstance(k, tuple) else k]: v for k, v in consts.items()}
            named = {k: v for k, v in named.items() if k in names}
            md = ck.metadata
            print(f"compiled {named} warps={md.num_warps} stages={md.num_stages} regs={ck.n_regs} "
                  f"spills={ck.n_spills} wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')}",
                  flush=True)
        except Exception as exc:      # another Triton's internals: say so, keep going
            print(f"compiled: no report ({type(exc).__name__}: {exc})", flush=True)


def int8_table(dev):
    """The compressed index (int8 documents, bf16 queries): tile choices on the int8 rows, with the bytes floor;
    the default quantises the query in the kernel and multiplies int8 x int8, INT8_PRODUCTS=False converts."""
    for Nq, B, Lq, Ld in INT8_ROWS:
        q = torch.randn(Nq, Lq, 128, device=dev, dtype=torch.bfloat16)
        index = fm.quantize(torch.randn(B, Ld, 128, device=dev, dtype=torch.bfloat16))
        res = forward_sweep(lambda: fm.maxsim(q, index), INT8_SWEEP)
        floor_ms = index.nbytes / 4.2e12 * 1e3
        print(f"int8 {Nq}x{B} {Lq}x{Ld}: bytes floor {floor_ms:.3f} ms; "
              + "  ".join(f"{t:.3f}:{v}" for t, v in sorted(res, key=lambda r: r[0])), flush=True)
        del q, index


def per_call_us(fn, n=300) -> float:
    """Microseconds of host time per call of ``fn``: ``n`` calls enqueued back to back after a warm-up, timed
    without a sync inside the loop (fewer calls than the launch queue holds, so the host never waits for the
    GPU when the GPU keeps up; tools/ab_forward.py uses it too)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def host_table(dev):
    """Host time per call (Python + launches; no synchronisation inside the loop) next to GPU time (do_bench),
    for the small calls that are launch-bound: what a cached launch plan can still save."""
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch
    q = torch.randn(1, 32, 128, device=dev, dtype=torch.bfloat16)
    docs = torch.randn(1000, 300, 128, device=dev, dtype=torch.bfloat16)
    p = _layout.canonicalize(q, docs)
    rows = {
        "maxsim 1x1k 32x300": (lambda: fm.maxsim(q, docs)),
        "canonicalize": (lambda: _layout.canonicalize(q, docs)),
        "launch.forward": (lambda: launch.forward(p.queries, p.documents, None, None, None, 0, False, None, False,
                                                  300)),
        "torch.empty": (lambda: torch.empty((1, 1000), device=dev)),
        "einsum amax sum (eager)": (lambda: torch.einsum("qid,bjd->qbij", q, docs).amax(-1).sum(-1)),
    }
    try:
        from _peers import PEER_KEYS, load_peers
        for peer in load_peers(PEER_KEYS)[0]:
            for name, fn in peer.forward_variants(q, docs):
                rows[f"{peer.label} {name}"] = (lambda fn=fn: fn(q, docs))
    except Exception as exc:       # peers not installed: ours only
        print(f"host: no peers ({type(exc).__name__}: {exc})")
    for name, fn in rows.items():
        print(f"host {name:28s} {per_call_us(fn):7.1f} us/call host, {bench(fn) * 1e3:7.1f} us do_bench", flush=True)
    # the GPU time alone: the same call captured in a CUDA graph and replayed (no Python, no launch overhead)
    for name in ("maxsim 1x1k 32x300", *[k for k in rows if k.startswith(("late", "flash-maxsim"))]):
        try:
            graph = torch.cuda.CUDAGraph()
            rows[name]()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                rows[name]()
            print(f"host {name + ' (graph)':28s} {bench(graph.replay) * 1e3:7.1f} us do_bench", flush=True)
        except Exception as exc:
            print(f"host {name}: no CUDA graph ({type(exc).__name__})", flush=True)
    qt = torch.randn(128, 32, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dt = torch.randn(128, 300, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.arange(128, device=dev)

    def step():
        torch.nn.functional.cross_entropy(fm.maxsim(qt, dt), labels).backward()
    print(f"host {'train step B128 32x300':28s} {per_call_us(step, 100):7.1f} us/call host, "
          f"{bench(step) * 1e3:7.1f} us do_bench", flush=True)
    # where a small step's host time goes: the loss alone, our scores' forward + backward alone, the peers' steps
    leaf = torch.randn(128, 128, device=dev, requires_grad=True)
    grad_scores = torch.randn(128, 128, device=dev)
    parts = {"loss alone (CE fwd+bwd)": lambda: torch.nn.functional.cross_entropy(leaf, labels).backward(),
             "maxsim fwd+bwd, no loss": lambda: fm.maxsim(qt, dt).backward(grad_scores),
             "maxsim fwd, grad enabled": lambda: fm.maxsim(qt, dt)}
    try:
        from _peers import PEER_KEYS, load_peers
        for peer in load_peers(PEER_KEYS)[0]:
            scores_fn = peer.train_scores("in-batch", None)
            if scores_fn is not None:
                parts[f"{peer.label} train step"] = (lambda fn=scores_fn: torch.nn.functional.cross_entropy(
                    fn(qt, dt), labels).backward())
    except Exception as exc:
        print(f"host: no peer steps ({type(exc).__name__}: {exc})")
    for name, fn in parts.items():
        print(f"host {name:28s} {per_call_us(fn, 100):7.1f} us/call host, {bench(fn) * 1e3:7.1f} us do_bench",
              flush=True)
    # a host synchronisation inside a step would make its host time the GPU's: name any
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    caught = [w for w in caught if "prototype" not in str(w.message)]     # the mode's own notice
    print(f"host syncs in one training step: {len(caught)}" + "".join(f"\n  {w.message}" for w in caught[:5]))
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        parts["maxsim fwd+bwd, no loss"]()
    torch.cuda.synchronize()
    prof.disable()
    print("host profile of 50 forward + backward calls, no loss (B128 32x300), by cumulative time:")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    prof.disable()
    print("host profile of 50 training steps (B128 32x300):")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(22)


def profile_steps(dev):
    from torch.profiler import ProfilerActivity, profile
    for name, Nq, B, Ld, tau in (("colpali B256", 256, 256, 1030, None), ("smooth B128", 128, 128, 1030, 0.1),
                                 ("colbert B128", 128, 128, 300, None), ("colpali B64", 64, 64, 1030, None)):
        q, docs, loss_of = training_problem(dev, Nq, B, 32, Ld, 0)

        def step():
            loss_of(fm.maxsim(q, docs, smooth_tau=tau)).backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / 5 / 1e3
        launches = sum(e.count for e in events if e.self_device_time_total > 0) / 5
        step_ms = bench(step)
        # a step slower than its kernels' sum is host-bound (launch gaps), not GPU-bound
        print(f"--- {name} (5 steps): step {step_ms:.3f} ms, kernels {gpu_ms:.3f} ms in {launches:.0f} launches")
        print(events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--full", action="store_true", help="every dtype and shape in the correctness round")
    ap.add_argument("--sweep", action="store_true", help="try backward/forward variants per training shape")
    ap.add_argument("--fwd-sweep", action="store_true", help="try tile configurations per forward shape")
    ap.add_argument("--profile", action="store_true", help="kernel time breakdown of two training steps")
    ap.add_argument("--host", action="store_true", help="host time per call of small launch-bound calls")
    ap.add_argument("--train-ab", nargs="?", const="bwd", choices=("bwd", "fwd"),
                    help="small training steps: our variants (TRAIN_AB: backward; TRAIN_AB_FWD: the forward that "
                         "saves the arg-max) and the peers, interleaved")
    ap.add_argument("--no-train", action="store_true", help="skip the training table")
    ap.add_argument("--train-only", default="", help="only the training cases whose name contains one of these "
                    "comma-separated texts (e.g. 'B256,B64 32x1030')")
    ap.add_argument("--fp32", action="store_true", help="fp32 ('highest' precision) tile choices against PyTorch")
    ap.add_argument("--no-forward", action="store_true", help="skip the forward table")
    ap.add_argument("--int8", action="store_true", help="int8-index tile choices")
    ap.add_argument("--persist", action="store_true", help="PERSIST_SWEEP on every forward row and the int8 rows")
    ap.add_argument("--int8-tiles", action="store_true", help="INT8_TILE_SWEEP on the int8 rows")
    ap.add_argument("--bandwidth", action="store_true",
                    help="one-query bandwidth-bound rows: tile variants against both peers, interleaved")
    ap.add_argument("--bandwidth-only", default="", help="with --bandwidth: only this row, as LqxLd (e.g. 32x1030)")
    ap.add_argument("--bandwidth-variants", choices=sorted(BANDWIDTH_VARIANTS), default="default",
                    help="with --bandwidth: which tile variants")
    args = ap.parse_args()
    dev = "cuda"
    t0 = time.time()
    ok = True if args.skip_correctness else correctness(dev, args.full)
    print(f"correctness: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f}s)", flush=True)
    torch.set_float32_matmul_precision("highest")
    if args.host:
        host_table(dev)
    if args.train_ab:
        train_ab(dev, variants=TRAIN_AB_FWD if args.train_ab == "fwd" else TRAIN_AB)
    if args.int8:
        int8_table(dev)
        from flash_maxsim.kernels.forward import maxsim_fwd_kernel
        compiled_report(maxsim_fwd_kernel)
    if args.persist:
        persist_rows(dev)
    if args.int8_tiles:
        persist_rows(dev, variants=INT8_TILE_SWEEP, int8_only=True)
    if args.fp32:
        fp32_table(dev)
    if args.bandwidth:
        bandwidth_rows(dev, only=args.bandwidth_only, variants=args.bandwidth_variants)
        torch.set_float32_matmul_precision("highest")
    fwd = [] if args.no_forward else forward_table(dev, args.quick, args.fwd_sweep)
    trn = [] if args.no_train else train_table(dev, args.sweep, args.train_only)
    if args.profile:
        profile_steps(dev)
    if args.json:
        json.dump(dict(correct=ok, forward=fwd, training=trn, device=torch.cuda.get_device_name()),
                  open(args.json, "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
