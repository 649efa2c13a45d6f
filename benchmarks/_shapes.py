"""The benchmark's rows: problem shapes of the forward, training and compressed-index sections, the sweeps, and
their shrunken CPU smoke-test versions.

Every row carries the design targets it was tuned against (H200, bf16, d = 128 unless the name says otherwise):
a time (and, for training, a memory) target, and for reference the roofline floor and the best peer as measured
on an H200 when the targets were set. They are written to the results JSON with each row; the per-run tables
(``results.md``) show them, the documentation page does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ForwardShape:
    """Nq queries of Lq tokens scored against B documents of Ld tokens, d features each."""
    name: str
    Nq: int
    B: int
    Lq: int
    Ld: int
    d: int
    issue_floor_ms: Optional[float] = None      # H200 roofline floor when the target was set
    issue_best_peer_ms: Optional[float] = None  # H200 best peer when the target was set
    target_ms: Optional[float] = None


@dataclass(frozen=True)
class TrainShape:
    """One training step: scores, loss, gradients of queries and documents."""
    name: str
    Nq: int
    B: int               # documents in the batch ("inbatch") or candidates per query ("kd")
    Lq: int
    Ld: int
    d: int
    layout: str          # "inbatch": documents [B, Ld, d], scores [Nq, B]; "kd": documents [Nq, B, Ld, d]
    smooth_tau: Optional[float] = None
    issue_eager: Optional[tuple] = None      # (ms, MB) of the eager step on an H200 when the target was set
    issue_best_peer: Optional[str] = None    # "ms / MB" of the best peer then
    target_ms: Optional[float] = None
    target_mb: Optional[float] = None


FORWARD_SHAPES = [
    ForwardShape("1x1k, 32x300", 1, 1000, 32, 300, 128, 0.018, 0.072, 0.035),
    ForwardShape("1x10k, 32x300", 1, 10000, 32, 300, 128, 0.181, 0.186, 0.19),
    ForwardShape("1x1k, 32x1024", 1, 1000, 32, 1024, 128, 0.062, 0.094, 0.07),
    ForwardShape("1x10k, 32x1030", 1, 10000, 32, 1030, 128, 0.621, 0.579, 0.58),
    ForwardShape("1x1k, 128x1024", 1, 1000, 128, 1024, 128, 0.062, 0.098, 0.075),
    ForwardShape("1x1k, 512x1024", 1, 1000, 512, 1024, 128, 0.192, 0.302, 0.23),
    ForwardShape("1x1k, 1024x1024", 1, 1000, 1024, 1024, 128, 0.383, 0.581, 0.45),
    ForwardShape("1x10k, 1024x1024", 1, 10000, 1024, 1024, 128, 3.834, 5.789, 4.4),
    ForwardShape("64x1k, 32x300", 64, 1000, 32, 300, 128, 0.225, 0.851, 0.30),
    ForwardShape("16x32, 32x8192", 16, 32, 32, 8192, 128, 0.049, 0.152, 0.07),
    ForwardShape("1x10k, 32x180, d=384", 1, 10000, 32, 180, 384, 0.326, 0.382, 0.35),
    ForwardShape("1x5k, 31x257, d=96", 1, 5000, 31, 257, 96, 0.058, 0.129, 0.08),
]

# colpali-engine 0.3.18's ColbertModule default smooth-max temperature is tau=0.1 (loss/late_interaction_losses.py)
COLPALI_SMOOTH_TAU = 0.1
# colpali-engine's ColbertLoss default logit temperature; the loss only needs to be a realistic one
CONTRASTIVE_TEMPERATURE = 0.02

TRAIN_SHAPES = [
    TrainShape("ColBERT in-batch B128, 32x300", 128, 128, 32, 300, 128, "inbatch", None,
               (2.94, 1655), "1.09 / 31", 0.30, 32),
    TrainShape("ColBERT B64 + 7 negatives (512 docs), 32x300", 64, 512, 32, 300, 128, "inbatch", None,
               (5.87, 3310), "1.23 / 117", 0.40, 64),
    TrainShape("ColPali in-batch B64, 32x1030", 64, 64, 32, 1030, 128, "inbatch", None,
               (2.45, 1417), "1.03 / 49", 0.35, 32),
    TrainShape("ColPali in-batch B256, 32x1030", 256, 256, 32, 1030, 128, "inbatch", None,
               (37.2, 22680), "4.15 / 204 (fmpypi), 5.54 / 76 (LIK)", 2.0, 64),
    TrainShape("smooth max (tau=0.1), ColPali in-batch B128, 32x1030", 128, 128, 32, 1030, 128, "inbatch",
               COLPALI_SMOOTH_TAU, (10.1, 4122), "none (eager only)", 2.0, 64),
    TrainShape("KD 64 queries x 64 candidates, 32x300", 64, 64, 32, 300, 128, "kd", None,
               (1.79, 601), "0.99 / 301", 0.40, 64),
]

# The eager training step's host cost: steps back to back, one sync at the end (microseconds per step). A small
# in-batch step and the ColBERT B128 training row, d = 128; goal: ours at most PyTorch's share of the step (the
# loss and its backward over a leaf tensor of scores) plus HOST_MARGIN_US, and never above a peer.
HOST_SHAPES = [
    TrainShape("in-batch B8, 32x64", 8, 8, 32, 64, 128, "inbatch"),
    TRAIN_SHAPES[0],
]
HOST_MARGIN_US = 150.0

# Compressed index (one bf16 query against an int8 / fp8 index): time targets, and index bytes at most
# COMPRESSED_TARGET_BYTES of the bf16 index
COMPRESSED_SHAPES = [
    ForwardShape("1x10k, 32x300", 1, 10000, 32, 300, 128, target_ms=0.11),
    ForwardShape("1x10k, 32x1030", 1, 10000, 32, 1030, 128, target_ms=0.33),
    ForwardShape("1x10k, 1024x1024", 1, 10000, 1024, 1024, 128, target_ms=2.5),
]
COMPRESSED_TARGET_BYTES = 0.53

# the sweeps behind the corpus-size and batch-size plots: (Lq, Ld, d) and the sizes
FORWARD_SWEEP_DIMS = (32, 300, 128)
FORWARD_SWEEP_B = [1000, 3000, 10000, 30000, 100000]
FORWARD_SWEEP_B_QUICK = [1000, 10000, 100000]
TRAIN_SWEEP_DIMS = (32, 1030, 128)
TRAIN_SWEEP_B = [16, 32, 64, 128, 256]
TRAIN_SWEEP_B_QUICK = [16, 64, 256]
SMOKE_SWEEP_DIMS = (9, 13, 32)
SMOKE_FORWARD_SWEEP_B = [2, 5, 9]
SMOKE_TRAIN_SWEEP_B = [2, 4]


def forward_sweep(sizes, dims=FORWARD_SWEEP_DIMS) -> list[ForwardShape]:
    return [ForwardShape(f"1x{b}", 1, b, *dims) for b in sizes]


def train_sweep(sizes, dims=TRAIN_SWEEP_DIMS) -> list[TrainShape]:
    return [TrainShape(f"B{b}", b, b, *dims, "inbatch") for b in sizes]


def _smoke_name(name, Nq, B, Lq, Ld, d) -> str:
    return f"{name} [smoke: {Nq}x{B}, {Lq}x{Ld}, d={d}]"


def smoke_forward(s: ForwardShape) -> ForwardShape:
    """The same row shrunk to a size the CPU path (or the Triton interpreter) runs in milliseconds."""
    # odd lengths stay odd and d keeps its ratio to 128, so the kernels' tails are exercised too
    dims = (min(s.Nq, 3), min(s.B, 5), min(s.Lq, 9 if s.Lq % 2 == 0 else 7), min(s.Ld, 13), max(8, s.d // 4))
    return ForwardShape(_smoke_name(s.name, *dims), *dims, s.issue_floor_ms, s.issue_best_peer_ms, s.target_ms)


def smoke_train(s: TrainShape) -> TrainShape:
    """The same training row shrunk for the CPU, keeping its layout's structure."""
    Nq = min(s.Nq, 2)
    # documents per query in-batch (1, or 8 with negatives), K candidates for KD
    B = Nq * min(max(1, s.B // s.Nq), 3) if s.layout == "inbatch" else min(s.B, 3)
    dims = (Nq, B, min(s.Lq, 9), min(s.Ld, 13), max(8, s.d // 4))
    return TrainShape(_smoke_name(s.name, *dims), *dims, s.layout, s.smooth_tau, s.issue_eager, s.issue_best_peer,
                      s.target_ms, s.target_mb)
