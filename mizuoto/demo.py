"""`make demo`: synthesize one sentence to demo.wav and say what was used.

With the CosyVoice engine available, it speaks with the smallest CosyVoice fixture model (random
weights: the audio is noise-like, but every stage runs). Until then, or if that fails, it falls
back to the built-in sine-tone engine and says so.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.cli import write_wav
from mizuoto.runtime.engine import SynthesisRequest

TEXT = "Hello from Mizuoto, a speech runtime."
OUTPUT = Path("demo.wav")


def _size(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())


def _cosyvoice(out: Path) -> str:
    """Speak with the smallest CosyVoice fixture model that has a preset voice; returns what was used."""
    from mizuoto.testing.fixtures import fixtures_root

    with Runtime() as rt:
        rt.registry.engine_class("cosyvoice")  # a clear error if the engine is missing or broken
        dirs = [d for d in fixtures_root().glob("cosyvoice/*/model") if rt.detect(d)]
        if not dirs:
            raise RuntimeError(f"no CosyVoice fixture model under {fixtures_root() / 'cosyvoice'}")
        model_dir = min(dirs, key=_size)
        name = rt.load(model_dir, engine="cosyvoice", device="cpu")
        presets = [v.id for v in rt.voices(name) if v.kind == "preset"]
        if not presets:
            raise RuntimeError(f"{model_dir} has no preset voice to speak with")
        seconds, rate, _ = write_wav(out, rt.synthesize(name, SynthesisRequest(TEXT, voice=presets[0], seed=0)))
        return (f"CosyVoice fixture model {model_dir} (random weights), voice {presets[0]}:"
                f" {seconds:.2f} s at {rate} Hz")


def _tone(out: Path) -> str:
    """Speak with the toy sine-tone engine; returns what was used."""
    from mizuoto.testing.toy import ToneEngine, write_model

    with tempfile.TemporaryDirectory() as tmp, Runtime(engines=[ToneEngine]) as rt:
        name = rt.load(write_model(Path(tmp) / "tone"), engine="tone", device="cpu")
        seconds, rate, _ = write_wav(out, rt.synthesize(name, SynthesisRequest(TEXT, voice="low", seed=0)))
        return f"the toy sine-tone engine (tones, not speech): {seconds:.2f} s at {rate} Hz"


def main(out: Path = OUTPUT) -> int:
    """Write the demo wav; returns the exit code."""
    try:
        used = _cosyvoice(out)
    except Exception as e:  # the demo must still produce audio while the engine is missing or broken
        print(f"demo: CosyVoice unavailable ({type(e).__name__}: {' '.join(str(e).split())});"
              " falling back to the toy engine", file=sys.stderr)
        used = _tone(out)
    print(f"demo: wrote {out.resolve()} with {used}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
