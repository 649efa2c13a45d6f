"""The README's main job, ``python -m flash_maxsim check`` / ``flash-maxsim check``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_maxsim
from flash_maxsim.__main__ import main


def test_check_passes_and_prints_the_table(capsys):
    assert main(["check", "--quick", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| check | shape | max error / tolerance |" in out
    for row in ("ColBERT", "ColPali", "ragged", "masks, zero mode", "smooth max", "training fwd+bwd"):
        assert row in out
    if not torch.cuda.is_available():
        assert "Triton kernels, interpreted" in out
    assert "FAILED" not in out and "all checks passed" in out


def test_check_fails_on_wrong_numbers(monkeypatch, capsys):
    correct = flash_maxsim.maxsim
    monkeypatch.setattr(flash_maxsim, "maxsim", lambda *args, **kwargs: correct(*args, **kwargs) * 1.001)
    assert main(["check", "--quick", "--repeats", "1", "--no-interpreter"]) == 1
    assert "FAILED" in capsys.readouterr().out


def _run(args):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)        # as on a user's machine: the CPU path, interpreter in a subprocess
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU flow (interpreter in a subprocess)")
def test_console_script_entry_point():
    script = Path(sys.executable).with_name("flash-maxsim")
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    proc = _run([str(script), "check", "--quick", "--repeats", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    assert "Triton kernels, interpreted" in proc.stdout          # ran in its own TRITON_INTERPRET=1 process
    assert "INFO flash_maxsim.check" in proc.stderr               # progress goes through logging


def test_module_entry_point_help():
    proc = _run([sys.executable, "-m", "flash_maxsim", "check", "--help"])
    assert proc.returncode == 0 and "--quick" in proc.stdout
