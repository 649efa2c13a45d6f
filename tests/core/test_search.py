"""flash_maxsim.search: the top k of the float64 reference's scores sorted with a stable descending sort, for every
layout, mask and mode, chunked in any way; exact ties (integer-valued embeddings) broken by the lower index."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_maxsim as fm
from flash_maxsim import _search, reference
from flash_maxsim.ops import force_backend
from flash_maxsim.quantization import queries_as_scored

LAYOUTS = ("padded", "candidates", "list", "packed")


def _backend_ok(name):
    from flash_maxsim.kernels import launch
    return name == "torch" or torch.cuda.is_available() or launch.interpreting()


def _values(shape, g, integer, dtype=torch.float32):
    if integer:            # small integers: every similarity and score exact in fp32, and many exact ties
        return torch.randint(-2, 3, shape, generator=g).to(dtype)
    return (torch.randn(*shape, generator=g) * shape[-1] ** -0.25).to(dtype)


def make_problem(layout, g, *, B=11, Nq=3, Lq=4, Ld=6, d=8, integer=True, dtype=torch.float32, masks=False,
                 device="cpu"):
    """(queries, documents, queries_mask, documents_mask) in ``layout``; lengths 0..Ld for the ragged ones, one
    document fully masked when ``masks``."""
    q = _values((Nq, Lq, d), g, integer, dtype).to(device)
    qm = (torch.rand(Nq, Lq, generator=g) > 0.3).to(device) if masks else None
    if layout in ("padded", "candidates"):
        shape = (B, Ld, d) if layout == "padded" else (Nq, B, Ld, d)
        docs = _values(shape, g, integer, dtype).to(device)
        dm = None
        if masks:
            dm = torch.rand(*shape[:-1], generator=g) > 0.4
            dm.view(-1, Ld)[min(2, dm.view(-1, Ld).shape[0] - 1)] = False
            dm = dm.to(device)
        return q, docs, qm, dm
    lengths = torch.randint(0, Ld + 1, (B,), generator=g).tolist()
    listed = [_values((n, d), g, integer, dtype).to(device) for n in lengths]
    dm = [(torch.rand(n, generator=g) > 0.4).to(device) for n in lengths] if masks else None
    if layout == "list":
        return q, listed, qm, dm
    packed = fm.pack(listed) if listed else fm.PackedDocuments(q.new_zeros(0, d), torch.zeros(1, dtype=torch.int64,
                                                                                               device=device))
    return q, packed, qm, (None if dm is None else torch.cat(dm))


def expected(queries, documents, k, queries_mask=None, documents_mask=None, masked="exclude"):
    """float64 reference scores (all), and the top k' of a stable descending sort."""
    ref = reference.maxsim(queries, documents, queries_mask, documents_mask, masked=masked)
    values, indices = torch.sort(ref, dim=-1, descending=True, stable=True)
    kk = min(k, ref.shape[-1])
    return ref, values[..., :kk], indices[..., :kk]


def check_exact(got, queries, documents, k, queries_mask=None, documents_mask=None, masked="exclude"):
    _, values, indices = expected(queries, documents, k, queries_mask, documents_mask, masked)
    assert got.scores.dtype == torch.float32 and got.indices.dtype == torch.int64
    assert got.indices.shape == indices.shape
    assert torch.equal(got.indices.cpu(), indices.cpu()), (got.indices, indices)
    assert torch.equal(got.scores.double().cpu(), values.cpu())


def check_close(got, ref, k, atol):
    """Where scores are not exact: each returned score within ``atol`` of its document's reference score; the
    returned scores within ``atol`` of the reference's k' largest (so no better document was left out); the
    order descending, ties by increasing index; no index twice."""
    ref = ref.cpu()
    scores, indices = got.scores.cpu(), got.indices.cpu()
    kk = min(k, ref.shape[-1])
    assert scores.shape == indices.shape == (*ref.shape[:-1], kk)
    if kk == 0:
        return
    scores2, indices2, ref2 = scores.reshape(-1, kk).double(), indices.reshape(-1, kk), ref.reshape(-1, ref.shape[-1])
    assert ((scores2 - ref2.gather(1, indices2)).abs() <= atol).all()
    best = torch.sort(ref2, dim=1, descending=True).values[:, :kk]
    assert ((scores2 - best).abs() <= atol).all()
    assert (scores2[:, 1:] <= scores2[:, :-1]).all()
    assert ((scores2[:, 1:] < scores2[:, :-1]) | (indices2[:, 1:] > indices2[:, :-1])).all()
    for row in indices2:
        assert len(set(row.tolist())) == kk


# ------------------------------------------------------------------------------------------- exact (the torch path)

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("masked", ["exclude", "zero"])
@pytest.mark.parametrize("masks", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 4, 100])
def test_equals_the_stable_sort_of_the_reference_with_exact_ties(layout, masked, masks, chunk_size, seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, qm, dm = make_problem(layout, g, masks=masks)
    for k in (1, 5, 11, 40):
        with force_backend("torch"):
            got = fm.search(q, docs, k, qm, dm, masked=masked, chunk_size=chunk_size)
        check_exact(got, q, docs, k, qm, dm, masked)


def test_ties_across_chunk_boundaries_keep_the_lower_index():
    """Every document scores the same: the result is 0, 1, ..., k-1 whatever the chunking."""
    q = torch.ones(2, 3, 4)
    d = torch.ones(10, 5, 4)
    for chunk_size in (None, 1, 2, 3, 7):
        for k in (1, 4, 10):
            with force_backend("torch"):
                got = fm.search(q, d, k, chunk_size=chunk_size)
            assert torch.equal(got.indices, torch.arange(k).expand(2, k))
            assert (got.scores == 12).all()
    # equal scores in an order that the chunks visit out of score order
    d = torch.zeros(9, 1, 4)
    d[[1, 4, 7], 0, 0] = 1.0
    d[[2, 8], 0, 0] = 2.0
    with force_backend("torch"):
        got = fm.search(q[:1], d, 6, chunk_size=2)
    assert got.indices.tolist() == [[2, 8, 1, 4, 7, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_embeddings_every_dtype(layout, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, qm, dm = make_problem(layout, g, B=13, Nq=5, Lq=7, Ld=9, d=20, integer=False, dtype=dtype, masks=True)
    ref = reference.maxsim(q, docs, qm, dm)
    for chunk_size in (None, 4):
        with force_backend("torch"):
            got = fm.search(q, docs, 6, qm, dm, chunk_size=chunk_size)
        check_close(got, ref, 6, atol=1e-4)


def test_one_query_drops_the_query_axis(seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, _, _ = make_problem("packed", g)
    qm = torch.rand(q.shape[1], generator=g) > 0.2
    with force_backend("torch"):
        got = fm.search(q[0], docs, 3, qm, chunk_size=2)
    assert got.scores.shape == got.indices.shape == (3,)
    check_exact(got, q[0], docs, 3, qm)


def test_k_larger_than_the_corpus_returns_every_document(seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, _, _ = make_problem("padded", g, B=5)
    with force_backend("torch"):
        got = fm.search(q, docs, 9, chunk_size=2)
    assert got.scores.shape == (3, 5)
    assert sorted(got.indices[0].tolist()) == [0, 1, 2, 3, 4]
    check_exact(got, q, docs, 9)


def test_empty_corpus_and_no_queries():
    q = torch.randn(2, 3, 4)
    with force_backend("torch"):
        for docs in ([], torch.zeros(0, 3, 4), fm.PackedDocuments(torch.zeros(0, 4), torch.zeros(1, dtype=torch.long))):
            got = fm.search(q, docs, 3)
            assert got.scores.shape == got.indices.shape == (2, 0)
        got = fm.search(q[:0], torch.randn(5, 2, 4), 3)
        assert got.scores.shape == got.indices.shape == (0, 3)


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "3", None, 2 ** 31])
def test_invalid_k_is_a_value_error_naming_k(k):
    with pytest.raises(ValueError, match="`k`"):
        fm.search(torch.randn(1, 2, 4), torch.randn(3, 2, 4), k)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.0, True, "8", 2 ** 31])
def test_invalid_chunk_size_is_a_value_error_naming_it(chunk_size):
    with pytest.raises(ValueError, match="`chunk_size`"):
        fm.search(torch.randn(1, 2, 4), torch.randn(3, 2, 4), 2, chunk_size=chunk_size)


def test_numpy_integers_are_accepted_as_k():
    np = pytest.importorskip("numpy")
    with force_backend("torch"):
        got = fm.search(torch.randn(1, 2, 4), torch.randn(3, 2, 4), np.int64(2), chunk_size=np.int32(2))
    assert got.indices.shape == (1, 2)


def test_bad_inputs_are_refused_before_any_scoring(monkeypatch):
    """A listed document or per-document mask that is wrong anywhere in the list fails before the first chunk is
    scored."""
    calls = []
    monkeypatch.setattr(_search, "_scores", lambda *a: calls.append(a))
    q = torch.randn(1, 2, 4)
    docs = [torch.randn(3, 4) for _ in range(6)]
    with pytest.raises(ValueError, match=r"documents\[5\]"):
        fm.search(q, docs[:5] + [torch.randn(3, 5)], 2, chunk_size=1)
    with pytest.raises(TypeError, match=r"documents\[4\]"):
        fm.search(q, docs[:4] + [torch.randn(3, 4, dtype=torch.float64)] + docs[5:], 2, chunk_size=1)
    with pytest.raises(ValueError, match=r"documents_mask\[5\]"):
        fm.search(q, docs, 2, documents_mask=[torch.ones(3)] * 5 + [torch.ones(2)], chunk_size=1)
    with pytest.raises(ValueError, match="documents_mask"):
        fm.search(q, docs, 2, documents_mask=torch.ones(17), chunk_size=1)
    with pytest.raises(ValueError, match="documents.offsets"):
        fm.search(q, fm.PackedDocuments(torch.randn(6, 4), torch.tensor([0, 4, 2, 6])), 2, chunk_size=1)
    with pytest.raises(ValueError, match="masked"):
        fm.search(q, docs, 2, masked="ignore")
    assert calls == []


def test_scores_are_detached():
    q = torch.randn(2, 3, 4, requires_grad=True)
    d = torch.randn(5, 3, 4, requires_grad=True)
    with force_backend("torch"):
        got = fm.search(q, d, 2)
    assert not got.scores.requires_grad


def test_nan_scores_rank_first_in_index_order_as_a_stable_sort_places_them():
    q = torch.ones(1, 2, 4)
    d = torch.randint(-2, 3, (8, 3, 4)).float()
    d[[2, 5], 1, 0] = float("nan")
    with force_backend("torch"):
        got = fm.search(q, d, 4, chunk_size=3)
        full = fm.maxsim(q, d)
    values, indices = torch.sort(full, descending=True, stable=True)
    assert got.indices.tolist() == indices[:, :4].tolist()
    assert got.indices[0, :2].tolist() == [2, 5]
    torch.testing.assert_close(got.scores, values[:, :4], equal_nan=True, rtol=0, atol=0)


@st.composite
def _offsets(draw):
    """Offsets over ``rows`` values: valid ones, or ones moved anywhere nearby (negative, decreasing, past the
    values)."""
    rows = draw(st.integers(0, 12))
    cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=6)))
    offsets = [0] + cuts + [rows]
    if draw(st.booleans()):
        i = draw(st.integers(0, len(offsets) - 1))
        offsets[i] = draw(st.integers(-3, rows + 3))
    return rows, offsets, draw(st.integers(1, 8)), draw(st.integers(1, 5)), draw(st.integers(0, 2 ** 31 - 1))


@settings(max_examples=80, deadline=None)
@given(arguments=_offsets())
def test_random_offsets_give_an_error_or_the_reference_top_k(arguments):
    rows, offsets, k, chunk_size, seed = arguments
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (2, 3, 8), generator=g).float()
    values = torch.randint(-2, 3, (rows, 8), generator=g).float()
    documents = fm.PackedDocuments(values, torch.tensor(offsets))
    valid = offsets[0] == 0 and offsets[-1] == rows and all(b >= a for a, b in zip(offsets, offsets[1:]))
    with force_backend("torch"):
        if not valid:
            with pytest.raises(ValueError, match=r"`documents\.offsets`"):
                fm.search(q, documents, k, chunk_size=chunk_size)
            return
        got = fm.search(q, documents, k, chunk_size=chunk_size)
    check_exact(got, q, [values[a:b] for a, b in zip(offsets, offsets[1:])], k)


# ------------------------------------------------------------------------------------------- the running top-k

def _special_rows(g, Nq, M):
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), -float("inf"), float("nan"), 3e38, -3e38,
                         1e-45, -1e-45])
    return pool[torch.randint(0, len(pool), (Nq, M), generator=g)]


@pytest.mark.parametrize("k", [1, 3, 8, 50])
def test_running_top_k_is_a_stable_descending_sort_of_any_floats(k, seed):
    """Specials included: NaN above +inf, -0.0 equal to 0.0, subnormals, the largest floats; pushed in uneven
    chunks."""
    g = torch.Generator().manual_seed(seed)
    rows = _special_rows(g, 4, 37)
    values, indices = torch.sort(rows, dim=1, descending=True, stable=True)
    for cuts in ([37], [1] * 37, [5, 0, 13, 19], [36, 1]):
        top = _search.RunningTopK(4, min(k, 37), "cpu")
        start = 0
        for n in cuts:
            top.push(rows[:, start:start + n], start)
            start += n
        kk = min(k, 37)
        assert top.positions.tolist() == indices[:, :kk].tolist()
        got = top.scores
        assert torch.equal(got.isnan(), values[:, :kk].isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(values[:, :kk]))
        # the scores returned are the pushed ones, bit for bit (-0.0 stays -0.0)
        assert torch.equal(got.view(torch.int32)[~got.isnan()],
                           rows.gather(1, top.positions).view(torch.int32)[~got.isnan()])


def test_running_top_k_skips_excluded_columns(seed):
    g = torch.Generator().manual_seed(seed)
    rows = _special_rows(g, 3, 20)
    excluded = torch.rand(20, generator=g) < 0.5
    excluded[0] = True
    live = (~excluded).nonzero()[:, 0]
    values, order = torch.sort(rows[:, live], dim=1, descending=True, stable=True)
    top = _search.RunningTopK(3, 6, "cpu")
    for s in range(0, 20, 7):
        e = min(20, s + 7)
        top.push(rows[:, s:e], torch.arange(s, e), excluded[s:e], int((~excluded[s:e]).sum()))
    kk = min(6, len(live))
    assert top.positions.tolist() == live[order[:, :kk]].tolist()


def test_merge_top_k_orders_ties_by_position_whatever_the_order_of_the_parts():
    a = (torch.tensor([[5.0, 3.0, 3.0]]), torch.tensor([[7, 2, 9]]))
    b = (torch.tensor([[5.0, 4.0, 3.0]]), torch.tensor([[1, 8, 0]]))
    scores, positions = _search.merge_top_k([a[0], b[0]], [a[1], b[1]], 5)
    assert positions.tolist() == [[1, 7, 8, 0, 2]]
    assert scores.tolist() == [[5.0, 5.0, 4.0, 3.0, 3.0]]


# ------------------------------------------------------------------------------------------- memory and copies

@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_chunk_scores_at_most_chunk_size_columns_and_packed_chunks_are_views(layout, monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, qm, dm = make_problem(layout, g, B=10, masks=True)
    seen = []
    real = _search._scores

    def spy(problem, zero, tau):
        seen.append(problem)
        return real(problem, zero, tau)

    monkeypatch.setattr(_search, "_scores", spy)
    with force_backend("torch"):
        got = fm.search(q, docs, 4, qm, dm, chunk_size=3)
    check_exact(got, q, docs, 4, qm, dm)
    assert [p.num_columns for p in seen] == [3, 3, 3, 1]
    if layout in ("padded", "packed"):
        base = (docs if layout == "padded" else docs.values).untyped_storage().data_ptr()
        assert all(p.documents.untyped_storage().data_ptr() == base for p in seen)


def test_the_default_chunk_holds_a_bounded_number_of_scores(monkeypatch):
    monkeypatch.setattr(_search, "SCORES_PER_CHUNK", 12)
    seen = []
    real = _search._scores
    monkeypatch.setattr(_search, "_scores", lambda p, z, t: seen.append(p.num_columns) or real(p, z, t))
    with force_backend("torch"):
        fm.search(torch.randn(5, 2, 4), torch.randn(9, 2, 4), 3)          # 12 // 5 = 2 documents a chunk
        fm.search(torch.randn(20, 2, 4), torch.randn(3, 2, 4), 3)         # at least 1
    assert seen == [2, 2, 2, 2, 1, 1, 1, 1]


# ------------------------------------------------------------------------------------------- quantised documents

@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["padded", "candidates", "packed"])
@pytest.mark.parametrize("masked", ["exclude", "zero"])
def test_quantized_documents_against_the_reference_on_the_dequantized_values(kind, layout, masked, seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, qm, dm = make_problem(layout, g, B=12, Nq=4, Lq=5, Ld=7, d=16, integer=False, masks=True)
    index = fm.quantize(docs, dm, dtype=kind)
    dense = index.dequantize(torch.float64)
    ref = reference.maxsim(queries_as_scored(q, index).double(), dense, qm, dm, masked=masked)
    for chunk_size in (None, 5):
        with force_backend("torch"):
            got = fm.search(q, index, 5, qm, masked=masked, chunk_size=chunk_size)
        check_close(got, ref, 5, atol=1e-4)


# ------------------------------------------------------------------------------------------- the kernels

@pytest.mark.interpret
@pytest.mark.parametrize("layout", LAYOUTS + ("int8",))
def test_the_kernels_give_the_same_top_k(layout, seed):
    if not _backend_ok("triton"):
        pytest.skip("the Triton backend needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    base = "packed" if layout == "int8" else layout
    q, docs, qm, dm = make_problem(base, g, B=7, Nq=2, Lq=3, Ld=5, d=16, masks=True, device=device)
    if layout == "int8":
        index = fm.quantize(docs, dm)
        ref = reference.maxsim(queries_as_scored(q, index).double(), index.dequantize(torch.float64), qm, dm)
        with force_backend("triton"):
            got = fm.search(q, index, 4, qm, chunk_size=3)
        check_close(got, ref, 4, atol=1e-3)
        return
    with force_backend("triton"):
        got = fm.search(q, docs, 4, qm, dm, masked="zero", chunk_size=3)
    check_exact(got, q, docs, 4, qm, dm, "zero")


# ------------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_cuda_against_the_reference(layout, storage, seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, qm, dm = make_problem(layout, g, B=300, Nq=8, Lq=32, Ld=70, d=128, integer=False,
                                   dtype=torch.bfloat16, masks=True, device="cuda")
    if storage == "int8":
        if layout == "list":
            docs, dm = fm.pack(docs), torch.cat(dm)
        docs = fm.quantize(docs, dm)
        ref = reference.maxsim(queries_as_scored(q, docs).double(), docs.dequantize(torch.float64), qm, dm)
        dm = None
    else:
        ref = reference.maxsim(q, docs, qm, dm)
    for chunk_size in (None, 64, 77):
        got = fm.search(q, docs, 10, qm, dm, chunk_size=chunk_size)
        check_close(got, ref, 10, atol=2e-3)
    # and identical to maxsim followed by a stable sort when the whole corpus is one chunk
    got = fm.search(q, docs, 10, qm, dm)
    values, indices = torch.sort(fm.maxsim(q, docs, qm, dm), descending=True, stable=True)
    assert torch.equal(got.indices, indices[:, :10]) and torch.equal(got.scores, values[:, :10])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_padded_search_never_waits_for_the_device(twice_second_without_sync, seed):
    g = torch.Generator().manual_seed(seed)
    q, docs, qm, dm = make_problem("padded", g, B=500, Nq=4, Lq=32, Ld=64, d=128, integer=False,
                                   dtype=torch.bfloat16, masks=True, device="cuda")
    first, second = twice_second_without_sync(lambda: fm.search(q, docs, 10, qm, dm, chunk_size=128))
    assert torch.equal(first.indices, second.indices) and torch.equal(first.scores, second.scores)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory_is_bounded_by_the_chunk_not_the_corpus(seed):
    """256 queries x 100k documents: the score matrix would be 100 MiB; a search in chunks of 2048 documents
    holds ~25 bytes per score of a chunk (13 MiB) and the kernels' scratch for it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(256, 8, 16, generator=g).to("cuda", torch.bfloat16)
    d = torch.randn(100_000, 4, 16, generator=g).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = fm.search(q, d, 10, chunk_size=2048)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 40 * 2 ** 20, extra / 2 ** 20
    want = torch.sort(fm.maxsim(q, d), descending=True, stable=True)
    torch.testing.assert_close(got.scores, want.values[:, :10], rtol=1e-6, atol=1e-4)
