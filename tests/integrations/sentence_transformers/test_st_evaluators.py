"""The multi-vector evaluators report the same metrics with and without enable(), and flash_maxsim really scores.

NanoBEIR normally downloads its datasets from the Hugging Face Hub; the tests run offline, so the
evaluator runs here with its loader replaced by a tiny in-memory dataset (two "subsets" of the corpus below), so
the NanoBEIR aggregation and its per-subset IR evaluators run unchanged on offline data.
"""

from __future__ import annotations

import pytest
import torch

from flash_maxsim.integrations import sentence_transformers as fst
from sentence_transformers.multi_vector_encoder import evaluation

from st_cases import DOCUMENTS, QUERIES

# query i is answered by document i; documents 6..11 are distractors
CORPUS = {f"d{i}": text for i, text in enumerate(DOCUMENTS)}
QUERY_TEXTS = {f"q{i}": text for i, text in enumerate(QUERIES)}
RELEVANT = {f"q{i}": {f"d{i}"} for i in range(len(QUERIES))}


class OfflineNanoBEIR(evaluation.MultiVectorNanoBEIREvaluator):
    """NanoBEIR with its datasets served from memory (rows as the Hub datasets hold them)."""

    def _load_dataset_subset_split(self, subset, split, required_columns):
        half = 0 if split == "NanoMSMARCO" else 1
        queries = [q for q in QUERY_TEXTS if int(q[1:]) % 2 == half]
        if subset == "corpus":
            return [{"_id": cid, "text": text} for cid, text in CORPUS.items()]
        if subset == "queries":
            return [{"_id": qid, "text": QUERY_TEXTS[qid]} for qid in queries]
        return [{"query-id": qid, "corpus-id": f"d{qid[1:]}"} for qid in queries]


def _information_retrieval():
    return evaluation.MultiVectorInformationRetrievalEvaluator(
        QUERY_TEXTS, CORPUS, RELEVANT, corpus_chunk_size=5, write_csv=False, name="ir")


def _nano_beir():
    return OfflineNanoBEIR(dataset_names=["msmarco", "nq"], write_csv=False, corpus_chunk_size=5)


def _reranking():
    samples = [{"query": QUERIES[i], "positive": [DOCUMENTS[i]],
                "negative": [DOCUMENTS[(i + 6) % 12], DOCUMENTS[(i + 1) % 6], DOCUMENTS[10]]}
               for i in range(len(QUERIES))]
    return evaluation.MultiVectorRerankingEvaluator(samples, write_csv=False, name="rerank")


def _triplet():
    return evaluation.MultiVectorTripletEvaluator(
        QUERIES, DOCUMENTS[:6], DOCUMENTS[6:], write_csv=False, similarity_fn_names=["maxsim", "meanmaxsim"])


def _distillation_candidates():
    scores = torch.randn(len(QUERIES), 3, generator=torch.Generator().manual_seed(3)).tolist()
    documents = [[DOCUMENTS[i], DOCUMENTS[i + 6], DOCUMENTS[(i + 1) % 6]] for i in range(len(QUERIES))]
    return evaluation.MultiVectorDistillationEvaluator(QUERIES, documents, scores, write_csv=False,
                                                       temperature=0.5)


def _distillation_pairs():
    scores = torch.randn(len(QUERIES), generator=torch.Generator().manual_seed(4)).tolist()
    return evaluation.MultiVectorDistillationEvaluator(QUERIES, DOCUMENTS[6:], scores, write_csv=False)


EVALUATORS = {"information_retrieval": _information_retrieval, "nano_beir": _nano_beir, "reranking": _reranking,
              "triplet": _triplet, "distillation_candidates": _distillation_candidates,
              "distillation_pairs": _distillation_pairs}


# the triplet evaluator scores both similarities in one run, and NanoBEIR runs the IR evaluator: maxsim only
CASES = [(name, fn) for name in EVALUATORS for fn in ("maxsim", "meanmaxsim")
         if fn == "maxsim" or name not in ("triplet", "nano_beir")]


@pytest.mark.parametrize("name, similarity_fn_name", CASES)
def test_metrics_equal_with_and_without_enable(model, mask_config, name, similarity_fn_name, flash_calls):
    saved = model.similarity_fn_name
    model.similarity_fn_name = similarity_fn_name
    try:
        # a fresh evaluator per run: sentence-transformers 6.0.x caches the scoring function on first call
        expected = EVALUATORS[name]()(model)
        assert not flash_calls
        with fst.enabled():
            got = EVALUATORS[name]()(model)
    finally:
        model.similarity_fn_name = saved
    assert flash_calls
    assert got.keys() == expected.keys() and len(expected) > 0
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
