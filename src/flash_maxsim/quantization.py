"""Compressed document index: per-token symmetric INT8 (or FP8 e4m3) vectors with one scale per token.

``D[t, j] ~= scale[t, j] * values[t, j]`` with ``scale = max_k |D[t, j, k]| / QMAX`` (QMAX = 127 for int8,
448 for e4m3). An int8 index keeps that scale rounded up to a bf16 number (2 bytes; no value passes QMAX, and the
quantisation step grows by at most 2^-7 of itself: bf16 keeps 8 significant bits); an fp8 index keeps it in fp32
(its streaming kernel, at 254 registers, was ~3% slower reading 2-byte scales: docs/perf-notes.md, session 27).
The kernels read either dtype for either format (an int8 index made before session 27 has fp32 scales).
Scoring (docs/semantics.md, "A compressed index"):

- d <= 256 (int8 or fp8): each query token is quantised to the index's format, with an fp32 scale (in registers by the
  forward kernel; by :func:`quantize_tokens` before the launch on the grid for long queries over many documents),
  the tensor cores multiply 8-bit x 8-bit (int8 into exact int32 sums; fp8 into fp32 sums), and similarity
  (i, j) is scaled by the query token's and the document token's scales. The score is that of the dequantised
  query against the dequantised index; the CPU path computes the same (``kernels.launch.eight_bit_products``
  says when).
- d > 256: a document tile is loaded as int8/fp8 (half the bytes of bf16), converted to the queries' dtype
  (exact: every int8 and e4m3 value is representable in bf16/fp16), multiplied on tensor cores with fp32
  accumulation, and column ``j`` is scaled by ``scale[t, j]``; the query is not quantised.

Index bytes per token: d (values) + 2 (int8's scale) or 4 (fp8's), against 2*d for bf16: at d=128, 0.508x
(int8) and 0.516x (fp8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._layout import PackedDocuments, _flat_document_mask, _is_packed, pack

_QMAX = {"int8": 127.0, "fp8": 448.0}
# the index's scales (module docstring): 2 bytes where that reads faster (measured on the device), 4 elsewhere
_INDEX_SCALE_DTYPE = {"int8": torch.bfloat16, "fp8": torch.float32}
# QuantizedDocuments.save's file: a dict of tensors and plain values, tagged so that load() knows its own
_SAVE_FORMAT = "flash_maxsim.QuantizedDocuments"
_SAVE_VERSION = 1


def _storage_dtype(kind: str) -> torch.dtype:
    if kind == "int8":
        return torch.int8
    if kind == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise TypeError("`dtype='fp8'` needs a PyTorch build with torch.float8_e4m3fn")
        return torch.float8_e4m3fn
    raise ValueError(f"`dtype` must be 'int8' or 'fp8', got {kind!r}")


@dataclass
class QuantizedDocuments:
    """Quantised documents in one of the layouts :func:`flash_maxsim.maxsim` accepts.

    ``values``: int8 / float8_e4m3fn, ``[B, Ld, d]``, ``[Nq, K, Ld, d]`` or packed ``[sum Ld, d]``;
    ``scales``: bf16 or fp32 (:func:`quantize` makes bf16 for int8, fp32 for fp8), shaped like ``values`` minus
    the feature axis;
    ``offsets``: ``[B + 1]`` for the packed layout; ``mask``: the documents mask given to :func:`quantize` (used
    when ``maxsim`` gets none).
    """

    values: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    max_length: Optional[int] = None
    kind: str = "int8"

    @property
    def nbytes(self) -> int:
        """Bytes of the index (values + scales + offsets + mask)."""
        total = 0
        for t in (self.values, self.scales, self.offsets, self.mask):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    @property
    def num_documents(self) -> int:
        """Documents in the index (``B``; ``Nq * K`` for per-query candidates)."""
        if self.offsets is not None:
            return self.offsets.shape[0] - 1
        return self.values.shape[:-2].numel()

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to(self, device) -> "QuantizedDocuments":
        move = (lambda t: None if t is None else t.to(device))
        return QuantizedDocuments(self.values.to(device), self.scales.to(device), move(self.offsets),
                                  move(self.mask), self.max_length, self.kind)

    def save(self, f) -> None:
        """Write the index to ``f`` (a path or a binary file) through ``torch.save``, as tensors and plain values
        only, so that :meth:`load` reads it back under ``torch.load``'s default ``weights_only=True``: loading an
        index runs no pickled code. (``torch.save(index, f)`` of the object itself works too, but reading that
        back needs ``weights_only=False`` or ``torch.serialization.safe_globals([QuantizedDocuments])``.)"""
        torch.save({"format": _SAVE_FORMAT, "version": _SAVE_VERSION, "kind": self.kind, "values": self.values,
                    "scales": self.scales, "offsets": self.offsets, "mask": self.mask,
                    "max_length": self.max_length}, f)

    @classmethod
    def load(cls, f, map_location=None) -> "QuantizedDocuments":
        """The index that :meth:`save` wrote to ``f``; ``map_location`` as in ``torch.load`` (e.g. ``"cpu"``)."""
        state = torch.load(f, map_location=map_location, weights_only=True)
        if not isinstance(state, dict) or state.get("format") != _SAVE_FORMAT:
            raise ValueError("`f` does not hold an index written by QuantizedDocuments.save (for an object saved "
                             "with torch.save(index, f), use torch.load(f, weights_only=False) on a trusted file)")
        if state.get("version") != _SAVE_VERSION:
            raise ValueError(f"`f` holds an index in save format version {state.get('version')}; this flash_maxsim "
                             f"reads version {_SAVE_VERSION}")
        if state["values"].dtype != _storage_dtype(state["kind"]):
            raise ValueError(f"`f` holds a {state['kind']!r} index whose values are {state['values'].dtype}")
        return cls(state["values"], state["scales"], state["offsets"], state["mask"], state["max_length"],
                   state["kind"])

    def dequantize(self, dtype: torch.dtype = torch.float32):
        """The approximated documents in ``dtype``, in the layout they were given (packed -> PackedDocuments)."""
        dense = (self.values.to(torch.float32) * self.scales.to(torch.float32)[..., None]).to(dtype)
        if self.offsets is not None:
            return PackedDocuments(dense, self.offsets, self.max_length)
        return dense


def quantize(documents, documents_mask=None, *, dtype: str = "int8") -> QuantizedDocuments:
    """Quantise documents (``[B, Ld, d]``, ``[Nq, K, Ld, d]``, a list of ``[Ld_i, d]`` or PackedDocuments) with a
    per-token symmetric scale. ``dtype``: ``"int8"`` anywhere, ``"fp8"`` (e4m3) where PyTorch has it; scoring fp8
    on a GPU needs native fp8 support (compute capability >= 8.9), checked when scoring."""
    _storage_dtype(dtype)          # an unknown or unsupported dtype fails before any work
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


def _round_up_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """The least bf16 number >= each non-negative fp32 ``x`` (0 stays 0, inf and NaN stay): the fp32 bits with the
    16 low ones carried up, then dropped (bf16 is the high half of fp32)."""
    bits = x.view(torch.int32)
    up = ((bits + 0xFFFF) & -0x10000).view(torch.float32)
    return torch.where(x == x, up, x).to(torch.bfloat16)


def quantize_tokens(x: torch.Tensor, dtype: str = "int8",
                    scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: every vector ``x[..., :]`` as ``scales[...] * values[..., :]``, one symmetric scale
    per vector (0 for a zero vector, whose values are then 0): ``amax / QMAX`` in fp32 (``scale_dtype`` fp32: how
    the kernels quantise queries; an fp8 index), or that rounded up to bf16 (``scale_dtype`` bf16: an int8
    index's 2-byte scales)."""
    storage = _storage_dtype(dtype)
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"`scale_dtype` must be torch.float32 or torch.bfloat16, got {scale_dtype}")
    x = x.detach().to(torch.float32)
    qmax = _QMAX[dtype]
    # divided by a tensor: PyTorch's CUDA kernels multiply by the reciprocal of a Python-number divisor, which is
    # one rounding away from the IEEE quotient that the CPU, and the kernel quantising queries, compute (new_full:
    # no host-to-device copy, so this stays capturable in a CUDA graph)
    scales = x.abs().amax(-1) / x.new_full((), qmax)
    if scale_dtype == torch.bfloat16:
        # rounded up, so that x / scale stays within +-QMAX (a value past it would be clipped); the division below
        # is by the stored scale, so the values are the nearest ones for the scale the index keeps
        stored = _round_up_to_bfloat16(scales)
        scales = stored.to(torch.float32)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = x / safe[..., None]
    if dtype == "int8":
        values = scaled.round().clamp_(-127, 127).to(storage)
    else:
        values = scaled.clamp_(-qmax, qmax).to(storage)
    return values, (stored if scale_dtype == torch.bfloat16 else scales)


def dequantized_queries(queries: torch.Tensor, dtype: str = "int8") -> torch.Tensor:
    """``queries`` quantised per token exactly like document tokens (:func:`quantize_tokens`, ``dtype`` "int8" or
    "fp8"), then dequantised to fp32: the queries that an index of that dtype with d <= 256 scores
    (docs/semantics.md)."""
    values, scales = quantize_tokens(queries, dtype)
    return values.float() * scales[..., None]


def queries_as_scored(queries: torch.Tensor, index: QuantizedDocuments) -> torch.Tensor:
    """The queries whose MaxSim against ``index.dequantize()`` ``flash_maxsim.maxsim(queries, index)`` computes:
    :func:`dequantized_queries` in the index's dtype where d <= 256, the queries themselves otherwise."""
    from .kernels import launch
    products = launch.eight_bit_products(index.values, index.scales, queries.shape[-1], save_aux=False)
    if products is not None:
        return dequantized_queries(queries, products)
    return queries
