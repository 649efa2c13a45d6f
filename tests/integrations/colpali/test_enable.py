"""enable() / disable() / is_enabled() / enabled(): what is patched per version, exact restoration, idempotence,
FLASH_MAXSIM_DISABLE, the log line, nothing at import, version gating, and that flash_maxsim really computes every
loss after enable() (no silent fallback to the library's einsum)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from colpali_engine.loss import late_interaction_losses as losses
from colpali_engine.utils import processing_utils
from flash_maxsim.integrations import colpali as flash_colpali

from colpali_cases import changed, loss_batch, optional_import, snapshot_library

LOSSES = ("ColbertLoss", "ColbertPairwiseCELoss", "ColbertSigmoidLoss", "ColbertNegativeCELoss",
          "ColbertPairwiseNegativeCELoss")


def _expected_targets(has_dispatch):
    base = {("BaseVisualRetrieverProcessor", "score_multi_vector")}
    if not has_dispatch:
        return base | {(name, "forward") for name in LOSSES}
    aliases = {(module, name) for module in ("colpali_engine.utils.maxsim",
                                             "colpali_engine.loss.late_interaction_losses")
               for name in ("maxsim_inbatch", "maxsim_kd")}
    aliases.add(("colpali_engine.utils.processing_utils", "maxsim_inbatch"))
    return base | aliases | {("ColbertModule", "_inbatch_scores"), ("ColbertNegativeCELoss", "forward"),
                             ("ColbertPairwiseNegativeCELoss", "forward")}


def test_enable_patches_exactly_the_expected_objects_and_disable_restores_them(has_dispatch):
    optional_import("colpali_engine.utils.maxsim")
    before = snapshot_library()
    assert not flash_colpali.is_enabled()
    assert flash_colpali.enable() is True
    assert flash_colpali.is_enabled()
    during = snapshot_library()
    assert changed(before, during) == _expected_targets(has_dispatch)
    assert flash_colpali.enable() is True                     # a second enable() changes nothing
    assert all(during[k] is v for k, v in snapshot_library().items())
    flash_colpali.disable()
    assert not flash_colpali.is_enabled()
    assert changed(before, snapshot_library()) == set()       # the very objects that were there
    flash_colpali.disable()                                   # harmless when not enabled
    # the restored staticmethod still works as one
    qs, ps = [torch.randn(2, 4)], [torch.randn(3, 4)]
    assert processing_utils.BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cpu").shape == (1, 1)


def test_disable_restores_names_copied_by_modules_imported_while_enabled(has_dispatch, monkeypatch):
    if not has_dispatch:
        pytest.skip("colpali-engine < 0.3.17 has no module-level MaxSim functions to import by name")
    from colpali_engine.utils import maxsim as dispatch

    originals = dispatch.maxsim_inbatch, dispatch.maxsim_kd
    flash_colpali.enable()
    late = types.ModuleType("colpali_engine.imported_while_enabled")
    exec("from colpali_engine.utils.maxsim import maxsim_inbatch, maxsim_kd", late.__dict__)
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert late.maxsim_inbatch is flash_colpali._maxsim_inbatch
    flash_colpali.disable()
    assert (late.maxsim_inbatch, late.maxsim_kd) == originals


@pytest.mark.parametrize("seed", range(2))
def test_toggling_from_many_threads_leaves_a_consistent_state(toggle_from_threads, seed):
    """8 threads calling enable/disable/is_enabled/enabled at random: no exception, is_enabled() agrees with
    whether any patch is installed, and disable() restores every object."""
    flash_colpali.enable()                                    # loads every module enable() imports
    flash_colpali.disable()
    before = snapshot_library()
    toggle_from_threads(flash_colpali, seed=seed)
    assert bool(changed(before, snapshot_library())) == flash_colpali.is_enabled()
    flash_colpali.disable()
    assert changed(before, snapshot_library()) == set()


def test_enabled_context_manager_restores_the_previous_state():
    before = snapshot_library()
    with flash_colpali.enabled():
        assert flash_colpali.is_enabled()
        with flash_colpali.enabled():
            assert flash_colpali.is_enabled()
        assert flash_colpali.is_enabled()                     # the inner block found it enabled: left so
    assert not flash_colpali.is_enabled()
    assert changed(before, snapshot_library()) == set()
    flash_colpali.enable()
    with flash_colpali.enabled():
        pass
    assert flash_colpali.is_enabled()


def test_one_info_line_names_what_was_patched(caplog, has_dispatch):
    with caplog.at_level(logging.INFO, logger="flash_maxsim"):
        flash_colpali.enable()
        flash_colpali.enable()
    records = [r for r in caplog.records if r.name == "flash_maxsim" and r.levelno == logging.INFO]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "colpali-engine" in message and "BaseVisualRetrieverProcessor.score_multi_vector" in message
    assert ("ColbertModule._inbatch_scores" in message) == has_dispatch
    assert "ColbertNegativeCELoss.forward" in message


def test_flash_maxsim_disable_makes_enable_a_no_op(enable_under_disable_variable, calls, generator):
    before = snapshot_library()
    enable_under_disable_variable(flash_colpali)
    assert changed(before, snapshot_library()) == set()
    batch = loss_batch(generator)
    losses.ColbertLoss()(*[batch.padded(batch.leaves())[k] for k in ("q", "d")])
    assert calls.flash == 0 and calls.library_einsum > 0


def test_nothing_happens_at_import():
    """Importing the integration imports no colpali_engine module (so it cannot patch one) and logs nothing."""
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.DEBUG)
        import flash_maxsim.integrations.colpali as integration
        assert not integration.is_enabled()
        print(sorted(m for m in sys.modules if m.startswith("colpali_engine")))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert "flash_maxsim" not in result.stderr


def test_too_old_a_release_is_refused_and_nothing_stays_patched(monkeypatch):
    monkeypatch.setattr(flash_colpali, "_version", lambda: (0, 3, 13))
    before = snapshot_library()
    with pytest.raises(RuntimeError, match=r"supports colpali-engine 0\.3\.14 to 0\.3\.18; found 0\.3\.13"):
        flash_colpali.enable()
    assert not flash_colpali.is_enabled()
    assert changed(before, snapshot_library()) == set()


def test_a_newer_release_is_patched_with_a_warning(monkeypatch):
    monkeypatch.setattr(flash_colpali, "_version", lambda: (0, 3, 19))
    with pytest.warns(UserWarning, match=r"tested with colpali-engine up to .*0\.3\.18.*found 0\.3\.19"):
        assert flash_colpali.enable() is True


def test_missing_colpali_engine_is_an_import_error_with_the_install_command(monkeypatch):
    for name in [n for n in sys.modules if n.startswith("colpali_engine")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r'needs colpali-engine: pip install "flash-maxsim-kernels\[colpali\]"'):
        flash_colpali.enable()
    assert not flash_colpali.is_enabled()


def test_the_running_version_is_a_supported_one(library_version):
    assert library_version is not None
    assert flash_colpali.SUPPORTED[0] <= library_version <= flash_colpali.SUPPORTED[1]


# the number of flash_maxsim.maxsim calls per loss call: in-batch scores, or positives + negatives (+ in-batch)
FLASH_CALLS = {"ColbertLoss": 1, "ColbertPairwiseCELoss": 1, "ColbertSigmoidLoss": 1,
               "ColbertNegativeCELoss": 3, "ColbertPairwiseNegativeCELoss": 3}


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("smooth", [False, True], ids=["hard", "smooth"])
def test_flash_maxsim_computes_every_loss_after_enable(name, smooth, calls, generator):
    """After enable() every MaxSim of every loss reaches flash_maxsim and colpali-engine computes no einsum of
    its own; before, it is the other way round (so the counters can see both)."""
    batch = loss_batch(generator, negatives=2 if "Negative" in name else 0)
    args = [batch.padded(batch.leaves())[k] for k in batch.raw]
    loss = getattr(losses, name)(use_smooth_max=smooth)
    loss(*args).backward()
    assert calls.flash == 0 and calls.library_einsum > 0
    calls.reset()
    with flash_colpali.enabled():
        value = loss(*[a.detach().requires_grad_() for a in args])
        value.backward()
    assert calls.flash == FLASH_CALLS[name] and calls.library_einsum == 0
    assert calls.flash_dtypes == [torch.float32] * FLASH_CALLS[name]


def test_losses_built_before_enable_are_patched_too(calls, generator):
    """ColModelTrainingConfig builds its default ColbertLoss at import: enable() patches classes, not instances."""
    loss = losses.ColbertNegativeCELoss(use_smooth_max=True)
    flash_colpali.enable()
    batch = loss_batch(generator, negatives=1)
    loss(*[batch.padded(batch.leaves())[k] for k in batch.raw])
    assert calls.flash == 3


@pytest.mark.parametrize("name", ["ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss"])
def test_negatives_of_the_wrong_rank_are_refused_as_by_the_library(name):
    """The library's einsum needs negatives [B, N, Ld, d]; a 3-D tensor must not read as all-pairs documents and
    return a loss after enable()."""
    g = torch.Generator().manual_seed(5)
    q, d, neg = (torch.randn(4, n, 16, generator=g) for n in (6, 9, 7))
    loss = getattr(losses, name)()
    with pytest.raises(RuntimeError):
        loss(q, d, neg)
    with flash_colpali.enabled(), pytest.raises(ValueError, match="`neg_doc_embeddings` has shape"):
        loss(q, d, neg)
