"""report.py: the documentation page, one run's tables and merged runs, rendered from a small hand-made results
JSON whose numbers must appear in the right cells."""

import json

import pytest

import report


def _ok(ms, peak_mb, **extra):
    return {"status": "ok", "ok": True, "ms": ms, "peak_mb": peak_mb, **extra}


def _host(us, gpu_us, kernels, launches, enqueue_us, **extra):
    return {"status": "ok", "us": us, "us_rounds": [us, us + 5, us - 5], "enqueue_us": enqueue_us, "gpu_us": gpu_us,
            "kernels": kernels, "launches": launches, "aten_ops": 20, **extra}


@pytest.fixture
def run():
    """One GPU's results: a forward, a training and a compressed-index row, one peer missing, one result wrong."""
    return {
        "meta": {"date": "2030-01-02T03:04:05", "device": "Test GPU 9000", "smoke": False, "torch": "2.99",
                 "triton": "3.99", "python": "3.12.0", "git_commit": "abc1234", "git_dirty": False,
                 "timer": "triton.testing.do_bench", "warmup_ms": 10.0, "rep_ms": 50.0, "dtype": "bfloat16",
                 "peers": {"lik": "late-interaction-kernels 0.4.5"},
                 "peers_missing": {"fmpypi": "import flash_maxsim_pypi failed: no such module"},
                 "elapsed_s": 42.0},
        "roofline": {"copy_bw_Bps": 4.2e12, "bf16_mm_flops": 7.4e14, "mm_n": 8192, "mm8_n": 8192,
                     "int8_mm_ops": 1.28e14, "fp8_mm_flops": 1.5e15},
        "forward": [{
            "name": "1x1k, 32x300", "Nq": 1, "B": 1000, "Lq": 32, "Ld": 300, "d": 128, "floor_ms": 0.075,
            "target_ms": 0.035, "results": {
                "ours": _ok(0.150, 0.004, ref_max_abs_diff=1.9e-06, ref_ok=True, ms_rounds=[0.15, 0.14, 0.16]),
                "torch_bf16": _ok(0.600, 18.4, max_abs_diff=0.035, tol=0.077),
                "lik": _ok(0.300, 0.004, max_abs_diff=1.9e-06, tol=0.0026, variant="maxsim",
                           peer="late-interaction-kernels 0.4.5", ms_rounds=[0.3, 0.3, 0.31]),
                "fmpypi": {"status": "skipped", "error": "import flash_maxsim_pypi failed: no such module"}}}],
        "training": [{
            "name": "ColBERT in-batch B128, 32x300", "Nq": 128, "B": 128, "Lq": 32, "Ld": 300, "d": 128,
            "layout": "inbatch", "smooth_tau": None, "floor_ms": 0.054, "target_ms": 0.3, "target_mb": 32,
            "pytorch_share_ms": 0.211, "results": {
                "ours": _ok(0.846, 11.5, ref_max_abs_diff=1.9e-06, ref_grad_rel_err=0.0027, ref_ok=True,
                            graph_ms=0.208),
                "eager": _ok(2.894, 1655.0, max_abs_diff=0.038, tol=0.08, grad_rel_err=0.2, grad_tol=0.5),
                "lik": {"status": "wrong", "ok": False, "ms": 1.166, "peak_mb": 33.0, "max_abs_diff": 0.5,
                        "tol": 0.0026, "grad_rel_err": 0.9, "grad_tol": 0.02, "peer": "late-interaction-kernels"}}}],
        "host": [
            {"name": "in-batch B8, 32x64", "Nq": 8, "B": 8, "Lq": 32, "Ld": 64, "d": 128, "steps": 200,
             "margin_us": 150.0, "results": {
                 "ours": _host(702.4, 45.2, 2, 2, 310.0, ref_ok=True, ok=True),
                 "fmpypi": _host(834.0, 30.1, 3, 3, 640.0, peer="flash-maxsim 0.3.0", ok=True),
                 "lik": _host(1151.0, 52.0, 4, 4, 900.0, peer="late-interaction-kernels 0.4.5", ok=True),
                 "pytorch_share": _host(348.3, 9.9, 5, 5, 300.0)}},
            {"name": "ColBERT in-batch B128, 32x300", "Nq": 128, "B": 128, "Lq": 32, "Ld": 300, "d": 128,
             "steps": 200, "margin_us": 150.0, "results": {
                 "ours": _host(600.0, 190.0, 3, 3, 290.0, ref_ok=True, ok=True),
                 "fmpypi": {"status": "skipped", "error": "import flash_maxsim_pypi failed: no such module"},
                 "lik": _host(1264.0, 420.0, 4, 4, 1000.0, peer="late-interaction-kernels 0.4.5", ok=True),
                 "pytorch_share": _host(519.0, 12.0, 5, 5, 500.0)}}],
        "compressed": [{
            "name": "1x10k, 32x300", "Nq": 1, "B": 10000, "Lq": 32, "Ld": 300, "d": 128, "flops": 2.46e10,
            "int8_index_bytes": 10000 * 300 * 130, "memory_floor_ms": {"unquantised": 0.182, "int8": 0.094},
            "compute_floor_ms": {"bf16": 0.033, "int8": 0.192, "fp8": 0.016}, "target_ms": 0.11,
            "target_bytes_ratio": 0.53, "results": {
                "ours_int8": _ok(0.111, 0.0, bytes_ratio=0.516, memory_floor_ms=0.094, fid_max_rel_err=1.8e-3,
                                 fid_mean_rel_err=4.5e-4, fid_docs=1000, max_abs_diff=9.5e-07, tol=0.0069,
                                 prepare_s=0.02),
                "lik": _ok(0.141, 0.0, bytes_ratio=0.516, memory_floor_ms=0.094, fid_max_rel_err=7.2e-3,
                           fid_mean_rel_err=1.7e-3, fid_docs=1000, max_abs_diff=7.5e-4, tol=0.0069,
                           variant="maxsim_inference_fp8, per-token scales, query pre-quantised",
                           peer="late-interaction-kernels 0.4.5")}}],
    }


@pytest.fixture
def fidelity():
    scorer = {"ndcg@10": 0.693365, "delta_ndcg@10": 0.0, "top10_identical": 50, "top10_overlap_mean": 1.0,
              "abs_error": {"max": 3.6e-06}, "rel_error_max": 2.7e-07}
    return {"device": "cpu", "device_name": "", "results": [
        {"dataset": "beir-tiny", "queries": 50, "scorers": {"flash_maxsim": scorer}}]}


def _search_row(corpus, label, storage, placement, nq, docs, floors, results, **extra):
    live = {k: v for k, v in floors.items() if v is not None}
    kind = max(live, key=live.get)
    return {"name": f"{label} · {storage} · {placement} · {nq}q", "corpus": corpus, "label": label,
            "kind": "passages", "storage": storage, "placement": placement, "Nq": nq, "Lq": 32, "k": 10, "d": 128,
            "docs": docs, "docs_nominal": docs, "tokens": 70 * docs, "corpus_bytes": 130 * 70 * docs,
            "floors": floors, "floor_ms": live[kind], "floor_kind": kind.replace("_ms", ""), "gpus": 1,
            "results": results, **extra}


@pytest.fixture
def search_run():
    """One search run: a resident int8 corpus at 1 and 8 queries (a peer skipped, one wrong), a host-streamed row
    sized to the host memory, a sharded row on one GPU."""
    identical = {"identical": True, "recall": 1.0, "ok": True, "exact": True, "score_err": 0.0, "kth_gap": 0.0,
                 "tol": 0.00264}
    ref = {"ok": True, "identical": True, "recall": 1.0, "docs": 256}
    return {
        "meta": {"date": "2030-01-02T03:04:05", "device": "Test GPU 9000", "smoke": False, "torch": "2.99",
                 "triton": "3.99", "python": "3.12.0", "git_commit": "abc1234", "git_dirty": False,
                 "timer": "triton.testing.do_bench", "warmup_ms": 10.0, "rep_ms": 50.0, "dtype": "bfloat16",
                 "peers": {"lik": "late-interaction-kernels 0.4.5"}, "peers_missing": {}, "kind": "search",
                 "gpus": 1, "k": 10, "elapsed_s": 300.0},
        "roofline": {"copy_bw_Bps": 4.2e12, "bf16_mm_flops": 7.4e14, "mm_n": 8192, "int8_mm_ops": 1.28e15,
                     "h2d_Bps": 5.3e10},
        "search": [
            _search_row("passages-8.8m", "passages 8.8M", "int8", "resident", 1, 8_841_823,
                        {"hbm_ms": 20.0, "tensor_ms": 0.5},
                        {"ours": _ok(22.0, 1.5, **identical), "maxsim": _ok(21.5, 35.0, max_abs_diff=0.0, tol=0.003),
                         "torch_chunked": _ok(900.0, 4000.0, identical=False, recall=0.99, ok=True, exact=True,
                                              timing="median of 2 calls (slow)"),
                         "lik": {"status": "skipped", "error": "no 8-bit top-k in the peer"}},
                        reference_check=ref),
            _search_row("passages-8.8m", "passages 8.8M", "int8", "resident", 8, 8_841_823,
                        {"hbm_ms": 20.0, "tensor_ms": 40.0},
                        {"ours": _ok(52.0, 3.0, **identical), "maxsim": _ok(50.0, 280.0, max_abs_diff=0.0, tol=0.003),
                         "lik": {"status": "wrong", "ok": False, "ms": 80.0, "peak_mb": 10.0, "recall": 0.5,
                                 "kth_gap": 0.7, "score_err": 0.0, "tol": 0.00264, "exact": True}},
                        reference_check=ref),
            _search_row("passages-8.8m", "passages 8.8M", "bf16", "host", 8, 4_000_000,
                        {"hbm_ms": None, "tensor_ms": 20.0, "h2d_ms": 1000.0},
                        {"ours": _ok(1100.0, 600.0, h2d_fraction=0.909, rate_Bps=4.8e10, **identical)},
                        note="sized to the host memory: the first 4,000,000 of 8,841,823 documents"),
            _search_row("passages-100k", "passages 100k", "int8", "sharded", 1, 100_000,
                        {"hbm_ms": 0.2, "tensor_ms": 0.01},
                        {"ours": _ok(0.5, 1.0, **identical)},
                        note="one GPU: the sharded placement holds one shard (N-GPU scaling not measurable here)"),
        ]}


@pytest.fixture
def quality():
    plaid = {"ndcg@10": 0.31, "ndcg@10_exact": 0.33, "recall@10": 0.87, "identical_to_exhaustive": 12,
             "identical_to_reference_up_to_ties": 12, "seconds": 1.5, "build_seconds": 20.0}
    search = {"ndcg@10": 0.33, "ndcg@10_exact": 0.33, "recall@10": 1.0, "identical_to_exhaustive": 50,
              "identical_to_reference_up_to_ties": 50, "seconds": 0.25}
    return {"device": "cpu", "device_name": "", "results": [
        {"dataset": "beir-tiny", "queries": 50, "scorers": {},
         "retrievers": {"search": search, "plaid": plaid, "voyager": {"error": "ImportError: no voyager"}}}]}


@pytest.fixture
def cpu():
    """cpu_bench.py's JSON: a scoring row with two peers and a training step (no peer has a backward)."""
    def row(name, shape, train, ms, peak, diff):
        best = None if train else round(ms["flash_maxsim"] / min(v for k, v in ms.items()
                                                                   if k not in ("eager", "flash_maxsim")), 3)
        return {"row": name, "shape": shape, "Nq": 1, "B": 1000, "Lq": 32, "Ld": 300, "d": 128, "train": train,
                "rounds": 5, "ms": ms, "vs_eager": {k: round(v / ms["eager"], 3) for k, v in ms.items()},
                "flash_vs_best_peer": best, "peak_mib": peak, "max_abs_diff_vs_eager": diff}

    return {
        "date": "2030-01-02T03:04:05",
        "machine": {"platform": "Linux-9.9-x86_64", "processor": "x86_64", "cpus": 4, "torch": "2.99.0+cpu",
                    "torch_threads": 3, "python": "3.12.1", "model": "Test CPU 7", "peers": {"rust-a": "1.2.3",
                    "rust-b": "0.4.0"}, "peer_threads": "all cores"},
        "load_before": [0.25, 0.5, 0.5], "load_after": [1.5, 1.0, 0.75],
        "rows": [row("1x1k", "1 x 1000 docs, 32 x 300, d=128, fp32, scoring", False,
                     {"eager": 80.0, "flash_maxsim": 40.0, "rust-a": 50.0, "rust-b": 44.0},
                     {"eager": 36.6, "flash_maxsim": 18.2, "rust-a": 0.0, "rust-b": 0.1},
                     {"eager": 0.0, "flash_maxsim": 0.0, "rust-a": 2.4e-06, "rust-b": 1.2e-06}),
                 row("train-B32", "32 x 32 docs, 32 x 300, d=128, fp32, in-batch training step", True,
                     {"eager": 150.0, "flash_maxsim": 45.0}, {"eager": 122.4, "flash_maxsim": 19.1},
                     {"eager": 0.0, "flash_maxsim": 3.7e-09})],
    }


def _row(text: str, first_cell: str, table_heading: str) -> str:
    """The line of the table under ``table_heading`` whose first cell is ``first_cell``."""
    section = text.split(table_heading, 1)[1]
    return next(line for line in section.splitlines() if line.startswith(f"| {first_cell} |"))


def test_page_tables_hold_the_runs_numbers(run, fidelity, tmp_path):
    page = report.render_page([run], [fidelity], tmp_path / "benchmarks.md", plots_dir=None)
    assert "## Test GPU 9000" in page and "[Test GPU 9000](#test-gpu-9000)" in page
    assert "flash_maxsim at `abc1234`" in page and "**4.2 TB/s**" in page and "**740 TFLOP/s**" in page
    # forward: ours, eager bf16, LIK with its version, the missing peer as a footnoted skip; floor, ratio, % of floor
    head = _row(page, "shape (queries×docs, Lq×Ld)", "### Forward: time")
    assert head.split(" | ")[1:5] == ["flash_maxsim", "eager bf16", "LIK 0.4.5", "flash-maxsim"]
    assert _row(page, "1x1k, 32x300", "### Forward: time") == \
        "| 1x1k, 32x300 | 0.150 | 0.600 | 0.300 | skip [1] | 0.075 | 0.50 | 50% |"
    assert "[1] skipped: import flash_maxsim_pypi failed: no such module" in page
    assert _row(page, "1x1k, 32x300", "### Forward: peak memory") == "| 1x1k, 32x300 | 0.0 | 18 | 0.0 | skip [1] |"
    # training: ms / MB cells, a wrong peer marked and never the "best peer" (no ratio), the CUDA-graph table
    assert _row(page, "ColBERT in-batch B128, 32x300", "### Training step: time").startswith(
        "| ColBERT in-batch B128, 32x300 | 0.846 / 12 | 2.894 / 1655 | 1.166 / 33 ✗[1] | 0.054 | – | 6% |")
    assert "gradient rel. error 0.9 (tol 0.02)" in page
    assert _row(page, "ColBERT in-batch B128, 32x300", "### Training step: GPU time") == \
        "| ColBERT in-batch B128, 32x300 | 0.208 | – | – | 0.846 | 0.211 |"
    # host cost: µs per step of each method and PyTorch's share, ours above the share; GPU µs, kernels, launches
    head = _row(page, "eager training step", "### Eager training step: host cost")
    assert head.split(" | ")[1:5] == ["flash_maxsim µs", "flash-maxsim µs", "LIK 0.4.5 µs", "PyTorch's share µs"]
    assert _row(page, "in-batch B8, 32x64", "### Eager training step: host cost") == \
        "| in-batch B8, 32x64 | 702 | 834 | 1151 | 348 | +354 |"
    assert _row(page, "ColBERT in-batch B128, 32x300", "### Eager training step: host cost") == \
        "| ColBERT in-batch B128, 32x300 | 600 | skip [1] | 1264 | 519 | +81 |"
    assert _row(page, "in-batch B8, 32x64", "### Eager training step: GPU time") == \
        "| in-batch B8, 32x64 | 45 / 2 / 2 / 310 | 30 / 3 / 3 / 640 | 52 / 4 / 4 / 900 | 10 / 5 / 5 / 300 |"
    assert _row(page, "ColBERT in-batch B128, 32x300", "### Eager training step: GPU time") == \
        "| ColBERT in-batch B128, 32x300 | 190 / 3 / 3 / 290 | – | 420 / 4 / 4 / 1000 | 12 / 5 / 5 / 500 |"
    # compressed index: time, bytes ratio, floor, fidelity; the floors table counts d + 2 bytes per token
    assert _row(page, "1x10k, 32x300", "### Compressed index: time") == \
        "| 1x10k, 32x300 | flash_maxsim int8 | 0.111 | 0.516 | 0.094 | 85% | 1.8e-03 |"
    assert "| LIK 0.4.5 fp8 (maxsim_inference_fp8, per-token scales, query pre-quantised) | 0.141 |" in page
    assert "int8 index (d + 2 B/token)" in page
    # retrieval fidelity
    assert "| beir-tiny | CPU | flash_maxsim | 0.6934 | +0.0e+00 | 50/50 | 1.000 | 3.6e-06 | 2.7e-07 |" in page
    # the page leaves the design targets out
    assert "met?" not in page and "target ms" not in page


def test_page_cpu_section_holds_the_cpu_runs_numbers(run, fidelity, cpu, tmp_path):
    page = report.render_page([run], [fidelity], tmp_path / "benchmarks.md", plots_dir=None, cpu=cpu)
    assert "· [CPU](#cpu) · [Retrieval fidelity](#retrieval-fidelity)" in page
    assert page.index("## Test GPU 9000") < page.index("\n## CPU\n") < page.index("## Retrieval fidelity")
    section = page.split("\n## CPU\n", 1)[1].split("## Retrieval fidelity", 1)[0]
    # the machine, threads and load; what runs; the method with its rounds and the agreement with eager
    assert "on **Test CPU 7, 4 logical CPUs** (Linux-9.9-x86_64): torch 2.99.0+cpu with **3 intra-op threads**" \
        in section
    assert "peers rust-a 1.2.3, rust-b 0.4.0 with their thread pool on all cores" in section
    assert "load average (1 min) 0.25 before the run, 1.50 after it" in section
    assert "| rust-a 1.2.3 / rust-b 0.4.0 | Rust SIMD extensions" in section
    assert "the median of 5 rounds and its ratio to eager's median" in section
    assert "largest absolute difference: flash_maxsim 3.7e-09, rust-a 1.2.3 2.4e-06, rust-b 0.4.0 1.2e-06." in section
    # time: eager's ms, the others' ms (÷ eager), ours / best peer; the training row has no peer
    head = _row(section, "row", "### CPU: time")
    assert head == "| row | shape | eager | flash_maxsim | rust-a 1.2.3 | rust-b 0.4.0 | ours / best peer |"
    assert _row(section, "1x1k", "### CPU: time") == ("| 1x1k | 1 x 1000 docs, 32 x 300, d=128, fp32, scoring | "
                                                      "80.0 | 40.0 (0.50) | 50.0 (0.62) | 44.0 (0.55) | 0.91 |")
    assert _row(section, "train-B32", "### CPU: time") == ("| train-B32 | 32 x 32 docs, 32 x 300, d=128, fp32, "
                                                           "in-batch training step | 150.0 | 45.0 (0.30) | – | – | – |")
    # peak memory
    assert _row(section, "1x1k", "### CPU: peak memory") == "| 1x1k | 37 | 18 | 0.0 | 0.1 |"
    assert _row(section, "train-B32", "### CPU: peak memory") == "| train-B32 | 122 | 19 | – | – |"
    assert "![" not in section                               # no plots asked for


def test_page_cpu_section_without_peers(cpu, tmp_path):
    cpu["machine"]["peers"] = {}
    for r in cpu["rows"]:
        for field in ("ms", "vs_eager", "peak_mib", "max_abs_diff_vs_eager"):
            r[field] = {k: v for k, v in r[field].items() if k in ("eager", "flash_maxsim")}
        r["flash_vs_best_peer"] = None
    page = report.render_page([], [], tmp_path / "benchmarks.md", plots_dir=None, cpu=cpu)
    assert "Sections: [CPU](#cpu)\n" in page and "; no peer installed;" in page
    assert _row(page, "1x1k", "### CPU: time") == \
        "| 1x1k | 1 x 1000 docs, 32 x 300, d=128, fp32, scoring | 80.0 | 40.0 (0.50) | – |"
    assert "Rust SIMD" not in page


def test_page_cpu_section_only_adds(run, fidelity, cpu, tmp_path):
    """The CPU section adds its link and its section; the rest of the page is unchanged."""
    without = report.render_page([run], [fidelity], tmp_path / "benchmarks.md", plots_dir=None)
    with_cpu = report.render_page([run], [fidelity], tmp_path / "benchmarks.md", plots_dir=None, cpu=cpu)
    start, end = with_cpu.index("## CPU\n"), with_cpu.index("## Retrieval fidelity")
    assert with_cpu[:start].replace(" · [CPU](#cpu)", "", 1) + with_cpu[end:] == without


def test_run_tables_show_the_design_targets(run):
    tables = report.render_run(run)
    assert _row(tables, "1x1k, 32x300", "### Forward: time").endswith("| ≤ 0.035 | no (target) |")
    assert "≤ 0.3 / ≤ 32 | no (time target) |" in tables
    assert _row(tables, "1x10k, 32x300", "### Compressed index: time").endswith(
        "| ≤ 0.11 ms, ≤ 0.53× | no (time) |")
    # the host goal: PyTorch's share + the row's margin, and no peer faster
    assert _row(tables, "in-batch B8, 32x64", "### Eager training step: host cost").endswith(
        "| +354 | ≤ 498 | no (above the share's margin) |")
    assert _row(tables, "ColBERT in-batch B128, 32x300", "### Eager training step: host cost").endswith(
        "| +81 | ≤ 669 | yes |")


def test_merged_runs_take_later_sections(run):
    later = json.loads(json.dumps(run))
    later["meta"]["date"] = "2030-02-03T00:00:00"
    later["forward"][0]["results"]["ours"]["ms"] = 0.125
    del later["training"], later["host"], later["compressed"]
    merged = report.merge_results([run, later])
    assert merged["forward"][0]["results"]["ours"]["ms"] == 0.125
    assert merged["training"] == run["training"] and merged["meta"]["date"] == run["meta"]["date"]
    assert merged["meta"]["merged_runs"][0]["sections"] == ["forward"]
    assert "Sections forward come from another run, of 2030-02-03T00:00:00" in report.render_run(merged)
    assert "merged_runs" not in run["meta"]


def test_page_command_writes_the_page_and_its_plots(run, fidelity, cpu, search_run, quality, tmp_path):
    pytest.importorskip("matplotlib")
    results, fid, cpu_results = tmp_path / "gpu.json", tmp_path / "fidelity.json", tmp_path / "cpu.json"
    searched, judged = tmp_path / "search-test.json", tmp_path / "search-quality.json"
    results.write_text(json.dumps(run))
    fid.write_text(json.dumps(fidelity))
    cpu_results.write_text(json.dumps(cpu))
    searched.write_text(json.dumps(search_run))
    judged.write_text(json.dumps(quality))
    page, plots = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks"
    assert report.main(["page", str(results), "--fidelity", str(fid), "--cpu", str(cpu_results), "--search",
                        str(searched), "--search-quality", str(judged), "--out", str(page), "--plots",
                        str(plots)]) == 0
    assert sorted(p.name for p in plots.iterdir()) == ["cpu-time.png", "test-2-search.png", "test-compressed.png",
                                                       "test-forward.png", "test-training.png"]
    text = page.read_text()
    for name in ("test-forward.png", "test-training.png", "test-compressed.png", "cpu-time.png",
                 "test-2-search.png"):
        assert f"](benchmarks/{name})" in text
        assert (plots / name).stat().st_size > 10_000
    assert text.index("### CPU: time") < text.index("](benchmarks/cpu-time.png)") < text.index("| 1x1k |")
    assert text.index("## CPU") < text.index("## Search") < text.index("## Retrieval fidelity")
    # --no-cpu: no CPU section, no CPU plot; no search files: no search section
    for png in plots.iterdir():
        png.unlink()
    assert report.main(["page", str(results), "--fidelity", str(fid), "--no-cpu", "--search", "--search-quality",
                        "--out", str(page), "--plots", str(plots)]) == 0
    text = page.read_text()
    assert "## CPU" not in text and not (plots / "cpu-time.png").exists()
    assert "## Search" not in text and not (plots / "test-2-search.png").exists()
    # the quality table alone: the search section without the GPU runs' method text
    assert report.main(["page", str(results), "--fidelity", "--no-cpu", "--search", "--search-quality", str(judged),
                        "--out", str(page), "--no-plots"]) == 0
    text = page.read_text()
    assert "## Search" in text and "### Retrieval quality on BEIR subsets" in text and "**Floors**" not in text


def test_search_section_holds_the_runs_numbers(search_run, quality, tmp_path):
    page = report.render_page([], [], tmp_path / "benchmarks.md", plots_dir=None, search=[search_run],
                              quality=[quality])
    assert "[Search](#search)" in page and "### Search on Test GPU 9000" in page
    assert "pinned host-to-device copy **53 GB/s**" in page and "int8 matmul **1.28e+03 TOP/s**" in page
    time_head = "#### Search: time"
    assert _row(page, "passages 8.8M · int8 · resident", time_head) == (
        "| passages 8.8M · int8 · resident | 1 | 8,841,823 | 80.5 | 22.0 | 21.5 | 900.0 | skip [1] | 20.0 (HBM) "
        "| 1.10 |")
    assert "[1] skipped: no 8-bit top-k in the peer" in page
    # a wrong peer is marked with what is wrong; a row's note is a footnote of the table
    section = page.split(time_head, 1)[1].split("####", 1)[0]
    assert "| 8 | 8,841,823 | 80.5 | 52.0 | 50.0 | – | 80.0 ✗[2] | 40.0 (tensor) | 1.30 |" in section
    assert "✗ = not the exact top-k within tolerance (recall 0.500, k-th score short by 0.7" in section
    assert "passages 8.8M · bf16 · host: sized to the host memory" in section
    ratio = _row(page, "passages 8.8M · bf16 · host", "#### Search: ours against the floors")
    assert ratio == "| passages 8.8M · bf16 · host | 8 | 1100.0 | – | 20.0 | 1000.0 | – | 55.00 | 91% | – | – |"
    ratios = page.split("#### Search: ours against the floors", 1)[1].split("####", 1)[0]
    assert "| passages 8.8M · int8 · resident | 1 | 22.0 | 20.0 | 0.500 | – | 1.10 | 44.00 | – | 1.023 | – |" in ratios
    checks = page.split("#### Search: checks", 1)[1].split("###", 1)[0]
    assert "| passages 8.8M · int8 · resident | 1 | ok | identical | max |Δ| 0 | recall 0.990 | – |" in checks
    assert "| 8 | ok | identical | max |Δ| 0 | – | recall 0.500 ✗ |" in checks
    # the quality table: nDCG, its difference to exact, recall, identical rankings; an error says so
    assert "| beir-tiny | CPU | PLAID (PyLate, fast-plaid) | 0.3100 | -0.0200 | 0.870 | 12/50 |" in page
    assert "| beir-tiny | CPU | flash_maxsim.search | 0.3300 | +0.0000 | 1.000 | 50/50 |" in page
    assert "| beir-tiny | CPU | Voyager (PyLate) | error: ImportError: no voyager | – | – | – |" in page
    # the page leaves the goals out; a run's tables list them
    assert "#### Search: goals" not in page
    goals = {g[0]: g[1:] for g in report.search_goals(search_run)}
    assert goals["resident int8, 8.8M passages, 1 query: ≤ 1.15× its HBM floor"] == \
        ("22.000 ms = 1.10× (20.000 ms)", "yes")
    assert goals["resident int8, 8.8M passages, 8 queries: ≤ 1.25× its tensor-core floor"] == \
        ("52.000 ms = 1.30× (40.000 ms)", "no")
    assert goals["host-streamed index: ≥ 85% of the pinned host-to-device bandwidth"][1] == "yes"
    assert goals["top-k costing ≤ 5% over maxsim on the same corpus"] == \
        ("+4.0% at worst (passages 8.8M · int8 · resident · 8q)", "yes")
    assert goals["N GPUs ≥ 0.9·N times one GPU's throughput"] == ("not measurable: 1 GPU", "–")
    assert "### Search: goals" in report.render_search_run(search_run)


def test_merged_search_runs_replace_rows_by_name(search_run):
    later = json.loads(json.dumps(search_run))
    later["meta"]["date"] = "2030-02-03T00:00:00"
    later["search"] = [later["search"][0]]
    later["search"][0]["results"]["ours"]["ms"] = 21.0
    extra = json.loads(json.dumps(search_run["search"][3]))
    extra["name"], extra["Nq"] = "passages 100k · int8 · sharded · 8q", 8
    later["search"].append(extra)
    merged = report.merge_search([search_run, later])
    assert [r["name"] for r in merged["search"]] == [r["name"] for r in search_run["search"]] + [extra["name"]]
    assert merged["search"][0]["results"]["ours"]["ms"] == 21.0 and merged["search"][1] == search_run["search"][1]
    assert merged["meta"]["merged_runs"][0]["groups"] == ["passages 100k · int8 · sharded",
                                                           "passages 8.8M · int8 · resident"]
    assert "come from another run, of 2030-02-03T00:00:00" in report.render_search_run(merged)
    assert search_run["search"][0]["results"]["ours"]["ms"] == 22.0
