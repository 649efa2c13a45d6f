"""The search benchmark's corpora and baselines: seeded random corpora generated chunk by chunk (so that any chunk
can be made again without the others), the layouts each method reads (packed, int8, padded for the peers, a
DocumentIndex), torch's chunked scoring with a running top-k, and the checks of a top-k against the exact one.

A corpus is a list of document lengths (drawn on the host from the seed) and, per chunk of documents, unit-norm
random token embeddings drawn on the device from ``(seed, chunk)``: nothing but the lengths is ever held for the
whole corpus outside the layout being built, and a chunk made twice is bitwise the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# MS MARCO passages under a ColBERT tokenizer: ~70 tokens on average, cut at ColBERT's 180-token document limit
PASSAGE_MEAN, PASSAGE_MIN, PASSAGE_MAX, PASSAGE_SIGMA = 70, 8, 180, 0.45
PAGE_TOKENS = 1030          # ColPali: 1024 patch tokens + 6 text tokens per page image
MSMARCO_PASSAGES = 8_841_823


@dataclass(frozen=True)
class Corpus:
    """One corpus of the benchmark: ``docs`` documents of ``length`` tokens each (pages) or of lengths drawn
    log-normally around ``mean`` within [``min_len``, ``max_len``] (passages)."""

    name: str
    label: str
    kind: str                       # "passages" or "pages"
    docs: int
    length: Optional[int] = None    # fixed length (pages)
    mean: float = PASSAGE_MEAN
    min_len: int = PASSAGE_MIN
    max_len: int = PASSAGE_MAX

    def scaled(self, factor: float) -> "Corpus":
        if factor == 1:
            return self
        docs = max(1, int(round(self.docs * factor)))
        return Corpus(self.name, f"{self.label} ×{factor:g}", self.kind, docs, self.length, self.mean,
                      self.min_len, self.max_len)


CORPORA = {c.name: c for c in (
    Corpus("passages-100k", "passages 100k", "passages", 100_000),
    Corpus("passages-1m", "passages 1M", "passages", 1_000_000),
    Corpus("passages-8.8m", "passages 8.8M", "passages", MSMARCO_PASSAGES),
    Corpus("pages-100k", "pages 100k", "pages", 100_000, PAGE_TOKENS),
    Corpus("pages-1m", "pages 1M", "pages", 1_000_000, PAGE_TOKENS),
)}

# the CPU smoke run: the same kinds, tiny
SMOKE_CORPORA = {c.name: c for c in (
    Corpus("passages-300", "passages 300 (smoke)", "passages", 300, mean=10, min_len=2, max_len=24),
    Corpus("pages-40", "pages 40 (smoke)", "pages", 40, 20),
)}


def storage_bytes_per_token(storage: str, d: int) -> int:
    """Bytes one token takes in a layout: bf16 values, or int8 values and one bf16 scale."""
    return 2 * d if storage == "bf16" else d + 2


class Generated:
    """A corpus's lengths and offsets (host, int64) and its tokens, made chunk by chunk on demand.

    ``bounds``: the chunks, ``(first, last)`` document ranges of at most ``chunk_tokens`` tokens each (a longer
    document alone in its chunk)."""

    def __init__(self, corpus: Corpus, d: int, seed: int, chunk_tokens: int = 1 << 21):
        self.corpus, self.d, self.seed = corpus, d, seed
        if corpus.length is not None:
            self.lengths = torch.full((corpus.docs,), corpus.length, dtype=torch.int64)
        else:
            gen = torch.Generator().manual_seed(seed)
            mu = math.log(corpus.mean) - PASSAGE_SIGMA ** 2 / 2        # the log-normal's mean is `mean`
            z = torch.randn(corpus.docs, generator=gen, dtype=torch.float64)
            self.lengths = (mu + PASSAGE_SIGMA * z).exp().round().clamp(corpus.min_len, corpus.max_len).long()
        self.offsets = torch.zeros(corpus.docs + 1, dtype=torch.int64)
        self.offsets[1:] = self.lengths.cumsum(0)
        self.tokens = int(self.offsets[-1])
        self.max_len = int(self.lengths.max())
        self.bounds = []
        first = 0
        while first < corpus.docs:
            last = int(torch.searchsorted(self.offsets, self.offsets[first] + chunk_tokens, right=True)) - 1
            last = min(corpus.docs, max(last, first + 1))
            self.bounds.append((first, last))
            first = last

    @property
    def docs(self) -> int:
        return self.corpus.docs

    def stats(self) -> dict:
        return {"docs": self.docs, "tokens": self.tokens, "mean_len": self.tokens / max(1, self.docs),
                "max_len": self.max_len, "min_len": int(self.lengths.min()), "d": self.d}

    def chunk(self, i: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``i``: its tokens ``[T_i, d]`` (unit vectors in ``dtype``) and its offsets rebased to 0 (host)."""
        first, last = self.bounds[i]
        offsets = self.offsets[first:last + 1] - self.offsets[first]
        gen = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + i + 1)
        x = torch.randn((int(offsets[-1]), self.d), generator=gen, device=device, dtype=torch.float32)
        return F.normalize(x, dim=-1).to(dtype), offsets

    def prefix_chunks(self, max_bytes: Optional[float], bytes_per_token: int) -> int:
        """How many leading chunks fit in ``max_bytes`` (all of them for None; at least one)."""
        if max_bytes is None:
            return len(self.bounds)
        n = 0
        for first, last in self.bounds:
            if (int(self.offsets[last]) * bytes_per_token + 8 * last) > max_bytes:
                break
            n += 1
        return max(1, n)


# ------------------------------------------------------------------------------------------------------ layouts

def resident_layout(gen: Generated, storage: str, device, dtype):
    """The whole corpus on ``device`` as flash_maxsim reads it: PackedDocuments (bf16) or packed
    QuantizedDocuments (int8, per-token bf16 scales by flash_maxsim.quantize's rule), filled chunk by chunk."""
    import flash_maxsim
    values = torch.empty((gen.tokens, gen.d), dtype=dtype if storage == "bf16" else torch.int8, device=device)
    scales = None if storage == "bf16" else torch.empty((gen.tokens,), dtype=torch.bfloat16, device=device)
    for i, (first, _) in enumerate(gen.bounds):
        x, offsets = gen.chunk(i, device, dtype)
        t0, t1 = int(gen.offsets[first]), int(gen.offsets[first]) + x.shape[0]
        if scales is None:
            values[t0:t1] = x
        else:
            q = flash_maxsim.quantize(flash_maxsim.PackedDocuments(x, offsets.to(device)), dtype="int8")
            values[t0:t1], scales[t0:t1] = q.values, q.scales
        del x
    offsets = gen.offsets.to(device)
    if scales is None:
        return flash_maxsim.PackedDocuments(values, offsets, gen.max_len)
    return flash_maxsim.QuantizedDocuments(values, scales, offsets, None, gen.max_len, "int8")


def layout_prefix(documents, docs: int):
    """The first ``docs`` documents of a packed layout (views)."""
    import flash_maxsim
    end = int(documents.offsets[docs])
    offsets = documents.offsets[:docs + 1]
    if isinstance(documents, flash_maxsim.QuantizedDocuments):
        return flash_maxsim.QuantizedDocuments(documents.values[:end], documents.scales[:end], offsets, None,
                                               None, documents.kind)
    return flash_maxsim.PackedDocuments(documents.values[:end], offsets)


def padded_layout(documents, gen: Generated) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The bf16 corpus as the peers read it: ``[N, Ld, d]`` and a ``[N, Ld]`` bool mask (None for equal lengths,
    then a view of the packed values, no copy)."""
    values = documents.values
    N, L = gen.docs, gen.max_len
    if gen.corpus.length is not None:
        return values.view(N, L, gen.d), None
    padded = torch.zeros((N, L, gen.d), dtype=values.dtype, device=values.device)
    mask = torch.zeros((N, L), dtype=torch.bool, device=values.device)
    lengths = (documents.offsets[1:] - documents.offsets[:-1])
    steps = torch.arange(L, device=values.device)
    step = max(1, (1 << 24) // L)
    for s in range(0, N, step):
        e = min(N, s + step)
        live = steps[None, :] < lengths[s:e, None]
        pos = documents.offsets[s:e, None] + steps[None, :]
        padded[s:e][live] = values[pos[live]]
        mask[s:e] = live
    return padded, mask


def build_index(gen: Generated, storage: str, placement, device, dtype, n_chunks: int, **options):
    """A flash_maxsim.DocumentIndex holding the first ``n_chunks`` chunks, added chunk by chunk (generated on
    ``device``)."""
    import flash_maxsim
    index = flash_maxsim.DocumentIndex(gen.d, storage=storage, placement=placement, **options)
    for i in range(n_chunks):
        x, offsets = gen.chunk(i, device, dtype)
        index.add(flash_maxsim.PackedDocuments(x, offsets.to(device), int(gen.lengths[slice(*gen.bounds[i])].max())))
        del x
    return index


# ---------------------------------------------------------------------------------------------------- torch

def torch_chunk_plan(gen: Generated, documents, num_queries: int, lq: int,
                     sim_bytes: int = 1 << 30) -> list[tuple[int, int, int]]:
    """``(first, last, longest)`` document chunks for :func:`torch_chunked_search`: each chunk's similarity
    tensor ``[Nq, c, Lq, longest]`` in bf16, and its padded documents (with an int8 corpus's dequantisation
    temporaries, ~3 copies), at most ``sim_bytes``. Read from the host lengths, so that the timed loop reads
    nothing from the device."""
    per_doc = gen.max_len * max(num_queries * lq * 2, gen.d * 6)
    c = max(1, sim_bytes // per_doc)
    plan = []
    for s in range(0, gen.docs, c):
        e = min(gen.docs, s + c)
        plan.append((s, e, int(gen.lengths[s:e].max())))
    return plan


def torch_chunked_search(queries: torch.Tensor, documents, k: int, plan, equal_lengths: Optional[int]):
    """What users write without a top-k kernel: per chunk of documents, pad the chunk (a gather), dequantise it
    (int8), ``einsum("qid,bjd->qbij")`` in bf16, mask the padding, ``amax`` over document tokens, sum over query
    tokens in fp32, ``torch.topk`` of the chunk, merged into the running top-k by another ``torch.topk``."""
    values, offsets = documents.values, documents.offsets
    scales = getattr(documents, "scales", None)
    lengths = offsets[1:] - offsets[:-1]
    steps = torch.arange(max(p[2] for p in plan), device=values.device)
    best_s = best_i = None
    for s, e, longest in plan:
        if equal_lengths is not None:
            rows = slice(s * equal_lengths, e * equal_lengths)
            chunk = values[rows].view(e - s, equal_lengths, -1)
            if scales is not None:
                chunk = chunk.to(queries.dtype) * scales[rows].view(e - s, equal_lengths, 1).to(queries.dtype)
            live = None
        else:
            live = steps[None, :longest] < lengths[s:e, None]
            pos = torch.where(live, offsets[s:e, None] + steps[None, :longest], 0)
            chunk = values[pos]
            if scales is not None:
                chunk = chunk.to(queries.dtype) * scales[pos][..., None].to(queries.dtype)
        sim = torch.einsum("qid,bjd->qbij", queries, chunk)
        if live is not None:
            sim.masked_fill_(~live[None, :, None, :], float("-inf"))
        scores = sim.amax(-1).sum(-1, dtype=torch.float32)
        del sim, chunk
        top = torch.topk(scores, min(k, e - s), dim=1)
        idx = top.indices + s
        if best_s is None:
            best_s, best_i = top.values, idx
        else:
            merged_s, merged_i = torch.cat([best_s, top.values], 1), torch.cat([best_i, idx], 1)
            top = torch.topk(merged_s, min(k, merged_s.shape[1]), dim=1)
            best_s, best_i = top.values, merged_i.gather(1, top.indices)
    return best_s, best_i


# ------------------------------------------------------------------------------------------------- top-k truth

def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of each row of ``scores`` ``[Nq, N]``: descending, equal scores by lower position (what
    ``flash_maxsim.search`` promises), without sorting the whole row."""
    k = min(k, scores.shape[1])
    kth = torch.topk(scores, k, dim=1).values[:, -1]
    out_s, out_i = [], []
    for q in range(scores.shape[0]):
        cand = torch.nonzero(scores[q] >= kth[q]).squeeze(1)          # ascending positions
        order = torch.sort(scores[q, cand], descending=True, stable=True).indices[:k]
        out_s.append(scores[q, cand[order]])
        out_i.append(cand[order])
    return torch.stack(out_s), torch.stack(out_i)


def merge_stable(parts: list[tuple[torch.Tensor, torch.Tensor]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of partial results given in position order (each descending, ties by lower position)."""
    values = torch.cat([p[0] for p in parts], 1)
    where = torch.cat([p[1] for p in parts], 1)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    return values.gather(1, order), where.gather(1, order)


def regenerated_topk(gen: Generated, storage: str, n_chunks: int, queries: torch.Tensor, k: int, device, dtype):
    """The exact top-k over the first ``n_chunks`` chunks, chunk by chunk (each made again and searched with
    ``flash_maxsim.search``), merged: the truth for an index whose corpus is not resident as one layout."""
    import flash_maxsim
    parts = []
    for i in range(n_chunks):
        x, offsets = gen.chunk(i, device, dtype)
        docs = flash_maxsim.PackedDocuments(x, offsets.to(device))
        if storage != "bf16":
            docs = flash_maxsim.quantize(docs, dtype=storage)
        found = flash_maxsim.search(queries, docs, k)
        parts.append((found.scores, found.indices + gen.bounds[i][0]))
        del x, docs
    return merge_stable(parts, k)


def compare_topk(got: tuple, truth: tuple, tol: float,
                 exact_of: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, exact: bool = True) -> dict:
    """A top-k ``got`` = (scores, indices) ``[Nq, k]`` against the exact one ``truth``: identical (same documents,
    order and scores), recall (share of the exact top-k found), and whether it is a correct top-k within ``tol``:
    every returned document's exact score (``exact_of(indices)``, or the returned score itself) at least the
    k-th exact score minus ``tol``, and the returned scores within ``tol`` of the exact ones. ``exact`` False (an
    approximate search): only the scores are held to ``tol``; the recall says the rest."""
    got_s, got_i = got[0].detach().float(), got[1].detach().long()
    ref_s, ref_i = truth[0].to(got_s.device).float(), truth[1].to(got_s.device).long()
    if tuple(got_i.shape) != tuple(ref_i.shape):
        return {"ok": False, "note": f"shape {tuple(got_i.shape)}, expected {tuple(ref_i.shape)}"}
    k = ref_i.shape[1]
    hits = (got_i[:, :, None] == ref_i[:, None, :]).any(-1).sum(1).float()
    true = exact_of(got_i).float().to(got_s.device) if exact_of is not None else got_s
    score_err = float((got_s - true).abs().max()) if got_s.numel() else 0.0
    kth_gap = float((ref_s[:, -1:] - true).clamp(min=0).max()) if got_s.numel() else 0.0
    out = {"identical": bool(torch.equal(got_i, ref_i) and torch.equal(got_s, ref_s)),
           "recall": float(hits.mean() / k), "score_err": score_err, "kth_gap": kth_gap, "tol": tol,
           "exact": exact}
    out["ok"] = bool(score_err <= tol and (kth_gap <= tol or not exact))
    return out
