"""The package's layering, checked from the source: who may import whom, and no import cycles.

Rules (docs/architecture.md): `mizuoto.errors` and `mizuoto.files` are leaves; `nn/` and `text/`
import only each other, themselves and the leaves; `runtime/` imports no engine, CLI or server
code; nothing but `mizuoto/testing/` imports `mizuoto.testing`; and the module graph, counting
every import (lazy ones inside functions too), has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mizuoto"
LEAVES = {"mizuoto.errors", "mizuoto.files"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every mizuoto module `path` imports, at any depth of the file (TYPE_CHECKING blocks too)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == "mizuoto" or m.startswith("mizuoto.")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # `from a.b import c` names module a.b.c when it exists, else the attribute c of a.b; a module's
        # own enclosing packages are initialised before it, so importing from them is no cycle
        graph[name] = {m for m in _imports(path, name) if m in files and m != name and not name.startswith(m + ".")}
    return graph


GRAPH = _graph()


def _in(module: str, *layers: str) -> bool:
    return any(module == f"mizuoto.{layer}" or module.startswith(f"mizuoto.{layer}.") for layer in layers)


def test_the_source_tree_was_read():
    assert len(GRAPH) > 50 and "mizuoto.runtime.api" in GRAPH and "mizuoto.nn.lm.decoder" in GRAPH


@pytest.mark.parametrize("layer", ["nn", "text"])
def test_blocks_import_only_blocks_and_leaves(layer):
    bad = sorted(f"{m} -> {dep}" for m, deps in GRAPH.items() if _in(m, layer) for dep in deps
                 if not (_in(dep, "nn", "text") or dep in LEAVES or dep == "mizuoto"))
    assert not bad, "; ".join(bad)


def test_leaves_import_no_mizuoto_module():
    bad = sorted(f"{m} -> {dep}" for m in LEAVES for dep in GRAPH[m])
    assert not bad, "; ".join(bad)


def test_the_runtime_imports_no_engine_cli_or_server():
    bad = sorted(f"{m} -> {dep}" for m, deps in GRAPH.items() if _in(m, "runtime", "nn", "text") for dep in deps
                 if _in(dep, "engines", "cli", "server", "demo"))
    assert not bad, "; ".join(bad)


def test_package_code_never_imports_the_testing_package():
    bad = sorted(f"{m} -> {dep}" for m, deps in GRAPH.items() if not _in(m, "testing") for dep in deps
                 if _in(dep, "testing"))
    assert not bad, "; ".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    """A planted two-module cycle is found (the check above is not vacuous)."""
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted["mizuoto.errors"].add("mizuoto.files")
    planted["mizuoto.files"].add("mizuoto.errors")
    assert _cycle(planted) in (["mizuoto.errors", "mizuoto.files", "mizuoto.errors"],
                               ["mizuoto.files", "mizuoto.errors", "mizuoto.files"])


def test_lazy_imports_are_seen(tmp_path):
    """An import inside a function counts, relative imports are resolved."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from mizuoto.runtime import api\n    from . import sibling\n")
    assert {"mizuoto.runtime", "mizuoto.runtime.api", "mizuoto.nn.sibling"} <= _imports(f, "mizuoto.nn.mod")
