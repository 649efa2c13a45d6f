"""The float64 reference itself, pinned by hand-computed cases: every other test trusts it."""

import math

import pytest
import torch

import flash_maxsim
from flash_maxsim import reference

from .helpers import LAYOUTS, first_argmax_maxsim, make_case, upstream_gradient

# One query of two tokens (unit axes, so similarities are read off the document's coordinates) and one
# document of three tokens whose valid similarities are all negative while the masked token's would be 3.
Q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
D = torch.tensor([[[-1.0, -2.0], [3.0, 3.0], [-0.5, -1.0]]])
MIDDLE_MASKED = torch.tensor([[True, False, True]])
# s = [[-1, 3, -0.5], [-2, 3, -1]]


def ref(*args, **kwargs):
    return reference.maxsim(*args, **kwargs)


def test_unmasked_hard_max():
    assert ref(Q, D).tolist() == [[6.0]]                       # 3 + 3


def test_exclude_ignores_the_masked_token():
    assert ref(Q, D, None, MIDDLE_MASKED).tolist() == [[-1.5]]  # max(-1, -0.5) + max(-2, -1)


def test_zero_counts_the_masked_token_as_zero():
    # the masked token enters as s = 0 and beats the negative valid similarities
    assert ref(Q, D, None, MIDDLE_MASKED, masked="zero").tolist() == [[0.0]]


def test_modes_agree_without_mask_and_when_valid_similarities_win():
    positive = -D
    positive[0, 1] = torch.tensor([-3.0, -3.0])
    # s = [[1, -3, 0.5], [2, -3, 1]]: the masked token's 0 never wins
    for masked in ("exclude", "zero"):
        assert ref(Q, positive, None, MIDDLE_MASKED, masked=masked).tolist() == [[3.0]]
        assert ref(Q, D, masked=masked).tolist() == [[6.0]]


def test_all_masked_document():
    none_valid = torch.zeros(1, 3, dtype=torch.bool)
    assert ref(Q, D, None, none_valid).tolist() == [[0.0]]
    assert ref(Q, D, None, none_valid, masked="zero").tolist() == [[0.0]]         # max of three zeros
    assert ref(Q, D, None, none_valid, smooth_tau=0.5).tolist() == [[0.0]]
    # "zero": three tokens at s = 0 -> tau * log(3) per query token
    got = ref(Q, D, None, none_valid, masked="zero", smooth_tau=0.5).item()
    assert got == pytest.approx(2 * 0.5 * math.log(3), rel=1e-12)


def test_zero_length_document_contributes_zero_in_both_modes():
    docs = [D[0], torch.zeros(0, 2)]
    for masked in ("exclude", "zero"):
        for tau in (None, 0.5):
            got = ref(Q, docs, masked=masked, smooth_tau=tau)
            assert got[0, 1].item() == 0.0


def test_masked_query_tokens_contribute_zero():
    qmask = torch.tensor([[True, False]])
    assert ref(Q, D, qmask).tolist() == [[3.0]]
    # also in smooth "zero" mode, where an all-masked document would otherwise give tau*log(L)
    got = ref(Q, D, qmask, torch.zeros(1, 3), masked="zero", smooth_tau=0.5).item()
    assert got == pytest.approx(0.5 * math.log(3), rel=1e-12)
    assert ref(Q, D, torch.zeros(1, 2)).tolist() == [[0.0]]


def test_smooth_max_by_hand():
    tau = 0.7

    def lse(values):
        return tau * math.log(sum(math.exp(v / tau) for v in values))

    assert ref(Q, D, smooth_tau=tau).item() == pytest.approx(lse([-1, 3, -0.5]) + lse([-2, 3, -1]), rel=1e-12)
    assert ref(Q, D, None, MIDDLE_MASKED, smooth_tau=tau).item() == \
        pytest.approx(lse([-1, -0.5]) + lse([-2, -1]), rel=1e-12)
    assert ref(Q, D, None, MIDDLE_MASKED, masked="zero", smooth_tau=tau).item() == \
        pytest.approx(lse([-1, 0, -0.5]) + lse([-2, 0, -1]), rel=1e-12)


def test_smooth_max_tends_to_hard_max():
    assert ref(Q, D, smooth_tau=1e-3).item() == pytest.approx(6.0, abs=1e-9)
    # tau * log(sum exp(s / tau)) >= max, with equality only as tau -> 0
    assert ref(Q, D, smooth_tau=1.0).item() > 6.0


def test_lq_one_and_single_query():
    q = Q[:, :1]                                                 # [1, 1, 2]
    assert ref(q, D).tolist() == [[3.0]]
    single = ref(Q[0], D)                                        # [Lq, d] -> output drops the query axis
    assert single.shape == (1,) and single.tolist() == [6.0]
    assert ref(Q[0], D, torch.tensor([True, False])).tolist() == [3.0]


def test_nonbinary_masks_mean_nonzero_is_valid():
    # float 0.5 and int 2 are "valid", exactly like True
    assert ref(Q, D, None, torch.tensor([[0.5, 0.0, 2.0]])).tolist() == [[-1.5]]
    assert ref(Q, D, torch.tensor([[3, 0]]), None).tolist() == [[3.0]]


def test_every_query_against_every_document_and_candidates():
    d2 = torch.tensor([[[1.0, 1.0]], [[2.0, -1.0]]])             # B=2 documents of 1 token
    q2 = torch.cat([Q, -Q])                                      # Nq=2
    assert ref(q2, d2).tolist() == [[2.0, 1.0], [-2.0, -1.0]]
    # per-query candidates: query 0 meets d2, query 1 meets the two documents in reverse order
    cands = torch.stack([d2, d2.flip(0)])                        # [Nq=2, K=2, 1, 2]
    assert ref(q2, cands).tolist() == [[2.0, 1.0], [-1.0, -2.0]]


def test_empty_query_batch():
    out = ref(torch.zeros(0, 2, 2), D)
    assert out.shape == (0, 1)


@pytest.mark.parametrize("documents", [torch.zeros(0, 3, 2), [], torch.zeros(1, 0, 3, 2)], ids=["B0", "list", "K0"])
def test_empty_document_batch(documents):
    assert ref(Q, documents).shape == (1, 0)


def test_nan_policy():
    d = D.clone()
    d[0, 1, 0] = float("nan")
    assert math.isnan(ref(Q, d).item())                          # NaN in an unmasked place
    assert ref(Q, d, None, MIDDLE_MASKED).item() == -1.5         # NaN only where masked ("exclude")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_are_one_function(layout):
    """Every layout of the same logical problem gives the same reference numbers."""
    case = make_case(layout=layout, Nq=3, C=4, Lq=5, Ld=6, d=3, query_mask_keep=0.7, doc_mask_keep=0.6,
                     empty_doc=True, seed=11, requires_grad=False)
    leaves = [x.double() for x in case.leaves()]
    Qd, qvalid, docs, masks, K = case.logical(leaves)
    got = case.run(reference.maxsim, leaves, for_reference=True)
    for q in range(Qd.shape[0]):
        cols = range(q * K, (q + 1) * K) if K else range(len(docs))
        for c, t in enumerate(cols):
            # one query against one document, given as a single-document list
            one = reference.maxsim(Qd[q], [docs[t]], qvalid[q], [masks[t]])
            assert one.shape == (1,)
            assert got[q, c].item() == pytest.approx(one.item(), rel=1e-12, abs=1e-12)


def test_reference_accepts_packed_documents():
    docs = [D[0], torch.zeros(0, 2), D[0, :2]]
    packed = flash_maxsim.pack(docs)
    torch.testing.assert_close(ref(Q, packed), ref(Q, docs))
    torch.testing.assert_close(ref(Q, (packed.values, packed.offsets)), ref(Q, docs))
    mask = torch.tensor([True, False, True, True, False])
    torch.testing.assert_close(ref(Q, packed, None, mask), ref(Q, docs, None, [mask[:3], mask[3:3], mask[3:]]))


@pytest.mark.parametrize("masked", ["exclude", "zero"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_argmax_oracle_is_the_reference_without_ties(layout, masked):
    """The hard-max gradient oracle of these tests equals autograd of the reference when no ties exist."""
    case = make_case(layout=layout, Nq=3, C=3, Lq=4, Ld=6, d=5, masked=masked, query_mask_keep=0.7,
                     doc_mask_keep=0.6, fully_masked_doc=True, empty_doc=True, seed=5)
    grad_out = upstream_gradient(case).double()
    a = [x.detach().double().requires_grad_() for x in case.leaves()]
    b = [x.detach().double().requires_grad_() for x in case.leaves()]
    out_a = case.run(reference.maxsim, a, for_reference=True)
    out_b = first_argmax_maxsim(case, b)
    torch.testing.assert_close(out_a, out_b, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad(out_a, a, grad_out, allow_unused=True)
    gb = torch.autograd.grad(out_b, b, grad_out, allow_unused=True)
    for x, y, leaf in zip(ga, gb, a):
        x = torch.zeros_like(leaf) if x is None else x
        y = torch.zeros_like(leaf) if y is None else y
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
