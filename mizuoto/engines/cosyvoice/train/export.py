"""The export stage: average the best epochs (upstream's average_model.py --val_best) into a model dir.

Epochs are ranked by their validation loss (the `epoch_<E>_whole.yaml` sidecar each epoch
writes, as upstream's save_model does), lowest first, ties in epoch order; the first `num`
checkpoints are summed in that order and divided by their count. The export is a copy of the
start model dir with the averaged `llm.pt` / `flow.pt`, written beside and moved into place.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import yaml

from mizuoto.engines.cosyvoice.train.checkpoint import read_checkpoint
from mizuoto.errors import InvalidRequest
from mizuoto.files import atomic_write_bytes

AVERAGE_NUM = 5  # the LibriTTS recipe's average_num
_EPOCH = re.compile(r"epoch_(\d+)_whole\.yaml")


def write_sidecar(path: Path, epoch: int, step: int, loss_dict: dict[str, float], lr: float) -> None:
    """`epoch_<E>_whole.yaml`: what average_model.py reads (tag, epoch, step, the validation losses)."""
    info = {"tag": "CV", "epoch": epoch, "step": step, "lr": lr, "loss_dict": dict(loss_dict)}
    atomic_write_bytes(path, yaml.safe_dump(info, sort_keys=True).encode("utf-8"))


def best_epochs(exp_dir: Path, num: int = AVERAGE_NUM) -> list[Path]:
    """The epoch checkpoints with the lowest validation loss, best first (at most num)."""
    scores = []
    for side in sorted(exp_dir.glob("epoch_*_whole.yaml")):
        m = _EPOCH.fullmatch(side.name)
        if m is None:
            continue
        info = yaml.safe_load(side.read_text(encoding="utf-8"))
        scores.append((int(info["epoch"]), float(info["loss_dict"]["loss"])))
    scores.sort(key=lambda s: s[0])
    scores.sort(key=lambda s: s[1])
    if not scores:
        raise InvalidRequest(f"{exp_dir} holds no trained epoch to export (run the training stage first)")
    return [exp_dir / f"epoch_{epoch}_whole.pt" for epoch, _ in scores[:num]]


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the checkpoints' tensors (epoch / step dropped), summed in the given order."""
    if not paths:
        raise InvalidRequest("no checkpoint to average")
    avg: dict[str, torch.Tensor] = {}
    for path in paths:
        for key, value in read_checkpoint(path).items():
            if key in ("epoch", "step"):
                continue
            if key not in avg:
                avg[key] = value.clone()
            else:
                avg[key] += value
    return {k: torch.true_divide(v, len(paths)) for k, v in avg.items()}


def export_model_dir(start_dir: Path, dest: Path, weights: dict[str, dict[str, torch.Tensor]],
                     replace: bool = False) -> Path:
    """A copy of start_dir with each `<name>.pt` of `weights` replaced; dest appears complete or not at all.

    An existing dest is an error unless `replace`, which swaps the new export in for it.
    """
    if dest.exists() and not replace:
        raise InvalidRequest(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        work = tmp / dest.name
        shutil.copytree(start_dir, work, symlinks=False)
        for name, state in weights.items():
            target = work / f"{name}.pt"
            if target.exists():
                target.unlink()
            torch.save(state, target)
        if dest.exists():
            os.replace(dest, tmp / "previous")
        os.replace(work, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
