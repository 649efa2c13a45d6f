"""Memory of the GPU path's training step, without a GPU (tools/offline_memory.py: the CUDA host code runs with the
kernels not run, every allocation tracked): the peak of a step is its outputs (scores, both gradients) plus the
saved per-(query, document, query token) state plus the loss's own [Nq, C] temporaries, and nothing grows with
Nq * B * Lq * Ld."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offline_memory import MiB, TRAINING_STEPS, TrainingStep, peak_above_inputs  # noqa: E402


def _binned_dd_scratch(step: TrainingStep, forced=False) -> int:
    """Bytes of the binned hard-max dD's scratch (each document's entry ids grouped by block of tokens, int16), or 0
    where the step takes the dense dD: the smooth max, where tuning's default_dd_method picks the dense one (unless
    ``forced``), more entries per document than a program holds."""
    from flash_maxsim.kernels import tuning
    entries = step.Lq if step.kd else step.Nq * step.Lq
    e_pow2 = tuning.pow2(max(entries, 16))
    n_docs = step.Nq * step.B if step.kd else step.B
    default = tuning.default_dd_method(step.Ld, entries)
    if step.smooth_tau is not None or e_pow2 > tuning.BINNED_DD_MAX_ENTRIES or not (forced or default == "binned"):
        return 0
    return n_docs * e_pow2 * 2


def _expected_mib(step: TrainingStep, elem=2, forced_binned=False):
    """Two launches of the backward, dQ's then dD's, peak at the larger phase: dQ's with its fp32 column-split
    partial sums (at most max(8 MiB, the fp32 dQ), and their sum; none up to 64 columns), dD's with the documents'
    gradient and dQ done (and the binned dD's scratch). The hard max with the dense dD: one launch for both, the
    partial sums (above 256 columns only) beside the documents' gradient."""
    C = step.B
    n_docs = step.Nq * step.B if step.kd else step.B
    scores, loss_temporaries = step.Nq * C * 4, 3 * step.Nq * C * 4 + 4096
    saved = step.Nq * C * step.Lq * (4 if step.smooth_tau is not None else 2)      # int16 arg-max / fp32 lse
    dq, dq_fp32 = step.Nq * step.Lq * step.d * elem, step.Nq * step.Lq * step.d * 4
    dd = n_docs * step.Ld * step.d * elem
    scratch = _binned_dd_scratch(step, forced_binned)
    if step.smooth_tau is None and not scratch:
        partials = max(8 * MiB, dq_fp32) + dq_fp32 if C > 256 else 0
        return (scores + loss_temporaries + saved + partials + dq + dd) / MiB
    partials = max(8 * MiB, dq_fp32) + dq_fp32 if C > 64 else 0
    dq_phase = scores + loss_temporaries + saved + partials + dq
    dd_phase = scores + loss_temporaries + saved + dq + dd + scratch
    return max(dq_phase, dd_phase) / MiB


def test_tracker_counts_what_is_alive_at_the_peak():
    def fn():
        a = torch.empty(3 * MiB, dtype=torch.uint8)
        b = torch.empty(5 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(1 * MiB, dtype=torch.uint8)
        view = b[: MiB]                               # a view allocates nothing
        return b, c, view
    peak, live = peak_above_inputs(fn, ())
    assert peak == pytest.approx(8.0)
    assert sorted(entry[-1] for entry in live) == [3.0, 5.0]


@pytest.mark.parametrize("step", TRAINING_STEPS, ids=lambda s: s.name.split(",")[0])
def test_training_step_peak_is_outputs_plus_saved_state(step):
    fn, inputs = step.build()
    peak, live = peak_above_inputs(fn, inputs)
    assert peak <= _expected_mib(step), live
    # the peak is reached while the documents' gradient exists: it is the step's largest allocation
    n_docs = step.Nq * step.B if step.kd else step.B
    assert peak >= n_docs * step.Ld * step.d * 2 / MiB


@pytest.mark.parametrize("smooth_tau", [None, 0.1])
def test_nothing_grows_with_query_tokens_times_document_tokens(smooth_tau):
    """Doubling Ld adds exactly the documents' gradient; doubling Lq adds the queries' gradient and the saved
    state; doubling both adds their sum, not a term in Lq * Ld. (Documents long enough for the peak to be in
    the dD phase in all four.)"""
    def peak(Lq, Ld):
        fn, inputs = TrainingStep("in-batch", 16, 16, Lq, Ld, 64, smooth_tau=smooth_tau).build()
        return peak_above_inputs(fn, inputs)[0]
    def scratch(Lq, Ld):     # the binned dD's (hard max): grows with Nq * Lq, not with Ld
        return _binned_dd_scratch(TrainingStep("in-batch", 16, 16, Lq, Ld, 64, smooth_tau=smooth_tau)) / MiB
    base = peak(32, 3000)
    more_ld = peak(32, 6000) - base
    more_lq = peak(64, 3000) - base
    both = peak(64, 6000) - base
    assert more_ld == pytest.approx(16 * 3000 * 64 * 2 / MiB + scratch(32, 6000) - scratch(32, 3000), abs=1e-3)
    assert more_lq == pytest.approx(16 * 32 * 64 * 2 / MiB + 16 * 16 * 32 * (2 if smooth_tau is None else 4) / MiB
                                    + scratch(64, 3000) - scratch(32, 3000), abs=1e-3)
    assert both == pytest.approx(more_ld + more_lq, abs=1e-3)


@pytest.mark.parametrize("step", [s for s in TRAINING_STEPS if s.smooth_tau is None],
                         ids=lambda s: s.name.split(",")[0])
def test_binned_document_gradient_adds_only_its_scratch(step, monkeypatch):
    """The binned hard-max dD (DD_METHOD="binned": dQ and dD in two launches) peaks at the larger of the two
    launches' phases, the dD phase holding the documents' gradient, dQ and each document's entry ids grouped by
    block (int16): ColPali B256 4 MiB more than its outputs and saved state."""
    from flash_maxsim.kernels import tuning
    monkeypatch.setitem(tuning.BACKWARD_OVERRIDES, "DD_METHOD", "binned")
    fn, inputs = step.build()
    peak, live = peak_above_inputs(fn, inputs)
    n_docs = step.Nq * step.B if step.kd else step.B
    assert peak <= _expected_mib(step, forced_binned=True), live
    assert peak >= (n_docs * step.Ld * step.d * 2 + _binned_dd_scratch(step, forced=True)) / MiB
