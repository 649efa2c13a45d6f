"""flash_maxsim for PyLate: scorer objects for a loss's ``score_metric``, and ``enable()`` for unchanged scripts.

Scorers (usable without ``enable()``; they need only torch, not PyLate itself):

- :class:`FlashColBERTScores` — drop-in for ``pylate.scores.ColBERTScores`` (PyLate >= 1.5), the
  ``score_metric`` of ``losses.Contrastive`` and ``losses.CachedContrastive``: queries ``[Q, Lq, H]`` against
  stacked document groups ``[D, N, Ld, H]`` -> ``[Q, D*N]`` in query-major order (column ``j*N + k`` is group
  ``j``'s ``k``-th document). Given ``[D, Ld, H]`` documents it scores like :func:`colbert_scores`, which is
  what PyLate 1.3/1.4 losses pass their ``score_metric``.
- :func:`colbert_scores`, :func:`colbert_scores_pairwise`, :func:`colbert_kd_scores` — PyLate's signatures
  (``backend=`` accepted and validated; it chooses nothing here) and PyLate's numbers.

PyLate multiplies the similarities by the masks before the max, so a masked document token counts as
similarity 0 (it is not skipped): that is ``flash_maxsim.maxsim(..., masked="zero")``, for any mask pattern —
skiplist holes included. Masks are 0/1 (bool or numbers); numpy arrays and lists are accepted as PyLate's
``convert_to_tensor`` accepts them. Scores come back float32 (fp32 accumulation) for fp16/bf16/fp32 inputs;
float64 inputs take the float64 reference path. Under ``torch.autocast`` fp32 embeddings are scored in the
autocast dtype, as PyLate's einsum would be.

``enable()`` / ``disable()`` / ``is_enabled()`` / ``enabled()``: while enabled, ``pylate.scores.colbert_scores``,
``colbert_scores_pairwise``, ``colbert_kd_scores`` (and every ``from pylate.scores import ...`` copy inside
PyLate), ``ColBERTScores.__call__``, the ``score_metric`` defaults of the losses, and ``ColBERT.similarity`` /
``similarity_pairwise`` run through flash_maxsim — so losses built with their defaults, ``rank.rerank``, the
retrievers and the evaluators do. ``rank.rerank`` also takes a compressed candidate index per query
(``flash_maxsim.quantize``). PyLate's own ``backend=`` / ``PYLATE_SCORES_BACKEND`` are then ignored.
Function objects handed out while enabled (a loss's default ``score_metric``, ``model.similarity``) go back to
PyLate's own code after ``disable()``.

Retrieval: :class:`ExactIndex` (needs PyLate; imported on first use of the name), a ``pylate.indexes`` index
that ``pylate.retrieve.ColBERT(index=ExactIndex())`` uses unchanged and that returns exactly what
``pylate.rank.rerank`` over the whole corpus returns, scoring every document (``flash_maxsim.DocumentIndex``).

``FLASH_MAXSIM_DISABLE=1`` (or ``true``/``yes``/``on``) in the environment makes ``enable()`` a no-op with one warning
(``flash_maxsim.integrations._patches`` lists the values it takes). ``enable()`` without PyLate installed raises an
ImportError naming ``pip install "flash-maxsim-kernels[pylate]"``.

Not enabled, PyLate >= 1.5.1 on CUDA takes this package for the PyPI project ``flash-maxsim`` (the same import
name) as its own "flash" backend; the names it imports then raise PyLate's ``FlashUnsupported`` (also an
``ImportError``), so ``backend="auto"`` falls back to PyLate's next backend with one warning
(``flash_maxsim._name_clash``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from typing import Callable, List, Optional, Tuple

import torch

import flash_maxsim
from flash_maxsim import reference

from ._inputs import ArrayLike, as_mask, as_tensor, check_rank, length_mask, shape_of
from ._patches import Integration, PatchSet, import_toolkit
from ._quantized import document_bounds, padded_by_group, with_zero_tokens

logger = logging.getLogger("flash_maxsim")

__all__ = ["FlashColBERTScores", "colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores", "enable",
           "disable", "is_enabled", "enabled"]

# PyLate's own backend names (pylate.scores._resolve_backend, PyLate >= 1.5).
_PYLATE_BACKENDS = ("auto", "torch", "flash", "lik")
_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------- inputs

# PyLate's ``convert_to_tensor`` rules: tensors as they are, numpy arrays as views, a list of tensors stacked, a list
# of arrays or of lists as float32
_convert = functools.partial(as_tensor, lists_dtype=torch.float32)


def _binary_mask(mask, name: str) -> Optional[torch.Tensor]:
    """A PyLate mask (0/1 numbers or bool) as a tensor. PyLate multiplies by the mask, so a value other than 0
    or 1 would weight the similarities: flash_maxsim has no such weighting. A CPU mask holding such a value is
    refused; a mask on a GPU is not read here, because reading it would wait for the device on every call
    (about 0.2 ms per call on an H100): there, as in flash_maxsim.maxsim, every nonzero entry marks a valid
    token. PyLate's own masks are bool."""
    mask = as_mask(mask, name, lists_dtype=torch.float32)
    if mask is not None and mask.dtype != torch.bool and mask.device.type == "cpu" and mask.numel() \
            and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"`{name}` holds values other than 0 and 1; PyLate's masks are 0/1 (a weighted mask "
                         "is not supported)")
    return mask


def _embeddings(queries_embeddings, documents_embeddings, backend, masked: str,
                documents_rank: int, documents_layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The arguments every scorer checks: ``backend``, ``masked``, queries ``[Nq, Lq, H]`` and documents of
    ``documents_rank`` dimensions, as tensors."""
    _check_backend(backend)
    _check_masked(masked)
    Q = _convert(queries_embeddings, "queries_embeddings")
    D = _convert(documents_embeddings, "documents_embeddings")
    check_rank(Q, 3, "queries_embeddings", "[Nq, Lq, H]")
    check_rank(D, documents_rank, "documents_embeddings", documents_layout)
    return Q, D


def _check_backend(backend) -> None:
    if backend is None:
        return
    if not isinstance(backend, str) or backend.lower() not in _PYLATE_BACKENDS:
        raise ValueError(f"`backend` must be None or one of {', '.join(map(repr, _PYLATE_BACKENDS))}; got "
                         f"{backend!r} (flash_maxsim scores every call whatever it is)")


def _common_dtype(queries: torch.Tensor, documents: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both sides in one dtype: the autocast dtype where PyLate's einsum would run in it, else the wider of the
    two (PyLate's einsum refuses mixed dtypes outside autocast; casting costs nothing in accuracy)."""
    device_type = queries.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type) \
            and queries.dtype in _FLASH_DTYPES and documents.dtype in _FLASH_DTYPES:
        # autocast casts fp32 einsum operands (never float64) to its dtype
        dtype = torch.get_autocast_dtype(device_type)
        return queries.to(dtype), documents.to(dtype)
    if queries.dtype != documents.dtype:
        dtype = torch.promote_types(queries.dtype, documents.dtype)
        return queries.to(dtype), documents.to(dtype)
    return queries, documents


def _maxsim(queries, documents, queries_mask, documents_mask, masked: str) -> torch.Tensor:
    """flash_maxsim for fp16/bf16/fp32, the float64 reference for float64 (PyLate keeps float64 as float64)."""
    queries, documents = _common_dtype(queries, documents)
    if queries.dtype == torch.float64:
        logger.debug("flash_maxsim.integrations.pylate: float64 embeddings take the float64 reference path")
        return reference.maxsim(queries, documents, queries_mask, documents_mask, masked=masked)
    if queries.dtype not in _FLASH_DTYPES:
        raise TypeError(f"`queries_embeddings` has dtype {queries.dtype}; expected a floating dtype "
                        "(float16, bfloat16, float32 or float64)")
    # looked up at call time so that tests can count the calls
    return flash_maxsim.maxsim(queries, documents, queries_mask, documents_mask, masked=masked)


def _check_masked(masked: str) -> None:
    if masked not in ("zero", "exclude"):
        raise ValueError(f"`masked` must be 'zero' (PyLate's mask multiplication) or 'exclude', got {masked!r}")


# ---------------------------------------------------------------------------------------------------- scorers

def colbert_scores(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                   queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                   backend: Optional[str] = None, *, masked: str = "zero") -> torch.Tensor:
    """``pylate.scores.colbert_scores`` through flash_maxsim: every query against every document.

    Args:
        queries_embeddings: ``[Nq, Lq, H]`` (tensor, numpy array, or list as PyLate accepts).
        documents_embeddings: ``[B, Ld, H]``.
        queries_mask: ``[Nq, Lq]`` 0/1 or bool; a masked query token adds 0.
        documents_mask: ``[B, Ld]`` 0/1 or bool, any pattern (skiplist holes, padding).
        backend: accepted for PyLate's signature and validated; flash_maxsim scores whatever it is.
        masked: ``"zero"`` (default; PyLate's numbers: a masked token counts as similarity 0) or ``"exclude"``
            (a masked token takes no part in the max, as in the original ColBERT's skiplist).

    Returns:
        ``[Nq, B]`` scores, float32 (float64 for float64 inputs).
    """
    Q, D = _embeddings(queries_embeddings, documents_embeddings, backend, masked, 3, "[B, Ld, H]")
    return _maxsim(Q, D, _binary_mask(queries_mask, "queries_mask"), _binary_mask(documents_mask, "documents_mask"),
                   masked)


def colbert_kd_scores(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                      queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                      backend: Optional[str] = None, *, masked: str = "zero") -> torch.Tensor:
    """``pylate.scores.colbert_kd_scores`` through flash_maxsim: each query against its own candidates (the
    ``score_metric`` of ``losses.Distillation``).

    Args:
        queries_embeddings: ``[Nq, Lq, H]``.
        documents_embeddings: ``[Nq, K, Ld, H]``.
        queries_mask: ``[Nq, Lq]``.
        documents_mask: ``[Nq, K, Ld]``, any pattern.
        backend, masked: as in :func:`colbert_scores`.

    Returns:
        ``[Nq, K]`` scores.
    """
    Q, D = _embeddings(queries_embeddings, documents_embeddings, backend, masked, 4,
                       "[Nq, K, Ld, H] (each query's own candidates)")
    if D.shape[0] != Q.shape[0]:
        raise ValueError(f"`documents_embeddings` has shape {shape_of(D)}; expected [Nq, K, Ld, H] with "
                         f"Nq={Q.shape[0]} as in `queries_embeddings`")
    return _maxsim(Q, D, _binary_mask(queries_mask, "queries_mask"), _binary_mask(documents_mask, "documents_mask"),
                   masked)


def _rows(name: str, x) -> List[torch.Tensor]:
    """A batch given as a padded ``[B, L, H]`` array or as a list of ``[L_i, H]`` items -> list of tensors."""
    if isinstance(x, (list, tuple)):
        rows = [_convert(item, f"{name}[{i}]") for i, item in enumerate(x)]
    else:
        t = _convert(x, name)
        check_rank(t, 3, name, "[B, L, H] or a list of [L_i, H]")
        rows = list(t.unbind(0))
    for i, r in enumerate(rows):
        check_rank(r, 2, f"{name}[{i}]", "[L, H]")
    return rows


def colbert_scores_pairwise(queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                            backend: Optional[str] = None) -> torch.Tensor:
    """``pylate.scores.colbert_scores_pairwise`` through flash_maxsim: query ``i`` against document ``i``.

    Args:
        queries_embeddings: ``[B, Lq, H]``, or a list of B ``[Lq_i, H]`` items (lengths may differ).
        documents_embeddings: ``[B, Ld, H]``, or a list of B ``[Ld_i, H]`` items (lengths may differ); every
            token takes part, as in PyLate (no masks here: padding inside a padded tensor counts).
        backend: as in :func:`colbert_scores`.

    Returns:
        ``[B]`` scores.
    """
    _check_backend(backend)
    if isinstance(queries_embeddings, torch.Tensor) and isinstance(documents_embeddings, torch.Tensor) \
            and queries_embeddings.dim() == 3 and documents_embeddings.dim() == 3:
        if queries_embeddings.shape[0] != documents_embeddings.shape[0]:
            raise ValueError(f"`documents_embeddings` has shape {shape_of(documents_embeddings)}; expected as many "
                             f"documents as queries ({queries_embeddings.shape[0]})")
        # the per-query candidate layout with one candidate each: [B, 1, Ld, H] -> [B, 1]
        return _maxsim(queries_embeddings, documents_embeddings.unsqueeze(1), None, None, "exclude")[:, 0]
    queries = _rows("queries_embeddings", queries_embeddings)
    documents = _rows("documents_embeddings", documents_embeddings)
    if len(queries) != len(documents):
        raise ValueError(f"`queries_embeddings` has {len(queries)} items but `documents_embeddings` has "
                         f"{len(documents)}; pairwise scoring needs one document per query")
    if not queries:
        return torch.zeros(0, dtype=torch.float32)
    device = queries[0].device
    documents = [d.to(device) for d in documents]
    q_lengths, d_lengths = [q.shape[0] for q in queries], [d.shape[0] for d in documents]
    q_mask = length_mask(q_lengths, max(q_lengths), device)
    d_mask = length_mask(d_lengths, max(d_lengths), device)
    Q = torch.nn.utils.rnn.pad_sequence(queries, batch_first=True)
    D = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
    # padding added here is excluded, so each pair sees exactly its own tokens
    return _maxsim(Q, D.unsqueeze(1), q_mask, d_mask.unsqueeze(1), "exclude")[:, 0]


class FlashColBERTScores:
    """Drop-in for ``pylate.scores.ColBERTScores``: pass an instance as ``score_metric`` of
    ``losses.Contrastive`` or ``losses.CachedContrastive``.

    ``scorer(queries [Q, Lq, H], documents [D, N, Ld, H], queries_mask [Q, Lq], documents_mask [D, N, Ld])``
    -> ``[Q, D*N]`` with column ``j*N + k`` = document group ``j``'s ``k``-th slot (query-major, as PyLate
    >= 1.5). Given ``[D, Ld, H]`` documents (PyLate 1.3/1.4 losses call their ``score_metric`` once per group)
    it returns ``[Q, D]`` as :func:`colbert_scores`. One flash_maxsim call scores every group.

    Args:
        masked: ``"zero"`` (default, PyLate's numbers) or ``"exclude"`` (masked tokens skipped, as in the
            original ColBERT skiplist); see :func:`colbert_scores`.
    """

    def __init__(self, masked: str = "zero") -> None:
        _check_masked(masked)
        self.masked = masked

    def __repr__(self) -> str:
        return f"FlashColBERTScores(masked={self.masked!r})"

    def __call__(self, queries_embeddings: ArrayLike, documents_embeddings: ArrayLike,
                 queries_mask: Optional[ArrayLike] = None, documents_mask: Optional[ArrayLike] = None,
                 backend: Optional[str] = None) -> torch.Tensor:
        return _grouped_scores(queries_embeddings, documents_embeddings, queries_mask, documents_mask, backend,
                               self.masked)


def _grouped_scores(queries_embeddings, documents_embeddings, queries_mask, documents_mask, backend,
                    masked: str) -> torch.Tensor:
    D = _convert(documents_embeddings, "documents_embeddings")
    if D.dim() == 3:
        return colbert_scores(queries_embeddings, D, queries_mask, documents_mask, backend, masked=masked)
    Q, D = _embeddings(queries_embeddings, D, backend, masked, 4,
                       "[D, N, Ld, H] (stacked document groups) or [D, Ld, H]")
    groups, per_group, Ld, H = D.shape
    dmask = _binary_mask(documents_mask, "documents_mask")
    if dmask is not None:
        if tuple(dmask.shape) != (groups, per_group, Ld):
            raise ValueError(f"`documents_mask` has shape {shape_of(dmask)}; expected [{groups}, {per_group}, {Ld}] "
                             "as `documents_embeddings` [D, N, Ld, H]")
        dmask = dmask.reshape(groups * per_group, Ld)
    # [D, N, Ld, H] -> [D*N, Ld, H]: document j*N + k is group j's k-th slot, which is PyLate's column order
    return _maxsim(Q, D.reshape(groups * per_group, Ld, H), _binary_mask(queries_mask, "queries_mask"), dmask,
                   masked)


def _colbert_scores_call(self, queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                         backend=None):
    """``pylate.scores.ColBERTScores.__call__`` while flash_maxsim is enabled."""
    return _grouped_scores(queries_embeddings, documents_embeddings, queries_mask, documents_mask, backend, "zero")


# ---------------------------------------------------------------------------------------------------- rerank

def _make_rerank(original: Callable) -> Callable:
    """``pylate.rank.rerank`` that also takes a compressed index: any query's candidates may be
    ``flash_maxsim.quantize(candidates)`` (int8, or fp8 on GPUs that have it). Those are scored in the fused kernel
    as PyLate scores its zero-padded candidates (one zero token, scale 0, after each candidate shorter than the
    query's longest: ``masked="zero"`` semantics), so the scores are PyLate's on the dequantised candidates (and,
    for int8 with d <= 256, the query quantised per token: ``flash_maxsim.quantization.queries_as_scored``).
    Other queries go through PyLate's own ``rerank`` (whose scoring is flash_maxsim's while enabled)."""

    def rerank(documents_ids, queries_embeddings, documents_embeddings, device=None):
        if not isinstance(documents_embeddings, (list, tuple)) or \
                not any(isinstance(x, flash_maxsim.QuantizedDocuments) for x in documents_embeddings):
            return original(documents_ids, queries_embeddings, documents_embeddings, device)
        if getattr(queries_embeddings, "ndim", None) == 2:          # a tensor or numpy array of one query:
            queries_embeddings = queries_embeddings[None]            # add its batch axis, as PyLate's reshape does
        results = []
        for i, (query, ids, candidates) in enumerate(zip(queries_embeddings, documents_ids, documents_embeddings)):
            if isinstance(candidates, flash_maxsim.QuantizedDocuments):
                results.append(_rerank_quantized(i, query, ids, candidates, device))
            else:
                results.extend(original([ids], [query], [candidates], device))
        return results

    return rerank


def _rerank_quantized(i: int, query, ids, index, device) -> list:
    """Query ``i``'s candidates given as a quantized index, ranked."""
    if index.offsets is not None:
        bounds, lengths = document_bounds(index, f"documents_embeddings[{i}]")
    if index.num_documents != len(ids):
        raise ValueError(f"a quantized candidate index holds {index.num_documents} documents but "
                         f"`documents_ids` lists {len(ids)} for that query")
    query = _convert(query, f"queries_embeddings[{i}]")
    check_rank(query, 2, f"queries_embeddings[{i}]", "[Lq, H]")
    device = device if device is not None else query.device
    query = query.to(device)
    if index.offsets is not None:
        # PyLate pads all of a query's candidates together, to the longest
        index = with_zero_tokens(index, bounds, padded_by_group(lengths, max(len(lengths), 1)), 0, len(lengths),
                                 device)
    else:
        index = index.to(device)
    scores = flash_maxsim.maxsim(query, index, masked="zero")
    scores, order = torch.sort(scores, descending=True)
    return [{"id": ids[j], "score": score} for j, score in zip(order.tolist(), scores.cpu().tolist())]


# ---------------------------------------------------------------------------------------------------- enable()

_SCORE_FUNCTIONS = (("colbert_scores", colbert_scores),
                    ("colbert_scores_pairwise", colbert_scores_pairwise),
                    ("colbert_kd_scores", colbert_kd_scores))

# imported before patching so that their `from ..scores import ...` copies exist and get patched
_PYLATE_MODULES = ("pylate.losses", "pylate.rank", "pylate.retrieve", "pylate.evaluation", "pylate.models")


def _dispatcher(flash_fn: Callable, original: Callable) -> Callable:
    """The object put in PyLate's place: flash_maxsim while enabled, PyLate's own function after disable() — so
    that references taken while enabled (a loss's default score_metric, model.similarity) follow the switch."""

    def dispatch(*args, **kwargs):
        if _integration.is_enabled():
            return flash_fn(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__name__ = original.__name__
    dispatch.__qualname__ = original.__qualname__
    dispatch.__doc__ = (f"flash_maxsim's {original.__name__} while flash_maxsim.integrations.pylate is enabled, "
                        f"PyLate's own otherwise.\n\n{flash_fn.__doc__ or ''}")
    try:
        dispatch.__signature__ = inspect.signature(original)
    except (TypeError, ValueError):  # pragma: no cover - builtins only
        pass
    dispatch.flash_maxsim_original = original
    return dispatch


def _translating_property(base: property, replacements: List[Tuple[Callable, Callable]]) -> property:
    """``ColBERT.similarity``: a model built before enable() stored PyLate's function; hand out ours instead."""

    def getter(self):
        fn = base.__get__(self, type(self))
        for original, dispatch in replacements:
            if fn is original:
                return dispatch
        return fn

    return property(getter, base.fset, base.fdel, base.__doc__)


def _install(patches: PatchSet) -> None:
    scores = import_toolkit("pylate.scores", "PyLate", "pylate")
    for name in _PYLATE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional dependency of that part of PyLate is missing
            logger.debug("flash_maxsim: could not import %s (%s); its scoring stays PyLate's", name, exc)

    replacements: List[Tuple[Callable, Callable]] = []
    for name, flash_fn in _SCORE_FUNCTIONS:
        original = getattr(scores, name, None)
        if original is None:
            continue
        dispatch = _dispatcher(flash_fn, original)
        # "pylate." with the dot: other distributions (pylate_rs, ...) share the prefix
        patches.patch_aliases(original, dispatch, ("pylate.",))
        replacements.append((original, dispatch))

    rank = sys.modules.get("pylate.rank.rank")
    original_rerank = getattr(rank, "rerank", None) if rank is not None else None
    if original_rerank is not None:
        patches.patch_aliases(original_rerank, _dispatcher(_make_rerank(original_rerank), original_rerank),
                              ("pylate.",))

    # PyLate >= 1.5: losses default to ColBERTScores() built in __init__; patching the method also covers
    # instances that already exist, and disable() restores them all.
    colbert_scores_class = getattr(scores, "ColBERTScores", None)
    if colbert_scores_class is not None:
        patches.patch(colbert_scores_class, "__call__", _colbert_scores_call)

    # Defaults bound at definition time (PyLate 1.3/1.4 Contrastive, CachedContrastive; every Distillation).
    losses = sys.modules.get("pylate.losses")
    for value in list(vars(losses).values()) if losses is not None else []:
        if not inspect.isclass(value) or "score_metric" not in _parameters(value.__init__):
            continue
        default = _parameters(value.__init__)["score_metric"].default
        for original, dispatch in replacements:
            if default is original:
                patches.patch_default(value.__init__, "score_metric", dispatch)

    models = sys.modules.get("pylate.models")
    model_class = getattr(models, "ColBERT", None) if models is not None else None
    if model_class is not None:
        for attribute in ("similarity", "similarity_pairwise"):
            base = inspect.getattr_static(model_class, attribute, None)
            if isinstance(base, property):
                patches.patch(model_class, attribute, _translating_property(base, replacements))


def _parameters(function) -> dict:
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


_integration = Integration("PyLate", _install)
enable = _integration.enable
disable = _integration.disable
is_enabled = _integration.is_enabled
enabled = _integration.enabled


def __getattr__(name: str) -> type:
    if name == "ExactIndex":          # it subclasses PyLate's index base class: PyLate is imported only now
        from ._pylate_index import ExactIndex
        return ExactIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
