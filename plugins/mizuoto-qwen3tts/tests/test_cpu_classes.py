"""The per-class re-recordings (fixtures/cpu/<folder>/, fixtures/README.md) stand beside the tree's own.

Each folder names one CPU class the tree's own recording is not known to hold for, holds whole
records of the same cases (same keys, dtypes and shapes), keeps every integer tensor and every
case.json field but the class fields, and differs somewhere in a float tensor (no identical copy).
Files only: nothing here depends on this machine's class.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mizuoto.testing.cpu_recordings import CPU_FOLDER, CpuClass, folder_class, recorded_on

ROOT = Path(os.environ.get("MIZUOTO_QWEN3TTS_FIXTURES", Path(__file__).parent / "fixtures"))
RECORD = "record.safetensors"
CLASS_FIELDS = ("cpu_class", "cpu", "isa_caps", "torch_cpu_capability")  # record.py's CLASS_FIELDS
FOLDERS = sorted(p for p in (ROOT / CPU_FOLDER).glob("*") if (p / "cases").is_dir())


def _metas(folder: Path) -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("cases/*/case.json"))]


@pytest.mark.parametrize("folder", FOLDERS or [None], ids=[f.name for f in FOLDERS] or ["none"])
def test_a_class_folder_names_a_class_of_its_own(folder):
    if folder is None:  # another tree of this layout may hold its own recording only
        pytest.skip("this tree holds no per-class re-recording")
    named = folder_class(folder, _metas(folder))
    assert named == folder_class(folder), f"{folder.name}: its case.json files name {named}"
    assert named not in recorded_on(ROOT), f"{folder.name}: {named} is a class the tree's own recording holds for"
    others = [f.name for f in FOLDERS if f != folder and folder_class(f, _metas(f)) == named]
    assert not others, f"{folder.name} and {others} record the same class {named}"
    CpuClass.parse(named.name)


@pytest.mark.parametrize("folder", FOLDERS or [None], ids=[f.name for f in FOLDERS] or ["none"])
def test_a_class_folder_keeps_the_integers_and_differs_in_some_float(folder):
    if folder is None:
        pytest.skip("this tree holds no per-class re-recording")
    floats_differ = 0
    cases = sorted(p for p in (folder / "cases").iterdir() if (p / "case.json").is_file())
    assert cases, f"{folder.name} holds no case"
    for theirs_dir in cases:
        own_dir = ROOT / "cases" / theirs_dir.name
        assert (own_dir / RECORD).is_file(), f"{folder.name}/{theirs_dir.name}: the tree has no such case"
        own, theirs = load_file(str(own_dir / RECORD)), load_file(str(theirs_dir / RECORD))
        assert own.keys() == theirs.keys(), f"{theirs_dir.name}: keys {sorted(own.keys() ^ theirs.keys())}"
        for key, value in own.items():
            other = theirs[key]
            assert (other.dtype, other.shape) == (value.dtype, value.shape), f"{theirs_dir.name} {key}"
            if not value.is_floating_point():
                assert torch.equal(other, value), f"{folder.name}/{theirs_dir.name}: integer tensor {key} differs"
            else:
                floats_differ += not torch.equal(other, value)
        meta = json.loads((theirs_dir / "case.json").read_text(encoding="utf-8"))
        own_meta = json.loads((own_dir / "case.json").read_text(encoding="utf-8"))
        assert {k: v for k, v in meta.items() if k not in CLASS_FIELDS} == own_meta, theirs_dir.name
    assert floats_differ, f"{folder.name} is a copy of the tree's own recording: name its class in cpu.json instead"
