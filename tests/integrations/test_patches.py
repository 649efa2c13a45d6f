"""The patch mechanism every integration shares, on a fake toolkit (no toolkit needed): exact restoration,
thread safety of enable()/disable()/enabled(), FLASH_MAXSIM_DISABLE, the install hint of a missing toolkit, and
the check of a caller's packed offsets."""

from __future__ import annotations

import copy
import importlib
import sys
import threading
import types

import pytest
import torch

import flash_maxsim
from flash_maxsim.integrations import _inputs, _quantized
from flash_maxsim.integrations._patches import Integration, disabled_by_environment

TOOLKIT = "fake_toolkit_for_patches"


def _original_score(x):
    return "toolkit"


def _flash_score(x):
    return "flash"


class _Model:
    def similarity(self):
        return "toolkit"


def _flash_similarity(self):
    return "flash"


@pytest.fixture
def toolkit(monkeypatch):
    """A toolkit package holding ``score``, a submodule that imported it by name, and a model class."""
    package = types.ModuleType(TOOLKIT)
    package.score = _original_score
    package.Model = _Model
    losses = types.ModuleType(f"{TOOLKIT}.losses")
    losses.score = _original_score
    losses.renamed = _original_score
    monkeypatch.setitem(sys.modules, TOOLKIT, package)
    monkeypatch.setitem(sys.modules, f"{TOOLKIT}.losses", losses)
    monkeypatch.delitem(sys.modules, f"{TOOLKIT}.late", raising=False)
    monkeypatch.delenv("FLASH_MAXSIM_DISABLE", raising=False)
    yield package
    assert _Model.__dict__["similarity"] is _ORIGINAL_SIMILARITY


_ORIGINAL_SIMILARITY = _Model.__dict__["similarity"]


def _install(patches):
    patches.patch_aliases(_original_score, _flash_score, (TOOLKIT,))
    patches.patch(_Model, "similarity", _flash_similarity)


def _installed():
    """How many of the toolkit's names and methods are flash_maxsim's now."""
    count = sum(value is _flash_score for name, module in list(sys.modules.items()) if name.startswith(TOOLKIT)
                for value in vars(module).values())
    return count + (_Model.__dict__["similarity"] is _flash_similarity)


@pytest.fixture
def integration(toolkit):
    created = Integration("fake toolkit", _install)
    yield created
    created.disable()


def test_enable_patches_every_alias_and_disable_restores_them(toolkit, integration):
    assert integration.enable() is True and integration.is_enabled()
    assert _installed() == 4 and _Model().similarity() == "flash"
    assert integration.enable() is True and _installed() == 4            # idempotent
    integration.disable()
    assert not integration.is_enabled() and _installed() == 0
    assert sys.modules[f"{TOOLKIT}.losses"].renamed is _original_score


def test_disable_restores_copies_made_by_modules_imported_while_enabled(toolkit, integration):
    integration.enable()
    late = types.ModuleType(f"{TOOLKIT}.late")
    late.score = toolkit.score                       # `from toolkit import score` after enable()
    sys.modules[late.__name__] = late
    integration.disable()
    assert late.score is _original_score and _installed() == 0


def test_disable_with_nothing_enabled_is_harmless(integration):
    integration.disable()
    integration.disable()
    assert not integration.is_enabled() and _installed() == 0


@pytest.mark.parametrize("seed", range(4))
def test_toggling_from_many_threads_leaves_a_consistent_state(integration, toggle_from_threads, seed):
    """8 threads calling enable/disable/is_enabled/enabled at random: no exception, is_enabled() agrees with what
    is installed, and disable() leaves nothing installed."""
    for round_ in range(3):
        toggle_from_threads(integration, seed=seed * 10 + round_)
        assert _installed() == (4 if integration.is_enabled() else 0)
    integration.disable()
    assert _installed() == 0


def test_enabled_blocks_overlapping_in_threads_keep_it_enabled_until_the_last_ends(integration):
    inside, leave_first, first_left = threading.Event(), threading.Event(), threading.Event()

    def first():
        with integration.enabled():
            inside.set()
            leave_first.wait(10)
        first_left.set()

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    with integration.enabled():
        leave_first.set()
        first_left.wait(10)
        assert integration.is_enabled() and _installed() == 4
    thread.join()
    assert not integration.is_enabled() and _installed() == 0
    integration.enable()
    with integration.enabled():
        pass
    assert integration.is_enabled()                 # enabled before the block: left enabled


def test_a_failing_install_leaves_nothing_patched(toolkit):
    def install(patches):
        _install(patches)
        raise RuntimeError("toolkit too old")

    failing = Integration("fake toolkit", install)
    with pytest.raises(RuntimeError, match="too old"):
        failing.enable()
    assert not failing.is_enabled() and _installed() == 0


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "True"])
def test_flash_maxsim_disable_values_that_disable(monkeypatch, integration, value):
    monkeypatch.setenv("FLASH_MAXSIM_DISABLE", value)
    assert disabled_by_environment()
    with pytest.warns(UserWarning, match="FLASH_MAXSIM_DISABLE"):
        assert integration.enable() is False
    assert integration.enable() is False            # warned once
    with integration.enabled():
        assert not integration.is_enabled()
    assert _installed() == 0


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off", " OFF "])
def test_flash_maxsim_disable_values_that_do_not_disable(monkeypatch, integration, value):
    monkeypatch.setenv("FLASH_MAXSIM_DISABLE", value)
    assert not disabled_by_environment()
    assert integration.enable() is True and _installed() == 4


@pytest.mark.parametrize("value", ["2", "disable", "offf", "y"])
def test_flash_maxsim_disable_other_values_are_refused(monkeypatch, integration, value):
    monkeypatch.setenv("FLASH_MAXSIM_DISABLE", value)
    with pytest.raises(ValueError, match="FLASH_MAXSIM_DISABLE"):
        integration.enable()
    assert not integration.is_enabled() and _installed() == 0


@pytest.mark.parametrize("integration_name, toolkit_module, extra", [
    ("pylate", "pylate", "pylate"),
    ("sentence_transformers", "sentence_transformers", "sentence-transformers"),
    ("colpali", "colpali_engine", "colpali"),
])
def test_a_missing_toolkit_is_an_import_error_with_the_install_command(monkeypatch, integration_name,
                                                                       toolkit_module, extra):
    monkeypatch.delenv("FLASH_MAXSIM_DISABLE", raising=False)
    module = importlib.import_module(f"flash_maxsim.integrations.{integration_name}")
    for name in [n for n in sys.modules if n == toolkit_module or n.startswith(toolkit_module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, toolkit_module, None)
    with pytest.raises(ImportError, match=rf'pip install "flash-maxsim-kernels\[{extra}\]"'):
        module.enable()
    assert not module.is_enabled()


def _packed_index():
    return flash_maxsim.quantize([torch.randn(3, 8), torch.randn(5, 8), torch.randn(2, 8)])


@pytest.mark.parametrize("offsets, message", [
    ([1, 3, 8, 10], "start at 0"),
    ([0, 5, 3, 10], "decrease at document 1"),
    ([0, 3, 8, 200], "end at 200 but the index holds 10"),
    ([0, 3, 8], "end at 8 but the index holds 10"),
    ([[0, 3, 8, 10]], "1-D integer"),
    ([0.0, 3.0, 8.0, 10.0], "1-D integer"),
])
def test_a_callers_packed_offsets_are_checked_before_use(offsets, message):
    index = copy.copy(_packed_index())
    index.offsets = torch.tensor(offsets)
    with pytest.raises(ValueError, match=rf"`ps` offsets .*{message}"):
        _quantized.document_bounds(index, "ps")


def test_valid_packed_offsets_give_the_documents_bounds_and_lengths():
    assert _quantized.document_bounds(_packed_index(), "ps") == ([0, 3, 8, 10], [3, 5, 2])
    assert _inputs.packed_bounds(torch.tensor([0, 0, 4]), 4, "x") == [0, 0, 4]
