"""A/B of the hard-max backward kernels against a baseline copy of them, in one process: the benchmark's hard-max
training rows (ColBERT in-batch B128 and B64 + 7 negatives, ColPali B64 and B256, KD 64 x 64 candidates), the
baseline's backward, this checkout's default and override variants of it timed in interleaved rounds (so that clock
drift hits every entry alike); medians of the rounds' medians. Each entry is the backward alone
(``kernels.launch.backward`` on one saved arg-max and upstream gradient), both gradients unless its label says
``dQ`` or ``dD``; with ``--graph`` captured in a CUDA graph and replayed (the GPU's time, without the host's
launches, as the benchmark's "GPU time" of a step).

    python tools/ab_forward.py --extract HEAD .ab/base              # .ab is git-ignored
    python tools/ab_backward.py --base .ab/base --graph [--rows B64] [--variants 0,3]

The variants are ``kernels.tuning.override_backward`` fields. Each entry's gradients are checked against the
baseline's first, outside the timed call (relative to their largest magnitude: 1e-2, a few units of bf16 rounding,
since the kernels sum in other orders). Not the published benchmark (benchmarks/bench.py times whole training steps
with the peers).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, Nq, documents, Lq, Ld, candidates per query or 0 for in-batch)
ROWS = [("ColBERT in-batch B128 32x300", 128, 128, 32, 300, 0),
        ("ColBERT B64 + 7 negatives 32x300", 64, 512, 32, 300, 0),
        ("ColPali in-batch B64 32x1030", 64, 64, 32, 1030, 0),
        ("ColPali in-batch B256 32x1030", 256, 256, 32, 1030, 0),
        ("KD 64 x 64 candidates 32x300", 64, 64, 32, 300, 64)]

# the hard-max dQ as a gather of DQ_ROWS x DQ_COLS document rows per step (its tile, warps, stages); the dD binned
# by token block inside its block programs (warps, 128-token blocks, 32-entry chunks, 2 stages, register caps); both;
# the dense dD beside the gather in separate launches
_G = {"DQ_METHOD": "gather"}
_B = {"DD_METHOD": "binned"}
VARIANTS = [_G, {**_G, "DQ_STAGES": 2}, {**_G, "DQ_ROWS": 2}, {**_G, "DQ_ROWS": 16}, {**_G, "DQ_WARPS": 8},
            {**_G, "DQ_ROWS": 16, "DQ_COLS": 8, "DQ_WARPS": 8}, {**_G, "DQ_ROWS": 8, "DQ_COLS": 16, "DQ_WARPS": 8},
            _B, {**_B, "DD_WARPS": 8}, {**_B, "DD_BLOCK_N": 128, "DD_WARPS": 8}, {**_B, "DD_CHUNK": 32},
            {**_B, "DD_STAGES": 2}, {**_B, "DD_MAXNREG": 0}, {**_B, "DD_MAXNREG": 96},
            {**_G, "FUSED": False, "DD_METHOD": "dense"}, {"DD_METHOD": "dense"}]


def _overrides(variant):
    """A context of ``variant``'s backward overrides (None: the baseline, whose own defaults stand)."""
    from flash_maxsim.kernels import tuning
    return contextlib.nullcontext() if variant is None else tuning.override_backward(**variant)


def graphed(fn):
    """``fn`` captured once in a CUDA graph (after warm-up launches on a side stream), to replay without host cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph

def time_entries(entries, wants, rounds: int, graph: bool, tol: float = 1e-2) -> dict:
    """``part -> {label -> [ms per round]}`` for ``entries`` of ``(label, part, run, variant)``: ``run(check)``
    launches the backward and, with ``check``, returns its gradients flattened to fp32 (compared with
    ``wants[part]`` before the first round), under ``variant``'s overrides (None: none). With ``graph``, each
    entry's launches are captured once in a CUDA graph and its replay is timed. An entry that fails is timed as inf
    under a label naming the error."""
    import triton.testing
    timed, times = {}, {part: {} for part in wants}
    for label, part, run, variant in entries:
        try:
            with _overrides(variant):
                got = run(True)
                err = (got - wants[part]).abs().max().item() / max(wants[part].abs().max().item(), 1e-30)
                if not err <= tol:
                    raise AssertionError(f"gradients differ from the baseline's (relative {err:.1e})")
                fn = lambda run=run: run(False)  # noqa: E731
                timed[part, label] = (graphed(fn).replay if graph else fn, variant)
        except Exception as exc:
            times[part][f"{label} [{type(exc).__name__}: {str(exc)[:80]}]"] = [float("inf")]
    for _ in range(rounds):
        for (part, label), (fn, variant) in timed.items():
            with _overrides(variant):
                times[part].setdefault(label, []).append(
                    triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="directory holding flash_maxsim_base (ab_forward.py --extract)")
    ap.add_argument("--rows", default="", help="only rows whose name contains one of these comma-separated texts")
    ap.add_argument("--variants", default=None, help="indices into VARIANTS, comma-separated ('' for none; "
                    "default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default=None, help="also time dQ alone and dD alone, for the baseline, the default "
                    "and these variants (indices, comma-separated; '' for none of them)")
    ap.add_argument("--graph", action="store_true", help="time each entry's launches replayed from a CUDA graph")
    ap.add_argument("--shape", action="append", default=[], metavar="Nq,T,Lq,Ld,K",
                    help="time this shape instead of the benchmark's rows (repeatable; T documents in-batch, or K "
                    "candidates per query when K > 0)")
    args = ap.parse_args(argv)
    sys.path[:0] = [args.base, HERE]
    from ab_forward import ranked_line
    import flash_maxsim as fm  # noqa: F401  (registers the ops; the kernels are called through launch)
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch
    base = importlib.import_module("flash_maxsim_base.kernels.launch")
    revision = open(os.path.join(args.base, "flash_maxsim_base", "REVISION")).read().strip()
    picked = range(len(VARIANTS)) if args.variants is None else [int(v) for v in args.variants.split(",") if v]
    wanted = [w for w in args.rows.split(",") if w]
    torch.manual_seed(0)
    print(f"baseline {revision}; variants {list(picked)}; {args.rounds} rounds; "
          f"{'CUDA graphs' if args.graph else 'eager launches'}", flush=True)
    rows = ROWS
    if args.shape:
        rows = []
        for spec in args.shape:
            Nq, T, Lq, Ld, K = (int(x) for x in spec.split(","))
            rows.append((f"Nq {Nq}, " + (f"{K} candidates each" if K else f"{T} documents") + f", {Lq}x{Ld}",
                         Nq, T, Lq, Ld, K))
    for name, Nq, T, Lq, Ld, K in rows:
        if wanted and not any(w in name for w in wanted):
            continue
        q = torch.randn(Nq, Lq, 128, device="cuda", dtype=torch.bfloat16)
        docs = torch.randn(*((Nq, K, Ld, 128) if K else (T, Ld, 128)), device="cuda", dtype=torch.bfloat16)
        p = _layout.canonicalize(q, docs)
        _, aux = launch.forward(p.queries, p.documents, None, None, None, p.candidates, False, None, True,
                                p.max_length)
        g = torch.randn(aux.shape[:2], device="cuda")

        def runner(lm, part):
            need_dq, need_dd = part in ("both", "dQ"), part in ("both", "dD")

            def run(check):
                dq, dd = lm.backward(g, p.queries, p.documents, None, None, None, p.max_length, aux, p.candidates,
                                     None, need_dq, need_dd)
                if check:
                    return torch.cat([x.flatten().float() for x in (dq, dd) if x is not None])
            return run

        labelled = [(f"base {revision}", base, None), ("default", launch, {})]
        labelled += [(f"{i} {VARIANTS[i]}", launch, VARIANTS[i]) for i in picked]
        entries = [(label, "both", runner(lm, "both"), v) for label, lm, v in labelled]
        if args.parts is not None:
            shown = [(f"base {revision}", base, None), ("default", launch, {})]
            shown += [(f"{i} {VARIANTS[int(i)]}", launch, VARIANTS[int(i)]) for i in args.parts.split(",") if i]
            for part in ("dQ", "dD"):
                entries += [(f"{part} {label}", part, runner(lm, part), v) for label, lm, v in shown]
        wants = {part: runner(base, part)(True) for part in ("both", "dQ", "dD")}
        times = time_entries(entries, wants, args.rounds, args.graph)
        print(f"--- {name} (backward alone, ms; ratio to the baseline's):", flush=True)
        for part, sub in times.items():
            if sub:
                ref = next((k for k in sub if f"base {revision}" in k), None)
                print(f"  {part}: {ranked_line(sub, ref)}", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
