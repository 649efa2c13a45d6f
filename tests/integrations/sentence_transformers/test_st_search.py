"""``fst.semantic_search``: the top k of sentence-transformers' own (unpatched) ``util.maxsim`` scores in
``util.semantic_search``'s format, for what ``MultiVectorEncoder.encode`` returns and for padded tensors, chunk
by chunk; and sentence-transformers' own ``semantic_search`` cannot take those ragged lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flash_maxsim.integrations import sentence_transformers as fst
from sentence_transformers import util

from st_cases import DOCUMENTS, ORIGINAL, QUERIES


def _grid(generator, *shape):
    """Multiples of 1/8: every score is exact in fp32, so equal scores are exact and frequent."""
    return torch.randint(-8, 9, shape, generator=generator).float() / 8


def _ranked(scores: torch.Tensor, top_k: int):
    """sentence-transformers' scores ranked: descending, equal scores by lower corpus id."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]
    return [[{"corpus_id": i, "score": s} for i, s in zip(ids, values)]
            for ids, values in zip(order.tolist(), scores.gather(1, order).tolist())]


@pytest.mark.parametrize("chunk", [None, 1, 4])
@pytest.mark.parametrize("length_normalize", [False, True])
def test_ragged_lists_rank_like_util_maxsim(chunk, length_normalize):
    g = torch.Generator().manual_seed(7)
    queries = [_grid(g, n, 8) for n in (3, 5, 2)]
    corpus = [_grid(g, int(n), 8) for n in torch.randint(1, 7, (11,), generator=g)]
    corpus[6] = corpus[1].clone()                   # an exact tie
    corpus[9] = torch.zeros(0, 8)                   # a document without tokens: -1e9, ranked last
    expected = _ranked(ORIGINAL["maxsim"](queries, corpus, length_normalize=length_normalize), 11)
    got = fst.semantic_search(queries, corpus, top_k=11, length_normalize=length_normalize, corpus_chunk_size=chunk)
    assert got == expected
    assert all(row[-1]["corpus_id"] == 9 for row in got)
    assert fst.semantic_search(queries, corpus, top_k=4, corpus_chunk_size=chunk) == \
        _ranked(ORIGINAL["maxsim"](queries, corpus), 4)


def test_padded_tensors_masks_and_numpy():
    g = torch.Generator().manual_seed(8)
    queries = _grid(g, 2, 4, 8)
    corpus = _grid(g, 9, 6, 8)
    mask = torch.rand(9, 6, generator=g) > 0.3
    mask[:, 0] = True
    expected = _ranked(ORIGINAL["maxsim"](queries, corpus, b_mask=mask), 5)
    assert fst.semantic_search(queries, corpus, top_k=5, corpus_mask=mask, corpus_chunk_size=2) == expected
    assert fst.semantic_search(queries.numpy(), corpus.numpy(), top_k=5, corpus_mask=mask.numpy(),
                               corpus_chunk_size=3) == expected
    # one query, one document: [tokens, dim] each
    single = fst.semantic_search(queries[0], corpus[0], top_k=3)
    assert single == _ranked(ORIGINAL["maxsim"](queries[0], corpus[0]), 3)
    assert fst.semantic_search(queries, [], top_k=3) == [[], []]


def test_real_model_embeddings(model):
    """What MultiVectorEncoder.encode returns: sentence-transformers' own semantic_search refuses it, ours
    ranks it as util.maxsim scores it."""
    q = model.encode_query(QUERIES)
    d = model.encode_document(DOCUMENTS)
    assert isinstance(d, list) and len({x.shape[0] for x in d}) > 1
    with pytest.raises(RuntimeError):
        util.semantic_search(q, d, top_k=3, score_function=ORIGINAL["maxsim"])
    scores = ORIGINAL["maxsim"](q, d)
    got = fst.semantic_search(q, d, top_k=5, corpus_chunk_size=3)
    expected = _ranked(scores, 5)
    assert [[r["corpus_id"] for r in row] for row in got] == [[r["corpus_id"] for r in row] for row in expected]
    for row, want in zip(got, expected):
        np.testing.assert_allclose([r["score"] for r in row], [r["score"] for r in want], rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument():
    queries = [torch.randn(3, 8)]
    corpus = [torch.randn(4, 8)]
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="`top_k`"):
            fst.semantic_search(queries, corpus, top_k=bad)
    with pytest.raises(ValueError, match="`corpus_chunk_size`"):
        fst.semantic_search(queries, corpus, corpus_chunk_size=0)
    with pytest.raises(TypeError, match="`corpus_embeddings`"):
        fst.semantic_search(queries, torch.randn(2, 3, 4, 8))
