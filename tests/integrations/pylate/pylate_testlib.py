"""Helpers of the PyLate integration tests: skiplist-style data, PyLate's own torch path as the baseline."""

from __future__ import annotations

import inspect
import random

import torch

import pylate
import pylate.scores as pylate_scores

from flash_maxsim.integrations import pylate as flash_pylate

PYLATE_VERSION = tuple(int(p) for p in pylate.__version__.split(".")[:2])
HAS_BACKEND_SWITCH = "backend" in inspect.signature(pylate_scores.colbert_scores).parameters
HAS_COLBERT_SCORES_CLASS = hasattr(pylate_scores, "ColBERTScores")

# the PyLate functions as imported before any patching: the baseline whatever the tests enable
PYLATE_COLBERT_SCORES = pylate_scores.colbert_scores
PYLATE_COLBERT_SCORES_PAIRWISE = pylate_scores.colbert_scores_pairwise
PYLATE_COLBERT_KD_SCORES = pylate_scores.colbert_kd_scores
PYLATE_COLBERT_SCORES_CALL = pylate_scores.ColBERTScores.__call__ if HAS_COLBERT_SCORES_CLASS else None


def _torch_backend() -> dict:
    return {"backend": "torch"} if HAS_BACKEND_SWITCH else {}


def pylate_colbert_scores(*args, **kwargs):
    return PYLATE_COLBERT_SCORES(*args, **kwargs, **_torch_backend())


def pylate_colbert_kd_scores(*args, **kwargs):
    return PYLATE_COLBERT_KD_SCORES(*args, **kwargs, **_torch_backend())


def pylate_colbert_scores_pairwise(*args, **kwargs):
    return PYLATE_COLBERT_SCORES_PAIRWISE(*args, **kwargs, **_torch_backend())


def pylate_grouped_scores(queries, documents, queries_mask=None, documents_mask=None):
    """PyLate's ColBERTScores (query-major [Q, D*N]); on PyLate < 1.5, which has no such class, the same
    definition written with its colbert_scores, one group at a time."""
    if HAS_COLBERT_SCORES_CLASS:
        return PYLATE_COLBERT_SCORES_CALL(pylate_scores.ColBERTScores(), queries, documents, queries_mask,
                                          documents_mask, **_torch_backend())
    groups, per_group = documents.shape[:2]
    columns = [pylate_colbert_scores(queries, documents[:, k], queries_mask,
                                     None if documents_mask is None else documents_mask[:, k])
               for k in range(per_group)]
    return torch.stack(columns, dim=2).reshape(queries.shape[0], groups * per_group)


def skiplist_mask(shape, generator: torch.Generator, hole_rate: float = 0.25, min_length: int = 1,
                  device="cpu") -> torch.Tensor:
    """bool [..., L]: a random valid length per row (padding after it) and holes inside it (skiplist tokens);
    the first row of the batch keeps every token, the second has none valid inside its length."""
    *batch, L = shape
    lengths = torch.randint(min_length, L + 1, tuple(batch), generator=generator)
    in_length = torch.arange(L)[None, :] < lengths.reshape(-1, 1)
    holes = torch.rand(in_length.shape, generator=generator) < hole_rate
    mask = in_length & ~holes
    mask[0] = True
    if mask.shape[0] > 2:
        mask[1] = False
    return mask.reshape(*batch, L).to(device)


def embeddings(shape, generator: torch.Generator, side: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Unit-norm token vectors (PyLate normalizes them). Queries (side=+1) and documents (side=-1) lean in
    opposite directions, so that most similarities are negative: where every valid token of a document is
    below zero, PyLate's mask multiplication (a masked token counts as 0) and skipping masked tokens give
    different scores, and the tests see which of the two runs."""
    lean = torch.randn(shape[-1], generator=torch.Generator().manual_seed(1234))
    x = torch.randn(*shape, generator=generator) + side * 0.6 * torch.sign(lean)
    x = torch.nn.functional.normalize(x, dim=-1)
    return x.to(device=device, dtype=dtype)


WORDS = ("fruit health apple river bank money loan water green tree city train music piano cat dog house "
         "paper science model retrieval query document token late interaction score vector dense sparse "
         "search engine index rank").split()
PUNCTUATION = list(".,;:!?()-'")


def sentences(count: int, seed: int, min_words: int = 4, max_words: int = 30):
    """Texts with punctuation (PyLate's skiplist removes it: holes in the document masks)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(min_words, max_words)
        words = []
        for _ in range(n):
            words.append(rng.choice(WORDS))
            if rng.random() < 0.3:
                words.append(rng.choice(PUNCTUATION))
        out.append(" ".join(words))
    return out


# ------------------------------------------------------------------ one training step, three ways

def run_step(model, loss, features, labels=None):
    """Loss value and every parameter gradient of one training step (dropout on, same random draws)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    value = loss(features, labels)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def assert_same_step(got, expected, tolerance=1e-4):
    value, grads = got
    expected_value, expected_grads = expected
    torch.testing.assert_close(value, expected_value, rtol=tolerance / 10, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and len(grads) > 10
    overall = max(g.abs().max().item() for g in expected_grads.values())
    for name in grads:
        # fp32 summation order differs between the scorers; some gradients are zero in exact arithmetic
        # (attention key biases) and only carry rounding noise, hence the floor tied to the largest gradient
        scale = expected_grads[name].abs().max().item()
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=0,
                                   atol=tolerance * scale + tolerance / 100 * overall, msg=lambda m: f"{name}: {m}")


def three_ways(model, make_loss, flash_metric, features, labels, flash_calls, tolerance=1e-4):
    """PyLate alone, the flash_maxsim scorer as score_metric, and enable() with the loss's default."""
    expected = run_step(model, make_loss(), features, labels)
    assert flash_calls.calls == 0
    with_scorer = run_step(model, make_loss(score_metric=flash_metric), features, labels)
    scorer_calls = flash_calls.calls
    assert scorer_calls > 0
    with flash_pylate.enabled():
        with_enable = run_step(model, make_loss(), features, labels)
    assert flash_calls.calls > scorer_calls
    assert_same_step(with_scorer, expected, tolerance)
    assert_same_step(with_enable, expected, tolerance)
    return expected
