"""kernel_config(): a MultiVectorEncoder built with ``kernel_config=flash_st.kernel_config()`` (sentence-transformers
>= 6.3 with the ``kernels`` package) scores MaxSim with flash_maxsim, that model only, nothing patched.

- ``chunk_scores`` (what the kernel repository's layers run) against sentence-transformers' own chunk functions
  on fresh random padded chunks: masks absent, boolean, 0/1 floats, weights; zero-width, fully masked and
  all-zero-row documents (zero rows count as tokens at this level); half precision against the fp32 upcast;
- the real MiniLM model built with the config: ``similarity`` / ``similarity_pairwise`` and the four losses'
  default scoring equal those of the same model built without it, and every one of them reached flash_maxsim
  (``kernels`` falls back to sentence-transformers' MaxSim without a word when a layer cannot be loaded);
- the repository's metadata records the digest of its layer file (else ``kernels`` warns on every load, or
  refuses a stale one).
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from flash_maxsim.integrations import sentence_transformers as fst

from st_cases import DOCUMENTS, LOSSES, LOSSES_SCORE_WITH_THE_MODEL, QUERIES, assert_same_loss, model_dir, \
    run_loss, train_top_only

if not LOSSES_SCORE_WITH_THE_MODEL:
    pytest.skip("kernel_config() needs sentence-transformers >= 6.3", allow_module_level=True)
pytest.importorskip("kernels")

from sentence_transformers.util import similarity as st_similarity  # noqa: E402


def _chunk(generator, n, m, lq, ld, d, dtype=torch.float32):
    a = torch.randn(n, lq, d, generator=generator).to(dtype)
    b = torch.randn(m, ld, d, generator=generator).to(dtype)
    return a, b


@pytest.mark.parametrize("pairs", [False, True], ids=["all-pairs", "pairs"])
@pytest.mark.parametrize("masks", ["none", "bool", "float01", "query-weights"])
@pytest.mark.parametrize("shape", [(3, 5, 7, 9, 16), (1, 1, 1, 1, 96), (4, 4, 33, 5, 8)],
                         ids=["small", "one-token", "odd"])
def test_chunk_scores_equal_sentence_transformers(pairs, masks, shape):
    n, m, lq, ld, d = shape
    m = n if pairs else m
    generator = torch.Generator().manual_seed(zlib.crc32(repr((pairs, masks, shape)).encode()))
    a, b = _chunk(generator, n, m, lq, ld, d)
    b[0, -1] = 0                                     # an all-zero row: a token like any other at this level
    a_mask = b_mask = None
    if masks != "none":
        a_mask = torch.rand(n, lq, generator=generator) > 0.3
        b_mask = torch.rand(m, ld, generator=generator) > 0.4
        b_mask[-1] = False                           # a document without any scoreable token
        if masks in ("float01", "query-weights"):
            a_mask, b_mask = a_mask.float(), b_mask.float()
        if masks == "query-weights":
            a_mask = a_mask * torch.rand(n, lq, generator=generator)
    own = st_similarity._maxsim_score_pairs if pairs else st_similarity._maxsim_score_documents
    want = own(a, b, a_mask, b_mask)
    got = fst.chunk_scores(a, b, a_mask, b_mask, pairs=pairs)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if b_mask is not None:
        assert (got[..., -1] if not pairs else got[-1]).eq(fst.EMPTY_DOCUMENT_SCORE).all()


@pytest.mark.parametrize("pairs", [False, True], ids=["all-pairs", "pairs"])
def test_chunk_scores_of_zero_width_documents(pairs):
    a = torch.randn(2, 3, 8)
    b = torch.zeros(2, 0, 8)
    want = (st_similarity._maxsim_score_pairs if pairs else st_similarity._maxsim_score_documents)(a, b, None, None)
    got = fst.chunk_scores(a, b, None, None, pairs=pairs)
    assert torch.equal(got, want) and got.eq(fst.EMPTY_DOCUMENT_SCORE).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_scores_in_half_precision_are_the_fp32_upcasts(dtype):
    """sentence-transformers rounds each similarity to the input dtype before the max; flash_maxsim sums in fp32,
    i.e. it returns sentence-transformers' scores of the fp32 upcast (the documented difference)."""
    generator = torch.Generator().manual_seed(7)
    a, b = _chunk(generator, 3, 4, 6, 10, 32, dtype)
    b_mask = torch.rand(4, 10, generator=generator) > 0.3
    want = st_similarity._maxsim_score_documents(a.float(), b.float(), None, b_mask)
    torch.testing.assert_close(fst.chunk_scores(a, b, None, b_mask), want, rtol=1e-5, atol=1e-5)


def test_the_repository_records_its_layer_files_digest():
    from kernels._rust import Digest, DigestAlgorithm

    variant = fst.KERNEL_REPOSITORY / "torch-universal"
    recorded = json.loads((variant / "metadata.json").read_text())["digest"]
    actual = Digest.hash_variant(DigestAlgorithm.SHA256, variant).files
    # after editing the layer file, put these values in metadata.json's "digest" -> "files"
    assert recorded == {"algorithm": "sha256", "files": actual}, actual


@pytest.fixture(scope="module")
def kernel_model():
    from sentence_transformers import MultiVectorEncoder

    torch.manual_seed(0)              # as the `model` fixture: the same random projection
    encoder = MultiVectorEncoder(model_dir(), device="cpu", kernel_config=fst.kernel_config())
    encoder.eval()
    return encoder


def test_the_model_is_the_same_network(model, kernel_model):
    reference, kernel = model.state_dict(), kernel_model.state_dict()
    assert reference.keys() == kernel.keys()
    assert all(torch.equal(reference[k], kernel[k]) for k in reference)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_similarity_equals_the_models_own(model, kernel_model, grad, flash_calls):
    queries, documents = model.encode_query(QUERIES), model.encode_document(DOCUMENTS)      # ragged lists
    padded = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
    padded_mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in documents],
                                                  batch_first=True)
    with torch.set_grad_enabled(grad):
        expected = (model.similarity(queries, documents), model.similarity_pairwise(queries, documents[:6]),
                    model.similarity(queries, padded, b_mask=padded_mask))
        assert not flash_calls
        got = (kernel_model.similarity(queries, documents), kernel_model.similarity_pairwise(queries, documents[:6]),
               kernel_model.similarity(queries, padded, b_mask=padded_mask))
    assert len(flash_calls) == 3                     # one chunk each: every call reached flash_maxsim
    for value, want in zip(got, expected):
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(LOSSES))
def test_default_losses_equal_the_models_own(model, kernel_model, name, flash_calls):
    cls, kwargs, _, _ = LOSSES[name]
    with train_top_only(model):
        expected = run_loss(model, cls(model, **kwargs), name)
    assert not flash_calls
    with train_top_only(kernel_model):
        got = run_loss(kernel_model, cls(kernel_model, **kwargs), name)
    assert flash_calls
    assert_same_loss(got, expected)


def test_kernel_config_leaves_other_models_alone(model, kernel_model, flash_calls):
    queries, documents = model.encode_query(QUERIES[:2]), model.encode_document(DOCUMENTS[:3])
    kernel_model.similarity(queries, documents)
    assert len(flash_calls) == 1
    model.similarity(queries, documents)
    assert len(flash_calls) == 1 and not fst.is_enabled()
