"""Bad input raises ValueError/TypeError naming the argument; NaN propagates from valid places only."""

import fractions

import numpy as np
import pytest
import torch

import flash_maxsim
from flash_maxsim import PackedDocuments
from flash_maxsim.kernels import launch
from flash_maxsim.ops import force_backend

Q = torch.randn(2, 3, 4)
D = torch.randn(5, 6, 4)
VALUES = torch.randn(7, 4)

BAD_INPUTS = [
    # (id, call, exception type, text that must appear in the message)
    ("queries-rank-1", lambda: flash_maxsim.maxsim(torch.randn(4), D), ValueError, "`queries`"),
    ("queries-rank-4", lambda: flash_maxsim.maxsim(torch.randn(1, 2, 3, 4), D), ValueError, "`queries`"),
    ("queries-not-tensor", lambda: flash_maxsim.maxsim([Q], D), TypeError, "`queries`"),
    ("queries-d-0", lambda: flash_maxsim.maxsim(torch.randn(2, 3, 0), torch.randn(5, 6, 0)), ValueError, "`queries`"),
    ("mismatched-d", lambda: flash_maxsim.maxsim(Q, torch.randn(5, 6, 3)), ValueError, "`documents`"),
    ("mismatched-d-list", lambda: flash_maxsim.maxsim(Q, [torch.randn(2, 4), torch.randn(2, 3)]), ValueError,
     "`documents[1]`"),
    ("mismatched-d-packed", lambda: flash_maxsim.maxsim(Q, PackedDocuments(torch.randn(7, 3), torch.tensor([0, 7]))),
     ValueError, "`documents.values`"),
    ("documents-rank-2", lambda: flash_maxsim.maxsim(Q, torch.randn(6, 4)), ValueError, "`documents`"),
    ("documents-rank-5", lambda: flash_maxsim.maxsim(Q, torch.randn(2, 1, 1, 6, 4)), ValueError, "`documents`"),
    ("documents-type", lambda: flash_maxsim.maxsim(Q, "documents"), TypeError, "`documents`"),
    ("list-item-rank", lambda: flash_maxsim.maxsim(Q, [torch.randn(1, 2, 4)]), ValueError, "`documents[0]`"),
    ("list-item-type", lambda: flash_maxsim.maxsim(Q, [torch.randn(2, 4), [1.0]]), TypeError, "`documents[1]`"),
    ("candidates-Nq", lambda: flash_maxsim.maxsim(Q, torch.randn(3, 2, 6, 4)), ValueError, "`documents`"),
    ("queries-mask-shape", lambda: flash_maxsim.maxsim(Q, D, torch.ones(2, 4)), ValueError, "`queries_mask`"),
    ("documents-mask-shape", lambda: flash_maxsim.maxsim(Q, D, None, torch.ones(5, 5)), ValueError,
     "`documents_mask`"),
    ("candidates-mask-shape", lambda: flash_maxsim.maxsim(Q, torch.randn(2, 2, 6, 4), None, torch.ones(2, 6)),
     ValueError, "`documents_mask`"),
    ("list-mask-count", lambda: flash_maxsim.maxsim(Q, [torch.randn(2, 4)] * 2, None, [torch.ones(2)]),
     ValueError, "`documents_mask`"),
    ("list-mask-length", lambda: flash_maxsim.maxsim(Q, [torch.randn(2, 4)] * 2, None, [torch.ones(2), torch.ones(3)]),
     ValueError, "`documents_mask[1]`"),
    ("packed-mask-length", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 7])), None,
                                                       torch.ones(6)), ValueError, "`documents_mask`"),
    ("mask-complex", lambda: flash_maxsim.maxsim(Q, D, torch.ones(2, 3, dtype=torch.complex64)), TypeError,
     "`queries_mask`"),
    ("mask-not-tensor", lambda: flash_maxsim.maxsim(Q, D, [[1, 1, 1], [1, 1, 1]]), TypeError, "`queries_mask`"),
    ("float64", lambda: flash_maxsim.maxsim(Q.double(), D.double()), TypeError, "`queries`"),
    ("int", lambda: flash_maxsim.maxsim(Q.int(), D.int()), TypeError, "`queries`"),
    ("documents-float64", lambda: flash_maxsim.maxsim(Q, D.double()), TypeError, "`documents`"),
    ("mixed-dtypes", lambda: flash_maxsim.maxsim(Q, D.half()), TypeError, "`documents`"),
    ("mixed-dtypes-bf16", lambda: flash_maxsim.maxsim(Q.bfloat16(), D), TypeError, "`documents`"),
    ("tau-zero", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=0.0), ValueError, "`smooth_tau`"),
    ("tau-negative", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=-1.0), ValueError, "`smooth_tau`"),
    ("tau-nan", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=float("nan")), ValueError, "`smooth_tau`"),
    ("tau-string", lambda: flash_maxsim.maxsim(Q, D, smooth_tau="0.1"), TypeError, "`smooth_tau`"),
    ("tau-bool", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=True), TypeError, "`smooth_tau`"),
    # the kernels scale by log2(e) / tau in fp32: it must stay finite and nonzero
    ("tau-below-range", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=1e-39), ValueError, "[2**-100, 2**100]"),
    ("tau-above-range", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=1e40), ValueError, "[2**-100, 2**100]"),
    ("tau-huge-int", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=10 ** 400), ValueError, "`smooth_tau`"),
    ("masked-unknown", lambda: flash_maxsim.maxsim(Q, D, masked="ignore"), ValueError, "`masked`"),
    ("masked-none", lambda: flash_maxsim.maxsim(Q, D, masked=None), ValueError, "`masked`"),
    ("offsets-start", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([1, 3, 7]))), ValueError,
     "`documents.offsets`"),
    ("offsets-end", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 3, 6]))), ValueError,
     "`documents.offsets`"),
    ("offsets-decreasing", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 5, 3, 7]))),
     ValueError, "`documents.offsets`"),
    ("offsets-float", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0.0, 7.0]))), ValueError,
     "`documents.offsets`"),
    ("offsets-2d", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([[0, 7]]))), ValueError,
     "`documents.offsets`"),
    ("offsets-empty", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.zeros(0, dtype=torch.long))),
     ValueError, "`documents.offsets`"),
    ("packed-values-rank", lambda: flash_maxsim.maxsim(Q, PackedDocuments(torch.randn(1, 7, 4), torch.tensor([0, 7]))),
     ValueError, "`documents.values`"),
    # a second device: "meta" stands in for one where no GPU exists
    ("documents-device", lambda: flash_maxsim.maxsim(Q, D.to("meta")), ValueError, "`documents`"),
    ("mask-device", lambda: flash_maxsim.maxsim(Q, D, torch.ones(2, 3, device="meta")), ValueError,
     "`queries_mask`"),
    ("offsets-device", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 7], device="meta"))),
     ValueError, "`documents.offsets`"),
    ("pack-empty", lambda: flash_maxsim.pack([]), ValueError, "`documents`"),
    # pack (and quantize, which packs a list) checks its items as maxsim checks a list: no silent promotion
    ("pack-mixed-dtype", lambda: flash_maxsim.pack([torch.randn(2, 4), torch.randn(3, 4).half()]), TypeError,
     "`documents[1]`"),
    ("pack-mixed-d", lambda: flash_maxsim.pack([torch.randn(2, 4), torch.randn(3, 5)]), ValueError, "`documents[1]`"),
    ("pack-none", lambda: flash_maxsim.pack([None, torch.randn(3, 4)]), TypeError, "`documents[0]`"),
    ("pack-rank", lambda: flash_maxsim.pack([torch.randn(4)]), ValueError, "`documents[0]`"),
    ("quantize-mixed-d", lambda: flash_maxsim.quantize([torch.randn(2, 4), torch.randn(3, 5)]), ValueError,
     "`documents[1]`"),
    # per-document masks are checked against their documents' lengths in every layout that takes them
    ("packed-mask-list-lengths", lambda: flash_maxsim.maxsim(
        Q, flash_maxsim.pack([torch.randn(2, 4), torch.randn(3, 4)]), None, [torch.ones(1), torch.ones(4)]),
     ValueError, "`documents_mask[0]`"),
    ("quantize-mask-list-lengths", lambda: flash_maxsim.quantize(
        [torch.randn(2, 4), torch.randn(3, 4)], [torch.ones(1), torch.ones(4)]), ValueError, "`documents_mask[0]`"),
    ("list-mask-none-entry", lambda: flash_maxsim.maxsim(Q, [torch.randn(2, 4)] * 2, None, [None, torch.ones(2)]),
     TypeError, "`documents_mask[0]`"),
    ("list-mask-scalar", lambda: flash_maxsim.maxsim(Q, [torch.randn(2, 4)] * 2, None, 1), TypeError,
     "`documents_mask`"),
    ("packed-max-length-negative", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 7]), -1)),
     ValueError, "`documents.max_length`"),
    ("packed-max-length-str", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 7]), "7")),
     TypeError, "`documents.max_length`"),
    # the kernels size their grids and saved arg-max indices by max_length: one below the longest document is refused
    ("packed-max-length-understated", lambda: flash_maxsim.maxsim(
        Q, PackedDocuments(VALUES, torch.tensor([0, 2, 7]), 4)), ValueError, "`documents.max_length`"),
    ("packed-max-length-zero", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 7]), 0)),
     ValueError, "`documents.max_length`"),
    ("offsets-bool", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([False, True]))),
     ValueError, "`documents.offsets`"),
    ("offsets-past-values", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, 3, 200]), 5)),
     ValueError, "`documents.offsets`"),
    ("offsets-negative", lambda: flash_maxsim.maxsim(Q, PackedDocuments(VALUES, torch.tensor([0, -3, 7]), 7)),
     ValueError, "`documents.offsets`"),
    ("offsets-int64-overflow", lambda: flash_maxsim.maxsim(Q, PackedDocuments(
        VALUES, torch.tensor([0, 2 ** 63 - 1, -2 ** 63, 7]), 7)), ValueError, "`documents.offsets`"),
    ("tau-numpy-bool", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=np.bool_(True)), TypeError, "`smooth_tau`"),
    ("tau-tensor", lambda: flash_maxsim.maxsim(Q, D, smooth_tau=torch.tensor(0.5)), TypeError, "`smooth_tau`"),
    ("quantized-scales-shape", lambda: flash_maxsim.maxsim(Q, flash_maxsim.QuantizedDocuments(
        flash_maxsim.quantize(D).values, flash_maxsim.quantize(D).scales.reshape(6, 5))), ValueError, "`scales`"),
    ("quantized-scales-int", lambda: flash_maxsim.maxsim(Q, flash_maxsim.QuantizedDocuments(
        flash_maxsim.quantize(D).values, torch.ones(5, 6, dtype=torch.int32))), TypeError, "`scales`"),
    ("quantized-scales-complex", lambda: flash_maxsim.maxsim(Q, flash_maxsim.QuantizedDocuments(
        flash_maxsim.quantize(D).values, torch.ones(5, 6, dtype=torch.complex64))), TypeError, "`scales`"),
    ("quantized-offsets-past-values", lambda: flash_maxsim.maxsim(Q, flash_maxsim.QuantizedDocuments(
        flash_maxsim.quantize(VALUES).values, flash_maxsim.quantize(VALUES).scales, torch.tensor([0, 3, 200]), None,
        5)), ValueError, "`documents.offsets`"),
    ("sparse-queries", lambda: flash_maxsim.maxsim(Q.to_sparse(), D), TypeError, "`queries`"),
    ("sparse-documents", lambda: flash_maxsim.maxsim(Q, D.to_sparse()), TypeError, "`documents`"),
    ("sparse-mask", lambda: flash_maxsim.maxsim(Q, D, torch.ones(2, 3).to_sparse()), TypeError, "`queries_mask`"),
    ("nested-documents", lambda: flash_maxsim.maxsim(Q, torch.nested.nested_tensor([torch.randn(2, 4)])), TypeError,
     "`documents`"),
]


def test_a_tuple_of_documents_is_a_list_of_documents():
    """Only PackedDocuments or a (values, offsets[, max_length]) tuple with 1-D offsets is the packed layout; a
    tuple of [Ld_i, d] documents scores as the same list, as in the reference and quantize."""
    with force_backend("torch"):
        got = flash_maxsim.maxsim(Q, (D[0], D[1, :4]))
        torch.testing.assert_close(got, flash_maxsim.maxsim(Q, [D[0], D[1, :4]]), rtol=0, atol=0)
    torch.testing.assert_close(got.double(), flash_maxsim.reference.maxsim(Q, (D[0], D[1, :4])), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("call, error, text", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS])
def test_bad_input_names_the_argument(call, error, text):
    with force_backend("torch"):
        with pytest.raises(error) as raised:
            call()
    assert text in str(raised.value), str(raised.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_device_mismatch_with_cuda():
    with pytest.raises(ValueError, match="`documents`"):
        flash_maxsim.maxsim(Q.cuda(), D)
    with pytest.raises(ValueError, match="`documents_mask`"):
        flash_maxsim.maxsim(Q.cuda(), D.cuda(), None, torch.ones(5, 6))


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
@pytest.mark.parametrize("masked", ["exclude", "zero"])
def test_nan_in_a_valid_place_gives_nan(masked, smooth_tau):
    d = D.clone()
    d[1, 2, 0] = float("nan")
    with force_backend("torch"):
        out = flash_maxsim.maxsim(Q, d, masked=masked, smooth_tau=smooth_tau)
    assert out[:, 1].isnan().all()
    assert out[:, [0, 2, 3, 4]].isfinite().all()
    q = Q.clone()
    q[0, 1, 3] = float("nan")
    with force_backend("torch"):
        out = flash_maxsim.maxsim(q, D, masked=masked, smooth_tau=smooth_tau)
    assert out[0].isnan().all() and out[1].isfinite().all()


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_nan_in_a_masked_place_is_ignored(smooth_tau):
    d = D.clone()
    d[1, 2, 0] = float("nan")
    dmask = torch.ones(5, 6, dtype=torch.bool)
    dmask[1, 2] = False
    q = Q.clone()
    q[0, 1, 3] = float("nan")
    qmask = torch.ones(2, 3, dtype=torch.bool)
    qmask[0, 1] = False
    with force_backend("torch"):
        out = flash_maxsim.maxsim(q, d, qmask, dmask, smooth_tau=smooth_tau)
    assert out.isfinite().all(), out
    expected = flash_maxsim.reference.maxsim(q, d, qmask, dmask, smooth_tau=smooth_tau)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _nan_gradient_cases():
    for backend in ("torch", "triton"):
        for tau in (None, 0.5):
            for where in ("document", "query"):
                marks = []
                if backend == "triton":
                    marks.append(pytest.mark.skipif(TRITON_DEVICE == "cpu" and not launch.interpreting(),
                                                    reason="needs CUDA or TRITON_INTERPRET=1"))
                yield pytest.param(backend, tau, where, marks=marks,
                                   id=f"{backend}-{'hard' if tau is None else 'smooth'}-{where}")


@pytest.mark.parametrize("backend, smooth_tau, where", list(_nan_gradient_cases()))
def test_nan_in_a_masked_place_gives_finite_gradients(backend, smooth_tau, where):
    """Masked tokens take no part, so a NaN stored there (e.g. uninitialised padding) must not reach any
    gradient either."""
    device = "cpu" if backend == "torch" else TRITON_DEVICE
    q, d = Q.clone(), D.clone()
    qmask = torch.ones(2, 3, dtype=torch.bool)
    dmask = torch.ones(5, 6, dtype=torch.bool)
    if where == "document":
        d[1, 2, 0] = float("nan")
        dmask[1, 2] = False
    else:
        q[0, 1, 3] = float("nan")
        qmask[0, 1] = False
    q = q.to(device).requires_grad_()
    d = d.to(device).requires_grad_()
    with force_backend(backend):
        out = flash_maxsim.maxsim(q, d, qmask.to(device), dmask.to(device), smooth_tau=smooth_tau)
        out.sum().backward()
    assert out.isfinite().all()
    assert q.grad.isfinite().all(), "NaN reached the queries' gradient"
    assert d.grad.isfinite().all(), "NaN reached the documents' gradient"


def _backends():
    return [pytest.param("torch", id="torch"),
            pytest.param("triton", id="triton", marks=pytest.mark.skipif(
                TRITON_DEVICE == "cpu" and not launch.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"))]


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
@pytest.mark.parametrize("masked", ["exclude", "zero"])
@pytest.mark.parametrize("backend", _backends())
def test_a_query_token_whose_similarities_are_all_minus_inf_adds_zero(backend, masked, smooth_tau):
    """Only infinite inputs give it: an aggregate of -inf counts as empty (0) on every path and in the
    reference (docs/semantics.md), while +inf stays +inf and the other query tokens add as usual."""
    q = torch.randn(2, 3, 4).abs() + 0.5
    q[0, 1] = float("inf")                                    # against all-negative tokens: every s = -inf
    d = -(torch.rand(3, 5, 4) + 0.5)
    d[2] = -d[2]                                              # document 2: every s of that token = +inf
    with force_backend(backend):
        out = flash_maxsim.maxsim(q.to(TRITON_DEVICE if backend == "triton" else "cpu"),
                                  d.to(TRITON_DEVICE if backend == "triton" else "cpu"),
                                  masked=masked, smooth_tau=smooth_tau).cpu()
    expected = flash_maxsim.reference.maxsim(q, d, masked=masked, smooth_tau=smooth_tau)
    # +inf: the hard max is +inf; the smooth max's m + tau * log(sum exp((s - m) / tau)) is NaN (inf - inf)
    assert expected[0, 2] == float("inf") if smooth_tau is None else expected[0, 2].isnan()
    torch.testing.assert_close(out[0, 2].double(), expected[0, 2], equal_nan=True)
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, 2] = False
    torch.testing.assert_close(out[finite].double(), expected[finite], rtol=1e-5, atol=1e-5)
    if masked == "exclude":
        # the -inf token adds 0: row 0's scores against documents 0, 1 are those of its other two tokens
        others = flash_maxsim.reference.maxsim(q[:1, [0, 2]], d[:2], smooth_tau=smooth_tau)
        torch.testing.assert_close(out[0, :2].double(), others[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_smallest_smooth_tau_is_the_hard_max_without_overflow(backend):
    """tau = 2**-100: s / tau alone would overflow fp32 (2 / 2**-100 = 2**101 is fine, 2**30 / 2**-100 is not);
    every path subtracts the row's max first, so the smooth max is the hard max."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q = torch.tensor([[[2.0 ** 15, 0.0, 0.0, 0.0]]])
    d = torch.tensor([[[2.0 ** 15, 0, 0, 0], [-2.0 ** 15, 0, 0, 0], [1.0, 0, 0, 0]]])
    with force_backend(backend):
        for sign in (1.0, -1.0):
            out = flash_maxsim.maxsim((sign * q).to(device), d.to(device), smooth_tau=2.0 ** -100).cpu()
            hard = flash_maxsim.reference.maxsim(sign * q, d)
            assert torch.equal(out.double(), hard), (sign, out, hard)


SECOND_ORDER = "differentiable once"


@pytest.mark.parametrize("loss", ["sum", "cross_entropy"])
@pytest.mark.parametrize("smooth_tau", [None, 1.0])
@pytest.mark.parametrize("backend", _backends())
def test_a_gradient_with_create_graph_raises_instead_of_a_wrong_second_derivative(backend, smooth_tau, loss):
    """The backward is first order only (docs/semantics.md, Gradients): ``create_graph=True`` through the scores
    raises, whether the upstream gradient is a constant (sum) or itself depends on the scores (cross-entropy)."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q = torch.randn(1, 2, 4, device=device, requires_grad=True)
    d = torch.randn(3, 5, 4, device=device, requires_grad=True)
    with force_backend(backend):
        scores = flash_maxsim.maxsim(q, d, smooth_tau=smooth_tau)
        value = scores.sum() if loss == "sum" else torch.nn.functional.cross_entropy(
            scores, torch.tensor([1], device=device))
        with pytest.raises(RuntimeError, match=SECOND_ORDER):
            torch.autograd.grad(value, q, create_graph=True)
        # first order after the refusal: as without it
        scores = flash_maxsim.maxsim(q, d, smooth_tau=smooth_tau)
        grad_q, = torch.autograd.grad(scores.sum(), q)
    assert not grad_q.requires_grad and grad_q.isfinite().all()


@pytest.mark.parametrize("backend", _backends())
def test_a_gradient_penalty_raises(backend):
    """``(s.sum() + g.pow(2).sum()).backward()`` with ``g`` from ``create_graph=True`` would drop the penalty's
    term if ``g`` were a constant: the gradient call raises instead."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q = torch.randn(2, 3, 8, device=device, requires_grad=True)
    d = torch.randn(4, 5, 8, device=device, requires_grad=True)
    with force_backend(backend):
        s = flash_maxsim.maxsim(q, d)
        with pytest.raises(RuntimeError, match=SECOND_ORDER):
            g, = torch.autograd.grad(s.sum(), q, create_graph=True)
            (s.sum() + g.pow(2).sum()).backward()


@pytest.mark.parametrize("backend", _backends())
def test_the_custom_ops_refuse_create_graph_too(backend):
    """The registered op's autograd (what torch.compile traces) refuses ``create_graph=True`` as the eager path
    does."""
    from flash_maxsim import _layout
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q = torch.randn(2, 3, 8, device=device, requires_grad=True)
    d = torch.randn(4, 5, 8, device=device, requires_grad=True)
    p = _layout.canonicalize(q, d)
    with force_backend(backend):
        scores, _ = torch.ops.flash_maxsim.maxsim_fwd(q, d, None, None, None, p.max_length, 0, False, None, True)
        with pytest.raises(RuntimeError, match=SECOND_ORDER):
            torch.autograd.grad(scores.sum(), d, create_graph=True)
        scores, _ = torch.ops.flash_maxsim.maxsim_fwd(q, d, None, None, None, p.max_length, 0, False, None, True)
        grad_d, = torch.autograd.grad(scores.sum(), d)
        expected, = torch.autograd.grad(flash_maxsim.maxsim(q, d).sum(), d)
    torch.testing.assert_close(grad_d, expected)


@pytest.mark.parametrize("tau", [np.float32(0.5), np.float16(0.5), np.float64(0.5), fractions.Fraction(1, 2), 0.5],
                         ids=["np.float32", "np.float16", "np.float64", "Fraction", "float"])
def test_smooth_tau_is_any_real_number(tau):
    with force_backend("torch"):
        got = flash_maxsim.maxsim(Q, D, smooth_tau=tau)
        assert torch.equal(got, flash_maxsim.maxsim(Q, D, smooth_tau=0.5))


@pytest.mark.parametrize("layout", ["padded", "candidates", "packed"])
@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_meta_tensors_give_the_shapes(layout, smooth_tau):
    """Queries and documents both on ``meta``: scores and gradients of the right shapes and dtypes, as PyTorch's
    own ops propagate them."""
    q = torch.randn(2, 3, 4, device="meta", requires_grad=True)
    if layout == "padded":
        documents = leaf = torch.randn(5, 6, 4, device="meta", requires_grad=True)
        shape = (2, 5)
    elif layout == "candidates":
        documents = leaf = torch.randn(2, 3, 6, 4, device="meta", requires_grad=True)
        shape = (2, 3)
    else:
        leaf = torch.randn(7, 4, device="meta", requires_grad=True)
        documents = PackedDocuments(leaf, torch.zeros(4, dtype=torch.int64, device="meta"))
        shape = (2, 3)
    scores = flash_maxsim.maxsim(q, documents, smooth_tau=smooth_tau)
    assert scores.device.type == "meta" and scores.shape == shape and scores.dtype == torch.float32
    grad_q, grad_d = torch.autograd.grad(scores.sum(), (q, leaf))
    assert grad_q.shape == q.shape and grad_d.shape == leaf.shape and grad_d.device.type == "meta"


def test_the_other_flash_maxsim_projects_names_say_which_package_this_is():
    """The PyPI project `flash-maxsim` shares the import name; asking this package for one of its functions
    says so (and hasattr stays False), while an unknown name is a plain AttributeError."""
    with pytest.raises(AttributeError, match="flash-maxsim-kernels.*flash_maxsim.maxsim"):
        flash_maxsim.flash_maxsim_batched
    with pytest.raises(ImportError, match="flash_maxsim_batched_train"):
        from flash_maxsim import flash_maxsim_batched_train  # noqa: F401
    assert not hasattr(flash_maxsim, "pack_pairs")
    with pytest.raises(AttributeError) as error:
        flash_maxsim.no_such_name
    assert "flash-maxsim-kernels" not in str(error.value)
    assert not hasattr(flash_maxsim, "sys"), "module-private imports stay private"


def test_pylate_asking_for_the_other_projects_names_gets_its_fallback_exception(monkeypatch):
    """PyLate's flash backend importing one of the other project's names gets an ImportError that is also PyLate's
    FlashUnsupported (what its backend="auto" falls back on), one warning per process, and PyLate's record of
    that backend's availability set to False."""
    import sys
    import types
    import warnings

    from flash_maxsim import _name_clash
    backend = types.ModuleType("pylate.scores._flash_backend")
    exec("_IMPORT_OK = True\n"
         "class FlashUnsupported(Exception):\n"
         "    pass\n"
         "def flash_scores():\n"
         "    from flash_maxsim import flash_maxsim_batched\n", backend.__dict__)
    monkeypatch.setitem(sys.modules, "pylate.scores._flash_backend", backend)
    monkeypatch.setattr(_name_clash, "_fallback_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors = []
        for _ in range(2):
            with pytest.raises(backend.FlashUnsupported) as error:
                backend.flash_scores()
            errors.append(error.value)
    assert all(isinstance(e, ImportError) and e.name == "flash_maxsim_batched" for e in errors)
    assert "flash-maxsim-kernels" in str(errors[0]) and "enable()" in str(errors[0])
    assert len([w for w in caught if "flash-maxsim-kernels" in str(w.message)]) == 1
    assert backend._IMPORT_OK is False
