"""Discovering the training parity fixtures (`train/<v>/data`, `train/<v>/<model>/runs.json`); nothing is named."""

from __future__ import annotations

import json
from pathlib import Path

from mizuoto.testing.fixtures import fixtures_root


def train_versions() -> list[Path]:
    """Every `train/<v>` folder holding a dataset."""
    found = sorted(p.parent for p in (fixtures_root() / "train").glob("*/data") if p.is_dir())
    assert found, f"no training fixtures under {fixtures_root() / 'train'}"
    return found


def train_runs() -> list[tuple[Path, int]]:
    """(run folder `train/<v>/<model>`, num_workers) of every recorded run."""
    runs = []
    for version in train_versions():
        for run in sorted(p.parent for p in version.glob("*/runs.json")):
            meta = json.loads((run / "runs.json").read_text(encoding="utf-8"))
            for rec in meta["runs"].values():
                runs.append((run, int(rec["num_workers"])))
    assert runs, "no recorded training runs"
    return runs


def model_dir_of(version: Path) -> Path:
    """The fixture model dir a training version starts from (`cosyvoice/<v>/model`)."""
    path = fixtures_root() / "cosyvoice" / version.name / "model"
    assert path.is_dir(), f"start model dir missing: {path}"
    return path
