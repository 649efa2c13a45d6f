"""The Triton kernels themselves, forward and backward, against the float64 reference: on CUDA when present,
otherwise on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py). Interpreted
calls cost ~1 s, so the shapes are tiny and the set is small, but every layout x mode x hard/smooth x
fp32/bf16 is here, plus the kernels' special paths (long queries, wide features, empty documents)."""

import pytest
import torch

import flash_maxsim
from flash_maxsim.kernels import launch
from flash_maxsim.ops import force_backend

from .helpers import (LAYOUTS, assert_grads_close, assert_scores_close, expected_scores_and_grads,
                      flash_scores_and_grads, make_case, upstream_gradient)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(DEVICE == "cpu" and not launch.interpreting(),
                       reason="needs CUDA, or TRITON_INTERPRET=1 set before flash_maxsim is imported"),
    pytest.mark.usefixtures("highest_fp32_precision"),
]


def check(case):
    grad_out = upstream_gradient(case)
    with force_backend("triton"):
        got, grads = flash_scores_and_grads(case, grad_out)
        expected, expected_grads = expected_scores_and_grads(case, grad_out)
    assert_scores_close(got, expected, case)
    assert_grads_close(grads, expected_grads, case)
    return got, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("smooth_tau", [None, 0.05], ids=["hard", "smooth"])
@pytest.mark.parametrize("masked", ["exclude", "zero"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_mode_dtype(layout, masked, smooth_tau, dtype, seed):
    # masks with holes, one fully masked document, (ragged) one zero-length document; every other layout
    # through non-contiguous views
    case = make_case(layout=layout, Nq=2, C=3, Lq=4, Ld=6, d=8, dtype=dtype, masked=masked,
                     smooth_tau=smooth_tau, query_mask_keep=0.7, doc_mask_keep=0.6, fully_masked_doc=True,
                     empty_doc=True, noncontiguous=(LAYOUTS.index(layout) + (masked == "zero")) % 2 == 1,
                     seed=seed, device=DEVICE)
    check(case)


@pytest.mark.parametrize("name, kwargs", [
    ("d96", dict(layout="padded", Nq=2, C=2, Lq=3, Ld=5, d=96)),
    ("Lq1", dict(layout="candidates", Nq=2, C=2, Lq=1, Ld=5, d=8, doc_mask_keep=0.6)),
    ("single_query_lq1", dict(layout="packed", Nq=1, C=3, Lq=1, Ld=4, d=8, single_query=True)),
    ("query_split_Lq130", dict(layout="padded", Nq=1, C=2, Lq=130, Ld=3, d=8, query_mask_keep=0.8)),
    ("query_split_smooth", dict(layout="list", Nq=1, C=2, Lq=130, Ld=3, d=8, smooth_tau=1.0, empty_doc=True)),
    ("chunked_d300", dict(layout="padded", Nq=1, C=2, Lq=2, Ld=3, d=300, doc_mask_keep=0.7)),
    ("chunked_d300_smooth", dict(layout="packed", Nq=1, C=2, Lq=2, Ld=3, d=300, smooth_tau=0.05, masked="zero",
                                 doc_mask_keep=0.7)),
    ("ragged_empty_doc", dict(layout="list", Nq=2, C=3, Lq=3, Ld=4, d=8, lengths=[2, 0, 4])),
    ("doc_longer_than_tile", dict(layout="padded", Nq=1, C=1, Lq=2, Ld=70, d=4, doc_mask_keep=0.5)),
    ("fp16", dict(layout="padded", Nq=2, C=2, Lq=3, Ld=5, d=8, dtype=torch.float16, doc_mask_keep=0.7)),
    ("d1", dict(layout="padded", Nq=2, C=2, Lq=3, Ld=5, d=1)),
])
def test_special_shapes(name, kwargs, seed):
    check(make_case(seed=seed, device=DEVICE, **kwargs))


def test_empty_batches():
    q = torch.randn(2, 3, 4, device=DEVICE)
    d = torch.randn(5, 6, 4, device=DEVICE)
    with force_backend("triton"):
        assert flash_maxsim.maxsim(q[:0], d).shape == (0, 5)
        assert flash_maxsim.maxsim(q, d[:0]).shape == (2, 0)
        assert flash_maxsim.maxsim(q, []).shape == (2, 0)
        out = flash_maxsim.maxsim(q, [torch.randn(0, 4, device=DEVICE), torch.randn(0, 4, device=DEVICE)])
        assert out.shape == (2, 2) and (out == 0).all()


def test_nan_policy():
    q = torch.randn(1, 3, 4, device=DEVICE)
    d = torch.randn(2, 5, 4, device=DEVICE)
    d[0, 1, 2] = float("nan")
    mask = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    with force_backend("triton"):
        for tau in (None, 0.5):
            out = flash_maxsim.maxsim(q, d, smooth_tau=tau)
            assert out[0, 0].isnan() and out[0, 1].isfinite(), (tau, out)
        mask[0, 1] = False
        for tau in (None, 0.5):
            out = flash_maxsim.maxsim(q, d, None, mask, smooth_tau=tau)
            assert out.isfinite().all(), out
