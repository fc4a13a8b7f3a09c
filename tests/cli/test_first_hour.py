"""What a new user meets first: files in the format their name says, feedback on slow work (progress
on stderr in a terminal, log lines), a parser that imports no torch, the input limit, the mode named."""

from __future__ import annotations

import io
import logging
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from mizuoto import progress
from mizuoto.cli import bench as cli_bench
from mizuoto.cli.main import MAX_INPUT_CHARS, MODES, build_parser, configure_logging, main
from mizuoto.nn.dsp.encode import available_formats

MIZUOTO = [sys.executable, "-m", "mizuoto.cli"]


def _say(capsys, tone_dir, out, *extra):
    code = main(["say", "hello world", "-m", str(tone_dir), "-o", str(out), "--voice", "low", "--seed", "1", *extra])
    o, e = capsys.readouterr()
    return code, o, e


# --- output formats, checked by content --------------------------------------------------------------------

def _magic(data: bytes, fmt: str) -> bool:
    if fmt == "wav":
        return data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    if fmt == "flac":
        return data[:4] == b"fLaC"
    if fmt == "mp3":  # an ID3 tag or an MPEG audio frame sync
        return data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
    if fmt == "opus":
        return data[:4] == b"OggS" and b"OpusHead" in data[:100]
    if fmt == "aac":  # ADTS sync word
        return data[0] == 0xFF and data[1] & 0xF6 == 0xF0
    raise AssertionError(fmt)


@pytest.mark.parametrize("suffix, fmt", [(".wav", "wav"), (".mp3", "mp3"), (".flac", "flac"), (".ogg", "opus"),
                                         (".opus", "opus"), (".aac", "aac"), (".MP3", "mp3")])
def test_say_writes_the_format_its_name_says(capsys, tone_dir, tmp_path, suffix, fmt):
    if fmt not in available_formats():
        pytest.skip(f"no {fmt} encoder here")
    out = tmp_path / f"out{suffix}"
    code, o, e = _say(capsys, tone_dir, out)
    assert code == 0, e
    data = out.read_bytes()
    assert _magic(data, fmt), data[:16]
    if fmt in ("wav", "flac", "mp3", "opus"):
        info = soundfile.info(out)
        assert info.frames > 0
        if fmt == "wav":  # PCM16, as the server writes it, and the samples are the server's rounding
            assert info.subtype == "PCM_16" and info.samplerate == 16000 and info.frames == 9600
    assert o.rstrip().endswith("16-bit PCM wav" if fmt == "wav" else fmt)


def test_float_wav_and_raw_pcm(capsys, tone_dir, tmp_path):
    code, o, e = _say(capsys, tone_dir, tmp_path / "f.wav", "--float")
    assert code == 0 and soundfile.info(tmp_path / "f.wav").subtype == "FLOAT" and "32-bit float wav" in o, e
    assert _say(capsys, tone_dir, tmp_path / "r.pcm")[0] == 0
    assert _say(capsys, tone_dir, tmp_path / "p.wav")[0] == 0
    wav16, _ = soundfile.read(tmp_path / "p.wav", dtype="int16")
    raw = np.frombuffer((tmp_path / "r.pcm").read_bytes(), "<i2")
    assert raw.size == 9600 and raw.tolist() == wav16.tolist()  # the same PCM16 samples, headerless


@pytest.mark.parametrize("name, message", [("out.xyz", "cannot tell the audio format from '.xyz'"),
                                           ("out", "a name without an extension"),
                                           ("out.mp3 --float", "--float writes a float WAV")])
def test_an_unknown_extension_is_a_clear_error_before_any_work(capsys, tone_dir, tmp_path, name, message):
    name, *extra = name.split()
    code, o, e = _say(capsys, tone_dir, tmp_path / name, *extra)
    assert (code, o) == (1, "") and e.count("\n") == 1 and message in e, e
    assert not (tmp_path / name).exists()


def test_aac_without_pyav_names_the_extra(capsys, tone_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    code, _, e = _say(capsys, tone_dir, tmp_path / "x.aac")
    assert code == 1 and "pip install 'mizuoto-runtime[aac]'" in e


# --- say: the input limit and the mode it used --------------------------------------------------------------

def test_say_takes_the_servers_input_limit(capsys, tone_dir, tmp_path):
    from mizuoto.server.state import ServerConfig

    assert MAX_INPUT_CHARS == ServerConfig().max_input_chars == 4096
    code, o, e = _say(capsys, tone_dir, tmp_path / "x.wav", "--max-input-chars", "5")
    assert code == 1 and "11 characters, more than 5" in e and "--max-input-chars" in e
    assert not (tmp_path / "x.wav").exists()
    long = "a" * (MAX_INPUT_CHARS + 1)
    assert main(["say", long, "-m", str(tone_dir), "-o", str(tmp_path / "y.wav"), "--voice", "low"]) == 1
    assert "4,097 characters, more than 4,096" in capsys.readouterr().err


def test_say_names_the_mode_it_used(capsys, tone_dir, tmp_path):
    code, o, e = _say(capsys, tone_dir, tmp_path / "ref.wav")
    assert code == 0 and "mode preset" in o
    assert main(["say", "hi", "-m", str(tone_dir), "-o", str(tmp_path / "c.wav"),
                 "--ref-audio", str(tmp_path / "ref.wav")]) == 0
    o = capsys.readouterr().out
    assert "mode cross_lingual (no --ref-text" in o
    assert main(["say", "hi", "-m", str(tone_dir), "-o", str(tmp_path / "d.wav"),
                 "--ref-audio", str(tmp_path / "ref.wav"), "--ref-text", "hello world"]) == 0
    assert "; mode clone," in capsys.readouterr().out


# --- the parser: no torch -----------------------------------------------------------------------------------

_NO_TORCH = """
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not importable in this test")
sys.meta_path.insert(0, _Refuse())
"""


def _without_torch(tmp_path, *argv, code: str | None = None) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_NO_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", code] if code else [*MIZUOTO, *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_the_parser_is_built_without_torch(tmp_path):
    probe = _without_torch(tmp_path, code="import torch")
    assert probe.returncode != 0 and "not importable" in probe.stderr  # the block works
    built = _without_torch(tmp_path, code="from mizuoto.cli.main import build_parser\n"
                                          "p = build_parser()\n"
                                          "for argv in (['say', 'hi', '-m', 'm', '-o', 'o.wav'], ['bench', '-m', 'm'],"
                                          " ['models', '--plan', 'm', '--plot', 'p.png'],"
                                          " ['fetch', 'whisper-vocab']):\n"
                                          "    p.parse_args(argv)\n"
                                          "import sys; assert 'torch' not in sys.modules")
    assert built.returncode == 0, built.stderr
    helped = _without_torch(tmp_path, "--help")
    assert helped.returncode == 0 and "say" in helped.stdout and "bench" in helped.stdout, helped.stderr
    for command in ("say", "bench", "models", "serve", "wyoming", "train", "fetch", "engines", "ray-serve"):
        sub = _without_torch(tmp_path, command, "--help")
        assert sub.returncode == 0 and "--log-level" in sub.stdout, (command, sub.stderr)
    typo = _without_torch(tmp_path, "sya")
    assert typo.returncode == 2 and "invalid choice: 'sya'" in typo.stderr


def test_the_parsers_spellings_match_what_they_stand_for():
    from mizuoto.runtime import bench, bench_memory, engine

    assert MODES == engine.MODES
    assert cli_bench.HELP_DEFAULTS == {k: (getattr(bench.BenchSettings, k), bench.CPU_DEFAULTS[k])
                                       for k in bench.CPU_DEFAULTS}
    assert cli_bench.MEMORY_SECONDS == ",".join(str(x) for x in bench_memory.SECONDS)


# --- logging and progress -----------------------------------------------------------------------------------

def test_every_command_configures_logging(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert all("--log-level" in p._option_string_actions and "--progress" in p._option_string_actions
               for p in sub.choices.values())
    restore = configure_logging("info")
    try:
        logging.getLogger("mizuoto.somewhere").info("loading the thing")
        logging.getLogger("some.library").info("chatter")
    finally:
        restore()
    err = capsys.readouterr().err
    assert "mizuoto: INFO: loading the thing" in err and "chatter" not in err
    restore = configure_logging("warning")
    try:
        logging.getLogger("mizuoto.somewhere").info("hidden")
    finally:
        restore()
    assert "hidden" not in capsys.readouterr().err
    assert not any(type(h).__name__ == "_StderrHandler" for h in logging.getLogger().handlers)  # put back


def _in_a_terminal(argv: list[str], timeout: float = 240) -> tuple[int, str, str]:
    """Run the command with stderr on a pseudo-terminal (stdout a pipe); returns (code, stdout, stderr)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    err = bytearray()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed its end
                break
            if not data:
                break
            err += data
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=60), out, err.decode(errors="replace")


def test_progress_shows_in_a_terminal_and_not_in_a_pipe(tone_dir, tmp_path):
    argv = [*MIZUOTO, "say", "hello world", "-m", str(tone_dir), "-o", str(tmp_path / "a.wav"), "--voice", "low"]
    code, out, err = _in_a_terminal(argv)
    assert code == 0 and out.startswith("wrote "), (out, err)
    assert "say: loading " in err and "say: loaded tone (tone on " in err, err
    assert "say: preset with tone, 11 characters" in err and "s of audio in " in err, err
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert piped.returncode == 0 and piped.stderr == ""
    asked = subprocess.run([*argv, "--progress"], capture_output=True, text=True, timeout=240)
    assert "say: loaded tone" in asked.stderr
    code, out, err = _in_a_terminal([*argv, "--no-progress"])
    assert code == 0 and "say: load" not in err


def test_the_onnx_conversion_reports_its_steps(tmp_path):
    """runtime.convert.onnx's progress printer is called where progress lines are on (the CLI turns them on)."""
    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper

    from mizuoto.runtime.convert import onnx as conv

    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path))

    def convert(g):
        return {}, {"w": torch.ones(2, 2)}
    stream = io.StringIO()
    progress.enable(stream)
    try:
        conv.load_converted(path, convert, "test-1")
    finally:
        progress.disable()
    assert "converting ONNX weights to torch: writing the cache ... done" in stream.getvalue()
    quiet = io.StringIO()
    conv.load_converted(path, convert, "test-2")  # progress off: nothing printed anywhere
    assert quiet.getvalue() == ""


def test_a_step_reports_what_it_does_and_how_long():
    stream = io.StringIO()
    progress.enable(stream)
    try:
        with progress.step("bench: warming up", tick=0.05, status=lambda: "2 runs"):
            time.sleep(0.2)
        progress.update("half")
        progress.interrupt()
    finally:
        progress.disable()
    text = stream.getvalue()
    assert text.startswith("bench: warming up ...") and ", 2 runs" in text
    assert "bench: warming up: done in 0." in text and text.endswith("half\n")
    with progress.step("nothing"):  # off: prints nothing, starts nothing
        pass
