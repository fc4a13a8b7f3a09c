"""Training fixtures: every `train/<v>/` tree (its data, its llm/flow runs) discovered, never named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.train_cases import model_dir_of


@pytest.fixture(autouse=True)
def _one_thread():
    """The references were recorded on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def assembled(tmp_path_factory):
    """A function: version folder -> a complete model dir (front-end files added) in a temp folder."""
    def make(version: Path) -> Path:
        return assemble_model_dir(model_dir_of(version), tmp_path_factory.mktemp(f"model-{version.name}"))
    return make
