"""PyLate's default ``backend="auto"`` on CUDA with flash-maxsim-kernels installed but not enabled.

PyLate >= 1.5.1 then takes this package for the PyPI project ``flash-maxsim`` (the same import name) and tries
it as its "flash" backend: it turns the masks into lengths, imports a function this package does not have, gets
PyLate's own ``FlashUnsupported`` back (flash_maxsim.integrations.pylate._other_project_fallback) and scores
with its next backend (late-interaction-kernels when installed, else its torch path); since session 39 that first
call also sets PyLate's record of the flash backend's availability to False, so later calls skip it. This script
measures what ``auto`` costs per call beyond that next backend (the warm-up absorbs the first call) and checks the
scores are that next backend's, bit for bit. For comparison, the same calls with
``flash_maxsim.integrations.pylate.enable()``.

    python benchmarks/pylate_auto_fallback.py [OUT.json]

Rows: PyLate's ``colbert_scores`` for inference (no gradient) and for a training step (scores + backward), at
ColBERT shapes (d = 128, bf16, skiplist-style masks). Columns, median ms (triton.testing.do_bench):
- ``torch``: ``backend="torch"``; ``lik``: ``backend="lik"`` (when late-interaction-kernels imports);
- ``auto``: PyLate's default, i.e. the detour and then the next backend;
- ``auto - next``: the detour alone; ``enabled``: ``auto`` after ``enable()`` (flash_maxsim's kernels).
Needs CUDA, PyLate >= 1.5.1 and Triton.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.pop("PYLATE_SCORES_BACKEND", None)  # PyLate's default is the point

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402

SHAPES = [  # (name, queries, query tokens, documents, document tokens, with gradient)
    ("rerank 1 x 100 x 300", 1, 32, 100, 300, False),
    ("score 32 x 1000 x 180", 32, 32, 1000, 180, False),
    ("train in-batch 64 x 64 x 180", 64, 32, 64, 180, True),
]


def inputs(nq, lq, nd, ld, grad, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", generator=g), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", generator=g), dim=-1)
    lengths = torch.randint(ld // 2, ld + 1, (nd, 1), device="cuda", generator=g)
    D_mask = (torch.arange(ld, device="cuda") < lengths) & (torch.rand(nd, ld, device="cuda", generator=g) > 0.1)
    Q_mask = torch.ones(nq, lq, device="cuda")
    Q, D = Q.bfloat16().requires_grad_(grad), D.bfloat16().requires_grad_(grad)
    return Q, D, Q_mask, D_mask.float()


def main(out_path: str | None) -> None:
    import triton.testing
    from pylate.scores import colbert as pylate_colbert
    from pylate.scores import _flash_backend  # noqa: F401  (PyLate >= 1.5.1)

    has_lik = pylate_colbert._try_lik("auto", torch.ones(1, device="cuda"))
    next_backend = "lik" if has_lik else "torch"
    rows = []
    warnings.simplefilter("ignore")  # the fallback's one warning
    print(f"{torch.cuda.get_device_name()}; PyLate's next backend after 'flash': {next_backend}")
    print(f"{'shape':32s} {'torch':>8s} {'lik':>8s} {'auto':>8s} {'auto-next':>9s} {'enabled':>8s}  same")
    for name, nq, lq, nd, ld, grad in SHAPES:
        Q, D, Q_mask, D_mask = inputs(nq, lq, nd, ld, grad, seed=len(rows))

        def call(backend):
            def run():
                scores = pylate_colbert.colbert_scores(Q, D, Q_mask, D_mask, backend=backend)
                if grad:
                    torch.autograd.grad(scores.sum(), (Q, D))
                return scores
            return run

        with torch.no_grad() if not grad else torch.enable_grad():
            same = torch.equal(call("auto")(), call(next_backend)())
            ms = {b: triton.testing.do_bench(call(b), return_mode="median")
                  for b in (["torch", "lik", "auto"] if has_lik else ["torch", "auto"])}
            with flash_pylate.enabled():
                ms["enabled"] = triton.testing.do_bench(call(None), return_mode="median")
        ms["auto - next"] = ms["auto"] - ms[next_backend]
        rows.append({"shape": name, "next_backend": next_backend, "same_scores": same, "ms": ms})
        print(f"{name:32s} {ms['torch']:8.3f} {ms.get('lik', float('nan')):8.3f} {ms['auto']:8.3f} "
              f"{ms['auto - next']:9.3f} {ms['enabled']:8.3f}  {same}")
    if out_path:
        Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    main(sys.argv[1] if len(sys.argv) > 1 else None)
