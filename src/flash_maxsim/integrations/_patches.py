"""The one reusable monkey-patch mechanism behind every integration's ``enable()`` / ``disable()``.

A :class:`PatchSet` records each replacement it makes (attribute, function default, or every module-level
alias of a function) and undoes them in reverse order, restoring the very objects that were there. An
:class:`Integration` wraps a PatchSet with the user-facing behaviour the integrations share:

- ``enable()`` patches (idempotent: a second call does nothing), logs one INFO line naming what it patched;
- ``disable()`` restores the originals exactly, also where a toolkit module imported while enabled copied a
  replaced function by name (``from x import f``); harmless when nothing is enabled;
- ``is_enabled()``; ``enabled()`` as a context manager;
- thread safety: one lock per integration serialises ``enable()``, ``disable()`` and the entry and exit of
  ``enabled()`` blocks, so that toggling from several threads at once leaves either every patch installed or
  none, as ``is_enabled()`` says. ``is_enabled()`` does not wait: it reports the last completed
  ``enable()`` / ``disable()``;
- the environment variable ``FLASH_MAXSIM_DISABLE``: ``1``, ``true``, ``yes`` or ``on`` (any case) makes
  ``enable()`` a no-op that returns False (one warning per integration); ``0``, ``false``, ``no``, ``off`` or
  empty leave it working; any other value makes ``enable()`` raise ValueError naming the variable;
- nothing happens at import.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator, List, Tuple

logger = logging.getLogger("flash_maxsim")

_MISSING = object()

DISABLE_VARIABLE = "FLASH_MAXSIM_DISABLE"
_DISABLING = ("1", "true", "yes", "on")
_NOT_DISABLING = ("", "0", "false", "no", "off")


def disabled_by_environment() -> bool:
    """Whether ``FLASH_MAXSIM_DISABLE`` turns the integrations off (see the module notes for its values)."""
    raw = os.environ.get(DISABLE_VARIABLE)
    value = "" if raw is None else raw.strip().lower()
    if value in _DISABLING:
        return True
    if value in _NOT_DISABLING:
        return False
    raise ValueError(f"{DISABLE_VARIABLE}={raw!r} is not understood: set it to one of "
                     f"{', '.join(_DISABLING)} to disable flash_maxsim's integrations, or to one of "
                     f"{', '.join(repr(v) for v in _NOT_DISABLING)} (or unset it) to leave them enabled")


def import_toolkit(module: str, toolkit: str, extra: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError that says how to install the toolkit."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"flash_maxsim's {toolkit} integration needs {toolkit}: "
                          f'pip install "flash-maxsim-kernels[{extra}]" (importing {module} failed: {error})'
                          ) from error


def _modules(prefixes: Tuple[str, ...]) -> Iterator[Tuple[str, Any]]:
    """The loaded modules whose names start with one of ``prefixes``, with their namespaces."""
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) if module is not None else None
        if namespace is not None and name.startswith(prefixes):
            yield module, namespace


class PatchSet:
    """Reversible replacements. Each ``patch*`` call returns the original object it replaced."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []
        self._aliases: List[Tuple[Callable, Callable, Tuple[str, ...]]] = []
        self.targets: List[str] = []

    def __len__(self) -> int:
        return len(self._undo)

    def patch(self, owner: Any, name: str, replacement: Any) -> Any:
        """Set ``owner.name = replacement``; restore puts back the original (or deletes the attribute when it
        was only inherited, so that a class keeps resolving it from its base)."""
        own = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        original = getattr(owner, name)
        setattr(owner, name, replacement)

        def undo():
            if own is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

        self._undo.append(undo)
        self.targets.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
        return original

    def patch_aliases(self, original: Callable, replacement: Callable, module_prefixes: Tuple[str, ...]) -> int:
        """Replace every module-level name bound to ``original`` in loaded modules under ``module_prefixes``
        (code that did ``from x import f`` holds its own reference). Returns how many were replaced.
        :meth:`restore` also puts ``original`` back where a module loaded later copied ``replacement``."""
        count = 0
        for module, namespace in _modules(module_prefixes):
            for attr, value in list(namespace.items()):
                if value is original:
                    self.patch(module, attr, replacement)
                    count += 1
        self._aliases.append((original, replacement, module_prefixes))
        return count

    def patch_default(self, function: Callable, parameter: str, replacement: Any) -> Any:
        """Replace the default value of ``parameter`` (bound when ``function`` was defined)."""
        function = inspect.unwrap(function)
        params = list(inspect.signature(function).parameters.values())
        kw = function.__kwdefaults__ or {}
        if parameter in kw:
            original = kw[parameter]
            new_kw = dict(kw)
            new_kw[parameter] = replacement
            function.__kwdefaults__ = new_kw

            def undo():
                function.__kwdefaults__ = kw
        else:
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            defaults = function.__defaults__ or ()
            with_default = positional[len(positional) - len(defaults):]
            names = [p.name for p in with_default]
            if parameter not in names:
                raise ValueError(f"{function.__qualname__} has no default for parameter {parameter!r}")
            i = names.index(parameter)
            original = defaults[i]
            function.__defaults__ = defaults[:i] + (replacement,) + defaults[i + 1:]

            def undo():
                function.__defaults__ = defaults

        self._undo.append(undo)
        self.targets.append(f"{function.__qualname__}({parameter}=...)")
        return original

    def restore(self) -> None:
        """Undo every replacement, newest first."""
        # copies of a replacement in modules imported while patched are in no undo record: found by identity
        for original, replacement, prefixes in self._aliases:
            for module, namespace in _modules(prefixes):
                for attr, value in list(namespace.items()):
                    if value is replacement:
                        setattr(module, attr, original)
        self._aliases.clear()
        while self._undo:
            self._undo.pop()()
        self.targets.clear()


class Integration:
    """enable/disable/is_enabled/enabled for one toolkit. ``install(patches)`` makes the replacements; it may
    raise ImportError when the toolkit is absent (:func:`import_toolkit`)."""

    def __init__(self, toolkit: str, install: Callable[[PatchSet], None]) -> None:
        self.toolkit = toolkit
        self._install = install
        self._patches: PatchSet | None = None
        self._warned_env = False
        # reentrant: an enabled() block enables under the lock it holds
        self._lock = threading.RLock()
        self._open_blocks = 0                  # enabled() blocks entered and not yet left, in any thread
        self._disable_after_blocks = False     # whether it was disabled when the first open block began

    def enable(self) -> bool:
        """Route the toolkit's MaxSim through flash_maxsim. Returns whether it is enabled afterwards."""
        with self._lock:
            if self._patches is not None:
                return True
            if disabled_by_environment():
                if not self._warned_env:
                    warnings.warn(f"{DISABLE_VARIABLE} is set: flash_maxsim does not patch {self.toolkit}",
                                  stacklevel=3)
                    self._warned_env = True
                return False
            patches = PatchSet()
            try:
                self._install(patches)
            except BaseException:
                patches.restore()
                raise
            self._patches = patches
        logger.info("flash_maxsim: %s now scores with flash_maxsim (patched %d: %s)", self.toolkit,
                    len(patches), ", ".join(patches.targets))
        return True

    def disable(self) -> None:
        """Restore every original object. Harmless when not enabled."""
        with self._lock:
            if self._patches is None:
                return
            self._patches.restore()
            self._patches = None
        logger.info("flash_maxsim: %s restored to its own scoring", self.toolkit)

    def is_enabled(self) -> bool:
        return self._patches is not None

    @contextlib.contextmanager
    def enabled(self) -> Iterator[None]:
        """``with integration.enabled(): ...`` — enabled inside, the previous state restored after. Blocks that
        overlap (nested, or in several threads) keep it enabled until the last of them ends, which disables it
        again if it was disabled when the first of them began."""
        with self._lock:
            if self._open_blocks == 0:
                self._disable_after_blocks = self._patches is None
            self._open_blocks += 1
            try:
                self.enable()
            except BaseException:
                self._open_blocks -= 1
                raise
        try:
            yield
        finally:
            with self._lock:
                self._open_blocks -= 1
                if self._open_blocks == 0 and self._disable_after_blocks:
                    self.disable()
