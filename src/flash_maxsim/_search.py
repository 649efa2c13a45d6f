"""Exact top-k search: :func:`search`, and the running top-k that :class:`flash_maxsim.DocumentIndex` shares.

Documents are scored chunk by chunk through the same scoring path as :func:`flash_maxsim.maxsim` (the Triton
kernels on CUDA tensors, the exact PyTorch path on the CPU) and every chunk's scores are merged into a running
top-k per query, so that no ``[Nq, B]`` score matrix is ever held (docs/design.md, "Search").

The selection is deterministic: each score is mapped to an int64 key whose high 32 bits order the float32 scores
(NaN above +inf, -0.0 equal to 0.0) and whose low 32 bits hold the column's rank reversed, so that
``torch.topk`` on the keys sees no ties and returns score descending, lower position first, whatever its
algorithm (``torch.topk`` on the scores themselves orders ties arbitrarily).
"""

from __future__ import annotations

import operator
from typing import Iterator, Literal, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ._layout import Problem, _check_document_list, _is_packed, _shape, canonicalize, remember_offsets
from ._types import Documents, DocumentsMask, QuantizedDocuments
from .ops import scores as _scores

__all__ = ["SearchResult", "search", "RunningTopK", "check_k", "check_chunk_size", "default_chunk_size",
           "SCORES_PER_CHUNK"]

# Default chunk: at most this many scores (Nq x chunk) per chunk. Per chunk the selection holds the fp32 scores,
# their int64 keys and the keys' temporaries, ~25 bytes a score in all (~100 MiB at this size), on top of the
# kernels' own scratch for C = chunk columns (docs/semantics.md, "Memory"); large enough that a chunk fills a GPU (one
# query: 4M documents a launch).
SCORES_PER_CHUNK = 1 << 22
# the low 32 bits of a key hold (LOW - column): a chunk and the running top-k together below 2^32 columns
_LOW = (1 << 32) - 1
_MAX_CHUNK = 1 << 31
_EXCLUDED = -(1 << 63)          # the key of an excluded column: below every real key


class SearchResult(NamedTuple):
    """The top k of :func:`search`: ``scores`` ``[Nq, k']`` float32, descending, and ``indices`` ``[Nq, k']``
    int64, the documents' positions (``[k']`` each for a single ``[Lq, d]`` query)."""

    scores: Tensor
    indices: Tensor


def check_k(k) -> int:
    """``k`` as an int >= 1, or a ValueError naming it."""
    if isinstance(k, bool):
        raise ValueError(f"`k` must be an int >= 1, got {k!r}")
    try:
        value = operator.index(k)
    except TypeError:
        raise ValueError(f"`k` must be an int >= 1, got {type(k).__name__}") from None
    if value < 1:
        raise ValueError(f"`k` must be an int >= 1, got {value}")
    if value >= _MAX_CHUNK:
        raise ValueError(f"`k` must be below 2**31, got {value}")
    return value


def check_chunk_size(chunk_size) -> Optional[int]:
    """``chunk_size`` as None or an int in [1, 2**31), or a ValueError naming it."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool):
        raise ValueError(f"`chunk_size` must be an int >= 1 or None, got {chunk_size!r}")
    try:
        value = operator.index(chunk_size)
    except TypeError:
        raise ValueError(f"`chunk_size` must be an int >= 1 or None, got {type(chunk_size).__name__}") from None
    if not 1 <= value < _MAX_CHUNK:
        raise ValueError(f"`chunk_size` must be an int in [1, 2**31), got {value}")
    return value


def default_chunk_size(num_queries: int) -> int:
    """Documents per chunk when none is given: :data:`SCORES_PER_CHUNK` scores over the queries."""
    return max(1, SCORES_PER_CHUNK // max(1, num_queries))


# ------------------------------------------------------------------------------------------- the selection

def _keys_into(out: Tensor, values: Tensor, first: int) -> None:
    """Write into ``out`` ``[Nq, M]`` int64 the order keys of ``values`` ``[Nq, M]`` float32 whose columns are
    ranks ``first ..`` of the merged row: larger key = higher score, then lower rank. NaN ranks above +inf; -0.0
    and 0.0 are equal (as ``torch.sort`` compares them)."""
    v = values.to(torch.float32) + 0.0                 # a fresh tensor, -0.0 turned into 0.0
    nan = v != v
    bits = v.view(torch.int32)
    # IEEE floats order like their bits as signed ints when positive; negative ones in reverse: flip them
    bits ^= (bits >> 31) & 0x7FFFFFFF
    bits.masked_fill_(nan, 0x7FFFFFFF)
    out.copy_(bits)
    out.mul_(1 << 32)                                  # key * 2^32 (no overflow: |key| < 2^31); low bits 0
    ranks = torch.arange(first, first + values.shape[1], dtype=torch.int64, device=values.device)
    out.add_(_LOW - ranks)


class RunningTopK:
    """The top ``k`` per query of the columns pushed so far, in push order: score descending, and among equal
    scores the column pushed first (the lower position, when columns are pushed in position order). Holds
    ``[Nq, k]`` scores and positions; a push of C columns needs O(Nq x (k + C)) more while it runs. Nothing
    reads the device: pushes only enqueue work."""

    def __init__(self, num_queries: int, k: int, device: Union[str, torch.device]):
        self.k = k
        self.scores = torch.empty((num_queries, 0), dtype=torch.float32, device=device)
        self.positions = torch.empty((num_queries, 0), dtype=torch.int64, device=device)

    def push(self, scores: Tensor, positions: Union[int, Tensor], excluded: Optional[Tensor] = None,
             count: Optional[int] = None) -> None:
        """Merge ``scores`` ``[Nq, C]`` (fp32) whose column ``j`` is the document at position ``positions + j``
        (an int) or ``positions[j]`` (a ``[C]`` int64 tensor, or ``[Nq, C]``). ``excluded`` ``[C]`` bool marks
        columns that never enter (removed documents); ``count`` is then the number of columns that may (a host
        number, so that nothing is read from the device)."""
        kept, C = self.scores.shape[1], scores.shape[1]
        available = C if excluded is None else int(count)
        k = min(self.k, kept + available)
        if C == 0 or available == 0 or k == 0:
            return
        Nq = scores.shape[0]
        keys = torch.empty((Nq, kept + C), dtype=torch.int64, device=scores.device)
        if kept:
            _keys_into(keys[:, :kept], self.scores, 0)
        _keys_into(keys[:, kept:], scores, kept)
        if excluded is not None:
            keys[:, kept:].masked_fill_(excluded, _EXCLUDED)
        top = torch.topk(keys, k, dim=1, largest=True, sorted=True).values
        del keys
        rank = _LOW - (top & _LOW)
        column = (rank - kept).clamp_(min=0)
        new_scores = scores.to(torch.float32).gather(1, column)
        if isinstance(positions, int):
            new_positions = column + positions
        elif positions.dim() == 1:
            new_positions = positions[column]
        else:
            new_positions = positions.gather(1, column)
        if kept:
            from_chunk = rank >= kept
            old = rank.clamp(max=kept - 1)
            new_scores = torch.where(from_chunk, new_scores, self.scores.gather(1, old))
            new_positions = torch.where(from_chunk, new_positions, self.positions.gather(1, old))
        self.scores, self.positions = new_scores, new_positions


def merge_top_k(scores: Sequence[Tensor], positions: Sequence[Tensor], k: int) -> tuple[Tensor, Tensor]:
    """The top ``k`` of several partial results ``[Nq, k_i]`` (each sorted, positions global and distinct): score
    descending, then lower position. Used where partial results do not arrive in position order (several GPUs)."""
    values = torch.cat(list(scores), 1)
    where = torch.cat(list(positions), 1)
    order = torch.argsort(where, dim=1, stable=True)
    merged = RunningTopK(values.shape[0], k, values.device)
    merged.push(values.gather(1, order), where.gather(1, order))
    return merged.scores, merged.positions


# ------------------------------------------------------------------------------------------- chunking

def _padded_chunks(p: Problem, chunk: int) -> Iterator[tuple[Problem, int]]:
    """``[B, Ld, d]`` documents: row slices (views)."""
    B = p.documents.shape[0]
    chunk = min(chunk, max(B, 1))
    for s in range(0, B, chunk):
        e = min(B, s + chunk)
        yield Problem(p.queries, p.queries_mask, p.documents[s:e],
                      None if p.documents_mask is None else p.documents_mask[s:e], None, p.max_length, 0, False,
                      None if p.document_scales is None else p.document_scales[s:e]), s


def _candidate_chunks(p: Problem, chunk: int) -> Iterator[tuple[Problem, int]]:
    """``[Nq, K, Ld, d]`` candidates: slices of K (copied into the ``[Nq x c, Ld, d]`` the kernels read, when a
    chunk is narrower than K)."""
    K = p.candidates
    if chunk >= K:
        yield p, 0
        return
    Nq = p.queries.shape[0]

    def part(x, s, e):
        if x is None:
            return None
        x = x.reshape(Nq, K, *x.shape[1:])[:, s:e]
        return x.reshape(Nq * (e - s), *x.shape[2:])

    for s in range(0, K, chunk):
        e = min(K, s + chunk)
        yield Problem(p.queries, p.queries_mask, part(p.documents, s, e), part(p.documents_mask, s, e), None,
                      p.max_length, e - s, False, part(p.document_scales, s, e)), s


def _packed_chunks(p: Problem, chunk: int) -> Iterator[tuple[Problem, int]]:
    """Packed documents: views of the values (and mask, scales) and the chunk's offsets rebased to 0. The chunks'
    bounds and longest documents are read from the (validated) offsets in one host read."""
    offsets = p.offsets
    B = offsets.shape[0] - 1
    if B == 0:
        return
    chunk = min(chunk, B)
    n = -(-B // chunk)
    lengths = offsets[1:] - offsets[:-1]
    padded = lengths.new_zeros(n * chunk)
    padded[:B] = lengths
    longest = padded.view(n, chunk).amax(1)
    bounds = offsets[torch.arange(0, n + 1, device=offsets.device).mul_(chunk).clamp_(max=B)]
    host = torch.cat([bounds, longest]).tolist()
    bounds, longest = host[:n + 1], host[n + 1:]
    for i in range(n):
        s, e = i * chunk, min(B, (i + 1) * chunk)
        t0, t1 = bounds[i], bounds[i + 1]
        local = offsets[s:e + 1] - t0
        remember_offsets(local, t1 - t0, longest[i])      # derived from validated offsets
        yield Problem(p.queries, p.queries_mask, p.documents[t0:t1],
                      None if p.documents_mask is None else p.documents_mask[t0:t1], local, int(longest[i]), 0,
                      False, None if p.document_scales is None else p.document_scales[t0:t1]), s


def _check_list_masks(documents_mask, lengths: list[int]) -> None:
    """Per-document masks of listed documents, checked against the documents' lengths before any scoring."""
    if documents_mask is None:
        return
    if isinstance(documents_mask, Tensor):
        if documents_mask.dim() != 1 or documents_mask.shape[0] != sum(lengths):
            raise ValueError(f"`documents_mask` has shape [{_shape(documents_mask)}]; expected one [Ld_i] mask per "
                             f"document or a flat [{sum(lengths)}] mask over every token")
        return
    if not isinstance(documents_mask, (list, tuple)):
        raise TypeError(f"`documents_mask` must be a tensor or a list of per-document [Ld_i] masks, got "
                        f"{type(documents_mask).__name__}")
    if len(documents_mask) != len(lengths):
        raise ValueError(f"`documents_mask` has {len(documents_mask)} entries; expected one [Ld_i] mask per "
                         f"document ({len(lengths)})")
    for i, (m, n) in enumerate(zip(documents_mask, lengths)):
        if isinstance(m, Tensor):
            shape = tuple(m.shape)
        elif isinstance(m, (list, tuple)):
            shape = (len(m),)
        else:
            raise TypeError(f"`documents_mask[{i}]` must be a tensor or a list of 0/1, got {type(m).__name__}")
        if shape != (n,):
            raise ValueError(f"`documents_mask[{i}]` has shape [{'x'.join(map(str, shape))}]; expected [{n}], the "
                             f"length of document {i}")


def _list_chunks(queries, documents: list, queries_mask, documents_mask, masked: str,
                 chunk: int) -> Iterator[tuple[Problem, int]]:
    """Listed documents: each chunk of the list packed on its own (a copy of that chunk only)."""
    lengths = [int(x.shape[0]) for x in documents]
    flat = isinstance(documents_mask, Tensor)
    token = 0
    for s in range(0, len(documents), chunk):
        e = min(len(documents), s + chunk)
        if documents_mask is None:
            mask = None
        elif flat:
            size = sum(lengths[s:e])
            mask, token = documents_mask[token:token + size], token + size
        else:
            mask = documents_mask[s:e]
        yield canonicalize(queries, documents[s:e], queries_mask, mask, masked=masked), s


def _chunks(queries, documents, queries_mask, documents_mask, masked: str,
            chunk_size: Optional[int]) -> tuple[int, int, bool, torch.device, Iterator[tuple[Problem, int]]]:
    """(queries, columns, single query, device, chunks): every input validated before the first chunk is made."""
    if isinstance(documents, (list, tuple)) and not _is_packed(documents):
        documents = list(documents)
        head = canonicalize(queries, documents[:1], queries_mask,
                            None if documents_mask is None or isinstance(documents_mask, Tensor)
                            else documents_mask[:1], masked=masked)
        if documents:
            _check_document_list(documents)
        _check_list_masks(documents_mask, [int(x.shape[0]) for x in documents])
        Nq = head.queries.shape[0]
        chunk = chunk_size or default_chunk_size(Nq)
        return (Nq, len(documents), head.single_query, head.queries.device,
                _list_chunks(queries, documents, queries_mask, documents_mask, masked, chunk))
    p = canonicalize(queries, documents, queries_mask, documents_mask, masked=masked)
    Nq = p.queries.shape[0]
    chunk = chunk_size or default_chunk_size(Nq)
    if p.candidates:
        chunks = _candidate_chunks(p, chunk)
    elif p.offsets is not None:
        chunks = _packed_chunks(p, chunk)
    else:
        chunks = _padded_chunks(p, chunk)
    return Nq, p.num_columns, p.single_query, p.queries.device, chunks


def search(queries: Tensor, documents: Union[Documents, QuantizedDocuments], k: int,
           queries_mask: Optional[Tensor] = None, documents_mask: DocumentsMask = None, *,
           masked: Literal["exclude", "zero"] = "exclude", chunk_size: Optional[int] = None) -> SearchResult:
    """The ``k`` best documents per query by MaxSim score, without the ``[Nq, B]`` score matrix.

    Args:
        queries, documents, queries_mask, documents_mask, masked: as in :func:`flash_maxsim.maxsim` (every
            layout, including :class:`QuantizedDocuments`); per-query candidates ``[Nq, K, Ld, d]`` are searched
            per query, indices into K.
        k: how many documents per query, an int >= 1; ``k' = min(k, number of documents)`` are returned.
        chunk_size: documents scored per chunk (candidates per query for ``[Nq, K, Ld, d]``); default
            ``max(1, 2**22 // Nq)``. Results do not depend on it, up to the last bits of the scores, which depend
            on the chunk's shape as ``maxsim``'s depend on the problem's.

    Returns:
        :class:`SearchResult` ``(scores [Nq, k'] float32, indices [Nq, k'] int64)`` (``[k']`` each for a
        ``[Lq, d]`` query): scores descending, equal scores in increasing index order, a NaN score above every
        other (as ``torch.sort`` places it): the first ``k'`` columns of ``maxsim(...)`` sorted with
        ``torch.sort(descending=True, stable=True)``. Not differentiable (the scores are computed without
        autograd).

    Memory: O(Nq x k) for the result, plus per chunk the ``Nq x chunk`` fp32 scores and their selection keys
    (~25 bytes a score in all), and the kernels' scratch for ``chunk`` columns (docs/semantics.md, "Memory");
    never O(Nq x B).
    Packed and quantised documents are chunked by views, without copying the corpus; a list is packed one chunk at
    a time; candidates are copied chunk by chunk when a chunk is narrower than K.
    """
    k = check_k(k)
    chunk_size = check_chunk_size(chunk_size)
    with torch.no_grad():
        Nq, columns, single, device, chunks = _chunks(queries, documents, queries_mask, documents_mask, masked,
                                                      chunk_size)
        top = RunningTopK(Nq, min(k, columns), device)
        zero = masked == "zero"
        for problem, start in chunks:
            top.push(_scores(problem, zero, None), start)
    if single:
        return SearchResult(top.scores[0], top.positions[0])
    return SearchResult(top.scores, top.positions)
