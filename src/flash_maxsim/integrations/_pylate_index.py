"""``ExactIndex``: a PyLate index (``pylate.indexes.base.Base``) that answers every query exactly, by scoring the
whole corpus held in a :class:`flash_maxsim.DocumentIndex`. Imported by ``flash_maxsim.integrations.pylate`` on
first use of the name (it subclasses PyLate's base class, so it needs PyLate)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

import flash_maxsim

from ._inputs import as_tensor, check_rank, is_ndarray

try:
    from pylate.indexes.base import Base as _PyLateBase
    from pylate.rank import RerankResult as _RerankResult
except ImportError as error:  # pragma: no cover - raised to the caller of ExactIndex
    raise ImportError("flash_maxsim.integrations.pylate.ExactIndex needs PyLate: "
                      'pip install "flash-maxsim-kernels[pylate]"') from error

logger = logging.getLogger("flash_maxsim")

Id = Union[int, str]


def _document(x, name: str) -> Tensor:
    """One document ``[tokens, dim]`` as a float32 CPU tensor, as PyLate's ``convert_to_tensor`` reads it."""
    t = as_tensor(x, name, lists_dtype=torch.float32)
    check_rank(t, 2, name, "[tokens, dim]")
    if not t.is_floating_point():
        raise TypeError(f"`{name}` has dtype {t.dtype}; expected floating-point embeddings")
    return t.detach()


def _stored(index: "flash_maxsim.DocumentIndex", ids: Sequence[Id]) -> List[Tensor]:
    """The stored tokens of documents ``ids``, as float32 CPU tensors (8-bit storage dequantised)."""
    out = []
    for value in ids:
        shard, row = index._where[value]
        t0, t1 = (int(v) for v in shard.offsets.data[row:row + 2])
        values = shard.values.data[t0:t1].to("cpu", torch.float32)
        if shard.scales is not None:
            values = values * shard.scales.data[t0:t1].to("cpu", torch.float32)[:, None]
        out.append(values)
    return out


class ExactIndex(_PyLateBase):
    """A PyLate index that returns, for every query, exactly what ``pylate.rank.rerank`` over the whole corpus
    returns: ids and scores of ``colbert_scores`` (zero padding included, below), score descending, equal scores
    in insertion order. No candidate generation, no index training: every document is scored, in flash_maxsim's
    kernels (on the GPU) or its exact PyTorch path (on the CPU), holding only the running top k.

    ``pylate.retrieve.ColBERT(index=ExactIndex())`` uses it unchanged (an end-to-end index, as PLAID is).

    Args:
        storage: how the corpus is stored: ``"fp32"`` (default; PyLate's embeddings are float32, so the scores
            are PyLate's), ``"bf16"``/``"fp16"`` (half the memory; scores of the rounded values), or
            ``"int8"``/``"fp8"`` (a quarter; one scale per token, :func:`flash_maxsim.quantize`).
        placement: where the corpus lives and is scored, as :class:`flash_maxsim.DocumentIndex` takes it
            (``"cpu"``, ``"cuda"``, ``"cuda:all"``, ``"host"``, ``"disk"`` with ``path``...); default ``"cuda"``
            when CUDA is available, else ``"cpu"``.
        path, stream_device: as :class:`flash_maxsim.DocumentIndex` (a ``"disk"`` index's directory; where a
            streamed one is scored).

    PyLate's padding: ``rank.rerank`` pads the candidates with zero vectors to the longest one and scores without
    a mask, so every document shorter than the longest in the corpus gets similarity-0 tokens (its per-token max
    never falls below 0). This index stores one zero token after exactly those documents. When the longest length
    changes (a longer document added, the longest ones removed), the documents whose padding changes are stored
    again (8-bit storage: quantised again from their stored values); equal scores still come in insertion order.
    """

    is_end_to_end_index = True

    def __init__(self, storage: str = "fp32", placement=None, path=None, stream_device=None) -> None:
        if placement is None:
            placement = "cuda" if torch.cuda.is_available() else "cpu"
        self._options = dict(storage=storage, placement=placement, path=path, stream_device=stream_device)
        # validated now, not at the first add: a DocumentIndex of the right dim is made then
        flash_maxsim.DocumentIndex(1, storage=storage, placement=placement if placement != "disk" else "cpu")
        self._index: Optional[flash_maxsim.DocumentIndex] = None
        self._lengths: Dict[Id, int] = {}          # real tokens (without the zero token)
        self._seq: Dict[Id, int] = {}              # insertion order
        self._padded: Dict[Id, bool] = {}          # stored with a zero token
        self._counts: Counter = Counter()          # documents per length
        self._moved: set = set()                   # stored again: their index position is not their order
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def __repr__(self) -> str:
        return f"ExactIndex(documents={len(self)}, longest={self._longest}, index={self._index!r})"

    @property
    def index(self) -> Optional["flash_maxsim.DocumentIndex"]:
        """The :class:`flash_maxsim.DocumentIndex` holding the corpus (None before the first document)."""
        return self._index

    @property
    def _longest(self) -> int:
        return max(self._counts) if self._counts else 0

    # --- documents
    def _store(self, ids: List[Id], documents: List[Tensor], longest: int, batch_size: Optional[int]) -> None:
        step = batch_size or max(1, len(ids))
        for s in range(0, len(ids), step):
            batch = []
            for value, doc in zip(ids[s:s + step], documents[s:s + step]):
                pad = doc.shape[0] < longest
                self._padded[value] = pad
                batch.append(torch.cat([doc, doc.new_zeros(1, doc.shape[1])]) if pad else doc)
            self._index.add(batch, ids=ids[s:s + step])

    def _restore(self, ids: List[Id], longest: int) -> None:
        """Store documents ``ids`` again, padded for the corpus' new ``longest`` length."""
        if not ids:
            return
        logger.debug("ExactIndex: the longest document has %d tokens now; storing %d documents again", longest,
                     len(ids))
        documents = [d[:self._lengths[i]] for i, d in zip(ids, _stored(self._index, ids))]
        self._index.remove(ids)
        self._store(ids, documents, longest, None)
        self._moved.update(ids)

    def add_documents(self, documents_ids: Union[Id, Sequence[Id]], documents_embeddings,
                      batch_size: Optional[int] = None, **kwargs) -> "ExactIndex":
        """Add documents: ``documents_ids`` (str or int each, unique) and their embeddings (a list of
        ``[tokens, dim]`` arrays or tensors, as ``model.encode(..., is_query=False)`` returns, or one padded
        ``[documents, tokens, dim]`` array whose rows all count as tokens). ``batch_size``: documents encoded and
        stored at a time (default: all). Returns the index, as PyLate's indexes do."""
        if isinstance(documents_ids, (str, int)):
            documents_ids = [documents_ids]
            if (isinstance(documents_embeddings, Tensor) or is_ndarray(documents_embeddings)) \
                    and documents_embeddings.ndim == 2:
                documents_embeddings = [documents_embeddings]
        ids = list(documents_ids)
        if isinstance(documents_embeddings, Tensor) or is_ndarray(documents_embeddings):
            if documents_embeddings.ndim != 3:
                raise ValueError(f"`documents_embeddings` has {documents_embeddings.ndim} dimensions; expected a list "
                                 "of [tokens, dim] embeddings or a [documents, tokens, dim] array")
            documents_embeddings = list(documents_embeddings)
        documents = [_document(x, f"documents_embeddings[{i}]") for i, x in enumerate(documents_embeddings)]
        if len(documents) != len(ids):
            raise ValueError(f"`documents_ids` has {len(ids)} entries for {len(documents)} documents")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"`batch_size` must be None or an int >= 1, got {batch_size!r}")
        seen = set()
        for i, value in enumerate(ids):
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise TypeError(f"`documents_ids[{i}]` must be a str or an int, got {type(value).__name__}")
            if value in seen or value in self._lengths:
                raise ValueError(f"`documents_ids[{i}]` = {value!r} is "
                                 f"{'listed twice' if value in seen else 'already in the index'}")
            seen.add(value)
        if not documents:
            return self
        dims = {d.shape[1] for d in documents}
        if self._index is not None:
            dims.add(self._index.dim)
        if len(dims) > 1:
            raise ValueError(f"`documents_embeddings` mixes embedding sizes {sorted(dims)}")
        if self._index is None:
            self._index = flash_maxsim.DocumentIndex(documents[0].shape[1], **self._options)
        old = self._longest
        longest = max(old, max(d.shape[0] for d in documents))
        if longest > old:
            # the documents of the old longest length were stored without padding: they need it now
            self._restore([i for i, n in self._lengths.items() if n == old and not self._padded[i]], longest)
        for value, doc in zip(ids, documents):
            self._lengths[value] = doc.shape[0]
            self._counts[doc.shape[0]] += 1
            self._seq[value] = self._next_seq
            self._next_seq += 1
        self._store(ids, documents, longest, batch_size)
        return self

    def remove_documents(self, documents_ids: Sequence[Id]) -> "ExactIndex":
        """Remove documents by id (an unknown id is a KeyError; nothing is removed then). Returns the index."""
        ids = [documents_ids] if isinstance(documents_ids, (str, int)) else list(documents_ids)
        for value in ids:
            if value not in self._lengths:
                raise KeyError(f"`documents_ids`: {value!r} is not in the index")
        if not ids:
            return self
        old = self._longest
        self._index.remove(ids)
        for value in ids:
            length = self._lengths.pop(value)
            self._counts[length] -= 1
            if not self._counts[length]:
                del self._counts[length]
            del self._seq[value], self._padded[value]
            self._moved.discard(value)
        longest = self._longest
        if longest < old:
            # the documents of the new longest length were stored padded: they must not be any more
            self._restore([i for i, n in self._lengths.items() if n == longest and self._padded[i]], longest)
        return self

    def get_documents_embeddings(self, documents_ids: Sequence[Sequence[Id]]) -> list:
        """Each listed document's embeddings ``[tokens, dim]`` (numpy float32; 8-bit storage dequantised), in the
        nesting of ``documents_ids``, as PyLate's token indexes return them for ``rank.rerank``."""
        return [[d.numpy() for d in self._documents(list(group))] for group in documents_ids]

    def _documents(self, ids: List[Id]) -> List[Tensor]:
        for value in ids:
            if value not in self._lengths:
                raise KeyError(f"`documents_ids`: {value!r} is not in the index")
        return [d[:self._lengths[i]] for i, d in zip(ids, _stored(self._index, ids))] if ids else []

    # --- search
    def _queries(self, queries_embeddings) -> List[Tensor]:
        if (isinstance(queries_embeddings, Tensor) or is_ndarray(queries_embeddings)) \
                and queries_embeddings.ndim == 2:
            queries_embeddings = [queries_embeddings]          # one query [tokens, dim]
        return [_document(q, f"queries_embeddings[{i}]").float() for i, q in enumerate(queries_embeddings)]

    def __call__(self, queries_embeddings, k: int = 10,
                 subset: Optional[Union[Sequence[Id], Sequence[Sequence[Id]]]] = None) -> List[List[dict]]:
        """The ``k`` best documents per query: one list per query of ``{"id", "score"}`` (``RerankResult``),
        score descending, equal scores in insertion order. ``subset``: one list of ids for every query, or one
        list per query: only those documents are ranked (as ``rank.rerank`` ranks them: padded to the longest
        among them)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` must be an int >= 1, got {k!r}")
        if not self._lengths:
            raise ValueError("The index is empty, add documents before querying.")
        queries = self._queries(queries_embeddings)
        if not queries:
            return []
        if subset is not None:
            return self._rank_subsets(queries, k, subset)
        lengths = [q.shape[0] for q in queries]
        Q = torch.nn.utils.rnn.pad_sequence(queries, batch_first=True)
        mask = None
        if len(set(lengths)) > 1:            # PyLate scores each query alone: padding tokens must add nothing
            mask = torch.arange(Q.shape[1])[None, :] < torch.tensor(lengths)[:, None]
        # on the CPU: the index moves the queries to where each part of the corpus is scored, the results come
        # back here
        scores, ids = self._search(Q, mask, min(k, len(self)))
        return [[_RerankResult(id=i, score=s) for i, s in zip(row_ids, row_scores)]
                for row_ids, row_scores in zip(ids, scores)]

    def _device(self) -> torch.device:
        """Where a subset is scored: the GPU for an index on or streamed to one, else the CPU."""
        placement = self._options["placement"]
        stream = self._options["stream_device"]
        if isinstance(placement, (list, tuple)) or str(placement).startswith("cuda") or \
                (placement in ("host", "disk") and stream != "cpu" and torch.cuda.is_available()):
            return torch.device("cuda")
        return torch.device("cpu")

    def _search(self, Q: Tensor, mask: Optional[Tensor], k: int):
        """(scores, ids) per query, k each: the index's top k, with equal scores put in insertion order. Documents
        stored again sit later in the index than their insertion order: enough extra results are fetched that
        every document scoring as the k-th one is seen, then equal scores are ordered by insertion."""
        total = len(self)
        moved = len(self._moved)
        fetch = min(total, k + moved)
        while True:
            result = self._index.search(Q, fetch, mask)
            if not moved or fetch == total:
                break
            kth = result.scores[:, k - 1]
            if not bool((result.scores[:, -1] == kth).any()):
                break
            fetch = min(total, 2 * fetch)
        scores = result.scores.cpu()
        if not moved:
            return scores.tolist(), result.ids
        out_scores, out_ids = [], []
        for row_scores, row_ids in zip(scores, result.ids):
            by_order = torch.tensor([self._seq[i] for i in row_ids]).argsort()
            order = by_order[torch.sort(row_scores[by_order], descending=True, stable=True).indices][:k].tolist()
            out_scores.append([float(row_scores[j]) for j in order])
            out_ids.append([row_ids[j] for j in order])
        return out_scores, out_ids

    def _rank_subsets(self, queries: List[Tensor], k: int, subset) -> List[List[dict]]:
        if len(subset) and isinstance(subset[0], (list, tuple)):
            if len(subset) != len(queries):
                raise ValueError(f"`subset` has {len(subset)} lists for {len(queries)} queries")
            groups = [list(s) for s in subset]
        else:
            groups = [list(subset)] * len(queries)
        device = self._device()
        out = []
        for query, group in zip(queries, groups):
            group = [i for i in group if i in self._lengths]          # PLAID drops unknown ids too
            if not group:
                out.append([])
                continue
            # ordered by insertion, so that equal scores come in insertion order as for the whole corpus
            group = sorted(set(group), key=self._seq.__getitem__)
            documents = torch.nn.utils.rnn.pad_sequence(self._documents(group), batch_first=True).to(device)
            # zero-padded and no mask: the padding counts as similarity 0, as in rank.rerank's colbert_scores
            scores = flash_maxsim.maxsim(query.to(device), documents)
            values, order = torch.sort(scores, descending=True, stable=True)
            out.append([_RerankResult(id=group[j], score=s)
                        for j, s in zip(order[:k].tolist(), values[:k].cpu().tolist())])
        return out
