"""``flash-maxsim check`` (or ``python -m flash_maxsim check``): verify flash_maxsim on this machine.

On CUDA the Triton kernels are checked against the float64 reference on a few standard shapes (ColBERT
32x300, ColPali 32x1030, ragged documents, masks, smooth max, a training step) and timed against eager PyTorch
(``einsum(...).amax(-1).sum(-1)``), with peak extra memory. On a CPU-only machine the same rows run on small
shapes through the exact CPU path, and one tiny problem runs the Triton kernels under Triton's interpreter (in
a subprocess with TRITON_INTERPRET=1) so that the kernels' code is verified too, and the CPU benchmark's short
form (run first) times the CPU path against eager PyTorch (and the Rust CPU peers, where installed) on two
realistic shapes. Prints a table (or JSON with ``--json``); exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from . import _cpu_benchmark

log = logging.getLogger("flash_maxsim.check")

DESCRIPTION = ("Verify flash_maxsim on this machine: scores and gradients against the float64 reference, "
               "speed and peak memory against eager PyTorch (on the GPU if there is one, else on the CPU).")
CPU_CAVEAT = ("On a CPU flash_maxsim runs an exact blocked PyTorch path, not the fused GPU kernels: these rows "
              "check its numbers; at their small shapes speed and memory say little ({where}). Peak memory on "
              "the CPU is the resident-set high-water mark.")
CPU_CAVEAT_BENCHMARK = "the CPU benchmark after the table times realistic ones"
CPU_CAVEAT_NO_BENCHMARK = "`flash-maxsim check --benchmark` times realistic ones"
# rounds of the CPU benchmark's short form: it adds about 4 s of CPU time to a check (2-core AMD EPYC, torch 2.13)
CPU_BENCHMARK_ROUNDS = 3
ERROR_NOTE = ("error / tolerance: the largest error against the float64 reference divided by its tolerance "
              "(1 or less passes). Scores: absolute error, tolerance 2e-5 x the fp32 accumulation bound; "
              "gradients: relative error, tolerance 1e-4 (fp32) or 1e-2 (bf16); interpreted kernels: 1e-5.")


@dataclass
class Row:
    name: str
    Nq: int
    B: int
    Lq: int
    Ld: int
    d: int
    ragged: bool = False
    masks: bool = False
    masked: str = "exclude"
    smooth_tau: Optional[float] = None
    training: bool = False


@dataclass
class Result:
    name: str
    shape: str
    error: float
    tolerance: float
    flash_ms: Optional[float] = None
    eager_ms: Optional[float] = None
    flash_bytes: Optional[int] = None
    eager_bytes: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    @property
    def error_over_tolerance(self) -> float:
        return self.error / self.tolerance


def standard_rows(device: str, quick: bool) -> list[Row]:
    if device == "cuda" and not quick:
        colbert, colpali, train = (16, 1000), (16, 256), (64, 64)
    elif not quick:
        colbert, colpali, train = (4, 64), (2, 16), (8, 8)
    else:
        colbert, colpali, train = (2, 8), (1, 4), (2, 4)
    return [
        Row("ColBERT", *colbert, 32, 300, 128),
        Row("ColPali", *colpali, 32, 1030, 128),
        Row("ragged (list, no padding)", *colbert, 32, 300, 128, ragged=True),
        Row("masks, zero mode (PyLate)", *colbert, 32, 300, 128, masks=True, masked="zero"),
        Row("masks, exclude mode", *colbert, 32, 300, 128, masks=True),
        Row("smooth max tau=0.1 (colpali-engine)", *colpali, 32, 1030, 128, smooth_tau=0.1),
        Row("training fwd+bwd (ColBERT in-batch)", *train, 32, 300, 128, masks=True, masked="zero",
            training=True),
    ]


# --- inputs and the eager PyTorch baseline ---------------------------------------------------------------------

Documents = Union[torch.Tensor, List[torch.Tensor]]


def make_inputs(row: Row, device: str, dtype: torch.dtype, seed: int = 0
                ) -> Tuple[torch.Tensor, Documents, Optional[torch.Tensor], Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        x = torch.randn(*shape, generator=g)
        return torch.nn.functional.normalize(x, dim=-1).to(device=device, dtype=dtype)  # unit vectors, as models

    q = normal(row.Nq, row.Lq, row.d)
    qmask = dmask = None
    if row.ragged:
        lengths = torch.randint(max(1, row.Ld // 8), row.Ld + 1, (row.B,), generator=g).tolist()
        documents = [normal(n, row.d) for n in lengths]
    else:
        documents = normal(row.B, row.Ld, row.d)
    if row.masks:
        qmask = (torch.rand(row.Nq, row.Lq, generator=g) < 0.9).to(device)
        dmask = (torch.rand(row.B, row.Ld, generator=g) < 0.8).to(device)
    return q, documents, qmask, dmask


def eager_scores(q: torch.Tensor, documents: Documents, qmask: Optional[torch.Tensor],
                 dmask: Optional[torch.Tensor], masked: str, smooth_tau: Optional[float]) -> torch.Tensor:
    """What users write: the full similarity tensor, then max (or logsumexp) and sum, in the inputs' dtype."""
    if isinstance(documents, list):
        lengths = torch.tensor([x.shape[0] for x in documents], device=q.device)
        documents = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
        dmask = torch.arange(documents.shape[1], device=q.device)[None, :] < lengths[:, None]
    s = torch.einsum("qid,bjd->qbij", q, documents)
    if dmask is not None:
        if masked == "zero":
            s = s * dmask[None, :, None, :]
        else:
            s = s.masked_fill(~dmask[None, :, None, :], float("-inf"))
    if smooth_tau is None:
        per_token = s.amax(-1)
    else:
        per_token = smooth_tau * torch.logsumexp(s / smooth_tau, -1)
    if qmask is not None:
        per_token = per_token * qmask[:, None, :]
    return per_token.sum(-1)


# --- measurement -----------------------------------------------------------------------------------------------

def peak_extra_bytes(fn: Callable[[], object], device: str) -> Optional[int]:
    """Peak memory above what was allocated before the call: the CUDA allocator's peak, or on Linux CPUs the
    resident-set high-water mark (reset through /proc/self/clear_refs)."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return _cpu_benchmark.peak_rss_above_start(fn)


def median_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    fn()                                        # warm-up (kernel compilation, allocator)
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# --- one row ---------------------------------------------------------------------------------------------------

def _scale(q, documents):
    """Bound on the sum over query tokens of |similarity|: the scale of fp32 accumulation errors."""
    docs = documents if isinstance(documents, list) else [documents.reshape(-1, documents.shape[-1])]
    dn = max(float(x.detach().double().norm(dim=-1).max()) for x in docs if x.numel())
    return q.shape[1] * float(q.detach().double().norm(dim=-1).max()) * dn


def run_row(row: Row, device: str, dtype: torch.dtype, repeats: int) -> Result:
    import flash_maxsim
    from flash_maxsim import reference

    q, documents, qmask, dmask = make_inputs(row, device, dtype)
    shape = (f"{row.Nq}x{row.B} docs, Lq={row.Lq}, Ld{'<=' if row.ragged else '='}{row.Ld}, d={row.d}, "
             f"{str(dtype).replace('torch.', '')}")
    kwargs = dict(masked=row.masked, smooth_tau=row.smooth_tau)
    if row.training:
        return _run_training_row(row, shape, q, documents, qmask, dmask, kwargs, device, repeats)

    with torch.no_grad():
        got = flash_maxsim.maxsim(q, documents, qmask, dmask, **kwargs)
        expected = reference.maxsim(q, documents, qmask, dmask, **kwargs)
    error = float((got.double() - expected).abs().max())
    result = Result(row.name, shape, error, 2e-5 * _scale(q, documents))
    with torch.no_grad():
        result.flash_ms = median_ms(lambda: flash_maxsim.maxsim(q, documents, qmask, dmask, **kwargs), device,
                                    repeats)
        result.eager_ms = median_ms(lambda: eager_scores(q, documents, qmask, dmask, **kwargs), device, repeats)
        result.flash_bytes = peak_extra_bytes(lambda: flash_maxsim.maxsim(q, documents, qmask, dmask, **kwargs),
                                              device)
        result.eager_bytes = peak_extra_bytes(lambda: eager_scores(q, documents, qmask, dmask, **kwargs), device)
    return result


def _run_training_row(row, shape, q, documents, qmask, dmask, kwargs, device, repeats) -> Result:
    import flash_maxsim
    from flash_maxsim import reference

    grad_out = torch.randn(row.Nq, row.B, generator=torch.Generator().manual_seed(1)).to(device)
    q = q.requires_grad_()
    documents = documents.requires_grad_()

    def step(fn):
        scores = fn(q, documents, qmask, dmask, **kwargs)
        return (scores.detach(),) + torch.autograd.grad((scores * grad_out.to(scores.dtype)).sum(), (q, documents))

    got = step(flash_maxsim.maxsim)
    q64 = q.detach().double().requires_grad_()
    d64 = documents.detach().double().requires_grad_()
    expected_scores = reference.maxsim(q64, d64, qmask, dmask, **kwargs)
    expected = (expected_scores.detach(),) + torch.autograd.grad(
        (expected_scores * grad_out.double()).sum(), (q64, d64))
    # scores: max error against the fp32-accumulation bound; gradients: relative norm error, which a few
    # near-tied arg-max rows (either token is a correct maximum within rounding) cannot move
    error = float((got[0].double() - expected[0]).abs().max()) / (2e-5 * _scale(q, documents))
    grad_rtol = 1e-4 if q.dtype == torch.float32 else 1e-2
    for g, e in zip(got[1:], expected[1:]):
        error = max(error, float((g.double() - e).norm() / e.norm().clamp_min(1e-30)) / grad_rtol)
    result = Result(row.name, shape + ", scores + dQ + dD", error, 1.0)
    result.flash_ms = median_ms(lambda: step(flash_maxsim.maxsim), device, repeats)
    result.eager_ms = median_ms(lambda: step(eager_scores), device, repeats)
    result.flash_bytes = peak_extra_bytes(lambda: step(flash_maxsim.maxsim), device)
    result.eager_bytes = peak_extra_bytes(lambda: step(eager_scores), device)
    return result


# --- the Triton kernels under the interpreter (CPU-only machines) ------------------------------------------------

INTERPRETED_NAME = "Triton kernels, interpreted (fwd+bwd, ragged, masks, smooth)"
INTERPRETED_SHAPE = "2x3 docs, Lq=5, Ld<=7, d=16, fp32"


def interpreter_check() -> dict:
    """One tiny problem through the Triton kernels (forward and backward) vs the float64 reference. Needs
    TRITON_INTERPRET=1 set before flash_maxsim is imported (or CUDA)."""
    import flash_maxsim
    from flash_maxsim import reference
    from flash_maxsim.ops import force_backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 16, generator=g).to(device).requires_grad_()
    docs = [torch.randn(n, 16, generator=g).to(device).requires_grad_() for n in (7, 0, 3)]
    dmask = [(torch.rand(n, generator=g) < 0.7).to(device) for n in (7, 0, 3)]
    qmask = (torch.rand(2, 5, generator=g) < 0.8).to(device)
    grad_out = torch.randn(2, 3, generator=g).to(device)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        start = time.perf_counter()
        with force_backend("triton"):
            scores = flash_maxsim.maxsim(q, docs, qmask, dmask, masked="zero", smooth_tau=0.5)
            grads = torch.autograd.grad((scores * grad_out).sum(), [q, *docs], allow_unused=True)
        seconds = time.perf_counter() - start
    finally:
        torch.set_float32_matmul_precision(previous)
    q64 = q.detach().double().requires_grad_()
    d64 = [x.detach().double().requires_grad_() for x in docs]
    expected = reference.maxsim(q64, d64, qmask, dmask, masked="zero", smooth_tau=0.5)
    expected_grads = torch.autograd.grad((expected * grad_out.double()).sum(), [q64, *d64], allow_unused=True)
    error = float((scores.detach().double() - expected.detach()).abs().max()) / 1e-5
    for a, b in zip(grads, expected_grads):
        if a is not None and b is not None and b.numel():
            error = max(error, float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)) / 1e-5)
    return {"error": error, "tolerance": 1.0, "seconds": seconds}


_INTERPRETER_CHECK_CODE = "import json, flash_maxsim.__main__ as m; print(json.dumps(m.interpreter_check()))"


def run_interpreter_check() -> Result:
    """The interpreter check in this process if the kernels were built for the interpreter, else in a new Python
    with TRITON_INTERPRET=1 (it must be set before the kernels are first imported)."""
    from flash_maxsim.kernels import launch

    if launch.interpreting():
        outcome = interpreter_check()
    else:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK_CODE], env=env, capture_output=True,
                              text=True, timeout=600)
        if proc.returncode != 0:
            log.error("the interpreter check failed to run:\n%s", proc.stderr[-4000:])
            outcome = {"error": math.inf, "tolerance": 1.0, "seconds": None}
        else:
            outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    seconds = outcome["seconds"]
    return Result(INTERPRETED_NAME, INTERPRETED_SHAPE, outcome["error"], outcome["tolerance"],
                  flash_ms=None if seconds is None else seconds * 1e3)


def _interpreter_runs_the_kernels(triton_version: str) -> bool:
    """Triton's interpreter runs the kernels from Triton 3.7; older ones fail on their loops' tensor bounds."""
    major, minor = (int(part) for part in triton_version.split("+")[0].split(".")[:2])
    return (major, minor) >= (3, 7)


# --- report ----------------------------------------------------------------------------------------------------

def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _number(x: Optional[float], digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _mib(x: Optional[int]) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def format_table(results: Sequence[Result]) -> str:
    lines = ["| check | result | error / tolerance | flash ms | eager ms | speed-up | flash peak MiB | "
             "eager peak MiB | eager/flash memory | shape |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {'passed' if r.ok else 'FAILED'} | {r.error_over_tolerance:.3g} | "
                     f"{_number(r.flash_ms)} | {_number(r.eager_ms)} | {_ratio(r.eager_ms, r.flash_ms)} | "
                     f"{_mib(r.flash_bytes)} | {_mib(r.eager_bytes)} | {_ratio(r.eager_bytes, r.flash_bytes)} | "
                     f"{r.shape} |")
    return "\n".join(lines)


def run_cpu_benchmark(rounds: int = CPU_BENCHMARK_ROUNDS) -> dict:
    """The CPU benchmark's short form (rows ``_cpu_benchmark.CHECK_ROWS``): the CPU path, eager PyTorch and the
    Rust CPU peers installed here, timed in interleaved rounds, with peak memory."""
    rows = _cpu_benchmark.rows_named(_cpu_benchmark.CHECK_ROWS, _cpu_benchmark.ROWS)
    peers = {dist: _version(dist) for dist in _cpu_benchmark.installed_peers()}
    start = time.perf_counter()
    measured = _cpu_benchmark.measure(
        rows, rounds, log=lambda r: log.info("      %s: flash_maxsim %.1f ms, eager %.1f ms (%.2f of eager)",
                                             r["row"], r["ms"]["flash_maxsim"], r["ms"]["eager"],
                                             r["vs_eager"]["flash_maxsim"]))
    return {"rounds": rounds, "torch_threads": torch.get_num_threads(), "peers": peers,
            "seconds": round(time.perf_counter() - start, 2), "rows": measured}


def format_cpu_benchmark(benchmark: dict) -> str:
    """The CPU benchmark's table with a line on what it measured."""
    peers = (", ".join(f"{k} {v}" for k, v in benchmark["peers"].items()) if benchmark["peers"]
             else "none installed (maxsim-cpu, maxsim-fast, fast-maxsim)")
    return (f"CPU benchmark: the CPU path against eager PyTorch on realistic shapes (fp32, d=128); median of "
            f"{benchmark['rounds']} interleaved rounds, {benchmark['torch_threads']} torch threads, "
            f"{benchmark['seconds']:.0f} s; Rust CPU peers: {peers}. (x) = time / eager's; MiB = peak resident "
            f"memory above the call's start. The full set: benchmarks/cpu_bench.py (docs/benchmarks.md).\n\n"
            + _cpu_benchmark.markdown(benchmark["rows"]))


def report(results: Sequence[Result], where: str, version: str, device: str,
           cpu_benchmark: Optional[dict] = None) -> dict:
    """The outcome as plain data (what ``--json`` prints); ``cpu_benchmark`` is None where it did not run."""
    def finite(x: Optional[float]) -> Optional[float]:
        return x if x is None or math.isfinite(x) else None

    return {
        "flash_maxsim": version, "torch": torch.__version__, "triton": _version("triton"),
        "device": device, "where": where, "passed": all(r.ok for r in results),
        "checks": [{"name": r.name, "passed": r.ok, "error_over_tolerance": finite(r.error_over_tolerance),
                    "error": finite(r.error), "tolerance": r.tolerance, "flash_ms": r.flash_ms,
                    "eager_ms": r.eager_ms, "flash_peak_bytes": r.flash_bytes, "eager_peak_bytes": r.eager_bytes,
                    "shape": r.shape} for r in results],
        "cpu_benchmark": cpu_benchmark,
    }


def print_report(data: dict, results: Sequence[Result]) -> None:
    failed = [r.name for r in results if not r.ok]
    verdict = "all passed" if not failed else f"{len(failed)} FAILED"
    print(f"flash_maxsim {data['flash_maxsim']} on {data['where']}: {len(results)} checks, {verdict}")
    if data["device"] == "cpu":
        where = CPU_CAVEAT_BENCHMARK if data["cpu_benchmark"] else CPU_CAVEAT_NO_BENCHMARK
        print("\n" + CPU_CAVEAT.format(where=where))
    print()
    print(format_table(results))
    print(f"\n{ERROR_NOTE}")
    if data["cpu_benchmark"]:
        print("\n" + format_cpu_benchmark(data["cpu_benchmark"]))
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
    else:
        print("\nall checks passed")


# --- the command -----------------------------------------------------------------------------------------------

def check(device: Optional[str] = None, quick: bool = False, interpreter: bool = True, repeats: int = 5,
          as_json: bool = False, benchmark: Optional[bool] = None) -> int:
    """Run the checks, print the report (a table, or JSON); 0 if every check passed, else 1. ``benchmark``: run
    the CPU benchmark's short form (default: on a CPU, unless ``quick``)."""
    import flash_maxsim
    from flash_maxsim.ops import force_backend

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if benchmark is None:
        benchmark = device == "cpu" and not quick
    cpu_benchmark = None
    if benchmark:       # first: the memory measurements below fix glibc's mmap threshold for the process
        log.info("CPU benchmark: rows %s, %d rounds (a few seconds)", ", ".join(_cpu_benchmark.CHECK_ROWS),
                 CPU_BENCHMARK_ROUNDS)
        cpu_benchmark = run_cpu_benchmark()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = standard_rows(device, quick)
    versions = f"torch {torch.__version__}, Triton {_version('triton') or 'not installed'}"
    if device == "cuda":
        where = f"{torch.cuda.get_device_name()} ({versions})"
        backend = None
    else:
        where = f"the CPU ({versions}; the CPU path computes in fp32)"
        backend = "torch"
        _cpu_benchmark.return_freed_memory_to_the_system()
    log.info("flash_maxsim %s on %s", flash_maxsim.__version__, where)
    results = []
    with force_backend(backend):
        for i, row in enumerate(rows, 1):
            log.info("[%d/%d] %s", i, len(rows), row.name)
            result = run_row(row, device, dtype, repeats)
            log.info("      error / tolerance %.3g, flash %s ms, eager %s ms", result.error_over_tolerance,
                     _number(result.flash_ms), _number(result.eager_ms))
            results.append(result)
    if device == "cpu" and interpreter:
        missing = [name for name in ("triton", "numpy") if _version(name) is None]
        if missing:
            log.warning("the check of the Triton kernels under Triton's interpreter is skipped: it needs %s "
                        "(pip install %s)", " and ".join(missing), " ".join(missing))
        elif not _interpreter_runs_the_kernels(_version("triton")):
            log.warning("the check of the Triton kernels under Triton's interpreter is skipped: Triton %s's "
                        "interpreter cannot run them (3.7 or newer can; compiled on a GPU, they run from 3.6)",
                        _version("triton"))
        else:
            log.info("the Triton kernels on one tiny problem under Triton's interpreter (up to a minute or two)")
            results.append(run_interpreter_check())
    data = report(results, where, flash_maxsim.__version__, device, cpu_benchmark)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        print_report(data, results)
    return 0 if data["passed"] else 1


def _package_version() -> str:
    import flash_maxsim

    return flash_maxsim.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-maxsim", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    commands = parser.add_subparsers(dest="command", title="commands")
    p = commands.add_parser("check", help="verify against the float64 reference; speed and memory against eager "
                                          "PyTorch (the default command)", description=DESCRIPTION)
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    p.add_argument("--no-interpreter", action="store_true",
                   help="CPU only: skip running the Triton kernels under Triton's interpreter")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement on the CPU (default 5)")
    p.add_argument("--benchmark", action=argparse.BooleanOptionalAction, default=None,
                   help="time the CPU path against eager PyTorch (and the Rust CPU peers, where installed) on two "
                        "realistic shapes, 1 query x 1k documents and a B32 training step (default: on a CPU, "
                        "unless --quick)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["check"])
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return check(args.device, args.quick, not args.no_interpreter, args.repeats, args.json, args.benchmark)


if __name__ == "__main__":
    sys.exit(main())
