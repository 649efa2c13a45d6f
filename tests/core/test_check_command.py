"""The check command: ``flash-maxsim check`` / ``python -m flash_maxsim check``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_maxsim
from flash_maxsim.__main__ import main

ROWS = ("ColBERT", "ColPali", "ragged", "masks, zero mode", "masks, exclude mode", "smooth max", "training fwd+bwd")


def _interpreter_row_expected() -> bool:
    """Without CUDA the check adds the interpreted kernels' row where Triton's interpreter can run them."""
    import flash_maxsim.__main__ as cli

    triton_version = cli._version("triton")
    return (not torch.cuda.is_available() and triton_version is not None and cli._version("numpy") is not None
            and cli._interpreter_runs_the_kernels(triton_version))


def test_check_passes_and_leads_with_the_verdict(capsys):
    assert main(["check", "--quick", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    first_line = out.splitlines()[0]
    assert first_line.startswith(f"flash_maxsim {flash_maxsim.__version__} on ") and "all passed" in first_line
    table = out.index("| check | result | error / tolerance |")
    if not torch.cuda.is_available():
        assert out.index("exact blocked PyTorch path, not the fused GPU kernels") < table          # the CPU caveat comes first
    assert ("| Triton kernels, interpreted" in out) == _interpreter_row_expected()
    for row in ROWS:
        assert f"| {row}" in out
    assert "FAILED" not in out and out.rstrip().endswith("all checks passed")


def test_check_fails_on_wrong_numbers(monkeypatch, capsys):
    correct = flash_maxsim.maxsim
    monkeypatch.setattr(flash_maxsim, "maxsim", lambda *args, **kwargs: correct(*args, **kwargs) * 1.001)
    assert main(["check", "--quick", "--repeats", "1", "--no-interpreter"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out.splitlines()[0] and "FAILED: " in out


def test_check_json(capsys):
    assert main(["check", "--quick", "--repeats", "1", "--no-interpreter", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True and data["flash_maxsim"] == flash_maxsim.__version__
    assert data["torch"] == torch.__version__
    assert len(data["checks"]) == len(ROWS)
    assert data["cpu_benchmark"] is None                  # --quick leaves the CPU benchmark out
    for check, row in zip(data["checks"], ROWS):
        assert check["name"].startswith(row) and check["passed"] is True
        assert 0 <= check["error_over_tolerance"] <= 1
        assert check["error_over_tolerance"] == pytest.approx(check["error"] / check["tolerance"])
        assert check["flash_ms"] > 0 and check["eager_ms"] > 0


def _check_cpu_benchmark_rows(benchmark, names, realistic=True):
    """The benchmark's rows: every implementation timed and agreeing with eager, peaks measured; on realistic
    rows (tens of ms, where rounding to 0.01 ms does not matter) the ratios are those of the times."""
    from flash_maxsim import _cpu_benchmark

    peers = _cpu_benchmark.installed_peers()
    assert [r["row"] for r in benchmark["rows"]] == list(names)
    assert benchmark["rounds"] == 3 and benchmark["torch_threads"] == torch.get_num_threads()
    assert set(benchmark["peers"]) == set(peers) and benchmark["seconds"] > 0
    for r in benchmark["rows"]:
        expected = {"eager", "flash_maxsim"} | (set() if r["train"] else set(peers))
        assert set(r["ms"]) == expected and all(ms > 0 for ms in r["ms"].values())
        assert r["vs_eager"]["eager"] == 1.0
        assert all(diff < 1e-4 for diff in r["max_abs_diff_vs_eager"].values()), r["max_abs_diff_vs_eager"]
        assert set(r["peak_mib"]) == expected
        assert all(mib is None or mib >= 0 for mib in r["peak_mib"].values())
        peer_ms = [ms for name, ms in r["ms"].items() if name in peers]
        assert (r["flash_vs_best_peer"] is None) == (not peer_ms)
        if realistic:
            assert r["vs_eager"]["flash_maxsim"] == pytest.approx(r["ms"]["flash_maxsim"] / r["ms"]["eager"],
                                                                  rel=1e-2)
            if peer_ms:
                assert r["flash_vs_best_peer"] == pytest.approx(r["ms"]["flash_maxsim"] / min(peer_ms), rel=1e-2)


def test_check_json_holds_the_cpu_benchmark(capsys):
    """--benchmark: the CPU benchmark's short form on its realistic rows, in the JSON beside the checks."""
    from flash_maxsim import _cpu_benchmark

    assert main(["check", "--device", "cpu", "--quick", "--repeats", "1", "--no-interpreter", "--benchmark",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True and len(data["checks"]) == len(ROWS)
    assert _cpu_benchmark.CHECK_ROWS == ("1x1k", "train-B32")
    _check_cpu_benchmark_rows(data["cpu_benchmark"], _cpu_benchmark.CHECK_ROWS)
    one_query, step = data["cpu_benchmark"]["rows"]
    assert [one_query[k] for k in ("Nq", "B", "Lq", "Ld", "d", "train")] == [1, 1000, 32, 300, 128, False]
    assert [step[k] for k in ("Nq", "B", "Lq", "Ld", "d", "train")] == [32, 32, 32, 300, 128, True]


def test_cpu_benchmark_steps_run_the_cpu_path(monkeypatch):
    """The benchmark's flash_maxsim training step runs its forward and its backward on the CPU path, also where
    CPU tensors would otherwise run the interpreted kernels (TRITON_INTERPRET=1, as in these tests)."""
    from flash_maxsim import _cpu, _cpu_benchmark

    calls = []
    for name in ("forward", "backward"):
        real = getattr(_cpu, name)
        monkeypatch.setattr(_cpu, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    row = _cpu_benchmark.Row("tiny-train", 3, 3, 4, 7, d=8, train=True)
    q, d = _cpu_benchmark.inputs(row)
    loss, dq, dd = _cpu_benchmark.implementations(row, q, d)["flash_maxsim"]()
    assert calls == ["forward", "backward"]
    expected = _cpu_benchmark.implementations(row, q, d)["eager"]()
    for got, want in zip((loss, dq, dd), expected):
        torch.testing.assert_close(got, want)


def test_cpu_benchmark_times_every_row_before_measuring_memory(monkeypatch):
    """Measuring memory fixes glibc's mmap threshold for the process: every timing comes first."""
    from flash_maxsim import _cpu_benchmark

    events = []
    real_medians, real_free = _cpu_benchmark.interleaved_medians, _cpu_benchmark.return_freed_memory_to_the_system
    monkeypatch.setattr(_cpu_benchmark, "interleaved_medians", lambda *a: events.append("time") or real_medians(*a))
    monkeypatch.setattr(_cpu_benchmark, "return_freed_memory_to_the_system",
                        lambda: events.append("memory") or real_free())
    rows = [_cpu_benchmark.Row("tiny", 2, 5, 4, 7, d=8), _cpu_benchmark.Row("tiny-train", 3, 3, 4, 7, d=8, train=True)]
    results = _cpu_benchmark.measure(rows, rounds=1, peers=False)
    assert events == ["time", "time"] + ["memory"] * 4                  # two implementations per row
    assert all(set(r["peak_mib"]) == {"eager", "flash_maxsim"} for r in results)


@pytest.fixture
def tiny_cpu_benchmark(monkeypatch):
    """The CPU benchmark's short form on tiny rows (the realistic ones take seconds)."""
    from flash_maxsim import _cpu_benchmark

    rows = (_cpu_benchmark.Row("tiny", 2, 5, 4, 7, d=8), _cpu_benchmark.Row("tiny-train", 3, 3, 4, 7, d=8,
                                                                             train=True))
    monkeypatch.setattr(_cpu_benchmark, "ROWS", rows)
    monkeypatch.setattr(_cpu_benchmark, "CHECK_ROWS", ("tiny", "tiny-train"))
    return [r.name for r in rows]


def test_check_prints_the_cpu_benchmark_after_the_checks(tiny_cpu_benchmark, capsys):
    assert main(["check", "--device", "cpu", "--quick", "--repeats", "1", "--no-interpreter", "--benchmark"]) == 0
    out = capsys.readouterr().out
    assert "the CPU benchmark after the table times realistic ones" in out.split("| check |")[0]
    section = out.index("CPU benchmark: the CPU path against eager PyTorch")
    assert out.index("| check | result |") < section and out.rstrip().endswith("all checks passed")
    assert f"median of 3 interleaved rounds, {torch.get_num_threads()} torch threads" in out
    lines = out[section:].splitlines()
    head = next(line for line in lines if line.startswith("| row |"))
    assert head.split(" | ")[1:3] == ["eager", "flash_maxsim"] and head.endswith("| ours / best peer |")
    for name in tiny_cpu_benchmark:
        row = next(line for line in lines if line.startswith(f"| {name} ("))
        eager, flash = row.split(" | ")[1:3]
        assert " ms (1.00)" in eager and " ms (" in flash


def test_check_runs_the_cpu_benchmark_by_default_on_a_cpu(tiny_cpu_benchmark, monkeypatch, capsys):
    """On by default on a CPU; --quick and --no-benchmark leave it out."""
    import flash_maxsim.__main__ as cli

    standard_rows = cli.standard_rows
    monkeypatch.setattr(cli, "standard_rows", lambda device, quick: standard_rows(device, True))   # fast rows
    common = ["check", "--device", "cpu", "--repeats", "1", "--no-interpreter", "--json"]
    assert main(common) == 0
    _check_cpu_benchmark_rows(json.loads(capsys.readouterr().out)["cpu_benchmark"], tiny_cpu_benchmark,
                              realistic=False)
    for extra in (["--quick"], ["--no-benchmark"]):
        assert main(common + extra) == 0
        assert json.loads(capsys.readouterr().out)["cpu_benchmark"] is None
    assert main(common[:-1] + ["--no-benchmark"]) == 0
    assert "`flash-maxsim check --benchmark` times realistic ones" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check runs on CPU-only machines")
@pytest.mark.parametrize("package, version, reason", [("numpy", None, "pip install numpy"),
                                                      ("triton", "3.6.0", "Triton 3.6.0's interpreter cannot")])
def test_check_skips_the_interpreter_where_it_cannot_run(monkeypatch, capsys, caplog, package, version, reason):
    import flash_maxsim.__main__ as cli

    real_version = cli._version
    monkeypatch.setattr(cli, "_version", lambda name: version if name == package else real_version(name))
    assert main(["check", "--quick", "--repeats", "1"]) == 0
    assert "Triton kernels, interpreted" not in capsys.readouterr().out
    assert reason in caplog.text


def _run(args):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)        # as on a user's machine: the CPU path, interpreter in a subprocess
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU flow (interpreter in a subprocess)")
def test_console_script():
    script = Path(sys.executable).with_name("flash-maxsim")
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    proc = _run([str(script), "check", "--quick", "--repeats", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    assert ("| Triton kernels, interpreted" in proc.stdout) == _interpreter_row_expected()
    assert "flash_maxsim.check: [7/7] training" in proc.stderr          # progress goes to stderr


def test_version_and_help():
    version = _run([sys.executable, "-m", "flash_maxsim", "--version"])
    assert version.returncode == 0 and version.stdout.strip() == f"flash-maxsim {flash_maxsim.__version__}"
    for args in ([], ["check"]):
        help_text = _run([sys.executable, "-m", "flash_maxsim", *args, "--help"])
        assert help_text.returncode == 0
        assert "SUPPRESS" not in help_text.stdout and "``" not in help_text.stdout
    assert "--json" in help_text.stdout and "--quick" in help_text.stdout
    assert "--benchmark" in help_text.stdout and "--no-benchmark" in help_text.stdout
