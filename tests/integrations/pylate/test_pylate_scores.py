"""flash_maxsim's PyLate scorers against PyLate's own torch path (and the float64 reference), on fresh random
data with skiplist-style masks: holes inside the documents, padding after them, one document without any
valid token."""

import pytest
import torch

pylate = pytest.importorskip("pylate")

from flash_maxsim import ops, reference  # noqa: E402
from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402
from flash_maxsim.kernels import launch  # noqa: E402

import pylate_testlib as lib  # noqa: E402

ATOL = 2e-5


def _grads(scores, inputs, weights):
    return torch.autograd.grad((scores * weights).sum(), inputs)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
@pytest.mark.parametrize("with_query_mask", [False, True])
def test_colbert_scores_equal_pylate_with_skiplist_masks(mask_dtype, with_query_mask):
    g = torch.Generator().manual_seed(11 + with_query_mask)
    Q = lib.embeddings((5, 9, 24), g, side=+1)
    D = lib.embeddings((7, 13, 24), g, side=-1)
    dmask = lib.skiplist_mask((7, 13), g).to(mask_dtype)
    qmask = lib.skiplist_mask((5, 9), g, hole_rate=0.1).to(mask_dtype) if with_query_mask else None
    weights = torch.randn(5, 7, generator=g)

    qa, da = _leaf(Q), _leaf(D)
    expected = lib.pylate_colbert_scores(qa, da, qmask, dmask)
    qb, db = _leaf(Q), _leaf(D)
    got = flash_pylate.colbert_scores(qb, db, qmask, dmask)

    assert got.shape == (5, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.double(), reference.maxsim(Q, D, qmask, dmask, masked="zero"), atol=ATOL, rtol=0)
    for g_got, g_expected in zip(_grads(got, (qb, db), weights), _grads(expected, (qa, da), weights)):
        torch.testing.assert_close(g_got, g_expected, atol=ATOL, rtol=0)
    # the data does tell PyLate's semantics apart from skipping masked tokens
    excluded = flash_pylate.colbert_scores(Q, D, qmask, dmask, masked="exclude")
    assert (excluded - expected.detach()).abs().max() > 0.1


def test_colbert_kd_scores_equal_pylate_with_skiplist_masks():
    g = torch.Generator().manual_seed(21)
    Q = lib.embeddings((4, 8, 16), g, side=+1)
    D = lib.embeddings((4, 5, 11, 16), g, side=-1)
    dmask = lib.skiplist_mask((4 * 5, 11), g).reshape(4, 5, 11)
    qmask = lib.skiplist_mask((4, 8), g, hole_rate=0.1)
    weights = torch.randn(4, 5, generator=g)

    qa, da = _leaf(Q), _leaf(D)
    expected = lib.pylate_colbert_kd_scores(qa, da, qmask, dmask)
    qb, db = _leaf(Q), _leaf(D)
    got = flash_pylate.colbert_kd_scores(qb, db, qmask, dmask)

    assert got.shape == (4, 5)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for g_got, g_expected in zip(_grads(got, (qb, db), weights), _grads(expected, (qa, da), weights)):
        torch.testing.assert_close(g_got, g_expected, atol=ATOL, rtol=0)
    assert (flash_pylate.colbert_kd_scores(Q, D, qmask, dmask, masked="exclude") - expected.detach()).abs().max() > 0.1


@pytest.mark.parametrize("with_query_mask", [False, True])
def test_flash_colbert_scores_equal_pylate_colbert_scores(with_query_mask):
    g = torch.Generator().manual_seed(31)
    Q = lib.embeddings((6, 8, 16), g, side=+1)
    D = lib.embeddings((6, 3, 12, 16), g, side=-1)           # 6 groups (1 positive + 2 negatives each)
    dmask = lib.skiplist_mask((18, 12), g).reshape(6, 3, 12)
    qmask = lib.skiplist_mask((6, 8), g, hole_rate=0.1) if with_query_mask else None
    weights = torch.randn(6, 18, generator=g)

    qa, da = _leaf(Q), _leaf(D)
    expected = lib.pylate_grouped_scores(qa, da, qmask, dmask)
    qb, db = _leaf(Q), _leaf(D)
    scorer = flash_pylate.FlashColBERTScores()
    got = scorer(qb, db, queries_mask=qmask, documents_mask=dmask)

    assert got.shape == (6, 18)                                # query-major: column j*N + k
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for g_got, g_expected in zip(_grads(got, (qb, db), weights), _grads(expected, (qa, da), weights)):
        torch.testing.assert_close(g_got, g_expected, atol=ATOL, rtol=0)
    # a query chunk (Contrastive's score_mini_batch_size) against every group
    torch.testing.assert_close(scorer(Q[2:4], D, None if qmask is None else qmask[2:4], dmask),
                               expected.detach()[2:4], atol=ATOL, rtol=0)
    # [D, Ld, H] documents, as PyLate 1.3/1.4 losses pass them group by group: colbert_scores
    torch.testing.assert_close(scorer(Q, D[:, 1], qmask, dmask[:, 1]),
                               lib.pylate_colbert_scores(Q, D[:, 1], qmask, dmask[:, 1]), atol=ATOL, rtol=0)


def test_pairwise_equals_pylate_for_padded_tensors_and_ragged_lists():
    g = torch.Generator().manual_seed(41)
    Q = lib.embeddings((5, 7, 16), g, side=+1)
    D = lib.embeddings((5, 10, 16), g, side=-1)
    torch.testing.assert_close(flash_pylate.colbert_scores_pairwise(Q, D), lib.pylate_colbert_scores_pairwise(Q, D),
                               atol=ATOL, rtol=0)

    q_lengths, d_lengths = [3, 7, 1, 5, 6], [10, 2, 7, 1, 9]
    queries = [Q[i, :n] for i, n in enumerate(q_lengths)]
    documents = [D[i, :n] for i, n in enumerate(d_lengths)]
    expected = lib.pylate_colbert_scores_pairwise(queries, documents)
    got = flash_pylate.colbert_scores_pairwise(queries, documents)
    assert got.shape == (5,)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # numpy items, as ColBERTTripletEvaluator's encode can hand them over
    got_np = flash_pylate.colbert_scores_pairwise([q.numpy() for q in queries], [d.numpy() for d in documents])
    torch.testing.assert_close(got_np, expected, atol=ATOL, rtol=0)


def test_numpy_and_list_inputs_as_pylate_accepts_them():
    g = torch.Generator().manual_seed(51)
    Q = lib.embeddings((3, 6, 8), g, side=+1)
    D = lib.embeddings((4, 9, 8), g, side=-1)
    dmask = lib.skiplist_mask((4, 9), g).float()
    expected = lib.pylate_colbert_scores(Q, D, None, dmask)
    cases = [
        (Q.numpy(), D.numpy(), dmask.numpy()),                                 # numpy arrays
        (Q.tolist(), D.tolist(), dmask.tolist()),                              # nested lists
        (list(Q), list(D), list(dmask)),                                       # lists of tensors
        ([q.numpy() for q in Q], [d.numpy() for d in D], dmask.numpy()),       # lists of arrays
    ]
    for queries, documents, mask in cases:
        torch.testing.assert_close(flash_pylate.colbert_scores(queries, documents, documents_mask=mask), expected,
                                   atol=ATOL, rtol=0)


def test_float64_inputs_stay_float64_and_equal_pylate():
    g = torch.Generator().manual_seed(61)
    Q = lib.embeddings((3, 5, 8), g, side=+1).double()
    D = lib.embeddings((3, 4, 7, 8), g, side=-1).double()
    dmask = lib.skiplist_mask((12, 7), g).reshape(3, 4, 7)
    got = flash_pylate.colbert_kd_scores(Q, D, None, dmask)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, lib.pylate_colbert_kd_scores(Q, D, None, dmask), atol=1e-12, rtol=0)


def test_half_precision_and_autocast():
    g = torch.Generator().manual_seed(71)
    Q = lib.embeddings((4, 8, 32), g, side=+1)
    D = lib.embeddings((6, 12, 32), g, side=-1)
    dmask = lib.skiplist_mask((6, 12), g)
    exact_bf16 = reference.maxsim(Q.bfloat16(), D.bfloat16(), None, dmask, masked="zero")
    got = flash_pylate.colbert_scores(Q.bfloat16(), D.bfloat16(), None, dmask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact_bf16, atol=1e-5, rtol=0)
    # under autocast PyLate's einsum runs in bf16: so does flash_maxsim (with fp32 accumulation)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_autocast = flash_pylate.colbert_scores(Q, D, None, dmask)
        pylate_autocast = lib.pylate_colbert_scores(Q, D, None, dmask)
    torch.testing.assert_close(got_autocast.double(), exact_bf16, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_autocast, pylate_autocast.float(), atol=0.1, rtol=0)   # PyLate sums in bf16
    # mixed dtypes are scored in the wider one
    torch.testing.assert_close(flash_pylate.colbert_scores(Q, D.bfloat16(), None, dmask),
                               lib.pylate_colbert_scores(Q, D.bfloat16().float(), None, dmask), atol=ATOL, rtol=0)


def test_pylate_documented_examples():
    """The examples in PyLate's docstrings, with their documented outputs."""
    queries = torch.tensor([[[1.], [0.], [0.], [0.]], [[0.], [2.], [0.], [0.]], [[0.], [0.], [3.], [0.]]])
    documents = torch.tensor([[[10.], [0.], [1.]], [[0.], [100.], [10.]], [[1.], [0.], [1000.]]])
    documents_mask = torch.tensor([[1., 1., 1.], [1., 0., 1.], [1., 1., 1.]])
    query_mask = torch.tensor([[1., 1., 1., 1.], [1., 1., 1., 1.], [1., 1., 0., 1.]])
    torch.testing.assert_close(
        flash_pylate.colbert_scores(queries, documents, query_mask, documents_mask),
        torch.tensor([[10., 10., 1000.], [20., 20., 2000.], [0., 0., 0.]]))

    pair_documents = torch.tensor([[[10.], [0.], [1.]], [[0.], [100.], [1.]], [[1.], [0.], [1000.]]])
    torch.testing.assert_close(flash_pylate.colbert_scores_pairwise(queries, pair_documents),
                               torch.tensor([10., 200., 3000.]))

    kd_documents = torch.tensor([
        [[[10.], [0.], [1.]], [[20.], [0.], [1.]], [[30.], [0.], [1.]]],
        [[[0.], [100.], [1.]], [[0.], [200.], [1.]], [[0.], [300.], [1.]]],
        [[[1.], [0.], [1000.]], [[1.], [0.], [2000.]], [[10.], [0.], [3000.]]]])
    kd_mask = torch.tensor([[[0., 1., 1.], [1., 1., 1.], [1., 1., 1.]],
                            [[1., 1., 1.], [1., 1., 1.], [1., 1., 1.]],
                            [[1., 1., 1.], [1., 1., 1.], [1., 1., 1.]]])
    torch.testing.assert_close(flash_pylate.colbert_kd_scores(queries, kd_documents, query_mask, kd_mask),
                               torch.tensor([[1., 20., 30.], [200., 400., 600.], [0., 0., 0.]]))


def test_bad_inputs_name_the_argument():
    g = torch.Generator().manual_seed(81)
    Q = lib.embeddings((2, 4, 8), g, side=+1)
    D = lib.embeddings((3, 5, 8), g, side=-1)
    with pytest.raises(ValueError, match="`queries_embeddings`"):
        flash_pylate.colbert_scores(Q[0], D)
    with pytest.raises(ValueError, match="`documents_embeddings`"):
        flash_pylate.colbert_kd_scores(Q, D)
    with pytest.raises(ValueError, match="`documents_embeddings`"):
        flash_pylate.colbert_kd_scores(Q, D.unsqueeze(0).expand(3, 3, 5, 8))
    with pytest.raises(ValueError, match="`documents_mask`"):
        flash_pylate.colbert_scores(Q, D, documents_mask=torch.full((3, 5), 0.5))
    with pytest.raises(ValueError, match="`documents_mask`"):
        flash_pylate.FlashColBERTScores()(Q, D.reshape(3, 1, 5, 8), documents_mask=torch.ones(3, 5))
    with pytest.raises(ValueError, match="`backend`"):
        flash_pylate.colbert_scores(Q, D, backend="cuda-magic")
    with pytest.raises(ValueError, match="`masked`"):
        flash_pylate.FlashColBERTScores(masked="skip")
    with pytest.raises(ValueError, match="`queries_embeddings`"):
        flash_pylate.colbert_scores_pairwise([Q[0], Q[1]], [D[0]])
    with pytest.raises(TypeError, match="`documents_embeddings`"):
        flash_pylate.colbert_scores(Q, "not embeddings")
    # PyLate's backend names are accepted (they choose nothing here)
    for name in ("auto", "torch", "flash", "lik", "TORCH"):
        torch.testing.assert_close(flash_pylate.colbert_scores(Q, D, backend=name), flash_pylate.colbert_scores(Q, D))


@pytest.mark.skipif(not (launch.interpreting() or torch.cuda.is_available()),
                    reason="needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py without CUDA)")
def test_triton_kernels_give_pylate_numbers():
    """The same parity through the real Triton kernels (interpreted on the CPU: tiny shapes)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(91)
    Q = lib.embeddings((2, 5, 16), g, side=+1, device=device)
    D = lib.embeddings((2, 2, 9, 16), g, side=-1, device=device)
    dmask = lib.skiplist_mask((4, 9), g, device=device).reshape(2, 2, 9)
    expected = lib.pylate_grouped_scores(Q, D, None, dmask)
    with ops.force_backend("triton"):
        qb = _leaf(Q)
        got = flash_pylate.FlashColBERTScores()(qb, D, None, dmask)
        (grad,) = torch.autograd.grad(got.sum(), qb)
    qa = _leaf(Q)
    (expected_grad,) = torch.autograd.grad(lib.pylate_grouped_scores(qa, D, None, dmask).sum(), qa)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, expected_grad, atol=ATOL, rtol=0)

