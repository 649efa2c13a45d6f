"""A compressed index scored as a toolkit scores the documents it zero-pads.

colpali-engine's ``score_multi_vector`` and PyLate's ``rank.rerank`` pad a group of documents to the group's
longest with zero vectors and score without a mask: a shorter document then has extra similarity-0 tokens, so its
hard max never falls below 0. flash_maxsim scores a packed index without padding; one zero token (an int8/fp8
zero with scale 0: similarity exactly 0) after exactly the documents the toolkit would lengthen gives the same
scores (one zero token and many give the same max).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

import flash_maxsim


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
    flagged in ``extra`` followed by a zero token, as a packed ``QuantizedDocuments`` on ``device``."""
    zero_value = index.values.new_zeros((1, index.values.shape[1]))
    zero_scale = index.scales.new_zeros((1,))
    zero_mask = None if index.mask is None else index.mask.new_ones((1,))
    values, scales, masks, offsets = [], [], [], [0]
    for i in range(start, stop):
        a, b = bounds[i], bounds[i + 1]
        values.append(index.values[a:b])
        scales.append(index.scales[a:b])
        if index.mask is not None:
            masks.append(index.mask[a:b])
        if extra[i]:
            values.append(zero_value)
            scales.append(zero_scale)
            if index.mask is not None:
                masks.append(zero_mask)
        offsets.append(offsets[-1] + (b - a) + int(extra[i]))
    longest = max(bounds[i + 1] - bounds[i] + int(extra[i]) for i in range(start, stop))
    return flash_maxsim.QuantizedDocuments(
        torch.cat(values).to(device), torch.cat(scales).to(device),
        torch.tensor(offsets, dtype=torch.int64, device=device),
        torch.cat(masks).to(device) if masks else None, longest, index.kind)
