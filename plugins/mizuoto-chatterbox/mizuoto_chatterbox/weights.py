"""Upstream's model directory: which files it holds, their tensors, sizes counted from their names, and what
weights do not hold.

A reduced test model states its head counts and other sizes beside its weights (`reduced_config.json`).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from mizuoto.errors import ModelLoadError

# as upstream's from_local reads them; file -> Turbo
T3_FILES = {"t3_cfg.safetensors": False, "t3_turbo_v1.safetensors": True}
S3GEN_FILES = {"s3gen.safetensors": False, "s3gen_meanflow.safetensors": True}
VOICE_ENCODER = "ve.safetensors"
PRESET = "conds.pt"


def one_of(model_dir: str | Path, names: dict[str, bool]) -> Path:
    """The one file of `names` the directory holds (a clear error for none or several)."""
    found = [Path(model_dir) / n for n in names if (Path(model_dir) / n).is_file()]
    if len(found) != 1:
        raise ModelLoadError(f"{model_dir}: expected exactly one of {', '.join(names)}, found {len(found)}")
    return found[0]


def read_weights(path: Path) -> dict:
    """Every tensor of a safetensors file; an unreadable file is a ModelLoadError."""
    try:
        return load_file(str(path))
    except Exception as exc:  # a truncated or foreign file fails in many ways inside safetensors
        raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def count_children(state: dict, prefix: str) -> int:
    """How many numbered children (blocks, layers) sit right under `prefix` in the state's keys."""
    return len({k[len(prefix):].split(".", 1)[0] for k in state if k.startswith(prefix)})


def reduced_config(model_dir: str | Path) -> dict:
    """The `reduced` table of model_dir/reduced_config.json, or {} when there is none (released weights)."""
    path = Path(model_dir) / "reduced_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("reduced", {})
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
