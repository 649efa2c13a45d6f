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
through /proc/self/clear_refs, with glibc told to return freed memory to the system). Threads: torch's intra-op
threads as configured and the peers' rayon pool on all cores, or both set by ``--threads``.

    python benchmarks/cpu_bench.py --out cpu.json [--rounds 9] [--rows 1x1k,train-B32] [--threads 1]

Prints a markdown table. ``measure(rows, rounds)`` returns the same rows as dicts, for other scripts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

PEERS = (("maxsim-cpu", "maxsim_cpu", "0.1.0"), ("maxsim-fast", "maxsim_fast", "0.1.1"),
         ("fast-maxsim", "fast_maxsim", "0.2.0"))


@dataclass(frozen=True)
class Row:
    name: str
    Nq: int
    B: int
    Lq: int
    Ld: int
    d: int = 128
    train: bool = False

    @property
    def shape(self) -> str:
        what = "in-batch training step, forward + backward" if self.train else "scoring"
        return f"{self.Nq} x {self.B} docs, {self.Lq} x {self.Ld}, d={self.d}, fp32, {what}"


ROWS = (
    Row("1x1k", 1, 1000, 32, 300),
    Row("8x1k", 8, 1000, 32, 300),
    Row("1x10k", 1, 10000, 32, 300),
    Row("1x200pages", 1, 200, 32, 1030),
    Row("64x1k", 64, 1000, 32, 300),
    Row("train-B32", 32, 32, 32, 300, train=True),
)
SHORT_ROWS = ("1x1k", "8x1k", "1x200pages", "train-B32")


# --- implementations -------------------------------------------------------------------------------------------

def eager_scores(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The full similarity tensor, then max and sum: what colpali-engine and PyLate (without masks) run."""
    return torch.einsum("qid,bjd->qbij", q, d).amax(-1).sum(-1)


def flash_scores(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    import flash_maxsim
    from flash_maxsim.ops import force_backend

    with force_backend("torch"):
        return flash_maxsim.maxsim(q, d)


def installed_peers() -> Dict[str, object]:
    """The peers that import here, by distribution name (a missing or other version is left out)."""
    found = {}
    for dist, module, version in PEERS:
        try:
            if importlib.metadata.version(dist) != version:
                continue
            found[dist] = importlib.import_module(module)
        except (ImportError, importlib.metadata.PackageNotFoundError):
            continue
    return found


def _peer_scores(module, q: torch.Tensor, d: torch.Tensor) -> Callable[[], torch.Tensor]:
    import numpy as np

    qn, dn = q.numpy(), d.numpy()                       # shares the tensors' memory
    return lambda: torch.from_numpy(np.stack([module.maxsim_scores(qn[i], dn) for i in range(qn.shape[0])]))


def _training_step(score_fn, q: torch.Tensor, d: torch.Tensor) -> Callable[[], torch.Tensor]:
    labels = torch.arange(q.shape[0])

    def step():
        qq, dd = q.detach().requires_grad_(), d.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(score_fn(qq, dd), labels)
        loss.backward()
        return loss.detach(), qq.grad, dd.grad
    return step


def implementations(row: Row, q: torch.Tensor, d: torch.Tensor, peers: bool = True) -> Dict[str, Callable]:
    if row.train:
        return {"eager": _training_step(eager_scores, q, d), "flash_maxsim": _training_step(flash_scores, q, d)}
    fns = {"eager": lambda: eager_scores(q, d), "flash_maxsim": lambda: flash_scores(q, d)}
    if peers:
        for name, module in installed_peers().items():
            fns[name] = _peer_scores(module, q, d)
    return fns


def inputs(row: Row, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(row.Nq, row.Lq, row.d, generator=g), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(row.B, row.Ld, row.d, generator=g), dim=-1)
    return q, d


# --- measurement -----------------------------------------------------------------------------------------------

def _rss_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _return_freed_memory_to_the_system() -> None:
    """glibc keeps freed blocks resident (and, once its mmap threshold has adapted upwards, serves large ones from
    them), which hides later peaks from the resident set: a fixed threshold makes every large allocation a fresh
    mapping, and a trim hands back what is free now. Called before the memory pass only, so that the timed calls
    run with the allocator's defaults."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 64 * 1024)                       # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn: Callable) -> Optional[int]:
    """Resident-set high-water mark during ``fn()`` above the resident set before it (Linux), else None."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                # resets the high-water mark
        before = _rss_bytes("VmRSS")
    except OSError:
        return None
    fn()
    return max(0, _rss_bytes("VmHWM") - before)


def interleaved_medians(fns: Dict[str, Callable], rounds: int) -> Dict[str, float]:
    """Median milliseconds per implementation; each round runs every one once, the order rotated per round."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def measure_row(row: Row, rounds: int, peers: bool = True, memory: bool = True) -> dict:
    q, d = inputs(row)
    fns = implementations(row, q, d, peers)
    def outputs(fn):                                     # scores, or a step's loss and gradients
        out = fn()
        return [x.float() for x in (out if isinstance(out, tuple) else (out,))]
    expected = outputs(fns["eager"])
    max_abs_diff = {}
    for name, fn in fns.items():                         # also the warm-up
        got = outputs(fn)
        max_abs_diff[name] = max(float((a.reshape(b.shape) - b).abs().max()) for a, b in zip(got, expected))
    ms = interleaved_medians(fns, rounds)
    peak = {}
    if memory:
        for name, fn in fns.items():
            _return_freed_memory_to_the_system()
            b = peak_extra_bytes(fn)
            peak[name] = None if b is None else round(b / 2 ** 20, 1)
    peer_ms = [v for k, v in ms.items() if k not in ("eager", "flash_maxsim")]
    return {
        "row": row.name, "shape": row.shape, "Nq": row.Nq, "B": row.B, "Lq": row.Lq, "Ld": row.Ld, "d": row.d,
        "train": row.train, "rounds": rounds,
        "ms": {k: round(v, 2) for k, v in ms.items()},
        "vs_eager": {k: round(v / ms["eager"], 3) for k, v in ms.items()},
        "flash_vs_best_peer": round(ms["flash_maxsim"] / min(peer_ms), 3) if peer_ms else None,
        "peak_mib": peak,
        "max_abs_diff_vs_eager": max_abs_diff,
    }


def machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            info["model"] = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    info["peers"] = {dist: importlib.metadata.version(dist) for dist in installed_peers()}
    info["peer_threads"] = os.environ.get("RAYON_NUM_THREADS", "all cores")
    return info


def measure(rows=None, rounds: int = 7, peers: bool = True, memory: bool = True, log=None) -> List[dict]:
    """The rows (names from ``ROWS``; default all) as dicts: median ms, ratio to eager, peak MiB per
    implementation."""
    wanted = [r for r in ROWS if rows is None or r.name in rows]
    out = []
    for row in wanted:
        result = measure_row(row, rounds, peers, memory)
        out.append(result)
        if log:
            log(result)
    return out


def markdown(results: List[dict]) -> str:
    names = []
    for r in results:
        names += [k for k in r["ms"] if k not in names]
    head = "| row | " + " | ".join(names) + " | ours / best peer |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for r in results:
        cells = []
        for k in names:
            if k not in r["ms"]:
                cells.append("")
                continue
            mem = r["peak_mib"].get(k)
            cells.append(f"{r['ms'][k]:.1f} ms ({r['vs_eager'][k]:.2f})" + (f", {mem:.0f} MiB" if mem is not None
                                                                            else ""))
        best = "" if r["flash_vs_best_peer"] is None else f"{r['flash_vs_best_peer']:.2f}"
        lines.append(f"| {r['row']} ({r['shape']}) | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines)


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
    rows = SHORT_ROWS if args.short else (args.rows.split(",") if args.rows else None)
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
