"""retrieval_fidelity.py scoring on another machine, run on the CPU: packs exported, scored one by one and brought
back compare exactly as the whole corpus scored in one go, and a missing or skipped pack is an error."""

import importlib.metadata
import importlib.util
import json

import pytest
import torch

import retrieval_fidelity as rf


@pytest.fixture
def beir_with_cache(tmp_path):
    """A 7-document BEIR folder and a cache of random token embeddings for it (ragged documents, d = 16)."""
    folder = tmp_path / "beir-tiny"
    (folder / "qrels").mkdir(parents=True)
    docs = [{"_id": f"d{i}", "title": "", "text": f"document {i}"} for i in range(7)]
    queries = [{"_id": f"q{i}", "text": f"query {i}"} for i in range(3)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td1\t1\nq1\td4\t2\nq2\td6\t1\n")
    g = torch.Generator().manual_seed(0)
    embeddings = [torch.randn(n, 16, generator=g) for n in (5, 9, 3, 12, 7, 4, 10)]
    digest = rf.file_digest(folder / "corpus.jsonl", folder / "queries.jsonl", folder / "qrels" / "test.tsv")
    cache = tmp_path / "cache"
    rf.save_cache(cache / folder.name / "synthetic", {"dataset": folder.name, "data_digest": digest,
                                                      "encoder": {"model": "random"}, "documents": 7, "queries": 3},
                  torch.randn(3, 8, 16, generator=g), embeddings)
    return folder, cache


def _scorers(report):
    return {name: {k: v for k, v in s.items() if k != "seconds"} for name, s in report["results"][0]["scorers"].items()}


def test_scores_from_packs_compare_as_the_whole_corpus_does(beir_with_cache, tmp_path):
    folder, cache = beir_with_cache
    packs = tmp_path / "packs"
    # ~1.5 KB packs: the queries (768 B) and a few documents (32 B per token) each
    assert rf.main(["--data", str(folder), "--cache", str(cache), "--export-packs", str(packs),
                    "--pack-mib", str(1536 / 2**20)]) == 0
    pack_dirs = sorted(packs.iterdir())
    assert len(pack_dirs) >= 3
    pieces = [torch.load(next(p.glob("*.pt"))) for p in pack_dirs]
    sizes = [len(p["lengths"]) for p in pieces]
    assert [p["first"] for p in pieces] == [sum(sizes[:i]) for i in range(len(sizes))]    # whole documents, in order
    assert sum(len(p["lengths"]) for p in pieces) == 7
    scores = []
    for i, pack in enumerate(pack_dirs):
        out = tmp_path / f"scores-{i}.pt"
        assert rf.main(["--score-pack", str(pack), "--quantized", "int8", "--device", "cpu", "--out", str(out)]) == 0
        scores.append(str(out))
    combined, direct = tmp_path / "combined.json", tmp_path / "direct.json"
    rf.main(["--data", str(folder), "--cache", str(cache), "--device-scores", *scores, "--out", str(combined)])
    rf.main(["--data", str(folder), "--cache", str(cache), "--device", "cpu", "--quantized", "int8",
             "--out", str(direct)])
    from_packs, whole = json.loads(combined.read_text()), json.loads(direct.read_text())
    assert set(_scorers(from_packs)) == {"flash_maxsim", "flash_maxsim int8 index"}
    assert _scorers(from_packs) == _scorers(whole)
    assert from_packs["device_name"] == from_packs["results"][0]["scored_on"]

    with pytest.raises(SystemExit, match="cover .* of 7 documents"):
        rf.main(["--data", str(folder), "--cache", str(cache), "--device-scores", *scores[:-1]])     # last missing
    with pytest.raises(SystemExit, match="the next piece starts"):
        rf.main(["--data", str(folder), "--cache", str(cache), "--device-scores", scores[0], *scores[2:]])


def _pylate_installed() -> bool:
    """PyLate's distribution, not a folder named pylate on sys.path (the test tree has one, which imports as an
    empty namespace package)."""
    try:
        importlib.metadata.version("pylate")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_retrievers_compare_with_exhaustive_and_exact_search(beir_with_cache, tmp_path):
    """flash_maxsim.search and DocumentIndex return exhaustive scoring's top-10 on every query; PyLate's indexes
    are compared the same way where PyLate is installed, and recorded with their error where it is not."""
    folder, cache = beir_with_cache
    out = tmp_path / "quality.json"
    assert rf.main(["--data", str(folder), "--cache", str(cache), "--device", "cpu", "--retrievers",
                    "search,index,plaid", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    for name in ("search", "index"):
        r = result["retrievers"][name]
        # 7 documents: each top-10 list is the whole corpus, ranked exactly as exhaustive scoring ranks it
        assert r["identical_to_exhaustive"] == 3 and r["recall@10"] == 1.0, (name, r)
        assert r["ndcg@10"] == r["ndcg@10_exact"] and r["seconds"] >= 0
    plaid = result["retrievers"]["plaid"]
    if not _pylate_installed():
        assert "error" in plaid
    else:
        assert 0 <= plaid["recall@10"] <= 1 and plaid["build_seconds"] > 0


def test_compare_retrieved_counts_identical_rankings_and_recall():
    exact = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    exhaustive = exact.clone()
    qrels = {"q0": {"d0": 1}, "q1": {"d1": 2}}
    ids = ["d0", "d1", "d2", "d3"]
    # query 0: exhaustive scoring's list; query 1: its last two documents swapped (it ranks [3, 2, 1, 0])
    got = [[0, 2, 1, 3], [3, 2, 0, 1]]
    r = rf.compare_retrieved(got, exhaustive, exact, ids, ["q0", "q1"], qrels)
    assert r["identical_to_exhaustive"] == 1 and r["recall@10"] == 1.0
    assert r["ndcg@10"] < r["ndcg@10_exact"]
    # a retriever that misses documents loses recall
    short = rf.compare_retrieved([[0, 2], [3, 2]], exhaustive, exact, ids, ["q0", "q1"], qrels)
    assert short["recall@10"] == 0.5 and short["identical_to_exhaustive"] == 0


def test_pylate_index_check_on_cached_embeddings(beir_with_cache, tmp_path):
    """--pylate-index: PyLate's retriever on ExactIndex against PyLate's exhaustive rerank, from the cache."""
    if not _pylate_installed():
        pytest.skip("needs PyLate")
    folder, cache = beir_with_cache
    out = tmp_path / "pylate.json"
    assert rf.main(["--pylate-index", "--data", str(folder), "--cache", str(cache), "--device", "cpu",
                    "--pylate-k", "5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["documents"] == 7 and result["queries"] == 3 and result["k"] == 5
    assert result["identical"] + result["identical_up_to_equal_scores"] == 3 and result["differing"] == 0
    assert result["max_abs_score_difference"] < 1e-4
