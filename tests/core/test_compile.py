"""torch.compile(fullgraph=True) traces through flash_maxsim.maxsim (forward and backward) without graph breaks
and gives the eager numbers. Backend "aot_eager" (AOTAutograd traces forward and backward through the ops'
fake implementations, without inductor's C++ build); one case also goes through "inductor"."""

import pytest
import torch

import flash_maxsim
from flash_maxsim.kernels import launch
from flash_maxsim.ops import force_backend

from .helpers import LAYOUTS, make_case, upstream_gradient

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _loss_and_grads(fn, case, grad_out):
    leaves = [x.detach().clone().requires_grad_() for x in case.leaves()]
    scores = fn(leaves)
    (scores * grad_out).sum().backward()
    return scores.detach(), [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]


def _compare_compiled_with_eager(case, backend, compile_backend):
    grad_out = upstream_gradient(case)

    def scores(leaves):
        return case.run(flash_maxsim.maxsim, leaves)

    torch._dynamo.reset()
    compiled = torch.compile(scores, fullgraph=True, backend=compile_backend)
    with force_backend(backend):
        eager_scores, eager_grads = _loss_and_grads(scores, case, grad_out)
        compiled_scores, compiled_grads = _loss_and_grads(compiled, case, grad_out)
    torch.testing.assert_close(compiled_scores, eager_scores, rtol=1e-6, atol=1e-6)
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("masked, smooth_tau", [("exclude", None), ("zero", 0.5)], ids=["exclude-hard", "zero-smooth"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compile_fullgraph_cpu_path(layout, masked, smooth_tau, seed):
    # packed documents carry max_length here: without it the offsets are validated with a host read, which
    # fullgraph tracing cannot do (see docs/semantics.md)
    case = make_case(layout=layout, Nq=2, C=3, Lq=4, Ld=5, d=8, masked=masked, smooth_tau=smooth_tau,
                     query_mask_keep=0.8, doc_mask_keep=0.7, empty_doc=True, seed=seed)
    _compare_compiled_with_eager(case, "torch", "aot_eager")


def test_compile_fullgraph_inductor(seed):
    case = make_case(layout="padded", Nq=2, C=3, Lq=4, Ld=5, d=8, doc_mask_keep=0.7, seed=seed)
    _compare_compiled_with_eager(case, "torch", "inductor")


@pytest.mark.skipif(TRITON_DEVICE == "cpu" and not launch.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_compile_fullgraph_triton(seed):
    case = make_case(layout="list", Nq=2, C=2, Lq=3, Ld=4, d=8, smooth_tau=0.5, doc_mask_keep=0.7, seed=seed,
                     device=TRITON_DEVICE)
    _compare_compiled_with_eager(case, "triton", "aot_eager")


def test_traced_graphs_hold_the_fused_ops(seed):
    """The forward graph calls maxsim_fwd and the backward graph maxsim_bwd: one opaque node each, nothing
    decomposed into similarity-sized tensors."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm)
        return compiler

    case = make_case(layout="padded", Nq=2, C=3, Lq=4, Ld=5, d=8, smooth_tau=0.5, seed=seed)
    torch._dynamo.reset()
    compiled = torch.compile(lambda leaves: case.run(flash_maxsim.maxsim, leaves), fullgraph=True,
                             backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
    with force_backend("torch"):
        _loss_and_grads(compiled, case, upstream_gradient(case))
    assert any("flash_maxsim.maxsim_fwd" in t for t in graphs["forward"]), graphs["forward"]
    assert any("flash_maxsim.maxsim_bwd" in t for t in graphs["backward"]), graphs["backward"]
    assert not any("einsum" in t or "bmm" in t for t in graphs["forward"] | graphs["backward"])
