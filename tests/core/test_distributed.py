"""flash_maxsim.distributed: a corpus sharded over 2, 3 and 4 processes (torchrun, gloo on the CPU) returns what
one index over the whole corpus returns — scores, ids and positions, equal scores across ranks included, with
k above a shard and above the corpus, empty shards, string, int and mixed ids; the ranks raise together when
they disagree; and ``python -m flash_maxsim.distributed`` checks a job end to end. On CUDA the same runs on
every GPU with NCCL, and with gloo between two processes sharing the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_maxsim
from flash_maxsim import distributed, ops

HERE = Path(__file__).resolve().parent
SRC = Path(flash_maxsim.__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
import distributed_worker as worker  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _torchrun(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` (a free port of its own) with this checkout's package first on the path. The
    ranks run flash_maxsim's exact CPU path (not Triton's interpreter): the merge is what is tested here."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"torchrun exited {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return run


def _one_process(case: worker.Case, storage: str, placement: str):
    index = worker.build_index(case, 0, len(case.documents), storage, placement)
    mask = None if case.queries_mask is None else case.queries_mask.to(placement)
    return index.search(case.queries.to(placement), case.k, mask)


def _check_ranks(out: Path, world: int, storage: str, placement: str) -> None:
    got = [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(world)]
    for case in worker.cases():
        expected = _one_process(case, storage, placement)
        for rank, records in enumerate(got):
            result = records[case.name]
            where = f"{case.name}, rank {rank} of {world}"
            assert torch.equal(result["scores"], expected.scores.cpu()), where
            assert result["ids"] == expected.ids, where
            assert torch.equal(result["positions"], expected.positions.cpu()), where
            # each rank's results stay on its own device
            assert [torch.device(d).type for d in result["devices"]] == [expected.scores.device.type] * 2, where
    for rank, records in enumerate(got):
        message = records["disagreeing k"]
        assert message is not None and "disagree on the k" in message, f"rank {rank}: {message}"
        assert all(f"rank {r}: {3 + r}" in message for r in range(world))


def test_cases_have_the_shapes_the_tests_claim():
    """The worker's corpora do put equal scores on different ranks, k above shards, and empty shards."""
    by_name = {case.name: case for case in worker.cases()}
    ties = by_name["ties across ranks, string ids"]
    for world in (2, 3, 4):
        parts = [ties.bounds(r, world) for r in range(world)]
        assert parts[0][0] == 0 and parts[-1][1] == len(ties.documents)
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        # a document and one equal to it on another rank
        assert any(torch.equal(ties.documents[i], ties.documents[j])
                   for i in range(*parts[0]) for j in range(*parts[1]))
        assert by_name["k above every shard"].k > max(b - a for a, b in
                                                       (by_name["k above every shard"].bounds(r, world)
                                                        for r in range(world)))
        few = by_name["fewer documents than ranks"]
        assert world == 2 or any(few.bounds(r, world)[0] == few.bounds(r, world)[1] for r in range(world))
        middle = by_name["one query with a mask, middle ranks empty"]
        assert all(middle.bounds(r, world)[0] == middle.bounds(r, world)[1] for r in range(1, world - 1))
    with ops.force_backend("torch"):
        result = _one_process(ties, "bf16", "cpu")
    # the equal scores reach the top k
    assert bool((result.scores[:, 1:] == result.scores[:, :-1]).any())


@pytest.mark.parametrize("world, storage", [(2, "int8"), (3, "bf16"), (4, "fp16")])
def test_gloo_ranks_return_one_process_results(world, storage, tmp_path):
    _torchrun(world, str(HERE / "distributed_worker.py"), "--out", str(tmp_path), "--storage", storage)
    with ops.force_backend("torch"):
        _check_ranks(tmp_path, world, storage, "cpu")


def test_module_checks_a_job():
    run = _torchrun(2, "-m", "flash_maxsim.distributed", "--documents", "300", "--distinct", "40", "--dim", "32",
                    "--queries", "3", "--k", "12", "--storage", "int8", "--backend", "gloo")
    assert "2 ranks (gloo" in run.stdout and "identical to one index over the whole corpus" in run.stdout


def test_shard_bounds_cover_the_corpus_in_rank_order():
    for n in (0, 1, 5, 11, 64):
        for world in (1, 2, 3, 4, 7):
            parts = [distributed.shard_bounds(n, r, world) for r in range(world)]
            assert [i for start, stop in parts for i in range(start, stop)] == list(range(n))
            sizes = [stop - start for start, stop in parts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shard_bounds_errors():
    with pytest.raises(ValueError, match="`rank`"):
        distributed.shard_bounds(10, 3, 3)
    with pytest.raises(ValueError, match="`world_size`"):
        distributed.shard_bounds(10, 0, 0)
    with pytest.raises(ValueError, match="`n`"):
        distributed.shard_bounds(-1, 0, 2)
    with pytest.raises(TypeError, match="`n`"):
        distributed.shard_bounds(2.5, 0, 2)
    with pytest.raises(TypeError, match="`rank`"):
        distributed.shard_bounds(4, True, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.shard_bounds(4)            # rank and world size from a process group that does not exist


def test_search_needs_a_process_group_and_a_valid_k():
    index = flash_maxsim.DocumentIndex(worker.DIM, storage="bf16", placement="cpu")
    queries = torch.randn(1, 3, worker.DIM)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.search(index, queries, 3)
    for k in (0, -2, 2.0, True, "3"):
        with pytest.raises(ValueError, match="`k`"):
            distributed.search(index, queries, k)


@cuda
def test_nccl_on_every_gpu(tmp_path):
    world = torch.cuda.device_count()
    _torchrun(world, str(HERE / "distributed_worker.py"), "--out", str(tmp_path), "--storage", "int8",
              "--placement", "cuda", "--backend", "nccl", timeout=300)
    _check_ranks(tmp_path, world, "int8", "cuda:0")


@cuda
def test_gloo_between_two_processes_on_the_gpu_machine(tmp_path):
    _torchrun(2, str(HERE / "distributed_worker.py"), "--out", str(tmp_path), "--storage", "bf16",
              "--placement", "cuda", "--backend", "gloo", timeout=300)
    _check_ranks(tmp_path, 2, "bf16", "cuda:0")


@cuda
def test_module_checks_a_job_on_every_gpu():
    run = _torchrun(torch.cuda.device_count(), "-m", "flash_maxsim.distributed", "--documents", "20000",
                    "--storage", "int8", timeout=300)
    assert "identical to one index over the whole corpus" in run.stdout
