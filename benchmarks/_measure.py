"""How the benchmark measures: the timer (and how it clears the L2 cache), peak memory, the time budget, the
roofline ceilings measured in the same run, random inputs, and one guarded measurement of one method.

The device is described by :class:`Machine`: CUDA for real runs, the CPU for the smoke test (timed with
``time.perf_counter``, no memory numbers).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
import platform
import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger("flash_maxsim.bench")

MB = 2 ** 20


# ------------------------------------------------------------------------------------------------------ timing

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
    measurement: ~8-9 us per call on an H200) or "read" (a reduction reads the same buffer: the L2 is as cold,
    its lines clean)."""

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


def interpreter_autotune_shim():
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


# ----------------------------------------------------------------------------------------------------- machine

class Machine:
    """The device under test: its timer, memory accounting, budget and measured ceilings."""

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

    def floor_ms(self, nbytes: float, flops: float) -> Optional[float]:
        """The roofline floor: max(bytes / copy bandwidth, flops / bf16 matmul rate), once both are measured."""
        if not self.copy_bw or not self.mm_flops:
            return None
        return max(nbytes / self.copy_bw, flops / self.mm_flops) * 1e3


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


def measure_host_to_device(m: Machine) -> dict:
    """The pinned host-to-device copy bandwidth, measured now: the ceiling of any index streamed from host memory.
    On the CPU (smoke runs) a host-to-host copy stands in, and pinning is skipped."""
    nbytes = 1024 * MB if m.cuda else 8 * MB
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=m.cuda)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=m.device)
    ms = m.timer.median_ms(lambda: dst.copy_(src, non_blocking=True))
    src = dst = None
    m.release()
    bw = nbytes / (ms * 1e-3)
    log.info("pinned host-to-device copy: %.1f GB/s", bw / 1e9)
    return {"h2d_bytes": nbytes, "h2d_ms": ms, "h2d_Bps": bw, "h2d_pinned": m.cuda}


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
        log.warning("no int8 matmul rate: %s", error_text(exc))
        out["int8_mm_ops"] = None
    try:
        a = torch.randn((n, n), device=m.device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn((n, n), device=m.device, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device=m.device)
        out["fp8_mm_flops"] = 2 * n ** 3 / (m.timer.median_ms(
            lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)) * 1e-3)
    except Exception as exc:
        log.warning("no fp8 matmul rate: %s", error_text(exc))
        out["fp8_mm_flops"] = None
    a = b = None
    m.release()
    log.info("8-bit matmul: int8 %s, fp8 %s",
             *(f"{out[k] / 1e12:.0f} T{unit}" if out[k] else "n/a"
               for k, unit in (("int8_mm_ops", "OP/s"), ("fp8_mm_flops", "FLOP/s"))))
    return out


# ------------------------------------------------------------------------------------------------------ inputs

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


def element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


# ------------------------------------------------------------------------------------------ one measurement

def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


def skipped(reason: str) -> dict:
    return {"status": "skipped", "error": reason}


def timed_call_ms(m: Machine, fn: Callable[[], object]) -> float:
    """Wall milliseconds of one synchronised call of ``fn``."""
    m.sync()
    t0 = time.perf_counter()
    out = fn()
    m.sync()
    del out
    return (time.perf_counter() - t0) * 1e3


def run_method(m: Machine, call: Callable, sets: list, check: Callable[[object], dict],
               slow_ms: Optional[float] = None) -> dict:
    """``call(*inputs)``: first on ``sets[0]`` (timed as first-call time, then checked), then its peak memory,
    then its median time cycling through every input set. Failures are recorded, never raised.

    ``slow_ms``: a call found slower than this (once warm) is timed as the median of two calls instead (its
    ``timing`` says so): do_bench's estimate, warm-up and repetitions would cost at least eight calls."""
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
        if slow_ms is not None:
            warm = timed_call_ms(m, lambda: call(*next(rotation)))
            if warm > slow_ms:
                res["ms"] = statistics.median([warm, timed_call_ms(m, lambda: call(*next(rotation)))])
                res["timing"] = "median of 2 calls (slow)"
                m.release()
                return res
        res["ms"] = m.timer.median_ms(lambda: call(*next(rotation)))
    except torch.cuda.OutOfMemoryError as exc:
        res = {"status": "oom", "error": error_text(exc)[:120]}
    except Exception as exc:
        log.debug("measurement failed", exc_info=True)
        res = {"status": "error", "error": error_text(exc)}
    m.release()
    return res


# host cost: steps run before a timed pass, and the names of the CUDA driver and runtime calls that launch a kernel
HOST_WARMUP_STEPS = 10
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def host_pass_us(m: Machine, step: Callable[[], object], n: int) -> dict:
    """``n`` calls of ``step`` back to back after a warm-up, one synchronisation at the end: microseconds per step
    (``us``, what a training loop without CUDA graphs gets), and the part before the synchronisation
    (``enqueue_us``: the host's own time per step when the GPU keeps up)."""
    for _ in range(HOST_WARMUP_STEPS):
        step()
    m.sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    m.sync()
    t2 = time.perf_counter()
    return {"us": (t2 - t0) / n * 1e6, "enqueue_us": (t1 - t0) / n * 1e6}


def profiled_step(m: Machine, step: Callable[[], object], n: int) -> dict:
    """``n`` steps under ``torch.profiler``: per step, the GPU's kernel time (``gpu_us``: every kernel, memset and
    copy, summed; None on the CPU), the kernels run (``kernels``), the host's kernel-launch calls (``launches``)
    and the aten operators dispatched, nested ones included (``aten_ops``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if m.cuda else [])
    step()
    m.sync()
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        m.sync()
    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    out = {"aten_ops": sum(e.name.startswith("aten::") for e in events if e.device_type == DeviceType.CPU) / n,
           "launches": sum(e.name in LAUNCH_CALLS for e in events) / n, "gpu_us": None, "kernels": None}
    if m.cuda:
        out["gpu_us"] = sum(e.time_range.elapsed_us() for e in device) / n
        out["kernels"] = len(device) / n
    return out


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
        log.warning("interleaved rounds failed (%s); keeping single measurements", error_text(exc))
        return
    finally:
        m.release()
    for key, times in passes.items():
        r = results[key]
        r["ms_single"], r["ms_rounds"], r["ms"] = r["ms"], times, statistics.median(times)


def brief(r: dict) -> str:
    """One result in a log line."""
    if r.get("ms") is None:
        return f"{r['status']}: {r.get('error', '')}"
    mem = "" if r.get("peak_mb") is None else f" {r['peak_mb']:.1f} MB"
    diff = "" if r.get("max_abs_diff") is None else f" diff {r['max_abs_diff']:.2e}"
    ref = "" if r.get("ref_max_abs_diff") is None else f" ref-diff {r['ref_max_abs_diff']:.2e}"
    return f"{r['ms']:.4f} ms{mem}{diff}{ref} [{r['status']}]"
