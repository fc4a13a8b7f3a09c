"""`mizuoto train cosyvoice` end to end: CLI stages, export + averaging, and every bad input as one line."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from mizuoto.cli.main import main
from mizuoto.engines.cosyvoice.train.export import average_checkpoints
from mizuoto.engines.cosyvoice.variants import VARIANTS, find_variant
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.testing.train_cases import train_runs

LLM_RUNS = sorted({run for run, _ in train_runs() if run.name == "llm"})
assert LLM_RUNS, "no recorded llm training runs"
RUN = LLM_RUNS[0]  # any one run: these tests check plumbing, not numbers


def _train_args(model_dir: Path, data: Path, out: Path, *extra: str, method: str = "llm",
                config: Path | None = None) -> list[str]:
    return ["train", "cosyvoice", "--method", method, "--from", str(model_dir), "--data", str(data),
            "--out", str(out), "--config", str(config or RUN / "train.yaml"), *extra]


@pytest.fixture
def data_copy(tmp_path) -> Path:
    """A writable copy of the run's recipe folder (wav.scp paths are relative)."""
    dest = tmp_path / "data"
    shutil.copytree(RUN.parent / "data", dest, ignore=shutil.ignore_patterns("parquet"))
    return dest


def _one_line_error(capsys, argv: list[str], *words: str) -> str:
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mizuoto: error: ") and "\n" not in err, err
    for w in words:
        assert w in err, err
    return err


def _untouched(out: Path) -> None:
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))


@pytest.mark.parametrize("run", LLM_RUNS, ids=lambda r: r.parent.name)
def test_train_features_llm_export_then_say(capsys, assembled, tmp_path, run):
    model_dir = assembled(run.parent)
    out = tmp_path / "run"
    assert main(_train_args(model_dir, run.parent / "data", out, method="llm_flow", config=run / "train.yaml")) == 0
    for name in ("utt2speech_token.pt", "utt2embedding.pt", "spk2embedding.pt"):
        assert (out / "features" / name).is_file()
    export = out / "export"
    for model in ("llm", "flow"):
        epochs = sorted((out / model).glob("epoch_*_whole.pt"))
        assert epochs and (out / model / "init.pt").is_file() and (out / model / "metrics.json").is_file()
        trained = torch.load(export / f"{model}.pt", map_location="cpu", weights_only=True)
        start = torch.load(model_dir / f"{model}.pt", map_location="cpu", weights_only=True)
        assert list(trained) == list(start)
        assert any(not torch.equal(trained[k], start[k]) for k in start), f"the exported {model}.pt is untrained"
    # the export is the start dir with the trained weights: Mizuoto loads it and speaks
    rt = Runtime()
    model = rt.load(str(export))
    wav = run.parent / "data" / sorted((run.parent / "data" / "wavs").iterdir())[0]
    text = (run.parent / "data" / "text").read_text(encoding="utf-8").splitlines()[0].split(maxsplit=1)[1]
    chunks = list(rt.synthesize(model, SynthesisRequest(text="Hello there.", voice=Reference(str(wav), text), seed=0)))
    assert chunks and chunks[-1].final and chunks[0].samples.numel() > 0
    # a second run into the same --out is refused; --resume continues (no epoch left: nothing retrained)
    _one_line_error(capsys, _train_args(model_dir, run.parent / "data", out, method="llm_flow", config=run / "train.yaml"),
                    "already holds a run", "--resume")
    before = (out / "llm" / "init.pt").read_bytes()
    assert main(_train_args(model_dir, run.parent / "data", out, "--resume", "--stage", "llm", "--stage", "export",
                           config=run / "train.yaml")) == 0
    assert (out / "llm" / "init.pt").read_bytes() == before
    assert (export / "llm.pt").is_file() and not any(p.name.startswith(".") for p in out.iterdir())


def test_nothing_left_after_the_filter_is_one_line(capsys, assembled, tmp_path):
    """A yaml whose filter keeps no utterance fails in one line instead of training on nothing."""
    text = (RUN / "train.yaml").read_text(encoding="utf-8")
    strict = re.sub(r"(\n    max_length: )\d+", r"\g<1>1", text, count=1)
    assert strict != text
    (tmp_path / "strict.yaml").write_text(strict, encoding="utf-8")
    argv = _train_args(assembled(RUN.parent), RUN.parent / "data", tmp_path / "out", "--stage", "llm")
    argv[argv.index("--config") + 1] = str(tmp_path / "strict.yaml")
    _one_line_error(capsys, argv, "no utterance passed")


def test_averaging_one_epoch_gives_that_epoch(assembled, tmp_path):
    model_dir = assembled(RUN.parent)
    out = tmp_path / "run"
    assert main(_train_args(model_dir, RUN.parent / "data", out, "--stage", "features", "--stage", "llm")) == 0
    epochs = sorted((out / "llm").glob("epoch_*_whole.pt"))
    assert epochs
    for path in epochs:
        one = average_checkpoints([path])
        saved = torch.load(path, map_location="cpu", weights_only=True)
        tensors = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
        assert list(one) == list(tensors)
        for key, value in tensors.items():
            assert torch.equal(one[key], value), key


def test_missing_wav_is_one_line(capsys, assembled, data_copy, tmp_path):
    victim = sorted((data_copy / "wavs").iterdir())[0]
    victim.unlink()
    _one_line_error(capsys, _train_args(assembled(RUN.parent), data_copy, tmp_path / "out"), victim.stem, "not found")
    _untouched(tmp_path / "out")


def test_unreadable_wav_is_one_line(capsys, assembled, data_copy, tmp_path):
    victim = sorted((data_copy / "wavs").iterdir())[0]
    victim.write_bytes(b"this is not audio at all")
    _one_line_error(capsys, _train_args(assembled(RUN.parent), data_copy, tmp_path / "out"), victim.stem)
    _untouched(tmp_path / "out")


def test_utterance_without_text_is_one_line(capsys, assembled, data_copy, tmp_path):
    lines = (data_copy / "text").read_text(encoding="utf-8").splitlines()
    utt = lines[0].split()[0]
    (data_copy / "text").write_text("\n".join(lines[1:]) + "\n", encoding="utf-8")
    _one_line_error(capsys, _train_args(assembled(RUN.parent), data_copy, tmp_path / "out"), utt, "text")
    _untouched(tmp_path / "out")


def test_wav_scp_line_without_path_is_one_line(capsys, assembled, data_copy, tmp_path):
    lines = (data_copy / "wav.scp").read_text(encoding="utf-8").splitlines()
    utt = lines[0].split()[0]
    (data_copy / "wav.scp").write_text("\n".join([utt] + lines[1:]) + "\n", encoding="utf-8")
    _one_line_error(capsys, _train_args(assembled(RUN.parent), data_copy, tmp_path / "out"), utt, "wav.scp")
    _untouched(tmp_path / "out")


def test_audio_shorter_than_one_token_is_one_line(capsys, assembled, data_copy, tmp_path):
    victim = sorted((data_copy / "wavs").iterdir())[0]
    rate = sf.info(str(victim)).samplerate
    sf.write(str(victim), np.zeros(rate // 200, dtype=np.float32), rate, subtype="PCM_16")  # 5 ms
    _one_line_error(capsys, _train_args(assembled(RUN.parent), data_copy, tmp_path / "out"), victim.stem,
                    "shorter than one speech token")
    _untouched(tmp_path / "out")


def test_start_dir_of_another_variant_is_one_line(capsys, assembled, tmp_path):
    """A --config whose LM class belongs to another generation than the start dir is refused."""
    model_dir = assembled(RUN.parent)
    ours = find_variant(model_dir)
    other = next(v for v in VARIANTS if v.llm_classes != ours.llm_classes)
    text = (RUN / "train.yaml").read_text(encoding="utf-8")
    swapped = re.sub(r"(^llm: !new:[\w.]*\.)(\w+)", lambda m: m.group(1) + other.llm_classes[0], text, count=1,
                     flags=re.M)
    assert swapped != text
    (tmp_path / "other.yaml").write_text(swapped, encoding="utf-8")
    argv = _train_args(model_dir, RUN.parent / "data", tmp_path / "out")
    argv[argv.index("--config") + 1] = str(tmp_path / "other.yaml")
    _one_line_error(capsys, argv, "--config", "start dir", other.llm_classes[0])
    _untouched(tmp_path / "out")


def test_dir_without_a_cosyvoice_yaml_is_one_line(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, _train_args(tmp_path / "empty", RUN.parent / "data", tmp_path / "out"), "CosyVoice yaml")
    _untouched(tmp_path / "out")


def test_unknown_train_option_is_one_line(capsys, assembled, tmp_path):
    argv = _train_args(assembled(RUN.parent), RUN.parent / "data", tmp_path / "out", "--train-option", "training.speed=on")
    _one_line_error(capsys, argv, "training.speed")
    _untouched(tmp_path / "out")


def test_instructed_lm_without_instruct_list_is_one_line(capsys, assembled, tmp_path):
    """An LM that trains on instructions refuses a recipe without them (others do not need one)."""
    from mizuoto.engines.cosyvoice.train.stages import INSTRUCTED_LMS
    from mizuoto.runtime.hyperyaml import load_hyperyaml

    runs = [r for r in LLM_RUNS if load_hyperyaml(r / "train.yaml")["llm"].cls in INSTRUCTED_LMS]
    assert runs, "no recorded run of an instructed LM"
    data = tmp_path / "data"
    shutil.copytree(runs[0].parent / "data", data, ignore=shutil.ignore_patterns("parquet", "instruct"))
    argv = ["train", "cosyvoice", "--method", "llm", "--from", str(assembled(runs[0].parent)), "--data", str(data),
            "--out", str(tmp_path / "out"), "--config", str(runs[0] / "train.yaml")]
    _one_line_error(capsys, argv, "instruct")
    _untouched(tmp_path / "out")


def test_cli_llm_stage_reproduces_upstream(assembled, tmp_path):
    """`mizuoto train ... --stage llm --threads 1` on upstream's features writes upstream's checkpoints."""
    from mizuoto.testing.train_cases import check_checkpoints, run_meta

    workers = min(w for r, w in train_runs() if r == RUN)
    out = tmp_path / "run"
    argv = _train_args(assembled(RUN.parent), RUN.parent / "data", out, "--stage", "llm", "--threads", "1",
                       "--workers", str(workers))
    assert main(argv) == 0
    check_checkpoints(out / "llm", RUN, workers, run_meta(RUN, workers))


def test_progress_is_a_bar_on_a_terminal_and_lines_otherwise():
    import io

    from mizuoto.engines.cosyvoice.train.stages import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    records = [("train", {"epoch": 0, "batch_idx": i, "loss": 1.5, "lr": 1e-5, "grad_norm": 0.0}) for i in range(3)]
    records.append(("cv", {"epoch": 0, "batch_idx": 0, "loss": 2.5}))
    plain, tty = io.StringIO(), Terminal()
    for stream in (plain, tty):
        progress = Progress(stream)
        for kind, record in records:
            progress(kind, record)
    assert plain.getvalue().count("\n") == 4 and "\r" not in plain.getvalue()
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().count("\n") == 2
    assert "lr 0.00001000" in tty.getvalue() and "loss 1.500000" in tty.getvalue()


def test_train_option_memory_is_parsed():
    from mizuoto.cli.main import build_parser

    args = build_parser().parse_args(_train_args(Path("m"), Path("d"), Path("o"), "--train-option", "training.memory=on"))
    from mizuoto.cli.train import _options

    assert _options(args.train_option) == {"memory": True}
    assert _options(["training.memory=off"]) == {"memory": False} and _options(None) == {}
