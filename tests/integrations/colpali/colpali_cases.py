"""Inputs for the colpali-engine integration tests, shaped like the trainer's: model outputs zero-padded to the
batch's longest sequence (right-padded, or left-padded as ``accelerate.pad_across_processes(pad_first=True)``
does across GPUs), negatives ``[B, N, Ld, d]``, documents gathered from several processes with an ``offset``.

Exact-arithmetic grid: CPU values are ``k / 256`` with ``|k| <= 256``. Every product is a multiple of 2^-16 and
every similarity (d = 16) and every hard-max score (Lq <= 6 tokens) needs at most 23 significant bits, so fp32
computes them EXACTLY in any summation order: the library's einsum and flash_maxsim agree bit for bit on which
token is the max, on the scores, and so on every threshold and top-k the losses apply afterwards. What remains is
the rounding of the backward sums and of the smooth max, which the 1e-5 tolerance measures. A draw whose real
top-two similarities tie exactly (or whose real max is exactly 0 next to padding) is redrawn: torch's ``amax``
splits a tie's gradient, flash_maxsim sends it to the first token (documented, and not what these tests measure).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

GRID = 256
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


def grid_values(shape, generator) -> torch.Tensor:
    return torch.randint(-GRID, GRID + 1, tuple(shape), generator=generator).to(torch.float32) / GRID


def padding_mask(shape, max_length: int, generator, min_length: int = 1, left: bool = False) -> torch.Tensor:
    """``[*shape, max_length]`` bool, random lengths; the first sequence is full length (a collator pads to the
    longest)."""
    lengths = torch.randint(min_length, max_length + 1, tuple(shape), generator=generator)
    lengths.view(-1)[0] = max_length
    position = torch.arange(max_length)
    if left:
        return position >= (max_length - lengths)[..., None]
    return position < lengths[..., None]


@dataclass
class Batch:
    """Leaf tensors (``raw``, random everywhere) and padding masks; ``padded()`` multiplies them as every
    colpali-engine model multiplies its output by the attention mask."""

    raw: Dict[str, torch.Tensor]
    masks: Dict[str, torch.Tensor]
    offset: int = 0
    extra: dict = field(default_factory=dict)

    def leaves(self, dtype=None, device=None) -> Dict[str, torch.Tensor]:
        return {k: v.detach().to(device=device, dtype=dtype).requires_grad_() for k, v in self.raw.items()}

    def padded(self, leaves) -> Dict[str, torch.Tensor]:
        out = {}
        for name, leaf in leaves.items():
            mask = self.masks[name].to(leaf.device)
            x = leaf * mask[..., None].to(leaf.dtype)
            x.retain_grad()
            out[name] = x
        return out


def has_fragile_max(queries, query_mask, documents, document_mask) -> bool:
    """Whether some real query token's hard max over a document's real tokens ties exactly (top two equal), or is
    exactly 0 while the document has zero padding (which the library also counts as similarity 0)."""
    q = queries.double()
    docs = documents.reshape(-1, *documents.shape[-2:]).double()
    dmask = document_mask.reshape(-1, document_mask.shape[-1])
    s = torch.einsum("bid,tjd->bitj", q, docs).masked_fill(~dmask[None, None], float("-inf"))
    top = s.topk(min(2, s.shape[-1]), dim=-1).values
    tie = top[..., 0] == top[..., 1] if top.shape[-1] == 2 else torch.zeros_like(top[..., 0], dtype=torch.bool)
    zero_with_padding = (top[..., 0] == 0) & (~dmask).any(-1)[None, None]
    return bool(((tie | zero_with_padding) & query_mask[:, :, None]).any())


def loss_batch(generator, *, batch=4, processes=1, query_length=6, doc_length=9, negatives=0, neg_length=7,
               dim=16, left_padded_docs=False, values=grid_values, max_draws=50) -> Batch:
    """A trainer-like batch: ``batch`` queries, ``batch * processes`` gathered documents (this process is rank 1
    when ``processes > 1``, so ``offset = batch``), ``negatives`` explicit negatives per query."""
    for _ in range(max_draws):
        masks = {"q": padding_mask((batch,), query_length, generator, min_length=2),
                 "d": padding_mask((batch * processes,), doc_length, generator, left=left_padded_docs)}
        raw = {"q": values((batch, query_length, dim), generator),
               "d": values((batch * processes, doc_length, dim), generator)}
        if negatives:
            masks["n"] = padding_mask((batch, negatives), neg_length, generator)
            raw["n"] = values((batch, negatives, neg_length, dim), generator)
        fragile = has_fragile_max(raw["q"] * masks["q"][..., None], masks["q"], raw["d"] * masks["d"][..., None],
                                  masks["d"])
        if negatives:
            fragile |= has_fragile_max(raw["q"] * masks["q"][..., None], masks["q"],
                                       raw["n"] * masks["n"][..., None], masks["n"])
        if not fragile:
            return Batch(raw, masks, offset=batch if processes > 1 else 0)
    raise AssertionError(f"no tie-free draw in {max_draws} attempts")


FP32_UNIT_ROUNDOFF = 2.0 ** -24


def logit_rounding(scores, query_lengths, loss, document_length: int) -> float:
    """Largest change of any logit ``z = score [/ query length] / temperature`` that fp32 rounding of the smooth max
    can cause, summed over two evaluations (the library's logsumexp and flash_maxsim's online one): each rounds once
    per summed term (``document_length`` exponentials, one score per query token) plus the log, the length
    normalization and the temperature division, each a relative ``u = 2^-24`` of at most the largest logit.
    ``scores`` are what reached flash_maxsim (rows = queries)."""
    z = scores.detach().double().abs()
    if getattr(loss, "normalize_scores", False):
        z = z / query_lengths.double().reshape(-1, *([1] * (z.dim() - 1)))
    steps = 2 * (document_length + int(query_lengths.max()) + 3)
    return steps * FP32_UNIT_ROUNDOFF * (z.max().item() / loss.temperature)


def loss_rounding_bound(loss_value: torch.Tensor, max_logit_change: float) -> float:
    """|change of the loss| when every logit moves by at most ``max_logit_change``. Each colpali-engine loss is a mean
    of cross-entropy (-log p) or softplus terms of logit differences; their gradient's 1-norm is at most
    2 (1 - p) <= 2 min(1, term), resp. 2 sigmoid <= 2 min(1, softplus), and the mean of min(1, .) is at most
    min(1, mean) (concavity). So the loss moves by at most 2 min(1, loss) max|dz|: RELATIVE to a small loss, the
    change is 2 max|dz|, however small the loss (a well-separated batch at temperature 0.02 has logits in the
    hundreds and a loss near 1e-3: one fp32 ulp of its logits is then ~1e-5 of the loss)."""
    return 2 * min(1.0, abs(loss_value.item())) * max_logit_change


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, floor) (the absolute difference when that is 0)."""
    scale = max(want.detach().abs().max().item(), floor)
    diff = (got.detach().double() - want.detach().double()).abs().max().item()
    return diff / scale if scale else diff


def tolerances(loss, batch: Batch, want_value: torch.Tensor, flash_outputs, smooth: bool):
    """``(absolute loss tolerance, relative gradient tolerance)`` for a patched loss against the library's.

    Hard max on grid data: every similarity and score is exact in fp32, so only the backward sums round (LOSS_RTOL,
    GRAD_RTOL). Smooth max: the library's logsumexp and flash_maxsim's online one round differently, so the loss and
    its softmax/sigmoid weights move by what a few ulps of the temperature-scaled logits imply, not by a fixed
    fraction of the loss (a well-separated draw has a loss near 1e-7 and logits in the hundreds).
    ``flash_outputs`` are the scores flash_maxsim returned (``Calls.flash_outputs``)."""
    loss_tolerance, grad_rtol = LOSS_RTOL * abs(want_value.item()), GRAD_RTOL
    if smooth:
        longest_document = max(mask.shape[-1] for name, mask in batch.masks.items() if name != "q")
        dz = logit_rounding(torch.cat([s.flatten(1) for s in flash_outputs], 1), batch.masks["q"].sum(1), loss,
                            document_length=longest_document)
        loss_tolerance = max(loss_tolerance, loss_rounding_bound(want_value, dz))
        grad_rtol = GRAD_RTOL + 2 * dz          # every softmax/sigmoid weight moves by at most 2 max|dz| relative
    return loss_tolerance, grad_rtol


# Below fp32's normal range (2^-126) every operation rounds to an ABSOLUTE 2^-150, so a gradient whose largest entry
# lies there keeps no relative precision: at temperature 0.02 a negative far below its positive gets softplus
# gradient sigmoid(-100) ~ 4e-44, and the library's own fp32 gradient is then ~2% off its float64 one. From such a
# term to an embedding's gradient the chain rule multiplies by at most 1 / temperature times Lq entries of size <= 1
# (50 * 6 < 2^10 on these inputs), so a gradient above 2^-116 never passed through the subnormal range; below it
# the comparison is absolute, at this floor.
GRADIENT_FLOOR = 2.0 ** -116


def gradient_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``relative_error`` for gradients: relative in fp32's normal range, absolute below ``GRADIENT_FLOOR``."""
    return relative_error(got, want, floor=GRADIENT_FLOOR)


class Calls:
    """Counts what reaches ``flash_maxsim.maxsim`` (and the dtypes it gets) and the ``torch.einsum`` calls made
    by colpali-engine's own code (flash_maxsim's CPU path uses einsum too: only callers in colpali_engine count)."""

    def __init__(self, monkeypatch):
        import flash_maxsim

        self.flash = 0
        self.flash_dtypes: List[torch.dtype] = []
        self.flash_outputs: List[torch.Tensor] = []
        self.library_einsum = 0
        real_maxsim, real_einsum = flash_maxsim.maxsim, torch.einsum

        def maxsim(queries, *args, **kwargs):
            self.flash += 1
            self.flash_dtypes.append(queries.dtype)
            out = real_maxsim(queries, *args, **kwargs)
            self.flash_outputs.append(out.detach())
            return out

        def einsum(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("colpali_engine"):
                self.library_einsum += 1
            return real_einsum(*args, **kwargs)

        monkeypatch.setattr(flash_maxsim, "maxsim", maxsim)
        monkeypatch.setattr(torch, "einsum", einsum)

    def reset(self):
        self.flash, self.library_einsum = 0, 0
        self.flash_dtypes.clear()
        self.flash_outputs.clear()


@contextlib.contextmanager
def nothing():
    yield


def outcome(function):
    """``("ok", value)`` or ``("raises", exception type)``: the patched code must fail where the library fails."""
    try:
        return "ok", function()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return "raises", type(error)


def snapshot_library() -> Dict[tuple, object]:
    """Every module attribute of colpali_engine and every class attribute of its loss classes and of
    BaseVisualRetrieverProcessor: enable() may change only the expected ones, disable() must restore all."""
    from colpali_engine.loss import late_interaction_losses
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    state = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("colpali_engine"):
            for attribute, value in list(vars(module).items()):
                state[(name, attribute)] = value
    classes = [v for v in vars(late_interaction_losses).values()
               if isinstance(v, type) and v.__module__ == late_interaction_losses.__name__]
    for cls in classes + [BaseVisualRetrieverProcessor]:
        for attribute, value in vars(cls).items():
            state[(cls.__qualname__, attribute)] = value
    return state


def changed(before: Dict[tuple, object], after: Dict[tuple, object]) -> set:
    keys = set(before) | set(after)
    return {k for k in keys if before.get(k, KeyError) is not after.get(k, KeyError)}


def optional_import(name: str) -> Optional[object]:
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        return None


class LargestTensor:
    """A dispatch mode recording the largest tensor any aten op outputs (flash_maxsim's custom op is opaque to
    it on CUDA: its Triton kernels call no aten op). The library's einsum materialises [B, B, Lq, Ld]."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for item in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(item, torch.Tensor):
                        recorder.largest = max(recorder.largest, item.numel())
                return out

        self.largest = 0
        self.mode = _Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def frobenius_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: robust to the rare hard-max near-ties that fp32 summation order flips at
    realistic sizes (each moves one token's gradient to an almost equally similar token)."""
    want = want.detach().double()
    return ((got.detach().double() - want).norm() / want.norm()).item()
