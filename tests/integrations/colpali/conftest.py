"""Fixtures of the colpali-engine integration tests.

- CPU tests run flash_maxsim's exact PyTorch path (the Triton interpreter costs ~1 s per call): tests marked
  ``interpret`` run the real Triton kernels in the interpreter instead, tests marked ``gpu`` choose nothing;
- fp32 matmuls at "highest" precision, so that the library's einsum is exact fp32 too;
- the integration is disabled again after every test;
- fresh data every run: the seed is printed, FLASH_MAXSIM_TEST_SEED=N replays it.
"""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("colpali_engine")

from flash_maxsim.integrations import colpali as flash_colpali  # noqa: E402
from flash_maxsim.ops import force_backend  # noqa: E402

from colpali_cases import Calls  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated(request):
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    flash_colpali.disable()
    marks = {m.name for m in request.node.iter_markers()}
    backend = force_backend("torch") if not marks & {"interpret", "gpu"} else None
    if backend is not None:
        backend.__enter__()
    try:
        yield
    finally:
        if backend is not None:
            backend.__exit__(None, None, None)
        flash_colpali.disable()
        torch.set_float32_matmul_precision(precision)


@pytest.fixture
def seed():
    value = int(os.environ.get("FLASH_MAXSIM_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
    print(f"seed={value} (replay with FLASH_MAXSIM_TEST_SEED={value})")
    return value


@pytest.fixture
def generator(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def calls(monkeypatch):
    return Calls(monkeypatch)


@pytest.fixture(scope="session")
def library_version():
    return flash_colpali._version()


@pytest.fixture(scope="session")
def has_dispatch():
    """colpali-engine 0.3.17+ (``colpali_engine.utils.maxsim`` and ``ColbertModule._inbatch_scores``)."""
    from colpali_engine.loss.late_interaction_losses import ColbertModule

    try:
        import colpali_engine.utils.maxsim  # noqa: F401
    except ImportError:
        return False
    return hasattr(ColbertModule, "_inbatch_scores")
