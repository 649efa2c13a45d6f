"""Where PyLate-shaped inference calls spend their time (device probe, session 39; docs/perf-notes.md).

benchmarks/pylate_auto_fallback.py found ``colbert_scores`` through ``enable()`` slower than PyLate's own
late-interaction-kernels backend at 32 queries x 1000 documents x 180 tokens (0.435 against 0.343 ms on an H100)
and slower than PyLate's torch path for one query against 100 documents (0.202 against 0.054 ms). This takes the
call apart: the public ``flash_maxsim.maxsim`` without masks, with bool masks (``exclude`` and ``zero``), with
PyLate's float masks, the PyLate scorer, and LIK through PyLate. Each row: GPU-inclusive median ms
(``triton.testing.do_bench``) and host microseconds per call with no sync inside the loop
(``kernel_check.per_call_us``).

    python3 benchmarks/pylate_inference_probe.py [OUT.json]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
os.environ.pop("PYLATE_SCORES_BACKEND", None)

import torch  # noqa: E402
import triton.testing  # noqa: E402

import flash_maxsim  # noqa: E402
from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402
from kernel_check import per_call_us  # noqa: E402

SHAPES = [("1 x 100 x 300", 1, 32, 100, 300), ("32 x 1000 x 180", 32, 32, 1000, 180),
          ("32 x 1000 x 300", 32, 32, 1000, 300), ("1 x 1000 x 300", 1, 32, 1000, 300)]


def main(out_path):
    pylate_scores = None
    try:
        from pylate.scores import colbert as pylate_scores
    except ImportError:
        pass
    rows = []
    print(torch.cuda.get_device_name())
    print(f"{'shape':18s} {'call':34s} {'ms':>8s} {'host us':>8s}")
    for name, nq, lq, nd, ld in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(nd)
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", generator=g), dim=-1).bfloat16()
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", generator=g), dim=-1).bfloat16()
        lengths = torch.randint(ld // 2, ld + 1, (nd, 1), device="cuda", generator=g)
        D_bool = (torch.arange(ld, device="cuda") < lengths) & (torch.rand(nd, ld, device="cuda", generator=g) > 0.1)
        Q_bool = torch.ones(nq, lq, dtype=torch.bool, device="cuda")
        D_float, Q_float = D_bool.float(), Q_bool.float()
        calls = {
            "maxsim, no masks": lambda: flash_maxsim.maxsim(Q, D),
            "maxsim, documents mask, exclude": lambda: flash_maxsim.maxsim(Q, D, None, D_bool),
            "maxsim, bool masks, zero": lambda: flash_maxsim.maxsim(Q, D, Q_bool, D_bool, masked="zero"),
            "maxsim, float masks, zero": lambda: flash_maxsim.maxsim(Q, D, Q_float, D_float, masked="zero"),
            "scorer, float masks": lambda: flash_pylate.colbert_scores(Q, D, Q_float, D_float),
            "scorer, bool masks": lambda: flash_pylate.colbert_scores(Q, D, Q_bool, D_bool),
            "scorer, no masks": lambda: flash_pylate.colbert_scores(Q, D),
        }
        if pylate_scores is not None:
            calls["PyLate torch, float masks"] = lambda: pylate_scores.colbert_scores(Q, D, Q_float, D_float,
                                                                                       backend="torch")
            if pylate_scores._try_lik("lik", Q):
                calls["PyLate lik, float masks"] = lambda: pylate_scores.colbert_scores(Q, D, Q_float, D_float,
                                                                                         backend="lik")
                calls["PyLate lik, no masks"] = lambda: pylate_scores.colbert_scores(Q, D, backend="lik")
        with torch.no_grad():
            for call, fn in calls.items():
                ms = triton.testing.do_bench(fn, return_mode="median")
                host = per_call_us(fn, n=100)
                rows.append({"shape": name, "call": call, "ms": ms, "host_us": host})
                print(f"{name:18s} {call:34s} {ms:8.3f} {host:8.1f}")
    if out_path:
        Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
