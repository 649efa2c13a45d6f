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

from flash_maxsim.integrations import sentence_transformers as fst

from st_cases import LOSSES, LOSSES_SCORE_WITH_THE_MODEL, ORIGINAL, assert_same_loss, run_loss, train_top_only


@pytest.fixture(autouse=True)
def _train_top_only(model):
    with train_top_only(model):
        yield


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_and_parameter_gradients_equal_sentence_transformers(model, mask_config, name, flash_calls):
    cls, kwargs, default_fn, _ = LOSSES[name]
    expected = run_loss(model, cls(model, **kwargs), name)
    assert expected[0].isfinite() and expected[0] != 0
    assert not flash_calls
    with fst.enabled():
        loss = cls(model, **kwargs)
        # what the model card reports is unchanged
        if LOSSES_SCORE_WITH_THE_MODEL:
            assert loss.similarity_fct is None
        else:
            assert loss.similarity_fct.__name__ == default_fn
        assert_same_loss(run_loss(model, loss, name), expected)
    assert flash_calls
    default_calls = len(flash_calls)
    flash_calls.clear()
    run_loss(model, cls(model, similarity_fct=getattr(fst, default_fn), **kwargs), name)
    assert default_calls == len(flash_calls)          # fused as the drop-in is, not one call per column


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_built_before_enable_and_drop_ins(model, name, flash_calls):
    cls, kwargs, default_fn, _ = LOSSES[name]
    expected = run_loss(model, cls(model, **kwargs), name)
    built_before = cls(model, **kwargs)
    if LOSSES_SCORE_WITH_THE_MODEL:
        assert built_before.similarity_fct is None
    else:
        assert built_before.similarity_fct is ORIGINAL[default_fn]
    with fst.enabled():
        assert_same_loss(run_loss(model, built_before, name), expected)
    assert flash_calls
    flash_calls.clear()
    dropin = cls(model, similarity_fct=getattr(fst, default_fn), **kwargs)     # no enable() needed
    assert_same_loss(run_loss(model, dropin, name), expected)
    assert flash_calls


@pytest.mark.parametrize("mask_config", ["keep_only"], indirect=True)
@pytest.mark.parametrize("name", list(LOSSES))
def test_meanmaxsim_losses(model, mask_config, name, flash_calls):
    cls, kwargs, _, mean_fn = LOSSES[name]
    expected = run_loss(model, cls(model, similarity_fct=ORIGINAL[mean_fn], **kwargs), name)
    assert_same_loss(run_loss(model, cls(model, similarity_fct=getattr(fst, mean_fn), **kwargs), name), expected)
    assert flash_calls


def test_a_loss_built_while_enabled_falls_back_after_disable(model, flash_calls):
    name = "mnrl"
    cls, kwargs, _, _ = LOSSES[name]
    expected = run_loss(model, cls(model, **kwargs), name)
    with fst.enabled():
        loss = cls(model, **kwargs)
    assert_same_loss(run_loss(model, loss, name), expected)
    assert not flash_calls                    # sentence-transformers' own scoring again once disabled


@pytest.mark.skipif(not LOSSES_SCORE_WITH_THE_MODEL, reason="sentence-transformers >= 6.3: losses score with the "
                    "model's similarity")
@pytest.mark.parametrize("name", list(LOSSES))
def test_default_losses_follow_a_meanmaxsim_model(model, name, flash_calls):
    cls, kwargs, _, mean_fn = LOSSES[name]
    saved = model.similarity_fn_name
    model.similarity_fn_name = "meanmaxsim"
    try:
        expected = run_loss(model, cls(model, **kwargs), name)
        # sentence-transformers' default is then MeanMaxSim: the same as passing its mean function
        assert_same_loss(run_loss(model, cls(model, similarity_fct=ORIGINAL[mean_fn], **kwargs), name), expected)
        assert not flash_calls
        with fst.enabled():
            assert_same_loss(run_loss(model, cls(model, **kwargs), name), expected)
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
        expected = run_loss(model, cls(model, **kwargs), name)
        assert not flash_calls
        with fst.enabled():
            assert_same_loss(run_loss(model, cls(model, **kwargs), name), expected)
        assert flash_calls
    finally:
        model._similarity_fn_name, model._similarity, model._similarity_pairwise = saved
