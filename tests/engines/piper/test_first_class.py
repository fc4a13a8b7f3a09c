"""Piper as a first-class engine: a short id, a model named after its voice, `mizuoto bench` through the
engine contract, and the figures drawn (`--plot`) for it and for `models --plan`."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from mizuoto.cli.main import main
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.hub import resolve_model

mizuoto_piper = pytest.importorskip("mizuoto_piper")
VOICE = "en_US-joe-medium"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_the_default_voice_has_a_short_id_and_its_own_name(tmp_path):
    folder = mizuoto_piper.default_voice_dir()
    assert folder.name == "data"  # the pinned package's folder: never the model's name
    assert resolve_model(VOICE) == folder
    copy = tmp_path / "voices" / "some-folder"
    shutil.copytree(folder, copy)
    with Runtime() as rt:
        assert rt.load(VOICE, device="cpu") == VOICE
        assert rt.load(str(folder), device="cpu") == f"{VOICE}-2"  # the same voice again: a unique name
        assert rt.load(str(copy), device="cpu") == f"{VOICE}-3"
        assert rt.registry.model_name(copy) == VOICE


def test_serve_names_piper_models_after_their_voice():
    from mizuoto.cli.serve import _models

    assert _models([VOICE]) == {VOICE: mizuoto_piper.default_voice_dir()}
    assert _models([str(mizuoto_piper.default_voice_dir())]) == {VOICE: mizuoto_piper.default_voice_dir()}
    assert _models([f"p={VOICE}"]) == {"p": mizuoto_piper.default_voice_dir()}


def test_bench_runs_piper_through_the_engine_contract(capsys, tmp_path):
    plot = tmp_path / "bench.png"
    assert main(["bench", "-m", VOICE, "--device", "cpu", "--runs", "2", "--warmup", "0", "--json",
                 "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["contract"]
    assert c["model"] == f"piper {VOICE}" and c["device"] == "cpu" and c["voice"] == "joe" and c["streamed"]
    assert len(c["runs"]) == 2 and c["load_s"] > 0
    assert 0 < c["first_chunk_ms"] <= c["wall_ms"] and c["audio_seconds"] > 1 and 0 < c["rtf"] < 10
    assert "lm_ms_per_token" not in out  # Piper has no per-stage driver: the contract is the result
    assert _png_size(plot) == (800, 450)
    assert main(["bench", "-m", VOICE, "--device", "cpu", "--runs", "1", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("engine contract (Runtime.synthesize)") and "first chunk" in text and "RTF" in text


def test_models_plan_plot(capsys, tmp_path, tone_dir):
    plot = tmp_path / "plan.png"
    assert main(["models", "--plan", str(tone_dir), VOICE, "--device", "cpu", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert f"model {VOICE} on cpu" in out and f"plotted 2 plan(s) in {plot}" in out
    assert _png_size(plot) == (800, 450)


@pytest.mark.parametrize("argv, message", [
    (["models", "--plan", "M", "--plot", "plan.svg"], "figures are written as PNG"),
    (["models", "M", "--plot", "plan.png"], "add --plan"),
    (["bench", "-m", "M", "--plot", "b.jpg"], "figures are written as PNG"),
])
def test_plot_mistakes_are_one_line_before_any_work(capsys, tmp_path, tone_dir, argv, message):
    argv = [str(tone_dir) if a == "M" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plot_without_matplotlib_names_the_extra(capsys, tone_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["models", "--plan", str(tone_dir), "--plot", "p.png"]) == 1
    assert "pip install 'mizuoto-runtime[plot]'" in capsys.readouterr().err
