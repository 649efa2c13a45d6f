"""``python -m flash_maxsim check`` (or ``flash-maxsim check``): verify flash_maxsim on this machine.

On CUDA the Triton kernels are checked against the float64 reference on a few standard shapes (ColBERT
32x300, ColPali 32x1030, ragged documents, masks, smooth max, a training step) and timed against eager PyTorch
(``einsum(...).amax(-1).sum(-1)``), with peak extra memory. On a CPU-only machine the same rows run on small
shapes through the exact CPU path, and one tiny problem runs the Triton kernels under Triton's interpreter (in
a subprocess with TRITON_INTERPRET=1) so that the kernels' code is verified too. Prints a markdown table;
exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger("flash_maxsim.check")


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
    row: Row
    shape: str
    error: float
    tolerance: float
    flash_ms: Optional[float] = None
    eager_ms: Optional[float] = None
    flash_bytes: Optional[int] = None
    eager_bytes: Optional[int] = None
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


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

def make_inputs(row: Row, device: str, dtype: torch.dtype, seed: int = 0):
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


def eager_scores(q, documents, qmask, dmask, masked, smooth_tau):
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

def _rss_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _return_freed_memory_to_the_system() -> None:
    """glibc keeps large freed blocks mapped once its mmap threshold has adapted upwards, which hides later
    peaks from the resident set; a fixed threshold makes every large allocation a fresh mapping."""
    try:
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _cpu_peak_supported() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                        # resets the resident-set high-water mark (Linux)
        _rss_bytes("VmHWM")
        return True
    except OSError:
        return False


def peak_extra_bytes(fn, device: str) -> Optional[int]:
    """Peak memory above what was allocated before the call: the CUDA allocator's peak, or on Linux CPUs the
    resident-set high-water mark (reset through /proc/self/clear_refs)."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    if not _cpu_peak_supported():
        return None
    before = _rss_bytes("VmRSS")
    fn()
    return max(0, _rss_bytes("VmHWM") - before)


def median_ms(fn, device: str, repeats: int) -> float:
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
    result = Result(row, shape, error, 2e-5 * _scale(q, documents))
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
    result = Result(row, shape + ", scores + dQ + dD", error, 1.0)
    result.notes.append("error column: worst of (score error / tolerance, gradient relative error / tolerance)")
    result.flash_ms = median_ms(lambda: step(flash_maxsim.maxsim), device, repeats)
    result.eager_ms = median_ms(lambda: step(eager_scores), device, repeats)
    result.flash_bytes = peak_extra_bytes(lambda: step(flash_maxsim.maxsim), device)
    result.eager_bytes = peak_extra_bytes(lambda: step(eager_scores), device)
    return result


# --- the Triton kernels under the interpreter (CPU-only machines) ------------------------------------------------

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
    return {"error": error, "tolerance": 1.0, "seconds": seconds,
            "interpreted": not torch.cuda.is_available()}


def run_interpreter_check_subprocess() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "flash_maxsim", "interpreter-check"], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        log.error("interpreter check failed to run:\n%s", proc.stderr[-4000:])
        return {"error": math.inf, "tolerance": 1.0, "seconds": None, "interpreted": True}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- report ----------------------------------------------------------------------------------------------------

def _ms(x):
    return "n/a" if x is None else f"{x:.3f}"


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def _ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def format_table(results: list[Result], interpreted: Optional[dict]) -> str:
    lines = ["| check | shape | max error / tolerance | flash ms | eager ms | speed-up | flash peak MiB | "
             "eager peak MiB | eager/flash memory | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.row.name} | {r.shape} | {r.error:.3g} / {r.tolerance:.3g} | {_ms(r.flash_ms)} | "
                     f"{_ms(r.eager_ms)} | {_ratio(r.eager_ms, r.flash_ms)} | {_mib(r.flash_bytes)} | "
                     f"{_mib(r.eager_bytes)} | {_ratio(r.eager_bytes, r.flash_bytes)} | "
                     f"{'yes' if r.ok else 'FAILED'} |")
    if interpreted is not None:
        ok = interpreted["error"] <= interpreted["tolerance"]
        lines.append(f"| Triton kernels, interpreted (fwd+bwd, ragged, masks, smooth) | 2x3 docs, Lq=5, "
                     f"Ld<=7, d=16, fp32 | {interpreted['error']:.3g} / {interpreted['tolerance']:.3g} | "
                     f"{_ms(None if interpreted['seconds'] is None else interpreted['seconds'] * 1e3)} | n/a | n/a "
                     f"| n/a | n/a | n/a | {'yes' if ok else 'FAILED'} |")
    return "\n".join(lines)


def check(device: Optional[str] = None, quick: bool = False, interpreter: bool = True, repeats: int = 5) -> int:
    import flash_maxsim
    from flash_maxsim.kernels import launch
    from flash_maxsim.ops import force_backend

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = standard_rows(device, quick)
    if device == "cuda":
        log.info("flash_maxsim %s: Triton kernels on %s", flash_maxsim.__version__, torch.cuda.get_device_name())
        backend = None
    else:
        log.info("flash_maxsim %s on the CPU: the exact chunked PyTorch path, small shapes; fp32 inputs "
                 "(the CPU path computes in fp32 whatever the input dtype)", flash_maxsim.__version__)
        backend = "torch"
    if device == "cpu":
        _return_freed_memory_to_the_system()
    results = []
    with force_backend(backend):
        for row in rows:
            log.info("checking %s", row.name)
            result = run_row(row, device, dtype, repeats)
            log.info("  max error / tolerance %.3g / %.3g, flash %s ms, eager %s ms", result.error,
                     result.tolerance, _ms(result.flash_ms), _ms(result.eager_ms))
            results.append(result)
    interpreted = None
    if device == "cpu" and interpreter:
        log.info("running one tiny problem through the Triton kernels under TRITON_INTERPRET=1")
        interpreted = interpreter_check() if launch.interpreting() else run_interpreter_check_subprocess()
    print(format_table(results, interpreted))
    notes = []
    if device == "cpu":
        notes.append("CPU: small shapes through the exact CPU path (fp32), not the fused GPU kernels; its "
                     "temporaries are bounded by 2^24-element similarity blocks, so at these sizes it uses "
                     "about as much memory as eager. Peak memory on the CPU is the resident-set high-water mark.")
    for note in {n for r in results for n in r.notes}:
        notes.append(note)
    for note in notes:
        print(f"\n{note}")
    failed = [r.row.name for r in results if not r.ok]
    if interpreted is not None and not interpreted["error"] <= interpreted["tolerance"]:
        failed.append("Triton kernels, interpreted")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
        return 1
    print("\nall checks passed")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flash-maxsim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("check", help="verify against the float64 reference; speed and memory vs eager PyTorch")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds; for tests)")
    p.add_argument("--no-interpreter", action="store_true",
                   help="CPU only: skip the Triton-interpreter check of the kernels")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement on the CPU")
    sub.add_parser("interpreter-check", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "interpreter-check":
        print(json.dumps(interpreter_check()))
        return 0
    if args.command in (None, "check"):
        if args.command is None:
            args = parser.parse_args(["check"])
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available")
        return check(args.device, args.quick, not args.no_interpreter, args.repeats)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
