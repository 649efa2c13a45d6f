"""Retrieval scoring: ``BaseVisualRetrieverProcessor.score_multi_vector``, every processor's ``score``, and
0.3.17+'s ``utils.maxsim`` dispatch, patched against the unpatched library."""

from __future__ import annotations

import copy

import pytest
import torch

import colpali_engine.models as models
import flash_maxsim
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor
from flash_maxsim.integrations import colpali as flash_colpali

from colpali_cases import grid_values, relative_error

score_multi_vector = BaseVisualRetrieverProcessor.score_multi_vector


def _ragged(generator, count, shortest, longest, dim=16, values=grid_values):
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [values((n, dim), generator) for n in lengths]


def _library_and_patched(qs, ps, calls=None, **kwargs):
    want = score_multi_vector(qs, ps, device="cpu", **kwargs)
    if calls is not None:
        assert calls.flash == 0 and calls.library_einsum > 0
        calls.reset()
    with flash_colpali.enabled():
        got = BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cpu", **kwargs)
    return want, got


@pytest.mark.parametrize("batch_size", [1, 2, 3, 128])
def test_ragged_lists_match_the_library_exactly(batch_size, generator, calls):
    """Exact-grid data: every similarity and score is exact in fp32, so the library and the patched scoring
    (packed, one zero token on exactly the documents the library pads) must agree bit for bit. Documents as
    short as one token make all-negative similarities common, where the library's padding changes the score."""
    qs = _ragged(generator, 5, 2, 6)
    ps = _ragged(generator, 11, 1, 12)
    # one such case for certain (the check below must not hinge on the draw): document 0 is a single token
    # whose similarity with query 0's first token is -|q|^2 < 0, and document 1, in its batch, is longer
    qs[0][0, 0] = 1.0
    ps[0] = -qs[0][:1].clone()
    if ps[1].shape[0] < 2:
        ps[1] = grid_values((2, ps[1].shape[1]), generator)
    want, got = _library_and_patched(qs, ps, calls, batch_size=batch_size)
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == (5, 11)
    assert torch.equal(got, want)
    assert calls.flash >= 1 and calls.library_einsum == 0
    # not vacuous: without the padding the library adds, some scores differ
    unpadded = flash_maxsim.reference.maxsim(torch.nn.utils.rnn.pad_sequence(qs, batch_first=True), ps).float()
    if batch_size == 1:
        assert torch.equal(want, unpadded)           # batches of one document: the library pads nothing
    else:
        assert not torch.equal(want, unpadded)


def test_only_documents_the_library_pads_get_the_zero_token(generator):
    """All similarities negative: a document shorter than its batch's longest scores 0 per query token (the
    library's padding wins the max), the longest of each batch keeps its negative score."""
    qs = [-torch.rand(n, 8, generator=generator) - 0.1 for n in (2, 4)]
    ps = [torch.rand(n, 8, generator=generator) + 0.1 for n in (3, 5, 5, 2, 4)]   # batches (3, 5) (5, 2) (4)
    want, got = _library_and_patched(qs, ps, batch_size=2)
    assert relative_error(got, want) <= 1e-6
    assert (got[:, [0, 3]] == 0).all()
    assert (got[:, [1, 2, 4]] < 0).all()


def test_gaussian_lists_within_fp32_rounding(generator):
    values = lambda shape, g: torch.randn(*shape, generator=g)  # noqa: E731
    qs = _ragged(generator, 4, 3, 9, dim=32, values=values)
    ps = _ragged(generator, 20, 1, 40, dim=32, values=values)
    want, got = _library_and_patched(qs, ps, batch_size=6)
    assert relative_error(got, want) <= 1e-6


def test_padded_tensors(generator):
    """Tensors ``[n, max_length, dim]`` (already zero-padded) are scored as they are."""
    qs = grid_values((3, 6, 16), generator)
    qs[1, 4:] = 0
    ps = grid_values((7, 10, 16), generator)
    ps[2, 3:] = 0
    ps[5, 1:] = 0
    want, got = _library_and_patched(qs, ps, batch_size=4)
    assert torch.equal(got, want)


def test_many_chunks(generator, monkeypatch, calls):
    """A large pool is scored chunk by chunk (bounded memory, no batch_size tuning); the chunking is invisible."""
    monkeypatch.setattr(flash_colpali, "_CHUNK_TOKENS", 13)
    qs = _ragged(generator, 3, 2, 6)
    ps = _ragged(generator, 17, 1, 9)
    want, got = _library_and_patched(qs, ps, calls, batch_size=5)
    assert torch.equal(got, want)
    # chunks hold at most 13 tokens, so there are at least ceil(total / 13) of them (2 or more: total >= 17)
    assert calls.flash >= -(-sum(len(p) for p in ps) // 13) and calls.library_einsum == 0


def test_bf16_accumulates_in_fp32(generator):
    """bf16 embeddings: the library sums in bf16, the patched scoring in fp32 (grid values are exact in bf16, so
    the fp32 library on the same values is the exact answer)."""
    qs = [x.bfloat16() for x in _ragged(generator, 4, 2, 6)]
    ps = [x.bfloat16() for x in _ragged(generator, 9, 1, 12)]
    exact = score_multi_vector([x.float() for x in qs], [x.float() for x in ps], batch_size=4, device="cpu")
    library = score_multi_vector(qs, ps, batch_size=4, device="cpu")
    with flash_colpali.enabled():
        got = BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, batch_size=4, device="cpu")
    assert torch.equal(got, exact)
    # the library rounds each similarity to bf16 (relative u = 2^-8) and sums the maxima in bf16: each score is
    # off by at most (Lq + 1) u sum_i |max_i|, a bound on both the rounded maxima and the Lq rounded partial sums
    u = 2.0 ** -8
    maxima = [[(q.double() @ p.double().T).amax(1).abs().sum().item() for p in ps] for q in qs]
    bound = torch.tensor([[(len(q) + 1) * u * m for m in row] for q, row in zip(qs, maxima)], dtype=torch.float64)
    assert ((library.double() - exact.double()).abs() <= bound).all()


def test_scores_keep_gradients(generator):
    qs = [x.requires_grad_() for x in _ragged(generator, 2, 2, 5, values=lambda s, g: torch.randn(*s, generator=g))]
    ps = [x.requires_grad_() for x in _ragged(generator, 5, 1, 8, values=lambda s, g: torch.randn(*s, generator=g))]
    weights = torch.randn(2, 5, generator=generator)
    (score_multi_vector(qs, ps, batch_size=5, device="cpu") * weights).sum().backward()
    want = [x.grad.clone() for x in qs + ps]
    for x in qs + ps:
        x.grad = None
    with flash_colpali.enabled():
        (BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, batch_size=5, device="cpu") * weights).sum().backward()
    for g, w in zip([x.grad for x in qs + ps], want):
        assert relative_error(g, w) <= 1e-5


def test_every_processor_scores_through_flash(generator, calls):
    qs = _ragged(generator, 3, 2, 6)
    ps = _ragged(generator, 6, 1, 10)
    names = [n for n in dir(models) if n.startswith("Col") and n.endswith(("Processor", "Processor3"))]
    assert len(names) >= 3
    for name in names:
        cls = getattr(models, name)
        processor = cls.__new__(cls)     # no weights or tokenizer needed: score() only calls score_multi_vector
        want = processor.score(qs, ps, device="cpu")
        want_batch_4 = processor.score(qs, ps, device="cpu", batch_size=4)
        calls.reset()
        with flash_colpali.enabled():
            got = processor.score(qs, ps, device="cpu")
            got_batch_4 = processor.score(qs, ps, device="cpu", batch_size=4)
        assert torch.equal(got, want) and torch.equal(got_batch_4, want_batch_4), name
        assert calls.flash == 2 and calls.library_einsum == 0, name


def test_bad_inputs_name_the_argument(generator):
    qs = _ragged(generator, 2, 2, 4)
    ps = _ragged(generator, 3, 1, 5)
    with flash_colpali.enabled():
        with pytest.raises(ValueError, match="No queries provided"):
            BaseVisualRetrieverProcessor.score_multi_vector([], ps, device="cpu")
        with pytest.raises(ValueError, match="No passages provided"):
            BaseVisualRetrieverProcessor.score_multi_vector(qs, [], device="cpu")
        with pytest.raises(ValueError, match="batch_size"):
            BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, batch_size=0, device="cpu")
        with pytest.raises(ValueError, match=r"ps\[1\]"):
            BaseVisualRetrieverProcessor.score_multi_vector(qs, [ps[0], ps[1][0]], device="cpu")
        with pytest.raises(TypeError, match=r"`ps\[0\]` has dtype"):
            BaseVisualRetrieverProcessor.score_multi_vector(qs, [p.double() for p in ps], device="cpu")
        with pytest.raises(ValueError, match=r"`ps\[0\]` has embedding dim"):
            BaseVisualRetrieverProcessor.score_multi_vector(qs, [p[:, :8] for p in ps], device="cpu")


def test_dispatch_functions(generator, has_dispatch, calls, monkeypatch):
    """0.3.17+: ``maxsim_inbatch`` / ``maxsim_kd`` and every name they were imported under route through
    flash_maxsim, whatever COLPALI_SCORES_BACKEND says (enable() is the user's choice of backend)."""
    if not has_dispatch:
        pytest.skip("this colpali-engine has no utils.maxsim dispatch (before 0.3.17)")
    from colpali_engine.loss import late_interaction_losses
    from colpali_engine.utils import maxsim as dispatch
    from colpali_engine.utils import processing_utils

    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
    q = grid_values((3, 5, 16), generator)
    q[0, 3:] = 0
    d = grid_values((4, 7, 16), generator)
    d[1, 2:] = 0
    kd = grid_values((3, 2, 6, 16), generator)
    kd[2, 1, 4:] = 0
    want_inbatch, want_kd = dispatch.maxsim_inbatch(q, d), dispatch.maxsim_kd(q, kd)
    assert calls.flash == 0
    with flash_colpali.enabled():
        for module in (dispatch, late_interaction_losses, processing_utils):
            assert module.maxsim_inbatch is flash_colpali._maxsim_inbatch
        assert late_interaction_losses.maxsim_kd is flash_colpali._maxsim_kd
        got_inbatch, got_kd = dispatch.maxsim_inbatch(q, d), dispatch.maxsim_kd(q, kd)
    assert torch.equal(got_inbatch, want_inbatch) and torch.equal(got_kd, want_kd)
    assert calls.flash == 2 and calls.library_einsum == 2     # the two library reference calls above


@pytest.mark.parametrize("layout", ["list", "padded"])
@pytest.mark.parametrize("batch_size", [2, 128])
def test_quantized_passages_score_as_the_library_on_the_dequantized_ones(layout, batch_size, generator, calls,
                                                                          monkeypatch):
    """A compressed index: ``score_multi_vector(qs, flash_maxsim.quantize(ps))`` after enable() gives
    the library's scores on the dequantised passages and the queries as an int8 index scores them (quantised per
    token: docs/semantics.md), the library's per-batch zero padding included (a zero token with scale 0 in the
    packed index), chunk boundaries included."""
    from flash_maxsim.quantization import queries_as_scored
    monkeypatch.setattr(flash_colpali, "_CHUNK_TOKENS", 12)        # several chunks: 13 passages hold >= 13 tokens
    qs = [torch.randn(n, 16, generator=generator) for n in (3, 5, 4)]
    ps = [torch.randn(n, 16, generator=generator) for n in torch.randint(1, 12, (13,), generator=generator).tolist()]
    if layout == "padded":
        ps = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True)
    index = flash_maxsim.quantize(ps, dtype="int8")
    dequantized = index.dequantize(torch.float32)
    if layout == "list":
        values, offsets, _ = dequantized
        dequantized = [values[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    want = score_multi_vector([queries_as_scored(q, index) for q in qs], dequantized, device="cpu",
                              batch_size=batch_size)
    calls.reset()
    with flash_colpali.enabled():
        got = BaseVisualRetrieverProcessor.score_multi_vector(qs, index, device="cpu", batch_size=batch_size)
    assert calls.flash >= 2 and calls.library_einsum == 0
    assert got.shape == (3, 13) and got.dtype == torch.float32
    assert relative_error(got, want) <= 1e-6
    # not vacuous: the index is not the original passages (int8 rounding moves the scores)
    original = score_multi_vector(qs, ps, device="cpu", batch_size=batch_size)
    assert not torch.equal(original, want)


def test_quantized_passages_with_another_dim_name_the_argument(generator):
    qs = [torch.randn(3, 16, generator=generator)]
    index = flash_maxsim.quantize([torch.randn(4, 8, generator=generator)])
    with flash_colpali.enabled(), pytest.raises(ValueError, match="quantized `ps`.*dim 8"):
        BaseVisualRetrieverProcessor.score_multi_vector(qs, index, device="cpu")


@pytest.mark.parametrize("offsets, message", [([0, 3, 200], "end at 200 but the index holds 8"),
                                              ([0, 5, 3, 8], "decrease at document 1"),
                                              ([2, 3, 8], "start at 0")])
def test_a_quantized_index_with_inconsistent_offsets_is_refused_before_scoring(generator, calls, offsets, message):
    qs = [torch.randn(3, 16, generator=generator)]
    index = copy.copy(flash_maxsim.quantize([torch.randn(n, 16, generator=generator) for n in (3, 5)]))
    index.offsets = torch.tensor(offsets)
    with flash_colpali.enabled(), pytest.raises(ValueError, match=f"`ps` offsets .*{message}"):
        BaseVisualRetrieverProcessor.score_multi_vector(qs, index, device="cpu")
    assert calls.flash == 0
