"""Engines and plugins use only the runtime's declared engine API (docs/plugins.md), checked from the source.

The declared API is what an engine is given to compute with: the contract (`runtime.engine`), the
sequence contract its token loops are run under (`runtime.sequence`), the hooks (`runtime.hookspecs`),
shared resources (`runtime.plugins.find_resource`), the bench harness (`runtime.bench`), checkpoint
matchers (`runtime.convert`), configs read as data (`runtime.hyperyaml`), load options
(`runtime.options`) and byte counts (`runtime.memory`), beside `mizuoto.errors`, `mizuoto.files`,
`mizuoto.nn` and `mizuoto.text`. The runtime's mechanics, how requests run (executors, leases, the
continuous batch and its rows, the decode loop, CUDA graphs), are not part of it, nor are
`Model.use`, `room` and `submit`: an engine states its work with `Model.compute` and runs its token
loops with `Model.decode` (engine contract v2). What an engine still reaches is listed in `NOT_YET`
by file; the list may only shrink, and a new use anywhere fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SOURCES = sorted([*ROOT.glob("mizuoto/engines/**/*.py"), *ROOT.glob("plugins/*/mizuoto_*/**/*.py")])
PUBLIC = {"mizuoto.runtime.engine", "mizuoto.runtime.sequence", "mizuoto.runtime.hookspecs", "mizuoto.runtime.plugins",
          "mizuoto.runtime.bench", "mizuoto.runtime.convert", "mizuoto.runtime.hyperyaml", "mizuoto.runtime.options",
          "mizuoto.runtime.memory"}
MECHANICS = {"Executor", "Lease", "Scheduler", "DecodeBatcher", "DecodeSteps", "Row", "RowSteps"}  # names, any module
# the runtime's mechanics under Model.compute and Model.decode: an engine states its work, it never places, reserves
# or sends it itself (engine contract v2)
SCHEDULING = {"use", "room", "submit"}
# (file, what it reaches) as of 2026-12-06: only shrinks
NOT_YET: set[tuple[str, str]] = set()


def _public(module: str) -> bool:
    if not module.startswith("mizuoto.runtime"):
        return True  # errors, files, nn, text: blocks and leaves (the layering test keeps runtime out of them)
    return any(module == p or module.startswith(p + ".") for p in PUBLIC)


def _reaches(path: Path) -> set[str]:
    """The runtime modules outside the declared API and the mechanics' names `path` imports (lazy imports too),
    and the scheduling methods it calls."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SCHEDULING:
            found.add(node.func.attr)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if not _public(a.name)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mizuoto"):
            if not _public(node.module):
                found.add(node.module)
            found |= {a.name for a in node.names if a.name in MECHANICS}
    return found


def test_the_engine_sources_were_read():
    names = {p.relative_to(ROOT).as_posix() for p in ENGINE_SOURCES}
    assert "mizuoto/engines/cosyvoice/engine.py" in names and len(names) > 20
    assert any(n.startswith("plugins/mizuoto-chatterbox/") for n in names)


def test_engines_use_only_the_declared_api_and_the_remaining_mechanics_only_shrink():
    found = {(p.relative_to(ROOT).as_posix(), what) for p in ENGINE_SOURCES for what in _reaches(p)}
    new = sorted(found - NOT_YET)
    assert not new, f"engine code reaches the runtime's mechanics or internals beyond its API: {new}"
    gone = sorted(NOT_YET - found)
    assert not gone, f"no longer reached (remove them from NOT_YET): {gone}"


def test_the_plugin_docs_declare_the_same_api():
    text = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    missing = [m for m in sorted(PUBLIC) if f"`{m}`" not in text]
    assert not missing, f"docs/plugins.md does not declare {missing}"
