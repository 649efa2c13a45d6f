"""Without CUDA, build the Triton kernels for the interpreter so that CI exercises the real kernel code on
the CPU. This must happen before flash_maxsim is imported. Also fixtures every suite's GPU tests share."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _twice_second_without_sync(fn):
    """``fn()`` once (it compiles and caches its launches), then again under torch's sync debug mode "error",
    which raises on any op that would synchronise with the device: both results."""
    first = fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return first, second


@pytest.fixture
def twice_second_without_sync():
    """The function ``fn -> (fn(), fn() again with any device synchronisation raising)``, for GPU tests that
    check a call enqueues its work without waiting for the device."""
    return _twice_second_without_sync
