"""search_bench.py: its corpora are reproducible chunk by chunk, its torch baseline and checks find (and flag) what
they should, and a --cpu-smoke run measures every kind of row, checks out against the exact top-k and renders."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_maxsim
import report
from _search_corpus import (Corpus, Generated, compare_topk, merge_stable, padded_layout, regenerated_topk,
                            resident_layout, stable_topk, torch_chunk_plan, torch_chunked_search)

SEARCH_BENCH = Path(__file__).resolve().parents[1] / "search_bench.py"
PASSAGES = Corpus("passages-tiny", "passages tiny", "passages", 57, mean=9, min_len=2, max_len=21)
PAGES = Corpus("pages-tiny", "pages tiny", "pages", 13, 7)


def test_generated_corpus_is_the_same_chunk_by_chunk():
    gen = Generated(PASSAGES, 16, seed=3, chunk_tokens=40)
    lengths = gen.lengths.tolist()
    assert min(lengths) >= 2 and max(lengths) <= 21 and gen.tokens == sum(lengths)
    # the chunks cover every document once, in order, each within the token limit unless a document is longer
    assert gen.bounds[0][0] == 0 and gen.bounds[-1][1] == 57 and len(gen.bounds) > 3
    for (s, e), (s2, _) in zip(gen.bounds, gen.bounds[1:]):
        assert e == s2
    for s, e in gen.bounds:
        assert sum(lengths[s:e]) <= 40 or e == s + 1
    first, offsets = gen.chunk(2, "cpu", torch.float32)
    again, _ = gen.chunk(2, "cpu", torch.float32)
    s, e = gen.bounds[2]
    assert torch.equal(first, again) and offsets.tolist() == [o - gen.offsets[s] for o in gen.offsets[s:e + 1].tolist()]
    assert torch.allclose(first.norm(dim=-1), torch.ones(first.shape[0]), atol=1e-5)
    assert not torch.equal(gen.chunk(1, "cpu", torch.float32)[0][:3], first[:3])
    # the same seed draws the same corpus; another seed another one
    assert torch.equal(Generated(PASSAGES, 16, seed=3).lengths, gen.lengths)
    assert not torch.equal(Generated(PASSAGES, 16, seed=4).lengths, gen.lengths)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_layouts_hold_the_generated_chunks(storage):
    gen = Generated(PASSAGES, 16, seed=1, chunk_tokens=64)
    docs = resident_layout(gen, storage, "cpu", torch.bfloat16)
    assert torch.equal(docs.offsets, gen.offsets) and docs.values.shape == (gen.tokens, 16)
    for i, (s, _) in enumerate(gen.bounds):
        x, _ = gen.chunk(i, "cpu", torch.bfloat16)
        t0 = int(gen.offsets[s])
        if storage == "bf16":
            assert torch.equal(docs.values[t0:t0 + x.shape[0]], x)
        else:
            want = flash_maxsim.quantize(flash_maxsim.PackedDocuments(x, torch.tensor([0, x.shape[0]])))
            assert torch.equal(docs.values[t0:t0 + x.shape[0]], want.values)
            assert torch.equal(docs.scales[t0:t0 + x.shape[0]], want.scales)
    if storage == "bf16":
        padded, mask = padded_layout(docs, gen)
        assert padded.shape == (57, gen.max_len, 16) and torch.equal(mask.sum(1), gen.lengths)
        assert torch.equal(padded[mask], docs.values) and not padded[~mask].any()


def test_stable_topk_puts_equal_scores_lower_position_first():
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.5], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    values, where = stable_topk(scores, 4)
    assert where.tolist() == [[1, 3, 4, 2], [3, 0, 1, 2]]
    assert values.tolist() == [[3.0, 3.0, 3.0, 2.0], [1.0, 0.0, 0.0, 0.0]]
    # merged partial results given in position order keep that rule
    parts = [stable_topk(scores[:, :3], 2), stable_topk(scores[:, 3:], 2)]
    parts = [(v, i + off) for (v, i), off in zip(parts, (0, 3))]
    merged = merge_stable(parts, 3)
    assert merged[1].tolist() == [[1, 3, 4], [3, 0, 1]]


def test_compare_topk_tells_identical_correct_and_wrong():
    exact = torch.tensor([[5.0, 1.0, 4.0, 3.0, 4.5]])
    truth = stable_topk(exact, 3)                    # documents 0, 4, 2

    def of(idx):
        return exact.gather(1, idx)
    same = compare_topk(truth, truth, 1e-3, exact_of=of)
    assert same["identical"] and same["ok"] and same["recall"] == 1.0
    # document 3 (4 points below the k-th score... 1 point below 4.0) instead of 2: wrong
    wrong = compare_topk((torch.tensor([[5.0, 4.5, 3.0]]), torch.tensor([[0, 4, 3]])), truth, 1e-3, exact_of=of)
    assert not wrong["identical"] and not wrong["ok"] and wrong["recall"] == pytest.approx(2 / 3)
    assert wrong["kth_gap"] == pytest.approx(1.0)
    # within tolerance of the k-th score: a correct top-k that is not the identical one
    near = compare_topk((torch.tensor([[5.0, 4.5, 3.0]]), torch.tensor([[0, 4, 3]])), truth, 1.5, exact_of=of)
    assert near["ok"] and not near["identical"]
    # an approximate search misses documents by design: only its scores are held to the tolerance
    approx = compare_topk((torch.tensor([[5.0, 4.5, 3.0]]), torch.tensor([[0, 4, 3]])), truth, 1e-3, exact_of=of,
                          exact=False)
    assert approx["ok"] and approx["recall"] < 1
    bad_scores = compare_topk((torch.tensor([[5.0, 4.0, 4.0]]), truth[1]), truth, 1e-3, exact_of=of)
    assert not bad_scores["ok"] and bad_scores["score_err"] == pytest.approx(0.5)
    assert not compare_topk((truth[0][:, :2], truth[1][:, :2]), truth, 1e-3)["ok"]


@pytest.mark.parametrize("corpus", [PASSAGES, PAGES], ids=["ragged", "equal-lengths"])
@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_torch_chunked_search_and_regenerated_truth_find_the_exact_topk(corpus, storage):
    corpus = Corpus(corpus.name, corpus.label, corpus.kind, 18, corpus.length, corpus.mean, corpus.min_len,
                    corpus.max_len)
    gen = Generated(corpus, 32, seed=2, chunk_tokens=60)
    docs = resident_layout(gen, storage, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    queries = torch.nn.functional.normalize(torch.randn(2, 4, 32, generator=g), dim=-1).to(torch.bfloat16)
    full = flash_maxsim.maxsim(queries, docs)
    truth = stable_topk(full, 5)
    # the per-chunk search, merged, is exactly flash_maxsim.search over the whole corpus
    regen = regenerated_topk(gen, storage, len(gen.bounds), queries, 5, "cpu", torch.bfloat16)
    assert torch.equal(regen[1], truth[1]) and torch.equal(regen[0], truth[0])
    assert len(gen.bounds) >= 2
    plan = torch_chunk_plan(gen, docs, 2, 4, sim_bytes=4 * gen.max_len * 32 * 6)     # 4 documents a chunk
    assert len(plan) == -(-corpus.docs // 4)
    got = torch_chunked_search(queries, docs, 5, plan, corpus.length)
    check = compare_topk(got, truth, 0.05, exact_of=lambda idx: full.gather(1, idx))
    assert check["ok"] and check["recall"] >= 0.8, check


def test_cpu_smoke_run_measures_every_row_and_renders(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASH_MAXSIM_PYPI_DIR")}
    done = subprocess.run([sys.executable, str(SEARCH_BENCH), "--cpu-smoke", "--queries", "1,4", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "search.json").read_text())
    assert res["meta"]["smoke"] and res["meta"]["kind"] == "search"
    assert {"copy_bw_Bps", "bf16_mm_flops", "h2d_Bps"} <= set(res["roofline"])
    rows = res["search"]
    # 2 corpora x 2 storages x 3 placements x 2 batch sizes
    assert len(rows) == 24
    assert {(r["corpus"], r["storage"], r["placement"]) for r in rows} == {
        (c, s, p) for c in ("passages-300", "pages-40") for s in ("bf16", "int8")
        for p in ("resident", "host", "sharded")}
    for row in rows:
        ours = row["results"]["ours"]
        assert ours["status"] == "ok" and ours["identical"], (row["name"], ours)
        assert row["floor_ms"] > 0 and row["corpus_bytes"] > 0
        if row["placement"] == "resident":
            assert row["reference_check"]["ok"], row["reference_check"]
            assert row["results"]["maxsim"]["status"] == "ok" and row["results"]["maxsim"]["max_abs_diff"] == 0
            chunked = row["results"]["torch_chunked"]
            assert chunked["status"] == "ok" and chunked["recall"] >= 0.9, chunked
            # the peers' kernels need CUDA: recorded as skipped, never raised
            assert {row["results"][k]["status"] for k in ("lik", "fmpypi")} == {"skipped"}
        else:
            assert "stands in for" in row["note"]
    assert "CPU smoke run" in (tmp_path / "search.md").read_text()
    page = report.render_page([], [], tmp_path / "page.md", plots_dir=None, search=[res])
    assert "## Search" in page and f"### Search on {res['meta']['device']}" in page
    assert page.count("| passages 300 (smoke) · int8 · host | 4 |") == 4     # time, floors, memory, checks
