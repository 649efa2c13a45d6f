"""Adapters that call the two peer kernel packages with the benchmark's layouts, for side-by-side numbers only.

The peers are read for facts (their public call signatures), never copied:

- ``late_interaction_kernels`` 0.4.5 ("LIK"): ``maxsim(Q, D, q_mask=None, d_mask=None, *, normalize=False,
  backward=None)``; ``D`` ``[Nd, Ld, d]`` -> ``[Nq, Nd]``, ``D`` ``[Nq, K, Ld, d]`` -> ``[Nq, K]``; fp32
  scores, autograd-aware (it saves the arg-max only when an input requires grad). It warns once when the
  queries are not L2-normalised; the benchmark's inputs are normalised, as ColBERT/ColPali embeddings are.
- flash-maxsim 0.3.0 from PyPI, whose import name ``flash_maxsim`` is this project's: it is imported as
  ``flash_maxsim_pypi``, either a package of that name on the path or the ``flash_maxsim`` package found in the
  folder named by the environment variable ``FLASH_MAXSIM_PYPI_DIR`` (e.g. ``pip install --no-deps --target DIR
  flash-maxsim==0.3.0``), loaded under the other name (its modules import each other relatively):
  ``flash_maxsim(Q [Lq, d], D [B, Ld, d], doc_lengths=None, query_chunk_size=128, splitk=False) -> [B]``
  (``splitk=True`` is its documented option for long queries and documents at small B),
  ``flash_maxsim_batched(Q [Nq, Lq, d], D [B, Ld, d]) -> [Nq, B]`` and
  ``flash_maxsim_batched_train(Q, D, shared_docs=True)``: ``D`` ``[B, Ld, d]`` (in-batch) or, with
  ``shared_docs=False``, ``[Nq, K, Ld, d]`` (per-query candidates) -> ``[Nq, B|K]`` fp32 with autograd.
  It computes in fp16 internally (bf16 inputs are converted on load).

Neither peer has a smooth (log-sum-exp) max: :meth:`Peer.train_scores` returns None for it.

Top-k over a corpus, :meth:`Peer.topk_variant` (search_bench.py); both take a padded ``[N, Ld, d]`` corpus only:

- late-interaction-kernels 0.4.5 ``retrieve(Q, D, top_k, q_mask=None, d_mask=None, *, normalize=True, chunk=None)``
  -> ``(scores, indices)`` ``[Nq, top_k]``: its ``maxsim`` forward per chunk of ``chunk`` documents and a running
  ``torch.topk`` (exact). Called with ``normalize=False`` (the benchmark's tokens are unit vectors already) and a
  chunk below 2^31 elements (see ``PEER_MAX_ELEMENTS`` in _sections.py).
- flash-maxsim 0.3.0 ``flash_maxsim_topk(Q [Lq, d], D [N, Ld, d], k, doc_lengths=None, n_candidates=None,
  D_int8=None, scales=None, mins=None)`` -> ``([k], [k])``: one query; an approximate two-stage search, its
  int8 kernel over every document (per-token affine uint8 from its ``quantize_int8(D) -> (uint8, scales, mins)``,
  passed pre-quantised as its docstring recommends) and an fp16 re-score of the best ``n_candidates`` (default
  4k). So it keeps the corpus twice (fp16 and uint8). Called once per query, on chunks below 2^31 elements whose
  results are merged with ``torch.topk``.

Compressed (8-bit) document paths, :meth:`Peer.compressed_variants`; both peers quantise the queries as well:

- flash-maxsim 0.3.0 ``flash_maxsim_int8x8(Q [Lq, d], D_int8 [B, Ld, d], d_scales [B, Ld(, 1)], Q_int8=None,
  q_scales=None) -> [B]``: int8 x int8 tensor-core products (int32), ``S = S_int32 * q_scale * d_scale``.
  Documents come from its ``quantize_int8_symmetric(D) -> (int8, fp16 scales [B, Ld, 1])`` (per token, absmax /
  127, the division done in D's dtype); the query from ``quantize_query_int8(Q [Lq, d]) -> (int8, fp16 [Lq])``,
  on the fly inside the call when ``Q_int8`` is not given. One query only.
- late-interaction-kernels 0.4.5 ``late_interaction_kernels.fp8.maxsim_inference_fp8(Q, D, *, scale_Q, scale_D)``:
  Q and D both ``float8_e4m3fn`` (a bf16 Q sends it to its dequantise-to-bf16 fallback), scales per tensor
  (``()``) or per token (``[N, L]``) from its ``quantize_fp8_per_tensor`` / ``quantize_fp8_per_token`` (amax /
  448, fp32). Its fp8 kernel needs CUDA and compute capability >= 9; elsewhere it warns once and falls back to
  dequantised bf16 (the CPU smoke run only exercises that fallback).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

log = logging.getLogger("flash_maxsim.bench")

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class CompressedVariant:
    """One way of scoring a compressed document index.

    ``prepare(queries, documents)`` does the index-time work (quantising the documents, and the queries for the
    "pre-quantised" variants) outside the timed region and returns the inputs of ``call``; ``call(*inputs)``
    returns ``[Nq, B]`` fp32 scores; ``index_nbytes(inputs)`` is the bytes the index keeps resident;
    ``dequantized(inputs, n_docs)`` returns the float64 queries ``[Nq, Lq, d]`` and first ``n_docs`` documents
    that ``call`` actually multiplies (after its own quantisation), to check its arithmetic against the float64
    reference; ``note()`` returns a caveat to print with the result (or None)."""

    name: str
    prepare: Callable[[torch.Tensor, torch.Tensor], tuple]
    call: Callable[..., torch.Tensor]
    index_nbytes: Callable[[tuple], int]
    dequantized: Callable[[tuple, int], tuple]
    note: Callable[[], Optional[str]] = lambda: None


@dataclass
class TopKVariant:
    """A peer's top-k over one prepared corpus: ``call(queries [Nq, Lq, d], k)`` -> ``(scores, indices)`` ``[Nq, k]``.
    ``index_bytes``: what the peer keeps resident besides the padded corpus (its quantised copy); ``exact``: False
    for an approximate search."""

    name: str
    call: Callable[[torch.Tensor, int], tuple]
    index_bytes: int = 0
    exact: bool = True


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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

    compressed_label = "compressed"

    def compressed_variants(self, num_queries: int) -> list[CompressedVariant]:
        """The peer's 8-bit document paths for ``num_queries`` queries against ``[B, Ld, d]`` documents (empty
        when it has none for that case). The benchmark keeps the fastest one whose arithmetic checks out."""
        return []

    def topk_variant(self, documents: torch.Tensor, documents_mask: torch.Tensor, lengths: torch.Tensor,
                     chunk: int) -> Optional[TopKVariant]:
        """The peer's top-k over the padded corpus ``documents`` ``[N, Ld, d]`` (``documents_mask`` ``[N, Ld]``
        bool, ``lengths`` ``[N]``), ``chunk`` documents per kernel call at most; index-time work (quantising) is
        done here, outside the timed calls. None when the peer has no top-k."""
        return None


def _per_token_dequant(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``values * scales``, one scale per vector (``scales`` ``[..., L]`` or ``[..., L, 1]``)."""
    return values.double() * scales.double().reshape(*values.shape[:-1], 1)


class _LateInteractionKernels(Peer):
    def forward_variants(self, queries, documents):
        maxsim = self.module.maxsim
        return [("maxsim", lambda q, d: maxsim(q, d))]

    def train_scores(self, layout, smooth_tau):
        if smooth_tau is not None:
            return None
        maxsim = self.module.maxsim
        return lambda q, d: maxsim(q, d)  # dispatches on d.dim(): 3-D in-batch, 4-D per-query candidates

    compressed_label = "fp8"

    def compressed_variants(self, num_queries):
        fp8 = importlib.import_module(f"{self.module.__name__}.fp8")
        score = fp8.maxsim_inference_fp8

        def fallback_note():
            # its one-shot flag, set when it has warned that it fell back to dequantised bf16
            if getattr(fp8, "_WARNED_FP8_FALLBACK", False):
                return "LIK fell back to its dequantised-bf16 path (its fp8 kernel needs a CUDA GPU with CC >= 9)"
            return None

        def index_nbytes(inputs):
            return tensor_bytes(*inputs[-2:])       # fp8 documents and their scale(s)

        def make(scaling, quantize, dequantize):
            def per_call(q, d, d_scale):
                q8, q_scale = quantize(q)
                return score(q8, d, scale_Q=q_scale, scale_D=d_scale)

            def pre_quantised(q8, q_scale, d, d_scale):
                return score(q8, d, scale_Q=q_scale, scale_D=d_scale)

            def dequantized(inputs, n_docs):
                if len(inputs) == 3:
                    q8, q_scale = quantize(inputs[0])
                    d, d_scale = inputs[1:]
                else:
                    q8, q_scale, d, d_scale = inputs
                d_scale = d_scale[:n_docs] if d_scale.dim() else d_scale
                return dequantize(q8, q_scale).double(), dequantize(d[:n_docs], d_scale).double()

            return [
                # the query quantised inside the timed call (what a search service does per request) ...
                CompressedVariant(f"maxsim_inference_fp8, {scaling}, query quantised per call",
                                  prepare=lambda q, d: (q, *quantize(d)), call=per_call,
                                  index_nbytes=index_nbytes, dequantized=dequantized, note=fallback_note),
                # ... and beforehand: the kernel alone
                CompressedVariant(f"maxsim_inference_fp8, {scaling}, query pre-quantised",
                                  prepare=lambda q, d: (*quantize(q), *quantize(d)), call=pre_quantised,
                                  index_nbytes=index_nbytes, dequantized=dequantized, note=fallback_note),
            ]

        # per-token scales: the layout of flash_maxsim.quantize's index; per-tensor: LIK's docstring example
        return (make("per-token scales", fp8.quantize_fp8_per_token, fp8.dequantize_fp8_per_token)
                + make("per-tensor scales", fp8.quantize_fp8_per_tensor, fp8.dequantize_fp8_per_tensor))

    def topk_variant(self, documents, documents_mask, lengths, chunk):
        retrieve = self.module.retrieve
        chunk = chunk if chunk < documents.shape[0] else None

        def call(queries, k):
            return retrieve(queries, documents, top_k=k, d_mask=documents_mask, normalize=False, chunk=chunk)

        return TopKVariant("retrieve(normalize=False" + (f", chunk={chunk})" if chunk else ")"), call)


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

    compressed_label = "int8×int8"

    def compressed_variants(self, num_queries):
        m = self.module
        if num_queries != 1:
            return []       # flash_maxsim_int8x8 scores one query [Lq, d]

        def dequantized(inputs, n_docs):
            q0, d, d_scale = inputs[:3]
            q, q_scale = inputs[3:] if len(inputs) == 5 else m.quantize_query_int8(q0)
            return (_per_token_dequant(q, q_scale)[None], _per_token_dequant(d[:n_docs], d_scale[:n_docs]))

        def index_nbytes(inputs):
            return tensor_bytes(*inputs[1:3])

        return [
            # its documented default: a float query, quantised on the fly inside the call
            CompressedVariant("flash_maxsim_int8x8, query quantised per call",
                              prepare=lambda q, d: (q[0], *m.quantize_int8_symmetric(d)),
                              call=lambda q0, d, sd: m.flash_maxsim_int8x8(q0, d, sd).unsqueeze(0),
                              index_nbytes=index_nbytes, dequantized=dequantized),
            CompressedVariant("flash_maxsim_int8x8, query pre-quantised",
                              prepare=lambda q, d: (q[0], *m.quantize_int8_symmetric(d),
                                                    *m.quantize_query_int8(q[0])),
                              call=lambda q0, d, sd, qi, qs: m.flash_maxsim_int8x8(q0, d, sd, Q_int8=qi,
                                                                                    q_scales=qs).unsqueeze(0),
                              index_nbytes=index_nbytes, dequantized=dequantized),
        ]

    def topk_variant(self, documents, documents_mask, lengths, chunk):
        m = self.module
        N, Ld, d = documents.shape
        # its own quantised copy, made chunk by chunk: quantize_int8 converts its input to fp32 whole
        d_int8 = torch.empty((N, Ld, d), dtype=torch.uint8, device=documents.device)
        scales = torch.empty((N, Ld, 1), dtype=torch.float16, device=documents.device)
        mins = torch.empty_like(scales)
        step = max(1, (256 * 2**20) // (Ld * d * 4))
        for s in range(0, N, step):
            d_int8[s:s + step], scales[s:s + step], mins[s:s + step] = m.quantize_int8(documents[s:s + step])
        lengths = lengths.to(torch.int32)
        bounds = [(s, min(N, s + chunk)) for s in range(0, N, chunk)]

        def one_query(q, k):
            parts = [m.flash_maxsim_topk(q, documents[s:e], k, doc_lengths=lengths[s:e], D_int8=d_int8[s:e],
                                         scales=scales[s:e], mins=mins[s:e]) for s, e in bounds]
            if len(parts) == 1:
                return parts[0]
            values = torch.cat([p[0].float() for p in parts])
            where = torch.cat([p[1] + s for p, (s, _) in zip(parts, bounds)])
            top = torch.topk(values, min(k, values.numel()))
            return top.values, where[top.indices]

        def call(queries, k):
            found = [one_query(q, k) for q in queries]
            return torch.stack([f[0].float() for f in found]), torch.stack([f[1] for f in found])

        name = "flash_maxsim_topk(D_int8=, scales=, mins=), one query a call"
        if len(bounds) > 1:
            name += f", per {chunk}-document chunk, merged"
        return TopKVariant(name, call, index_bytes=tensor_bytes(d_int8, scales, mins), exact=False)


_KNOWN = {
    "lik": ("late_interaction_kernels", "late-interaction-kernels", _LateInteractionKernels),
    "fmpypi": ("flash_maxsim_pypi", "flash-maxsim (PyPI)", _FlashMaxsimPypi),
}

PEER_KEYS = tuple(_KNOWN)


# the folder holding flash-maxsim 0.3.0's ``flash_maxsim`` package (pip install --target), imported under
# PYPI_MODULE so that it does not shadow this project's flash_maxsim
PYPI_DIR_VARIABLE = "FLASH_MAXSIM_PYPI_DIR"
PYPI_MODULE = "flash_maxsim_pypi"


def _import_peer(module_name: str):
    """The peer's module: importable by its name, or, for flash-maxsim, loaded from ``$FLASH_MAXSIM_PYPI_DIR``."""
    folder = os.environ.get(PYPI_DIR_VARIABLE)
    if module_name != PYPI_MODULE or not folder or module_name in sys.modules:
        return importlib.import_module(module_name)
    package = os.path.join(folder, "flash_maxsim")
    spec = importlib.util.spec_from_file_location(module_name, os.path.join(package, "__init__.py"),
                                                  submodule_search_locations=[package])
    if spec is None:
        raise ImportError(f"{PYPI_DIR_VARIABLE}={folder}: no flash_maxsim package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_peers(keys) -> tuple[list[Peer], dict[str, str]]:
    """Import the requested peers; returns (the importable ones, {key: why not} for the others)."""
    peers, missing = [], {}
    for key in keys:
        if key not in _KNOWN:
            raise ValueError(f"unknown peer {key!r}; known: {', '.join(_KNOWN)}")
        module_name, label, cls = _KNOWN[key]
        try:
            module = _import_peer(module_name)
        except Exception as exc:  # ImportError, or a peer failing at import (no Triton, no CUDA, ...)
            missing[key] = f"import {module_name} failed: {type(exc).__name__}: {exc}"
            log.info("peer %s not available: %s", key, missing[key])
            continue
        version = str(getattr(module, "__version__", "?"))
        peers.append(cls(key=key, label=f"{label} {version}", version=version, module=module))
    return peers, missing
