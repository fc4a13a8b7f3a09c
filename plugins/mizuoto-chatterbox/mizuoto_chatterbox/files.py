"""What a Chatterbox model directory holds, as upstream's `from_local` reads it."""

from __future__ import annotations

import json
from pathlib import Path

from mizuoto.errors import ModelLoadError

T3_FILES = {"t3_cfg.safetensors": False, "t3_turbo_v1.safetensors": True}  # file -> Turbo
S3GEN_FILES = {"s3gen.safetensors": False, "s3gen_meanflow.safetensors": True}
VOICE_ENCODER = "ve.safetensors"
PRESET = "conds.pt"


def one_of(model_dir: str | Path, names: dict[str, bool]) -> Path:
    """The one file of `names` the directory holds (a clear error for none or several)."""
    found = [Path(model_dir) / n for n in names if (Path(model_dir) / n).is_file()]
    if len(found) != 1:
        raise ModelLoadError(f"{model_dir}: expected exactly one of {', '.join(names)}, found {len(found)}")
    return found[0]


def reduced_sizes(model_dir: str | Path) -> dict:
    """Sizes the weights cannot tell (head counts), from `reduced_config.json` beside reduced weights; {} if none.

    The released models have no such file: upstream's own constants apply.
    """
    path = Path(model_dir) / "reduced_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("reduced", {})
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
