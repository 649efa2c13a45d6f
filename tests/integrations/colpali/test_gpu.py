"""On a CUDA device, at ColPali's sizes: B = 32..256 queries of up to 32 tokens (20..32 real, zero-padded), pages of
up to 1030 tokens, d = 128, L2-normalised bf16 embeddings as the models output them.

Reference: the unpatched library (its einsum: COLPALI_SCORES_BACKEND=torch) on the fp32 copy of the same bf16
values: bf16 products are exact in fp32, so this is the exact answer up to fp32 summation order (the library's own
bf16 einsum rounds every similarity and sum to bf16). Gradients are compared in Frobenius norm: at Ld = 1030 a few
hard-max near-ties flip with the summation order (each moves one token's gradient to an almost equally similar
token), see colpali_cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colpali_engine.loss import late_interaction_losses as losses
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor
from flash_maxsim.integrations import colpali as flash_colpali

from colpali_cases import Batch, LargestTensor, frobenius_error, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DIM, QUERY_LENGTH, DOC_LENGTH = 128, 32, 1030


@pytest.fixture(autouse=True)
def _library_einsum(monkeypatch):
    """The reference is the library's own einsum: with late-interaction-kernels installed, 0.3.17+ would route
    its hard max to that package instead (COLPALI_SCORES_BACKEND=auto)."""
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
IN_BATCH = ("ColbertLoss", "ColbertPairwiseCELoss", "ColbertSigmoidLoss")
WITH_NEGATIVES = ("ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss")


def realistic_batch(batch, seed, *, negatives=0, processes=1, dtype=torch.bfloat16) -> Batch:
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def embeddings(*shape):
        x = torch.randn(*shape, DIM, device="cuda", generator=generator)
        return F.normalize(x, dim=-1).to(dtype)

    def mask(shape, longest, shortest):
        lengths = torch.randint(shortest, longest + 1, shape, device="cuda", generator=generator)
        lengths.view(-1)[0] = longest
        return torch.arange(longest, device="cuda") < lengths[..., None]

    raw = {"q": embeddings(batch, QUERY_LENGTH), "d": embeddings(batch * processes, DOC_LENGTH)}
    masks = {"q": mask((batch,), QUERY_LENGTH, 20), "d": mask((batch * processes,), DOC_LENGTH, 700)}
    if negatives:
        raw["n"] = embeddings(batch, negatives, DOC_LENGTH)
        masks["n"] = mask((batch, negatives), DOC_LENGTH, 700)
    return Batch(raw, masks, offset=batch if processes > 1 else 0)


def _run(loss, batch, *, patched, reference_dtype=None):
    leaves = batch.leaves()
    padded = batch.padded(leaves)
    args = [padded[k] if reference_dtype is None else padded[k].to(reference_dtype) for k in batch.raw]
    if patched:
        with flash_colpali.enabled():
            value = loss(*args, offset=batch.offset)
    else:
        value = loss(*args, offset=batch.offset)
    value.backward()
    return value.detach(), {k: leaf.grad for k, leaf in leaves.items()}


def _check(name, smooth, batch, loss_rtol, grad_rtol, **loss_kwargs):
    loss = getattr(losses, name)(use_smooth_max=smooth, **loss_kwargs).cuda()
    want_value, want_grads = _run(loss, batch, patched=False, reference_dtype=torch.float32)
    got_value, got_grads = _run(loss, batch, patched=True)
    assert torch.isfinite(got_value)
    assert relative_error(got_value, want_value) <= loss_rtol, (got_value.item(), want_value.item())
    for key, want in want_grads.items():
        assert got_grads[key].dtype == batch.raw[key].dtype
        assert frobenius_error(got_grads[key], want) <= grad_rtol, key


@pytest.mark.parametrize("batch_size", [32, 128, 256])
@pytest.mark.parametrize("smooth", [False, True], ids=["hard", "smooth"])
@pytest.mark.parametrize("name", IN_BATCH)
def test_in_batch_losses_bf16(name, smooth, batch_size):
    batch = realistic_batch(batch_size, seed=batch_size + 7 * smooth)
    _check(name, smooth, batch, loss_rtol=1e-4, grad_rtol=1e-2)


@pytest.mark.parametrize("batch_size, processes", [(32, 1), (32, 2), (128, 1)])
@pytest.mark.parametrize("smooth", [False, True], ids=["hard", "smooth"])
@pytest.mark.parametrize("name", WITH_NEGATIVES)
def test_losses_with_negatives_bf16(name, smooth, batch_size, processes):
    batch = realistic_batch(batch_size, seed=batch_size + processes, negatives=2, processes=processes)
    _check(name, smooth, batch, loss_rtol=1e-4, grad_rtol=1e-2, pos_aware_negative_filtering=processes > 1)


@pytest.mark.parametrize("smooth", [False, True], ids=["hard", "smooth"])
@pytest.mark.parametrize("name", IN_BATCH + WITH_NEGATIVES)
def test_fp32_highest_precision(name, smooth):
    batch = realistic_batch(32, seed=3, negatives=2 if name in WITH_NEGATIVES else 0, dtype=torch.float32)
    _check(name, smooth, batch, loss_rtol=1e-5, grad_rtol=1e-4)


@pytest.mark.parametrize("smooth", [False, True], ids=["hard", "smooth"])
def test_no_similarity_tensor_and_far_less_memory(smooth):
    """After enable() no [B, B, Lq, Ld] tensor exists, nor anything larger than the document embeddings
    (flash_maxsim really runs: no silent fallback), and the step's peak memory above its inputs drops > 10x."""
    batch = realistic_batch(128, seed=11)
    loss = losses.ColbertLoss(use_smooth_max=smooth).cuda()
    similarity_elements = 128 * 128 * QUERY_LENGTH * DOC_LENGTH
    peaks, largest = {}, {}
    for patched in (False, True):
        leaves = batch.leaves()
        padded = batch.padded(leaves)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with LargestTensor() as spy, (flash_colpali.enabled() if patched else _nothing()):
            loss(padded["q"], padded["d"]).backward()
        torch.cuda.synchronize()
        peaks[patched] = torch.cuda.max_memory_allocated() - base
        largest[patched] = spy.largest
        del leaves, padded
    assert largest[False] >= similarity_elements
    assert largest[True] <= batch.raw["d"].numel()             # nothing larger than the documents themselves
    assert peaks[True] * 10 < peaks[False], peaks


def test_one_query_against_20k_pages():
    """A large pool as a list of variable-length pages: no batch_size tuning, bounded extra memory, the library's
    scores (its padding semantics included)."""
    pages, generator = 20_000, torch.Generator(device="cuda").manual_seed(5)
    lengths = torch.randint(700, DOC_LENGTH + 1, (pages,), device="cuda", generator=generator).tolist()
    storage = F.normalize(torch.randn(sum(lengths), DIM, device="cuda", generator=generator), dim=-1).bfloat16()
    ps = list(torch.split(storage, lengths))
    qs = [F.normalize(torch.randn(24, DIM, device="cuda", generator=generator), dim=-1).bfloat16()]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with flash_colpali.enabled():
        got = BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cuda")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert got.shape == (1, pages) and got.device.type == "cpu"
    chunk_bytes = (flash_colpali._CHUNK_TOKENS + DOC_LENGTH) * DIM * 2
    assert extra < 2 * chunk_bytes, extra                       # one packed chunk (+ its offsets, scores)
    library = BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cuda")   # bf16 sums
    assert relative_error(got, library) <= 1e-2
    head = 1024
    exact = BaseVisualRetrieverProcessor.score_multi_vector([q.float() for q in qs], [p.float() for p in ps[:head]],
                                                           device="cuda")
    assert relative_error(got[:, :head], exact) <= 1e-5


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
