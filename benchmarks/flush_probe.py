"""What the benchmark's L2 flush costs a short bandwidth-bound call (device probe; session 14, docs/perf-notes.md).

``triton.testing.do_bench`` (bench.py's timer) clears the L2 cache before every timed call by zeroing a 256 MB
buffer: the 50 MB of L2 are then full of dirty lines, which the timed call's reads evict by writing them back to
HBM, inside its measurement. This times the same calls after that flush and after one that leaves the L2 full of
clean lines (a reduction reading the same 256 MB), with CUDA events around each call alone, median of ``--reps``.

    python3 benchmarks/flush_probe.py [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flash_maxsim as fm

ROWS = [("1x1k 32x1024", 1, 1000, 32, 1024, 128), ("1x1k 128x1024", 1, 1000, 128, 1024, 128),
        ("1x1k 32x300", 1, 1000, 32, 300, 128), ("1x5k 31x257 d=96", 1, 5000, 31, 257, 96),
        ("1x10k 32x1030", 1, 10000, 32, 1030, 128)]


def timed(fn, flush, reps: int) -> float:
    """Median ms of ``fn`` alone between two events, each call after ``flush``."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(5):
        flush()
        fn()
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    total = torch.empty((), dtype=torch.int64, device="cuda")
    flushes = {"zeroed (do_bench's)": buf.zero_, "read (clean lines)": lambda: torch.sum(buf, dim=0, out=total),
               "none": lambda: None}
    torch.manual_seed(0)
    for name, Nq, B, Lq, Ld, d in ROWS:
        q = torch.randn(Nq, Lq, d, device="cuda", dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, d, device="cuda", dtype=torch.bfloat16)
        mb = docs.numel() * 2 / 1e6
        times = {f: timed(lambda: fm.maxsim(q, docs), fl, args.reps) for f, fl in flushes.items()}
        print(f"{name} ({mb:.0f} MB): " + "  ".join(f"{f} {t:.4f} ms ({mb / 1e3 / t:.2f} TB/s)"
                                                   for f, t in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
