"""Can the fp8 index meet issue 7's fidelity budget by *how* it rounds, keeping e4m3 values and one scale per token?

Round to nearest makes each token's error a fixed fraction of each feature (e4m3: 3 mantissa bits), spread evenly
over every direction. A similarity only sees the error along the query token's direction, and query tokens are
not spread evenly: the embeddings are anisotropic. Rounding each feature in turn and carrying its error into the
features not yet rounded, weighted by a second-moment matrix ``H`` of the embedding space (the error feedback of
GPTQ / optimal brain quantisation, one token at a time), pushes the error into the directions where ``H`` is
small. ``H`` comes from the documents being quantised (no query and no judgement is used); ``query-H`` (from the
queries) is reported as a bound on what any calibration could give.

On the retrieval fidelity benchmark's cached embeddings: every variant's index is dequantised, the queries are
quantised to the index's format as the kernels do (round to nearest, per token), scored with flash_maxsim's
exact CPU path and compared with the float64 reference.

    python benchmarks/shaped_rounding.py --data ../shared/data/beir-msmarco-5k \\
        --data ../shared/data/beir-dbpedia-5k --cache .cache/fidelity --out shaped-rounding.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import retrieval_fidelity as rf  # noqa: E402  (puts src/ on the path too)

import flash_maxsim  # noqa: E402
from flash_maxsim.quantization import dequantized_queries  # noqa: E402

QMAX = {"int8": 127.0, "fp8": 448.0}


def round_grid(v: torch.Tensor, kind: str) -> torch.Tensor:
    """Nearest value of the format (ties to even), in the scaled units (|v| clamped to QMAX)."""
    v = v.clamp(-QMAX[kind], QMAX[kind])
    return v.round() if kind == "int8" else v.to(torch.float8_e4m3fn).float()


def second_moment(x: torch.Tensor, damp: float) -> torch.Tensor:
    """``E[x x^T]`` of the rows of ``x``, float64, with ``damp`` times its mean diagonal added (GPTQ's damping)."""
    x = x.double()
    h = x.T @ x / x.shape[0]
    return h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)


def shaped_quantize(x: torch.Tensor, kind: str, h: torch.Tensor, refit: bool) -> torch.Tensor:
    """Per-token scale ``amax / QMAX``, then features rounded one at a time in descending order of ``H``'s
    diagonal, each one's error carried into the rest through the Cholesky factor of ``H^-1`` (so that the error
    ``e`` of each token is small in ``e^T H e``). ``refit``: each token's scale then re-chosen as the least
    ``H``-weighted squared error for its rounded values. Returns the dequantised tokens."""
    n, d = x.shape
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / QMAX[kind]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    order = torch.argsort(h.diagonal(), descending=True)
    hp = h[order][:, order]
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hp)), upper=True).float()
    w = (x / scale)[:, order].contiguous()
    q = torch.empty_like(w)
    for i in range(d):
        q[:, i] = round_grid(w[:, i], kind)
        err = (w[:, i] - q[:, i]) / u[i, i]
        w[:, i + 1:] -= err[:, None] * u[i, i + 1:][None, :]
    values = torch.empty_like(q)
    values[:, order] = q
    if refit:
        hv = values.double() @ h
        best = (hv * x.double()).sum(-1, keepdim=True) / (hv * values.double()).sum(-1, keepdim=True).clamp_min(1e-300)
        scale = torch.where(best > 0, best, scale.double()).float()
    return values * scale


def nearest_quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    values, scales = flash_maxsim.quantization.quantize_tokens(x, kind)
    return values.float() * scales[..., None]


def variant_rows(dataset: str, data: rf.CachedDataset):
    values = data.values
    h_docs = second_moment(values, 0.01)
    flat_queries = data.queries.reshape(-1, data.queries.shape[-1])
    h_queries = second_moment(flat_queries[flat_queries.abs().sum(-1) > 0], 0.01)
    eig = torch.linalg.eigvalsh(h_docs).flip(0)
    share = (eig.cumsum(0) / eig.sum())
    print(f"{dataset}: documents' H, share of the trace in the top 8 / 16 / 32 directions: "
          f"{share[7]:.3f} / {share[15]:.3f} / {share[31]:.3f}", flush=True)
    variants = [("int8", "nearest", None, False), ("fp8", "nearest", None, False),
                ("fp8", "documents-H", h_docs, False), ("fp8", "documents-H + refit", h_docs, True),
                ("fp8", "query-H", h_queries, False), ("int8", "documents-H", h_docs, False)]
    for kind, name, h, refit in variants:
        t0 = time.perf_counter()
        dq = nearest_quantize(values, kind) if h is None else shaped_quantize(values, kind, h, refit)
        seconds = time.perf_counter() - t0
        energy = (dq - values).pow(2).sum(-1).mean().item()
        h_energy = ((dq - values).double() @ h_queries * (dq - values).double()).sum(-1).mean().item()
        for query_format in ("index", "exact"):
            queries = dequantized_queries(data.queries, kind) if query_format == "index" else data.queries
            documents = flash_maxsim.PackedDocuments(dq, data.offsets, data.max_len)
            c = rf.compare(flash_maxsim.maxsim(queries, documents).double(), data.exact, data.doc_ids,
                           data.query_ids, data.qrels)
            yield {"dataset": dataset, "kind": kind, "rounding": name, "queries": query_format,
                   "delta_ndcg@10": c["delta_ndcg@10"], "top10_overlap_mean": c["top10_overlap_mean"],
                   "abs_error_p50": c["abs_error"]["p50"], "abs_error_p99": c["abs_error"]["p99"],
                   "abs_error_max": c["abs_error"]["max"], "error_energy_per_token": energy,
                   "error_energy_in_query_H": h_energy, "quantise_seconds": seconds}


def main(argv=None) -> int:
    return rf.run_emulation(__doc__.split("\n\n")[0], variant_rows, argv)


if __name__ == "__main__":
    raise SystemExit(main())
