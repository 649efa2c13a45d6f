"""The data types and dtype rules that the layout, the quantisation and the kernels share.

A leaf: it imports nothing of the package (only torch, and safetensors when an index is saved or loaded), so
that every layer can import it without a circle.

- :class:`PackedDocuments` and :class:`QuantizedDocuments` (saved and loaded by :meth:`QuantizedDocuments.save`
  and :meth:`QuantizedDocuments.load`, every field validated), the public document containers;
- :func:`offsets_longest`, the validation of packed offsets (the one host read it costs, once per tensor);
- :data:`SUPPORTED_DTYPES`, the floating-point dtypes scored;
- :func:`aux_dtype`, the dtype of the state the forward saves for the backward;
- :func:`quantize_tokens`, the per-token symmetric quantisation of an index and of the queries scored against
  one, and :func:`eight_bit_products`, when such queries are quantised at all.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import operator
import os
import pickle
import weakref
from dataclasses import dataclass
from typing import IO, NamedTuple, Optional, Sequence, Union

import torch

__all__ = ["SUPPORTED_DTYPES", "PackedDocuments", "QuantizedDocuments", "Documents", "DocumentsMask", "aux_dtype",
           "storage_dtype", "quantize_tokens", "eight_bit_products", "check_offsets_tensor", "offsets_longest",
           "remember_offsets", "known_longest"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# what torch.save / torch.load accept as a file
FileLike = Union[str, os.PathLike, IO[bytes]]


class PackedDocuments(NamedTuple):
    """Ragged documents without padding: ``values`` ``[sum Ld_t, d]``, ``offsets`` ``[T + 1]`` (int, starts at
    0, never decreases, ends at ``values.shape[0]``): document ``t`` is ``values[offsets[t]:offsets[t + 1]]``.
    ``max_length`` (optional): the longest document, checked against the offsets (a smaller one is an error).
    The offsets are validated on the host once per tensor (:func:`offsets_longest`); those that
    :func:`flash_maxsim.pack` makes need no read."""

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


# ------------------------------------------------------------------------------------------- packed offsets

# offsets tensors already validated, by id(): (weak reference, version counter then, rows, longest document). A
# tensor changed in place since (its version counter moved) is validated again; one without a version counter
# (made under torch.inference_mode) is validated on every use.
_VALIDATED_OFFSETS: dict[int, tuple[weakref.ref, int, int, int]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _VALIDATED_OFFSETS.get(key)
    if entry is not None and entry[0] is ref:
        del _VALIDATED_OFFSETS[key]


def _version(tensor: torch.Tensor) -> Optional[int]:
    try:
        return tensor._version
    except RuntimeError:          # an inference tensor
        return None


def remember_offsets(offsets: torch.Tensor, rows: int, longest: int) -> None:
    """Record ``offsets`` as valid for ``rows`` rows of values, ``longest`` its longest document: the caller built
    or checked them (:func:`flash_maxsim.pack`, :func:`offsets_longest`)."""
    version = _version(offsets)
    if version is None:
        return
    key = id(offsets)
    ref = weakref.ref(offsets, lambda r, key=key: _forget(key, r))
    _VALIDATED_OFFSETS[key] = (ref, version, int(rows), int(longest))


def known_longest(offsets: torch.Tensor, rows: int) -> Optional[int]:
    """The longest document of ``offsets`` if they were validated for ``rows`` rows and not changed since."""
    entry = _VALIDATED_OFFSETS.get(id(offsets))
    if entry is None or entry[0]() is not offsets or entry[2] != rows or entry[1] != _version(offsets):
        return None
    return entry[3]


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_offsets_tensor(offsets, name: str = "documents.offsets") -> None:
    """What packed offsets must be, short of their values: a dense 1-D integer tensor ``[T + 1]``."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.layout != torch.strided or offsets.is_nested:
        raise TypeError(f"`{name}` is a {offsets.layout} tensor; expected a dense (strided) one")
    if offsets.dim() != 1 or offsets.shape[0] < 1 or not _is_integer(offsets.dtype):
        shape = "x".join(str(s) for s in offsets.shape)
        raise ValueError(f"`{name}` has shape [{shape}], dtype {offsets.dtype}; expected an integer tensor [T + 1]")


def offsets_longest(offsets, rows: int, name: str = "documents.offsets",
                    rows_name: str = "documents.values") -> int:
    """The longest document of packed ``offsets`` over ``rows`` rows of values, after checking them: a 1-D integer
    tensor ``[T + 1]`` that starts at 0, never decreases and ends at ``rows``; or an error naming ``name``.

    Checking reads four numbers on the host (first, last, whether any step decreases, the longest step): on a
    GPU one small device-to-host copy, which waits for the work queued before it. It happens once per offsets
    tensor: a tensor validated before (or made by :func:`flash_maxsim.pack`) and unchanged since is not read
    again. Inside a CUDA-graph capture nothing can be read, so offsets not validated before are an error there."""
    check_offsets_tensor(offsets, name)
    tracing = torch.compiler.is_compiling()
    if not tracing:
        known = known_longest(offsets, rows)
        if known is not None:
            return known
        if offsets.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"`{name}` was not validated before this CUDA-graph capture, which cannot read it: "
                               "score once with these offsets before capturing (flash_maxsim.pack's need no read)")
    o = offsets.to(torch.int64)
    zero = o.new_zeros(())
    decreasing = (o[1:] < o[:-1]).any().to(torch.int64) if o.shape[0] > 1 else zero
    longest = (o[1:] - o[:-1]).max() if o.shape[0] > 1 else zero
    first, last, decreases, longest = torch.stack([o[0], o[-1], decreasing, longest]).tolist()
    if first != 0 or decreases or last != rows:
        raise ValueError(f"`{name}` must start at 0, never decrease and end at the number of rows of `{rows_name}` "
                         f"({rows}); got first={first}, last={last}" + (", a decreasing step" if decreases else ""))
    if not tracing:
        remember_offsets(offsets, rows, longest)
    return longest


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


# ------------------------------------------------------------------------------------------- index files
#
# Written: safetensors. No pickle at all; the tensors lie at aligned offsets after a JSON header, so a file can be
# memory-mapped; float8_e4m3fn is its F8_E4M3. The text fields are its __metadata__, with "sha256": a SHA-256 over
# those fields and every tensor's name, dtype, shape and bytes, checked on reading. Also read: the dict of tensors
# and plain values of the torch.save format (read with weights_only=True, so no pickled code runs), which carries
# no checksum. The checksum detects a damaged file (a flipped bit, a cut copy); it is no signature: a crafted file
# may carry a matching one, and is refused by the validation (_checked_index) instead.

INDEX_FORMAT = "flash_maxsim.QuantizedDocuments"
INDEX_VERSION = 1
INDEX_TENSORS = ("values", "scales", "offsets", "mask")


def _hash_tensor(h, t: torch.Tensor) -> None:
    """``h.update`` with the tensor's bytes in memory order (read in place through ctypes: no NumPy needed)."""
    flat = t.detach().to("cpu").contiguous()
    size = flat.numel() * flat.element_size()
    if size:
        h.update(memoryview((ctypes.c_ubyte * size).from_address(flat.data_ptr())))


def index_checksum(tensors: dict, fields: dict) -> str:
    """SHA-256 (hex) over the text ``fields`` and the ``tensors``' names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for key in sorted(fields):
        h.update(f"{key}={fields[key]}\n".encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{list(t.shape)}\n".encode())
        _hash_tensor(h, t)
    return h.hexdigest()


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError(f"saving and loading an index needs safetensors: pip install safetensors ({error})") \
            from error
    return safetensors


def _write_index(f: FileLike, state: dict) -> None:
    """Write ``state`` (``kind``, ``max_length`` and the :data:`INDEX_TENSORS`, None where absent) to ``f``, a
    path or a binary file."""
    safetensors = _safetensors()
    tensors = {}
    for name in INDEX_TENSORS:
        t = state[name]
        if t is not None:
            t = t.detach().to("cpu").contiguous()
            # safetensors refuses tensors that share memory or are views of a larger one: a copy of those
            tensors[name] = t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
    fields = {"format": INDEX_FORMAT, "version": str(INDEX_VERSION), "kind": state["kind"],
              "max_length": "" if state["max_length"] is None else str(state["max_length"])}
    fields["sha256"] = index_checksum(tensors, fields)
    if isinstance(f, (str, os.PathLike)):
        safetensors.torch.save_file(tensors, f, metadata=fields)
    else:
        f.write(safetensors.torch.save(tensors, metadata=fields))


def _is_safetensors(head: bytes) -> bool:
    """A safetensors file starts with its header's length (8 bytes, little-endian) and the header's ``{``."""
    return len(head) >= 9 and head[8:9] == b"{"


def _read_index(f: FileLike, map_location=None) -> dict:
    """The state :func:`_write_index` wrote (or the ``torch.save`` format held): ``format``, ``version``, ``kind``,
    ``max_length`` and the :data:`INDEX_TENSORS` (None where absent), on ``map_location`` (None: where they were
    saved; safetensors: the CPU). A file that cannot be decoded, or whose checksum does not match, is a
    ValueError."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as stream:
            head = stream.read(9)
        if _is_safetensors(head):
            return _read_safetensors(f, None, map_location)
        with open(f, "rb") as stream:
            return _read_torch_format(stream, map_location)
    start = f.tell()
    head = f.read(9)
    f.seek(start)
    if _is_safetensors(head):
        return _read_safetensors(None, f.read(), map_location)
    return _read_torch_format(f, map_location)


def _unreadable(error: Exception) -> ValueError:
    return ValueError(f"`f` could not be read as an index written by QuantizedDocuments.save "
                      f"({type(error).__name__}: {error})")


def _read_safetensors(path, data, map_location) -> dict:
    safetensors = _safetensors()
    try:
        if path is not None:
            with safetensors.safe_open(path, framework="pt", device="cpu") as opened:
                fields = opened.metadata() or {}
                tensors = {name: opened.get_tensor(name) for name in opened.keys()}
        else:
            tensors = safetensors.torch.load(data)
            size = int.from_bytes(data[:8], "little")
            fields = json.loads(data[8:8 + size]).get("__metadata__") or {}
    except Exception as error:          # any decoding failure of a damaged or foreign file
        raise _unreadable(error) from error
    if not isinstance(fields, dict) or fields.get("format") != INDEX_FORMAT:
        raise ValueError("`f` does not hold an index written by QuantizedDocuments.save")
    unexpected = sorted(set(tensors) - set(INDEX_TENSORS))
    if unexpected:
        raise ValueError(f"`f` holds tensors {unexpected} besides an index's {list(INDEX_TENSORS)}")
    stored = fields.get("sha256")
    expected = index_checksum(tensors, {k: v for k, v in fields.items() if k != "sha256"})
    if stored != expected:
        raise ValueError("`f` holds an index whose checksum does not match its contents: the file is damaged "
                         "(or was altered after it was written)")
    try:
        version = int(fields.get("version", ""))
        max_length = None if fields.get("max_length", "") == "" else int(fields["max_length"])
    except ValueError as error:
        raise _unreadable(error) from error
    state = {"format": INDEX_FORMAT, "version": version, "kind": fields.get("kind"), "max_length": max_length}
    for name in INDEX_TENSORS:
        t = tensors.get(name)
        state[name] = t if t is None or map_location is None else t.to(map_location)
    return state


def _read_torch_format(stream, map_location) -> dict:
    try:
        state = torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"`f` does not hold an index written by QuantizedDocuments.save (for an object saved with "
                         f"torch.save(index, f), use torch.load(f, weights_only=False) on a trusted file): "
                         f"{error}") from error
    except Exception as error:          # any decoding failure of a damaged or foreign file
        raise _unreadable(error) from error
    if not isinstance(state, dict) or state.get("format") != INDEX_FORMAT:
        raise ValueError("`f` does not hold an index written by QuantizedDocuments.save (for an object saved with "
                         "torch.save(index, f), use torch.load(f, weights_only=False) on a trusted file)")
    unexpected = sorted(set(state) - {"format", "version", "kind", "max_length", *INDEX_TENSORS})
    if unexpected:
        raise ValueError(f"`f` holds entries {unexpected} besides an index's")
    return {key: state.get(key) for key in ("format", "version", "kind", "max_length", *INDEX_TENSORS)}


def _checked_index(values, scales, offsets, mask, max_length, kind, source: str) -> Optional[int]:
    """Check an index's fields against each other, as :meth:`QuantizedDocuments.save` writes them and
    :meth:`QuantizedDocuments.load` reads them (``source`` names where they came from in the errors); returns its
    ``max_length``: the longest document for the packed layout (a stored one smaller is an error), else None."""
    if kind not in ("int8", "fp8"):
        raise ValueError(f"{source}: `kind` must be 'int8' or 'fp8', got {kind!r}")
    storage = storage_dtype(kind)
    for name, t in (("values", values), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{source}: `{name}` must be a tensor, got {type(t).__name__}")
    for name, t in (("offsets", offsets), ("mask", mask)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{source}: `{name}` must be a tensor or None, got {type(t).__name__}")
    shape = (lambda t: "[" + ", ".join(str(n) for n in t.shape) + "]")
    if values.dtype != storage:
        raise ValueError(f"{source}: a {kind!r} index's `values` must be {storage}, got {values.dtype}")
    if values.dim() not in ((2,) if offsets is not None else (3, 4)) or values.shape[-1] < 1:
        want = "[sum Ld, d] (packed, with offsets)" if offsets is not None else "[B, Ld, d] or [Nq, K, Ld, d]"
        raise ValueError(f"{source}: `values` has shape {shape(values)}; expected {want}, d >= 1")
    if not scales.dtype.is_floating_point:
        raise ValueError(f"{source}: `scales` has dtype {scales.dtype}; expected a real floating-point dtype "
                         "(bfloat16 or float32)")
    if tuple(scales.shape) != tuple(values.shape[:-1]):
        raise ValueError(f"{source}: `scales` has shape {shape(scales)}; expected the values' shape {shape(values)} "
                         "without its last axis")
    for name, t in (("scales", scales), ("offsets", offsets), ("mask", mask)):
        if t is not None and t.device != values.device:
            raise ValueError(f"{source}: `{name}` is on {t.device} but `values` on {values.device}")
    if not bool(torch.isfinite(scales.to(torch.float32)).all()):
        raise ValueError(f"{source}: `scales` holds a NaN or infinite scale")
    if mask is not None:
        if mask.dtype.is_complex or tuple(mask.shape) != tuple(values.shape[:-1]):
            raise ValueError(f"{source}: `mask` has shape {shape(mask)}, dtype {mask.dtype}; expected bool or a real "
                             f"0/1 dtype, shaped like `scales` {shape(scales)}")
    if max_length is not None:
        try:
            value = operator.index(max_length)
        except TypeError:
            value = -1
        if value < 0 or isinstance(max_length, bool):
            raise ValueError(f"{source}: `max_length` must be an int >= 0 or None, got {max_length!r}")
        max_length = value
    if offsets is None:
        if max_length is not None:
            raise ValueError(f"{source}: `max_length` is {max_length} without `offsets`; it belongs to the packed "
                             "layout")
        return None
    try:
        longest = offsets_longest(offsets, values.shape[0], "offsets", "values")
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None
    if max_length is not None and max_length < longest:
        raise ValueError(f"{source}: `max_length` is {max_length} but the longest document has {longest} tokens")
    return longest


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
        offsets = move(self.offsets)
        if offsets is not None and offsets is not self.offsets:
            # validated offsets stay validated on the new device: no host read there
            longest = known_longest(self.offsets, self.values.shape[0])
            if longest is not None:
                remember_offsets(offsets, self.values.shape[0], longest)
        return QuantizedDocuments(self.values.to(device), self.scales.to(device), offsets, move(self.mask),
                                  self.max_length, self.kind)

    def save(self, f: FileLike) -> None:
        """Write the index to ``f`` (a path or a binary file) as safetensors: no pickle, memory-mappable, with a
        SHA-256 checksum of its contents that :meth:`load` verifies. The fields are validated first, as
        :meth:`load` validates them. (``torch.save(index, f)`` of the object itself works too, but reading that
        back needs ``weights_only=False`` or ``torch.serialization.safe_globals([QuantizedDocuments])``.)"""
        max_length = _checked_index(self.values, self.scales, self.offsets, self.mask, self.max_length, self.kind,
                                    "QuantizedDocuments")
        _write_index(f, {"kind": self.kind, "max_length": max_length, "values": self.values, "scales": self.scales,
                         "offsets": self.offsets, "mask": self.mask})

    @classmethod
    def load(cls, f: FileLike, map_location: Union[None, str, torch.device] = None) -> QuantizedDocuments:
        """The index that :meth:`save` wrote to ``f`` (or an index in the ``torch.save`` format, a dict of tensors
        and plain values, read with ``weights_only=True``), validated completely: its checksum, the kind, the
        dtypes and shapes of its tensors against each other, finite scales, and the offsets (start at 0, never
        decrease, end at the values' rows; ``max_length`` the longest document). Anything else is a ValueError.
        ``map_location`` as in ``torch.load`` (e.g. ``"cpu"``)."""
        state = _read_index(f, map_location)
        if state["version"] != INDEX_VERSION:
            raise ValueError(f"`f` holds an index in save format version {state['version']}; this flash_maxsim "
                             f"reads version {INDEX_VERSION}")
        max_length = _checked_index(state["values"], state["scales"], state["offsets"], state["mask"],
                                    state["max_length"], state["kind"], "the index in `f`")
        return cls(state["values"], state["scales"], state["offsets"], state["mask"], max_length, state["kind"])

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
