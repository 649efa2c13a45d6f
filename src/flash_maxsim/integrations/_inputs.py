"""Input coercion and checks shared by the integrations: a toolkit's embeddings and masks (tensors, numpy
arrays, lists of either) as tensors, shapes in error messages, length masks, and the offsets of a packed index
handed in by a caller. Every error names the caller's argument."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union

import torch
from torch import Tensor

if TYPE_CHECKING:
    import numpy

try:  # numpy comes with every toolkit; without it no argument can be an array
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

#: What the toolkits accept as embeddings or masks: a tensor, a numpy array, or a list or tuple of either (or of
#: numbers), converted by :func:`as_tensor`.
if TYPE_CHECKING:
    ArrayLike = Union[Tensor, "numpy.ndarray", Sequence[Any]]
else:
    ArrayLike = Union[(Tensor, Sequence[Any]) if _np is None else (Tensor, _np.ndarray, Sequence[Any])]


def shape_of(x) -> str:
    """``[2, 3, 16]``: a tensor's or array's shape as error messages print it."""
    return "[" + ", ".join(str(int(s)) for s in x.shape) + "]"


def is_ndarray(x) -> bool:
    return _np is not None and isinstance(x, _np.ndarray)


def array_to_tensor(x) -> Tensor:
    """A numpy array as a tensor: a view when possible (a corpus of embeddings is large); read-only or exotic
    arrays are copied."""
    if x.flags.writeable:
        try:
            return torch.from_numpy(x)
        except (TypeError, ValueError):
            pass
    return torch.tensor(_np.ascontiguousarray(x))


def _stack(items: List[Tensor], name: str) -> Tensor:
    try:
        return torch.stack(items)
    except RuntimeError as error:
        raise ValueError(f"`{name}` lists items of different shapes ({shape_of(items[0])} and others); pass one "
                         "array or tensor, or items of one shape") from error


def as_tensor(x, name: str, *, lists_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``x`` as a dense tensor: a tensor as it is, a numpy array through :func:`array_to_tensor`, a list or tuple of
    tensors or arrays stacked, any other sequence through ``torch.tensor``.

    ``lists_dtype``: the dtype of a tensor made from a list of arrays or of numbers (PyLate's ``convert_to_tensor``
    makes those float32); None keeps theirs. A list of tensors keeps its dtype either way."""
    if isinstance(x, Tensor):
        t = x
    elif is_ndarray(x):
        t = array_to_tensor(x)
    elif isinstance(x, (list, tuple)) and x and all(isinstance(v, Tensor) for v in x):
        t = _stack(list(x), name)
    elif isinstance(x, (list, tuple)) and x and all(is_ndarray(v) for v in x):
        t = _stack([array_to_tensor(v) for v in x], name)
        if lists_dtype is not None:
            t = t.to(lists_dtype)
    else:
        try:
            t = torch.tensor(x, dtype=lists_dtype)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"`{name}` must be a tensor, a numpy array or a list of them, "
                            f"got {type(x).__name__}") from error
    if t.is_sparse:
        raise TypeError(f"`{name}` is a sparse tensor; multi-vector embeddings must be dense")
    return t


def as_mask(mask, name: str, *, per_item_lists: bool = False,
            lists_dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """A mask argument as a tensor (None stays None). With ``per_item_lists`` a list holds one ``[tokens]`` mask
    per item, of any lengths, and is zero-padded to ``[items, longest]``; otherwise a list is converted as
    :func:`as_tensor` converts it."""
    if mask is None:
        return None
    if per_item_lists and isinstance(mask, (list, tuple)):
        if not mask:
            return torch.zeros(0, 0, dtype=torch.bool)
        items = [as_tensor(m, f"{name}[{i}]") for i, m in enumerate(mask)]
        for i, m in enumerate(items):
            check_rank(m, 1, f"{name}[{i}]", "one [tokens] mask per item")
        return torch.nn.utils.rnn.pad_sequence(items, batch_first=True)
    return as_tensor(mask, name, lists_dtype=lists_dtype)


def check_rank(x: Tensor, dims: int, name: str, layout: str) -> None:
    """``x`` has ``dims`` dimensions, else a ValueError: "`name` has shape [...]; expected <layout>"."""
    if x.dim() != dims:
        raise ValueError(f"`{name}` has shape {shape_of(x)}; expected {layout}")


def length_mask(lengths: Sequence[int], width: int, device) -> Tensor:
    """``[len(lengths), width]`` bool, True at the first ``lengths[i]`` positions of row ``i``."""
    return torch.arange(width, device=device)[None, :] < torch.tensor(list(lengths), device=device)[:, None]


def packed_bounds(offsets: Tensor, rows: int, name: str) -> List[int]:
    """The offsets of a packed index handed in by a caller, as a list, checked before anything reads by them:
    one dimension, integers, starting at 0, non-decreasing (no negative document length), ending at ``rows``
    (the index's token rows). Cheap: the integrations read the offsets on the host anyway."""
    if offsets.dim() != 1 or offsets.numel() == 0 or offsets.is_floating_point() or offsets.is_complex() \
            or offsets.dtype == torch.bool:
        raise ValueError(f"`{name}` offsets must be a non-empty 1-D integer tensor, got {offsets.dtype} of shape "
                         f"{shape_of(offsets)}")
    cpu = offsets.to("cpu", torch.int64)
    if int(cpu[0]) != 0:
        raise ValueError(f"`{name}` offsets must start at 0, got {int(cpu[0])}")
    decreasing = (cpu[1:] < cpu[:-1]).nonzero()
    if decreasing.numel():
        i = int(decreasing[0, 0])
        raise ValueError(f"`{name}` offsets decrease at document {i} ({int(cpu[i])} -> {int(cpu[i + 1])}): its "
                         "length would be negative")
    if int(cpu[-1]) != rows:
        raise ValueError(f"`{name}` offsets end at {int(cpu[-1])} but the index holds {rows} token rows")
    return cpu.tolist()
