#!/usr/bin/env python3
"""Side-by-side benchmark of flash_maxsim on a CUDA GPU: forward scoring and training steps against eager PyTorch,
colpali-engine's chunked loop and the two peer kernel packages, and scoring of a compressed (int8 / fp8) index
against the peers' compressed paths, with a roofline floor measured in the same run; and the host cost of the eager
training step (steps back to back, microseconds per step) beside PyTorch's own share of it.

    python benchmarks/bench.py --out OUT_DIR                          # every section, ~6 minutes on an H100
    python benchmarks/bench.py --out OUT_DIR --sections compressed    # one section
    python benchmarks/bench.py --out OUT_DIR --sections host          # the eager training step's host cost
    python benchmarks/bench.py --out OUT_DIR --only 1x10k --peers none  # rows whose name has "1x10k", no peers

Test every code path on the CPU (tiny shapes, flash_maxsim's CPU path, time.perf_counter timings):

    python benchmarks/bench.py --cpu-smoke --out /tmp/bench-smoke
    python benchmarks/bench.py --cpu-smoke --interpret --out /tmp/bench-smoke   # real Triton kernels, peers too

Writes into --out: results.json (every raw number), results.md (the tables) and PNG plots (with matplotlib).
``benchmarks/report.py`` turns results files into the documentation page (docs/benchmarks.md).

The modules: _shapes.py (the rows), _measure.py (timer, memory, roofline, one guarded measurement),
_sections.py (the forward, training, host-cost and compressed-index sections), _peers.py (the peer packages' adapters),
report.py (tables, plots, page).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

# TRITON_INTERPRET must be set before triton (and so flash_maxsim and the peers) is first imported.
if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Benchmark the working tree's flash_maxsim, whatever else is installed.
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import report  # noqa: E402
from _measure import (L2_FLUSH_HELP, L2_FLUSH_MODES, Machine, interpreter_autotune_shim, l2_flush,  # noqa: E402,F401
                      measure_8bit_rates, measure_roofline)
from _peers import PEER_KEYS, load_peers  # noqa: E402
from _sections import (COMPRESSED_METHODS, HOST_METHODS, run_compressed_rows, run_forward_rows,  # noqa: E402
                       run_host_rows, run_training_rows)
from _shapes import (COMPRESSED_SHAPES, FORWARD_SHAPES, FORWARD_SWEEP_B, FORWARD_SWEEP_B_QUICK,  # noqa: E402
                     HOST_SHAPES, SMOKE_FORWARD_SWEEP_B, SMOKE_SWEEP_DIMS, SMOKE_TRAIN_SWEEP_B, TRAIN_SHAPES,
                     TRAIN_SWEEP_B, TRAIN_SWEEP_B_QUICK, forward_sweep, smoke_forward, smoke_train, train_sweep)

log = logging.getLogger("flash_maxsim.bench")

SECTIONS = ("forward", "training", "host", "compressed", "forward-sweep", "training-sweep")


def _git(*args) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:
        return None


def _meta(m: Machine, args, peers, peer_missing) -> dict:
    """The run's header: date, device, versions, commit, timer settings, peers."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    import flash_maxsim
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"), "device": m.name, "smoke": args.cpu_smoke,
            "interpret": args.interpret, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "flash_maxsim": getattr(flash_maxsim, "__version__", "?"),
            "git_commit": _git("rev-parse", "--short", "HEAD"), "git_dirty": bool(status) if status is not None
            else None, "timer": m.timer.name, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "dtype": str(m.dtype).replace("torch.", ""), "peers": {p.key: p.label for p in peers},
            "peers_missing": peer_missing, "argv": sys.argv[1:], "l2_bytes": m.l2_bytes, "rounds": args.rounds}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for results.json, results.md and the PNG plots (default: benchmarks/results)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma list from: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--no-sweeps", action="store_true", help="skip the corpus-size and batch-size sweeps (plots)")
    p.add_argument("--only", default=None,
                   help="keep only the table rows whose name contains this text (implies --no-sweeps)")
    p.add_argument("--peers", default="lik,fmpypi", help="comma list of peers (lik, fmpypi) or 'none'")
    p.add_argument("--skip-compressed-variants", default="per-tensor scales",
                   help="compressed section: comma list of texts; peer variants whose name contains one are not "
                        "run (default 'per-tensor scales': LIK's per-tensor fp8 scaling autotunes and compiles a "
                        "second set of kernels; '' runs every variant)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sweep points")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warmup in ms (default 10; 5 with --quick)")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="do_bench repetition time in ms (default 50; 20 with --quick)")
    p.add_argument("--budget-s", type=float, default=390.0,
                   help="soft wall-clock budget: measurements not started by then are recorded as skipped")
    p.add_argument("--max-eager-ms", type=float, default=2000.0,
                   help="skip an eager baseline whose estimated time per call exceeds this")
    p.add_argument("--cpu-smoke", "--dry-run", dest="cpu_smoke", action="store_true",
                   help="tiny shapes on the CPU, timed with time.perf_counter: exercises every code path")
    p.add_argument("--interpret", action="store_true",
                   help="with --cpu-smoke: TRITON_INTERPRET=1, so flash_maxsim's and the peers' Triton kernels "
                        "run in the interpreter (fp16 inputs; slow)")
    p.add_argument("--cpu-reps", type=int, default=None,
                   help="timed repetitions per measurement on the CPU (default 2; 1 with --interpret)")
    p.add_argument("--l2-flush", choices=L2_FLUSH_MODES, default="zero", help=L2_FLUSH_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3,
                   help="forward, training and compressed-index rows: time ours and the peers again in this many "
                        "alternating passes and report the median (0: one sequential measurement each)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.interpret and not args.cpu_smoke:
        p.error("--interpret only makes sense with --cpu-smoke")
    args.cpu_reps = args.cpu_reps if args.cpu_reps is not None else (1 if args.interpret else 2)
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else (5.0 if args.quick else 10.0)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else (20.0 if args.quick else 50.0)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.no_sweeps or args.only is not None:
        sections = [s for s in sections if not s.endswith("-sweep")]
    args.sections = sections
    args.skip_compressed_variants = tuple(t.strip() for t in args.skip_compressed_variants.split(",") if t.strip())
    args.peer_keys = [] if args.peers.strip() == "none" else [k.strip() for k in args.peers.split(",") if k.strip()]
    bad = [k for k in args.peer_keys if k not in PEER_KEYS]
    if bad:
        p.error(f"--peers: unknown {bad}; choose from {', '.join(PEER_KEYS)} or 'none'")
    return args


def run(args) -> dict:
    """Every requested section, as the dictionary results.json holds."""
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --cpu-smoke here")
    if args.interpret:
        interpreter_autotune_shim()
    m = Machine(args)
    peers, peer_missing = load_peers(args.peer_keys)
    res = {"meta": _meta(m, args, peers, peer_missing)}
    res["roofline"] = measure_roofline(m)
    labels = report.labels_for(res["meta"])

    def keep(shapes, smoke):
        shapes = [s for s in shapes if args.only is None or args.only in s.name]
        return [smoke(s) for s in shapes] if args.cpu_smoke else shapes

    peer_keys = [p for p in ("lik", "fmpypi") if p in args.peer_keys]
    train_keys = ["ours", "eager"] + [k for k in ("fmpypi", "lik") if k in peer_keys]
    if "forward" in args.sections:
        keys = ["ours", "torch_bf16", "torch_fp32", "colpali_loop"] + peer_keys
        res["forward"] = run_forward_rows(m, keep(FORWARD_SHAPES, smoke_forward), keys, peers, peer_missing,
                                          args.seed, args.rounds)
        if res["forward"]:
            print("\n".join(report.forward_table(res["forward"], labels)), flush=True)
    if "training" in args.sections:
        res["training"] = run_training_rows(m, keep(TRAIN_SHAPES, smoke_train), train_keys, peers, peer_missing,
                                            args.seed, args.rounds)
        if res["training"]:
            print("\n".join(report.training_table(res["training"], labels)), flush=True)
    if "host" in args.sections:
        keys = [k for k in HOST_METHODS if k not in ("lik", "fmpypi") or k in peer_keys]
        res["host"] = run_host_rows(m, keep(HOST_SHAPES, smoke_train), keys, peers, peer_missing, args.seed,
                                    max(args.rounds, 1))
        if res["host"]:
            print("\n".join(report.host_table(res["host"], labels)), flush=True)
    if "compressed" in args.sections:
        shapes = keep(COMPRESSED_SHAPES, smoke_forward)
        if shapes:
            m.mm8_rates = measure_8bit_rates(m)
            res["roofline"].update(m.mm8_rates)
        keys = [k for k in COMPRESSED_METHODS if k.startswith("ours_")] + peer_keys
        res["compressed"] = run_compressed_rows(m, shapes, keys, peers, peer_missing, args.seed,
                                                args.skip_compressed_variants, args.rounds)
        if res["compressed"]:
            print("\n".join(report.compressed_table(res["compressed"], labels)), flush=True)
    if "forward-sweep" in args.sections:
        if args.cpu_smoke:
            shapes = forward_sweep(SMOKE_FORWARD_SWEEP_B, SMOKE_SWEEP_DIMS)
        else:
            shapes = forward_sweep(FORWARD_SWEEP_B_QUICK if args.quick else FORWARD_SWEEP_B)
        res["forward_sweep"] = run_forward_rows(m, shapes, ["ours", "torch_bf16"] + peer_keys, peers,
                                                peer_missing, args.seed)
    if "training-sweep" in args.sections:
        if args.cpu_smoke:
            shapes = train_sweep(SMOKE_TRAIN_SWEEP_B, SMOKE_SWEEP_DIMS)
        else:
            shapes = train_sweep(TRAIN_SWEEP_B_QUICK if args.quick else TRAIN_SWEEP_B)
        res["training_sweep"] = run_training_rows(m, shapes, train_keys, peers, peer_missing, args.seed)
    res["meta"]["elapsed_s"] = m.budget.elapsed()
    res["meta"]["timer"] = m.timer.name     # may have fallen back during the run
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    out = args.out or HERE / "results"
    res = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    plots = report.make_plots(res, out)
    (out / "results.md").write_text(report.render_run(res, {kind: path.name for kind, path in plots.items()}))
    log.info("wrote %s", ", ".join(str(p) for p in [out / "results.json", out / "results.md", *plots.values()]))
    print("\n" + report.summary(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
