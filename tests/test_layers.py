"""The package's layers, checked from the source: which package may import
what (docs/architecture.md, "Layers"). Imports under `if TYPE_CHECKING:`
are annotations only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trioserve"

# package -> what its modules must never import (prefixes of module names)
FORBIDDEN = {
    "types": ("torch", "trio", "quart", "hypercorn", "trioserve.models", "trioserve.state", "trioserve.core", "trioserve.actors", "trioserve.http", "trioserve.engine"),
    "state": ("torch", "trio", "quart", "trioserve.models", "trioserve.core", "trioserve.actors", "trioserve.http", "trioserve.engine"),
    "core": ("torch", "trio", "quart", "trioserve.actors", "trioserve.http", "trioserve.engine"),
    "models": ("trio", "quart", "trioserve.core", "trioserve.actors", "trioserve.http", "trioserve.engine"),
    "kernels": ("trio", "quart", "trioserve.core", "trioserve.actors", "trioserve.http", "trioserve.engine"),
    "actors": ("quart", "hypercorn", "trioserve.http", "trioserve.engine"),
}
# Imported inside a function on purpose: replay's model mode runs the worker's
# and the sampler's functions (and so torch) only when asked to.
ALLOWED_LAZY = {("core/replay.py", "trioserve.actors"), ("core/replay.py", "trioserve.engine")}


def runtime_imports(path: Path) -> list[tuple[str, bool]]:
    """(module, inside a function) for every import outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                for other in child.orelse:
                    visit(other, in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.module, in_function))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return found


def modules_of(package: str) -> list[Path]:
    single = PACKAGE / f"{package}.py"
    return [single] if single.exists() else sorted((PACKAGE / package).glob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layers(package: str) -> None:
    bad = []
    for path in modules_of(package):
        rel = path.relative_to(PACKAGE).as_posix()
        for module, lazy in runtime_imports(path):
            for prefix in FORBIDDEN[package]:
                if module == prefix or module.startswith(prefix + "."):
                    if lazy and (rel, prefix) in ALLOWED_LAZY:
                        continue
                    bad.append(f"{rel} imports {module}")
    assert not bad, bad


def test_the_checker_sees_imports(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text(
        "import torch\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trio\n"
        "def f():\n    from trioserve.http import app\n"
    )
    assert runtime_imports(sample) == [("torch", False), ("typing", False), ("trioserve.http", True)]


def test_the_core_loads_without_torch_or_trio() -> None:
    """Not even indirectly: replaying a trace without the model needs neither."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = (
        "import sys, trioserve.core.engine_core, trioserve.core.trace, trioserve.state.session_store\n"
        "print(sorted(m for m in ('torch', 'trio', 'quart') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
