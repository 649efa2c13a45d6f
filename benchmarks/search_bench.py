#!/usr/bin/env python3
"""Exact top-k search at corpus scale on a CUDA GPU: ``flash_maxsim.search`` over a resident corpus and
``flash_maxsim.DocumentIndex`` streamed from pinned host memory or sharded over the GPUs present, against the
peers' top-k (late-interaction-kernels ``retrieve``, flash-maxsim 0.3.0 ``flash_maxsim_topk``), torch chunked
scoring with a running top-k, ``flash_maxsim.maxsim``'s full scores, and optionally PyLate's PLAID and Voyager
indexes; with the HBM, tensor-core and host-to-device floors measured in the same run.

    python benchmarks/search_bench.py --out OUT                                     # every row that fits
    python benchmarks/search_bench.py --out OUT --corpora passages-8.8m --storage int8 --placements resident
    python benchmarks/search_bench.py --out OUT --scale 0.01 --budget-s 120         # every kind of row, small

Test every code path on the CPU (tiny corpora, flash_maxsim's CPU path, the "cpu" placement standing in for
"host" and "sharded", time.perf_counter timings):

    python benchmarks/search_bench.py --cpu-smoke --out /tmp/search-smoke

Rows: corpora (``--corpora``) x storage (bf16, int8) x placement (resident, host, sharded) x queries per batch
(``--queries``, 32 tokens each). A corpus is random unit vectors (timing needs no real embeddings), generated on
the GPU chunk by chunk from the seed; a row whose corpus does not fit where it is placed is recorded as skipped,
the host-streamed rows are sized to ``--host-gib`` (default: half the available host memory), and with one GPU
the sharded placement is measured on the smallest corpus only. Every top-k is checked against the exact one
(``flash_maxsim.maxsim``'s scores, ties to the lower position) and ours on a prefix against the float64
reference. ``--budget-s`` is a soft wall-clock budget: rows not started by then are recorded as skipped.

Writes into --out: search.json (every raw number, rewritten after every measurement, so that a run cut short
keeps what it measured), search.md (the tables) and search.png (with matplotlib). ``benchmarks/report.py page``
renders benchmarks/results/search-<gpu>.json on docs/benchmarks.md; ``report.py merge-search`` joins the files
of several runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import report  # noqa: E402
from _measure import (Machine, brief, error_text, interpreter_autotune_shim, measure_8bit_rates,  # noqa: E402
                      measure_host_to_device, measure_roofline, run_method, skipped, timed_call_ms, unit_tokens)
from _peers import PEER_KEYS, load_peers  # noqa: E402
from _search_corpus import (CORPORA, SMOKE_CORPORA, Generated, build_index, compare_topk, layout_prefix,  # noqa: E402
                            padded_layout, regenerated_topk, resident_layout, stable_topk,
                            storage_bytes_per_token, torch_chunk_plan, torch_chunked_search)
from _sections import PEER_MAX_ELEMENTS, _peer_or_skip, score_tolerance  # noqa: E402

log = logging.getLogger("flash_maxsim.bench")

METHODS = ("ours", "maxsim", "torch_chunked", "lik", "fmpypi", "plaid", "voyager")
DEFAULT_METHODS = ("ours", "maxsim", "torch_chunked", "lik", "fmpypi")
PLACEMENTS = ("resident", "host", "sharded")
STORAGES = ("bf16", "int8")
GIB = 2 ** 30
# room left beside a layout for scoring scratch, the truth's scores and the allocator
HEADROOM_BYTES = 2 * GIB


# ------------------------------------------------------------------------------------------------------- setup

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, required=True, help="folder for search.json, search.md and search.png")
    p.add_argument("--corpora", default=None,
                   help=f"comma list from: {', '.join(CORPORA)} (default: all; the smoke run has its own)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every corpus's document count (e.g. 0.01 for a short run of every kind of row)")
    p.add_argument("--storage", default=",".join(STORAGES), help="comma list from: bf16, int8")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="comma list from: " + ", ".join(PLACEMENTS))
    p.add_argument("--queries", default="1,8,64", help="queries per batch, comma list")
    p.add_argument("--query-tokens", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list from: {', '.join(METHODS)} (plaid and voyager build their indexes on the "
                        "host first: minutes for 100k passages)")
    p.add_argument("--peers", default="lik,fmpypi", help="comma list of peers (lik, fmpypi) or 'none'")
    p.add_argument("--host-gib", type=float, default=None,
                   help="host-streamed rows: the index's size at most (default: half the available host memory)")
    p.add_argument("--max-baseline-s", type=float, default=4.0,
                   help="skip torch chunked scoring and per-query peer loops estimated slower than this per call")
    p.add_argument("--slow-ms", type=float, default=250.0,
                   help="time a call slower than this as the median of two calls instead of do_bench's loop")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="soft wall-clock budget: measurements not started by then are recorded as skipped")
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny corpora on the CPU, timed with time.perf_counter: exercises every code path")
    p.add_argument("--interpret", action="store_true",
                   help="with --cpu-smoke: TRITON_INTERPRET=1 and fp16 inputs, so that the peers' kernels run")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.interpret and not args.cpu_smoke:
        p.error("--interpret only makes sense with --cpu-smoke")
    known = SMOKE_CORPORA if args.cpu_smoke else CORPORA

    def listed(text, allowed, what):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad:
            p.error(f"--{what}: unknown {bad}; choose from {', '.join(allowed)}")
        return items

    args.corpora = listed(args.corpora or ",".join(known), known, "corpora")
    args.storage = listed(args.storage, STORAGES, "storage")
    args.placements = listed(args.placements, PLACEMENTS, "placements")
    args.methods = listed(args.methods, METHODS, "methods")
    args.peer_keys = [] if args.peers.strip() == "none" else listed(args.peers, PEER_KEYS, "peers")
    try:
        args.queries = sorted({int(t) for t in args.queries.split(",") if t.strip()})
    except ValueError:
        p.error(f"--queries: expected a comma list of integers, got {args.queries!r}")
    if not args.queries or min(args.queries) < 1:
        p.error("--queries: every count must be >= 1")
    if args.k < 1:
        p.error("--k must be >= 1")
    if args.scale <= 0:
        p.error("--scale must be > 0")
    # what Machine reads
    args.cpu_reps, args.l2_flush, args.max_eager_ms, args.rounds = 2, "zero", 1e3 * args.max_baseline_s, 0
    return args


def available_host_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def write_json(path: Path, res: dict) -> None:
    """Atomically: a run killed while writing keeps the previous file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class Context:
    """What every group of rows shares: the machine, the options, the query pool, the peers, the output."""

    def __init__(self, m: Machine, args, res: dict, peers, peer_missing):
        self.m, self.args, self.res = m, args, res
        self.peers, self.peer_missing = peers, peer_missing
        self.path = args.out / "search.json"
        self.gpus = torch.cuda.device_count() if m.cuda else 0
        gen = torch.Generator(device=m.device).manual_seed(args.seed + 7)
        # Nq queries are the first Nq of one pool: one exact top-k (per corpus) serves every batch size
        self.pool = unit_tokens((max(args.queries), args.query_tokens, args.dim), m, gen)
        self.truth: dict = {}         # (corpus, storage, Nq) -> the exact (scores, indices), on the host
        self.resident_ms: dict = {}   # (corpus, storage, Nq) -> ours' resident time, for the sharded scaling

    def save(self) -> None:
        self.res["meta"]["elapsed_s"] = self.m.budget.elapsed()
        write_json(self.path, self.res)

    def spent(self) -> bool:
        return self.m.budget.spent()

    def no_room(self, nbytes: float, host: bool) -> Optional[str]:
        """Why a group whose layout has ``nbytes`` should not start now (None: it may): its build, estimated at
        2 GB/s into pinned host memory or 20 GB/s on the GPU, plus a minute of measurements would overrun the
        budget. The budget is soft: a measurement started goes on; a build cannot be cut short."""
        budget = self.m.budget
        if budget.seconds is None:
            return None
        if budget.spent():
            return "time budget spent"
        need = nbytes / (2e9 if host else 20e9) + 60
        if budget.elapsed() + need > budget.seconds:
            return (f"time budget: ~{need:.0f} s to build and measure, {budget.seconds - budget.elapsed():.0f} s "
                    "left")
        return None


# --------------------------------------------------------------------------------------------------------- rows

def _rate_for(m: Machine, storage: str) -> Optional[float]:
    if storage == "int8":
        return (m.mm8_rates or {}).get("int8_mm_ops")
    return m.mm_flops


def new_rows(ctx: Context, gen: Generated, corpus, storage: str, placement: str) -> list[dict]:
    """One row per batch size, with the corpus's shape; the floors are filled in once the layout is built."""
    a = ctx.args
    rows = []
    for nq in a.queries:
        rows.append({"name": f"{corpus.label} · {storage} · {placement} · {nq}q", "corpus": corpus.name,
                     "label": corpus.label, "kind": corpus.kind, "storage": storage, "placement": placement,
                     "Nq": nq, "Lq": a.query_tokens, "k": a.k, **gen.stats(), "docs_nominal": corpus.docs,
                     "gpus": ctx.gpus, "results": {}})
    ctx.res["search"].extend(rows)
    return rows


def set_floors(ctx: Context, rows: list[dict], tokens: int, corpus_bytes: int, streamed: bool,
               shards: int = 1) -> None:
    """HBM floor (the corpus read once, at the measured copy bandwidth; a shard per GPU), tensor-core floor
    (2·Nq·Lq·tokens·d products at the bf16 or int8 matmul rate), and for a streamed index the host-to-device
    floor (the index's bytes at the measured pinned copy bandwidth)."""
    m = ctx.m
    h2d = ctx.res["roofline"].get("h2d_Bps")
    for row in rows:
        flops = 2 * row["Nq"] * row["Lq"] * tokens * row["d"]
        rate = _rate_for(m, row["storage"])
        floors = {"hbm_ms": corpus_bytes / shards / m.copy_bw * 1e3 if m.copy_bw else None,
                  "tensor_ms": flops / shards / rate * 1e3 if rate else None}
        if streamed:
            floors["h2d_ms"] = corpus_bytes / h2d * 1e3 if h2d else None
            floors["hbm_ms"] = None         # the copies land in HBM once; the host link is the narrower pipe
        live = {k: v for k, v in floors.items() if v is not None}
        row.update(corpus_bytes=corpus_bytes, flops=flops, floors=floors,
                   floor_ms=max(live.values()) if live else None,
                   floor_kind=max(live, key=live.get).replace("_ms", "") if live else None)


def skip_rows(rows: list[dict], methods, reason: str, whole: bool = True) -> None:
    """Records ``methods`` as skipped on ``rows``; ``whole``: the rows themselves were not measured (their note
    says why)."""
    for row in rows:
        for key in methods:
            row["results"].setdefault(key, skipped(reason))
        if whole:
            row.setdefault("note", reason)


def _fits(ctx: Context, need: float, where: str) -> Optional[str]:
    free = ctx.m.free_bytes()
    if need + HEADROOM_BYTES > free:
        return f"needs ~{need / GIB:.1f} GiB {where} (+{HEADROOM_BYTES / GIB:.0f} GiB room); {free / GIB:.1f} GiB free"
    return None


def measure(ctx: Context, row: dict, key: str, call, check, estimate_ms: Optional[float] = None) -> dict:
    """One method on one row (guarded, recorded, saved)."""
    a, m = ctx.args, ctx.m
    if ctx.spent():
        res = skipped("time budget spent")
    elif estimate_ms is not None and estimate_ms > 1e3 * a.max_baseline_s:
        res = skipped(f"estimated {estimate_ms / 1e3:.1f} s per call (> --max-baseline-s {a.max_baseline_s:g})")
    else:
        q = ctx.pool[:row["Nq"]]
        res = run_method(m, call, [(q,)], check, slow_ms=a.slow_ms if m.cuda else None)
        if estimate_ms is not None:
            res["estimate_ms"] = estimate_ms
    row["results"][key] = res
    log.info("    %-34s %-14s %s", row["name"], key, brief(res))
    ctx.save()
    return res


def _tol(ctx: Context, truth_scores: torch.Tensor, kind: str = "fp32") -> float:
    return score_tolerance(kind, truth_scores, ctx.args.query_tokens, ctx.m.dtype)


def reference_check(ctx: Context, documents, storage: str) -> dict:
    """flash_maxsim.search on the first documents (up to 256) against the float64 reference's stable top-k, for
    two queries: a correct top-k within the fp32 tolerance. For int8 the reference scores what the kernels
    multiply: the dequantised documents and the queries quantised per token (docs/semantics.md)."""
    import flash_maxsim
    from flash_maxsim import reference
    from flash_maxsim.quantization import queries_as_scored
    n = min(256, int(documents.offsets.shape[0]) - 1)
    prefix = layout_prefix(documents, n)
    q = ctx.pool[:2]
    got = flash_maxsim.search(q, prefix, ctx.args.k)
    if storage == "bf16":
        qs, ds = q.double(), prefix
        values = ds.values.double()
    else:
        qs = queries_as_scored(q, prefix).double()
        values = prefix.dequantize(torch.float64).values
    offsets = prefix.offsets.tolist()
    docs = [values[offsets[i]:offsets[i + 1]] for i in range(n)]
    exact = reference.maxsim(qs, docs)
    truth = stable_topk(exact, ctx.args.k)
    out = compare_topk((got.scores, got.indices), truth, _tol(ctx, truth[0]),
                       exact_of=lambda idx: exact.gather(1, idx))
    out["docs"] = n
    return out


# ------------------------------------------------------------------------------------------------ resident

def run_resident(ctx: Context, corpus, gen: Generated, storage: str, methods) -> None:
    import flash_maxsim
    a, m = ctx.args, ctx.m
    rows = new_rows(ctx, gen, corpus, storage, "resident")
    bpt = storage_bytes_per_token(storage, gen.d)
    # the layout, and each batch size's full scores (the truth) with the selection's temporaries
    need = gen.tokens * bpt + 8 * gen.docs + 4 * sum(a.queries) * gen.docs + 8 * max(a.queries) * gen.docs
    reason = (_fits(ctx, need, "on the GPU") if m.cuda else None) or ctx.no_room(gen.tokens * bpt, host=False)
    if reason:
        skip_rows(rows, methods, reason)
        return ctx.save()
    t0 = time.perf_counter()
    documents = resident_layout(gen, storage, m.device, m.dtype)
    m.sync()
    build_s = time.perf_counter() - t0
    nbytes = (documents.values.numel() * documents.values.element_size() + documents.offsets.numel() * 8
              + (documents.scales.numel() * 2 if storage == "int8" else 0))
    set_floors(ctx, rows, gen.tokens, nbytes, streamed=False)
    # the truth of each batch: flash_maxsim.maxsim's scores of the same queries, ties to the lower position (the
    # same batch, since the kernels may sum in another order for another number of queries)
    fulls, truths = {}, {}
    for nq in a.queries:
        fulls[nq] = flash_maxsim.maxsim(ctx.pool[:nq], documents)
        truths[nq] = stable_topk(fulls[nq], a.k)
        ctx.truth[(corpus.name, storage, nq)] = (truths[nq][0].cpu(), truths[nq][1].cpu())
    try:
        ref = reference_check(ctx, documents, storage)
    except Exception as exc:            # recorded; the timings still count
        ref = {"ok": False, "note": error_text(exc)}
    for row in rows:
        row.update(build_s=build_s, reference_check=ref)
    log.info("[%5.0fs] %s %s resident: %.1f GB, built in %.1f s; reference check %s", m.budget.elapsed(),
             corpus.label, storage, nbytes / 1e9, build_s, "ok" if ref.get("ok") else f"FAILED {ref}")

    def truth_of(nq):
        return truths[nq]

    def exact_of(nq):
        return lambda idx: fulls[nq].gather(1, idx)

    top = truths[max(a.queries)][0]
    tol = _tol(ctx, top)
    # the bf16 einsum rounds each similarity; on int8 rows it also reads the queries unquantised (docs/semantics.md:
    # the kernels quantise them per token), up to half a step of 127 per element
    tol_torch = _tol(ctx, top, "lowp") + (0.02 * float(top.abs().max()) if storage == "int8" else 0)
    plan_cache: dict = {}
    for row in rows:
        nq = row["Nq"]
        if "ours" in methods:
            r = measure(ctx, row, "ours", lambda q: flash_maxsim.search(q, documents, a.k),
                        lambda out: compare_topk((out.scores, out.indices), truth_of(nq), tol))
            if r.get("ms") is not None:
                ctx.resident_ms[(corpus.name, storage, nq)] = r["ms"]
        if "maxsim" in methods:
            def check_full(out, nq=nq):
                diff = float((out - fulls[nq]).abs().max())
                return {"max_abs_diff": diff, "tol": tol, "ok": diff <= tol}
            measure(ctx, row, "maxsim", lambda q: flash_maxsim.maxsim(q, documents), check_full)
        if "torch_chunked" in methods:
            plan = plan_cache.setdefault(nq, torch_chunk_plan(gen, documents, nq, a.query_tokens))
            est = _probe_torch(ctx, documents, plan, nq, corpus.length)

            def torch_call(q, plan=plan):
                return torch_chunked_search(q, documents, a.k, plan, corpus.length)
            r = measure(ctx, row, "torch_chunked", torch_call,
                        lambda out, nq=nq: compare_topk(out, truth_of(nq), tol_torch, exact_of=exact_of(nq)),
                        estimate_ms=est)
            r["chunk_docs"] = plan[0][1] - plan[0][0]
    peer_keys = [k for k in ("lik", "fmpypi") if k in methods and k in ctx.args.peer_keys]
    skip_rows(rows, [k for k in ("lik", "fmpypi") if k in methods and k not in peer_keys], "not requested (--peers)",
              whole=False)
    if peer_keys:
        run_resident_peers(ctx, rows, gen, documents, storage, peer_keys, truth_of, exact_of, tol)
    ann = [k for k in ("plaid", "voyager") if k in methods]
    if ann:
        run_ann(ctx, rows, gen, storage, ann, truth_of, exact_of)
    documents = fulls = truths = None
    m.release()
    ctx.save()


def _probe_torch(ctx: Context, documents, plan, nq: int, equal_lengths) -> Optional[float]:
    """torch chunked scoring's time per call, extrapolated from its first chunks (one warm-up chunk, then up to
    four timed)."""
    if not ctx.m.cuda or len(plan) <= 4:
        return None
    q = ctx.pool[:nq]
    try:
        torch_chunked_search(q, documents, ctx.args.k, plan[:1], equal_lengths)
        part = plan[1:5]
        ms = timed_call_ms(ctx.m, lambda: torch_chunked_search(q, documents, ctx.args.k, part, equal_lengths))
    except Exception as exc:
        log.info("torch chunked probe failed: %s", error_text(exc))
        return None
    finally:
        ctx.m.release()
    docs = sum(e - s for s, e, _ in part)
    return ms * plan[-1][1] / max(1, docs)


def run_resident_peers(ctx, rows, gen, documents, storage, peer_keys, truth_of, exact_of, tol) -> None:
    """The peers' top-k on the padded copy of a bf16 corpus (the pages' packed values are already padded: a
    view). Neither peer has an int8 top-k of its own for this layout: int8 rows record them as skipped."""
    m = ctx.m
    if storage != "bf16":
        skip_rows(rows, peer_keys, "no 8-bit top-k in the peer (flash-maxsim 0.3.0's int8 pass is part of "
                                   "its bf16/fp16 top-k, measured on the bf16 rows)", whole=False)
        return
    ready = {}
    for key in peer_keys:
        peer, skip = _peer_or_skip(m, key, ctx.peers, ctx.peer_missing)
        if skip:
            skip_rows(rows, [key], skip["error"], whole=False)
        else:
            ready[key] = peer
    if not ready:
        return
    N, L, d = gen.docs, gen.max_len, gen.d
    padded_bytes = 0 if gen.corpus.length is not None else N * L * (2 * d + 1)
    extra = {"fmpypi": N * L * (d + 4), "lik": 0}
    padded = mask = None
    chunk = max(1, (PEER_MAX_ELEMENTS - 1) // (L * d))
    try:
        for key, peer in ready.items():
            if ctx.spent():
                skip_rows(rows, [key], "time budget spent", whole=False)
                continue
            reason = _fits(ctx, (padded_bytes if padded is None else 0) + extra[key], "for the peer's layout") \
                if m.cuda else None
            if reason:
                skip_rows(rows, [key], reason, whole=False)
                continue
            if padded is None:
                padded, mask = padded_layout(documents, gen)
            lengths = documents.offsets[1:] - documents.offsets[:-1]
            try:
                variant = peer.topk_variant(padded, mask, lengths, chunk)
            except Exception as exc:
                skip_rows(rows, [key], f"preparing its index failed: {error_text(exc)}", whole=False)
                continue
            per_query_ms = None
            for row in rows:
                nq = row["Nq"]
                est = per_query_ms * nq if (per_query_ms and not variant.exact) else None
                r = measure(ctx, row, key, lambda q: variant.call(q, ctx.args.k),
                            lambda out, nq=nq: compare_topk(out, truth_of(nq), tol, exact_of=exact_of(nq),
                                                            exact=variant.exact), estimate_ms=est)
                r.update(variant=variant.name, peer=peer.label, index_extra_bytes=variant.index_bytes,
                         padded_bytes=padded_bytes)
                if r.get("ms") is not None and not variant.exact:
                    per_query_ms = r["ms"] / nq       # one call per query: the next batch size is a multiple
            variant = None
            m.release()
    finally:
        padded = mask = None
        m.release()


def _documents_on_host(gen: Generated, storage: str, m: Machine) -> list:
    """Each document's tokens as float32 host tensors (what PyLate's indexes take); int8: dequantised."""
    import flash_maxsim
    out = []
    for i in range(len(gen.bounds)):
        x, offsets = gen.chunk(i, m.device, m.dtype)
        if storage != "bf16":
            q = flash_maxsim.quantize(flash_maxsim.PackedDocuments(x, offsets.to(m.device)), dtype=storage)
            x = q.dequantize(torch.float32).values
        out += list(x.float().cpu().split(torch.diff(offsets).tolist()))
    return out


def run_ann(ctx: Context, rows, gen: Generated, storage: str, keys, truth_of, exact_of) -> None:
    """PyLate's PLAID (fast-plaid) and Voyager indexes on the same corpus: built once (untimed, its seconds
    recorded), then searched per batch through ``retrieve.ColBERT``; recall against the exact top-k (their
    scores are their own, approximate: not held to a tolerance)."""
    m = ctx.m
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")          # PyLate's retriever draws a progress bar per call
        from pylate import indexes, retrieve
    except Exception as exc:
        return skip_rows(rows, keys, f"pylate not importable: {error_text(exc)}", whole=False)
    if ctx.spent():
        return skip_rows(rows, keys, "time budget spent", whole=False)
    docs = _documents_on_host(gen, storage, m)
    ids = [str(i) for i in range(len(docs))]
    device = "cuda" if m.cuda else "cpu"
    with tempfile.TemporaryDirectory(prefix="search-bench-") as folder:
        for key in keys:
            if ctx.spent():
                skip_rows(rows, [key], "time budget spent", whole=False)
                continue
            t0 = time.perf_counter()
            try:
                if key == "plaid":
                    index = indexes.PLAID(index_folder=folder, index_name="plaid", override=True, device=device,
                                          show_progress=False)
                    params = {"nbits": 4, "n_ivf_probe": 8, "n_full_scores": 8192, "kmeans_niters": 4}
                else:
                    index = indexes.Voyager(index_folder=folder, index_name="voyager", override=True,
                                            embedding_size=gen.d)
                    params = {"M": 64, "ef_construction": 200, "ef_search": 200, "k_token": 100}
                index.add_documents(documents_ids=ids, documents_embeddings=docs)
            except Exception as exc:
                skip_rows(rows, [key], f"building its index failed: {error_text(exc)}", whole=False)
                continue
            build_s = time.perf_counter() - t0
            retriever = retrieve.ColBERT(index=index)

            def call(q, retriever=retriever):
                found = retriever.retrieve(queries_embeddings=q.float().cpu(), k=ctx.args.k, device=device)
                scores = torch.tensor([[r["score"] for r in hits] for hits in found], dtype=torch.float32)
                where = torch.tensor([[int(r["id"]) for r in hits] for hits in found], dtype=torch.int64)
                return scores, where

            for row in rows:
                nq = row["Nq"]
                r = measure(ctx, row, key, call,
                            lambda out, nq=nq: dict(compare_topk(out, truth_of(nq), float("inf"),
                                                                 exact_of=lambda i: exact_of(nq)(i.to(m.device)),
                                                                 exact=False), ok=True))
                r.update(build_s=build_s, params=params, note="random embeddings: no cluster structure, so this "
                         "recall is not the index's recall on real data (the quality table has that)")
            index = retriever = None


# ---------------------------------------------------------------------------------------------- index rows

def run_index(ctx: Context, corpus, gen: Generated, storage: str, placement: str, smallest: bool) -> None:
    """DocumentIndex streamed from pinned host memory ("host", sized to --host-gib) or sharded over every GPU of
    this process ("sharded"), ours only: built by ``add`` chunk by chunk, searched per batch size, checked
    against the exact top-k (the resident rows' truth, or each chunk made again and searched)."""
    import flash_maxsim
    a, m = ctx.args, ctx.m
    rows = new_rows(ctx, gen, corpus, storage, placement)
    if not hasattr(flash_maxsim, "DocumentIndex"):
        skip_rows(rows, ["ours"], "this flash_maxsim has no DocumentIndex")
        return ctx.save()
    bpt = storage_bytes_per_token(storage, gen.d)
    n_chunks, options, note = len(gen.bounds), {}, None
    if placement == "host":
        where = "host" if m.cuda else "cpu"
        if m.cuda:
            options["stream_device"] = m.device
        host_budget = a.host_gib * GIB if a.host_gib else (available_host_bytes() or 0) / 2
        n_chunks = gen.prefix_chunks(host_budget, bpt)
        if n_chunks < len(gen.bounds):
            note = (f"sized to the host memory: the first {gen.bounds[n_chunks - 1][1]:,} of {gen.docs:,} "
                    f"documents ({host_budget / GIB:.0f} GiB budget); the rate is what counts")
    else:
        where = "cuda:all" if m.cuda else "cpu"
        if ctx.gpus <= 1 and m.cuda:
            note = "one GPU: the sharded placement holds one shard (N-GPU scaling not measurable here)"
            if not smallest:
                skip_rows(rows, ["ours"], note + "; measured on the smallest corpus only")
                return ctx.save()
        if m.cuda:
            free = sum(torch.cuda.mem_get_info(i)[0] for i in range(ctx.gpus))
            need = gen.tokens * bpt + 8 * gen.docs
            if need + HEADROOM_BYTES * max(1, ctx.gpus) > free:
                skip_rows(rows, ["ours"], f"needs ~{need / GIB:.1f} GiB over {ctx.gpus} GPU(s); "
                                          f"{free / GIB:.1f} GiB free")
                return ctx.save()
    if not m.cuda:
        note = f"smoke run: placement 'cpu' stands in for '{placement}'"
    docs = gen.bounds[n_chunks - 1][1]
    reason = ctx.no_room(int(gen.offsets[docs]) * bpt, host=placement == "host")
    if reason:
        skip_rows(rows, ["ours"], reason)
        return ctx.save()
    for row in rows:
        row.update(docs=docs, tokens=int(gen.offsets[docs]), placement_arg=where)
        if note:
            row["note"] = note
    t0 = time.perf_counter()
    try:
        index = build_index(gen, storage, where, m.device, m.dtype, n_chunks, **options)
        m.sync()
    except Exception as exc:
        skip_rows(rows, ["ours"], f"building the index failed: {error_text(exc)}")
        m.release()
        return ctx.save()
    build_s = time.perf_counter() - t0
    shards = ctx.gpus if (placement == "sharded" and m.cuda) else 1
    set_floors(ctx, rows, int(gen.offsets[docs]), int(index.nbytes), streamed=placement == "host", shards=shards)
    log.info("[%5.0fs] %s %s %s: %.1f GB, built in %.1f s", m.budget.elapsed(), corpus.label, storage, placement,
             index.nbytes / 1e9, build_s)
    for row in rows:
        nq = row["Nq"]
        row["build_s"] = build_s
        if n_chunks == len(gen.bounds) and (corpus.name, storage, nq) in ctx.truth:
            truth = ctx.truth[(corpus.name, storage, nq)]
        else:
            truth = regenerated_topk(gen, storage, n_chunks, ctx.pool[:nq], a.k, m.device, m.dtype)
        truth = (truth[0].to(m.device), truth[1].to(m.device))
        tol = _tol(ctx, truth[0])
        r = measure(ctx, row, "ours", lambda q: index.search(q, a.k),
                    lambda out, truth=truth, tol=tol: compare_topk((out.scores, out.positions), truth, tol))
        if r.get("ms") is not None:
            r["rate_Bps"] = index.nbytes / (r["ms"] * 1e-3)
            h2d = ctx.res["roofline"].get("h2d_Bps")
            if placement == "host" and h2d:
                r["h2d_fraction"] = r["rate_Bps"] / h2d
            single = ctx.resident_ms.get((corpus.name, storage, nq))
            if placement == "sharded" and single and shards > 1:
                r["scaling"] = single / (shards * r["ms"])      # 1.0: N GPUs answer N times as fast
    index = None
    m.release()
    ctx.save()


# ------------------------------------------------------------------------------------------------------- main

def run(args) -> dict:
    import bench
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --cpu-smoke here")
    if args.interpret:
        interpreter_autotune_shim()
    m = Machine(args)
    peers, peer_missing = load_peers(args.peer_keys)
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"meta": bench._meta(m, args, peers, peer_missing), "roofline": {}, "search": []}
    res["meta"].update(kind="search", gpus=torch.cuda.device_count() if m.cuda else 0, k=args.k,
                       host_available_bytes=available_host_bytes())
    import flash_maxsim
    if not hasattr(flash_maxsim, "search"):
        raise SystemExit("this flash_maxsim has no search(): nothing to benchmark")
    with torch.no_grad():
        res["roofline"] = measure_roofline(m)
        if "int8" in args.storage:
            m.mm8_rates = measure_8bit_rates(m)
            res["roofline"].update(m.mm8_rates)
        if "host" in args.placements:
            res["roofline"].update(measure_host_to_device(m))
        ctx = Context(m, args, res, peers, peer_missing)
        ctx.save()
        corpora = [(SMOKE_CORPORA if args.cpu_smoke else CORPORA)[name].scaled(args.scale) for name in args.corpora]
        by_size = sorted(corpora, key=lambda c: c.docs * (c.length or c.mean))
        for corpus in corpora:
            gen = Generated(corpus, args.dim, args.seed)
            for storage in args.storage:
                for placement in args.placements:
                    log.info("[%5.0fs] %s, %s, %s", m.budget.elapsed(), corpus.label, storage, placement)
                    try:
                        if placement == "resident":
                            run_resident(ctx, corpus, gen, storage, args.methods)
                        else:
                            run_index(ctx, corpus, gen, storage, placement, smallest=corpus is by_size[0])
                    except torch.cuda.OutOfMemoryError as exc:
                        log.warning("%s %s %s: out of memory (%s)", corpus.label, storage, placement,
                                    error_text(exc))
                    m.release()
    res["meta"]["elapsed_s"] = m.budget.elapsed()
    res["meta"]["timer"] = m.timer.name
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    res = run(args)
    write_json(args.out / "search.json", res)
    plots = report.make_search_plots(res, args.out)
    (args.out / "search.md").write_text(report.render_search_run(res, {k: p.name for k, p in plots.items()}))
    print("\n" + report.search_summary(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
