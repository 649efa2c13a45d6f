"""Kernel variants chosen by tuning overrides (tuning.FORWARD_OVERRIDES / BACKWARD_OVERRIDES) compute the same
function: the hard-max dD methods (dense one-hot, with and without the gradient's 16-bit split; each block of a
document's tokens multiplied by its own entries, binned in its program; entries sorted by torch.sort), the hard-max
dQ methods (a row at a time; a gather of several columns per step), the document-token split of the forward, the
dQ column split."""

import pytest
import torch

import flash_maxsim as fm
from flash_maxsim import reference
from flash_maxsim.kernels import launch, tuning
from flash_maxsim.ops import force_backend

from .helpers import make_case

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or launch.interpreting()),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def overrides(monkeypatch):
    """``tuning``, with empty forward and backward overrides of this test's own."""
    monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward())
    monkeypatch.setattr(tuning, "BACKWARD_OVERRIDES", tuning.Overrides.backward())
    return tuning


def _assert_forward_matches_reference(q, docs, qmask, dmask, smooth_tau):
    """Triton scores, in both masked modes, against the float64 reference."""
    with force_backend("triton"), torch.no_grad():
        for masked in ("exclude", "zero"):
            got = fm.maxsim(q, docs, qmask, dmask, masked=masked, smooth_tau=smooth_tau)
            want = reference.maxsim(q.double(), docs.double(), qmask, dmask, masked=masked, smooth_tau=smooth_tau)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _masked_padded_problem(Nq, Lq, B, Ld, d, query_keep, doc_keep, seed):
    """(queries, documents, queries_mask, documents_mask), random, with one fully masked document."""
    case = make_case(layout="padded", Nq=Nq, C=B, Lq=Lq, Ld=Ld, d=d, query_mask_keep=query_keep,
                     doc_mask_keep=doc_keep, fully_masked_doc=True, seed=seed, requires_grad=False,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    return case.queries, case.documents[0], case.queries_mask, case.documents_mask


def _grads(q, docs, **kw):
    """Scores and both gradients, ours and the float64 reference's; ``docs`` a tensor or a list of documents
    (their gradients concatenated)."""
    listed = isinstance(docs, list)

    def leaf(x, dtype=None):
        return x.detach().to(dtype).requires_grad_()

    def leaves(x, dtype=None):
        return [leaf(t, dtype) for t in x] if listed else leaf(x, dtype)

    def grad_of(x):
        return torch.cat([t.grad for t in x]) if listed else x.grad
    q, d = leaf(q), leaves(docs)
    out = fm.maxsim(q, d, **kw)
    g = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    (out * g).sum().backward()
    q64, d64 = leaf(q, torch.float64), leaves(d, torch.float64)
    ref = reference.maxsim(q64, d64, **kw)
    (ref * g.double()).sum().backward()
    return out, ref, q.grad, q64.grad, grad_of(d), grad_of(d64)


@pytest.mark.parametrize("method", [{"DD_METHOD": "sparse"}, {"DD_METHOD": "dense", "G_SPLIT": False, "FUSED": False},
                                    {"DD_METHOD": "dense", "G_SPLIT": False, "FUSED": True},
                                    {"DD_METHOD": "dense", "FUSED": False, "DQ_METHOD": "rows"},
                                    {"DD_METHOD": "binned", "DQ_METHOD": "gather"},
                                    {"DD_METHOD": "binned", "DQ_METHOD": "gather", "DQ_ROWS": 2, "DQ_COLS": 4}],
                         ids=["sparse", "dense", "dense-fused-with-dq", "dense-dq-rows", "binned-dq-gather",
                              "binned-dq-gather-2x4"])
@pytest.mark.parametrize("layout", ["in-batch", "candidates", "packed"])
def test_hard_max_document_gradient_methods(overrides, layout, method):
    overrides.BACKWARD_OVERRIDES.update(method)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 6, 16, generator=g).to(dev)
    docs = torch.randn(*((3, 2, 9, 16) if layout == "candidates" else (4, 9, 16)), generator=g).to(dev)
    mask = (torch.rand(docs.shape[:-1], generator=g) > 0.3).to(dev)
    if layout == "packed":
        docs, mask = [docs[0], docs[1, :4], docs[2, :1], docs[3]], [mask[0], mask[1, :4], mask[2, :1], mask[3]]
    with force_backend("triton"):
        out, ref, gq, gq64, gd, gd64 = _grads(q, docs, documents_mask=mask, masked="zero")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gq.double(), gq64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gd.double(), gd64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("smooth_tau", [None, 0.3])
def test_document_token_split_forward(overrides, smooth_tau):
    overrides.FORWARD_OVERRIDES["DSPLIT"] = 3
    _assert_forward_matches_reference(*_masked_padded_problem(2, 5, 3, 200, 16, 0.7, 0.5, seed=12), smooth_tau)


@pytest.mark.parametrize("smooth_tau", [None, 0.3])
def test_document_token_split_propagates_nan(overrides, smooth_tau):
    """A NaN document token in one of three token slices: the combined score of its document is NaN, as the
    reference's is, and the other documents' scores are untouched."""
    overrides.FORWARD_OVERRIDES["DSPLIT"] = 3
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(18)
    q, docs = torch.randn(2, 5, 16, generator=g).to(dev), torch.randn(3, 200, 16, generator=g).to(dev)
    docs[1, 150, 3] = float("nan")
    with force_backend("triton"), torch.no_grad():
        got = fm.maxsim(q, docs, smooth_tau=smooth_tau)
    want = reference.maxsim(q.double(), docs.double(), smooth_tau=smooth_tau)
    assert got[:, 1].isnan().all() and not got[:, [0, 2]].isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("fused, dq_method", [(False, "rows"), (True, "rows"), (False, "gather")],
                         ids=["separate", "fused-with-dd", "separate-gather"])
def test_query_gradient_column_split(overrides, fused, dq_method):
    # 300 columns against a single query block: the dQ grid is split over columns (partial sums; not at <= 64
    # columns, nor at <= 256 in the launch of the dD programs), in its own launch or in the dD's (hard max); the
    # hard max's gather as well
    overrides.BACKWARD_OVERRIDES.update(FUSED=fused, DQ_METHOD=dq_method)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 5, 16, generator=g).to(dev)
    docs = torch.randn(300, 6, 16, generator=g).to(dev)
    plan = launch._backward_plan(torch.zeros(1, 300), q, docs, None, None, None, 6,
                                 torch.zeros(1, 300, 5, dtype=torch.int16), 0, None, True, True, None)
    assert plan.n_cs > 1 and plan.fused == fused and plan.dq_method == dq_method
    with force_backend("triton"):
        for tau in (None, 0.3):
            out, ref, gq, gq64, gd, gd64 = _grads(q, docs, smooth_tau=tau)
            torch.testing.assert_close(gq.double(), gq64, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gd.double(), gd64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("peel", [True, False], ids=["peeled", "one-loop"])
@pytest.mark.parametrize("smooth_tau", [None, 0.3])
def test_whole_document_tiles_and_the_partial_last_one(overrides, peel, smooth_tau):
    """16-token document tiles on documents of 48 (three whole tiles), 50 (whole tiles and a partial one), 16,
    7 (one partial tile) and 0 tokens: whole tiles skip the per-element range test (PEEL_TAIL), and scores,
    gradients and the first-arg-max rule across tiles must not depend on where the tiles end."""
    overrides.FORWARD_OVERRIDES.update(BLOCK_N=16, PEEL_TAIL=peel)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(14)
    q = torch.randn(2, 5, 16, generator=g).to(dev)
    lengths = [48, 50, 16, 7, 0]
    docs = [torch.randn(n, 16, generator=g).to(dev) for n in lengths]
    # an exact tie across whole tiles, at the max of query 0's first token: its gradient goes to token 3 alone
    docs[0][3] = q[0, 0]
    docs[0][40] = docs[0][3]
    qmask = (torch.rand(2, 5, generator=g) > 0.2).to(dev)
    qmask[0, 0] = True
    padded = torch.nn.utils.rnn.pad_sequence(docs, batch_first=True)
    dmask = torch.zeros(padded.shape[:2], dtype=torch.bool, device=dev)
    for i, n in enumerate(lengths):
        dmask[i, :n] = torch.rand(n, generator=g).to(dev) > 0.1
    dmask[0, [3, 40]] = True
    with force_backend("triton"):
        for masked in ("exclude", "zero"):
            out, ref, gq, gq64, gd, gd64 = _grads(q, padded, queries_mask=qmask, documents_mask=dmask,
                                                   masked=masked, smooth_tau=smooth_tau)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gq.double(), gq64, rtol=1e-5, atol=1e-5)
            if smooth_tau is None:
                # autograd of the reference's amax splits a tie evenly; the kernels give it to the first token
                assert gd[0, 40].abs().sum() == 0 and gd64[0, 40].abs().sum() > 0
                gd64[0, 3] += gd64[0, 40]
                gd64[0, 40] = 0
            torch.testing.assert_close(gd.double(), gd64, rtol=1e-5, atol=1e-5)
        with torch.no_grad():           # ragged, no masks: the range test is the only one left
            got = fm.maxsim(q, docs, smooth_tau=smooth_tau)
            want = reference.maxsim(q.double(), [x.double() for x in docs], smooth_tau=smooth_tau)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knobs", [dict(DD_BLOCK_N=16), dict(DD_BLOCK_N=128), dict(DQ_PARTIAL_BYTES=0)],
                         ids=["dd-16-token-blocks", "dd-128-token-blocks", "dq-no-column-split"])
@pytest.mark.parametrize("smooth_tau", [None, 0.3])
def test_backward_tuning_knobs_compute_the_same_gradients(overrides, knobs, smooth_tau):
    """The backward's tuning hooks (swept on the device by benchmarks/kernel_check.py --sweep) change tiles and
    splits, not the function."""
    overrides.BACKWARD_OVERRIDES.update(knobs)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(15)
    q = torch.randn(2, 5, 8, generator=g).to(dev)
    docs = torch.randn(20, 21, 8, generator=g).to(dev)
    mask = (torch.rand(20, 21, generator=g) > 0.2).to(dev)
    with force_backend("triton"):
        out, ref, gq, gq64, gd, gd64 = _grads(q, docs, documents_mask=mask, smooth_tau=smooth_tau)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gq.double(), gq64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gd.double(), gd64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 64), (torch.bfloat16, 40), (torch.float32, 24),
                                      (torch.bfloat16, 300)], ids=["bf16", "bf16-padded-features", "fp32",
                                                                   "bf16-chunked-features"])
@pytest.mark.parametrize("layout", ["masked", "packed", "candidates"])
def test_smooth_gradients_load_each_streamed_tile_once(overrides, layout, dtype, d):
    """The smooth max's dQ and dD multiply each streamed tile (dQ: a document tile, dD: a block of query rows) twice,
    once for the similarities and once for the gradient, from one load (chunked features keep two:
    the similarities need every feature, the gradient its program's slice). Gradients and scores equal bit for bit
    those of the two loads before (``RELOAD_TILE``), masked document tokens holding NaN included (they load as 0
    and take no part), and match the float64 reference."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(19)
    q = torch.randn(3, 6, d, generator=g).to(dev, dtype)
    qm = (torch.rand(3, 6, generator=g) > 0.2).to(dev)
    kw = dict(smooth_tau=0.2)
    if layout == "masked":
        docs = torch.randn(5, 70, d, generator=g)
        dm = torch.rand(5, 70, generator=g) > 0.3
        dm[2] = False                                       # a document with no valid token
        docs[1, 7] = float("nan")                           # a masked token holding NaN
        dm[1, 7] = False
        docs, kw["documents_mask"] = docs.to(dev, dtype), dm.to(dev)
        kw["queries_mask"] = qm
    elif layout == "packed":
        docs = [torch.randn(n, d, generator=g).to(dev, dtype) for n in (5, 70, 0, 64)]
    else:
        docs = torch.randn(3, 2, 33, d, generator=g).to(dev, dtype)
    results = []
    for reload in (True, False):
        overrides.BACKWARD_OVERRIDES.clear()
        overrides.BACKWARD_OVERRIDES.update(RELOAD_TILE=reload)
        launch._BACKWARD_PLANS.clear()
        with force_backend("triton"):
            results.append(_grads(q, docs, **kw))
        metas = [m for p in launch._BACKWARD_PLANS.values() for m in (p.dq_meta, p.dd_meta)]
        assert [m.get("RELOAD_TILE", False) for m in metas] == [reload, reload]
    (out0, _, gq0, _, gd0, _), (out, ref, gq, gq64, gd, gd64) = results
    assert torch.equal(out, out0) and torch.equal(gq, gq0) and torch.equal(gd, gd0)
    assert not gd.isnan().any() and not gq.isnan().any()
    if layout == "masked":
        # the float64 reference multiplies the masked NaN by 0 (NaN): its gradients from the token set to 0, which
        # takes no part either
        with force_backend("triton"):
            _, ref, _, gq64, _, gd64 = _grads(q, docs.nan_to_num(), **kw)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gq.double(), gq64, **tol)
    torch.testing.assert_close(gd.double(), gd64, **tol)


@pytest.mark.parametrize("smooth_tau", [None, 0.3])
@pytest.mark.parametrize("grouping, docs, groups", [({"DOCS": 3, "TMA_DOCS": True}, 3, 3),
                                                     ({"PROGRAMS_PER_SM": 2}, 6, 2)])
@pytest.mark.parametrize("Ld", [50, 48, 9])
def test_several_documents_per_program(overrides, smooth_tau, grouping, docs, groups, Ld, monkeypatch):
    """Several documents per program stream all their tiles in one loop and write each score at its document's
    last tile: 7 documents over programs of 3 (the last program has one), or sized by PROGRAMS_PER_SM (2 per SM
    of 4 SMs: 8 program slots for 7 documents x 3 queries x 2 row tiles, so 6 documents per program, the last
    has one); in 16-token tiles, 50 tokens (tiles that straddle two documents) or 48 (whole tiles), streamed as
    one run of tokens (FLAT_RUN; the programs of 3 copy the run's whole tiles by TMA, where there is TMA), or 9
    tokens (shorter than a tile: a loop that finds each tile's document), an all-masked document, a second query
    block and a query longer than one row tile."""
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    monkeypatch.setattr(tuning, "sm_count", lambda: 4)
    # the run's mask values loaded a tile ahead (the compute-bound int8 grid's choice) on 50-token documents
    overrides.FORWARD_OVERRIDES.update(BLOCK_N=16, ROWS=16, PREFETCH_TOKENS=Ld == 50, **grouping)
    _assert_forward_matches_reference(*_masked_padded_problem(3, 20, 7, Ld, 16, 0.8, 0.6, seed=16), smooth_tau)
    plans = list(launch._FORWARD_PLANS.values())
    # groups of documents x 3 queries x 2 row tiles
    assert plans and all(p.docs == docs and p.grid == (groups * 3 * 2,) for p in plans)
    assert all(p.meta["FLAT_RUN"] == (Ld >= 16) for p in plans)
    assert all(p.meta["PREFETCH_TOKENS"] == (Ld == 50) for p in plans)
    tma = grouping.get("TMA_DOCS", False) and (launch.interpreting() or torch.cuda.get_device_capability() >= (9, 0))
    assert all(p.meta["TMA_DOCS"] == (tma and Ld >= 16) for p in plans)


@pytest.mark.parametrize("Ld, d", [(50, 32), (48, 32), (50, 24)])
def test_runs_of_16_bit_documents_copied_by_tma(overrides, Ld, d, monkeypatch):
    """bf16 documents in runs of 3 per program, the run's whole tiles copied through a tensor descriptor (TMA on
    Hopper, emulated by the interpreter): tiles that straddle two documents (50 tokens) or not (48), features
    padded to the tile (d = 24 in 32: the copy fills them with zeros), the run's partial last tile by the threads,
    masks and an all-masked document; the same scores as the float64 reference."""
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    overrides.FORWARD_OVERRIDES.update(BLOCK_N=16, ROWS=32, DOCS=3, PROGRAMS_PER_SM=0, TMA_DOCS=True)
    q, docs, qmask, dmask = _masked_padded_problem(2, 13, 7, Ld, d, 0.8, 0.6, seed=19)
    _assert_forward_matches_reference(q.bfloat16(), docs.bfloat16(), qmask, dmask, None)
    plans = list(launch._FORWARD_PLANS.values())
    tma = launch.interpreting() or torch.cuda.get_device_capability() >= (9, 0)
    assert plans and all(p.meta["FLAT_RUN"] and p.meta["TMA_DOCS"] == tma and p.meta["STRADDLE"] == (Ld == 50)
                         and p.meta["BLOCK_D"] == 32 and p.meta["EVEN_D"] == (d == 32) for p in plans)


@pytest.mark.parametrize("tma", [True, False], ids=["default-tma", "threads-copies"])
def test_default_runs_of_128_rows_on_8_warps(overrides, tma, monkeypatch):
    """One query of 128 tokens against documents of whole tiles, with the default plan (grid sized as on 4 SMs):
    runs of several documents per program on 8 warps, copied by TMA (Hopper; the interpreter emulates it) or, with
    TMA turned off, by the threads, masks and an all-masked document; the same scores as the float64 reference."""
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    monkeypatch.setattr(tuning, "sm_count", lambda: 4)
    if not tma:
        overrides.FORWARD_OVERRIDES.update(TMA_DOCS=False)
    q, docs, qmask, dmask = _masked_padded_problem(1, 128, 24, 64, 32, 0.8, 0.6, seed=23)
    _assert_forward_matches_reference(q.bfloat16(), docs.bfloat16(), qmask, dmask, None)
    plans = list(launch._FORWARD_PLANS.values())
    tma = tma and (launch.interpreting() or torch.cuda.get_device_capability() >= (9, 0))
    assert plans and all(p.docs == 3 and p.meta["FLAT_RUN"] and p.meta["num_warps"] == 8
                         and p.meta["TMA_DOCS"] == tma for p in plans)


def test_flat_run_only_for_contiguous_documents(overrides, monkeypatch):
    """Documents that do not lie end to end (a transposed [Ld, B, d] tensor, a mask with a gap between
    documents): the loop that finds each tile's document, with the same scores."""
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    overrides.FORWARD_OVERRIDES.update(BLOCK_N=16, ROWS=16, DOCS=3, PROGRAMS_PER_SM=0)
    q, docs, qmask, dmask = _masked_padded_problem(3, 20, 7, 48, 16, 0.8, 0.6, seed=18)
    transposed = docs.transpose(0, 1).contiguous().transpose(0, 1)
    gapped = torch.zeros(7, 64, dtype=dmask.dtype, device=dmask.device)[:, :48]
    gapped.copy_(dmask)
    for d_, m_ in ((transposed, dmask), (docs, gapped)):
        launch._FORWARD_PLANS.clear()
        _assert_forward_matches_reference(q, d_, qmask, m_, None)
        plans = list(launch._FORWARD_PLANS.values())
        assert plans and all(p.docs == 3 and not p.meta["FLAT_RUN"] for p in plans)


def test_several_documents_per_program_only_for_padded_scoring(overrides, monkeypatch):
    """Per-query candidates, ragged documents and a forward that saves the backward's state keep one document
    per program (their per-document state is not the flattened loop's)."""
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    overrides.FORWARD_OVERRIDES.update(DOCS=4)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(17)
    q = torch.randn(2, 5, 16, generator=g).to(dev)
    with force_backend("triton"):
        with torch.no_grad():
            fm.maxsim(q, torch.randn(2, 3, 9, 16, generator=g).to(dev))
            fm.maxsim(q, [torch.randn(n, 16, generator=g).to(dev) for n in (3, 9)])
        fm.maxsim(q, torch.randn(3, 9, 16, generator=g).to(dev).requires_grad_()).sum().backward()
    plans = list(launch._FORWARD_PLANS.values())
    assert len(plans) == 3 and all(p.docs == 1 for p in plans)


@pytest.mark.parametrize("method", [{}, {"DD_METHOD": "sparse"}, {"DD_METHOD": "binned"}])
def test_document_gradient_goes_to_the_first_of_tied_tokens(overrides, method):
    """Documents whose tokens are all equal: every query token's first arg-max is token 0 (the tie rule), so
    dD[t, 0] = sum_q G[q, t] * sum_i Q[q, i] and every other row is 0 (autograd of amax would split it)."""
    overrides.BACKWARD_OVERRIDES.update(method)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    # small integers: every product and sum is exact in fp32, so the equal tokens tie exactly in any summation order
    q = torch.randint(-3, 4, (5, 9, 32), generator=gen).float().to(dev)
    docs = torch.randint(-3, 4, (3, 1, 32), generator=gen).float().expand(3, 70, 32).contiguous().to(dev)
    docs.requires_grad_()
    with force_backend("triton"):
        out = fm.maxsim(q, docs)
    g = torch.linspace(-1, 1, out.numel(), device=dev).reshape(out.shape)
    (out * g).sum().backward()
    want = torch.zeros(docs.shape, dtype=torch.float64, device=dev)
    want[:, 0] = g.double().t() @ q.double().sum(1)
    torch.testing.assert_close(docs.grad.double(), want, rtol=1e-5, atol=1e-5)


def _half_way_problem(dtype, dev):
    """Queries, documents, and an upstream gradient G in [1, 2) exactly half-way between two neighbours of the
    16-bit dtype (rounding G to it is off by half a unit), with the float64 arg-max [Nq, T, Lq], the hard-max dD
    they give and the sum of the magnitudes of its terms (what a rounding of G scales with)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 8, 32, generator=gen).to(dtype).to(dev)
    docs = torch.randn(4, 5, 32, generator=gen).to(dtype).to(dev)
    mantissa_bits = 7 if dtype == torch.bfloat16 else 10
    g = (1 + (torch.randint(0, 2 ** mantissa_bits - 1, (6, 4), generator=gen) + 0.5) * 2.0 ** -mantissa_bits).to(dev)
    chosen = torch.einsum("qid,tjd->qtij", q.double(), docs.double()).argmax(-1)       # [Nq, T, Lq]
    want = torch.zeros(docs.shape, dtype=torch.float64, device=dev)
    magnitude = torch.zeros_like(want)
    for qi in range(6):
        for t in range(4):
            term = q[qi].double() * g[qi, t].double()
            want[t].index_add_(0, chosen[qi, t], term)
            magnitude[t].index_add_(0, chosen[qi, t], term.abs())
    return q, docs, g, chosen, want, magnitude


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hard_max_document_gradient_rounding(overrides, dtype):
    """Autograd's dD in the inputs' 16-bit dtype: G goes to the tensor cores rounded to that dtype (as PyTorch's
    own 16-bit autograd rounds it), then dD itself is rounded: |error| <= u (|dD| + sum of |terms|), u the unit
    roundoff."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, docs, g, _, want, magnitude = _half_way_problem(dtype, dev)
    docs.requires_grad_()
    with force_backend("triton"):
        (fm.maxsim(q, docs) * g).sum().backward()
    unit_roundoff = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    # the interpreter truncates fp32 -> bf16: up to 2u of |dD| there
    output_units = 2 if dtype == torch.bfloat16 and launch.interpreting() else 1
    bound = unit_roundoff * (output_units * want.abs() + magnitude) * 1.01 + 1e-6
    assert ((docs.grad.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("method", [{"DD_METHOD": "dense"}, {"DD_METHOD": "binned", "DQ_METHOD": "gather"}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_gradients_keep_the_upstream_gradient_whole(overrides, dtype, method):
    """``maxsim_backward(..., fp32_grads=True)`` on 16-bit inputs: fp32 dQ and dD, and the dD kernel multiplies
    G as two 16-bit parts (hi + lo), so dD matches float64 to fp32 summation error, where G rounded to the dtype
    would be off by up to half a unit of the dtype."""
    from flash_maxsim import _layout, ops
    overrides.BACKWARD_OVERRIDES.update(method)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, docs, g, chosen, want, _ = _half_way_problem(dtype, dev)
    p = _layout.canonicalize(q, docs)
    with force_backend("triton"):
        _, aux = ops.forward_impl(p.queries, p.documents, None, None, None, p.max_length, 0, False, None, True)
        dq, dd = ops.maxsim_backward(g, p, aux, fp32_grads=True)
    assert dq.dtype == dd.dtype == torch.float32
    torch.testing.assert_close(dd.double(), want, rtol=1e-6, atol=1e-6)
    want_dq = torch.einsum("qt,qtid->qid", g.double(),
                           docs.double()[torch.arange(4, device=dev)[None, :, None], chosen])
    torch.testing.assert_close(dq.double(), want_dq, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["in-batch", "in-batch-128-token-blocks", "candidates", "ragged"])
def test_binned_document_gradient_blocks_and_chunks(overrides, layout, monkeypatch):
    """The binned dD (each block of a document's tokens multiplied by its own entries, which its program picks out
    of the document's): documents of several blocks, a block receiving more entries than one 64-entry chunk (copies
    of query tokens that two query tokens each pick), a token every query's tokens pick (candidates), masked query
    tokens (no entry), an empty document; against the float64 reference, bitwise the same when run again (dQ's
    gather too), and the dense kernel where a document has more entries than a program holds."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(17)
    q = torch.randn(5, 16, 16, generator=g)
    q[:, 8:] = q[:, :8]                                  # each query's tokens 8-15 repeat its tokens 0-7
    block_n = 128 if layout.endswith("128-token-blocks") else tuning.BINNED_DD_BLOCK_N
    if layout == "candidates":
        docs = torch.randn(5, 2, 200, 16, generator=g)
        docs[:, 0, 150] = q.sum(1) * 4                   # token 150 of each query's first candidate dominates
    else:
        docs = torch.randn(3, 200, 16, generator=g)
        docs[1, 128:168] = 3 * q[:, :8].reshape(40, 16)  # 40 copies, each two query tokens' arg-max: one block
    qmask = torch.rand(5, 16, generator=g) > 0.1
    if layout != "candidates":                           # the test covers a block of more than one chunk
        picks = torch.einsum("qid,jd->qij", q.double(), docs[1].double()).argmax(-1)[qmask]
        assert ((picks >= 128) & (picks < 128 + block_n)).sum() > 64
    q, docs, qmask = q.to(dev), docs.to(dev), qmask.to(dev)
    if layout == "ragged":
        docs = [docs[0], docs[1], docs[2, :0], docs[2, :129]]
    if block_n != tuning.BINNED_DD_BLOCK_N:
        overrides.BACKWARD_OVERRIDES["DD_BLOCK_N"] = block_n
    overrides.BACKWARD_OVERRIDES["DD_METHOD"] = "binned"
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
    with force_backend("triton"):
        out, ref, gq, gq64, gd, gd64 = _grads(q, docs, queries_mask=qmask)
        _, _, again_q, _, again, _ = _grads(q, docs, queries_mask=qmask)
    assert {(p.dd_method, p.dq_method) for p in launch._BACKWARD_PLANS.values()} == {("binned", "gather")}
    torch.testing.assert_close(gq.double(), gq64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gd.double(), gd64, rtol=1e-5, atol=1e-4)
    assert torch.equal(gd, again) and torch.equal(gq, again_q)
    monkeypatch.setattr(tuning, "BINNED_DD_MAX_ENTRIES", 8)
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
    with force_backend("triton"):
        _, _, _, _, dense, _ = _grads(q, docs, queries_mask=qmask)
    assert {p.dd_method for p in launch._BACKWARD_PLANS.values()} == {"dense"}
    torch.testing.assert_close(dense.double(), gd64, rtol=1e-5, atol=1e-4)
