"""colpali-engine integration: one call routes every late-interaction loss and the processors' multi-vector
scoring through :func:`flash_maxsim.maxsim`, with the library's own semantics.

    from flash_maxsim.integrations import colpali as flash_colpali
    flash_colpali.enable()          # before trainer.train() / processor.score(...)

What ``enable()`` replaces (found by feature, colpali-engine 0.3.14 to 0.3.18; see ``SUPPORTED``):

- 0.3.17 and later (``colpali_engine.utils.maxsim`` exists): ``maxsim_inbatch`` and ``maxsim_kd`` (in that module
  and wherever they were imported by name), ``ColbertModule._inbatch_scores`` (serves ColbertLoss,
  ColbertPairwiseCELoss and ColbertSigmoidLoss, hard and smooth max), and the ``forward`` of
  ColbertNegativeCELoss and ColbertPairwiseNegativeCELoss, whose positive-pair and smooth-max MaxSim are inline
  einsums with no helper to patch.
- 0.3.14 to 0.3.16 (every loss computes its einsum inline): the ``forward`` of all five losses.
- Every version: ``BaseVisualRetrieverProcessor.score_multi_vector``, which every processor's ``score`` calls.

Semantics kept from the library:

- The losses get zero-padded tensors and no mask. flash_maxsim is called with no mask either, so a padding token
  is an ordinary token of similarity 0 (``masked="zero"``): it takes part in the hard max, and in the smooth max a
  zero-padded query token adds ``tau * log(Ld)`` exactly as the library's logsumexp over the padded length does.
- Everything around the MaxSim (length normalisation by ``query[:, :, 0] != 0``, the bound check,
  ``pos_aware_negative_filtering``, ``offset``, the in-batch term and its weight, the loss formulas) is the
  library's code path: its own helper methods are called, and the replaced forwards perform the same operations.
- Scores are float32 (products accumulate in fp32), also for bf16/fp16 embeddings, where the library's einsum
  returns (and sums in) the input dtype. Under ``torch.autocast`` both inputs are cast to the autocast dtype first,
  as autocast does for the library's einsum.
- Hard-max gradients: where several tokens tie for the max, flash_maxsim sends the gradient to the first of them,
  torch's ``amax`` splits it evenly. Ties happen in practice only on padding (a zero query token ties with every
  document token; a query token whose real similarities are all negative ties with every zero document token), and
  every colpali-engine model multiplies its output by the attention mask, so those gradients never reach the model.
- ``score_multi_vector`` scores a list of variable-length documents without padding them (packed, in chunks of at
  most ``_CHUNK_TOKENS`` tokens, so a large pool needs no ``batch_size`` tuning). The library pads each group of
  ``batch_size`` documents to the group's longest, which gives a shorter document extra similarity-0 tokens: a hard
  max then never falls below 0. One zero token appended to exactly those documents reproduces this bit for bit
  (one zero token and many give the same max), so ``batch_size`` still selects which documents those are.

``FLASH_MAXSIM_DISABLE=1`` (or ``true``/``yes``/``on``) makes ``enable()`` a no-op
(``flash_maxsim.integrations._patches`` lists the values it takes); ``disable()`` restores the original objects, also
in colpali_engine modules imported while enabled. ``enable()`` without colpali-engine raises an ImportError naming
``pip install "flash-maxsim-kernels[colpali]"``.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

import flash_maxsim

from ._inputs import check_rank, shape_of
from ._patches import Integration, PatchSet, import_toolkit
from ._quantized import document_bounds, padded_by_group, with_zero_tokens

__all__ = ["enable", "disable", "is_enabled", "enabled", "search", "SUPPORTED"]

SUPPORTED = ((0, 3, 14), (0, 3, 18))
"""Oldest and newest colpali-engine releases whose losses these replacements reproduce (parity-tested: 0.3.16 and
0.3.18; 0.3.14 to 0.3.16 ship the same loss module, 0.3.17 the same as 0.3.18). 0.3.13's ColbertSigmoidLoss has the
opposite sign, older releases other loss signatures."""

_CHUNK_TOKENS = 1 << 21
"""Document tokens packed per scoring call in ``score_multi_vector``: bounds the device memory of the packed copy
(2M tokens x 128 dims x 2 bytes = 512 MiB in bf16) whatever the pool size."""


# --- MaxSim on the library's zero-padded tensors ------------------------------------------------------------------

def _cast_like_autocast(queries: torch.Tensor, documents: torch.Tensor):
    """Under autocast the library's einsum runs in the autocast dtype; the custom op is not autocast-aware."""
    device_type = queries.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return queries.to(dtype), documents.to(dtype)
    return queries, documents


def _late_interaction(queries: torch.Tensor, documents, smooth_tau: Optional[float] = None) -> torch.Tensor:
    """MaxSim of colpali-engine's zero-padded embeddings: no masks, so padding tokens are similarity-0 tokens.

    ``documents`` ``[B, Ld, d]`` -> ``[Nq, B]``; ``[Nq, K, Ld, d]`` -> ``[Nq, K]`` (each query its own K)."""
    if isinstance(documents, flash_maxsim.PackedDocuments):
        queries, values = _cast_like_autocast(queries, documents.values)
        documents = documents._replace(values=values)
    elif isinstance(documents, torch.Tensor):
        queries, documents = _cast_like_autocast(queries, documents)
    # quantised passages: dequantised on chip; an int8 index with d <= 256 quantises the queries per token too
    # (flash_maxsim.quantization.queries_as_scored, docs/semantics.md)
    return flash_maxsim.maxsim(queries, documents, masked="zero", smooth_tau=smooth_tau)


def _smooth_tau(loss) -> Optional[float]:
    return float(loss.tau) if loss.use_smooth_max else None


def _query_lengths(query_embeddings: torch.Tensor) -> torch.Tensor:
    # the library's definition of a query's length: tokens whose first component is non-zero
    return (query_embeddings[:, :, 0] != 0).sum(dim=1)


def _inbatch_scores(self, query_embeddings: torch.Tensor, doc_embeddings: torch.Tensor) -> torch.Tensor:
    """Every query against every document, ``[B_q, B_d]``, optionally length-normalised (library helper)."""
    scores = _late_interaction(query_embeddings, doc_embeddings, _smooth_tau(self))
    if self.normalize_scores:
        scores = self._apply_normalization(scores, _query_lengths(query_embeddings))
    return scores


def _positive_and_negative_scores(self, query_embeddings, positives, neg_doc_embeddings):
    """Query ``b`` against its positive ``positives[b]`` -> ``[B]`` and its negatives -> ``[B, N]``."""
    # the library's einsum refuses anything but 4-D negatives; a 3-D tensor would otherwise read as all-pairs
    # documents
    check_rank(neg_doc_embeddings, 4, "neg_doc_embeddings", "[batch_size, num_negs, neg_doc_length, dim]")
    tau = _smooth_tau(self)
    pos_scores = _late_interaction(query_embeddings, positives.unsqueeze(1), tau)[:, 0]
    neg_scores = _late_interaction(query_embeddings, neg_doc_embeddings, tau)
    if self.normalize_scores:
        lengths = _query_lengths(query_embeddings)
        pos_scores = self._apply_normalization(pos_scores, lengths)
        neg_scores = self._apply_normalization(neg_scores, lengths)
    return pos_scores, neg_scores


# --- loss forwards (the library's operations around the MaxSim) ----------------------------------------------------

def _colbert_loss_forward(self, query_embeddings, doc_embeddings, offset: int = 0):
    scores = _inbatch_scores(self, query_embeddings, doc_embeddings)
    _, pos_idx = self._get_idx(scores.size(0), offset, scores.device)
    if self.pos_aware_negative_filtering:
        self._filter_high_negatives(scores, pos_idx)
    return self.ce_loss(scores / self.temperature, pos_idx)


def _pairwise_ce_forward(self, query_embeddings, doc_embeddings, offset: int = 0):
    scores = _inbatch_scores(self, query_embeddings, doc_embeddings)
    _, pos_idx = self._get_idx(scores.size(0), offset, scores.device)
    if self.pos_aware_negative_filtering:
        self._filter_high_negatives(scores, pos_idx)
    pos_scores = scores.diagonal(offset=offset)
    best_two = scores.topk(2, dim=1).values
    # the hardest negative: the best score unless that one is the positive itself
    neg_scores = torch.where(best_two[:, 0] == pos_scores, best_two[:, 1], best_two[:, 0])
    return F.softplus((neg_scores - pos_scores) / self.temperature).mean()


def _sigmoid_forward(self, query_embeddings, doc_embeddings, offset: int = 0):
    scores = _inbatch_scores(self, query_embeddings, doc_embeddings)
    batch_size = scores.size(0)
    _, pos_idx = self._get_idx(batch_size, offset, scores.device)
    if self.pos_aware_negative_filtering:
        self._filter_high_negatives(scores, pos_idx)
    # label +1 at each query's positive, -1 elsewhere, on the flattened [B * B] scores (the library's layout)
    labels = -torch.ones(batch_size * batch_size, device=scores.device)
    labels[pos_idx * (batch_size + 1)] = 1.0
    logits = scores.view(-1) / self.temperature
    return F.softplus(-logits * labels).mean()


def _with_negatives_loss(self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset, positives_count,
                         in_batch_loss):
    """The loss of the two losses with explicit negatives: softplus of each negative's margin over the positive,
    mixed with ``in_batch_loss`` by ``in_batch_term_weight``."""
    positives = doc_embeddings[offset: offset + positives_count]
    pos_scores, neg_scores = _positive_and_negative_scores(self, query_embeddings, positives, neg_doc_embeddings)
    loss = F.softplus((neg_scores - pos_scores.unsqueeze(1)) / self.temperature).mean()
    if self.in_batch_term_weight > 0:
        in_batch = in_batch_loss(query_embeddings, doc_embeddings, offset)
        loss = loss * (1 - self.in_batch_term_weight) + in_batch * self.in_batch_term_weight
    return loss


def _negative_ce_forward(self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset: int = 0):
    # the library slices the positives by the negatives' batch, the pairwise variant by the queries'
    return _with_negatives_loss(self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset,
                                neg_doc_embeddings.size(0), self.inner_loss)


def _pairwise_negative_ce_forward(self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset: int = 0):
    return _with_negatives_loss(self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset,
                                query_embeddings.size(0), self.inner_pairwise)


# --- utils.maxsim dispatch (0.3.17+) --------------------------------------------------------------------------------

def _maxsim_inbatch(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """``[B_q, B_d]`` hard-max scores of zero-padded ``query [B_q, L_q, d]`` and ``doc [B_d, L_d, d]``."""
    return _late_interaction(query, doc)


def _maxsim_kd(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` hard-max scores of zero-padded ``query [B, L_q, d]`` against its own ``doc [B, N, L_d, d]``."""
    return _late_interaction(query, doc)


# --- retrieval scoring ------------------------------------------------------------------------------------------------

def _check_passages(ps, queries: torch.Tensor) -> None:
    """Name the offending argument (the library would fail inside einsum, flash_maxsim with its own names)."""
    if isinstance(ps, flash_maxsim.QuantizedDocuments):
        if ps.values.shape[-1] != queries.shape[-1]:
            raise ValueError(f"quantized `ps` has embedding dim {ps.values.shape[-1]}; the queries `qs` have "
                             f"{queries.shape[-1]}")
        return
    tensor = isinstance(ps, torch.Tensor)
    for i, p in enumerate([ps] if tensor else ps):
        name = "`ps`" if tensor else f"`ps[{i}]`"
        want = "[n_passages, sequence_length, dim]" if tensor else "[sequence_length, dim]"
        if not isinstance(p, torch.Tensor) or p.dim() != (3 if tensor else 2):
            got = shape_of(p) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"{name} is {got}; expected a {want} tensor"
                             + ("" if tensor else " (or pass one padded [n, max_length, dim] tensor)"))
        if p.dtype != queries.dtype:
            raise TypeError(f"{name} has dtype {p.dtype} but the queries `qs` have {queries.dtype}; "
                            "cast one of them so both match")
        if p.shape[-1] != queries.shape[-1]:
            raise ValueError(f"{name} has embedding dim {p.shape[-1]}; the queries `qs` have {queries.shape[-1]}")


def _chunk_ranges(lengths: List[int], extra: List[bool]) -> Iterator[Tuple[int, int]]:
    """Consecutive document ranges of at most ``_CHUNK_TOKENS`` tokens (zero tokens included; at least one
    document each)."""
    start = 0
    while start < len(lengths):
        stop, tokens = start, 0
        while stop < len(lengths) and (stop == start or tokens + lengths[stop] + 1 <= _CHUNK_TOKENS):
            tokens += lengths[stop] + extra[stop]
            stop += 1
        yield start, stop
        start = stop


def _padded_slices(count: int, width: int) -> Iterator[slice]:
    """Consecutive slices of ``count`` padded passages of ``width`` tokens, at most ``_CHUNK_TOKENS`` tokens each
    (at least one passage)."""
    step = max(1, _CHUNK_TOKENS // max(int(width), 1))
    for start in range(0, count, step):
        yield slice(start, start + step)


def _document_chunks(ps, batch_size: int, device) -> Iterator[object]:
    """Yield the passages in chunks of at most ``_CHUNK_TOKENS`` tokens, on ``device``, in flash_maxsim's
    padded-tensor or packed layout."""
    if isinstance(ps, flash_maxsim.QuantizedDocuments):
        yield from _quantized_chunks(ps, batch_size, device)
        return
    if isinstance(ps, torch.Tensor):
        # already padded to one length: the library's per-batch padding adds nothing
        for part in _padded_slices(ps.shape[0], ps.shape[1]):
            yield ps[part].to(device)
        return
    ps = list(ps)
    lengths = [int(p.shape[0]) for p in ps]
    extra = padded_by_group(lengths, batch_size)
    for start, stop in _chunk_ranges(lengths, extra):
        home = ps[start].device
        zero_token = ps[start].new_zeros((1, ps[start].shape[1]))
        pieces, offsets = [], [0]
        for i in range(start, stop):
            pieces.append(ps[i].to(home))
            if extra[i]:
                pieces.append(zero_token)
            offsets.append(offsets[-1] + lengths[i] + extra[i])
        # concatenated where the passages live, then moved once
        values = torch.cat(pieces).to(device)
        longest = max(lengths[i] + extra[i] for i in range(start, stop))
        offsets = torch.tensor(offsets, dtype=torch.int64, device=values.device)
        yield flash_maxsim.PackedDocuments(values, offsets, longest)
        del values, offsets, pieces      # before the next chunk exists: one chunk at a time


def _quantized_chunks(ps, batch_size: int, device) -> Iterator[object]:
    """The same chunks for a quantised index (``flash_maxsim.quantize`` of the passages): a padded one is sliced;
    a packed one (quantised from a list) gets the library's zero token as an int8/fp8 zero with scale 0, so its
    scores are the library's on the dequantised passages."""
    if ps.offsets is None:
        if ps.values.dim() != 3:
            raise ValueError(f"quantized `ps` has values of shape {shape_of(ps.values)}; expected padded "
                             "[n_passages, sequence_length, dim] or packed (quantize a list of passages)")
        for part in _padded_slices(ps.values.shape[0], ps.values.shape[1]):
            yield flash_maxsim.QuantizedDocuments(
                ps.values[part], ps.scales[part], None, None if ps.mask is None else ps.mask[part],
                None, ps.kind).to(device)
        return
    bounds, lengths = document_bounds(ps, "ps")
    extra = padded_by_group(lengths, batch_size)
    for start, stop in _chunk_ranges(lengths, extra):
        yield with_zero_tokens(ps, bounds, extra, start, stop, device)


def _score_multi_vector(qs, ps, batch_size: int = 128, device=None) -> torch.Tensor:
    """Late-interaction (MaxSim) scores ``[n_queries, n_passages]``, float32 on the CPU, equal to the library's.

    ``qs`` / ``ps``: lists of ``[sequence_length_i, dim]`` tensors or padded ``[n, max_length, dim]`` tensors;
    ``ps`` may also be a compressed index, ``flash_maxsim.quantize(ps)`` (int8, or fp8 on GPUs that have it):
    then the scores are the library's on the dequantised passages and the queries as the index scores them
    (``flash_maxsim.quantization.queries_as_scored``: quantised per token for int8 at d <= 256).
    Passages are scored without padding, chunk by chunk, so memory does not grow with ``batch_size`` or the pool;
    ``batch_size`` only names the groups the library would pad together (see the module notes)."""
    from colpali_engine.utils import processing_utils

    device = device or processing_utils.get_torch_device("auto")
    if len(qs) == 0:
        raise ValueError("No queries provided")
    if (ps.num_documents if isinstance(ps, flash_maxsim.QuantizedDocuments) else len(ps)) == 0:
        raise ValueError("No passages provided")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}")
    if isinstance(qs, torch.Tensor):
        queries = qs.to(device)
    else:
        # zero query tokens add exactly 0 to a hard max, so padding the queries changes no score
        queries = torch.nn.utils.rnn.pad_sequence(list(qs), batch_first=True, padding_value=0).to(device)
    _check_passages(ps, queries)
    columns = []
    for documents in _document_chunks(ps, batch_size, device):
        columns.append(_late_interaction(queries, documents).cpu())
        del documents                    # freed before the next chunk is packed
    return torch.cat(columns, dim=1).to(torch.float32)


# --- top-k search ----------------------------------------------------------------------------------------------------

def _documents_in(chunk) -> int:
    if isinstance(chunk, flash_maxsim.QuantizedDocuments):
        return chunk.num_documents
    if isinstance(chunk, flash_maxsim.PackedDocuments):
        return chunk.offsets.shape[0] - 1
    return chunk.shape[0]


def search(qs: Union[List[torch.Tensor], torch.Tensor],
           ps: Union[List[torch.Tensor], torch.Tensor, "flash_maxsim.QuantizedDocuments"], k: int,
           batch_size: int = 128, device: Union[str, torch.device, None] = None, *,
           ps_mask: Optional[torch.Tensor] = None, masked: str = "zero") -> "flash_maxsim.SearchResult":
    """The ``k`` best pages per query: ``processor.score(qs, ps, batch_size)`` followed by a top-k, without the
    ``[n_queries, n_pages]`` score matrix (pages are scored chunk by chunk through :func:`flash_maxsim.search`).

    Args:
        qs: the queries, as ``processor.score`` takes them: a list of ``[query_length_i, dim]`` tensors (zero
            padded here, as the library pads them: a zero query token adds 0) or a padded tensor.
        ps: the pages: a list of ``[sequence_length_i, dim]`` tensors (e.g. ``list(torch.unbind(model(**batch)))``
            accumulated over batches), a padded ``[n_pages, sequence_length, dim]`` tensor, or a compressed index
            ``flash_maxsim.quantize(ps)``.
        k: results per query (an int >= 1); fewer when there are fewer pages.
        batch_size: the library's scoring batch, which decides what its zero padding adds (module notes):
            ``masked="zero"`` reproduces ``processor.score(qs, ps, batch_size=batch_size)``.
        device: where to score (default: CUDA when available, else the CPU); the pages move there a chunk at a
            time.
        ps_mask: ``[n_pages, sequence_length]`` for a padded ``ps`` (the attention mask of the processor's batch):
            tokens it marks 0 are padding.
        masked: ``"zero"`` (default): the library's numbers, padding tokens and the zero tokens its per-batch
            padding adds count as similarity 0; ``"exclude"``: padding takes no part (a listed page is scored
            on its own tokens, a padded one on the tokens ``ps_mask`` marks).

    Returns:
        ``flash_maxsim.SearchResult(scores [n_queries, k'] float32, indices [n_queries, k'] int64)`` on the
        CPU, as ``processor.score`` returns its scores: the pages' positions in ``ps``, score descending, equal
        scores by lower position.
    """
    if masked not in ("zero", "exclude"):
        raise ValueError(f"`masked` must be 'zero' (the library's numbers) or 'exclude', got {masked!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"`k` must be an int >= 1, got {k!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}")
    if len(qs) == 0:
        raise ValueError("No queries provided")
    if (ps.num_documents if isinstance(ps, flash_maxsim.QuantizedDocuments) else len(ps)) == 0:
        raise ValueError("No passages provided")
    if ps_mask is not None and not isinstance(ps, torch.Tensor):
        raise ValueError("`ps_mask` goes with a padded `ps` tensor [n_pages, sequence_length, dim]; a list of pages "
                         "is scored on the tokens each page has")
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(qs, torch.Tensor):
        queries = qs.to(device)
    else:
        queries = torch.nn.utils.rnn.pad_sequence(list(qs), batch_first=True, padding_value=0).to(device)
    _check_passages(ps, queries)
    if isinstance(ps, torch.Tensor):
        if ps_mask is not None and tuple(ps_mask.shape) != tuple(ps.shape[:2]):
            raise ValueError(f"`ps_mask` has shape {shape_of(ps_mask)}; expected [{ps.shape[0]}, {ps.shape[1]}] as "
                             "`ps` [n_pages, sequence_length, dim]")
        chunks = ((ps[part].to(device), None if ps_mask is None else ps_mask[part].to(device))
                  for part in _padded_slices(ps.shape[0], ps.shape[1]))
    else:
        # batches of one page: the library's padding adds nothing, each page is scored on its own tokens
        chunks = ((documents, None) for documents in
                  _document_chunks(ps, batch_size if masked == "zero" else 1, device))
    scores = torch.empty((queries.shape[0], 0), dtype=torch.float32)
    indices = torch.empty((queries.shape[0], 0), dtype=torch.int64)
    first = 0
    for documents, mask in chunks:
        found = flash_maxsim.search(queries, documents, k, documents_mask=mask, masked=masked)
        # the chunk's top k after the running top k (lower positions): a stable sort keeps equal scores in order
        scores = torch.cat([scores, found.scores.cpu()], dim=1)
        indices = torch.cat([indices, found.indices.cpu() + first], dim=1)
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
        scores, indices = scores.gather(1, order), indices.gather(1, order)
        first += _documents_in(documents)
        del documents, found
    return flash_maxsim.SearchResult(scores, indices)


# --- installation ---------------------------------------------------------------------------------------------------

def _version() -> Optional[Tuple[int, int, int]]:
    try:
        text = importlib.metadata.version("colpali-engine")
    except importlib.metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(g) for g in match.groups()) if match else None


_LOSS_CLASSES = ("ColbertLoss", "ColbertNegativeCELoss", "ColbertPairwiseCELoss", "ColbertPairwiseNegativeCELoss",
                 "ColbertSigmoidLoss")
_MODULE_HELPERS = ("_apply_normalization", "_get_idx", "_filter_high_negatives", "_aggregate")


def _install(patches: PatchSet) -> None:
    losses = import_toolkit("colpali_engine.loss.late_interaction_losses", "colpali-engine", "colpali")
    processing_utils = import_toolkit("colpali_engine.utils.processing_utils", "colpali-engine", "colpali")
    version = _version()
    shown = "unknown" if version is None else ".".join(map(str, version))
    supported = " to ".join(".".join(map(str, v)) for v in SUPPORTED)
    if version is not None and version < SUPPORTED[0]:
        raise RuntimeError(f"flash_maxsim.integrations.colpali supports colpali-engine {supported}; "
                           f"found {shown}, whose losses differ (upgrade colpali-engine)")
    module = getattr(losses, "ColbertModule", None)
    missing = [name for name in _LOSS_CLASSES if not hasattr(losses, name)]
    missing += [f"ColbertModule.{name}" for name in _MODULE_HELPERS if module is None or not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"colpali-engine {shown} lacks {', '.join(missing)}; flash_maxsim supports "
                           f"colpali-engine {supported}")
    if version is not None and version > SUPPORTED[1]:
        warnings.warn(f"flash_maxsim.integrations.colpali is tested with colpali-engine up to {supported}; "
                      f"found {shown}: check its losses still match (tests/integrations/colpali)", stacklevel=3)

    try:
        from colpali_engine.utils import maxsim as dispatch
    except ImportError:
        dispatch = None
    if dispatch is not None and hasattr(module, "_inbatch_scores"):
        # 0.3.17+: the in-batch losses score through one helper; the dispatch functions are imported by name
        patches.patch_aliases(dispatch.maxsim_inbatch, _maxsim_inbatch, ("colpali_engine",))
        patches.patch_aliases(dispatch.maxsim_kd, _maxsim_kd, ("colpali_engine",))
        patches.patch(module, "_inbatch_scores", _inbatch_scores)
        forwards = {"ColbertNegativeCELoss": _negative_ce_forward,
                    "ColbertPairwiseNegativeCELoss": _pairwise_negative_ce_forward}
    else:
        forwards = {"ColbertLoss": _colbert_loss_forward,
                    "ColbertNegativeCELoss": _negative_ce_forward,
                    "ColbertPairwiseCELoss": _pairwise_ce_forward,
                    "ColbertPairwiseNegativeCELoss": _pairwise_negative_ce_forward,
                    "ColbertSigmoidLoss": _sigmoid_forward}
    for name, forward in forwards.items():
        cls = getattr(losses, name)
        patches.patch(cls, "forward", forward)

    base = processing_utils.BaseVisualRetrieverProcessor
    patches.patch(base, "score_multi_vector", staticmethod(_score_multi_vector))


_integration = Integration("colpali-engine", _install)
enable = _integration.enable
disable = _integration.disable
is_enabled = _integration.is_enabled
enabled = _integration.enabled
