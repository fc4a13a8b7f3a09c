"""The Qwen3-TTS engine: a 12 Hz model directory in upstream's layout, driven through Mizuoto's engine contract.

A request runs what upstream's `Qwen3TTSModel.generate_voice_clone` / `generate_custom_voice` /
`generate_voice_design` run (qwen-tts 0.1.1) for one text: the chat-formatted prompt, the talker's
prefill (`prefill`), the talker and code predictor drawing a frame of 16 codes per step with
upstream's processors (`generate`, run by the runtime's `decode`: alone, or in the model's
continuous batch), then the 12 Hz codec's decoder. Every draw comes from one generator seeded with
the request's seed in upstream's order, so a request equals upstream's
`torch.manual_seed(seed); model.generate_*(...)` on the same CPU class. Streaming audio out decodes
the frames so far in chunks (`stream`); its audio is the codec's chunked decode, not the whole one.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.runtime.engine import (AudioChunk, Capabilities, Engine, Model, Reference, Stage, SynthesisRequest,
                                    Voice, VoicePrompt)
from mizuoto_qwen3tts import memory
from mizuoto_qwen3tts.clone import ClonePrompt, load_reference
from mizuoto_qwen3tts.layout import ModelLayout, read_layout
from mizuoto_qwen3tts.options import ENGINE_OPTIONS, model_options, sampling_from

DESIGN_VOICE = "design"  # VoiceDesign's one voice: the one its instruction describes


class Qwen3TTSModel(Model):
    """One loaded Qwen3-TTS directory (Base, CustomVoice or VoiceDesign)."""

    def __init__(self, layout: ModelLayout, parts: Any, batch: int = 1) -> None:
        self.layout, self.parts = layout, parts
        self.cached: dict[str, ClonePrompt] = {}
        self._voices_lock = threading.Lock()
        self.figures = memory.Figures(parts, layout)
        self.batch_width = max(1, batch)
        self.ban_stop = False  # set by the bench driver only: the talker speaks exactly max_new_tokens tokens
        self.unbatched = False  # the bench's single-request table: the talker by itself on the calling thread
        talker_modules = {"talker": parts.talker, "predictor": parts.predictor}
        stages = []
        if layout.kind == "base":
            stages.append(Stage("voice", "frontend", {"speaker": parts.speaker, "encoder": parts.codec_encoder},
                                memory=lambda request: self.figures.voice_least(),
                                call_memory=self.figures.voice, bound_memory=lambda r: self.figures.voice_most()))
        stages += [
            Stage("talker", "sequence", talker_modules, memory=self._talker_memory, call_memory=self.figures.talker,
                  sequence=parts.sequence),
            Stage("codec", "frames", {"codec": parts.codec_decoder}, memory=lambda r: self.figures.codec_least(),
                  call_memory=self.figures.codec, bound_memory=lambda r: self.figures.codec_most()),
        ]
        self.stages = tuple(stages)
        modes = {"base": {"clone", "cross_lingual"}, "custom_voice": {"preset"} | ({"instruct"} if layout.instruct
                 else set()), "voice_design": {"instruct"}}[layout.kind]
        self.capabilities = Capabilities(modes=frozenset(modes), sample_rate=parts.codec_decoder.sample_rate,
                                         stream_out=True, languages=layout.language_codes,
                                         voice_cache=layout.kind == "base", options=model_options(layout))

    # -- memory ------------------------------------------------------------------------------------
    def _talker_memory(self, request: SynthesisRequest | None) -> int:
        return self.figures.talker_request(request)

    # -- voices ------------------------------------------------------------------------------------
    def voices(self) -> list[Voice]:
        presets = [Voice(name, "preset", f"preset speaker {name}" + (f" ({dialect})" if dialect else ""))
                   for name, dialect in self.layout.speakers.items()]
        if self.layout.kind == "voice_design":
            presets = [Voice(DESIGN_VOICE, "preset", "the voice the instruction describes (VoiceDesign)")]
        with self._voices_lock:
            return presets + [Voice(v, "cached", "cloned voice") for v in sorted(self.cached)]

    def _clone(self, reference: Reference, in_context: bool) -> ClonePrompt:
        """A reference clip's prompt: its x-vector, and for in-context cloning its codes and transcript."""
        wav = load_reference(reference.audio, self.parts.codec_encoder.sample_rate)

        def run(device: Any) -> ClonePrompt:
            with torch.inference_mode():
                xvector = self.parts.speaker.embed(wav)
                # upstream encodes the clip even for an x-vector clone (and drops the codes): nothing depends on it
                codes = self.parts.codec_encoder.encode(wav) if in_context else None
            return ClonePrompt(xvector, codes, reference.text if in_context else None)
        return self.compute("voice", run, samples=int(wav.numel()))

    def add_voice(self, voice_id: str, ref_audio: Any, ref_text: str | None = None) -> Voice:
        if self.layout.kind != "base":
            raise InvalidRequest(f"only a Base model clones voices; this is {self.layout.kind}", field="voice")
        if not isinstance(voice_id, str) or not voice_id or voice_id in self.layout.speakers:
            raise InvalidRequest(f"voice id {voice_id!r} is empty or a preset's", field="voice")
        prompt = self._clone(Reference(ref_audio, ref_text), ref_text is not None)
        return self._keep(voice_id, prompt)

    def _keep(self, voice_id: str, prompt: ClonePrompt) -> Voice:
        with self._voices_lock:
            self.cached[voice_id] = prompt
        return Voice(voice_id, "cached", "cloned voice")

    def export_voice(self, voice_id: str) -> VoicePrompt:
        with self._voices_lock:
            prompt = self.cached.get(voice_id)
        if prompt is None:
            raise InvalidRequest(f"no cached voice {voice_id!r}", field="voice")
        return prompt.export()

    def import_voice(self, voice_id: str, prompt: VoicePrompt) -> Voice:
        if self.layout.kind != "base":
            raise InvalidRequest(f"only a Base model takes cloned voices; this is {self.layout.kind}", field="voice")
        return self._keep(voice_id, ClonePrompt.from_export(prompt, self.layout.hidden, self.layout.groups))

    def remove_voice(self, voice_id: str) -> None:
        with self._voices_lock:
            if self.cached.pop(voice_id, None) is None:
                raise InvalidRequest(f"no cached voice {voice_id!r}", field="voice")

    # -- synthesis ---------------------------------------------------------------------------------
    def _voice(self, request: SynthesisRequest) -> tuple[str | None, ClonePrompt | None]:
        """The request's preset speaker or clone prompt."""
        voice = request.voice
        if isinstance(voice, Reference):
            return None, self._clone(voice, request.mode == "clone")
        with self._voices_lock:
            cached = self.cached.get(voice)
        if cached is not None:  # asked as cross_lingual, a voice cached with its transcript clones by x-vector
            return None, cached if request.mode == "clone" else ClonePrompt(cached.xvector)
        return (None if voice == DESIGN_VOICE and self.layout.kind == "voice_design" else voice), None

    def frames(self, request: SynthesisRequest, generator: torch.Generator) -> tuple[Iterator[torch.Tensor], Any]:
        """The request's frames of codes as the talker draws them, and its clone prompt (None for presets)."""
        if request.text_streamed:
            raise InvalidRequest("Qwen3-TTS takes the text as one string", field="text")
        if request.speed != 1.0:  # upstream has no speed control, and resampling the audio would change its pitch
            raise InvalidRequest(f"Qwen3-TTS speaks at its own pace: speed must be 1, got {request.speed:g}",
                                 field="speed")
        options = request.options
        sampling = sampling_from(options)
        speaker, clone = self._voice(request)
        parts = self.parts

        def prompt(_: Any) -> Any:
            return parts.prefill(request.text, language=options["language"], speaker=speaker,
                                 instruct=request.instruct, clone=clone,
                                 non_streaming=options["non_streaming_mode"])
        prefill = self.compute("talker", prompt, kind="lm input")  # the text is tokenized there: a few ids
        sizes = self.figures.talker_sizes(prefill.inputs_embeds.shape[1], sampling.max_new_tokens)
        loop = self.decode("talker", lambda steps: parts.generate(prefill, sampling, generator, steps, self.ban_stop),
                           alone=self.unbatched, **sizes)
        return loop, clone

    def decode_codes(self, codes: torch.Tensor, context: int = 0) -> torch.Tensor:
        """The codec decoder's waveform of codes [frames, groups]: upstream's speech tokenizer `decode`, or with
        `context` one window whose first `context` frames are left context (their samples dropped)."""
        decoder = self.parts.codec_decoder

        def run(device: Any) -> torch.Tensor:
            with torch.inference_mode():
                return decoder.decode_window(codes, context) if context else decoder.decode(codes)
        return self.compute("codec", run, kind="codec", urgent=True, frames=int(codes.shape[0]))

    def _decode(self, codes: torch.Tensor, clone: ClonePrompt | None) -> torch.Tensor:
        """The waveform of the codes (after a clone's reference codes, whose audio is cut, as upstream)."""
        ref = clone.ref_codes if clone is not None and clone.in_context else None
        whole = codes if ref is None else torch.cat([ref, codes], dim=0)
        if whole.shape[0] == 0:  # upstream's decode fails on no frames at all
            raise InvalidRequest("the model spoke no audio frame for this text (it drew its stop code at once, or "
                                 "max_new_tokens is 1); try another seed or a longer text", field="text")
        wav = self.decode_codes(whole)
        if ref is None:
            return wav
        cut = int(ref.shape[0] / max(whole.shape[0], 1) * wav.shape[0])  # upstream's float cut, as it computes it
        return wav[cut:]

    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """The request's audio: one chunk, or chunks as the frames come when streaming."""
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        frames, clone = self.frames(request, generator)
        rate = self.capabilities.sample_rate
        if request.stream:
            from mizuoto_qwen3tts.stream import stream_audio

            yield from stream_audio(self, frames, clone, rate)
            return
        got = list(frames)
        codes = torch.stack(got) if got else torch.zeros(0, self.layout.groups, dtype=torch.int64)
        audio = self._decode(codes, clone)
        yield AudioChunk(audio.to(torch.float32).reshape(-1).contiguous(), rate, 0, True)

    def close(self) -> None:
        super().close()  # the continuous batch, if it batches
        with self._voices_lock:
            self.cached.clear()


class Qwen3TTSEngine(Engine):
    """Qwen3-TTS 12 Hz directories (Base, CustomVoice, VoiceDesign) as upstream's from_pretrained reads them."""

    name = "qwen3tts"
    description = "Qwen3-TTS 12 Hz (Alibaba Qwen, Apache-2.0): Base clone, CustomVoice, VoiceDesign; mizuoto-qwen3tts"
    capabilities = Capabilities(modes=frozenset({"preset", "clone", "cross_lingual", "instruct"}), sample_rate=24000,
                                stream_out=True, voice_cache=True, options=ENGINE_OPTIONS)

    def detect(self, model_dir: Path) -> bool | str:
        try:
            layout = read_layout(Path(model_dir))
        except Exception:  # detect never raises: a dir that is not ours is simply not ours
            return False
        return layout.kind

    def load(self, model_dir: Path, options: Any) -> Qwen3TTSModel:
        from mizuoto_qwen3tts.parts import load_parts

        precision = getattr(options, "precision", "fp32")
        if precision != "fp32":
            raise ModelLoadError(f"Qwen3-TTS runs in fp32 here; precision {precision!r} is not supported")
        device = str(getattr(options, "device", "cpu"))
        if device not in ("cpu", "auto"):
            raise ModelLoadError(f"mizuoto-qwen3tts runs on the CPU for now, not {device}: load it with device=cpu")
        layout = read_layout(Path(model_dir))
        compute = getattr(options, "compute", None)
        return Qwen3TTSModel(layout, load_parts(layout), batch=int(getattr(compute, "batch", 1) or 1))

    # `mizuoto bench --random qwen3tts` (1.7B; qwen3tts-1.7b the same, qwen3tts-0.6b the small one): full-size, random
    bench_random = ("qwen3tts", "qwen3tts-1.7b", "qwen3tts-0.6b")

    def bench_driver(self, model_dir: Path | None, random: str | None, options: Any, settings: Any,
                     workdir: Path, assets: str | Path | None = None) -> Any:
        """`mizuoto bench`'s driver: this engine's own model of a directory, or a full-size random one."""
        from mizuoto_qwen3tts.bench import bench_driver

        return bench_driver(model_dir, random, options, settings, workdir)
