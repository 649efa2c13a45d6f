"""The four multi-vector losses: loss values and parameter gradients equal sentence-transformers' own.

Each loss runs forward + backward on the real MiniLM MultiVectorEncoder (eval mode: no dropout), once with
sentence-transformers' scoring (the oracle), then with flash_maxsim reached four ways: a loss built after
enable() (default similarity_fct: as many fused calls as the drop-in makes, not one per candidate column), a
loss built before enable() (up to 6.2 it holds the original colbert_scores, whose inner maxsim is patched; from
6.3 it scores with the model's similarity), the drop-in passed as similarity_fct without enable(), and the
MeanMaxSim drop-in against sentence-transformers' MeanMaxSim function. From 6.3 the default losses follow the
model's similarity_fn_name (MeanMaxSim models included) and a ``use_kernels`` model's scorer.

Gradients are compared for the parameters of the projection and of the last transformer layer: the layers below
are frozen to keep this CPU suite within its time budget (their gradients are functions of the same gradient
flowing back through the last layer, which is compared).
"""

from __future__ import annotations

import pytest
import torch

from flash_maxsim.integrations import sentence_transformers as fst
from sentence_transformers.multi_vector_encoder import losses

from st_cases import DOCUMENTS, LOSSES_SCORE_WITH_THE_MODEL, ORIGINAL, QUERIES, features

# name -> (loss class, extra constructor arguments, default scoring function, MeanMaxSim scoring function)
LOSSES = {
    "mnrl": (losses.MultiVectorMultipleNegativesRankingLoss, {}, "colbert_scores", "mean_colbert_scores"),
    # one embedding mini-batch per column (the GradCache replay is sentence-transformers' own code), scores in
    # two query chunks
    "cached_mnrl": (losses.CachedMultiVectorMultipleNegativesRankingLoss,
                    {"mini_batch_size": 4, "score_mini_batch_size": 2}, "colbert_scores", "mean_colbert_scores"),
    "distill_kl": (losses.MultiVectorDistillKLDivLoss, {"temperature": 0.5}, "colbert_kd_scores",
                   "mean_colbert_kd_scores"),
    "margin_mse": (losses.MultiVectorMarginMSELoss, {}, "colbert_scores_pairwise", "mean_colbert_scores_pairwise"),
}

# query, positive and hard-negative columns; documents 8 and 10 lose every token under keep_only
COLUMNS = [QUERIES[:4], DOCUMENTS[:4], DOCUMENTS[6:10], DOCUMENTS[8:12]]


def _batch(name):
    generator = torch.Generator().manual_seed(5)
    if name == "distill_kl":
        return COLUMNS, torch.randn(4, 3, generator=generator) * 3        # teacher scores per candidate
    if name == "margin_mse":
        return COLUMNS[:3], torch.randn(4, generator=generator)            # teacher margins
    return COLUMNS[:3], None


def _run(model, loss, name):
    columns, labels = _batch(name)
    model.zero_grad(set_to_none=True)
    inputs = [features(model, texts, "query" if i == 0 else "document") for i, texts in enumerate(columns)]
    value = loss(inputs, labels)
    value.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def _assert_same(got, expected):
    value, grads = got
    expected_value, expected_grads = expected
    torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and len(grads) > 10      # the last layer, the projection
    # one absolute scale for all tensors: some gradients are zero in exact arithmetic (e.g. attention key
    # biases, which softmax cancels) and hold only rounding noise
    scale = max(g.abs().max().item() for g in expected_grads.values())
    assert scale > 0
    for key in expected_grads:
        torch.testing.assert_close(grads[key], expected_grads[key], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m: f"{key}: {m}")


@pytest.fixture(autouse=True)
def _train_top_only(model):
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("1.") or ".encoder.layer.5." in n)     # the projection, the last layer
    yield
    for n, p in model.named_parameters():
        p.requires_grad_(saved[n])


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_and_parameter_gradients_equal_sentence_transformers(model, mask_config, name, flash_calls):
    cls, kwargs, default_fn, _ = LOSSES[name]
    expected = _run(model, cls(model, **kwargs), name)
    assert expected[0].isfinite() and expected[0] != 0
    assert not flash_calls
    with fst.enabled():
        loss = cls(model, **kwargs)
        # what the model card reports is unchanged
        if LOSSES_SCORE_WITH_THE_MODEL:
            assert loss.similarity_fct is None
        else:
            assert loss.similarity_fct.__name__ == default_fn
        _assert_same(_run(model, loss, name), expected)
    assert flash_calls
    default_calls = len(flash_calls)
    flash_calls.clear()
    _run(model, cls(model, similarity_fct=getattr(fst, default_fn), **kwargs), name)
    assert default_calls == len(flash_calls)          # fused as the drop-in is, not one call per column


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_built_before_enable_and_drop_ins(model, name, flash_calls):
    cls, kwargs, default_fn, _ = LOSSES[name]
    expected = _run(model, cls(model, **kwargs), name)
    built_before = cls(model, **kwargs)
    if LOSSES_SCORE_WITH_THE_MODEL:
        assert built_before.similarity_fct is None
    else:
        assert built_before.similarity_fct is ORIGINAL[default_fn]
    with fst.enabled():
        _assert_same(_run(model, built_before, name), expected)
    assert flash_calls
    flash_calls.clear()
    dropin = cls(model, similarity_fct=getattr(fst, default_fn), **kwargs)     # no enable() needed
    _assert_same(_run(model, dropin, name), expected)
    assert flash_calls


@pytest.mark.parametrize("mask_config", ["keep_only"], indirect=True)
@pytest.mark.parametrize("name", list(LOSSES))
def test_meanmaxsim_losses(model, mask_config, name, flash_calls):
    cls, kwargs, _, mean_fn = LOSSES[name]
    expected = _run(model, cls(model, similarity_fct=ORIGINAL[mean_fn], **kwargs), name)
    _assert_same(_run(model, cls(model, similarity_fct=getattr(fst, mean_fn), **kwargs), name), expected)
    assert flash_calls


def test_a_loss_built_while_enabled_falls_back_after_disable(model, flash_calls):
    name = "mnrl"
    cls, kwargs, _, _ = LOSSES[name]
    expected = _run(model, cls(model, **kwargs), name)
    with fst.enabled():
        loss = cls(model, **kwargs)
    _assert_same(_run(model, loss, name), expected)
    assert not flash_calls                    # sentence-transformers' own scoring again once disabled


@pytest.mark.skipif(not LOSSES_SCORE_WITH_THE_MODEL, reason="sentence-transformers >= 6.3: losses score with the "
                    "model's similarity")
@pytest.mark.parametrize("name", list(LOSSES))
def test_default_losses_follow_a_meanmaxsim_model(model, name, flash_calls):
    cls, kwargs, _, mean_fn = LOSSES[name]
    saved = model.similarity_fn_name
    model.similarity_fn_name = "meanmaxsim"
    try:
        expected = _run(model, cls(model, **kwargs), name)
        # sentence-transformers' default is then MeanMaxSim: the same as passing its mean function
        _assert_same(_run(model, cls(model, similarity_fct=ORIGINAL[mean_fn], **kwargs), name), expected)
        assert not flash_calls
        with fst.enabled():
            _assert_same(_run(model, cls(model, **kwargs), name), expected)
        assert flash_calls
    finally:
        model.similarity_fn_name = saved


@pytest.mark.skipif(not LOSSES_SCORE_WITH_THE_MODEL, reason="sentence-transformers >= 6.3: use_kernels scorers")
@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("name", ["mnrl", "distill_kl", "margin_mse"])
def test_default_losses_of_a_use_kernels_model(model, name, length_normalize, flash_calls):
    """A model built with ``use_kernels`` holds a ``_MaxSimScorer``; without a kernel config it scores with
    sentence-transformers' own torch code, the oracle here. Enabled, flash_maxsim scores in its place."""
    from sentence_transformers.multi_vector_encoder.scoring.colbert import _MaxSimScorer

    cls, kwargs, _, _ = LOSSES[name]
    saved = model.similarity_fn_name, model._similarity, model._similarity_pairwise
    scorer = _MaxSimScorer(None, length_normalize=length_normalize)
    model._similarity, model._similarity_pairwise = scorer, scorer.pairwise
    try:
        expected = _run(model, cls(model, **kwargs), name)
        assert not flash_calls
        with fst.enabled():
            _assert_same(_run(model, cls(model, **kwargs), name), expected)
        assert flash_calls
    finally:
        model._similarity_fn_name, model._similarity, model._similarity_pairwise = saved
