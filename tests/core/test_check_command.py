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
    for check, row in zip(data["checks"], ROWS):
        assert check["name"].startswith(row) and check["passed"] is True
        assert 0 <= check["error_over_tolerance"] <= 1
        assert check["error_over_tolerance"] == pytest.approx(check["error"] / check["tolerance"])
        assert check["flash_ms"] > 0 and check["eager_ms"] > 0


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
