"""Bad input raises ValueError/TypeError naming the argument; NaN propagates from valid places only."""

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
]


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
