"""`make demo`: speak one sentence to demo.wav and say what was used.

Without arguments it speaks with the Piper plugin's default voice (a real en_US voice shipped
by a pinned package). `python -m mizuoto.demo MODEL_DIR [--ref-audio F --ref-text T]` speaks
with the model in MODEL_DIR (e.g. a CosyVoice directory): with its first preset voice, or
cloning the reference clip. If Piper is not installed, the smallest CosyVoice fixture model
(random weights: every stage runs, the audio is not speech) is used, then the toy tone engine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from mizuoto.runtime.api import Runtime
from mizuoto.cli.main import write_wav
from mizuoto.runtime.engine import Reference, SynthesisRequest

TEXT = "Hello from Mizuoto, a speech runtime that hosts several voices behind one API."
OUTPUT = Path("demo.wav")


def _speak(rt: Runtime, model_dir: Path, out: Path, ref_audio: str | None = None, ref_text: str | None = None) -> str:
    name = rt.load(model_dir, device="cpu")
    if ref_audio:
        voice = Reference(ref_audio, ref_text)
    else:
        presets = [v.id for v in rt.voices(name) if v.kind == "preset"]
        if not presets:
            raise RuntimeError(f"{model_dir} has no preset voice: pass --ref-audio and --ref-text")
        voice = presets[0]
    seconds, rate, _ = write_wav(out, rt.synthesize(name, SynthesisRequest(TEXT, voice=voice, seed=0)))
    shown = voice if isinstance(voice, str) else f"cloned from {ref_audio}"
    return f"{model_dir} ({rt.info(name).engine}), voice {shown}: {seconds:.2f} s at {rate} Hz"


def _piper(out: Path) -> str:
    import mizuoto_piper

    with Runtime() as rt:
        return "Piper: " + _speak(rt, mizuoto_piper.default_voice_dir(), out)


def _cosyvoice_fixture(out: Path) -> str:
    from mizuoto.testing.fixtures import fixtures_root

    with Runtime() as rt:
        dirs = [d for d in fixtures_root().glob("cosyvoice/*/model") if (d / "spk2info.pt").is_file()]
        if not dirs:
            raise RuntimeError("no CosyVoice fixture model with preset voices")
        model_dir = min(dirs, key=lambda d: sum(p.stat().st_size for p in d.rglob("*") if p.is_file()))
        return "the CosyVoice fixture model (random weights, not speech): " + _speak(rt, model_dir, out)


def _tone(out: Path) -> str:
    from mizuoto.testing.toy import ToneEngine, write_model

    with tempfile.TemporaryDirectory() as tmp, Runtime(engines=[ToneEngine]) as rt:
        name = rt.load(write_model(Path(tmp) / "tone"), engine="tone", device="cpu")
        seconds, rate, _ = write_wav(out, rt.synthesize(name, SynthesisRequest(TEXT, voice="low", seed=0)))
        return f"the toy sine-tone engine (tones, not speech): {seconds:.2f} s at {rate} Hz"


def main(argv: list[str] | None = None, out: Path = OUTPUT) -> int:
    """Write the demo wav; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mizuoto.demo", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", type=Path, help="a model directory (default: Piper's voice)")
    parser.add_argument("--ref-audio", help="reference clip to clone")
    parser.add_argument("--ref-text", help="transcript of the reference clip")
    parser.add_argument("-o", "--output", type=Path, default=out)
    args = parser.parse_args(argv)
    if args.model_dir is not None:
        with Runtime() as rt:
            used = _speak(rt, args.model_dir, args.output, args.ref_audio, args.ref_text)
    else:
        used = None
        for attempt in (_piper, _cosyvoice_fixture, _tone):
            try:
                used = attempt(args.output)
                break
            except Exception as e:  # the demo must still produce audio while an engine is missing
                print(f"demo: {attempt.__name__.strip('_')} unavailable ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]}); trying the next", file=sys.stderr)
    print(f"demo: wrote {args.output.resolve()} with {used}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
