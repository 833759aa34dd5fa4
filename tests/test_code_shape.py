"""The shape the code keeps: short functions and modules, imports that point down (import-linter), and
an API that uses only public names of the engine. (Kernels and tests are exempt from the length rules.)"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "api", "checkpoints", "jaxserve_kernels")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _modules() -> dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = ast.parse(path.read_text(), str(path))
    out["run_server"] = ast.parse((ROOT / "run_server.py").read_text())
    return out


def test_no_function_over_60_lines_outside_kernels_and_tests():
    long = []
    for name, tree in _modules().items():
        if name.startswith("jaxserve_kernels"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {node.end_lineno - first + 1} lines")
    assert not long, long


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the project at `root` (in a process of its own: it reconfigures logging)."""
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True, no_logo=True))"], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})


def test_imports_point_down():
    """The import-linter contracts in pyproject.toml: api -> jaxserve -> checkpoints -> jaxserve_kernels, the
    engine's stages in order, models and checkpoints independent; no import goes up, so none cycles."""
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_an_upward_import_breaks_the_contracts(tmp_path):
    """The contracts bite: a copy of the project where the sampler imports the engine fails them."""
    for part in (*PACKAGES, "pyproject.toml"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, tmp_path / part)
    params = tmp_path / "jaxserve" / "sample" / "params.py"
    params.write_text(params.read_text() + "\nimport jaxserve.engine.core  # noqa: E402\n")
    run = _lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "jaxserve.sample is not allowed to import jaxserve.engine" in run.stdout


def test_no_other_installed_distribution_has_our_package_names():
    """Each top-level name is ours alone: where another distribution installs one of the same name, one of
    the two shadows the other (transformers 5.25 brought Hugging Face's `kernels`, then this project's
    kernels' name, and every tokenizer load failed from the checkout). The scripts' and tests' helper
    modules count too: bench/ and tests/ come first on the path where they run (bench/kernels.py shadowed
    it for every benchmark that builds a model)."""
    owners = importlib.metadata.packages_distributions()
    helpers = [path.stem for folder in ("bench", "tests") for path in sorted((ROOT / folder).glob("*.py"))]
    names = [*PACKAGES, "run_server", *helpers]
    clashes = {name: others for name in names if (others := sorted(set(owners.get(name, [])) - {"jaxserve"}))}
    assert not clashes, clashes


def test_no_module_over_400_lines_outside_kernels_and_tests():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for package in PACKAGES if package != "jaxserve_kernels"
            for path in sorted((ROOT / package).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_importing_a_stage_loads_only_what_it_imports():
    """`import jaxserve.sample` does not load the engine (the package's names load on first use)."""
    code = ("import sys, jaxserve.sample.params, jaxserve.config.engine; "
            "print(sorted(m for m in sys.modules if m.startswith(('jaxserve.engine', 'jaxserve.worker', 'api'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


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
