"""The Chatterbox cases recorded from upstream (fixtures/README.md), found by walking the tree.

`$MIZUOTO_CHATTERBOX_FIXTURES` points at another tree of the same layout (default: fixtures/ here).
Upstream's float results depend on the CPU class (`mizuoto.testing.cpu_recordings`): the tree's own
recording holds for the classes its `cpu.json` names; whole re-recordings for other classes sit in
`<tree>/cpu/<folder>/cases/<case>/` (for the default tree also `$MIZUOTO_FIXTURES/chatterbox/cpu/`).
A case is compared with the record of this machine's class (`Case.tensors`, `Case.assert_equal`):
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
ROOT = Path(os.environ.get("MIZUOTO_CHATTERBOX_FIXTURES", DEFAULT_ROOT))
RECORD = "record.safetensors"


@functools.cache
def tree():
    """The tree and its per-class re-recordings (the shared fixtures' `chatterbox/cpu/` too for the default tree)."""
    from mizuoto.testing.cpu_recordings import CPU_FOLDER, RecordTree
    from mizuoto.testing.fixtures import fixtures_root

    extra = [fixtures_root() / "chatterbox" / CPU_FOLDER] if ROOT.resolve() == DEFAULT_ROOT.resolve() else []
    return RecordTree(ROOT, RECORD, "Chatterbox cases", extra)


@dataclass(frozen=True)
class Case:
    """One recorded `generate` call: its case.json and its tensors."""

    name: str
    spec: dict
    path: Path

    @property
    def model_dir(self) -> Path:
        return ROOT / self.spec["model_dir"]

    @property
    def clip(self) -> Path | None:
        """The reference clip of a clone case (None for a preset)."""
        clip = self.spec.get("reference_clip")
        return ROOT / clip if clip else None

    @property
    def cpu(self):
        """How this case is compared on this machine's CPU class (`cpu_recordings.Comparison`)."""
        return tree().comparison(self.name)

    def tensors(self) -> dict:
        """The case's recorded tensors: this CPU class's record where the tree has one."""
        return load_file(str(tree().record_path(self.name)))

    def assert_equal(self, ours, key: str, what: str = "") -> None:
        """`ours` equals the record's `key` (torch.equal, or on an unrecorded class within upstream's spread)."""
        self.cpu.assert_equal(ours, self.tensors()[key], key, what or key)

    def model_file(self, names: dict) -> Path:
        """The one file of `names` (`weights.T3_FILES`, `S3GEN_FILES`) in the case's model dir."""
        from mizuoto_chatterbox.weights import one_of

        return one_of(self.model_dir, names)

    def t3(self):
        """The case's T3, loaded once per model dir."""
        from mizuoto_chatterbox.t3 import load_t3
        from mizuoto_chatterbox.weights import T3_FILES

        return _cached(load_t3, self.model_file(T3_FILES))

    def t3_options(self):
        """The generate kwargs T3 reads."""
        from mizuoto_chatterbox.t3 import T3Options

        kw = self.spec["generate_kwargs"]
        return T3Options(**{k: kw[k] for k in ("temperature", "top_p", "min_p", "top_k", "repetition_penalty",
                                                "cfg_weight") if k in kw})


@functools.lru_cache(maxsize=None)
def _cached(load, path: Path):
    return load(path)


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


def pytest_terminal_summary(terminalreporter):
    """Name this CPU's class and what the Chatterbox cases were compared with."""
    terminalreporter.write_line(tree().describe([c.name for c in cases()]))
