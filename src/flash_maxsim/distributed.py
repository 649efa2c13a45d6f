"""Exact search over a corpus sharded across the processes of a ``torch.distributed`` job.

Each rank holds one shard of the corpus in its own :class:`flash_maxsim.DocumentIndex`, searches it, and
:func:`search` merges the ranks' top-k lists into the exact global top-k, which every rank receives::

    import torch.distributed as dist
    from flash_maxsim import DocumentIndex, distributed

    dist.init_process_group("nccl")                     # "gloo" on CPUs; launched with torchrun
    start, stop = distributed.shard_bounds(len(corpus)) # this rank's contiguous part
    index = DocumentIndex(dim, storage="int8")
    index.add(corpus[start:stop], ids=corpus_ids[start:stop])
    result = distributed.search(index, queries, k=10)   # the same on every rank

Every rank passes the same queries, ``k`` and ``queries_mask``. The global order is the order of one
index holding the ranks' shards one after the other (rank 0's documents first): score descending, equal
scores by rank, then by insertion order within the rank. So a corpus split with :func:`shard_bounds` in rank
order gives exactly what one process searching the whole corpus gives (ids, positions and scores).

What crosses the network per call: the ranks' shard sizes, and per rank ``[Nq, k]`` float32 scores, ``[Nq, k]``
int64 positions and the ``Nq * k`` ids (as int64 when every id in those lists is an int, else pickled through
``all_gather_object``). Memory on each rank: O(world_size * Nq * k) besides the local search.

``python -m flash_maxsim.distributed`` (under ``torchrun``) checks a cluster end to end: see :func:`main`.
"""

from __future__ import annotations

import argparse
import logging
import operator
import os
import sys
import time
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._search import check_k, merge_top_k

if TYPE_CHECKING:  # pragma: no cover
    from .index import DocumentIndex, IndexSearchResult

__all__ = ["search", "shard_bounds"]

logger = logging.getLogger("flash_maxsim")

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

# the numbers each rank announces before the merge: [documents, Nq, single query, dim, k, ids are all int64]
_META_FIELDS = ("documents", "queries", "single_query", "dim", "k", "int_ids")


def _group_rank_and_size(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_maxsim.distributed needs an initialised default process group: call "
                           "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_bounds(n: int, rank: Optional[int] = None, world_size: Optional[int] = None, *,
                 group: Optional[dist.ProcessGroup] = None) -> Tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s contiguous part of ``n`` items split over ``world_size`` ranks.

    The first ``n % world_size`` ranks take one item more than the others; ranks beyond ``n`` get an empty part
    (``start == stop``). The parts, in rank order, cover ``range(n)`` exactly once, so sharding a corpus by these
    bounds makes :func:`search` return what one process over the whole corpus returns.

    Args:
        n: the number of items (documents) to split, ``>= 0``.
        rank, world_size: default to this process's rank and the world size of ``group`` (the default group
            when None), which must then be initialised.
    """
    n = _index(n, "n")
    if rank is None or world_size is None:
        own_rank, own_size = _group_rank_and_size(group)
        rank = own_rank if rank is None else rank
        world_size = own_size if world_size is None else world_size
    world_size = _index(world_size, "world_size")
    rank = _index(rank, "rank")
    if world_size < 1:
        raise ValueError(f"`world_size` must be at least 1, got {world_size}")
    if rank >= world_size:
        raise ValueError(f"`rank` must be below `world_size` ({world_size}), got {rank}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _index(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value}")
    return value


def _comm_device(group, local_device: torch.device) -> torch.device:
    """Where the collectives' tensors live: this rank's current GPU for NCCL, the CPU for gloo (and for a
    multi-backend group, the GPU when the local results are there)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and (backend == "nccl" or local_device.type == "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_int64(ids: Sequence[Sequence[Any]]) -> bool:
    return all(type(i) is int and _INT64_MIN <= i <= _INT64_MAX for row in ids for i in row)


def search(index: "DocumentIndex", queries: torch.Tensor, k: int, queries_mask: Optional[torch.Tensor] = None, *,
           group: Optional[dist.ProcessGroup] = None) -> "IndexSearchResult":
    """The exact top-k over the documents of every rank's ``index``; call it on every rank of ``group``.

    Args:
        index: this rank's shard (a :class:`flash_maxsim.DocumentIndex`; may be empty). Every rank's index has
            the same ``dim``.
        queries: ``[Nq, Lq, d]`` or one query ``[Lq, d]``, the same on every rank.
        k: the number of results per query (an int >= 1), the same on every rank.
        queries_mask: ``[Nq, Lq]`` (or ``[Lq]``), as for :meth:`DocumentIndex.search`.
        group: the process group (default: the default group). NCCL groups exchange tensors on this rank's
            current CUDA device (``torch.cuda.set_device`` it first), gloo groups on the CPU.

    Returns:
        An ``IndexSearchResult`` as :meth:`DocumentIndex.search` gives it, over the union of the ranks'
        documents and identical on every rank: ``scores`` ``[Nq, k']`` float32 descending with
        ``k' = min(k, total documents)``; ``ids``; ``positions`` in the concatenation of the ranks' live
        documents in rank order (rank ``r``'s local position plus the documents of ranks ``< r``). Equal scores:
        lower rank first, then lower local insertion order. Results are on the device of this rank's local
        results.

    Raises:
        ValueError (on every rank, before any result is exchanged) when the ranks disagree on the number of
        queries, a single query, ``dim`` or ``k``.
    """
    k = check_k(k)
    rank, world = _group_rank_and_size(group)
    local = index.search(queries, k, queries_mask)
    scores, ids, positions = local.scores, local.ids, local.positions
    single = scores.dim() == 1
    if single:
        scores, positions, ids = scores.unsqueeze(0), positions.unsqueeze(0), [ids]
    out_device = scores.device
    nq, width = scores.shape
    int_ids = _all_int64(ids)
    device = _comm_device(group, out_device)

    meta = torch.tensor([len(index), nq, int(single), int(index.dim), k, int(int_ids)], dtype=torch.int64,
                        device=device)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    table = torch.stack(metas).cpu()
    for column, name in enumerate(_META_FIELDS[1:5], start=1):
        values = table[:, column].tolist()
        if len(set(values)) > 1:
            label = {"queries": "number of queries", "single_query": "query layout ([Lq, d] or [Nq, Lq, d])",
                     "dim": "index dim", "k": "k"}[name]
            raise ValueError(f"flash_maxsim.distributed.search: the ranks disagree on the {label}: "
                             f"{', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}")
    counts = table[:, 0].tolist()
    total = sum(counts)
    kk = min(k, max(counts))                      # the width every rank pads its list to
    kept = min(k, total)
    offsets = [sum(counts[:r]) for r in range(world)]

    if kk == 0:                                   # no rank holds a document
        empty_scores = torch.empty(nq, 0, dtype=torch.float32, device=out_device)
        empty_positions = torch.empty(nq, 0, dtype=torch.int64, device=out_device)
        return _result(local, empty_scores, [[] for _ in range(nq)], empty_positions, single)

    padded_scores = torch.zeros((nq, kk), dtype=torch.float32, device=device)
    padded_positions = torch.zeros((nq, kk), dtype=torch.int64, device=device)
    padded_scores[:, :width] = scores.to(device=device, dtype=torch.float32)
    padded_positions[:, :width] = positions.to(device=device, dtype=torch.int64) + offsets[rank]
    all_scores = [torch.empty_like(padded_scores) for _ in range(world)]
    all_positions = [torch.empty_like(padded_positions) for _ in range(world)]
    dist.all_gather(all_scores, padded_scores, group=group)
    dist.all_gather(all_positions, padded_positions, group=group)
    # rank r's list holds min(k, its documents) entries for every query; the rest of its kk columns is padding
    widths = [min(k, c) for c in counts]

    if bool(table[:, 5].all()):                   # every rank's listed ids are int64: one tensor collective
        padded_ids = torch.zeros((nq, kk), dtype=torch.int64, device=device)
        if width and nq:
            padded_ids[:, :width] = torch.tensor(ids, dtype=torch.int64).to(device)
        all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
        dist.all_gather(all_ids, padded_ids, group=group)
        merged_ids = torch.cat([t[:, :w] for t, w in zip(all_ids, widths)], dim=1).cpu().tolist()
    else:                                         # strings (or ints beyond int64): pickled
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, [list(row) for row in ids], group=group)
        merged_ids = [[i for r in range(world) for i in gathered[r][q]] for q in range(nq)]

    # score descending, then lower global position: lower rank first, then the rank's own insertion order (the
    # rule, NaN first included, by which one index merges the top k of its devices)
    final_scores, final_positions = merge_top_k([t[:, :w] for t, w in zip(all_scores, widths)],
                                                [t[:, :w] for t, w in zip(all_positions, widths)], kept)
    final_scores, final_positions = final_scores.to(out_device), final_positions.to(out_device)
    listed = torch.cat([t[:, :w] for t, w in zip(all_positions, widths)], dim=1).cpu().tolist()
    final_ids = []
    for q, row in enumerate(final_positions.cpu().tolist()):
        id_of = dict(zip(listed[q], merged_ids[q]))
        final_ids.append([id_of[p] for p in row])
    return _result(local, final_scores, final_ids, final_positions, single)


def _result(local, scores: torch.Tensor, ids: List[List[Any]], positions: torch.Tensor, single: bool):
    """The merged result in the local result's own type (``IndexSearchResult``)."""
    if single:
        return type(local)(scores[0], ids[0], positions[0])
    return type(local)(scores, ids, positions)


# ------------------------------------------------------------------------------------------- cluster check

def _synthetic_corpus(documents: int, dim: int, seed: int, distinct: int) -> Tuple[List[torch.Tensor], List[str]]:
    """Ragged random documents, ``distinct`` different ones repeated in turn (so that equal scores fall on
    documents of different ranks), with string ids."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(int(torch.randint(1, 48, (1,), generator=g)), dim, generator=g) for _ in range(distinct)]
    return [base[i % distinct] for i in range(documents)], [f"doc-{i}" for i in range(documents)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``torchrun --nproc-per-node N -m flash_maxsim.distributed``: every rank builds the same seeded random
    corpus, indexes its contiguous shard (:func:`shard_bounds`), searches with :func:`search`, and compares the
    result with one index over the whole corpus built on that rank; rank 0 prints the verdict and the time of
    the distributed search. Exits 1 on any rank when any rank's result differs. NCCL with one GPU per rank
    (``LOCAL_RANK``) where CUDA is available, gloo on the CPU otherwise (``--backend`` chooses)."""
    from . import DocumentIndex   # here: importing this module needs no index

    parser = argparse.ArgumentParser(prog="python -m flash_maxsim.distributed",
                                     description="Check exact sharded search on this torch.distributed job "
                                                 "(launch with torchrun).")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--distinct", type=int, default=500,
                        help="different documents among them (repeats give equal scores across ranks)")
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--query-tokens", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--storage", default="bf16", choices=["bf16", "fp16", "int8", "fp8"])
    parser.add_argument("--backend", choices=["nccl", "gloo"],
                        help="default: nccl where CUDA is available, else gloo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        placement = f"cuda:{torch.cuda.current_device()}"
    else:
        placement = "cpu"
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        corpus, ids = _synthetic_corpus(args.documents, args.dim, args.seed, max(1, args.distinct))
        g = torch.Generator().manual_seed(args.seed + 1)
        queries = torch.randn(args.queries, args.query_tokens, args.dim, generator=g).to(placement)
        start, stop = shard_bounds(len(corpus))
        shard = DocumentIndex(args.dim, storage=args.storage, placement=placement)
        if stop > start:
            shard.add(corpus[start:stop], ids=ids[start:stop])
        whole = DocumentIndex(args.dim, storage=args.storage, placement=placement)
        whole.add(corpus, ids=ids)

        search(shard, queries, args.k)            # warm-up (kernels compiled, communicators set up)
        dist.barrier()
        started = time.perf_counter()
        got = search(shard, queries, args.k)
        if placement != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        expected = whole.search(queries, args.k)
        same = (torch.equal(got.scores.cpu(), expected.scores.cpu()) and got.ids == expected.ids
                and torch.equal(got.positions.cpu(), expected.positions.cpu()))
        flag = torch.tensor([0 if same else 1], device=placement if backend == "nccl" else "cpu")
        dist.all_reduce(flag)
        failed = int(flag.item())
        if rank == 0:
            verdict = "identical to one index over the whole corpus" if failed == 0 else \
                f"DIFFERENT from one index over the whole corpus on {failed} of {world} ranks"
            print(f"flash_maxsim.distributed: {world} ranks ({backend}, {placement if world == 1 else 'per rank'}"
                  f"), {args.documents} documents, {args.queries} queries, k={args.k}, {args.storage}: "
                  f"{verdict}; search {seconds * 1e3:.2f} ms")
        return 1 if failed else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
