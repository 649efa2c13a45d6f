"""A/B of the forward kernels against a baseline copy of them, in one process: the benchmark's forward rows, the
baseline, this checkout's default and tile variants of it timed in interleaved rounds (so that clock drift hits
every entry alike); medians of the rounds' medians.

The baseline is ``src/flash_maxsim/kernels`` of a git revision (with the modules they import), extracted as the
package ``flash_maxsim_base``:

    python tools/ab_forward.py --extract HEAD .ab/base              # .ab is git-ignored
    python tools/ab_forward.py --base .ab/base [--rows int8] [--variants 3,5] [--variant '{"num_stages": 2}']

Both sides score the same canonical inputs through ``kernels.launch.forward`` (the host path above it is shared);
the variants are ``kernels.tuning.override_forward`` fields. Not the published benchmark (benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# (Nq, B, Lq, Ld, d, kind): scoring rows (bf16, and int8 / fp8 indexes) and the training forwards (arg-max, or the
# smooth max's log-sum-exp, saved for the backward): ColBERT in-batch B128 and B64 + 7 negatives (512 documents),
# ColPali B64 and B256, the smooth max (tau 0.1) at B128
ROWS = [
    (1, 1000, 32, 300, 128, None), (1, 10000, 32, 300, 128, None), (1, 1000, 32, 1024, 128, None),
    (1, 10000, 32, 1030, 128, None), (1, 1000, 128, 1024, 128, None), (1, 1000, 512, 1024, 128, None),
    (1, 1000, 1024, 1024, 128, None), (1, 10000, 1024, 1024, 128, None), (64, 1000, 32, 300, 128, None),
    (16, 32, 32, 8192, 128, None), (1, 10000, 32, 180, 384, None), (1, 5000, 31, 257, 96, None),
    (1, 10000, 32, 300, 128, "int8"), (1, 10000, 32, 1030, 128, "int8"), (1, 10000, 1024, 1024, 128, "int8"),
    (1, 10000, 32, 300, 128, "fp8"), (1, 10000, 32, 1030, 128, "fp8"), (1, 10000, 1024, 1024, 128, "fp8"),
    (128, 128, 32, 300, 128, "train"), (64, 512, 32, 300, 128, "train"), (64, 64, 32, 1030, 128, "train"),
    (256, 256, 32, 1030, 128, "train"), (128, 128, 32, 1030, 128, "smooth-train"),
]


def _token_rows(programs_per_sm, block_n=64, tma=False, stages=2, maxnreg=0, warps=4):
    """A variant of the token-rows kernel (kernels/forward_token_rows.py), every one of its choices spelled out."""
    return {"TOKEN_ROWS": True, "TOKEN_ROWS_PROGRAMS_PER_SM": programs_per_sm, "TOKEN_ROWS_BLOCK_N": block_n,
            "TOKEN_ROWS_TMA": tma, "TOKEN_ROWS_STAGES": stages, "TOKEN_ROWS_MAXNREG": maxnreg,
            "TOKEN_ROWS_WARPS": warps}


# tile variants around the defaults (--variants picks by index; --variant adds any other), by what they change
VARIANTS = [
    {},
    # pipelining, warps, tile widths
    {"num_stages": 2}, {"num_stages": 3}, {"num_stages": 4}, {"num_warps": 8}, {"num_warps": 8, "num_stages": 4},
    {"BLOCK_N": 64}, {"BLOCK_N": 128}, {"ROWS": 64}, {"ROWS": 256, "num_warps": 8},
    {"ROWS": 256, "num_warps": 8, "num_stages": 3}, {"TOKB": 64, "BLOCK_N": 128, "num_warps": 4, "PROGRAMS_PER_SM": 4},
    # grid sizes (programs per SM, each an equal share of the documents), documents per program, register caps
    {"PROGRAMS_PER_SM": 2}, {"PROGRAMS_PER_SM": 4}, {"PROGRAMS_PER_SM": 8}, {"PROGRAMS_PER_SM": 12},
    {"PROGRAMS_PER_SM": 16}, {"PROGRAMS_PER_SM": 32}, {"DOCS": 2}, {"DOCS": 4}, {"FLAT_RUN": False},
    {"MAXNREG": 128}, {"MAXNREG": 168}, {"MAXNREG": 168, "PROGRAMS_PER_SM": 12}, {"PROGRAMS_PER_SM": 8, "MAXNREG": 128},
    {"num_warps": 1, "PROGRAMS_PER_SM": 8}, {"num_warps": 1, "PROGRAMS_PER_SM": 8, "MAXNREG": 0},
    {"num_warps": 16, "PROGRAMS_PER_SM": 1},
    # the document-token split
    {"DSPLIT": 2}, {"DSPLIT": 3}, {"DSPLIT": 4},
    # the last tile: peeled or in one masked loop, peeled in narrower tiles, several documents each peeled
    {"PEEL_TAIL": True}, {"PEEL_TAIL": False}, {"TAIL_N": 16}, {"TAIL_N": 32}, {"TAIL_N": 16, "num_stages": 3},
    {"DOCS": 4, "PEEL_EACH_DOC": True, "MAXNREG": 128},
    {"PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 16},
    {"PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 32},
    {"PROGRAMS_PER_SM": 4, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 16},
    {"ROWS": 256, "num_warps": 8, "TAIL_N": 16, "num_stages": 3},
    # copies by TMA
    {"TMA_DOCS": True}, {"TMA_DOCS": False}, {"TMA_DOCS": True, "num_stages": 4}, {"TMA_DOCS": True, "BLOCK_N": 128},
    {"TMA_DOCS": True, "PROGRAMS_PER_SM": 8, "MAXNREG": 128}, {"num_warps": 8, "TMA_DOCS": True},
    {"TMA_ONE_DOC": True}, {"TMA_ONE_DOC": False},
    # 8-bit products: the queries quantised in the kernel, the scales loaded in the tile, the sums converted
    {"QUANTIZE_FIRST": False}, {"PREFETCH_TOKENS": False}, {"PREFETCH_TOKENS": True}, {"BITCAST_SUMS": True},
    {"BITCAST_SUMS": False}, {"BITCAST_SUMS": True, "num_stages": 2}, {"INT8_PRODUCTS": False},
    {"FP8_PRODUCTS": False},
    # partial maxima per row and the order their maxima fold in
    {"ROW_PARTIALS": 1}, {"ROW_PARTIALS": 4}, {"ROW_PARTIALS": 8}, {"ROW_PARTIALS": 8, "TMA_ONE_DOC": True},
    {"CHAINED_MAX": True}, {"CHAINED_MAX": False},
    # the token-rows kernel (8-bit streaming rows) against the tile kernel, and its own tiles and grid
    {"TOKEN_ROWS": False}, _token_rows(4), _token_rows(6), _token_rows(8, maxnreg=64), _token_rows(4, tma=True),
    _token_rows(6, tma=True), _token_rows(6, tma=True, stages=3), _token_rows(7, tma=True, maxnreg=72),
    _token_rows(8, tma=True, maxnreg=64), _token_rows(4, block_n=128, tma=True),
    _token_rows(4, block_n=128, tma=True, stages=3), _token_rows(3, block_n=128, tma=True, stages=4),
    _token_rows(4, block_n=128, warps=8),
]


# the modules outside kernels/ that the kernels of a revision may import (those it has are extracted)
_BASE_MODULES = ("_layout.py", "_types.py", "quantization.py")


def extract(rev: str, out: str) -> None:
    """``flash_maxsim_base`` under ``out``: the kernels of ``rev`` and the package modules they import."""
    pkg = os.path.join(out, "flash_maxsim_base")
    os.makedirs(os.path.join(pkg, "kernels"), exist_ok=True)
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=HERE).stdout.strip()
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "src/flash_maxsim/kernels/"], capture_output=True,
                           text=True, check=True, cwd=root).stdout.split()
    # launch.py imports quantization lazily (queries quantised before the launch)
    present = subprocess.run(["git", "ls-tree", "--name-only", rev, "src/flash_maxsim/"], capture_output=True,
                             text=True, check=True, cwd=root).stdout.split()
    names += [f"src/flash_maxsim/{m}" for m in _BASE_MODULES if f"src/flash_maxsim/{m}" in present]
    for path in names:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True,
                              cwd=root).stdout
        rel = os.path.relpath(path, "src/flash_maxsim")
        with open(os.path.join(pkg, rel), "w") as f:
            f.write(text)
    for init in (os.path.join(pkg, "__init__.py"), os.path.join(pkg, "kernels", "__init__.py")):
        if not os.path.exists(init):
            open(init, "w").close()
    rev_id = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True,
                            cwd=root).stdout.strip()
    with open(os.path.join(pkg, "REVISION"), "w") as f:
        f.write(rev_id + "\n")
    print(f"extracted {len(names)} files of {rev} ({rev_id}) into {pkg}")


def forward_scores(lm, p, save_aux: bool = False, smooth_tau=None):
    """Scores of the canonical problem ``p`` (``_layout.canonicalize``) through ``lm.forward`` (a ``kernels.launch``
    module: this checkout's or the baseline's), hard max or smooth (``smooth_tau``). ``save_aux``: the training
    forward, its scores and saved arg-max (or log-sum-exp) flattened into one fp32 vector, so that a check of it
    covers both."""
    scores, aux = lm.forward(p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets, p.candidates,
                             False, smooth_tau, save_aux, p.max_length, p.document_scales)
    if not save_aux:
        return scores
    return torch.cat([scores.flatten(), aux.flatten().to(torch.float32)])


def _overrides(variant):
    """A context of ``variant``'s forward overrides (None: the baseline, whose own defaults stand)."""
    from flash_maxsim.kernels import tuning
    return contextlib.nullcontext() if variant is None else tuning.override_forward(**variant)


def time_interleaved(entries, want, rounds: int, tol: float = 1e-5, clocks=None, unchecked=()) -> dict:
    """``label -> [ms per round]`` for ``entries`` of ``(label, call, variant)``, timed in interleaved rounds
    (``triton.testing.do_bench`` medians) under ``variant``'s forward overrides (None: none). Each round first
    checks the entry's scores against ``want`` (relative 1e-5); an entry that fails, does not compile or does not
    fit is timed as inf under a label that names the error, and the sweep goes on. ``clocks`` (a running
    gpu_clocks.ClockSampler): each timed pass is printed with the GPU's clocks, power and throttle reasons during
    it. Entries labelled in ``unchecked`` are timed without the check (--ceiling)."""
    import triton.testing
    times: dict = {}
    for r in range(rounds):
        for label, call, variant in entries:
            try:
                with _overrides(variant):
                    got = call()
                    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                    if not err <= tol and label not in unchecked:
                        raise AssertionError(f"scores differ from the first entry's (relative {err:.1e})")
                    t0 = time.monotonic()
                    t = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
                    if clocks is not None:
                        print(f"  pass {r} {label}: {t:.4f} ms, {clocks.summary(t0, time.monotonic())}", flush=True)
            except Exception as exc:
                t = float("inf")
                label = f"{label} [{type(exc).__name__}: {str(exc)[:80]}]"
            times.setdefault(label, []).append(t)
    return times


def ranked_line(times: dict, ref_label: str) -> str:
    """The entries' medians, fastest first, each with its ratio to ``ref_label``'s (to the fastest's if that entry
    failed)."""
    ranked = sorted((statistics.median(v), k) for k, v in times.items())
    ref = statistics.median(times[ref_label]) if ref_label in times else ranked[0][0]
    return "  ".join(f"{t:.4f} ({t / ref:.3f}) {k}" for t, k in ranked)


def host_times(fm, _layout, launches, calls: int = 200) -> None:
    """Microseconds of host time per scoring call, with and without a TMA descriptor (kernel_check.per_call_us:
    ``calls`` calls back to back, no sync inside the loop), on 1 query x 16 documents 32x128 in runs of 2
    documents, through each ``(label, kernels.launch module)`` of ``launches`` (the baseline's, this checkout's)."""
    from kernel_check import per_call_us
    for kind in (None, "int8"):
        q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
        docs = torch.randn(16, 128, 128, device="cuda", dtype=torch.bfloat16)
        if kind:
            docs = fm.quantize(docs, dtype=kind)
        p = _layout.canonicalize(q, docs, None, None, masked="exclude", smooth_tau=None)
        for tma in (False, True):
            for label, launch in launches:
                with _forward_overrides_of(launch, dict(PROGRAMS_PER_SM=0, DOCS=2, TMA_DOCS=tma)):
                    us = per_call_us(lambda: forward_scores(launch, p), calls)
                plan = next(reversed(launch._FORWARD_PLANS.values()))
                print(f"host {label} {kind or 'bf16'} 1x16 32x128 runs of 2, TMA {tma} "
                      f"(plan: {plan.meta['TMA_DOCS']}): {us:.1f} us per call", flush=True)


@contextlib.contextmanager
def _forward_overrides_of(launch, fields: dict):
    """``fields`` as the forward overrides of ``launch`` (this checkout's ``kernels.launch`` or a baseline's) for
    the block: through its package's ``tuning.override_forward``, or, for a baseline older than kernels/tuning.py,
    its ``FORWARD_OVERRIDES`` dict."""
    tuning = sys.modules.get(launch.__name__.rsplit(".", 1)[0] + ".tuning")
    if tuning is not None:
        with tuning.override_forward(**fields):
            yield
        return
    saved = dict(launch.FORWARD_OVERRIDES)
    launch.FORWARD_OVERRIDES.update(fields)
    try:
        yield
    finally:
        launch.FORWARD_OVERRIDES.clear()
        launch.FORWARD_OVERRIDES.update(saved)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extract", nargs=2, metavar=("REV", "DIR"), help="write the baseline package and exit")
    ap.add_argument("--base", help="directory holding flash_maxsim_base (from --extract)")
    ap.add_argument("--rows", default="", help="only rows whose name contains one of these comma-separated texts "
                    "(e.g. int8, 1024x1024)")
    ap.add_argument("--variants", default="", help="indices into VARIANTS, comma-separated (default: all; 'none' "
                    "for the default alone)")
    ap.add_argument("--variant", action="append", default=[], metavar="JSON", help="another variant to time: a "
                    "JSON object of tuning.override_forward fields (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clocks", action="store_true", help="print every timed pass with the GPU's SM clock, power, "
                    "temperature and throttle reasons during it (nvidia-smi sampled every 20 ms: gpu_clocks.py)")
    ap.add_argument("--ceiling", action="store_true", help="time the baseline without checking its scores: a "
                    "deliberately wrong copy (e.g. one with some work cut out) bounds what removing that work gains")
    ap.add_argument("--base-fp32-scales", action="store_true", help="quantized rows: give the baseline fp32 scales "
                    "(a baseline older than bf16 scales reads no others; by default it scores the index as this "
                    "checkout)")
    ap.add_argument("--fp32-scales", action="store_true", help="quantized rows: also time this checkout's default "
                    "on the same index with its scales as fp32 (4 bytes a token) instead of bf16")
    ap.add_argument("--host", action="store_true", help="first, the host time of a launch with and without a TMA "
                    "descriptor, on a run of documents small enough to be host-bound")
    args = ap.parse_args(argv)
    if args.extract:
        extract(*args.extract)
        return 0
    import flash_maxsim as fm
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch
    base_launch = None
    if args.base:
        sys.path.insert(0, os.path.abspath(args.base))
        base_launch = importlib.import_module("flash_maxsim_base.kernels.launch")
        with open(os.path.join(args.base, "flash_maxsim_base", "REVISION")) as f:
            print(f"baseline: kernels of {f.read().strip()}")
    if args.variants == "none":
        variants = [{}]
    else:
        variants = [VARIANTS[int(i)] for i in args.variants.split(",")] if args.variants else list(VARIANTS)
    variants += [json.loads(v) for v in args.variant]
    torch.manual_seed(0)
    if args.host:
        host_times(fm, _layout, ([("base", base_launch)] if base_launch else []) + [("new", launch)])
    clocks = None
    with contextlib.ExitStack() as stack:
        if args.clocks:
            from gpu_clocks import ClockSampler, smi_id
            clocks = stack.enter_context(ClockSampler(index=smi_id()))
        run_rows(args, fm, _layout, launch, base_launch, variants, clocks)
    # a failed direct launch switches every later one to Triton's path (slower on the host, same kernels): say so
    from flash_maxsim.kernels import direct_launch
    print(f"direct launches: {'on' if direct_launch._enabled else 'off (fell back to Triton launches)'}")
    return 0


def run_rows(args, fm, _layout, launch, base_launch, variants, clocks) -> None:
    """Every row of ROWS that ``--rows`` selects: the baseline and the variants in interleaved rounds, a ranked
    line each."""
    dev = "cuda"
    for Nq, B, Lq, Ld, d, kind in ROWS:
        name = f"{kind or 'bf16'} {Nq}x{B} {Lq}x{Ld} d={d}"
        if not any(r in name for r in args.rows.split(",")):
            continue
        q = torch.randn(Nq, Lq, d, device=dev, dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, d, device=dev, dtype=torch.bfloat16)
        training = kind in ("train", "smooth-train")
        if kind and not training:
            docs = fm.quantize(docs, dtype=kind)
        tau = 0.1 if kind == "smooth-train" else None
        p = _layout.canonicalize(q, docs, None, None, masked="exclude", smooth_tau=tau)
        # the same index with fp32 scales, which a baseline older than bf16 scales reads (--base-fp32-scales); a later
        # one is given the index as it is
        p32 = p if p.document_scales is None else dataclasses.replace(p, document_scales=p.document_scales.float())
        p_base = p32 if args.base_fp32_scales else p

        entries = ([("base", lambda: forward_scores(base_launch, p_base, training, tau), None)]
                   if base_launch else [])
        entries += [("new " + (str(v) if v else "default"), lambda: forward_scores(launch, p, training, tau), v)
                    for v in variants]
        if args.fp32_scales and p32 is not p:
            entries.append(("new default, fp32 scales", lambda: forward_scores(launch, p32, training, tau), {}))
        # the reference scores: this checkout's when the baseline is a deliberately wrong copy (--ceiling)
        want = forward_scores(launch if args.ceiling else (base_launch or launch), p_base, training, tau)
        # fp8 rows: Hopper's fp8 tensor cores sum in fewer bits than fp32 (~2^-14 of the products' magnitude: docs/
        # semantics.md), so an fp8 path on other tensor-core instructions differs at ~1e-4 of the largest score
        times = time_interleaved(entries, want, args.rounds, 5e-4 if kind == "fp8" else 1e-5, clocks,
                                 unchecked=("base",) if args.ceiling else ())
        print(f"ab {name}: {ranked_line(times, 'base')}", flush=True)
        del q, docs, p


if __name__ == "__main__":
    sys.exit(main())
