"""The Triton kernels themselves, forward and backward, against the float64 reference: on CUDA when present,
otherwise on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py). Interpreted
calls cost ~1 s, so the shapes are tiny and the set is small, but every layout x mode x hard/smooth x
fp32/bf16 is here, plus the kernels' special paths (long queries, wide features, empty documents)."""

import pytest
import torch
import triton
import triton.language as tl

import flash_maxsim
from flash_maxsim import _layout, reference
from flash_maxsim.kernels import launch, tuning
from flash_maxsim.kernels.forward import _fold_row_partials, _tile_max_dropping_nan
from flash_maxsim.ops import force_backend

from .helpers import LAYOUTS, check_case, make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(DEVICE == "cpu" and not launch.interpreting(),
                       reason="needs CUDA, or TRITON_INTERPRET=1 set before flash_maxsim is imported"),
    pytest.mark.usefixtures("highest_fp32_precision"),
]


def check(case):
    return check_case(case, "triton")


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


def _row_partial_cases():
    """(name, builder of (scores function, float64 reference), tuning.FORWARD_OVERRIDES fields): every loop that can keep
    partial row maxima, at interpreter size."""
    def padded(masked):
        def build(g):
            q = torch.randn(3, 16, 64, generator=g)
            d = torch.randn(5, 128, 64, generator=g)
            d[3, 17, 5] = float("nan")                    # an unmasked NaN token: its document scores NaN
            qm = torch.rand(3, 16, generator=g) > 0.2
            dm = torch.rand(5, 128, generator=g) > 0.3
            dm[1] = False                                 # no valid token
            dm[3, 17] = True
            q, d, qm, dm = (t.to(DEVICE) for t in (q, d, qm, dm))
            return (lambda: flash_maxsim.maxsim(q.bfloat16(), d.bfloat16(), qm, dm, masked=masked),
                    reference.maxsim(q.bfloat16().double(), d.bfloat16().double(), qm, dm, masked=masked))
        return build

    def ragged(g):
        q = torch.randn(2, 16, 64, generator=g).to(DEVICE).bfloat16()
        docs = [torch.randn(n, 64, generator=g).to(DEVICE).bfloat16() for n in (5, 130, 64)]
        return (lambda: flash_maxsim.maxsim(q, docs), reference.maxsim(q.double(), [t.double() for t in docs]))

    def paired(g):
        q = torch.randn(2, 16, 64, generator=g).to(DEVICE).bfloat16()
        cands = torch.randn(2, 3, 150, 64, generator=g).to(DEVICE).bfloat16()
        return (lambda: flash_maxsim.maxsim(q, cands), reference.maxsim(q.double(), cands.double()))

    def quantized(kind, **extra):
        def build(g):
            from flash_maxsim.quantization import queries_as_scored
            q = torch.randn(3, 16, 64, generator=g)
            d = torch.randn(6, 128, 64, generator=g)
            d[2] = -d[2].abs()
            q[0, 3] = q[0, 3].abs()               # every sum of query 0's token 3 with document 2 < 0 (int8: redone)
            q = q.to(DEVICE).bfloat16()
            index = flash_maxsim.quantize(d.to(DEVICE), dtype=kind)
            return (lambda: flash_maxsim.maxsim(q, index),
                    reference.maxsim(queries_as_scored(q, index).double(), index.dequantize(torch.float64)))
        return build

    one_doc = dict(DOCS=1, PROGRAMS_PER_SM=0)
    return [
        ("one document per program", padded("exclude"), one_doc),
        ("one document per program, masked as zero", padded("zero"), one_doc),
        ("token split", padded("exclude"), dict(one_doc, DSPLIT=2)),
        ("several documents' tile loop", padded("zero"), dict(DOCS=2, PROGRAMS_PER_SM=0, FLAT_RUN=False)),
        ("run of whole tiles", padded("exclude"), dict(DOCS=2, PROGRAMS_PER_SM=0)),
        ("ragged", ragged, one_doc),
        ("per-query candidates", paired, one_doc),
        ("int8 bit-cast run of whole tiles", quantized("int8"),
         dict(DOCS=3, PROGRAMS_PER_SM=0, ROWS=32, BITCAST_SUMS=True)),
        ("fp8 run of whole tiles", quantized("fp8"), dict(DOCS=3, PROGRAMS_PER_SM=0, ROWS=32)),
    ]


@pytest.mark.filterwarnings("ignore:All-NaN slice")      # the interpreter's max over the NaN of negative sums
@pytest.mark.parametrize("name, build, overrides", _row_partial_cases(), ids=[c[0] for c in _row_partial_cases()])
def test_partial_row_maxima_score_bit_for_bit_like_one_max_per_row(name, build, overrides, monkeypatch, seed):
    """``ROW_PARTIALS`` (kernels/forward.py, ``_fold_row_partials``): 8 partial maxima per row across a document's
    tiles (or 4, over column pairs), the max across them once per document. Scores equal bit for bit those of one
    running max per row (the same maxima of the same similarities, only grouped otherwise), NaN where the NaN
    token's document is scored, in every loop that takes them: one document per program (token-split too),
    several documents' tile loop, runs of whole tiles (bf16; int8 with bit-cast sums and their exact second
    pass; fp8), ragged and paired documents; and close to the float64 reference."""
    if DEVICE == "cpu" and "fp8" in name and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8_e4m3fn in this torch")
    if DEVICE == "cuda" and "fp8" in name and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 documents need compute capability >= 8.9")
    scores, want_ref = build(torch.Generator().manual_seed(seed))
    results = []
    for partials in (1, 4, 8):
        monkeypatch.setattr(tuning, "FORWARD_OVERRIDES",
            tuning.Overrides.forward(dict(overrides, ROW_PARTIALS=partials)))
        monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
        with force_backend("triton"):
            got = scores()
        assert [p.meta["ROW_PARTIALS"] for p in launch._FORWARD_PLANS.values()] == [partials]
        results.append(got)
    one = results[0]
    for other in results[1:]:
        assert torch.equal(one.isnan(), other.isnan()) and torch.equal(one.nan_to_num(), other.nan_to_num())
    eight = results[-1]
    assert torch.equal(eight.isnan(), want_ref.isnan().to(eight.device))
    torch.testing.assert_close(eight.double(), want_ref.to(eight.device), rtol=1e-4 if "fp8" in name else 1e-5,
                               atol=1e-3, equal_nan=True)


def _narrow_tail_cases():
    """(name, builder of (scores function, float64 reference) with the reference's gradients, tuning.FORWARD_OVERRIDES fields):
    documents whose last tile is partial (100 tokens: 64 + 36), in the loop that peels it."""
    def padded(masked, smooth_tau=None, train=False):
        def build(g):
            q = torch.randn(3, 16, 64, generator=g)
            d = torch.randn(4, 100, 64, generator=g)
            d[1, 90:] += 3.0                          # the maxima of document 1 in its tail
            qm = torch.rand(3, 16, generator=g) > 0.2
            dm = torch.rand(4, 100, generator=g) > 0.3
            dm[2] = False                             # no valid token
            q, d, qm, dm = (t.to(DEVICE).bfloat16() if t.is_floating_point() else t.to(DEVICE)
                            for t in (q, d, qm, dm))
            return (lambda q_, d_: flash_maxsim.maxsim(q_, d_, qm, dm, masked=masked, smooth_tau=smooth_tau),
                    lambda q_, d_: reference.maxsim(q_, d_, qm, dm, masked=masked, smooth_tau=smooth_tau), q, d)
        return build

    def ragged(g):
        q = torch.randn(2, 16, 64, generator=g).to(DEVICE).bfloat16()
        docs = torch.randn(5 + 130 + 64 + 81, 64, generator=g).to(DEVICE).bfloat16()
        lengths = [5, 130, 0, 64, 81]

        def split(d_):
            return list(torch.split(d_, lengths))
        return (lambda q_, d_: flash_maxsim.maxsim(q_, split(d_)),
                lambda q_, d_: reference.maxsim(q_, split(d_)), q, docs)

    def paired(g):
        q = torch.randn(2, 16, 64, generator=g).to(DEVICE).bfloat16()
        cands = torch.randn(2, 3, 150, 64, generator=g).to(DEVICE).bfloat16()
        return (lambda q_, d_: flash_maxsim.maxsim(q_, d_), lambda q_, d_: reference.maxsim(q_, d_), q, cands)

    peeled = dict(DOCS=1, PROGRAMS_PER_SM=0, PEEL_TAIL=True)
    return [
        ("hard max", padded("exclude"), dict(peeled, TAIL_N=16)),
        ("hard max, 32-token tail", padded("exclude"), dict(peeled, TAIL_N=32)),
        ("partial row maxima, masked as zero", padded("zero"), dict(peeled, TAIL_N=16, ROW_PARTIALS=8)),
        ("token split", padded("exclude"), dict(peeled, TAIL_N=16, DSPLIT=2)),
        ("smooth max", padded("exclude", smooth_tau=0.1), dict(peeled, TAIL_N=16)),
        ("training (arg-max)", padded("zero", train=True), dict(peeled, TAIL_N=16)),
        ("ragged", ragged, dict(peeled, TAIL_N=16)),
        ("per-query candidates", paired, dict(peeled, TAIL_N=32)),
    ]


@pytest.mark.parametrize("name, build, overrides", _narrow_tail_cases(), ids=[c[0] for c in _narrow_tail_cases()])
def test_narrow_tail_tiles_score_like_whole_ones(name, build, overrides, monkeypatch, seed):
    """``TAIL_N`` (kernels/forward.py): the peeled last tile of each document in narrower tiles, in scoring and in
    the training forward (its first arg-max, or log-sum-exp, feeds the backward). The same scores as whole last
    tiles within rounding (a narrower tl.dot may round its sums otherwise), close to the float64 reference,
    gradients included."""
    scores, ref, q, d = build(torch.Generator().manual_seed(seed))
    train = "training" in name
    q64, d64 = q.double().requires_grad_(train), d.double().requires_grad_(train)
    want = ref(q64, d64)
    upstream = torch.linspace(-1, 1, want.numel(), dtype=torch.float64, device=DEVICE).view_as(want)
    if train:
        want.backward(upstream)
    results = []
    for tail in (0, overrides["TAIL_N"]):
        monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward(dict(overrides, TAIL_N=tail)))
        monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
        q_, d_ = q.clone().requires_grad_(train), d.clone().requires_grad_(train)
        with force_backend("triton"):
            got = scores(q_, d_)
            if train:
                got.backward(upstream.float())
        plans = list(launch._FORWARD_PLANS.values())
        assert [p.meta.get("TAIL_N", 0) for p in plans] == [tail]
        assert plans[0].meta["SAVE_AUX"] == train
        results.append(got.detach())
        torch.testing.assert_close(got.detach().double(), want.detach(), rtol=1e-5, atol=1e-3)
        if train:
            torch.testing.assert_close(q_.grad.double(), q64.grad, rtol=1e-2, atol=2e-2)
            torch.testing.assert_close(d_.grad.double(), d64.grad, rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("masked, smooth_tau", [("zero", None), ("exclude", 0.1)],
                         ids=["hard, masked as zero", "smooth"])
def test_training_forward_on_long_documents_matches_the_reference(masked, smooth_tau, monkeypatch, seed):
    """The training forward's default for long documents (256-row tiles, 3 stages, 16-token tail tiles; 8 queries
    x 32 tokens, 530-token documents ending 18 tokens into a tile), scores and both gradients against the float64
    reference, masks included (one SM assumed, so that two documents make enough programs)."""
    monkeypatch.setattr(tuning, "sm_count", lambda: 1)
    monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward({}))
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(8, 32, 32, generator=g)
    d = torch.randn(3, 530, 32, generator=g)
    d[1, 515:] += 3.0                                 # document 1's maxima in its tail tiles
    qm = torch.rand(8, 32, generator=g) > 0.2
    dm = torch.rand(3, 530, generator=g) > 0.3
    dm[2] = False                                     # no valid token
    q, d, qm, dm = (t.to(DEVICE).bfloat16() if t.is_floating_point() else t.to(DEVICE) for t in (q, d, qm, dm))
    q64, d64 = q.double().requires_grad_(), d.double().requires_grad_()
    want = reference.maxsim(q64, d64, qm, dm, masked=masked, smooth_tau=smooth_tau)
    upstream = torch.linspace(-1, 1, want.numel(), dtype=torch.float64, device=DEVICE).view_as(want)
    want.backward(upstream)
    q_, d_ = q.clone().requires_grad_(), d.clone().requires_grad_()
    with force_backend("triton"):
        got = flash_maxsim.maxsim(q_, d_, qm, dm, masked=masked, smooth_tau=smooth_tau)
        got.backward(upstream.float())
    meta = next(p.meta for p in launch._FORWARD_PLANS.values() if p.meta["SAVE_AUX"])
    assert (meta["QPB"] * meta["TOKB"], meta["num_stages"], meta["TAIL_N"]) == (256, 3, 16)
    # the hard max's arg-max in partial pairs, whole tiles copied by TMA (the interpreter runs both)
    assert (meta["ROW_PARTIALS"], meta["TMA_DOCS"]) == ((1, False) if smooth_tau else (8, True))
    torch.testing.assert_close(got.detach().double(), want.detach(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(q_.grad.double(), q64.grad, rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(d_.grad.double(), d64.grad, rtol=1e-2, atol=2e-2)


def _first_arg_max(q, d, qm, dm, masked):
    """The first arg-max document token of every (query, document, query token) in float64 (-1: no gradient: a
    masked query token, a document with no valid token, or, masked as zero, a maximum on a masked token)."""
    sim = torch.einsum("qid,tjd->qtij", q.double(), d.double())
    valid = dm[None, :, None, :].expand_as(sim)
    sim = sim.masked_fill(~valid, 0.0 if masked == "zero" else float("-inf"))
    best, arg = sim.max(-1, keepdim=True)
    first = (sim == best).to(torch.int8).argmax(-1)           # argmax of a 0/1 tensor: its first 1
    assert torch.equal(first, arg.squeeze(-1))
    keep = qm[:, None, :] & (best.squeeze(-1) > float("-inf"))
    if masked == "zero":
        keep &= dm[torch.arange(d.shape[0])[None, :, None], first]
    return torch.where(keep, first, -1)


@pytest.mark.parametrize("tma", [True, False], ids=["TMA copies", "threads' copies"])
@pytest.mark.parametrize("Ld, masked, tail", [(300, "exclude", None), (300, "zero", None), (530, "exclude", 16),
                                              (530, "exclude", 32)],
                         ids=["300 tokens", "300 tokens, masked as zero", "530 tokens, 16-token tails",
                              "530 tokens, 32-token tails"])
def test_training_forward_arg_max_pairs_keep_the_first_arg_max_on_ties(Ld, masked, tail, tma, monkeypatch, seed):
    """The training forward's default for the hard max (8 partial (max, arg-max) pairs per row,
    ``_fold_arg_partials``), on inputs of small integers (exact products, ties everywhere: within a tile, across
    the partials and across tiles): the saved arg-max is the first maximal token, as PyTorch's max picks it, and
    the scores are the float64 reference's, exactly. Documents of 300 tokens (64-token tiles, a partial last
    one) and of 530 (256-row tiles, 16-token tails, and the 32-token tail option: every group count of the fold),
    masks, a document with no valid token; with TMA copies and without."""
    monkeypatch.setattr(tuning, "sm_count", lambda: 1)
    monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward({"TAIL_N": 32} if tail == 32 else {}))
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    if not tma:
        monkeypatch.setattr(tuning, "has_tma", lambda queries: False)
    g = torch.Generator().manual_seed(seed)
    nq = 8 if Ld == 530 else 4                       # 256 or 128 query-token rows
    q = torch.randint(-2, 3, (nq, 32, 32), generator=g).to(torch.bfloat16)
    d = torch.randint(-2, 3, (3, Ld, 32), generator=g).to(torch.bfloat16)
    qm = torch.rand(nq, 32, generator=g) > 0.2
    dm = torch.rand(3, Ld, generator=g) > 0.3
    dm[2] = False                                    # no valid token
    want_arg = _first_arg_max(q, d, qm, dm, masked)
    want = reference.maxsim(q.double(), d.double(), qm, dm, masked=masked)
    q, d, qm, dm = (t.to(DEVICE) for t in (q, d, qm, dm))
    p = _layout.canonicalize(q, d, qm, dm, masked=masked, smooth_tau=None)
    scores, aux = launch.forward(p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets, p.candidates,
                                 masked == "zero", None, True, p.max_length, p.document_scales)
    meta = next(iter(launch._FORWARD_PLANS.values())).meta
    assert (meta["ROW_PARTIALS"], meta["TMA_DOCS"], meta.get("TAIL_N")) == (8, tma, tail)
    assert torch.equal(scores.cpu().double(), want)
    assert torch.equal(aux.cpu().long(), want_arg)


@pytest.mark.parametrize("Ld", [100, 128], ids=["partial last tile", "whole tiles"])
@pytest.mark.parametrize("masked, smooth_tau", [("exclude", None), ("zero", None), ("exclude", 0.1)],
                         ids=["hard", "hard, masked as zero", "smooth"])
def test_several_documents_each_peeled_score_like_one_document_per_program(masked, smooth_tau, Ld, monkeypatch,
                                                                           seed):
    """``PEEL_EACH_DOC`` (kernels/forward.py): several documents per program, a loop per document over its whole
    tiles then its partial last tile, the query tile loaded once. The scores equal those of one document per
    program (the same tiles folded in the same order; NaN where the NaN token's document is scored), for 2 or 3
    documents per program (the last program holds fewer), with or without partial row maxima; with the tail in
    16-token tiles, within rounding; all close to the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 16, 64, generator=g)
    d = torch.randn(7, Ld, 64, generator=g)
    d[4, Ld - 3, 5] = float("nan")                       # an unmasked NaN token in a last tile
    qm = torch.rand(3, 16, generator=g) > 0.2
    dm = torch.rand(7, Ld, generator=g) > 0.3
    dm[1] = False                                        # no valid token
    dm[4, Ld - 3] = True
    q, d = q.to(DEVICE).bfloat16(), d.to(DEVICE).bfloat16()
    qm, dm = qm.to(DEVICE), dm.to(DEVICE)
    want = reference.maxsim(q.double(), d.double(), qm, dm, masked=masked, smooth_tau=smooth_tau)
    peeled = dict(PROGRAMS_PER_SM=0, PEEL_TAIL=True, FLAT_RUN=False)
    runs = [("one document per program", dict(peeled, DOCS=1), False)]
    for docs in (2, 3):
        for partials in ((1,) if smooth_tau else (1, 8)):
            runs.append((f"{docs} documents, {partials} partials",
                         dict(peeled, DOCS=docs, PEEL_EACH_DOC=True, ROW_PARTIALS=partials), True))
    # with the tail in 16-token tiles: the same within rounding (below)
    runs.append(("3 documents, 16-token tail", dict(peeled, DOCS=3, PEEL_EACH_DOC=True, TAIL_N=16), True))
    # whole tiles copied by TMA (the documents' rows a tensor descriptor's; the interpreter runs descriptors)
    runs.append(("3 documents, whole tiles by TMA", dict(peeled, DOCS=3, PEEL_EACH_DOC=True, TMA_DOCS=True), True))
    results = []
    for label, overrides, each_peeled in runs:
        monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward(overrides))
        monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
        with force_backend("triton"):
            got = flash_maxsim.maxsim(q, d, qm, dm, masked=masked, smooth_tau=smooth_tau)
        (plan,) = launch._FORWARD_PLANS.values()
        assert (plan.meta["MULTI_DOC"], plan.meta.get("PEEL_EACH_DOC", False)) == (each_peeled, each_peeled), label
        assert plan.meta["TMA_DOCS"] == ("TMA" in label), label
        assert torch.equal(got.isnan(), want.isnan().to(got.device)), label
        torch.testing.assert_close(got.double(), want.to(got.device), rtol=1e-5, atol=1e-3, equal_nan=True)
        results.append(got)
    for (label, overrides, _), got in zip(runs[1:], results[1:]):
        if "TAIL_N" in overrides:
            torch.testing.assert_close(got, results[0], rtol=1e-6, atol=1e-5, equal_nan=True)
        else:
            assert torch.equal(got.nan_to_num(), results[0].nan_to_num()), label


@triton.jit
def _tile_max_kernel(S, OUT, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_tile_max_dropping_nan`` of the [ROWS, BLOCK_N] tile ``S`` (row-major) into ``OUT``."""
    r = tl.arange(0, ROWS)
    s = tl.load(S + r[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    tl.store(OUT + r, _tile_max_dropping_nan(s, BLOCK_N))


@pytest.mark.parametrize("rows, block_n", [(64, 32), (64, 64), (128, 128), (32, 64)],
                         ids=["64x32", "64x64", "128x128", "32x64-tl.max"])
def test_tile_max_dropping_nan_folds_every_column(rows, block_n, seed):
    """``_tile_max_dropping_nan`` (the bit-cast sums' hard max: columns folded in a fixed chain, kernels/forward.py)
    is each row's maxNum over all its columns: every column position holds some row's maximum, NaN entries are
    dropped, a row of NaN stays NaN; at 32 rows (``tl.max``) too."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(rows, block_n, generator=g)
    at = torch.randperm(rows, generator=g) % block_n           # row r's max at column at[r]: every column used
    s[torch.arange(rows), at] = 2.0 + torch.rand(rows, generator=g)
    s[torch.rand(rows, block_n, generator=g) < 0.3] = float("nan")   # dropped, the planted maxima included
    s[1] = float("nan")
    s = s.to(DEVICE)
    out = torch.empty(rows, device=DEVICE)
    _tile_max_kernel[(1,)](s, out, rows, block_n)
    want = torch.where(s.isnan(), float("-inf"), s).amax(1)
    want[s.isnan().all(1)] = float("nan")
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


@triton.jit
def _row_partials_kernel(S, M, OUT, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DROP_NAN: tl.constexpr,
                         CHAINED_MAX: tl.constexpr):
    """``_fold_row_partials`` (8 partials) of the [ROWS, BLOCK_N] tile ``S`` into the running partials ``M``
    ([ROWS, 8]), written to ``OUT``."""
    r = tl.arange(0, ROWS)
    w = tl.arange(0, 8)
    s = tl.load(S + r[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    m = tl.load(M + r[:, None] * 8 + w[None, :])
    tl.store(OUT + r[:, None] * 8 + w[None, :], _fold_row_partials(m, s, BLOCK_N, 8, DROP_NAN, CHAINED_MAX))


@pytest.mark.parametrize("chained", [True, False], ids=["chained", "tl.reduce"])
@pytest.mark.parametrize("drop_nan", [True, False], ids=["maxNum", "nan-propagating"])
@pytest.mark.parametrize("rows, block_n", [(64, 32), (64, 64), (128, 128), (32, 64)],
                         ids=["64x32", "64x64", "128x128", "32x64"])
def test_row_partials_fold_their_columns(rows, block_n, drop_nan, chained, seed):
    """The 8 partial maxima per row (``_fold_row_partials``: partial w over the columns 8g + w, folded into the
    running ones), chained (``CHAINED_MAX``: a fixed chain where it fits, 64 rows and more) or not: every column
    position holds some row's maximum of its partial; NaN entries are dropped (maxNum, the bit-cast sums) or
    propagate (the fp8 grid's max: a running partial of NaN stays NaN); a row of NaN stays NaN under either."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(rows, block_n, generator=g)
    at = torch.randperm(rows, generator=g) % block_n
    s[torch.arange(rows), at] = 2.0 + torch.rand(rows, generator=g)
    s[torch.rand(rows, block_n, generator=g) < 0.05] = float("nan")
    s[1] = float("nan")
    m = torch.rand(rows, 8, generator=g) * 2.5
    m[1] = m[3, 5] = float("nan")
    s, m = s.to(DEVICE), m.to(DEVICE)
    out = torch.empty(rows, 8, device=DEVICE)
    _row_partials_kernel[(1,)](s, m, out, rows, block_n, drop_nan, chained)
    both = torch.cat([m[:, :, None], s.reshape(rows, block_n // 8, 8).transpose(1, 2)], 2)   # [rows, 8, 1 + G]
    if drop_nan:
        want = torch.where(both.isnan(), float("-inf"), both).amax(2)
        want[both.isnan().all(2)] = float("nan")
    else:
        want = both.amax(2)        # torch's max propagates NaN
    assert want.isnan().any() and not want.isnan().all()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())
