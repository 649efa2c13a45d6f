"""The public entry point, :func:`maxsim`."""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch

from ._layout import canonicalize
from ._types import Documents, DocumentsMask, QuantizedDocuments
from .ops import scores


def maxsim(queries: torch.Tensor, documents: Union[Documents, QuantizedDocuments],
           queries_mask: Optional[torch.Tensor] = None, documents_mask: DocumentsMask = None, *,
           masked: Literal["exclude", "zero"] = "exclude", smooth_tau: Optional[float] = None) -> torch.Tensor:
    """Late-interaction (MaxSim) scores, computed tile by tile without the similarity tensor.

    Args:
        queries: ``[Nq, Lq, d]`` (or ``[Lq, d]`` for one query: the output then drops the query axis).
        documents: ``[B, Ld, d]`` -> scores ``[Nq, B]`` (every query against every document);
            ``[Nq, K, Ld, d]`` -> ``[Nq, K]`` (each query against its own K candidates);
            a list of B ``[Ld_i, d]`` tensors or :class:`PackedDocuments` -> ``[Nq, B]``, no padding computed;
            :class:`QuantizedDocuments` (:func:`flash_maxsim.quantize`) in any of these layouts, for scoring.
        queries_mask: ``[Nq, Lq]``, bool or 0/1; a masked query token contributes 0.
        documents_mask: ``[B, Ld]`` / ``[Nq, K, Ld]`` / one ``[Ld_i]`` per listed document, any pattern.
        masked: ``"exclude"`` (masked document tokens take no part; no valid token -> the query token adds 0)
            or ``"zero"`` (masked document tokens count as similarity 0, as PyLate and colpali-engine compute).
        smooth_tau: None for the hard max, or tau > 0 for ``tau * logsumexp(s / tau)`` over document tokens.

    Returns:
        float32 scores. fp16/bf16 products accumulate in fp32; fp32 inputs follow
        ``torch.get_float32_matmul_precision()``. Differentiable w.r.t. queries and documents.
        See ``docs/semantics.md`` and :func:`flash_maxsim.reference.maxsim` for the exact definition.
    """
    p = canonicalize(queries, documents, queries_mask, documents_mask, masked=masked, smooth_tau=smooth_tau)
    out = scores(p, masked == "zero", None if smooth_tau is None else float(smooth_tau))
    return out[0] if p.single_query else out
