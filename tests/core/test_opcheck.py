"""``torch.library.opcheck`` on the custom ops ``flash_maxsim::maxsim_fwd`` and ``maxsim_bwd``: schema (no input
mutated or aliased), fake (meta) implementations against the real outputs, autograd registration, and AOT
dispatch with dynamic shapes; on the exact PyTorch path and, for a few problems, on the interpreted kernels."""

import pytest
import torch
from torch.library import opcheck

import flash_maxsim
from flash_maxsim import _layout
from flash_maxsim.ops import force_backend

from .helpers import make_case

# (name, make_case arguments); small problems: every check runs the op several times
PROBLEMS = {
    "padded-masks": dict(layout="padded", Nq=2, C=3, Lq=4, Ld=5, d=8, query_mask_keep=0.8, doc_mask_keep=0.7),
    "padded-zero-masked": dict(layout="padded", Nq=2, C=3, Lq=4, Ld=5, d=8, masked="zero", doc_mask_keep=0.6),
    "packed": dict(layout="packed", Nq=2, C=3, Lq=3, Ld=6, d=8, doc_mask_keep=0.7, empty_doc=True),
    "listed-smooth": dict(layout="list", Nq=2, C=3, Lq=3, Ld=5, d=8, smooth_tau=0.5),
    "candidates": dict(layout="candidates", Nq=2, C=2, Lq=3, Ld=4, d=8, query_mask_keep=0.7, doc_mask_keep=0.7),
    "candidates-smooth-bf16": dict(layout="candidates", Nq=2, C=2, Lq=3, Ld=4, d=16, smooth_tau=0.25,
                                   dtype=torch.bfloat16),
}
# the problems also checked on the interpreted kernels (each kernel launch is slow there)
INTERPRETED = ("padded-masks", "packed", "listed-smooth")


def _interpreter_available() -> bool:
    try:
        from flash_maxsim.kernels import launch
    except ImportError:
        return False
    return launch.interpreting()


def _backends(names):
    return [pytest.param(name, "torch", id=f"{name}-torch") for name in PROBLEMS] + [
        pytest.param(name, "triton", id=f"{name}-interpreted", marks=pytest.mark.skipif(
            not _interpreter_available(), reason="needs TRITON_INTERPRET=1")) for name in names]


def _canonical(name: str):
    """The canonical problem of ``PROBLEMS[name]`` as the ops take it, its floating-point inputs leaves that
    require grad; plus the zero-masked flag and smooth_tau."""
    case = make_case(seed=7, **PROBLEMS[name])
    p = _layout.canonicalize(*case.arguments(case.leaves()), masked=case.masked, smooth_tau=case.smooth_tau)
    queries = p.queries.detach().clone().requires_grad_()
    documents = p.documents.detach().clone().requires_grad_()
    return p, queries, documents, case.masked == "zero", case.smooth_tau


def _forward_args(p, queries, documents, zero_masked, smooth_tau, save_aux):
    return (queries, documents, p.queries_mask, p.documents_mask, p.offsets, p.max_length, p.candidates,
            zero_masked, smooth_tau, save_aux)


@pytest.mark.parametrize("name, backend", _backends(INTERPRETED))
def test_opcheck_forward(name, backend):
    """With the aux saved for a backward (inputs that require grad) and without (scoring, inputs that do not)."""
    p, queries, documents, zero_masked, smooth_tau = _canonical(name)
    with force_backend(backend):
        opcheck(torch.ops.flash_maxsim.maxsim_fwd.default,
                _forward_args(p, queries, documents, zero_masked, smooth_tau, True))
        opcheck(torch.ops.flash_maxsim.maxsim_fwd.default,
                _forward_args(p, queries.detach(), documents.detach(), zero_masked, smooth_tau, False))


@pytest.mark.parametrize("name, backend", _backends(INTERPRETED[:1]))
def test_opcheck_backward(name, backend):
    """Both gradients, one of them (the other an empty tensor) and fp32 gradients, from the forward's aux."""
    p, queries, documents, zero_masked, smooth_tau = _canonical(name)
    queries, documents = queries.detach(), documents.detach()
    with force_backend(backend):
        scores, aux = torch.ops.flash_maxsim.maxsim_fwd(
            *_forward_args(p, queries, documents, zero_masked, smooth_tau, True))
        grad = torch.randn(scores.shape, generator=torch.Generator().manual_seed(3))
        for need_q, need_d, fp32_grads in ((True, True, False), (True, False, False), (False, True, True)):
            opcheck(torch.ops.flash_maxsim.maxsim_bwd.default,
                    (grad, queries, documents, p.queries_mask, p.documents_mask, p.offsets, p.max_length, aux,
                     p.candidates, smooth_tau, need_q, need_d, fp32_grads))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_opcheck_forward_on_quantized_documents(layout, kind):
    """Scoring a quantized index: 8-bit documents with their per-token scales, no aux saved."""
    if kind == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    g = torch.Generator().manual_seed(5)
    queries = torch.randn(2, 3, 16, generator=g)
    documents = [torch.randn(n, 16, generator=g) for n in (4, 1, 6)] if layout == "packed" else \
        torch.randn(3, 5, 16, generator=g)
    index = flash_maxsim.quantize(documents, dtype=kind)
    p = _layout.canonicalize(queries, index)
    checks = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    if kind == "fp8":
        checks.remove("test_schema")     # its mutation check compares fp8 tensors by a product CPU torch lacks
    with force_backend("torch"):
        opcheck(torch.ops.flash_maxsim.maxsim_fwd.default,
                (p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets, p.max_length, p.candidates,
                 False, None, False, p.document_scales), test_utils=checks)
