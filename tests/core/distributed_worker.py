"""One rank of the sharded-search tests, launched by tests/core/test_distributed.py under torchrun.

Every rank builds the same cases from fixed seeds (:func:`cases`), indexes its part of each corpus, runs
``flash_maxsim.distributed.search`` and saves what it got to ``OUT/rank-R.pt``; the test compares every rank's
results with one index over each whole corpus.

    torchrun --standalone --nproc-per-node N tests/core/distributed_worker.py --out DIR --storage bf16 \\
        [--placement cpu|cuda] [--backend gloo|nccl]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

DIM = 16


@dataclass
class Case:
    name: str
    documents: List[torch.Tensor]
    ids: list
    queries: torch.Tensor
    queries_mask: Optional[torch.Tensor]
    k: int
    bounds: Callable[[int, int], Tuple[int, int]]   # (rank, world) -> this rank's (start, stop)


def _contiguous(n: int) -> Callable[[int, int], Tuple[int, int]]:
    from flash_maxsim.distributed import shard_bounds

    return lambda rank, world: shard_bounds(n, rank, world)


def _outer_ranks_only(n: int) -> Callable[[int, int], Tuple[int, int]]:
    """The first half of the corpus on rank 0, the rest on the last rank, nothing in between."""
    half = n // 2
    return lambda rank, world: (0, half) if rank == 0 else (half, n) if rank == world - 1 else (half, half)


def _grid(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random multiples of 1/4 in [-1, 1]: every product and sum of the scores is exact in fp32 (and the values in
    fp16 and bf16), so a document's score cannot depend on the order in which a scorer adds them up, and equal
    scores are frequent."""
    return torch.randint(-4, 5, shape, generator=g).float() / 4


def _documents(g: torch.Generator, n: int, longest: int = 12) -> List[torch.Tensor]:
    return [_grid(g, int(torch.randint(1, longest + 1, (1,), generator=g)), DIM) for _ in range(n)]


def cases() -> List[Case]:
    g = torch.Generator().manual_seed(1234)
    out = []
    # three different documents repeated over eleven places: equal scores on every rank
    distinct = _documents(g, 3)
    docs = [distinct[i % 3] for i in range(11)]
    out.append(Case("ties across ranks, string ids", docs, [f"doc-{i}" for i in range(11)],
                    _grid(g, 3, 6, DIM), None, 5, _contiguous(11)))
    docs = _documents(g, 7)
    ids = [1000 + 7 * i for i in range(7)]
    queries = _grid(g, 2, 5, DIM)
    out.append(Case("k above every shard", docs, ids, queries, None, 6, _contiguous(7)))
    out.append(Case("k above the corpus", docs, ids, queries, None, 100, _contiguous(7)))
    docs = _documents(g, 2)
    out.append(Case("fewer documents than ranks", docs, ["a", "b"], _grid(g, 2, 4, DIM), None, 3,
                    _contiguous(2)))
    docs = _documents(g, 9)
    mask = torch.ones(7, dtype=torch.bool)
    mask[4:] = False
    out.append(Case("one query with a mask, middle ranks empty", docs, list(range(9)),
                    _grid(g, 7, DIM), mask, 4, _outer_ranks_only(9)))
    docs = _documents(g, 8)
    out.append(Case("ints and strings mixed", docs, [i if i % 2 else f"s{i}" for i in range(8)],
                    _grid(g, 3, 5, DIM), None, 8, _contiguous(8)))
    out.append(Case("no documents on any rank", [], [], _grid(g, 2, 4, DIM), None, 3,
                    lambda rank, world: (0, 0)))
    return out


def build_index(case: Case, start: int, stop: int, storage: str, placement: str):
    from flash_maxsim import DocumentIndex

    index = DocumentIndex(DIM, storage=storage, placement=placement)
    if stop > start:
        index.add(case.documents[start:stop], ids=case.ids[start:stop])
    return index


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch.distributed as dist

    from flash_maxsim import distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--storage", default="bf16")
    parser.add_argument("--placement", default="cpu", help="cpu, or cuda: this rank's GPU (LOCAL_RANK)")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args(argv)
    placement = args.placement
    if placement == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        placement = f"cuda:{torch.cuda.current_device()}"
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    records = {}
    try:
        for case in cases():
            start, stop = case.bounds(rank, world)
            index = build_index(case, start, stop, args.storage, placement)
            mask = None if case.queries_mask is None else case.queries_mask.to(placement)
            result = distributed.search(index, case.queries.to(placement), case.k, mask)
            records[case.name] = {"scores": result.scores.cpu(), "ids": result.ids,
                                  "positions": result.positions.cpu(),
                                  "devices": (str(result.scores.device), str(result.positions.device))}
        # the ranks disagree on k: every rank raises, none waits for the others
        index = build_index(cases()[0], *cases()[0].bounds(rank, world), args.storage, placement)
        try:
            distributed.search(index, cases()[0].queries.to(placement), 3 + rank)
            records["disagreeing k"] = None
        except ValueError as error:
            records["disagreeing k"] = str(error)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(records, Path(args.out) / f"rank-{rank}.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
