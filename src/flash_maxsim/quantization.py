"""Compressed document index: per-token symmetric INT8 (or FP8 e4m3) vectors with one scale per token.

``D[t, j] ~= scale[t, j] * values[t, j]`` with ``scale = max_k |D[t, j, k]| / QMAX`` (QMAX = 127 for int8,
448 for e4m3). An int8 index keeps that scale rounded up to a bf16 number (2 bytes; no value passes QMAX, and the
quantisation step grows by at most 2^-7 of itself: bf16 keeps 8 significant bits); an fp8 index keeps it in fp32
(with 2-byte scales its streaming kernel, at 254 registers, was ~3% slower: H200, 32 x 300 tokens, Triton 3.6).
The kernels read either dtype for either format (an index made by hand may have fp32 scales).
Scoring (docs/semantics.md, "A compressed index"):

- d <= 256 (int8 or fp8): each query token is quantised to the index's format, with an fp32 scale (in registers by the
  forward kernel; by :func:`quantize_tokens` before the launch on the grid for long queries over many documents),
  the tensor cores multiply 8-bit x 8-bit (int8 into exact int32 sums; fp8 into fp32 sums), and similarity
  (i, j) is scaled by the query token's and the document token's scales. The score is that of the dequantised
  query against the dequantised index; the CPU path computes the same (:func:`eight_bit_products_in_use`
  says when).
- d > 256: a document tile is loaded as int8/fp8 (half the bytes of bf16), converted to the queries' dtype
  (exact: every int8 and e4m3 value is representable in bf16/fp16), multiplied on tensor cores with fp32
  accumulation, and column ``j`` is scaled by ``scale[t, j]``; the query is not quantised.

Index bytes per token: d (values) + 2 (int8's scale) or 4 (fp8's), against 2*d for bf16: at d=128, 0.508x
(int8) and 0.516x (fp8).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from ._layout import _flat_document_mask, _is_packed, pack
from ._types import (Documents, DocumentsMask, QuantizedDocuments, eight_bit_products, quantize_tokens,
                     storage_dtype)

__all__ = ["QuantizedDocuments", "quantize", "quantize_tokens", "dequantized_queries", "queries_as_scored"]

# the index's scales (module docstring): bf16 where 2 bytes read faster, fp32 for fp8
_INDEX_SCALE_DTYPE = {"int8": torch.bfloat16, "fp8": torch.float32}


def quantize(documents: Documents, documents_mask: DocumentsMask = None, *,
             dtype: str = "int8") -> QuantizedDocuments:
    """Quantise documents (``[B, Ld, d]``, ``[Nq, K, Ld, d]``, a list of ``[Ld_i, d]`` or PackedDocuments) with a
    per-token symmetric scale. ``dtype``: ``"int8"`` anywhere, ``"fp8"`` (e4m3) where PyTorch has it; scoring fp8
    on a GPU needs native fp8 support (compute capability >= 8.9), checked when scoring."""
    storage_dtype(dtype)           # an unknown or unsupported dtype fails before any work
    offsets = max_length = None
    if isinstance(documents, (list, tuple)) and not _is_packed(documents):
        documents = pack(documents)                    # checks the items: one dtype, device and d
    if _is_packed(documents):
        values, offsets = documents[0], documents[1]
        max_length = documents[2] if len(documents) == 3 else None
        if documents_mask is not None and not isinstance(documents_mask, torch.Tensor):
            # per-document masks: stored flat, so each one's length is checked against its document here
            documents_mask = _flat_document_mask(documents_mask, (offsets[1:] - offsets[:-1]).tolist(),
                                                 values.device)
        documents = values
    if not isinstance(documents, torch.Tensor) or not documents.is_floating_point():
        raise TypeError("`documents` must be a floating-point tensor, a list of them or PackedDocuments")
    values, scales = quantize_tokens(documents, dtype, scale_dtype=_INDEX_SCALE_DTYPE[dtype])
    return QuantizedDocuments(values, scales, offsets, documents_mask, max_length, dtype)


def dequantized_queries(queries: torch.Tensor, dtype: str = "int8") -> torch.Tensor:
    """``queries`` quantised per token exactly like document tokens (:func:`quantize_tokens`, ``dtype`` "int8" or
    "fp8"), then dequantised to fp32: the queries that an index of that dtype with d <= 256 scores
    (docs/semantics.md)."""
    values, scales = quantize_tokens(queries, dtype)
    return values.float() * scales[..., None]


def queries_as_scored(queries: torch.Tensor, index: QuantizedDocuments) -> torch.Tensor:
    """The queries whose MaxSim against ``index.dequantize()`` ``flash_maxsim.maxsim(queries, index)`` computes:
    :func:`dequantized_queries` in the index's dtype where d <= 256, the queries themselves otherwise."""
    products = eight_bit_products_in_use(index.values, index.scales, queries.shape[-1], save_aux=False)
    if products is not None:
        return dequantized_queries(queries, products)
    return queries


_TUNING_MODULE = __package__ + ".kernels.tuning"


def eight_bit_products_in_use(documents: torch.Tensor, document_scales: Optional[torch.Tensor], d: int,
                              save_aux: bool) -> Optional[str]:
    """:func:`flash_maxsim._types.eight_bit_products` as the kernels apply it: through their tuning switch
    (``kernels.tuning.eight_bit_products``) once they are loaded, so that the CPU path scores what the kernels
    would; without loading them (and Triton) when they are not."""
    tuning = sys.modules.get(_TUNING_MODULE)
    if tuning is not None:
        return tuning.eight_bit_products(documents, document_scales, d, save_aux)
    return eight_bit_products(documents, document_scales, d, save_aux)
