"""The Qwen3-TTS cases recorded from upstream (fixtures/README.md), found by walking the tree.

`$MIZUOTO_QWEN3TTS_FIXTURES` points at another tree of the same layout (default: fixtures/ here);
a missing tree, or one without cases, fails loudly. Upstream's float results depend on the CPU
class (`mizuoto.testing.cpu_recordings`): the tree's own recording holds for the classes its
`cpu.json` names, re-recordings for other classes sit in `<tree>/cpu/<folder>/cases/<case>/`. A
case is compared with the record of this machine's class (`Case.cpu`, `Case.tensors`):
torch.equal where one exists, else integers equal and floats within upstream's measured spread.
"""

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

DEFAULT_ROOT = Path(__file__).parent / "fixtures"
ROOT = Path(os.environ.get("MIZUOTO_QWEN3TTS_FIXTURES", DEFAULT_ROOT))
RECORD = "record.safetensors"


@functools.cache
def tree():
    """The tree and its per-class re-recordings."""
    from mizuoto.testing.cpu_recordings import RecordTree

    return RecordTree(ROOT, RECORD, "Qwen3-TTS cases")


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

    @property
    def cpu(self):
        """How this case is compared on this machine's CPU class (`cpu_recordings.Comparison`)."""
        return tree().comparison(self.name)

    def tensors(self) -> dict:
        """The case's recorded tensors: this CPU class's record where the tree has one."""
        return load_file(str(tree().record_path(self.name)))


def cases() -> list[Case]:
    """Every case of the tree, by name."""
    if not ROOT.is_dir():
        raise FileNotFoundError(f"Qwen3-TTS fixture tree not found: {ROOT} (set MIZUOTO_QWEN3TTS_FIXTURES)")
    found = []
    for spec_path in sorted(ROOT.glob("cases/*/case.json")):
        if not (spec_path.parent / RECORD).is_file():
            raise FileNotFoundError(f"{spec_path.parent} has case.json but no {RECORD}")
        found.append(Case(spec_path.parent.name, json.loads(spec_path.read_text(encoding="utf-8")), spec_path.parent))
    if not found:
        raise FileNotFoundError(f"no Qwen3-TTS cases under {ROOT / 'cases'} (set MIZUOTO_QWEN3TTS_FIXTURES)")
    return found


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        found = cases()
        metafunc.parametrize("case", found, ids=[c.name for c in found])


@pytest.fixture(autouse=True)
def _threads():
    import torch

    torch.set_num_threads(int(os.environ.get("MIZUOTO_TEST_THREADS", "2")))


def pytest_terminal_summary(terminalreporter):
    """Name this CPU's class and what the Qwen3-TTS cases were compared with."""
    terminalreporter.write_line(tree().describe([c.name for c in cases()]))


@pytest.fixture
def any_case() -> Case:
    """One case of the tree (its model dir is what a test derives a broken copy from)."""
    return cases()[0]
