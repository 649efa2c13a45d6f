"""Without CUDA, build the Triton kernels for the interpreter so that CI exercises the real kernel code on
the CPU. This must happen before flash_maxsim is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
