"""The drop-in scorers: sentence-transformers' ``util.similarity`` MaxSim functions and the ColBERT scoring
functions of ``multi_vector_encoder.scoring``, with their signatures and semantics, on flash_maxsim (the package
docstring states the semantics and what differs by design); and ``chunk_scores``, what the kernel repository's
layers run."""

from __future__ import annotations

import logging
from typing import List, Optional, Union

import torch
from torch import Tensor

import flash_maxsim as _flash

from .._inputs import ArrayLike, as_tensor, length_mask, shape_of
from ._sides import Side, as_embeddings, check_dims, has_weights, kernel_dtype, marks_padding, pad_items, \
    prepare_queries, read_side, result_device

logger = logging.getLogger("flash_maxsim")

#: The score of a document without any scoreable token, as sentence-transformers defines it
#: (``util.similarity._EMPTY_DOCUMENT_SCORE``): below every real score, and it survives a loss's scaling.
EMPTY_DOCUMENT_SCORE = -1e9

#: Elements of listed documents copied (packed, or padded for pairs) at a time when ``chunk_elements`` is not
#: given: sentence-transformers' default budget (about 400 MB in fp32). Nothing else grows with the corpus.
DEFAULT_CHUNK_ELEMENTS = 100_000_000


def _fused_inputs(queries: Side, documents: Side, device, where: torch.device):
    """``(Q, qmask, counts, scoring_device, dtype)`` for one fused call, or None where sentence-transformers' own
    function must score (a query mask weighting tokens; a ragged list's mask marking positions past an item)."""
    check_dims(queries, documents)
    if has_weights(queries.mask) or marks_padding(documents):
        return None
    scoring_device = torch.device(device) if device is not None else where
    dtype = kernel_dtype(queries.dtype, documents.dtype)
    Q, qmask, counts = prepare_queries(queries, scoring_device, dtype)
    return Q, qmask, counts, scoring_device, dtype


def _fallback(name: str, *args, **kwargs) -> Tensor:
    """sentence-transformers' own function, for the rare inputs the kernels cannot express exactly."""
    from sentence_transformers.util import similarity as st_similarity
    original = getattr(st_similarity, name)
    original = getattr(original, "_flash_maxsim_original", original)
    logger.debug("flash_maxsim: %s input outside the fused kernels' semantics; using sentence-transformers' own",
                 name)
    return original(*args, **kwargs)


def _finish(scores: Tensor, empty: Tensor, counts: Optional[Tensor], result_device) -> Tensor:
    scores = scores.masked_fill(empty, EMPTY_DOCUMENT_SCORE).to(result_device)
    if counts is not None:
        counts = counts.to(device=scores.device, dtype=scores.dtype)
        scores = scores / (counts.unsqueeze(1) if scores.dim() == 2 and counts.dim() == 1 else counts)
    return scores


def _score(name: str, a, b, a_mask, b_mask, chunk_elements, length_normalize, device, fused_scores) -> Tensor:
    """What :func:`maxsim` (``name`` "maxsim") and :func:`maxsim_pairwise` ("maxsim_pairwise") share: read both
    sides, hand the inputs the kernels cannot express to sentence-transformers, else score with
    ``fused_scores(documents, Q, qmask, scoring_device, dtype, chunk_elements) -> (scores, empty)`` and finish
    (empty documents, length normalisation, the result's device)."""
    pairs = name == "maxsim_pairwise"
    queries = read_side(a, a_mask, "a", "a_mask")
    documents = read_side(b, b_mask, "b", "b_mask")
    if pairs and queries.count != documents.count:
        raise ValueError(f"`a` and `b` must hold the same number of items to score as pairs, got {queries.count} "
                         f"and {documents.count}.")
    where = result_device(queries, documents)
    if queries.count == 0 or documents.count == 0:
        shape = (queries.count,) if pairs else (queries.count, documents.count)
        return torch.zeros(shape, dtype=torch.float32, device=documents.device or queries.device)
    fused = _fused_inputs(queries, documents, device, where)
    if fused is None:
        return _fallback(name, a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                         length_normalize=length_normalize, device=device)
    Q, qmask, counts, scoring_device, dtype = fused
    scores, empty = fused_scores(documents, Q, qmask, scoring_device, dtype, chunk_elements)
    return _finish(scores, empty, counts if length_normalize else None, where)


# --------------------------------------------------------------------------------------------------------------
# util.similarity
# --------------------------------------------------------------------------------------------------------------

def maxsim(a: ArrayLike, b: ArrayLike, a_mask: Optional[ArrayLike] = None, b_mask: Optional[ArrayLike] = None,
           chunk_elements: Optional[int] = None, length_normalize: bool = False,
           device: Union[str, torch.device, None] = None) -> Tensor:
    """``sentence_transformers.util.similarity.maxsim`` on flash_maxsim: ``[len(a), len(b)]`` float32 scores,
    ``sum_i max_j a_i . b_j`` over real query tokens ``i`` and scoreable document tokens ``j``.

    ``a``/``b``: ``[N, tokens, dim]`` tensors or arrays (all-zero rows are padding unless a mask is given), a
    list of ``[tokens_i, dim]`` embeddings (documents are packed, not padded), or one ``[tokens, dim]``
    embedding. ``a_mask``/``b_mask``: ``[N, tokens]`` (or a list of per-item masks), nonzero = scoreable.
    ``length_normalize`` divides by the real query-token count. ``chunk_elements`` bounds the packed copy of
    listed documents (default: 100M elements). ``device`` runs the scoring there; scores return on the
    documents' device.
    """
    return _score("maxsim", a, b, a_mask, b_mask, chunk_elements, length_normalize, device, _all_pairs_scores)


def _all_pairs_scores(documents: Side, Q, qmask, scoring_device, dtype, chunk_elements):
    """``[N, M]`` scores of every query against every document, and ``[1, M]`` which documents are empty."""
    if documents.items is not None:
        lengths = documents.lengths
        if documents.mask is not None:
            in_doc = length_mask(lengths, documents.width, documents.mask.device)
            valid = documents.mask.bool()               # no bit beyond a length (checked above)
            empty = ~valid.any(-1)
        else:
            empty = torch.tensor([n == 0 for n in lengths])
        # packed (no padding), a bounded number of tokens at a time: the packed copy is the only buffer
        parts = []
        for start, end in _token_ranges(lengths, documents.dim or 1, _budget(chunk_elements)):
            chunk = lengths[start:end]
            if sum(chunk) == 0:
                parts.append(torch.zeros(Q.shape[0], end - start, dtype=torch.float32, device=scoring_device))
                continue
            # torch.cat promotes mixed dtypes to documents.dtype, which `dtype` contains: one conversion after
            values = torch.cat(documents.items[start:end]).to(device=scoring_device, dtype=dtype)
            offsets = torch.tensor([0] + chunk, device=scoring_device).cumsum(0)
            valid_packed = None if documents.mask is None else \
                valid[start:end][in_doc[start:end]].to(scoring_device)
            packed = _flash.PackedDocuments(values, offsets, max(chunk))
            parts.append(_flash.maxsim(Q, packed, qmask, valid_packed, masked="exclude"))
        scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    else:
        D = documents.padded.to(scoring_device)
        valid = documents.mask.to(scoring_device).bool() if documents.mask is not None else D.any(-1)
        empty = ~valid.any(-1)
        scores = _all_pairs(Q, qmask, D.to(dtype), valid)
    return scores, empty.to(scoring_device)[None, :]


def maxsim_pairwise(a: ArrayLike, b: ArrayLike, a_mask: Optional[ArrayLike] = None, b_mask: Optional[ArrayLike] = None,
                    chunk_elements: Optional[int] = None, length_normalize: bool = False,
                    device: Union[str, torch.device, None] = None) -> Tensor:
    """``sentence_transformers.util.similarity.maxsim_pairwise`` on flash_maxsim: ``[N]`` float32 scores,
    MaxSim of ``a[i]`` against ``b[i]``. Same inputs and rules as :func:`maxsim`; ragged document lists are
    padded here (the fused per-pair layout is padded)."""
    return _score("maxsim_pairwise", a, b, a_mask, b_mask, chunk_elements, length_normalize, device,
                  _pair_scores)


def _pair_scores(documents: Side, Q, qmask, scoring_device, dtype, chunk_elements):
    """``[N]`` scores of each query against its own document, and ``[N]`` which documents are empty."""
    if documents.items is not None:
        # the fused per-pair layout is padded: pad a bounded number of pairs at a time, each to its own width
        lengths = documents.lengths
        scores, empty = [], []
        for start, end in _pair_ranges(lengths, Q.shape[1] + (documents.dim or 1), Q.shape[1] * Q.shape[2],
                                       _budget(chunk_elements)):
            width = max(lengths[start:end])
            D = pad_items(documents.items[start:end], width, scoring_device, dtype)
            valid = length_mask(lengths[start:end], width, scoring_device)
            if documents.mask is not None:
                valid = valid & documents.mask[start:end, :width].to(scoring_device).bool()
            scores.append(_paired(Q[start:end], qmask[start:end], D.unsqueeze(1), valid.unsqueeze(1)))
            empty.append(~valid.any(-1))
        scores, empty = torch.cat(scores), torch.cat(empty)
    else:
        D = documents.padded.to(scoring_device)
        valid = documents.mask.to(scoring_device).bool() if documents.mask is not None else D.any(-1)
        scores = _paired(Q, qmask, D.to(dtype).unsqueeze(1), valid.unsqueeze(1))
        empty = ~valid.any(-1)
    return scores[:, 0], empty


def _budget(chunk_elements) -> int:
    if chunk_elements is None:
        return DEFAULT_CHUNK_ELEMENTS
    try:
        return max(1, int(chunk_elements))       # like sentence-transformers, at least one item per chunk
    except (TypeError, ValueError) as error:
        raise TypeError(f"`chunk_elements` must be an int or None, got {chunk_elements!r}") from error


def _token_ranges(lengths: List[int], dim: int, budget: int):
    """Consecutive documents whose packed copy holds at most ``budget`` elements (at least one document)."""
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (used + n) * dim > budget:
            yield start, i
            start, used = i, 0
        used += n
    yield start, len(lengths)


def _pair_ranges(lengths: List[int], per_token: int, per_pair: int, budget: int):
    """Consecutive pairs whose padded documents plus their queries hold at most ``budget`` elements."""
    start, width = 0, 0
    for i, n in enumerate(lengths):
        wider = max(width, n)
        if i > start and (wider * per_token + per_pair) * (i - start + 1) > budget:
            yield start, i
            start, wider = i, n
        width = wider
    yield start, len(lengths)


def _all_pairs(Q: Tensor, qmask: Optional[Tensor], D: Tensor, valid: Tensor) -> Tensor:
    """Scores ``[N, M]`` of every query against every padded document (``D`` ``[M, Ld, d]``)."""
    if D.shape[1] == 0:
        return torch.zeros(Q.shape[0], D.shape[0], dtype=torch.float32, device=D.device)
    return _flash.maxsim(Q, D, qmask, valid, masked="exclude")


def _paired(Q: Tensor, qmask: Tensor, D: Tensor, valid: Tensor) -> Tensor:
    """Scores ``[N, K]`` of each query against its own K padded candidates (``D`` ``[N, K, Ld, d]``)."""
    if D.shape[2] == 0:
        return torch.zeros(D.shape[:2], dtype=torch.float32, device=D.device)
    return _flash.maxsim(Q, D, qmask, valid, masked="exclude")


def mean_maxsim(a: ArrayLike, b: ArrayLike, a_mask: Optional[ArrayLike] = None, b_mask: Optional[ArrayLike] = None,
                chunk_elements: Optional[int] = None, length_normalize: bool = True,
                device: Union[str, torch.device, None] = None) -> Tensor:
    """``sentence_transformers.util.similarity.mean_maxsim`` (MeanMaxSim) on flash_maxsim: :func:`maxsim`
    divided by each query's real token count."""
    return maxsim(a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                  length_normalize=length_normalize, device=device)


def mean_maxsim_pairwise(a: ArrayLike, b: ArrayLike, a_mask: Optional[ArrayLike] = None, b_mask: Optional[ArrayLike] = None,
                         chunk_elements: Optional[int] = None, length_normalize: bool = True,
                         device: Union[str, torch.device, None] = None) -> Tensor:
    """``sentence_transformers.util.similarity.mean_maxsim_pairwise`` on flash_maxsim."""
    return maxsim_pairwise(a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                           length_normalize=length_normalize, device=device)


# --------------------------------------------------------------------------------------------------------------
# The drop-ins: multi_vector_encoder.scoring (the losses' similarity_fct)
# --------------------------------------------------------------------------------------------------------------

def colbert_scores(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                   queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                   chunk_elements: Optional[int] = None, length_normalize: bool = False) -> Tensor:
    """``multi_vector_encoder.scoring.colbert_scores`` on flash_maxsim, in one fused call: queries
    ``[Q, q_tokens, dim]`` against stacked document groups ``[D, N, d_tokens, dim]`` -> ``[Q, D * N]``,
    query-major (the positive of query ``i`` at column ``i * N``). The default ``similarity_fct`` of
    ``MultiVectorMultipleNegativesRankingLoss`` and its cached variant."""
    queries_embeddings = as_tensor(queries_embeddings, "queries_embeddings")
    documents_embeddings = as_tensor(documents_embeddings, "documents_embeddings")
    if documents_embeddings.dim() != 4:
        raise ValueError(f"`documents_embeddings` has shape {shape_of(documents_embeddings)}; expected stacked "
                         "document groups [num_groups, group_size, tokens, dim]")
    groups, size, tokens, dim = documents_embeddings.shape
    if documents_mask is not None:
        documents_mask = as_tensor(documents_mask, "documents_mask")
        if tuple(documents_mask.shape) != (groups, size, tokens):
            raise ValueError(f"`documents_mask` has shape {shape_of(documents_mask)}; expected "
                             f"[{groups}, {size}, {tokens}] as `documents_embeddings`")
        documents_mask = documents_mask.reshape(groups * size, tokens)
    # document (g, n) becomes row g * N + n, which is exactly the column order sentence-transformers stacks
    scores = maxsim(queries_embeddings, documents_embeddings.reshape(groups * size, tokens, dim),
                    a_mask=queries_mask, b_mask=documents_mask, chunk_elements=chunk_elements,
                    length_normalize=length_normalize)
    return scores.reshape(scores.shape[0], groups * size)


def colbert_scores_pairwise(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                            queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                            chunk_elements: Optional[int] = None, length_normalize: bool = False) -> Tensor:
    """``multi_vector_encoder.scoring.colbert_scores_pairwise`` on flash_maxsim: ``[B]`` MaxSim of matched
    pairs. The default ``similarity_fct`` of ``MultiVectorMarginMSELoss``."""
    return maxsim_pairwise(queries_embeddings, documents_embeddings, a_mask=queries_mask, b_mask=documents_mask,
                           chunk_elements=chunk_elements, length_normalize=length_normalize)


def colbert_kd_scores(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                      queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                      chunk_elements: Optional[int] = None, length_normalize: bool = False) -> Tensor:
    """``multi_vector_encoder.scoring.colbert_kd_scores`` on flash_maxsim, in one fused call: each query
    ``[B, q_tokens, dim]`` against its own candidates ``[B, n_ways, d_tokens, dim]`` -> ``[B, n_ways]``. The
    default ``similarity_fct`` of ``MultiVectorDistillKLDivLoss``."""
    queries = as_embeddings(queries_embeddings, "queries_embeddings")
    documents = as_embeddings(documents_embeddings, "documents_embeddings")
    qmask_in = as_tensor(queries_mask, "queries_mask") if queries_mask is not None else None
    dmask_in = as_tensor(documents_mask, "documents_mask") if documents_mask is not None else None
    if queries.dim() != 3 or documents.dim() != 4:
        raise ValueError(f"`queries_embeddings` {shape_of(queries)} and `documents_embeddings` "
                         f"{shape_of(documents)}: expected [batch, q_tokens, dim] and [batch, n_ways, d_tokens, dim]")
    batch, ways, tokens, dim = documents.shape
    if queries.shape[0] != batch:
        raise ValueError(f"`queries_embeddings` holds {queries.shape[0]} queries but `documents_embeddings` "
                         f"{batch} candidate groups")
    if dmask_in is not None and tuple(dmask_in.shape) != (batch, ways, tokens):
        raise ValueError(f"`documents_mask` has shape {shape_of(dmask_in)}; expected [{batch}, {ways}, {tokens}]")
    query_side = read_side(queries, qmask_in, "queries_embeddings", "queries_mask")
    if batch == 0 or ways == 0 or has_weights(query_side.mask):
        # per column through maxsim_pairwise, which keeps sentence-transformers' exact result for these
        columns = [maxsim_pairwise(queries, documents[:, j], a_mask=qmask_in,
                                   b_mask=dmask_in[:, j] if dmask_in is not None else None,
                                   length_normalize=length_normalize) for j in range(ways)]
        return torch.stack(columns, dim=1) if columns else torch.zeros(batch, 0, device=documents.device)
    if queries.shape[-1] != dim:
        raise ValueError(f"`queries_embeddings` has embedding size {queries.shape[-1]} but "
                         f"`documents_embeddings` has {dim}")
    device = documents.device
    dtype = kernel_dtype(queries.dtype, documents.dtype)
    Q, qmask, counts = prepare_queries(query_side, device, dtype)
    valid = dmask_in.to(device).bool() if dmask_in is not None else documents.any(-1)
    scores = _paired(Q, qmask, documents.to(dtype), valid)
    return _finish(scores, ~valid.any(-1), counts if length_normalize else None, device)


def mean_colbert_scores(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                        queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                        chunk_elements: Optional[int] = None, length_normalize: bool = True) -> Tensor:
    """MeanMaxSim :func:`colbert_scores` (``multi_vector_encoder.scoring.mean_colbert_scores``)."""
    return colbert_scores(queries_embeddings, documents_embeddings, queries_mask=queries_mask,
                          documents_mask=documents_mask, chunk_elements=chunk_elements,
                          length_normalize=length_normalize)


def mean_colbert_scores_pairwise(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                                 queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                                 chunk_elements: Optional[int] = None, length_normalize: bool = True) -> Tensor:
    """MeanMaxSim :func:`colbert_scores_pairwise` (``multi_vector_encoder.scoring.mean_colbert_scores_pairwise``)."""
    return colbert_scores_pairwise(queries_embeddings, documents_embeddings, queries_mask=queries_mask,
                                   documents_mask=documents_mask, chunk_elements=chunk_elements,
                                   length_normalize=length_normalize)


def mean_colbert_kd_scores(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                           queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                           chunk_elements: Optional[int] = None, length_normalize: bool = True) -> Tensor:
    """MeanMaxSim :func:`colbert_kd_scores` (``multi_vector_encoder.scoring.mean_colbert_kd_scores``)."""
    return colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=queries_mask,
                             documents_mask=documents_mask, chunk_elements=chunk_elements,
                             length_normalize=length_normalize)


# --------------------------------------------------------------------------------------------------------------
# The kernel repository's layers (sentence-transformers >= 6.3, kernel_config())
# --------------------------------------------------------------------------------------------------------------

def chunk_scores(a: Tensor, b: Tensor, a_mask: Optional[Tensor], b_mask: Optional[Tensor],
                 pairs: bool = False) -> Tensor:
    """One chunk as sentence-transformers' ``_maxsim_score_documents`` (``[len(a), len(b)]``) or, with
    ``pairs``, ``_maxsim_score_pairs`` (``[len(a)]``) score it: padded ``[N, tokens, dim]`` tensors whose masks
    the caller built (a missing mask: every token counts, zero rows included), float32 scores,
    :data:`EMPTY_DOCUMENT_SCORE` for a document without a scoreable token. What the kernel repository's
    layers run. A query mask with values other than 0/1 (which weights the tokens there) goes to
    sentence-transformers' own function."""
    if has_weights(a_mask):
        from sentence_transformers.util import similarity as st_similarity

        own = st_similarity._maxsim_score_pairs if pairs else st_similarity._maxsim_score_documents
        return own(a, b, a_mask, b_mask)
    device = b.device
    dtype = kernel_dtype(a.dtype, b.dtype)
    queries_mask = a_mask.to(device).bool() if a_mask is not None else None
    valid = b_mask.to(device).bool() if b_mask is not None else \
        torch.ones(b.shape[:2], dtype=torch.bool, device=device)
    queries, documents = a.to(device=device, dtype=dtype), b.to(dtype)
    empty = ~valid.any(-1)
    if pairs:
        scores = _paired(queries, queries_mask, documents.unsqueeze(1), valid.unsqueeze(1))[:, 0]
        return _finish(scores, empty, None, device)
    return _finish(_all_pairs(queries, queries_mask, documents, valid), empty[None, :], None, device)

