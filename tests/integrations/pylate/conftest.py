"""Shared setup of the PyLate integration tests (CPU on PyLate 1.6.0 and 1.3.4; GPU tests on CUDA).

- No model hub: HF_HUB_OFFLINE=1 before anything imports huggingface_hub.
- PyLate's own torch path is the baseline everywhere: PYLATE_SCORES_BACKEND=torch (PyLate >= 1.5 would
  otherwise pick its "flash" backend on CUDA, which imports the name ``flash_maxsim`` expecting another package
  and, finding this one, falls back with a warning: test_pylate_flash_backend.py).
- tests/conftest.py sets TRITON_INTERPRET=1 without CUDA, which would run every CPU call through the Triton
  interpreter (~1 s per call): the tests here run flash_maxsim's exact CPU path unless they ask for the kernels.
- One CPU thread: on a busy 2-core machine OpenMP's spin-waiting made the MiniLM steps 10x slower with two.
- Each test starts and ends with the integration disabled.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYLATE_SCORES_BACKEND", "torch")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import flash_maxsim  # noqa: E402
from flash_maxsim import ops  # noqa: E402
from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cpu_path_and_disabled_integration():
    flash_pylate.disable()
    if torch.cuda.is_available():
        yield
    else:
        with ops.force_backend("torch"):
            yield
    flash_pylate.disable()


class CallCounter:
    """Wraps flash_maxsim.maxsim (the integration looks it up at call time) and counts the calls."""

    def __init__(self, real):
        self.real = real
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.fixture
def flash_calls(monkeypatch):
    counter = CallCounter(flash_maxsim.maxsim)
    monkeypatch.setattr(flash_maxsim, "maxsim", counter)
    return counter
