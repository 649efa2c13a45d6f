"""The PyPI project ``flash-maxsim`` uses this package's import name, ``flash_maxsim``.

Code written for that project asks this package for names it does not have (:data:`OTHER_PROJECT_NAMES`);
:func:`other_project_error` is the error ``flash_maxsim.__getattr__`` raises for them. PyLate >= 1.5.1 imports
some of them for its "flash" scoring backend whenever ``import flash_maxsim`` works: for PyLate the error is its
own ``FlashUnsupported`` (also an ``ImportError``), so that ``backend="auto"`` falls back to PyLate's next backend
with one warning.
"""

from __future__ import annotations

import sys
import warnings

# the public functions of `flash-maxsim` 0.3.0
OTHER_PROJECT_NAMES = frozenset({
    "flash_maxsim", "flash_maxsim_batched", "flash_maxsim_train", "flash_maxsim_pairs",
    "flash_maxsim_batched_train", "flash_maxsim_varlen", "pack_pairs", "flash_maxsim_packed", "pack_docs",
    "flash_maxsim_pairs_dense", "flash_maxsim_rerank", "flash_maxsim_rerank_direct", "flash_maxsim_rerank_padded",
    "flash_maxsim_int8", "flash_maxsim_int8x8", "flash_maxsim_int8_symmetric", "quantize_int8",
    "dequantize_int8", "quantize_int8_symmetric", "quantize_query_int8", "flash_maxsim_persistent",
    "flash_maxsim_topk", "flash_maxsim_qreuse", "flash_maxsim_splitk",
})

_PYLATE_MESSAGE = (
    "PyLate's scoring backend 'flash' imports the PyPI project `flash-maxsim`, but the `flash_maxsim` installed "
    "here is flash-maxsim-kernels (the same import name), which does not have `{name}`. With backend='auto' "
    "PyLate falls back to its next backend (late-interaction-kernels if installed, else its torch path). To "
    "score with flash_maxsim, call flash_maxsim.integrations.pylate.enable() or pass its scorer objects; to "
    "choose PyLate's torch path outright, set PYLATE_SCORES_BACKEND=torch. PyLate's flash backend now counts as "
    "not installed for this process.")
_fallback_classes: dict = {}
_fallback_warned = False


def other_project_error(name: str, caller: str) -> Exception:
    """The error for ``flash_maxsim.<name>``, one of :data:`OTHER_PROJECT_NAMES`, asked for by the module named
    ``caller``: PyLate's fallback exception (:func:`pylate_fallback`) for PyLate, an AttributeError that says
    which project ``name`` belongs to for anyone else."""
    if caller == "pylate" or caller.startswith("pylate."):
        # PyLate's backend="auto" would crash on the missing name; hand it the exception it falls back on (the
        # warning points at the caller of PyLate's importing function, past this frame and __getattr__'s)
        return pylate_fallback(name, stacklevel=5)
    return AttributeError(
        f"module 'flash_maxsim' has no attribute {name!r}: {name} belongs to the PyPI project `flash-maxsim`, "
        "which uses the same import name. This `flash_maxsim` is flash-maxsim-kernels: score with "
        "flash_maxsim.maxsim (README, 'Name clash')")


def pylate_fallback(name: str, stacklevel: int = 2) -> ImportError:
    """The error for PyLate's ``from flash_maxsim import <the other project's function>`` (PyLate >= 1.5.1, not
    enabled): an ImportError that is also PyLate's ``FlashUnsupported``, the one exception its ``backend="auto"``
    falls back on (``backend="flash"`` re-raises it). Warns once per process (``stacklevel`` as in
    ``warnings.warn``, counted from this function), and sets PyLate's record of the flash backend's availability
    to False, so that PyLate skips that backend from then on."""
    global _fallback_warned
    message = _PYLATE_MESSAGE.format(name=name)
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
    flash_backend = sys.modules.get("pylate.scores._flash_backend")
    if getattr(flash_backend, "_IMPORT_OK", None) is True:
        # PyLate's own cache of "flash-maxsim is importable", which it got wrong: corrected, later calls skip its
        # flash backend instead of converting masks to lengths on every call before falling back here
        flash_backend._IMPORT_OK = False
    unsupported = getattr(flash_backend, "FlashUnsupported", None)
    if not (isinstance(unsupported, type) and issubclass(unsupported, Exception)):
        return ImportError(message, name=name)
    cls = _fallback_classes.get(unsupported)
    if cls is None:
        cls = type("NotTheFlashMaxsimProject", (unsupported, ImportError), {"__module__": __name__})
        _fallback_classes[unsupported] = cls
    return cls(message, name=name)
