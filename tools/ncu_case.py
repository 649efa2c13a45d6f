"""One forward case (or training step), launched a few times, for Nsight Compute (``ncu``) on a GPU:

    ncu --clock-control none --kernel-name maxsim_fwd_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python tools/ncu_case.py int8-1024

Cases: int8-1024 (1x10k 1024x1024, int8 index), int8-300 (1x10k 32x300, int8 index), bf16-64q (64x1k 32x300),
bf16-128x1024 (1x1k 128x1024); training steps (scores, cross-entropy, backward): train-b256 (ColPali in-batch
B256 32x1030), train-b64 (B64 32x1030), train-b64x8 (ColBERT B64 + 7 negatives: 512 documents of 32x300),
train-smooth-b128 (the smooth max, tau 0.1, ColPali B128), for the backward kernels (``--kernel-name
maxsim_bwd_dd_binned_kernel``, ``maxsim_bwd_dq_gather_kernel``, ``maxsim_bwd_kernel``, or
``regex:maxsim_bwd`` for all of them).
An optional second argument, a JSON object of ``kernels.tuning`` override fields, profiles a variant: forward fields
(``override_forward``) for a forward case, backward fields (``override_backward``) for a training case.
"""

import json
import sys

import torch

import flash_maxsim as fm
from flash_maxsim.kernels import tuning

CASES = {"int8-1024": (1, 10000, 1024, 1024, True), "int8-300": (1, 10000, 32, 300, True),
         "bf16-64q": (64, 1000, 32, 300, False), "bf16-128x1024": (1, 1000, 128, 1024, False)}
# (queries, documents, Lq, Ld, smooth_tau): in-batch, the first Nq documents each query's positive
TRAIN_CASES = {"train-b256": (256, 256, 32, 1030, None), "train-b64": (64, 64, 32, 1030, None),
               "train-b64x8": (64, 512, 32, 300, None), "train-smooth-b128": (128, 128, 32, 1030, 0.1)}


def train(name: str, overrides: str = "{}") -> None:
    Nq, B, Lq, Ld, tau = TRAIN_CASES[name]
    q = torch.randn(Nq, Lq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    docs = torch.randn(B, Ld, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.arange(Nq, device="cuda")
    with tuning.override_backward(**json.loads(overrides)):
        for _ in range(4):
            torch.nn.functional.cross_entropy(fm.maxsim(q, docs, smooth_tau=tau), labels).backward()
    torch.cuda.synchronize()
    print(f"{name}: done", flush=True)


def main(name: str, overrides: str = "{}") -> None:
    Nq, B, Lq, Ld, quantized = CASES[name]
    q = torch.randn(Nq, Lq, 128, device="cuda", dtype=torch.bfloat16)
    docs = torch.randn(B, Ld, 128, device="cuda", dtype=torch.bfloat16)
    index = fm.quantize(docs) if quantized else docs
    with tuning.override_forward(**json.loads(overrides)):
        for _ in range(4):
            fm.maxsim(q, index)
    torch.cuda.synchronize()
    print(f"{name}: done", flush=True)


if __name__ == "__main__":
    case = sys.argv[1] if len(sys.argv) > 1 else "int8-1024"
    (train if case in TRAIN_CASES else main)(case, *sys.argv[2:3])
