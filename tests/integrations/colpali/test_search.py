"""``flash_colpali.search``: the top k of ``processor.score`` (the unpatched library's ``score_multi_vector``)
without its score matrix, for lists of pages, padded batches with their mask, and a compressed index."""

from __future__ import annotations

import pytest
import torch

import flash_maxsim
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor
from flash_maxsim.integrations import colpali as flash_colpali

from colpali_cases import grid_values

score_multi_vector = BaseVisualRetrieverProcessor.score_multi_vector


def _ragged(generator, count, shortest, longest, dim=16):
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [grid_values((n, dim), generator) for n in lengths]


def _top(scores: torch.Tensor, k: int):
    """The library's scores ranked: descending, equal scores by lower position."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, order), order


@pytest.mark.parametrize("batch_size, k", [(1, 3), (3, 4), (128, 25)])
def test_lists_of_pages_give_the_librarys_top_k(batch_size, k, generator, monkeypatch):
    """Exact-grid data, so the library's scores and ours are equal bit for bit and equal scores are common; one
    page per chunk, so the running top k is merged across many chunks."""
    qs = _ragged(generator, 4, 2, 6)
    ps = _ragged(generator, 13, 1, 9)
    ps[7] = ps[2].clone()                        # an exact tie between two pages
    # a single-token page all of whose similarities with query 0 are negative: the library's padding counts
    qs[0][0, 0] = 1.0
    ps[0] = -qs[0][:1].clone()
    monkeypatch.setattr(flash_colpali, "_CHUNK_TOKENS", 12)
    want_scores, want_indices = _top(score_multi_vector(qs, ps, batch_size=batch_size, device="cpu"), k)
    got = flash_colpali.search(qs, ps, k, batch_size=batch_size, device="cpu")
    assert isinstance(got, flash_maxsim.SearchResult)
    assert got.scores.dtype == torch.float32 and got.indices.dtype == torch.int64
    assert got.scores.shape == (4, min(k, 13)) and got.scores.device.type == "cpu"
    assert torch.equal(got.indices, want_indices)
    assert torch.equal(got.scores, want_scores)


def test_padded_batch_with_its_mask(generator):
    """A padded batch scores every row as the library does (``masked="zero"``); with the processor's attention
    mask and ``masked="exclude"`` the padding takes no part."""
    qs = _ragged(generator, 3, 2, 5)
    pages = _ragged(generator, 9, 1, 8)
    ps = torch.nn.utils.rnn.pad_sequence(pages, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(p.shape[0], dtype=torch.bool) for p in pages],
                                           batch_first=True)
    want = _top(score_multi_vector(qs, ps, device="cpu"), 5)
    got = flash_colpali.search(qs, ps, 5, device="cpu", ps_mask=mask)
    assert torch.equal(got.indices, want[1]) and torch.equal(got.scores, want[0])
    queries = torch.nn.utils.rnn.pad_sequence(qs, batch_first=True)
    exact = flash_maxsim.reference.maxsim(queries, pages).float()
    got = flash_colpali.search(qs, ps, 5, device="cpu", ps_mask=mask, masked="exclude")
    assert torch.equal(got.indices, _top(exact, 5)[1]) and torch.equal(got.scores, _top(exact, 5)[0])
    # a list of pages, "exclude": each page on its own tokens, the same ranking
    got = flash_colpali.search(qs, pages, 5, batch_size=4, device="cpu", masked="exclude")
    assert torch.equal(got.indices, _top(exact, 5)[1])


def test_compressed_index_ranks_as_its_scores(generator):
    qs = _ragged(generator, 3, 2, 5)
    ps = _ragged(generator, 10, 1, 9)
    index = flash_maxsim.quantize(ps, dtype="int8")
    with flash_colpali.enabled():
        scores = BaseVisualRetrieverProcessor.score_multi_vector(qs, index, batch_size=4, device="cpu")
    got = flash_colpali.search(qs, index, 6, batch_size=4, device="cpu")
    want = _top(scores, 6)
    assert torch.equal(got.indices, want[1]) and torch.equal(got.scores, want[0])


def test_random_values_rank_like_the_library(generator):
    """Ordinary fp32 data: scores equal to rounding, the same pages in the same order."""
    qs = [torch.randn(n, 32, generator=generator) for n in (5, 9)]
    ps = [torch.randn(int(n), 32, generator=generator) for n in torch.randint(1, 40, (60,), generator=generator)]
    library = score_multi_vector(qs, ps, batch_size=8, device="cpu")
    got = flash_colpali.search(qs, ps, 10, batch_size=8, device="cpu")
    want = _top(library, 10)
    assert torch.equal(got.indices, want[1])
    torch.testing.assert_close(got.scores, want[0], rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument(generator):
    qs = _ragged(generator, 2, 2, 4)
    ps = _ragged(generator, 3, 1, 4)
    for k in (0, 1.5, True):
        with pytest.raises(ValueError, match="`k`"):
            flash_colpali.search(qs, ps, k, device="cpu")
    with pytest.raises(ValueError, match="`masked`"):
        flash_colpali.search(qs, ps, 2, device="cpu", masked="skip")
    with pytest.raises(ValueError, match="`ps_mask`"):
        flash_colpali.search(qs, ps, 2, device="cpu", ps_mask=torch.ones(3, 4))
    padded = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True)
    with pytest.raises(ValueError, match="`ps_mask`"):
        flash_colpali.search(qs, padded, 2, device="cpu", ps_mask=torch.ones(3, padded.shape[1] + 1))
    with pytest.raises(ValueError, match="No passages"):
        flash_colpali.search(qs, [], 2, device="cpu")
    with pytest.raises(TypeError, match=r"`ps\[1\]`"):
        flash_colpali.search(qs, [ps[0], ps[1].double()], 2, device="cpu")
