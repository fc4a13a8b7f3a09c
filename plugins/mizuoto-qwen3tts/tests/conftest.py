"""The Qwen3-TTS cases recorded from upstream (fixtures/README.md), found by walking the tree.

`$MIZUOTO_QWEN3TTS_FIXTURES` points at another tree of the same layout (default: fixtures/ here).
A missing tree, or one without cases, fails loudly.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

DEFAULT_ROOT = Path(__file__).parent / "fixtures"
ROOT = Path(os.environ.get("MIZUOTO_QWEN3TTS_FIXTURES", DEFAULT_ROOT))
RECORD = "record.safetensors"


@dataclass(frozen=True)
class Case:
    """One recorded call: its case.json and its tensors."""

    name: str
    spec: dict
    path: Path

    @property
    def model_dir(self) -> Path:
        return ROOT / self.spec["model_dir"]

    @property
    def kwargs(self) -> dict:
        """The call's keyword arguments (paths relative to the tree)."""
        return dict(self.spec["kwargs"])

    def tensors(self) -> dict:
        return load_file(str(self.path / RECORD))


def discover() -> list[Case]:
    """Every case of the tree, by name."""
    if not ROOT.is_dir():
        raise FileNotFoundError(f"Qwen3-TTS fixture tree not found: {ROOT} (set MIZUOTO_QWEN3TTS_FIXTURES)")
    found = []
    for spec_path in sorted(ROOT.glob("cases/*/case.json")):
        if not (spec_path.parent / RECORD).is_file():
            raise FileNotFoundError(f"{spec_path.parent} has case.json but no {RECORD}")
        found.append(Case(spec_path.parent.name, json.loads(spec_path.read_text(encoding="utf-8")), spec_path.parent))
    if not found:
        raise FileNotFoundError(f"no cases under {ROOT / 'cases'}")
    return found


CASES = discover()


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", CASES, ids=[c.name for c in CASES])
