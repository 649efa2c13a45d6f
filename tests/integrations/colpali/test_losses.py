"""Every late-interaction loss x every option, patched against the unpatched library on the same inputs: the loss
value and the gradients with respect to the query, document and negative embeddings (CPU, fp32, exact-grid data:
see colpali_cases)."""

from __future__ import annotations

import itertools

import pytest
import torch

from colpali_engine.loss import late_interaction_losses as losses
from flash_maxsim.integrations import colpali as flash_colpali

from colpali_cases import LOSS_RTOL, gradient_error, loss_batch, nothing, outcome, relative_error, tolerances

IN_BATCH = ("ColbertLoss", "ColbertPairwiseCELoss", "ColbertSigmoidLoss")
WITH_NEGATIVES = ("ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss")


def _cases():
    for name in IN_BATCH + WITH_NEGATIVES:
        weights = (0.0, 0.5) if name in WITH_NEGATIVES else (None,)
        for smooth, normalize, filtering, processes, weight in itertools.product(
                (False, True), (False, True), (False, True), (1, 3), weights):
            case_id = (f"{name}-{'smooth' if smooth else 'hard'}-{'norm' if normalize else 'raw'}"
                       f"{'-filter' if filtering else ''}-{processes}proc"
                       f"{'' if weight is None else f'-inbatch{weight}'}")
            yield pytest.param(name, smooth, normalize, filtering, processes, weight, id=case_id)


def _make_loss(name, smooth, normalize, filtering, weight):
    kwargs = dict(use_smooth_max=smooth, normalize_scores=normalize, pos_aware_negative_filtering=filtering)
    if weight is not None:
        kwargs["in_batch_term_weight"] = weight
    return getattr(losses, name)(**kwargs)


def _run(loss, batch, patched):
    """Loss value, gradients w.r.t. the raw (pre-mask) leaves and w.r.t. the zero-padded embeddings."""
    leaves = batch.leaves()
    padded = batch.padded(leaves)
    args = [padded["q"], padded["d"]] + ([padded["n"]] if "n" in padded else [])
    with flash_colpali.enabled() if patched else nothing():
        value = loss(*args, offset=batch.offset)
    value.backward()
    return value.detach(), {k: v.grad for k, v in leaves.items()}, {k: v.grad for k, v in padded.items()}


@pytest.mark.parametrize("name, smooth, normalize, filtering, processes, weight", list(_cases()))
def test_loss_and_gradients_match_the_library(name, smooth, normalize, filtering, processes, weight, generator,
                                               calls):
    loss = _make_loss(name, smooth, normalize, filtering, weight)
    for _ in range(5):
        batch = loss_batch(generator, processes=processes, negatives=2 if name in WITH_NEGATIVES else 0,
                           left_padded_docs=processes > 1)
        want = outcome(lambda: _run(loss, batch, patched=False))
        # a saturated draw (the library's own gradients exactly 0) would compare nothing: draw again
        if want[0] != "ok" or any(g.abs().max() > 0 for g in want[1][1].values()):
            break
    calls.reset()
    got = outcome(lambda: _run(loss, batch, patched=True))
    if want[0] == "raises":
        # e.g. ColbertSigmoidLoss with documents gathered from several processes: the library's [B*B] label
        # layout does not fit [B, B*P] scores. The patched loss fails the same way.
        assert got == want
        assert name == "ColbertSigmoidLoss" and processes > 1, f"the library failed unexpectedly: {want}"
        return
    assert got[0] == "ok", f"the patched loss raised {got[1]} where the library did not"
    (want_value, want_raw, want_padded), (got_value, got_raw, got_padded) = want[1], got[1]
    assert torch.isfinite(want_value)
    loss_tolerance, grad_rtol = tolerances(loss, batch, want_value, calls.flash_outputs, smooth)
    assert abs(got_value.item() - want_value.item()) <= loss_tolerance, (got_value, want_value)
    for key in want_raw:
        # what reaches a model: gradients through the attention-mask multiplication
        assert gradient_error(got_raw[key], want_raw[key]) <= grad_rtol, key
        mask = batch.masks[key][..., None]
        if smooth:
            # logsumexp's gradient is the softmax: equal at padding positions too
            assert gradient_error(got_padded[key], want_padded[key]) <= grad_rtol, key
        else:
            # at padding positions ties are broken differently (torch amax splits, flash_maxsim picks the first);
            # the mask multiplication above removes them, real positions must agree
            assert gradient_error(got_padded[key] * mask, want_padded[key] * mask) <= grad_rtol, key
    assert any(g.abs().max() > 0 for g in want_raw.values())


@pytest.mark.parametrize("name", IN_BATCH + WITH_NEGATIVES)
@pytest.mark.parametrize("smooth", [False, True], ids=["hard", "smooth"])
def test_without_gradients(name, smooth, generator, calls):
    """The trainer's prediction_step computes the loss under no_grad (flash_maxsim then keeps no auxiliary)."""
    batch = loss_batch(generator, negatives=2 if name in WITH_NEGATIVES else 0)
    args = [batch.padded(batch.leaves())[k].detach() for k in batch.raw]
    loss = getattr(losses, name)(use_smooth_max=smooth)
    with torch.no_grad():
        want = loss(*args)
        calls.reset()
        with flash_colpali.enabled():
            got = loss(*args)
    assert calls.flash > 0
    loss_tolerance, _ = tolerances(loss, batch, want, calls.flash_outputs, smooth)
    assert abs(got.item() - want.item()) <= loss_tolerance, (got, want)


def test_zero_padding_counts_as_similarity_zero(generator):
    """A real query token whose similarities to a short document's real tokens are all negative gets max 0 from
    the zero padding, in the library and after enable(); in the smooth max a zero query token adds tau*log(Ld)."""
    q = -torch.rand(1, 3, 8, generator=generator) - 0.1          # negative entries
    docs = torch.rand(2, 5, 8, generator=generator) + 0.1        # positive entries: every similarity < 0
    docs[1, 3:] = 0                                              # document 1 has two padding tokens
    q[0, 2] = 0                                                  # one zero-padded query token
    for smooth in (False, True):
        loss = losses.ColbertLoss(use_smooth_max=smooth, normalize_scores=False)
        want = loss(q, docs)
        with flash_colpali.enabled():
            got = loss(q, docs)
        assert relative_error(got, want) <= LOSS_RTOL
    hard = flash_colpali._late_interaction(q, docs)
    smooth = flash_colpali._late_interaction(q, docs, 0.1)
    s = torch.einsum("bnd,csd->bcns", q.double(), docs.double())
    assert s[0, 1, :2, :3].max() < 0 and hard[0, 1] == 0          # the padding wins every max for document 1
    assert hard[0, 0] < 0                                         # no padding: the real (negative) maxima
    assert relative_error(hard[0, 0], s[0, 0].amax(-1).sum()) <= 1e-6
    tau_log_ld = 0.1 * torch.log(torch.tensor(5.0, dtype=torch.float64))
    assert relative_error((0.1 * torch.logsumexp(s[0, :, 2] / 0.1, -1)), tau_log_ld.expand(2)) <= 1e-12
    assert relative_error(smooth, (0.1 * torch.logsumexp(s / 0.1, -1)).sum(-1)) <= 1e-6


class _RecordingCrossEntropy(torch.nn.CrossEntropyLoss):
    """The library's cross-entropy, keeping the first logits it is given."""

    logits = None

    def forward(self, logits, target):
        if self.logits is None:
            self.logits = logits.detach()
        return super().forward(logits, target)


def test_autocast_inputs_reach_flash_in_the_autocast_dtype(generator, calls):
    """Under autocast the library's einsum runs in bf16; the patched loss casts for flash_maxsim the same way
    (fp32 inputs would otherwise take the slow fp32 kernel). Both then compute the loss of the bf16-rounded
    embeddings: flash_maxsim to fp32 accumulation error, the library to bf16 rounding of every similarity, maximum,
    score and logit. Each is held to its own rounding bound (unit roundoff u = 2^-8 for bf16, 2^-24 for fp32) around
    the float64 loss of the bf16-rounded inputs; at temperature 0.02 the library's bf16 logits can move the loss by
    several percent, so a fixed tolerance between the two would depend on the draw."""
    u_bf16, u_fp32 = 2.0 ** -8, 2.0 ** -24
    batch = loss_batch(generator, values=lambda shape, g: torch.randn(*shape, generator=g))
    args = [batch.padded(batch.leaves())[k] for k in batch.raw]
    loss = losses.ColbertLoss(normalize_scores=False)
    loss.ce_loss = _RecordingCrossEntropy()          # every version ends in ce_loss(scores / temperature, ...)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss(*args)
        library_logits = loss.ce_loss.logits
        with flash_colpali.enabled():
            got = loss(*args)
    assert calls.flash_dtypes == [torch.bfloat16]
    assert library_logits.dtype == torch.bfloat16  # the comparison below is about bf16 arithmetic in the library

    q, d = (a.detach().bfloat16().double() for a in args)
    sims = torch.einsum("bnd,csd->bcns", q, d)
    abs_products = torch.einsum("bnd,csd->bcns", q.abs(), d.abs())   # bounds every dot product's rounding
    scores = sims.amax(-1).sum(-1)
    exact = torch.nn.functional.cross_entropy(scores / loss.temperature, torch.arange(len(q)))
    dim, query_length = q.shape[-1], q.shape[1]

    # flash_maxsim: fp32 accumulation over dim products, then over query_length maxima (gamma_n < 1.01 n u); the
    # cross-entropy of n logits moves by at most twice their largest change
    score_err = 1.01 * (dim + query_length) * u_fp32 * abs_products.amax(-1).sum(-1)
    logit_err = (score_err + u_fp32 * scores.abs()) / loss.temperature
    assert (got.double() - exact).abs() <= 2 * logit_err.max()

    # the library: fp32 dots rounded to bf16, bf16 maxima summed and rounded to bf16, divided in bf16
    sim_err = u_bf16 * sims.abs() + 1.01 * dim * u_fp32 * abs_products
    score_err = sim_err.amax(-1).sum(-1) * (1 + u_bf16) + u_bf16 * scores.abs()
    exact_logits = scores / loss.temperature
    library_err = (score_err / loss.temperature) * (1 + u_bf16) + u_bf16 * exact_logits.abs() * (1 + u_bf16)
    assert ((library_logits.double() - exact_logits).abs() <= library_err).all()
    assert not torch.equal(library_logits.double(), exact_logits)  # the library really rounds: not vacuous
