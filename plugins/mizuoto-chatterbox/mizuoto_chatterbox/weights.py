"""Reading upstream's weight files: the tensors, sizes counted from their names, and what weights do not hold.

A reduced test model states its head counts and other sizes beside its weights (`reduced_config.json`).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from mizuoto.errors import ModelLoadError


def read_weights(path: Path) -> dict:
    """Every tensor of a safetensors file; an unreadable file is a ModelLoadError."""
    try:
        return load_file(str(path))
    except Exception as exc:  # a truncated or foreign file fails in many ways inside safetensors
        raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def count_children(state: dict, prefix: str) -> int:
    """How many numbered children (blocks, layers) sit right under `prefix` in the state's keys."""
    return len({k[len(prefix):].split(".", 1)[0] for k in state if k.startswith(prefix)})


def reduced_config(model_dir: Path) -> dict:
    """The `reduced` table of model_dir/reduced_config.json, or {} when there is none (released weights)."""
    path = model_dir / "reduced_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("reduced", {})
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
