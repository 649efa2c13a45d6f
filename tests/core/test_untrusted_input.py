"""Inputs that no kernel may trust: packed offsets and max_length given by a caller, and index files, crafted or
damaged. Each gives a clear error or the float64 reference's result, on the CPU path and on the interpreted
kernels (property tests: random offsets, random truncations and bit flips of a saved index)."""

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flash_maxsim
from flash_maxsim import PackedDocuments, QuantizedDocuments, _types
from flash_maxsim.kernels import launch
from flash_maxsim.ops import force_backend

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = pytest.mark.skipif(TRITON_DEVICE == "cpu" and not launch.interpreting(),
                                 reason="needs CUDA or TRITON_INTERPRET=1")
BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=INTERPRETED)]
# interpreted kernel launches take ~0.5 s each: fewer examples there
EXAMPLES = {"torch": 60, "triton": 8}
D = 8


def _device(backend):
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _offsets_are_valid(offsets, rows, max_length):
    if not offsets or offsets[0] != 0 or offsets[-1] != rows or any(b < a for a, b in zip(offsets, offsets[1:])):
        return False
    longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    return max_length is None or max_length >= longest


def _reference_scores_and_grads(queries, values, offsets, smooth_tau=None):
    q = queries.detach().double().requires_grad_()
    v = values.detach().double().requires_grad_()
    documents = [v[a:b] for a, b in zip(offsets, offsets[1:])]
    scores = flash_maxsim.reference.maxsim(q, documents, smooth_tau=smooth_tau)
    if not scores.requires_grad:                  # no documents: nothing to differentiate
        return scores, torch.zeros_like(q), torch.zeros_like(v)
    grad_q, grad_v = torch.autograd.grad(scores.sum(), (q, v), allow_unused=True)
    return scores, grad_q, (torch.zeros_like(v) if grad_v is None else grad_v)


@st.composite
def packed_arguments(draw):
    """Values of ``rows`` tokens with offsets and max_length drawn around the valid ones: some valid, others
    starting elsewhere than 0, decreasing, ending before or after the values, understating the longest document."""
    rows = draw(st.integers(0, 9))
    T = draw(st.integers(0, 4))
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=T, max_size=T)))
        offsets = [0] + cuts + [rows]
        if draw(st.booleans()):                        # one entry moved anywhere nearby
            i = draw(st.integers(0, len(offsets) - 1))
            offsets[i] = draw(st.integers(-3, rows + 3))
    else:
        offsets = draw(st.lists(st.integers(-3, rows + 3), min_size=1, max_size=T + 2))
    max_length = draw(st.none() | st.integers(0, rows + 2))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return rows, offsets, max_length, dtype, draw(st.integers(0, 2 ** 31 - 1))


def _check_packed_scores(backend, rows, offsets, max_length, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(2, 3, D, generator=g)
    values = torch.randn(rows, D, generator=g)
    device = _device(backend)
    q = queries.to(device).requires_grad_()
    v = values.to(device).requires_grad_()
    documents = PackedDocuments(v, torch.tensor(offsets, dtype=dtype, device=device), max_length)
    with force_backend(backend):
        if not _offsets_are_valid(offsets, rows, max_length):
            with pytest.raises(ValueError, match=r"`documents\.(offsets|max_length)`"):
                flash_maxsim.maxsim(q, documents)
            return
        scores = flash_maxsim.maxsim(q, documents)
        grad_q, grad_v = torch.autograd.grad(scores.sum(), (q, v), allow_unused=True)
    expected, expected_q, expected_v = _reference_scores_and_grads(queries, values, offsets)
    torch.testing.assert_close(scores.cpu().double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_q.cpu().double(), expected_q, rtol=1e-5, atol=1e-5)
    grad_v = torch.zeros_like(values) if grad_v is None else grad_v
    torch.testing.assert_close(grad_v.cpu().double(), expected_v, rtol=1e-5, atol=1e-5)


@settings(max_examples=EXAMPLES["torch"], deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=packed_arguments())
def test_random_offsets_give_an_error_or_the_reference_cpu_path(arguments):
    _check_packed_scores("torch", *arguments)


@INTERPRETED
@settings(max_examples=EXAMPLES["triton"], deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=packed_arguments())
def test_random_offsets_give_an_error_or_the_reference_interpreted(arguments):
    _check_packed_scores("triton", *arguments)


def test_offsets_changed_in_place_are_validated_again():
    """Validated offsets are remembered by tensor and version counter: an in-place change after a first call (or
    after flash_maxsim.pack made them) is caught at the next call."""
    values = torch.randn(7, D)
    queries = torch.randn(1, 2, D)
    offsets = torch.tensor([0, 3, 7])
    with force_backend("torch"):
        flash_maxsim.maxsim(queries, PackedDocuments(values, offsets, 4))
        assert _types.known_longest(offsets, 7) == 4
        offsets[1] = 200
        with pytest.raises(ValueError, match="`documents.offsets`"):
            flash_maxsim.maxsim(queries, PackedDocuments(values, offsets, 4))
        packed = flash_maxsim.pack([torch.randn(3, D), torch.randn(4, D)])
        assert _types.known_longest(packed.offsets, 7) == 4        # pack's own offsets: no read needed
        packed.offsets[1] = 6
        with pytest.raises(ValueError, match="`documents.max_length`"):
            flash_maxsim.maxsim(queries, packed)
        # the same offsets over values of another length are checked against those
        with pytest.raises(ValueError, match="`documents.offsets`"):
            flash_maxsim.maxsim(queries, PackedDocuments(torch.randn(8, D), torch.tensor([0, 3, 7])))


def test_offsets_made_under_inference_mode_are_validated_on_every_call():
    """Inference tensors have no version counter, so nothing is remembered about them."""
    values = torch.randn(7, D)
    with torch.inference_mode():
        offsets = torch.tensor([0, 3, 7])
        with force_backend("torch"):
            flash_maxsim.maxsim(torch.randn(1, 2, D), PackedDocuments(values, offsets, 4))
        assert _types.known_longest(offsets, 7) is None
        offsets[1] = 9
        with pytest.raises(ValueError, match="`documents.offsets`"):
            flash_maxsim.maxsim(torch.randn(1, 2, D), PackedDocuments(values, offsets, 4))


def test_an_overstated_max_length_scores_as_the_longest_document():
    values = torch.randn(7, D)
    queries = torch.randn(2, 3, D)
    offsets = torch.tensor([0, 3, 7])
    with force_backend("torch"):
        got = flash_maxsim.maxsim(queries, PackedDocuments(values, offsets, 10 ** 8))
        assert torch.equal(got, flash_maxsim.maxsim(queries, PackedDocuments(values, offsets)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ops_check_offsets_that_reach_them_directly(backend):
    """The registered ops (what a torch.compile graph calls with offsets its tracing could not read) validate
    them too."""
    device = _device(backend)
    q = torch.randn(1, 2, D, device=device)
    values = torch.randn(7, D, device=device)
    with force_backend(backend):
        for offsets, max_length, text in (([0, 3, 200], 5, "`offsets`"), ([0, 5, 3, 7], 5, "`offsets`"),
                                          ([0, 3, 7], 2, "`max_length`")):
            with pytest.raises(ValueError, match=text):
                torch.ops.flash_maxsim.maxsim_fwd(q, values, None, None, torch.tensor(offsets, device=device),
                                                  max_length, 0, False, None, False)


def test_compiled_scoring_checks_max_length_when_it_runs():
    """Under torch.compile(fullgraph=True) a given max_length is used for tracing; the op compares it with the
    offsets when the graph runs."""
    values = torch.randn(7, D, requires_grad=True)
    queries = torch.randn(2, 3, D)

    def scores(values, offsets, max_length):
        return flash_maxsim.maxsim(queries, PackedDocuments(values, offsets, max_length))

    torch._dynamo.reset()
    compiled = torch.compile(scores, fullgraph=True, backend="aot_eager", dynamic=False)
    with force_backend("torch"):
        good = compiled(values, torch.tensor([0, 3, 7]), 4)
        torch.testing.assert_close(good, scores(values, torch.tensor([0, 3, 7]), 4))
        with pytest.raises(ValueError, match="`max_length`"):
            compiled(values, torch.tensor([0, 1, 7]), 4)
        with pytest.raises(ValueError, match="`offsets`"):
            compiled(values, torch.tensor([0, 3, 9]), 4)


# ----------------------------------------------------------------------------------------------- index files

def _index(kind="int8", layout="packed", seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "packed":
        lengths = (3, 0, 5)
        documents = [torch.randn(n, D, generator=g) for n in lengths]
        mask = [torch.rand(n, generator=g) > 0.3 for n in lengths]
    else:
        documents = torch.randn(3, 4, D, generator=g)
        mask = torch.rand(3, 4, generator=g) > 0.3
    return flash_maxsim.quantize(documents, mask, dtype=kind)


def _saved(index) -> bytes:
    buffer = io.BytesIO()
    index.save(buffer)
    return buffer.getvalue()


def _same_index(a: QuantizedDocuments, b: QuantizedDocuments) -> bool:
    bits = (lambda t: None if t is None else t.view(torch.uint8) if t.element_size() == 1 else t)
    for name in ("values", "scales", "offsets", "mask"):
        x, y = bits(getattr(a, name)), bits(getattr(b, name))
        if (x is None) != (y is None) or (x is not None and (x.dtype != y.dtype or not torch.equal(x, y))):
            return False
    return a.kind == b.kind and a.max_length == b.max_length


def _assert_scores_its_dequantization(index, backend):
    """maxsim against the index is the reference against the dequantised index, for the queries it scores."""
    device = _device(backend)
    queries = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))
    with force_backend(backend), torch.no_grad():
        got = flash_maxsim.maxsim(queries.to(device), index.to(device)).cpu()
    scored = flash_maxsim.quantization.queries_as_scored(queries, index)
    expected = flash_maxsim.reference.maxsim(scored.double(), index.dequantize(torch.float64), None, index.mask)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


KINDS = ["int8", pytest.param("fp8", marks=pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"),
                                                              reason="this PyTorch has no float8_e4m3fn"))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_save_writes_safetensors_that_load_reads_back(kind, layout, tmp_path):
    """A path and a binary file: no pickle in the file, every field back, the offsets known as validated."""
    index = _index(kind, layout)
    data = _saved(index)
    assert data[8:9] == b"{" and b"__metadata__" in data and b"sha256" in data
    index.save(tmp_path / "index.safetensors")
    for source in (tmp_path / "index.safetensors", str(tmp_path / "index.safetensors"), io.BytesIO(data)):
        back = QuantizedDocuments.load(source)
        assert _same_index(back, index)
        if layout == "packed":
            assert _types.known_longest(back.offsets, back.values.shape[0]) == 5
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "index.safetensors")) == ({"values", "scales", "offsets", "mask"}
                                                              if layout == "packed" else {"values", "scales", "mask"})


def test_save_refuses_an_index_it_could_not_load():
    index = _index()
    with pytest.raises(ValueError, match="`offsets`"):
        QuantizedDocuments(index.values, index.scales, torch.tensor([0, 3, 9]), None, None).save(io.BytesIO())
    with pytest.raises(ValueError, match="`scales`"):
        QuantizedDocuments(index.values, index.scales.int(), index.offsets).save(io.BytesIO())


def test_the_torch_save_format_still_loads_and_is_validated(tmp_path):
    index = _index()
    state = {"format": "flash_maxsim.QuantizedDocuments", "version": 1, "kind": "int8", "values": index.values,
             "scales": index.scales, "offsets": index.offsets, "mask": index.mask, "max_length": 5}
    torch.save(state, tmp_path / "index.pt")
    assert _same_index(QuantizedDocuments.load(tmp_path / "index.pt"), index)
    # an index whose offsets run past its values
    torch.save({**state, "offsets": torch.tensor([0, 3, 200])}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="`offsets` must start at 0, never decrease and end at"):
        QuantizedDocuments.load(tmp_path / "evil.pt")


def _craft_safetensors(tensors, fields) -> io.BytesIO:
    """A safetensors index with a checksum that matches whatever it holds: what a crafted file can do."""
    from safetensors.torch import save
    fields = {"format": _types.INDEX_FORMAT, "version": "1", **fields}
    fields["sha256"] = _types.index_checksum(tensors, fields)
    return io.BytesIO(save(tensors, metadata=fields))


def _craft_torch(tensors, fields) -> io.BytesIO:
    buffer = io.BytesIO()
    state = {"format": _types.INDEX_FORMAT, "version": 1, "offsets": None, "mask": None, **tensors}
    for key, value in fields.items():
        state[key] = None if value == "" else int(value) if key in ("version", "max_length") else value
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def _crafted_cases():
    index = _index()
    v, s, o, m = index.values, index.scales, index.offsets, index.mask
    ok = {"values": v, "scales": s, "offsets": o, "mask": m}
    fields = {"kind": "int8", "max_length": "5"}
    yield "offsets-past-values", {**ok, "offsets": torch.tensor([0, 3, 200])}, fields, "`offsets`"
    yield "offsets-decreasing", {**ok, "offsets": torch.tensor([0, 5, 3, 8])}, fields, "`offsets`"
    yield "offsets-short", {**ok, "offsets": torch.tensor([0, 3, 3, 7])}, fields, "`offsets`"
    yield "offsets-float", {**ok, "offsets": o.float()}, fields, "`offsets`"
    yield "offsets-2d", {**ok, "offsets": o[None]}, fields, "`offsets`"
    yield "max-length-understated", ok, {**fields, "max_length": "2"}, "`max_length`"
    yield "max-length-padded", {"values": v[None], "scales": s[None]}, fields, "`max_length`"
    yield "values-dtype", {**ok, "values": v.float()}, fields, "`values`"
    yield "values-rank", {**ok, "values": v[None]}, fields, "`values`"
    yield "kind-unknown", ok, {**fields, "kind": "int4"}, "`kind`"
    yield "kind-other", ok, {**fields, "kind": "fp8"}, "`values`"
    yield "scales-int", {**ok, "scales": s.to(torch.int32)}, fields, "`scales`"
    yield "scales-complex", {**ok, "scales": s.to(torch.complex64)}, fields, "`scales`"
    yield "scales-nan", {**ok, "scales": torch.where(torch.arange(8) == 2, float("nan"), s.float())}, fields, "`scales`"
    yield "scales-inf", {**ok, "scales": torch.full((8,), float("inf"))}, fields, "`scales`"
    yield "scales-shape", {**ok, "scales": s[:7]}, fields, "`scales`"
    yield "mask-shape", {**ok, "mask": m[:7]}, fields, "`mask`"
    yield "mask-complex", {**ok, "mask": m.to(torch.complex64)}, fields, "`mask`"
    yield "no-values", {"scales": s, "offsets": o}, fields, "`values`"
    yield "extra-tensor", {**ok, "code": torch.zeros(1)}, fields, "besides"
    yield "version", ok, {**fields, "version": "2"}, "version 2"


CRAFTED = list(_crafted_cases())


@pytest.mark.parametrize("container", ["safetensors", "torch"])
@pytest.mark.parametrize("tensors, fields, text", [pytest.param(*c[1:], id=c[0]) for c in CRAFTED])
def test_a_crafted_index_is_refused_by_name(container, tensors, fields, text):
    craft = _craft_safetensors if container == "safetensors" else _craft_torch
    try:
        f = craft(tensors, fields)
    except Exception as error:        # a dtype the container cannot hold: nothing to load
        pytest.skip(f"{container} cannot hold it: {error}")
    with pytest.raises(ValueError, match=text):
        QuantizedDocuments.load(f)


@st.composite
def crafted_offsets(draw):
    rows = 8
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=2, max_size=2)))
    offsets = [0] + cuts + [rows]
    if draw(st.booleans()):
        offsets[draw(st.integers(0, 3))] = draw(st.integers(-2 ** 40, 2 ** 40) | st.integers(-3, rows + 3))
    return offsets, draw(st.none() | st.integers(0, 10)), draw(st.sampled_from(["safetensors", "torch"]))


def _check_crafted_offsets(backend, offsets, max_length, container):
    index = _index()
    craft = _craft_safetensors if container == "safetensors" else _craft_torch
    f = craft({"values": index.values, "scales": index.scales, "offsets": torch.tensor(offsets)},
              {"kind": "int8", "max_length": "" if max_length is None else str(max_length)})
    if not _offsets_are_valid(offsets, 8, max_length):
        with pytest.raises(ValueError, match="`offsets`|`max_length`"):
            QuantizedDocuments.load(f)
        return
    loaded = QuantizedDocuments.load(f)
    _assert_scores_its_dequantization(loaded, backend)


@settings(max_examples=EXAMPLES["torch"], deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=crafted_offsets())
def test_crafted_offsets_in_an_index_file_cpu_path(arguments):
    _check_crafted_offsets("torch", *arguments)


@INTERPRETED
@settings(max_examples=EXAMPLES["triton"], deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=crafted_offsets())
def test_crafted_offsets_in_an_index_file_interpreted(arguments):
    _check_crafted_offsets("triton", *arguments)


SAVED = _saved(_index())


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(0, len(SAVED) - 1))
def test_a_truncated_index_file_is_a_clear_error(cut):
    with pytest.raises(ValueError, match="`f`"):
        QuantizedDocuments.load(io.BytesIO(SAVED[:cut]))


def _check_bit_flip(backend, bit):
    data = bytearray(SAVED)
    data[bit // 8] ^= 1 << (bit % 8)
    try:
        loaded = QuantizedDocuments.load(io.BytesIO(bytes(data)))
    except ValueError as error:
        assert "`f`" in str(error) or "the index in `f`" in str(error), str(error)
        return
    # a flip that the container itself ignores (e.g. in the header's padding) changes nothing
    assert _same_index(loaded, _index())
    _assert_scores_its_dequantization(loaded, backend)


@settings(max_examples=300, deadline=None)
@given(bit=st.integers(0, len(SAVED) * 8 - 1))
def test_a_flipped_bit_in_an_index_file_is_a_clear_error_cpu_path(bit):
    _check_bit_flip("torch", bit)


@INTERPRETED
@settings(max_examples=EXAMPLES["triton"], deadline=None)
@given(bit=st.integers(0, len(SAVED) * 8 - 1))
def test_a_flipped_bit_in_an_index_file_is_a_clear_error_interpreted(bit):
    _check_bit_flip("triton", bit)


def test_a_flipped_bit_in_the_payload_is_named_as_damage():
    data = bytearray(SAVED)
    data[-3] ^= 0x10                              # inside the last tensor's bytes
    with pytest.raises(ValueError, match="checksum does not match"):
        QuantizedDocuments.load(io.BytesIO(bytes(data)))
