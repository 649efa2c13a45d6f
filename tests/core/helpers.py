"""Shared pieces of the core tests: random problems in every layout, the float64 oracles, tolerances.

A :class:`Case` holds leaf tensors (what gradients are taken with respect to) and knows how to turn them into
the arguments of ``flash_maxsim.maxsim`` in its layout (padded, per-query candidates, list, packed), possibly
through non-contiguous views. The same construction applied to float64 copies of the leaves gives the
reference's arguments, so scores and gradients of both sides are compared leaf by leaf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

import flash_maxsim
from flash_maxsim import reference
from flash_maxsim.ops import force_backend

LAYOUTS = ("padded", "candidates", "list", "packed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASK_DTYPES = (torch.bool, torch.uint8, torch.int64, torch.float32)

# Tolerances per input dtype. Both sides see the same rounded inputs (the reference upcasts the very same
# fp16/bf16 values) and fp16/bf16 products are exact in fp32, so scores differ only by fp32 accumulation for
# every dtype: relative to a bound on the summed |similarities| (Case.score_scale).
SCORE_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
# Gradients accumulate in fp32 and are then rounded to the input dtype (half an ulp: 2^-8 bf16, 2^-11 fp16).
GRAD_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -8 + 2e-5, torch.float16: 2.0 ** -11 + 2e-5}
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def random_tensor(shape, dtype, generator, device="cpu"):
    """Normal data scaled by d^-1/4 per side, so similarities are O(1) whatever d is (tau stays meaningful)."""
    d = shape[-1] if len(shape) else 1
    x = torch.randn(*shape, generator=generator, dtype=torch.float32) * max(d, 1) ** -0.25
    return x.to(device=device, dtype=dtype)


def random_mask(shape, keep, dtype, generator, device="cpu"):
    valid = torch.rand(*shape, generator=generator) < keep
    return valid.to(device=device, dtype=dtype)


@dataclass
class Case:
    layout: str
    dtype: torch.dtype
    queries: torch.Tensor                     # leaf: [Nq, Lq, d], or its transposed storage [Lq, Nq, d]
    documents: list                           # leaves: one base tensor, or one tensor per listed document
    queries_mask: Optional[torch.Tensor] = None
    documents_mask: object = None             # tensor, list of tensors, or None
    offsets: Optional[torch.Tensor] = None    # packed layout
    masked: str = "exclude"
    smooth_tau: Optional[float] = None
    single_query: bool = False
    noncontiguous: bool = False
    lengths: list = field(default_factory=list)
    num_queries: int = 0
    num_columns: int = 0
    seed: int = 0

    # --- building the arguments from (possibly float64) leaves -------------------------------------------
    def leaves(self):
        return [self.queries, *self.documents]

    def _queries_view(self, q):
        if self.noncontiguous:
            q = q[:, ::2] if self.single_query else q.transpose(0, 1)
        return q[0] if self.single_query else q

    def _documents_view(self, docs, for_reference):
        if self.layout in ("padded", "candidates"):
            x = docs[0]
            return x.transpose(0, 1) if self.noncontiguous else x
        if self.layout == "list":
            return [x[::2] if self.noncontiguous else x for x in docs]
        values = docs[0][:, ::2] if self.noncontiguous else docs[0]
        if for_reference:
            return (values, self.offsets)   # the reference's 2-tuple packed form (PackedDocuments: see test_reference)
        return flash_maxsim.PackedDocuments(values, self.offsets, max(self.lengths + [0]))

    def arguments(self, leaves, for_reference=False):
        q, docs = leaves[0], leaves[1:]
        qm = self.queries_mask
        if self.single_query and qm is not None:
            qm = qm[0]
        return (self._queries_view(q), self._documents_view(docs, for_reference), qm, self.documents_mask)

    def run(self, fn, leaves, for_reference=False):
        return fn(*self.arguments(leaves, for_reference), masked=self.masked, smooth_tau=self.smooth_tau)

    # --- the logical content, in float64: per column, the document tokens and their mask ----------------
    def logical(self, leaves):
        """(Q64 [Nq, Lq, d], qvalid [Nq, Lq] bool, docs [T] of [L_t, d], dvalid [T] of [L_t] bool, K)."""
        q, docs, qm, dm = self.arguments(leaves, for_reference=True)
        Q = q[None] if q.dim() == 2 else q
        qvalid = torch.ones(Q.shape[:2], dtype=torch.bool, device=Q.device) if qm is None else \
            (qm[None] if qm.dim() == 1 else qm) != 0
        K = 0
        if self.layout == "padded":
            doc_list = list(docs)
            mask_list = None if dm is None else list(dm != 0)
        elif self.layout == "candidates":
            K = docs.shape[1]
            doc_list = list(docs.reshape(-1, *docs.shape[2:]))
            mask_list = None if dm is None else list((dm != 0).reshape(-1, dm.shape[-1]))
        elif self.layout == "list":
            doc_list = list(docs)
            mask_list = None if dm is None else [m != 0 for m in dm]
        else:
            values, offsets = docs
            o = offsets.tolist()
            doc_list = [values[o[t]:o[t + 1]] for t in range(len(o) - 1)]
            mask_list = None if dm is None else [(dm != 0)[o[t]:o[t + 1]] for t in range(len(o) - 1)]
        if mask_list is None:
            mask_list = [torch.ones(x.shape[0], dtype=torch.bool, device=x.device) for x in doc_list]
        return Q, qvalid, doc_list, mask_list, K

    def similarity_bound(self):
        """max ||q_i|| * max ||d_j||: a bound on every |s_ij|."""
        Q, _, docs, _, _ = self.logical([x.detach().double() for x in self.leaves()])
        qn = Q.norm(dim=-1).max().item() if Q.numel() else 0.0
        dn = max([x.norm(dim=-1).max().item() for x in docs if x.shape[0]] + [0.0])
        return qn * dn

    def score_scale(self):
        """Bound on the sum over query tokens of |per-token value|: the scale of fp32 accumulation errors."""
        longest = max(self.lengths + [1])
        smooth = 0.0 if self.smooth_tau is None else self.smooth_tau * math.log(longest + 1)
        return self.num_query_tokens * (self.similarity_bound() + smooth) + 1e-30

    def grad_extra_rtol(self):
        """Smooth max: softmax weights move by ds/tau, so errors in s (fp32 accumulation) grow by 1/tau."""
        if self.smooth_tau is None:
            return 0.0
        d = self.queries.shape[-1]
        return 4 * math.sqrt(d) * FP32_UNIT_ROUNDOFF * self.similarity_bound() / self.smooth_tau

    @property
    def num_query_tokens(self):
        return self._queries_view(self.queries).shape[-2]

    def describe(self):
        return (f"seed={self.seed} layout={self.layout} dtype={self.dtype} q={tuple(self.queries.shape)} "
                f"lengths={self.lengths} "
                f"masked={self.masked} tau={self.smooth_tau} single={self.single_query} "
                f"noncontig={self.noncontiguous} qmask={self.queries_mask is not None} "
                f"dmask={self.documents_mask is not None}")


def make_case(*, layout, Nq, C, Lq, Ld, d, dtype=torch.float32, masked="exclude", smooth_tau=None,
              query_mask_keep=None, doc_mask_keep=None, mask_dtype=torch.bool, fully_masked_doc=False,
              empty_doc=False, single_query=False, noncontiguous=False, seed=0, device="cpu",
              requires_grad=True, lengths=None):
    """A random problem. ``C`` is B (padded/list/packed) or K (candidates); ragged lengths are drawn in
    [0, Ld] (``empty_doc`` forces one zero-length document); masks keep each token with the given probability
    (None: no mask). Fully masked documents are forced with ``fully_masked_doc``."""
    g = torch.Generator().manual_seed(seed)
    if single_query:
        Nq = 1
    if layout == "candidates":
        T = Nq * C
    else:
        T = C
    if lengths is None:
        if layout in ("padded", "candidates"):
            lengths = [Ld] * T
        else:
            lengths = torch.randint(0, Ld + 1, (T,), generator=g).tolist()
            if empty_doc and T:
                lengths[int(torch.randint(0, T, (1,), generator=g))] = 0
    lengths = list(lengths)

    def leaf(shape):
        return random_tensor(shape, dtype, g, device).requires_grad_(requires_grad)

    if noncontiguous and not single_query:
        queries = leaf((Lq, Nq, d))          # viewed as .transpose(0, 1)
    elif noncontiguous:
        queries = leaf((1, 2 * Lq, d))       # viewed as [:, ::2]
    else:
        queries = leaf((Nq, Lq, d))
    offsets = None
    if layout == "padded":
        documents = [leaf((Ld, C, d)) if noncontiguous else leaf((C, Ld, d))]
    elif layout == "candidates":
        documents = [leaf((C, Nq, Ld, d)) if noncontiguous else leaf((Nq, C, Ld, d))]
    elif layout == "list":
        documents = [leaf((2 * n, d)) if noncontiguous else leaf((n, d)) for n in lengths]
    else:
        total = sum(lengths)
        documents = [leaf((total, 2 * d)) if noncontiguous else leaf((total, d))]
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device)

    qmask = None
    if query_mask_keep is not None:
        qmask = random_mask((Nq, Lq), query_mask_keep, mask_dtype, g, device)
    dmask = None
    if doc_mask_keep is not None or fully_masked_doc:
        keep = 1.0 if doc_mask_keep is None else doc_mask_keep
        if layout == "padded":
            dmask = random_mask((C, Ld), keep, mask_dtype, g, device)
            rows = dmask
        elif layout == "candidates":
            dmask = random_mask((Nq, C, Ld), keep, mask_dtype, g, device)
            rows = dmask.view(-1, Ld)
        elif layout == "list":
            dmask = [random_mask((n,), keep, mask_dtype, g, device) for n in lengths]
            rows = dmask
        else:
            dmask = random_mask((sum(lengths),), keep, mask_dtype, g, device)
            o = offsets.tolist()
            rows = [dmask[o[t]:o[t + 1]] for t in range(T)]
        if fully_masked_doc and T:
            rows[int(torch.randint(0, T, (1,), generator=g))].zero_()
    return Case(layout, dtype, queries, documents, qmask, dmask, offsets, masked, smooth_tau, single_query,
                noncontiguous, lengths, Nq, C, seed)


# --- oracles -------------------------------------------------------------------------------------------------

def _pad_columns(docs, masks):
    """Differentiable padding of a list of [L_t, d] float64 tensors: [T, L, d], in-document and valid masks."""
    T = len(docs)
    L = max([x.shape[0] for x in docs] + [1])
    d = docs[0].shape[-1]
    D = torch.stack([F.pad(x, (0, 0, 0, L - x.shape[0])) for x in docs])
    pos = torch.arange(L, device=D.device)
    in_doc = pos[None, :] < torch.tensor([x.shape[0] for x in docs], device=D.device)[:, None]
    valid = torch.stack([F.pad(m, (0, L - m.shape[0])) for m in masks]) & in_doc
    return D.view(T, L, d), in_doc, valid


def first_argmax_maxsim(case: Case, leaves64, chosen=None, tie_tol=0.0):
    """Hard-max MaxSim in float64 whose autograd sends each row's gradient to the FIRST arg-max token (the
    documented tie rule; ``amax``'s autograd would split it). Same numbers as the reference.

    ``chosen`` ``[Nq, C, Lq]`` (token index per row, -1 for none: the kernels' saved arg-max) replaces the
    float64 arg-max: at large sizes two tokens can be closer than fp32 rounding, and either is then a correct
    maximum. Every chosen token is checked to be a maximum within ``tie_tol``, and a row without one must
    have nothing to differentiate (masked query token, empty document, or a "zero"-mode maximum at 0)."""
    Q, qvalid, docs, masks, K = case.logical(leaves64)
    Nq = Q.shape[0]
    C = K if K else len(docs)
    if Nq == 0 or C == 0:
        out = Q.new_zeros(Nq, C)
        return out[0] if case.single_query else out
    D, in_doc, valid = _pad_columns(docs, masks)
    rows = []
    for q in range(Nq):
        cols = slice(q * K, (q + 1) * K) if K else slice(None)
        s = torch.einsum("id,cjd->cij", Q[q], D[cols])                                   # [C, Lq, L]
        allowed = (in_doc if case.masked == "zero" else valid)[cols][:, None, :]
        as_seen = torch.where(valid[cols][:, None, :], s, torch.zeros_like(s))          # masked -> 0 ("zero")
        candidates = torch.where(allowed, as_seen, torch.full_like(s, float("-inf")))
        nonempty = allowed.any(-1)
        live = nonempty & qvalid[q][None, :]
        if chosen is None:
            pick = candidates.detach().argmax(-1, keepdim=True)                         # first maximal index
            use = live
        else:
            c = chosen[q].to(device=s.device, dtype=torch.long)                         # [C, Lq]
            use = c >= 0
            pick = c.clamp(min=0)[..., None]
            best = candidates.detach().amax(-1)
            got = torch.gather(candidates.detach(), -1, pick)[..., 0]
            bad = use & live & ~(got >= best - tie_tol)
            assert not bad.any(), f"query {q}: a saved arg-max is not a maximum ({case.describe()})"
            masked_in_doc = (in_doc & ~valid)[cols][:, None, :].any(-1)
            unexplained = ~use & live & ~((case.masked == "zero") & masked_in_doc & (best <= tie_tol))
            assert not unexplained.any(), f"query {q}: a row lost its gradient ({case.describe()})"
            use = use & live
        picked = torch.gather(as_seen, -1, pick)[..., 0]
        picked = torch.where(use, picked, torch.zeros_like(picked))
        rows.append(picked.sum(-1))
    out = torch.stack(rows)
    return out[0] if case.single_query else out


def reference_scores_and_grads(case: Case, grad_output=None, oracle="auto", chosen=None, tie_tol=0.0):
    """float64 scores and gradients w.r.t. the leaves. Hard max uses :func:`first_argmax_maxsim` (first
    arg-max tie rule, or the given ``chosen`` arg-max); smooth max uses autograd of
    ``flash_maxsim.reference.maxsim`` (softmax weights)."""
    leaves64 = [x.detach().double().requires_grad_(True) for x in case.leaves()]
    if case.num_queries == 0 or case.num_columns == 0:
        # nothing to score: an empty result and zero gradients
        shape = (case.num_columns,) if case.single_query else (case.num_queries, case.num_columns)
        out = torch.zeros(shape, dtype=torch.float64, device=case.queries.device)
    elif oracle == "reference" or (oracle == "auto" and case.smooth_tau is not None):
        out = case.run(reference.maxsim, leaves64, for_reference=True)
    else:
        out = first_argmax_maxsim(case, leaves64, chosen, tie_tol)
    if grad_output is None:
        return out.detach(), None
    return out.detach(), _grads(out, leaves64, grad_output.double())


def expected_scores_and_grads(case: Case, grad_output=None):
    """What the path under test (the current backend) must return for ``case``: float64 scores and gradients.
    For the hard max the oracle follows the arg-max that path saved for its backward, after checking that it is
    a maximum to within fp32 rounding (8 sqrt(d) u32 times the similarity bound): two tokens can be closer than
    that on random data, and either is then a correct maximum. The exact-tie rule (first token) is tested on
    planted ties, where the float64 first arg-max is the only answer."""
    chosen, tie_tol = None, 0.0
    if case.smooth_tau is None and grad_output is not None:
        chosen = saved_argmax(case)
        tie_tol = 8 * math.sqrt(case.queries.shape[-1]) * FP32_UNIT_ROUNDOFF * similarity_bound(case)
    return reference_scores_and_grads(case, grad_output, chosen=chosen, tie_tol=tie_tol)


def similarity_bound(case: Case):
    return case.similarity_bound()


def saved_argmax(case: Case):
    """The arg-max per (query, column, query token) that the forward saves for the hard-max backward."""
    from flash_maxsim._layout import canonicalize

    p = canonicalize(*case.arguments(case.leaves()), masked=case.masked, smooth_tau=None)
    with torch.no_grad():
        _, aux = torch.ops.flash_maxsim.maxsim_fwd(p.queries, p.documents, p.queries_mask, p.documents_mask,
                                                   p.offsets, p.max_length, p.candidates, case.masked == "zero",
                                                   None, True)
    return aux



def _grads(out, leaves, grad_output):
    if not out.requires_grad:
        return [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, grad_output, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def flash_scores_and_grads(case: Case, grad_output=None):
    leaves = [x.detach().clone().requires_grad_(grad_output is not None) for x in case.leaves()]
    out = case.run(flash_maxsim.maxsim, leaves)
    if grad_output is None:
        return out.detach(), None
    return out.detach(), _grads(out, leaves, grad_output)


def assert_scores_close(actual, expected, case: Case, rtol=None):
    assert actual.dtype == torch.float32, actual.dtype
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    atol = (SCORE_RTOL[case.dtype] if rtol is None else rtol) * case.score_scale()
    err = (actual.double() - expected).abs()
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= atol, f"max |score error| {worst:.3g} > {atol:.3g} ({case.describe()})"


def assert_grads_close(actual, expected, case: Case):
    rtol = GRAD_RTOL[case.dtype] + case.grad_extra_rtol()
    for k, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == case.dtype, f"gradient {k} has dtype {a.dtype}, expected the input dtype {case.dtype}"
        assert a.shape == e.shape, (k, a.shape, e.shape)
        if not e.numel():
            continue
        scale = e.abs().max().item()
        # gradients come back in the input dtype: below its smallest normal number (fp16: 6.1e-5) only
        # subnormals or 0 can be returned, so no relative precision is owed there
        bound = rtol * e.abs() + rtol * scale + torch.finfo(case.dtype).tiny
        err = (a.double() - e).abs()
        bad = err > bound
        assert not bad.any(), (f"gradient of leaf {k}: {int(bad.sum())} of {e.numel()} elements off, worst "
                               f"|err| {err.max().item():.3g} (max |grad| {scale:.3g}, rtol {rtol:.3g}); "
                               f"{case.describe()}")


def upstream_gradient(case: Case, seed=None):
    """Random (not all-ones) upstream gradient of the scores' shape."""
    shape = (case.num_columns,) if case.single_query else (case.num_queries, case.num_columns)
    g = torch.Generator().manual_seed(case.seed + 1 if seed is None else seed)
    return torch.randn(*shape, generator=g).to(case.queries.device)


def check_case(case: Case, backend: str):
    """Scores and gradients (for a random upstream gradient) of ``case`` on ``backend`` ("torch" or "triton")
    against the float64 oracle; returns them."""
    grad_out = upstream_gradient(case)
    with force_backend(backend):
        got, grads = flash_scores_and_grads(case, grad_out)
        expected, expected_grads = expected_scores_and_grads(case, grad_out)
    assert_scores_close(got, expected, case)
    assert_grads_close(grads, expected_grads, case)
    return got, grads
