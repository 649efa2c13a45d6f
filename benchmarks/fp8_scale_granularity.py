"""Is the fp8 index's fidelity miss (issue 7) inherent to e4m3, or to one scale per token? On the retrieval
fidelity benchmark's cached embeddings, emulate int8 and e4m3 with one scale per token (what
``flash_maxsim.quantize`` stores) and per 32- and 16-element group, score the dequantised values with
flash_maxsim's exact CPU path, and compare nDCG@10 and top-10 overlap with the float64 reference.

    python benchmarks/fp8_scale_granularity.py --data ../shared/data/beir-msmarco-5k \\
        --data ../shared/data/beir-dbpedia-5k --cache .cache/fidelity --out fp8-granularity.json

Needs the embedding cache written by ``retrieval_fidelity.py`` (CPU only; a few minutes per dataset).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import retrieval_fidelity as rf  # noqa: E402  (puts src/ on the path too)

import flash_maxsim  # noqa: E402

# (kind, elements per scale); "fp8-search": e4m3 with each scale picked among 16 steps of 2^(1/16) below amax / 448 as
# the one with the least squared error (session 24: does a better per-token scale, not a finer one, close the gap?);
# "-rotated": the features turned by a fixed randomised Hadamard rotation before quantising and back after
# (session 34: scores are unchanged by an orthogonal turn of both sides, but the rounding error of q . d is
# sum_i q_i^2 d_i^2 eps_i^2, which a turn that spreads each token over all features can lower)
VARIANTS = [("int8", 128), ("fp8", 128), ("fp8", 32), ("fp8", 16), ("int8", 32), ("fp8-search", 128),
            ("int8-rotated", 128), ("fp8-rotated", 128)]
SEARCH_STEPS = 16
ROTATION_SEED = 0


def randomized_hadamard(d: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """An orthonormal [d, d] Sylvester Hadamard matrix with randomly signed rows (d a power of two)."""
    if d & (d - 1):
        raise ValueError(f"the rotated variants need a power-of-two feature size, got d={d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return (signs[:, None] * h / d ** 0.5).float()


def fake_quantize(values: torch.Tensor, group: int, kind: str) -> torch.Tensor:
    """Symmetric quantisation with one fp32 scale per ``group`` consecutive features, dequantised."""
    n, d = values.shape
    if kind.endswith("-rotated"):
        turn = randomized_hadamard(d)
        return fake_quantize(values.float() @ turn, group, kind[: -len("-rotated")]) @ turn.T
    v = values.float().view(n, d // group, group)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    if kind == "fp8":
        scale = amax / 448.0                                   # e4m3's largest finite value
        q = (v / scale).to(torch.float8_e4m3fn).float() * scale
    elif kind == "fp8-search":
        q, q_err = v, torch.full_like(amax, float("inf"))
        for k in range(SEARCH_STEPS):                          # larger scales only leave e4m3's range unused
            scale = amax / 448.0 * 2.0 ** (k / SEARCH_STEPS)
            cand = (v / scale).to(torch.float8_e4m3fn).float() * scale
            err = (cand - v).pow(2).sum(-1, keepdim=True)
            q, q_err = torch.where(err < q_err, cand, q), torch.minimum(err, q_err)
    else:
        scale = amax / 127.0
        q = torch.round(v / scale).clamp(-127, 127) * scale
    return q.view(n, d)


def variant_rows(dataset: str, data: rf.CachedDataset):
    d = data.values.shape[1]
    for kind, group in VARIANTS:
        documents = flash_maxsim.PackedDocuments(fake_quantize(data.values, group, kind), data.offsets, data.max_len)
        c = rf.compare(flash_maxsim.maxsim(data.queries, documents).double(), data.exact, data.doc_ids,
                       data.query_ids, data.qrels)
        yield {"dataset": dataset, "kind": kind, "elements_per_scale": group,
               "index_bytes_vs_bf16": (d + 4 * (d // group)) / (2 * d),
               "delta_ndcg@10": c["delta_ndcg@10"], "top10_overlap_mean": c["top10_overlap_mean"],
               "max_abs_error": c["abs_error"]["max"]}


def main(argv=None) -> int:
    return rf.run_emulation(__doc__.split("\n\n")[0], variant_rows, argv)


if __name__ == "__main__":
    raise SystemExit(main())
