"""The package's import structure: no import circle between its modules, the package root imports no
integration and no kernel, and the CPU path works where Triton is not installed."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flash_maxsim

PACKAGE_DIR = Path(flash_maxsim.__file__).parent
ROOT = "flash_maxsim"


def _module_files() -> dict:
    """Module name -> source file, for every module of the package."""
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, lazy: bool = False):
    """(imported module name or None, level, names, lazy) per import statement; ``lazy``: inside a function.
    Imports under ``if TYPE_CHECKING:`` run no code and are left out."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(ast.Module(body=node.orelse, type_ignores=[]), lazy)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, (), lazy
        elif isinstance(node, ast.ImportFrom):
            yield node.module, node.level, tuple(a.name for a in node.names), lazy
        yield from _imports(node, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _edges(name: str, path: Path):
    """(imported module of the package, lazy) for each import in module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for module, level, names, lazy in _imports(ast.parse(path.read_text(), str(path))):
        if level:
            base = package.split(".")
            base = base[:len(base) - (level - 1)]
            module = ".".join(base + ([module] if module else []))
        if not (module == ROOT or module.startswith(ROOT + ".")):
            continue
        targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        if len(targets) < len(names):          # some names are attributes of `module` itself
            targets.append(module)
        for target in targets:
            if target != name:
                yield target, lazy


def _graph(include_lazy: bool) -> dict:
    return {name: {t for t, lazy in _edges(name, path) if include_lazy or not lazy} for name, path in MODULES.items()}


def _cycle(graph: dict):
    """One import circle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_module_list_covers_the_layers():
    for name in ("flash_maxsim", "flash_maxsim._types", "flash_maxsim._layout", "flash_maxsim.ops",
                 "flash_maxsim.kernels.launch", "flash_maxsim.integrations.pylate"):
        assert name in MODULES, name


def test_no_import_circle_at_module_level():
    cycle = _cycle(_graph(include_lazy=False))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_import_circle_through_function_level_imports():
    """Imports inside functions count too: a circle closed by a deferred import is still a circle."""
    cycle = _cycle(_graph(include_lazy=True))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_package_root_imports_no_integration_and_no_kernel():
    """``import flash_maxsim`` (and anything it may import later) reaches no integration; at import time it
    reaches no kernel module, so that Triton loads only when a kernel is needed."""
    everything = _reachable(_graph(include_lazy=True), ROOT)
    assert not {m for m in everything if m.startswith(ROOT + ".integrations")}
    at_import = _reachable(_graph(include_lazy=False), ROOT)
    assert not {m for m in at_import if m.startswith(ROOT + ".kernels")}


def test_the_leaf_modules_import_nothing_of_the_package():
    graph = _graph(include_lazy=True)
    for leaf in ("flash_maxsim._types", "flash_maxsim._name_clash"):
        assert graph[leaf] == set(), (leaf, graph[leaf])


# A finder placed first on sys.meta_path: any import of triton fails as it does where triton is not installed.
_WITHOUT_TRITON = textwrap.dedent("""
    import sys

    class _NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTriton())
""")


def _run_without_triton(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent), environment.get("PYTHONPATH", "")])
    environment.update(env)
    return subprocess.run([sys.executable, "-c", _WITHOUT_TRITON + textwrap.dedent(code)], env=environment,
                          capture_output=True, text=True, timeout=300)


def test_the_cpu_path_runs_without_triton():
    """Without Triton: ``import flash_maxsim`` works, maxsim and its backward run on CPU tensors (padded, listed
    and quantized documents) and match the float64 reference; asking for the Triton backend names what is
    missing."""
    result = _run_without_triton("""
        import torch
        import flash_maxsim as fm
        from flash_maxsim import reference
        from flash_maxsim.ops import force_backend

        assert "triton" not in sys.modules
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 3, 8, generator=g, requires_grad=True)
        d = torch.randn(4, 5, 8, generator=g, requires_grad=True)
        mask = torch.rand(4, 5, generator=g) > 0.3
        for smooth_tau in (None, 0.5):
            got = fm.maxsim(q, d, documents_mask=mask, smooth_tau=smooth_tau)
            got_q, got_d = torch.autograd.grad(got.sum(), (q, d))
            want = reference.maxsim(q, d, documents_mask=mask, smooth_tau=smooth_tau)
            want_q, want_d = torch.autograd.grad(want.sum(), (q, d))
            for a, b in ((got, want), (got_q, want_q), (got_d, want_d)):
                torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
        listed = [d[0, :2], d[1]]
        torch.testing.assert_close(fm.maxsim(q, listed).double(), reference.maxsim(q, listed).double())
        index = fm.quantize(d.detach())
        assert fm.maxsim(q.detach(), index).shape == (2, 4)
        assert "triton" not in sys.modules
        try:
            with force_backend("triton"):
                pass
        except ImportError as error:
            assert "need Triton: pip install triton" in str(error), error
        else:
            raise AssertionError("the Triton backend was granted without Triton")
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_interpreter_asked_for_without_triton_names_what_is_missing():
    """TRITON_INTERPRET=1 asks for the kernels on CPU tensors: without Triton, scoring raises an ImportError that
    says how to install it."""
    result = _run_without_triton("""
        import torch
        import flash_maxsim as fm
        try:
            fm.maxsim(torch.randn(1, 2, 4), torch.randn(3, 2, 4))
        except ImportError as error:
            print(error)
    """, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    assert "need Triton: pip install triton" in result.stdout


def test_the_data_types_pickle_under_the_paths_that_export_them():
    """PackedDocuments and QuantizedDocuments live in the leaf module but pickle as ``flash_maxsim._layout`` and
    ``flash_maxsim.quantization`` objects, paths that hold them; their annotations resolve there."""
    import importlib
    import pickle
    import typing

    import torch

    packed = flash_maxsim.pack([torch.randn(2, 4), torch.randn(3, 4)])
    index = flash_maxsim.quantize(torch.randn(2, 3, 4))
    for obj, module, field in ((packed, "flash_maxsim._layout", "offsets"),
                               (index, "flash_maxsim.quantization", "scales")):
        cls = type(obj)
        assert cls.__module__ == module and getattr(importlib.import_module(module), cls.__name__) is cls
        assert typing.get_type_hints(cls)
        again = pickle.loads(pickle.dumps(obj))
        assert type(again) is cls
        assert torch.equal(again.values, obj.values) and torch.equal(getattr(again, field), getattr(obj, field))
