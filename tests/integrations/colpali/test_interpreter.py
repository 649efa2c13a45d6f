"""The same parity through flash_maxsim's real Triton kernels, run by the Triton interpreter on the CPU (CI has no
GPU; ~1 s per kernel call, so a few tiny cases). On a CUDA machine test_gpu.py covers the compiled kernels."""

from __future__ import annotations

import pytest
import torch

from colpali_engine.loss import late_interaction_losses as losses
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor
from flash_maxsim.integrations import colpali as flash_colpali
from flash_maxsim.kernels import launch
from flash_maxsim.ops import force_backend

from colpali_cases import gradient_error, grid_values, loss_batch, tolerances

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(not launch.interpreting(), reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py "
                       "when there is no CUDA device)"),
]


def _loss_and_grads(loss, batch, patched):
    leaves = batch.leaves()
    padded = batch.padded(leaves)
    args = [padded[k] for k in batch.raw]
    if patched:
        with flash_colpali.enabled(), force_backend("triton"):
            value = loss(*args, offset=batch.offset)
            value.backward()
    else:
        value = loss(*args, offset=batch.offset)
        value.backward()
    return value.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("name, smooth, negatives, processes", [
    ("ColbertLoss", False, 0, 1),
    ("ColbertLoss", True, 0, 3),
    ("ColbertPairwiseNegativeCELoss", True, 2, 3),
])
def test_losses_through_the_triton_kernels(name, smooth, negatives, processes, generator, calls):
    batch = loss_batch(generator, batch=3, processes=processes, negatives=negatives, query_length=5,
                       doc_length=7, neg_length=6, left_padded_docs=processes > 1)
    loss = getattr(losses, name)(use_smooth_max=smooth, pos_aware_negative_filtering=True)
    want_value, want_grads = _loss_and_grads(loss, batch, patched=False)
    calls.reset()
    got_value, got_grads = _loss_and_grads(loss, batch, patched=True)
    assert calls.flash > 0 and calls.library_einsum == 0
    loss_tolerance, grad_rtol = tolerances(loss, batch, want_value, calls.flash_outputs, smooth)
    assert abs(got_value.item() - want_value.item()) <= loss_tolerance
    for key in want_grads:
        assert gradient_error(got_grads[key], want_grads[key]) <= grad_rtol, key


def test_score_multi_vector_through_the_triton_kernels(generator):
    qs = [grid_values((n, 16), generator) for n in (3, 5)]
    ps = [grid_values((n, 16), generator) for n in (1, 6, 2, 4, 4)]
    want = BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, batch_size=2, device="cpu")
    with flash_colpali.enabled(), force_backend("triton"):
        got = BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, batch_size=2, device="cpu")
    assert torch.equal(got, want)
