"""Reading a Qwen3-TTS model dir's `model.safetensors` into mizuoto.nn modules: one matcher, every key and shape checked.

Upstream's checkpoint holds the whole model under one file (`talker.model.*`, `talker.codec_head`,
`talker.text_projection.*`, `talker.code_predictor.*`, `speaker_encoder.*`). Each part is read by
`load_into`: the module's own names, mapped from upstream's (a prefix, and the names that differ),
must be exactly the file's keys under that prefix (minus those another part reads), shape for
shape. Nothing is transposed: every weight is an `nn.Linear` / `nn.Embedding` / norm weight in
upstream's layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mizuoto.errors import ModelLoadError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def read_config(model_dir: str | Path) -> dict:
    """The model dir's `config.json`."""
    path = Path(model_dir) / CONFIG
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None


def load_into(module: nn.Module, model_dir: str | Path, prefix: str, renamed: Mapping[str, str] | None = None,
              skip: tuple[str, ...] = (), moved: Mapping[str, str] | None = None) -> None:
    """Fill `module` (every parameter and persistent buffer) from the file's keys under `prefix`.

    `renamed`: upstream's name (after the prefix) -> the module's, where they differ; `moved`: the
    start of upstream's names -> the module's (a submodule of another name), for names not renamed;
    `skip`: the starts of names under the prefix that other parts read. A key missing, left over or
    of another shape is a ModelLoadError naming it.
    """
    renamed, moved = dict(renamed or {}), dict(moved or {})

    def ours_of(name: str) -> str:
        if name in renamed:
            return renamed[name]
        start = next((m for m in moved if name.startswith(m)), None)
        return name if start is None else moved[start] + name[len(start):]
    path = Path(model_dir) / WEIGHTS
    wanted = module.state_dict()
    try:
        f = safe_open(str(path), "pt")
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    with f:
        keys = [k for k in f.keys() if k.startswith(prefix) and not k[len(prefix):].startswith(skip)]
        ours = {ours_of(k[len(prefix):]): k for k in keys}
        missing, extra = sorted(set(wanted) - set(ours)), sorted(set(ours) - set(wanted))
        if missing or extra:
            raise ModelLoadError(f"{path}: the weights under {prefix!r} do not match the config (missing "
                                 f"{missing[:5]}, unexpected {extra[:5]})")
        state = {}
        for name, key in ours.items():
            tensor = f.get_tensor(key)
            if tensor.shape != wanted[name].shape:
                raise ModelLoadError(f"{path}: {key} is {tuple(tensor.shape)}, the config makes it "
                                     f"{tuple(wanted[name].shape)}")
            state[name] = tensor.to(torch.float32)
    assert len(state) == len(wanted), (len(state), len(wanted))
    module.load_state_dict(state, strict=True)
