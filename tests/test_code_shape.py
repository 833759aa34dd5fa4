"""The shape the code keeps: short functions, no import cycles between modules, and an API that uses
only public names of the engine. (Kernels and tests are exempt from the length rule.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "api", "checkpoints", "kernels")
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = ast.parse(path.read_text(), str(path))
    out["run_server"] = ast.parse((ROOT / "run_server.py").read_text())
    return out


def _top_level_imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The project modules `name` imports when it is imported (not inside functions or TYPE_CHECKING)."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.Import, ast.ImportFrom, ast.If, ast.Try)) else ():
            if isinstance(sub, ast.Import):
                found |= {alias.name for alias in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                # `from package import submodule` depends on the submodule, not on the package's names
                found |= {f"{sub.module}.{a.name}" if f"{sub.module}.{a.name}" in modules else sub.module
                          for a in sub.names}
    ancestors = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}  # imported first anyway
    return {m for m in found if m in modules and m != name and m not in ancestors}


def test_no_function_over_60_lines_outside_kernels_and_tests():
    long = []
    for name, tree in _modules().items():
        if name.startswith("kernels"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {node.end_lineno - first + 1} lines")
    assert not long, long


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {name: _top_level_imports(name, tree, set(modules)) for name, tree in modules.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path[path.index(dep):] + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_api_uses_only_public_names_of_jaxserve():
    private = []
    for name, tree in _modules().items():
        if not name.startswith("api"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxserve"):
                private += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("engine", "scheduler", "runner"):
                    private.append(f"{name}: {node.value.id}.{node.attr}")
    assert not private, private
