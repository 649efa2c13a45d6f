"""The definition of MaxSim, written as plain float64 PyTorch. Every fast path is tested against this.

For a query ``q`` (tokens ``i``, mask ``qm``) and a document ``t`` (tokens ``j < len(t)``, mask ``dm``), with
``s_ij = <Q[q, i], D[t, j]>``::

    score(q, t) = sum over i with qm[i] of  agg_j s_ij

- ``masked="exclude"``: ``agg`` runs over the tokens with ``dm[j]``; over no token at all it is 0.
- ``masked="zero"``: ``agg`` runs over every token ``j < len(t)``, a masked one entering as ``s_ij = 0``
  (what multiplying the similarities by the mask computes, as PyLate and colpali-engine do).
- ``agg`` is ``max`` (``smooth_tau=None``) or ``tau * log(sum_j exp(s_ij / tau))``, written
  ``m + tau * log(sum_j exp((s_ij - m) / tau))`` with ``m = max_j s_ij`` (so a row holding +inf gives NaN).
- An ``agg`` of ``-inf`` (every similarity it runs over is ``-inf``: only infinite inputs give that) is 0 too:
  no fast path can tell it from an empty one, and 0 keeps the score finite.
- Masks are bool or numbers (nonzero = valid token). NaN in an unmasked place gives NaN.

This module is documentation first: it materialises the per-query similarity tensor on purpose.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from ._types import Documents, DocumentsMask

__all__ = ["maxsim"]


def _pad(docs: Sequence[torch.Tensor], masks: Optional[Sequence[torch.Tensor]]):
    """List of ``[Ld_t, d]`` -> padded float64 ``[T, L, d]``, in-document ``[T, L]``, valid ``[T, L]``."""
    T = len(docs)
    L = max([int(x.shape[0]) for x in docs] + [1])
    d = int(docs[0].shape[-1]) if T else 0
    device = docs[0].device if T else "cpu"
    D = torch.zeros(T, L, d, dtype=torch.float64, device=device)
    in_doc = torch.zeros(T, L, dtype=torch.bool, device=device)
    valid = torch.zeros(T, L, dtype=torch.bool, device=device)
    for t, x in enumerate(docs):
        n = x.shape[0]
        D[t, :n] = x.double()
        in_doc[t, :n] = True
        valid[t, :n] = True if masks is None else (masks[t] != 0)
    return D, in_doc, valid


def _document_lists(documents, documents_mask):
    """Any documents layout -> (list of [Ld_t, d], list of masks or None, candidates per query or 0)."""
    if isinstance(documents, torch.Tensor) and documents.dim() == 4:
        Nq, K = documents.shape[:2]
        docs = list(documents.reshape(Nq * K, *documents.shape[2:]))
        masks = None if documents_mask is None else list(documents_mask.reshape(Nq * K, -1))
        return docs, masks, K
    if isinstance(documents, torch.Tensor):
        return list(documents), None if documents_mask is None else list(documents_mask), 0
    if isinstance(documents, tuple) and len(documents) in (2, 3) and isinstance(documents[1], torch.Tensor) \
            and documents[1].dim() == 1 and documents[0].dim() == 2:      # PackedDocuments / (values, offsets)
        values, offsets = documents[0], documents[1]
        offs = offsets.tolist()
        docs = [values[offs[t]:offs[t + 1]] for t in range(len(offs) - 1)]
        if documents_mask is None:
            return docs, None, 0
        if isinstance(documents_mask, torch.Tensor):
            return docs, [documents_mask[offs[t]:offs[t + 1]] for t in range(len(offs) - 1)], 0
        return docs, list(documents_mask), 0
    docs = list(documents)
    return docs, None if documents_mask is None else list(documents_mask), 0


def maxsim(queries: torch.Tensor, documents: Documents, queries_mask: Optional[torch.Tensor] = None,
           documents_mask: DocumentsMask = None, *, masked: Literal["exclude", "zero"] = "exclude",
           smooth_tau: Optional[float] = None) -> torch.Tensor:
    """float64 MaxSim with the same layouts and arguments as :func:`flash_maxsim.maxsim`."""
    single = queries.dim() == 2
    Q = (queries[None] if single else queries).double()
    qvalid = torch.ones(Q.shape[:2], dtype=torch.bool, device=Q.device) if queries_mask is None else \
        ((queries_mask[None] if single else queries_mask) != 0)
    docs, masks, K = _document_lists(documents, documents_mask)
    Nq = Q.shape[0]
    C = K if K else len(docs)
    if not docs or C == 0:
        out = torch.zeros(Nq, C, dtype=torch.float64, device=Q.device)
        return out[0] if single else out
    D, in_doc, valid = _pad(docs, masks)
    rows = []
    for q in range(Nq):
        sl = slice(q * K, (q + 1) * K) if K else slice(None)
        Dq, in_q, valid_q = D[sl], in_doc[sl], valid[sl]               # [C, L, d], [C, L]
        s = torch.einsum("id,cjd->cij", Q[q], Dq)                     # [C, Lq, L]
        if masked == "zero":
            s = torch.where(valid_q[:, None, :], s, torch.zeros((), dtype=s.dtype, device=s.device))
            agg_over = in_q
        else:
            agg_over = valid_q
        s = s.masked_fill(~agg_over[:, None, :], float("-inf"))
        if smooth_tau is None:
            per_token = s.amax(-1)
        else:
            # the row's max taken out first (0 for a row of -inf), as written in docs/semantics.md: a row
            # holding +inf is NaN (inf - inf), in every path
            m = s.amax(-1, keepdim=True)
            m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
            per_token = (m + smooth_tau * torch.log(torch.exp((s - m) / smooth_tau).sum(-1, keepdim=True)))[..., 0]
        # nothing to aggregate over, or nothing but -inf (only infinite inputs give that): 0
        empty = ~agg_over.any(-1)[:, None] | (per_token == float("-inf"))
        per_token = torch.where(empty, torch.zeros_like(per_token), per_token)
        per_token = torch.where(qvalid[q][None, :], per_token, torch.zeros_like(per_token))
        rows.append(per_token.sum(-1))
    out = torch.stack(rows) if rows else torch.zeros(0, C, dtype=torch.float64, device=Q.device)
    return out[0] if single else out
