"""Fixtures shared by every integration's tests (no toolkit imported here)."""

from __future__ import annotations

import random
import sys
import threading

import pytest


def _toggle_from_threads(integration, *, threads: int = 8, operations: int = 25, seed: int = 0) -> None:
    """Call ``enable()``, ``disable()``, ``is_enabled()`` and ``enabled()`` blocks of ``integration`` (a module or
    an Integration) in a random order from ``threads`` threads at once, the interpreter switching threads every
    microsecond; re-raises the first exception a thread raised."""
    errors = []
    start = threading.Barrier(threads)

    def work(rng: random.Random) -> None:
        try:
            start.wait()
            for _ in range(operations):
                choice = rng.randrange(4)
                if choice == 0:
                    integration.enable()
                elif choice == 1:
                    integration.disable()
                elif choice == 2:
                    integration.is_enabled()
                else:
                    with integration.enabled():
                        integration.is_enabled()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=work, args=(random.Random(seed * 1000 + i),)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]


@pytest.fixture
def toggle_from_threads():
    """The function ``(integration, *, threads=8, operations=25, seed=0) -> None`` that toggles an integration
    from many threads at once (see ``_toggle_from_threads``)."""
    return _toggle_from_threads


@pytest.fixture
def enable_under_disable_variable(monkeypatch):
    """The function ``(integration module) -> None`` that sets ``FLASH_MAXSIM_DISABLE=1`` and checks that
    ``enable()`` then warns, returns False and leaves the integration disabled."""

    def check(module) -> None:
        monkeypatch.setenv("FLASH_MAXSIM_DISABLE", "1")
        monkeypatch.setattr(module.enable.__self__, "_warned_env", False)      # the warning comes once
        with pytest.warns(UserWarning, match="FLASH_MAXSIM_DISABLE"):
            assert module.enable() is False
        assert not module.is_enabled()

    return check
