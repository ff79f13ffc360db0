"""The code's layout stays readable: imports go down the layers, no import
circle, no module too long to read. Read from the sources, not by importing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_PYTHON_LINES = 400
MAX_RUST_LINES = 600

# Each package may not import these, directly or lazily (a lazy import inside a
# function is an upward dependency all the same).
LOWER_LAYERS_DO_NOT_IMPORT = {
    "pyserve.model": ("pyserve.engine", "pyserve.http", "pyserve.api", "pyserve.files", "pyserve.batches",
                      "pyserve.asgi", "pyserve.cli"),
    "pyserve.lora": ("pyserve.engine", "pyserve.http", "pyserve.api", "pyserve.files", "pyserve.batches",
                     "pyserve.asgi", "pyserve.cli"),
    "pyserve.engine": ("pyserve.http", "pyserve.api", "pyserve.files", "pyserve.batches", "pyserve.asgi",
                       "pyserve.cli"),
    "pyserve.http": ("pyserve.model", "pyserve.engine", "pyserve.api", "pyserve.files", "pyserve.batches",
                     "pyserve.asgi", "pyserve.cli"),
    "pyserve.api.protocol": ("pyserve.api.generation", "pyserve.api.openai", "pyserve.api.native",
                             "pyserve.api.responses", "pyserve.api.app", "pyserve.engine", "pyserve.model"),
    "pyserve.api.generation": ("pyserve.api.openai", "pyserve.api.native", "pyserve.api.responses",
                               "pyserve.api.app", "pyserve.batches", "pyserve.asgi", "pyserve.cli"),
    "pyserve.api.openai": ("pyserve.api.app", "pyserve.batches", "pyserve.asgi", "pyserve.cli"),
    "pyserve.api.native": ("pyserve.api.app", "pyserve.batches", "pyserve.asgi", "pyserve.cli"),
    "pyserve.api.responses": ("pyserve.api.app", "pyserve.batches", "pyserve.asgi", "pyserve.cli"),
    "pyserve.files": ("pyserve.api", "pyserve.batches", "pyserve.engine", "pyserve.model", "pyserve.asgi",
                      "pyserve.cli"),
    "pyserve.batches": ("pyserve.api.app", "pyserve.asgi", "pyserve.cli"),
    "pyserve.api.app": ("pyserve.asgi", "pyserve.cli"),
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "pyserve").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of `name` (a module, or a name inside one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules imported when the module loads, all modules imported anywhere in it)."""
    tree = ast.parse(path.read_text())
    at_load = {id(node) for node in tree.body}
    eager, every = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("pyserve") and (owner := _owner(name)) is not None:
                every.add(owner)
                # `if TYPE_CHECKING:` blocks sit at the top but do not run.
                if id(node) in at_load:
                    eager.add(owner)
    return eager, every


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_module_imports_a_layer_above_it():
    upward = []
    for name, (_, every) in GRAPH.items():
        for package, above in LOWER_LAYERS_DO_NOT_IMPORT.items():
            if _within(name, package):
                upward += [f"{name} imports {dep}" for dep in sorted(every)
                           if any(_within(dep, layer) for layer in above)]
    assert upward == []


def test_no_import_circle():
    """Tarjan's strongly connected components over the imports made at load."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in GRAPH[node][0] - {node, "pyserve"}:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    assert circles == []


def test_the_package_root_imports_nothing_when_loaded():
    """`import pyserve._rust` (or any module) must not pull in the server above it."""
    assert GRAPH["pyserve"][0] == set()


@pytest.mark.parametrize("pattern, limit", [("pyserve/**/*.py", MAX_PYTHON_LINES), ("rust/**/*.rs", MAX_RUST_LINES)])
def test_no_module_is_too_long_to_read(pattern, limit):
    long = {str(p.relative_to(ROOT)): n for p in ROOT.glob(pattern)
            if (n := len(p.read_text().splitlines())) > limit}
    assert long == {}


def test_the_rules_see_the_real_tree():
    """The checks above would pass on an empty tree: make sure they read this one."""
    assert len(MODULES) > 50 and "pyserve.engine.engine" in MODULES
    engine_deps = GRAPH["pyserve.engine.engine"][0]
    assert "pyserve.engine.scheduler" in engine_deps
