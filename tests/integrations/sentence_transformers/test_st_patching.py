"""enable() / disable() / is_enabled() / enabled(): what is replaced, and that disable() puts back the very objects."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

from flash_maxsim.integrations import sentence_transformers as fst
from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
from sentence_transformers.util.similarity import SimilarityFunction

from st_cases import DOCUMENTS, ORIGINAL, QUERIES

ORIGINAL_METHODS = {name: MultiVectorEncoder.__dict__[name] for name in ("similarity", "similarity_pairwise")}

# every place sentence-transformers holds the functions by name (module, attribute, original)
ALIASES = [
    ("sentence_transformers.util.similarity", "maxsim"),
    ("sentence_transformers.util.similarity", "maxsim_pairwise"),
    ("sentence_transformers.util.similarity", "mean_maxsim"),
    ("sentence_transformers.util.similarity", "mean_maxsim_pairwise"),
    ("sentence_transformers.util", "maxsim"),
    ("sentence_transformers.util", "mean_maxsim_pairwise"),
    ("sentence_transformers.multi_vector_encoder", "maxsim"),
    ("sentence_transformers.multi_vector_encoder", "maxsim_pairwise"),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "maxsim"),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "maxsim_pairwise"),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "colbert_scores"),
    ("sentence_transformers.multi_vector_encoder.scoring", "colbert_kd_scores"),
    ("sentence_transformers.multi_vector_encoder.scoring", "mean_colbert_scores_pairwise"),
    ("sentence_transformers.multi_vector_encoder.losses.multiple_negatives_ranking", "colbert_scores"),
    ("sentence_transformers.multi_vector_encoder.losses.cached_multiple_negatives_ranking", "colbert_scores"),
    ("sentence_transformers.multi_vector_encoder.losses.distill_kl_div", "colbert_kd_scores"),
    ("sentence_transformers.multi_vector_encoder.losses.margin_mse", "colbert_scores_pairwise"),
]


def _current(module, attribute):
    return getattr(importlib.import_module(module), attribute)


def _assert_all_original():
    for module, attribute in ALIASES:
        assert _current(module, attribute) is ORIGINAL[attribute], f"{module}.{attribute}"
    for name, method in ORIGINAL_METHODS.items():
        assert MultiVectorEncoder.__dict__[name] is method
    assert SimilarityFunction.to_similarity_fn("maxsim") is ORIGINAL["maxsim"]


def test_import_changes_nothing():
    importlib.reload(fst)          # a fresh import of the integration module
    assert not fst.is_enabled()
    _assert_all_original()


def test_enable_replaces_every_alias_and_disable_restores_the_same_objects(caplog):
    _assert_all_original()
    with caplog.at_level(logging.INFO, logger="flash_maxsim"):
        assert fst.enable() is True
    assert fst.is_enabled()
    assert len([r for r in caplog.records if "sentence-transformers now scores" in r.getMessage()]) == 1
    for module, attribute in ALIASES:
        routed = _current(module, attribute)
        assert routed is not ORIGINAL[attribute], f"{module}.{attribute}"
        assert routed.__name__ == attribute          # loss configs and model cards name the function the same
    assert SimilarityFunction.to_similarity_fn("meanmaxsim").__name__ == "mean_maxsim"
    patched = {name: MultiVectorEncoder.__dict__[name] for name in ORIGINAL_METHODS}
    assert all(patched[name] is not ORIGINAL_METHODS[name] for name in patched)

    assert fst.enable() is True                     # idempotent: nothing replaced twice
    assert all(MultiVectorEncoder.__dict__[name] is patched[name] for name in patched)

    fst.disable()
    assert not fst.is_enabled()
    _assert_all_original()
    fst.disable()                                   # harmless when not enabled
    _assert_all_original()


def test_enabled_context_manager_keeps_the_previous_state():
    with fst.enabled():
        assert fst.is_enabled()
    assert not fst.is_enabled()
    _assert_all_original()
    fst.enable()
    with fst.enabled():
        assert fst.is_enabled()
    assert fst.is_enabled()
    fst.disable()
    _assert_all_original()


def test_flash_maxsim_disable_environment_variable(monkeypatch, flash_calls):
    monkeypatch.setenv("FLASH_MAXSIM_DISABLE", "1")
    monkeypatch.setattr(fst._integration, "_warned_env", False)
    with pytest.warns(UserWarning, match="FLASH_MAXSIM_DISABLE"):
        assert fst.enable() is False
    assert not fst.is_enabled()
    _assert_all_original()
    with fst.enabled():
        assert not fst.is_enabled()
        _assert_all_original()
    assert not flash_calls
    # the drop-ins are explicit: they still score with flash_maxsim
    import torch
    fst.maxsim(torch.randn(2, 3, 8), torch.randn(4, 5, 8))
    assert flash_calls


def test_model_resolving_its_similarity_while_enabled_falls_back_after_disable(model, flash_calls):
    queries, documents = model.encode_query(QUERIES[:3]), model.encode_document(DOCUMENTS[:5])
    expected = model.similarity(queries, documents)
    saved = model.similarity_fn_name
    with fst.enabled():
        model.similarity_fn_name = "maxsim"         # the setter stores what to_similarity_fn returns now
        assert model._similarity is not ORIGINAL["maxsim"]
        assert (model.similarity(queries, documents) - expected).abs().max() < 1e-4
    assert len(flash_calls) == 1
    try:
        again = model.similarity(queries, documents)
        assert len(flash_calls) == 1                # disabled: sentence-transformers' own maxsim ran
        assert (again == expected).all()
    finally:
        model.similarity_fn_name = saved


def test_every_module_that_imports_the_functions_by_name_is_covered():
    """A guard for future sentence-transformers releases: every loaded module under sentence_transformers that
    holds one of the original functions, under any name, is replaced by enable()."""
    originals = {id(fn) for fn in ORIGINAL.values()}
    holders = {(name, attr) for name, module in list(sys.modules.items())
               if module is not None and name.startswith("sentence_transformers")
               for attr, value in vars(module).items() if id(value) in originals}
    assert holders >= set(ALIASES)
    fst.enable()
    try:
        for module, attribute in holders:
            assert id(_current(module, attribute)) not in originals, f"{module}.{attribute} not replaced"
    finally:
        fst.disable()
