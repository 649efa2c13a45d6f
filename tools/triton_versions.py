"""The same rows timed under whichever Triton is first on the path, so that runs of this script under two Tritons
(e.g. 3.6 and 3.9, each in its own environment) compare what a user's Triton version costs: forward (bf16, int8
index) and a training step. Run each Triton's pass alternately, twice or more, on the same GPU and machine.

    python tools/triton_versions.py [--json OUT]                  # one environment's Triton
    PYTHONPATH=/path/to/other/triton python tools/triton_versions.py  # another's, ahead of it on the path

Prints one line per row (median ms of ``triton.testing.do_bench``) and, with ``--json``, writes them.
Inputs: random L2-normalised bf16 tokens, d = 128, no masks (as benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.testing import do_bench

import flash_maxsim as fm


def _tokens(*shape):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda", dtype=torch.bfloat16), dim=-1)


def _forward(Nq, B, Lq, Ld, quantized=False):
    q, docs = _tokens(Nq, Lq, 128), _tokens(B, Ld, 128)
    if quantized:
        docs = fm.quantize(docs)
    return lambda: fm.maxsim(q, docs)


def _training_step(Nq, B, Lq, Ld):
    """In-batch scores, cross-entropy over scores / 0.02, both gradients (benchmarks/bench.py's training rows)."""
    q, docs = _tokens(Nq, Lq, 128).requires_grad_(True), _tokens(B, Ld, 128).requires_grad_(True)
    labels = torch.arange(Nq, device="cuda") * (B // Nq)

    def step():
        loss = torch.nn.functional.cross_entropy(fm.maxsim(q, docs) / 0.02, labels)
        torch.autograd.grad(loss, (q, docs))
    return step


ROWS = {
    "bf16 1x10k 32x300": lambda: _forward(1, 10000, 32, 300),
    "bf16 1x10k 32x1030": lambda: _forward(1, 10000, 32, 1030),
    "bf16 1x1k 1024x1024": lambda: _forward(1, 1000, 1024, 1024),
    "bf16 64x1k 32x300": lambda: _forward(64, 1000, 32, 300),
    "int8 1x10k 32x300": lambda: _forward(1, 10000, 32, 300, quantized=True),
    "int8 1x10k 32x1030": lambda: _forward(1, 10000, 32, 1030, quantized=True),
    "int8 1x10k 1024x1024": lambda: _forward(1, 10000, 1024, 1024, quantized=True),
    "train ColBERT B128 32x300": lambda: _training_step(128, 128, 32, 300),
    "train ColPali B256 32x1030": lambda: _training_step(256, 256, 32, 1030),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--only", default="", help="only the rows whose name contains this text")
    args = ap.parse_args()
    torch.manual_seed(0)
    times = {}
    for name, make in ROWS.items():
        if args.only not in name:
            continue
        fn = make()
        times[name] = do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"triton {triton.__version__}  {name:28s} {times[name]:.4f} ms", flush=True)
        del fn
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
