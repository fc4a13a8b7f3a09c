"""The training parity fixtures (`train/<v>/data`, `train/<v>/<model>/runs.json`): discovery and comparisons; nothing is named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from mizuoto.engines.cosyvoice.train.session import f32_hex
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


def fewest_workers() -> list[tuple[Path, int]]:
    """Each recorded run once, with its smallest recorded worker count."""
    best: dict[Path, int] = {}
    for run, workers in train_runs():
        best[run] = min(workers, best.get(run, workers))
    return sorted(best.items())


RECORD_VALUES = ("loss", "acc", "lr", "grad_norm")
# The training fixtures hold one CPU class's run (cpu_recordings). On another class upstream's own
# losses and gradient norms move in their last bits; with no training recording of a second class,
# they are compared within the full-pipeline spread of the flow's mel (a forward pass of the same
# model), as a fraction of the value, and checkpoints (recorded as digests) by keys, shapes, dtypes.
TRAIN_TREE = "train"


def assert_same_float(got: float, want: float, where: str) -> None:
    """A recorded float32 training value: bit-equal on the recorded class, else within the borrowed spread."""
    from mizuoto.testing.cpu_recordings import FLOW_MEL, tree_comparison

    cpu = tree_comparison(TRAIN_TREE)
    if cpu.exact or float(got) == float(want):
        assert f32_hex(got) == f32_hex(want), f"{where}: {float(got)!r} ({f32_hex(got)}) != {want!r} ({f32_hex(want)})"
        return
    limit = cpu.bound(FLOW_MEL, torch.tensor([float(want)]))
    assert abs(float(got) - float(want)) <= limit, \
        f"{where}: {float(got)!r} differs from {want!r} by more than {limit:.3g} (no training recording of {cpu.cpu})"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_meta(run: Path, workers: int) -> dict:
    meta = json.loads((run / "runs.json").read_text(encoding="utf-8"))
    found = [r for r in meta["runs"].values() if int(r["num_workers"]) == workers]
    assert len(found) == 1
    return {**found[0], "start_sha256": meta["start_checkpoint"]["sha256"]}


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def first_differing_tensor(path: Path, expected: dict, compare_bytes: bool = True) -> str:
    """The first key (in the file's order) whose dtype, shape or (`compare_bytes`) bytes differ from tensors_sha256."""
    sd = torch.load(path, map_location="cpu", weights_only=True)
    for key, want in expected.items():
        got = sd.get(key)
        if "sha256" not in want:  # epoch / step
            if got != want.get("value"):
                return f"{key} ({got!r}, upstream {want.get('value')!r})"
            continue
        if not isinstance(got, torch.Tensor):
            return f"{key} (missing)"
        if list(got.shape) != list(want["shape"]) or str(got.dtype).removeprefix("torch.") != want["dtype"] \
                or (compare_bytes and tensor_sha256(got) != want["sha256"]):
            return key
    extra = [k for k in sd if isinstance(sd[k], torch.Tensor) and k not in expected]
    return f"{extra[0]} (unexpected)" if extra else "no tensor (key order, epoch/step or archive bytes)"


def check_records(kind: str, mine: list[dict], theirs: list[dict]) -> None:
    assert theirs, f"no {kind} records in the fixture"
    assert len(mine) == len(theirs), f"{kind}: {len(mine)} batches, upstream {len(theirs)}"
    for m, r in zip(mine, theirs):
        where = f"{kind} epoch {r['epoch']} batch {r['batch_idx']}"
        assert (m["epoch"], m["batch_idx"], m["step"]) == (r["epoch"], r["batch_idx"], r["step"]), where
        assert m["utts"] == r["utts"], f"{where}: batch utterances"
        if kind == "train":
            assert m["boundary"] == r["boundary"], f"{where}: boundary"
        for name in RECORD_VALUES:
            if name not in r:
                continue
            want = r[name]
            if want["f32"] is None:
                assert float(m[name]) == want["value"], f"{where}: {name} {float(m[name])!r} != {want['value']!r}"
            else:
                assert f32_hex(want["value"]) == want["f32"], f"{where}: {name}: the record's value and bits disagree"
                assert_same_float(m[name], want["value"], f"{where}: {name}")


def check_checkpoints(out: Path, run: Path, workers: int, meta: dict) -> None:
    from mizuoto.testing.cpu_recordings import tree_comparison

    tensors = json.loads((run / f"tensors_sha256_w{workers}.json").read_text(encoding="utf-8"))
    assert meta["sha256"]
    cpu = tree_comparison(TRAIN_TREE)
    for name, want in meta["sha256"].items():
        path = out / name
        assert path.is_file(), f"{name} was not written"
        if not cpu.exact:  # digests only: the bytes are not checkable on a class with no training recording
            if name in tensors:
                found = first_differing_tensor(path, tensors[name], compare_bytes=False)
                assert found.startswith("no tensor"), f"{name}: {found} (keys, shapes, dtypes)"
            print(f"{name}: bytes not checkable on CPU class {cpu.cpu} (no training recording)")
            continue
        if sha256(path) != want:
            detail = first_differing_tensor(path, tensors[name]) if name in tensors else "see the file"
            raise AssertionError(f"{name}: sha256 differs from upstream; first differing tensor: {detail}")
        if name in tensors:  # the per-tensor record agrees too (and keeps the diagnosis honest)
            assert first_differing_tensor(path, tensors[name]).startswith("no tensor"), name
