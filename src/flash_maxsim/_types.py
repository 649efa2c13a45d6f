"""The data types and dtype rules that the layout, the quantisation and the kernels share.

A leaf: it imports nothing of the package (only torch), so that every layer can import it without a circle.

- :class:`PackedDocuments` and :class:`QuantizedDocuments` (with its file format, :meth:`QuantizedDocuments.save`
  and :meth:`QuantizedDocuments.load`), the public document containers;
- :data:`SUPPORTED_DTYPES`, the floating-point dtypes scored;
- :func:`aux_dtype`, the dtype of the state the forward saves for the backward;
- :func:`quantize_tokens`, the per-token symmetric quantisation of an index and of the queries scored against
  one, and :func:`eight_bit_products`, when such queries are quantised at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import IO, NamedTuple, Optional, Sequence, Union

import torch

__all__ = ["SUPPORTED_DTYPES", "PackedDocuments", "QuantizedDocuments", "Documents", "DocumentsMask", "aux_dtype",
           "storage_dtype", "quantize_tokens", "eight_bit_products"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# what torch.save / torch.load accept as a file
FileLike = Union[str, os.PathLike, IO[bytes]]


class PackedDocuments(NamedTuple):
    """Ragged documents without padding: ``values`` ``[sum Ld_t, d]``, ``offsets`` ``[T + 1]`` (int, starts at
    0, non-decreasing): document ``t`` is ``values[offsets[t]:offsets[t + 1]]``. ``max_length`` (optional) is
    the longest document; given, it saves one device-to-host read in the backward."""

    values: torch.Tensor
    offsets: torch.Tensor
    max_length: Optional[int] = None


# the documents' layouts that maxsim, quantize and reference.maxsim accept: [B, Ld, d] or [Nq, K, Ld, d], a list of
# [Ld_i, d], PackedDocuments or a (values, offsets[, max_length]) tuple; and their masks (one [Ld_i] per listed one)
Documents = Union[torch.Tensor, Sequence[torch.Tensor], PackedDocuments,
                  tuple[torch.Tensor, torch.Tensor, Optional[int]]]
DocumentsMask = Union[None, torch.Tensor, Sequence[Union[torch.Tensor, Sequence[int], Sequence[bool]]]]


def aux_dtype(smooth_tau: Optional[float], max_length: int) -> torch.dtype:
    """dtype of the state the forward saves for the backward, per (query, document, query token): the row's
    log-sum-exp (smooth max, fp32) or the arg-max token index (hard max; -1 = no gradient), int16 while every
    index fits (documents of at most 32767 tokens: half the memory), int32 beyond."""
    if smooth_tau is not None:
        return torch.float32
    return torch.int16 if max_length <= 32767 else torch.int32


# ------------------------------------------------------------------------------------------- quantisation

_QMAX = {"int8": 127.0, "fp8": 448.0}


def storage_dtype(kind: str) -> torch.dtype:
    """The values' dtype of an index of this kind (``"int8"`` or ``"fp8"``), or an error naming what is wrong."""
    if kind == "int8":
        return torch.int8
    if kind == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise TypeError("`dtype='fp8'` needs a PyTorch build with torch.float8_e4m3fn")
        return torch.float8_e4m3fn
    raise ValueError(f"`dtype` must be 'int8' or 'fp8', got {kind!r}")


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
    storage = storage_dtype(dtype)
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


def eight_bit_products(documents: torch.Tensor, document_scales: Optional[torch.Tensor], d: int, save_aux: bool,
                       *, int8: bool = True, fp8: bool = True) -> Optional[str]:
    """``"int8"`` or ``"fp8"`` where quantized documents are scored with 8-bit x 8-bit tensor-core products, each
    query token quantised like a document token (:func:`quantize_tokens`), rather than converted to the queries'
    dtype; None otherwise. Only with the whole feature axis in one tile (d <= 256), scoring only; ``int8`` /
    ``fp8`` False turn the products off for that format (the kernels' tuning switch). int8 products are faster
    than the conversion on every shape measured: 0.361 against 0.507 ms on an H200 (1 query x 10k documents,
    32 x 1030 tokens, d=128)."""
    if document_scales is None or d > 256 or save_aux:
        return None
    if documents.dtype == torch.int8 and int8:
        return "int8"
    if documents.dtype == getattr(torch, "float8_e4m3fn", None) and fp8:
        return "fp8"
    return None


# the file QuantizedDocuments.save writes: a dict of tensors and plain values, tagged so that load() knows its own
_SAVE_FORMAT = "flash_maxsim.QuantizedDocuments"
_SAVE_VERSION = 1


@dataclass
class QuantizedDocuments:
    """Quantised documents in one of the layouts :func:`flash_maxsim.maxsim` accepts.

    ``values``: int8 / float8_e4m3fn, ``[B, Ld, d]``, ``[Nq, K, Ld, d]`` or packed ``[sum Ld, d]``;
    ``scales``: bf16 or fp32 (:func:`flash_maxsim.quantize` makes bf16 for int8, fp32 for fp8), shaped like
    ``values`` minus the feature axis;
    ``offsets``: ``[B + 1]`` for the packed layout; ``mask``: the documents mask given to
    :func:`flash_maxsim.quantize` (used when ``maxsim`` gets none).
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
        """The device of the index's tensors."""
        return self.values.device

    def to(self, device: Union[str, torch.device]) -> QuantizedDocuments:
        """The index with every tensor on ``device``."""
        move = (lambda t: None if t is None else t.to(device))
        return QuantizedDocuments(self.values.to(device), self.scales.to(device), move(self.offsets),
                                  move(self.mask), self.max_length, self.kind)

    def save(self, f: FileLike) -> None:
        """Write the index to ``f`` (a path or a binary file) through ``torch.save``, as tensors and plain values
        only, so that :meth:`load` reads it back under ``torch.load``'s default ``weights_only=True``: loading an
        index runs no pickled code. (``torch.save(index, f)`` of the object itself works too, but reading that
        back needs ``weights_only=False`` or ``torch.serialization.safe_globals([QuantizedDocuments])``.)"""
        torch.save({"format": _SAVE_FORMAT, "version": _SAVE_VERSION, "kind": self.kind, "values": self.values,
                    "scales": self.scales, "offsets": self.offsets, "mask": self.mask,
                    "max_length": self.max_length}, f)

    @classmethod
    def load(cls, f: FileLike, map_location: Union[None, str, torch.device] = None) -> QuantizedDocuments:
        """The index that :meth:`save` wrote to ``f``; ``map_location`` as in ``torch.load`` (e.g. ``"cpu"``)."""
        state = torch.load(f, map_location=map_location, weights_only=True)
        if not isinstance(state, dict) or state.get("format") != _SAVE_FORMAT:
            raise ValueError("`f` does not hold an index written by QuantizedDocuments.save (for an object saved "
                             "with torch.save(index, f), use torch.load(f, weights_only=False) on a trusted file)")
        if state.get("version") != _SAVE_VERSION:
            raise ValueError(f"`f` holds an index in save format version {state.get('version')}; this flash_maxsim "
                             f"reads version {_SAVE_VERSION}")
        if state["values"].dtype != storage_dtype(state["kind"]):
            raise ValueError(f"`f` holds a {state['kind']!r} index whose values are {state['values'].dtype}")
        return cls(state["values"], state["scales"], state["offsets"], state["mask"], state["max_length"],
                   state["kind"])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Union[torch.Tensor, PackedDocuments]:
        """The approximated documents in ``dtype``, in the layout they were given (packed -> PackedDocuments)."""
        dense = (self.values.to(torch.float32) * self.scales.to(torch.float32)[..., None]).to(dtype)
        if self.offsets is not None:
            return PackedDocuments(dense, self.offsets, self.max_length)
        return dense


# pickles name a class by its module: these are the modules that export them to callers, so that objects pickled
# (and torch.serialization.safe_globals entries written) against those paths keep loading
PackedDocuments.__module__ = "flash_maxsim._layout"
QuantizedDocuments.__module__ = "flash_maxsim.quantization"
