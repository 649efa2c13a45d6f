"""``enable()`` / ``disable()`` / ``is_enabled()`` / ``enabled()`` for sentence-transformers: what is replaced
(the package docstring lists it) and the routes that decide, call by call, whether flash_maxsim scores."""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from typing import Callable, Optional

from .._patches import Integration, PatchSet, import_toolkit
from .scoring import colbert_kd_scores, colbert_scores, colbert_scores_pairwise, maxsim, maxsim_pairwise, \
    mean_colbert_kd_scores, mean_colbert_scores, mean_colbert_scores_pairwise, mean_maxsim, mean_maxsim_pairwise

logger = logging.getLogger("flash_maxsim")

# (module, name) of every sentence-transformers function replaced, and its flash_maxsim counterpart
_ROUTES = (
    ("sentence_transformers.util.similarity", "maxsim", maxsim),
    ("sentence_transformers.util.similarity", "maxsim_pairwise", maxsim_pairwise),
    ("sentence_transformers.util.similarity", "mean_maxsim", mean_maxsim),
    ("sentence_transformers.util.similarity", "mean_maxsim_pairwise", mean_maxsim_pairwise),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "colbert_scores", colbert_scores),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "colbert_scores_pairwise", colbert_scores_pairwise),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "colbert_kd_scores", colbert_kd_scores),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "mean_colbert_scores", mean_colbert_scores),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "mean_colbert_scores_pairwise",
     mean_colbert_scores_pairwise),
    ("sentence_transformers.multi_vector_encoder.scoring.colbert", "mean_colbert_kd_scores", mean_colbert_kd_scores),
)

# sentence-transformers >= 6.3: with ``similarity_fct=None`` (their default) the losses hand the model's
# ``similarity`` / ``similarity_pairwise`` to these private helpers, which call it once per candidate column;
# while enabled they score in one fused call instead, when that scorer is one flash_maxsim replaces.
# (helper name, flash_maxsim counterpart, the kind of scorer it takes)
_HELPER_ROUTES = (
    ("_colbert_scores", colbert_scores, "all-pairs"),
    ("_colbert_scores_pairwise", colbert_scores_pairwise, "pairwise"),
    ("_colbert_kd_scores", colbert_kd_scores, "pairwise"),
)

# sentence-transformers' scoring functions by name -> (kind, length_normalize by default)
_SCORER_KINDS = {
    "maxsim": ("all-pairs", False),
    "maxsim_pairwise": ("pairwise", False),
    "mean_maxsim": ("all-pairs", True),
    "mean_maxsim_pairwise": ("pairwise", True),
}
# MultiVectorEncoder's scoring methods -> the attribute holding the function each one calls, and its kind
_MODEL_SCORERS = {"similarity": ("_similarity", "all-pairs"),
                  "similarity_pairwise": ("_similarity_pairwise", "pairwise")}

# filled by enable(): sentence-transformers' four scoring functions -> (kind, their flash_maxsim counterpart,
# length_normalize default); the model's scoring methods (original and patched) -> their name; the class of the
# hub-kernel scorer of models built with ``use_kernels`` (6.3+)
_SCORERS: dict = {}
_MODEL_METHODS: dict = {}
_KERNEL_SCORER: list = []
_warned_kernel_scorer = False


def _routed(original: Callable, flash: Callable) -> Callable:
    """What enable() installs in place of ``original``. References that outlive disable() (a model's stored
    similarity, a loss's similarity_fct built while enabled) then fall back to the original by themselves."""

    @functools.wraps(original)
    def route(*args, **kwargs):
        if _integration.is_enabled():
            return flash(*args, **kwargs)
        return original(*args, **kwargs)

    route._flash_maxsim_original = original
    return route


def _kernel_scorer(score) -> Optional[tuple]:
    """:func:`_resolve_scorer` for a ``use_kernels`` model's MaxSim scorer or its ``pairwise``: their
    ``length_normalize=None`` (the default) means the scorer's own setting."""
    global _warned_kernel_scorer
    if not _KERNEL_SCORER:
        return None
    if isinstance(score, _KERNEL_SCORER[0]):
        kind, flash = "all-pairs", maxsim
    elif isinstance(getattr(score, "__self__", None), _KERNEL_SCORER[0]) and \
            getattr(score, "__name__", None) == "pairwise":
        kind, flash, score = "pairwise", maxsim_pairwise, score.__self__
    else:
        return None
    if not _warned_kernel_scorer:
        # the user enabled flash_maxsim explicitly: it takes over the model's MaxSim, not its other kernels
        logger.info("flash_maxsim: a MultiVectorEncoder built with use_kernels scores MaxSim with flash_maxsim "
                    "while enabled; its backbone and token-pooling kernels are unchanged")
        _warned_kernel_scorer = True
    normalize = bool(score.length_normalize)

    def call(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=None, device=None):
        return flash(a, b, a_mask, b_mask, chunk_elements, normalize if length_normalize is None else length_normalize,
                     device)

    return kind, call, normalize


def _resolve_scorer(score) -> Optional[tuple]:
    """(kind, flash_maxsim function called as ``score`` is, length_normalize default) when flash_maxsim computes
    what ``score`` computes, else None. ``score`` may be one of sentence-transformers' four scoring functions (or
    its replacement), a model's ``similarity`` / ``similarity_pairwise`` (resolved to the function the model
    holds), or a ``use_kernels`` model's scorer."""
    method = _MODEL_METHODS.get(getattr(score, "__func__", None)) if hasattr(score, "__self__") else None
    if method is not None:
        return _model_scorer(score.__self__, method)
    try:
        known = _SCORERS.get(getattr(score, "_flash_maxsim_original", score))
    except TypeError:                                        # an unhashable callable: not one of ours
        return None
    return known if known is not None else _kernel_scorer(score)


def _model_scorer(model, method_name: str) -> Optional[tuple]:
    """:func:`_resolve_scorer` for what ``model.<method_name>`` (``similarity`` / ``similarity_pairwise``) scores
    with: the function the model holds, when it is of the method's kind."""
    attribute, kind = _MODEL_SCORERS[method_name]
    model.similarity_fn_name  # noqa: B018 (resolves the scoring function on first use)
    resolved = _resolve_scorer(getattr(model, attribute))
    return resolved if resolved is not None and resolved[0] == kind else None


def _model_method(original: Callable, method_name: str) -> Callable:
    """``MultiVectorEncoder.similarity`` / ``similarity_pairwise``: a model resolves its scoring function once,
    when its ``similarity_fn_name`` is set, so models built before enable() hold the original."""

    @functools.wraps(original)
    def method(self, embeddings1, embeddings2, **kwargs):
        resolved = _model_scorer(self, method_name)
        if resolved is None:
            return original(self, embeddings1, embeddings2, **kwargs)
        return resolved[1](embeddings1, embeddings2, **kwargs)

    return method


def _routed_helper(original: Callable, flash: Callable, kind: str) -> Callable:
    """What enable() installs in place of ``_colbert_scores``-like helpers (first argument: the scorer)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def route(score, *args, **kwargs):
        resolved = _resolve_scorer(score) if _integration.is_enabled() else None
        if resolved is None or resolved[0] != kind:
            return original(score, *args, **kwargs)
        try:
            arguments = signature.bind(score, *args, **kwargs).arguments
        except TypeError:
            return original(score, *args, **kwargs)         # raises sentence-transformers' own error
        arguments.pop(next(iter(signature.parameters)))      # the scorer
        if arguments.get("length_normalize") is None:        # the helpers then leave it to the scorer
            arguments["length_normalize"] = resolved[2]
        return flash(**arguments)

    route._flash_maxsim_original = original
    return route


def _install(patches: PatchSet) -> None:
    sentence_transformers = import_toolkit("sentence_transformers", "sentence-transformers", "sentence-transformers")
    major = int(str(sentence_transformers.__version__).split(".")[0])
    if major < 6:
        raise ImportError(f"flash_maxsim's sentence-transformers integration needs sentence-transformers >= 6.0 "
                          f"(MultiVectorEncoder); found {sentence_transformers.__version__}")
    # load every module that may hold the functions by name, so that their aliases are replaced too
    for module in ("sentence_transformers.multi_vector_encoder", "sentence_transformers.multi_vector_encoder.losses",
                   "sentence_transformers.multi_vector_encoder.evaluation"):
        importlib.import_module(module)
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
    colbert_module = importlib.import_module("sentence_transformers.multi_vector_encoder.scoring.colbert")

    _SCORERS.clear()
    _MODEL_METHODS.clear()
    _KERNEL_SCORER.clear()
    for module_name, name, flash in _ROUTES:
        original = getattr(importlib.import_module(module_name), name)
        original = getattr(original, "_flash_maxsim_original", original)
        if name in _SCORER_KINDS:
            kind, normalize = _SCORER_KINDS[name]
            _SCORERS[original] = (kind, flash, normalize)
        patches.patch_aliases(original, _routed(original, flash), ("sentence_transformers",))
    for name, flash, kind in _HELPER_ROUTES:
        original = getattr(colbert_module, name, None)
        if original is None:                                 # before 6.3
            continue
        original = getattr(original, "_flash_maxsim_original", original)
        patches.patch_aliases(original, _routed_helper(original, flash, kind), ("sentence_transformers",))
    kernel_scorer = getattr(colbert_module, "_MaxSimScorer", None)      # 6.3+
    if kernel_scorer is not None:
        _KERNEL_SCORER.append(kernel_scorer)
    for method_name in _MODEL_SCORERS:
        original = MultiVectorEncoder.__dict__[method_name]
        replacement = _model_method(original, method_name)
        _MODEL_METHODS[original] = _MODEL_METHODS[replacement] = method_name
        patches.patch(MultiVectorEncoder, method_name, replacement)


_integration = Integration("sentence-transformers", _install)
enable = _integration.enable
disable = _integration.disable
is_enabled = _integration.is_enabled
enabled = _integration.enabled
