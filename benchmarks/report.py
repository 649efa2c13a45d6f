#!/usr/bin/env python3
"""Tables, plots and the documentation page from the benchmark's saved results (no GPU, no torch needed).

    python benchmarks/report.py page                      # docs/benchmarks.md and its plots, from benchmarks/results/
    python benchmarks/report.py page RUN.json [RUN.json ...] --out PAGE.md --plots DIR
    python benchmarks/report.py tables RUN.json [--plots DIR]  # one run's tables (as bench.py's results.md)
    python benchmarks/report.py merge A.json B.json --out RUN.json  # B's sections replace A's
    python benchmarks/report.py merge-search A.json B.json --out benchmarks/results/search-h200.json

``page`` writes one section per results JSON (one per GPU: benchmarks/results/h200.json and h100.json by default),
each with its tables and PNG plots, after the method text kept here in :data:`PAGE_INTRO`; a CPU section from
``cpu_bench.py``'s JSON (benchmarks/results/cpu.json), with its plot; a search section from ``search_bench.py``'s
runs (benchmarks/results/search-<gpu>.json, method text in :data:`SEARCH_INTRO`) and the retrievers' quality
(``retrieval_fidelity.py --retrievers``, search-quality*.json); and a retrieval fidelity table from
``retrieval_fidelity.py``'s JSON files. Everything on the page comes from the JSON, so a
page is regenerated, never edited. The per-run tables (``tables``, and bench.py's results.md) also show the
design targets each row was tuned against; the page does not.

Plots need matplotlib; without it the tables are written and the plots left out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger("flash_maxsim.bench")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT_KEYS = ("forward", "training", "host", "compressed", "forward_sweep", "training_sweep")

# ---------------------------------------------------------------------------------------------------- labels

LABELS = {
    "ours": "flash_maxsim",
    "torch_bf16": "eager bf16",
    "torch_fp32": "eager fp32",
    "colpali_loop": "colpali loop",
    "eager": "eager autograd",
    "lik": "LIK",
    "fmpypi": "flash-maxsim",
    "pytorch_share": "PyTorch's share",
}
PEER_METHODS = ("lik", "fmpypi")
COMPRESSED_METHODS = ("ours_int8", "ours_fp8", "ours_exact", "fmpypi", "lik")
COMPRESSED_LABELS = {
    "ours_int8": "flash_maxsim int8",
    "ours_fp8": "flash_maxsim fp8",
    "ours_exact": "flash_maxsim, unquantised (reference)",
}
COMPRESSED_PEER_KINDS = {"fmpypi": "int8×int8", "lik": "fp8"}


def labels_for(meta: dict) -> dict:
    """Column labels of a run: the peers' labels carry the versions that ran."""
    labels = dict(LABELS)
    for key, label in (meta.get("peers") or {}).items():
        if key in LABELS:
            labels[key] = f"{LABELS[key]} {label.rsplit(' ', 1)[-1]}"
    for key, label in COMPRESSED_LABELS.items():
        labels[key] = label
    for key, kind in COMPRESSED_PEER_KINDS.items():
        labels["compressed:" + key] = f"{labels[key]} {kind}"
    return labels


def _compressed_label(labels: dict, key: str) -> str:
    return labels.get("compressed:" + key, labels[key])


# ------------------------------------------------------------------------------------------------ formatting

def format_rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _fmt_mb(x: Optional[float]) -> str:
    if x is None:
        return "–"
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def _fmt_err(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.1e}"


def _table(head: list, rows: list) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


class _Notes:
    """Footnotes for cells that hold no plain number (skipped, failed, flagged as wrong)."""

    def __init__(self):
        self.items: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"

    def render(self) -> list[str]:
        """The footnotes, preceded by a blank line, or nothing."""
        return ([""] + [f"[{i + 1}] {t}  " for i, t in enumerate(self.items)]) if self.items else []


def _cell(r: Optional[dict], notes: _Notes, value: str) -> str:
    if r is None:
        return "–"
    if r["status"] == "skipped":
        return "skip " + notes.mark(f"skipped: {r.get('error', '')}")
    if r["status"] in ("error", "oom"):
        return r["status"] + " " + notes.mark(f"{r['status']}: {r.get('error', '')}")
    if r["status"] == "wrong":
        return value + " ✗" + notes.mark(f"✗ = result differs from flash_maxsim beyond tolerance ({_diff_text(r)})")
    if r["status"] == "ok" and r.get("ok") is None and r.get("note"):
        return value + " " + notes.mark(r["note"])
    return value


def _diff_text(r: dict) -> str:
    parts = []
    if r.get("max_abs_diff") is not None:
        parts.append(f"max |Δscore| {r['max_abs_diff']:.3g} > tol {r['tol']:.3g}" if r['max_abs_diff'] > r['tol']
                     else f"max |Δscore| {r['max_abs_diff']:.3g}")
    if r.get("grad_rel_err") is not None:
        parts.append(f"gradient rel. error {r['grad_rel_err']:.3g} (tol {r['grad_tol']:.3g})")
    if r.get("ref_max_abs_diff") is not None:
        parts.append(f"vs float64 reference {r['ref_max_abs_diff']:.3g}")
    if r.get("note"):
        parts.append(r["note"])
    return ", ".join(parts)


def _best_peer(row: dict, field: str = "ms") -> Optional[tuple]:
    """(value, key) of the best correct peer for ``field``."""
    vals = [(r[field], k) for k, r in row["results"].items()
            if k in PEER_METHODS and r.get("status") == "ok" and r.get(field) is not None]
    return min(vals) if vals else None


def _ours(row) -> dict:
    return row["results"].get("ours") or {}


def _ours_ms(row) -> Optional[float]:
    ours = _ours(row)
    return ours.get("ms") if ours.get("status") == "ok" else None


def _methods(rows: list[dict], order) -> list[str]:
    return [k for k in order if any(k in r["results"] for r in rows)]


def _ratio_cells(row: dict, ours_ms: Optional[float], best: Optional[tuple]) -> list[str]:
    """floor, ours / best peer, % of floor."""
    return [_fmt_ms(row.get("floor_ms")),
            f"{ours_ms / best[0]:.2f}" if ours_ms and best else "–",
            f"{100 * row['floor_ms'] / ours_ms:.0f}%" if ours_ms and row.get("floor_ms") else "–"]


# ---------------------------------------------------------------------------------------------------- forward

def forward_table(rows: list[dict], labels: dict, targets: bool = True) -> list[str]:
    keys = _methods(rows, LABELS)
    notes = _Notes()
    head = ["shape (queries×docs, Lq×Ld)"] + [labels[k] for k in keys] + ["floor", "ours / best peer", "% of floor"]
    head += ["target", "met?"] if targets else []
    body = []
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, _fmt_ms(r.get("ms") if r else None)))
        ours_ms, best = _ours_ms(row), _best_peer(row)
        cells += _ratio_cells(row, ours_ms, best)
        if targets:
            cells.append(f"≤ {row['target_ms']}" if row.get("target_ms") else "–")
            cells.append(_forward_met(row, ours_ms, best))
        body.append(cells)
    return _table(head, body) + notes.render()


def _forward_met(row, ours_ms, best) -> str:
    if ours_ms is None:
        return "no (no result)" if _ours(row).get("status") != "wrong" else "no (wrong)"
    misses = []
    if row.get("target_ms") is not None and ours_ms > row["target_ms"]:
        misses.append("target")
    if best is not None and ours_ms > best[0]:
        misses.append("peer")
    return "yes" if not misses else "no (" + ", ".join(misses) + ")"


def forward_memory_table(rows: list[dict], labels: dict) -> list[str]:
    keys = _methods(rows, LABELS)
    notes = _Notes()
    body = []
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, _fmt_mb(r.get("peak_mb") if r else None)))
        body.append(cells)
    return _table(["shape"] + [labels[k] for k in keys], body) + notes.render()


def correctness_table(rows: list[dict], labels: dict, train: bool) -> list[str]:
    keys = [k for k in _methods(rows, LABELS) if k != "ours"]
    body = []
    for row in rows:
        ours = _ours(row)
        ref = "–"
        if ours.get("ref_max_abs_diff") is not None:
            ref = f"{ours['ref_max_abs_diff']:.2g}"
            if ours.get("ref_grad_rel_err") is not None:
                ref += f" / {ours['ref_grad_rel_err']:.2g}"
            ref += "" if ours.get("ref_ok") else " ✗"
        cells = [row["name"], ref]
        for k in keys:
            r = row["results"].get(k, {})
            if r.get("max_abs_diff") is None:
                cells.append("–")
                continue
            c = f"{r['max_abs_diff']:.2g}"
            if train and r.get("grad_rel_err") is not None:
                c += f" / {r['grad_rel_err']:.2g}"
            cells.append(c + ("" if r.get("ok") else " ✗"))
        body.append(cells)
    return _table(["shape", "flash_maxsim vs float64 ref"] + [labels[k] for k in keys], body)


def sweep_table(rows: list[dict], labels: dict, axis: str) -> list[str]:
    keys = _methods(rows, LABELS)
    notes = _Notes()
    body = []
    for row in rows:
        cells = [str(row["B"])]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, f"{_fmt_ms(r.get('ms'))} / {_fmt_mb(r.get('peak_mb'))}" if r else "–"))
        cells.append(_fmt_ms(row.get("floor_ms")))
        body.append(cells)
    return _table([axis] + [f"{labels[k]} ms / MB" for k in keys] + ["floor ms"], body) + notes.render()


# --------------------------------------------------------------------------------------------------- training

TRAINING_ORDER = ("ours", "eager", "fmpypi", "lik")


def training_table(rows: list[dict], labels: dict, targets: bool = True) -> list[str]:
    keys = _methods(rows, TRAINING_ORDER)
    notes = _Notes()
    head = ["training step"] + [labels[k] + " ms / MB" for k in keys] + ["floor ms", "ours / best peer", "% of floor"]
    head += ["target ms / MB", "met?"] if targets else []
    body = []
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, f"{_fmt_ms(r.get('ms'))} / {_fmt_mb(r.get('peak_mb'))}" if r else "–"))
        ours_ms, best = _ours_ms(row), _best_peer(row)
        cells += _ratio_cells(row, ours_ms, best)
        if targets:
            cells.append(f"≤ {row['target_ms']} / ≤ {row['target_mb']}" if row.get("target_ms") else "–")
            cells.append(_training_met(row, _ours(row), ours_ms, best))
        body.append(cells)
    return _table(head, body) + notes.render()


def _training_met(row, ours, ours_ms, best) -> str:
    if ours_ms is None:
        return "no (wrong)" if ours.get("status") == "wrong" else "no (no result)"
    misses = []
    if row.get("target_ms") is not None and ours_ms > row["target_ms"]:
        misses.append("time target")
    mb = ours.get("peak_mb")
    if row.get("target_mb") is not None and mb is not None and mb > row["target_mb"]:
        misses.append("memory target")
    if best is not None and ours_ms > best[0]:
        misses.append("slower than a peer")
    leanest = _best_peer(row, "peak_mb")
    if leanest is not None and mb is not None and mb > leanest[0]:
        misses.append("more memory than a peer")
    eager = row["results"].get("eager", {})
    if row.get("smooth_tau") is not None and eager.get("status") == "ok" and eager.get("ms") is not None \
            and 4 * ours_ms > eager["ms"]:
        misses.append("< 4x eager")
    return "yes" if not misses else "no (" + ", ".join(misses) + ")"


def training_graph_table(rows: list[dict], labels: dict, targets: bool = True) -> list[str]:
    """GPU time of each method's step captured in a CUDA graph, beside PyTorch's share of the eager step (the loss
    and autograd over a leaf tensor of scores): the two bounds of a host-bound step."""
    rows = [r for r in rows if r.get("pytorch_share_ms") is not None
            or any(v.get("graph_ms") is not None for v in r["results"].values())]
    if not rows:
        return []
    keys = _methods(rows, ("ours", "fmpypi", "lik"))
    head = ["training step"] + [labels[k] + " GPU ms" for k in keys] + \
        ["ours / best peer", "ours eager ms", "PyTorch's share, eager ms"]
    head += ["target ms", "GPU time meets it?"] if targets else []
    body = []
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k) or {}
            cells.append(_fmt_ms(r["graph_ms"]) if r.get("graph_ms") is not None
                         else ("no graph" if r.get("graph_error") else "–"))
        ours = _ours(row)
        ours_gpu = ours.get("graph_ms")
        peers = [row["results"][k]["graph_ms"] for k in keys if k != "ours"
                 and (row["results"].get(k) or {}).get("graph_ms") is not None]
        cells.append(f"{ours_gpu / min(peers):.2f}" if ours_gpu and peers else "–")
        cells.append(_fmt_ms(ours.get("ms")))
        cells.append(_fmt_ms(row.get("pytorch_share_ms")))
        if targets:
            cells.append(f"≤ {row['target_ms']}" if row.get("target_ms") else "–")
            cells.append("–" if ours_gpu is None or not row.get("target_ms")
                         else ("yes" if ours_gpu <= row["target_ms"] else "no"))
        body.append(cells)
    return _table(head, body)


# -------------------------------------------------------------------------------------------------- host cost

HOST_ORDER = ("ours", "fmpypi", "lik", "pytorch_share")


def _fmt_us(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.0f}"


def _us(row: dict, key: str) -> Optional[float]:
    r = row["results"].get(key) or {}
    return r.get("us") if r.get("status") == "ok" else None


def host_table(rows: list[dict], labels: dict, targets: bool = True) -> list[str]:
    """The eager step's microseconds per step (back to back, one synchronisation at the end) for each method and
    PyTorch's share, ours above the share; with ``targets``, the goal (the share plus the row's margin, and no
    peer faster) and whether ours meets it."""
    keys = _methods(rows, HOST_ORDER)
    notes = _Notes()
    head = ["eager training step"] + [labels[k] + " µs" for k in keys] + ["ours above PyTorch's share µs"]
    head += ["goal µs", "met?"] if targets else []
    body = []
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_cell(r, notes, _fmt_us(r.get("us")) if r else "–"))
        ours, share = _us(row, "ours"), _us(row, "pytorch_share")
        cells.append(f"{ours - share:+.0f}" if ours is not None and share is not None else "–")
        if targets:
            goal = share + row["margin_us"] if share is not None and row.get("margin_us") is not None else None
            cells.append(f"≤ {goal:.0f}" if goal is not None else "–")
            cells.append(_host_met(row, ours, goal))
        body.append(cells)
    return _table(head, body) + notes.render()


def _host_met(row: dict, ours: Optional[float], goal: Optional[float]) -> str:
    if ours is None:
        return "no (no result)"
    misses = []
    if goal is not None and ours > goal:
        misses.append("above the share's margin")
    best = _best_peer(row, "us")
    if best is not None and ours > best[0]:
        misses.append("slower than a peer")
    return "yes" if not misses else "no (" + ", ".join(misses) + ")"


def host_gpu_table(rows: list[dict], labels: dict) -> list[str]:
    """Per step of each method: the GPU's kernel time (torch.profiler, every kernel, memset and copy summed), the
    kernels run and the host's kernel-launch calls, and the host's time before the final synchronisation."""
    rows = [r for r in rows if any(v.get("us") is not None for v in r["results"].values())]
    if not rows:
        return []
    keys = _methods(rows, HOST_ORDER)
    head = ["eager training step"] + [labels[k] + " GPU µs / kernels / launches / enqueue µs" for k in keys]
    body = []
    for row in rows:
        cells = [row["name"]]
        for k in keys:
            r = row["results"].get(k) or {}
            if r.get("us") is None:
                cells.append("–")
                continue
            count = (lambda x: "–" if x is None else f"{x:.3g}")
            cells.append(f"{_fmt_us(r.get('gpu_us'))} / {count(r.get('kernels'))} / {count(r.get('launches'))} / "
                         f"{_fmt_us(r.get('enqueue_us'))}")
        body.append(cells)
    return _table(head, body)


# ------------------------------------------------------------------------------------------- compressed index

def _compressed_cell(r: Optional[dict], notes: _Notes, value: str) -> str:
    if r is None:
        return "–"
    if r["status"] == "skipped":
        return "skip " + notes.mark(f"skipped: {r.get('error', '')}")
    if r["status"] in ("error", "oom"):
        return r["status"] + " " + notes.mark(f"{r['status']}: {r.get('error', '')}")
    marks = ""
    if r["status"] == "wrong" or r.get("ok") is False:
        marks += " ✗" + notes.mark("✗ = its scores differ from the float64 reference on the operands it multiplies "
                                   "beyond tolerance (see the check table)")
    if r.get("note"):
        marks += " " + notes.mark(r["note"])
    return value + marks


def _compressed_met(row: dict, key: str, labels: dict) -> str:
    r = row["results"].get(key) or {}
    if r.get("status") != "ok" or r.get("ms") is None:
        return "no (wrong)" if r.get("status") == "wrong" else "no (no result)"
    misses = []
    if row.get("target_ms") is not None and r["ms"] > row["target_ms"]:
        misses.append("time")
    if r.get("bytes_ratio") is not None and r["bytes_ratio"] > row["target_bytes_ratio"]:
        misses.append("bytes")
    for peer in PEER_METHODS:
        p = row["results"].get(peer) or {}
        # a peer that fell back to a non-8-bit path was not measured on its compressed path
        if p.get("status") == "ok" and not p.get("fallback") and p.get("ms") is not None and p["ms"] < r["ms"]:
            misses.append(f"slower than {labels[peer]}")
    return "yes" if not misses else "no (" + ", ".join(misses) + ")"


def _compressed_lines(rows: list[dict]):
    """(row, key, result, first line of its row?) for every method of every compressed row."""
    for row in rows:
        for i, key in enumerate(k for k in COMPRESSED_METHODS if k in row["results"]):
            yield row, key, row["results"][key], i == 0


def compressed_table(rows: list[dict], labels: dict, targets: bool = True) -> list[str]:
    notes = _Notes()
    head = ["shape", "method", "median ms", "index bytes ÷ unquantised", "memory floor ms", "% of memory floor",
            "max score error ÷ max score"] + (["target", "met?"] if targets else [])
    body = []
    for row, key, r, first in _compressed_lines(rows):
        method = _compressed_label(labels, key)
        if key in PEER_METHODS and r.get("variant"):
            method += f" ({r['variant']})"
        ms, floor = r.get("ms"), r.get("memory_floor_ms")
        cells = [row["name"] if first else "", method, _compressed_cell(r, notes, _fmt_ms(ms)),
                 "–" if r.get("bytes_ratio") is None else f"{r['bytes_ratio']:.3f}",
                 _fmt_ms(floor), f"{100 * floor / ms:.0f}%" if ms and floor else "–",
                 _fmt_err(r.get("fid_max_rel_err"))]
        if targets:
            targeted = key in ("ours_int8", "ours_fp8")
            cells.append(f"≤ {row['target_ms']} ms, ≤ {row['target_bytes_ratio']}×"
                         if targeted and row.get("target_ms") is not None else "–")
            cells.append(_compressed_met(row, key, labels) if targeted else "–")
        body.append(cells)
    return _table(head, body) + notes.render()


def compressed_floors_table(rows: list[dict], targets: bool = True) -> list[str]:
    # the int8 index's bytes per token as the run counted them (d + 2 with bf16 scales, d + 4 with fp32 ones)
    scale_bytes = {row["int8_index_bytes"] // (row["B"] * row["Ld"]) - row["d"] for row in rows} or {2}
    head = ["shape", "GFLOP", "memory floor: unquantised index",
            f"memory floor: int8 index (d + {'/'.join(map(str, sorted(scale_bytes)))} B/token)",
            "compute floor at the bf16 rate", "at the int8 rate", "at the fp8 rate"]
    head += ["time target"] if targets else []
    body = []
    for row in rows:
        mem, comp = row.get("memory_floor_ms") or {}, row.get("compute_floor_ms") or {}
        cells = [row["name"], f"{row['flops'] / 1e9:.3g}", _fmt_ms(mem.get("unquantised")), _fmt_ms(mem.get("int8")),
                 _fmt_ms(comp.get("bf16")), _fmt_ms(comp.get("int8")), _fmt_ms(comp.get("fp8"))]
        if targets:
            cells.append(f"≤ {row['target_ms']}" if row.get("target_ms") is not None else "–")
        body.append(cells)
    return _table(head, body)


def compressed_checks_table(rows: list[dict], labels: dict) -> list[str]:
    head = ["shape", "method", "check: max abs. score difference from float64 on its own operands (tolerance)",
            "fidelity: max / mean score error ÷ max score (documents)", "peak MB above inputs",
            "index build s (untimed)"]
    body = []
    for row, key, r, first in _compressed_lines(rows):
        check = "–" if r.get("max_abs_diff") is None else \
            f"{r['max_abs_diff']:.2g} ({r['tol']:.2g}){'' if r.get('ok') else ' ✗'}"
        fid = "–" if r.get("fid_max_rel_err") is None else \
            f"{r['fid_max_rel_err']:.1e} / {r['fid_mean_rel_err']:.1e} ({r['fid_docs']})"
        body.append([row["name"] if first else "", _compressed_label(labels, key), check, fid,
                     _fmt_mb(r.get("peak_mb")), "–" if r.get("prepare_s") is None else f"{r['prepare_s']:.2f}"])
    return _table(head, body)


def compressed_variants_table(rows: list[dict], labels: dict) -> list[str]:
    """Every variant of every peer, the fastest correct one of which is the peer's line in the main table."""
    notes = _Notes()
    body = []
    for row in rows:
        first = True
        for key in [k for k in PEER_METHODS if k in row["results"]]:
            for name, r in (row["results"][key].get("variants") or {}).items():
                body.append([row["name"] if first else "", f"{_compressed_label(labels, key)}: {name}",
                             _compressed_cell(r, notes, _fmt_ms(r.get("ms"))),
                             "–" if r.get("bytes_ratio") is None else f"{r['bytes_ratio']:.3f}",
                             _fmt_err(r.get("fid_max_rel_err"))])
                first = False
    if not body:
        return []
    head = ["shape", "peer variant", "median ms", "index bytes ÷ unquantised", "max score error ÷ max score"]
    return _table(head, body) + notes.render()


# ------------------------------------------------------------------------------------------------- one run

def _passes_text(res: dict) -> str:
    """Which sections' rows were timed again in alternating passes (read from the results themselves: a merged
    file's sections may come from runs made with and without them)."""
    passes, names = set(), []
    for key, name in (("forward", "forward"), ("training", "training"), ("compressed", "compressed-index")):
        counts = {len(r["ms_rounds"]) for row in res.get(key) or [] for r in row["results"].values()
                  if isinstance(r, dict) and r.get("ms_rounds")}
        if counts:
            names.append(name)
            passes |= counts
    if not names:
        return ""
    n = "/".join(str(c) for c in sorted(passes))
    return (f" Rows of the {', '.join(names)} sections: ours and the peers timed again in {n} alternating passes, "
            "median of the passes.")


def _mm8_text(roof: dict, bold: bool = True) -> str:
    """The 8-bit matmul rates of a run, when it measured them (compressed section)."""
    b = "**" if bold else ""
    parts = [f"{name} matmul {b}{format_rate(roof[key], unit)}{b}" for name, key, unit in
             (("int8", "int8_mm_ops", "OP/s"), ("fp8", "fp8_mm_flops", "FLOP/s")) if roof.get(key)]
    if not parts:
        return ""
    how = f" ({roof.get('mm8_n', '?')}³ `torch._int_mm` / `torch._scaled_mm`)" if bold else ""
    return ", " + ", ".join(parts) + how


def run_header(res: dict) -> list[str]:
    """The paragraphs above a run's tables: versions, timer, ceilings, missing peers, merged runs."""
    meta, roof = res["meta"], res.get("roofline") or {}
    out = [f"Run of {meta['date']} on **{meta['device']}**: torch {meta['torch']}, triton {meta['triton']}, "
           f"Python {meta['python']}, flash_maxsim at `{meta.get('git_commit') or '?'}`"
           f"{' (uncommitted changes)' if meta.get('git_dirty') else ''}; timer `{meta['timer']}` "
           f"(warmup {meta['warmup_ms']} ms, rep {meta['rep_ms']} ms, median); inputs {meta['dtype']}, "
           f"random L2-normalised tokens; total {meta.get('elapsed_s', 0):.0f} s." + _passes_text(res), ""]
    if meta.get("smoke"):
        out += ["**CPU smoke run: tiny shapes, numbers meaningless; it only shows that every path runs.**", ""]
    if meta.get("peers_missing"):
        out += ["Peers not available in this run: " + "; ".join(f"`{k}`: {v}" for k, v in
                                                               meta["peers_missing"].items()), ""]
    if roof:
        out += [f"Measured ceilings: device-to-device copy **{format_rate(roof['copy_bw_Bps'], 'B/s')}** (bytes "
                f"read + written), bf16 matmul **{format_rate(roof['bf16_mm_flops'], 'FLOP/s')}** "
                f"({roof['mm_n']}³ `torch.mm`){_mm8_text(roof)}.", ""]
    for run in meta.get("merged_runs") or []:
        r = run.get("roofline") or {}
        ceilings = (f" (its ceilings: {format_rate(r['copy_bw_Bps'], 'B/s')}, "
                    f"{format_rate(r['bf16_mm_flops'], 'FLOP/s')}{_mm8_text(r, bold=False)})" if r else "")
        code = (f", flash_maxsim at `{run['git_commit']}`{' (uncommitted changes)' if run.get('git_dirty') else ''}"
                if run.get("git_commit") else "")
        out += [f"Sections {', '.join(run['sections'])} come from another run, of {run['date']}{code}{ceilings}; "
                "their floors use that run's ceilings.", ""]
    return out


def render_run(res: dict, plots: Optional[dict] = None, level: int = 3, targets: bool = True) -> str:
    """One run's tables as markdown, headings at ``level``; ``plots`` maps a plot's kind ("forward", "training",
    "compressed", "forward_sweep", "training_sweep") to its path relative to the markdown file."""
    labels, plots = labels_for(res["meta"]), plots or {}
    h = "#" * level

    def image(kind, alt):
        return [f"![{alt}]({plots[kind]})", ""] if kind in plots else []

    out = run_header(res)
    if res.get("forward"):
        rows = res["forward"]
        out += [f"{h} Forward: time (ms, median)", ""] + image("forward", "forward time relative to flash_maxsim")
        out += forward_table(rows, labels, targets) + [""]
        out += [f"{h} Forward: peak memory above inputs (MB, outputs included)", ""]
        out += forward_memory_table(rows, labels) + [""]
        out += [f"{h} Forward: correctness (max |Δscore| against flash_maxsim; ✗ = flagged)", ""]
        out += correctness_table(rows, labels, train=False) + [""]
    if res.get("training"):
        rows = res["training"]
        out += [f"{h} Training step: time (ms, median) / peak memory above inputs (MB)", ""]
        out += image("training", "training step time and memory") + training_table(rows, labels, targets) + [""]
        graphed = training_graph_table(rows, labels, targets)
        if graphed:
            out += [f"{h} Training step: GPU time (each step captured in a CUDA graph and replayed) and PyTorch's "
                    "share of the eager step (ms, median)", "",
                    "A step whose eager time is above both its GPU time and PyTorch's share (the loss and "
                    "`autograd.grad` over a leaf tensor of scores, timed alone) is bound by the host.", ""]
            out += graphed + [""]
        out += [f"{h} Training step: correctness (max |Δscore| / gradient relative error against flash_maxsim; "
                "✗ = flagged)", ""] + correctness_table(rows, labels, train=True) + [""]
    if res.get("host"):
        rows = res["host"]
        steps = rows[0].get("steps", "?")
        out += [f"{h} Eager training step: host cost (µs per step, median)", "",
                f"{steps} steps back to back, one synchronisation at the end: what a training loop without CUDA "
                "graphs gets. PyTorch's share is the loss and its gradient over a leaf tensor of scores alone; no "
                "scoring function makes the step cheaper on this host.", ""]
        out += host_table(rows, labels, targets) + [""]
        gpu = host_gpu_table(rows, labels)
        if gpu:
            out += [f"{h} Eager training step: GPU time, kernels and launches per step", "",
                    "From `torch.profiler` over a few steps: the GPU's kernel time summed (not the step's wall "
                    "time), the kernels run, the host's kernel-launch calls; enqueue µs is the host's time per step "
                    "before the final synchronisation.", ""]
            out += gpu + [""]
    if res.get("compressed"):
        rows = res["compressed"]
        out += [f"{h} Compressed index: time (ms, median), index bytes, fidelity", ""]
        out += image("compressed", "compressed-index time") + compressed_table(rows, labels, targets) + [""]
        out += [f"{h} Compressed index: floors (ms)", ""] + compressed_floors_table(rows, targets) + [""]
        out += [f"{h} Compressed index: checks (scores against the float64 reference)", ""]
        out += compressed_checks_table(rows, labels) + [""]
        variants = compressed_variants_table(rows, labels)
        if variants:
            out += [f"{h} Compressed index: every peer variant timed", ""] + variants + [""]
    if res.get("forward_sweep"):
        r0 = res["forward_sweep"][0]
        out += [f"{h} Forward against corpus size (1 query, {r0['Lq']}×{r0['Ld']}, d={r0['d']})", ""]
        out += image("forward_sweep", "forward time and memory against corpus size")
        out += sweep_table(res["forward_sweep"], labels, "documents") + [""]
    if res.get("training_sweep"):
        r0 = res["training_sweep"][0]
        out += [f"{h} Training step against batch size (in-batch, {r0['Lq']}×{r0['Ld']}, d={r0['d']})", ""]
        out += image("training_sweep", "training time and memory against batch size")
        out += sweep_table(res["training_sweep"], labels, "batch") + [""]
    return "\n".join(out).rstrip() + "\n"


def summary(res: dict) -> str:
    """The main tables only, printed last so that they survive a truncated log (results.md has everything)."""
    labels = labels_for(res["meta"])
    out = [f"== {res['meta']['device']}: {res['meta'].get('elapsed_s', 0):.0f} s; timer {res['meta']['timer']}"]
    roof = res.get("roofline")
    if roof:
        out.append(f"== ceilings: copy {format_rate(roof['copy_bw_Bps'], 'B/s')}, "
                   f"bf16 mm {format_rate(roof['bf16_mm_flops'], 'FLOP/s')}")
    if res.get("forward"):
        out += ["", "Forward (ms):"] + forward_table(res["forward"], labels)
    if res.get("training"):
        out += ["", "Training step (ms / MB):"] + training_table(res["training"], labels)
        graphed = training_graph_table(res["training"], labels)
        if graphed:
            out += ["", "Training step, GPU time (CUDA graph) and PyTorch's share (ms):"] + graphed
    if res.get("host"):
        out += ["", "Eager training step, host cost (µs per step):"] + host_table(res["host"], labels)
        out += ["", "Eager training step, GPU µs / kernels / launches / enqueue µs per step:"]
        out += host_gpu_table(res["host"], labels)
    if res.get("compressed"):
        out += ["", "Compressed index (ms, bytes, fidelity):"] + compressed_table(res["compressed"], labels)
    return "\n".join(out) + "\n"


def merge_results(runs: list[dict]) -> dict:
    """Several saved runs as one: the sections of later runs replace those of earlier ones; the header (meta,
    roofline) is the first run's, with the others' listed under meta["merged_runs"]."""
    res = json.loads(json.dumps(runs[0]))
    for other in runs[1:]:
        for key in RESULT_KEYS:
            if other.get(key):
                res[key] = other[key]
        res["meta"].setdefault("merged_runs", []).append(
            {"date": other["meta"]["date"], "sections": [k for k in RESULT_KEYS if other.get(k)],
             "roofline": other.get("roofline"), "elapsed_s": other["meta"].get("elapsed_s"),
             "git_commit": other["meta"].get("git_commit"), "git_dirty": other["meta"].get("git_dirty")})
    return res


# ------------------------------------------------------------------------------------------------------ plots

COLORS = {"torch_bf16": "C0", "eager": "C0", "torch_fp32": "C1", "colpali_loop": "C2", "lik": "C4", "fmpypi": "C5",
          "ours": "C3", "ours_int8": "C3", "ours_fp8": "C6", "ours_exact": "C7"}


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        log.warning("no plots: matplotlib unavailable (%s)", exc)
        return None
    return plt


def _ok(r: Optional[dict], field: str = "ms") -> Optional[float]:
    return r.get(field) if r and r.get("status") == "ok" and r.get(field) is not None else None


def _relative(row: dict, key: str) -> Optional[float]:
    """A method's time on ``row`` divided by flash_maxsim's (None without a correct result)."""
    ms = _ok(row["results"].get(key))
    return ms / _ours(row)["ms"] if ms is not None else None


def _grouped_bars(ax, groups: list[str], series: list[tuple], log_x: bool, origin: float = 0.0):
    """Horizontal bars, one group per entry of ``groups`` (top to bottom), one bar per (label, color, values)
    series with None where a method has no value; bars run from ``origin`` to their value."""
    n = max(1, len(series))
    height = 0.8 / n
    for i, (label, color, values) in enumerate(series):
        ys = [g + (i - (n - 1) / 2) * height for g in range(len(groups))]
        pts = [(y, v) for y, v in zip(ys, values) if v is not None]
        if pts:
            ax.barh([p[0] for p in pts], [p[1] - origin for p in pts], left=origin, height=height, color=color,
                    label=label)
    ax.set_yticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    if log_x:
        ax.set_xscale("log")
    ax.grid(True, axis="x", which="both", alpha=0.3)


def _floor_marks(ax, rows: list[dict]) -> None:
    """The roofline floor of each row as a black tick, relative to flash_maxsim's time."""
    floors = [(i, r["floor_ms"] / _ours(r)["ms"]) for i, r in enumerate(rows) if r.get("floor_ms")]
    if floors:
        ax.plot([f[1] for f in floors], [f[0] for f in floors], "k|", markersize=14, mew=2, label="roofline floor")


def _legend_below(ax) -> None:
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4, frameon=False)


def plot_forward(res: dict, path: Path, plt) -> bool:
    """Each method's forward time relative to flash_maxsim's, per shape, with the roofline floor."""
    rows = [r for r in res.get("forward") or [] if _ok(_ours(r))]
    if not rows:
        return False
    labels = labels_for(res["meta"])
    keys = [k for k in _methods(rows, LABELS) if k != "ours"]
    series = [(labels[k], COLORS[k], [_relative(r, k) for r in rows]) for k in keys]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    _grouped_bars(ax, [r["name"] for r in rows], series, log_x=True, origin=1.0)
    _floor_marks(ax, rows)
    ax.axvline(1.0, color=COLORS["ours"], linewidth=2, label="flash_maxsim")
    ax.set_xlabel("time ÷ flash_maxsim's time (log scale): bars to the right are slower than flash_maxsim")
    _legend_below(ax)
    ax.set_title(f"Forward scoring, {res['meta']['device']}")
    return _save(fig, path, plt)


def plot_training(res: dict, path: Path, plt) -> bool:
    """Each method's training-step time relative to flash_maxsim's, and every method's peak memory."""
    rows = [r for r in res.get("training") or [] if _ok(_ours(r))]
    if not rows:
        return False
    labels = labels_for(res["meta"])
    keys = _methods(rows, TRAINING_ORDER)
    names = [r["name"].replace(", ", ",\n", 1) if len(r["name"]) > 34 else r["name"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 1.8), sharey=True)
    time_series = [(labels[k], COLORS[k], [_relative(r, k) for r in rows]) for k in keys if k != "ours"]
    _grouped_bars(ax_t, names, time_series, log_x=True, origin=1.0)
    _floor_marks(ax_t, rows)
    ax_t.axvline(1.0, color=COLORS["ours"], linewidth=2, label="flash_maxsim")
    ax_t.set_xlabel("step time ÷ flash_maxsim's (log scale): bars to the right are slower")
    mem_series = [(labels[k], COLORS[k], [_ok(r["results"].get(k), "peak_mb") for r in rows]) for k in keys]
    _grouped_bars(ax_m, names, mem_series, log_x=True)
    ax_m.set_xlabel("peak memory above inputs, MB (log scale)")
    if not ax_m.get_legend_handles_labels()[0]:
        ax_m.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax_m.transAxes)
    # one legend for both panels: every method's color (the memory panel has them all) and the floor's tick
    handles, legend_labels = ax_m.get_legend_handles_labels()
    handles += [h for h, n in zip(*ax_t.get_legend_handles_labels()) if n == "roofline floor"]
    legend_labels += ["roofline floor"] * (len(handles) - len(legend_labels))
    fig.legend(handles, legend_labels, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"Training step (scores → loss → gradients), {res['meta']['device']}")
    return _save(fig, path, plt, rect=(0, 0.05, 1, 1))


def plot_compressed(res: dict, path: Path, plt) -> bool:
    """Median time of each compressed-index path, one panel per shape, with the int8 index's memory floor."""
    rows = [r for r in res.get("compressed") or [] if any(_ok(v) for v in r["results"].values())]
    if not rows:
        return False
    labels = labels_for(res["meta"])
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        keys = [k for k in COMPRESSED_METHODS if _ok(row["results"].get(k))]
        ys = range(len(keys))
        ax.barh(ys, [row["results"][k]["ms"] for k in keys], color=[COLORS[k] for k in keys])
        ax.set_yticks(ys, [_compressed_label(labels, k).replace(", unquantised (reference)", " unquantised")
                           for k in keys], fontsize=8)
        ax.set_ylim(len(keys) - 0.5, -0.5)
        floor = (row.get("memory_floor_ms") or {}).get("int8")
        if floor:
            ax.axvline(floor, color="k", linestyle="--", linewidth=1, label="memory floor: the int8 index read once")
        ax.set_title(row["name"], fontsize=9)
        ax.set_xlabel("median ms")
        ax.grid(True, axis="x", alpha=0.3)
    handles, legend_labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, legend_labels, loc="lower center", fontsize=8, frameon=False)
    fig.suptitle(f"Compressed index (bf16 queries), {res['meta']['device']}")
    return _save(fig, path, plt, rect=(0, 0.06, 1, 1))


def plot_sweep(res: dict, key: str, path: Path, plt) -> bool:
    """Time and memory of every method against corpus size (forward) or batch size (training)."""
    rows = res.get(key) or []
    if not rows:
        return False
    xlabel, title = {"forward_sweep": ("documents in the corpus (1 query, {Lq}×{Ld}, d={d})", "Forward scoring"),
                     "training_sweep": ("in-batch batch size ({Lq}×{Ld}, d={d})",
                                        "Training step (scores → loss → backward)")}[key]
    labels = labels_for(res["meta"])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k in _methods(rows, LABELS):
        pts = [(r["B"], r["results"][k].get("ms"), r["results"][k].get("peak_mb")) for r in rows
               if k in r["results"] and r["results"][k].get("status") == "ok"]
        style = dict(marker="o", linewidth=2.5 if k == "ours" else 1.3, label=labels[k], color=COLORS[k])
        if any(p[1] is not None for p in pts):
            ax_t.plot([p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None], **style)
        if any(p[2] is not None for p in pts):
            ax_m.plot([p[0] for p in pts if p[2] is not None], [max(p[2], 1e-2) for p in pts if p[2] is not None],
                      **style)
    floors = [(r["B"], r["floor_ms"]) for r in rows if r.get("floor_ms")]
    if floors:
        ax_t.plot([f[0] for f in floors], [f[1] for f in floors], "k--", linewidth=1, label="roofline floor")
    for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "peak memory above inputs (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel.format(**rows[0]))
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{title}: {res['meta']['device']}")
    return _save(fig, path, plt)


def _save(fig, path: Path, plt, rect=None) -> bool:
    fig.tight_layout(rect=rect)
    try:
        fig.savefig(path, dpi=90)
        return True
    except OSError as exc:
        log.warning("could not write %s: %s", path, exc)
        return False
    finally:
        plt.close(fig)


PLOTS = {  # kind -> function(results, path, pyplot) that draws it, False when the run has no data for it
    "forward": plot_forward,
    "training": plot_training,
    "compressed": plot_compressed,
    "forward_sweep": lambda res, path, plt: plot_sweep(res, "forward_sweep", path, plt),
    "training_sweep": lambda res, path, plt: plot_sweep(res, "training_sweep", path, plt),
}


def make_plots(res: dict, out_dir: Path, prefix: str = "") -> dict:
    """Draws every plot ``res`` has data for into ``out_dir`` as ``{prefix}{kind}.png``; returns kind -> path."""
    plt = _pyplot()
    if plt is None:
        return {}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for kind, draw in PLOTS.items():
        path = out_dir / f"{prefix}{kind.replace('_', '-')}.png"
        if draw(res, path, plt):
            written[kind] = path
    return written


# ------------------------------------------------------------------------------------------------ CPU section

CPU_TITLE = "CPU"
CPU_OURS, CPU_EAGER = "flash_maxsim", "eager"
CPU_PEER_COLORS = ("C2", "C8", "C9", "C4", "C5")

CPU_INTRO = """\
How fast `flash_maxsim.maxsim` scores and trains on CPU tensors (an exact blocked PyTorch path, not the GPU
kernels), next to eager PyTorch and the native CPU implementations of MaxSim: one run of
`benchmarks/cpu_bench.py`. `flash-maxsim check` on a CPU runs two of its rows (1x1k and train-B32) in short form.
"""


def _cpu_impls(cpu: dict) -> list[str]:
    """The implementations of a CPU run in column order: eager, flash_maxsim, then the peers as first met."""
    names = [CPU_EAGER, CPU_OURS]
    for row in cpu["rows"]:
        names += [k for k in row["ms"] if k not in names]
    return names


def _cpu_label(cpu: dict, key: str) -> str:
    version = (cpu["machine"].get("peers") or {}).get(key)
    return f"{key} {version}" if version else key


def _cpu_peers(cpu: dict) -> list[str]:
    return [k for k in _cpu_impls(cpu) if k not in (CPU_EAGER, CPU_OURS)]


def cpu_header(cpu: dict) -> list[str]:
    """The run's machine, threads and load, what runs in each column, and the method."""
    m = cpu["machine"]
    rounds = sorted({r["rounds"] for r in cpu["rows"]})
    peers = _cpu_peers(cpu)
    load = ""
    if cpu.get("load_before") and cpu.get("load_after"):
        load = (f"; load average (1 min) {cpu['load_before'][0]:.2f} before the run, {cpu['load_after'][0]:.2f} "
                "after it")
    peer_text = (f"; peers {', '.join(_cpu_label(cpu, k) for k in peers)} with their thread pool on "
                 f"{m.get('peer_threads', 'all cores')}" if peers else "; no peer installed")
    out = [f"Run of {cpu['date']} on **{m.get('model') or m.get('processor', '?')}, {m['cpus']} logical CPUs** "
           f"({m['platform']}): torch {m['torch']} with **{m['torch_threads']} intra-op threads**, Python "
           f"{m['python']}{peer_text}{load}.", ""]
    rows = [["eager", '`torch.einsum("qid,bjd->qbij", Q, D).amax(-1).sum(-1)` in fp32: colpali-engine\'s scoring, '
                      "PyLate's without masks"],
            ["flash_maxsim", "`flash_maxsim.maxsim(Q, D)` on CPU tensors (this project)"]]
    if peers:
        rows.append([" / ".join(_cpu_label(cpu, k) for k in peers),
                     "Rust SIMD extensions from PyPI: `maxsim_scores(query [Lq, d], documents [B, Ld, d])` on numpy "
                     "arrays sharing the tensors' memory, one call per query; scoring only (no backward)"])
    out += _table(["column", "what runs"], rows) + [""]
    diffs = {}
    for row in cpu["rows"]:
        for k, v in row["max_abs_diff_vs_eager"].items():
            if k != CPU_EAGER:
                diffs[k] = max(diffs.get(k, 0.0), v)
    agreement = ", ".join(f"{_cpu_label(cpu, k)} {v:.1e}" for k, v in diffs.items())
    out += [f"Method: fp32 inputs, d = 128, random L2-normalised tokens, no masks. Each round runs every "
            f"implementation of a row once, in an order rotated from round to round; the tables give the median of "
            f"{'/'.join(map(str, rounds))} rounds and its ratio to eager's median (÷ eager: below 1 is faster than "
            "eager), so that a machine's load slows every implementation alike. The training step is scores, "
            "cross-entropy over the in-batch scores and the backward to queries and documents. Peak memory is the "
            "resident-set high-water mark during one call above the resident set before it (Linux "
            "`/proc/self/clear_refs`; glibc made to return freed memory first), outputs included. Every "
            "implementation's scores (a step's loss and gradients) are compared with eager's in the same run; "
            f"largest absolute difference: {agreement}.", ""]
    return out


def cpu_time_table(cpu: dict) -> list[str]:
    impls = _cpu_impls(cpu)
    head = ["row", "shape"] + [_cpu_label(cpu, k) for k in impls] + ["ours / best peer"]
    body = []
    for row in cpu["rows"]:
        cells = [row["row"], row["shape"]]
        for k in impls:
            if k not in row["ms"]:
                cells.append("–")
            elif k == CPU_EAGER:
                cells.append(_fmt_ms(row["ms"][k]))
            else:
                cells.append(f"{_fmt_ms(row['ms'][k])} ({row['vs_eager'][k]:.2f})")
        best = row.get("flash_vs_best_peer")
        cells.append("–" if best is None else f"{best:.2f}")
        body.append(cells)
    return _table(head, body)


def cpu_memory_table(cpu: dict) -> list[str]:
    impls = _cpu_impls(cpu)
    body = []
    for row in cpu["rows"]:
        peak = row.get("peak_mib") or {}
        body.append([row["row"]] + [_fmt_mb(peak.get(k)) if k in row["ms"] else "–" for k in impls])
    return _table(["row"] + [_cpu_label(cpu, k) for k in impls], body)


def plot_cpu(cpu: dict, path: Path, plt) -> bool:
    """Each implementation's time relative to eager's, per row, with eager at 1."""
    rows = [r for r in cpu.get("rows") or [] if r.get("vs_eager")]
    if not rows:
        return False
    keys = [k for k in _cpu_impls(cpu) if k != CPU_EAGER]
    colors = {CPU_OURS: COLORS["ours"], **dict(zip(_cpu_peers(cpu), CPU_PEER_COLORS))}
    series = [(_cpu_label(cpu, k), colors[k], [r["vs_eager"].get(k) for r in rows]) for k in keys]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.8))
    _grouped_bars(ax, [r["row"] for r in rows], series, log_x=False)
    ax.axvline(1.0, color=COLORS["eager"], linewidth=2, label="eager einsum (1.0)")
    ax.set_xlim(0, max(1.1, 1.05 * max(v for _, _, vals in series for v in vals if v is not None)))
    ax.set_xlabel("time ÷ eager's time: bars left of the line are faster than eager")
    _legend_below(ax)
    m = cpu["machine"]
    ax.set_title(f"CPU, {m.get('model') or m.get('processor', '?')}, {m['torch_threads']} threads: "
                 "time relative to eager PyTorch")
    return _save(fig, path, plt)


def render_cpu(cpu: dict, plot: Optional[str] = None, level: int = 3) -> str:
    """The CPU section's body (below its heading): intro, machine and method, the plot, time and memory tables."""
    h = "#" * level
    out = [CPU_INTRO] + cpu_header(cpu)
    out += [f"{h} CPU: time (ms, median; ÷ eager's in brackets)", ""]
    out += ([f"![CPU time relative to eager]({plot})", ""] if plot else []) + cpu_time_table(cpu) + [""]
    out += [f"{h} CPU: peak memory above the call's start (MiB, outputs included)", ""]
    out += cpu_memory_table(cpu) + [""]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------------------------- fidelity table

def fidelity_table(reports: list[dict]) -> list[str]:
    """Rows of retrieval_fidelity.py's JSON reports: each scorer's ranking against the float64 reference's."""
    body = []
    for report in reports:
        where = "CPU" if report.get("device") == "cpu" else (report.get("device_name") or "GPU").split(",")[0]
        for r in report["results"]:
            for name, s in r["scorers"].items():
                body.append([r["dataset"], where, name,
                             f"{s['ndcg@10']:.4f}", f"{s['delta_ndcg@10']:+.1e}",
                             f"{s['top10_identical']}/{r['queries']}", f"{s['top10_overlap_mean']:.3f}",
                             f"{s['abs_error']['max']:.1e}", f"{s['rel_error_max']:.1e}"])
    head = ["dataset", "scored on", "scorer", "nDCG@10", "Δ nDCG@10 vs float64", "top-10 identical",
            "mean top-10 overlap", "max abs. score error", "max rel. score error"]
    return _table(head, body)


# ---------------------------------------------------------------------------------------------------- search
# search_bench.py's results: one row per corpus x storage x placement x batch size, each with every method's
# result and the floors measured in the same run.

SEARCH_ORDER = ("ours", "maxsim", "torch_chunked", "lik", "fmpypi", "plaid", "voyager")
SEARCH_LABELS = {"ours": "flash_maxsim", "maxsim": "maxsim, all scores", "torch_chunked": "torch chunked",
                 "plaid": "PLAID", "voyager": "Voyager"}
SEARCH_COLORS = {"ours": "C3", "maxsim": "C7", "torch_chunked": "C0", "lik": "C4", "fmpypi": "C5", "plaid": "C2",
                 "voyager": "C8"}
FLOOR_NAMES = {"hbm": "HBM", "tensor": "tensor", "h2d": "H2D"}


def search_labels(meta: dict) -> dict:
    labels = labels_for(meta)
    labels.update(SEARCH_LABELS)
    return labels


def _search_cell(r: Optional[dict], notes: _Notes, value: str) -> str:
    if r is not None and r.get("status") == "wrong":
        return value + " ✗" + notes.mark("✗ = not the exact top-k within tolerance (" + _search_check_text(r) + ")")
    return _cell(r, notes, value)


def _search_check_text(r: dict) -> str:
    parts = []
    if r.get("recall") is not None:
        parts.append(f"recall {r['recall']:.3f}")
    if r.get("kth_gap") is not None and r.get("exact", True):
        parts.append(f"k-th score short by {r['kth_gap']:.3g}")
    if r.get("score_err") is not None:
        parts.append(f"score error {r['score_err']:.3g}")
    if r.get("max_abs_diff") is not None:
        parts.append(f"max |Δscore| {r['max_abs_diff']:.3g}")
    if r.get("tol") is not None and r["tol"] != float("inf"):
        parts.append(f"tol {r['tol']:.3g}")
    if r.get("note"):
        parts.append(r["note"])
    return ", ".join(parts)


def _group(row: dict) -> str:
    return f"{row['label']} · {row['storage']} · {row['placement']}"


def _gb(x: Optional[float]) -> str:
    return "–" if not x else f"{x / 1e9:.3g}"


def search_time_table(rows: list[dict], labels: dict) -> list[str]:
    """Median ms of every method per row, the floor (and which one binds) and ours ÷ floor."""
    keys = _methods(rows, SEARCH_ORDER)
    notes = _Notes()
    head = ["corpus · storage · placement", "queries", "documents", "GB"] + [labels[k] for k in keys]
    head += ["floor (bound)", "ours ÷ floor"]
    body = []
    for row in rows:
        cells = [_group(row), str(row["Nq"]), f"{row['docs']:,}", _gb(row.get("corpus_bytes"))]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_search_cell(r, notes, _fmt_ms(r.get("ms") if r else None)))
        floor, ours = row.get("floor_ms"), _ours_ms(row)
        cells.append(f"{_fmt_ms(floor)} ({FLOOR_NAMES.get(row.get('floor_kind'), '?')})" if floor else "–")
        cells.append(f"{ours / floor:.2f}" if ours and floor else "–")
        body.append(cells)
    for row in rows:
        # a row's note, unless it is the reason its own result was skipped (footnoted already)
        if row.get("note") and (row["results"].get("ours") or {}).get("error") != row["note"]:
            notes.mark(f"{_group(row)}: {row['note']}")
    return _table(head, body) + notes.render()


def search_ratio_table(rows: list[dict]) -> list[str]:
    """Ours against each floor, the streamed rate, the top-k's cost over the full scores, the N-GPU scaling."""
    head = ["corpus · storage · placement", "queries", "ours ms", "HBM floor", "tensor floor", "H2D floor",
            "× HBM floor", "× tensor floor", "% of H2D rate", "top-k ÷ maxsim", "N-GPU scaling"]
    body = []
    for row in rows:
        ours, f = _ours_ms(row), row.get("floors") or {}
        r = _ours(row)
        maxsim = _ok(row["results"].get("maxsim"))

        def times(key):
            return f"{ours / f[key]:.2f}" if ours and f.get(key) else "–"
        body.append([_group(row), str(row["Nq"]), _fmt_ms(ours), _fmt_ms(f.get("hbm_ms")),
                     _fmt_ms(f.get("tensor_ms")), _fmt_ms(f.get("h2d_ms")), times("hbm_ms"), times("tensor_ms"),
                     f"{100 * r['h2d_fraction']:.0f}%" if r.get("h2d_fraction") else "–",
                     f"{ours / maxsim:.3f}" if ours and maxsim else "–",
                     f"{r['scaling']:.2f}" if r.get("scaling") else "–"])
    return _table(head, body)


def search_memory_table(rows: list[dict], labels: dict) -> list[str]:
    keys = _methods(rows, SEARCH_ORDER)
    notes = _Notes()
    body = []
    for row in rows:
        cells = [_group(row), str(row["Nq"])]
        for k in keys:
            r = row["results"].get(k)
            cells.append(_search_cell(r, notes, _fmt_mb(r.get("peak_mb") if r else None)))
        body.append(cells)
    return _table(["corpus · storage · placement", "queries"] + [labels[k] for k in keys], body) + notes.render()


def search_checks_table(rows: list[dict], labels: dict) -> list[str]:
    """Each top-k against the exact one: "identical" (documents, order and scores), else the recall@k and ✗
    where it is not a correct top-k within tolerance; ours on a prefix against the float64 reference."""
    keys = _methods(rows, SEARCH_ORDER)
    body = []
    for row in rows:
        ref = row.get("reference_check")
        cells = [_group(row), str(row["Nq"]),
                 "–" if not ref else ("ok" if ref.get("ok") else "✗ " + _search_check_text(ref))]
        for k in keys:
            r = row["results"].get(k) or {}
            if r.get("max_abs_diff") is not None:
                cells.append(f"max |Δ| {r['max_abs_diff']:.2g}" + ("" if r.get("ok") else " ✗"))
            elif r.get("recall") is None:
                cells.append("–")
            elif r.get("identical"):
                cells.append("identical")
            else:
                cells.append(f"recall {r['recall']:.3f}" + ("" if r.get("ok") else " ✗"))
        body.append(cells)
    head = ["corpus · storage · placement", "queries", "flash_maxsim vs float64 (prefix)"] + [labels[k] for k in keys]
    return _table(head, body)


SEARCH_GOALS = (
    ("resident int8, 8.8M passages, 1 query: ≤ 1.15× its HBM floor", "passages-8.8m", "int8", "resident", 1,
     lambda row, r: (row["floors"].get("hbm_ms"), 1.15)),
    ("resident int8, 8.8M passages, 8 queries: ≤ 1.25× its tensor-core floor", "passages-8.8m", "int8", "resident",
     8, lambda row, r: (row["floors"].get("tensor_ms"), 1.25)),
)


def search_goals(res: dict) -> list[tuple[str, str, str]]:
    """(goal, measured, met) for the goals the rows can answer."""
    rows = res.get("search") or []
    out = []
    for text, corpus, storage, placement, nq, floor_of in SEARCH_GOALS:
        row = next((r for r in rows if (r["corpus"], r["storage"], r["placement"], r["Nq"]) ==
                    (corpus, storage, placement, nq)), None)
        ours = _ours_ms(row) if row else None
        floor, limit = floor_of(row, _ours(row)) if row and row.get("floors") else (None, None)
        if ours and floor:
            out.append((text, f"{ours:.3f} ms = {ours / floor:.2f}× ({floor:.3f} ms)",
                        "yes" if ours <= limit * floor else "no"))
        else:
            out.append((text, "not measured", "–"))
    fractions = [(r["results"]["ours"]["h2d_fraction"], r) for r in rows
                 if (r["results"].get("ours") or {}).get("h2d_fraction")]
    if fractions:
        worst = min(fractions, key=lambda x: x[0])
        out.append(("host-streamed index: ≥ 85% of the pinned host-to-device bandwidth",
                    f"{100 * worst[0]:.0f}% at worst ({worst[1]['name']}), "
                    f"{100 * max(f for f, _ in fractions):.0f}% at best", "yes" if worst[0] >= 0.85 else "no"))
    else:
        out.append(("host-streamed index: ≥ 85% of the pinned host-to-device bandwidth", "not measured", "–"))
    overheads = [(_ours_ms(r) / _ok(r["results"].get("maxsim")), r) for r in rows
                 if _ours_ms(r) and _ok(r["results"].get("maxsim"))]
    if overheads:
        worst = max(overheads, key=lambda x: x[0])
        out.append(("top-k costing ≤ 5% over maxsim on the same corpus",
                    f"{100 * (worst[0] - 1):+.1f}% at worst ({worst[1]['name']})", "yes" if worst[0] <= 1.05 else "no"))
    scaling = [(r["results"]["ours"]["scaling"], r) for r in rows if (r["results"].get("ours") or {}).get("scaling")]
    if scaling:
        worst = min(scaling, key=lambda x: x[0])
        out.append(("N GPUs ≥ 0.9·N times one GPU's throughput", f"{worst[0]:.2f} at worst ({worst[1]['name']})",
                    "yes" if worst[0] >= 0.9 else "no"))
    else:
        gpus = res["meta"].get("gpus")
        out.append(("N GPUs ≥ 0.9·N times one GPU's throughput",
                    f"not measurable: {gpus} GPU" + ("" if gpus == 1 else "s"), "–"))
    return out


def search_header(res: dict) -> list[str]:
    meta, roof = res["meta"], res.get("roofline") or {}
    out = [f"Run of {meta['date']} on **{meta['device']}** ({meta.get('gpus', '?')} GPU"
           f"{'' if meta.get('gpus') == 1 else 's'}): torch {meta['torch']}, triton {meta['triton']}, flash_maxsim "
           f"at `{meta.get('git_commit') or '?'}`{' (uncommitted changes)' if meta.get('git_dirty') else ''}; "
           f"timer `{meta['timer']}`; top-{meta.get('k', 10)}, 32-token bf16 queries; total "
           f"{meta.get('elapsed_s', 0):.0f} s.", ""]
    if meta.get("smoke"):
        out += ["**CPU smoke run: tiny corpora, numbers meaningless; it only shows that every path runs.**", ""]
    if meta.get("peers_missing"):
        out += ["Peers not available in this run: " + "; ".join(f"`{k}`: {v}" for k, v in
                                                               meta["peers_missing"].items()), ""]
    if roof:
        parts = [f"device-to-device copy **{format_rate(roof['copy_bw_Bps'], 'B/s')}** (bytes read + written)",
                 f"bf16 matmul **{format_rate(roof['bf16_mm_flops'], 'FLOP/s')}**"]
        if roof.get("int8_mm_ops"):
            parts.append(f"int8 matmul **{format_rate(roof['int8_mm_ops'], 'OP/s')}**")
        if roof.get("h2d_Bps"):
            parts.append(f"pinned host-to-device copy **{format_rate(roof['h2d_Bps'], 'B/s')}**")
        out += ["Measured ceilings: " + ", ".join(parts) + ".", ""]
    for run in meta.get("merged_runs") or []:
        out += [f"Rows of {', '.join(run['groups'])} come from another run, of {run['date']} (flash_maxsim at "
                f"`{run.get('git_commit') or '?'}`); their floors use that run's ceilings.", ""]
    return out


def render_search_run(res: dict, plots: Optional[dict] = None, level: int = 3, targets: bool = True) -> str:
    """One search run's tables as markdown (``plots``: kind "search" -> the plot's path)."""
    rows, labels, plots = res.get("search") or [], search_labels(res["meta"]), plots or {}
    h = "#" * level
    out = search_header(res)
    if not rows:
        return "\n".join(out + ["No rows."]) + "\n"
    out += [f"{h} Search: time (ms, median)", ""]
    if "search" in plots:
        out += [f"![search time relative to each row's floor]({plots['search']})", ""]
    out += search_time_table(rows, labels) + [""]
    out += [f"{h} Search: ours against the floors", ""] + search_ratio_table(rows) + [""]
    out += [f"{h} Search: peak GPU memory above the corpus (MB, outputs included)", ""]
    out += search_memory_table(rows, labels) + [""]
    out += [f"{h} Search: checks against the exact top-k", ""] + search_checks_table(rows, labels) + [""]
    if targets:
        out += [f"{h} Search: goals", ""] + _table(["goal", "measured", "met?"],
                                                    [list(g) for g in search_goals(res)]) + [""]
    return "\n".join(out).rstrip() + "\n"


def search_summary(res: dict) -> str:
    """The time table and the goals, printed last."""
    rows = res.get("search") or []
    out = [f"== search on {res['meta']['device']}: {res['meta'].get('elapsed_s', 0):.0f} s, {len(rows)} rows"]
    if rows:
        out += [""] + search_time_table(rows, search_labels(res["meta"]))
        out += ["", "Goals:"] + _table(["goal", "measured", "met?"], [list(g) for g in search_goals(res)])
    return "\n".join(out) + "\n"


def merge_search(runs: list[dict]) -> dict:
    """Several search runs as one: rows of later runs replace earlier rows of the same name, new ones are added
    in order; the header is the first run's, the others listed under meta["merged_runs"]."""
    res = json.loads(json.dumps(runs[0]))
    for other in runs[1:]:
        names = {r["name"]: i for i, r in enumerate(res["search"])}
        for row in other.get("search") or []:
            row = dict(row, run_date=other["meta"]["date"])
            if row["name"] in names:
                res["search"][names[row["name"]]] = row
            else:
                res["search"].append(row)
        groups = sorted({_group(r) for r in other.get("search") or []})
        res["meta"].setdefault("merged_runs", []).append(
            {"date": other["meta"]["date"], "groups": groups, "roofline": other.get("roofline"),
             "git_commit": other["meta"].get("git_commit"), "elapsed_s": other["meta"].get("elapsed_s")})
    return res


def plot_search(res: dict, path: Path, plt) -> bool:
    """Every method's time divided by the row's floor (log scale; 1 = the floor): one panel per batch size, one
    group of bars per corpus · storage · placement."""
    rows = [r for r in res.get("search") or [] if r.get("floor_ms") and any(_ok(v) for v in r["results"].values())]
    if not rows:
        return False
    labels = search_labels(res["meta"])
    keys = _methods(rows, SEARCH_ORDER)
    groups = list(dict.fromkeys(_group(r) for r in rows))
    batches = sorted({r["Nq"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches) + 3, 0.18 * len(groups) * len(keys) + 1.6),
                             sharex=True, sharey=True, squeeze=False)
    for ax, nq in zip(axes[0], batches):
        by_group = {_group(r): r for r in rows if r["Nq"] == nq}
        series = []
        for k in keys:
            values = []
            for g in groups:
                r = by_group.get(g)
                ms = _ok(r["results"].get(k)) if r else None
                values.append(ms / r["floor_ms"] if ms else None)
            series.append((labels[k], SEARCH_COLORS[k], values))
        _grouped_bars(ax, groups, series, log_x=True, origin=1.0)
        ax.axvline(1.0, color="k", linewidth=1.5, label="the floor (HBM, tensor-core or H2D, this run's)")
        ax.set_title(f"{nq} quer{'y' if nq == 1 else 'ies'} per batch", fontsize=9)
        ax.set_xlabel("time ÷ floor (log)")
    handles, names = [], []
    for ax in axes[0]:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize=8, frameon=False)
    fig.suptitle(f"Exact top-{res['meta'].get('k', 10)} search: time ÷ floor, {res['meta']['device']}")
    return _save(fig, path, plt, rect=(0, 0.6 / (0.18 * len(groups) * len(keys) + 1.6), 1, 1))


def make_search_plots(res: dict, out_dir: Path, prefix: str = "") -> dict:
    plt = _pyplot()
    if plt is None:
        return {}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}search.png"
    return {"search": path} if plot_search(res, path, plt) else {}


RETRIEVER_LABELS = {"search": "flash_maxsim.search", "index": "flash_maxsim.DocumentIndex",
                    "plaid": "PLAID (PyLate, fast-plaid)", "voyager": "Voyager (PyLate)"}


def quality_table(reports: list[dict]) -> list[str]:
    """retrieval_fidelity.py --retrievers: each retriever's nDCG@10, its recall@10 against the exact top-10
    (float64 scores) and how many of its rankings equal exhaustive scoring's. (Their seconds stay in the JSON:
    measured on whatever CPU ran them, they are no speed comparison.)"""
    body = []
    for report in reports:
        where = "CPU" if report.get("device") == "cpu" else (report.get("device_name") or "GPU").split(",")[0]
        for r in report["results"]:
            for name, s in (r.get("retrievers") or {}).items():
                label = RETRIEVER_LABELS.get(name, name)
                if s.get("error"):
                    body.append([r["dataset"], where, label, "error: " + s["error"][:80]] + ["–"] * 3)
                    continue
                body.append([r["dataset"], where, label, f"{s['ndcg@10']:.4f}",
                             f"{s['ndcg@10'] - s['ndcg@10_exact']:+.4f}", f"{s['recall@10']:.3f}",
                             f"{s['identical_to_exhaustive']}/{r['queries']}"])
    head = ["dataset", "on", "retriever", "nDCG@10", "Δ vs exact", "recall@10 vs exact",
            "top-10 identical to exhaustive scoring"]
    return _table(head, body)


# ------------------------------------------------------------------------------------------------------- page

PAGE_INTRO = """\
# Benchmarks

<!-- Generated by `python benchmarks/report.py page` from benchmarks/results/*.json; edit the template in
benchmarks/report.py and regenerate, never this file. -->

How fast `flash_maxsim.maxsim` scores and trains, next to what users run today (eager PyTorch) and next to the
two other fused implementations, with a roofline floor measured in the same run. Each GPU's section is one run
of `benchmarks/bench.py`; to run it on your own GPU, see [benchmarks/README.md](../benchmarks/README.md).
Absolute numbers drift between machines and runs; the ratios to the peers and to the floor of the same run are
what count.

Sections: {contents}

## What is compared

| column | what runs |
|---|---|
| flash_maxsim | `flash_maxsim.maxsim(queries, documents)` (this project, at the commit the run names) |
| eager bf16 | `torch.einsum("qid,bjd->qbij", Q, D).amax(-1).sum(-1)` in the input dtype: what PyLate-style code computes |
| eager fp32 | the same einsum on inputs cast to fp32 (fp32 accumulation; `"highest"` matmul precision, no TF32) |
| colpali loop | colpali-engine's `score_multi_vector` algorithm (0.3.18), re-written from its documented behaviour: blocks of 128 queries × 128 passages, each padded with `pad_sequence` and scored with the torch einsum; blocks stay on the GPU |
| eager autograd | training: the eager einsum above (colpali-engine's `tau * logsumexp(s / tau)` for the smooth max) under autograd |
| LIK | `late_interaction_kernels` 0.4.5: `maxsim(Q, D)` (3-D documents in-batch, 4-D per-query candidates), its autograd for training |
| flash-maxsim | flash-maxsim 0.3.0 from PyPI (imported as `flash_maxsim_pypi`): `flash_maxsim(Q[0], D)` for one query (also with `splitk=True` for long queries and documents; the faster correct variant is kept), `flash_maxsim_batched(Q, D)` for several, `flash_maxsim_batched_train(Q, D, shared_docs=...)` for training |

Inputs are bf16, random and L2-normalised per token (what ColBERT and ColPali models emit), d = 128 unless the
row says otherwise, no masks. Shapes read "queries×documents, query tokens×document tokens".

**Compressed index** (one bf16 query against 10k documents):

| line | what runs | what is quantised |
|---|---|---|
| flash_maxsim int8 / fp8 | `flash_maxsim.maxsim(queries, flash_maxsim.quantize(documents, dtype="int8"/"fp8"))` | documents: int8 or e4m3 values with one scale per token; with d ≤ 256 **the query too**, per token, in the kernel (int8 × int8 or fp8 × fp8 tensor-core products) |
| flash_maxsim, unquantised | `flash_maxsim.maxsim(queries, documents)` on the bf16 documents | nothing |
| flash-maxsim int8×int8 | flash-maxsim 0.3.0's `flash_maxsim_int8x8(Q[0], D_int8, d_scales)`, documents from its `quantize_int8_symmetric` | documents (int8, one fp16 scale per token) **and the query** (its `quantize_query_int8`) |
| LIK fp8 | late-interaction-kernels 0.4.5's `fp8.maxsim_inference_fp8(Q8, D8, scale_Q=, scale_D=)`, both sides from its `quantize_fp8_per_token` | documents (e4m3, one fp32 scale per token) **and the query** (e4m3 per token) |

Each peer runs in two variants, the query quantised inside the timed call (what a search service does per
request) and beforehand (the kernel alone); the faster variant whose arithmetic checks out is its line, and
every variant is listed. The documents are quantised once per shape, outside the timed region.

## Method

- **Time**: median of `triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")` (milliseconds);
  do_bench clears the L2 cache before every repetition. When a working set is smaller than twice the L2 cache,
  calls also cycle through up to 8 distinct copies of the inputs. Ours and the peers are then timed again in 3
  alternating passes per row and the median of the passes is reported, so that clock drift hits every method
  alike.
- **Memory**: `torch.cuda.max_memory_allocated()` during one call, after `reset_peak_memory_stats()`, minus what
  was allocated before: the peak above the inputs, outputs (scores, gradients) included.
- **Correctness**: every method's first call on every shape is compared with flash_maxsim's result (scores; for
  training both gradients too, as a relative Frobenius error), and flash_maxsim with the float64 reference
  (`flash_maxsim.reference.maxsim`) on a 2-query × 8-document slice. A result outside tolerance is timed but
  marked ✗ and never counts as "best peer". Tolerances: paths that sum products in fp32 2e-3 + 2e-5·Lq on
  scores and 2e-2 on gradients; eager bf16 (similarities and scores rounded to bf16) 2·2⁻⁸·max|score| + 1e-2
  and 0.5 on gradients (bf16 similarities tie often, and `amax` splits the gradient among ties).
- **Roofline floor**, measured in the same run: copy bandwidth (bytes read + written by a 1 GiB device-to-device
  copy) and bf16 matmul rate (an 8192³ `torch.mm`). Forward floor = max(bytes / bandwidth, flops / rate), bytes
  = inputs read once + fp32 scores written, flops = 2·Nq·B·Lq·Ld·d. Training floor: inputs read twice, both
  gradients and the scores written; flops 2·Nq·C·Lq·Ld·d for the hard max (its backward gathers arg-max rows),
  four times that for the smooth max. "% of floor" = floor ÷ time; "ours / best peer" < 1 means faster.
- **Training step** = scores → loss → `torch.autograd.grad` for queries and documents. In-batch rows use
  cross-entropy over scores ÷ 0.02 (colpali-engine's `ColbertLoss` temperature), the positive of query i being
  document i·B/Nq ("B64 + 7 negatives": 64 queries against the batch's 512 documents); the KD row uses the KL
  divergence to fixed random teacher scores over each query's 64 candidates (documents `[Nq, K, Ld, d]`); the
  smooth max uses τ = 0.1 (colpali-engine's `ColbertModule` default). The GPU-time table replays each step from
  a CUDA graph; PyTorch's share is the loss and `autograd.grad` over a leaf tensor of scores, timed alone.
- **Host cost of the eager training step**: in-batch steps of 8 queries against 8 documents of 32×64 tokens and
  of the ColBERT B128 row (scores → the cross-entropy above → `autograd.grad`), run back to back, 200 steps per pass and one synchronisation at the end, microseconds per step, median of 3
  alternating passes: what a training loop without CUDA graphs gets, on that machine's host. PyTorch's share is
  the loss and its gradient over a leaf tensor of scores alone. A second table gives each step's GPU kernel time
  (`torch.profiler`, every kernel summed), its kernels and the host's kernel-launch calls.
- **Skips**: an eager baseline is skipped when its estimated memory exceeds 85% of free GPU memory or its
  estimated time per call exceeds 2 s; a peer that lacks an operation (the smooth max) is skipped.
- **Compressed index**: "index bytes ÷ unquantised" = bytes the index keeps resident (values + scales) ÷ the
  bf16 documents' bytes; "memory floor" = index bytes ÷ copy bandwidth. The floors table adds the compute floors
  at the bf16, int8 (`torch._int_mm`) and fp8 (`torch._scaled_mm`) matmul rates measured in the same run.
  **Fidelity**: max |score − exact| ÷ max |exact| over the first documents of the corpus (up to 1000), exact =
  the float64 reference on the *unquantised* inputs: what each path's quantisation costs. **Check**: each path's
  scores against the float64 reference on the very operands it multiplies (its dequantised documents and query),
  1 query × 8 documents, tolerance the fp32 one + 5·10⁻⁴·max|score|; a path that fails is marked ✗, and a peer
  that falls back to a non-8-bit path is footnoted; neither counts as that peer's result.
"""

FIDELITY_INTRO = """\
## Retrieval fidelity

Does flash_maxsim rank a real corpus as the float64 definition does? `benchmarks/retrieval_fidelity.py` encodes
two 5,000-document BEIR subsets (MS MARCO passages and DBpedia-Entity, 50 queries each) with a PyLate ColBERT
(all-MiniLM-L6-v2 with a random 128-d head: the question is fidelity, not retrieval quality), scores every query
against every document with flash_maxsim (exact, and on an int8 / fp8 index) and with the float64 reference, and
compares the rankings. Targets: exact |Δ nDCG@10| ≤ 1e-4 and identical top-10 lists up to exact ties; compressed
|Δ nDCG@10| ≤ 1e-3 and a mean top-10 overlap ≥ 0.98.
"""


SEARCH_HEAD = """\
## Search

Exact top-k retrieval over whole corpora: how fast (one part per GPU run of `benchmarks/search_bench.py`) and how
it ranks next to approximate indexes on real data (the retrieval-quality table).
"""

SEARCH_INTRO = """\
Exact top-k retrieval over whole corpora (`benchmarks/search_bench.py`): `flash_maxsim.search(queries, documents,
k)` over a corpus resident on the GPU, and `flash_maxsim.DocumentIndex(...).search(queries, k)` over an index
streamed from pinned host memory (`placement="host"`) or sharded over the GPUs of the process
(`placement="cuda:all"`). Corpora are random unit vectors generated on the GPU from a seed (timing needs no real
embeddings), d = 128: passages with MS MARCO-like lengths (log-normal around 70 tokens, 8 to 180) and ColPali
pages (1,030 tokens); stored bf16 or int8 (one bf16 scale per token); batches of 1, 8 and 64 queries of 32 tokens;
top-10.

| column | what runs |
|---|---|
| flash_maxsim | `flash_maxsim.search` on a resident `PackedDocuments` / packed `QuantizedDocuments`; `DocumentIndex.search` on the host-streamed and sharded rows |
| maxsim, all scores | `flash_maxsim.maxsim(queries, documents)`: the full `[Nq, B]` scores, no selection (what the top-k costs over it) |
| torch chunked | per chunk of documents (similarity tensor ≤ 1 GiB): gather into a padded chunk, dequantise (int8), `einsum("qid,bjd->qbij")` in bf16, mask, `amax`, fp32 `sum`, `torch.topk`, merged into a running `torch.topk` |
| LIK | late-interaction-kernels 0.4.5 `retrieve(Q, D, top_k, d_mask=..., normalize=False, chunk=...)` on a padded copy of the corpus (bf16 rows; chunks below 2³¹ elements) |
| flash-maxsim | flash-maxsim 0.3.0 `flash_maxsim_topk(Q[i], D, k, doc_lengths, D_int8=, scales=, mins=)`, one query a call: its approximate two-stage search (an int8 pass over every document, an fp16 re-score of the best 4k), on the padded copy plus its own uint8 copy (bf16 rows) |
| PLAID, Voyager | PyLate 1.6's `indexes.PLAID` (fast-plaid) and `indexes.Voyager` through `retrieve.ColBERT`, default parameters, built on the same embeddings (on random vectors their recall says little: the quality table below has real data) |

**Floors**, measured in the same run: HBM = the corpus's bytes ÷ the device-to-device copy bandwidth (read +
written); tensor = 2·Nq·Lq·tokens·d ÷ the bf16 (bf16 rows) or int8 (int8 rows) matmul rate; H2D (host-streamed
rows) = the index's bytes ÷ the pinned host-to-device copy bandwidth. The floor is the largest that applies; a
sharded row divides by the number of GPUs. "% of H2D rate" = index bytes ÷ time ÷ that bandwidth; "top-k ÷
maxsim" = ours ÷ the full scores' time on the same corpus; "N-GPU scaling" = one GPU's time ÷ (N × the sharded
time). **Checks**: every top-k against the exact one (`flash_maxsim.maxsim`'s scores of the same stored corpus,
equal scores to the lower position): "identical" = same documents, order and scores; otherwise its recall@k, and ✗
where a returned document's exact score falls short of the k-th exact score by more than the tolerance (fp32
2e-3 + 2e-5·Lq; the bf16 einsum's similarities are rounded: 2·2⁻⁸·max|score| + 1e-2). The host-streamed rows'
truth is each chunk made again and searched, merged. Ours is also checked on the corpus's first 256 documents
against the float64 reference. **Memory**: the peak allocated above the corpus (and the peers' copies) during one
call. Rows that do not fit where they are placed are listed as skipped, with the room they need; host-streamed
rows are sized to the host memory (the rate is what counts).
"""

QUALITY_INTRO = """\
### Retrieval quality on BEIR subsets

`benchmarks/retrieval_fidelity.py --retrievers search,index,plaid,voyager` on the two 5,000-document BEIR subsets
(all-MiniLM-L6-v2 with PyLate's random 128-d head, so absolute nDCG is low; what counts is each retriever against
exact search on the same embeddings): nDCG@10, recall@10 against the exact top-10 (float64 scores), and how many
queries' top-10 equal exhaustive scoring (`flash_maxsim.maxsim` over the whole corpus, stable sort). PLAID and
Voyager with PyLate's default parameters.
"""


def gpu_slug(device: str, taken: set) -> str:
    """A short file-name prefix for a device ("NVIDIA H100 80GB HBM3" -> "h100"), unique among ``taken``."""
    words = [w for w in re.split(r"[^a-z0-9]+", device.lower()) if w and w != "nvidia"]
    slug = words[0] if words else "gpu"
    base, n = slug, 2
    while slug in taken:
        slug, n = f"{base}-{n}", n + 1
    taken.add(slug)
    return slug


def _anchor(title: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def render_page(runs: list[dict], fidelity: list[dict], page: Path, plots_dir: Optional[Path],
                cpu: Optional[dict] = None, search: Optional[list[dict]] = None,
                quality: Optional[list[dict]] = None) -> str:
    """The documentation page: intro and method, one section per run (GPU) with its tables and plots, the CPU
    section (``cpu``: cpu_bench.py's JSON, or None), the search section (one part per search_bench.py run, then
    the retrieval-quality table), the retrieval fidelity table. Plots are drawn into ``plots_dir`` (None: no
    plots)."""
    taken: set = set()
    search, quality = search or [], [q for q in quality or [] if any(r.get("retrievers") for r in q["results"])]
    titles = [r["meta"]["device"] for r in runs]
    links = [f"[{t}](#{_anchor(t)})" for t in titles]
    if cpu:
        links.append(f"[{CPU_TITLE}](#{_anchor(CPU_TITLE)})")
    if search or quality:
        links.append("[Search](#search)")
    if fidelity:
        links.append("[Retrieval fidelity](#retrieval-fidelity)")
    out = [PAGE_INTRO.format(contents=" · ".join(links))]

    def rel_plots(written):
        rel = os.path.relpath(plots_dir.resolve(), page.resolve().parent).replace(os.sep, "/")
        return {kind: f"{rel}/{path.name}" for kind, path in written.items()}

    for res, title in zip(runs, titles):
        plots = {}
        if plots_dir is not None:
            plots = rel_plots(make_plots(res, plots_dir, prefix=gpu_slug(title, taken) + "-"))
        out += [f"## {title}", "", render_run(res, plots, level=3, targets=False)]
    if cpu:
        plot = None
        if plots_dir is not None:
            plt = _pyplot()
            path = plots_dir / "cpu-time.png"
            if plt is not None:
                plots_dir.mkdir(parents=True, exist_ok=True)
                if plot_cpu(cpu, path, plt):
                    plot = os.path.relpath(path.resolve(), page.resolve().parent).replace(os.sep, "/")
        out += [f"## {CPU_TITLE}", "", render_cpu(cpu, plot, level=3)]
    if search or quality:
        out += [SEARCH_HEAD]
    if search:
        out += [SEARCH_INTRO]
    for res in search:
        title = res["meta"]["device"]
        plots = {}
        if plots_dir is not None:
            plots = rel_plots(make_search_plots(res, plots_dir, prefix=gpu_slug(title, taken) + "-"))
        out += [f"### Search on {title}", "", render_search_run(res, plots, level=4, targets=False)]
    if quality:
        out += [QUALITY_INTRO, *quality_table(quality), ""]
    if fidelity:
        out += [FIDELITY_INTRO, *fidelity_table(fidelity), ""]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------------------------------------- CLI

def _load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    pg = sub.add_parser("page", help="the documentation page (one section per results JSON) and its plots")
    pg.add_argument("runs", nargs="*", type=Path,
                    default=[HERE / "results" / "h200.json", HERE / "results" / "h100.json"],
                    help="bench.py results, one per GPU (default: benchmarks/results/h200.json h100.json)")
    pg.add_argument("--fidelity", nargs="*", type=Path,
                    default=[HERE / "results" / "fidelity-cpu.json", HERE / "results" / "fidelity-gpu.json"],
                    help="retrieval_fidelity.py reports for the fidelity table ('--fidelity' alone: none)")
    pg.add_argument("--cpu", type=Path, default=HERE / "results" / "cpu.json",
                    help="cpu_bench.py's results for the CPU section (default: benchmarks/results/cpu.json)")
    pg.add_argument("--no-cpu", action="store_true", help="leave the CPU section out")
    pg.add_argument("--search", nargs="*", type=Path, default=None,
                    help="search_bench.py results, one per GPU (default: benchmarks/results/search-*.json but the "
                         "quality files; '--search' alone: none)")
    pg.add_argument("--search-quality", nargs="*", type=Path, default=None,
                    help="retrieval_fidelity.py --retrievers reports (default: benchmarks/results/"
                         "search-quality*.json)")
    pg.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md", help="the page to write")
    pg.add_argument("--plots", type=Path, default=REPO / "docs" / "benchmarks",
                    help="folder for the page's PNG plots")
    pg.add_argument("--no-plots", action="store_true")
    tb = sub.add_parser("tables", help="one run's tables (markdown on stdout), with its design targets")
    tb.add_argument("run", type=Path)
    tb.add_argument("--plots", type=Path, default=None, help="also draw the run's plots into this folder")
    mg = sub.add_parser("merge", help="several runs as one: later files' sections replace earlier ones'")
    mg.add_argument("runs", nargs="+", type=Path)
    mg.add_argument("--out", type=Path, required=True)
    ms = sub.add_parser("merge-search", help="several search_bench.py runs as one: later rows replace earlier ones "
                                             "of the same name")
    ms.add_argument("runs", nargs="+", type=Path)
    ms.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.command == "page":
        runs = [_load(path) for path in args.runs]
        fidelity = [_load(path) for path in args.fidelity or []]
        cpu = None if args.no_cpu else _load(args.cpu)
        results = HERE / "results"
        if args.search is None:
            args.search = sorted(p for p in results.glob("search-*.json") if not p.name.startswith("search-quality"))
        if args.search_quality is None:
            args.search_quality = sorted(results.glob("search-quality*.json"))
        search = [_load(path) for path in args.search]
        quality = [_load(path) for path in args.search_quality]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(render_page(runs, fidelity, args.out, None if args.no_plots else args.plots, cpu,
                                        search=search, quality=quality))
        log.info("wrote %s (%d bytes)", args.out, args.out.stat().st_size)
    elif args.command == "tables":
        res = _load(args.run)
        search = res["meta"].get("kind") == "search"
        plots = {}
        if args.plots is not None:
            written = (make_search_plots if search else make_plots)(res, args.plots)
            plots = {kind: str(path) for kind, path in written.items()}
        sys.stdout.write((render_search_run if search else render_run)(res, plots))
    elif args.command == "merge-search":
        args.out.write_text(json.dumps(merge_search([_load(path) for path in args.runs]), indent=1) + "\n")
        log.info("wrote %s", args.out)
    else:
        args.out.write_text(json.dumps(merge_results([_load(path) for path in args.runs]), indent=1) + "\n")
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
