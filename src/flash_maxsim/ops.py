"""The operator layer: ``torch.library`` custom ops with fake (meta) implementations and autograd.

``torch.ops.flash_maxsim.maxsim_fwd`` and ``torch.ops.flash_maxsim.maxsim_bwd`` take the canonical problem
(see ``flash_maxsim._layout.Problem``) as plain tensors and numbers, so that ``torch.compile(fullgraph=True)``
traces through them and CUDA graphs can capture them. They dispatch to the Triton kernels for CUDA tensors (and
for CPU tensors under ``TRITON_INTERPRET=1``) and to the exact chunked PyTorch path otherwise. The kernels, and
Triton, are imported on the first call that needs them (:func:`kernels`), so the PyTorch path runs without
Triton installed.

Most users want :func:`flash_maxsim.maxsim`; :func:`maxsim_backward` is the functional backward, with the
option of fp32 gradients whatever the input dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from types import ModuleType
from typing import Iterator, Optional

import torch
from torch import Tensor

from . import _cpu
from ._layout import Problem, num_columns
from ._types import aux_dtype, known_longest, offsets_longest
from .quantization import dequantized_queries, eight_bit_products_in_use

_LIB = "flash_maxsim"
_LAUNCH_MODULE = __package__ + ".kernels.launch"

# flash_maxsim.kernels.launch once loaded: the kernels import Triton, which the CPU path does without
_launch: Optional[ModuleType] = None
# whether CPU tensors go to the kernels (Triton's interpreter), decided on the first CPU call
_cpu_runs_kernels: Optional[bool] = None


def kernels() -> ModuleType:
    """``flash_maxsim.kernels.launch``, imported on first use, or an ImportError that names what is missing."""
    global _launch
    if _launch is None:
        try:
            from .kernels import launch
        except ImportError as error:
            raise ImportError(f"flash_maxsim's Triton kernels (CUDA tensors, or CPU tensors under "
                              f"TRITON_INTERPRET=1) need Triton: pip install triton ({error})") from error
        _launch = launch
    return _launch


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no")


def _resolve_cpu_runs_kernels() -> bool:
    """CPU tensors go to the kernels when they were built for Triton's interpreter: TRITON_INTERPRET=1 was set
    when they were first imported (here, if nothing imported them before)."""
    global _cpu_runs_kernels
    if _cpu_runs_kernels is None:
        loaded = _LAUNCH_MODULE in sys.modules
        _cpu_runs_kernels = (loaded or _interpreter_requested()) and kernels().interpreting()
    return _cpu_runs_kernels


_forced_backend: Optional[str] = None


@contextlib.contextmanager
def force_backend(name: Optional[str]) -> Iterator[None]:
    """Run the ops on one backend: ``"triton"`` (CUDA, or CPU when the kernels are interpreted) or ``"torch"``
    (the chunked PyTorch path). For tests and comparisons; not thread-safe."""
    global _forced_backend
    if name not in (None, "triton", "torch"):
        raise ValueError(f"`name` must be 'triton', 'torch' or None, got {name!r}")
    if name == "triton" and not kernels().interpreting() and not torch.cuda.is_available():
        raise RuntimeError("the Triton backend needs CUDA or TRITON_INTERPRET=1 set before importing flash_maxsim")
    previous, _forced_backend = _forced_backend, name
    try:
        yield
    finally:
        _forced_backend = previous


def _use_triton(x: Tensor) -> bool:
    if _forced_backend is not None:
        return _forced_backend == "triton"
    # Tensor.is_cuda / is_cpu are attributes; Tensor.device builds a device object on every read
    return x.is_cuda or (x.is_cpu and (
        _cpu_runs_kernels if _cpu_runs_kernels is not None else _resolve_cpu_runs_kernels()))


def _problem(queries, documents, queries_mask, documents_mask, offsets, max_length, candidates,
             document_scales=None) -> Problem:
    return Problem(queries, queries_mask, documents, documents_mask, offsets, max_length, candidates, False,
                   document_scales)


def forward_impl(queries: Tensor, documents: Tensor, queries_mask: Optional[Tensor],
                 documents_mask: Optional[Tensor], offsets: Optional[Tensor], max_length: int, candidates: int,
                 zero_masked: bool, smooth_tau: Optional[float], save_aux: bool,
                 document_scales: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Scores ``[Nq, C]`` fp32 and the auxiliary tensor for the backward (``[Nq, C, Lq]``; None when
    ``save_aux`` is False). ``document_scales`` (bf16 or fp32, shaped like a documents mask) marks int8/fp8 documents:
    D = scale * values."""
    Nq, Lq, _ = queries.shape
    C = num_columns(documents, offsets, candidates)
    if queries.is_meta:                         # shapes only, as the fake implementation gives them
        return (queries.new_empty((Nq, C), dtype=torch.float32),
                queries.new_empty((Nq, C, Lq), dtype=aux_dtype(smooth_tau, max_length)) if save_aux else None)
    if Nq == 0 or C == 0 or Lq == 0 or max_length == 0:      # nothing to score: every score is 0
        fill = float("inf") if smooth_tau is not None else -1
        return (queries.new_zeros((Nq, C), dtype=torch.float32),
                torch.full((Nq, C, Lq), fill, dtype=aux_dtype(smooth_tau, max_length), device=queries.device)
                if save_aux else None)
    if _use_triton(queries):
        return (_launch or kernels()).forward(queries, documents, queries_mask, documents_mask, offsets,
                                              candidates, zero_masked, smooth_tau, save_aux, max_length,
                                              document_scales)
    p = _problem(queries, documents, queries_mask, documents_mask, offsets, max_length, candidates, document_scales)
    products = eight_bit_products_in_use(documents, document_scales, queries.shape[-1], save_aux)
    if products is not None:
        # what the kernels score against an 8-bit index: the query quantised per token like a document token
        p = dataclasses.replace(p, queries=dequantized_queries(queries, products))
    # the exact path computes in fp32 whatever autocast region the caller is in
    with torch.autocast(queries.device.type, enabled=False):
        scores, aux = _cpu.forward(p, zero_masked, smooth_tau, save_aux)
    return scores, (aux if save_aux else None)


def check_packed(documents: Tensor, offsets: Optional[Tensor], max_length: int) -> None:
    """Packed offsets as the ops get them from a torch.compile graph, whose tracing could not read them: validated
    (once per tensor: :func:`flash_maxsim._types.offsets_longest`) and ``max_length`` at least the longest
    document. Eager calls validated them before (:func:`flash_maxsim.maxsim`), so this finds them known. Inside a
    CUDA-graph capture, where nothing can be read, offsets not yet known pass: the runs before the capture (the
    warm-up of torch.compile's CUDA graphs) checked what the graph holds, and replays run no Python at all."""
    if offsets is None or documents.device.type == "meta":
        return
    rows = documents.shape[0]
    if offsets.is_cuda and torch.cuda.is_current_stream_capturing() and known_longest(offsets, rows) is None:
        return
    longest = offsets_longest(offsets, rows, "offsets", "documents")
    if max_length < longest:
        raise ValueError(f"`max_length` is {max_length} but the longest document (from `offsets`) has {longest} "
                         "tokens")


@torch.library.custom_op(f"{_LIB}::maxsim_fwd", mutates_args=())
def maxsim_fwd(queries: Tensor, documents: Tensor, queries_mask: Optional[Tensor],
               documents_mask: Optional[Tensor], offsets: Optional[Tensor], max_length: int, candidates: int,
               zero_masked: bool, smooth_tau: Optional[float], save_aux: bool,
               document_scales: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Scores ``[Nq, C]`` fp32 and the auxiliary tensor for the backward (``[Nq, C, Lq]``, or empty)."""
    check_packed(documents, offsets, max_length)
    scores, aux = forward_impl(queries, documents, queries_mask, documents_mask, offsets, max_length, candidates,
                               zero_masked, smooth_tau, save_aux, document_scales)
    # an op returns tensors: an empty one when nothing was saved
    return scores, (aux if aux is not None else queries.new_empty((0, 0, 0), dtype=aux_dtype(smooth_tau, max_length)))


@maxsim_fwd.register_fake
def _(queries, documents, queries_mask, documents_mask, offsets, max_length, candidates, zero_masked,
      smooth_tau, save_aux, document_scales=None):
    Nq, Lq, _ = queries.shape
    C = num_columns(documents, offsets, candidates)
    aux_shape = (Nq, C, Lq) if save_aux else (0, 0, 0)
    return (queries.new_empty((Nq, C), dtype=torch.float32),
            queries.new_empty(aux_shape, dtype=aux_dtype(smooth_tau, max_length)))


def backward_impl(grad: Tensor, queries: Tensor, documents: Tensor, queries_mask: Optional[Tensor],
                  documents_mask: Optional[Tensor], offsets: Optional[Tensor], max_length: int, aux: Tensor,
                  candidates: int, smooth_tau: Optional[float], need_queries_grad: bool,
                  need_documents_grad: bool, fp32_grads: bool) -> tuple[Tensor, Tensor]:
    """Gradients w.r.t. queries and documents (an empty tensor for one not asked for)."""
    grad_dtype = torch.float32 if fp32_grads else None
    Nq, Lq, _ = queries.shape
    if queries.is_meta:                         # shapes only, as the fake implementation gives them
        dq = queries.new_empty(queries.shape, dtype=grad_dtype or queries.dtype)
        dd = documents.new_empty(documents.shape, dtype=grad_dtype or documents.dtype)
    elif Nq == 0 or num_columns(documents, offsets, candidates) == 0 or Lq == 0 or max_length == 0:
        dq = torch.zeros(queries.shape, dtype=grad_dtype or queries.dtype, device=queries.device)
        dd = torch.zeros(documents.shape, dtype=grad_dtype or documents.dtype, device=documents.device)
    elif _use_triton(queries):
        dq, dd = (_launch or kernels()).backward(grad, queries, documents, queries_mask, documents_mask, offsets,
                                                 max_length, aux, candidates, smooth_tau, need_queries_grad,
                                                 need_documents_grad, grad_dtype)
    else:
        p = _problem(queries, documents, queries_mask, documents_mask, offsets, max_length, candidates)
        with torch.autocast(queries.device.type, enabled=False):
            dq, dd = _cpu.backward(grad, p, aux, smooth_tau, need_queries_grad, need_documents_grad, grad_dtype)
    if need_queries_grad and need_documents_grad:
        return dq, dd
    # an op returns tensors: an empty one for a gradient not asked for (allocated only then: ~3-6 us of host time)
    return (dq if need_queries_grad else queries.new_empty((0,), dtype=grad_dtype or queries.dtype)), \
        (dd if need_documents_grad else documents.new_empty((0,), dtype=grad_dtype or documents.dtype))


@torch.library.custom_op(f"{_LIB}::maxsim_bwd", mutates_args=())
def maxsim_bwd(grad: Tensor, queries: Tensor, documents: Tensor, queries_mask: Optional[Tensor],
               documents_mask: Optional[Tensor], offsets: Optional[Tensor], max_length: int, aux: Tensor,
               candidates: int, smooth_tau: Optional[float], need_queries_grad: bool,
               need_documents_grad: bool, fp32_grads: bool) -> tuple[Tensor, Tensor]:
    """Gradients w.r.t. queries and documents (an empty tensor for one not asked for)."""
    check_packed(documents, offsets, max_length)
    return backward_impl(grad, queries, documents, queries_mask, documents_mask, offsets, max_length, aux,
                         candidates, smooth_tau, need_queries_grad, need_documents_grad, fp32_grads)


@maxsim_bwd.register_fake
def _(grad, queries, documents, queries_mask, documents_mask, offsets, max_length, aux, candidates, smooth_tau,
      need_queries_grad, need_documents_grad, fp32_grads):
    qdt = torch.float32 if fp32_grads else queries.dtype
    ddt = torch.float32 if fp32_grads else documents.dtype
    dq = queries.new_empty(queries.shape if need_queries_grad else (0,), dtype=qdt)
    dd = documents.new_empty(documents.shape if need_documents_grad else (0,), dtype=ddt)
    return dq, dd


def _setup_context(ctx, inputs, output):
    queries, documents, queries_mask, documents_mask, offsets, max_length, candidates = inputs[:7]
    smooth_tau, save_aux = inputs[8:10]
    _, aux = output
    # no zero-filled gradient for the aux output, which nothing differentiates (it would be as large as aux)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(queries, documents, queries_mask, documents_mask, offsets, aux)
    ctx.max_length, ctx.candidates, ctx.smooth_tau, ctx.save_aux = max_length, candidates, smooth_tau, save_aux


def _first_order_only() -> None:
    """The backward builds no graph of its own: with ``create_graph=True`` (grad mode on inside a backward) its
    gradients would be constants to autograd, and a second derivative silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError("flash_maxsim.maxsim is differentiable once: its gradients are not differentiable, so a "
                           "backward with create_graph=True through it (a gradient penalty, a Hessian) is refused "
                           "rather than giving a wrong second derivative (docs/semantics.md, Gradients)")


def _backward(ctx, grad_scores, _grad_aux):
    _first_order_only()
    queries, documents, queries_mask, documents_mask, offsets, aux = ctx.saved_tensors
    need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_q or need_d) or grad_scores is None:
        return (None,) * 11
    if not ctx.save_aux:
        raise RuntimeError("flash_maxsim: the forward ran with save_aux=False (no gradient expected); "
                           "call flash_maxsim.maxsim with inputs that require grad")
    dq, dd = maxsim_bwd(grad_scores, queries, documents, queries_mask, documents_mask, offsets, ctx.max_length,
                        aux, ctx.candidates, ctx.smooth_tau, need_q, need_d, False)
    return (dq if need_q else None), (dd if need_d else None), None, None, None, None, None, None, None, None, None


maxsim_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerMaxSim(torch.autograd.Function):
    """The same forward/backward as the custom ops, without the dispatcher's per-call cost (~0.1 ms of host
    time, which dominates small scoring calls). Used outside torch.compile tracing.

    Its arguments are the two differentiable tensors and the canonical problem that holds the rest (masks, offsets,
    sizes); its one output is the scores. The arg-max (or log-sum-exp) tensor is saved, not returned, and the
    optional tensors are saved only when present: each argument, output and saved tensor is per-call work for
    autograd (9 arguments and 2 outputs cost ~7 us more per forward + backward than this, CPU host)."""

    @staticmethod
    def forward(ctx, queries, documents, p, zero_masked, smooth_tau):
        scores, aux = forward_impl(queries, documents, p.queries_mask, p.documents_mask, p.offsets, p.max_length,
                                   p.candidates, zero_masked, smooth_tau, True)
        optional = (p.queries_mask, p.documents_mask, p.offsets)
        if p.queries_mask is None and p.documents_mask is None and p.offsets is None:
            ctx.present = None
            ctx.save_for_backward(queries, documents, aux)
        else:
            ctx.present = tuple(t is not None for t in optional)
            ctx.save_for_backward(queries, documents, aux, *(t for t in optional if t is not None))
        ctx.max_length, ctx.candidates, ctx.smooth_tau = p.max_length, p.candidates, smooth_tau
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        _first_order_only()
        if ctx.present is None:
            queries, documents, aux = ctx.saved_tensors
            queries_mask = documents_mask = offsets = None
        else:
            queries, documents, aux, *rest = ctx.saved_tensors
            rest = iter(rest)
            queries_mask, documents_mask, offsets = (next(rest) if present else None for present in ctx.present)
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dq, dd = backward_impl(grad_scores, queries, documents, queries_mask, documents_mask, offsets,
                               ctx.max_length, aux, ctx.candidates, ctx.smooth_tau, need_q, need_d, False)
        return (dq if need_q else None), (dd if need_d else None), None, None, None


def scores(p: Problem, zero_masked: bool, smooth_tau: Optional[float]) -> Tensor:
    """Scores of a canonical problem, differentiable. Under torch.compile tracing this goes through the
    registered custom op (one graph node, fake tensors, CUDA-graph safe); in eager mode through the same
    implementation directly."""
    needs_grad = torch.is_grad_enabled() and (p.queries.requires_grad or p.documents.requires_grad)
    if p.document_scales is not None:
        if needs_grad:
            raise ValueError("quantized documents are scoring-only: `queries` must not require grad "
                             "(wrap the call in torch.no_grad() or detach the queries)")
        args = (p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets, p.max_length, p.candidates,
                zero_masked, smooth_tau, False, p.document_scales)
        if torch.compiler.is_compiling():
            return maxsim_fwd(*args)[0]
        return forward_impl(*args)[0]
    if needs_grad and not torch.compiler.is_compiling():
        return _EagerMaxSim.apply(p.queries, p.documents, p, zero_masked, smooth_tau)
    args = (p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets, p.max_length, p.candidates,
            zero_masked, smooth_tau)
    if torch.compiler.is_compiling():
        return maxsim_fwd(*args, needs_grad)[0]
    return forward_impl(*args, False)[0]


def maxsim_backward(grad_scores: Tensor, problem: Problem, aux: Tensor, smooth_tau: Optional[float] = None, *,
                    fp32_grads: bool = False) -> tuple[Tensor, Tensor]:
    """Functional backward on a canonical problem; ``fp32_grads=True`` returns fp32 gradients for any input
    dtype (autograd through :func:`flash_maxsim.maxsim` returns them in the inputs' dtype)."""
    p = problem
    grad_scores = grad_scores.unsqueeze(0) if grad_scores.dim() == 1 else grad_scores
    return backward_impl(grad_scores, p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets,
                         p.max_length, aux, p.candidates, smooth_tau, True, True, fp32_grads)
