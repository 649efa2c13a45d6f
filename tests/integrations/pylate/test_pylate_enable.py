"""enable()/disable(): what gets routed through flash_maxsim, exact restore, idempotence, FLASH_MAXSIM_DISABLE,
nothing at import."""

import copy
import logging
import os
import subprocess
import sys

import pytest
import torch

pylate = pytest.importorskip("pylate")

import pylate.evaluation  # noqa: E402,F401  (imported here so that the snapshots see every module enable() imports)
import pylate.losses  # noqa: E402
import pylate.models  # noqa: E402
import pylate.rank  # noqa: E402
import pylate.retrieve  # noqa: E402,F401
import pylate.scores  # noqa: E402
from pylate.scores import SimilarityFunction  # noqa: E402

from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402

import pylate_testlib as lib  # noqa: E402


def _snapshot():
    """Every object the integration may touch: module-level names under pylate.*, the ColBERTScores method,
    the losses' __init__ defaults, the ColBERT model class's own attributes."""
    state = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("pylate."):
            for attr, value in list(vars(module).items()):
                state[(name, attr)] = value
    if lib.HAS_COLBERT_SCORES_CLASS:
        state["ColBERTScores.__call__"] = pylate.scores.ColBERTScores.__dict__["__call__"]
    for cls in (pylate.losses.Contrastive, pylate.losses.CachedContrastive, pylate.losses.Distillation):
        state[(cls.__name__, "defaults")] = cls.__init__.__defaults__
        state[(cls.__name__, "kwdefaults")] = cls.__init__.__kwdefaults__
    state["ColBERT.__dict__"] = dict(vars(pylate.models.ColBERT))
    return state


def _changed(before, after):
    """The objects of ``before`` that ``after`` holds another of (an equal copy counts as the same)."""
    return [k for k in before if before[k] is not after.get(k) and before[k] != after.get(k)]


def _assert_same(before, after):
    assert before.keys() <= after.keys()
    changed = _changed(before, after)
    assert not changed, f"not restored: {changed[:5]}"


def _data(seed=5):
    g = torch.Generator().manual_seed(seed)
    Q = lib.embeddings((3, 6, 16), g, side=+1)
    D = lib.embeddings((4, 9, 16), g, side=-1)
    return Q, D, lib.skiplist_mask((4, 9), g)


def test_enable_disable_round_trip_restores_every_object():
    before = _snapshot()
    assert flash_pylate.enable() is True
    during = _snapshot()
    assert pylate.scores.colbert_scores is not before[("pylate.scores", "colbert_scores")]
    assert pylate.rank.rank.colbert_scores is pylate.scores.colbert_scores      # `from ..scores import` copies too
    assert pylate.scores.colbert_kd_scores is pylate.losses.distillation.colbert_kd_scores
    changed = [k for k in before if before[k] is not during.get(k)]
    assert len(changed) >= 6
    flash_pylate.disable()
    _assert_same(before, _snapshot())
    assert not flash_pylate.is_enabled()
    # and again: a second cycle patches and restores the same way
    flash_pylate.enable()
    assert pylate.rank.rank.colbert_scores is not before[("pylate.rank.rank", "colbert_scores")]
    flash_pylate.disable()
    _assert_same(before, _snapshot())


def test_enable_is_idempotent_and_enabled_restores_previous_state():
    flash_pylate.enable()
    patched = pylate.scores.colbert_scores
    patches = flash_pylate._integration._patches
    assert flash_pylate.enable() is True
    assert pylate.scores.colbert_scores is patched and flash_pylate._integration._patches is patches
    with flash_pylate.enabled():
        assert pylate.scores.colbert_scores is patched
    assert flash_pylate.is_enabled()                                  # it was enabled before the block
    flash_pylate.disable()
    flash_pylate.disable()                                            # harmless
    before = _snapshot()
    with flash_pylate.enabled():
        assert flash_pylate.is_enabled()
    assert not flash_pylate.is_enabled()
    _assert_same(before, _snapshot())


def test_flash_maxsim_disable_environment_makes_enable_a_no_op(enable_under_disable_variable, flash_calls):
    before = _snapshot()
    enable_under_disable_variable(flash_pylate)
    _assert_same(before, _snapshot())
    Q, D, dmask = _data()
    lib.pylate_colbert_scores(Q, D, None, dmask)
    pylate.scores.colbert_scores(Q, D, None, dmask)
    assert flash_calls.calls == 0


def test_enable_logs_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="flash_maxsim"):
        flash_pylate.enable()
        flash_pylate.enable()
    lines = [r for r in caplog.records if "PyLate now scores with flash_maxsim" in r.getMessage()]
    assert len(lines) == 1 and "colbert_scores" in lines[0].getMessage()


def test_import_changes_nothing():
    code = ("import sys, flash_maxsim.integrations.pylate as p; "
            "assert 'pylate' not in sys.modules, 'importing the integration imported PyLate'; "
            "assert not p.is_enabled()")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "FLASH_MAXSIM_DISABLE": ""})


def test_enabled_routes_scores_rerank_similarity_and_loss_defaults(flash_calls):
    Q, D, dmask = _data()
    expected = lib.pylate_colbert_scores(Q, D, None, dmask)
    expected_kd = lib.pylate_colbert_kd_scores(Q, D[:3].reshape(3, 1, 9, 16), None, dmask[:3].reshape(3, 1, 9))
    flash_pylate.enable()

    # the module functions, whatever backend PyLate is asked for
    kw = {"backend": "torch"} if lib.HAS_BACKEND_SWITCH else {}
    torch.testing.assert_close(pylate.scores.colbert_scores(Q, D, None, dmask, **kw), expected, atol=2e-5, rtol=0)
    assert flash_calls.calls == 1
    # what a ColBERT model's `similarity` resolves to (the IR evaluators' score function)
    similarity = SimilarityFunction.to_similarity_fn("MaxSim")
    torch.testing.assert_close(similarity(Q, D, None, dmask), expected, atol=2e-5, rtol=0)
    assert flash_calls.calls == 2
    # the losses' default score_metric, bound when PyLate was imported (model not needed to build them)
    distillation = pylate.losses.Distillation(model=None)
    torch.testing.assert_close(distillation.score_metric(Q, D[:3].reshape(3, 1, 9, 16), None,
                                                         dmask[:3].reshape(3, 1, 9)), expected_kd, atol=2e-5, rtol=0)
    assert flash_calls.calls == 3
    contrastive = pylate.losses.Contrastive(model=None)
    contrastive.score_metric(Q, D.reshape(2, 2, 9, 16) if lib.HAS_COLBERT_SCORES_CLASS else D, None,
                             dmask.reshape(2, 2, 9) if lib.HAS_COLBERT_SCORES_CLASS else dmask)
    assert flash_calls.calls == 4

    # rank.rerank: padded documents, no masks, per query; same order and scores as PyLate's own
    doc_lists = [[D[i, : 3 + 2 * i].numpy() for i in range(4)], [D[i, : 9 - i].numpy() for i in range(4)]]
    ids = [["a", "b", "c", "d"], ["e", "f", "g", "h"]]
    flash_pylate.disable()
    reference_ranking = pylate.rank.rerank(documents_ids=ids, queries_embeddings=[Q[0].numpy(), Q[1].numpy()],
                                           documents_embeddings=doc_lists)
    calls = flash_calls.calls
    flash_pylate.enable()
    ranking = pylate.rank.rerank(documents_ids=ids, queries_embeddings=[Q[0].numpy(), Q[1].numpy()],
                                 documents_embeddings=doc_lists)
    assert flash_calls.calls == calls + 2
    assert [[r["id"] for r in q] for q in ranking] == [[r["id"] for r in q] for q in reference_ranking]
    for q, q_ref in zip(ranking, reference_ranking):
        assert [r["score"] for r in q] == pytest.approx([r["score"] for r in q_ref], abs=2e-5)


@pytest.mark.skipif(not lib.HAS_COLBERT_SCORES_CLASS, reason="PyLate < 1.5 has no ColBERTScores")
def test_colbert_scores_objects_made_before_enable_follow_the_switch(flash_calls):
    Q, D, dmask = _data(7)
    D, dmask = D.reshape(2, 2, 9, 16), dmask.reshape(2, 2, 9)
    scorer = pylate.scores.ColBERTScores()
    expected = scorer(Q, D, None, dmask, backend="torch")
    with flash_pylate.enabled():
        torch.testing.assert_close(scorer(Q, D, None, dmask), expected, atol=2e-5, rtol=0)
        assert flash_calls.calls == 1
    scorer(Q, D, None, dmask)
    assert flash_calls.calls == 1


def test_functions_handed_out_while_enabled_go_back_to_pylate_after_disable(flash_calls):
    Q, D, dmask = _data(9)
    with flash_pylate.enabled():
        handed_out = pylate.scores.colbert_scores
        distillation_metric = pylate.losses.Distillation(model=None).score_metric
    torch.testing.assert_close(handed_out(Q, D, None, dmask), lib.pylate_colbert_scores(Q, D, None, dmask))
    distillation_metric(Q, D[:3].unsqueeze(1), None, dmask[:3].unsqueeze(1))
    assert flash_calls.calls == 0
    assert handed_out.flash_maxsim_original is lib.PYLATE_COLBERT_SCORES


def test_rerank_takes_a_quantized_candidate_index(flash_calls):
    """A query's candidates may be a compressed index: ``flash_maxsim.quantize`` of the candidate list
    (packed) or of a padded tensor. Rankings and scores are PyLate's own on the dequantised candidates and the
    query as an int8 index scores it (quantised per token: docs/semantics.md), its zero padding included; the
    other queries of the same call keep PyLate's path."""
    import flash_maxsim
    from flash_maxsim.quantization import queries_as_scored

    g = torch.Generator().manual_seed(21)
    queries = [torch.randn(5, 16, generator=g) for _ in range(3)]
    candidates = [[torch.randn(n, 16, generator=g) for n in lengths] for lengths in ((3, 9, 1, 6), (4, 4), (2, 7, 5))]
    ids = [["a", "b", "c", "d"], ["e", "f"], ["g", "h", "i"]]
    packed = flash_maxsim.quantize(candidates[0])
    padded = flash_maxsim.quantize(torch.nn.utils.rnn.pad_sequence(candidates[2], batch_first=True))
    values, offsets, _ = packed.dequantize()
    dequantized = [
        [values[a:b].numpy() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())],
        [c.numpy() for c in candidates[1]],
        [row.numpy() for row in padded.dequantize()],
    ]
    scored_queries = [queries_as_scored(queries[0], packed), queries[1], queries_as_scored(queries[2], padded)]
    assert not torch.equal(scored_queries[0], queries[0])
    expected = pylate.rank.rerank(documents_ids=ids, queries_embeddings=scored_queries,
                                  documents_embeddings=dequantized)
    with flash_pylate.enabled():
        got = pylate.rank.rerank(documents_ids=ids, queries_embeddings=queries,
                                 documents_embeddings=[packed, dequantized[1], padded])
    assert flash_calls.calls == 3
    assert [[r["id"] for r in q] for q in got] == [[r["id"] for r in q] for q in expected]
    for q, q_ref in zip(got, expected):
        assert [r["score"] for r in q] == pytest.approx([r["score"] for r in q_ref], abs=2e-5)
    # not vacuous: the zero padding decides some scores (a candidate whose similarities are all negative)
    negative = [-torch.rand(4, 16, generator=g) - 0.1]
    short_and_long = [[torch.rand(1, 16, generator=g) + 0.1, torch.rand(8, 16, generator=g) + 0.1]]
    with flash_pylate.enabled():
        padded_scores = pylate.rank.rerank(documents_ids=[["x", "y"]], queries_embeddings=negative,
                                           documents_embeddings=[flash_maxsim.quantize(short_and_long[0])])
    assert {r["id"]: r["score"] for r in padded_scores[0]}["x"] == 0.0
    with pytest.raises(ValueError, match="holds 2 documents but `documents_ids` lists 3"), flash_pylate.enabled():
        pylate.rank.rerank(documents_ids=[["x", "y", "z"]], queries_embeddings=negative,
                           documents_embeddings=[flash_maxsim.quantize(short_and_long[0])])


@pytest.mark.parametrize("as_array", [torch.as_tensor, lambda t: t.numpy()], ids=["tensor", "numpy"])
def test_rerank_takes_one_query_as_a_2d_array_with_a_quantized_index(as_array):
    """PyLate's rerank takes a single query as a 2-D tensor or numpy array (its reshape adds the batch axis); so
    does the quantized path, which must not iterate over that query's token rows."""
    import flash_maxsim
    from flash_maxsim.quantization import queries_as_scored

    g = torch.Generator().manual_seed(22)
    query = torch.randn(5, 16, generator=g)
    candidates = [torch.randn(n, 16, generator=g) for n in (3, 7)]
    index = flash_maxsim.quantize(candidates)
    values, offsets, _ = index.dequantize()
    dequantized = [values[a:b].numpy() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    expected = pylate.rank.rerank(documents_ids=[["a", "b"]], queries_embeddings=queries_as_scored(query, index),
                                  documents_embeddings=[dequantized])
    with flash_pylate.enabled():
        got = pylate.rank.rerank(documents_ids=[["a", "b"]], queries_embeddings=as_array(query),
                                 documents_embeddings=[index])
    assert len(got) == 1 and [r["id"] for r in got[0]] == [r["id"] for r in expected[0]]
    assert [r["score"] for r in got[0]] == pytest.approx([r["score"] for r in expected[0]], abs=2e-5)


@pytest.mark.parametrize("offsets, message", [([0, 3, 200], "end at 200 but the index holds 10"),
                                              ([0, 7, 10], None), ([0, 8, 2, 10], "decrease at document 1")])
def test_rerank_checks_the_offsets_of_a_quantized_index(offsets, message, flash_calls):
    import flash_maxsim

    index = copy.copy(flash_maxsim.quantize([torch.randn(3, 16), torch.randn(7, 16)]))
    index.offsets = torch.tensor(offsets)
    ids = [[str(i) for i in range(len(offsets) - 1)]]
    with flash_pylate.enabled():
        if message is None:                  # other valid bounds: scored as the documents they delimit
            assert len(pylate.rank.rerank(documents_ids=ids, queries_embeddings=[torch.randn(4, 16)],
                                          documents_embeddings=[index])[0]) == 2
            return
        with pytest.raises(ValueError, match=rf"`documents_embeddings\[0\]` offsets .*{message}"):
            pylate.rank.rerank(documents_ids=ids, queries_embeddings=[torch.randn(4, 16)],
                               documents_embeddings=[index])
    assert flash_calls.calls == 0


@pytest.mark.parametrize("seed", range(2))
def test_toggling_from_many_threads_leaves_a_consistent_state(toggle_from_threads, seed):
    """8 threads calling enable/disable/is_enabled/enabled at random: no exception, is_enabled() agrees with
    whether any patch is installed, and disable() restores every object."""
    before = _snapshot()
    toggle_from_threads(flash_pylate, seed=seed)
    assert bool(_changed(before, _snapshot())) == flash_pylate.is_enabled()
    flash_pylate.disable()
    _assert_same(before, _snapshot())


def test_missing_pylate_is_an_import_error_with_the_install_command(monkeypatch):
    for name in [n for n in sys.modules if n == "pylate" or n.startswith("pylate.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r'needs PyLate: pip install "flash-maxsim-kernels\[pylate\]"'):
        flash_pylate.enable()
    assert not flash_pylate.is_enabled()
