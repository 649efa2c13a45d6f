"""Where a small scoring call's host time goes (device probe; session 14, docs/perf-notes.md): microseconds per
call (``kernel_check.per_call_us``: calls back to back, no sync inside the loop) of the public call, of
``kernels.launch.forward``, of the cached launch alone (``kernels/_launcher.py``: Triton's C launcher called
directly where the compiled kernel allows it) against the compiled kernel's runner on the same arguments, and
of the pieces around them (an output allocation, the current stream, a tensor descriptor made and encoded).

    python3 benchmarks/host_probe.py            # on the GPU machine
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import flash_maxsim as fm  # noqa: E402
from ab_forward import forward_scores  # noqa: E402
from flash_maxsim import _layout  # noqa: E402
from flash_maxsim.kernels import _launcher, launch  # noqa: E402
from kernel_check import per_call_us  # noqa: E402

CALLS = 1000


def last_launch(p):
    """(entry, plan, tensors, scalars) of the forward's scoring launch (the one with a launch plan) for ``p``."""
    seen = {}
    real = _launcher.launch

    def spy(kernel, grid, tensors, scalars, meta, meta_key=None, plan=None):
        if plan is not None:
            seen.update(tensors=tensors, scalars=scalars, plan=plan)
        return real(kernel, grid, tensors, scalars, meta, meta_key, plan)
    _launcher.launch = spy
    try:
        forward_scores(launch, p)
    finally:
        _launcher.launch = real
    entry = next(e for k, e in _launcher._RUNNERS.items() if k[1] is seen["plan"])
    return entry, seen["plan"], seen["tensors"], seen["scalars"]


def probe(name, q, docs, overrides):
    launch.FORWARD_OVERRIDES.clear()
    launch.FORWARD_OVERRIDES.update(overrides)
    p = _layout.canonicalize(q, docs, None, None, masked="exclude", smooth_tau=None)
    entry, plan, tensors, scalars = last_launch(p)
    print(f"== {name} {overrides or ''} (TMA {plan.meta['TMA_DOCS']}, launch: {type(entry).__name__})")
    rows = {
        "fm.maxsim": lambda: fm.maxsim(q, docs),
        "launch.forward": lambda: forward_scores(launch, p),
        "cached launch alone": lambda: _launcher.launch(plan.kernel, plan.grid, tensors, scalars, plan.meta,
                                                        plan.meta_key, plan),
        # the compiled kernel's runner on the same arguments (what a direct C launch falls back to)
        "compiled runner alone": lambda: getattr(entry, "through_runner", entry)(tensors, None, scalars, None),
        "torch.empty scores": lambda: torch.empty(plan.scores_shape, device="cuda"),
    }
    if isinstance(scalars[0], _launcher.TensorDesc) and hasattr(entry, "encode"):
        desc = _launcher._tritons_scalars(tensors, scalars)[0]
        rows["TensorDescriptor made"] = lambda: _launcher._tritons_scalars(tensors, scalars)
        rows["descriptor encoded"] = lambda: entry.encode(desc, entry.desc_meta[0])
    for label, fn in rows.items():
        print(f"  {label:24s} {per_call_us(fn, CALLS):6.1f} us", flush=True)
    launch.FORWARD_OVERRIDES.clear()


def main():
    torch.manual_seed(0)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    probe("bf16 1x1k 32x300", q, torch.randn(1000, 300, 128, device="cuda", dtype=torch.bfloat16), {})
    q96 = torch.randn(1, 31, 96, device="cuda", dtype=torch.bfloat16)
    docs96 = torch.randn(5000, 257, 96, device="cuda", dtype=torch.bfloat16)
    probe("bf16 1x5k 31x257 d=96", q96, docs96, {})
    probe("bf16 1x5k 31x257 d=96", q96, docs96, {"TMA_DOCS": False})
    q128 = torch.randn(1, 128, 128, device="cuda", dtype=torch.bfloat16)
    probe("bf16 1x1k 128x1024", q128, torch.randn(1000, 1024, 128, device="cuda", dtype=torch.bfloat16), {})
    probe("int8 1x10k 32x300", q, fm.quantize(torch.randn(10000, 300, 128, device="cuda", dtype=torch.bfloat16)), {})
    print(f"direct launches: {'on' if _launcher._enabled else 'off'}")


if __name__ == "__main__":
    main()
