"""enable() / disable() / is_enabled() / enabled(): what is replaced, and that disable() puts back the very objects."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

import pytest
import torch

from flash_maxsim.integrations import sentence_transformers as fst
from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
from sentence_transformers.util.similarity import SimilarityFunction

from st_cases import DOCUMENTS, LOSSES_SCORE_WITH_THE_MODEL, ORIGINAL, QUERIES

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
]
if LOSSES_SCORE_WITH_THE_MODEL:     # 6.3+: the losses hold the helpers that score with the model's similarity
    ALIASES += [
        ("sentence_transformers.multi_vector_encoder.scoring.colbert", "_colbert_scores"),
        ("sentence_transformers.multi_vector_encoder.scoring.colbert", "_colbert_scores_pairwise"),
        ("sentence_transformers.multi_vector_encoder.scoring.colbert", "_colbert_kd_scores"),
        ("sentence_transformers.multi_vector_encoder.losses.multiple_negatives_ranking", "_colbert_scores"),
        ("sentence_transformers.multi_vector_encoder.losses.cached_multiple_negatives_ranking", "_colbert_scores"),
        ("sentence_transformers.multi_vector_encoder.losses.distill_kl_div", "_colbert_kd_scores"),
    ]
else:
    ALIASES += [
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


def test_flash_maxsim_disable_environment_variable(enable_under_disable_variable, flash_calls):
    enable_under_disable_variable(fst)
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


def test_a_use_kernels_model_scores_with_flash_maxsim_while_enabled(flash_calls):
    """sentence-transformers >= 6.3 with the ``kernels`` package: a model built with ``use_kernels=True`` holds a
    hub-kernel MaxSim scorer (on the CPU it falls back to sentence-transformers' torch code, the oracle). Enabled,
    flash_maxsim scores in its place and the hub kernels are never configured (nothing is downloaded)."""
    pytest.importorskip("kernels")        # transformers 5.25 installs it, whatever the sentence-transformers version
    from sentence_transformers.multi_vector_encoder.scoring import colbert

    if not hasattr(colbert, "_MaxSimScorer"):
        pytest.skip("sentence-transformers < 6.3 has no hub-kernel MaxSim scorer")
    _MaxSimScorer = colbert._MaxSimScorer

    from st_cases import model_dir

    torch.manual_seed(0)
    model = MultiVectorEncoder(model_dir(), device="cpu", use_kernels=True)
    model.eval()
    scorer = model._similarity
    assert isinstance(scorer, _MaxSimScorer)
    queries, documents = model.encode_query(QUERIES[:3]), model.encode_document(DOCUMENTS[:5])
    with fst.enabled():
        got = model.similarity(queries, documents), model.similarity_pairwise(queries, documents[:3])
        model.similarity_fn_name = "meanmaxsim"          # the scorer's own length normalisation is followed
        got_mean = model.similarity(queries, documents)
        model.similarity_fn_name = "maxsim"
    assert len(flash_calls) == 3 and scorer._operations == {}
    expected = model.similarity(queries, documents), model.similarity_pairwise(queries, documents[:3])
    model.similarity_fn_name = "meanmaxsim"
    expected_mean = model.similarity(queries, documents)
    for value, want in zip((*got, got_mean), (*expected, expected_mean)):
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got_mean, got[0])


def test_kernel_config_says_what_it_needs(monkeypatch, tmp_path):
    if not LOSSES_SCORE_WITH_THE_MODEL:
        with pytest.raises(ImportError, match="sentence-transformers >= 6.3"):
            fst.kernel_config()
        return
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "kernels", None)            # not installed
        with pytest.raises(ImportError, match="`kernels` package"):
            fst.kernel_config()
    if importlib.util.find_spec("kernels") is None:
        return
    with monkeypatch.context() as patched:
        patched.setattr(fst.kernel_layers, "KERNEL_REPOSITORY", tmp_path / "missing")
        with pytest.raises(FileNotFoundError, match="kernel repository is missing"):
            fst.kernel_config()
    config = fst.kernel_config()
    assert config.use_local_kernel and set(config.kernel_mapping) == {"STMaxSim", "STMaxSimPairwise"}


@pytest.mark.parametrize("seed", range(2))
def test_toggling_from_many_threads_leaves_a_consistent_state(toggle_from_threads, seed):
    """8 threads calling enable/disable/is_enabled/enabled at random: no exception, is_enabled() agrees with
    whether the functions are replaced, and disable() restores every object."""
    toggle_from_threads(fst, seed=seed)
    replaced = [(module, attribute) for module, attribute in ALIASES
                if _current(module, attribute) is not ORIGINAL[attribute]]
    assert len(replaced) == (len(ALIASES) if fst.is_enabled() else 0)
    fst.disable()
    _assert_all_original()


def test_missing_sentence_transformers_is_an_import_error_with_the_install_command(monkeypatch):
    for name in [n for n in sys.modules if n == "sentence_transformers" or n.startswith("sentence_transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r'pip install "flash-maxsim-kernels\[sentence-transformers\]"'):
        fst.enable()
    with pytest.raises(ImportError, match=r'pip install "flash-maxsim-kernels\[sentence-transformers\]"'):
        fst.kernel_config()
    assert not fst.is_enabled()
