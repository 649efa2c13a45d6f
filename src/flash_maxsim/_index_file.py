"""The file of a saved index (:meth:`flash_maxsim.QuantizedDocuments.save` and ``load``): its tensors and text
fields written and read back, and the payload's checksum. What the fields must satisfy is checked in
:mod:`flash_maxsim._types`, before writing and after reading.

Written: safetensors. No pickle at all; the tensors lie at aligned offsets after a JSON header, so a file can
be memory-mapped; ``float8_e4m3fn`` is its ``F8_E4M3``. The text fields are its ``__metadata__``, with
``sha256``: a SHA-256 over those fields and every tensor's name, dtype, shape and bytes, checked on reading.
Also read: the dict of tensors and plain values of the ``torch.save`` format (read with ``weights_only=True``,
so no pickled code runs), which carries no checksum.

The checksum detects a damaged file (a flipped bit, a cut copy); it is no signature: a crafted file may carry a
matching one, and is refused by the validation instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from typing import IO, Union

import torch

FileLike = Union[str, os.PathLike, IO[bytes]]

FORMAT = "flash_maxsim.QuantizedDocuments"
VERSION = 1
TENSORS = ("values", "scales", "offsets", "mask")


def _hash_tensor(h, t: torch.Tensor) -> None:
    """``h.update`` with the tensor's bytes in memory order (read in place through ctypes: no NumPy needed)."""
    flat = t.detach().to("cpu").contiguous()
    size = flat.numel() * flat.element_size()
    if size:
        h.update(memoryview((ctypes.c_ubyte * size).from_address(flat.data_ptr())))


def checksum(tensors: dict, fields: dict) -> str:
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


def write(f: FileLike, state: dict) -> None:
    """Write ``state`` (``kind``, ``max_length`` and the :data:`TENSORS`, None where absent) to ``f``, a path or a
    binary file."""
    safetensors = _safetensors()
    tensors = {}
    for name in TENSORS:
        t = state[name]
        if t is not None:
            t = t.detach().to("cpu").contiguous()
            # safetensors refuses tensors that share memory or are views of a larger one: a copy of those
            tensors[name] = t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
    fields = {"format": FORMAT, "version": str(VERSION), "kind": state["kind"],
              "max_length": "" if state["max_length"] is None else str(state["max_length"])}
    fields["sha256"] = checksum(tensors, fields)
    if isinstance(f, (str, os.PathLike)):
        safetensors.torch.save_file(tensors, f, metadata=fields)
    else:
        f.write(safetensors.torch.save(tensors, metadata=fields))


def _is_safetensors(head: bytes) -> bool:
    """A safetensors file starts with its header's length (8 bytes, little-endian) and the header's ``{``."""
    return len(head) >= 9 and head[8:9] == b"{"


def read(f: FileLike, map_location=None) -> dict:
    """The state :func:`write` wrote (or the ``torch.save`` format held): ``format``, ``version``, ``kind``,
    ``max_length`` and the :data:`TENSORS` (None where absent), on ``map_location`` (None: where they were
    saved; safetensors: the CPU). A file that cannot be decoded, or whose checksum does not match, is a
    ValueError."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as stream:
            head = stream.read(9)
        if _is_safetensors(head):
            return _read_safetensors(f, None, map_location)
        with open(f, "rb") as stream:
            return _read_torch(stream, map_location)
    start = f.tell()
    head = f.read(9)
    f.seek(start)
    if _is_safetensors(head):
        return _read_safetensors(None, f.read(), map_location)
    return _read_torch(f, map_location)


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
    if not isinstance(fields, dict) or fields.get("format") != FORMAT:
        raise ValueError("`f` does not hold an index written by QuantizedDocuments.save")
    unexpected = sorted(set(tensors) - set(TENSORS))
    if unexpected:
        raise ValueError(f"`f` holds tensors {unexpected} besides an index's {list(TENSORS)}")
    stored = fields.get("sha256")
    expected = checksum(tensors, {k: v for k, v in fields.items() if k != "sha256"})
    if stored != expected:
        raise ValueError("`f` holds an index whose checksum does not match its contents: the file is damaged "
                         "(or was altered after it was written)")
    try:
        version = int(fields.get("version", ""))
        max_length = None if fields.get("max_length", "") == "" else int(fields["max_length"])
    except ValueError as error:
        raise _unreadable(error) from error
    state = {"format": FORMAT, "version": version, "kind": fields.get("kind"), "max_length": max_length}
    for name in TENSORS:
        t = tensors.get(name)
        state[name] = t if t is None or map_location is None else t.to(map_location)
    return state


def _read_torch(stream, map_location) -> dict:
    import pickle
    try:
        state = torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"`f` does not hold an index written by QuantizedDocuments.save (for an object saved with "
                         f"torch.save(index, f), use torch.load(f, weights_only=False) on a trusted file): "
                         f"{error}") from error
    except Exception as error:          # any decoding failure of a damaged or foreign file
        raise _unreadable(error) from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("`f` does not hold an index written by QuantizedDocuments.save (for an object saved with "
                         "torch.save(index, f), use torch.load(f, weights_only=False) on a trusted file)")
    unexpected = sorted(set(state) - {"format", "version", "kind", "max_length", *TENSORS})
    if unexpected:
        raise ValueError(f"`f` holds entries {unexpected} besides an index's")
    return {key: state.get(key) for key in ("format", "version", "kind", "max_length", *TENSORS)}
