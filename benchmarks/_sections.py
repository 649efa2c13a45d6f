"""The benchmark's measured sections, each a list of rows (one per shape) of per-method results:

- forward scoring: flash_maxsim against eager PyTorch (bf16 and fp32), colpali-engine's chunked loop and the
  peers' kernels;
- training step (scores -> loss -> gradients of queries and documents): flash_maxsim against eager autograd and
  the peers' autograd paths, also replayed from CUDA graphs (the GPU's time alone);
- host cost of the eager training step: steps back to back, one synchronisation at the end, microseconds per
  step for flash_maxsim, the peers and PyTorch's share of the step alone, with each step's GPU time (profiler);
- compressed index: flash_maxsim on an int8 / fp8 index against the peers' 8-bit paths, with index bytes,
  fidelity to the unquantised float64 scores and the 8-bit compute floors.

Every method's first call is checked (against flash_maxsim, whose own first call is checked against the float64
reference); a failure is recorded in the row, never raised. The row dictionaries are what results.json holds.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F

from _measure import (MB, Machine, brief, element_size, error_text, host_pass_us, interleave_rounds, profiled_step,
                      run_method, skipped, unit_tokens)
from _peers import CompressedVariant, tensor_bytes
from _shapes import CONTRASTIVE_TEMPERATURE, COMPRESSED_TARGET_BYTES, HOST_MARGIN_US, TrainShape

log = logging.getLogger("flash_maxsim.bench")

# Documents of 2^31 elements or more are not given to the peers: late-interaction-kernels 0.4.5 faulted (an illegal
# memory access, as 32-bit offsets past 2^31 would) on 1x100k 32x300 (3.8e9 elements) on an H200, and a fault ends
# the CUDA context for every later measurement of the run
PEER_MAX_ELEMENTS = 2**31
PEER_TOO_LARGE = ("the documents have 2^31 elements or more; late-interaction-kernels 0.4.5 faulted on such a "
                  "tensor (illegal memory access) and a fault would end this run's CUDA context")


# ---------------------------------------------------------------------------------------------- scoring functions

def _flash_maxsim():
    import flash_maxsim
    return flash_maxsim


def ours_forward(q, d):
    return _flash_maxsim().maxsim(q, d)


def torch_bf16_forward(q, d):
    """The eager PyTorch users write: the similarity tensor in the input dtype, then max and sum."""
    return torch.einsum("qid,bjd->qbij", q, d).amax(-1).sum(-1).float()


def torch_fp32_forward(q, d):
    """Eager with fp32 accumulation throughout (inputs cast to fp32; "highest" matmul precision, no TF32)."""
    return torch.einsum("qid,bjd->qbij", q.float(), d.float()).amax(-1).sum(-1)


def colpali_loop_forward(q, d, batch_size=128):
    """colpali-engine's ``BaseVisualRetrieverProcessor.score_multi_vector`` algorithm (0.3.18), re-written from
    its documented behaviour: blocks of ``batch_size`` queries x ``batch_size`` passages, each block padded into
    a fresh tensor with ``pad_sequence`` and scored as ``einsum("bnd,csd->bcns").amax(3).sum(2)`` (its torch
    backend), blocks concatenated, float32 result. Unlike the original, blocks stay on the GPU instead of being
    copied to the CPU one by one."""
    pad = torch.nn.utils.rnn.pad_sequence
    rows = []
    for i in range(0, q.shape[0], batch_size):
        qs = pad(q[i:i + batch_size], batch_first=True, padding_value=0)
        cols = []
        for j in range(0, d.shape[0], batch_size):
            ps = pad(d[j:j + batch_size], batch_first=True, padding_value=0)
            cols.append(torch.einsum("bnd,csd->bcns", qs, ps).amax(dim=3).sum(dim=2))
        rows.append(torch.cat(cols, dim=1))
    return torch.cat(rows, dim=0).float()


def eager_train_scores(layout: str, smooth_tau: Optional[float]):
    """Eager autograd scores as PyLate / colpali-engine compute them (colpali's smooth max for ``smooth_tau``)."""
    spec = "qid,qkjd->qkij" if layout == "kd" else "qid,bjd->qbij"

    def scores(q, d):
        s = torch.einsum(spec, q, d)
        if smooth_tau is None:
            return s.amax(-1).sum(-1)
        return (smooth_tau * torch.logsumexp(s / smooth_tau, dim=-1)).sum(-1)
    return scores


def ours_train_scores(layout: str, smooth_tau: Optional[float]):
    return lambda q, d: _flash_maxsim().maxsim(q, d, smooth_tau=smooth_tau)


# ------------------------------------------------------------------------------------------------------- checks

def score_tolerance(kind: str, truth: torch.Tensor, Lq: int, dtype: torch.dtype) -> float:
    """Absolute tolerance on scores against flash_maxsim. "fp32": products of the input dtype summed in fp32
    (kernels, fp32 einsum) differ only by summation order. "lowp": the similarity tensor itself is rounded to the
    input dtype (eager bf16 einsum) and summed into a bf16 score."""
    if kind == "fp32":
        return 2e-3 + 2e-5 * Lq
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    return 2 * unit * float(truth.abs().max()) + 1e-2


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    a, b = a.detach().float(), b.detach().float()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float(a.norm())


def check_against_reference(q, d, layout: str, smooth_tau: Optional[float], train: bool) -> dict:
    """flash_maxsim against the float64 reference on a slice (2 queries x 8 documents), scores and, for training,
    gradients of a random weighting of the scores."""
    import flash_maxsim
    from flash_maxsim import reference
    qs = q.detach()[:2].clone()
    ds = (d.detach()[:2, :8] if layout == "kd" else d.detach()[:8]).clone()
    Lq = qs.shape[1]
    out = {}
    if not train:
        got = flash_maxsim.maxsim(qs, ds, smooth_tau=smooth_tau)
        want = reference.maxsim(qs, ds, smooth_tau=smooth_tau)
        out["ref_max_abs_diff"] = max_abs_diff(got, want)
        out["ref_ok"] = out["ref_max_abs_diff"] <= score_tolerance("fp32", want, Lq, qs.dtype)
        return out
    qo, do_ = qs.clone().requires_grad_(), ds.clone().requires_grad_()
    qr, dr = qs.double().requires_grad_(), ds.double().requires_grad_()
    got = flash_maxsim.maxsim(qo, do_, smooth_tau=smooth_tau)
    want = reference.maxsim(qr, dr, smooth_tau=smooth_tau)
    w = torch.randn(want.shape, dtype=torch.float64, device=want.device,
                    generator=torch.Generator(device=want.device).manual_seed(7))
    gq, gd = torch.autograd.grad((got.double() * w).sum(), (qo, do_))
    rq, rd = torch.autograd.grad((want * w).sum(), (qr, dr))
    out["ref_max_abs_diff"] = max_abs_diff(got, want)
    out["ref_grad_rel_err"] = max(rel_error(gq, rq), rel_error(gd, rd))
    out["ref_ok"] = (out["ref_max_abs_diff"] <= score_tolerance("fp32", want, Lq, qs.dtype)
                     and out["ref_grad_rel_err"] <= 2e-2)
    return out


# ------------------------------------------------------------------------------------------------------- peers

def _peer_or_skip(m: Machine, key: str, peers, peer_missing) -> tuple:
    """(the peer for ``key``, None), or (None, the skipped result saying why it cannot run here)."""
    peer = next((p for p in peers if p.key == key), None)
    if peer is None:
        return None, skipped(peer_missing.get(key, "not requested"))
    if not m.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return None, skipped("peer kernels need CUDA (or --interpret on the CPU)")
    return peer, None


def _best_variant(peer, variants: dict) -> dict:
    """The fastest correct variant (a wrong one is reported only if no variant is right)."""
    timed = [(v["ms"], n) for n, v in variants.items() if v.get("ms") is not None and v["status"] == "ok"]
    if not timed:
        timed = [(v["ms"], n) for n, v in variants.items() if v.get("ms") is not None]
    name = min(timed)[1] if timed else next(iter(variants))
    best = dict(variants[name])
    best["variant"], best["peer"] = name, peer.label
    if len(variants) > 1:
        best["variants"] = variants
    return best


def _skip_row(m: Machine, row: dict, method_keys) -> bool:
    """Marks every method of ``row`` skipped once the time budget is spent; True if it did."""
    if not m.budget.spent():
        return False
    for key in method_keys:
        row["results"][key] = skipped("time budget spent")
    return True


# ---------------------------------------------------------------------------------------------------- forward

FORWARD_BASELINES = {
    # key: (function, tolerance class, bytes per similarity element, fp32 matmul?)
    "torch_bf16": (torch_bf16_forward, "lowp", 2, False),
    "torch_fp32": (torch_fp32_forward, "fp32", 4, True),
    "colpali_loop": (colpali_loop_forward, "lowp", 2, False),
}


def _eager_estimate(m: Machine, shape, elem_bytes: int, fp32: bool, chunk: Optional[int] = None):
    """(bytes, ms) an eager baseline needs: the similarity tensor (or one block of it) written and read back."""
    Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
    n_all = Nq * B * Lq * Ld
    n_live = n_all if chunk is None else min(Nq, chunk) * min(B, chunk) * Lq * Ld
    nbytes = n_live * elem_bytes * 1.25 + (4 * (Nq * Lq + B * Ld) * d if fp32 else 0)
    if not (m.copy_bw and m.mm_flops):
        return nbytes, 0.0
    rate = m.mm_flops / (12 if fp32 else 1)   # H200: fp32 (no TF32) runs ~1/12 of the bf16 tensor-core rate
    ms = (2 * n_all * d / rate + 2 * n_all * elem_bytes / m.copy_bw) * 1e3
    return nbytes, ms


def _too_big(m: Machine, nbytes: float, ms: float) -> Optional[str]:
    if nbytes > 0.85 * m.free_bytes():
        return f"would need ~{nbytes / 2**30:.1f} GiB (free {m.free_bytes() / 2**30:.1f} GiB)"
    if ms > m.max_eager_ms:
        return f"estimated {ms:.0f} ms per call (> --max-eager-ms {m.max_eager_ms:.0f})"
    return None


def run_forward_rows(m: Machine, shapes, method_keys, peers, peer_missing, seed=0, rounds=0) -> list[dict]:
    rows = []
    for shape in shapes:
        Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
        in_bytes = (Nq * Lq + B * Ld) * d * element_size(m.dtype)
        nbytes, flops = in_bytes + Nq * B * 4, 2 * Nq * B * Lq * Ld * d
        row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "dtype": str(m.dtype),
               "bytes": nbytes, "flops": flops, "floor_ms": m.floor_ms(nbytes, flops),
               "issue_floor_ms": shape.issue_floor_ms, "issue_best_peer_ms": shape.issue_best_peer_ms,
               "target_ms": shape.target_ms, "results": {}}
        rows.append(row)
        if _skip_row(m, row, method_keys):
            continue
        log.info("[%5.0fs] forward %s", m.budget.elapsed(), shape.name)
        gen = torch.Generator(device=m.device).manual_seed(seed)
        n_sets = m.rotation_count(in_bytes)
        sets = [(unit_tokens((Nq, Lq, d), m, gen), unit_tokens((B, Ld, d), m, gen)) for _ in range(n_sets)]
        row["input_sets"] = n_sets
        truth = {}

        def check_ours(out):
            truth["scores"] = out.detach().float().clone()
            r = check_against_reference(*sets[0], "inbatch", None, train=False)
            r["ok"] = r["ref_ok"]
            return r

        def check_against_ours(kind):
            def check(out):
                if "scores" not in truth:
                    return {"ok": None, "note": "unchecked: flash_maxsim produced no scores"}
                if tuple(out.shape) != tuple(truth["scores"].shape):
                    return {"ok": False, "note": f"shape {tuple(out.shape)} != {tuple(truth['scores'].shape)}"}
                diff = max_abs_diff(out, truth["scores"])
                tol = score_tolerance(kind, truth["scores"], Lq, m.dtype)
                return {"max_abs_diff": diff, "tol": tol, "ok": bool(diff <= tol)}
            return check

        calls: dict = {}    # what interleave_rounds times again: ours and each peer's chosen variant
        for key in method_keys:
            if m.budget.spent():
                row["results"][key] = skipped("time budget spent")
                continue
            if key == "ours":
                row["results"][key] = run_method(m, ours_forward, sets, check_ours)
                calls[key] = (ours_forward, sets)
            elif key in FORWARD_BASELINES:
                fn, kind, elem_bytes, fp32 = FORWARD_BASELINES[key]
                est = _eager_estimate(m, shape, elem_bytes, fp32, chunk=128 if key == "colpali_loop" else None)
                reason = _too_big(m, *est)
                row["results"][key] = skipped(reason) if reason else run_method(m, fn, sets, check_against_ours(kind))
            elif B * Ld * d >= PEER_MAX_ELEMENTS:
                row["results"][key] = skipped(PEER_TOO_LARGE)
            else:
                row["results"][key] = _run_peer_forward(m, key, peers, peer_missing, sets, check_against_ours("fp32"),
                                                        calls)
            log.info("    %-14s %s", key, brief(row["results"][key]))
        if not m.budget.spent():
            interleave_rounds(m, calls, row["results"], rounds)
        sets = truth = calls = None  # free this shape's inputs before the next one
        m.release()
    return rows


def _run_peer_forward(m, key, peers, peer_missing, sets, check, calls) -> dict:
    """The peer's fastest correct forward variant; ``calls[key]`` gets that variant (for interleave_rounds)."""
    peer, skip = _peer_or_skip(m, key, peers, peer_missing)
    if skip:
        return skip
    variants, fns = {}, {}
    for name, fn in peer.forward_variants(*sets[0]):
        variants[name] = run_method(m, fn, sets, check)
        fns[name] = fn
    best = _best_variant(peer, variants)
    calls[key] = (fns[best["variant"]], sets)
    return best


# --------------------------------------------------------------------------------------------------- training

def _loss_fn(shape: TrainShape, m: Machine, gen: torch.Generator):
    """In-batch contrastive cross-entropy (the positive of query i is document i*B/Nq), or KL divergence to
    fixed random teacher scores over each query's candidates (PyLate's distillation)."""
    if shape.layout == "kd":
        teacher = torch.randn((shape.Nq, shape.B), generator=gen, device=m.device).log_softmax(-1)
        return lambda s: F.kl_div(s.float().log_softmax(-1), teacher, log_target=True, reduction="batchmean")
    labels = torch.arange(shape.Nq, device=m.device) * (shape.B // shape.Nq)
    return lambda s: F.cross_entropy(s.float() / CONTRASTIVE_TEMPERATURE, labels)


def _train_step(score_fn, loss_fn):
    def step(q, d):
        s = score_fn(q, d)
        gq, gd = torch.autograd.grad(loss_fn(s), (q, d))
        return s, gq, gd
    return step


def _graphed_step_ms(m: Machine, step, inputs) -> dict:
    """The step captured in a CUDA graph and replayed: the GPU's time for it, without Python or launches.
    ``{"graph_ms": ...}``, or ``{"graph_error": ...}`` for a step that does not capture."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):       # warm-up off the capture (first-call compilation, allocator pools)
            for _ in range(3):
                step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(*inputs)
        return {"graph_ms": m.timer.median_ms(graph.replay)}
    except Exception as exc:
        log.debug("CUDA graph capture failed", exc_info=True)
        return {"graph_error": error_text(exc)[:120]}
    finally:
        graph = None
        m.release()


def _pytorch_share_ms(m: Machine, shape: TrainShape, loss_fn) -> float:
    """PyTorch's part of a step alone, eager: the loss and ``autograd.grad`` over a leaf tensor of scores
    ([Nq, C] fp32). No scoring function can make a step faster than this on the same host."""
    leaf = torch.zeros((shape.Nq, shape.B), device=m.device, requires_grad=True)
    return m.timer.median_ms(lambda: torch.autograd.grad(loss_fn(leaf), leaf))


def run_training_rows(m: Machine, shapes, method_keys, peers, peer_missing, seed=0, rounds=0) -> list[dict]:
    rows = []
    for shape in shapes:
        Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
        C = B                                   # score columns per query
        n_docs = Nq * B if shape.layout == "kd" else B
        in_bytes = (Nq * Lq + n_docs * Ld) * d * element_size(m.dtype)
        n_sim = Nq * C * Lq * Ld
        # read the inputs in the forward and again in the backward, write both gradients; the hard max needs
        # one pass of products, the smooth max four (forward, recomputation, and the two gradient products)
        nbytes = 3 * in_bytes + 2 * Nq * C * 4
        flops = (8 if shape.smooth_tau is not None else 2) * n_sim * d
        row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "layout": shape.layout,
               "smooth_tau": shape.smooth_tau, "dtype": str(m.dtype), "bytes": nbytes, "flops": flops,
               "floor_ms": m.floor_ms(nbytes, flops), "issue_eager": shape.issue_eager,
               "issue_best_peer": shape.issue_best_peer, "target_ms": shape.target_ms,
               "target_mb": shape.target_mb, "results": {}}
        rows.append(row)
        if _skip_row(m, row, method_keys):
            continue
        log.info("[%5.0fs] training %s", m.budget.elapsed(), shape.name)
        gen = torch.Generator(device=m.device).manual_seed(seed)
        doc_shape = (Nq, B, Ld, d) if shape.layout == "kd" else (B, Ld, d)
        n_sets = m.rotation_count(in_bytes)
        sets = [(unit_tokens((Nq, Lq, d), m, gen, True), unit_tokens(doc_shape, m, gen, True))
                for _ in range(n_sets)]
        row["input_sets"] = n_sets
        loss_fn = _loss_fn(shape, m, gen)
        truth = {}

        def check_ours(out):
            s, gq, gd = out
            truth.update(scores=s.detach().float().clone(), gq=gq.float().clone(), gd=gd.float().clone())
            r = check_against_reference(*sets[0], shape.layout, shape.smooth_tau, train=True)
            r["ok"] = r["ref_ok"]
            return r

        def check_against_ours(kind, grad_limit):
            def check(out):
                s, gq, gd = out
                if "scores" not in truth:
                    return {"ok": None, "note": "unchecked: flash_maxsim produced no result"}
                if tuple(s.shape) != tuple(truth["scores"].shape):
                    return {"ok": False, "note": f"shape {tuple(s.shape)} != {tuple(truth['scores'].shape)}"}
                diff = max_abs_diff(s, truth["scores"])
                tol = score_tolerance(kind, truth["scores"], Lq, m.dtype)
                grad_err = max(rel_error(gq, truth["gq"]), rel_error(gd, truth["gd"]))
                return {"max_abs_diff": diff, "tol": tol, "grad_rel_err": grad_err, "grad_tol": grad_limit,
                        "ok": bool(diff <= tol and grad_err <= grad_limit)}
            return check

        calls: dict = {}    # what interleave_rounds times again: ours and the peers
        for key in method_keys:
            if m.budget.spent():
                row["results"][key] = skipped("time budget spent")
                continue
            if key == "ours":
                step = _train_step(ours_train_scores(shape.layout, shape.smooth_tau), loss_fn)
                row["results"][key] = run_method(m, step, sets, check_ours)
                calls[key] = (step, sets)
            elif key == "eager":
                # autograd keeps the similarity tensor and builds its gradient: ~12 bytes per element measured
                # (10.5 for the hard max, 7.6 for the smooth max)
                nbytes_est = 12 * n_sim
                ms_est = ((3 * 2 * n_sim * d / m.mm_flops + 12 * n_sim / m.copy_bw) * 1e3
                          if m.copy_bw and m.mm_flops else 0.0)
                reason = _too_big(m, nbytes_est, ms_est)
                step = _train_step(eager_train_scores(shape.layout, shape.smooth_tau), loss_fn)
                # bf16 similarities tie often and amax splits the gradient among ties: gradients are compared
                # loosely (a wrong gradient is off by O(1))
                row["results"][key] = skipped(reason) if reason else \
                    run_method(m, step, sets, check_against_ours("lowp", 0.5))
            else:
                peer, skip = _peer_or_skip(m, key, peers, peer_missing)
                score_fn = peer.train_scores(shape.layout, shape.smooth_tau) if peer else None
                if skip:
                    row["results"][key] = skip
                elif score_fn is None:
                    missing = "smooth max" if shape.smooth_tau is not None else f"{shape.layout} training path"
                    row["results"][key] = skipped(f"{peer.label} has no {missing}")
                else:
                    step = _train_step(score_fn, loss_fn)
                    r = run_method(m, step, sets, check_against_ours("fp32", 2e-2))
                    r["peer"] = peer.label
                    row["results"][key] = r
                    calls[key] = (step, sets)
            log.info("    %-14s %s", key, brief(row["results"][key]))
        if not m.budget.spent():
            interleave_rounds(m, calls, row["results"], rounds)
        if m.cuda and not m.budget.spent():
            # where the eager step's time goes: the GPU's share (each step in a CUDA graph) and PyTorch's
            row["pytorch_share_ms"] = _pytorch_share_ms(m, shape, loss_fn)
            for key, (step, step_sets) in calls.items():
                if row["results"][key].get("ms") is not None:
                    row["results"][key].update(_graphed_step_ms(m, step, step_sets[0]))
        sets = truth = calls = None  # free this shape's inputs before the next one
        m.release()
    return rows


# -------------------------------------------------------------------------------------------------- host cost

HOST_METHODS = ("ours", "fmpypi", "lik", "pytorch_share")
HOST_STEPS = 200            # steps per timed pass on the GPU (3 on the CPU)
HOST_PROFILED_STEPS = 20    # steps under torch.profiler for the GPU time (2 on the CPU)


def _host_method(m: Machine, key: str, shape: TrainShape, peers, peer_missing):
    """(the score function of ``key``, None), or (None, the skipped result saying why it cannot run here)."""
    if key == "ours":
        return ours_train_scores(shape.layout, shape.smooth_tau), None
    peer, skip = _peer_or_skip(m, key, peers, peer_missing)
    if skip:
        return None, skip
    fn = peer.train_scores(shape.layout, shape.smooth_tau)
    return (fn, None) if fn is not None else (None, skipped(f"{peer.label} has no {shape.layout} training path"))


def run_host_rows(m: Machine, shapes, method_keys, peers, peer_missing, seed=0, rounds=3) -> list[dict]:
    """The eager training step (scores -> loss -> ``autograd.grad`` of queries and documents), as a training loop
    without CUDA graphs runs it: ``HOST_STEPS`` steps back to back, one synchronisation at the end, microseconds
    per step, timed in ``rounds`` alternating passes (median). ``pytorch_share`` is the loss and its gradient over a
    leaf tensor of scores alone: no scoring function makes a step cheaper on the same host. Each method's first
    step is checked (ours against the float64 reference, the peers against ours); each step is then profiled for
    its GPU time, kernels and launches."""
    n = HOST_STEPS if m.cuda else 3
    n_profiled = HOST_PROFILED_STEPS if m.cuda else 2
    rows = []
    for shape in shapes:
        Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
        row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "layout": shape.layout,
               "dtype": str(m.dtype), "steps": n, "margin_us": HOST_MARGIN_US, "results": {}}
        rows.append(row)
        if _skip_row(m, row, method_keys):
            continue
        log.info("[%5.0fs] host %s", m.budget.elapsed(), shape.name)
        gen = torch.Generator(device=m.device).manual_seed(seed)
        doc_shape = (Nq, B, Ld, d) if shape.layout == "kd" else (B, Ld, d)
        q, docs = unit_tokens((Nq, Lq, d), m, gen, True), unit_tokens(doc_shape, m, gen, True)
        loss_fn = _loss_fn(shape, m, gen)
        truth: dict = {}
        calls: dict = {}
        for key in method_keys:
            results = row["results"]
            if m.budget.spent():
                results[key] = skipped("time budget spent")
                continue
            if key == "pytorch_share":
                leaf = torch.zeros((Nq, B), device=m.device, requires_grad=True)
                calls[key] = lambda leaf=leaf: torch.autograd.grad(loss_fn(leaf), leaf)
                results[key] = {"status": "ok"}
                continue
            score_fn, skip = _host_method(m, key, shape, peers, peer_missing)
            if skip:
                results[key] = skip
                continue
            step = _train_step(score_fn, loss_fn)
            r = {"status": "ok"} if key == "ours" else {"status": "ok", "peer": next(p.label for p in peers
                                                                                   if p.key == key)}
            try:
                s, gq, gd = step(q, docs)
                if key == "ours":
                    truth.update(scores=s.detach().float(), gq=gq.float(), gd=gd.float())
                    r.update(check_against_reference(q, docs, shape.layout, shape.smooth_tau, train=True))
                    r["ok"] = r["ref_ok"]
                elif truth:
                    diff = max_abs_diff(s, truth["scores"])
                    tol = score_tolerance("fp32", truth["scores"], Lq, m.dtype)
                    grad_err = max(rel_error(gq, truth["gq"]), rel_error(gd, truth["gd"]))
                    r.update(max_abs_diff=diff, tol=tol, grad_rel_err=grad_err, grad_tol=2e-2,
                             ok=bool(diff <= tol and grad_err <= 2e-2))
                if r.get("ok") is False:
                    r["status"] = "wrong"
            except Exception as exc:
                log.debug("host step failed", exc_info=True)
                results[key] = {"status": "error", "error": error_text(exc)}
                continue
            results[key] = r
            calls[key] = lambda step=step: step(q, docs)
        passes: dict = {key: [] for key in calls}
        for _ in range(max(1, rounds)):          # alternating passes: host drift hits every method alike
            for key in list(calls):
                try:
                    passes[key].append(host_pass_us(m, calls[key], n))
                except Exception as exc:
                    log.debug("host pass failed", exc_info=True)
                    row["results"][key] = {"status": "error", "error": error_text(exc)}
                    del calls[key], passes[key]
        for key, timed in passes.items():
            r = row["results"][key]
            us = [p["us"] for p in timed]
            r.update(us=statistics.median(us), us_rounds=us,
                     enqueue_us=statistics.median(p["enqueue_us"] for p in timed))
            try:
                r.update(profiled_step(m, calls[key], n_profiled))
            except Exception as exc:     # the timing stands without the profile
                r["profile_error"] = error_text(exc)[:160]
            log.info("    %-14s %.1f us per step (enqueue %.1f us), GPU %s us", key, r["us"], r["enqueue_us"],
                     "n/a" if r.get("gpu_us") is None else f"{r['gpu_us']:.1f}")
        q = docs = truth = calls = None
        m.release()
    return rows


# ------------------------------------------------------------------------------------------- compressed index

COMPRESSED_METHODS = ("ours_int8", "ours_fp8", "ours_exact", "fmpypi", "lik")
# The 8-bit paths multiply 8-bit values on tensor cores; LIK's fp8 products are accumulated by Hopper's fp8 MMA
# with fewer than fp32's bits. Their scores are checked against the float64 reference on the operands they
# actually multiply within the fp32 tolerance plus this fraction of max |score|: a wrong scale or a skipped tile
# is off by far more.
COMPRESSED_CHECK_REL_TOL = 5e-4
COMPRESSED_CHECK_DOCS = 8
# documents whose float64 scores (unquantised inputs) measure each path's fidelity: up to 1000, fewer for long
# queries and documents, so that the float64 products stay near 3e10 multiply-adds (a second or two on the GPU)
FIDELITY_MAX_DOCS = 1000
FIDELITY_MACS = 3e10


def ours_compressed_variant(kind: str) -> CompressedVariant:
    """flash_maxsim on an int8 / fp8 index from ``flash_maxsim.quantize`` (an int8 index with d <= 256 quantises
    the queries too: docs/semantics.md), or, for ``kind="exact"``, on the unquantised documents."""
    fm = _flash_maxsim()
    if kind == "exact":
        return CompressedVariant("maxsim(queries, documents)", prepare=lambda q, d: (q, d), call=fm.maxsim,
                                 index_nbytes=lambda inputs: tensor_bytes(inputs[1]),
                                 dequantized=lambda inputs, n: (inputs[0].double(), inputs[1][:n].double()))

    def dequantized(inputs, n_docs):
        from flash_maxsim.quantization import queries_as_scored
        q, qd = inputs
        return (queries_as_scored(q, qd).double(),
                qd.values[:n_docs].double() * qd.scales[:n_docs, :, None].double())

    return CompressedVariant(f"maxsim(queries, quantize(documents, dtype={kind!r}))",
                             prepare=lambda q, d: (q, fm.quantize(d, dtype=kind)), call=fm.maxsim,
                             index_nbytes=lambda inputs: inputs[1].nbytes, dequantized=dequantized)


def exact_scores(q: torch.Tensor, d: torch.Tensor, n_docs: int) -> torch.Tensor:
    """float64 reference scores ``[Nq, n_docs]`` of the unquantised queries and first ``n_docs`` documents."""
    from flash_maxsim import reference
    Nq, Lq, _ = q.shape
    chunk = max(1, (32 * MB) // (Nq * Lq * d.shape[1]))       # the reference's float64 similarities: ~256 MB
    return torch.cat([reference.maxsim(q, d[i:min(i + chunk, n_docs)]) for i in range(0, n_docs, chunk)], dim=1)


def _compressed_check(m: Machine, variant: CompressedVariant, inputs: tuple, exact: torch.Tensor, shape):
    """The check of a compressed path's first call: its arithmetic (scores against the float64 reference on the
    very operands it multiplies, first 2 queries x 8 documents) and its fidelity (scores against the float64
    scores of the unquantised documents, relative to max |score|)."""
    from flash_maxsim import reference

    def check(out):
        out = out.detach()
        want_shape = (shape.Nq, shape.B)
        if tuple(out.shape) != want_shape:
            return {"ok": False, "note": f"shape {tuple(out.shape)} != {want_shape}"}
        res = {}
        note = variant.note()
        if note:
            res["note"], res["fallback"] = note, True
        n = min(shape.B, COMPRESSED_CHECK_DOCS)
        q64, d64 = variant.dequantized(inputs, n)
        truth = reference.maxsim(q64[:2], d64)
        res["max_abs_diff"] = max_abs_diff(out[:2, :n], truth)
        if note:   # a fallback to a dequantise-to-bf16 path rounds every product to bf16
            res["tol"] = score_tolerance("lowp", truth, shape.Lq, torch.bfloat16)
        else:
            res["tol"] = (score_tolerance("fp32", truth, shape.Lq, m.dtype)
                          + COMPRESSED_CHECK_REL_TOL * float(truth.abs().max()))
        res["ok"] = bool(res["max_abs_diff"] <= res["tol"])
        err = (out[:, :exact.shape[1]].double() - exact).abs()
        top = float(exact.abs().max()) or 1.0
        res.update(fid_max_rel_err=float(err.max()) / top, fid_mean_rel_err=float(err.mean()) / top,
                   fid_docs=int(exact.shape[1]))
        return res
    return check


def _run_compressed_variant(m: Machine, variant: CompressedVariant, sets, exact, shape, unquantised_bytes,
                            keep: dict) -> dict:
    """Index-time preparation (untimed), then :func:`run_method` on the prepared inputs. ``keep`` gets
    ``variant.name -> (call, prepared inputs)`` of a timed variant, for :func:`interleave_rounds`."""
    try:
        m.sync()
        t0 = time.perf_counter()
        prepared = [variant.prepare(q, d) for q, d in sets]
        m.sync()
        prepare_s = time.perf_counter() - t0
        index_bytes = int(variant.index_nbytes(prepared[0]))
    except torch.cuda.OutOfMemoryError as exc:
        m.release()
        return {"status": "oom", "error": error_text(exc)[:120]}
    except Exception as exc:
        log.debug("preparation failed", exc_info=True)
        m.release()
        return {"status": "error", "error": "preparing the index: " + error_text(exc)}
    r = run_method(m, variant.call, prepared, _compressed_check(m, variant, prepared[0], exact, shape))
    r.update(prepare_s=prepare_s, index_bytes=index_bytes, bytes_ratio=index_bytes / unquantised_bytes,
             memory_floor_ms=index_bytes / m.copy_bw * 1e3 if m.copy_bw else None)
    if r.get("ms") is not None:
        keep[variant.name] = (variant.call, prepared)
    prepared = None
    m.release()
    return r


def run_compressed_rows(m: Machine, shapes, method_keys, peers, peer_missing, seed=0,
                        skip_variants=(), rounds=0) -> list[dict]:
    rows = []
    rates = m.mm8_rates or {}
    for shape in shapes:
        Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
        elem = element_size(m.dtype)
        unquantised_bytes = B * Ld * d * elem
        int8_bytes = B * Ld * (d + 2)                 # int8 values + one bf16 scale per token
        flops = 2 * Nq * B * Lq * Ld * d
        compute = {"bf16": m.mm_flops, "int8": rates.get("int8_mm_ops"), "fp8": rates.get("fp8_mm_flops")}
        row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "dtype": str(m.dtype),
               "flops": flops, "unquantised_bytes": unquantised_bytes, "int8_index_bytes": int8_bytes,
               "memory_floor_ms": {k: (v / m.copy_bw * 1e3 if m.copy_bw else None)
                                   for k, v in (("unquantised", unquantised_bytes), ("int8", int8_bytes))},
               "compute_floor_ms": {k: (flops / v * 1e3 if v else None) for k, v in compute.items()},
               "target_ms": shape.target_ms, "target_bytes_ratio": COMPRESSED_TARGET_BYTES, "results": {}}
        rows.append(row)
        if _skip_row(m, row, method_keys):
            continue
        log.info("[%5.0fs] compressed %s", m.budget.elapsed(), shape.name)
        gen = torch.Generator(device=m.device).manual_seed(seed)
        n_sets = m.rotation_count((Nq * Lq * d) * elem + B * Ld * (d + 4))
        sets = [(unit_tokens((Nq, Lq, d), m, gen), unit_tokens((B, Ld, d), m, gen)) for _ in range(n_sets)]
        row["input_sets"] = n_sets
        n_fid = int(min(B, FIDELITY_MAX_DOCS, max(64, FIDELITY_MACS // (Nq * Lq * Ld * d))))
        try:
            exact = exact_scores(*sets[0], n_fid)
        except torch.cuda.OutOfMemoryError:
            m.release()
            n_fid = min(B, 64)
            exact = exact_scores(*sets[0], n_fid)
        calls: dict = {}    # what interleave_rounds times again: each of ours and each peer's chosen variant
        for key in method_keys:
            if m.budget.spent():
                row["results"][key] = skipped("time budget spent")
                continue
            if key.startswith("ours_"):
                variant = ours_compressed_variant(key[len("ours_"):])
                kept: dict = {}
                r = _run_compressed_variant(m, variant, sets, exact, shape, unquantised_bytes, kept)
                r["variant"] = variant.name
                row["results"][key] = r
                if variant.name in kept:
                    calls[key] = kept[variant.name]
            else:
                row["results"][key] = _run_peer_compressed(m, key, peers, peer_missing, sets, exact, shape,
                                                           unquantised_bytes, skip_variants, calls)
            log.info("    %-14s %s", key, _brief_compressed(row["results"][key]))
        if not m.budget.spent():
            interleave_rounds(m, calls, row["results"], rounds)
        sets = exact = calls = None  # free this shape's inputs (and prepared indexes) before the next one
        m.release()
    return rows


def _run_peer_compressed(m, key, peers, peer_missing, sets, exact, shape, unquantised_bytes, skip_variants,
                         calls) -> dict:
    """The peer's fastest correct compressed variant; ``calls[key]`` gets that variant's call and prepared inputs
    (for interleave_rounds)."""
    peer, skip = _peer_or_skip(m, key, peers, peer_missing)
    if skip:
        return skip
    try:
        variants = peer.compressed_variants(shape.Nq)
    except Exception as exc:
        return {"status": "error", "error": f"{peer.label} compressed path: {error_text(exc)}"}
    if not variants:
        return skipped(f"{peer.label} has no compressed path for {shape.Nq} queries at once")
    if all(any(text in v.name for text in skip_variants) for v in variants):
        return skipped(f"every {peer.label} variant matched --skip-compressed-variants")
    results, kept = {}, {}
    for v in variants:
        if any(text in v.name for text in skip_variants):
            continue
        if m.budget.spent():
            results[v.name] = skipped("time budget spent")
            continue
        results[v.name] = _run_compressed_variant(m, v, sets, exact, shape, unquantised_bytes, kept)
        log.debug("      %s: %s", v.name, _brief_compressed(results[v.name]))
    best = _best_variant(peer, results)
    if best["variant"] in kept:
        calls[key] = kept[best["variant"]]
    return best


def _brief_compressed(r: dict) -> str:
    text = brief(r)
    if r.get("bytes_ratio") is not None:
        text += f" bytes {r['bytes_ratio']:.3f}x"
    if r.get("fid_max_rel_err") is not None:
        text += f" fidelity err {r['fid_max_rel_err']:.2e}"
    if r.get("variant") and r.get("peer"):
        text += f" ({r['variant']})"
    return text
