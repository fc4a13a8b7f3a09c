"""The `mizuoto` command: engines, models --plan, say; errors are one line with a non-zero exit."""

import subprocess
import sys
from pathlib import Path

import pytest
import soundfile
import torch

from mizuoto.cli.main import build_parser, main
from mizuoto.runtime.options import ComputeOptions, LoadOptions, options_from_args

# Where a request runs when no --device is given: the device every default must name.
DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

MIZUOTO = str(Path(sys.executable).with_name("mizuoto"))


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_engines_lists_plugins_and_failures(capsys):
    code, out, err = _run(capsys, "engines")
    assert code == 0 and err == ""
    assert "tone         [toy] modes clone,cross_lingual,instruct,preset,vc; 16000 Hz; stream out" in out
    assert "unavailable: broken-import: import failed: ImportError" in out
    assert "unavailable: broken-hook: mizuoto_engines failed: RuntimeError: deliberately broken hook" in out


def test_say_writes_wav(capsys, tone_dir, tmp_path):
    out_wav = tmp_path / "out" / "a.wav"
    code, out, err = _run(capsys, "say", "hello world", "-m", tone_dir, "-o", out_wav, "--voice", "low",
                          "--seed", 1)
    assert (code, err) == (0, "")
    assert out.startswith(f"wrote {out_wav}: 0.60 s at 16000 Hz in 1 chunk(s) (tone engine on {DEFAULT_DEVICE})")
    audio, rate = soundfile.read(out_wav, dtype="float32")
    assert rate == 16000 and audio.shape == (9600,)
    clone = tmp_path / "clone.wav"
    code, out, err = _run(capsys, "say", "hi again", "-m", tone_dir, "-o", clone, "--ref-audio", out_wav,
                          "--ref-text", "hello world", "--stream", "--seed", 2, "--option", "compute.kv_cache=static",
                          "--precision", "fp32", "--device", "cpu")
    assert code == 0 and "in 2 chunk(s)" in out
    assert soundfile.info(clone).frames == 7 * 960
    code, out, err = _run(capsys, "say", "--mode", "vc", "--source-audio", out_wav, "--voice", "high", "-m", tone_dir,
                          "-o", tmp_path / "vc.wav")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clone.wav", "out", "tone", "vc.wav"]  # no temp files


@pytest.mark.parametrize("args,message", [
    (["say", "", "--voice", "low"], "mizuoto: error: text is empty"),
    (["say", "hi", "--voice", "nobody"], "mizuoto: error: unknown voice 'nobody'; this model has: high, low"),
    (["say", "hi", "--voice", "low", "--option", "colour=red"], "mizuoto: error: unknown option 'colour'"),
    (["say", "hi", "--voice", "low", "--option", "colour"], "mizuoto: error: --option takes KEY=VALUE"),
    (["say", "hi", "--voice", "low", "--engine", "nope"], "mizuoto: error: unknown engine 'nope'"),
    (["say", "hi", "--voice", "low", "--speed", "0"], "mizuoto: error: speed must be"),
    (["say", "hi", "--ref-text", "x"], "mizuoto: error: --ref-text needs --ref-audio"),
    (["say", "hi", "--ref-audio", "missing.wav"], "mizuoto: error: reference audio: audio file not found"),
])
def test_say_errors_are_one_line(capsys, tone_dir, tmp_path, args, message):
    code, out, err = _run(capsys, *args, "-m", tone_dir, "-o", tmp_path / "x.wav")
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "x.wav").exists()


def test_missing_model_dir_through_the_console_script(tmp_path):
    r = subprocess.run([MIZUOTO, "say", "hi", "-m", tmp_path / "nowhere", "-o", tmp_path / "x.wav"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"mizuoto: error: model directory not found: {tmp_path / 'nowhere'}\n"
    r = subprocess.run([MIZUOTO, "--debug", "say", "hi", "-m", tmp_path / "nowhere", "-o", tmp_path / "x.wav"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" in r.stderr and "ModelLoadError" in r.stderr


def test_models_detect(capsys, tone_dir, tmp_path):
    code, out, err = _run(capsys, "models", tone_dir, tmp_path)
    assert code == 0 and out == f"{tone_dir}: tone\n{tmp_path}: no engine recognises it\n"


def test_models_plan_defaults_to_the_device_a_request_uses(capsys, tone_dir):
    code, out, err = _run(capsys, "models", "--plan", tone_dir)
    assert (code, err) == (0, "")
    assert out.splitlines()[0].startswith(f"model tone on {DEFAULT_DEVICE}, non-streaming: resident, peak 1.84 MiB")
    assert out.splitlines()[-1].startswith(f"device {DEFAULT_DEVICE}: 1.84 MiB of ")


def test_models_plan_on_the_cpu_within_the_host_budget(capsys, tone_dir):
    code, out, err = _run(capsys, "models", "--plan", tone_dir, tone_dir, "--device", "cpu", "--ram", "3MiB")
    assert code == 0
    assert out.startswith("model tone on cpu, non-streaming: resident, peak 1.84 MiB of 3.00 MiB")
    assert "admitting tone-2 unloads tone" in out  # the host is the device: nowhere to offload to
    assert out.splitlines()[-1] == "device cpu: 1.84 MiB of 3.00 MiB in use; active: tone-2; offloaded: none"
    code, out, err = _run(capsys, "models", "--plan", tone_dir, "--device", "cpu", "--vram", "1GiB")
    assert code == 0 and out.splitlines()[0] == ("planning for cpu (as asked) within the host budget; --vram is a"
                                                 " GPU budget: add --device cuda to plan for it")


def test_models_plan_for_a_gpu_budget(capsys, tone_dir):
    """A GPU plan for --vram; without a GPU the first line says that it is a plan for a budget only."""
    no_gpu = "no cuda device on this machine: this is a cuda plan for the budget --vram"
    code, out, err = _run(capsys, "models", "--plan", tone_dir, "--device", "cuda", "--vram", "1GiB")
    assert code == 0 and (no_gpu in out) == (not torch.cuda.is_available())
    assert "model tone on cuda, non-streaming: resident, peak 1.84 MiB of 1.00 GiB" in out
    assert "offloaded: none" in out
    code, out, err = _run(capsys, "models", "--plan", tone_dir, tone_dir, "--device", "cuda", "--vram", "3MiB",
                          "--ram", "1GiB")
    assert code == 0 and "admitting tone-2 offloads tone" in out and "offloaded: tone" in out
    code, out, err = _run(capsys, "models", "--plan", tone_dir, "--device", "cuda", "--vram", "1MiB", "--stream")
    assert code == 1
    assert "refused: model tone does not fit 1.00 MiB on cuda" in out and "streaming keeps notes+render together" in out


def test_models_plan_for_a_missing_gpu_needs_a_budget(capsys, tone_dir):
    code, out, err = _run(capsys, "models", "--plan", tone_dir, "--device", "cuda")
    if torch.cuda.is_available():
        assert code == 0 and out.startswith("model tone on cuda")
    else:
        assert (code, out) == (1, "") and err.count("\n") == 1
        assert err.startswith("mizuoto: error: models --plan: there is no cuda device on this machine")
        assert "--vram SIZE" in err


# Each command that loads models, with the arguments it needs beside the load options.
LOADING_COMMANDS = [["say", "hi", "-m", "m", "-o", "o.wav"], ["models", "m"], ["serve"], ["bench", "m"], ["wyoming"]]


@pytest.mark.parametrize("argv", LOADING_COMMANDS, ids=lambda a: a[0])
def test_every_command_reads_load_options_with_the_one_parser(argv):
    args = build_parser().parse_args([*argv, "--device", "cpu", "--precision", "fp16",
                                      "--option", "compute.kv_cache=static", "--option", "compute.cuda_graphs=on"])
    assert options_from_args(args) == LoadOptions("cpu", "fp16", ComputeOptions("static", True, False))
    assert options_from_args(build_parser().parse_args(argv)) == LoadOptions()


def test_every_loading_command_is_checked():
    """A new command that takes load options must be added to LOADING_COMMANDS."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    loading = {name for name, p in sub.choices.items() if any("--option" in a.option_strings for a in p._actions)}
    assert loading and loading == {argv[0] for argv in LOADING_COMMANDS}


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["say", "hi"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.parametrize("argv", LOADING_COMMANDS, ids=lambda a: a[0])
def test_a_bad_load_option_is_one_line_in_every_command(capsys, tmp_path, argv):
    argv = [str(tmp_path / a) if a in ("m", "o.wav") else a for a in argv]
    code, out, err = _run(capsys, *argv, "--option", "colour=red")
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert err.startswith("mizuoto: error: unknown option 'colour'; known options: device, precision")
