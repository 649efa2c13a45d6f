"""A compressed index scored as a toolkit scores the documents it zero-pads.

colpali-engine's ``score_multi_vector`` and PyLate's ``rank.rerank`` pad a group of documents to the group's
longest with zero vectors and score without a mask: a shorter document then has extra similarity-0 tokens, so its
hard max never falls below 0. flash_maxsim scores a packed index without padding; one zero token (an int8/fp8
zero with scale 0: similarity exactly 0) after exactly the documents the toolkit would lengthen gives the same
scores (one zero token and many give the same max).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

import flash_maxsim

from ._inputs import packed_bounds


def document_bounds(index, name: str) -> Tuple[List[int], List[int]]:
    """``(offsets, lengths)`` of a packed ``QuantizedDocuments`` handed in by a caller, as lists, its offsets
    checked against its token rows (:func:`packed_bounds`) before anything is read by them."""
    bounds = packed_bounds(index.offsets, index.values.shape[0], name)
    return bounds, [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def padded_by_group(lengths: Sequence[int], group_size: int) -> List[bool]:
    """Which documents a toolkit's per-group padding lengthens (shorter than their group's longest)."""
    flags = []
    for start in range(0, len(lengths), group_size):
        group = lengths[start:start + group_size]
        longest = max(group)
        flags.extend(n < longest for n in group)
    return flags


def with_zero_tokens(index, bounds: Sequence[int], extra: Sequence[bool], start: int, stop: int, device):
    """Documents ``start:stop`` of a packed ``QuantizedDocuments`` (``bounds`` = its offsets as a list), each one
    flagged in ``extra`` followed by a zero token, as a packed ``QuantizedDocuments`` on ``device``. One scatter
    per tensor, not one slice per document (a pool of 20k pages is one call)."""
    first, last = bounds[start], bounds[stop]
    lengths = [bounds[i + 1] - bounds[i] for i in range(start, stop)]
    grown = [n + int(e) for n, e in zip(lengths, extra[start:stop])]
    offsets = torch.tensor([0] + grown, dtype=torch.int64).cumsum(0)
    # each original token moves by the zero tokens inserted before its document
    shift = offsets[:-1] - torch.tensor([0] + lengths[:-1], dtype=torch.int64).cumsum(0)
    where = (torch.arange(last - first) + shift.repeat_interleave(torch.tensor(lengths))).to(index.values.device)
    total = int(offsets[-1])
    # bytes, so that int8 and fp8 alike scatter (a zero byte is the value 0 in both); zero scales too
    values = index.values.new_zeros((total, index.values.shape[1]), dtype=torch.uint8)
    values[where] = index.values[first:last].view(torch.uint8)
    scales = index.scales.new_zeros((total,))
    scales[where] = index.scales[first:last]
    mask = None
    if index.mask is not None:
        mask = index.mask.new_ones((total,))
        mask[where] = index.mask[first:last]
    return flash_maxsim.QuantizedDocuments(
        values.view(index.values.dtype).to(device), scales.to(device), offsets.to(device),
        None if mask is None else mask.to(device), max(grown), index.kind)
