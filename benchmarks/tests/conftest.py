"""The benchmark's scripts import each other as top-level modules (``import report``, ``import _peers``), as they do
when run from the command line, and benchmark the working tree's flash_maxsim. Without CUDA, flash_maxsim's
Triton kernels run in the interpreter, as in the library's own suites (this must happen before it is imported)."""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCHMARKS = Path(__file__).resolve().parents[1]
for path in (BENCHMARKS.parent / "src", BENCHMARKS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
