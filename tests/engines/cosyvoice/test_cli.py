"""`mizuoto say` and `mizuoto models --plan` on assembled CosyVoice dirs, through the CLI entry."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import soundfile
import torch

from mizuoto.engines.cosyvoice.variants import find_variant
from mizuoto.cli.main import main
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.runtime.hyperyaml import load_hyperyaml

MIZUOTO = str(Path(sys.executable).with_name("mizuoto"))


def _say(capsys, *argv):
    code = main(["say", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _rate(variant_dir: Path) -> int:
    return int(load_hyperyaml(next(variant_dir.glob("cosyvoice*.yaml")))["sample_rate"])


def test_say_clones_and_streams(capsys, assembled, runtime, variant_dir, clip, tmp_path):
    model = assembled[variant_dir]
    out_wav = tmp_path / "clone.wav"
    code, out, err = _say(capsys, "Hello there.", "-m", model, "--ref-audio", clip, "--ref-text",
                          "A short reference.", "-o", out_wav, "--seed", 1)
    assert (code, err) == (0, ""), err
    assert re.match(rf"wrote {re.escape(str(out_wav))}: \d+\.\d\d s at {_rate(variant_dir)} Hz in 1 chunk\(s\) "
                    r"\(cosyvoice engine[ )]", out), out
    audio, rate = soundfile.read(out_wav, dtype="float32")
    assert rate == _rate(variant_dir) and audio.ndim == 1 and audio.size > 0

    long_text = " ".join(["one two three four five six seven eight nine ten"] * 7) + "."
    code, out, err = _say(capsys, long_text, "-m", model, "--ref-audio", clip, "--ref-text", "A short reference.",
                          "-o", tmp_path / "stream.wav", "--stream", "--seed", 1)
    assert code == 0, err
    chunks = int(re.search(r"in (\d+) chunk\(s\)", out).group(1))
    # how many chunks depends on how long the random-weight LM speaks: the CLI must write what the
    # runtime streams for the same request
    rt, names = runtime
    request = SynthesisRequest(long_text, voice=Reference(str(clip), "A short reference."), seed=1, stream=True)
    streamed = list(rt.synthesize(names[variant_dir], request))
    assert chunks == len(streamed)
    written, _ = soundfile.read(tmp_path / "stream.wav", dtype="float32")
    assert written.size == sum(c.samples.numel() for c in streamed) > 0


def test_say_with_a_preset_voice(capsys, assembled, preset_dir, tmp_path):
    model = assembled[preset_dir]
    voice = next(iter(torch.load(model / "spk2info.pt", weights_only=True)))
    code, out, err = _say(capsys, "Hello there.", "-m", model, "--voice", voice, "-o", tmp_path / "p.wav",
                          "--seed", 3)
    assert code == 0, err
    code, out, err = _say(capsys, "Hello there.", "-m", model, "--voice", voice, "--instruct", "Speak slowly.",
                          "-o", tmp_path / "i.wav", "--seed", 3)
    assert code == 0, err
    assert soundfile.info(tmp_path / "i.wav").samplerate == _rate(preset_dir)


def test_say_errors_are_one_line(capsys, assembled, variant_dir, tmp_path):
    model = assembled[variant_dir]
    code, out, err = _say(capsys, "Hello.", "-m", model, "--voice", "nobody", "-o", tmp_path / "x.wav")
    assert code == 1 and err.startswith("mizuoto: error: unknown voice 'nobody'") and err.count("\n") == 1
    code, out, err = _say(capsys, "Hello.", "-m", model, "--ref-audio", tmp_path / "missing.wav",
                          "-o", tmp_path / "x.wav")
    assert code == 1 and "audio file not found" in err
    assert not (tmp_path / "x.wav").exists()


def test_console_script_say(assembled, clip, tmp_path):
    """The installed `mizuoto` script in a fresh process (one dir: main() covers every variant above)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for variant_dir, model in sorted(assembled.items())[:1]:
        out_wav = tmp_path / f"{variant_dir.parent.name}.wav"
        done = subprocess.run([MIZUOTO, "say", "Hi there.", "-m", str(model), "--ref-audio", str(clip),
                               "--mode", "cross_lingual", "-o", str(out_wav), "--seed", "5"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"wrote {out_wav}") and soundfile.info(out_wav).frames > 0


def test_models_plan_shows_streaming_coresidency(capsys, runtime, assembled, variant_dir):
    """Streaming keeps llm, flow and hift on the device together; without streaming they take turns."""
    from mizuoto.runtime.memory import floor, measure

    model = assembled[variant_dir]
    assert main(["models", str(model)]) == 0
    out, _ = capsys.readouterr()
    assert f"cosyvoice (cosyvoice{find_variant(variant_dir).version})" in out
    rt, names = runtime
    sizes = measure(rt.model(names[variant_dir]).stages, None, None)
    by = {s.name: s for s in sizes}
    together = sum(by[n].weights + by[n].working for n in ("llm", "flow", "hift"))
    alone = max(by[n].weights + by[n].working for n in by)
    assert floor(sizes, stream=True) == sum(s.fixed for s in sizes) + max(together, by["frontend"].weights)
    assert floor(sizes, stream=False) == sum(s.fixed for s in sizes) + alone < floor(sizes, stream=True)
    budget = str(floor(sizes, stream=False))
    assert main(["models", "--plan", "--device", "cpu", "--ram", budget, str(model)]) == 0
    out, _ = capsys.readouterr()
    # at the non-streaming floor the stages take turns (the largest one may stay resident)
    assert "non-streaming: turns" in out and len(re.findall(r"^  \w+ .*turn \w+$", out, re.M)) >= 2, out
    assert main(["models", "--plan", "--device", "cpu", "--ram", budget, "--stream", str(model)]) == 1
    out, _ = capsys.readouterr()
    assert "refused:" in out and "streaming keeps llm+flow+hift together" in out, out
    budget = str(floor(sizes, stream=True))
    assert main(["models", "--plan", "--device", "cpu", "--ram", budget, "--stream", str(model)]) == 0
    out, _ = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "placement" not in line}
    assert set(rows) == {"frontend", "llm", "flow", "hift"}, out
    assert all(rows[n].rstrip().endswith("resident") for n in ("llm", "flow", "hift")) \
        or re.search(r"^  llm .*turn llm\+flow\+hift$", out, re.M), out
