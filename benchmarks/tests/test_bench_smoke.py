"""bench.py --cpu-smoke: every section runs on tiny CPU shapes, flash_maxsim's results check out against the float64
reference, and the JSON it writes renders into the documentation page."""

import json
import os
import subprocess
import sys
from pathlib import Path

import report

BENCH = Path(__file__).resolve().parents[1] / "bench.py"


def test_cpu_smoke_run_writes_results_that_render(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASH_MAXSIM_PYPI_DIR")}
    done = subprocess.run([sys.executable, str(BENCH), "--cpu-smoke", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["smoke"] and res["meta"]["timer"] == "perf_counter"
    sections = {"forward": 12, "training": 6, "host": 2, "compressed": 3, "forward_sweep": 3, "training_sweep": 2}
    assert {k: len(res[k]) for k in sections} == sections
    for key in ("forward", "training", "forward_sweep", "training_sweep"):
        for row in res[key]:
            ours = row["results"]["ours"]
            assert ours["status"] == "ok" and ours["ref_ok"], (key, row["name"], ours)
            eager = row["results"]["torch_bf16" if key.startswith("forward") else "eager"]
            assert eager["status"] == "ok" and eager["ok"], (key, row["name"], eager)
            # the peers' kernels need CUDA (or the interpreter): recorded as skipped, never raised
            assert {row["results"][k]["status"] for k in ("lik", "fmpypi")} == {"skipped"}
    for row in res["host"]:
        ours, share = row["results"]["ours"], row["results"]["pytorch_share"]
        assert ours["status"] == "ok" and ours["ref_ok"] and ours["us"] > 0 and len(ours["us_rounds"]) == 3, ours
        assert share["status"] == "ok" and 0 < share["us"] and share["aten_ops"] > 0, share
        assert ours["gpu_us"] is None and ours["aten_ops"] > share["aten_ops"], ours     # no GPU; more operators
        assert {row["results"][k]["status"] for k in ("lik", "fmpypi")} == {"skipped"}
    for row in res["compressed"]:
        for key in ("ours_int8", "ours_fp8", "ours_exact"):
            r = row["results"][key]
            assert r["status"] == "ok" and r["ok"] and r["fid_max_rel_err"] < 0.05, (row["name"], key, r)
    assert "CPU smoke run" in (tmp_path / "results.md").read_text()
    page = report.render_page([res], [], tmp_path / "page.md", plots_dir=None)
    assert page.count("|---|") >= 10 and f"## {res['meta']['device']}" in page
