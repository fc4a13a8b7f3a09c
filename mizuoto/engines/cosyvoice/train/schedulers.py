"""The learning-rate schedules upstream's train_conf names (`constantlr`, `warmuplr`), and Adam."""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler

from mizuoto.errors import InvalidRequest


class ConstantLR(LRScheduler):
    """The base rate at every step."""

    def get_lr(self) -> list[float]:
        """The base rates."""
        return list(self.base_lrs)

    def set_step(self, step: int) -> None:
        """Resume at `step`."""
        self.last_epoch = step


class WarmupLR(LRScheduler):
    """base * w**0.5 * min(s**-0.5, s * w**-1.5), s = steps taken + 1: linear warm-up, then inverse square root."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: float = 25000, last_epoch: int = -1) -> None:
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The rates of the current step."""
        s, w = self.last_epoch + 1, self.warmup_steps
        if w == 0:
            return [lr * s ** -0.5 for lr in self.base_lrs]
        return [lr * w ** 0.5 * min(s ** -0.5, s * w ** -1.5) for lr in self.base_lrs]

    def set_step(self, step: int) -> None:
        """Resume at `step`."""
        self.last_epoch = step


def make_optimizer(params: list, conf: dict) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """Adam (or AdamW) over params with the yaml's optim_conf, and the yaml's scheduler."""
    optim = conf.get("optim", "adam")
    kinds = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    if optim not in kinds:
        raise InvalidRequest(f"train_conf.optim {optim!r} is not supported (adam or adamw)")
    optimizer = kinds[optim](params, **dict(conf.get("optim_conf") or {}))
    name = conf.get("scheduler", "constantlr")
    if name == "constantlr":
        scheduler = ConstantLR(optimizer)
    elif name == "warmuplr":
        scheduler = WarmupLR(optimizer, **dict(conf.get("scheduler_conf") or {}))
    else:
        raise InvalidRequest(f"train_conf.scheduler {name!r} is not supported (constantlr or warmuplr)")
    return optimizer, scheduler
