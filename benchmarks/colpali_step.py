#!/usr/bin/env python3
"""A colpali-engine training step's MaxSim, with and without ``flash_maxsim.integrations.colpali.enable()``.

One step = ``ColbertLoss`` (library defaults: temperature 0.02, normalize_scores=True) forward + backward on
ColPali-shaped embeddings: B queries of 32 tokens (20..32 real, zero-padded), B pages of 1030 tokens, d = 128,
L2-normalised bf16, hard max and smooth max (use_smooth_max=True, tau 0.1). Measured per (B, max):

- step time: median of ``triton.testing.do_bench`` (gradients reset between runs);
- MaxSim memory: peak allocated during one step minus what was allocated before it (the embeddings). The
  gradients of the embeddings (the same for both) are included;
- the loss of both runs (flash_maxsim accumulates in fp32, the library's einsum in bf16): relative difference.

Without enable() the library runs its own einsum (COLPALI_SCORES_BACKEND=torch; ``--library-backend auto`` lets
0.3.18 use late-interaction-kernels for the hard max when that package is installed).

On a CUDA GPU, with colpali-engine installed (``pip install colpali-engine==0.3.18``):

    python benchmarks/colpali_step.py colpali_step.json [--batch-sizes 64 128 256]

Prints a markdown table and writes every number to the JSON path. ``--cpu-smoke`` runs tiny shapes on the CPU
(flash_maxsim's PyTorch path, wall-clock timings, no memory numbers) to test the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))     # the working tree's flash_maxsim, whatever else is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MIB = 2 ** 20


def make_inputs(batch, query_length, doc_length, dim, dtype, device, seed):
    generator = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(batch, query_length, dim, device=device, generator=generator), dim=-1)
    real = torch.randint(max(1, query_length * 5 // 8), query_length + 1, (batch,), device=device,
                         generator=generator)
    q = q * (torch.arange(query_length, device=device) < real[:, None])[..., None]
    d = F.normalize(torch.randn(batch, doc_length, dim, device=device, generator=generator), dim=-1)
    return q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()


def make_step(loss_fn, q, d):
    def step():
        # the library prints a line per call when normalised smooth-max scores leave [0, 1] (zero query tokens
        # add tau*log(Ld) each); the print stays in both runs' time, its text is dropped
        with contextlib.redirect_stdout(io.StringIO()):
            loss = loss_fn(q, d)
        loss.backward()
        return loss
    return step


def time_ms(step, tensors, device, repeats):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(step, grad_to_none=tensors, return_mode="median")
    samples = []
    for _ in range(repeats):
        for t in tensors:
            t.grad = None
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def peak_mib(step, tensors, device):
    if device != "cuda":
        return None
    for t in tensors:
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


def measure(batch, smooth, args, device, dtype):
    from colpali_engine.loss.late_interaction_losses import ColbertLoss
    from flash_maxsim.integrations import colpali as flash_colpali

    q, d = make_inputs(batch, args.query_length, args.doc_length, args.dim, dtype, device, seed=batch)
    loss_fn = ColbertLoss(use_smooth_max=smooth).to(device)
    step = make_step(loss_fn, q, d)
    row = {"batch": batch, "max": "smooth" if smooth else "hard", "query_length": args.query_length,
           "doc_length": args.doc_length, "dim": args.dim, "dtype": str(dtype).replace("torch.", ""),
           "similarity_tensor_mib": batch * batch * args.query_length * args.doc_length * dtype.itemsize / MIB}
    for variant in ("library", "flash"):
        context = flash_colpali.enabled() if variant == "flash" else contextlib.nullcontext()
        try:
            with context:
                q.grad = d.grad = None
                row[f"{variant}_loss"] = step().item()
                row[f"{variant}_ms"] = time_ms(step, [q, d], device, args.repeats)
                row[f"{variant}_mib"] = peak_mib(step, [q, d], device)
        except torch.cuda.OutOfMemoryError:
            row[f"{variant}_loss"] = row[f"{variant}_ms"] = row[f"{variant}_mib"] = None
            row[f"{variant}_error"] = "out of memory"
            torch.cuda.empty_cache()
        q.grad = d.grad = None
    if row.get("library_loss") is not None and row.get("flash_loss") is not None:
        row["loss_relative_difference"] = abs(row["flash_loss"] - row["library_loss"]) / abs(row["library_loss"])
    return row


def fmt(value, pattern="{:.2f}"):
    return "n/a" if value is None else pattern.format(value)


def table(rows):
    lines = ["| B | max | library step (ms) | flash step (ms) | speed-up | library MaxSim memory (MiB) "
             "| flash MaxSim memory (MiB) | memory ratio | loss rel. diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = r["library_ms"] / r["flash_ms"] if r.get("library_ms") and r.get("flash_ms") else None
        ratio = r["library_mib"] / r["flash_mib"] if r.get("library_mib") and r.get("flash_mib") else None
        lines.append(f"| {r['batch']} | {r['max']} | {fmt(r.get('library_ms'))} | {fmt(r.get('flash_ms'))} "
                     f"| {fmt(speedup, '{:.1f}x')} | {fmt(r.get('library_mib'), '{:.0f}')} "
                     f"| {fmt(r.get('flash_mib'), '{:.0f}')} | {fmt(ratio, '{:.0f}x')} "
                     f"| {fmt(r.get('loss_relative_difference'), '{:.1e}')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json_path", help="where to write the results (JSON)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--query-length", type=int, default=32)
    parser.add_argument("--doc-length", type=int, default=1030)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="CPU timing repeats (CUDA uses do_bench)")
    parser.add_argument("--library-backend", choices=["torch", "auto", "lik"], default="torch",
                        help="COLPALI_SCORES_BACKEND for the run without enable() (0.3.17+): torch = the library's "
                             "einsum (default); auto/lik = late-interaction-kernels for the hard max when installed")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, to test this script")
    args = parser.parse_args(argv)
    os.environ["COLPALI_SCORES_BACKEND"] = args.library_backend
    if args.cpu_smoke:
        device, dtype = "cpu", torch.float32
        args.batch_sizes, args.query_length, args.doc_length, args.dim = [4, 8], 8, 40, 16
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (or --cpu-smoke)")
        device, dtype = "cuda", torch.bfloat16
    import colpali_engine  # noqa: F401 - fail early when it is missing
    import importlib.metadata

    rows = [measure(batch, smooth, args, device, dtype) for batch in args.batch_sizes for smooth in (False, True)]
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "colpali_engine": importlib.metadata.version("colpali-engine"),
            "library_backend": args.library_backend}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    print(f"ColbertLoss step (forward + backward), Lq={args.query_length} (zero-padded), Ld={args.doc_length}, "
          f"d={args.dim}, {str(dtype).replace('torch.', '')}, on {info['device']}; torch {info['torch']}, "
          f"colpali-engine {info['colpali_engine']} (without enable(): COLPALI_SCORES_BACKEND={args.library_backend})")
    print(table(rows))


if __name__ == "__main__":
    main()
