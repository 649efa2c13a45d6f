"""``semantic_search`` for multi-vector embeddings: sentence-transformers' own ``util.semantic_search`` ranks
single vectors (it stacks the corpus into one tensor, so the ragged token lists ``MultiVectorEncoder.encode``
returns fail; padded tensors with ``score_function=util.maxsim`` work, at the cost of padding the whole corpus).
This one takes what ``MultiVectorEncoder.encode`` returns and ranks by sentence-transformers' MaxSim."""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from .._inputs import ArrayLike, is_ndarray
from .scoring import maxsim

# Default corpus chunk: at most this many scores (queries x chunk documents) held at once.
_SCORES_PER_CHUNK = 1 << 22


def _document_count(embeddings, name: str) -> int:
    """How many items ``embeddings`` holds (one 2-D embedding is one item)."""
    if isinstance(embeddings, (list, tuple)):
        return len(embeddings)
    if (isinstance(embeddings, Tensor) or is_ndarray(embeddings)) and embeddings.ndim in (2, 3):
        return 1 if embeddings.ndim == 2 else int(embeddings.shape[0])
    raise TypeError(f"`{name}` must be a list of [tokens, dim] embeddings, a [items, tokens, dim] tensor or "
                    f"array, or one [tokens, dim] embedding; got "
                    f"{getattr(embeddings, 'shape', type(embeddings).__name__)}")


def _rows(x, start: int, stop: int, whole: bool):
    """Items ``start:stop`` of a corpus or of its mask (one 2-D embedding is a corpus of one: kept whole)."""
    if x is None or whole:
        return x
    return x[start:stop]


def semantic_search(query_embeddings: ArrayLike, corpus_embeddings: ArrayLike, top_k: int = 10,
                    query_mask: Optional[ArrayLike] = None, corpus_mask: Optional[ArrayLike] = None,
                    length_normalize: bool = False, corpus_chunk_size: Optional[int] = None,
                    chunk_elements: Optional[int] = None,
                    device: Union[str, torch.device, None] = None) -> List[List[Dict[str, Union[int, float]]]]:
    """The ``top_k`` best documents per query by MaxSim, in ``util.semantic_search``'s format.

    Args:
        query_embeddings: what ``model.encode_query(...)`` returns: a list of ``[tokens_i, dim]`` embeddings,
            a padded ``[queries, tokens, dim]`` tensor or array (all-zero rows are padding unless
            ``query_mask`` says otherwise), or one ``[tokens, dim]`` embedding.
        corpus_embeddings: what ``model.encode_document(...)`` returns, in the same forms.
        top_k: results per query (an int >= 1); fewer when the corpus is smaller.
        query_mask, corpus_mask: as ``util.maxsim``'s ``a_mask`` / ``b_mask`` (``[N, tokens]`` or per-item).
        length_normalize: MeanMaxSim (``model.similarity_fn_name == "meanmaxsim"``): divide by the real
            query-token count.
        corpus_chunk_size: documents scored per step (default: about 4M scores per step, queries x documents):
            only ``[queries, corpus_chunk_size]`` scores and the running top k are held.
        chunk_elements, device: as ``util.maxsim`` (the copy of listed documents per call; where to score).

    Returns:
        One list per query of ``{"corpus_id": int, "score": float}``, score descending; equal scores by lower
        ``corpus_id``. Scores are ``util.maxsim``'s (sentence-transformers' semantics: masked tokens take no
        part, a document with no scoreable token scores -1e9), computed by flash_maxsim.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"`top_k` must be an int >= 1, got {top_k!r}")
    if corpus_chunk_size is not None and (isinstance(corpus_chunk_size, bool) or
                                          not isinstance(corpus_chunk_size, int) or corpus_chunk_size < 1):
        raise ValueError(f"`corpus_chunk_size` must be None or an int >= 1, got {corpus_chunk_size!r}")
    total = _document_count(corpus_embeddings, "corpus_embeddings")
    queries = _document_count(query_embeddings, "query_embeddings")
    whole = not isinstance(corpus_embeddings, (list, tuple)) and corpus_embeddings.ndim == 2
    step = corpus_chunk_size or max(1, _SCORES_PER_CHUNK // max(1, queries))
    best_scores: Optional[Tensor] = None
    best_ids: Optional[Tensor] = None
    for start in range(0, total, step):
        stop = min(total, start + step)
        scores = maxsim(query_embeddings, _rows(corpus_embeddings, start, stop, whole), query_mask,
                        _rows(corpus_mask, start, stop, whole), chunk_elements, length_normalize, device).cpu()
        ids = torch.arange(start, stop, dtype=torch.int64).expand(scores.shape[0], -1)
        if best_scores is not None:
            scores = torch.cat([best_scores, scores], dim=1)
            ids = torch.cat([best_ids, ids], dim=1)
        # the running top k holds lower ids first: a stable sort keeps equal scores in id order
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]
        best_scores, best_ids = scores.gather(1, order), ids.gather(1, order)
    if best_scores is None:                    # an empty corpus
        return [[] for _ in range(queries)]
    return [[{"corpus_id": i, "score": s} for i, s in zip(row_ids, row_scores)]
            for row_ids, row_scores in zip(best_ids.tolist(), best_scores.tolist())]
