"""Scores (and their gradients) of the MaxSim family equal sentence-transformers' own, with and without enable().

The oracle is always sentence-transformers' unpatched function (captured in st_cases.ORIGINAL) on the very same
inputs: real MiniLM token embeddings under three scoring-mask configurations, and fresh random data for the edge
cases (empty documents, fully masked rows, numpy, single embeddings, the inputs that take the fallback).
"""

from __future__ import annotations

import pytest
import torch

from flash_maxsim.integrations import sentence_transformers as fst
from sentence_transformers.util import similarity as st_similarity
from sentence_transformers.multi_vector_encoder.scoring import colbert as st_colbert

from st_cases import DOCUMENTS, ORIGINAL, QUERIES, padded_embeddings

ALL_PAIRS = ("maxsim", "mean_maxsim")
PAIRWISE = ("maxsim_pairwise", "mean_maxsim_pairwise")
SCORING = ("colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores",
           "mean_colbert_scores", "mean_colbert_scores_pairwise", "mean_colbert_kd_scores")


def assert_same_scores(got, expected, rtol=1e-5, atol=1e-5):
    assert got.dtype == torch.float32
    assert got.device == expected.device
    assert got.shape == expected.shape
    sentinel = expected <= fst.EMPTY_DOCUMENT_SCORE / 1e3      # -1e9 / (query tokens) stays far below real scores
    assert torch.equal(got <= fst.EMPTY_DOCUMENT_SCORE / 1e3, sentinel)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


class Embeddings:
    """Token embeddings of QUERIES and DOCUMENTS in every input form sentence-transformers accepts."""

    def __init__(self, model):
        self.q_list = model.encode_query(QUERIES)               # ragged, masked tokens already dropped
        self.d_list = model.encode_document(DOCUMENTS)
        self.q_pad, self.q_mask, q_tokens = padded_embeddings(model, QUERIES, "query")
        self.d_pad, self.d_mask, d_tokens = padded_embeddings(model, DOCUMENTS, "document")
        # masked rows zeroed and no mask: sentence-transformers then treats the all-zero rows as padding
        self.q_zero = self.q_pad * self.q_mask[..., None]
        self.d_zero = self.d_pad * self.d_mask[..., None]
        # every real token listed, the scoring mask given per item
        self.q_tok = [e[t] for e, t in zip(self.q_pad, q_tokens)]
        self.q_tok_mask = [m[t] for m, t in zip(self.q_mask, q_tokens)]
        self.d_tok = [e[t] for e, t in zip(self.d_pad, d_tokens)]
        self.d_tok_mask = [m[t] for m, t in zip(self.d_mask, d_tokens)]

    def forms(self, documents=slice(None)):
        """(form name, args, kwargs) of one scoring call per input form, documents restricted to a slice."""
        ds = documents
        yield "lists", (self.q_list, self.d_list[ds]), {}
        yield "padded+masks", (self.q_pad, self.d_pad[ds]), dict(a_mask=self.q_mask, b_mask=self.d_mask[ds])
        yield "padded, zero rows", (self.q_zero, self.d_zero[ds]), {}
        yield "lists+per-item masks", (self.q_tok, self.d_tok[ds]), dict(a_mask=self.q_tok_mask,
                                                                          b_mask=self.d_tok_mask[ds])
        yield "numpy lists", ([x.numpy() for x in self.q_list], [x.numpy() for x in self.d_list[ds]]), {}
        yield "numpy padded+masks", (self.q_pad.numpy(), self.d_pad[ds].numpy()), dict(
            a_mask=self.q_mask.numpy(), b_mask=self.d_mask[ds].numpy())
        yield "padded queries, listed documents", (self.q_pad, self.d_list[ds]), dict(a_mask=self.q_mask)


_EMBEDDINGS = {}


@pytest.fixture
def embeddings(model, mask_config):
    # encoded once per mask configuration: the inputs are read, never written, by the functions under test
    if mask_config not in _EMBEDDINGS:
        _EMBEDDINGS[mask_config] = Embeddings(model)
    return _EMBEDDINGS[mask_config]


@pytest.mark.parametrize("name", ALL_PAIRS + PAIRWISE)
def test_scores_equal_sentence_transformers(embeddings, mask_config, name, flash_calls):
    pairwise = name in PAIRWISE
    documents = slice(6, 12) if pairwise else slice(None)      # 6..11 hold the documents keep_only empties
    saw_empty = False
    for form, args, kwargs in embeddings.forms(documents):
        for length_normalize in (False, True):
            kw = dict(kwargs, length_normalize=length_normalize)
            expected = ORIGINAL[name](*args, **kw)
            calls = len(flash_calls)
            dropin = getattr(fst, name)(*args, **kw)
            with fst.enabled():
                patched = getattr(st_similarity, name)(*args, **kw)
            assert len(flash_calls) == calls + 2, form
            assert_same_scores(dropin, expected)
            assert_same_scores(patched, expected)
            saw_empty |= bool((expected < -1e6).any())
    # the allowlist leaves documents 8 and 10 without a scoreable token: the sentinel path really ran
    assert saw_empty == (mask_config == "keep_only")


@pytest.mark.parametrize("name", ALL_PAIRS)
def test_listed_documents_are_packed_not_padded(embeddings, name, flash_calls):
    fst.maxsim(embeddings.q_list, embeddings.d_list)
    assert flash_calls == ["PackedDocuments"]


def _stacked_documents(embeddings, zero_rows=False):
    """Loss-shaped documents: the two document columns 0..5 and 6..11 stacked to ``[6, 2, T, d]``."""
    pad, mask = (embeddings.d_zero, None) if zero_rows else (embeddings.d_pad, embeddings.d_mask)
    docs = torch.stack([pad[:6], pad[6:]], dim=1)
    return docs, (torch.stack([mask[:6], mask[6:]], dim=1) if mask is not None else None)


@pytest.mark.parametrize("name", SCORING)
def test_scoring_functions_equal_sentence_transformers(embeddings, mask_config, name, flash_calls):
    for zero_rows in (False, True):
        docs, docs_mask = _stacked_documents(embeddings, zero_rows)
        queries = embeddings.q_zero if zero_rows else embeddings.q_pad
        queries_mask = None if zero_rows else embeddings.q_mask
        if "pairwise" in name:
            docs = docs[:, 0]
            docs_mask = docs_mask[:, 0] if docs_mask is not None else None
        kwargs = dict(queries_mask=queries_mask, documents_mask=docs_mask)
        expected = ORIGINAL[name](queries, docs, **kwargs)
        calls = len(flash_calls)
        dropin = getattr(fst, name)(queries, docs, **kwargs)
        with fst.enabled():
            patched = getattr(st_colbert, name)(queries, docs, **kwargs)
        assert len(flash_calls) == calls + 2        # one fused call each, not one per document column
        assert_same_scores(dropin, expected)
        assert_same_scores(patched, expected)


def test_model_similarity_routes_through_flash(model, mask_config, flash_calls):
    """A model built before enable() (its stored scoring function is sentence-transformers') scores through
    flash_maxsim once enabled."""
    queries, documents = model.encode_query(QUERIES), model.encode_document(DOCUMENTS)
    for fn_name in ("maxsim", "meanmaxsim"):
        saved = model.similarity_fn_name
        model.similarity_fn_name = fn_name
        try:
            expected = model.similarity(queries, documents)
            expected_pairs = model.similarity_pairwise(queries, documents[:6])
            assert not flash_calls
            with fst.enabled():
                got = model.similarity(queries, documents)
                got_pairs = model.similarity_pairwise(queries, documents[:6])
            assert len(flash_calls) == 2
            flash_calls.clear()
        finally:
            model.similarity_fn_name = saved
        assert_same_scores(got, expected)
        assert_same_scores(got_pairs, expected_pairs)


# ----------------------------------------------------------------------------------------------------------
# Edge cases on fresh random data
# ----------------------------------------------------------------------------------------------------------

def _random(*shape, generator, dtype=torch.float32):
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _compare(name, *args, expect_flash=True, flash_calls=None, **kwargs):
    expected = ORIGINAL[name](*args, **kwargs)
    calls = len(flash_calls) if flash_calls is not None else 0
    got = getattr(fst, name)(*args, **kwargs)
    if flash_calls is not None:
        assert (len(flash_calls) > calls) == expect_flash
    assert_same_scores(got, expected)
    return got


@pytest.mark.parametrize("length_normalize", [False, True])
def test_empty_and_fully_masked_documents_score_the_sentinel(gen, length_normalize, flash_calls):
    queries = [_random(n, 8, generator=gen) for n in (3, 0, 5)]
    documents = [_random(n, 8, generator=gen) for n in (4, 0, 6, 1)]
    got = _compare("maxsim", queries, documents, length_normalize=length_normalize, flash_calls=flash_calls)
    assert (got[:, 1] < -1e8 / 5).all() and (got[:, [0, 2, 3]] > -1e3).all()
    assert (got[1, [0, 2, 3]] == 0).all()                     # a query without tokens scores 0
    masks = [torch.tensor([1, 0, 1, 1]), torch.zeros(0), torch.zeros(6), torch.ones(1)]
    got = _compare("maxsim", queries, documents, b_mask=masks, length_normalize=length_normalize,
                   flash_calls=flash_calls)
    assert (got[:, 2] < -1e8 / 5).all()
    padded = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
    _compare("maxsim", queries, padded, length_normalize=length_normalize, flash_calls=flash_calls)
    # every document empty, in both layouts (nothing for the kernels to do)
    _compare("maxsim", queries, [torch.zeros(0, 8), torch.zeros(0, 8)], length_normalize=length_normalize)
    _compare("maxsim", queries, torch.zeros(2, 0, 8), length_normalize=length_normalize)
    _compare("maxsim_pairwise", queries, [torch.zeros(0, 8)] * 3, length_normalize=length_normalize)
    _compare("maxsim_pairwise", queries, documents[:3], length_normalize=length_normalize, flash_calls=flash_calls)


def test_single_embeddings_and_broadcast_masks(gen, flash_calls):
    query, document = _random(5, 8, generator=gen), _random(7, 8, generator=gen)
    _compare("maxsim", query, document, flash_calls=flash_calls)
    _compare("maxsim", query, document, a_mask=torch.tensor([1, 1, 0, 1, 0]),
             b_mask=torch.tensor([0, 1, 1, 0, 1, 1, 0]), flash_calls=flash_calls)
    _compare("maxsim_pairwise", query.numpy(), document.numpy(), flash_calls=flash_calls)
    queries, documents = _random(3, 5, 8, generator=gen), _random(4, 7, 8, generator=gen)
    row = torch.tensor([[1, 0, 1, 1, 1, 0, 1]], dtype=torch.float32)         # one mask row for every document
    _compare("maxsim", queries, documents, b_mask=row, length_normalize=True, flash_calls=flash_calls)
    _compare("maxsim", queries, documents, a_mask=torch.tensor([[True, True, False, True, False]]),
             flash_calls=flash_calls)


def test_dtypes(gen, flash_calls):
    queries, documents = _random(3, 5, 8, generator=gen), [_random(n, 8, generator=gen) for n in (4, 6)]
    # float64 is scored in float32 (sentence-transformers documents float32 scores; 6.0-6.2 return float64 here,
    # their float64 padding mask promotes them, 6.3 returns float32)
    q64, d64 = queries.double(), [d.double() for d in documents]
    got = fst.maxsim(q64, d64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ORIGINAL["maxsim"](q64, d64).float(), rtol=1e-5, atol=1e-5)
    # quantized (integer) embeddings are scored as float, as sentence-transformers does
    q_int = (queries * 20).to(torch.int8)
    d_int = [(d * 20).to(torch.int8) for d in documents]
    _compare("maxsim", q_int, d_int, flash_calls=flash_calls)
    # bf16: products and sums in fp32, i.e. sentence-transformers' scores of the fp32 upcast (it rounds each
    # similarity to bf16 before the max)
    q_bf, d_bf = queries.bfloat16(), [d.bfloat16() for d in documents]
    got = fst.maxsim(q_bf, d_bf)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ORIGINAL["maxsim"](q_bf.float(), [d.float() for d in d_bf]),
                               rtol=1e-5, atol=1e-5)


def test_inputs_outside_the_kernels_take_sentence_transformers_path(gen, flash_calls):
    queries, documents = _random(3, 5, 8, generator=gen), [_random(n, 8, generator=gen) for n in (4, 6)]
    # a query mask with weights other than 0/1 weights the query tokens in sentence-transformers
    weights = torch.rand(3, 5, generator=gen) * 2
    for name in ("maxsim", "maxsim_pairwise"):
        docs = documents if name == "maxsim" else documents + [documents[0]]
        _compare(name, queries, docs, a_mask=weights, length_normalize=True, expect_flash=False,
                 flash_calls=flash_calls)
    stacked = _random(3, 2, 6, 8, generator=gen)
    expected = ORIGINAL["colbert_kd_scores"](queries, stacked, queries_mask=weights)
    assert_same_scores(fst.colbert_kd_scores(queries, stacked, queries_mask=weights), expected)
    # a mask marking positions past a listed document's length scores the padding in sentence-transformers
    beyond = torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1]])
    _compare("maxsim", queries, documents, b_mask=beyond, expect_flash=False, flash_calls=flash_calls)
    # 0/1 float masks are plain masks: they stay on the kernels
    _compare("maxsim", queries, documents, a_mask=(weights > 1).float(), flash_calls=flash_calls)


def test_empty_inputs_and_devices(gen):
    documents = [_random(4, 8, generator=gen)]
    for name in ALL_PAIRS:
        _compare(name, [], documents)
        _compare(name, _random(2, 3, 8, generator=gen), [])
    _compare("maxsim_pairwise", [], [])
    queries = _random(2, 3, 8, generator=gen)
    got = _compare("maxsim", queries, documents * 2, device="cpu")
    assert got.device.type == "cpu"


@pytest.mark.parametrize("chunk_elements", [1, 40, 200])
def test_listed_documents_are_copied_in_bounded_chunks(gen, chunk_elements, flash_calls):
    queries = [_random(n, 8, generator=gen) for n in (3, 5)]
    documents = [_random(n, 8, generator=gen) for n in (4, 0, 6, 1, 9, 3)]
    masks = [torch.rand(len(d), generator=gen) < 0.7 for d in documents]
    for name, docs in (("maxsim", documents), ("maxsim_pairwise", documents[:2])):
        for b_mask in (None, masks[:len(docs)]):
            flash_calls.clear()
            _compare(name, queries, docs, b_mask=b_mask, chunk_elements=chunk_elements, length_normalize=True)
            if chunk_elements == 1:
                # one document (pair) at a time; a chunk of 0-token documents needs no kernel call
                assert len(flash_calls) == len([n for n in docs if len(n)])
    flash_calls.clear()
    fst.maxsim(queries, documents)
    assert len(flash_calls) == 1


def test_bad_inputs_raise_clear_errors(gen):
    queries, documents = _random(2, 3, 8, generator=gen), _random(4, 5, 8, generator=gen)
    with pytest.raises(ValueError, match="a_mask"):
        fst.maxsim(queries, documents, a_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="b_mask"):
        fst.maxsim(queries, documents, b_mask=torch.ones(3, 5))
    with pytest.raises(ValueError, match="embedding size"):
        fst.maxsim(queries, _random(4, 5, 6, generator=gen))
    with pytest.raises(ValueError, match="same number of items"):
        fst.maxsim_pairwise(queries, documents)
    with pytest.raises(TypeError, match="`a`"):
        fst.maxsim("not embeddings", documents)
    with pytest.raises(TypeError, match="b_mask"):
        fst.maxsim(queries, documents, b_mask="mask")
    with pytest.raises(ValueError, match="`b`"):
        fst.maxsim(queries, _random(1, 4, 5, 8, generator=gen))
    with pytest.raises(ValueError, match="documents_embeddings"):
        fst.colbert_scores(queries, documents)
    with pytest.raises(TypeError, match="chunk_elements"):
        fst.maxsim(queries, [documents[0]], chunk_elements="many")


# ----------------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------------

def _grads(fn, leaves, *args, weights_seed=7, **kwargs):
    """Gradients of a random weighted sum of ``fn``'s scores (sentinel entries included: they carry none)."""
    scores = fn(*args, **kwargs)
    weights = torch.rand(scores.shape, generator=torch.Generator().manual_seed(weights_seed))
    grads = torch.autograd.grad((scores * weights).sum(), leaves)
    return scores.detach(), grads


def _check_grads(name, make_args, kwargs=None, module=None):
    kwargs = kwargs or {}
    leaves_ref, args_ref = make_args()
    expected, expected_grads = _grads(ORIGINAL[name], leaves_ref, *args_ref, **kwargs)
    leaves, args = make_args()
    got, got_grads = _grads(getattr(fst, name), leaves, *args, **kwargs)
    assert_same_scores(got, expected)
    assert any(g.abs().sum() > 0 for g in expected_grads)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length_normalize", [False, True])
def test_gradients_equal_sentence_transformers(length_normalize):
    gen = torch.Generator().manual_seed(99)
    base_q, base_d = torch.randn(4, 6, 8, generator=gen), torch.randn(5, 7, 8, generator=gen)
    q_mask = torch.rand(4, 6, generator=gen) < 0.7
    d_mask = torch.rand(5, 7, generator=gen) < 0.6
    d_mask[2] = False                                      # one document with no scoreable token
    lengths = [7, 0, 3, 5, 6]
    stacked = torch.randn(4, 3, 7, 8, generator=gen)
    stacked_mask = torch.rand(4, 3, 7, generator=gen) < 0.6
    kw = dict(length_normalize=length_normalize)

    def padded():
        q, d = base_q.clone().requires_grad_(), base_d.clone().requires_grad_()
        return (q, d), (q, d)

    def listed():
        q, d = base_q.clone().requires_grad_(), base_d.clone().requires_grad_()
        return (q, d), ([q[i, : 3 + i] for i in range(4)], [d[i, :n] for i, n in enumerate(lengths)])

    def loss_shaped():
        q, d = base_q.clone().requires_grad_(), stacked.clone().requires_grad_()
        return (q, d), (q, d)

    _check_grads("maxsim", padded, dict(kw, a_mask=q_mask, b_mask=d_mask))
    _check_grads("maxsim", listed, kw)
    _check_grads("maxsim_pairwise", lambda: ((lambda l: (l[0], (l[1][0], l[1][1][:4])))(listed())), kw)
    _check_grads("maxsim_pairwise", lambda: ((lambda l: (l[0], (l[1][0], l[1][1][:4])))(padded())),
                 dict(kw, a_mask=q_mask, b_mask=d_mask[:4]))
    _check_grads("colbert_scores", loss_shaped, dict(kw, queries_mask=q_mask, documents_mask=stacked_mask))
    _check_grads("colbert_kd_scores", loss_shaped, dict(kw, queries_mask=q_mask, documents_mask=stacked_mask))
    _check_grads("colbert_kd_scores", loss_shaped, kw)


# ----------------------------------------------------------------------------------------------------------
# The real Triton kernels (interpreted on the CPU in CI): tiny and few
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.interpret
def test_triton_kernels_match_sentence_transformers(gen, flash_calls):
    queries = [_random(n, 16, generator=gen) for n in (3, 4)]
    documents = [_random(n, 16, generator=gen) for n in (5, 0, 2)]
    b_mask = [torch.tensor([1, 1, 0, 1, 0]), torch.zeros(0), torch.tensor([0, 0])]
    _compare("maxsim", queries, documents, b_mask=b_mask, length_normalize=True, flash_calls=flash_calls)
    base_q, base_d = _random(2, 3, 16, generator=gen), _random(2, 2, 4, 16, generator=gen)
    d_mask = torch.tensor([[[1, 1, 0, 1], [1, 0, 0, 0]], [[0, 0, 0, 0], [1, 1, 1, 0]]])
    _check_grads("colbert_scores", lambda: (lambda q, d: ((q, d), (q, d)))(
        base_q.clone().requires_grad_(), base_d.clone().requires_grad_()), dict(documents_mask=d_mask))
