"""A sine-tone engine: the smallest complete implementation of the engine contract, for tests and demos.

It speaks no language: every character of the text becomes a short note whose pitch follows the
voice (a preset pitch, or one estimated from reference audio). Its three stages use real torch
modules, so the planner and scheduler see real sizes and real moves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from mizuoto.runtime.engine import (MODES, AudioChunk, Capabilities, Engine, Model, Reference, RequestOption, Stage,
                                    SynthesisRequest, Voice, VoicePrompt, load_audio)
from mizuoto.errors import InvalidRequest, ModelLoadError

CONFIG = "tone.json"
NOTE_SECONDS = 0.06
CHUNK_NOTES = 4
_PLANNING_CHARS = 200  # working-memory bound when no request is given
_PLANNING_SECONDS = 30
# the engine's own request option (runtime.request_options): the front ends show it without knowing the engine
OPTIONS = (RequestOption("transpose", "int", 0, "shift every note by this many semitones", -12, 12),)


def write_model(model_dir: str | Path, sample_rate: int = 16000, hidden: int = 16,
                voices: dict[str, float] | None = None, seed: int = 0) -> Path:
    """Create a tone model directory (config + weights) and return it."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config = {"engine": "tone", "sample_rate": sample_rate, "hidden": hidden,
              "voices": voices or {"low": 220.0, "high": 440.0}, "languages": ["any"]}
    (model_dir / CONFIG).write_text(json.dumps(config, indent=1))
    torch.manual_seed(seed)
    torch.save(_build(hidden).state_dict(), model_dir / "tone.pt")
    return model_dir


class _Window(torch.nn.Module):
    """A fade applied at note edges; fixed, like a module that must stay on one device."""

    def __init__(self, length: int = 32):
        super().__init__()
        self.register_buffer("fade", torch.linspace(0.0, 1.0, length))


def _build(hidden: int) -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({"probe": torch.nn.Linear(1, hidden), "table": torch.nn.Embedding(128, hidden),
                                "gain": torch.nn.Linear(hidden, 1), "window": _Window()})


def _pitch(audio: torch.Tensor, rate: int) -> float:
    """Pitch estimated from zero crossings, clamped to a speaking range."""
    crossings = int((torch.signbit(audio[1:]) != torch.signbit(audio[:-1])).sum())
    return min(max(crossings / 2 / (audio.numel() / rate), 60.0), 1000.0)


class ToneModel(Model):
    """A loaded tone model."""

    def __init__(self, config: dict, modules: torch.nn.ModuleDict):
        self.config = config
        self.rate = int(config["sample_rate"])
        self.hidden = int(config["hidden"])
        self._m = modules
        self._presets = {k: float(v) for k, v in config["voices"].items()}
        self._cached: dict[str, float] = {}
        self.stages = (
            Stage("listen", "frontend", {"probe": modules["probe"]}, memory=self._listen_memory),
            Stage("notes", "sequence", {"table": modules["table"]}, memory=self._notes_memory),
            Stage("render", "frames", {"gain": modules["gain"], "window": modules["window"]},
                  fixed={"window"}, memory=self._render_memory, call_memory=self._render_call_memory),
        )
        self.capabilities = Capabilities(modes=frozenset(MODES), sample_rate=self.rate, stream_out=True, stream_in=True,
                                  languages=tuple(config.get("languages", ())), voice_cache=True, options=OPTIONS)

    def voices(self) -> list[Voice]:
        return [Voice(k, "preset", f"{v:g} Hz") for k, v in self._presets.items()] + \
               [Voice(k, "cached", f"{v:.1f} Hz") for k, v in self._cached.items()]

    def _listen_memory(self, request: SynthesisRequest | None) -> int:
        return 4 * self.rate * _PLANNING_SECONDS

    def _notes_memory(self, request: SynthesisRequest | None) -> int:
        chars = len(request.text) if request is not None and isinstance(request.text, str) else _PLANNING_CHARS
        return 4 * self.hidden * chars

    def _render_memory(self, request: SynthesisRequest | None) -> int:
        # each render call reserves its own notes (Model.room); every request renders one note at least
        speed = request.speed if request is not None else 0.25
        return self._render_call_memory(notes=1, samples=int(NOTE_SECONDS * self.rate / speed))

    @staticmethod
    def _render_call_memory(notes: int, samples: int) -> int:
        """A render call: one float32 wave of `samples` per note."""
        return 4 * notes * samples

    def _listen(self, audio: torch.Tensor, rate: int) -> float:
        def probe(device: torch.device) -> float:
            # The probe only scales the estimate by ~1, but it runs where the stage was placed.
            return self._m["probe"](audio.abs().mean().reshape(1, 1).to(device)).tanh().mean().item()
        level = self.compute("listen", probe)
        return _pitch(audio, rate) * (1.0 + 1e-3 * level)

    def add_voice(self, voice_id: str, ref_audio, ref_text: str | None = None) -> Voice:
        if not voice_id or voice_id in self._presets:
            raise InvalidRequest(f"cannot cache a voice as {voice_id!r}: empty or a preset's name")
        self._cached[voice_id] = self._listen(*Reference(ref_audio, ref_text).load())
        return Voice(voice_id, "cached")

    def export_voice(self, voice_id: str) -> VoicePrompt:
        if voice_id not in self._cached:
            raise InvalidRequest(f"no cached voice {voice_id!r}")
        return VoicePrompt({"pitch": torch.tensor([self._cached[voice_id]], dtype=torch.float64)}, {"unit": "Hz"})

    def import_voice(self, voice_id: str, prompt: VoicePrompt) -> Voice:
        pitch = prompt.tensors.get("pitch")
        if not voice_id or voice_id in self._presets:
            raise InvalidRequest(f"cannot cache a voice as {voice_id!r}: empty or a preset's name")
        if pitch is None or pitch.numel() != 1:
            raise InvalidRequest(f"voice {voice_id!r}: a tone voice prompt is one 'pitch' value")
        self._cached[voice_id] = float(pitch.item())
        return Voice(voice_id, "cached")

    def remove_voice(self, voice_id: str) -> None:
        if self._cached.pop(voice_id, None) is None:
            raise InvalidRequest(f"no cached voice {voice_id!r}")

    def _voice_pitch(self, request: SynthesisRequest) -> float:
        v = request.voice
        if isinstance(v, Reference):
            f0 = self._listen(*v.load())
        elif v in self._presets:
            f0 = self._presets[v]
        elif v in self._cached:
            f0 = self._cached[v]
        else:
            raise InvalidRequest(f"unknown voice {v!r}", field="voice")
        if request.instruct:
            words = request.instruct.lower()
            f0 *= 2.0 if "high" in words else 0.5 if "low" in words else 1.0
        return f0

    def _tokens(self, request: SynthesisRequest) -> Iterator[str]:
        if request.mode == "vc":
            audio, rate = load_audio(request.source_audio)
            yield "~" * max(1, round(audio.numel() / rate / NOTE_SECONDS))
        elif isinstance(request.text, str):
            yield request.text
        else:
            yield from request.text

    def _notes(self, request: SynthesisRequest, gen: torch.Generator) -> Iterator[tuple[int, torch.Tensor]]:
        """(semitone, embedding) per non-space character, drawing one jitter per note."""
        for piece in self._tokens(request):
            if not isinstance(piece, str):
                raise InvalidRequest(f"streamed text pieces must be strings, got {type(piece).__name__}", field="text")
            for ch in piece:
                if ch.isspace():
                    continue
                token = ord(ch) % 128
                jitter = int(torch.randint(0, 3, (1,), generator=gen))
                emb = self._m["table"](torch.tensor([token], device=self._m["table"].weight.device))
                yield token % 12 + jitter, emb.detach().cpu()

    def _render(self, notes: list[tuple[int, torch.Tensor]], f0: float, speed: float,
                phase: float) -> tuple[torch.Tensor, float]:
        """Sine notes continuing from `phase`; returns the audio and the phase it ends on."""
        n = int(NOTE_SECONDS * self.rate / speed)
        return self.compute("render", lambda device: self._waves(device, notes, f0, n, phase), notes=len(notes),
                            samples=n)

    def _waves(self, device: torch.device, notes: list[tuple[int, torch.Tensor]], f0: float, n: int,
               phase: float) -> tuple[torch.Tensor, float]:
        """The render call, its stage's modules on `device`."""
        out = []
        fade = self._m["window"].fade  # fixed: read where it lives
        for semitone, emb in notes:
            freq = f0 * 2.0 ** (semitone / 12)
            amp = 0.2 + 0.1 * torch.tanh(self._m["gain"](emb.to(device))).item()
            t = torch.arange(n, dtype=torch.float64)
            wave = torch.sin(phase + 2 * math.pi * freq * t / self.rate) * amp
            phase = (phase + 2 * math.pi * freq * n / self.rate) % (2 * math.pi)
            edge = fade.to("cpu", torch.float64)
            k = min(edge.numel(), n // 2)
            wave[:k] *= edge[:k]
            out.append(wave.float())
        return (torch.cat(out) if out else torch.zeros(0)), phase

    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        f0 = self._voice_pitch(request) * 2.0 ** (request.options.get("transpose", 0) / 12)
        gen = torch.Generator().manual_seed(request.seed if request.seed is not None else
                                            int(torch.randint(0, 2**31, (1,))))
        notes = self._notes(request, gen)
        if not request.stream:
            todo = self.compute("notes", lambda device: list(notes))
            if not todo:
                raise InvalidRequest("text has nothing to say (only spaces)", field="text")
            audio, _ = self._render(todo, f0, request.speed, 0.0)
            yield AudioChunk(audio, self.rate, 0, True)
            return
        # Chunks are held back by one so the last can carry final=True.
        phase, index, pending, ready = 0.0, 0, [], None
        while True:
            item = self.compute("notes", lambda device: next(notes, None))
            if item is not None:
                pending.append(item)
            if pending and (item is None or len(pending) == CHUNK_NOTES):
                if ready is not None:
                    yield AudioChunk(ready, self.rate, index, False)
                    index += 1
                ready, phase = self._render(pending, f0, request.speed, phase)
                pending = []
            if item is None:
                break
        if ready is None:
            raise InvalidRequest("text has nothing to say (only spaces)", field="text")
        yield AudioChunk(ready, self.rate, index, True)

    def close(self) -> None:
        self._cached.clear()


class ToneEngine(Engine):
    """Sine tones from text; see mizuoto.testing.toy."""

    name = "tone"
    description = "toy sine-tone engine (tests and demos; not speech)"
    capabilities = Capabilities(modes=frozenset(MODES), sample_rate=16000, stream_out=True, stream_in=True,
                                voice_cache=True, options=OPTIONS)

    def detect(self, model_dir: Path) -> bool | str:
        try:
            return json.loads((Path(model_dir) / CONFIG).read_text()).get("engine") == "tone"
        except (OSError, ValueError, AttributeError):
            return False

    def load(self, model_dir: Path, options) -> ToneModel:
        try:
            config = json.loads((Path(model_dir) / CONFIG).read_text())
            modules = _build(int(config["hidden"]))
            modules.load_state_dict(torch.load(Path(model_dir) / "tone.pt", weights_only=True))
        except Exception as e:  # missing, truncated or foreign files all mean the same to a user
            raise ModelLoadError(f"cannot load tone model {model_dir}: {e}") from e
        # The fixed window lives on the load device for good; the rest starts on the host.
        modules["window"].to(options.device if options is not None else "cpu")
        return ToneModel(config, modules)
