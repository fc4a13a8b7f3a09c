"""`mizuoto train` reproduces upstream's recorded runs: every per-batch record bit for bit, every checkpoint's sha256.

Runs are discovered from the fixture tree (`train/<v>/<model>/runs.json` + `metrics_w<N>.json`);
the start checkpoint is the fixture model dir's `<model>.pt`, checked against runs.json first.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.train.session import StageSpec, f32_hex, run_training
from mizuoto.testing.train_cases import model_dir_of, train_runs

RUNS = train_runs()
RECORD_VALUES = ("loss", "acc", "lr", "grad_norm")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_meta(run: Path, workers: int) -> dict:
    meta = json.loads((run / "runs.json").read_text(encoding="utf-8"))
    found = [r for r in meta["runs"].values() if int(r["num_workers"]) == workers]
    assert len(found) == 1
    return {**found[0], "start_sha256": meta["start_checkpoint"]["sha256"]}


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def first_differing_tensor(path: Path, expected: dict) -> str:
    """The first key (in the file's order) whose dtype, shape or bytes differ from tensors_sha256."""
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
                or tensor_sha256(got) != want["sha256"]:
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
                assert f32_hex(m[name]) == want["f32"], \
                    f"{where}: {name} {float(m[name])!r} ({f32_hex(m[name])}) != {want['value']!r} ({want['f32']})"


def check_checkpoints(out: Path, run: Path, workers: int, meta: dict) -> None:
    tensors = json.loads((run / f"tensors_sha256_w{workers}.json").read_text(encoding="utf-8"))
    assert meta["sha256"]
    for name, want in meta["sha256"].items():
        path = out / name
        assert path.is_file(), f"{name} was not written"
        if sha256(path) != want:
            detail = first_differing_tensor(path, tensors[name]) if name in tensors else "see the file"
            pytest.fail(f"{name}: sha256 differs from upstream; first differing tensor: {detail}")
        if name in tensors:  # the per-tensor record agrees too (and keeps the diagnosis honest)
            assert first_differing_tensor(path, tensors[name]).startswith("no tensor"), name


def train_run(run: Path, workers: int, model_dir: Path, out: Path, memory: bool = False):
    meta = run_meta(run, workers)
    start = model_dir_of(run.parent) / f"{run.name}.pt"
    assert sha256(start) == meta["start_sha256"], f"{start} is not the recorded start checkpoint"
    spec = StageSpec(run.name, model_dir, run.parent / "data", out, run / "train.yaml", workers=workers, memory=memory)
    return run_training(spec), meta


@pytest.mark.parametrize("run,workers", RUNS, ids=[f"{r.parent.name}-{r.name}-w{w}" for r, w in RUNS])
def test_run_matches_upstream(run, workers, assembled, tmp_path):
    log, meta = train_run(run, workers, assembled(run.parent), tmp_path)
    ref = json.loads((run / f"metrics_w{workers}.json").read_text(encoding="utf-8"))
    check_records("train", log.train, ref["train"])
    check_records("cv", log.cv, ref["cv"])
    assert [(s["name"], s["epoch"], s["step"]) for s in log.saves] == \
        [(s["name"], s["epoch"], s["step"]) for s in ref["saves"]]
    for mine, theirs in zip(log.cv_summary, ref["cv_summary"]):
        assert mine["loss_dict"] == theirs["loss_dict"]
    check_checkpoints(tmp_path / run.name, run, workers, meta)


def _fewest_workers() -> list[tuple[Path, int]]:
    best: dict[Path, int] = {}
    for run, workers in RUNS:
        best[run] = min(workers, best.get(run, workers))
    return sorted(best.items())


@pytest.mark.parametrize("run,workers", _fewest_workers(), ids=lambda x: f"{x.parent.name}-{x.name}" if isinstance(x, Path) else f"w{x}")
def test_memory_option_gives_the_same_checkpoints(run, workers, assembled, tmp_path):
    """training.memory (gradient checkpointing) changes nothing: same records and checkpoint bytes."""
    log, meta = train_run(run, workers, assembled(run.parent), tmp_path, memory=True)
    ref = json.loads((run / f"metrics_w{workers}.json").read_text(encoding="utf-8"))
    check_records("train", log.train, ref["train"])
    check_checkpoints(tmp_path / run.name, run, workers, meta)


@pytest.mark.parametrize("run,workers", _fewest_workers(), ids=lambda x: f"{x.parent.name}-{x.name}" if isinstance(x, Path) else f"w{x}")
def test_memory_option_holds_fewer_activations(run, workers, assembled, tmp_path):
    """With training.memory the first batch's forward keeps fewer bytes for backward."""
    from mizuoto.engines.cosyvoice.train.memory import activation_bytes, checkpoint_blocks
    from mizuoto.engines.cosyvoice.train.session import (build_model, make_loaders, model_forward, open_model_dir,
                                                         train_config)

    spec = StageSpec(run.name, assembled(run.parent), run.parent / "data", tmp_path, run / "train.yaml")
    variant, model_config = open_model_dir(spec.model_dir)
    config = train_config(spec, variant, model_config)
    batch = next(iter(make_loaders(spec, variant, config).train))
    sizes = []
    for memory in (False, True):
        model, _, _ = build_model(spec, config)
        if memory:
            checkpoint_blocks(model)
        torch.manual_seed(0)
        sizes.append(activation_bytes(model, model_forward(model, config, memory), batch, torch.device("cpu")))
    assert 0 < sizes[1] < sizes[0], sizes
