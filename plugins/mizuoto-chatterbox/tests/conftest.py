"""The Chatterbox cases recorded from upstream (fixtures/README.md), found by walking the tree.

`$MIZUOTO_CHATTERBOX_FIXTURES` points at another tree of the same layout (default: fixtures/ here).
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(os.environ.get("MIZUOTO_CHATTERBOX_FIXTURES", Path(__file__).parent / "fixtures"))


@dataclass(frozen=True)
class Case:
    """One recorded `generate` call: its case.json and its tensors."""

    name: str
    spec: dict
    path: Path

    @property
    def model_dir(self) -> Path:
        return ROOT / self.spec["model_dir"]

    def tensors(self) -> dict:
        return load_file(str(self.path / "record.safetensors"))


def cases() -> list[Case]:
    """Every case under cases/ (a missing or empty tree fails collection)."""
    found = sorted(ROOT.glob("cases/*/case.json"))
    if not found:
        raise FileNotFoundError(f"no Chatterbox cases under {ROOT}/cases (set MIZUOTO_CHATTERBOX_FIXTURES)")
    return [Case(p.parent.name, json.loads(p.read_text(encoding="utf-8")), p.parent) for p in found]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        found = cases()
        metafunc.parametrize("case", found, ids=[c.name for c in found])


@pytest.fixture(autouse=True)
def _threads():
    import torch

    torch.set_num_threads(int(os.environ.get("MIZUOTO_TEST_THREADS", "2")))
