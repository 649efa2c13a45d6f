"""sentence-transformers (>= 6.0) integration: ``MultiVectorEncoder`` MaxSim through flash_maxsim.

Three ways to use it:

- ``enable()`` (and ``disable()``, ``is_enabled()``, ``enabled()``): unchanged sentence-transformers code then
  scores with flash_maxsim: ``util.similarity.maxsim`` / ``maxsim_pairwise`` / ``mean_maxsim`` /
  ``mean_maxsim_pairwise`` and every module that imported them by name, the ColBERT scoring functions of
  ``multi_vector_encoder.scoring`` (the default ``similarity_fct`` of the four multi-vector losses up to 6.2),
  ``MultiVectorEncoder.similarity`` / ``similarity_pairwise`` (from 6.3 also when the model was built with
  ``use_kernels``: its MaxSim scorer is replaced, its other kernels are not), the private helpers through which
  6.3's losses score with the model's similarity by default (fused into one call), and through all of these
  the evaluators.
- ``kernel_config()`` (sentence-transformers >= 6.3): ``MultiVectorEncoder(..., kernel_config=kernel_config())``
  scores that model's MaxSim with flash_maxsim through sentence-transformers' own kernel mechanism, nothing
  patched (the layers are a local ``kernels`` repository in this package, ``st_kernel_repo``);
- the drop-in callables of this module, with sentence-transformers' signatures, e.g.
  ``MultiVectorMultipleNegativesRankingLoss(model, similarity_fct=colbert_scores)``: they always score with
  flash_maxsim, enabled or not.

Semantics are sentence-transformers' own (``util/similarity.py`` of 6.0.x, 6.2.0 and 6.3.0), not PyLate's:

- masked document tokens take no part in the max (``masked="exclude"``); a document with no scoreable token
  (all masked, zero tokens, or every row zero in a padded tensor without a mask) scores
  :data:`EMPTY_DOCUMENT_SCORE` (-1e9) before any length normalisation;
- a masked query token contributes 0; without a mask, padded tensors treat all-zero token rows as padding on
  both sides, and ragged lists use their lengths;
- ``length_normalize`` (MeanMaxSim) divides by the real query-token count (at least 1);
- scores are float32 and come back on the documents' device (the queries' for numpy documents); ``device``
  only chooses where the scoring runs;
- numpy arrays, a single ``[tokens, dim]`` embedding (a batch of one) and ragged lists are accepted.

What differs, by design: ragged document lists are packed (no padding) for all-pairs scoring, and nothing of
size queries x documents x tokens is ever built; ``chunk_elements`` only bounds the copy made of listed
documents (packed, or padded per chunk for pairs), padded tensors are scored in place; fp16/bf16 similarities
are computed in fp32 (sentence-transformers rounds each similarity to the input dtype before the max); float64
inputs are scored in float32 and return float32 (sentence-transformers documents float32 but returns float64
for them). Two rare inputs the fused kernels cannot express
are handed to sentence-transformers' own function, so the result stays exact: a query mask with values other
than 0/1 (sentence-transformers weights the query tokens by it), and a document mask that marks positions
beyond a listed document's own length (sentence-transformers then scores its zero padding there).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch
from torch import Tensor

import flash_maxsim as _flash
from ._patches import Integration, PatchSet

try:  # numpy comes with sentence-transformers; the drop-ins only need it to recognise arrays
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

logger = logging.getLogger("flash_maxsim")

__all__ = [
    "enable", "disable", "is_enabled", "enabled",
    "maxsim", "maxsim_pairwise", "mean_maxsim", "mean_maxsim_pairwise",
    "colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores",
    "mean_colbert_scores", "mean_colbert_scores_pairwise", "mean_colbert_kd_scores",
    "EMPTY_DOCUMENT_SCORE",
]

#: The score of a document without any scoreable token, as sentence-transformers defines it
#: (``util.similarity._EMPTY_DOCUMENT_SCORE``): below every real score, and it survives a loss's scaling.
EMPTY_DOCUMENT_SCORE = -1e9

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Elements of listed documents copied (packed, or padded for pairs) at a time when ``chunk_elements`` is not
#: given: sentence-transformers' default budget (about 400 MB in fp32). Nothing else grows with the corpus.
DEFAULT_CHUNK_ELEMENTS = 100_000_000


# --------------------------------------------------------------------------------------------------------------
# Input canonicalisation (sentence-transformers' front door, reimplemented)
# --------------------------------------------------------------------------------------------------------------

def _is_ndarray(x) -> bool:
    return _np is not None and isinstance(x, _np.ndarray)


def _array_to_tensor(x) -> Tensor:
    # a view when possible (a corpus of embeddings is large); read-only or exotic arrays are copied
    if x.flags.writeable:
        try:
            return torch.from_numpy(x)
        except (TypeError, ValueError):
            pass
    return torch.tensor(_np.ascontiguousarray(x))


def _as_tensor(x, name: str) -> Tensor:
    if isinstance(x, Tensor):
        t = x
    elif _is_ndarray(x):
        t = _array_to_tensor(x)
    elif isinstance(x, (list, tuple)) and x and all(isinstance(v, Tensor) for v in x):
        t = torch.stack(list(x))
    elif isinstance(x, (list, tuple)) and x and all(_is_ndarray(v) for v in x):
        t = torch.stack([_array_to_tensor(v) for v in x])
    else:
        try:
            t = torch.tensor(x)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"`{name}` must be a tensor, a numpy array or a list of them, "
                            f"got {type(x).__name__}") from error
    if t.is_sparse:
        raise TypeError(f"`{name}` is a sparse tensor; multi-vector embeddings must be dense")
    return t


def _as_embeddings(x, name: str) -> Tensor:
    t = _as_tensor(x, name)
    # quantized (integer) embeddings score as float, as in sentence-transformers
    return t if t.is_floating_point() else t.float()


def _as_mask(mask, name: str) -> Optional[Tensor]:
    if mask is None:
        return None
    if isinstance(mask, (list, tuple)):
        if not mask:
            return torch.zeros(0, 0, dtype=torch.bool)
        items = [_as_tensor(m, f"{name}[{i}]") for i, m in enumerate(mask)]
        for i, m in enumerate(items):
            if m.dim() != 1:
                raise ValueError(f"`{name}[{i}]` has shape {list(m.shape)}; expected one [tokens] mask per item")
        return torch.nn.utils.rnn.pad_sequence(items, batch_first=True)
    if _is_ndarray(mask):
        return _array_to_tensor(mask)
    if not isinstance(mask, Tensor):
        raise TypeError(f"`{name}` must be a tensor, an ndarray, or a list of per-item masks, "
                        f"not {type(mask).__name__}")
    return mask


@dataclass
class _Side:
    """One side of a scoring call: either a ragged list (``items``) or a padded ``[N, L, d]`` tensor."""

    name: str
    mask_name: str
    items: Optional[List[Tensor]]
    padded: Optional[Tensor]
    mask: Optional[Tensor]          # the caller's mask, [N, width], any dtype; None when not given
    device: Optional[torch.device]  # where the caller's tensors live; None for numpy input

    lengths_: Optional[List[int]] = None      # computed once: a 20k-item list makes every pass count
    dtype_: Optional[torch.dtype] = None

    @property
    def count(self) -> int:
        return len(self.items) if self.items is not None else self.padded.shape[0]

    @property
    def lengths(self) -> List[int]:
        if self.lengths_ is None:
            self.lengths_ = [int(x.shape[0]) for x in self.items]
        return self.lengths_

    @property
    def width(self) -> int:
        if self.items is not None:
            return max(self.lengths, default=0)
        return self.padded.shape[1]

    @property
    def dim(self) -> Optional[int]:
        if self.items is not None:
            return next((int(x.shape[1]) for x in self.items if x.dim() == 2), None)
        return self.padded.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        if self.items is None:
            return self.padded.dtype
        if self.dtype_ is None:
            self.dtype_ = functools.reduce(torch.promote_types, {x.dtype for x in self.items})
        return self.dtype_


def _side(embeddings, mask, name: str, mask_name: str) -> _Side:
    mask = _as_mask(mask, mask_name)
    if isinstance(embeddings, (list, tuple)):
        device = embeddings[0].device if embeddings and isinstance(embeddings[0], Tensor) else None
        # the common case in one pass (dense floating [tokens, dim] tensors of one dim); else item by item
        try:
            kinds = {(x.dim(), x.is_floating_point(), x.layout, x.shape[-1]) for x in embeddings}
        except (AttributeError, IndexError):
            kinds = None
        if kinds is not None and len(kinds) == 1 and next(iter(kinds))[:3] == (2, True, torch.strided):
            items = list(embeddings)
        else:
            items = [_as_embeddings(x, f"{name}[{i}]") for i, x in enumerate(embeddings)]
            dims = {int(x.shape[1]) for x in items if x.dim() == 2}
            if len(dims) > 1:
                raise ValueError(f"`{name}` mixes embedding sizes {sorted(dims)}; every item must be "
                                 "[tokens, dim] with one dim")
            dim = next(iter(dims), 1)
            for i, x in enumerate(items):
                if x.dim() == 1 and x.numel() == 0:      # an empty item written as [] has no dim of its own
                    items[i] = x.new_zeros(0, dim)
                elif x.dim() != 2:
                    raise ValueError(f"`{name}[{i}]` has shape {list(x.shape)}; expected [tokens, dim]")
        side = _Side(name, mask_name, items, None, mask, device)
    else:
        device = embeddings.device if isinstance(embeddings, Tensor) else None
        t = _as_embeddings(embeddings, name)
        if t.dim() == 2:                              # one embedding, scored as a batch of one
            t = t.unsqueeze(0)
            if mask is not None and mask.dim() == 1:
                mask = mask.unsqueeze(0)
        if t.dim() != 3:
            raise ValueError(f"`{name}` has shape {list(t.shape)}; expected [batch, tokens, dim], [tokens, dim] "
                             "or a list of [tokens, dim] embeddings")
        side = _Side(name, mask_name, None, t, mask, device)
    if side.mask is not None and side.count > 0:
        side.mask = _fit_mask(side.mask, side.count, side.width, mask_name)
    return side


def _fit_mask(mask: Tensor, count: int, width: int, name: str) -> Tensor:
    if mask.dim() not in (1, 2) or mask.shape[-1] != width:
        raise ValueError(f"`{name}` has shape {list(mask.shape)}, but the padded embeddings have {width} tokens: "
                         f"expected [{count}, {width}] (or [1, {width}] / [{width}] for all items)")
    if mask.dim() == 2 and mask.shape[0] not in (1, count):
        raise ValueError(f"`{name}` has {mask.shape[0]} rows; expected {count} (one per item) or 1")
    return mask.expand(count, width).contiguous()      # one row for all items becomes one row per item


def _result_device(queries: _Side, documents: _Side) -> torch.device:
    # sentence-transformers: scores live on the documents' device; numpy documents follow the queries
    return documents.device or queries.device or torch.device("cpu")


def _common_dtype(queries: _Side, documents: _Side) -> torch.dtype:
    dtype = torch.promote_types(queries.dtype, documents.dtype)
    return dtype if dtype in _KERNEL_DTYPES else torch.float32


def _has_weights(mask: Optional[Tensor]) -> bool:
    """Whether a query mask weights tokens (values other than 0/1), which the kernels cannot express."""
    if mask is None or mask.dtype == torch.bool:
        return False
    return bool(((mask != 0) & (mask != 1)).any())


def _marks_padding(side: _Side) -> bool:
    """Whether the caller's mask of a ragged list marks positions beyond an item's own length."""
    if side.items is None or side.mask is None or side.width == 0:
        return False
    lengths = torch.tensor(side.lengths, device=side.mask.device)
    beyond = torch.arange(side.width, device=side.mask.device)[None, :] >= lengths[:, None]
    return bool((side.mask.bool() & beyond).any())


def _pad_items(items: List[Tensor], width: int, device, dtype) -> Tensor:
    """Stack ragged ``[L_i, d]`` items into zero-padded ``[N, width, d]`` with one scatter (no per-item copy)."""
    lengths = [int(x.shape[0]) for x in items]
    d = next(int(x.shape[1]) for x in items)
    if all(n == width for n in lengths):
        return torch.stack([x.to(device=device, dtype=dtype) for x in items])
    flat = torch.cat([x.to(dtype) for x in items]).to(device)
    counts = torch.tensor(lengths, device=device)
    starts = torch.cumsum(counts, 0) - counts
    rows = torch.repeat_interleave(torch.arange(len(items), device=device), counts, output_size=flat.shape[0])
    positions = torch.arange(flat.shape[0], device=device) - starts[rows]
    padded = flat.new_zeros(len(items) * width, d)
    return padded.index_copy(0, rows * width + positions, flat).view(len(items), width, d)


def _length_mask(lengths: List[int], width: int, device) -> Tensor:
    return torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def _prepare_queries(side: _Side, device, dtype):
    """Padded queries ``[N, Lq, d]``, the scoring mask (bool), and the real token counts for MeanMaxSim."""
    if side.items is not None:
        width = side.width
        queries = _pad_items(side.items, width, device, dtype)
        if side.mask is not None:
            # zero padding rows the caller's mask marks score exactly 0 here as in sentence-transformers
            mask = side.mask.to(device).bool()
        else:
            mask = _length_mask(side.lengths, width, device)
    else:
        queries = side.padded.to(device)
        mask = side.mask.to(device).bool() if side.mask is not None else queries.any(-1)
        queries = queries.to(dtype)
    if side.mask is None and side.items is not None:
        counts = torch.tensor(side.lengths, device=device).clamp(min=1)
    else:
        counts = mask.sum(-1).clamp(min=1)
    return queries, mask, counts


def _fused_inputs(queries: _Side, documents: _Side, device, result_device):
    """``(Q, qmask, counts, scoring_device, dtype)`` for one fused call, or None where sentence-transformers' own
    function must score (a query mask weighting tokens; a ragged list's mask marking positions past an item)."""
    _check_dims(queries, documents)
    if _has_weights(queries.mask) or _marks_padding(documents):
        return None
    scoring_device = torch.device(device) if device is not None else result_device
    dtype = _common_dtype(queries, documents)
    Q, qmask, counts = _prepare_queries(queries, scoring_device, dtype)
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


# --------------------------------------------------------------------------------------------------------------
# The drop-ins: util.similarity
# --------------------------------------------------------------------------------------------------------------

def maxsim(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=False, device=None) -> Tensor:
    """``sentence_transformers.util.similarity.maxsim`` on flash_maxsim: ``[len(a), len(b)]`` float32 scores,
    ``sum_i max_j a_i . b_j`` over real query tokens ``i`` and scoreable document tokens ``j``.

    ``a``/``b``: ``[N, tokens, dim]`` tensors or arrays (all-zero rows are padding unless a mask is given), a
    list of ``[tokens_i, dim]`` embeddings (documents are packed, not padded), or one ``[tokens, dim]``
    embedding. ``a_mask``/``b_mask``: ``[N, tokens]`` (or a list of per-item masks), nonzero = scoreable.
    ``length_normalize`` divides by the real query-token count. ``chunk_elements`` bounds the packed copy of
    listed documents (default: 100M elements). ``device`` runs the scoring there; scores return on the
    documents' device.
    """
    queries = _side(a, a_mask, "a", "a_mask")
    documents = _side(b, b_mask, "b", "b_mask")
    result_device = _result_device(queries, documents)
    if queries.count == 0 or documents.count == 0:
        return torch.zeros(queries.count, documents.count, dtype=torch.float32,
                           device=documents.device or queries.device)
    fused = _fused_inputs(queries, documents, device, result_device)
    if fused is None:
        return _fallback("maxsim", a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                         length_normalize=length_normalize, device=device)
    Q, qmask, counts, scoring_device, dtype = fused

    if documents.items is not None:
        lengths = documents.lengths
        if documents.mask is not None:
            in_doc = _length_mask(lengths, documents.width, documents.mask.device)
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
    return _finish(scores, empty.to(scoring_device)[None, :], counts if length_normalize else None, result_device)


def maxsim_pairwise(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=False,
                    device=None) -> Tensor:
    """``sentence_transformers.util.similarity.maxsim_pairwise`` on flash_maxsim: ``[N]`` float32 scores,
    MaxSim of ``a[i]`` against ``b[i]``. Same inputs and rules as :func:`maxsim`; ragged document lists are
    padded here (the fused per-pair layout is padded)."""
    queries = _side(a, a_mask, "a", "a_mask")
    documents = _side(b, b_mask, "b", "b_mask")
    if queries.count != documents.count:
        raise ValueError(f"`a` and `b` must hold the same number of items to score as pairs, got {queries.count} "
                         f"and {documents.count}.")
    result_device = _result_device(queries, documents)
    if queries.count == 0:
        return torch.zeros(0, dtype=torch.float32, device=documents.device or queries.device)
    fused = _fused_inputs(queries, documents, device, result_device)
    if fused is None:
        return _fallback("maxsim_pairwise", a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                         length_normalize=length_normalize, device=device)
    Q, qmask, counts, scoring_device, dtype = fused
    if documents.items is not None:
        # the fused per-pair layout is padded: pad a bounded number of pairs at a time, each to its own width
        lengths = documents.lengths
        scores, empty = [], []
        for start, end in _pair_ranges(lengths, Q.shape[1] + (documents.dim or 1), Q.shape[1] * Q.shape[2],
                                       _budget(chunk_elements)):
            width = max(lengths[start:end])
            D = _pad_items(documents.items[start:end], width, scoring_device, dtype)
            valid = _length_mask(lengths[start:end], width, scoring_device)
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
    return _finish(scores[:, 0], empty, counts if length_normalize else None, result_device)


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


def _check_dims(queries: _Side, documents: _Side) -> None:
    dq, dd = queries.dim, documents.dim
    if dq is not None and dd is not None and dq != dd:
        raise ValueError(f"`{queries.name}` has embedding size {dq} but `{documents.name}` has {dd}")


def mean_maxsim(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=True, device=None) -> Tensor:
    """``sentence_transformers.util.similarity.mean_maxsim`` (MeanMaxSim) on flash_maxsim: :func:`maxsim`
    divided by each query's real token count."""
    return maxsim(a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                  length_normalize=length_normalize, device=device)


def mean_maxsim_pairwise(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=True,
                         device=None) -> Tensor:
    """``sentence_transformers.util.similarity.mean_maxsim_pairwise`` on flash_maxsim."""
    return maxsim_pairwise(a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                           length_normalize=length_normalize, device=device)


# --------------------------------------------------------------------------------------------------------------
# The drop-ins: multi_vector_encoder.scoring (the losses' similarity_fct)
# --------------------------------------------------------------------------------------------------------------

def colbert_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                   chunk_elements=None, length_normalize=False) -> Tensor:
    """``multi_vector_encoder.scoring.colbert_scores`` on flash_maxsim, in one fused call: queries
    ``[Q, q_tokens, dim]`` against stacked document groups ``[D, N, d_tokens, dim]`` -> ``[Q, D * N]``,
    query-major (the positive of query ``i`` at column ``i * N``). The default ``similarity_fct`` of
    ``MultiVectorMultipleNegativesRankingLoss`` and its cached variant."""
    queries_embeddings = _as_tensor(queries_embeddings, "queries_embeddings")
    documents_embeddings = _as_tensor(documents_embeddings, "documents_embeddings")
    if documents_embeddings.dim() != 4:
        raise ValueError(f"`documents_embeddings` has shape {list(documents_embeddings.shape)}; expected stacked "
                         "document groups [num_groups, group_size, tokens, dim]")
    groups, size, tokens, dim = documents_embeddings.shape
    if documents_mask is not None:
        documents_mask = _as_tensor(documents_mask, "documents_mask")
        if tuple(documents_mask.shape) != (groups, size, tokens):
            raise ValueError(f"`documents_mask` has shape {list(documents_mask.shape)}; expected "
                             f"[{groups}, {size}, {tokens}] as `documents_embeddings`")
        documents_mask = documents_mask.reshape(groups * size, tokens)
    # document (g, n) becomes row g * N + n, which is exactly the column order sentence-transformers stacks
    scores = maxsim(queries_embeddings, documents_embeddings.reshape(groups * size, tokens, dim),
                    a_mask=queries_mask, b_mask=documents_mask, chunk_elements=chunk_elements,
                    length_normalize=length_normalize)
    return scores.reshape(scores.shape[0], groups * size)


def colbert_scores_pairwise(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                            chunk_elements=None, length_normalize=False) -> Tensor:
    """``multi_vector_encoder.scoring.colbert_scores_pairwise`` on flash_maxsim: ``[B]`` MaxSim of matched
    pairs. The default ``similarity_fct`` of ``MultiVectorMarginMSELoss``."""
    return maxsim_pairwise(queries_embeddings, documents_embeddings, a_mask=queries_mask, b_mask=documents_mask,
                           chunk_elements=chunk_elements, length_normalize=length_normalize)


def colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                      chunk_elements=None, length_normalize=False) -> Tensor:
    """``multi_vector_encoder.scoring.colbert_kd_scores`` on flash_maxsim, in one fused call: each query
    ``[B, q_tokens, dim]`` against its own candidates ``[B, n_ways, d_tokens, dim]`` -> ``[B, n_ways]``. The
    default ``similarity_fct`` of ``MultiVectorDistillKLDivLoss``."""
    queries = _as_embeddings(queries_embeddings, "queries_embeddings")
    documents = _as_embeddings(documents_embeddings, "documents_embeddings")
    qmask_in = _as_tensor(queries_mask, "queries_mask") if queries_mask is not None else None
    dmask_in = _as_tensor(documents_mask, "documents_mask") if documents_mask is not None else None
    if queries.dim() != 3 or documents.dim() != 4:
        raise ValueError(f"`queries_embeddings` {list(queries.shape)} and `documents_embeddings` "
                         f"{list(documents.shape)}: expected [batch, q_tokens, dim] and [batch, n_ways, d_tokens, dim]")
    batch, ways, tokens, dim = documents.shape
    if queries.shape[0] != batch:
        raise ValueError(f"`queries_embeddings` holds {queries.shape[0]} queries but `documents_embeddings` "
                         f"{batch} candidate groups")
    if dmask_in is not None and tuple(dmask_in.shape) != (batch, ways, tokens):
        raise ValueError(f"`documents_mask` has shape {list(dmask_in.shape)}; expected [{batch}, {ways}, {tokens}]")
    query_side = _side(queries, qmask_in, "queries_embeddings", "queries_mask")
    if batch == 0 or ways == 0 or _has_weights(query_side.mask):
        # per column through maxsim_pairwise, which keeps sentence-transformers' exact result for these
        columns = [maxsim_pairwise(queries, documents[:, j], a_mask=qmask_in,
                                   b_mask=dmask_in[:, j] if dmask_in is not None else None,
                                   length_normalize=length_normalize) for j in range(ways)]
        return torch.stack(columns, dim=1) if columns else torch.zeros(batch, 0, device=documents.device)
    if queries.shape[-1] != dim:
        raise ValueError(f"`queries_embeddings` has embedding size {queries.shape[-1]} but "
                         f"`documents_embeddings` has {dim}")
    device = documents.device
    dtype = torch.promote_types(queries.dtype, documents.dtype)
    dtype = dtype if dtype in _KERNEL_DTYPES else torch.float32
    Q, qmask, counts = _prepare_queries(query_side, device, dtype)
    valid = dmask_in.to(device).bool() if dmask_in is not None else documents.any(-1)
    scores = _paired(Q, qmask, documents.to(dtype), valid)
    return _finish(scores, ~valid.any(-1), counts if length_normalize else None, device)


def mean_colbert_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                        chunk_elements=None, length_normalize=True) -> Tensor:
    """MeanMaxSim :func:`colbert_scores` (``multi_vector_encoder.scoring.mean_colbert_scores``)."""
    return colbert_scores(queries_embeddings, documents_embeddings, queries_mask=queries_mask,
                          documents_mask=documents_mask, chunk_elements=chunk_elements,
                          length_normalize=length_normalize)


def mean_colbert_scores_pairwise(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                                 chunk_elements=None, length_normalize=True) -> Tensor:
    """MeanMaxSim :func:`colbert_scores_pairwise` (``multi_vector_encoder.scoring.mean_colbert_scores_pairwise``)."""
    return colbert_scores_pairwise(queries_embeddings, documents_embeddings, queries_mask=queries_mask,
                                   documents_mask=documents_mask, chunk_elements=chunk_elements,
                                   length_normalize=length_normalize)


def mean_colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                           chunk_elements=None, length_normalize=True) -> Tensor:
    """MeanMaxSim :func:`colbert_kd_scores` (``multi_vector_encoder.scoring.mean_colbert_kd_scores``)."""
    return colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=queries_mask,
                             documents_mask=documents_mask, chunk_elements=chunk_elements,
                             length_normalize=length_normalize)


# --------------------------------------------------------------------------------------------------------------
# sentence-transformers >= 6.3: a per-model kernel through its ``kernel_config`` (nothing patched)
# --------------------------------------------------------------------------------------------------------------

# a `kernels` layer repository in this package (loaded by the `kernels` package, not imported by flash_maxsim)
KERNEL_REPOSITORY = Path(__file__).with_name("st_kernel_repo")


def kernel_config():
    """A ``transformers.KernelConfig`` that makes a sentence-transformers (>= 6.3) ``MultiVectorEncoder`` score
    MaxSim with flash_maxsim, that model only, with nothing patched::

        model = MultiVectorEncoder("lightonai/GTE-ModernColBERT-v1", kernel_config=flash_st.kernel_config())

    Its ``similarity`` / ``similarity_pairwise``, the losses' default scoring and the evaluators then score with
    flash_maxsim; sentence-transformers still chunks and pads the inputs and calls it once per chunk (the
    ``enable()`` route packs ragged documents instead). The two targets are ``STMaxSim`` and
    ``STMaxSimPairwise``; the layers live in this package (a local `kernels` repository: no download). Needs
    the ``kernels`` package (``pip install "sentence-transformers[kernels]"``; transformers 5.25 installs it
    too)."""
    import sentence_transformers
    from sentence_transformers.multi_vector_encoder.scoring import colbert as st_colbert

    if not hasattr(st_colbert, "_MaxSimScorer"):
        raise ImportError(f"kernel_config() needs sentence-transformers >= 6.3 (its MaxSim kernel targets); found "
                          f"{sentence_transformers.__version__}: use enable() or the drop-ins instead")
    try:
        import kernels  # noqa: F401
    except ImportError as error:
        raise ImportError('kernel_config() needs the `kernels` package: pip install "sentence-transformers[kernels]"'
                          ) from error
    from transformers import KernelConfig

    if not (KERNEL_REPOSITORY / "torch-universal" / "metadata.json").is_file():
        # `kernels` would fall back to sentence-transformers' own MaxSim without a word
        raise FileNotFoundError(f"flash_maxsim's kernel repository is missing from this install: "
                                f"{KERNEL_REPOSITORY}")
    return KernelConfig(kernel_mapping={"STMaxSim": f"{KERNEL_REPOSITORY}:MaxSim",
                                        "STMaxSimPairwise": f"{KERNEL_REPOSITORY}:MaxSimPairwise"},
                        use_local_kernel=True)


def chunk_scores(a: Tensor, b: Tensor, a_mask: Optional[Tensor], b_mask: Optional[Tensor],
                 pairs: bool = False) -> Tensor:
    """One chunk as sentence-transformers' ``_maxsim_score_documents`` (``[len(a), len(b)]``) or, with
    ``pairs``, ``_maxsim_score_pairs`` (``[len(a)]``) score it: padded ``[N, tokens, dim]`` tensors whose masks
    the caller built (a missing mask: every token counts, zero rows included), float32 scores,
    :data:`EMPTY_DOCUMENT_SCORE` for a document without a scoreable token. What the kernel repository's
    layers run. A query mask with values other than 0/1 (which weights the tokens there) goes to
    sentence-transformers' own function."""
    if _has_weights(a_mask):
        from sentence_transformers.util import similarity as st_similarity

        own = st_similarity._maxsim_score_pairs if pairs else st_similarity._maxsim_score_documents
        return own(a, b, a_mask, b_mask)
    device = b.device
    dtype = torch.promote_types(a.dtype, b.dtype)
    dtype = dtype if dtype in _KERNEL_DTYPES else torch.float32
    queries_mask = a_mask.to(device).bool() if a_mask is not None else None
    valid = b_mask.to(device).bool() if b_mask is not None else \
        torch.ones(b.shape[:2], dtype=torch.bool, device=device)
    queries, documents = a.to(device=device, dtype=dtype), b.to(dtype)
    empty = ~valid.any(-1)
    if pairs:
        scores = _paired(queries, queries_mask, documents.unsqueeze(1), valid.unsqueeze(1))[:, 0]
        return _finish(scores, empty, None, device)
    return _finish(_all_pairs(queries, queries_mask, documents, valid), empty[None, :], None, device)


# --------------------------------------------------------------------------------------------------------------
# enable() / disable()
# --------------------------------------------------------------------------------------------------------------

# (module, name) of every sentence-transformers function replaced, and its flash_maxsim counterpart
_ROUTES = (
    ("sentence_transformers.util.similarity", "maxsim", maxsim),
    ("sentence_transformers.util.similarity", "maxsim_pairwise", maxsim_pairwise),
    ("sentence_transformers.util.similarity", "mean_maxsim", mean_maxsim),
    ("sentence_transformers.util.similarity", "mean_maxsim_pairwise", mean_maxsim_pairwise),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "colbert_scores", colbert_scores),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "colbert_scores_pairwise", colbert_scores_pairwise),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "colbert_kd_scores", colbert_kd_scores),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "mean_colbert_scores", mean_colbert_scores),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "mean_colbert_scores_pairwise",
     mean_colbert_scores_pairwise),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "mean_colbert_kd_scores", mean_colbert_kd_scores),
)

# sentence-transformers >= 6.3: with ``similarity_fct=None`` (their default) the losses hand the model's
# ``similarity`` / ``similarity_pairwise`` to these private helpers, which call it once per candidate column;
# while enabled they score in one fused call instead, when that scorer is one flash_maxsim replaces.
# (helper name, flash_maxsim counterpart, the kind of scorer it takes)
_HELPER_ROUTES = (
    ("_colbert_scores", colbert_scores, "all-pairs"),
    ("_colbert_scores_pairwise", colbert_scores_pairwise, "pairwise"),
    ("_colbert_kd_scores", colbert_kd_scores, "pairwise"),
)

# sentence-transformers' scoring functions by name -> (kind, length_normalize by default)
_SCORER_KINDS = {
    "maxsim": ("all-pairs", False),
    "maxsim_pairwise": ("pairwise", False),
    "mean_maxsim": ("all-pairs", True),
    "mean_maxsim_pairwise": ("pairwise", True),
}
# MultiVectorEncoder's scoring methods -> the attribute holding the function each one calls, and its kind
_MODEL_SCORERS = {"similarity": ("_similarity", "all-pairs"),
                  "similarity_pairwise": ("_similarity_pairwise", "pairwise")}

# filled by enable(): sentence-transformers' four scoring functions -> (kind, their flash_maxsim counterpart,
# length_normalize default); the model's scoring methods (original and patched) -> their name; the class of the
# hub-kernel scorer of models built with ``use_kernels`` (6.3+)
_SCORERS: dict = {}
_MODEL_METHODS: dict = {}
_KERNEL_SCORER: list = []
_warned_kernel_scorer = False


def _routed(original: Callable, flash: Callable) -> Callable:
    """What enable() installs in place of ``original``. References that outlive disable() (a model's stored
    similarity, a loss's similarity_fct built while enabled) then fall back to the original by themselves."""

    @functools.wraps(original)
    def route(*args, **kwargs):
        if _integration.is_enabled():
            return flash(*args, **kwargs)
        return original(*args, **kwargs)

    route._flash_maxsim_original = original
    return route


def _kernel_scorer(score) -> Optional[tuple]:
    """:func:`_resolve_scorer` for a ``use_kernels`` model's MaxSim scorer or its ``pairwise``: their
    ``length_normalize=None`` (the default) means the scorer's own setting."""
    global _warned_kernel_scorer
    if not _KERNEL_SCORER:
        return None
    if isinstance(score, _KERNEL_SCORER[0]):
        kind, flash = "all-pairs", maxsim
    elif isinstance(getattr(score, "__self__", None), _KERNEL_SCORER[0]) and \
            getattr(score, "__name__", None) == "pairwise":
        kind, flash, score = "pairwise", maxsim_pairwise, score.__self__
    else:
        return None
    if not _warned_kernel_scorer:
        # the user enabled flash_maxsim explicitly: it takes over the model's MaxSim, not its other kernels
        logger.info("flash_maxsim: a MultiVectorEncoder built with use_kernels scores MaxSim with flash_maxsim "
                    "while enabled; its backbone and token-pooling kernels are unchanged")
        _warned_kernel_scorer = True
    normalize = bool(score.length_normalize)

    def call(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=None, device=None):
        return flash(a, b, a_mask, b_mask, chunk_elements, normalize if length_normalize is None else length_normalize,
                     device)

    return kind, call, normalize


def _resolve_scorer(score) -> Optional[tuple]:
    """(kind, flash_maxsim function called as ``score`` is, length_normalize default) when flash_maxsim computes
    what ``score`` computes, else None. ``score`` may be one of sentence-transformers' four scoring functions (or
    its replacement), a model's ``similarity`` / ``similarity_pairwise`` (resolved to the function the model
    holds), or a ``use_kernels`` model's scorer."""
    method = _MODEL_METHODS.get(getattr(score, "__func__", None)) if hasattr(score, "__self__") else None
    if method is not None:
        return _model_scorer(score.__self__, method)
    try:
        known = _SCORERS.get(getattr(score, "_flash_maxsim_original", score))
    except TypeError:                                        # an unhashable callable: not one of ours
        return None
    return known if known is not None else _kernel_scorer(score)


def _model_scorer(model, method_name: str) -> Optional[tuple]:
    """:func:`_resolve_scorer` for what ``model.<method_name>`` (``similarity`` / ``similarity_pairwise``) scores
    with: the function the model holds, when it is of the method's kind."""
    attribute, kind = _MODEL_SCORERS[method_name]
    model.similarity_fn_name  # noqa: B018 (resolves the scoring function on first use)
    resolved = _resolve_scorer(getattr(model, attribute))
    return resolved if resolved is not None and resolved[0] == kind else None


def _model_method(original: Callable, method_name: str) -> Callable:
    """``MultiVectorEncoder.similarity`` / ``similarity_pairwise``: a model resolves its scoring function once,
    when its ``similarity_fn_name`` is set, so models built before enable() hold the original."""

    @functools.wraps(original)
    def method(self, embeddings1, embeddings2, **kwargs):
        resolved = _model_scorer(self, method_name)
        if resolved is None:
            return original(self, embeddings1, embeddings2, **kwargs)
        return resolved[1](embeddings1, embeddings2, **kwargs)

    return method


def _routed_helper(original: Callable, flash: Callable, kind: str) -> Callable:
    """What enable() installs in place of ``_colbert_scores``-like helpers (first argument: the scorer)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def route(score, *args, **kwargs):
        resolved = _resolve_scorer(score) if _integration.is_enabled() else None
        if resolved is None or resolved[0] != kind:
            return original(score, *args, **kwargs)
        try:
            arguments = signature.bind(score, *args, **kwargs).arguments
        except TypeError:
            return original(score, *args, **kwargs)         # raises sentence-transformers' own error
        arguments.pop(next(iter(signature.parameters)))      # the scorer
        if arguments.get("length_normalize") is None:        # the helpers then leave it to the scorer
            arguments["length_normalize"] = resolved[2]
        return flash(**arguments)

    route._flash_maxsim_original = original
    return route


def _install(patches: PatchSet) -> None:
    import importlib

    import sentence_transformers

    major = int(str(sentence_transformers.__version__).split(".")[0])
    if major < 6:
        raise ImportError(f"flash_maxsim's sentence-transformers integration needs sentence-transformers >= 6.0 "
                          f"(MultiVectorEncoder); found {sentence_transformers.__version__}")
    # load every module that may hold the functions by name, so that their aliases are replaced too
    for module in ("sentence_transformers.multi_vector_encoder", "sentence_transformers.multi_vector_encoder.losses",
                   "sentence_transformers.multi_vector_encoder.evaluation"):
        importlib.import_module(module)
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
    colbert_module = importlib.import_module("sentence_transformers.multi_vector_encoder.scoring.colbert")

    _SCORERS.clear()
    _MODEL_METHODS.clear()
    _KERNEL_SCORER.clear()
    for module_name, name, flash in _ROUTES:
        original = getattr(importlib.import_module(module_name), name)
        original = getattr(original, "_flash_maxsim_original", original)
        if name in _SCORER_KINDS:
            kind, normalize = _SCORER_KINDS[name]
            _SCORERS[original] = (kind, flash, normalize)
        patches.patch_aliases(original, _routed(original, flash), ("sentence_transformers",))
    for name, flash, kind in _HELPER_ROUTES:
        original = getattr(colbert_module, name, None)
        if original is None:                                 # before 6.3
            continue
        original = getattr(original, "_flash_maxsim_original", original)
        patches.patch_aliases(original, _routed_helper(original, flash, kind), ("sentence_transformers",))
    kernel_scorer = getattr(colbert_module, "_MaxSimScorer", None)      # 6.3+
    if kernel_scorer is not None:
        _KERNEL_SCORER.append(kernel_scorer)
    for method_name in _MODEL_SCORERS:
        original = MultiVectorEncoder.__dict__[method_name]
        replacement = _model_method(original, method_name)
        _MODEL_METHODS[original] = _MODEL_METHODS[replacement] = method_name
        patches.patch(MultiVectorEncoder, method_name, replacement)


_integration = Integration("sentence-transformers", _install)
enable = _integration.enable
disable = _integration.disable
is_enabled = _integration.is_enabled
enabled = _integration.enabled
