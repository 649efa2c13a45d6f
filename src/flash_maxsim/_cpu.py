"""Exact PyTorch path for CPU tensors (and any device without Triton), on the canonical problem.

Same outputs as the Triton kernels: scores fp32 and the same auxiliary tensor (first arg-max index / row
log-sum-exp), so that one backward definition serves both. Products are exact in fp32 for fp16/bf16 inputs
and accumulate in fp32.

How it runs. The similarities are computed a block at a time (a range of documents against a set of query-token
rows) and reduced as soon as each block exists: masks, then the max or smooth max over each document's tokens.
A block is one product laid out ``[document tokens, query-token rows]``: a tall matrix times the small transposed
query matrix (faster in BLAS than the transposed product), and the max over a document's tokens then runs along
the block's middle axis, vectorised over the query rows. Only torch ops are used, so the path installs wherever
torch does, and torch's intra-op threads share every product and reduction (all cores, one query or many). Blocks
are large (``BLOCK_ELEMENTS``) because threads meet at a barrier after each op: on a loaded machine every barrier
waits for a descheduled thread, and fewer, larger blocks keep that cost low, for at most a tenth of one core's
speed (many queries, whose blocks no longer stay in cache).

The hard max's backward gathers instead of recomputing: each (query, document, query token) passes its gradient
to one document token, the saved arg-max, so dQ and dD are weighted sums of rows (``embedding_bag``, summed in a
fixed order). The smooth max's backward recomputes each block's weights and multiplies them by the documents
and the queries.

Memory bound. Beyond the inputs, the outputs, the saved auxiliary tensor (``Nq x C x Lq``) and, in the backward,
fp32 gradients shaped like the inputs, a call holds at most: one block of similarities (``BLOCK_ELEMENTS`` fp32
values, 32 MiB), for ragged documents a padded copy of it, a block's documents as fp32 rows or their gradient
(at most ``BLOCK_ELEMENTS`` values; none for contiguous fp32 documents while scoring), and index and mask vectors
over a block's document tokens (at most two blocks' bytes): below 5 x 32 MiB whatever Nq, B, Lq, Ld are, and one
block (at most the similarity tensor's size) when scoring padded fp32 documents. The hard max's backward holds,
instead of similarities, at most ``BLOCK_ELEMENTS / 8`` gathered entries and as many document-row values. A single document longer than ``BLOCK_ELEMENTS`` tokens is still
processed whole (``Ld`` values per query-token row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ._types import aux_dtype

# 32 MiB of fp32 similarities per block: on one core as fast as L2-sized blocks; with two threads on a loaded
# machine, fewer barriers: 1.3x faster than 16 MiB blocks (2-core AMD EPYC, torch 2.13 with MKL)
BLOCK_ELEMENTS = 1 << 23

_NEG_INF = float("-inf")


# --- documents, a block at a time ------------------------------------------------------------------------------

@dataclass
class _DocumentBlock:
    """Documents ``t0 .. t1 - 1`` (or one query's candidates): their token rows as one fp32 matrix, and how the
    rows pad out to ``[g, L]``."""

    rows: torch.Tensor                    # [n, d] fp32 (in-batch) or [qc, kc * L, d] (candidates)
    g: int                                # documents
    L: int                                # tokens per document, padded
    pad_index: Optional[torch.Tensor]     # ragged: [g * L] row of each padded position (clamped), else None
    in_doc: Optional[torch.Tensor]        # ragged: [g, L] position < length, else None (all in the document)
    valid: Optional[torch.Tensor]         # [g, L] in the document and unmasked; None: every position valid
    real: Optional[torch.Tensor]          # ragged: [g * L] bool, the padded positions holding a real row


def _as_fp32(x: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    x = x.float()
    if scales is not None:
        x = x * scales[..., None]         # D = scale * values, the dequantised index (fp32 products)
    return x


def _needs_copy(p) -> bool:
    """Whether a block of documents is copied (converted to fp32, scaled, or made contiguous)."""
    return p.documents.dtype != torch.float32 or p.document_scales is not None or not p.documents.is_contiguous()


def _padded_block(p, t0: int, t1: int) -> _DocumentBlock:
    D = p.documents[t0:t1]
    g, L, d = D.shape
    scales = None if p.document_scales is None else p.document_scales[t0:t1]
    rows = _as_fp32(D, scales).reshape(g * L, d)
    valid = None if p.documents_mask is None else p.documents_mask[t0:t1].bool()
    return _DocumentBlock(rows, g, L, None, None, valid, None)


def _ragged_block(p, t0: int, t1: int) -> _DocumentBlock:
    offs = p.offsets[t0:t1 + 1]
    r0, r1 = int(offs[0]), int(offs[-1])
    starts, lengths = offs[:-1] - r0, offs[1:] - offs[:-1]
    g = t1 - t0
    L = int(lengths.max()) if g else 0
    scales = None if p.document_scales is None else p.document_scales[r0:r1]
    rows = _as_fp32(p.documents[r0:r1], scales)
    pos = torch.arange(L, device=offs.device)
    in_doc = pos[None, :] < lengths[:, None]
    pad_index = (starts[:, None] + pos[None, :]).clamp_(max=max(r1 - r0 - 1, 0)).reshape(-1)
    valid = in_doc if p.documents_mask is None else in_doc & p.documents_mask[r0:r1][pad_index].view(g, L).bool()
    return _DocumentBlock(rows, g, L, pad_index, in_doc, valid, in_doc.reshape(-1))


def _candidate_block(p, q0: int, q1: int, k0: int, k1: int) -> _DocumentBlock:
    K = p.candidates
    D = p.documents.unflatten(0, (-1, K))[q0:q1, k0:k1]                    # [qc, kc, L, d]
    qc, kc, L, d = D.shape
    scales = None if p.document_scales is None else p.document_scales.unflatten(0, (-1, K))[q0:q1, k0:k1]
    rows = _as_fp32(D, scales).reshape(qc, kc * L, d)
    valid = None if p.documents_mask is None else \
        p.documents_mask.unflatten(0, (-1, K))[q0:q1, k0:k1].reshape(qc * kc, L).bool()
    return _DocumentBlock(rows, qc * kc, L, None, None, valid, None)


# --- the block plan --------------------------------------------------------------------------------------------

def _even(n: int, step: int) -> int:
    """A step of at most ``step`` that cuts ``n`` into as few and as equal parts as ``step`` does (the scratch is
    sized by the largest part)."""
    parts = -(-n // max(step, 1))
    return max(1, -(-n // max(parts, 1)))


def _token_chunks(Lq: int, rows_cap: int):
    """Query-token ranges: the whole query when it fits a block's rows, else chunks of it."""
    step = Lq if Lq <= rows_cap else _even(Lq, rows_cap)
    return [(i0, min(Lq, i0 + step)) for i0 in range(0, Lq, step)]


def _in_batch_plan(p, budget: int, token_rows: bool):
    """Documents per block and query blocks ``(q0, q1, i0, i1)`` for the every-query-against-every-document
    layout: as many query rows as fit (whole queries when a query fits), then as many documents as fit.
    ``token_rows``: the block also holds a d-wide row per document token (converted documents, a gradient)."""
    Nq, Lq, d = p.queries.shape
    L = max(p.max_length, 1)
    rows_cap = max(1, budget // L)
    qc = _even(Nq, rows_cap // Lq) if Lq <= rows_cap else 1
    chunks = _token_chunks(Lq, rows_cap)
    R = qc * (chunks[0][1] - chunks[0][0])
    g = budget // (L * R)
    if token_rows:
        g = min(g, budget // (L * d))
    g = _even(p.num_columns, g)
    query_blocks = [(q0, min(Nq, q0 + qc), i0, i1) for q0 in range(0, Nq, qc) for i0, i1 in chunks]
    return g, query_blocks


def _candidate_plan(p, budget: int, token_rows: bool):
    """``(q0, q1, k0, k1, i0, i1)`` blocks for the candidates layout: whole queries with all their candidates
    when they fit, else one query's candidates in ranges."""
    Nq, Lq, d = p.queries.shape
    K, L = p.candidates, max(p.max_length, 1)
    rows_cap = max(1, budget // L)
    chunks = _token_chunks(Lq, rows_cap)
    R = chunks[0][1] - chunks[0][0]
    per_doc = L * max(R, d if token_rows else 1)
    kc = _even(K, budget // per_doc)
    qc = _even(Nq, budget // (per_doc * K)) if kc == K else 1
    return [(q0, min(Nq, q0 + qc), k0, min(K, k0 + kc), i0, i1)
            for q0 in range(0, Nq, qc) for k0 in range(0, K, kc) for i0, i1 in chunks]


# --- similarities and their reduction --------------------------------------------------------------------------

class _Buffers:
    """Scratch reused across the blocks of one call (a fresh large allocation per block would be paged in and
    zeroed every time)."""

    def __init__(self, device):
        self.device = device
        self._store = {}

    def get(self, name: str, shape, dtype=torch.float32) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        buf = self._store.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1), dtype=dtype, device=self.device)
            self._store[name] = buf
        return buf[:n].view(shape)


def _queries_fp32(p) -> torch.Tensor:
    return p.queries.float().contiguous()


def _similarities(blk: _DocumentBlock, Qb: torch.Tensor, zero_masked: bool, buffers: _Buffers) -> torch.Tensor:
    """The masked similarity block ``[g, L, R]``: ``Qb`` is ``[R, d]`` (in-batch) or ``[qc, R, d]`` (candidates);
    a masked token is -inf (``exclude``) or 0 (``zero``), a ragged document's padding -inf."""
    if Qb.dim() == 2:
        R = Qb.shape[0]
        S = torch.mm(blk.rows, Qb.T, out=buffers.get("s", (blk.rows.shape[0], R)))
    else:
        R = Qb.shape[1]
        S = torch.bmm(blk.rows, Qb.transpose(1, 2), out=buffers.get("s", (*blk.rows.shape[:2], R)))
    if blk.pad_index is not None:
        S = torch.index_select(S, 0, blk.pad_index, out=buffers.get("padded", (blk.pad_index.shape[0], R)))
    S = S.view(blk.g, blk.L, R)
    if blk.valid is not None:
        if not zero_masked:
            S.masked_fill_(~blk.valid[..., None], _NEG_INF)
        else:
            if blk.valid is not blk.in_doc:           # masked tokens, not only a ragged document's padding
                S.masked_fill_(~blk.valid[..., None], 0.0)
            if blk.in_doc is not None:
                S.masked_fill_(~blk.in_doc[..., None], _NEG_INF)
    return S


def _smooth_max_(S: torch.Tensor, tau: float) -> torch.Tensor:
    """``tau * logsumexp(S / tau)`` over axis 1, overwriting ``S``: computed as ``m + tau * log(sum exp((s - m) /
    tau))`` with ``m`` the row's max (0 for a row of -inf), as the kernels and the reference do: ``s / tau`` itself
    overflows fp32 for small tau (max 2^128). A row holding +inf gives NaN (inf - inf), as in the kernels."""
    m = S.amax(1, keepdim=True)
    shift = torch.where(m == _NEG_INF, 0.0, m)
    S.sub_(shift).div_(tau).exp_()
    return shift[:, 0] + tau * torch.log(S.sum(1))


def _reduce(S, blk: _DocumentBlock, qvalid, smooth_tau, save_aux: bool, buffers: _Buffers):
    """Per-token aggregates ``[g, R]`` of a masked block (0 where empty or the query token is masked) and, when
    asked, the saved state: first arg-max token (-1: no gradient) or the row's log-sum-exp (inf: none)."""
    g, _, R = S.shape
    aux = None
    if smooth_tau is not None:
        agg = _smooth_max_(S, smooth_tau)
    elif save_aux:
        agg, arg = torch.max(S, 1, out=(buffers.get("agg", (g, R)), buffers.get("arg", (g, R), torch.int64)))
    else:
        agg = torch.amax(S, 1, out=buffers.get("agg", (g, R)))
    none = agg == _NEG_INF                        # nothing to aggregate over (or only -inf): counts as 0
    if qvalid is not None:
        none |= ~qvalid
    if save_aux:
        if smooth_tau is not None:
            aux = agg.masked_fill(none, float("inf"))
        else:
            keep = ~none
            if blk.valid is not None:                 # `zero` mode: a masked token (a constant 0) can be the max
                keep &= torch.gather(blk.valid, 1, arg)
            aux = arg.masked_fill(~keep, -1)
    return agg.masked_fill_(none, 0.0), aux


def forward(p, zero_masked: bool, smooth_tau, save_aux: bool):
    Nq, Lq, _ = p.queries.shape
    C = p.num_columns
    device = p.queries.device
    scores = torch.zeros(Nq, C, dtype=torch.float32, device=device)
    aux = torch.empty((Nq, C, Lq) if save_aux else (0, 0, 0), dtype=aux_dtype(smooth_tau, p.max_length),
                      device=device)
    Q = _queries_fp32(p)
    qmask = None if p.queries_mask is None else p.queries_mask.bool()
    buffers = _Buffers(device)

    if p.candidates:
        for q0, q1, k0, k1, i0, i1 in _candidate_plan(p, BLOCK_ELEMENTS, _needs_copy(p)):
            blk = _candidate_block(p, q0, q1, k0, k1)
            S = _similarities(blk, Q[q0:q1, i0:i1], zero_masked, buffers)       # [qc * kc, L, R]
            qvalid = None if qmask is None else qmask[q0:q1, None, i0:i1].expand(-1, k1 - k0, -1).reshape(blk.g, -1)
            agg, blk_aux = _reduce(S, blk, qvalid, smooth_tau, save_aux, buffers)
            part = agg.view(q1 - q0, k1 - k0, i1 - i0).sum(-1)
            if i0 == 0:
                scores[q0:q1, k0:k1] = part
            else:
                scores[q0:q1, k0:k1] += part
            if save_aux:
                aux[q0:q1, k0:k1, i0:i1] = blk_aux.view(q1 - q0, k1 - k0, i1 - i0)
        return scores, aux

    g, query_blocks = _in_batch_plan(p, BLOCK_ELEMENTS, _needs_copy(p))
    for t0 in range(0, C, g):
        t1 = min(C, t0 + g)
        blk = _ragged_block(p, t0, t1) if p.offsets is not None else _padded_block(p, t0, t1)
        if blk.L == 0:                                    # only empty documents: every score stays 0
            if save_aux:
                aux[:, t0:t1] = float("inf") if smooth_tau is not None else -1
            continue
        for q0, q1, i0, i1 in query_blocks:
            qc, Lr = q1 - q0, i1 - i0
            S = _similarities(blk, Q[q0:q1, i0:i1].reshape(qc * Lr, -1), zero_masked, buffers)   # [g, L, qc * Lr]
            qvalid = None if qmask is None else qmask[q0:q1, i0:i1].reshape(1, -1)
            agg, blk_aux = _reduce(S, blk, qvalid, smooth_tau, save_aux, buffers)
            part = agg.view(blk.g, qc, Lr).sum(-1).T
            if i0 == 0:
                scores[q0:q1, t0:t1] = part
            else:
                scores[q0:q1, t0:t1] += part
            if save_aux:
                aux[q0:q1, t0:t1, i0:i1] = blk_aux.view(blk.g, qc, Lr).transpose(0, 1)
    return scores, aux


# --- backward --------------------------------------------------------------------------------------------------

def _bag_offsets(counts: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(counts.numel(), dtype=torch.int64, device=counts.device)
    torch.cumsum(counts.reshape(-1)[:-1], 0, out=offsets[1:])
    return offsets


def _weighted_row_sums(table, index, weight, bags, bag_of_entry=None):
    """``out[b] = sum of weight[e] * table[index[e]]`` over the entries ``e`` of bag ``b``, in entry order.
    Entries come grouped by bag unless ``bag_of_entry`` is given (then they are grouped here, stably)."""
    if bag_of_entry is None:
        counts = bags
    else:
        order = torch.sort(bag_of_entry, stable=True).indices
        index, weight = index[order], weight[order]
        counts = torch.bincount(bag_of_entry, minlength=bags)
    return F.embedding_bag(index, table, _bag_offsets(counts), mode="sum", per_sample_weights=weight)


def _hard_backward_block(a, G, D_rows, Q_rows, row_of, need_dq: bool, need_dd: bool):
    """One block of the hard max's backward. ``a`` ``[qc, c, Lr]`` saved arg-max (-1: none), ``G`` ``[qc, c]``,
    ``row_of`` ``[qc, c]`` the row in ``D_rows`` of each document's first token, ``Q_rows`` ``[qc * Lr, d]``.
    Returns dQ ``[qc * Lr, d]`` and dD ``[len(D_rows), d]`` (None where not asked for)."""
    qc, c, Lr = a.shape
    a = a.transpose(1, 2).long()                                           # [qc, Lr, c]: bags (q, i) in order
    live = a >= 0
    d_row = (row_of[:, None, :] + a)[live]
    weight = G[:, None, :].expand(qc, Lr, c)[live]
    dq = dd = None
    if need_dq:
        dq = _weighted_row_sums(D_rows, d_row, weight, live.sum(-1))
    if need_dd:
        q_row = torch.arange(qc * Lr, device=a.device).view(qc, Lr, 1).expand(qc, Lr, c)[live]
        dd = _weighted_row_sums(Q_rows, q_row, weight, D_rows.shape[0], bag_of_entry=d_row)
    return dq, dd


def _hard_backward(grad, p, aux, need_dq, need_dd, dq, dd):
    Nq, Lq, d = p.queries.shape
    C = p.num_columns
    L = max(p.max_length, 1)
    device = p.queries.device
    Q = _queries_fp32(p)
    # per block: the gathered entries (qc x documents x Lq, below 64 bytes each with their indices) and the
    # documents' rows and gradient (documents x L x d) stay within an eighth of a similarity block's count each
    budget = max(1, BLOCK_ELEMENTS // 8)
    per_doc = max(Lq, L * d)
    if p.candidates:
        K = p.candidates
        kc = _even(K, budget // per_doc)
        qc = _even(Nq, min(budget // (per_doc * K), budget // (Lq * d))) if kc == K else 1
        for q0 in range(0, Nq, qc):
            q1 = min(Nq, q0 + qc)
            for k0 in range(0, K, kc):
                k1 = min(K, k0 + kc)
                blk = _candidate_block(p, q0, q1, k0, k1)
                row_of = torch.arange(blk.g, device=device).view(q1 - q0, k1 - k0) * blk.L
                gq, gd = _hard_backward_block(aux[q0:q1, k0:k1], grad[q0:q1, k0:k1], blk.rows.reshape(-1, d),
                                              Q[q0:q1].reshape(-1, d), row_of, need_dq, need_dd)
                if need_dq:
                    dq[q0:q1] += gq.view(q1 - q0, Lq, d)
                if need_dd:
                    dd.unflatten(0, (-1, K))[q0:q1, k0:k1] += gd.view(q1 - q0, k1 - k0, blk.L, d)
        return
    g = _even(C, budget // per_doc)
    qc = _even(Nq, min(budget // (g * Lq), budget // (Lq * d)))
    for t0 in range(0, C, g):
        t1 = min(C, t0 + g)
        if p.offsets is not None:
            offs = p.offsets[t0:t1 + 1]
            r0, r1 = int(offs[0]), int(offs[-1])
            D_rows = p.documents[r0:r1].float()
            first = offs[:-1] - r0
        else:
            D_rows = _padded_block(p, t0, t1).rows
            first = torch.arange(t1 - t0, device=device) * p.documents.shape[1]
        for q0 in range(0, Nq, qc):
            q1 = min(Nq, q0 + qc)
            gq, gd = _hard_backward_block(aux[q0:q1, t0:t1], grad[q0:q1, t0:t1], D_rows, Q[q0:q1].reshape(-1, d),
                                          first[None, :].expand(q1 - q0, -1), need_dq, need_dd)
            if need_dq:
                dq[q0:q1] += gq.view(q1 - q0, Lq, d)
            if need_dd:
                if p.offsets is not None:
                    dd[r0:r1] += gd
                else:
                    dd[t0:t1] += gd.view(t1 - t0, -1, d)


def _smooth_weights_(S, lse, G, tau, valid, qvalid):
    """``S`` overwritten with ``G[q, t] * exp((s - lse) / tau)`` on the live tokens, 0 elsewhere."""
    S.sub_(lse[:, None, :]).div_(tau).exp_()
    if valid is not None:
        S.masked_fill_(~valid[..., None], 0.0)
    if qvalid is not None:
        S.masked_fill_(~qvalid[:, None, :], 0.0)
    return S.mul_(G[:, None, :])


def _smooth_backward(grad, p, aux, smooth_tau, need_dq, need_dd, dq, dd):
    Nq, Lq, d = p.queries.shape
    qmask = None if p.queries_mask is None else p.queries_mask.bool()
    Q = _queries_fp32(p)
    if qmask is not None:                  # masked tokens get zero weight; zero their vectors too (NaN stays out)
        Q = torch.where(qmask[..., None], Q, 0.0)
    buffers = _Buffers(p.queries.device)

    def zeroed(blk):
        if p.documents_mask is None:       # every row of a block is then a valid token
            return blk.rows
        valid_rows = blk.valid.reshape(-1) if blk.real is None else blk.valid.reshape(-1)[blk.real]
        return torch.where(valid_rows.view(*blk.rows.shape[:-1], 1), blk.rows, 0.0)

    if p.candidates:
        K = p.candidates
        for q0, q1, k0, k1, i0, i1 in _candidate_plan(p, BLOCK_ELEMENTS, True):
            qc, kc, Lr = q1 - q0, k1 - k0, i1 - i0
            blk = _candidate_block(p, q0, q1, k0, k1)
            S = _similarities(blk, Q[q0:q1, i0:i1], True, buffers)             # [qc * kc, L, Lr]
            qvalid = None if qmask is None else qmask[q0:q1, None, i0:i1].expand(-1, kc, -1).reshape(blk.g, Lr)
            G = grad[q0:q1, k0:k1].reshape(-1, 1).expand(-1, Lr)
            W = _smooth_weights_(S, aux[q0:q1, k0:k1, i0:i1].reshape(blk.g, Lr), G, smooth_tau, blk.valid, qvalid)
            W = W.view(qc, kc * blk.L, Lr)
            if need_dq:
                dq[q0:q1, i0:i1] += torch.bmm(W.transpose(1, 2), zeroed(blk))
            if need_dd:
                dd.unflatten(0, (-1, K))[q0:q1, k0:k1] += \
                    torch.bmm(W, Q[q0:q1, i0:i1]).view(qc, kc, blk.L, d)
        return
    C = p.num_columns
    g, query_blocks = _in_batch_plan(p, BLOCK_ELEMENTS, True)
    for t0 in range(0, C, g):
        t1 = min(C, t0 + g)
        blk = _ragged_block(p, t0, t1) if p.offsets is not None else _padded_block(p, t0, t1)
        if blk.L == 0:
            continue
        D_rows = zeroed(blk) if need_dq else None
        for q0, q1, i0, i1 in query_blocks:
            qc, Lr = q1 - q0, i1 - i0
            Qb = Q[q0:q1, i0:i1].reshape(qc * Lr, d)
            S = _similarities(blk, Qb, True, buffers)                              # [g, L, qc * Lr]
            qvalid = None if qmask is None else qmask[q0:q1, i0:i1].reshape(1, -1)
            lse = aux[q0:q1, t0:t1, i0:i1].transpose(0, 1).reshape(blk.g, qc * Lr)
            G = grad[q0:q1, t0:t1].T.repeat_interleave(Lr, dim=1)                  # [g, qc * Lr]
            W = _smooth_weights_(S, lse, G, smooth_tau, blk.valid, qvalid).view(-1, qc * Lr)
            if blk.real is not None:
                W = W[blk.real]                                                    # padded positions -> rows
            if need_dq:
                dq[q0:q1, i0:i1] += torch.mm(W.T, D_rows).view(qc, Lr, d)
            if need_dd:
                part = torch.mm(W, Qb)
                if p.offsets is not None:
                    r0 = int(p.offsets[t0])
                    dd[r0:r0 + part.shape[0]] += part
                else:
                    dd[t0:t1] += part.view(t1 - t0, -1, d)


def backward(grad, p, aux, smooth_tau, need_dq: bool, need_dd: bool, grad_dtype=None):
    """dQ and dD from the saved auxiliary tensor, accumulated in fp32 in a fixed order."""
    grad = grad.float()
    device = p.queries.device
    dq = torch.zeros(p.queries.shape, dtype=torch.float32, device=device) if need_dq else None
    dd = torch.zeros(p.documents.shape, dtype=torch.float32, device=device) if need_dd else None
    if need_dq or need_dd:
        if smooth_tau is None:
            _hard_backward(grad, p, aux, need_dq, need_dd, dq, dd)
        else:
            _smooth_backward(grad, p, aux, smooth_tau, need_dq, need_dd, dq, dd)
    out_q = dq.to(grad_dtype or p.queries.dtype) if need_dq else None
    out_d = dd.to(grad_dtype or p.documents.dtype) if need_dd else None
    return out_q, out_d
