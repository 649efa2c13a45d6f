"""Gradient rules that random data does not reach: exact ties, a maximum on a masked token, determinism, and
what the forward keeps for the backward. Each runs on the CPU path and on the Triton kernels (CUDA, or the
interpreter)."""

import pytest
import torch

import flash_maxsim
from flash_maxsim.kernels import launch
from flash_maxsim.ops import force_backend

from .helpers import LAYOUTS, flash_scores_and_grads, make_case, upstream_gradient

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [
    pytest.param("torch", "cpu", id="cpu-path"),
    pytest.param("triton", TRITON_DEVICE, id="triton", marks=pytest.mark.skipif(
        TRITON_DEVICE == "cpu" and not launch.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")),
]


def _grads(backend, queries, documents, documents_mask=None, **kwargs):
    q = queries.detach().clone().requires_grad_()
    d = documents.detach().clone().requires_grad_()
    with force_backend(backend):
        out = flash_maxsim.maxsim(q, d, None, documents_mask, **kwargs)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, d.grad


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("first, second", [(1, 3), (5, 70)], ids=["same-tile", "across-tiles"])
def test_exact_tie_sends_the_whole_gradient_to_the_first_token(backend, device, first, second, seed):
    g = torch.Generator().manual_seed(seed)
    Ld, d = 80, 4
    queries = torch.randn(1, 1, d, generator=g)
    queries = queries / queries.norm()                                  # |q| = 1
    documents = (torch.randn(1, Ld, d, generator=g) * 0.1).clamp(-0.45, 0.45)   # |q . d_j| <= |d_j| < 1
    documents[0, first] = documents[0, second] = queries[0, 0] * 3    # both reach the (unique) maximum, ~3
    _, dq, dd = _grads(backend, queries.to(device), documents.to(device))
    expected = torch.zeros(Ld, d)
    expected[first] = queries[0, 0]
    torch.testing.assert_close(dd[0].cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(dq[0, 0].cpu(), documents[0, first], rtol=0, atol=0)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_zero_mode_maximum_on_a_masked_token_gives_no_gradient(backend, device, seed):
    g = torch.Generator().manual_seed(seed)
    d = 4
    queries = torch.randn(1, 2, d, generator=g)
    documents = torch.randn(1, 6, d, generator=g)
    # valid tokens D_j = -a_j u + b_j w (w orthogonal to u): all similarities with query token 0 (u) are
    # negative, so its "zero"-mode maximum is a masked token's constant 0; token 4 wins for query token 1 (v)
    u, v = queries[0, 0], queries[0, 1]
    w = v - (v @ u) / (u @ u) * u
    a = torch.rand(6, 1, generator=g) + 0.5
    b = torch.rand(6, 1, generator=g) * 2 - 1
    b[4] = 5.0 + abs(v @ u) / (w @ w) * 2
    documents[0] = -a * u + b * w
    documents[0, 2] = 3 * u                      # masked: would win if it were valid
    mask = torch.tensor([[True, True, False, True, True, False]])
    s = queries[0] @ documents[0].T
    assert (s[0][mask[0]] < 0).all() and (s[1][mask[0]] > 0).any()
    out, dq, dd = _grads(backend, queries.to(device), documents.to(device), mask.to(device), masked="zero")
    assert out.item() == pytest.approx(s[1][mask[0]].max().item(), rel=1e-5)
    assert (dq[0, 0] == 0).all(), "query token 0's maximum is a masked (constant) token: no gradient"
    j = int(torch.where(mask[0], s[1], torch.tensor(float("-inf"))).argmax())
    expected = torch.zeros_like(documents[0])
    expected[j] = queries[0, 1]
    torch.testing.assert_close(dd[0].cpu(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dq[0, 1].cpu(), documents[0, j], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("smooth_tau", [None, 0.1], ids=["hard", "smooth"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_backward_is_deterministic(backend, device, smooth_tau, layout, seed):
    case = make_case(layout=layout, Nq=2, C=3, Lq=5, Ld=7, d=16, dtype=torch.bfloat16, smooth_tau=smooth_tau,
                     doc_mask_keep=0.7, seed=seed, device=device)
    grad_out = upstream_gradient(case)
    with force_backend(backend):
        first_scores, first = flash_scores_and_grads(case, grad_out)
        second_scores, second = flash_scores_and_grads(case, grad_out)
    assert torch.equal(first_scores, second_scores)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("smooth_tau, aux_dtype", [(None, torch.int16), (0.5, torch.float32)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_saved_state_is_per_query_token_not_per_similarity(layout, smooth_tau, aux_dtype, seed):
    Nq, C, Lq, Ld, d = 3, 4, 16, 16, 1
    case = make_case(layout=layout, Nq=Nq, C=C, Lq=Lq, Ld=Ld, d=d, smooth_tau=smooth_tau, doc_mask_keep=0.8,
                     seed=seed)
    inputs_numel = sum(x.numel() for x in case.leaves())
    with force_backend("torch"):
        out = case.run(flash_maxsim.maxsim, case.leaves())
    saved = out.grad_fn.saved_tensors
    assert saved, "the backward keeps its state in saved tensors"
    similarity_numel = Nq * C * Lq * Ld
    assert similarity_numel > 4 * max(inputs_numel, Nq * C * Lq)     # so the assertions below can tell
    aux = [t for t in saved if t is not None and t.shape == (Nq, C, Lq)]
    assert len(aux) == 1 and aux[0].dtype == aux_dtype
    for t in saved:
        if t is not None:
            assert t.numel() <= max(inputs_numel, Nq * C * Lq), (t.shape, t.dtype)


@pytest.mark.parametrize("save_aux", [True, False])
@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_forward_op_returns_aux_only_when_asked(save_aux, smooth_tau, seed):
    g = torch.Generator().manual_seed(seed)
    q, docs = torch.randn(3, 5, 8, generator=g), torch.randn(4, 7, 8, generator=g)
    with force_backend("torch"):
        scores, aux = torch.ops.flash_maxsim.maxsim_fwd(q, docs, None, None, None, 7, 0, False, smooth_tau,
                                                        save_aux)
    assert scores.shape == (3, 4) and scores.dtype == torch.float32
    if save_aux:
        assert aux.shape == (3, 4, 5)
        assert aux.dtype == (torch.int16 if smooth_tau is None else torch.float32)
    else:
        assert aux.numel() == 0


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("modified", ["queries_mask", "documents_mask", "offsets"])
def test_tensors_modified_in_place_before_the_backward_are_refused(backend, device, modified, seed):
    """Masks and packed offsets are saved for the backward as autograd saves tensors (with their versions), each
    one whether or not the others are given: one modified in place after the forward makes the backward raise
    rather than compute gradients of other inputs than the scores'."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 8, generator=g).to(device).requires_grad_()
    queries_mask = torch.ones(2, 3, dtype=torch.bool, device=device) if modified == "queries_mask" else None
    documents_mask = torch.ones(2, 5, dtype=torch.bool, device=device) if modified == "documents_mask" else None
    if modified == "offsets":
        docs = flash_maxsim.PackedDocuments(torch.randn(9, 8, generator=g).to(device).requires_grad_(),
                                            torch.tensor([0, 4, 9], device=device))
    else:
        docs = torch.randn(2, 5, 8, generator=g).to(device).requires_grad_()
    with force_backend(backend):
        out = flash_maxsim.maxsim(q, docs, queries_mask, documents_mask)
        target = {"queries_mask": queries_mask, "documents_mask": documents_mask}.get(modified)
        with torch.no_grad():
            if target is None:
                docs.offsets[1] = 5
            else:
                target[0, 0] = False
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_no_gradient_needed_keeps_no_aux(seed):
    case = make_case(layout="padded", Nq=2, C=3, Lq=4, Ld=5, d=8, seed=seed, requires_grad=False)
    with force_backend("torch"):
        out = case.run(flash_maxsim.maxsim, case.leaves())
    assert out.grad_fn is None and not out.requires_grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_arg_max_past_int16_range_in_documents_over_32767_tokens(backend, seed):
    """The saved arg-max is int16 up to 32767 document tokens and int32 beyond, where the arg-max token (the
    last one here) and its gradient must come out right. The kernels on the GPU only: interpreted, 40k-token
    documents take minutes (every interpreted training test saves an int16 arg-max)."""
    if backend == "triton" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    for Ld, want in ((32767, torch.int16), (40000, torch.int32)):
        q = torch.randn(1, 2, 16, generator=g).to(device)
        docs = (torch.randn(1, Ld, 16, generator=g) * 0.01).to(device)
        docs[0, -1] = q[0, 0] * 3            # query token 0 peaks at the last document token
        with force_backend(backend):
            scores, aux = torch.ops.flash_maxsim.maxsim_fwd(q, docs, None, None, None, Ld, 0, False, None, True)
        assert aux.dtype == want
        assert int(aux[0, 0, 0]) == Ld - 1
        d = docs.clone().requires_grad_()
        with force_backend(backend):
            flash_maxsim.maxsim(q, d).sum().backward()
        assert torch.equal(d.grad[0, -1], q[0, 0] + (q[0, 1] if int(aux[0, 0, 1]) == Ld - 1 else 0))
