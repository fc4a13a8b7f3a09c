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


def class_folders() -> list[Path]:
    """The tree's per-class re-recordings (`cpu/<folder>`), the shared ones too for the default tree."""
    from mizuoto.testing.cpu_recordings import CPU_FOLDER
    from mizuoto.testing.fixtures import fixtures_root

    places = [ROOT / CPU_FOLDER]
    if ROOT.resolve() == DEFAULT_ROOT.resolve():
        places.append(fixtures_root() / "chatterbox" / CPU_FOLDER)
    return sorted(p for place in places if place.is_dir() for p in place.iterdir() if (p / "cases").is_dir())


@functools.cache
def _classes() -> dict:
    """Class -> its folder; and, per tensor key, the largest difference between any two recorded classes."""
    from mizuoto.testing.cpu_recordings import folder_class, measured_bounds, merge_bounds

    folders, bounds, relative = {}, {}, {}
    for folder in class_folders():
        named = folder_class(folder, [json.loads(p.read_text(encoding="utf-8"))
                                      for p in folder.glob("cases/*/case.json")])
        if named in folders:
            raise AssertionError(f"{folder} and {folders[named]} both record class {named}")
        folders[named] = folder
        for record in sorted(folder.glob(f"cases/*/{RECORD}")):
            own = ROOT / "cases" / record.parent.name / RECORD
            if own.is_file():
                base, other = load_file(str(own)), load_file(str(record))
                bounds = merge_bounds(bounds, measured_bounds(base, other))
                relative = merge_bounds(relative, measured_bounds(base, other, relative=True))
    return {"folders": folders, "bounds": bounds, "relative": relative}


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
        from mizuoto.testing.cpu_recordings import Comparison, recorded_on, this_class

        cpu, found = this_class(), _classes()
        folder = found["folders"].get(cpu)
        if folder is not None and (folder / "cases" / self.name / RECORD).is_file():
            return Comparison(cpu, folder, True, found["bounds"], found["relative"], what="Chatterbox cases")
        return Comparison(cpu, None, cpu in recorded_on(ROOT), found["bounds"], found["relative"],
                          what="Chatterbox cases")

    def tensors(self) -> dict:
        """The case's recorded tensors: this CPU class's record where the tree has one."""
        folder = self.cpu.folder
        return load_file(str((folder / "cases" / self.name if folder else self.path) / RECORD))

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
    found = cases()
    exact = [c for c in found if c.cpu.exact]
    line = found[0].cpu.describe() if found else "no Chatterbox cases"
    if found and len(exact) not in (0, len(found)):
        line += f" ({len(exact)} of {len(found)} cases recorded on this class; the rest as unrecorded)"
    terminalreporter.write_line(line)
