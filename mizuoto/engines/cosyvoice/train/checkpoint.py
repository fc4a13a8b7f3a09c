"""Checkpoints in upstream's bytes: `{**state_dict, 'epoch': E, 'step': S}` in upstream's key order.

torch.save names the zip's folder after the file's stem (`epoch_0_whole/`), so the file is
written under its final name in a private temporary folder and then moved into place: a crash
never leaves a half file, and the bytes are those of a direct save.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from mizuoto.errors import ModelLoadError


class UpstreamState:
    """Maps a model's parameters to upstream's keys and order (read off the start checkpoint)."""

    def __init__(self, model: nn.Module, key_order: list[str], tied: dict[str, str] | None = None) -> None:
        self.model = model
        self.key_order = list(key_order)
        self.tied = dict(tied or {})  # upstream key -> the upstream key whose storage it shares
        to_up = getattr(model, "upstream_key", lambda k: k)
        self.ours = {to_up(k): k for k in model.state_dict()}
        missing = [k for k in self.key_order if k not in self.ours and k not in self.tied]
        if missing:
            raise ModelLoadError(f"the model has no parameter for checkpoint key {missing[0]!r}")

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters in upstream's registration order (shared ones once)."""
        named = dict(self.model.named_parameters())
        out, seen = [], set()
        for key in self.key_order:
            name = self.ours.get(key)
            p = named.get(name) if name is not None else None
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        if len(out) != len(named):
            raise ModelLoadError(f"{len(named) - len(out)} parameters have no key in the start checkpoint")
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Upstream's state_dict: detached tensors in its key order, tied keys sharing storage."""
        ours = self.model.state_dict()
        out = {}
        for key in self.key_order:
            # a tied key is its own tensor object on the shared storage, as a module's state_dict gives it
            out[key] = ours[self.ours[key]] if key in self.ours else ours[self.ours[self.tied[key]]].detach()
        return out


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], epoch: int, step: int) -> None:
    """torch.save `{**state, 'epoch', 'step'}` to path as upstream's save_model does, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".save-", dir=path.parent))
    try:
        torch.save({**state, "epoch": epoch, "step": step}, tmp / path.name)
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_checkpoint(path: Path) -> dict:
    """An upstream llm.pt / flow.pt / epoch checkpoint as a dict (tensors plus optional epoch, step)."""
    if not Path(path).is_file():
        raise ModelLoadError(f"{path} is missing")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a truncated or foreign file
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(sd, dict):
        raise ModelLoadError(f"{path}: expected a state_dict, got {type(sd).__name__}")
    return sd


def tensors_of(sd: dict) -> dict[str, torch.Tensor]:
    """The tensor entries of a checkpoint (without epoch / step)."""
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
