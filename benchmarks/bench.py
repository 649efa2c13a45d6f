#!/usr/bin/env python3
"""Side-by-side benchmark of flash_maxsim: forward scoring and training steps against eager PyTorch,
colpali-engine's chunked loop and the two peer kernel packages, and scoring of a compressed (int8 / fp8) index
against the peers' compressed paths, with a roofline floor measured in the same run.

Run on the GPU machine (see benchmarks/README.md for the exact command):

    python benchmarks/bench.py --out OUT_DIR [--quick] [--sections forward,training] [--only 1x10k]
    python benchmarks/bench.py --out OUT_DIR --sections compressed        # issue 7 only

Test every code path on the CPU (tiny shapes, flash_maxsim's CPU path, time.perf_counter timings):

    python benchmarks/bench.py --cpu-smoke --out /tmp/bench-smoke
    python benchmarks/bench.py --cpu-smoke --interpret --out /tmp/bench-smoke   # real Triton kernels, peers too

Regenerate the results part of docs/benchmarks.md (and the plots) from a saved run:

    python benchmarks/bench.py --from-json benchmarks/results/results.json --write-docs docs/benchmarks.md

Writes into --out: results.json (every raw number), results.md (the tables), forward_vs_corpus.png and
training_vs_batch.png.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import inspect
import itertools
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

# TRITON_INTERPRET must be set before triton (and so flash_maxsim and the peers) is first imported.
if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"


REPO = Path(__file__).resolve().parent.parent
# Benchmark the working tree's flash_maxsim, whatever else is installed.
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _peers import CompressedVariant, tensor_bytes  # noqa: E402

log = logging.getLogger("flash_maxsim.bench")

MB = 2 ** 20
DOCS_BEGIN = "<!-- BEGIN GENERATED RESULTS: written by `benchmarks/bench.py --write-docs`; edits here are lost -->"
DOCS_END = "<!-- END GENERATED RESULTS -->"


# ----------------------------------------------------------------------------------------------------------------
# Shapes and targets (issues 2, 3 and 6; H200, bf16, d=128 unless said)
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ForwardShape:
    name: str
    Nq: int
    B: int
    Lq: int
    Ld: int
    d: int
    issue_floor_ms: Optional[float] = None
    issue_best_peer_ms: Optional[float] = None
    target_ms: Optional[float] = None


@dataclass(frozen=True)
class TrainShape:
    name: str
    Nq: int
    B: int               # documents in the batch ("inbatch") or candidates per query ("kd")
    Lq: int
    Ld: int
    d: int
    layout: str          # "inbatch": documents [B, Ld, d], scores [Nq, B]; "kd": documents [Nq, B, Ld, d]
    smooth_tau: Optional[float] = None
    issue_eager: Optional[tuple] = None      # (ms, MB) measured by the issue's author
    issue_best_peer: Optional[str] = None
    target_ms: Optional[float] = None
    target_mb: Optional[float] = None


FORWARD_SHAPES = [
    ForwardShape("1x1k, 32x300", 1, 1000, 32, 300, 128, 0.018, 0.072, 0.035),
    ForwardShape("1x10k, 32x300", 1, 10000, 32, 300, 128, 0.181, 0.186, 0.19),
    ForwardShape("1x1k, 32x1024", 1, 1000, 32, 1024, 128, 0.062, 0.094, 0.07),
    ForwardShape("1x10k, 32x1030", 1, 10000, 32, 1030, 128, 0.621, 0.579, 0.58),
    ForwardShape("1x1k, 128x1024", 1, 1000, 128, 1024, 128, 0.062, 0.098, 0.075),
    ForwardShape("1x1k, 512x1024", 1, 1000, 512, 1024, 128, 0.192, 0.302, 0.23),
    ForwardShape("1x1k, 1024x1024", 1, 1000, 1024, 1024, 128, 0.383, 0.581, 0.45),
    ForwardShape("1x10k, 1024x1024", 1, 10000, 1024, 1024, 128, 3.834, 5.789, 4.4),
    ForwardShape("64x1k, 32x300", 64, 1000, 32, 300, 128, 0.225, 0.851, 0.30),
    ForwardShape("16x32, 32x8192", 16, 32, 32, 8192, 128, 0.049, 0.152, 0.07),
    ForwardShape("1x10k, 32x180, d=384", 1, 10000, 32, 180, 384, 0.326, 0.382, 0.35),
    ForwardShape("1x5k, 31x257, d=96", 1, 5000, 31, 257, 96, 0.058, 0.129, 0.08),
]

# colpali-engine 0.3.18's ColbertModule default smooth-max temperature is tau=0.1 (loss/late_interaction_losses.py)
COLPALI_SMOOTH_TAU = 0.1
# colpali-engine's ColbertLoss default logit temperature; the loss only needs to be a realistic one
CONTRASTIVE_TEMPERATURE = 0.02

TRAIN_SHAPES = [
    TrainShape("ColBERT in-batch B128, 32x300", 128, 128, 32, 300, 128, "inbatch", None,
               (2.94, 1655), "1.09 / 31", 0.30, 32),
    TrainShape("ColBERT B64 + 7 negatives (512 docs), 32x300", 64, 512, 32, 300, 128, "inbatch", None,
               (5.87, 3310), "1.23 / 117", 0.40, 64),
    TrainShape("ColPali in-batch B64, 32x1030", 64, 64, 32, 1030, 128, "inbatch", None,
               (2.45, 1417), "1.03 / 49", 0.35, 32),
    TrainShape("ColPali in-batch B256, 32x1030", 256, 256, 32, 1030, 128, "inbatch", None,
               (37.2, 22680), "4.15 / 204 (fmpypi), 5.54 / 76 (LIK)", 2.0, 64),
    TrainShape("smooth max (tau=0.1), ColPali in-batch B128, 32x1030", 128, 128, 32, 1030, 128, "inbatch",
               COLPALI_SMOOTH_TAU, (10.1, 4122), "none (eager only)", 2.0, 64),
    TrainShape("KD 64 queries x 64 candidates, 32x300", 64, 64, 32, 300, 128, "kd", None,
               (1.79, 601), "0.99 / 301", 0.40, 64),
]

# issue 7, compressed index (H200, d=128, one query, queries in bf16): time targets, and index bytes at most
# COMPRESSED_TARGET_BYTES of the bf16 index
COMPRESSED_SHAPES = [
    ForwardShape("1x10k, 32x300", 1, 10000, 32, 300, 128, target_ms=0.11),
    ForwardShape("1x10k, 32x1030", 1, 10000, 32, 1030, 128, target_ms=0.33),
    ForwardShape("1x10k, 1024x1024", 1, 10000, 1024, 1024, 128, target_ms=2.5),
]
COMPRESSED_TARGET_BYTES = 0.53

FORWARD_SWEEP_B = [1000, 3000, 10000, 30000, 100000]
FORWARD_SWEEP_B_QUICK = [1000, 10000, 100000]
TRAIN_SWEEP_B = [16, 32, 64, 128, 256]
TRAIN_SWEEP_B_QUICK = [16, 64, 256]
# Documents of 2^31 elements or more are not given to the peers: late-interaction-kernels 0.4.5 faulted (an illegal
# memory access, as 32-bit offsets past 2^31 would) on 1x100k 32x300 (3.8e9 elements; session 16, device call 8),
# and a fault ends the CUDA context for every later measurement of the run
PEER_MAX_ELEMENTS = 2**31
PEER_TOO_LARGE = ("the documents have 2^31 elements or more; late-interaction-kernels 0.4.5 faulted on such a "
                  "tensor (illegal memory access) and a fault would end this run's CUDA context")


def _smoke_name(name, Nq, B, Lq, Ld, d) -> str:
    return f"{name} [smoke: {Nq}x{B}, {Lq}x{Ld}, d={d}]"


def smoke_forward(s: ForwardShape) -> ForwardShape:
    """The same row shrunk to a size the CPU path (or the Triton interpreter) runs in milliseconds."""
    # odd lengths stay odd and d keeps its ratio to 128, so the kernels' tails are exercised too
    dims = (min(s.Nq, 3), min(s.B, 5), min(s.Lq, 9 if s.Lq % 2 == 0 else 7), min(s.Ld, 13), max(8, s.d // 4))
    return ForwardShape(_smoke_name(s.name, *dims), *dims, s.issue_floor_ms, s.issue_best_peer_ms, s.target_ms)


def smoke_train(s: TrainShape) -> TrainShape:
    Nq = min(s.Nq, 2)
    # keep the layout's structure: documents per query in-batch (1, or 8 with negatives), K candidates for KD
    B = Nq * min(max(1, s.B // s.Nq), 3) if s.layout == "inbatch" else min(s.B, 3)
    dims = (Nq, B, min(s.Lq, 9), min(s.Ld, 13), max(8, s.d // 4))
    return TrainShape(_smoke_name(s.name, *dims), *dims, s.layout, s.smooth_tau, s.issue_eager, s.issue_best_peer,
                      s.target_ms, s.target_mb)


# ----------------------------------------------------------------------------------------------------------------
# Machine: device, timing, memory, time budget
# ----------------------------------------------------------------------------------------------------------------

def _resolve_do_bench():
    """triton.testing.do_bench if it takes (warmup, rep, return_mode) as triton 3.x does (3.6 and 3.9 alike:
    ``do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean")``)."""
    try:
        from triton.testing import do_bench
    except Exception as exc:  # no triton, or a triton without a usable driver
        log.warning("triton.testing.do_bench unavailable (%s); timing with CUDA events", exc)
        return None
    params = inspect.signature(do_bench).parameters
    if not {"warmup", "rep", "return_mode"} <= set(params):
        log.warning("triton.testing.do_bench has signature %s; timing with CUDA events",
                    inspect.signature(do_bench))
        return None
    return do_bench


@contextlib.contextmanager
def l2_flushed_by_read():
    """Inside it, triton's do_bench clears the L2 before each repetition by reading its 256 MB buffer (a reduction
    into one value) instead of zeroing it: the L2 is as cold, and its lines clean."""
    from triton.runtime import driver
    active = driver.active
    total = torch.empty((), dtype=torch.int64, device="cuda")
    active.clear_cache = lambda cache: torch.sum(cache, dim=0, out=total)
    try:
        yield
    finally:
        del active.clear_cache


def l2_flush(mode: str):
    """The context do_bench is called in: its own L2 clearing ("zero") or ``l2_flushed_by_read`` ("read")."""
    return l2_flushed_by_read() if mode == "read" else contextlib.nullcontext()


L2_FLUSH_MODES = ("zero", "read")
L2_FLUSH_HELP = ("how the L2 cache is cleared before each timed call: do_bench's zeroed buffer (dirty lines, "
                 "written back inside the next measurement) or a read of it (clean lines)")


class Timer:
    """Median milliseconds of ``fn()``: triton's do_bench on CUDA (it flushes L2 before every repetition),
    CUDA events as a fallback, time.perf_counter on the CPU.

    ``l2_flush``: how do_bench clears the L2 cache before each repetition. "zero" (do_bench's own: it zeroes a
    256 MB buffer, which leaves the L2 full of dirty lines that the timed call's reads write back to HBM inside its
    measurement: ~8-9 us on the H200, session 14's benchmarks/flush_probe.py) or "read" (a reduction reads the same
    buffer: the L2 is as cold, its lines clean)."""

    def __init__(self, cuda: bool, warmup_ms: float, rep_ms: float, cpu_reps: int, l2_flush: str = "zero"):
        self.cuda, self.warmup_ms, self.rep_ms, self.cpu_reps = cuda, warmup_ms, rep_ms, cpu_reps
        self.l2_flush = l2_flush
        self._do_bench = _resolve_do_bench() if cuda else None
        self.name = "triton.testing.do_bench" if self._do_bench else ("cuda-events" if cuda else "perf_counter")
        if self._do_bench is not None and l2_flush == "read":
            self.name += ", L2 flushed by a read"

    def median_ms(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            fn()
            times = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        if self._do_bench is not None:
            try:
                with l2_flush(self.l2_flush):
                    return float(self._do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
            except (TypeError, AssertionError) as exc:  # a do_bench that rejects "median"
                log.warning("do_bench failed (%s); timing with CUDA events from now on", exc)
                self._do_bench, self.name = None, "cuda-events"
        return self._events_median(fn)

    def _events_median(self, fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 3, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / estimate))):
            fn()
        n = max(5, min(10000, int(self.rep_ms / estimate)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _interpreter_autotune_shim():
    """The peers autotune, and triton's autotuner benchmarks each config through a GPU driver that the
    interpreter lacks: for the CPU smoke test only, report increasing fake times, so the first config wins
    without being timed. Never used on the GPU."""
    from triton.runtime import autotuner
    counter = itertools.count()
    autotuner.Autotuner.do_bench = property(
        lambda self: (lambda kernel_call, quantiles=None: [float(next(counter))] * 3))


class Budget:
    """A soft wall-clock budget: once spent, the remaining measurements are recorded as skipped."""

    def __init__(self, seconds: Optional[float]):
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds


class Machine:
    def __init__(self, args):
        self.cuda = not args.cpu_smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        # The Triton interpreter mishandles bf16 in the peers' kernels (garbage scores); fp16 runs them exactly.
        self.dtype = torch.float16 if args.interpret else torch.bfloat16
        self.timer = Timer(self.cuda, args.warmup_ms, args.rep_ms, cpu_reps=args.cpu_reps, l2_flush=args.l2_flush)
        self.budget = Budget(args.budget_s if self.cuda else None)
        self.max_eager_ms = args.max_eager_ms
        self.l2_bytes = 60 * MB
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or self.l2_bytes)
            self.name = props.name
        else:
            self.name = f"CPU ({platform.processor() or platform.machine()}), smoke test"
        self.copy_bw = None     # bytes/s, measured by measure_roofline
        self.mm_flops = None    # flop/s, measured by measure_roofline
        self.mm8_rates = None   # int8 / fp8 matmul rates, measured by measure_8bit_rates (compressed section)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free_bytes(self) -> float:
        if not self.cuda:
            return float("inf")
        free, _ = torch.cuda.mem_get_info(self.device)
        # blocks cached by PyTorch's allocator are free for our purposes
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def release(self):
        if self.cuda:
            torch.cuda.empty_cache()

    def peak_extra_mb(self, fn) -> Optional[float]:
        """Peak memory allocated while ``fn()`` runs, above what was allocated before (outputs included)."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del out
        return peak / MB

    def rotation_count(self, working_set_bytes: int) -> int:
        """Distinct input copies to cycle through, so that no timed call finds its inputs warm in L2."""
        if not self.cuda or working_set_bytes >= 2 * self.l2_bytes:
            return 1
        return min(8, math.ceil(4 * self.l2_bytes / max(working_set_bytes, 1)))


def measure_roofline(m: Machine) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate, measured now."""
    if m.cuda:
        copy_elems, mm_n = 512 * MB, 8192          # 1 GiB of bf16 each way; 1.1 TFLOP
    else:
        copy_elems, mm_n = 8 * MB, 256
    src = torch.randn(copy_elems, device=m.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = m.timer.median_ms(lambda: dst.copy_(src))
    copy_bytes = 2 * src.numel() * src.element_size()
    src = dst = None  # free before the matmul buffers
    a = torch.randn(mm_n, mm_n, device=m.device).to(torch.bfloat16)
    b = torch.randn(mm_n, mm_n, device=m.device).to(torch.bfloat16)
    mm_ms = m.timer.median_ms(lambda: torch.mm(a, b))
    a = b = None
    m.release()
    m.copy_bw = copy_bytes / (copy_ms * 1e-3)
    m.mm_flops = 2 * mm_n ** 3 / (mm_ms * 1e-3)
    log.info("roofline: copy %.2f TB/s, bf16 matmul %.0f TFLOP/s", m.copy_bw / 1e12, m.mm_flops / 1e12)
    return {"copy_bytes": copy_bytes, "copy_ms": copy_ms, "copy_bw_Bps": m.copy_bw,
            "mm_n": mm_n, "mm_ms": mm_ms, "bf16_mm_flops": m.mm_flops}


def measure_8bit_rates(m: Machine) -> dict:
    """The int8 (``torch._int_mm``, int32 accumulation) and fp8 e4m3 (``torch._scaled_mm``, fast accumulation)
    matmul rates, measured now: the compute ceilings of 8-bit tensor cores for the compressed section's floors.
    None for one this torch build or device cannot run."""
    n = 8192 if m.cuda else 256
    out = {"mm8_n": n}
    gen = torch.Generator(device=m.device).manual_seed(1)
    try:
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=m.device, generator=gen)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=m.device, generator=gen)
        out["int8_mm_ops"] = 2 * n ** 3 / (m.timer.median_ms(lambda: torch._int_mm(a, b)) * 1e-3)
    except Exception as exc:
        log.warning("no int8 matmul rate: %s", _error_text(exc))
        out["int8_mm_ops"] = None
    try:
        a = torch.randn((n, n), device=m.device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn((n, n), device=m.device, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device=m.device)
        out["fp8_mm_flops"] = 2 * n ** 3 / (m.timer.median_ms(
            lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)) * 1e-3)
    except Exception as exc:
        log.warning("no fp8 matmul rate: %s", _error_text(exc))
        out["fp8_mm_flops"] = None
    a = b = None
    m.release()
    log.info("8-bit matmul: int8 %s, fp8 %s",
             *(_rate(out[k], "OP/s") if out[k] else "n/a" for k in ("int8_mm_ops", "fp8_mm_flops")))
    return out


def floor_ms(m: Machine, nbytes: float, flops: float) -> Optional[float]:
    if not m.copy_bw or not m.mm_flops:
        return None
    return max(nbytes / m.copy_bw, flops / m.mm_flops) * 1e3


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------

def unit_tokens(shape, m: Machine, gen: torch.Generator, requires_grad=False) -> torch.Tensor:
    """Random L2-normalised token embeddings (what ColBERT/ColPali models emit), generated in slabs so the
    fp32 temporaries stay small next to the result."""
    out = torch.empty(shape, dtype=m.dtype, device=m.device)
    flat = out.view(-1, shape[-1])
    step = max(1, (64 * MB) // shape[-1])
    for r0 in range(0, flat.shape[0], step):
        r1 = min(flat.shape[0], r0 + step)
        x = torch.randn((r1 - r0, shape[-1]), generator=gen, device=m.device, dtype=torch.float32)
        flat[r0:r1] = F.normalize(x, dim=-1).to(m.dtype)
    return out.requires_grad_(requires_grad)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------------------------------------------
# Scoring functions: ours, baselines (forward), eager autograd (training)
# ----------------------------------------------------------------------------------------------------------------

def _flash_maxsim():
    import flash_maxsim
    return flash_maxsim


def ours_forward(q, d):
    return _flash_maxsim().maxsim(q, d)


def torch_bf16_forward(q, d):
    """The eager PyTorch users write: the similarity tensor in the input dtype, then max and sum."""
    return torch.einsum("qid,bjd->qbij", q, d).amax(-1).sum(-1).float()


def torch_fp32_forward(q, d):
    """Eager with fp32 accumulation throughout (inputs cast to fp32; "highest" matmul precision, no TF32)."""
    return torch.einsum("qid,bjd->qbij", q.float(), d.float()).amax(-1).sum(-1)


def colpali_loop_forward(q, d, batch_size=128):
    """colpali-engine's ``BaseVisualRetrieverProcessor.score_multi_vector`` algorithm (0.3.18), re-written from
    its documented behaviour: blocks of ``batch_size`` queries x ``batch_size`` passages, each block padded into
    a fresh tensor with ``pad_sequence`` and scored as ``einsum("bnd,csd->bcns").amax(3).sum(2)`` (its torch
    backend), blocks concatenated, float32 result. Unlike the original, blocks stay on the GPU instead of being
    copied to the CPU one by one."""
    pad = torch.nn.utils.rnn.pad_sequence
    rows = []
    for i in range(0, q.shape[0], batch_size):
        qs = pad(q[i:i + batch_size], batch_first=True, padding_value=0)
        cols = []
        for j in range(0, d.shape[0], batch_size):
            ps = pad(d[j:j + batch_size], batch_first=True, padding_value=0)
            cols.append(torch.einsum("bnd,csd->bcns", qs, ps).amax(dim=3).sum(dim=2))
        rows.append(torch.cat(cols, dim=1))
    return torch.cat(rows, dim=0).float()


def eager_train_scores(layout: str, smooth_tau: Optional[float]):
    """Eager autograd scores as PyLate / colpali-engine compute them (colpali's smooth max for ``smooth_tau``)."""
    spec = "qid,qkjd->qkij" if layout == "kd" else "qid,bjd->qbij"

    def scores(q, d):
        s = torch.einsum(spec, q, d)
        if smooth_tau is None:
            return s.amax(-1).sum(-1)
        return (smooth_tau * torch.logsumexp(s / smooth_tau, dim=-1)).sum(-1)
    return scores


def ours_train_scores(layout: str, smooth_tau: Optional[float]):
    return lambda q, d: _flash_maxsim().maxsim(q, d, smooth_tau=smooth_tau)


# ----------------------------------------------------------------------------------------------------------------
# Correctness checks (first call of every shape)
# ----------------------------------------------------------------------------------------------------------------

def score_tolerance(kind: str, truth: torch.Tensor, Lq: int, dtype: torch.dtype) -> float:
    """Absolute tolerance on scores against flash_maxsim. "fp32": products of the input dtype summed in fp32
    (kernels, fp32 einsum) differ only by summation order. "lowp": the similarity tensor itself is rounded to the
    input dtype (eager bf16 einsum) and summed into a bf16 score."""
    if kind == "fp32":
        return 2e-3 + 2e-5 * Lq
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    return 2 * unit * float(truth.abs().max()) + 1e-2


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    a, b = a.detach().float(), b.detach().float()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float(a.norm())


def check_against_reference(q, d, layout: str, smooth_tau: Optional[float], train: bool) -> dict:
    """flash_maxsim against the float64 reference on a slice (2 queries x 8 documents), scores and, for training,
    gradients of a random weighting of the scores."""
    import flash_maxsim
    from flash_maxsim import reference
    qs = q.detach()[:2].clone()
    ds = (d.detach()[:2, :8] if layout == "kd" else d.detach()[:8]).clone()
    Lq = qs.shape[1]
    out = {}
    if not train:
        got = flash_maxsim.maxsim(qs, ds, smooth_tau=smooth_tau)
        want = reference.maxsim(qs, ds, smooth_tau=smooth_tau)
        out["ref_max_abs_diff"] = max_abs_diff(got, want)
        out["ref_ok"] = out["ref_max_abs_diff"] <= score_tolerance("fp32", want, Lq, qs.dtype)
        return out
    qo, do_ = qs.clone().requires_grad_(), ds.clone().requires_grad_()
    qr, dr = qs.double().requires_grad_(), ds.double().requires_grad_()
    got = flash_maxsim.maxsim(qo, do_, smooth_tau=smooth_tau)
    want = reference.maxsim(qr, dr, smooth_tau=smooth_tau)
    w = torch.randn(want.shape, dtype=torch.float64, device=want.device,
                    generator=torch.Generator(device=want.device).manual_seed(7))
    gq, gd = torch.autograd.grad((got.double() * w).sum(), (qo, do_))
    rq, rd = torch.autograd.grad((want * w).sum(), (qr, dr))
    out["ref_max_abs_diff"] = max_abs_diff(got, want)
    out["ref_grad_rel_err"] = max(rel_error(gq, rq), rel_error(gd, rd))
    out["ref_ok"] = (out["ref_max_abs_diff"] <= score_tolerance("fp32", want, Lq, qs.dtype)
                     and out["ref_grad_rel_err"] <= 2e-2)
    return out


# ----------------------------------------------------------------------------------------------------------------
# One measurement: first call (correctness), peak memory, median time
# ----------------------------------------------------------------------------------------------------------------

def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


def run_method(m: Machine, call: Callable, sets: list, check: Callable[[object], dict]) -> dict:
    """``call(*inputs)``: first on ``sets[0]`` (timed as first-call time, then checked), then its peak memory,
    then its median time cycling through every input set. Failures are recorded, never raised."""
    res: dict = {"status": "ok"}
    try:
        m.sync()
        t0 = time.perf_counter()
        out = call(*sets[0])
        m.sync()
        res["first_call_s"] = time.perf_counter() - t0
        res.update(check(out))
        del out
        if res.get("ok") is False:
            res["status"] = "wrong"
        res["peak_mb"] = m.peak_extra_mb(lambda: call(*sets[0]))
        rotation = itertools.cycle(sets)
        res["ms"] = m.timer.median_ms(lambda: call(*next(rotation)))
    except torch.cuda.OutOfMemoryError as exc:
        res = {"status": "oom", "error": _error_text(exc)[:120]}
    except Exception as exc:
        log.debug("measurement failed", exc_info=True)
        res = {"status": "error", "error": _error_text(exc)}
    m.release()
    return res


def skipped(reason: str) -> dict:
    return {"status": "skipped", "error": reason}


def interleave_rounds(m: Machine, calls: dict, results: dict, rounds: int) -> None:
    """Times ``calls`` (key -> (call, input sets): ours and each peer's chosen variant on one row) again in
    ``rounds`` alternating passes, so that drift of GPU clocks and host speed during the run hits every method
    alike, and sets each one's ``ms`` to the median of its passes (the first, sequential measurement is kept as
    ``ms_single``, the passes as ``ms_rounds``). Rows where ours and a peer sit within noise of each other
    (launch-bound calls, the bandwidth floor) otherwise read as a win or a loss by chance."""
    live = {k: v for k, v in calls.items() if results.get(k, {}).get("ms") is not None}
    if rounds < 1 or not live:
        return
    passes: dict = {k: [] for k in live}
    try:
        for _ in range(rounds):
            for key, (call, sets) in live.items():
                rotation = itertools.cycle(sets)
                passes[key].append(m.timer.median_ms(lambda: call(*next(rotation))))
    except Exception as exc:     # keep the single measurements
        log.warning("interleaved rounds failed (%s); keeping single measurements", _error_text(exc))
        return
    finally:
        m.release()
    for key, times in passes.items():
        r = results[key]
        r["ms_single"], r["ms_rounds"], r["ms"] = r["ms"], times, statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------
# Forward section
# ----------------------------------------------------------------------------------------------------------------

FORWARD_BASELINES = {
    # key: (function, tolerance class, bytes per similarity element, fp32 matmul?)
    "torch_bf16": (torch_bf16_forward, "lowp", 2, False),
    "torch_fp32": (torch_fp32_forward, "fp32", 4, True),
    "colpali_loop": (colpali_loop_forward, "lowp", 2, False),
}


def _eager_estimate(m: Machine, shape, elem_bytes: int, fp32: bool, chunk: Optional[int] = None):
    """(bytes, ms) an eager baseline needs: the similarity tensor (or one block of it) written and read back."""
    Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
    n_all = Nq * B * Lq * Ld
    n_live = n_all if chunk is None else min(Nq, chunk) * min(B, chunk) * Lq * Ld
    nbytes = n_live * elem_bytes * 1.25 + (4 * (Nq * Lq + B * Ld) * d if fp32 else 0)
    if not (m.copy_bw and m.mm_flops):
        return nbytes, 0.0
    rate = m.mm_flops / (12 if fp32 else 1)   # H200: fp32 (no TF32) runs ~1/12 of the bf16 tensor-core rate
    ms = (2 * n_all * d / rate + 2 * n_all * elem_bytes / m.copy_bw) * 1e3
    return nbytes, ms


def _too_big(m: Machine, nbytes: float, ms: float) -> Optional[str]:
    if nbytes > 0.85 * m.free_bytes():
        return f"would need ~{nbytes / 2**30:.1f} GiB (free {m.free_bytes() / 2**30:.1f} GiB)"
    if ms > m.max_eager_ms:
        return f"estimated {ms:.0f} ms per call (> --max-eager-ms {m.max_eager_ms:.0f})"
    return None


def run_forward_rows(m: Machine, shapes, method_keys, peers, peer_missing, seed=0, rounds=0) -> list[dict]:
    rows = []
    for shape in shapes:
        Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
        elem = torch.tensor([], dtype=m.dtype).element_size()
        in_bytes = (Nq * Lq + B * Ld) * d * elem
        nbytes, flops = in_bytes + Nq * B * 4, 2 * Nq * B * Lq * Ld * d
        row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "dtype": str(m.dtype),
               "bytes": nbytes, "flops": flops, "floor_ms": floor_ms(m, nbytes, flops),
               "issue_floor_ms": shape.issue_floor_ms, "issue_best_peer_ms": shape.issue_best_peer_ms,
               "target_ms": shape.target_ms, "results": {}}
        rows.append(row)
        if m.budget.spent():
            for key in method_keys:
                row["results"][key] = skipped("time budget spent")
            continue
        log.info("[%5.0fs] forward %s", m.budget.elapsed(), shape.name)
        gen = torch.Generator(device=m.device).manual_seed(seed)
        n_sets = m.rotation_count(in_bytes)
        sets = [(unit_tokens((Nq, Lq, d), m, gen), unit_tokens((B, Ld, d), m, gen)) for _ in range(n_sets)]
        row["input_sets"] = n_sets
        truth = {}

        def check_ours(out):
            truth["scores"] = out.detach().float().clone()
            r = check_against_reference(*sets[0], "inbatch", None, train=False)
            r["ok"] = r["ref_ok"]
            return r

        def check_against_ours(kind):
            def check(out):
                if "scores" not in truth:
                    return {"ok": None, "note": "unchecked: flash_maxsim produced no scores"}
                if tuple(out.shape) != tuple(truth["scores"].shape):
                    return {"ok": False, "note": f"shape {tuple(out.shape)} != {tuple(truth['scores'].shape)}"}
                diff = max_abs_diff(out, truth["scores"])
                tol = score_tolerance(kind, truth["scores"], Lq, m.dtype)
                return {"max_abs_diff": diff, "tol": tol, "ok": bool(diff <= tol)}
            return check

        calls: dict = {}    # what interleave_rounds times again: ours and each peer's chosen variant
        for key in method_keys:
            if m.budget.spent():
                row["results"][key] = skipped("time budget spent")
                continue
            if key == "ours":
                row["results"][key] = run_method(m, ours_forward, sets, check_ours)
                calls[key] = (ours_forward, sets)
            elif key in FORWARD_BASELINES:
                fn, kind, elem_bytes, fp32 = FORWARD_BASELINES[key]
                est = _eager_estimate(m, shape, elem_bytes, fp32, chunk=128 if key == "colpali_loop" else None)
                reason = _too_big(m, *est)
                row["results"][key] = skipped(reason) if reason else run_method(m, fn, sets, check_against_ours(kind))
            elif B * Ld * d >= PEER_MAX_ELEMENTS:
                row["results"][key] = skipped(PEER_TOO_LARGE)
            else:
                row["results"][key] = _run_peer_forward(m, key, peers, peer_missing, sets, check_against_ours("fp32"),
                                                        calls)
            r = row["results"][key]
            log.info("    %-14s %s", key, _brief(r))
        if not m.budget.spent():
            interleave_rounds(m, calls, row["results"], rounds)
        sets = truth = calls = None  # free this shape's inputs before the next one
        m.release()
    return rows


def _run_peer_forward(m, key, peers, peer_missing, sets, check, calls=None) -> dict:
    """The peer's fastest correct forward variant; ``calls[key]`` gets that variant (for interleave_rounds)."""
    peer = next((p for p in peers if p.key == key), None)
    if peer is None:
        return skipped(peer_missing.get(key, "not requested"))
    if not m.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return skipped("peer kernels need CUDA (or --interpret on the CPU)")
    variants, fns = {}, {}
    for name, fn in peer.forward_variants(*sets[0]):
        variants[name] = run_method(m, fn, sets, check)
        fns[name] = fn
    best = _best_variant(peer, variants)
    if calls is not None:
        calls[key] = (fns[best["variant"]], sets)
    return best


def _best_variant(peer, variants: dict) -> dict:
    """The fastest correct variant (a wrong one is reported only if no variant is right)."""
    timed = [(v["ms"], n) for n, v in variants.items() if v.get("ms") is not None and v["status"] == "ok"]
    if not timed:
        timed = [(v["ms"], n) for n, v in variants.items() if v.get("ms") is not None]
    name = min(timed)[1] if timed else next(iter(variants))
    best = dict(variants[name])
    best["variant"], best["peer"] = name, peer.label
    if len(variants) > 1:
        best["variants"] = variants
    return best


def _brief(r: dict) -> str:
    if r.get("ms") is None:
        return f"{r['status']}: {r.get('error', '')}"
    mem = "" if r.get("peak_mb") is None else f" {r['peak_mb']:.1f} MB"
    diff = "" if r.get("max_abs_diff") is None else f" diff {r['max_abs_diff']:.2e}"
    ref = "" if r.get("ref_max_abs_diff") is None else f" ref-diff {r['ref_max_abs_diff']:.2e}"
    return f"{r['ms']:.4f} ms{mem}{diff}{ref} [{r['status']}]"


# ----------------------------------------------------------------------------------------------------------------
# Training section
# ----------------------------------------------------------------------------------------------------------------

def _loss_fn(shape: TrainShape, m: Machine, gen: torch.Generator):
    """In-batch contrastive cross-entropy (the positive of query i is document i*B/Nq), or KL divergence to
    fixed random teacher scores over each query's candidates (PyLate's distillation)."""
    if shape.layout == "kd":
        teacher = torch.randn((shape.Nq, shape.B), generator=gen, device=m.device).log_softmax(-1)
        return lambda s: F.kl_div(s.float().log_softmax(-1), teacher, log_target=True, reduction="batchmean")
    labels = torch.arange(shape.Nq, device=m.device) * (shape.B // shape.Nq)
    return lambda s: F.cross_entropy(s.float() / CONTRASTIVE_TEMPERATURE, labels)


def _train_step(score_fn, loss_fn):
    def step(q, d):
        s = score_fn(q, d)
        gq, gd = torch.autograd.grad(loss_fn(s), (q, d))
        return s, gq, gd
    return step


def _graphed_step_ms(m: Machine, step, inputs) -> dict:
    """The step captured in a CUDA graph and replayed: the GPU's time for it, without Python or launches.
    ``{"graph_ms": ...}``, or ``{"graph_error": ...}`` for a step that does not capture."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):       # warm-up off the capture (first-call compilation, allocator pools)
            for _ in range(3):
                step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(*inputs)
        return {"graph_ms": m.timer.median_ms(graph.replay)}
    except Exception as exc:
        log.debug("CUDA graph capture failed", exc_info=True)
        return {"graph_error": _error_text(exc)[:120]}
    finally:
        graph = None
        m.release()


def _pytorch_share_ms(m: Machine, shape: TrainShape, loss_fn) -> float:
    """PyTorch's part of a step alone, eager: the loss and ``autograd.grad`` over a leaf tensor of scores
    ([Nq, C] fp32). No scoring function can make a step faster than this on the same host."""
    leaf = torch.zeros((shape.Nq, shape.B), device=m.device, requires_grad=True)
    return m.timer.median_ms(lambda: torch.autograd.grad(loss_fn(leaf), leaf))


def run_training_rows(m: Machine, shapes, method_keys, peers, peer_missing, seed=0, rounds=0) -> list[dict]:
    rows = []
    for shape in shapes:
        Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
        C = B                                   # score columns per query
        n_docs = Nq * B if shape.layout == "kd" else B
        elem = torch.tensor([], dtype=m.dtype).element_size()
        in_bytes = (Nq * Lq + n_docs * Ld) * d * elem
        n_sim = Nq * C * Lq * Ld
        # read the inputs in the forward and again in the backward, write both gradients; the hard max needs
        # one pass of products, the smooth max four (forward, recomputation, and the two gradient products)
        nbytes = 3 * in_bytes + 2 * Nq * C * 4
        flops = (8 if shape.smooth_tau is not None else 2) * n_sim * d
        row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "layout": shape.layout,
               "smooth_tau": shape.smooth_tau, "dtype": str(m.dtype), "bytes": nbytes, "flops": flops,
               "floor_ms": floor_ms(m, nbytes, flops), "issue_eager": shape.issue_eager,
               "issue_best_peer": shape.issue_best_peer, "target_ms": shape.target_ms,
               "target_mb": shape.target_mb, "results": {}}
        rows.append(row)
        if m.budget.spent():
            for key in method_keys:
                row["results"][key] = skipped("time budget spent")
            continue
        log.info("[%5.0fs] training %s", m.budget.elapsed(), shape.name)
        gen = torch.Generator(device=m.device).manual_seed(seed)
        doc_shape = (Nq, B, Ld, d) if shape.layout == "kd" else (B, Ld, d)
        n_sets = m.rotation_count(in_bytes)
        sets = [(unit_tokens((Nq, Lq, d), m, gen, True), unit_tokens(doc_shape, m, gen, True))
                for _ in range(n_sets)]
        row["input_sets"] = n_sets
        loss_fn = _loss_fn(shape, m, gen)
        truth = {}

        def check_ours(out):
            s, gq, gd = out
            truth.update(scores=s.detach().float().clone(), gq=gq.float().clone(), gd=gd.float().clone())
            r = check_against_reference(*sets[0], shape.layout, shape.smooth_tau, train=True)
            r["ok"] = r["ref_ok"]
            return r

        def check_against_ours(kind, grad_limit):
            def check(out):
                s, gq, gd = out
                if "scores" not in truth:
                    return {"ok": None, "note": "unchecked: flash_maxsim produced no result"}
                if tuple(s.shape) != tuple(truth["scores"].shape):
                    return {"ok": False, "note": f"shape {tuple(s.shape)} != {tuple(truth['scores'].shape)}"}
                diff = max_abs_diff(s, truth["scores"])
                tol = score_tolerance(kind, truth["scores"], Lq, m.dtype)
                grad_err = max(rel_error(gq, truth["gq"]), rel_error(gd, truth["gd"]))
                return {"max_abs_diff": diff, "tol": tol, "grad_rel_err": grad_err, "grad_tol": grad_limit,
                        "ok": bool(diff <= tol and grad_err <= grad_limit)}
            return check

        calls: dict = {}    # what interleave_rounds times again: ours and the peers
        for key in method_keys:
            if m.budget.spent():
                row["results"][key] = skipped("time budget spent")
                continue
            if key == "ours":
                step = _train_step(ours_train_scores(shape.layout, shape.smooth_tau), loss_fn)
                row["results"][key] = run_method(m, step, sets, check_ours)
                calls[key] = (step, sets)
            elif key == "eager":
                # autograd keeps the similarity tensor and builds its gradient: ~12 bytes per element (issue 3's
                # measurements: 10.5 for the hard max, 7.6 for the smooth max)
                nbytes_est = 12 * n_sim
                ms_est = ((3 * 2 * n_sim * d / m.mm_flops + 12 * n_sim / m.copy_bw) * 1e3
                          if m.copy_bw and m.mm_flops else 0.0)
                reason = _too_big(m, nbytes_est, ms_est)
                step = _train_step(eager_train_scores(shape.layout, shape.smooth_tau), loss_fn)
                # bf16 similarities tie often and amax splits the gradient among ties: gradients are compared
                # loosely (a wrong gradient is off by O(1))
                row["results"][key] = skipped(reason) if reason else \
                    run_method(m, step, sets, check_against_ours("lowp", 0.5))
            else:
                peer = next((p for p in peers if p.key == key), None)
                if peer is None:
                    row["results"][key] = skipped(peer_missing.get(key, "not requested"))
                elif not m.cuda and os.environ.get("TRITON_INTERPRET") != "1":
                    row["results"][key] = skipped("peer kernels need CUDA (or --interpret on the CPU)")
                else:
                    score_fn = peer.train_scores(shape.layout, shape.smooth_tau)
                    if score_fn is None:
                        missing = "smooth max" if shape.smooth_tau is not None else f"{shape.layout} training path"
                        row["results"][key] = skipped(f"{peer.label} has no {missing}")
                    else:
                        step = _train_step(score_fn, loss_fn)
                        r = run_method(m, step, sets, check_against_ours("fp32", 2e-2))
                        r["peer"] = peer.label
                        row["results"][key] = r
                        calls[key] = (step, sets)
            log.info("    %-14s %s", key, _brief(row["results"][key]))
        if not m.budget.spent():
            interleave_rounds(m, calls, row["results"], rounds)
        if m.cuda and not m.budget.spent():
            # where the eager step's time goes: the GPU's share (each step in a CUDA graph) and PyTorch's
            row["pytorch_share_ms"] = _pytorch_share_ms(m, shape, loss_fn)
            for key, (step, step_sets) in calls.items():
                if row["results"][key].get("ms") is not None:
                    row["results"][key].update(_graphed_step_ms(m, step, step_sets[0]))
        sets = truth = calls = None  # free this shape's inputs before the next one
        m.release()
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Compressed-index section (issue 7): 8-bit document indexes, ours and the peers'
# ----------------------------------------------------------------------------------------------------------------

COMPRESSED_METHODS = ("ours_int8", "ours_fp8", "ours_exact", "fmpypi", "lik")
# The 8-bit paths multiply 8-bit values on tensor cores; LIK's fp8 products are accumulated by Hopper's fp8 MMA
# with fewer than fp32's bits. Their scores are checked against the float64 reference on the operands they
# actually multiply within the fp32 tolerance plus this fraction of max |score|: a wrong scale or a skipped tile
# is off by far more.
COMPRESSED_CHECK_REL_TOL = 5e-4
COMPRESSED_CHECK_DOCS = 8
# documents whose float64 scores (unquantised inputs) measure each path's fidelity: up to 1000, fewer for long
# queries and documents, so that the float64 products stay near 3e10 multiply-adds (a second or two on the GPU)
FIDELITY_MAX_DOCS = 1000
FIDELITY_MACS = 3e10


def ours_compressed_variant(kind: str) -> CompressedVariant:
    """flash_maxsim on an int8 / fp8 index from ``flash_maxsim.quantize`` (an int8 index with d <= 256 quantises
    the queries too: docs/semantics.md), or, for ``kind="exact"``, on the unquantised documents."""
    fm = _flash_maxsim()
    if kind == "exact":
        return CompressedVariant("maxsim(queries, documents)", prepare=lambda q, d: (q, d), call=fm.maxsim,
                                 index_nbytes=lambda inputs: tensor_bytes(inputs[1]),
                                 dequantized=lambda inputs, n: (inputs[0].double(), inputs[1][:n].double()))

    def dequantized(inputs, n_docs):
        from flash_maxsim.quantization import queries_as_scored
        q, qd = inputs
        return (queries_as_scored(q, qd).double(),
                qd.values[:n_docs].double() * qd.scales[:n_docs, :, None].double())

    return CompressedVariant(f"maxsim(queries, quantize(documents, dtype={kind!r}))",
                             prepare=lambda q, d: (q, fm.quantize(d, dtype=kind)), call=fm.maxsim,
                             index_nbytes=lambda inputs: inputs[1].nbytes, dequantized=dequantized)


def exact_scores(q: torch.Tensor, d: torch.Tensor, n_docs: int) -> torch.Tensor:
    """float64 reference scores ``[Nq, n_docs]`` of the unquantised queries and first ``n_docs`` documents."""
    from flash_maxsim import reference
    Nq, Lq, _ = q.shape
    chunk = max(1, (32 * MB) // (Nq * Lq * d.shape[1]))       # the reference's float64 similarities: ~256 MB
    return torch.cat([reference.maxsim(q, d[i:min(i + chunk, n_docs)]) for i in range(0, n_docs, chunk)], dim=1)


def _compressed_check(m: Machine, variant: CompressedVariant, inputs: tuple, exact: torch.Tensor, shape):
    """The check of a compressed path's first call: its arithmetic (scores against the float64 reference on the
    very operands it multiplies, first 2 queries x 8 documents) and its fidelity (scores against the float64
    scores of the unquantised documents, relative to max |score|)."""
    from flash_maxsim import reference

    def check(out):
        out = out.detach()
        want_shape = (shape.Nq, shape.B)
        if tuple(out.shape) != want_shape:
            return {"ok": False, "note": f"shape {tuple(out.shape)} != {want_shape}"}
        res = {}
        note = variant.note()
        if note:
            res["note"], res["fallback"] = note, True
        n = min(shape.B, COMPRESSED_CHECK_DOCS)
        q64, d64 = variant.dequantized(inputs, n)
        truth = reference.maxsim(q64[:2], d64)
        res["max_abs_diff"] = max_abs_diff(out[:2, :n], truth)
        if note:   # a fallback to a dequantise-to-bf16 path rounds every product to bf16
            res["tol"] = score_tolerance("lowp", truth, shape.Lq, torch.bfloat16)
        else:
            res["tol"] = (score_tolerance("fp32", truth, shape.Lq, m.dtype)
                          + COMPRESSED_CHECK_REL_TOL * float(truth.abs().max()))
        res["ok"] = bool(res["max_abs_diff"] <= res["tol"])
        err = (out[:, :exact.shape[1]].double() - exact).abs()
        top = float(exact.abs().max()) or 1.0
        res.update(fid_max_rel_err=float(err.max()) / top, fid_mean_rel_err=float(err.mean()) / top,
                   fid_docs=int(exact.shape[1]))
        return res
    return check


def _run_compressed_variant(m: Machine, variant: CompressedVariant, sets, exact, shape, unquantised_bytes,
                            keep: Optional[dict] = None) -> dict:
    """Index-time preparation (untimed), then :func:`run_method` on the prepared inputs. ``keep`` (optional) gets
    ``variant.name -> (call, prepared inputs)`` of a timed variant, for :func:`interleave_rounds`."""
    try:
        m.sync()
        t0 = time.perf_counter()
        prepared = [variant.prepare(q, d) for q, d in sets]
        m.sync()
        prepare_s = time.perf_counter() - t0
        index_bytes = int(variant.index_nbytes(prepared[0]))
    except torch.cuda.OutOfMemoryError as exc:
        m.release()
        return {"status": "oom", "error": _error_text(exc)[:120]}
    except Exception as exc:
        log.debug("preparation failed", exc_info=True)
        m.release()
        return {"status": "error", "error": "preparing the index: " + _error_text(exc)}
    r = run_method(m, variant.call, prepared, _compressed_check(m, variant, prepared[0], exact, shape))
    r.update(prepare_s=prepare_s, index_bytes=index_bytes, bytes_ratio=index_bytes / unquantised_bytes,
             memory_floor_ms=index_bytes / m.copy_bw * 1e3 if m.copy_bw else None)
    if keep is not None and r.get("ms") is not None:
        keep[variant.name] = (variant.call, prepared)
    prepared = None
    m.release()
    return r


def run_compressed_rows(m: Machine, shapes, method_keys, peers, peer_missing, seed=0,
                        skip_variants=(), rounds=0) -> list[dict]:
    rows = []
    rates = m.mm8_rates or {}
    for shape in shapes:
        Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
        elem = torch.tensor([], dtype=m.dtype).element_size()
        unquantised_bytes = B * Ld * d * elem
        int8_bytes = B * Ld * (d + 2)                 # int8 values + one bf16 scale per token (session 27)
        flops = 2 * Nq * B * Lq * Ld * d
        compute = {"bf16": m.mm_flops, "int8": rates.get("int8_mm_ops"), "fp8": rates.get("fp8_mm_flops")}
        row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "dtype": str(m.dtype),
               "flops": flops, "unquantised_bytes": unquantised_bytes, "int8_index_bytes": int8_bytes,
               "memory_floor_ms": {k: (v / m.copy_bw * 1e3 if m.copy_bw else None)
                                   for k, v in (("unquantised", unquantised_bytes), ("int8", int8_bytes))},
               "compute_floor_ms": {k: (flops / v * 1e3 if v else None) for k, v in compute.items()},
               "target_ms": shape.target_ms, "target_bytes_ratio": COMPRESSED_TARGET_BYTES, "results": {}}
        rows.append(row)
        if m.budget.spent():
            for key in method_keys:
                row["results"][key] = skipped("time budget spent")
            continue
        log.info("[%5.0fs] compressed %s", m.budget.elapsed(), shape.name)
        gen = torch.Generator(device=m.device).manual_seed(seed)
        n_sets = m.rotation_count((Nq * Lq * d) * elem + B * Ld * (d + 4))
        sets = [(unit_tokens((Nq, Lq, d), m, gen), unit_tokens((B, Ld, d), m, gen)) for _ in range(n_sets)]
        row["input_sets"] = n_sets
        n_fid = int(min(B, FIDELITY_MAX_DOCS, max(64, FIDELITY_MACS // (Nq * Lq * Ld * d))))
        try:
            exact = exact_scores(*sets[0], n_fid)
        except torch.cuda.OutOfMemoryError:
            m.release()
            n_fid = min(B, 64)
            exact = exact_scores(*sets[0], n_fid)
        calls: dict = {}    # what interleave_rounds times again: each of ours and each peer's chosen variant
        for key in method_keys:
            if m.budget.spent():
                row["results"][key] = skipped("time budget spent")
                continue
            if key.startswith("ours_"):
                variant = ours_compressed_variant(key[len("ours_"):])
                kept: dict = {}
                r = _run_compressed_variant(m, variant, sets, exact, shape, unquantised_bytes, kept)
                r["variant"] = variant.name
                row["results"][key] = r
                if variant.name in kept:
                    calls[key] = kept[variant.name]
            else:
                row["results"][key] = _run_peer_compressed(m, key, peers, peer_missing, sets, exact, shape,
                                                           unquantised_bytes, skip_variants, calls)
            log.info("    %-14s %s", key, _brief_compressed(row["results"][key]))
        if not m.budget.spent():
            interleave_rounds(m, calls, row["results"], rounds)
        sets = exact = calls = None  # free this shape's inputs (and prepared indexes) before the next one
        m.release()
    return rows


def _run_peer_compressed(m, key, peers, peer_missing, sets, exact, shape, unquantised_bytes,
                         skip_variants=(), calls=None) -> dict:
    """The peer's fastest correct compressed variant; ``calls[key]`` gets that variant's call and prepared inputs
    (for interleave_rounds)."""
    peer = next((p for p in peers if p.key == key), None)
    if peer is None:
        return skipped(peer_missing.get(key, "not requested"))
    if not m.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return skipped("peer kernels need CUDA (or --interpret on the CPU)")
    try:
        variants = peer.compressed_variants(shape.Nq)
    except Exception as exc:
        return {"status": "error", "error": f"{peer.label} compressed path: {_error_text(exc)}"}
    if not variants:
        return skipped(f"{peer.label} has no compressed path for {shape.Nq} queries at once")
    if all(any(text in v.name for text in skip_variants) for v in variants):
        return skipped(f"every {peer.label} variant matched --skip-compressed-variants")
    results, kept = {}, {}
    for v in variants:
        if any(text in v.name for text in skip_variants):
            continue
        if m.budget.spent():
            results[v.name] = skipped("time budget spent")
            continue
        results[v.name] = _run_compressed_variant(m, v, sets, exact, shape, unquantised_bytes, kept)
        log.debug("      %s: %s", v.name, _brief_compressed(results[v.name]))
    best = _best_variant(peer, results)
    if calls is not None and best["variant"] in kept:
        calls[key] = kept[best["variant"]]
    return best


def _brief_compressed(r: dict) -> str:
    text = _brief(r)
    if r.get("bytes_ratio") is not None:
        text += f" bytes {r['bytes_ratio']:.3f}x"
    if r.get("fid_max_rel_err") is not None:
        text += f" fidelity err {r['fid_max_rel_err']:.2e}"
    if r.get("variant") and r.get("peer"):
        text += f" ({r['variant']})"
    return text


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------

LABELS = {
    "ours": "flash_maxsim",
    "torch_bf16": "eager bf16",
    "torch_fp32": "eager fp32",
    "colpali_loop": "colpali loop",
    "eager": "eager autograd",
    "lik": "LIK",
    "fmpypi": "flash-maxsim",
}
PEER_METHODS = ("lik", "fmpypi")


def _label(key: str) -> str:
    return _LABEL_OVERRIDES.get(key, LABELS[key])


_LABEL_OVERRIDES: dict = {}   # the peers' labels with the versions of the run being rendered


def _set_labels(meta: dict) -> None:
    _LABEL_OVERRIDES.clear()
    for key, label in (meta.get("peers") or {}).items():
        version = label.rsplit(" ", 1)[-1]
        if key in LABELS:
            _LABEL_OVERRIDES[key] = f"{LABELS[key]} {version}"


def _rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _fmt_mb(x: Optional[float]) -> str:
    if x is None:
        return "–"
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


class _Notes:
    """Footnotes for cells that hold no plain number (skipped, failed, flagged as wrong)."""

    def __init__(self):
        self.items: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"

    def render(self) -> list[str]:
        """The footnotes, preceded by a blank line, or nothing."""
        return ([""] + [f"[{i + 1}] {t}  " for i, t in enumerate(self.items)]) if self.items else []


def _cell(r: Optional[dict], notes: _Notes, value: str) -> str:
    if r is None:
        return "–"
    if r["status"] == "skipped":
        return "skip " + notes.mark(f"skipped: {r.get('error', '')}")
    if r["status"] in ("error", "oom"):
        return r["status"] + " " + notes.mark(f"{r['status']}: {r.get('error', '')}")
    if r["status"] == "wrong":
        return value + " ✗" + notes.mark(f"✗ = result differs from flash_maxsim beyond tolerance ({_diff_text(r)})")
    if r["status"] == "ok" and r.get("ok") is None and r.get("note"):
        return value + " " + notes.mark(r["note"])
    return value


def _diff_text(r: dict) -> str:
    parts = []
    if r.get("max_abs_diff") is not None:
        parts.append(f"max |Δscore| {r['max_abs_diff']:.3g} > tol {r['tol']:.3g}" if r['max_abs_diff'] > r['tol']
                     else f"max |Δscore| {r['max_abs_diff']:.3g}")
    if r.get("grad_rel_err") is not None:
        parts.append(f"gradient rel. error {r['grad_rel_err']:.3g} (tol {r['grad_tol']:.3g})")
    if r.get("ref_max_abs_diff") is not None:
        parts.append(f"vs float64 reference {r['ref_max_abs_diff']:.3g}")
    if r.get("note"):
        parts.append(r["note"])
    return ", ".join(parts)


def _best_peer(row: dict, field: str = "ms") -> Optional[tuple]:
    """(value, key) of the best correct peer for ``field``."""
    vals = [(r[field], k) for k, r in row["results"].items()
            if k in PEER_METHODS and r.get("status") == "ok" and r.get(field) is not None]
    return min(vals) if vals else None


def _ours(row) -> dict:
    return row["results"].get("ours") or {}


def forward_table(rows: list[dict]) -> list[str]:
    keys = [k for k in LABELS if any(k in r["results"] for r in rows)]
    notes = _Notes()
    head = ["shape (queries×docs, Lq×Ld)"] + [_label(k) for k in keys] + \
        ["floor", "ours / best peer", "% of floor", "target", "met?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, _fmt_ms(r.get("ms") if r else None)))
        ours = _ours(row)
        best = _best_peer(row)
        ours_ms = ours.get("ms") if ours.get("status") == "ok" else None
        cells.append(_fmt_ms(row.get("floor_ms")))
        cells.append(f"{ours_ms / best[0]:.2f}" if ours_ms and best else "–")
        cells.append(f"{100 * row['floor_ms'] / ours_ms:.0f}%" if ours_ms and row.get("floor_ms") else "–")
        cells.append(f"≤ {row['target_ms']}" if row.get("target_ms") else "–")
        cells.append(_forward_met(row, ours_ms, best))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + notes.render()


def _forward_met(row, ours_ms, best) -> str:
    if ours_ms is None:
        return "no (no result)" if _ours(row).get("status") != "wrong" else "no (wrong)"
    misses = []
    if row.get("target_ms") is not None and ours_ms > row["target_ms"]:
        misses.append("target")
    if best is not None and ours_ms > best[0]:
        misses.append("peer")
    return "yes" if not misses else "no (" + ", ".join(misses) + ")"


def forward_memory_table(rows: list[dict]) -> list[str]:
    keys = [k for k in LABELS if any(k in r["results"] for r in rows)]
    notes = _Notes()
    head = ["shape"] + [_label(k) for k in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, _fmt_mb(r.get("peak_mb") if r else None)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + notes.render()


def training_table(rows: list[dict]) -> list[str]:
    keys = [k for k in ("ours", "eager", "fmpypi", "lik") if any(k in r["results"] for r in rows)]
    notes = _Notes()
    head = ["training step"] + [_label(k) + " ms / MB" for k in keys] + \
        ["floor ms", "ours / best peer", "% of floor", "target ms / MB", "met?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, f"{_fmt_ms(r.get('ms'))} / {_fmt_mb(r.get('peak_mb'))}" if r else "–"))
        ours = _ours(row)
        ours_ms = ours.get("ms") if ours.get("status") == "ok" else None
        best = _best_peer(row)
        cells.append(_fmt_ms(row.get("floor_ms")))
        cells.append(f"{ours_ms / best[0]:.2f}" if ours_ms and best else "–")
        cells.append(f"{100 * row['floor_ms'] / ours_ms:.0f}%" if ours_ms and row.get("floor_ms") else "–")
        cells.append(f"≤ {row['target_ms']} / ≤ {row['target_mb']}" if row.get("target_ms") else "–")
        cells.append(_training_met(row, ours, ours_ms, best))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + notes.render()


def training_graph_table(rows: list[dict]) -> list[str]:
    """GPU time of each method's step captured in a CUDA graph, beside PyTorch's share of the eager step (the loss
    and autograd over a leaf tensor of scores): the two bounds of a host-bound step."""
    rows = [r for r in rows if r.get("pytorch_share_ms") is not None
            or any(v.get("graph_ms") is not None for v in r["results"].values())]
    if not rows:
        return []
    keys = [k for k in ("ours", "fmpypi", "lik") if any(k in r["results"] for r in rows)]
    head = ["training step"] + [_label(k) + " GPU ms" for k in keys] + \
        ["ours / best peer", "ours eager ms", "PyTorch's share, eager ms", "target ms", "GPU time meets it?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k) or {}
            cells.append(_fmt_ms(r["graph_ms"]) if r.get("graph_ms") is not None
                         else ("no graph" if r.get("graph_error") else "–"))
        ours = row["results"].get("ours") or {}
        ours_gpu = ours.get("graph_ms")
        peers = [row["results"][k]["graph_ms"] for k in keys if k != "ours"
                 and (row["results"].get(k) or {}).get("graph_ms") is not None]
        cells.append(f"{ours_gpu / min(peers):.2f}" if ours_gpu and peers else "–")
        cells.append(_fmt_ms(ours.get("ms")))
        cells.append(_fmt_ms(row.get("pytorch_share_ms")))
        cells.append(f"≤ {row['target_ms']}" if row.get("target_ms") else "–")
        cells.append("–" if ours_gpu is None or not row.get("target_ms")
                     else ("yes" if ours_gpu <= row["target_ms"] else "no"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _training_met(row, ours, ours_ms, best) -> str:
    if ours_ms is None:
        return "no (wrong)" if ours.get("status") == "wrong" else "no (no result)"
    misses = []
    if row.get("target_ms") is not None and ours_ms > row["target_ms"]:
        misses.append("time target")
    mb = ours.get("peak_mb")
    if row.get("target_mb") is not None and mb is not None and mb > row["target_mb"]:
        misses.append("memory target")
    if best is not None and ours_ms > best[0]:
        misses.append("slower than a peer")
    leanest = _best_peer(row, "peak_mb")
    if leanest is not None and mb is not None and mb > leanest[0]:
        misses.append("more memory than a peer")
    eager = row["results"].get("eager", {})
    if row.get("smooth_tau") is not None and eager.get("status") == "ok" and eager.get("ms") is not None \
            and 4 * ours_ms > eager["ms"]:
        misses.append("< 4x eager")
    return "yes" if not misses else "no (" + ", ".join(misses) + ")"


def correctness_table(rows: list[dict], train: bool) -> list[str]:
    keys = [k for k in LABELS if any(k in r["results"] for r in rows)]
    head = ["shape", "flash_maxsim vs float64 ref"] + [_label(k) for k in keys if k != "ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ours = _ours(row)
        ref = "–"
        if ours.get("ref_max_abs_diff") is not None:
            ref = f"{ours['ref_max_abs_diff']:.2g}"
            if ours.get("ref_grad_rel_err") is not None:
                ref += f" / {ours['ref_grad_rel_err']:.2g}"
            ref += "" if ours.get("ref_ok") else " ✗"
        cells = [row["name"], ref]
        for k in keys:
            if k == "ours":
                continue
            r = row["results"].get(k, {})
            if r.get("max_abs_diff") is None:
                cells.append("–")
                continue
            c = f"{r['max_abs_diff']:.2g}"
            if train and r.get("grad_rel_err") is not None:
                c += f" / {r['grad_rel_err']:.2g}"
            cells.append(c + ("" if r.get("ok") else " ✗"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def sweep_table(rows: list[dict], axis: str, train: bool) -> list[str]:
    keys = [k for k in LABELS if any(k in r["results"] for r in rows)]
    unit = "ms / MB"
    head = [axis] + [f"{_label(k)} {unit}" for k in keys] + ["floor ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = _Notes()
    for row in rows:
        cells = [str(row["B"])]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, f"{_fmt_ms(r.get('ms'))} / {_fmt_mb(r.get('peak_mb'))}" if r else "–"))
        cells.append(_fmt_ms(row.get("floor_ms")))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + notes.render()


COMPRESSED_LABELS = {
    "ours_int8": "flash_maxsim int8",
    "ours_fp8": "flash_maxsim fp8",
    "ours_exact": "flash_maxsim, unquantised (reference)",
    "fmpypi": "flash-maxsim",
    "lik": "LIK",
}
COMPRESSED_PEER_KINDS = {"fmpypi": "int8×int8", "lik": "fp8"}


def _compressed_label(key: str) -> str:
    if key in COMPRESSED_PEER_KINDS:
        return f"{_label(key)} {COMPRESSED_PEER_KINDS[key]}"
    return COMPRESSED_LABELS[key]


def _compressed_cell(r: Optional[dict], notes: _Notes, value: str) -> str:
    if r is None:
        return "–"
    if r["status"] == "skipped":
        return "skip " + notes.mark(f"skipped: {r.get('error', '')}")
    if r["status"] in ("error", "oom"):
        return r["status"] + " " + notes.mark(f"{r['status']}: {r.get('error', '')}")
    marks = ""
    if r["status"] == "wrong" or r.get("ok") is False:
        marks += " ✗" + notes.mark("✗ = its scores differ from the float64 reference on the operands it multiplies "
                                   "beyond tolerance (see the check table)")
    if r.get("note"):
        marks += " " + notes.mark(r["note"])
    return value + marks


def _fmt_err(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.1e}"


def _compressed_met(row: dict, key: str) -> str:
    r = row["results"].get(key) or {}
    if r.get("status") != "ok" or r.get("ms") is None:
        return "no (wrong)" if r.get("status") == "wrong" else "no (no result)"
    misses = []
    if row.get("target_ms") is not None and r["ms"] > row["target_ms"]:
        misses.append("time")
    if r.get("bytes_ratio") is not None and r["bytes_ratio"] > row["target_bytes_ratio"]:
        misses.append("bytes")
    for peer in PEER_METHODS:
        p = row["results"].get(peer) or {}
        # a peer that fell back to a non-8-bit path was not measured on its compressed path
        if p.get("status") == "ok" and not p.get("fallback") and p.get("ms") is not None and p["ms"] < r["ms"]:
            misses.append(f"slower than {_label(peer)}")
    return "yes" if not misses else "no (" + ", ".join(misses) + ")"


def compressed_table(rows: list[dict]) -> list[str]:
    notes = _Notes()
    head = ["shape", "method", "median ms", "index bytes ÷ unquantised", "memory floor ms", "% of memory floor",
            "max score error ÷ max score", "target", "met?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        first = True
        for key in [k for k in COMPRESSED_METHODS if k in row["results"]]:
            r = row["results"][key]
            method = _compressed_label(key)
            if key in PEER_METHODS and r.get("variant"):
                method += f" ({r['variant']})"
            ms, floor = r.get("ms"), r.get("memory_floor_ms")
            targeted = key in ("ours_int8", "ours_fp8")
            target = (f"≤ {row['target_ms']} ms, ≤ {row['target_bytes_ratio']}×"
                      if targeted and row.get("target_ms") is not None else "–")
            cells = [row["name"] if first else "", method, _compressed_cell(r, notes, _fmt_ms(ms)),
                     "–" if r.get("bytes_ratio") is None else f"{r['bytes_ratio']:.3f}",
                     _fmt_ms(floor), f"{100 * floor / ms:.0f}%" if ms and floor else "–",
                     _fmt_err(r.get("fid_max_rel_err")), target,
                     _compressed_met(row, key) if targeted else "–"]
            lines.append("| " + " | ".join(cells) + " |")
            first = False
    return lines + notes.render()


def compressed_floors_table(rows: list[dict]) -> list[str]:
    # the int8 index's bytes per token as the run counted them (d + 4 with fp32 scales, before session 27)
    scale_bytes = {row["int8_index_bytes"] // (row["B"] * row["Ld"]) - row["d"] for row in rows} or {2}
    head = ["shape", "GFLOP", "memory floor: unquantised index",
            f"memory floor: int8 index (d + {'/'.join(map(str, sorted(scale_bytes)))} B/token)",
            "compute floor at the bf16 rate", "at the int8 rate", "at the fp8 rate", "time target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        mem, comp = row.get("memory_floor_ms") or {}, row.get("compute_floor_ms") or {}
        lines.append("| " + " | ".join([
            row["name"], f"{row['flops'] / 1e9:.3g}", _fmt_ms(mem.get("unquantised")), _fmt_ms(mem.get("int8")),
            _fmt_ms(comp.get("bf16")), _fmt_ms(comp.get("int8")), _fmt_ms(comp.get("fp8")),
            f"≤ {row['target_ms']}" if row.get("target_ms") is not None else "–"]) + " |")
    return lines


def compressed_checks_table(rows: list[dict]) -> list[str]:
    head = ["shape", "method", "check: max abs. score difference from float64 on its own operands (tolerance)",
            "fidelity: max / mean score error ÷ max score (documents)", "peak MB above inputs",
            "index build s (untimed)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        first = True
        for key in [k for k in COMPRESSED_METHODS if k in row["results"]]:
            r = row["results"][key]
            check = "–" if r.get("max_abs_diff") is None else \
                f"{r['max_abs_diff']:.2g} ({r['tol']:.2g}){'' if r.get('ok') else ' ✗'}"
            fid = "–" if r.get("fid_max_rel_err") is None else \
                f"{r['fid_max_rel_err']:.1e} / {r['fid_mean_rel_err']:.1e} ({r['fid_docs']})"
            lines.append("| " + " | ".join([
                row["name"] if first else "", _compressed_label(key), check, fid, _fmt_mb(r.get("peak_mb")),
                "–" if r.get("prepare_s") is None else f"{r['prepare_s']:.2f}"]) + " |")
            first = False
    return lines


def compressed_variants_table(rows: list[dict]) -> list[str]:
    """Every variant of every peer, the fastest correct one of which is the peer's line in the main table."""
    notes = _Notes()
    head = ["shape", "peer variant", "median ms", "index bytes ÷ unquantised", "max score error ÷ max score"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    count = 0
    for row in rows:
        first = True
        for key in [k for k in PEER_METHODS if k in row["results"]]:
            for name, r in (row["results"][key].get("variants") or {}).items():
                lines.append("| " + " | ".join([
                    row["name"] if first else "", f"{_compressed_label(key)}: {name}",
                    _compressed_cell(r, notes, _fmt_ms(r.get("ms"))),
                    "–" if r.get("bytes_ratio") is None else f"{r['bytes_ratio']:.3f}",
                    _fmt_err(r.get("fid_max_rel_err"))]) + " |")
                first, count = False, count + 1
    return (lines + notes.render()) if count else []


def _passes_text(res: dict) -> str:
    """Which sections' rows were timed again in alternating passes (read from the results themselves: a merged
    file's sections may come from runs made with and without them)."""
    passes, names = set(), []
    for key, name in (("forward", "forward"), ("training", "training"), ("compressed", "compressed-index")):
        counts = {len(r["ms_rounds"]) for row in res.get(key) or [] for r in row["results"].values()
                  if isinstance(r, dict) and r.get("ms_rounds")}
        if counts:
            names.append(name)
            passes |= counts
    if not names:
        return ""
    n = "/".join(str(c) for c in sorted(passes))
    return (f" Rows of the {', '.join(names)} sections: ours and the peers timed again in {n} alternating passes, "
            "median of the passes.")


def render_markdown(res: dict, plot_prefix: Optional[str] = None) -> str:
    meta, roof = res["meta"], res.get("roofline") or {}
    _set_labels(meta)
    out = [f"Run of {meta['date']} on **{meta['device']}**: torch {meta['torch']}, triton {meta['triton']}, "
           f"Python {meta['python']}, flash_maxsim at `{meta.get('git_commit') or '?'}`"
           f"{' (uncommitted changes)' if meta.get('git_dirty') else ''}; timer `{meta['timer']}` "
           f"(warmup {meta['warmup_ms']} ms, rep {meta['rep_ms']} ms, median); inputs {meta['dtype']}, "
           f"random L2-normalised tokens; total {meta.get('elapsed_s', 0):.0f} s." + _passes_text(res), ""]
    if meta.get("smoke"):
        out += ["**CPU smoke run: tiny shapes, numbers meaningless; it only shows that every path runs.**", ""]
    if meta.get("peers_missing"):
        out += ["Peers not available in this run: " + "; ".join(f"`{k}`: {v}" for k, v in
                                                               meta["peers_missing"].items()), ""]
    if roof:
        out += [f"Measured ceilings: device-to-device copy **{_rate(roof['copy_bw_Bps'], 'B/s')}** (bytes read + "
                f"written), bf16 matmul **{_rate(roof['bf16_mm_flops'], 'FLOP/s')}** "
                f"({roof['mm_n']}³ `torch.mm`){_mm8_text(roof)}.", ""]
    for run in meta.get("merged_runs") or []:
        r = run.get("roofline") or {}
        ceilings = (f" (its ceilings: {_rate(r['copy_bw_Bps'], 'B/s')}, {_rate(r['bf16_mm_flops'], 'FLOP/s')}"
                    f"{_mm8_text(r, bold=False)})" if r else "")
        code = (f", flash_maxsim at `{run['git_commit']}`{' (uncommitted changes)' if run.get('git_dirty') else ''}"
                if run.get("git_commit") else "")
        out += [f"Sections {', '.join(run['sections'])} come from another run, of {run['date']}{code}{ceilings}; "
                "their floors use that run's ceilings.", ""]
    if res.get("forward"):
        out += ["### Forward: time (ms, median)", ""] + forward_table(res["forward"]) + [""]
        out += ["### Forward: peak memory above inputs (MB, outputs included)", ""] + \
            forward_memory_table(res["forward"]) + [""]
        out += ["### Forward: correctness (max |Δscore| against flash_maxsim; ✗ = flagged)", ""] + \
            correctness_table(res["forward"], train=False) + [""]
    if res.get("training"):
        out += ["### Training step: time (ms, median) / peak memory above inputs (MB)", ""] + \
            training_table(res["training"]) + [""]
        graphed = training_graph_table(res["training"])
        if graphed:
            out += ["### Training step: GPU time (each step captured in a CUDA graph and replayed) and PyTorch's "
                    "share of the eager step (ms, median)", "",
                    "A step whose eager time is above both its GPU time and PyTorch's share (the loss and "
                    "`autograd.grad` over a leaf tensor of scores, timed alone) is bound by the host.", ""] + \
                graphed + [""]
        out += ["### Training step: correctness (max |Δscore| / gradient relative error against flash_maxsim; "
                "✗ = flagged)", ""] + correctness_table(res["training"], train=True) + [""]
    if res.get("compressed"):
        out += ["### Compressed index (issue 7): time (ms, median), index bytes, fidelity", ""] + \
            compressed_table(res["compressed"]) + [""]
        out += ["### Compressed index: floors (ms)", ""] + compressed_floors_table(res["compressed"]) + [""]
        out += ["### Compressed index: checks (scores against the float64 reference)", ""] + \
            compressed_checks_table(res["compressed"]) + [""]
        variants = compressed_variants_table(res["compressed"])
        if variants:
            out += ["### Compressed index: every peer variant timed", ""] + variants + [""]
    if res.get("forward_sweep"):
        r0 = res["forward_sweep"][0]
        out += [f"### Forward against corpus size (1 query, {r0['Lq']}×{r0['Ld']}, d={r0['d']})", ""]
        if plot_prefix is not None:
            out += [f"![forward time and memory against corpus size]({plot_prefix}forward_vs_corpus.png)", ""]
        out += sweep_table(res["forward_sweep"], "documents", train=False) + [""]
    if res.get("training_sweep"):
        r0 = res["training_sweep"][0]
        out += [f"### Training step against batch size (in-batch, {r0['Lq']}×{r0['Ld']}, d={r0['d']})", ""]
        if plot_prefix is not None:
            out += [f"![training time and memory against batch size]({plot_prefix}training_vs_batch.png)", ""]
        out += sweep_table(res["training_sweep"], "batch", train=True) + [""]
    return "\n".join(out).rstrip() + "\n"


def _mm8_text(roof: dict, bold: bool = True) -> str:
    """The 8-bit matmul rates of a run, when it measured them (compressed section)."""
    b = "**" if bold else ""
    parts = [f"{name} matmul {b}{_rate(roof[key], unit)}{b}" for name, key, unit in
             (("int8", "int8_mm_ops", "OP/s"), ("fp8", "fp8_mm_flops", "FLOP/s")) if roof.get(key)]
    if not parts:
        return ""
    how = f" ({roof.get('mm8_n', '?')}³ `torch._int_mm` / `torch._scaled_mm`)" if bold else ""
    return ", " + ", ".join(parts) + how


def summary(res: dict) -> str:
    """The main tables only, printed last so that they survive a truncated log (results.md has everything)."""
    out = [f"== {res['meta']['device']}: {res['meta'].get('elapsed_s', 0):.0f} s; timer {res['meta']['timer']}"]
    roof = res.get("roofline")
    if roof:
        out.append(f"== ceilings: copy {_rate(roof['copy_bw_Bps'], 'B/s')}, "
                   f"bf16 mm {_rate(roof['bf16_mm_flops'], 'FLOP/s')}")
    if res.get("forward"):
        out += ["", "Forward (ms):"] + forward_table(res["forward"])
    if res.get("training"):
        out += ["", "Training step (ms / MB):"] + training_table(res["training"])
        graphed = training_graph_table(res["training"])
        if graphed:
            out += ["", "Training step, GPU time (CUDA graph) and PyTorch's share (ms):"] + graphed
    if res.get("compressed"):
        out += ["", "Compressed index (ms, bytes, fidelity):"] + compressed_table(res["compressed"])
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------------

def make_plots(res: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        log.warning("no plots: matplotlib unavailable (%s)", exc)
        return []
    written = []
    for key, fname, xlabel, title in (
            ("forward_sweep", "forward_vs_corpus.png", "documents in the corpus (1 query, {Lq}×{Ld}, d={d})",
             "Forward scoring"),
            ("training_sweep", "training_vs_batch.png", "in-batch batch size ({Lq}×{Ld}, d={d})",
             "Training step (scores → loss → backward)")):
        rows = res.get(key) or []
        if not rows:
            continue
        xlabel = xlabel.format(**rows[0])
        _set_labels(res["meta"])
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
        methods = [k for k in LABELS if any(k in r["results"] for r in rows)]
        for k in methods:
            pts = [(r["B"], r["results"][k].get("ms"), r["results"][k].get("peak_mb")) for r in rows
                   if k in r["results"] and r["results"][k].get("status") == "ok"]
            style = dict(marker="o", linewidth=2.5 if k == "ours" else 1.3, label=_label(k))
            if any(p[1] is not None for p in pts):
                ax_t.plot([p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None], **style)
            if any(p[2] is not None for p in pts):
                ax_m.plot([p[0] for p in pts if p[2] is not None], [max(p[2], 1e-2) for p in pts
                                                                     if p[2] is not None], **style)
        floors = [(r["B"], r["floor_ms"]) for r in rows if r.get("floor_ms")]
        if floors:
            ax_t.plot([f[0] for f in floors], [f[1] for f in floors], "k--", linewidth=1, label="roofline floor")
        for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "peak memory above inputs (MB)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
        fig.suptitle(f"{title}: {res['meta']['device']}")
        fig.tight_layout()
        path = out_dir / fname
        try:
            fig.savefig(path, dpi=110)
            written.append(path)
        except OSError as exc:
            log.warning("could not write %s: %s", path, exc)
        plt.close(fig)
    return written


# ----------------------------------------------------------------------------------------------------------------
# docs/benchmarks.md
# ----------------------------------------------------------------------------------------------------------------

def _plot_files(res: dict) -> list[str]:
    return [f for key, f in (("forward_sweep", "forward_vs_corpus.png"), ("training_sweep", "training_vs_batch.png"))
            if res.get(key)]


def write_docs(doc_path: Path, res: dict, plots_dir: Path) -> None:
    """Replace what lies between the marker comments of ``doc_path`` with the tables of ``res``; the text
    outside the markers (intro, method) is kept as written."""
    text = doc_path.read_text() if doc_path.exists() else f"# Benchmarks\n\n{DOCS_BEGIN}\n{DOCS_END}\n"
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise SystemExit(f"{doc_path}: the marker comments are missing; expected the lines\n{DOCS_BEGIN}\n{DOCS_END}")
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    prefix = os.path.relpath(plots_dir.resolve(), doc_path.resolve().parent).replace(os.sep, "/") + "/"
    have_plots = all((plots_dir / f).exists() for f in _plot_files(res))
    body = render_markdown(res, plot_prefix=prefix if have_plots else None)
    doc_path.write_text(f"{head}{DOCS_BEGIN}\n\n{body}\n{DOCS_END}{tail}")
    log.info("wrote %s", doc_path)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------

def _git(*args) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:
        return None


def _meta(m: Machine, args, peers, peer_missing) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"), "device": m.name, "smoke": args.cpu_smoke,
            "interpret": args.interpret, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "flash_maxsim": getattr(_flash_maxsim(), "__version__", "?"),
            "git_commit": _git("rev-parse", "--short", "HEAD"), "git_dirty": bool(status) if status is not None
            else None, "timer": m.timer.name, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "dtype": str(m.dtype).replace("torch.", ""), "peers": {p.key: p.label for p in peers},
            "peers_missing": peer_missing, "argv": sys.argv[1:], "l2_bytes": m.l2_bytes, "rounds": args.rounds}


SECTIONS = ("forward", "training", "compressed", "forward-sweep", "training-sweep")
RESULT_KEYS = ("forward", "training", "compressed", "forward_sweep", "training_sweep")


def merge_results(paths: list[Path]) -> dict:
    """Several saved runs as one: the sections of later files replace those of earlier ones; the header (meta,
    roofline) is the first file's, with the others' listed under meta["merged_runs"]."""
    runs = [json.loads(p.read_text()) for p in paths]
    res = runs[0]
    for other in runs[1:]:
        for key in RESULT_KEYS:
            if other.get(key):
                res[key] = other[key]
        res["meta"].setdefault("merged_runs", []).append(
            {"date": other["meta"]["date"], "sections": [k for k in RESULT_KEYS if other.get(k)],
             "roofline": other.get("roofline"), "elapsed_s": other["meta"].get("elapsed_s"),
             "git_commit": other["meta"].get("git_commit"), "git_dirty": other["meta"].get("git_dirty")})
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for results.json, results.md and the PNG plots (default: benchmarks/results; "
                        "with --from-json: the JSON's folder, where the plots are redrawn)")
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
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time in ms (default 50; 20 with --quick)")
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
                   help="forward, training and compressed-index rows: time ours and the peers again in this many alternating passes "
                        "and report the median (0: one sequential measurement each)")
    p.add_argument("--from-json", type=Path, nargs="+", default=None,
                   help="run nothing: load saved results.json files (several are merged, later sections "
                        "replacing earlier ones) to redraw the plots and --write-docs")
    p.add_argument("--write-docs", type=Path, default=None,
                   help="regenerate the results part of this markdown file (e.g. docs/benchmarks.md)")
    p.add_argument("--allow-smoke-docs", action="store_true", help="let --write-docs write smoke-test results")
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
    from _peers import PEER_KEYS
    bad = [k for k in args.peer_keys if k not in PEER_KEYS]
    if bad:
        p.error(f"--peers: unknown {bad}; choose from {', '.join(PEER_KEYS)} or 'none'")
    return args


def run(args) -> dict:
    from _peers import load_peers
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or use --cpu-smoke here")
    if args.interpret:
        _interpreter_autotune_shim()
    m = Machine(args)
    peers, peer_missing = load_peers(args.peer_keys)
    res = {"meta": _meta(m, args, peers, peer_missing)}
    res["roofline"] = measure_roofline(m)

    def keep(shapes):
        return [s for s in shapes if args.only is None or args.only in s.name]

    peer_keys = [p for p in ("lik", "fmpypi") if p in args.peer_keys]
    if "forward" in args.sections:
        shapes = keep(FORWARD_SHAPES)
        shapes = [smoke_forward(s) for s in shapes] if args.cpu_smoke else shapes
        keys = ["ours", "torch_bf16", "torch_fp32", "colpali_loop"] + peer_keys
        res["forward"] = run_forward_rows(m, shapes, keys, peers, peer_missing, args.seed, args.rounds)
        if res["forward"]:
            print("\n".join(forward_table(res["forward"])), flush=True)
    if "training" in args.sections:
        shapes = keep(TRAIN_SHAPES)
        shapes = [smoke_train(s) for s in shapes] if args.cpu_smoke else shapes
        keys = ["ours", "eager"] + [k for k in ("fmpypi", "lik") if k in peer_keys]
        res["training"] = run_training_rows(m, shapes, keys, peers, peer_missing, args.seed, args.rounds)
        if res["training"]:
            print("\n".join(training_table(res["training"])), flush=True)
    if "compressed" in args.sections:
        shapes = keep(COMPRESSED_SHAPES)
        shapes = [smoke_forward(s) for s in shapes] if args.cpu_smoke else shapes
        if shapes:
            m.mm8_rates = measure_8bit_rates(m)
            res["roofline"].update(m.mm8_rates)
        res["compressed"] = run_compressed_rows(m, shapes, [k for k in COMPRESSED_METHODS if k.startswith("ours_")]
                                                + peer_keys, peers, peer_missing, args.seed,
                                                args.skip_compressed_variants, args.rounds)
        if res["compressed"]:
            print("\n".join(compressed_table(res["compressed"])), flush=True)
    if "forward-sweep" in args.sections:
        sizes = FORWARD_SWEEP_B_QUICK if args.quick else FORWARD_SWEEP_B
        sizes = [2, 5, 9] if args.cpu_smoke else sizes
        dims = (9, 13, 32) if args.cpu_smoke else (32, 300, 128)
        shapes = [ForwardShape(f"1x{b}", 1, b, *dims) for b in sizes]
        res["forward_sweep"] = run_forward_rows(m, shapes, ["ours", "torch_bf16"] + peer_keys, peers,
                                                peer_missing, args.seed)
    if "training-sweep" in args.sections:
        sizes = TRAIN_SWEEP_B_QUICK if args.quick else TRAIN_SWEEP_B
        sizes = [2, 4] if args.cpu_smoke else sizes
        dims = (9, 13, 32) if args.cpu_smoke else (32, 1030, 128)
        shapes = [TrainShape(f"B{b}", b, b, *dims, "inbatch") for b in sizes]
        res["training_sweep"] = run_training_rows(m, shapes, ["ours", "eager"] +
                                                  [k for k in ("fmpypi", "lik") if k in peer_keys],
                                                  peers, peer_missing, args.seed)
    res["meta"]["elapsed_s"] = m.budget.elapsed()
    res["meta"]["timer"] = m.timer.name     # may have fallen back during the run
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.from_json is not None:
        res = merge_results(args.from_json)
        args.out = args.out or args.from_json[0].resolve().parent
        args.out.mkdir(parents=True, exist_ok=True)
        plots_dir = args.out
    else:
        args.out = args.out or REPO / "benchmarks" / "results"
        res = run(args)
        args.out.mkdir(parents=True, exist_ok=True)
        plots_dir = args.out
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    plots = make_plots(res, plots_dir)
    md = render_markdown(res, plot_prefix="" if plots else None)
    if args.from_json is None:
        (args.out / "results.md").write_text(md)
        log.info("wrote %s", ", ".join(str(p) for p in
                                      [args.out / "results.json", args.out / "results.md", *plots]))
        print("\n" + summary(res), flush=True)
    if args.write_docs is not None:
        if res["meta"].get("smoke") and not args.allow_smoke_docs:
            raise SystemExit("refusing to write CPU smoke-test numbers into the docs (--allow-smoke-docs to force)")
        write_docs(args.write_docs, res, plots_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
