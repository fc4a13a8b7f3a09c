"""The Chatterbox engine: a model directory in upstream's layout, loaded and driven through Mizuoto's contract.

A request runs upstream's `generate` (chatterbox-tts 0.1.7): the text cleaned and tokenized, T3
sampling speech tokens from the voice's conditioning, S3Gen turning them into 24 kHz audio, then
Perth's watermark when `resemble-perth` is installed and the load option `watermark` is on. All
draws come from one generator seeded with the request's seed, in upstream's order, so a
non-streamed request equals upstream's `torch.manual_seed(seed); model.generate(...)` before the
watermark. Streaming (upstream has none) runs S3Gen on the tokens so far in growing chunks
(`stream.py`); its T3 draws are the same as the whole request's, its S3Gen draws are not.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.runtime.engine import (AudioChunk, Capabilities, Engine, Model, Reference, RequestOption, Stage,
                                    SynthesisRequest, Voice, VoicePrompt)
from mizuoto_chatterbox import memory
from mizuoto_chatterbox.clip import TURBO_MIN_SECONDS
from mizuoto_chatterbox.gen_ref import load_xvector
from mizuoto_chatterbox.s3gen import SAMPLE_RATE, S3Gen, load_s3gen
from mizuoto_chatterbox.t3 import (MAX_NEW_TOKENS, START_SPEECH, STOP_SPEECH, TURBO_MAX_NEW_TOKENS, T3, T3Options,
                                   load_t3)
from mizuoto_chatterbox.text import TextFront
from mizuoto_chatterbox.voice import Voice as Conditioning
from mizuoto_chatterbox.voice import load_preset, load_s3_tokenizer, load_voice_encoder
from mizuoto_chatterbox.weights import PRESET, S3GEN_FILES, T3_FILES, VOICE_ENCODER, one_of

PRESET_VOICE = "default"  # the id of the directory's conds.pt
SILENCE_TOKEN = 4299  # S3GEN_SIL: Turbo appends three before S3Gen
TURBO_TAIL = 3

_SAMPLING = (
    RequestOption("temperature", "float", 0.8, "sampling temperature of the speech tokens", 0.05, 5.0),
    RequestOption("top_p", "float", 1.0, "nucleus sampling: keep the likeliest tokens up to this mass (1: off)",
                  0.0, 1.0),
    RequestOption("repetition_penalty", "float", 1.2, "divide the scores of tokens already spoken (1: off)",
                  1.0, 10.0),
)
ENGLISH_OPTIONS = (
    RequestOption("exaggeration", "float", 0.5, "emotion intensity (0.5: neutral, higher: more expressive)",
                  0.0, 2.0),
    RequestOption("cfg_weight", "float", 0.5, "classifier-free guidance weight (must be > 0 for the English "
                  "model; lower: slower, calmer pacing)", 0.0, 5.0),
    *_SAMPLING,
    RequestOption("min_p", "float", 0.05, "drop tokens less likely than this fraction of the likeliest (0: off)",
                  0.0, 1.0),
)
# every argument of upstream's ChatterboxTurboTTS.generate but text and audio_prompt_path (the request's voice)
# and those in TURBO_REFUSED, with upstream's defaults
TURBO_OPTIONS = (
    _SAMPLING[0],
    RequestOption("top_p", "float", 0.95, _SAMPLING[1].help, 0.0, 1.0),
    _SAMPLING[2],
    RequestOption("top_k", "int", 1000, "sample among this many likeliest tokens (0: off)", 0, 100000),
    RequestOption("norm_loudness", "bool", True, "scale a reference clip to -27 LUFS before cloning from it"),
)
# upstream's Turbo generate takes these and ignores them (a logged warning); undeclared, so a request giving
# one is refused ("has no option ...") and a client learns they do nothing
TURBO_REFUSED = ("exaggeration", "cfg_weight", "min_p")
TURBO_ONLY = tuple(o for o in TURBO_OPTIONS if o.name not in {e.name for e in ENGLISH_OPTIONS})


def _speech_for_s3gen(drawn: list[int], turbo: bool) -> list[int]:
    """T3's draws as S3Gen takes them: upstream's drop_invalid_tokens and vocabulary cut, Turbo's silence tail."""
    if not turbo:
        if START_SPEECH in drawn:  # upstream slices after a start token, and before the stop token
            drawn = drawn[drawn.index(START_SPEECH) + 1:]
        if STOP_SPEECH in drawn:
            drawn = drawn[:drawn.index(STOP_SPEECH)]
    tokens = [t for t in drawn if t < START_SPEECH]
    return tokens + [SILENCE_TOKEN] * TURBO_TAIL if turbo else tokens


class ChatterboxModel(Model):
    """One loaded Chatterbox (English) or Chatterbox-Turbo directory."""

    def __init__(self, model_dir: Path, t3: T3, s3gen: S3Gen, text: TextFront, ve: torch.nn.Module,
                 tokenizer: torch.nn.Module, xvector: torch.nn.Module, preset: Conditioning | None,
                 watermarker: Any = None, batch: int = 1) -> None:
        self.model_dir = model_dir
        self.turbo = t3.turbo
        self.t3, self.s3gen, self.text, self.ve, self.tokenizer, self.xvector = t3, s3gen, text, ve, tokenizer, xvector
        self.watermarker = watermarker
        self.presets = {PRESET_VOICE: preset} if preset is not None else {}
        self.cached: dict[str, Conditioning] = {}
        self._voices_lock = threading.Lock()
        self.figures = memory.Figures(t3, s3gen)
        self.bench_tokens: int | None = None  # set by the bench driver only: T3 speaks exactly this many tokens
        # compute.batch > 1: T3's steps shared by that many requests in the runtime's continuous batch, each
        # request taking its cond and uncond rows (Turbo: one): the runtime runs T3's token loop (Model.decode)
        self.rows_per_request = 1 if self.turbo else 2
        self.batch_width = max(1, batch)
        self.unbatched = False  # the bench's single-request table: T3 by itself on the calling thread
        self.stages = (
            Stage("text", "frontend", {}, memory=lambda request: memory.TEXT_BYTES),
            # CAM++ stays on the CPU (fixed), as upstream's reference analysis is checked there
            Stage("voice", "frontend", {"ve": ve, "tokenizer": tokenizer, "xvector": xvector}, fixed={"xvector"},
                  memory=self._voice_memory),
            Stage("t3", "sequence", {"t3": t3}, memory=self._t3_memory, call_memory=self.figures.t3_call,
                  sequence=t3.sequence()),
            Stage("s3gen", "frames", {"s3gen": s3gen}, memory=lambda request: self.figures.s3gen_least(),
                  call_memory=self.figures.s3gen, bound_memory=lambda request: self.figures.s3gen_most()),
        )
        modes = {"clone", "cross_lingual"} | ({"preset"} if preset is not None else set())
        self.capabilities = Capabilities(modes=frozenset(modes), sample_rate=SAMPLE_RATE, stream_out=True,
                                         languages=("en",), voice_cache=True,
                                         options=TURBO_OPTIONS if self.turbo else ENGLISH_OPTIONS,
                                         min_reference_seconds=TURBO_MIN_SECONDS if self.turbo else 0.0)

    # -- memory ------------------------------------------------------------------------------------
    def _text_ids(self, request: SynthesisRequest | None) -> int:
        if request is None or not isinstance(request.text, str):
            return memory.TEXT_IDS_BOUND
        try:
            return len(self.text.ids(request.text))
        except Exception:  # the request fails on its text when it runs; admission is not where to say so
            return memory.TEXT_IDS_BOUND

    def _t3_memory(self, request: SynthesisRequest | None) -> int:
        return self.figures.t3(self._text_ids(request), self._prompt_tokens(request))

    def _voice_memory(self, request: SynthesisRequest | None) -> int:
        if request is not None and not isinstance(request.voice, Reference):
            return 0
        return memory.VOICE_BYTES

    def _prompt_tokens(self, request: SynthesisRequest | None) -> int:
        """T3's speech prompt for the request's voice: a known voice's own, else upstream's cap (a clip's)."""
        if request is not None and isinstance(request.voice, str):
            with self._voices_lock:
                found = self.presets.get(request.voice) or self.cached.get(request.voice)
            if found is not None:
                return found.prompt_tokens.shape[-1]
        return memory.PROMPT_TOKENS_BOUND[self.turbo]

    # -- voices ------------------------------------------------------------------------------------
    def voices(self) -> list[Voice]:
        with self._voices_lock:
            cached = sorted(self.cached)
        out = [Voice(PRESET_VOICE, "preset", "the model's own voice (conds.pt)")] if self.presets else []
        return out + [Voice(v, "cached", "a cloned voice") for v in cached]

    def _conditioning(self, voice: str | Reference, options: dict | None = None) -> Conditioning:
        if isinstance(voice, Reference):
            return self._clone(voice, bool((options or {}).get("norm_loudness", True)))
        with self._voices_lock:
            found = self.presets.get(voice) or self.cached.get(voice)
        if found is None:
            raise InvalidRequest(f"unknown voice {voice!r}", field="voice")
        return found

    def _clone(self, reference: Reference, norm_loudness: bool = True) -> Conditioning:
        from mizuoto_chatterbox.clone import clone_voice

        def run(device: Any) -> Conditioning:
            with torch.inference_mode():
                return clone_voice(self, reference.audio, norm_loudness)
        return self.compute("voice", run, kind="frontend")

    def add_voice(self, voice_id: str, ref_audio: Any, ref_text: str | None = None) -> Voice:
        """Clone a voice from reference audio (its transcript is not used) and keep it under `voice_id`."""
        return self._keep(voice_id, self._clone(Reference(ref_audio, ref_text)))

    def _keep(self, voice_id: str, conditioning: Conditioning) -> Voice:
        """Cache `conditioning` under `voice_id` (not the preset's id)."""
        with self._voices_lock:
            if voice_id in self.presets:
                raise InvalidRequest(f"{voice_id!r} is the preset voice's id")
            self.cached[voice_id] = conditioning
        return Voice(voice_id, "cached", "a cloned voice")

    def export_voice(self, voice_id: str) -> VoicePrompt:
        """A cached voice's conditioning tensors."""
        with self._voices_lock:
            found = self.cached.get(voice_id)
        if found is None:
            raise InvalidRequest(f"no cached voice {voice_id!r}")
        tensors = {k: v for k, v in vars(found).items() if isinstance(v, torch.Tensor)}
        return VoicePrompt(tensors, {"exaggeration": repr(found.exaggeration), "turbo": str(self.turbo)})

    def import_voice(self, voice_id: str, prompt: VoicePrompt) -> Voice:
        """Cache a voice from `export_voice`'s tensors, without the clip."""
        if prompt.meta.get("turbo") != str(self.turbo):
            raise InvalidRequest(f"voice {voice_id!r} was made for the other Chatterbox model")
        try:
            conditioning = Conditioning(exaggeration=float(prompt.meta["exaggeration"]), **prompt.tensors)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"voice {voice_id!r} is not a Chatterbox voice prompt: {exc}") from None
        return self._keep(voice_id, conditioning)

    def remove_voice(self, voice_id: str) -> None:
        with self._voices_lock:
            if self.cached.pop(voice_id, None) is None:
                raise InvalidRequest(f"no cached voice {voice_id!r}")

    # -- synthesis ---------------------------------------------------------------------------------
    def _t3_options(self, options: dict) -> T3Options:
        fields = {k: options[k] for k in ("temperature", "top_p", "min_p", "top_k", "repetition_penalty",
                                          "cfg_weight") if k in options}
        if not self.turbo and fields["cfg_weight"] <= 0:
            raise InvalidRequest("the English Chatterbox samples with classifier-free guidance: cfg_weight "
                                 "must be > 0 (upstream fails at 0 too)", field="options")
        return T3Options(**fields)

    def _draws(self, request: SynthesisRequest, voice: Conditioning, generator: torch.Generator,
               **sizes: int) -> Iterator[int]:
        """T3's draws for the request, one token at a time, as the runtime decodes them (`sizes`: the call's)."""
        options = self._t3_options(request.options)
        exaggeration = request.options.get("exaggeration", voice.exaggeration)

        def prompt(_: Any) -> tuple[torch.Tensor, torch.Tensor]:
            ids = self.compute("text", lambda device: torch.tensor(self.text.ids(request.text)))

            def conditioning(device: Any) -> torch.Tensor:
                with torch.inference_mode():
                    return self.t3.conditioning(voice.speaker_emb, voice.prompt_tokens, exaggeration)
            cond = self.compute("t3", conditioning)
            self._check_length(ids.numel(), cond.shape[1])
            return ids, cond
        ids, cond = self.compute(None, prompt, kind="lm input")
        run = self.t3.generate_turbo if self.turbo else self.t3.generate
        exact = {} if self.bench_tokens is None else {  # Turbo draws once more than its max_new_tokens
            "ban_stop": True, "max_new_tokens": self.bench_tokens - (1 if self.turbo else 0)}
        yield from self.decode("t3", lambda steps: run(cond, ids, options, generator=generator, steps=steps, **exact),
                               alone=self.unbatched, **sizes)

    def _check_length(self, text_ids: int, cond: int) -> None:
        """A text longer than T3's position tables is refused with its length (upstream fails on an index)."""
        t3 = self.t3
        if t3.text_pos_emb is not None and text_ids > t3.text_pos_emb.num_embeddings:
            raise InvalidRequest(f"the text is too long for this model: {text_ids} text ids, at most "
                                 f"{t3.text_pos_emb.num_embeddings}; split it into several requests", field="text")
        # Turbo: upstream fails only once its positions run out, so a prompt that fits runs (a decode that
        # reaches the table's end fails there, in T3.generate_turbo)
        positions = t3.tfmr.config.max_positions
        if positions and cond + text_ids + 1 > positions:
            raise InvalidRequest(f"the text is too long for this model: {text_ids} text ids with the voice's "
                                 f"{cond} conditioning positions exceed its {positions} positions; split it into "
                                 "several requests", field="text")

    def speech_tokens(self, request: SynthesisRequest, voice: Conditioning, generator: torch.Generator) -> list[int]:
        """The tokens S3Gen speaks for a request (upstream's filtering of T3's draws), T3's call reserved first."""
        draws = list(self._draws(request, voice, generator, **self._t3_call_sizes(request, voice)))
        return _speech_for_s3gen(draws, self.turbo)

    def _t3_call_sizes(self, request: SynthesisRequest, voice: Conditioning) -> dict[str, int]:
        """T3's call sizes: the positions its cache holds (the prompt and the most draws), the prompt's, and
        whether the cache grows (a batch's rows) or is allocated once (the unbatched path's static cache)."""
        prefill = self.figures.t3_prefill(self._text_ids(request), voice.prompt_tokens.shape[-1])
        draws = self.bench_tokens or (TURBO_MAX_NEW_TOKENS + 1 if self.turbo else MAX_NEW_TOKENS)
        grown = int(self.batch_loop() is not None and not self.unbatched)
        positions = prefill + draws
        if self.t3.tfmr.config.max_positions:  # Turbo's decode ends at its position table
            positions = min(positions, self.t3.tfmr.config.max_positions)
        return {"positions": positions, "prefill": prefill, "grown": grown}

    def _to_audio(self, tokens: list[int], voice: Conditioning, generator: torch.Generator, speed: float
                  ) -> torch.Tensor:
        if not tokens:
            raise InvalidRequest("the model spoke no speech tokens for this text", field="text")
        frames = 2 * (voice.gen_prompt_token.shape[-1] + len(tokens))

        def run(device: Any) -> torch.Tensor:
            mel = self.s3gen.mel(torch.tensor(tokens), voice.gen_prompt_token, voice.gen_prompt_feat,
                                 voice.gen_embedding, generator)
            if speed != 1.0:
                mel = torch.nn.functional.interpolate(mel, size=max(1, int(mel.shape[2] / speed)), mode="linear")
            return self.s3gen.wav(mel, generator)[0]
        vocoded = int(2 * len(tokens) / speed) + 1  # HiFT speaks the new mel only (the prompt's is cut), resized
        return self.compute("s3gen", run, kind="flow", urgent=True, tokens=frames // 2, frames=frames, vocoded=vocoded)

    def mark(self, audio: torch.Tensor) -> torch.Tensor:
        """Perth's watermark over audio, when the model was loaded with one."""
        if self.watermarker is None or audio.numel() == 0:
            return audio
        marked = self.watermarker.apply_watermark(audio.numpy(), sample_rate=SAMPLE_RATE)
        return torch.as_tensor(marked, dtype=torch.float32).reshape(-1)

    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """The request's audio (one chunk, or growing chunks when streaming); the runtime bounds every wait by the
        request's lease (the runtime reads it from the request's context: `compute` and `decode` take none)."""
        if request.text_streamed:
            raise InvalidRequest("Chatterbox takes the text as one string", field="text")
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        voice = self._conditioning(request.voice, request.options)
        if request.stream:
            from mizuoto_chatterbox.stream import stream_audio

            yield from stream_audio(self, request, voice, generator, seed)
            return
        tokens = self.speech_tokens(request, voice, generator)
        audio = self._to_audio(tokens, voice, generator, request.speed)
        yield AudioChunk(self.mark(audio), SAMPLE_RATE, 0, True)

    def close(self) -> None:
        super().close()  # the continuous batch, if it batches: answers what still waits and joins its loop
        self.presets.clear()
        self.cached.clear()


def _watermarker(enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        import perth
    except ImportError:
        return None  # the extra is not installed: upstream's mark is skipped (docs/engines/chatterbox.md)
    return perth.PerthImplicitWatermarker()


class ChatterboxEngine(Engine):
    """Chatterbox and Chatterbox-Turbo (Resemble AI) directories as upstream's from_local reads them."""

    name = "chatterbox"
    description = "Chatterbox and Chatterbox-Turbo (Resemble AI), mizuoto-chatterbox plugin"
    capabilities = Capabilities(modes=frozenset({"preset", "clone", "cross_lingual"}), sample_rate=SAMPLE_RATE,
                                stream_out=True, languages=("en",), voice_cache=True,
                                options=ENGLISH_OPTIONS + TURBO_ONLY)

    bench_random = ("chatterbox", "chatterbox-turbo")  # `mizuoto bench --random chatterbox`: full-size, random

    def bench_driver(self, model_dir: Path | None, random: str | None, options: Any, settings: Any,
                     workdir: Path, assets: str | Path | None = None) -> Any:
        """`mizuoto bench`'s driver: this engine's own model of a directory, or a full-size random one."""
        from mizuoto_chatterbox.bench import bench_driver

        return bench_driver(model_dir, random, options, settings)

    def detect(self, model_dir: Path) -> bool | str:
        try:
            t3 = one_of(model_dir, T3_FILES)
            one_of(model_dir, S3GEN_FILES)
            d = Path(model_dir)
            tokenizer = (d / "tokenizer.json").is_file() or (d / "vocab.json").is_file() and (d / "merges.txt").is_file()
            ok = (d / VOICE_ENCODER).is_file() and tokenizer
        except Exception:  # detect never raises: a dir that is not ours is simply not ours
            return False
        return ("turbo" if T3_FILES[t3.name] else "english") if ok else False

    def load(self, model_dir: Path, options: Any) -> ChatterboxModel:
        model_dir = Path(model_dir)
        precision = getattr(options, "precision", "fp32")
        if precision != "fp32":
            raise ModelLoadError(f"Chatterbox runs in fp32 here; precision {precision!r} is not supported")
        device = str(getattr(options, "device", "cpu"))
        if device not in ("cpu", "auto"):  # its draws and buffers are made on the CPU (docs/engines/chatterbox.md)
            raise ModelLoadError(f"mizuoto-chatterbox runs on the CPU for now, not {device}: load it with "
                                 "device=cpu (--device cpu)")
        t3 = load_t3(one_of(model_dir, T3_FILES))
        s3gen = load_s3gen(one_of(model_dir, S3GEN_FILES))
        if t3.turbo != s3gen.meanflow:
            raise ModelLoadError(f"{model_dir}: T3 and S3Gen are of different models (Turbo's T3 goes with "
                                 "s3gen_meanflow.safetensors, the English one with s3gen.safetensors)")
        preset = load_preset(model_dir / PRESET) if (model_dir / PRESET).is_file() else None
        compute = getattr(options, "compute", None)
        return ChatterboxModel(model_dir, t3, s3gen, TextFront(model_dir, t3.turbo),
                               load_voice_encoder(model_dir / VOICE_ENCODER), load_s3_tokenizer(model_dir),
                               load_xvector(model_dir), preset,
                               _watermarker(bool(getattr(options, "watermark", True))),
                               batch=int(getattr(compute, "batch", 1) or 1))
