"""The epoch loop of upstream's bin/train.py + executor (torch_ddp semantics at world size 1).

Per epoch: set the epoch, train (forward, `loss / accum_grad` backward; on a boundary, counted
per epoch, clip in upstream's parameter order, step if the norm is finite, zero the grads, step
the scheduler), then a validation pass in inference mode, then `epoch_<E>_whole.pt`. Gradients
of a partial accumulation at an epoch's end stay and join the next epoch's first step. A single
process computes what DDP at world size 1 computes (its all-reduce over one rank is exact), so
no process group is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.utils import clip_grad_norm_
from torch.utils.data import DataLoader

from mizuoto.engines.cosyvoice.train.checkpoint import UpstreamState, save_checkpoint
from mizuoto.engines.cosyvoice.train.export import write_sidecar
from mizuoto.engines.cosyvoice.train.tensorboard import ScalarLog
from mizuoto.errors import InvalidRequest
from mizuoto.engines.cosyvoice.train.schedulers import make_optimizer


@dataclass
class TrainLog:
    """Per-batch records (train, cv), per-epoch validation means and the checkpoints saved."""

    train: list[dict[str, Any]] = field(default_factory=list)
    cv: list[dict[str, Any]] = field(default_factory=list)
    cv_summary: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Loaders:
    """The train and validation loaders (and the train dataset, whose epoch drives its shard order)."""

    train_set: Any
    train: DataLoader
    cv: DataLoader


Forward = Callable[[dict, torch.device], dict[str, torch.Tensor]]


class Trainer:
    """Runs upstream's training epochs over one model and writes its checkpoints into exp_dir."""

    def __init__(self, model: torch.nn.Module, forward: Forward, state: UpstreamState, conf: dict,
                 exp_dir: Path, device: torch.device, start_epoch: int = -1, start_step: int = 0,
                 on_batch: Callable[[str, dict], None] | None = None, scalars: ScalarLog | None = None) -> None:
        self.model, self.forward, self.state, self.conf = model, forward, state, conf
        self.exp_dir, self.device = Path(exp_dir), device
        self.params = state.parameters()
        self.optimizer, self.scheduler = make_optimizer(self.params, conf)
        self.scheduler.set_step(start_step)
        self.epoch, self.step, self.start_epoch = start_epoch, start_step, start_epoch
        self.accum = int(conf.get("accum_grad", 1))
        self.grad_clip = float(conf.get("grad_clip", 5))
        self.log = TrainLog()
        self.on_batch = on_batch
        self.scalars = scalars

    def _save(self, name: str) -> None:
        save_checkpoint(self.exp_dir / f"{name}.pt", self.state.state_dict(), self.epoch, self.step)
        self.log.saves.append({"name": name, "epoch": self.epoch, "step": self.step})

    def save_init(self) -> None:
        """init.pt: the start weights, with the start epoch and step."""
        self._save("init")

    def run(self, loaders: Loaders, max_epoch: int | None = None) -> TrainLog:
        """Train from the epoch after the start one up to the yaml's max_epoch."""
        last = int(self.conf.get("max_epoch", 1)) if max_epoch is None else max_epoch
        for epoch in range(self.start_epoch + 1, last):
            self.epoch = epoch
            loaders.train_set.set_epoch(epoch)
            self.train_epoch(loaders.train)
            means = self.validate(loaders.cv)
            self._save(f"epoch_{epoch}_whole")
            write_sidecar(self.exp_dir / f"epoch_{epoch}_whole.yaml", epoch, self.step, means,
                          self.optimizer.param_groups[0]["lr"])
        return self.log

    def train_epoch(self, loader: DataLoader) -> None:
        """One pass over the train loader."""
        self.model.train()
        batch_idx = -1
        for batch_idx, batch in enumerate(loader):
            step = self.step
            loss_dict = self.forward(batch, self.device)
            scaled = loss_dict["loss"] / self.accum
            scaled.backward()
            loss_dict["loss"] = scaled
            boundary = (batch_idx + 1) % self.accum == 0
            grad_norm: Any = 0.0
            if boundary:
                grad_norm = clip_grad_norm_(self.params, self.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                self.optimizer.zero_grad()
                self.scheduler.step()
            record = {"epoch": self.epoch, "batch_idx": batch_idx, "step": step, "utts": list(batch["utts"]),
                      **{k: v.detach() for k, v in loss_dict.items()}, "boundary": boundary,
                      "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm}
            self.log.train.append(record)
            if self.on_batch is not None:
                self.on_batch("train", record)
            if boundary:
                self._scalars("TRAIN", record, ("epoch", "lr", "grad_norm", *loss_dict))
                self.step += 1
        if batch_idx < 0:
            raise InvalidRequest("no utterance passed the training yaml's filter (audio and text length limits)")

    @torch.inference_mode()
    def validate(self, loader: DataLoader) -> dict[str, float]:
        """The validation pass: mean losses weighted by utterances (logged, not used as a metric)."""
        self.model.eval()
        total_utts, sums = 0, {}
        for batch_idx, batch in enumerate(loader):
            n = len(batch["utts"])
            total_utts += n
            loss_dict = self.forward(batch, self.device)
            for k, v in loss_dict.items():
                sums.setdefault(k, []).append(v.mean().item() * n)
            record = {"epoch": self.epoch, "batch_idx": batch_idx, "step": self.step, "utts": list(batch["utts"]),
                      **{k: v.detach().clone() for k, v in loss_dict.items()}}
            self.log.cv.append(record)
            if self.on_batch is not None:
                self.on_batch("cv", record)
        means = {k: sum(v) / total_utts for k, v in sums.items()} if total_utts else {}
        summary = {"epoch": self.epoch, "step": self.step, "lr": self.optimizer.param_groups[0]["lr"]}
        self.log.cv_summary.append({**summary, "loss_dict": means})
        self._scalars("CV", {**summary, **means}, ("epoch", "lr", *means))
        return means

    def _scalars(self, tag: str, values: dict, keys: tuple[str, ...]) -> None:
        # upstream's SummaryWriter: `<TAG>/<key>` at step + 1
        if self.scalars is not None:
            for key in keys:
                self.scalars.add(f"{tag}/{key}", float(values[key]), values["step"] + 1)
