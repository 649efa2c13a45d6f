"""Validation of the public inputs and their reduction to one canonical form shared by every backend."""

from __future__ import annotations

import numbers
import operator
import reprlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# PackedDocuments and aux_dtype are re-exported: callers import them from here as well as from ._types
from ._types import (SUPPORTED_DTYPES, PackedDocuments, QuantizedDocuments, aux_dtype,  # noqa: F401
                     check_offsets_tensor, offsets_longest, remember_offsets)

MASKED_MODES = ("exclude", "zero")
SMOOTH_TAU_RANGE = (2.0 ** -100, 2.0 ** 100)


def pack(documents: Sequence[torch.Tensor]) -> PackedDocuments:
    """Concatenate a list of ``[Ld_t, d]`` tensors (one dtype, device and ``d``) into :class:`PackedDocuments`
    (differentiable). Its offsets, built from the documents' shapes, need no validation when scored."""
    documents = list(documents)
    if not documents:
        raise ValueError("pack: `documents` is an empty list; expected at least one [Ld, d] tensor")
    _check_document_list(documents)
    packed = _pack_checked(documents)
    remember_offsets(packed.offsets, packed.values.shape[0], packed.max_length)
    return packed


def _check_document_list(documents: list) -> None:
    """Every item a ``[Ld_i, d]`` tensor of the first one's dtype, device and ``d``, or an error naming the first
    that is not. One pass collecting the distinct (dtype, device, rank, d): a 20k-document list costs ~0.5 us per
    document; the slow pass runs only to name a culprit."""
    try:
        kinds = {(x.dtype, x.device, x.dim(), x.shape[-1], x.layout) for x in documents}
    except (AttributeError, IndexError, TypeError):
        kinds = None
    if kinds is not None and len(kinds) == 1 and next(iter(kinds))[2] == 2 and \
            next(iter(kinds))[4] == torch.strided:
        return
    first = None
    for i, x in enumerate(documents):
        _check_tensor(f"documents[{i}]", x)
        if x.dim() != 2:
            raise ValueError(f"`documents[{i}]` has shape [{_shape(x)}]; expected [Ld_i, d]")
        first = x if first is None else first
        if x.dtype != first.dtype:
            raise TypeError(f"`documents[{i}]` has dtype {x.dtype} but `documents[0]` has {first.dtype}; "
                            "every document must have one dtype")
        if x.device != first.device:
            raise ValueError(f"`documents[{i}]` is on {x.device} but `documents[0]` on {first.device}")
        if x.shape[-1] != first.shape[-1]:
            raise ValueError(f"`documents[{i}]` has feature size {x.shape[-1]} (shape [{_shape(x)}]); expected "
                             f"d={first.shape[-1]} as in `documents[0]`")
        _check_strided(f"documents[{i}]", x)


def _pack_checked(documents: list) -> PackedDocuments:
    lengths = [int(x.shape[0]) for x in documents]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return PackedDocuments(torch.cat(documents, 0), offsets.to(documents[0].device), max(lengths))


@dataclass
class Problem:
    """The canonical problem. ``documents`` is padded ``[T, Ld, d]`` (``offsets`` None) or packed
    ``[sum Ld_t, d]``; masks are uint8 (1 = valid) or None; ``candidates`` K > 0 means document
    ``t = q*K + k`` is query ``q``'s k-th candidate, 0 means every query meets every document."""

    queries: torch.Tensor
    queries_mask: Optional[torch.Tensor]
    documents: torch.Tensor
    documents_mask: Optional[torch.Tensor]
    offsets: Optional[torch.Tensor]
    max_length: int
    candidates: int
    single_query: bool
    document_scales: Optional[torch.Tensor] = None   # quantized documents: bf16 / fp32 per token, shaped like a mask

    @property
    def num_columns(self) -> int:
        return num_columns(self.documents, self.offsets, self.candidates)


def num_columns(documents, offsets, candidates: int) -> int:
    """Score columns per query: K candidates, else the number of documents (padded or packed)."""
    if candidates:
        return candidates
    return documents.shape[0] if offsets is None else offsets.shape[0] - 1


def _shape(x) -> str:
    return "x".join(str(s) for s in x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    _check_strided(name, x)


def _check_strided(name: str, x: torch.Tensor) -> None:
    if x.layout != torch.strided or x.is_nested:
        raise TypeError(f"`{name}` is a {'nested' if x.is_nested else x.layout} tensor; expected a dense (strided) "
                        "one (.to_dense(); nested documents: a list of [Ld_i, d] tensors)")


def _as_mask(name: str, mask, expected_shape: tuple, device) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    _check_tensor(name, mask)
    if tuple(mask.shape) != tuple(expected_shape):
        want = "[" + ", ".join(str(s) for s in expected_shape) + "]"
        raise ValueError(f"`{name}` has shape [{_shape(mask)}]; expected {want} (bool or 0/1 values)")
    if mask.device != device:
        raise ValueError(f"`{name}` is on {mask.device}; expected the queries' device {device}")
    if mask.dtype.is_complex:
        raise TypeError(f"`{name}` has dtype {mask.dtype}; expected bool or a real 0/1 dtype")
    if torch.compiler.is_compiling():
        return (mask != 0).to(torch.uint8)     # Inductor cannot lower a bool->uint8 view
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)          # zero-copy
    return (mask != 0).view(torch.uint8)       # one kernel: a launch less per mask than a cast after it


def _check_floating(name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`{name}` has dtype {x.dtype}; expected one of float16, bfloat16, float32")
    if x.dtype != dtype:
        raise TypeError(f"`{name}` has dtype {x.dtype} but `queries` has {dtype}; cast one of them so both match")


def _is_packed(documents) -> bool:
    """PackedDocuments, or a ``(values, offsets[, max_length])`` tuple: a 1-D second item (a tuple of ``[Ld_i, d]``
    documents is a list of documents, as in :func:`flash_maxsim.reference.maxsim` and ``quantize``)."""
    if isinstance(documents, PackedDocuments):
        return True
    return isinstance(documents, tuple) and len(documents) in (2, 3) and \
        all(isinstance(v, torch.Tensor) for v in documents[:2]) and documents[1].dim() == 1


def _as_max_length(max_length) -> Optional[int]:
    """PackedDocuments' ``max_length``: None or an int >= 0 (checked against the offsets by
    :func:`_packed_max_length`)."""
    if max_length is None:
        return None
    try:
        value = operator.index(max_length)
    except TypeError:
        raise TypeError(f"`documents.max_length` must be an int or None, got {type(max_length).__name__}") from None
    if value < 0 or isinstance(max_length, bool):
        raise ValueError(f"`documents.max_length` must be an int >= 0 or None, got {max_length!r}")
    return value


def _packed_max_length(values: torch.Tensor, offsets: torch.Tensor, max_length: Optional[int]) -> int:
    """The ``max_length`` the kernels get for packed documents: the longest document, from the validated offsets
    (:func:`flash_maxsim._types.offsets_longest`: once per offsets tensor, one host read); a given ``max_length``
    below it is an error (the kernels size their grids and saved indices by it). Under torch.compile tracing,
    which cannot read the offsets, a given ``max_length`` is used and the op checks it when it runs
    (:func:`flash_maxsim.ops.check_packed`); without one the offsets are read (a graph break)."""
    if values.device.type == "meta":            # no data: shapes only
        return 0 if max_length is None else max_length
    if max_length is not None and torch.compiler.is_compiling():
        return max_length
    longest = offsets_longest(offsets, values.shape[0])
    if max_length is not None and max_length < longest:
        raise ValueError(f"`documents.max_length` is {max_length} but the longest document (from "
                         f"`documents.offsets`) has {longest} tokens; pass the longest length, or None")
    return longest


def _flat_document_mask(documents_mask, lengths: list, device) -> torch.Tensor:
    """Per-document masks given as a sequence (one tensor or list of 0/1 per document), each checked against its
    document's length ``lengths[i]``, concatenated into the packed layout's ``[sum Ld_i]`` mask on ``device``."""
    if not isinstance(documents_mask, (list, tuple)):
        raise TypeError(f"`documents_mask` must be a tensor or a list of per-document [Ld_i] masks, got "
                        f"{type(documents_mask).__name__}")
    if len(documents_mask) != len(lengths):
        raise ValueError(f"`documents_mask` has {len(documents_mask)} entries; expected one [Ld_i] mask per "
                         f"document ({len(lengths)})")
    masks = []
    for i, (m, n) in enumerate(zip(documents_mask, lengths)):
        if m is None or isinstance(m, (str, bytes)):
            raise TypeError(f"`documents_mask[{i}]` must be a tensor or a list of 0/1, got {type(m).__name__}")
        m = torch.as_tensor(m, device=device)
        if m.dim() != 1:
            raise ValueError(f"`documents_mask[{i}]` has shape [{_shape(m)}]; expected [Ld_{i}]")
        if m.shape[0] != n:
            raise ValueError(f"`documents_mask[{i}]` has shape [{m.shape[0]}]; expected [{n}], the length of "
                             f"document {i}")
        masks.append(m)
    return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool, device=device)


def canonicalize(queries, documents, queries_mask=None, documents_mask=None, *, masked="exclude",
                 smooth_tau=None) -> Problem:
    _check_tensor("queries", queries)
    if queries.dim() not in (2, 3):
        raise ValueError(f"`queries` has shape [{_shape(queries)}]; expected [Nq, Lq, d] or [Lq, d]")
    if queries.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`queries` has dtype {queries.dtype}; expected one of float16, bfloat16, float32")
    if masked not in MASKED_MODES:
        raise ValueError(f"`masked` must be 'exclude' or 'zero', got {masked!r}")
    if smooth_tau is not None:
        # any real number: Python's, NumPy's (np.float32 as np.float64) or a Fraction; not a bool
        if isinstance(smooth_tau, bool) or not isinstance(smooth_tau, numbers.Real):
            raise TypeError(f"`smooth_tau` must be a float > 0 or None, got {type(smooth_tau).__name__}")
        # compared as a Python number: an int of any size, a float otherwise (no NumPy casts of the bounds)
        tau = int(smooth_tau) if isinstance(smooth_tau, numbers.Integral) else float(smooth_tau)
        if not tau > 0:
            raise ValueError(f"`smooth_tau` must be > 0, got {smooth_tau}")
        if not SMOOTH_TAU_RANGE[0] <= tau <= SMOOTH_TAU_RANGE[1]:
            # the kernels scale similarities by log2(e) / tau in fp32, which must be finite and nonzero; below the
            # range the smooth max equals the hard max to within tau * log(Ld) anyway
            raise ValueError(f"`smooth_tau` must lie in [2**-100, 2**100], got {reprlib.repr(smooth_tau)}")
    quantized = isinstance(documents, QuantizedDocuments)
    scales = None
    if quantized:
        if documents_mask is None:
            documents_mask = documents.mask
        scales = documents.scales
        if tuple(scales.shape) != tuple(documents.values.shape[:-1]):
            raise ValueError(f"quantized documents' `scales` has shape [{_shape(scales)}]; expected "
                             f"[{', '.join(map(str, documents.values.shape[:-1]))}], the values' shape without d")
        documents = documents.values if documents.offsets is None else \
            PackedDocuments(documents.values, documents.offsets, documents.max_length)
    single = queries.dim() == 2
    Q = queries.unsqueeze(0) if single else queries
    Nq, Lq, d = Q.shape
    if d < 1:
        raise ValueError(f"`queries` has shape [{_shape(queries)}]; the feature size d must be >= 1")
    device = Q.device
    qmask = queries_mask
    if qmask is not None and single and isinstance(qmask, torch.Tensor) and qmask.dim() == 1:
        qmask = qmask.unsqueeze(0)
    qmask = _as_mask("queries_mask", qmask, (Nq, Lq), device)

    def check_docs(name, x):
        _check_strided(name, x)
        if quantized:
            if x.dtype not in (torch.int8, getattr(torch, "float8_e4m3fn", torch.int8)):
                raise TypeError(f"quantized `{name}` has dtype {x.dtype}; expected int8 or float8_e4m3fn")
        else:
            _check_floating(name, x, Q.dtype)
        if x.device != device:
            raise ValueError(f"`{name}` is on {x.device}; expected the queries' device {device}")
        if x.shape[-1] != d:
            raise ValueError(f"`{name}` has feature size {x.shape[-1]} (shape [{_shape(x)}]); "
                             f"expected d={d} as in `queries`")

    offsets = None
    candidates = 0
    if _is_packed(documents):
        values, offsets = documents[0], documents[1]
        max_length = _as_max_length(documents[2]) if len(documents) == 3 else None
        if values.dim() != 2:
            raise ValueError(f"packed `documents.values` has shape [{_shape(values)}]; expected [sum Ld, d]")
        check_docs("documents.values", values)
        check_offsets_tensor(offsets)
        if offsets.device != device:
            raise ValueError(f"`documents.offsets` is on {offsets.device}; expected {device}")
        max_length = _packed_max_length(values, offsets, max_length)
        offsets = offsets.to(torch.int64).contiguous()
        docs = values
        if documents_mask is None or isinstance(documents_mask, torch.Tensor):
            dmask = _as_mask("documents_mask", documents_mask, (values.shape[0],), device)
        else:
            lengths = (offsets[1:] - offsets[:-1]).tolist()          # one host read, on this layout only
            dmask = _as_mask("documents_mask", _flat_document_mask(documents_mask, lengths, device),
                             (values.shape[0],), device)
    elif isinstance(documents, torch.Tensor):
        if documents.dim() == 3:
            check_docs("documents", documents)
            docs = documents
            dmask = _as_mask("documents_mask", documents_mask, documents.shape[:2], device)
        elif documents.dim() == 4:
            check_docs("documents", documents)
            if documents.shape[0] != Nq:
                raise ValueError(f"`documents` has shape [{_shape(documents)}]: the per-query candidate layout "
                                 f"[Nq, K, Ld, d] needs Nq={Nq} as in `queries`")
            candidates = documents.shape[1]
            dmask = _as_mask("documents_mask", documents_mask, documents.shape[:3], device)
            docs = documents.reshape(Nq * candidates, *documents.shape[2:])
            if dmask is not None:
                dmask = dmask.reshape(Nq * candidates, documents.shape[2])
        else:
            raise ValueError(f"`documents` has shape [{_shape(documents)}]; expected [B, Ld, d], [Nq, K, Ld, d], "
                             "a list of [Ld_i, d] tensors or PackedDocuments(values, offsets)")
        max_length = docs.shape[1]
    elif isinstance(documents, (list, tuple)):
        if not documents:
            docs = Q.new_zeros((0, 1, d))
            max_length = 1
            dmask = None
        else:
            _check_document_list(documents)
            check_docs("documents[0]", documents[0])          # the rest are like it
            docs, offsets, max_length = _pack_checked(documents)
            if documents_mask is None:
                dmask = None
            else:
                if isinstance(documents_mask, torch.Tensor) and documents_mask.dim() == 1:
                    flat = documents_mask
                else:
                    flat = _flat_document_mask(documents_mask, [x.shape[0] for x in documents], device)
                dmask = _as_mask("documents_mask", flat, (docs.shape[0],), device)
    else:
        raise TypeError(f"`documents` must be a tensor, a list of tensors or PackedDocuments, "
                        f"got {type(documents).__name__}")

    if quantized:
        want = tuple(docs.shape[:-1])
        scales = scales.reshape(want)                  # checked above against the values' own shape
        if tuple(scales.shape) != want or scales.device != device:
            raise ValueError(f"quantized documents' `scales` has shape [{_shape(scales)}] on {scales.device}; "
                             f"expected [{', '.join(map(str, want))}] on {device}")
        if not scales.dtype.is_floating_point:
            raise TypeError(f"quantized documents' `scales` has dtype {scales.dtype}; expected a real floating-point "
                            "dtype (bfloat16 or float32)")
        if scales.dtype not in (torch.float32, torch.bfloat16):
            # the kernels read bf16 (quantize's) or fp32 scales as they are
            scales = scales.to(torch.float32)
    return Problem(Q, qmask, docs, dmask, offsets, int(max_length), int(candidates), single, scales)
