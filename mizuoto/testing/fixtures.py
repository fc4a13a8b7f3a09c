"""Locating the parity fixtures and shared assets; a missing one fails loudly, never skips."""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]


def fixtures_root() -> Path:
    """`$MIZUOTO_FIXTURES`, default `../shared/fixtures` beside the checkout."""
    root = Path(os.environ.get("MIZUOTO_FIXTURES", _REPO.parent / "shared" / "fixtures")).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"fixtures not found at {root}: set $MIZUOTO_FIXTURES")
    return root


def assets_root() -> Path:
    """`$MIZUOTO_ASSETS`, default the `assets` folder beside the fixtures."""
    root = Path(os.environ.get("MIZUOTO_ASSETS", fixtures_root().parent / "assets")).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"shared assets not found at {root}: set $MIZUOTO_ASSETS")
    return root


def fixture_path(*parts: str) -> Path:
    """A path inside the fixture tree."""
    path = fixtures_root().joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"fixture missing: {path}")
    return path


def asset_path(*parts: str) -> Path:
    """A path inside the shared assets."""
    path = assets_root().joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"asset missing: {path}")
    return path


def read_jsonl(path: Path) -> list[dict]:
    """Every non-empty line of a jsonl file, parsed."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_manifest(path: Path, *keys: str) -> dict[str, Any] | None:
    """A json manifest holding every one of `keys`, or None (unreadable, or some other json)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) and all(k in meta for k in keys) else None


def load_tensors(path: Path, meta: dict[str, Any]) -> dict:
    """The tensors of a case manifest at `path`: its `tensor_file`, each of its `aliases` under its own name."""
    from safetensors.torch import load_file

    tensors = load_file(str(path.parent / meta["tensor_file"]))
    for name, stored in meta.get("aliases", {}).items():
        tensors[name] = tensors[stored]
    return tensors


@dataclass
class Recording:
    """A loaded fixture case: its manifest and its tensors, every alias under its own name."""

    meta: dict[str, Any]
    tensors: dict[str, Any] = field(repr=False)

    def get(self, name: str) -> Any:
        """A tensor by logical name, or None."""
        return self.tensors.get(name)

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]
