"""benchmarks/cpu_bench.py on tiny rows: every implementation runs, agrees with eager, and the row's dict holds
medians, ratios to eager and peak memory for each."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cpu_bench  # noqa: E402


def test_scoring_and_training_rows(tmp_path):
    rows = [cpu_bench.Row("tiny", 2, 5, 4, 7, d=8), cpu_bench.Row("tiny-train", 3, 3, 4, 7, d=8, train=True)]
    for row in rows:
        result = cpu_bench.measure_row(row, rounds=2, memory=True)
        assert {"eager", "flash_maxsim"} <= set(result["ms"])
        assert set(result["vs_eager"]) == set(result["ms"]) and result["vs_eager"]["eager"] == 1.0
        assert all(v < 1e-4 for v in result["max_abs_diff_vs_eager"].values()), result["max_abs_diff_vs_eager"]
        assert set(result["peak_mib"]) == set(result["ms"])
        json.dumps(result)                                          # what the script writes
    peers = cpu_bench.installed_peers()
    assert (result["flash_vs_best_peer"] is None) == (rows[-1].train or not peers)


def test_eager_is_the_toolkits_formula():
    g = torch.Generator().manual_seed(0)
    q, d = torch.randn(2, 3, 4, generator=g), torch.randn(5, 6, 4, generator=g)
    expected = torch.stack([torch.stack([(q[i] @ d[j].T).max(-1).values.sum() for j in range(5)]) for i in range(2)])
    torch.testing.assert_close(cpu_bench.eager_scores(q, d), expected)


def test_main_writes_json_and_a_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_bench, "ROWS", (cpu_bench.Row("tiny", 1, 4, 3, 5, d=8),))
    out = tmp_path / "cpu.json"
    cpu_bench.main(["--rounds", "1", "--no-memory", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["row"] for r in data["rows"]] == ["tiny"] and "torch" in data["machine"]
    assert "| tiny" in capsys.readouterr().out
