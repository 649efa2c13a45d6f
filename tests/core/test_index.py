"""flash_maxsim.DocumentIndex: search equals flash_maxsim.search over the live documents in insertion order, for
every storage and placement; ids; add / remove; save / load round trips; crafted bad files refused with errors
naming the file and the field."""

import json
import logging
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_maxsim as fm
from flash_maxsim import _index
from flash_maxsim.ops import force_backend

STORAGES = ["fp32", "bf16", "fp16", "int8", "fp8"]


@pytest.fixture(autouse=True)
def _torch_path():
    with force_backend("torch"):
        yield


def _docs(g, n, d=8, longest=6, integer=True):
    lengths = torch.randint(0, longest + 1, (n,), generator=g).tolist()
    if integer:
        return [torch.randint(-2, 3, (m, d), generator=g).float() for m in lengths]
    return [torch.randn(m, d, generator=g) * d ** -0.25 for m in lengths]


def _queries(g, Nq=3, Lq=4, d=8, integer=True):
    if integer:
        return torch.randint(-2, 3, (Nq, Lq, d), generator=g).float()
    return torch.randn(Nq, Lq, d, generator=g) * d ** -0.25


def _stored(docs, storage):
    """The documents as the index stores them, in a form flash_maxsim.search scores the same way."""
    if storage in ("int8", "fp8"):
        return fm.quantize(fm.pack(docs), dtype=storage)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[storage]
    return [x.to(dtype) for x in docs]


def _expected(queries, docs, k, storage, queries_mask=None, chunk_size=None):
    stored = _stored(docs, storage)
    if storage in ("bf16", "fp16"):
        queries = queries.to(stored[0].dtype if stored else torch.float32)
    return fm.search(queries, stored, k, queries_mask, chunk_size=chunk_size)


def _same(got, want, ids=None):
    assert torch.equal(got.positions, want.indices), (got.positions, want.indices)
    assert torch.equal(got.scores, want.scores)
    if ids is not None:
        rows = want.indices.tolist()
        rows = [rows] if want.indices.dim() == 1 else rows
        expected = [[ids[p] for p in row] for row in rows]
        assert got.ids == (expected[0] if want.indices.dim() == 1 else expected)


TOKEN_BYTES = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8 + 2, "fp8": 8 + 4}      # d = 8, with the scale


def _near(got, want_scores, want_positions, atol=1e-4, ids=None):
    """Where scores are not exact (random or 8-bit values: a score's last bits depend on the shape of the chunk it
    was computed in): the same scores to ``atol``, positions equal except where near-equal scores swapped."""
    assert got.scores.shape == got.positions.shape == want_scores.shape
    torch.testing.assert_close(got.scores, want_scores, rtol=0, atol=atol)
    if want_scores.numel() == 0:
        return
    # a score more than 2 atol from its neighbours (the last one's lower neighbour is not returned) is the same
    # document's
    scores = want_scores.reshape(-1, want_scores.shape[-1])
    positions = want_positions.reshape(scores.shape)
    apart = torch.ones_like(scores, dtype=torch.bool)
    apart[:, -1] = False
    apart[:, 1:] &= (scores[:, 1:] - scores[:, :-1]).abs() > 2 * atol
    apart[:, :-1] &= (scores[:, :-1] - scores[:, 1:]).abs() > 2 * atol
    assert torch.equal(got.positions.reshape(scores.shape)[apart], positions[apart])
    for row in got.positions.reshape(-1, got.positions.shape[-1]).tolist():
        assert len(set(row)) == len(row)
    if ids is not None:
        rows = got.positions.tolist()
        rows = [rows] if got.positions.dim() == 1 else rows
        names = [[ids[p] for p in row] for row in rows]
        assert got.ids == (names[0] if got.positions.dim() == 1 else names)


def _small(storage="fp32", **kw):
    """An index of small shards (9 tokens: a few documents each), so that searches cross shard boundaries."""
    kw.setdefault("placement", "cpu")
    return fm.DocumentIndex(8, storage=storage, shard_bytes=kw.pop("shard_bytes", TOKEN_BYTES[storage] * 9), **kw)


# ------------------------------------------------------------------------------------------- search

@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_search_equals_flash_maxsim_search_over_the_documents(storage, chunk_size, seed):
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 23)
    index = _small(storage)
    for s in range(0, 23, 5):
        index.add(docs[s:s + 5])
    assert len(index) == 23 and index.ids == list(range(23))
    assert len(index._shards) > 2
    q = _queries(g)
    qm = torch.rand(3, 4, generator=g) > 0.2
    for k in (1, 7, 23, 50):
        got = index.search(q, k, qm, chunk_size=chunk_size)
        want = _expected(q, docs, k, storage, qm)
        if storage in ("int8", "fp8"):
            # the same values and scales: the same scores up to the summation order of the chunk's shape
            _near(got, want.scores, want.indices, ids=list(range(23)))
        else:
            _same(got, want, list(range(23)))


@pytest.mark.parametrize("storage", ["int8", "fp8"])
def test_8bit_storage_against_the_reference_on_the_dequantized_values(storage, seed):
    from flash_maxsim import reference
    from flash_maxsim.quantization import queries_as_scored
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 15, d=8, integer=False)
    index = _small(storage)
    index.add(docs)
    q = _queries(g, Nq=4, integer=False)
    stored = fm.quantize(fm.pack(docs), dtype=storage)
    ref = reference.maxsim(queries_as_scored(q, stored).double(), stored.dequantize(torch.float64))
    got = index.search(q, 6)
    torch.testing.assert_close(got.scores.double(), ref.gather(1, got.positions), rtol=0, atol=1e-4)
    best = torch.sort(ref, dim=1, descending=True).values[:, :6]
    torch.testing.assert_close(got.scores.double(), best, rtol=0, atol=1e-4)


def test_random_embeddings_single_query_and_k_beyond_the_corpus(seed):
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 9, d=8, integer=False)
    index = _small("fp32")
    index.add(docs)
    q = _queries(g, Nq=1, integer=False)[0]
    got = index.search(q, 20)
    assert got.scores.shape == got.positions.shape == (9,) and len(got.ids) == 9
    want = _expected(q, docs, 20, "fp32")
    _near(got, want.scores, want.indices, ids=list(range(9)))


def test_many_small_adds_equal_one_big_add(seed):
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 30)
    q = _queries(g)
    one = _small("int8")
    one.add(docs)
    many = _small("int8")
    for x in docs:
        many.add([x])
    a, b = one.search(q, 10), many.search(q, 10)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.scores, b.scores) and a.ids == b.ids
    assert one.nbytes == many.nbytes
    for x, y in zip(one._shards, many._shards):
        assert torch.equal(x.values.data, y.values.data) and torch.equal(x.scales.data, y.scales.data)
        assert torch.equal(x.offsets.data, y.offsets.data)


def test_every_embeddings_form_and_its_mask(seed):
    """Masked tokens are not stored: the search equals flash_maxsim.search with masked='exclude' on the masked
    input, for listed, packed and padded embeddings."""
    g = torch.Generator().manual_seed(seed)
    q = _queries(g)
    padded = torch.randint(-2, 3, (6, 5, 8), generator=g).float()
    mask = torch.rand(6, 5, generator=g) > 0.4
    mask[2] = False
    listed = [padded[i] for i in range(6)]
    listed_masks = [mask[i] for i in range(6)]
    want = fm.search(q, padded, 6, documents_mask=mask)
    for embeddings, m in ((padded, mask), (listed, listed_masks), (fm.pack(listed), mask.reshape(-1)),
                          (listed, mask.reshape(-1).float())):
        index = _small()
        index.add(embeddings, mask=m)
        _same(index.search(q, 6), want)
    index = _small()
    index.add(padded.double())                  # any floating dtype
    _same(index.search(q, 6), fm.search(q, padded, 6))


def test_bad_embeddings_change_nothing():
    index = _small()
    index.add([torch.ones(2, 8)])
    bad = [
        (lambda: index.add([torch.ones(2, 7)]), ValueError, "dim=8"),
        (lambda: index.add(torch.ones(2, 3, 8, dtype=torch.int64)), TypeError, "floating"),
        (lambda: index.add(torch.ones(2, 3, 8), mask=torch.ones(2, 4)), ValueError, "mask"),
        (lambda: index.add([torch.ones(2, 8), torch.ones(3, 8)], mask=[torch.ones(2)]), ValueError, "mask"),
        (lambda: index.add([torch.ones(2, 8)], mask=[torch.ones(3)]), ValueError, r"mask\[0\]"),
        (lambda: index.add(fm.PackedDocuments(torch.ones(4, 8), torch.tensor([0, 5, 4]))), ValueError, "offsets"),
        (lambda: index.add(torch.full((1, 2, 8), float("nan"))), ValueError, "NaN"),
        (lambda: index.add("documents"), TypeError, "embeddings"),
        (lambda: index.add([torch.ones(2, 8)], ids=[1, 2]), ValueError, "ids"),
        (lambda: index.add([torch.ones(2, 8)] * 2, ids=["a", "a"]), ValueError, r"`ids\[1\]` = 'a' is twice"),
        (lambda: index.add([torch.ones(2, 8)], ids=[0]), ValueError, "already in the index"),
        (lambda: index.add([torch.ones(2, 8)], ids=[1.5]), TypeError, r"ids\[0\]"),
        (lambda: index.add([torch.ones(2, 8)], ids=[True]), TypeError, r"ids\[0\]"),
        (lambda: index.add([torch.ones(2, 8)], ids="a"), TypeError, "ids"),
    ]
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()
    assert index.ids == [0] and len(index._shards) == 1 and index._shards[0].tokens == 2
    # a NaN in a masked token is not stored, so it is no error
    x = torch.ones(1, 3, 8)
    x[0, 2] = float("nan")
    index.add(x, mask=torch.tensor([[True, True, False]]))
    assert index.ids == [0, 1]


def test_ids_ints_and_strings(seed):
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 8)
    index = _small()
    assert index.add(docs[:2]) == [0, 1]
    assert index.add(docs[2:4], ids=["x", 10]) == ["x", 10]
    assert index.add(docs[4:6]) == [11, 12]                      # after the largest int id
    assert index.add(docs[6:8], ids=torch.tensor([3, 2])) == [3, 2]
    assert index.ids == [0, 1, "x", 10, 11, 12, 3, 2]
    q = _queries(g)
    _same(index.search(q, 8), _expected(q, docs, 8, "fp32"), index.ids)


def test_remove_then_search_equals_search_over_the_live_documents(seed):
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 40)
    ids = [f"doc{i}" for i in range(40)]
    index = _small()
    for s in range(0, 40, 7):
        index.add(docs[s:s + 7], ids=ids[s:s + 7])
    q = _queries(g)
    gone = set()
    for batch in ([3], [0, 1, 2, 39], ["doc10", "doc11", "doc12", "doc13", "doc14", "doc15"], [20]):
        names = [b if isinstance(b, str) else ids[b] for b in batch]
        index.remove(names if len(names) > 1 else names[0])
        gone.update(names)
        live = [i for i in range(40) if ids[i] not in gone]
        assert index.ids == [ids[i] for i in live] and len(index) == len(live)
        for chunk_size in (None, 3):
            _same(index.search(q, 9, chunk_size=chunk_size), _expected(q, [docs[i] for i in live], 9, "fp32"),
                  [ids[i] for i in live])
    # a shard with half its documents removed was compacted
    assert all(2 * s.removed_count < s.count for s in index._shards)


def test_remove_unknown_ids_is_a_key_error_and_removes_nothing():
    index = _small()
    index.add([torch.ones(2, 8)] * 3, ids=["a", "b", "c"])
    with pytest.raises(KeyError, match="'z'"):
        index.remove(["a", "z"])
    with pytest.raises(ValueError, match="twice"):
        index.remove(["a", "a"])
    assert index.ids == ["a", "b", "c"]
    index.remove(["a", "b", "c"])
    assert len(index) == 0 and index.nbytes == 0
    got = index.search(torch.ones(2, 3, 8), 4)
    assert got.scores.shape == (2, 0) and got.ids == [[], []]
    with pytest.raises(KeyError, match="'a'"):
        index.remove("a")


def test_search_arguments_are_checked():
    index = _small()
    index.add([torch.ones(2, 8)])
    for k in (0, -2, 1.0, None, True):
        with pytest.raises(ValueError, match="`k`"):
            index.search(torch.ones(1, 2, 8), k)
    with pytest.raises(ValueError, match="queries"):
        index.search(torch.ones(1, 2, 7), 1)
    with pytest.raises(TypeError, match="queries"):
        index.search(torch.ones(1, 2, 8, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="queries_mask"):
        index.search(torch.ones(1, 2, 8), 1, torch.ones(1, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        index.search(torch.ones(1, 2, 8), 1, chunk_size=0)


def test_constructor_arguments_are_checked(tmp_path):
    for kwargs, error, match in (
            (dict(dim=0), ValueError, "dim"), (dict(dim=8, storage="int4"), ValueError, "storage"),
            (dict(dim=8, placement="tpu"), ValueError, "placement"),
            (dict(dim=8, placement="disk"), ValueError, "path"),
            (dict(dim=8, placement="cpu", path=str(tmp_path)), ValueError, "path"),
            (dict(dim=8, placement="cpu", stream_device="cpu"), ValueError, "stream_device"),
            (dict(dim=8, placement=[]), ValueError, "placement"),
            (dict(dim=8, placement="cpu", shard_bytes=0), ValueError, "shard_bytes")):
        with pytest.raises(error, match=match):
            fm.DocumentIndex(**kwargs)
    if not torch.cuda.is_available():
        for placement in ("cuda", "cuda:all", ["cuda:0"]):
            with pytest.raises(ValueError, match="CUDA"):
                fm.DocumentIndex(8, placement=placement)


def test_several_slots_merge_to_the_same_result(seed):
    """A placement of several devices (here the CPU listed three times): shards spread over the slots, each
    searched on its own, the per-slot top k merged by score then position."""
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 30)
    index = _small(placement=["cpu", "cpu", "cpu"])
    for s in range(0, 30, 4):
        index.add(docs[s:s + 4])
    assert {s.slot for s in index._shards} == {0, 1, 2}
    q = _queries(g)
    for k in (1, 5, 30):
        _same(index.search(q, k), _expected(q, docs, k, "fp32"), list(range(30)))
    index.remove(list(range(0, 30, 3)))
    live = [i for i in range(30) if i % 3]
    _same(index.search(q, 8), _expected(q, [docs[i] for i in live], 8, "fp32"), live)


def test_host_placement_without_cuda_says_so_and_scores_in_place(caplog, seed):
    if torch.cuda.is_available():
        pytest.skip("this is the fallback without CUDA")
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 12)
    with caplog.at_level(logging.WARNING, logger="flash_maxsim._index"):
        index = _small(placement="host")
    assert "pinned host memory needs CUDA" in caplog.text
    index.add(docs)
    q = _queries(g)
    _same(index.search(q, 5), _expected(q, docs, 5, "fp32"))


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_disk_placement_streams_shard_files_in_chunks(storage, tmp_path, seed):
    """placement='disk' scored on the CPU (stream_device='cpu', no copies): full shards become memory-mapped
    files as they are added; chunks are bounded by stream_bytes."""
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 25)
    index = _small(storage, placement="disk", path=tmp_path / "idx", stream_device="cpu",
                   stream_bytes=8 * 2 * 5)
    for s in range(0, 25, 3):
        index.add(docs[s:s + 3])
    files = sorted(os.listdir(tmp_path / "idx"))
    assert len(files) >= 2 and all(f.endswith(".safetensors") for f in files)
    assert all(s.file is not None for s in index._shards[:-1])
    q = _queries(g)
    got = index.search(q, 6)
    want = _expected(q, docs, 6, storage)
    _near(got, want.scores, want.indices)
    with pytest.raises(ValueError, match="already holds an index"):
        index.save(tmp_path / "idx")
        fm.DocumentIndex(8, placement="disk", path=tmp_path / "idx")


# ------------------------------------------------------------------------------------------- save / load

@pytest.mark.parametrize("storage", STORAGES)
def test_save_load_round_trip(storage, tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 17, integer=False)
    ids = [f"p{i}" if i % 3 else i for i in range(17)]
    index = _small(storage)
    index.add(docs[:9], ids=ids[:9])
    index.add(docs[9:], ids=ids[9:])
    index.remove([ids[4], ids[5]])
    q = _queries(g, integer=False)
    want = index.search(q, 6)
    index.save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["storage"] == storage and manifest["dim"] == 8 and manifest["ids"] == index.ids
    for placement in ("cpu", "disk", ["cpu", "cpu"]):
        back = fm.DocumentIndex.load(tmp_path, placement=placement, stream_device="cpu" if placement == "disk"
                                     else None)
        assert back.ids == index.ids and back.storage == storage and back.dim == 8
        got = back.search(q, 6)
        _near(got, want.scores, want.positions, ids=index.ids)
    # what was loaded can be changed and saved again, over the old one
    back = fm.DocumentIndex.load(tmp_path, placement="cpu")
    back.add(docs[:1], ids=["new"])
    back.remove([ids[0]])
    back.save(tmp_path)
    again = fm.DocumentIndex.load(tmp_path, placement="cpu")
    assert again.ids == back.ids and again.ids[-1] == "new" and ids[0] not in again.ids
    listed = {s["file"] for s in json.loads((tmp_path / "manifest.json").read_text())["shards"]}
    assert set(os.listdir(tmp_path)) == listed | {"manifest.json"}


def test_a_disk_index_saved_in_place_rewrites_only_what_changed(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    docs = _docs(g, 20)
    index = _small("int8")
    index.add(docs)
    index.save(tmp_path)
    disk = fm.DocumentIndex.load(tmp_path, placement="disk", stream_device="cpu")
    before = {s["file"]: s["sha256"] for s in json.loads((tmp_path / "manifest.json").read_text())["shards"]}
    disk.remove([0])
    disk.add(docs[:2], ids=["a", "b"])
    disk.save(tmp_path)
    after = {s["file"]: s["sha256"] for s in json.loads((tmp_path / "manifest.json").read_text())["shards"]}
    kept = set(before) & set(after)
    assert kept and len(kept) == len(before) - 1 and all(before[f] == after[f] for f in kept)
    assert set(os.listdir(tmp_path)) == set(after) | {"manifest.json"}
    q = _queries(g)
    live = docs[1:] + docs[:2]
    got = fm.DocumentIndex.load(tmp_path, placement="cpu").search(q, 5)
    want = _expected(q, live, 5, "int8")
    _near(got, want.scores, want.indices)
    _near(disk.search(q, 5), want.scores, want.indices)


# crafted files: each a ValueError naming the file and the field

def _saved(tmp_path, storage="int8", n=6):
    g = torch.Generator().manual_seed(0)
    index = _small(storage, shard_bytes=1 << 20)
    index.add(_docs(g, n, longest=4) + [torch.ones(3, 8)], ids=list(range(n)) + ["last"])
    index.save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    return manifest, tmp_path / manifest["shards"][0]["file"]


def _write_manifest(tmp_path, manifest):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))


def _rewrite_shard(tmp_path, manifest, tensors, metadata=None):
    """Replace shard 0 with ``tensors`` and make the manifest agree with it (counts, checksum): what only the
    content checks can refuse."""
    import safetensors.torch
    path = tmp_path / manifest["shards"][0]["file"]
    safetensors.torch.save_file(tensors, str(path), metadata=metadata or {"format": _index.SHARD_FORMAT,
                                                                         "version": "1"})
    shard = manifest["shards"][0]
    shard["documents"] = tensors["offsets"].shape[0] - 1 if tensors["offsets"].dim() == 1 else shard["documents"]
    shard["tokens"] = tensors["values"].shape[0]
    shard["sha256"] = _index._sha256(str(path))
    manifest["ids"] = list(range(shard["documents"]))
    _write_manifest(tmp_path, manifest)


def _tensors(tmp_path, manifest):
    import safetensors.torch
    return safetensors.torch.load_file(str(tmp_path / manifest["shards"][0]["file"]))


def _load_fails(tmp_path, *patterns, verify=True):
    with pytest.raises(ValueError) as info:
        fm.DocumentIndex.load(tmp_path, placement="cpu", verify=verify)
    for pattern in patterns:
        assert pattern in str(info.value), (pattern, str(info.value))


def test_a_truncated_shard_is_refused(tmp_path):
    manifest, shard = _saved(tmp_path)
    data = shard.read_bytes()
    shard.write_bytes(data[:-5])
    for verify in (True, False):
        _load_fails(tmp_path, shard.name, "`values`", "truncated", verify=verify)
    shard.write_bytes(data[:6])
    _load_fails(tmp_path, shard.name, "`header`")


def test_a_changed_byte_fails_the_checksum(tmp_path):
    manifest, shard = _saved(tmp_path)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    _load_fails(tmp_path, shard.name, "`sha256`")
    fm.DocumentIndex.load(tmp_path, placement="cpu", verify=False)      # the structure is still valid


def test_offsets_past_the_values_or_decreasing_are_refused(tmp_path):
    manifest, shard = _saved(tmp_path)
    tensors = _tensors(tmp_path, manifest)
    good = tensors["offsets"].clone()
    tensors["offsets"] = good.clone()
    tensors["offsets"][-1] += 4
    _rewrite_shard(tmp_path, manifest, tensors)
    _load_fails(tmp_path, shard.name, "`offsets`", "end at")
    tensors["offsets"] = good.clone()
    tensors["offsets"][2] = tensors["offsets"][1] - 1 if tensors["offsets"][1] > 0 else 5
    tensors["offsets"][1] = max(int(tensors["offsets"][1]), int(tensors["offsets"][2]) + 1)
    _rewrite_shard(tmp_path, manifest, tensors)
    _load_fails(tmp_path, shard.name, "`offsets`", "decreas")


def test_wrong_dtypes_shapes_names_and_scales_are_refused(tmp_path):
    manifest, shard = _saved(tmp_path)
    original = _tensors(tmp_path, manifest)
    cases = [
        (dict(original, values=original["values"].float()), "`values`", "dtype"),
        (dict(original, scales=original["scales"].float()), "`scales`", "dtype"),
        (dict(original, offsets=original["offsets"].int()), "`offsets`", "dtype"),
        (dict(original, values=original["values"][:, :4].contiguous()), "`values`", "shape"),
        (dict(original, extra=torch.zeros(1)), "`tensors`", "extra"),
        ({k: v for k, v in original.items() if k != "scales"}, "`tensors`", "scales"),
        (dict(original, scales=torch.full_like(original["scales"], float("nan"))), "`scales`", "NaN"),
    ]
    for tensors, *patterns in cases:
        _rewrite_shard(tmp_path, json.loads(json.dumps(manifest)), tensors)
        _load_fails(tmp_path, shard.name, *patterns)
    _rewrite_shard(tmp_path, json.loads(json.dumps(manifest)), original, metadata={"format": "other"})
    _load_fails(tmp_path, shard.name, "`__metadata__`")
    shard.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{{{{")
    _load_fails(tmp_path, shard.name, "`header`", "JSON", verify=False)


def test_manifest_fields_are_checked(tmp_path):
    manifest, shard = _saved(tmp_path)
    (tmp_path.parent / "outside.safetensors").write_bytes(shard.read_bytes())
    os.symlink(tmp_path.parent / "outside.safetensors", tmp_path / "link.safetensors")

    def variant(**changes):
        m = json.loads(json.dumps(manifest))
        for key, value in changes.items():
            if key.startswith("shard_"):
                m["shards"][0][key[len("shard_"):]] = value
            else:
                m[key] = value
        return m

    cases = [
        (variant(format="something else"), "`format`"),
        (variant(version=2), "`version`"),
        (variant(dim=0), "`dim`"),
        (variant(dim=True), "`dim`"),
        (variant(storage="int4"), "`storage`"),
        (variant(ids=manifest["ids"][:-1] + [0]), "`ids`", "twice"),
        (variant(ids=manifest["ids"][:-1]), "`ids`"),
        (variant(ids=manifest["ids"][:-1] + [1.5]), "`ids[6]`"),
        (variant(shard_file="../outside.safetensors"), "`shards[0].file`"),
        (variant(shard_file="/etc/passwd"), "`shards[0].file`"),
        (variant(shard_file="link.safetensors"), "`shards[0].file`", "outside"),
        (variant(shard_file="missing.safetensors"), "missing.safetensors", "missing"),
        (variant(shard_sha256="abc"), "`shards[0].sha256`"),
        (variant(shard_documents=-1), "`shards[0].documents`"),
        (variant(shard_tokens=manifest["shards"][0]["tokens"] + 1), shard.name, "`values`", "shape"),
    ]
    for m, *patterns in cases:
        _write_manifest(tmp_path, m)
        _load_fails(tmp_path, *patterns)
    (tmp_path / "manifest.json").write_text("{not json")
    _load_fails(tmp_path, "manifest.json", "JSON")
    os.remove(tmp_path / "manifest.json")
    _load_fails(tmp_path, "manifest")


# ------------------------------------------------------------------------------------------- the kernels, CUDA

@pytest.mark.interpret
def test_the_kernels_score_an_index(seed):
    from flash_maxsim.kernels import launch
    if not (torch.cuda.is_available() or launch.interpreting()):
        pytest.skip("the Triton backend needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    docs = [x.to(device) for x in _docs(g, 7, d=16)]
    q = _queries(g, Nq=2, Lq=3, d=16).to(device)
    for storage in ("fp32", "int8"):
        index = fm.DocumentIndex(16, storage=storage, placement=device, shard_bytes=16 * 4 * 8)
        index.add(docs)
        with force_backend("triton"):
            got = index.search(q, 4, chunk_size=3)
            want = _expected(q, docs, 4, storage)
        _near(got, want.scores, want.indices)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_cuda_placements_agree(storage, tmp_path, seed):
    """Resident on the GPU, across every GPU, pinned host memory streamed in small chunks (many turns of the
    two buffers), and shard files streamed through pinned staging: the same top k."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 140, (400,), generator=g).tolist()
    docs = [torch.randn(n, 128, generator=g).to("cuda", torch.bfloat16) for n in lengths]
    q = torch.randn(8, 32, 128, generator=g).to("cuda", torch.bfloat16)
    small = dict(shard_bytes=128 * 2 * 4000, stream_bytes=128 * 2 * 900)
    indexes = {"cuda": fm.DocumentIndex(128, storage=storage, placement="cuda", **small),
               "cuda:all": fm.DocumentIndex(128, storage=storage, placement="cuda:all", **small),
               "host": fm.DocumentIndex(128, storage=storage, placement="host", **small),
               "disk": fm.DocumentIndex(128, storage=storage, placement="disk", path=tmp_path / "d", **small)}
    for index in indexes.values():
        for s in range(0, 400, 37):
            index.add(docs[s:s + 37])
        index.remove(list(range(0, 400, 11)))
    assert indexes["host"]._shards[0].values.data.is_pinned()
    live = [docs[i] for i in range(400) if i % 11]
    want = _expected(q, live, 10, storage)
    for name, index in indexes.items():
        got = index.search(q, 10)
        assert got.scores.device.type == "cuda", name
        _near(got, want.scores, want.indices, atol=1e-3)
    indexes["host"].save(tmp_path / "saved")
    back = fm.DocumentIndex.load(tmp_path / "saved", placement="disk", **small)
    _near(back.search(q, 10), want.scores, want.indices, atol=1e-3)


def test_no_queries_and_an_empty_index():
    index = _small("int8")
    got = index.search(torch.ones(2, 3, 8), 5)
    assert got.scores.shape == got.positions.shape == (2, 0) and got.ids == [[], []]
    index.add([torch.ones(2, 8), torch.zeros(0, 8)])
    got = index.search(torch.ones(0, 3, 8), 5)
    assert got.scores.shape == (0, 2) and got.ids == []
    got = index.search(torch.ones(3, 8), 5)
    assert got.ids == [0, 1] and got.scores[1] == 0


# ------------------------------------------------------------------------------------------- damaged files at random

def _saved_bytes():
    import tempfile
    g = torch.Generator().manual_seed(1)
    index = _small("int8", shard_bytes=1 << 20)
    index.add(_docs(g, 4, longest=3), ids=["a", 1, "c", 3])
    with tempfile.TemporaryDirectory() as directory:
        index.save(directory)
        manifest = (json.loads(open(os.path.join(directory, "manifest.json")).read()))
        name = manifest["shards"][0]["file"]
        return manifest, name, open(os.path.join(directory, name), "rb").read()


MANIFEST, SHARD_NAME, SHARD = _saved_bytes()


def _load_damaged(data, verify):
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "manifest.json"), "w") as f:
            json.dump(MANIFEST, f)
        with open(os.path.join(directory, SHARD_NAME), "wb") as f:
            f.write(data)
        try:
            index = fm.DocumentIndex.load(directory, placement="cpu", verify=verify)
        except ValueError as error:
            assert SHARD_NAME in str(error) and "`" in str(error), str(error)
            return None
        with force_backend("torch"):
            result = index.search(torch.ones(2, 3, 8), 3)     # whatever the bytes, scoring reads only its inputs
        assert result.scores.shape == (2, 3)
        return index


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, len(SHARD) - 1), verify=st.booleans())
def test_a_shard_cut_anywhere_is_a_clear_error(cut, verify):
    assert _load_damaged(SHARD[:cut], verify) is None


@settings(max_examples=150, deadline=None)
@given(bit=st.integers(0, len(SHARD) * 8 - 1))
def test_a_flipped_bit_anywhere_is_a_clear_error_or_an_index_that_scores(bit):
    data = bytearray(SHARD)
    data[bit // 8] ^= 1 << (bit % 8)
    assert _load_damaged(bytes(data), verify=True) is None          # the checksum covers every byte
    _load_damaged(bytes(data), verify=False)
