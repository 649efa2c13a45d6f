"""flash_maxsim's CPU path beside eager einsum (what the toolkits run) and the native CPU peers.

Rows: fp32, d = 128, random unit vectors (the cost does not depend on the values), no masks:

- scoring: 1 query x 1k documents (32 x 300 tokens), 8 queries x 1k, 1 x 10k, 1 query x 200 pages (32 x 1030)
  and, in the full set, 64 queries x 1k;
- a training step: forward and backward of an in-batch B32 step (32 queries x 32 documents, 32 x 300 tokens,
  cross-entropy over the in-batch scores).

Implementations: ``eager`` is ``einsum("qid,bjd->qbij").amax(-1).sum(-1)`` (colpali-engine's scoring, PyLate's
without masks); ``flash_maxsim`` the package's CPU path; the Rust SIMD peers maxsim-cpu 0.1.0, maxsim-fast 0.1.1
and fast-maxsim 0.2.0 (``maxsim_scores(query [Lq, d], documents [B, Ld, d])`` on numpy arrays, one call per query)
where they are installed. Each implementation's scores are checked against eager's in the same run.

Method: every implementation of a row runs once per round, the order rotated each round, and the median over
rounds is reported with its ratio to eager's median (a loaded machine slows all of them alike within a round).
Peak memory is the resident-set high-water mark above the resident set before one call (Linux only: reset
through /proc/self/clear_refs, with glibc told to return freed memory to the system), measured once every row has
been timed. Threads: torch's intra-op threads as configured and the peers' rayon pool on all cores, or both set
by ``--threads``.

    python benchmarks/cpu_bench.py --out cpu.json [--rounds 9] [--rows 1x1k,train-B32] [--threads 1]

Prints a markdown table. The measuring code lives in the package (``flash_maxsim._cpu_benchmark``), where
``flash-maxsim check`` runs a short form of it (rows 1x1k and train-B32) on a CPU; ``report.py page`` puts the
JSON on docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from flash_maxsim._cpu_benchmark import (ROWS, SHORT_ROWS, Row, eager_scores, installed_peers, machine, markdown,
                                         measure, measure_row, rows_named)

__all__ = ["ROWS", "SHORT_ROWS", "Row", "eager_scores", "installed_peers", "machine", "markdown", "measure",
           "measure_row", "rows_named", "main"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--rows", help="comma-separated row names (default: all): " + ", ".join(r.name for r in ROWS))
    p.add_argument("--short", action="store_true", help="the short set: " + ", ".join(SHORT_ROWS))
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--threads", type=int, help="torch's intra-op threads and the peers' (RAYON_NUM_THREADS); "
                   "default: both as configured (all cores)")
    args = p.parse_args(argv)
    if args.threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)     # read when a peer first starts its pool
        torch.set_num_threads(args.threads)
    names = SHORT_ROWS if args.short else (args.rows.split(",") if args.rows else None)
    try:
        rows = rows_named(names, ROWS)
    except ValueError as exc:
        p.error(f"--rows: {exc}")
    info = machine()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(json.dumps(info), file=sys.stderr)
    results = measure(rows, args.rounds, not args.no_peers, not args.no_memory,
                      log=lambda r: print(json.dumps(r), file=sys.stderr, flush=True))
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(markdown(results))
    print(f"\nmedian of {args.rounds} interleaved rounds; (x) = time / eager's; MiB = peak above the call's start; "
          f"load average {load_before} before, {load_after} after", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": info, "load_before": load_before,
                       "load_after": load_after, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
