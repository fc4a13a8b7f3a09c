"""Suite-wide setup: fixtures must exist, threads are pinned, and shared resources come from ../shared/assets."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from mizuoto.testing.fixtures import asset_path, fixtures_root
from mizuoto.testing.toy import write_model

# Fixtures were recorded with 2 threads; float reductions can depend on the thread count.
torch.set_num_threads(2)
fixtures_root()  # raises at collection if the fixture tree is missing

# A private $MIZUOTO_HOME holding the shared resources as a user would install them.
_home = Path(tempfile.mkdtemp(prefix="mizuoto-home-"))
(_home / "cosyvoice").mkdir()
(_home / "cosyvoice" / "wetext").symlink_to(asset_path("wetext", "fsts"))
(_home / "whisper").symlink_to(asset_path("whisper"))
os.environ["MIZUOTO_HOME"] = str(_home)


@pytest.fixture
def tone_dir(tmp_path):
    """A fresh sine-tone model directory (the toy engine of mizuoto.testing.toy)."""
    return write_model(tmp_path / "tone")
