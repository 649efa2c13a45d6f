"""One side of a sentence-transformers scoring call (queries or documents) as sentence-transformers accepts it:
a ragged list of ``[tokens, dim]`` embeddings or a padded ``[N, tokens, dim]`` tensor (numpy arrays, and one
``[tokens, dim]`` embedding as a batch of one, too), with its mask; and what the fused kernels need of it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from .._inputs import as_mask, as_tensor, check_rank, length_mask, shape_of

#: The dtypes the kernels score in; any other is scored in float32.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def as_embeddings(x, name: str) -> Tensor:
    t = as_tensor(x, name)
    # quantized (integer) embeddings score as float, as in sentence-transformers
    return t if t.is_floating_point() else t.float()


@dataclass
class Side:
    """One side of a scoring call: either a ragged list (``items``) or a padded ``[N, L, d]`` tensor."""

    name: str
    mask_name: str
    items: Optional[List[Tensor]]
    padded: Optional[Tensor]
    mask: Optional[Tensor]          # the caller's mask, [N, width], any dtype; None when not given
    device: Optional[torch.device]  # where the caller's tensors live; None for numpy input

    lengths_: Optional[List[int]] = None      # computed once: a 20k-item list makes every pass count
    dtype_: Optional[torch.dtype] = None

    @property
    def count(self) -> int:
        return len(self.items) if self.items is not None else self.padded.shape[0]

    @property
    def lengths(self) -> List[int]:
        if self.lengths_ is None:
            self.lengths_ = [int(x.shape[0]) for x in self.items]
        return self.lengths_

    @property
    def width(self) -> int:
        if self.items is not None:
            return max(self.lengths, default=0)
        return self.padded.shape[1]

    @property
    def dim(self) -> Optional[int]:
        if self.items is not None:
            return next((int(x.shape[1]) for x in self.items if x.dim() == 2), None)
        return self.padded.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        if self.items is None:
            return self.padded.dtype
        if self.dtype_ is None:
            self.dtype_ = functools.reduce(torch.promote_types, {x.dtype for x in self.items})
        return self.dtype_


def read_side(embeddings, mask, name: str, mask_name: str) -> Side:
    """The argument ``embeddings`` (called ``name``) and its mask ``mask`` (``mask_name``) as a :class:`Side`."""
    mask = as_mask(mask, mask_name, per_item_lists=True)
    if isinstance(embeddings, (list, tuple)):
        device = embeddings[0].device if embeddings and isinstance(embeddings[0], Tensor) else None
        # the common case in one pass (dense floating [tokens, dim] tensors of one dim); else item by item
        try:
            kinds = {(x.dim(), x.is_floating_point(), x.layout, x.shape[-1]) for x in embeddings}
        except (AttributeError, IndexError):
            kinds = None
        if kinds is not None and len(kinds) == 1 and next(iter(kinds))[:3] == (2, True, torch.strided):
            items = list(embeddings)
        else:
            items = [as_embeddings(x, f"{name}[{i}]") for i, x in enumerate(embeddings)]
            dims = {int(x.shape[1]) for x in items if x.dim() == 2}
            if len(dims) > 1:
                raise ValueError(f"`{name}` mixes embedding sizes {sorted(dims)}; every item must be "
                                 "[tokens, dim] with one dim")
            dim = next(iter(dims), 1)
            for i, x in enumerate(items):
                if x.dim() == 1 and x.numel() == 0:      # an empty item written as [] has no dim of its own
                    items[i] = x.new_zeros(0, dim)
                else:
                    check_rank(x, 2, f"{name}[{i}]", "[tokens, dim]")
        side = Side(name, mask_name, items, None, mask, device)
    else:
        device = embeddings.device if isinstance(embeddings, Tensor) else None
        t = as_embeddings(embeddings, name)
        if t.dim() == 2:                              # one embedding, scored as a batch of one
            t = t.unsqueeze(0)
            if mask is not None and mask.dim() == 1:
                mask = mask.unsqueeze(0)
        check_rank(t, 3, name, "[batch, tokens, dim], [tokens, dim] or a list of [tokens, dim] embeddings")
        side = Side(name, mask_name, None, t, mask, device)
    if side.mask is not None and side.count > 0:
        side.mask = fit_mask(side.mask, side.count, side.width, mask_name)
    return side


def fit_mask(mask: Tensor, count: int, width: int, name: str) -> Tensor:
    if mask.dim() not in (1, 2) or mask.shape[-1] != width:
        raise ValueError(f"`{name}` has shape {shape_of(mask)}, but the padded embeddings have {width} tokens: "
                         f"expected [{count}, {width}] (or [1, {width}] / [{width}] for all items)")
    if mask.dim() == 2 and mask.shape[0] not in (1, count):
        raise ValueError(f"`{name}` has {mask.shape[0]} rows; expected {count} (one per item) or 1")
    return mask.expand(count, width).contiguous()      # one row for all items becomes one row per item


def result_device(queries: Side, documents: Side) -> torch.device:
    # sentence-transformers: scores live on the documents' device; numpy documents follow the queries
    return documents.device or queries.device or torch.device("cpu")


def kernel_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype both sides are scored in: the wider of the two where the kernels take it, else float32."""
    dtype = torch.promote_types(a, b)
    return dtype if dtype in KERNEL_DTYPES else torch.float32


def has_weights(mask: Optional[Tensor]) -> bool:
    """Whether a query mask weights tokens (values other than 0/1), which the kernels cannot express."""
    if mask is None or mask.dtype == torch.bool:
        return False
    return bool(((mask != 0) & (mask != 1)).any())


def marks_padding(side: Side) -> bool:
    """Whether the caller's mask of a ragged list marks positions beyond an item's own length."""
    if side.items is None or side.mask is None or side.width == 0:
        return False
    beyond = ~length_mask(side.lengths, side.width, side.mask.device)
    return bool((side.mask.bool() & beyond).any())


def pad_items(items: List[Tensor], width: int, device, dtype) -> Tensor:
    """Stack ragged ``[L_i, d]`` items into zero-padded ``[N, width, d]`` with one scatter (no per-item copy)."""
    lengths = [int(x.shape[0]) for x in items]
    d = next(int(x.shape[1]) for x in items)
    if all(n == width for n in lengths):
        return torch.stack([x.to(device=device, dtype=dtype) for x in items])
    flat = torch.cat([x.to(dtype) for x in items]).to(device)
    counts = torch.tensor(lengths, device=device)
    starts = torch.cumsum(counts, 0) - counts
    rows = torch.repeat_interleave(torch.arange(len(items), device=device), counts, output_size=flat.shape[0])
    positions = torch.arange(flat.shape[0], device=device) - starts[rows]
    padded = flat.new_zeros(len(items) * width, d)
    return padded.index_copy(0, rows * width + positions, flat).view(len(items), width, d)


def prepare_queries(side: Side, device, dtype):
    """Padded queries ``[N, Lq, d]``, the scoring mask (bool), and the real token counts for MeanMaxSim."""
    if side.items is not None:
        width = side.width
        queries = pad_items(side.items, width, device, dtype)
        if side.mask is not None:
            # zero padding rows the caller's mask marks score exactly 0 here as in sentence-transformers
            mask = side.mask.to(device).bool()
        else:
            mask = length_mask(side.lengths, width, device)
    else:
        queries = side.padded.to(device)
        mask = side.mask.to(device).bool() if side.mask is not None else queries.any(-1)
        queries = queries.to(dtype)
    if side.mask is None and side.items is not None:
        counts = torch.tensor(side.lengths, device=device).clamp(min=1)
    else:
        counts = mask.sum(-1).clamp(min=1)
    return queries, mask, counts


def check_dims(queries: Side, documents: Side) -> None:
    dq, dd = queries.dim, documents.dim
    if dq is not None and dd is not None and dq != dd:
        raise ValueError(f"`{queries.name}` has embedding size {dq} but `{documents.name}` has {dd}")

