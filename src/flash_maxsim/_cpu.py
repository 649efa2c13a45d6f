"""Exact PyTorch path for CPU tensors (and any device without Triton), on the canonical problem.

Same outputs as the Triton kernels: scores fp32 and the same auxiliary tensor (first arg-max index / row
log-sum-exp), so that one backward definition serves both. Products are exact in fp32 for fp16/bf16 inputs
and accumulate in fp32.

Memory bound: work proceeds in blocks of queries x documents whose similarity block holds at most
``BLOCK_ELEMENTS`` (2^24) fp32 values, so the temporaries stay below ~5 x 64 MiB whatever Nq, B, Lq, Ld are;
nothing of size Nq*B*Lq*Ld exists at once. A single (query, document) pair larger than the budget is still
processed whole (Lq*Ld values).
"""

from __future__ import annotations

import torch

from ._types import aux_dtype

BLOCK_ELEMENTS = 1 << 24


def _document_block(p, t0: int, t1: int):
    """Documents t0..t1 as padded fp32 ``[g, L, d]``, plus in-document and valid masks ``[g, L]``."""
    if p.offsets is None:
        D = p.documents[t0:t1].float()
        if p.document_scales is not None:
            D = D * p.document_scales[t0:t1, :, None]
        in_doc = torch.ones(D.shape[:2], dtype=torch.bool, device=D.device)
        valid = in_doc if p.documents_mask is None else p.documents_mask[t0:t1].bool()
        return D, in_doc, valid, None
    offs = p.offsets[t0:t1 + 1]
    starts, lengths = offs[:-1], offs[1:] - offs[:-1]
    L = max(int(lengths.max()) if lengths.numel() else 0, 1)
    pos = torch.arange(L, device=offs.device)
    in_doc = pos[None, :] < lengths[:, None]
    rows = (starts[:, None] + pos[None, :]).clamp(max=max(p.documents.shape[0] - 1, 0))
    D = p.documents[rows].float() * in_doc[..., None]
    if p.document_scales is not None:
        D = D * p.document_scales[rows][..., None]
    valid = in_doc if p.documents_mask is None else in_doc & p.documents_mask[rows].bool()
    return D, in_doc, valid, rows


def _blocks(p):
    """Yield (query slice, column slice, first document, last document + 1)."""
    Nq, Lq, _ = p.queries.shape
    L = max(p.max_length, 1)
    C = p.num_columns
    per_pair = max(Lq * L, 1)
    if p.candidates:
        K = p.candidates
        qc = max(1, BLOCK_ELEMENTS // (per_pair * K))
        for q0 in range(0, Nq, qc):
            q1 = min(Nq, q0 + qc)
            yield slice(q0, q1), slice(0, K), q0 * K, q1 * K
    else:
        qc = max(1, min(Nq, BLOCK_ELEMENTS // per_pair))
        gc = max(1, BLOCK_ELEMENTS // (per_pair * qc))
        for t0 in range(0, C, gc):
            t1 = min(C, t0 + gc)
            for q0 in range(0, Nq, qc):
                yield slice(q0, min(Nq, q0 + qc)), slice(t0, t1), t0, t1


def _similarities(p, qs, D, in_doc, valid, zero_masked):
    """Masked similarity block ``[qc, g, Lq, L]`` (paired: ``D`` is ``[qc*K, L, d]``)."""
    Q = p.queries[qs].float()
    if p.candidates:
        K = p.candidates
        s = torch.einsum("qid,qkjd->qkij", Q, D.view(Q.shape[0], K, *D.shape[1:]))
        in_doc = in_doc.view(Q.shape[0], K, -1)[:, :, None, :]
        valid = valid.view(Q.shape[0], K, -1)[:, :, None, :]
    else:
        s = torch.einsum("qid,gjd->qgij", Q, D)
        in_doc, valid = in_doc[None, :, None, :], valid[None, :, None, :]
    neg_inf = torch.tensor(float("-inf"), device=s.device)
    if zero_masked:
        s = torch.where(valid, s, torch.where(in_doc, torch.zeros((), device=s.device), neg_inf))
    else:
        s = torch.where(valid, s, neg_inf)
    return s, valid


def _qvalid(p, qs):
    Nq, Lq = p.queries[qs].shape[:2]
    if p.queries_mask is None:
        return torch.ones(Nq, 1, Lq, dtype=torch.bool, device=p.queries.device)
    return p.queries_mask[qs].bool()[:, None, :]


def _smooth_max(s, tau):
    """``tau * logsumexp(s / tau)`` over the last axis, computed as ``m + tau * log(sum exp((s - m) / tau))`` with
    ``m`` the row's max (0 for a row of -inf), as the kernels and the reference do: ``s / tau`` itself overflows fp32
    for small tau (max 2^128). A row holding +inf gives NaN (inf - inf), as in the kernels."""
    m = s.amax(-1, keepdim=True)
    shift = torch.where(m == float("-inf"), torch.zeros((), device=s.device), m)
    terms = (s - shift).div_(tau).exp_()                                        # one block-sized temporary
    return (shift + tau * torch.log(terms.sum(-1, keepdim=True)))[..., 0]


def forward(p, zero_masked: bool, smooth_tau, save_aux: bool):
    Nq, Lq, _ = p.queries.shape
    C = p.num_columns
    device = p.queries.device
    scores = torch.zeros(Nq, C, dtype=torch.float32, device=device)
    smooth = smooth_tau is not None
    aux = torch.empty((Nq, C, Lq) if save_aux else (0, 0, 0), dtype=aux_dtype(smooth_tau, p.max_length),
                      device=device)
    for qs, cs, t0, t1 in _blocks(p):
        D, in_doc, valid, _ = _document_block(p, t0, t1)
        s, valid_b = _similarities(p, qs, D, in_doc, valid, zero_masked)
        qvalid = _qvalid(p, qs)
        if smooth:
            lse = _smooth_max(s, smooth_tau)
            empty = lse == float("-inf")
            row = torch.where(empty | ~qvalid, torch.zeros((), device=device), lse)
            if save_aux:
                aux[qs, cs] = torch.where(empty | ~qvalid, torch.tensor(float("inf"), device=device), lse)
        else:
            mx = s.amax(-1)
            empty = mx == float("-inf")
            row = torch.where(empty | ~qvalid, torch.zeros((), device=device), mx)
            if save_aux:
                arg = s.argmax(-1)                     # the first maximal index, as documented by torch.argmax
                hit_valid = torch.gather(valid_b.expand(*s.shape[:2], 1, s.shape[-1]).expand_as(s), -1,
                                         arg[..., None])[..., 0]
                keep = ~empty & qvalid & hit_valid
                aux[qs, cs] = torch.where(keep, arg, -1).to(aux.dtype)
        scores[qs, cs] = row.sum(-1)
    return scores, aux


def backward(grad, p, aux, smooth_tau, need_dq: bool, need_dd: bool, grad_dtype=None):
    """dQ and dD from the saved auxiliary tensor; weights W[q, c, i, j] = G[q, c] * dagg/ds_ij per block."""
    device = p.queries.device
    grad = grad.float()
    dq = torch.zeros(p.queries.shape, dtype=torch.float32, device=device) if need_dq else None
    dd = torch.zeros(p.documents.shape, dtype=torch.float32, device=device) if need_dd else None
    for qs, cs, t0, t1 in _blocks(p):
        D, in_doc, valid, rows = _document_block(p, t0, t1)
        a = aux[qs, cs]                                                         # [qc, g, Lq]
        L = D.shape[1]
        if smooth_tau is None:
            W = (a[..., None] == torch.arange(L, device=device)).float()       # one-hot, -1 never matches
        else:
            s, valid_b = _similarities(p, qs, D, in_doc, valid, zero_masked=True)
            live = valid_b & _qvalid(p, qs)[..., None]
            W = torch.where(live, torch.exp((s - a[..., None]) / smooth_tau), torch.zeros((), device=device))
        W = W * grad[qs, cs][..., None, None]
        # masked tokens get zero weight; zero their vectors too, so that a NaN stored there stays out
        D = torch.where(valid[..., None], D, torch.zeros((), device=device))
        Q = torch.where(_qvalid(p, qs)[:, 0, :, None], p.queries[qs].float(), torch.zeros((), device=device))
        if p.candidates:
            Dv = D.view(Q.shape[0], p.candidates, L, -1)
            if need_dq:
                dq[qs] += torch.einsum("qkij,qkjd->qid", W, Dv)
            dblock = torch.einsum("qkij,qid->qkjd", W, Q).reshape(-1, L, Q.shape[-1]) if need_dd else None
        else:
            if need_dq:
                dq[qs] += torch.einsum("qgij,gjd->qid", W, D)
            dblock = torch.einsum("qgij,qid->gjd", W, Q) if need_dd else None
        if need_dd:
            if rows is None:
                dd[t0:t1] += dblock
            else:
                in_doc_flat = in_doc.reshape(-1)
                dd.index_add_(0, rows.reshape(-1)[in_doc_flat], dblock.reshape(-1, dblock.shape[-1])[in_doc_flat])
    out_q = dq.to(grad_dtype or p.queries.dtype) if need_dq else None
    out_d = dd.to(grad_dtype or p.documents.dtype) if need_dd else None
    return out_q, out_d
