"""Peak memory of the GPU path, computed without a GPU: the library's CUDA host code runs on CPU tensors with the
kernel launches recorded instead of run (``offline_compile.launches_recorded``), and every tensor allocated while
a function runs is tracked (a ``TorchDispatchMode``: each new storage counts from its first op until its last
tensor dies), so the peak above the inputs is what ``torch.cuda.max_memory_allocated`` would report, up to the
caching allocator's rounding (within 0.7 MiB of the H200's measurement on bench.py's training steps).

    python tools/offline_memory.py [--results RESULTS.json]

Prints the training table: predicted peak MiB above inputs (outputs included), next to a GPU run's measurement for
ours and the peers when a benchmark results JSON is given. tools/tests/test_offline_memory.py asserts memory
properties with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_compile import launches_recorded  # noqa: E402

import flash_maxsim as fm  # noqa: E402

MiB = 2 ** 20


class AllocationTracker(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, counting only storages created inside the mode."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self._ignored = {t.untyped_storage().data_ptr() for t in existing}
        self._users: dict = {}          # storage pointer -> live tensors using it
        self._bytes: dict = {}
        self._made_by: dict = {}        # storage pointer -> (op, shape, dtype) of its first tensor
        self.current = 0
        self.peak = 0
        self.live_at_peak: list = []    # (op, shape, dtype, MiB) of every storage alive at the peak

    def _release(self, key):
        self._users[key] -= 1
        if self._users[key] == 0:
            self.current -= self._bytes.pop(key)
            del self._users[key], self._made_by[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._ignored:
                continue
            if key not in self._users:
                self._users[key] = 0
                self._bytes[key] = storage.nbytes()
                self.current += storage.nbytes()
                self._made_by[key] = (func.__name__, tuple(t.shape), str(t.dtype).replace("torch.", ""))
                if self.current > self.peak:
                    self.peak = self.current
                    self.live_at_peak = [(*self._made_by[k], round(self._bytes[k] / MiB, 2)) for k in self._users]
            self._users[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def peak_above_inputs(fn, inputs, sms: int = 132) -> tuple[float, list]:
    """Peak MiB allocated while ``fn()`` runs on the GPU path (kernels not run), outputs included, above the
    ``inputs``; and what was alive at that peak."""
    with launches_recorded(sms, keep_tensors=False):
        tracker = AllocationTracker(*inputs)
        with tracker:
            out = fn()
        del out
    return tracker.peak / MiB, tracker.live_at_peak


@dataclass
class TrainingStep:
    """bench.py's training rows: scores -> loss (in-batch cross-entropy, or KL for per-query candidates) ->
    gradients of queries and documents."""

    name: str
    Nq: int
    B: int
    Lq: int
    Ld: int
    d: int = 128
    kd: bool = False
    smooth_tau: Optional[float] = None

    def build(self, dtype=torch.bfloat16):
        q = torch.empty(self.Nq, self.Lq, self.d, dtype=dtype).normal_().requires_grad_()
        shape = (self.Nq, self.B, self.Ld, self.d) if self.kd else (self.B, self.Ld, self.d)
        docs = torch.empty(shape, dtype=dtype).requires_grad_()     # never read: the kernels do not run
        labels = torch.arange(self.Nq) * (self.B // self.Nq)
        teacher = torch.zeros(self.Nq, self.B).log_softmax(-1)

        def step():
            s = fm.maxsim(q, docs, smooth_tau=self.smooth_tau)
            if self.kd:
                loss = F.kl_div(s.float().log_softmax(-1), teacher, log_target=True, reduction="batchmean")
            else:
                loss = F.cross_entropy(s.float() / 0.02, labels)
            return (s, *torch.autograd.grad(loss, (q, docs)))
        return step, (q, docs, labels, teacher)


# the names of bench.py's rows, so that a results.json can be matched
TRAINING_STEPS = [
    TrainingStep("ColBERT in-batch B128, 32x300", 128, 128, 32, 300),
    TrainingStep("ColBERT B64 + 7 negatives (512 docs), 32x300", 64, 512, 32, 300),
    TrainingStep("ColPali in-batch B64, 32x1030", 64, 64, 32, 1030),
    TrainingStep("ColPali in-batch B256, 32x1030", 256, 256, 32, 1030),
    TrainingStep("smooth max (tau=0.1), ColPali in-batch B128, 32x1030", 128, 128, 32, 1030, smooth_tau=0.1),
    TrainingStep("KD 64 queries x 64 candidates, 32x300", 64, 64, 32, 300, kd=True),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=None, help="a bench.py results.json: its training memory beside ours")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("-v", action="store_true", help="list what is alive at each peak")
    args = ap.parse_args(argv)
    measured = {}
    if args.results:
        with open(args.results) as f:
            for row in json.load(f).get("training", []):
                measured[row["name"]] = {k: v.get("peak_mb") for k, v in row["results"].items()
                                         if isinstance(v, dict)}
    print("| training step | predicted MiB (this code) | " + ("measured: ours / fmpypi / lik |" if measured else ""))
    print("|---|---|" + ("---|" if measured else ""))
    for step in TRAINING_STEPS:
        fn, inputs = step.build()
        peak, live = peak_above_inputs(fn, inputs, args.sms)
        m = measured.get(step.name, {})
        device = " / ".join("-" if m.get(k) is None else f"{m[k]:.1f}" for k in ("ours", "fmpypi", "lik"))
        print(f"| {step.name} | {peak:.1f} | " + (f"{device} |" if measured else ""))
        if args.v:
            for entry in live:
                print(f"|   {entry} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
