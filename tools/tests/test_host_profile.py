"""tools/host_profile.py on the CPU: its smoke mode profiles the CPU path (PyTorch's operators), and with
--stub-launches the kernels' host path with every launch replaced by a no-op; both write every view (timed pieces,
cProfile buckets, torch.profiler counts) for each host row of the benchmark."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "host_profile.py"


def _run(tmp_path, *flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, str(TOOL), "--smoke", "--steps", "3", "--profiled-steps", "3",
                           "--json", str(out), *flags], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.parametrize("stub", [False, True], ids=["cpu-path", "stubbed-kernel-path"])
def test_smoke_profile_reports_every_view(tmp_path, stub):
    res, text = _run(tmp_path, *(["--stub-launches"] if stub else []))
    assert [r["name"].split(" [smoke")[0] for r in res["rows"]] == ["in-batch B8, 32x64",
                                                                      "ColBERT in-batch B128, 32x300"]
    for row in res["rows"]:
        assert row["kernels_path"] == stub and row["stub_launches"] == stub
        timed = row["timed_us"]
        assert timed["step (ours)"]["us"] > 0 and timed["canonicalize"]["us"] > 0
        # the kernels' own host functions are timed alone only where the step goes through them
        assert ("launch.forward (plan, allocations, launch)" in timed) == stub
        cp = row["cprofile"]
        pipeline, buckets = cp["pipeline_us"], cp["buckets_us"]
        assert pipeline["  canonicalize (validation)"] > 0 and pipeline["loss (cross-entropy)"] > 0
        assert (pipeline["          launch.forward"] > 0) == stub
        assert (pipeline["          _cpu.forward (CPU path)"] > 0) != stub
        assert (buckets["CPU path compute (_cpu.forward / _cpu.backward)"] > 0) != stub
        # the buckets split the profiled step: they add up to it, none negative but the rest within rounding
        assert sum(buckets.values()) == pytest.approx(cp["profiled_step_us"])
        # the two autograd buckets are what is left after subtracting inclusive times, and how cProfile attributes
        # the engine's C++ calls into Python differs between torch versions (negative on torch 2.15)
        derived = ("autograd engine", "autograd Function plumbing")
        assert all(v >= 0 for k, v in buckets.items() if not k.startswith(derived)), buckets
        assert buckets["allocations by flash_maxsim (outputs, arg-max, gradients)"] > 0 or not stub
        tp = row["torch_profiler"]
        assert tp["aten_ops"] > 0 and tp["gpu_us"] is None and row["host_syncs"] == []
    assert "ours above PyTorch share" in text and "cProfile:" in text
