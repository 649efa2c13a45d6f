"""A document index for exact MaxSim search: :class:`DocumentIndex`.

Documents are kept packed (only their valid tokens) in shards: each shard a values tensor ``[tokens, d]`` in the
index's storage dtype (int8 / fp8 with one scale per token, the rule of :func:`flash_maxsim.quantize`), its
offsets (on the host, and on the scoring device) and its documents' ids. A search streams chunks of every shard
through the scoring path and the running top-k of :func:`flash_maxsim.search`, so it returns exactly what
``flash_maxsim.search`` returns over the live documents in insertion order.

Where the shards live (``placement``):

- ``"cpu"``, ``"cuda"``, ``"cuda:N"``: one device, scored where they are;
- a list of devices, or ``"cuda:all"``: new shards go to the device holding the fewest bytes; every device scores
  its own shards (launches are asynchronous, so the devices work at the same time) and the per-device top k are
  merged by score, then position;
- ``"host"``: pinned host memory, copied chunk by chunk to ``stream_device`` on a side stream into two device
  buffers used in turn, so that copying chunk i + 1 overlaps scoring chunk i;
- ``"disk"``: shard files under ``path`` (safetensors, memory-mapped), streamed like ``"host"`` through two
  pinned staging buffers.

A saved index is a directory: ``manifest.json`` (format, version, dim, storage, the shards with their SHA-256,
the ids) and one safetensors file per shard (tensors ``offsets``, ``scales`` for 8-bit storage, ``values``).
Loading validates every field a file from elsewhere can get wrong before any of it is scored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import operator
import os
import re
from collections.abc import Iterable
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ._layout import Problem, _check_document_list, _is_packed, _shape, canonicalize
from ._search import RunningTopK, check_chunk_size, check_k, default_chunk_size, merge_top_k
from ._types import SUPPORTED_DTYPES, PackedDocuments, offsets_longest, quantize_tokens
from .ops import scores as _scores

__all__ = ["DocumentIndex", "IndexSearchResult", "STORAGES", "FORMAT", "VERSION", "MANIFEST"]

logger = logging.getLogger(__name__)

FORMAT = "flash_maxsim.DocumentIndex"
VERSION = 1
MANIFEST = "manifest.json"
SHARD_FORMAT = FORMAT + ".shard"

Id = Union[int, str]

_FP8 = getattr(torch, "float8_e4m3fn", None)
# storage name -> values dtype (8-bit ones: the dtype of flash_maxsim.quantize's values)
STORAGES: dict[str, Optional[torch.dtype]] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                              "fp32": torch.float32, "int8": torch.int8, "fp8": _FP8}
# the scales of an 8-bit index: as flash_maxsim.quantize makes them (bf16 for int8, fp32 for fp8)
_SCALES = {"int8": torch.bfloat16, "fp8": torch.float32}
# safetensors' dtype names
_FILE_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int8: "I8",
                torch.int64: "I64"}
if _FP8 is not None:
    _FILE_DTYPES[_FP8] = "F8_E4M3"

DEFAULT_SHARD_BYTES = 1 << 32          # 4 GiB of values a shard: few launches per search over a resident corpus
DEFAULT_STREAM_BYTES = 1 << 28         # 256 MiB of values a streamed chunk (two such buffers on the device)
_MAX_HEADER = 100 << 20                # safetensors' own bound on a header
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class IndexSearchResult(NamedTuple):
    """The top k of :meth:`DocumentIndex.search`: ``scores`` ``[Nq, k']`` float32 (descending), ``ids`` (one list
    per query, or one list for a ``[Lq, d]`` query), ``positions`` ``[Nq, k']`` int64, each document's place in
    insertion order among the live documents (``index.ids[position]`` is its id)."""

    scores: Tensor
    ids: list
    positions: Tensor


# ------------------------------------------------------------------------------------------- small helpers

def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _empty(shape, dtype, device, pin: bool) -> Tensor:
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.empty(shape, dtype=dtype, device=device)


class _Buffer:
    """A tensor grown along dim 0 by appending (capacity doubling up to ``limit`` rows); ``data`` is the filled
    part, a view."""

    def __init__(self, tail: tuple, dtype: torch.dtype, device: torch.device, pin: bool = False,
                 limit: Optional[int] = None, data: Optional[Tensor] = None):
        self.tail, self.dtype, self.device, self.pin, self.limit = tail, dtype, device, pin, limit
        self._buf = data if data is not None else _empty((0, *tail), dtype, device, pin)
        self.size = self._buf.shape[0]

    @property
    def data(self) -> Tensor:
        return self._buf[:self.size]

    def append(self, x: Tensor) -> None:
        need = self.size + x.shape[0]
        if need > self._buf.shape[0]:
            capacity = max(need, 2 * self._buf.shape[0], 16)
            if self.limit is not None:
                capacity = max(need, min(capacity, self.limit))
            grown = _empty((capacity, *self.tail), self.dtype, self.device, self.pin)
            grown[:self.size].copy_(self._buf[:self.size])
            self._buf = grown
        self._buf[self.size:need].copy_(x)
        self.size = need

    def trim(self) -> None:
        """Drop the spare capacity (a copy, when there is any)."""
        if self._buf.shape[0] != self.size:
            exact = _empty((self.size, *self.tail), self.dtype, self.device, self.pin)
            exact.copy_(self._buf[:self.size])
            self._buf = exact

    @property
    def nbytes(self) -> int:
        return self._buf.numel() * self._buf.element_size()


class _Shard:
    """Packed documents: ``values`` ``[T, d]`` (+ ``scales`` ``[T]`` for 8-bit storage) where the placement keeps
    them, ``offsets`` ``[n + 1]`` on the host (and a copy on the scoring device), the documents' ids and which of
    them were removed."""

    def __init__(self, dim: int, storage: str, device: torch.device, score_device: torch.device, pin: bool,
                 token_limit: Optional[int]):
        self.dim, self.storage, self.device, self.score_device, self.pin = dim, storage, device, score_device, pin
        self.values = _Buffer((dim,), STORAGES[storage], device, pin, token_limit)
        self.scales = _Buffer((), _SCALES[storage], device, pin, token_limit) if storage in _SCALES else None
        self.offsets = _Buffer((), torch.int64, torch.device("cpu"))
        self.offsets.append(torch.zeros(1, dtype=torch.int64))
        self.removed = _Buffer((), torch.bool, torch.device("cpu"))
        self.removed_count = 0
        self.ids: list = []
        self.file: Optional[str] = None        # the file it is mapped from (disk placement), a path
        self.sha256: Optional[str] = None
        self.sealed = False
        self.slot = 0                          # which of the placement's devices holds it
        self._cache: dict = {}

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def live(self) -> int:
        return len(self.ids) - self.removed_count

    @property
    def tokens(self) -> int:
        return self.values.size

    @property
    def nbytes(self) -> int:
        total = self.values.data.numel() * self.values.data.element_size() + self.offsets.data.numel() * 8
        if self.scales is not None:
            total += self.scales.data.numel() * self.scales.data.element_size()
        return total

    def append(self, values: Tensor, scales: Optional[Tensor], lengths: Tensor, ids: list) -> None:
        end = self.offsets.data[-1]
        self.values.append(values)
        if self.scales is not None:
            self.scales.append(scales)
        self.offsets.append(end + lengths.cumsum(0))
        self.removed.append(torch.zeros(len(ids), dtype=torch.bool))
        self.ids.extend(ids)
        self._cache.clear()

    def seal(self) -> None:
        self.values.trim()
        if self.scales is not None:
            self.scales.trim()
        self.sealed = True

    def remove_rows(self, rows: list[int]) -> None:
        self.removed.data[rows] = True
        self.removed_count += len(rows)
        self._cache.clear()

    # --- what a search needs, cached until the shard changes
    def device_offsets(self) -> Tensor:
        """The offsets on the scoring device."""
        if "offsets" not in self._cache:
            host = self.offsets.data
            self._cache["offsets"] = host if self.score_device.type == "cpu" else host.to(self.score_device)
        return self._cache["offsets"]

    def lengths(self) -> Tensor:
        if "lengths" not in self._cache:
            o = self.offsets.data
            self._cache["lengths"] = o[1:] - o[:-1]
        return self._cache["lengths"]

    def live_ranks(self) -> Tensor:
        """Each document's rank among the shard's live documents, on the scoring device (removed ones: -1)."""
        if "ranks" not in self._cache:
            keep = ~self.removed.data
            ranks = torch.where(keep, keep.cumsum(0) - 1, -1)
            self._cache["ranks"] = ranks.to(self.score_device)
            self._cache["removed"] = self.removed.data.to(self.score_device)
        return self._cache["ranks"]

    def device_removed(self) -> Tensor:
        self.live_ranks()
        return self._cache["removed"]

    def plan(self, max_docs: int, max_tokens: Optional[int]) -> list[tuple[int, int, int, int, int]]:
        """Chunks ``(s, e, t0, t1, longest)``: documents ``s:e`` (at most ``max_docs``, and at most ``max_tokens``
        tokens unless one document alone has more), tokens ``t0:t1``, the longest document; from the host
        offsets, with no read of the device."""
        key = ("plan", max_docs, max_tokens)
        if key in self._cache:
            return self._cache[key]
        o = self.offsets.data
        n = self.count
        chunks = []
        s = 0
        while s < n:
            e = min(n, s + max_docs)
            if max_tokens is not None:
                fits = int(torch.searchsorted(o, o[s:s + 1] + max_tokens, right=True)[0]) - 1
                e = max(s + 1, min(e, fits))
            chunks.append((s, e))
            s = e
        lengths = self.lengths()
        bounds = o[torch.tensor([c[0] for c in chunks] + [n], dtype=torch.int64)].tolist()
        out = []
        for i, (s, e) in enumerate(chunks):
            longest = int(lengths[s:e].max()) if e > s else 0
            out.append((s, e, bounds[i], bounds[i + 1], longest))
        self._cache[key] = out
        return out

    def live_mask_tokens(self) -> Tensor:
        """[T] bool: the tokens of live documents."""
        return torch.repeat_interleave(~self.removed.data, self.lengths())

    def live_tensors(self) -> dict:
        """The shard's live documents as CPU tensors (``offsets``, ``values``, ``scales``), for writing."""
        values = self.values.data
        scales = None if self.scales is None else self.scales.data
        offsets = self.offsets.data
        if self.removed_count:
            keep = self.live_mask_tokens()
            values = values[keep.to(values.device)]
            scales = None if scales is None else scales[keep.to(scales.device)]
            lengths = self.lengths()[~self.removed.data]
            offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
            offsets[1:] = lengths.cumsum(0)
        tensors = {"offsets": _owned(offsets), "values": _owned(values)}
        if scales is not None:
            tensors["scales"] = _owned(scales)
        return tensors


def _owned(t: Tensor) -> Tensor:
    """``t`` on the CPU in a storage of its own (safetensors refuses views of a larger storage: a mapped file, a
    shard's buffer)."""
    t = t.to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


# ------------------------------------------------------------------------------------------- argument checks

def _check_storage(storage) -> str:
    if storage not in STORAGES:
        raise ValueError(f"`storage` must be one of {sorted(STORAGES)}, got {storage!r}")
    if STORAGES[storage] is None:
        raise TypeError("`storage='fp8'` needs a PyTorch build with torch.float8_e4m3fn")
    return storage


def _check_dim(dim) -> int:
    if isinstance(dim, bool):
        raise ValueError(f"`dim` must be an int >= 1, got {dim!r}")
    try:
        value = operator.index(dim)
    except TypeError:
        raise ValueError(f"`dim` must be an int >= 1, got {type(dim).__name__}") from None
    if value < 1:
        raise ValueError(f"`dim` must be an int >= 1, got {value}")
    return value


def _check_bytes(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"`{name}` must be an int >= 1, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value}")
    return value


def _cuda_device(name: str, value) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"`{name}` has {value!r}, which is not a device") from None
    if device.type == "cuda":
        if not _cuda_available():
            raise ValueError(f"`{name}` asks for {value!r} but CUDA is not available")
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"`{name}` asks for {value!r} but this process sees {torch.cuda.device_count()} GPU(s)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"`{name}` must name a CUDA device or the CPU, got {value!r}")
    return device


def _parse_placement(placement, stream_device, path) -> tuple[str, list[torch.device], torch.device, bool]:
    """(kind, storage devices, scoring device of streamed shards, pinned)."""
    streamed = placement in ("host", "disk")
    if stream_device is not None and not streamed:
        raise ValueError(f"`stream_device` applies to placement 'host' or 'disk', not {placement!r}")
    if path is not None and placement != "disk":
        raise ValueError(f"`path` applies to placement 'disk', not {placement!r}")
    if streamed:
        if stream_device is None:
            stream = torch.device("cuda", torch.cuda.current_device()) if _cuda_available() else torch.device("cpu")
        else:
            stream = _cuda_device("stream_device", stream_device)
        pin = placement == "host" and _cuda_available()
        if placement == "host" and not pin:
            logger.warning("DocumentIndex(placement='host'): pinned host memory needs CUDA, which is not available; "
                           "the index is kept in ordinary host memory and scored on the CPU")
        if placement == "disk" and path is None:
            raise ValueError("placement='disk' needs `path`, the directory that holds the shard files")
        return placement, [torch.device("cpu")], stream, pin
    if isinstance(placement, (list, tuple)):
        if not placement:
            raise ValueError("`placement` is an empty list; expected one or more devices")
        devices = [_cuda_device(f"placement[{i}]", p) for i, p in enumerate(placement)]
        gpus = [d for d in devices if d.type == "cuda"]
        if len(set(gpus)) != len(gpus):
            # the CPU may be listed more than once: slots scored one after the other (a test of the merge)
            raise ValueError(f"`placement` lists a GPU twice: {list(map(str, devices))}")
        return "devices", devices, devices[0], False
    if placement == "cuda:all":
        if not _cuda_available():
            raise ValueError("`placement='cuda:all'` needs CUDA, which is not available")
        return "devices", [torch.device("cuda", i) for i in range(torch.cuda.device_count())], \
            torch.device("cuda", 0), False
    if isinstance(placement, (str, torch.device)):
        device = _cuda_device("placement", placement)
        return device.type, [device], device, False
    raise ValueError(f"`placement` must be 'cpu', 'cuda', 'cuda:N', 'cuda:all', a list of devices, 'host' or "
                     f"'disk', got {placement!r}")


def _as_id(name: str, value) -> Id:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise TypeError(f"`{name}` is a bool; ids are ints or strings")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"`{name}` is a {type(value).__name__}; ids are ints or strings") from None


def _id_list(ids, name: str = "ids") -> list:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Iterable, Tensor)):
        raise TypeError(f"`{name}` must be a list of ints or strings, got {type(ids).__name__}")
    if isinstance(ids, Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"`{name}` as a tensor must be 1-D of an integer dtype, got [{_shape(ids)}] {ids.dtype}")
        ids = ids.tolist()
    return [_as_id(f"{name}[{i}]", v) for i, v in enumerate(ids)]


# ------------------------------------------------------------------------------------------- the embeddings added

def _packed_embeddings(embeddings, mask, dim: int) -> tuple[Tensor, Tensor]:
    """``(values [T, d] of the valid tokens, lengths [B] int64 on the CPU)`` from any accepted form, validated."""
    if isinstance(embeddings, (list, tuple)) and not _is_packed(embeddings):
        docs = list(embeddings)
        if not docs:
            if mask is not None and len(mask) != 0:
                raise ValueError("`mask` has entries but `embeddings` is an empty list")
            return torch.zeros(0, dim), torch.zeros(0, dtype=torch.int64)
        _check_document_list(docs)
        lengths = torch.tensor([x.shape[0] for x in docs], dtype=torch.int64)
        values = torch.cat(docs, 0)
        if mask is not None:
            if isinstance(mask, Tensor):
                flat = mask
            else:
                if not isinstance(mask, (list, tuple)) or len(mask) != len(docs):
                    raise ValueError(f"`mask` must hold one [L_i] mask per document ({len(docs)})")
                for i, (m, n) in enumerate(zip(mask, lengths.tolist())):
                    if not isinstance(m, Tensor) or m.dim() != 1 or m.shape[0] != n:
                        raise ValueError(f"`mask[{i}]` must be a [{n}] tensor, the length of embeddings[{i}]; got "
                                         f"{type(m).__name__} [{_shape(m)}]")
                flat = torch.cat([m.to(values.device) for m in mask]) if mask else None
            mask = flat
    elif _is_packed(embeddings):
        values, offsets = embeddings[0], embeddings[1]
        if not isinstance(values, Tensor) or values.dim() != 2:
            raise ValueError(f"`embeddings.values` has shape [{_shape(values)}]; expected [sum L_i, d]")
        offsets_longest(offsets, values.shape[0], "embeddings.offsets", "embeddings.values")
        o = offsets.to("cpu", torch.int64)
        lengths = o[1:] - o[:-1]
    elif isinstance(embeddings, Tensor):
        if embeddings.dim() != 3:
            raise ValueError(f"`embeddings` has shape [{_shape(embeddings)}]; expected [B, L, d], a list of "
                             "[L_i, d] tensors or PackedDocuments")
        B, L = embeddings.shape[:2]
        values = embeddings.reshape(B * L, embeddings.shape[2])
        lengths = torch.full((B,), L, dtype=torch.int64)
        if mask is not None:
            if not isinstance(mask, Tensor) or tuple(mask.shape) != (B, L):
                raise ValueError(f"`mask` must be a [{B}, {L}] tensor for embeddings [{_shape(embeddings)}], got "
                                 f"{type(mask).__name__} [{_shape(mask)}]")
            mask = mask.reshape(B * L)
    else:
        raise TypeError(f"`embeddings` must be a [B, L, d] tensor, a list of [L_i, d] tensors or PackedDocuments, "
                        f"got {type(embeddings).__name__}")
    if values.layout != torch.strided or values.is_nested:
        raise TypeError("`embeddings` must be dense (strided) tensors")
    if not values.dtype.is_floating_point:
        raise TypeError(f"`embeddings` has dtype {values.dtype}; expected a floating-point dtype")
    if values.shape[-1] != dim:
        raise ValueError(f"`embeddings` has feature size {values.shape[-1]}; the index has dim={dim}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dim() != 1 or mask.shape[0] != values.shape[0]:
            raise ValueError(f"`mask` must be one mask value per token ({values.shape[0]}), got [{_shape(mask)}]")
        if mask.dtype.is_complex:
            raise TypeError(f"`mask` has dtype {mask.dtype}; expected bool or a real 0/1 dtype")
        keep = (mask != 0).to(values.device)
        # kept tokens per document: differences of the running count of kept tokens at the documents' ends
        running = torch.zeros(values.shape[0] + 1, dtype=torch.int64)
        running[1:] = keep.to("cpu", torch.int64).cumsum(0)
        ends = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
        ends[1:] = lengths.cumsum(0)
        lengths = running[ends[1:]] - running[ends[:-1]]
        values = values[keep]
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise ValueError("`embeddings` holds a NaN or infinite value in a valid token")
    return values, lengths


# ------------------------------------------------------------------------------------------- shard files

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 24)
            if not block:
                return h.hexdigest()
            h.update(block)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError(f"saving and loading a DocumentIndex needs safetensors: pip install safetensors ({error})") \
            from error
    return safetensors.torch


def _expected_tensors(storage: str, dim: int, documents: int, tokens: int) -> dict:
    expected = {"offsets": (torch.int64, [documents + 1]), "values": (STORAGES[storage], [tokens, dim])}
    if storage in _SCALES:
        expected["scales"] = (_SCALES[storage], [tokens])
    return expected


def _map_shard(path: str, name: str, storage: str, dim: int, documents: int, tokens: int) -> dict:
    """The tensors of shard file ``path`` memory-mapped, after checking its header against what the manifest says:
    the tensors' names, dtypes and shapes, their byte ranges tiling the data section exactly (a truncated or
    padded file fails here), and alignment."""
    def bad(field: str, what: str) -> ValueError:
        return ValueError(f"{name}: `{field}` {what}")

    size = os.path.getsize(path)
    if size < 8:
        raise bad("header", f"is missing: the file has {size} bytes (truncated?)")
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > min(size - 8, _MAX_HEADER):
            raise bad("header", f"claims {length} bytes but the file has {size} (truncated or not a safetensors file)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad("header", f"is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise bad("header", "is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT or meta.get("version") != str(VERSION):
        raise bad("__metadata__", f"does not name format {SHARD_FORMAT!r} version {VERSION}: {meta!r}")
    expected = _expected_tensors(storage, dim, documents, tokens)
    if set(header) != set(expected):
        raise bad("tensors", f"are {sorted(header)}; expected {sorted(expected)}")
    start = 8 + length
    data_size = size - start
    spans = []
    for tensor, (dtype, shape) in expected.items():
        entry = header[tensor]
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(tensor, f"has header entry {entry!r}; expected dtype, shape and data_offsets")
        if entry["dtype"] != _FILE_DTYPES[dtype]:
            raise bad(tensor, f"has dtype {entry['dtype']!r}; a {storage} index stores {_FILE_DTYPES[dtype]}")
        if entry["shape"] != shape:
            raise bad(tensor, f"has shape {entry['shape']!r}; the manifest's documents={documents}, "
                              f"tokens={tokens} and dim={dim} make it {shape}")
        offsets = entry["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(v) is int for v in offsets)):
            raise bad(tensor, f"has data_offsets {offsets!r}; expected [begin, end]")
        begin, end = offsets
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if not 0 <= begin <= end or end - begin != numel * itemsize:
            raise bad(tensor, f"has data_offsets {offsets} for {numel} elements of {itemsize} bytes")
        if end > data_size:
            raise bad(tensor, f"ends at byte {end} of the data but the file holds {data_size} (truncated)")
        if (start + begin) % itemsize:
            raise bad(tensor, f"starts at file byte {start + begin}, not a multiple of its {itemsize}-byte items")
        spans.append((begin, end, tensor, dtype, shape))
    spans.sort()
    position = 0
    for begin, end, tensor, _, _ in spans:
        if begin != position:
            raise bad(tensor, f"starts at data byte {begin}; expected {position} (tensors must tile the data)")
        position = end
    if position != data_size:
        raise bad("data", f"holds {data_size} bytes but its tensors cover {position}")
    whole = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    return {tensor: whole[start + begin:start + end].view(dtype).view(shape)
            for begin, end, tensor, dtype, shape in spans}


def _check_shard_contents(name: str, tensors: dict) -> None:
    """Offsets start at 0, never decrease and end at the tokens; scales finite."""
    offsets = tensors["offsets"]
    try:
        offsets_longest(offsets, tensors["values"].shape[0], "offsets", "values")
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from None
    scales = tensors.get("scales")
    if scales is not None and scales.numel() and not bool(torch.isfinite(scales.to(torch.float32)).all()):
        raise ValueError(f"{name}: `scales` holds a NaN or infinite scale")


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no index manifest here (DocumentIndex.save writes one)")

    def bad(field: str, what: str) -> ValueError:
        return ValueError(f"{path}: `{field}` {what}")

    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable as JSON ({error})") from None
    if not isinstance(manifest, dict):
        raise bad("manifest", "is not a JSON object")
    expected = {"format", "version", "dim", "storage", "shards", "ids"}
    if set(manifest) != expected:
        raise bad("manifest", f"has fields {sorted(manifest)}; expected {sorted(expected)}")
    if manifest["format"] != FORMAT:
        raise bad("format", f"is {manifest['format']!r}; expected {FORMAT!r}")
    if manifest["version"] != VERSION:
        raise bad("version", f"is {manifest['version']!r}; this flash_maxsim reads version {VERSION}")
    dim = manifest["dim"]
    if type(dim) is not int or dim < 1:
        raise bad("dim", f"is {dim!r}; expected an int >= 1")
    if manifest["storage"] not in STORAGES:
        raise bad("storage", f"is {manifest['storage']!r}; expected one of {sorted(STORAGES)}")
    shards = manifest["shards"]
    if not isinstance(shards, list):
        raise bad("shards", "is not a list")
    root = os.path.realpath(directory)
    names = set()
    for i, shard in enumerate(shards):
        field = f"shards[{i}]"
        if not isinstance(shard, dict) or set(shard) != {"file", "sha256", "documents", "tokens"}:
            raise bad(field, f"is {shard!r}; expected file, sha256, documents and tokens")
        name = shard["file"]
        if not isinstance(name, str) or not _SHARD_NAME.match(name) or name in names:
            raise bad(f"{field}.file", f"is {name!r}; expected a plain file name in the index directory, once")
        if os.path.dirname(os.path.realpath(os.path.join(directory, name))) != root:
            raise bad(f"{field}.file", f"{name!r} leads outside the index directory")
        names.add(name)
        if not isinstance(shard["sha256"], str) or not _HEX64.match(shard["sha256"]):
            raise bad(f"{field}.sha256", f"is {shard['sha256']!r}; expected 64 lowercase hex digits")
        for key in ("documents", "tokens"):
            if type(shard[key]) is not int or shard[key] < 0:
                raise bad(f"{field}.{key}", f"is {shard[key]!r}; expected an int >= 0")
    ids = manifest["ids"]
    if not isinstance(ids, list) or len(ids) != sum(s["documents"] for s in shards):
        raise bad("ids", f"must be a list of one id per document ({sum(s['documents'] for s in shards)})")
    seen = set()
    for i, value in enumerate(ids):
        if not (isinstance(value, str) or type(value) is int):
            raise bad(f"ids[{i}]", f"is {value!r}; ids are ints or strings")
        if value in seen:
            raise bad("ids", f"holds {value!r} twice")
        seen.add(value)
    return manifest


# ------------------------------------------------------------------------------------------- streaming

class _Streamer:
    """Copies chunks of host shards to a CUDA device: two device buffers used in turn, the copies on a side stream
    (chunk i + 1 copied while chunk i is scored), events ordering each copy after the scoring that last read its
    buffer. Sources that are not pinned (memory-mapped files) are first copied by the host into one of two pinned
    staging buffers, kept between searches."""

    def __init__(self, device: torch.device, staging: list):
        self.device = device
        self.staging = staging            # [pinned values, pinned scales] x 2, grown as needed; owned by the index

    def _stage(self, slot: int, source: Tensor, which: int) -> Tensor:
        rows = source.shape[0]
        held = self.staging[slot][which]
        if held is None or held.shape[0] < rows or held.dtype != source.dtype:
            held = torch.empty((max(rows, 1), *source.shape[1:]), dtype=source.dtype, pin_memory=True)
            self.staging[slot][which] = held
        held[:rows].copy_(source)
        return held[:rows]

    def run(self, chunks: list):
        """Yield ``(values, scales)`` on the device for each ``(shard, t0, t1)`` of ``chunks``, in order."""
        device = self.device
        n = len(chunks)
        if n == 0:
            return
        tokens = max(t1 - t0 for _, t0, t1 in chunks)
        first = chunks[0][0]
        values_dtype = first.values.dtype
        dim = first.dim
        buffers = [torch.empty((max(tokens, 1), dim), dtype=values_dtype, device=device) for _ in range(2)]
        scales = None
        if first.scales is not None:
            scales = [torch.empty(max(tokens, 1), dtype=first.scales.dtype, device=device) for _ in range(2)]
        copy_stream = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        for buffer in buffers + (scales or []):
            # freed at the end: not reused before the side stream's last copy into it (a search stopped early)
            buffer.record_stream(copy_stream)
        ready: list = [None] * n
        free: list = [None, None]            # the scoring that last read each buffer
        staged: list = [None, None]          # the copy that last read each staging buffer

        def issue(i: int) -> None:
            shard, t0, t1 = chunks[i]
            slot = i % 2
            sources = [shard.values.data[t0:t1]]
            if shard.scales is not None:
                sources.append(shard.scales.data[t0:t1])
            if not shard.pin:
                if staged[slot] is not None:
                    staged[slot].synchronize()
                sources = [self._stage(slot, src, j) for j, src in enumerate(sources)]
            with torch.cuda.stream(copy_stream):
                if free[slot] is not None:
                    copy_stream.wait_event(free[slot])
                buffers[slot][:t1 - t0].copy_(sources[0], non_blocking=True)
                if scales is not None:
                    scales[slot][:t1 - t0].copy_(sources[1], non_blocking=True)
                event = torch.cuda.Event()
                event.record(copy_stream)
            ready[i] = staged[slot] = event

        issue(0)
        for i in range(n):
            if i + 1 < n:
                issue(i + 1)
            main.wait_event(ready[i])
            _, t0, t1 = chunks[i]
            slot = i % 2
            yield buffers[slot][:t1 - t0], (None if scales is None else scales[slot][:t1 - t0])
            event = torch.cuda.Event()
            event.record(main)
            free[slot] = event


# ------------------------------------------------------------------------------------------- the index

class DocumentIndex:
    """Documents with ids, stored for exact MaxSim search where they fit: on a GPU, across GPUs, in pinned host
    memory or on disk, streamed to the GPU. See the module docstring and docs/semantics.md, "Search".

    Args:
        dim: the embeddings' feature size d.
        storage: ``"bf16"``, ``"fp16"``, ``"fp32"``, or ``"int8"`` / ``"fp8"`` (one scale per token, as
            :func:`flash_maxsim.quantize`; about half the bytes of bf16).
        placement: ``"cpu"``; ``"cuda"`` / ``"cuda:N"``; a list of devices or ``"cuda:all"``; ``"host"`` (pinned
            host memory streamed to ``stream_device``); ``"disk"`` (shard files under ``path``, memory-mapped,
            streamed).
        path: the directory of a ``"disk"`` index (created if missing; it must not hold an index already: open
            one with :meth:`load`).
        stream_device: where ``"host"`` and ``"disk"`` indexes are scored: a CUDA device (default: the current
            one), or ``"cpu"`` (scored in place, no copies; the default without CUDA).
        shard_bytes: values bytes per shard (each shard is one scoring launch per chunk and, saved, one file).
        stream_bytes: values bytes per streamed chunk; two device buffers of this size are used while searching.

    Scoring is :func:`flash_maxsim.maxsim`'s with ``masked="exclude"``: masked tokens given to :meth:`add` are not
    stored. Not thread-safe.
    """

    def __init__(self, dim: int, *, storage: str = "bf16", placement: Union[str, torch.device, Sequence] = "cuda",
                 path: Optional[Union[str, os.PathLike]] = None, stream_device: Optional[Union[str, torch.device]]
                 = None, shard_bytes: int = DEFAULT_SHARD_BYTES, stream_bytes: int = DEFAULT_STREAM_BYTES):
        self._setup(dim, storage, placement, path, stream_device, shard_bytes, stream_bytes, existing_ok=False)

    def _setup(self, dim, storage, placement, path, stream_device, shard_bytes, stream_bytes,
               existing_ok: bool) -> None:
        self._dim = _check_dim(dim)
        self._storage = _check_storage(storage)
        self._shard_bytes = _check_bytes("shard_bytes", shard_bytes)
        self._stream_bytes = _check_bytes("stream_bytes", stream_bytes)
        path = None if path is None else os.fspath(path)
        self._kind, self._devices, self._score_device, self._pin = _parse_placement(placement, stream_device, path)
        self._placement = placement
        self._path = path
        if self._kind == "disk":
            os.makedirs(path, exist_ok=True)
            if os.path.exists(os.path.join(path, MANIFEST)) and not existing_ok:
                raise ValueError(f"`path` {path!r} already holds an index: open it with "
                                 "DocumentIndex.load(path, placement='disk')")
        self._shards: list[_Shard] = []
        self._open: Optional[_Shard] = None
        self._where: dict = {}                 # id -> (shard, row)
        self._next_id = 0
        self._live_ids: Optional[list] = None
        self._staging: list = [[None, None], [None, None]]
        self._written: set = set()             # shard files this index wrote into its own directory

    # --- properties
    @property
    def dim(self) -> int:
        """The embeddings' feature size."""
        return self._dim

    @property
    def storage(self) -> str:
        """``"bf16"``, ``"fp16"``, ``"fp32"``, ``"int8"`` or ``"fp8"``."""
        return self._storage

    @property
    def placement(self) -> Union[str, torch.device, Sequence]:
        """The placement given to the constructor (or :meth:`load`)."""
        return self._placement

    @property
    def path(self) -> Optional[str]:
        """The directory of a ``"disk"`` index."""
        return self._path

    @property
    def nbytes(self) -> int:
        """Bytes of stored documents (values, scales and offsets; removed documents count until compacted)."""
        return sum(s.nbytes for s in self._shards)

    def __len__(self) -> int:
        return len(self._where)

    @property
    def ids(self) -> list:
        """The live documents' ids, in insertion order (position ``i`` of a search result is ``ids[i]``)."""
        return list(self._ids())

    def _ids(self) -> list:
        if self._live_ids is None:
            live = []
            for shard in self._shards:
                if shard.removed_count:
                    live.extend(i for i, r in zip(shard.ids, shard.removed.data.tolist()) if not r)
                else:
                    live.extend(shard.ids)
            self._live_ids = live
        return self._live_ids

    def __repr__(self) -> str:
        return (f"DocumentIndex(dim={self._dim}, storage={self._storage!r}, placement={self._placement!r}, "
                f"documents={len(self)}, shards={len(self._shards)}, nbytes={self.nbytes})")

    # --- shards
    def _token_bytes(self) -> int:
        extra = _SCALES[self._storage].itemsize if self._storage in _SCALES else 0
        return self._dim * STORAGES[self._storage].itemsize + extra

    def _new_shard(self, append: bool = True) -> _Shard:
        slot = 0
        if self._kind == "devices":
            held = [0] * len(self._devices)
            for s in self._shards:
                held[s.slot] += s.nbytes
            slot = min(range(len(held)), key=lambda i: held[i])
        device = self._devices[slot]
        score = self._score_device if self._kind in ("host", "disk") else device
        limit = max(1, self._shard_bytes // self._token_bytes())
        shard = _Shard(self._dim, self._storage, device, score, self._pin, limit)
        shard.slot = slot
        if append:
            self._shards.append(shard)
        return shard

    def _seal_open(self) -> None:
        shard, self._open = self._open, None
        if shard is None:
            return
        shard.seal()
        if self._kind == "disk" and shard.count:
            self._to_file(shard, self._path)

    def _fresh_name(self, directory: str) -> str:
        taken = set(os.listdir(directory))
        taken.update(os.path.basename(s.file) for s in self._shards if s.file)
        i = 0
        while f"shard-{i:06d}.safetensors" in taken:
            i += 1
        return f"shard-{i:06d}.safetensors"

    def _write_shard(self, shard: _Shard, directory: str) -> tuple[str, str, int, int]:
        """Write ``shard``'s live documents to a new file in ``directory``: (name, sha256, documents, tokens)."""
        tensors = shard.live_tensors()
        name = self._fresh_name(directory)
        final = os.path.join(directory, name)
        temporary = final + ".partial"
        _safetensors().save_file(tensors, temporary, metadata={"format": SHARD_FORMAT, "version": str(VERSION)})
        os.replace(temporary, final)
        if self._path is not None and os.path.realpath(directory) == os.path.realpath(self._path):
            self._written.add(name)
        return name, _sha256(final), tensors["offsets"].shape[0] - 1, tensors["values"].shape[0]

    def _to_file(self, shard: _Shard, directory: str) -> None:
        """A disk index's shard written out and replaced by its memory-mapped file."""
        name, sha, documents, tokens = self._write_shard(shard, directory)
        live_ids = [i for i, r in zip(shard.ids, shard.removed.data.tolist()) if not r]
        path = os.path.join(directory, name)
        mapped = self._shard_from_file(path, path, documents, tokens, live_ids, sha)
        self._replace_shard(shard, mapped)

    def _shard_from_file(self, path: str, name: str, documents: int, tokens: int, ids: list, sha: str) -> _Shard:
        tensors = _map_shard(path, name, self._storage, self._dim, documents, tokens)
        _check_shard_contents(name, tensors)
        shard = _Shard(self._dim, self._storage, torch.device("cpu"), self._score_device, False, None)
        shard.values = _Buffer((self._dim,), tensors["values"].dtype, shard.device, data=tensors["values"])
        if "scales" in tensors:
            shard.scales = _Buffer((), tensors["scales"].dtype, shard.device, data=tensors["scales"])
        shard.offsets = _Buffer((), torch.int64, shard.device, data=tensors["offsets"])
        shard.removed = _Buffer((), torch.bool, shard.device, data=torch.zeros(documents, dtype=torch.bool))
        shard.ids = list(ids)
        shard.file, shard.sha256, shard.sealed = path, sha, True
        return shard

    def _replace_shard(self, old: _Shard, new: Optional[_Shard]) -> None:
        i = self._shards.index(old)
        if new is None or new.count == 0:
            del self._shards[i]
        else:
            self._shards[i] = new
            for row, value in enumerate(new.ids):
                self._where[value] = (new, row)
        if self._open is old:
            self._open = None
        self._live_ids = None

    def _compact(self, shard: _Shard) -> None:
        """An in-memory shard rebuilt without its removed documents."""
        keep_docs = ~shard.removed.data
        if not bool(keep_docs.any()):
            self._replace_shard(shard, None)
            return
        keep = shard.live_mask_tokens()
        fresh = _Shard(self._dim, self._storage, shard.device, shard.score_device, shard.pin,
                       shard.values.limit)
        fresh.slot = shard.slot
        scales = None if shard.scales is None else shard.scales.data[keep.to(shard.device)]
        fresh.append(shard.values.data[keep.to(shard.device)], scales, shard.lengths()[keep_docs],
                     [i for i, k in zip(shard.ids, keep_docs.tolist()) if k])
        if self._open is not shard:
            fresh.seal()
        was_open = self._open is shard
        self._replace_shard(shard, fresh)
        if was_open:
            self._open = fresh

    # --- add / remove
    def add(self, embeddings: Union[Sequence[Tensor], PackedDocuments, Tensor], ids: Optional[Sequence[Id]] = None,
            mask: Optional[Tensor] = None) -> list:
        """Add documents; returns their ids.

        Args:
            embeddings: a list of ``[L_i, d]`` tensors, :class:`PackedDocuments`, or ``[B, L, d]`` (with ``mask``
                ``[B, L]``); any floating dtype and device (encoded there, then moved to the index's placement).
            ids: one int or string per document, unique across the index (a duplicate is a ValueError naming
                ``ids``); default: consecutive ints after the largest int id the index has given or seen.
            mask: which tokens are valid (bool or 0/1): ``[B, L]``, one ``[L_i]`` per listed document, or ``[T]``
                for packed ones. Masked tokens are not stored (a document may end up with none: it scores 0).

        Everything is validated before the index changes. Memory beyond the index: this batch (and its
        encoding); the corpus can be added batch by batch.
        """
        values, lengths = _packed_embeddings(embeddings, mask, self._dim)
        count = lengths.shape[0]
        if ids is None:
            new_ids = list(range(self._next_id, self._next_id + count))
        else:
            new_ids = _id_list(ids)
            if len(new_ids) != count:
                raise ValueError(f"`ids` has {len(new_ids)} entries for {count} documents")
        seen = set()
        for i, value in enumerate(new_ids):
            if value in seen or value in self._where:
                where = "twice in `ids`" if value in seen else "already in the index"
                raise ValueError(f"`ids[{i}]` = {value!r} is {where}; ids must be unique")
            seen.add(value)
        if count == 0:
            return []
        if not values.is_cuda and self._kind in ("cuda", "devices") and self._devices[0].type == "cuda":
            values = values.to(self._devices[0])          # encoded where it is stored (one GPU of several)
        if self._storage in _SCALES:
            values, scales = quantize_tokens(values, self._storage, scale_dtype=_SCALES[self._storage])
        else:
            values, scales = values.to(STORAGES[self._storage]), None
        ints = [v for v in new_ids if not isinstance(v, str)]
        if ints:
            self._next_id = max(self._next_id, max(ints) + 1)
        limit = max(1, self._shard_bytes // self._token_bytes())
        ends = torch.zeros(count + 1, dtype=torch.int64)
        ends[1:] = lengths.cumsum(0)
        s = 0
        while s < count:
            if self._open is None:
                self._open = self._new_shard()
            shard = self._open
            room = limit - shard.tokens
            fits = int(torch.searchsorted(ends, ends[s:s + 1] + room, right=True)[0]) - 1
            e = min(count, fits)
            if e <= s:
                if shard.count:
                    self._seal_open()
                    continue
                e = s + 1                       # a document longer than a shard: a shard of its own
            t0, t1 = int(ends[s]), int(ends[e])
            rows = shard.count
            shard.append(values[t0:t1], None if scales is None else scales[t0:t1], lengths[s:e], new_ids[s:e])
            for row, value in enumerate(new_ids[s:e], start=rows):
                self._where[value] = (shard, row)
            if shard.tokens >= limit:
                self._seal_open()
            s = e
        self._live_ids = None
        return new_ids

    def remove(self, ids: Union[Id, Sequence[Id]]) -> None:
        """Remove documents by id (an unknown id is a KeyError naming it; nothing is removed then). In-memory shards
        are compacted once half their documents are removed; a disk index keeps its files until :meth:`save`."""
        single = isinstance(ids, str) or not isinstance(ids, Iterable)
        values = [_as_id("ids", ids)] if single else _id_list(ids)
        if len(set(values)) != len(values):
            raise ValueError("`ids` lists an id twice")
        for value in values:
            if value not in self._where:
                raise KeyError(f"`ids`: {value!r} is not in the index")
        rows: dict = {}
        for value in values:
            shard, row = self._where.pop(value)
            rows.setdefault(id(shard), (shard, []))[1].append(row)
        for shard, shard_rows in rows.values():
            shard.remove_rows(shard_rows)
            if shard.file is None and 2 * shard.removed_count >= shard.count:
                self._compact(shard)
            elif shard.live == 0:
                self._replace_shard(shard, None)
        self._live_ids = None

    # --- search
    def _queries(self, queries, queries_mask, device: torch.device) -> Problem:
        if not isinstance(queries, Tensor):
            raise TypeError(f"`queries` must be a torch.Tensor, got {type(queries).__name__}")
        if not queries.dtype.is_floating_point:
            raise TypeError(f"`queries` has dtype {queries.dtype}; expected a floating-point dtype")
        if queries.dim() not in (2, 3) or queries.shape[-1] != self._dim:
            raise ValueError(f"`queries` has shape [{_shape(queries)}]; expected [Nq, Lq, {self._dim}] or "
                             f"[Lq, {self._dim}]")
        if self._storage in _SCALES:
            dtype = queries.dtype if queries.dtype in SUPPORTED_DTYPES else torch.float32
        else:
            dtype = STORAGES[self._storage]
        q = queries.to(device=device, dtype=dtype)
        qm = queries_mask.to(device) if isinstance(queries_mask, Tensor) else queries_mask
        return canonicalize(q, [], qm)

    def search(self, queries: Tensor, k: int, queries_mask: Optional[Tensor] = None, *,
               chunk_size: Optional[int] = None) -> IndexSearchResult:
        """The ``k`` best live documents per query: exactly :func:`flash_maxsim.search` over the live documents in
        insertion order (``masked="exclude"``), with their ids.

        Args:
            queries: ``[Nq, Lq, d]`` or ``[Lq, d]``, any floating dtype (cast to the storage dtype for a 16/32-bit
                index; an 8-bit index quantises fp16/bf16/fp32 queries itself, d <= 256).
            k: an int >= 1; ``k' = min(k, len(index))`` are returned.
            queries_mask: ``[Nq, Lq]`` (or ``[Lq]``), bool or 0/1.
            chunk_size: documents per scoring launch (default ``max(1, 2**22 // Nq)``, and at most
                ``stream_bytes`` of values for a streamed index).

        Returns:
            :class:`IndexSearchResult` on the queries' device: ``scores`` ``[Nq, k']`` float32 descending (ties:
            lower position first; NaN first), ``ids``, ``positions`` (insertion order among live documents).
            Not differentiable.
        """
        k = check_k(k)
        chunk_size = check_chunk_size(chunk_size)
        probe = self._queries(queries, queries_mask, queries.device if isinstance(queries, Tensor) else "cpu")
        Nq = probe.queries.shape[0]
        kk = min(k, len(self))
        groups: dict = {}
        base = 0
        for shard in self._shards:
            if shard.live:
                groups.setdefault(shard.slot, []).append((shard, base))
            base += shard.live
        max_docs = chunk_size or default_chunk_size(Nq)
        streamed = self._kind in ("host", "disk")
        max_tokens = max(1, self._stream_bytes // self._token_bytes()) if streamed else None
        partial = []
        with torch.no_grad():
            for members in groups.values():
                device = members[0][0].score_device
                # the kernels launch on the current CUDA device: each device's shards are scored under it
                with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                    partial.append(self._search_on(device, members, queries, queries_mask, Nq, kk, max_docs,
                                                   max_tokens))
        out_device = probe.queries.device
        if not partial:
            scores = torch.zeros((Nq, 0), dtype=torch.float32, device=out_device)
            positions = torch.zeros((Nq, 0), dtype=torch.int64, device=out_device)
        elif len(partial) == 1:
            scores, positions = partial[0][0].to(out_device), partial[0][1].to(out_device)
        else:
            scores, positions = merge_top_k([s.to(out_device) for s, _ in partial],
                                            [p.to(out_device) for _, p in partial], kk)
        live = self._ids()
        ids = [[live[i] for i in row] for row in positions.tolist()]
        if probe.single_query:
            return IndexSearchResult(scores[0], ids[0], positions[0])
        return IndexSearchResult(scores, ids, positions)

    def _search_on(self, device: torch.device, members: list, queries: Tensor, queries_mask, Nq: int, k: int,
                   max_docs: int, max_tokens: Optional[int]) -> tuple[Tensor, Tensor]:
        """The top k of the shards ``members`` (``(shard, live documents before it)``, in insertion order), all
        scored on ``device``: ``(scores, positions)`` there."""
        p = self._queries(queries, queries_mask, device)
        top = RunningTopK(Nq, k, device)
        chunks = [(shard, live_base, plan) for shard, live_base in members
                  for plan in shard.plan(max_docs, max_tokens)]
        if max_tokens is not None and device.type == "cuda":
            tensors = _Streamer(device, self._staging).run([(shard, plan[2], plan[3]) for shard, _, plan in chunks])
        else:
            tensors = ((shard.values.data[plan[2]:plan[3]],
                        None if shard.scales is None else shard.scales.data[plan[2]:plan[3]])
                       for shard, _, plan in chunks)
        for (shard, live_base, (s, e, t0, t1, longest)), (values, scales) in zip(chunks, tensors):
            offsets = shard.device_offsets()[s:e + 1] - t0
            problem = Problem(p.queries, p.queries_mask, values, None, offsets, longest, 0, False, scales)
            out = _scores(problem, False, None)
            if shard.removed_count:
                live = (e - s) - int(shard.removed.data[s:e].sum())      # a host count: no read of the device
                top.push(out, shard.live_ranks()[s:e] + live_base, shard.device_removed()[s:e], live)
            else:
                top.push(out, live_base + s)
        return top.scores, top.positions

    # --- save / load
    def save(self, directory: Union[str, os.PathLike]) -> None:
        """Write the index to ``directory``: one safetensors file per shard (live documents only) and
        ``manifest.json`` (written last, replacing any earlier one; files of the index saved there before that
        the new manifest no longer lists are deleted). A ``"disk"`` index saved to its own directory writes only
        what changed, and maps the new files."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        root = os.path.realpath(directory)
        previous = []
        try:
            previous = [s["file"] for s in _read_manifest(directory)["shards"]]
        except ValueError:
            pass
        own = self._kind == "disk" and os.path.realpath(self._path) == root
        if own:
            self._seal_open()
        entries, ids = [], []
        for i in range(len(self._shards)):
            if own and self._shards[i].removed_count:
                self._to_file(self._shards[i], directory)      # replaced by the new file, in place
            shard = self._shards[i]
            if own and shard.file is not None:
                entries.append({"file": os.path.basename(shard.file), "sha256": shard.sha256,
                                "documents": shard.count, "tokens": shard.tokens})
            else:
                name, sha, documents, tokens = self._write_shard(shard, directory)
                entries.append({"file": name, "sha256": sha, "documents": documents, "tokens": tokens})
            ids.extend(v for v, r in zip(shard.ids, shard.removed.data.tolist()) if not r)
        manifest = {"format": FORMAT, "version": VERSION, "dim": self._dim, "storage": self._storage,
                    "shards": entries, "ids": ids}
        temporary = os.path.join(directory, MANIFEST + ".partial")
        with open(temporary, "w") as f:
            json.dump(manifest, f)
        os.replace(temporary, os.path.join(directory, MANIFEST))
        listed = {e["file"] for e in entries}
        stale = set(previous) | (self._written if own else set())
        for name in sorted(stale - listed):
            if name not in listed and _SHARD_NAME.match(name):
                try:
                    os.remove(os.path.join(directory, name))
                except FileNotFoundError:
                    pass

    @classmethod
    def load(cls, directory: Union[str, os.PathLike], *, placement: Union[str, torch.device, Sequence] = "cuda",
             stream_device: Optional[Union[str, torch.device]] = None, verify: bool = True,
             shard_bytes: int = DEFAULT_SHARD_BYTES, stream_bytes: int = DEFAULT_STREAM_BYTES) -> DocumentIndex:
        """The index :meth:`save` wrote to ``directory``, validated before anything is scored: the manifest's
        fields (format, version, dim, storage, shard file names inside the directory, counts, unique int/str ids),
        each shard file's SHA-256 (``verify=False`` skips reading every byte for it; the rest is still checked),
        header (tensor names, dtypes, shapes, byte ranges: a truncated file fails), offsets (start at 0, never
        decrease, end at the tokens) and scales (finite). Errors are ValueErrors naming the file and the field.
        ``placement="disk"`` maps the shards where they are (and adds new shards there); any other placement
        copies them in."""
        directory = os.fspath(directory)
        manifest = _read_manifest(directory)
        index = cls.__new__(cls)
        index._setup(manifest["dim"], manifest["storage"], placement, directory if placement == "disk" else None,
                     stream_device, shard_bytes, stream_bytes, existing_ok=True)
        ids = manifest["ids"]
        start = 0
        for entry in manifest["shards"]:
            name = entry["file"]
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise ValueError(f"{path}: the shard file listed in the manifest is missing")
            mapped = index._shard_from_file(path, path, entry["documents"], entry["tokens"],
                                            ids[start:start + entry["documents"]], entry["sha256"])
            start += entry["documents"]
            if verify and _sha256(path) != entry["sha256"]:
                raise ValueError(f"{path}: `sha256` does not match the file's contents (damaged, truncated or "
                                 "altered after it was written)")
            if mapped.count == 0:
                continue
            if index._kind != "disk":
                mapped = index._copied_in(mapped)
            index._shards.append(mapped)
            for row, value in enumerate(mapped.ids):
                index._where[value] = (mapped, row)
        ints = [v for v in ids if not isinstance(v, str)]
        index._next_id = max(ints) + 1 if ints else 0
        return index

    def _copied_in(self, mapped: _Shard) -> _Shard:
        """A mapped shard copied to this index's placement."""
        fresh = self._new_shard(append=False)
        fresh.values.limit = None
        if fresh.scales is not None:
            fresh.scales.limit = None
        fresh.append(mapped.values.data, None if mapped.scales is None else mapped.scales.data, mapped.lengths(),
                     mapped.ids)
        fresh.seal()
        return fresh
