"""Can the compressed index (issue 7) use int8 (or e4m3) tensor-core products? That needs the QUERY quantised too:
one symmetric scale per query token, applied after the integer dot product, like the documents' per-token scale.
On the retrieval fidelity benchmark's cached embeddings, emulate each pairing (query x document format, one scale
per token on both sides), score the dequantised values with flash_maxsim's exact CPU path (an integer product
times the two scales is that same number, up to fp32 rounding) and compare nDCG@10 and top-10 overlap with the
float64 reference. The question it answers: does quantising the query spend the fidelity budget
(|delta nDCG@10| <= 1e-3, mean top-10 overlap >= 0.98)?

    python benchmarks/quantized_query_fidelity.py --data ../shared/data/beir-msmarco-5k \\
        --data ../shared/data/beir-dbpedia-5k --cache .cache/fidelity --out quantized-query.json

Needs the embedding cache written by ``retrieval_fidelity.py`` (CPU only; a few minutes per dataset).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import retrieval_fidelity as rf  # noqa: E402  (puts src/ on the path too)
from fp8_scale_granularity import fake_quantize  # noqa: E402

import flash_maxsim  # noqa: E402

PAIRINGS = [("bf16", "int8"), ("int8", "int8"), ("fp8", "fp8"), ("int8", "fp8")]  # (query format, document format)


def quantize_like(values: torch.Tensor, kind: str) -> torch.Tensor:
    """``values`` [..., d] rounded as the kernel would see them: bf16, or one scale per token (row)."""
    if kind == "bf16":
        return values.bfloat16().float()
    flat = values.reshape(-1, values.shape[-1])
    return fake_quantize(flat, flat.shape[1], kind).view(values.shape)


def pairing_rows(dataset: str, data: rf.CachedDataset):
    for query_kind, document_kind in PAIRINGS:
        documents = flash_maxsim.PackedDocuments(quantize_like(data.values, document_kind), data.offsets,
                                                 data.max_len)
        scores = flash_maxsim.maxsim(quantize_like(data.queries, query_kind), documents).double()
        c = rf.compare(scores, data.exact, data.doc_ids, data.query_ids, data.qrels)
        yield {"dataset": dataset, "queries": query_kind, "documents": document_kind,
               "delta_ndcg@10": c["delta_ndcg@10"], "top10_overlap_mean": c["top10_overlap_mean"],
               "max_abs_error": c["abs_error"]["max"]}


def main(argv=None) -> int:
    return rf.run_emulation(__doc__.split("\n\n")[0], pairing_rows, argv)


if __name__ == "__main__":
    raise SystemExit(main())
