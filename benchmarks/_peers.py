"""Adapters that call the two peer kernel packages with the benchmark's layouts, for side-by-side numbers only.

The peers are read for facts (their public call signatures), never copied:

- ``late_interaction_kernels`` 0.4.5 ("LIK"): ``maxsim(Q, D, q_mask=None, d_mask=None, *, normalize=False,
  backward=None)``; ``D`` ``[Nd, Ld, d]`` -> ``[Nq, Nd]``, ``D`` ``[Nq, K, Ld, d]`` -> ``[Nq, K]``; fp32
  scores, autograd-aware (it saves the arg-max only when an input requires grad). It warns once when the
  queries are not L2-normalised; the benchmark's inputs are normalised, as ColBERT/ColPali embeddings are.
- flash-maxsim 0.3.0, unpacked as ``flash_maxsim_pypi`` (see ../shared/device/wheels.sh):
  ``flash_maxsim(Q [Lq, d], D [B, Ld, d], doc_lengths=None, query_chunk_size=128, splitk=False) -> [B]``
  (``splitk=True`` is its documented option for long queries and documents at small B),
  ``flash_maxsim_batched(Q [Nq, Lq, d], D [B, Ld, d]) -> [Nq, B]`` and
  ``flash_maxsim_batched_train(Q, D, shared_docs=True)``: ``D`` ``[B, Ld, d]`` (in-batch) or, with
  ``shared_docs=False``, ``[Nq, K, Ld, d]`` (per-query candidates) -> ``[Nq, B|K]`` fp32 with autograd.
  It computes in fp16 internally (bf16 inputs are converted on load).

Neither peer has a smooth (log-sum-exp) max: :meth:`Peer.train_scores` returns None for it.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

log = logging.getLogger("flash_maxsim.bench")

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Peer:
    """One peer package: how to score with it, per layout."""

    key: str
    label: str
    version: str
    module: object = field(repr=False)

    def forward_variants(self, queries: torch.Tensor, documents: torch.Tensor) -> list[tuple[str, ScoreFn]]:
        """Inference calls worth timing for this shape (``[Nq, Lq, d]`` x ``[B, Ld, d]`` -> ``[Nq, B]`` fp32).

        More than one when the peer documents an option for this regime; the benchmark keeps the fastest
        correct one, so that the peer is measured at its best."""
        raise NotImplementedError

    def train_scores(self, layout: str, smooth_tau: Optional[float]) -> Optional[ScoreFn]:
        """Differentiable scores for ``layout`` ("inbatch": ``[B, Ld, d]`` documents, "kd": ``[Nq, K, Ld, d]``),
        or None when the peer has no such operation."""
        raise NotImplementedError


class _LateInteractionKernels(Peer):
    def forward_variants(self, queries, documents):
        maxsim = self.module.maxsim
        return [("maxsim", lambda q, d: maxsim(q, d))]

    def train_scores(self, layout, smooth_tau):
        if smooth_tau is not None:
            return None
        maxsim = self.module.maxsim
        return lambda q, d: maxsim(q, d)  # dispatches on d.dim(): 3-D in-batch, 4-D per-query candidates


class _FlashMaxsimPypi(Peer):
    def forward_variants(self, queries, documents):
        m = self.module
        Nq, Lq, _ = queries.shape
        Ld = documents.shape[1]
        if Nq == 1:
            variants = [("flash_maxsim", lambda q, d: m.flash_maxsim(q[0], d).unsqueeze(0))]
            # its docstring recommends split-K "for the ColPali regime (Lq>=512, Ld>=512) at small B"
            if Lq >= 512 and Ld >= 512:
                variants.append(("flash_maxsim(splitk=True)",
                                 lambda q, d: m.flash_maxsim(q[0], d, splitk=True).unsqueeze(0)))
            return variants
        return [("flash_maxsim_batched", lambda q, d: m.flash_maxsim_batched(q, d))]

    def train_scores(self, layout, smooth_tau):
        if smooth_tau is not None:
            return None
        train = self.module.flash_maxsim_batched_train
        if layout == "kd":
            return lambda q, d: train(q, d, shared_docs=False)
        return lambda q, d: train(q, d, shared_docs=True)


_KNOWN = {
    "lik": ("late_interaction_kernels", "late-interaction-kernels", _LateInteractionKernels),
    "fmpypi": ("flash_maxsim_pypi", "flash-maxsim (PyPI)", _FlashMaxsimPypi),
}

PEER_KEYS = tuple(_KNOWN)


def load_peers(keys) -> tuple[list[Peer], dict[str, str]]:
    """Import the requested peers; returns (the importable ones, {key: why not} for the others)."""
    peers, missing = [], {}
    for key in keys:
        if key not in _KNOWN:
            raise ValueError(f"unknown peer {key!r}; known: {', '.join(_KNOWN)}")
        module_name, label, cls = _KNOWN[key]
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # ImportError, or a peer failing at import (no Triton, no CUDA, ...)
            missing[key] = f"import {module_name} failed: {type(exc).__name__}: {exc}"
            log.info("peer %s not available: %s", key, missing[key])
            continue
        version = str(getattr(module, "__version__", "?"))
        peers.append(cls(key=key, label=f"{label} {version}", version=version, module=module))
    return peers, missing
