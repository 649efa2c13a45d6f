"""The one reusable monkey-patch mechanism behind every integration's ``enable()`` / ``disable()``.

A :class:`PatchSet` records each replacement it makes (attribute, function default, or every module-level
alias of a function) and undoes them in reverse order, restoring the very objects that were there. An
:class:`Integration` wraps a PatchSet with the user-facing behaviour the integrations share:

- ``enable()`` patches (idempotent: a second call does nothing), logs one INFO line naming what it patched;
- ``disable()`` restores the originals exactly; ``is_enabled()``; ``enabled()`` as a context manager;
- ``FLASH_MAXSIM_DISABLE=1`` in the environment makes ``enable()`` a no-op (with one warning);
- nothing happens at import.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import warnings
from typing import Any, Callable, Iterator, List, Tuple

logger = logging.getLogger("flash_maxsim")

_MISSING = object()


def disabled_by_environment() -> bool:
    return os.environ.get("FLASH_MAXSIM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


class PatchSet:
    """Reversible replacements. Each ``patch*`` call returns the original object it replaced."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []
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
        (code that did ``from x import f`` holds its own reference). Returns how many were replaced."""
        count = 0
        for mod_name, module in list(sys.modules.items()):
            if module is None or not mod_name.startswith(module_prefixes):
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    self.patch(module, attr, replacement)
                    count += 1
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
        while self._undo:
            self._undo.pop()()
        self.targets.clear()


class Integration:
    """enable/disable/is_enabled/enabled for one toolkit. ``install(patches)`` makes the replacements; it may
    raise ImportError when the toolkit is absent."""

    def __init__(self, toolkit: str, install: Callable[[PatchSet], None]) -> None:
        self.toolkit = toolkit
        self._install = install
        self._patches: PatchSet | None = None
        self._warned_env = False

    def enable(self) -> bool:
        """Route the toolkit's MaxSim through flash_maxsim. Returns whether it is enabled afterwards."""
        if self._patches is not None:
            return True
        if disabled_by_environment():
            if not self._warned_env:
                warnings.warn(f"FLASH_MAXSIM_DISABLE is set: flash_maxsim does not patch {self.toolkit}",
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
        if self._patches is not None:
            self._patches.restore()
            self._patches = None
            logger.info("flash_maxsim: %s restored to its own scoring", self.toolkit)

    def is_enabled(self) -> bool:
        return self._patches is not None

    @contextlib.contextmanager
    def enabled(self) -> Iterator[None]:
        """``with integration.enabled(): ...`` — enabled inside, previous state restored after."""
        was = self.is_enabled()
        self.enable()
        try:
            yield
        finally:
            if not was:
                self.disable()
