"""The exact chunked PyTorch path (CPU tensors) against the float64 reference: property tests on random shapes,
dtypes, layouts, masks and modes, fresh random data every run (hypothesis prints the seed of a failure)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flash_maxsim
from flash_maxsim import _cpu
from flash_maxsim.ops import force_backend

from .helpers import (DTYPES, LAYOUTS, MASK_DTYPES, assert_grads_close, assert_scores_close, check_case, expected_scores_and_grads,
                      flash_scores_and_grads, make_case, reference_scores_and_grads, upstream_gradient)

PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, dtypes=tuple(DTYPES.values()), allow_empty=True):
    layout = draw(st.sampled_from(LAYOUTS))
    low = 0 if allow_empty else 1
    masked_keep = st.none() | st.sampled_from([0.3, 0.7, 1.0])
    return make_case(
        layout=layout,
        Nq=draw(st.integers(low, 4)),
        C=draw(st.integers(low, 5)),
        Lq=draw(st.sampled_from([1, 2, 3, 5, 8, 9])),
        Ld=draw(st.sampled_from([1, 2, 3, 7, 12])),
        d=draw(st.sampled_from([1, 2, 3, 8, 17, 96])),
        dtype=draw(st.sampled_from(dtypes)),
        masked=draw(st.sampled_from(["exclude", "zero"])),
        smooth_tau=draw(st.sampled_from([None, None, 0.05, 1.0])),
        query_mask_keep=draw(masked_keep),
        doc_mask_keep=draw(masked_keep),
        mask_dtype=draw(st.sampled_from(MASK_DTYPES)),
        fully_masked_doc=draw(st.booleans()),
        empty_doc=draw(st.booleans()),
        single_query=draw(st.booleans()),
        noncontiguous=draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


@PROPERTY
@given(case=cases())
def test_scores_match_reference(case):
    with force_backend("torch"):
        got, _ = flash_scores_and_grads(case)
    expected, _ = reference_scores_and_grads(case)
    assert_scores_close(got, expected, case)


@PROPERTY
@given(case=cases())
def test_gradients_match_reference(case):
    check_case(case, "torch")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_gradients_at_highest_precision(layout, seed, highest_fp32_precision):
    """fp32 inputs at "highest" precision: gradients match float64 autograd to ~1e-6 relative."""
    for masked, tau in [("exclude", None), ("zero", None), ("exclude", 0.05), ("zero", 1.0)]:
        case = make_case(layout=layout, Nq=3, C=4, Lq=6, Ld=9, d=17, masked=masked, smooth_tau=tau,
                         query_mask_keep=0.8, doc_mask_keep=0.7, empty_doc=True, seed=seed)
        grad_out = upstream_gradient(case)
        with force_backend("torch"):
            _, grads = flash_scores_and_grads(case, grad_out)
            _, expected = expected_scores_and_grads(case, grad_out)
        # the smooth max's weights are exp(s / tau): fp32 rounding of s is amplified by 1/tau
        amplification = 1.0 if tau is None else max(1.0, 1.0 / tau)
        for g, e in zip(grads, expected):
            if e.numel():
                tol = 2e-6 * amplification
                torch.testing.assert_close(g.double(), e, rtol=tol, atol=tol * e.abs().max().item())


def test_blocking_over_many_documents_and_queries(monkeypatch, seed):
    """Force tiny blocks so that the query and document blocking (and its index bookkeeping) is exercised."""
    monkeypatch.setattr(_cpu, "BLOCK_ELEMENTS", 64)
    for layout in LAYOUTS:
        for tau in (None, 0.5):
            check_case(make_case(layout=layout, Nq=5, C=7, Lq=3, Ld=5, d=4, smooth_tau=tau, doc_mask_keep=0.7,
                                 empty_doc=True, seed=seed), "torch")


@pytest.mark.parametrize("layout", ["list", "packed"])
def test_ragged_with_zero_length_documents(layout, seed):
    got, _ = check_case(make_case(layout=layout, Nq=2, C=4, Lq=3, Ld=5, d=8, lengths=[3, 0, 5, 0], seed=seed),
                        "torch")
    assert (got[:, [1, 3]] == 0).all()


def test_all_documents_empty_cpu():
    q = torch.randn(2, 3, 4)
    with force_backend("torch"):
        got = flash_maxsim.maxsim(q, [torch.randn(0, 4), torch.randn(0, 4)])
    assert got.shape == (2, 2) and (got == 0).all()


def test_padded_documents_of_length_zero_cpu():
    q = torch.randn(2, 3, 4)
    with force_backend("torch"):
        try:
            got = flash_maxsim.maxsim(q, torch.randn(5, 0, 4))
        except ValueError as error:                  # a clear refusal naming the argument is fine too
            assert "documents" in str(error)
            return
    assert got.shape == (2, 5) and (got == 0).all()


def test_empty_batches_have_the_right_shape():
    d = torch.randn(5, 6, 4)
    with force_backend("torch"):
        assert flash_maxsim.maxsim(torch.randn(0, 3, 4), d).shape == (0, 5)
        assert flash_maxsim.maxsim(torch.randn(2, 3, 4), torch.randn(0, 6, 4)).shape == (2, 0)
        assert flash_maxsim.maxsim(torch.randn(2, 3, 4), []).shape == (2, 0)
        assert flash_maxsim.maxsim(torch.randn(2, 3, 4), torch.randn(2, 0, 6, 4)).shape == (2, 0)
        assert flash_maxsim.maxsim(torch.randn(3, 4), d).shape == (5,)
        out = flash_maxsim.maxsim(torch.randn(2, 0, 4), d)           # Lq = 0: nothing to sum
        assert out.shape == (2, 5) and (out == 0).all()


@pytest.mark.parametrize("budget", [16, 50, 300])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_of_every_size_match_reference(monkeypatch, layout, budget, seed):
    """Blocks that cut through a query's tokens (budget below Lq x Ld), through a query's candidates and through
    the documents in uneven parts: scores and gradients against the float64 reference, every mode and mask."""
    monkeypatch.setattr(_cpu, "BLOCK_ELEMENTS", budget)
    for masked, tau, doc_keep, query_keep in [("exclude", None, 0.7, 0.8), ("zero", None, 0.6, None),
                                              ("exclude", 0.3, None, 0.8), ("zero", 1.0, 0.7, 0.8)]:
        case = make_case(layout=layout, Nq=3, C=7, Lq=9, Ld=7, d=5, masked=masked, smooth_tau=tau,
                         query_mask_keep=query_keep, doc_mask_keep=doc_keep, empty_doc=True,
                         noncontiguous=budget == 50, seed=seed)
        grad_out = upstream_gradient(case)
        with force_backend("torch"):
            got, grads = flash_scores_and_grads(case, grad_out)
            expected, expected_grads = expected_scores_and_grads(case, grad_out)
        assert_scores_close(got, expected, case)
        assert_grads_close(grads, expected_grads, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_larger_random_problems_match_reference(dtype, seed):
    """Sizes that are not multiples of anything (several blocks at the default size, odd d), fresh data:
    scores and gradients of both maxima against the float64 reference."""
    for layout, tau in [("padded", None), ("packed", None), ("padded", 0.1), ("candidates", None)]:
        case = make_case(layout=layout, Nq=5, C=37 if layout != "candidates" else 11, Lq=31, Ld=203, d=67,
                         dtype=dtype, smooth_tau=tau, doc_mask_keep=0.9, query_mask_keep=0.9, seed=seed)
        grad_out = upstream_gradient(case)
        with force_backend("torch"):
            got, grads = flash_scores_and_grads(case, grad_out)
            expected, expected_grads = expected_scores_and_grads(case, grad_out)
        assert_scores_close(got, expected, case)
        assert_grads_close(grads, expected_grads, case)


@pytest.mark.parametrize("smooth_tau", [None, 0.2])
@pytest.mark.parametrize("layout", ["padded", "packed", "candidates"])
def test_many_blocks_are_deterministic(monkeypatch, layout, smooth_tau, seed):
    """Many blocks over torch's threads: scores and gradients bitwise identical from one call to the next."""
    monkeypatch.setattr(_cpu, "BLOCK_ELEMENTS", 1 << 14)
    case = make_case(layout=layout, Nq=6, C=40, Lq=32, Ld=64, d=48, smooth_tau=smooth_tau, doc_mask_keep=0.8,
                     seed=seed)
    grad_out = upstream_gradient(case)
    with force_backend("torch"):
        first_scores, first = flash_scores_and_grads(case, grad_out)
        second_scores, second = flash_scores_and_grads(case, grad_out)
    assert torch.equal(first_scores, second_scores)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _resident_peak_above_start(fn):
    """The process's resident-set high-water mark during ``fn()`` above its resident set before (Linux)."""
    import re

    def read(key):
        with open("/proc/self/status") as f:
            return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                    # resets the high-water mark
        before = read("VmRSS")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs")
    fn()
    return read("VmHWM") - before


@pytest.mark.parametrize("smooth_tau", [None, 0.1])
def test_peak_memory_stays_within_blocks(monkeypatch, smooth_tau):
    """Scoring and a training step hold blocks, never the similarity tensor: the resident set grows by less
    than a few blocks plus the fp32 gradients, where the similarities alone would take 20x that."""
    monkeypatch.setattr(_cpu, "BLOCK_ELEMENTS", 1 << 18)                  # 1 MiB of similarities per block
    g = torch.Generator().manual_seed(0)
    q, d = torch.randn(20, 32, 32, generator=g), torch.randn(1000, 80, 32, generator=g)
    similarity_bytes = 20 * 1000 * 32 * 80 * 4
    block_bytes = _cpu.BLOCK_ELEMENTS * 4
    with force_backend("torch"):
        flash_maxsim.maxsim(q, d, smooth_tau=smooth_tau)                  # warm-up: threads, allocator

        scoring = _resident_peak_above_start(lambda: flash_maxsim.maxsim(q, d, smooth_tau=smooth_tau))

        def step():
            qq, dd = q.clone().requires_grad_(), d.clone().requires_grad_()
            flash_maxsim.maxsim(qq, dd, smooth_tau=smooth_tau).sum().backward()
        training = _resident_peak_above_start(step)
    gradients_and_copies = 3 * (q.numel() + d.numel()) * 4              # leaf copies and fp32 gradients
    limit = 8 * block_bytes
    assert similarity_bytes > 20 * limit
    print(f"peak above start: scoring {scoring / 2**20:.1f} MiB, training {training / 2**20:.1f} MiB")
    assert scoring < limit, (scoring, limit)
    assert training < limit + gradients_and_copies, (training, limit + gradients_and_copies)
