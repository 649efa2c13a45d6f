import os
import random

import pytest


@pytest.fixture
def seed():
    """Fresh data every run; a failing test's captured output shows the seed, and FLASH_MAXSIM_TEST_SEED=N
    replays it."""
    value = int(os.environ.get("FLASH_MAXSIM_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
    print(f"seed={value} (replay with FLASH_MAXSIM_TEST_SEED={value})")
    return value


@pytest.fixture
def highest_fp32_precision():
    """fp32 inputs follow torch's matmul precision; tolerances that assume full fp32 products use this."""
    import torch
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)
