"""The Piper engine: VITS voices exported to ONNX, run on onnxruntime, phonemes from espeak-ng.

Only Mizuoto's public API is used (mizuoto.runtime.engine and mizuoto.errors). The
weights live in an onnxruntime session, not in torch modules, so the stages own no modules and
declare the session's memory by formula instead (see `vits_bytes`).
"""

from __future__ import annotations

import math
import re
import secrets
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mizuoto.runtime.engine import AudioChunk, Capabilities, Engine, Model, Stage, SynthesisRequest, Voice
from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto_piper.noise import NOISE_INPUT, draw, make_seedable
from mizuoto_piper.phonemize import phonemize
from mizuoto_piper.voice import VoiceConfig, find_voice, is_piper_config

# Memory model of the onnxruntime session (CPU arena off, so run memory is returned after each run),
# from peak resident-set growth on x86-64 with the en_US joe voice: loading a session costs ~1.8x
# the .onnx file (weights plus onnxruntime's graph), and a run of 600 stretched ids peaked at
# 404 MiB (speed 1) and 455 MiB (speed 0.25), i.e. <= 0.76 MiB per id (decoder activations at 256x
# upsampling, plus the noise inputs); 1 MiB per id leaves ~1.3x headroom.
SESSION_FACTOR = 2.0
BYTES_PER_ID = 1 << 20
RUN_BASE = 32 << 20
PHONEMIZE_BYTES = 16 << 20
# Decoder memory follows the frames, i.e. ids x length_scale (slower speech, more frames per id).
# A sentence is cut at word boundaries so that ids x max(1, length_scale) stays within MAX_IDS:
# one run stays bounded at any speed.
MAX_IDS = 600
IDS_PER_CHAR = 3.0  # ids per input character, an upper estimate for the request-sized formula

# Noise values drawn per id before a run (the flow's noise is 192 channels x ~2.5 frames per id
# at speed 1, ~470 values); a run that needs more says so and is repeated with exactly enough.
NOISE_PER_ID = 1024

_SENTENCE = re.compile(r"(?<=[.!?])\s+")

# Requests a voice runs at once (at least; the load option compute.batch may raise it). A request
# keeps its state (its sentences, seed and part index) in its own iterator and a VITS run reads
# only its own inputs, so requests interleave without changing a sample: their runs take turns on
# the voice's one compute thread (Model.executor), and a request waiting for streamed text, in its
# own thread, holds no turn (a session dripping text no longer holds the voice from the others).
INTERLEAVED = 8


def vits_bytes(onnx_bytes: int, ids: float) -> int:
    """Working memory of the VITS stage: the session plus one run over `ids` speed-scaled phoneme ids."""
    return int(onnx_bytes * SESSION_FACTOR) + RUN_BASE + int(BYTES_PER_ID * min(ids, MAX_IDS))


def run_limit(length_scale: float) -> int:
    """Most phoneme ids one run may take at this length scale."""
    return max(8, int(MAX_IDS / max(1.0, length_scale)))


def _split_long(phonemes: str, config: VoiceConfig, limit: int) -> list[str]:
    """Cut a sentence's phonemes at spaces into parts of at most `limit` ids each (a longer word stays whole)."""
    if len(config.ids(phonemes)) <= limit:
        return [phonemes]
    parts, current = [], ""
    for word in phonemes.split(" "):
        trial = f"{current} {word}".strip()
        if current and len(config.ids(trial)) > limit:
            parts.append(current)
            current = word
        else:
            current = trial
    return parts + ([current] if current else [])


def _sentences(pieces: Iterable[str]) -> Iterator[str]:
    """Whole sentences from text that arrives in pieces; the rest is flushed at the end."""
    buffer = ""
    for piece in pieces:
        if not isinstance(piece, str):
            raise InvalidRequest(f"streamed text pieces must be strings, got {type(piece).__name__}", field="text")
        buffer += piece
        parts = _SENTENCE.split(buffer)
        for done in parts[:-1]:
            if done.strip():
                yield done
        buffer = parts[-1]
    if buffer.strip():
        yield buffer


class PiperModel(Model):
    """One loaded Piper voice."""

    def __init__(self, onnx_path: Path, config: VoiceConfig, session: Any, noises: int, width: int = INTERLEAVED):
        self.config = config
        self.session = session
        self.onnx_bytes = onnx_path.stat().st_size
        self._inputs = {i.name for i in session.get_inputs()}
        self._noises = noises
        self.stages = (
            Stage("phonemes", "frontend", {}, memory=lambda request: PHONEMIZE_BYTES),
            Stage("vits", "frames", {}, memory=self._vits_memory),
        )
        self.capabilities = Capabilities(modes=frozenset({"preset"}), sample_rate=config.sample_rate, stream_out=True,
                                  stream_in=True, languages=(config.language,) if config.language else ())
        self.batch_width = width  # the runtime gives the voice its one compute thread (Model.submit runs there)


    def voices(self) -> list[Voice]:
        if self.config.speakers:
            return [Voice(name, "preset", f"speaker {sid}") for name, sid in self.config.speakers.items()]
        return [Voice(self.config.name, "preset", f"Piper voice {self.config.name} ({self.config.language})")]

    def _vits_memory(self, request: SynthesisRequest | None) -> int:
        if request is None or not isinstance(request.text, str):
            return vits_bytes(self.onnx_bytes, MAX_IDS)
        stretch = max(1.0, self.config.length_scale / request.speed)
        longest = max((len(s) for s in _SENTENCE.split(request.text)), default=0)
        return vits_bytes(self.onnx_bytes, min(longest * IDS_PER_CHAR + 2, run_limit(stretch)) * stretch)

    def _speaker(self, voice: str) -> int | None:
        if not self.config.speakers:
            return None
        return self.config.speakers[voice]

    def _run(self, ids: list[int], speaker: int | None, speed: float, seed: int, part: int) -> torch.Tensor:
        """One VITS run, on the voice's compute thread in its turn."""
        return self.compute("vits", lambda device: self._vits(ids, speaker, speed, seed, part))

    def _vits(self, ids: list[int], speaker: int | None, speed: float, seed: int, part: int) -> torch.Tensor:
        c = self.config
        length_scale = c.length_scale / speed
        feeds = {"input": np.asarray([ids], dtype=np.int64),
                 "input_lengths": np.asarray([len(ids)], dtype=np.int64),
                 "scales": np.asarray([c.noise_scale, length_scale, c.noise_w], dtype=np.float32)}
        if "sid" in self._inputs:
            feeds["sid"] = np.asarray([speaker or 0], dtype=np.int64)
        size = len(ids) * NOISE_PER_ID * max(1, math.ceil(length_scale))
        for k in range(self._noises):
            feeds[NOISE_INPUT.format(k)] = draw(seed, part, k, size)
        for _ in range(2):  # a second run only when some noise input was too short
            out, *needs = self.session.run(None, feeds)
            short = [k for k, n in enumerate(needs) if int(n) > feeds[NOISE_INPUT.format(k)].size]
            if not short:
                break
            for k in short:
                feeds[NOISE_INPUT.format(k)] = draw(seed, part, k, int(needs[k]))
        return torch.from_numpy(np.ascontiguousarray(out.reshape(-1), dtype=np.float32))

    def _audio(self, request: SynthesisRequest) -> Iterator[torch.Tensor]:
        """Audio per sentence (or per part of an over-long sentence); streamed text is waited for here."""
        speaker = self._speaker(request.voice)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        text = [request.text] if isinstance(request.text, str) else request.text
        limit = run_limit(self.config.length_scale / request.speed)
        index = 0
        for sentence in _sentences(text):
            phonemes = self.compute("phonemes", lambda device: phonemize(sentence, self.config.espeak_voice))
            for p in phonemes:
                for part in _split_long(p, self.config, limit):
                    yield self._run(self.config.ids(part), speaker, request.speed, seed, index)
                    index += 1

    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """The request's audio, a chunk per sentence when streaming (every wait bounded by the request's lease)."""
        rate = self.config.sample_rate
        if not request.stream:
            audio = list(self._audio(request))
            if not audio:
                raise InvalidRequest("text has nothing to say (no words)", field="text")
            yield AudioChunk(torch.from_numpy(np.concatenate([a.numpy() for a in audio])), rate, 0, True)
            return
        # Held back by one so the last chunk can carry final=True.
        ready, index = None, 0
        for audio in self._audio(request):
            if ready is not None:
                yield AudioChunk(ready, rate, index, False)
                index += 1
            ready = audio
        if ready is None:
            raise InvalidRequest("text has nothing to say (no words)", field="text")
        yield AudioChunk(ready, rate, index, True)

    def close(self) -> None:
        self.session = None


def _providers(device: str) -> list[str]:
    import onnxruntime

    if device.startswith("cuda"):
        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        warnings.warn("mizuoto-piper: this onnxruntime has no CUDA provider; the voice runs on the CPU", stacklevel=3)
    return ["CPUExecutionProvider"]


class PiperEngine(Engine):
    """Piper VITS voices (ONNX + JSON config) on onnxruntime."""

    name = "piper"
    description = "Piper VITS voices on onnxruntime (mizuoto-piper plugin)"
    capabilities = Capabilities(modes=frozenset({"preset"}), sample_rate=22050, stream_out=True, stream_in=True)

    def detect(self, model_dir: Path) -> bool | str:
        try:
            import json

            found = find_voice(Path(model_dir))
            return found is not None and is_piper_config(json.loads(found[1].read_text(encoding="utf-8")))
        except Exception:  # detect never raises: an unreadable dir is simply not ours
            return False

    @classmethod
    def model_name(cls, model_dir: Path) -> str:
        """The voice's name (`en_US-joe-medium`), as Piper names its voices, whatever folder holds it."""
        try:
            found = find_voice(Path(model_dir))
        except Exception:  # several voices: the folder's name
            found = None
        return found[0].stem if found is not None else super().model_name(model_dir)

    def load(self, model_dir: Path, options: Any) -> PiperModel:
        found = find_voice(Path(model_dir))
        if found is None:
            raise ModelLoadError(f"no Piper voice (<voice>.onnx + <voice>.onnx.json) in {model_dir}")
        onnx_path, json_path = found
        config = VoiceConfig.read(json_path)
        precision = getattr(options, "precision", "fp32")
        if precision != "fp32":
            raise ModelLoadError(f"Piper voices run in fp32; precision {precision!r} is not supported")
        try:
            import onnxruntime
        except ImportError as e:
            raise ModelLoadError("mizuoto-piper needs onnxruntime (pip install onnxruntime)") from e
        so = onnxruntime.SessionOptions()
        so.enable_cpu_mem_arena = False  # return run memory at once, so the declared formula holds between runs
        so.intra_op_num_threads = max(1, torch.get_num_threads())
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        try:
            import onnx

            graph = onnx.load(str(onnx_path))
            noises = make_seedable(graph)
            session = onnxruntime.InferenceSession(graph.SerializeToString(), so,
                                                   providers=_providers(str(getattr(options, "device", "cpu"))))
            del graph
        except Exception as e:
            raise ModelLoadError(f"cannot load Piper voice {onnx_path}: {type(e).__name__}: {e}") from e
        missing = {"input", "input_lengths", "scales"} - {i.name for i in session.get_inputs()}
        if missing:
            raise ModelLoadError(f"{onnx_path} is not a Piper VITS export: inputs {sorted(missing)} are missing")
        width = max(INTERLEAVED, int(getattr(getattr(options, "compute", None), "batch", 1) or 1))
        return PiperModel(onnx_path, config, session, noises, width)
