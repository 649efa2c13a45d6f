"""The CPU benchmark's measurements: the CPU path beside eager einsum (what the toolkits run) and the native CPU
peers, on realistic shapes. ``benchmarks/cpu_bench.py`` runs the full set; ``flash-maxsim check`` a short form.

Rows: fp32, d = 128, random unit vectors (the cost does not depend on the values), no masks: scoring (queries x
documents of 32 x 300 tokens, or pages of 32 x 1030) and a training step (forward and backward of an in-batch
step, cross-entropy over the in-batch scores).

Implementations: ``eager`` is ``einsum("qid,bjd->qbij").amax(-1).sum(-1)`` (colpali-engine's scoring, PyLate's
without masks); ``flash_maxsim`` the package's CPU path; the Rust SIMD peers maxsim-cpu 0.1.0, maxsim-fast 0.1.1
and fast-maxsim 0.2.0 (``maxsim_scores(query [Lq, d], documents [B, Ld, d])`` on numpy arrays, one call per query)
where they are installed. Each implementation's scores (a step's loss and gradients) are compared with eager's.

Method: every implementation of a row runs once per round, the order rotated each round, and the median over
rounds is reported with its ratio to eager's median (a loaded machine slows all of them alike within a round).
Peak memory is the resident-set high-water mark above the resident set before one call (Linux only: reset
through /proc/self/clear_refs, with glibc told to return freed memory to the system), measured after every row
has been timed, since that setting lasts for the process. Threads: torch's intra-op threads as configured, the
peers' rayon pool on all cores unless ``RAYON_NUM_THREADS`` says otherwise.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

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
CHECK_ROWS = ("1x1k", "train-B32")          # what `flash-maxsim check` times on a CPU (a few seconds on 2 cores)


def rows_named(names: Optional[Sequence[str]], table: Sequence[Row] = ROWS) -> List[Row]:
    """The rows of ``table`` with these names (all for None), in the table's order; an unknown name is an
    error."""
    if names is None:
        return list(table)
    unknown = sorted(set(names) - {r.name for r in table})
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(r.name for r in table)}")
    return [r for r in table if r.name in names]


# --- implementations -------------------------------------------------------------------------------------------

def eager_scores(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The full similarity tensor, then max and sum: what colpali-engine and PyLate (without masks) run."""
    return torch.einsum("qid,bjd->qbij", q, d).amax(-1).sum(-1)


def flash_scores(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    from . import _api
    from .ops import force_backend

    with force_backend("torch"):
        return _api.maxsim(q, d)


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


def _training_step(score_fn, q: torch.Tensor, d: torch.Tensor) -> Callable[[], tuple]:
    labels = torch.arange(q.shape[0])

    def step():
        qq, dd = q.detach().requires_grad_(), d.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(score_fn(qq, dd), labels)
        loss.backward()
        return loss.detach(), qq.grad, dd.grad
    return step


def _on_the_cpu_path(fn: Callable) -> Callable:
    """``fn`` with flash_maxsim's ops on the CPU path, its backward included (with TRITON_INTERPRET=1 set, CPU
    tensors would otherwise run the interpreted kernels)."""
    def run():
        from .ops import force_backend

        with force_backend("torch"):
            return fn()
    return run


def implementations(row: Row, q: torch.Tensor, d: torch.Tensor, peers: bool = True) -> Dict[str, Callable]:
    if row.train:
        return {"eager": _training_step(eager_scores, q, d),
                "flash_maxsim": _on_the_cpu_path(_training_step(flash_scores, q, d))}
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


def return_freed_memory_to_the_system() -> None:
    """glibc keeps freed blocks resident (and, once its mmap threshold has adapted upwards, serves large ones from
    them), which hides later peaks from the resident set: a fixed threshold makes every large allocation a fresh
    mapping, and a trim hands back what is free now. Call it before measuring memory, not before timing."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 64 * 1024)                       # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_above_start(fn: Callable) -> Optional[int]:
    """Resident-set high-water mark during ``fn()`` above the resident set before it, in bytes (Linux), else
    None (``fn`` is then not called)."""
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
    """One row: median ms, ratio to eager, the CPU path's time over the best peer's, peak MiB and the largest
    difference from eager's outputs, per implementation."""
    if rounds < 1:
        raise ValueError(f"`rounds` must be at least 1, got {rounds}")
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
    peak = _peaks(fns) if memory else {}
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


def _peaks(fns: Dict[str, Callable]) -> Dict[str, Optional[float]]:
    """Peak MiB of one call of each (warm) implementation. Fixes glibc's mmap threshold for the rest of the
    process: time before this."""
    peak = {}
    for name, fn in fns.items():
        return_freed_memory_to_the_system()
        b = peak_rss_above_start(fn)
        peak[name] = None if b is None else round(b / 2 ** 20, 1)
    return peak


def peak_memory_row(row: Row, peers: bool = True) -> Dict[str, Optional[float]]:
    """Peak MiB of one call of each implementation of ``row``, on fresh inputs, after one warm-up call each."""
    q, d = inputs(row)
    fns = implementations(row, q, d, peers)
    for fn in fns.values():
        fn()
    return _peaks(fns)


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


def measure(rows: Sequence[Row], rounds: int = 7, peers: bool = True, memory: bool = True,
            log: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """The rows as dicts (:func:`measure_row`), in order; ``log`` is called with each as soon as it is timed. Every
    row is timed before any memory is measured (then on fresh inputs), so that every timing runs with the
    allocator's defaults."""
    out = []
    for row in rows:
        out.append(measure_row(row, rounds, peers, memory=False))
        if log:
            log(out[-1])
    if memory:
        for row, result in zip(rows, out):
            result["peak_mib"] = peak_memory_row(row, peers)
    return out


def markdown(results: List[dict]) -> str:
    """The rows as a markdown table: ms (time / eager's) and peak MiB per implementation, ours / best peer."""
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
