"""Quantized (int8 / fp8) documents: the kernels score exactly the dequantized index, in every layout."""

import dataclasses
import io

import pytest
import torch

import flash_maxsim as fm
from flash_maxsim import reference
from flash_maxsim.ops import force_backend
from flash_maxsim.quantization import queries_as_scored

KINDS = ["int8", "fp8"]
BACKENDS = ["torch", "triton"]


def _backend_ok(name):
    from flash_maxsim.kernels import launch
    return name == "torch" or torch.cuda.is_available() or launch.interpreting()


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _skip_without_kernels_for(kind):
    """Skips where the kernels cannot score an index of ``kind``: no CUDA and no interpreter, or fp8 before sm_89."""
    if not _backend_ok("triton"):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    if kind == "fp8" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 documents need compute capability >= 8.9")


def _assert_scores_match(got, queries, index, queries_mask=None, documents_mask=None, masked="exclude",
                         smooth_tau=None):
    """``got`` against the float64 MaxSim of ``queries`` (as scored: dequantised where the index's products
    quantise them) and the dequantised index. fp8 on a GPU: Hopper's fp8 tensor cores sum a similarity's products
    in fewer than fp32's bits (~2^-14 of the largest term, docs/semantics.md), so each score is within 2^-9 of the
    same MaxSim on absolute values (the smooth max moves no more than its inputs' largest error)."""
    qs = queries_as_scored(queries, index).double()
    ref = reference.maxsim(qs, index.dequantize(torch.float64), queries_mask, documents_mask, masked=masked,
                           smooth_tau=smooth_tau)
    if index.kind == "fp8" and got.is_cuda:
        bound = _absolute_maxsim(queries, index, queries_mask, documents_mask, masked)
        err = (got.double() - ref).abs()
        assert (err <= 1e-4 + 2**-9 * bound).all(), (err.max(), (err / bound).max())
    else:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    return ref


def _absolute_maxsim(queries, index, queries_mask=None, documents_mask=None, masked="exclude"):
    """The float64 MaxSim of the absolute values of the operands as scored: the scale of the rounding errors of any
    order of summing a similarity's products (each similarity's error is at most a multiple of its products'
    absolute sum, and the max and the sum over query tokens carry that bound through)."""
    absolute = dataclasses.replace(index, values=index.values.float().abs().to(index.values.dtype))
    return reference.maxsim(queries_as_scored(queries, index).double().abs(), absolute.dequantize(torch.float64),
                            queries_mask, documents_mask, masked=masked)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("masked", ["exclude", "zero"])
def test_padded_scores_equal_reference_on_dequantized_index(backend, kind, masked, seed):
    if not _backend_ok(backend):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    dev = _device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 6, 40, generator=g).to(dev, torch.bfloat16)
    d = torch.randn(5, 11, 40, generator=g).to(dev, torch.bfloat16)
    dm = (torch.rand(5, 11, generator=g) > 0.3).to(dev)
    dm[2] = False
    qd = fm.quantize(d, dm, dtype=kind)
    with force_backend(backend):
        got = fm.maxsim(q, qd, masked=masked)
    ref = _assert_scores_match(got, q, qd, None, dm, masked=masked)
    # and the index is a faithful approximation of the original documents: every element of the documents and of the
    # queries (quantised alike, queries_as_scored) lies within its format's rounding, |x - x^| <= e(x) (int8: half a
    # step of the scale amax/127, bf16-rounded up: 2^-7 more; e4m3: 2^-4 |x| plus half the subnormal step,
    # 2^-10 scale), so a similarity moves by at most sum_k (e(q)|d| + |q|e(d) + e(q)e(d)) and a score by the sum over
    # query tokens of their largest such move (a max moves no more than its inputs). This bound holds for every
    # draw, where a fixed fraction of the largest score is only a statistical margin.
    exact = reference.maxsim(q.double(), d.double(), None, dm, masked=masked)
    q64, d64 = q.double().cpu(), d.double().cpu()

    def rounding(x):
        qmax = 127.0 if kind == "int8" else 448.0
        scale = x.abs().amax(-1, keepdim=True) / qmax * (1 + 2.0 ** -7)
        if kind == "int8":
            return scale * (0.5 + 2.0 ** -16)
        return (2.0 ** -4 + 2.0 ** -20) * x.abs() + 2.0 ** -10 * scale

    eq, ed = rounding(q64), rounding(d64)
    valid = dm.cpu()[..., None].expand_as(d64)
    assert ((qd.dequantize(torch.float64).cpu() - d64).abs() <= ed)[valid].all()
    assert ((queries_as_scored(q, qd).double().cpu() - q64).abs() <= eq).all()
    moves = torch.einsum("qid,tjd->qtij", eq, d64.abs() + ed) + torch.einsum("qid,tjd->qtij", q64.abs(), ed)
    bound = moves.masked_fill(~dm.cpu()[None, :, None, :], 0.0).amax(-1).sum(-1)
    # got against ref is checked above (fp32 accumulation); here ref (float64 on the quantised data) against exact
    err = (ref.cpu() - exact.cpu()).abs()
    assert (err <= bound * (1 + 1e-9) + 1e-12).all(), ((err / bound).max(), seed)
    assert (err > 0).any()                      # not vacuous: quantisation moves some score


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["ragged", "candidates"])
def test_other_layouts_and_smooth(backend, layout):
    if not _backend_ok(backend):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    dev = _device()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 5, 24, generator=g).to(dev)
    if layout == "ragged":
        docs = [torch.randn(n, 24, generator=g).to(dev) for n in (4, 0, 19)]
    else:
        docs = torch.randn(2, 3, 8, 24, generator=g).to(dev)
    qd = fm.quantize(docs)
    with force_backend(backend):
        got = fm.maxsim(q, qd, smooth_tau=0.2)
    ref = reference.maxsim(queries_as_scored(q, qd).double(), qd.dequantize(torch.float64), smooth_tau=0.2)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout, d, smooth, masked", [
    ("padded", 40, None, "exclude"), ("padded", 40, None, "zero"), ("padded", 96, 0.2, "zero"),
    ("padded", 256, None, "exclude"), ("candidates", 40, 0.2, "exclude"), ("ragged", 40, None, "zero"),
    ("sliced", 64, None, "exclude"), ("sliced", 64, 0.2, "zero"), ("grouped", 40, None, "zero"),
    ("grouped", 64, 0.2, "exclude"), ("grouped-whole", 64, None, "zero"), ("grouped-whole", 32, 0.2, "exclude"),
    ("grouped", 48, None, "exclude")])
@pytest.mark.parametrize("kind", KINDS)
def test_8bit_products_score_the_dequantized_query_against_the_index(kind, layout, d, smooth, masked, monkeypatch,
                                                                     seed):
    """8-bit tensor-core products (kernels.launch.eight_bit_products): the kernel quantises each query token
    exactly as quantization.quantize_tokens quantises a document token, to the index's format (ties included), and
    the score is the float64 MaxSim of the dequantised query against the dequantised index (int8: exact integer
    sums; fp8: fp32 sums, on Hopper within its fp8 tensor cores' accumulation, below): in every layout, both
    masked modes, hard and smooth, d up to 256, documents sliced over several programs (as long ones are), several
    documents per program (as bandwidth-bound scoring streams them), a zero query token, masked query tokens and
    an all-masked document."""
    from flash_maxsim.kernels import launch, tuning
    from flash_maxsim.quantization import quantize_tokens
    _skip_without_kernels_for(kind)
    dev = _device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 5, d, generator=g)
    q[1, 2] = 0                                              # a zero query token: scale 0
    q[0, 1] = 0
    if kind == "int8":
        q[0, 1, :3] = torch.tensor([127.0, 0.5, 1.5])       # scale exactly 1: two exact ties, rounded to even
        rounded = [127, 0, 2]
    else:
        # scale exactly 1: ties between e4m3 neighbours (16 | 18, 18 | 20, 0 | 2^-9, 2^-9 | 2^-8) rounded to even,
        # a value rounded up into the next binade, one into the normal range from the subnormals, a subnormal
        q[0, 1, :8] = torch.tensor([448.0, 17.0, 19.0, 2**-10, 3 * 2**-10, 1.97, 2**-6 - 2**-11, 0.0139])
        rounded = [448.0, 16.0, 20.0, 0.0, 2**-8, 2.0, 2**-6, 0.013671875]
    qm = torch.rand(3, 5, generator=g) > 0.2
    qm[:, 0] = True
    if layout == "candidates":
        docs = torch.randn(3, 2, 9, d, generator=g)
        dm = torch.rand(3, 2, 9, generator=g) > 0.3
        dm[0, 1] = False
    elif layout == "ragged":
        docs = [torch.randn(n, d, generator=g) for n in (9, 0, 1, 70)]
        dm = [torch.rand(n, generator=g) > 0.3 for n in (9, 0, 1, 70)]
        dm[2][:] = False
    else:
        # grouped: 70-token documents in 64-token tiles (tiles straddle documents), grouped-whole: 128 (2 tiles
        # each), both streamed as one run of tokens (FLAT_RUN)
        n_docs, length = {"padded": (4, 9), "sliced": (2, 200), "grouped": (5, 70), "grouped-whole": (5, 128)}[layout]
        docs = torch.randn(n_docs, length, d, generator=g)
        dm = torch.rand(n_docs, length, generator=g) > 0.3
        dm[1] = False
    to_dev = (lambda x: [t.to(dev) for t in x]) if isinstance(docs, list) else (lambda x: x.to(dev))
    index = fm.quantize(to_dev(docs), to_dev(dm), dtype=kind)
    q, qm = q.to(dev, torch.float32 if kind == "fp8" else torch.bfloat16), qm.to(dev)

    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    if layout == "sliced":
        # what long documents with few programs get: each document's tokens split over programs (here 2 slices
        # of 128 tokens), the per-row states combined afterwards
        monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "DSPLIT", 3)
    # d = 64: the run's scales and mask values loaded a tile ahead (as the compute-bound int8 grid does); d = 64 or
    # 96: the queries quantised before the launch (as that grid does too), the kernel reading their int8 values
    prefetch = layout.startswith("grouped") and d == 64
    monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "QUANTIZE_FIRST", d in (64, 96))
    # grouped at d = 48 and 64: the run's whole tiles (straddling two documents or not) copied through a tensor
    # descriptor (TMA on Hopper; at d = 48 its 64-feature blocks arrive with features 48-63 zero-filled)
    tma = layout.startswith("grouped") and d in (48, 64)
    monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "TMA_DOCS", tma)
    if layout.startswith("grouped"):
        monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "DOCS", 3)    # 5 documents: programs of 3 and of 2
        monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "PROGRAMS_PER_SM", 0)
        monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "PREFETCH_TOKENS", prefetch)
        # 32-row tiles (2 queries of 16 tokens, 2 query blocks): tiles may straddle documents with these
        monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "ROWS", 32)
    with force_backend("triton"):
        got = fm.maxsim(q, index, qm, masked=masked, smooth_tau=smooth)
    (plan,) = launch._FORWARD_PLANS.values()
    assert plan.meta["QUANTIZE_Q"] and plan.row_out == (layout == "sliced")
    assert plan.docs == (3 if layout.startswith("grouped") else 1)
    assert plan.meta["FLAT_RUN"] == layout.startswith("grouped")
    assert plan.meta["PREFETCH_TOKENS"] == prefetch
    assert plan.meta["Q_QUANTIZED"] == (d in (64, 96))
    assert plan.meta["TMA_DOCS"] == (tma and (launch.interpreting() or torch.cuda.get_device_capability() >= (9, 0)))
    values, scales = quantize_tokens(q, kind)
    assert scales[1, 2] == 0 and (values[1, 2].float() == 0).all()
    assert values[0, 1, :len(rounded)].float().tolist() == rounded
    assert torch.equal(queries_as_scored(q, index), values.float() * scales[..., None])
    ref = _assert_scores_match(got, q, index, qm, to_dev(dm), masked=masked, smooth_tau=smooth)
    with force_backend("torch"):     # the CPU path computes the same function
        torch.testing.assert_close(fm.maxsim(q, index, qm, masked=masked, smooth_tau=smooth).double(), ref,
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("smooth", [None, 0.3])
def test_int8_products_several_documents_per_program_with_query_splits(smooth, monkeypatch, seed):
    """What compute-bound int8 scoring launches: several documents per program while the query's
    tokens are split over programs (here 16-row tiles: 3 splits of a 40-token query; 5 documents in programs of
    3 and 2), each split quantising its rows once for all its documents; d = 16 is zero-padded to 32 features."""
    from flash_maxsim.kernels import launch, tuning
    if not _backend_ok("triton"):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    dev = _device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 40, 16, generator=g).to(dev, torch.bfloat16)
    qm = (torch.rand(2, 40, generator=g) > 0.2).to(dev)
    docs = torch.randn(5, 70, 16, generator=g).to(dev)
    dm = (torch.rand(5, 70, generator=g) > 0.3).to(dev)
    dm[3] = False
    index = fm.quantize(docs, dm)
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "ROWS", 16)
    monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "DOCS", 3)
    with force_backend("triton"):
        got = fm.maxsim(q, index, qm, smooth_tau=smooth)
    (plan,) = launch._FORWARD_PLANS.values()
    assert plan.meta["QUANTIZE_Q"] and plan.docs == 3 and plan.n_splits == 3 and plan.meta["BLOCK_D"] == 32
    want = reference.maxsim(queries_as_scored(q, index).double(), index.dequantize(torch.float64), qm, dm,
                            smooth_tau=smooth)
    assert (got[:, 3] == 0).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_8bit_products_only_where_one_tile_holds_the_features(monkeypatch):
    from flash_maxsim.kernels import launch, tuning
    index = fm.quantize(torch.randn(2, 3, 300))
    assert launch.eight_bit_products(index.values, index.scales, 256, save_aux=False) == "int8"
    assert launch.eight_bit_products(index.values, index.scales, 300, save_aux=False) is None
    assert launch.eight_bit_products(index.values.float(), None, 256, save_aux=False) is None
    fp8 = fm.quantize(torch.randn(2, 3, 64), dtype="fp8")
    assert launch.eight_bit_products(fp8.values, fp8.scales, 64, save_aux=False) == "fp8"
    assert launch.eight_bit_products(fp8.values, fp8.scales, 64, save_aux=True) is None
    q = torch.randn(2, 4, 300)
    assert queries_as_scored(q, index) is q                                  # d > 256: the query as it is
    small = fm.quantize(torch.randn(2, 3, 64))
    q = torch.randn(2, 4, 64)
    assert not torch.equal(queries_as_scored(q, small), q)                  # quantised, within its rounding
    assert (queries_as_scored(q, small) - q).abs().max() <= q.abs().amax() / 254 * 1.0001
    monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "INT8_PRODUCTS", False)   # the tuning hook's comparison path
    assert launch.eight_bit_products(small.values, small.scales, 64, save_aux=False) is None
    assert queries_as_scored(q, small) is q
    # fp8: quantised to e4m3 per token (3 mantissa bits: within 2^-4 of each value, or 2^-9 of the scale)
    assert (queries_as_scored(q, fp8) - q).abs().max() <= (q.abs() / 16 + q.abs().amax(-1, keepdim=True) / 448 / 2**9).max()
    monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "FP8_PRODUCTS", False)
    assert queries_as_scored(q, fp8) is q


@pytest.mark.parametrize("backend, quantize_first", [("torch", False), ("triton", False), ("triton", True)],
                         ids=["torch", "triton", "triton-queries-quantized-first"])
def test_non_finite_query_tokens_score_nan_against_an_int8_index(backend, quantize_first, monkeypatch):
    """A NaN or infinite value in a valid query token: its quantisation scale is not finite, so every score it
    enters is NaN, on the kernels (which quantise it in registers, or read it quantised before the launch) as on
    the CPU path; the same token masked out changes nothing. A document with no valid token still adds 0 for it."""
    from flash_maxsim.kernels import launch, tuning
    if not _backend_ok(backend):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setitem(tuning.FORWARD_OVERRIDES, "QUANTIZE_FIRST", quantize_first)
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    dev = _device()
    g = torch.Generator().manual_seed(19)
    q = torch.randn(3, 4, 16, generator=g)
    q[0, 1, 5] = float("nan")
    q[1, 2, 0] = float("inf")
    q, docs = q.to(dev), torch.randn(3, 7, 16, generator=g).to(dev)
    dm = torch.ones(3, 7, dtype=torch.bool, device=dev)
    dm[2] = False
    index = fm.quantize(docs, dm)
    with force_backend(backend):
        got = fm.maxsim(q, index)
        qm = torch.ones(3, 4, dtype=torch.bool, device=dev)
        qm[0, 1] = qm[1, 2] = False
        masked = fm.maxsim(q, index, qm)
    assert launch.eight_bit_products(index.values, index.scales, 16, save_aux=False) == "int8"
    assert got[:2, :2].isnan().all() and not got[2].isnan().any()
    assert (got[:2, 2] == 0).all()                                       # the all-masked document
    finite = q.masked_fill(~qm[..., None], 0.0)
    want = reference.maxsim(queries_as_scored(finite, index).double(), index.dequantize(torch.float64), qm, dm)
    torch.testing.assert_close(masked.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantization_is_the_same_on_cuda_and_cpu(scale_dtype, seed):
    """The scales are IEEE quotients on both devices (PyTorch's CUDA division by a Python number multiplies by
    its reciprocal instead, one rounding off now and then), rounded up to bf16 by the same bit arithmetic for an
    int8 index, so an index, and the query the kernel quantises, do not depend on where they were made."""
    from flash_maxsim.quantization import quantize_tokens
    x = torch.randn(20000, 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    values, scales = quantize_tokens(x, scale_dtype=scale_dtype)
    values_gpu, scales_gpu = quantize_tokens(x.cuda(), scale_dtype=scale_dtype)
    assert torch.equal(scales_gpu.cpu(), scales) and torch.equal(values_gpu.cpu(), values)


def test_index_object_bytes_device_and_save_load():
    d = torch.randn(4, 16, 128, dtype=torch.bfloat16)
    qd = fm.quantize(d)
    assert qd.values.dtype == torch.int8 and qd.scales.shape == (4, 16) and qd.scales.dtype == torch.bfloat16
    # d + 2 bytes per token against 2 d: 0.508x at d = 128 (at most 0.53x); fp8 keeps 4-byte scales
    assert qd.nbytes == 4 * 16 * (128 + 2) and qd.nbytes <= 0.53 * d.numel() * d.element_size()
    if hasattr(torch, "float8_e4m3fn"):
        assert fm.quantize(d, dtype="fp8").nbytes == 4 * 16 * (128 + 4)
    buf = io.BytesIO()
    torch.save(qd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert torch.equal(back.values, qd.values) and torch.equal(back.scales, qd.scales)
    assert qd.to("cpu").device.type == "cpu"
    # per-token symmetric: the largest |component| of each token maps to 126 or 127 (the scale is rounded up to
    # bf16, at most 2^-7 above amax / 127)
    assert int(qd.values.abs().amax(-1).min()) >= 126 and int(qd.values.abs().amax()) == 127


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["padded", "candidates", "packed"])
def test_index_save_load_round_trip_under_weights_only(kind, layout, tmp_path, seed):
    """``index.save(path)`` / ``QuantizedDocuments.load(path)``: every field back as it was (mask, offsets and
    max_length included), and the loaded index scores as the saved one; files in the ``torch.save`` format that
    are not such an index, or of a newer version, are refused."""
    if kind == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    g = torch.Generator().manual_seed(seed)
    if layout == "packed":
        lengths = (3, 1, 6)
        documents = [torch.randn(n, 32, generator=g) for n in lengths]
        mask = [torch.rand(n, generator=g) > 0.3 for n in lengths]
    else:
        shape = (4, 6, 32) if layout == "padded" else (2, 3, 6, 32)
        documents, mask = torch.randn(*shape, generator=g), torch.rand(*shape[:-1], generator=g) > 0.3
    index = fm.quantize(documents, mask, dtype=kind)
    index.save(tmp_path / "index.pt")
    back = fm.QuantizedDocuments.load(tmp_path / "index.pt", map_location="cpu")
    assert type(back) is fm.QuantizedDocuments
    for field in dataclasses.fields(index):
        saved, loaded = getattr(index, field.name), getattr(back, field.name)
        if isinstance(saved, torch.Tensor):
            bits = (lambda t: t.view(torch.uint8) if t.element_size() == 1 else t)   # torch.equal has no fp8
            assert loaded.dtype == saved.dtype and torch.equal(bits(loaded), bits(saved)), field.name
        else:
            assert loaded == saved, field.name
    assert (index.offsets is not None) == (layout == "packed") and index.mask is not None
    queries = torch.randn(2, 5, 32, generator=g)
    with force_backend("torch"):
        assert torch.equal(fm.maxsim(queries, back), fm.maxsim(queries, index))
    # a file that is not such an index is refused by name; so is a file from a newer format
    torch.save({"values": index.values}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not hold an index written by QuantizedDocuments.save"):
        fm.QuantizedDocuments.load(tmp_path / "other.pt")
    torch.save({"format": "flash_maxsim.QuantizedDocuments", "version": 99}, tmp_path / "newer.pt")
    with pytest.raises(ValueError, match="format version 99"):
        fm.QuantizedDocuments.load(tmp_path / "newer.pt")


@pytest.mark.parametrize("kind", KINDS)
def test_index_scales_are_the_quotient_rounded_up_to_bf16(kind, seed):
    """Each stored scale is the least bf16 number at or above the fp32 quotient amax / QMAX, so that no value is
    clipped, and the values are the nearest ones (round half to even; e4m3's rounding) for that stored scale."""
    from flash_maxsim.quantization import quantize_tokens
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, a zero token, a NaN token and a denormal-scale token
    x = torch.randn(500, 64, generator=g) * torch.exp2(torch.randint(-30, 30, (500, 1), generator=g).float())
    x[3] = 0.0
    x[4, 5] = float("nan")
    x[5] = torch.full((64,), 1e-39) * torch.randn(64, generator=g).sign()
    values, scales = quantize_tokens(x, kind, scale_dtype=torch.bfloat16)
    qmax = 127.0 if kind == "int8" else 448.0
    quotient = x.abs().amax(-1) / torch.tensor(qmax)
    stored = scales.float()
    ok = ~quotient.isnan()
    assert scales.dtype == torch.bfloat16 and stored[4].isnan() and stored[3] == 0
    assert (stored[ok] >= quotient[ok]).all()
    below = torch.nextafter(scales[ok], torch.zeros_like(scales[ok])).float()
    assert ((below < quotient[ok]) | (stored[ok] == 0)).all()
    safe = torch.where(stored > 0, stored, torch.ones_like(stored))
    scaled = x / safe[:, None]
    want = scaled.round().clamp(-127, 127) if kind == "int8" else scaled.clamp(-qmax, qmax).to(values.dtype).float()
    assert torch.equal(values[ok].float(), want[ok])
    assert values[ok].float().abs().max() <= qmax
    # the fp32 scales are the quotients themselves, as the kernels quantise queries
    _, fp32_scales = quantize_tokens(x, kind)
    assert fp32_scales.dtype == torch.float32 and torch.equal(fp32_scales[ok], quotient[ok])
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_tokens(x, kind, scale_dtype=torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_an_index_with_fp32_scales_scores_as_its_bf16_twin(backend, kind, layout, seed):
    """Either format is read with scales of either dtype (an index made by hand may hold fp32 ones; an fp8 index
    keeps fp32 ones): the same numbers held as bf16 or as fp32 give bit-for-bit the same scores
    (the bf16 scale converts exactly), on every backend, from one launch plan to the other."""
    if not _backend_ok(backend):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    dev = _device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 5, 64, generator=g).to(dev, torch.bfloat16)
    if layout == "padded":
        docs = torch.randn(4, 70, 64, generator=g).to(dev, torch.bfloat16)
    else:
        docs = [torch.randn(n, 64, generator=g).to(dev, torch.bfloat16) for n in (70, 3, 65)]
    from flash_maxsim.quantization import quantize_tokens
    made = fm.quantize(docs, dtype=kind)
    assert made.scales.dtype == (torch.bfloat16 if kind == "int8" else torch.float32)
    values, scales = quantize_tokens(made.dequantize().values if layout == "ragged" else made.dequantize(), kind,
                                     scale_dtype=torch.bfloat16)
    index = dataclasses.replace(made, values=values, scales=scales)
    wide = dataclasses.replace(index, scales=index.scales.float())
    assert index.scales.dtype == torch.bfloat16 and wide.scales.dtype == torch.float32
    assert wide.nbytes - index.nbytes == 2 * index.scales.numel()
    with force_backend(backend):
        got = fm.maxsim(q, index)
        got_wide = fm.maxsim(q, wide)
    assert torch.equal(got, got_wide)
    _assert_scores_match(got, q, index)


def test_quantized_scoring_refuses_gradients():
    q = torch.randn(2, 3, 8, requires_grad=True)
    qd = fm.quantize(torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match="queries"):
        fm.maxsim(q, qd)
    with torch.no_grad():
        assert fm.maxsim(q, qd).shape == (2, 3)


def test_bad_quantize_arguments():
    with pytest.raises(ValueError, match="dtype"):
        fm.quantize(torch.randn(2, 3, 4), dtype="int4")
    with pytest.raises(TypeError, match="documents"):
        fm.quantize(torch.randint(0, 3, (2, 3, 4)))


def test_tma_copies_fall_back_to_per_thread_copies_for_a_misaligned_index(monkeypatch):
    """Whole int8 tiles come by TMA from a tensor descriptor, which needs a 16-byte aligned base: an index whose
    values start 1 byte into their storage takes the per-thread copies instead (a plan of its own, the base's
    alignment being part of the plan's key), with the same scores as the aligned index."""
    from flash_maxsim.kernels import direct_launch, launch, tuning
    if not _backend_ok("triton"):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    dev = _device()
    if dev == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0")
    g = torch.Generator().manual_seed(23)
    q = torch.randn(2, 5, 32, generator=g).to(dev, torch.bfloat16)
    index = fm.quantize(torch.randn(5, 32, 32, generator=g).to(dev))
    storage = torch.empty(1 + index.values.numel(), dtype=torch.int8, device=dev)
    shifted = storage[1:].view(index.values.shape)
    shifted.copy_(index.values)
    misaligned = fm.QuantizedDocuments(values=shifted, scales=index.scales)
    assert misaligned.values.data_ptr() % 16 == 1
    for knob, value in dict(DOCS=3, PROGRAMS_PER_SM=0, BLOCK_N=16, QUANTIZE_FIRST=True, TMA_DOCS=True).items():
        monkeypatch.setitem(tuning.FORWARD_OVERRIDES, knob, value)
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    launched = []
    real_launch = direct_launch.launch

    def record(kernel, grid, tensors, scalars, meta, *rest, **kw):
        launched.append(meta["TMA_DOCS"])
        return real_launch(kernel, grid, tensors, scalars, meta, *rest, **kw)
    monkeypatch.setattr(direct_launch, "launch", record)
    with force_backend("triton"):
        aligned_scores, misaligned_scores = fm.maxsim(q, index), fm.maxsim(q, misaligned)
    aligned_plan, misaligned_plan = launch._FORWARD_PLANS.values()
    assert aligned_plan.meta["TMA_DOCS"] and aligned_plan.meta["FLAT_RUN"]
    assert not misaligned_plan.meta["TMA_DOCS"] and misaligned_plan.meta["FLAT_RUN"]
    assert launched == [True, False]
    want = reference.maxsim(queries_as_scored(q, index).double(), index.dequantize(torch.float64))
    torch.testing.assert_close(aligned_scores.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(misaligned_scores, aligned_scores, rtol=0, atol=0)


def _scores_with(monkeypatch, q, index, qm=None, masked="exclude", **knobs):
    """Scores through the kernels with these tuning.FORWARD_OVERRIDES fields (and only these), and the one plan used."""
    from flash_maxsim.kernels import launch, tuning
    monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward(dict(knobs)))
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    with force_backend("triton"):
        got = fm.maxsim(q, index, qm, masked=masked)
    (plan,) = launch._FORWARD_PLANS.values()
    return got, plan


# what the int8 x int8 grids' runs of documents look like at test size: 3 documents per program, 32-row tiles
_RUNS = dict(DOCS=3, PROGRAMS_PER_SM=0, ROWS=32)


@pytest.mark.filterwarnings("ignore:All-NaN slice")      # the interpreter's max over the NaN of negative sums
@pytest.mark.parametrize("length, masked, knobs", [
    (70, "exclude", {}), (70, "zero", {"QUANTIZE_FIRST": True, "TMA_DOCS": True}),
    (128, "exclude", {"PREFETCH_TOKENS": True, "TMA_DOCS": True}), (128, "zero", {"QUANTIZE_FIRST": True}),
    (200, "exclude", {"ROWS": 64, "BLOCK_N": 128, "CHAINED_MAX": True}),
    (128, "zero", {"ROWS": 64, "PREFETCH_TOKENS": True, "CHAINED_MAX": True})],
    ids=["straddling-exclude", "straddling-zero-tma", "whole-tiles-prefetched-tma", "whole-tiles-zero",
         "64-rows-straddling-exclude", "64-rows-whole-tiles-zero"])
def test_bitcast_sums_score_bit_for_bit_like_converted_sums(length, masked, knobs, monkeypatch, seed):
    """``BITCAST_SUMS`` reads each int8 x int8 sum's bits as an fp32 denormal and scales it by the token's scale
    times 2^100 (kernels/forward.py, ``_tile_similarities``): negative sums become NaN, which the max drops, and a
    second, exact pass redoes a program whose documents leave a row without a non-negative similarity. Scores are
    bit for bit those of the converted sums, in runs of documents whose tiles straddle two documents or not, with
    the scales and mask loaded a tile ahead, queries quantised before the launch, TMA copies, both masked modes,
    a document with no valid token and one against which a query token's every sum is negative; with 64-row tiles
    and ``CHAINED_MAX`` (the tile max folded in a fixed chain, ``_tile_max_dropping_nan``) too."""
    if not _backend_ok("triton"):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    dev = _device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 16, 64, generator=g)
    docs = torch.randn(5, length, 64, generator=g)
    docs[2] = -docs[2].abs()
    q[0, 3] = q[0, 3].abs()                                  # every sum of query 0's token 3 with document 2 < 0
    dm = torch.rand(5, length, generator=g) > 0.3
    dm[1] = False                                            # no valid token
    qm = torch.rand(3, 16, generator=g) > 0.2
    qm[0, 3] = True
    index = fm.quantize(docs.to(dev), dm.to(dev))
    q, qm = q.to(dev, torch.bfloat16), qm.to(dev)
    knobs = {**_RUNS, **knobs}
    want, plan = _scores_with(monkeypatch, q, index, qm, masked, **knobs)
    assert plan.meta["FLAT_RUN"] and not plan.meta["BITCAST_SUMS"]
    got, plan = _scores_with(monkeypatch, q, index, qm, masked, BITCAST_SUMS=True, **knobs)
    assert plan.meta["BITCAST_SUMS"] and plan.meta["STRADDLE"] == (length % plan.meta["BLOCK_N"] != 0)
    assert plan.meta["QPB"] * plan.meta["TOKB"] == knobs["ROWS"]
    assert plan.meta.get("CHAINED_MAX", False) == knobs.get("CHAINED_MAX", False)
    assert torch.equal(got, want)
    ref = reference.maxsim(queries_as_scored(q, index).double(), index.dequantize(torch.float64), qm, dm.to(dev),
                           masked=masked)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.filterwarnings("ignore:All-NaN slice")      # the interpreter's max over the NaN of negative sums
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("kind", KINDS)
def test_chained_row_partials_score_bit_for_bit(kind, block_n, monkeypatch, seed):
    """8 partial maxima per row over runs of documents of whole tiles (fp8's compute-bound grid; int8's bit-cast
    sums, where they are an option), folded in a fixed chain (``CHAINED_MAX``: kernels/forward.py,
    ``_column_chains``) or by ``tl.reduce``: bit for bit the same scores, those of the float64 MaxSim, with 64-row
    tiles of 64 or 128 tokens, masks, and a document with no valid token."""
    _skip_without_kernels_for(kind)
    dev = _device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 40, 64, generator=g)
    docs = torch.randn(5, 2 * block_n, 64, generator=g)
    dm = torch.rand(5, 2 * block_n, generator=g) > 0.3
    dm[3] = False
    qm = torch.rand(2, 40, generator=g) > 0.2
    index = fm.quantize(docs.to(dev), dm.to(dev), dtype=kind)
    q, qm = q.to(dev, torch.bfloat16), qm.to(dev)
    knobs = {**_RUNS, "ROWS": 64, "BLOCK_N": block_n, "ROW_PARTIALS": 8}
    if kind == "int8":
        knobs["BITCAST_SUMS"] = True
    want, plan = _scores_with(monkeypatch, q, index, qm, **knobs)
    assert plan.meta["FLAT_RUN"] and plan.meta["ROW_PARTIALS"] == 8 and "CHAINED_MAX" not in plan.meta
    assert plan.meta["BITCAST_SUMS"] == (kind == "int8")
    got, plan = _scores_with(monkeypatch, q, index, qm, CHAINED_MAX=True, **knobs)
    assert plan.meta["ROW_PARTIALS"] == 8 and plan.meta["CHAINED_MAX"]
    assert torch.equal(got, want)
    _assert_scores_match(got, q, index, qm, dm.to(dev))


@pytest.mark.filterwarnings("ignore:All-NaN slice", "ignore:overflow encountered")
def test_bitcast_sums_redo_what_they_cannot_hold(monkeypatch):
    """Scales outside the range where the bit-cast product is exact (a token of huge values, a token of tiny ones,
    a NaN token: scale NaN) and a query scale that the 2^49 restoring the max would overflow: the second, exact
    pass makes the scores bit for bit the converted sums', NaN where the NaN token is used. Without that pass
    (``BITCAST_REDO`` off, a test knob) the same inputs come out wrong, while ordinary queries and documents come
    out right: the first pass alone is exact where nothing needs redoing."""
    if not _backend_ok("triton"):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    dev = _device()
    g = torch.Generator().manual_seed(29)
    q = torch.randn(2, 16, 32, generator=g)
    docs = torch.randn(6, 64, 32, generator=g)
    ordinary = (q.to(dev, torch.bfloat16), fm.quantize(docs.to(dev)))
    docs[1, 5] *= 1e12                  # scale ~8e9 >= 2^28
    docs[3, 7] *= 1e-27                 # scale ~1e-29 < 2^-77
    docs[4, 9, 3] = float("nan")
    q[1, 2] *= 1e26                     # query scale ~8e23 >= 2^79: times 2^49 it would pass fp32's largest
    unusual = (q.to(dev, torch.bfloat16), fm.quantize(docs.to(dev)))
    for (queries, index), redo_needed in ((unusual, True), (ordinary, False)):
        want, _ = _scores_with(monkeypatch, queries, index, **_RUNS)
        got, plan = _scores_with(monkeypatch, queries, index, BITCAST_SUMS=True, **_RUNS)
        assert plan.meta["BITCAST_SUMS"]
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        if redo_needed:     # NaN exactly where the NaN token's document is scored
            assert torch.equal(want.isnan().any(0), torch.arange(6, device=dev) == 4)
        else:
            assert want.isfinite().all()
        alone, plan = _scores_with(monkeypatch, queries, index, BITCAST_SUMS=True, BITCAST_REDO=False, **_RUNS)
        assert plan.meta["BITCAST_REDO"] is False
        assert torch.equal(alone.nan_to_num(), want.nan_to_num()) != redo_needed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("length, masked", [(1024, False), (1030, True)], ids=["whole-tiles", "straddling-masked"])
def test_bitcast_sums_on_the_compute_bound_grid(length, masked, monkeypatch, seed):
    """At the size that picks the compute-bound int8 grid (1024 query tokens against 400 long documents: 128-row
    programs over runs of two documents' 128-token tiles, queries quantised before the launch, TMA copies on
    Hopper), bit-cast sums score bit for bit like converted ones, a document that sends one query token's every sum
    below zero included; they are the default there for documents of whole tiles only."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_docs = 400                          # 400 documents x 8 row blocks > 24 programs per SM: runs of 2 documents
    q = torch.randn(1, 1024, 128, generator=g, device="cuda")
    docs = torch.randn(n_docs, length, 128, generator=g, device="cuda")
    docs[7] = -docs[7].abs()
    q[0, 5] = q[0, 5].abs()
    dm = (torch.rand(n_docs, length, generator=g, device="cuda") > 0.2) if masked else None
    index = fm.quantize(docs.bfloat16(), dm)
    q = q.bfloat16()
    want, plan = _scores_with(monkeypatch, q, index, BITCAST_SUMS=False)
    assert plan.meta["Q_QUANTIZED"] and plan.meta["FLAT_RUN"] and plan.meta["STRADDLE"] == (length == 1030)
    got, plan = _scores_with(monkeypatch, q, index, BITCAST_SUMS=True)
    assert plan.meta["BITCAST_SUMS"] and plan.meta["Q_QUANTIZED"]
    assert torch.equal(got, want)
    default, plan = _scores_with(monkeypatch, q, index)
    assert plan.meta["BITCAST_SUMS"] == (length % 128 == 0)
    assert torch.equal(default, want)
    ref = reference.maxsim(queries_as_scored(q, index).double(), index.dequantize(torch.float64), None, dm)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")
@pytest.mark.parametrize("length", [300, 1024], ids=["straddling", "whole-tiles"])
def test_fp8_streaming_grid_at_its_real_size(length, monkeypatch, seed):
    """One query against enough fp8 documents to pick the streaming grid (tuning.forward_config: >= 2^19 streamed
    tokens), masked, with a document of no valid token: the tile kernel's one-warp programs with uncapped registers
    (the default where the token-rows kernel does not run) score the float64 MaxSim of the dequantised operands
    (within the fp8 accumulation's bound), as the grid of two-warp programs at 128 registers does."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_docs = 2048
    q = torch.randn(1, 32, 128, generator=g, device="cuda").bfloat16()
    docs = torch.randn(n_docs, length, 128, generator=g, device="cuda")
    dm = torch.rand(n_docs, length, generator=g, device="cuda") > 0.2
    dm[5] = False
    index = fm.quantize(docs.bfloat16(), dm, dtype="fp8")
    got, plan = _scores_with(monkeypatch, q, index, TOKEN_ROWS=False)
    assert plan.meta["num_warps"] == 1 and "maxnreg" not in plan.meta and plan.meta["MULTI_DOC"]
    _assert_scores_match(got, q, index, None, dm)
    two_warps, plan = _scores_with(monkeypatch, q, index, num_warps=2, MAXNREG=128, TOKEN_ROWS=False)
    assert plan.meta["num_warps"] == 2 and plan.meta["maxnreg"] == 128
    _assert_scores_match(two_warps, q, index, None, dm)


# the token-rows kernel's runs at test size: 3 documents per program (5 documents: programs of 3 and 2)
_TOKEN_ROWS = dict(DOCS=3, PROGRAMS_PER_SM=0, TOKEN_ROWS=True, TOKEN_ROWS_PROGRAMS_PER_SM=0, TOKEN_ROWS_BLOCK_N=64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length, masked, nq, lq, knobs", [
    (70, "exclude", 1, 32, {"TOKEN_ROWS_TMA": False}), (70, "zero", 2, 13, {"TOKEN_ROWS_TMA": True}),
    (128, "zero", 1, 1, {"TOKEN_ROWS_TMA": False}), (128, "exclude", 2, 16, {"TOKEN_ROWS_TMA": True}),
    (150, "zero", 1, 20, {"TOKEN_ROWS_TMA": True, "TOKEN_ROWS_BLOCK_N": 128}),
    (128, "exclude", 1, 32, {"TOKEN_ROWS_TMA": True, "TOKEN_ROWS_BLOCK_N": 128})],
    ids=["straddling-exclude", "straddling-zero-tma", "whole-tiles-zero-lq1", "whole-tiles-exclude-tma",
         "straddling-128-zero-tma", "whole-128-exclude-tma"])
def test_token_rows_kernel_scores_as_the_tile_kernel(kind, length, masked, nq, lq, knobs, monkeypatch, seed):
    """The 8-bit streaming grid with document tokens as the tile's rows (kernels/forward_token_rows.py) over runs of
    documents whose tiles straddle two documents or not, both masked modes, masked query tokens, one query token or
    two queries in the block, a document with no valid token and one against which a query token's every
    similarity is negative, TMA copies: the float64 MaxSim of the dequantised operands, and the tile kernel's
    scores. int8 under the interpreter: bit for bit (its sums are integers below 2^24, exact in fp32 in any order).
    fp8 under the interpreter: within fp32 summation's bound (the kernels' products are transposed matrices of
    each other; OpenBLAS's AVX2 sgemm, which numpy uses on CPUs without AVX-512, may add one similarity's products
    in another order for each, e.g. under OPENBLAS_CORETYPE=Haswell).
    On a GPU the per-query sum may add in another order, and fp8 sums come from other tensor-core instructions."""
    from flash_maxsim.kernels import launch
    _skip_without_kernels_for(kind)
    dev = _device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, lq, 64, generator=g)
    docs = torch.randn(5, length, 64, generator=g)
    docs[2] = -docs[2].abs()
    q[0, 0] = q[0, 0].abs()                                  # every similarity of query 0's token 0 with document 2 < 0
    dm = torch.rand(5, length, generator=g) > 0.3
    dm[1] = False                                            # no valid token
    qm = torch.rand(nq, lq, generator=g) > 0.2
    qm[:, 0] = True
    index = fm.quantize(docs.to(dev), dm.to(dev), dtype=kind)
    q, qm = q.to(dev, torch.bfloat16), qm.to(dev)
    want, plan = _scores_with(monkeypatch, q, index, qm, masked, **dict(_TOKEN_ROWS, TOKEN_ROWS=False))
    assert plan.kernel is not launch.maxsim_fwd_token_rows_kernel and plan.meta["FLAT_RUN"]
    got, plan = _scores_with(monkeypatch, q, index, qm, masked, **dict(_TOKEN_ROWS, **knobs))
    assert plan.kernel is launch.maxsim_fwd_token_rows_kernel and plan.docs == 3
    assert plan.meta["STRADDLE"] == (length % plan.meta["BLOCK_N"] != 0)
    assert plan.meta["TMA_DOCS"] == (knobs["TOKEN_ROWS_TMA"] and (launch.interpreting()
                                                      or torch.cuda.get_device_capability() >= (9, 0)))
    if kind == "int8" and launch.interpreting():
        assert torch.equal(got, want)
    elif kind == "int8":
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    elif launch.interpreting():
        # each kernel within d * 2^-24 of the products' absolute sums (the rounding of any order of adding d
        # terms), plus a few roundings of the scale products and the per-query sum: 2^-16 holds both kernels
        bound = _absolute_maxsim(q, index, qm, dm.to(dev), masked)
        err = (got.double() - want.double()).abs()
        assert (err <= 2**-16 * bound).all(), (err.max(), (err / bound).max())
    # fp8 on a GPU: other tensor-core instructions, each within _assert_scores_match's bound
    _assert_scores_match(got, q, index, qm, dm.to(dev), masked=masked)


@pytest.mark.parametrize("kind", KINDS)
def test_token_rows_kernel_nan_tokens(kind, monkeypatch):
    """A NaN value in a valid document token makes that document's scores NaN (its scale is NaN); one in a masked
    token changes nothing: the token-rows kernel's scores are NaN exactly where the CPU path's are, and equal to
    them elsewhere (docs/semantics.md, "NaN and infinity")."""
    from flash_maxsim.kernels import launch
    _skip_without_kernels_for(kind)
    dev = _device()
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 8, 32, generator=g)
    docs = torch.randn(5, 70, 32, generator=g)
    dm = torch.ones(5, 70, dtype=torch.bool)
    docs[3, 10, 4] = float("nan")                        # valid: document 3 scores NaN
    docs[1, 5, 0] = float("nan")                         # masked: document 1 stays finite
    dm[1, 5] = False
    index = fm.quantize(docs.to(dev), dm.to(dev), dtype=kind)
    q = q.to(dev, torch.bfloat16)
    got, plan = _scores_with(monkeypatch, q, index, None, "exclude", **_TOKEN_ROWS)
    assert plan.kernel is launch.maxsim_fwd_token_rows_kernel
    with force_backend("torch"):
        want = fm.maxsim(q.cpu(), index.to("cpu"), None, dm)
    assert got.isnan().cpu().tolist() == [[False, False, False, True, False]]
    # fp8 on a GPU: Hopper's fp8 accumulation (_assert_scores_match's bound, ~2^-9 of these scores at most)
    rtol = 4e-3 if kind == "fp8" and got.is_cuda else 1e-5
    torch.testing.assert_close(got.cpu().nan_to_num(), want.nan_to_num(), rtol=rtol, atol=1e-4)


def test_token_rows_kernel_only_where_it_applies(monkeypatch):
    """The token-rows kernel takes the hard max over runs of documents of one block of at most 32 query rows:
    the smooth max, per-query candidates, ragged documents and more than 32 query rows keep the tile kernel."""
    from flash_maxsim.kernels import launch, tuning
    dev = _device()
    if not _backend_ok("triton"):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    index = fm.quantize(torch.randn(5, 70, 32, generator=g).to(dev))
    q = torch.randn(1, 8, 32, generator=g).to(dev, torch.bfloat16)
    cases = {"hard max": (q, index, None, True), "smooth max": (q, index, 0.2, False),
             "48 query rows": (torch.randn(3, 16, 32, generator=g).to(dev, torch.bfloat16), index, None, False),
             "ragged": (q, fm.quantize([torch.randn(n, 32, generator=g).to(dev) for n in (70, 80, 90, 75, 64)]),
                        None, False)}
    for name, (queries, docs, tau, expected) in cases.items():
        monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
        monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward(dict(_TOKEN_ROWS)))
        with force_backend("triton"):
            got = fm.maxsim(queries, docs, smooth_tau=tau)
        (plan,) = launch._FORWARD_PLANS.values()
        assert (plan.kernel is launch.maxsim_fwd_token_rows_kernel) == expected, name
        ref = reference.maxsim(queries_as_scored(queries, docs).double(), docs.dequantize(torch.float64),
                               smooth_tau=tau)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [300, 1030], ids=["300-tokens", "1030-tokens"])
def test_token_rows_kernel_at_the_streaming_grids_real_size(kind, length, monkeypatch, seed):
    """One query of 32 tokens against 2048 masked documents (the streaming grid's runs at its real size, a
    document with no valid token): the token-rows kernel's scores are the float64 MaxSim of the dequantised
    operands, and the tile kernel's."""
    from flash_maxsim.kernels import launch
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 documents need compute capability >= 8.9")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, 32, 128, generator=g, device="cuda").bfloat16()
    docs = torch.randn(2048, length, 128, generator=g, device="cuda")
    dm = torch.rand(2048, length, generator=g, device="cuda") > 0.2
    dm[5] = False
    index = fm.quantize(docs.bfloat16(), dm, dtype=kind)
    tiles, plan = _scores_with(monkeypatch, q, index, TOKEN_ROWS=False)
    assert plan.kernel is launch.maxsim_fwd_kernel
    got, plan = _scores_with(monkeypatch, q, index, TOKEN_ROWS=True)
    assert plan.kernel is launch.maxsim_fwd_token_rows_kernel and plan.docs > 1
    _assert_scores_match(got, q, index, None, dm)
    if kind == "int8":      # fp8: other tensor-core instructions, each within the bound above (~1e-4 apart)
        torch.testing.assert_close(got, tiles, rtol=1e-6, atol=1e-5)
