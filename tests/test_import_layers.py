"""The packages of trioserve import only downward, in one documented order
(docs/architecture.md, "Layers"): every import statement counts, those
inside functions and under `if TYPE_CHECKING:` too, so no package reaches
up into one that depends on it, and the graph has no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trioserve"
# Lowest first; a module may import its own layer's modules and any below.
LAYERS = (
    ("__init__", "errors", "types", "option_kinds", "options", "config", "progress"),
    ("state",),
    ("kernels",),
    ("models",),
    ("core",),
    ("actors",),
    ("engine",),
    ("http",),
    ("cli", "__main__"),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _part(module: str) -> str | None:
    """The layer part of a dotted trioserve module name (its package, or the
    top-level module), or None for what is not trioserve's."""
    names = module.split(".")
    if names[0] != "trioserve":
        return None
    return names[1] if len(names) > 1 else "__init__"  # the package itself: its __init__


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    names = list(rel.parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, wherever it stands."""
    here = _module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            if node.module is None or module == "trioserve":  # `from . import x`, `from trioserve import x`
                for alias in node.names:  # a module or package of that name, else a name in its __init__
                    inside = root.joinpath(*module.split(".")[1:], alias.name)
                    is_module = inside.is_dir() or inside.with_suffix(".py").is_file()
                    found.append((node.lineno, f"{module}.{alias.name}" if is_module else module))
            else:
                found.append((node.lineno, module))
    return found


def _upward(root: Path = PACKAGE) -> list[str]:
    """Each import that goes up the layers (or into a part LAYERS lacks), as
    "file:line: what"."""
    wrong = []
    for path in sorted(root.rglob("*.py")):
        source = _part(_module_name(path, root))
        for line, module in _imports(path, root):
            target = _part(module)
            if target is None or target == source:
                continue
            if target not in RANK or source not in RANK:
                wrong.append(f"{path.relative_to(root.parent)}:{line}: {module} (a part missing from LAYERS)")
            elif RANK[target] > RANK[source]:
                wrong.append(f"{path.relative_to(root.parent)}:{line}: {source} imports {module}, a layer above it")
    return wrong


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if (p.suffix == ".py" or p.is_dir()) and not p.name.startswith("__pycache__")}
    assert parts - {"__init__"} <= set(RANK), sorted(parts - set(RANK) - {"__init__"})


def test_imports_go_only_down_the_layers():
    assert _upward() == []


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The walker finds an import inside a function, one under TYPE_CHECKING
    and a relative one (so the test above can fail)."""
    sample = tmp_path / "trioserve" / "state" / "sample.py"
    sample.parent.mkdir(parents=True)
    (sample.parent / "__init__.py").write_text("")
    (sample.parent / "pooling.py").write_text("")
    sample.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trioserve.engine import Engine\n"
        "def f():\n    from ..http import app\n    import trioserve.actors.worker\n    from . import pooling\n"
    )
    got = {module for _, module in _imports(sample, tmp_path / "trioserve")}
    assert {"trioserve.engine", "trioserve.http", "trioserve.actors.worker", "trioserve.state.pooling"} <= got
    upward = _upward(tmp_path / "trioserve")
    assert len(upward) == 3 and all("state imports" in w for w in upward), upward
