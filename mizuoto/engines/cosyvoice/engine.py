"""The CosyVoice engine plugin (v1, v2, v3): detection, loading, stages, voices and synthesis.

A request runs as upstream's `inference_<mode>`: the text is normalized and split into
segments, each segment becomes upstream's model input, and `synthesis.Synthesizer` runs the
LM, flow and vocoder on it. Generators are made once per request and carried across
segments, as upstream's global generator is.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mizuoto.engines.cosyvoice.flow import build_flow, load_flow_weights
from mizuoto.engines.cosyvoice.frontend import CosyVoiceFrontend
from mizuoto.engines.cosyvoice.hift import load_hift
from mizuoto.engines.cosyvoice.llm import QwenSpeechLM, drop_silent_runs, load_lm
from mizuoto.engines.cosyvoice.memory import FlowMemory, HiftMemory, LmMemory, admission
from mizuoto.engines.cosyvoice.noise import cosyvoice3_noise
from mizuoto.engines.cosyvoice.synthesis import Synthesizer, fp16_autocast, request_generators, schedule_for
from mizuoto.engines.cosyvoice.variants import find_variant, load_config
from mizuoto.nn.vocoders.f0 import f0_device
from mizuoto.runtime.engine import (MODES, AudioChunk, Capabilities, Engine, Model, Reference, Stage,
                                    SynthesisRequest, Voice, VoicePrompt, check_request)
from mizuoto.errors import InvalidRequest, MizuotoError, ModelLoadError
from mizuoto.runtime.options import LoadOptions

log = logging.getLogger("mizuoto.cosyvoice")

LANGUAGES = ("zh", "en", "ja", "ko", "yue")
SEGMENTED_TEXTS = 64  # texts whose segments a model keeps (admission and the run share one normalization)
# what a cached voice holds (upstream's add_zero_shot_spk entry), beside the optional "prompt_text" tokens
PROMPT_KEYS = ("llm_prompt_speech_token", "flow_prompt_speech_token", "prompt_speech_feat", "llm_embedding",
               "flow_embedding")


class CosyVoiceEngine(Engine):
    """CosyVoice 1 (300M, -SFT, -Instruct), 2 (0.5B) and 3 (Fun-CosyVoice3-0.5B) model directories."""

    name = "cosyvoice"
    description = "Alibaba Tongyi CosyVoice v1/v2/v3: LLM + flow matching + HiFT, sample-identical to upstream on the CPU"
    capabilities = Capabilities(modes=frozenset(MODES), sample_rate=24000, stream_out=True, stream_in=True,
                                languages=LANGUAGES, voice_cache=True)

    bench_random = ("cosyvoice1", "cosyvoice2", "cosyvoice3")  # `mizuoto bench --random cosyvoice2`

    def bench_driver(self, model_dir: Path | None, random: str | None, options: Any, settings: Any,
                     workdir: Path, assets: str | Path | None = None) -> Any:
        """`mizuoto bench`'s driver: this engine's own model of a CosyVoice 2/3 directory or a random full-size one."""
        from mizuoto.engines.cosyvoice.bench import CosyVoiceBench, bench_model_dir

        model_dir, label = bench_model_dir(model_dir, random, workdir, assets)
        return CosyVoiceBench(CosyVoiceModel(model_dir, options, frontend_optional=True), settings, label)

    def detect(self, model_dir: Path) -> bool | str:
        """"cosyvoice1|2|3" when the directory holds that generation's yaml."""
        try:
            variant = find_variant(model_dir)
        except ModelLoadError:
            return "cosyvoice"  # several yamls: ours, and load says which to keep
        except Exception:
            return False
        return f"cosyvoice{variant.version}" if variant else False

    def load(self, model_dir: Path, options: Any) -> "CosyVoiceModel":
        """Build every module from the yaml and load upstream's checkpoints."""
        return CosyVoiceModel(Path(model_dir), options if options is not None else LoadOptions())


class CosyVoiceModel(Model):
    """One loaded CosyVoice directory."""

    def __init__(self, model_dir: Path, options: LoadOptions, frontend_optional: bool = False):
        if not model_dir.is_dir():
            raise ModelLoadError(f"model directory not found: {model_dir}")
        variant = find_variant(model_dir)
        if variant is None:
            raise ModelLoadError(f"{model_dir} holds no cosyvoice.yaml, cosyvoice2.yaml or cosyvoice3.yaml")
        self.model_dir, self.variant, self.options = model_dir, variant, options.resolved()
        if self.options.precision == "fp16" and torch.device(self.options.device).type != "cuda":
            log.warning("fp16 runs only on CUDA (as upstream); %s runs in fp32", model_dir)
        self.config = config = load_config(model_dir, variant)
        self.sample_rate = int(config["sample_rate"])
        device = torch.device(self.options.device)
        self.llm = load_lm(model_dir, config)
        self.flow = load_flow_weights(build_flow(config), model_dir / "flow.pt")
        self._graphs_arg = self._cuda_graphs(device)
        if self.options.compute.compile:
            # in place (Module.compile): parameter names, device moves and memory sizes stay as they are
            self.flow.decoder.estimator.compile()
        noise = cosyvoice3_noise(config) if variant.version == 3 else None
        self.hift = load_hift(model_dir / "hift.pt", config, noise, device="cpu")
        self.frontend = CosyVoiceFrontend(model_dir, variant, config, device="cpu",
                                          exact_embedding=self.options.compute.reference == "exact")
        self.presets, self.cached = self._read_spk2info(model_dir / "spk2info.pt")
        self._voices_lock = threading.Lock()
        self._segmented: OrderedDict[str, list[str]] = OrderedDict()  # text -> its segments, newest last
        self._segmented_lock = threading.Lock()
        self.schedule = schedule_for(variant.version, self.flow, self.sample_rate)
        self.batch_width = self._batch_width(self.options.compute.batch)
        self._audio_ok = not self.frontend.missing_files(need_audio=True)
        self._text_ok = not self.frontend.missing_files(need_audio=False)
        front_modules = {}
        if self._audio_ok:
            front_modules = {"speech_tokenizer": self.frontend.speech_tokenizer, "campplus": self.frontend.campplus}
        fixed_hift = {"f0_predictor"} if variant.version == 3 and f0_device(device) != device else set()
        calls = {"llm": LmMemory(self.llm, static=self.options.compute.kv_cache == "static"),
                 "flow": FlowMemory(self.flow), "hift": HiftMemory(self.hift)}
        admitted = admission(calls["llm"], calls["flow"], calls["hift"], self._segment_tokens, variant.version,
                             self.schedule_mel_frames)
        self.stages = (
            Stage("frontend", "frontend", front_modules, fixed={"campplus"} & set(front_modules)),
            Stage("llm", "sequence", {"llm": self.llm}, memory=admitted["llm"], call_memory=calls["llm"],
                  sequence=self._sequence(device)),
            Stage("flow", "frames", {"flow": self.flow}, memory=admitted["flow"], call_memory=calls["flow"],
                  bound_memory=admitted["flow_bound"]),
            Stage("hift", "frames", dict(self.hift.named_children()), fixed=fixed_hift,
                  memory=admitted["hift"], call_memory=calls["hift"], bound_memory=admitted["hift_bound"]),
        )
        # the bench runs token ids through the stages: a directory without the front end's files is fine there
        self.capabilities = None if frontend_optional and not self._audio_ok else self._capabilities()

    def _segments(self, text: str) -> list[str]:
        """Upstream's segments of `text`, normalized once for the request's admission and its run."""
        with self._segmented_lock:
            hit = self._segmented.get(text)
        if hit is None:
            hit = self.frontend.segments(text)
            with self._segmented_lock:
                self._segmented[text] = hit
                while len(self._segmented) > SEGMENTED_TEXTS:
                    self._segmented.popitem(last=False)
        return list(hit)

    def _segment_tokens(self, text: str) -> list[int]:
        """Text tokens of each segment the request's text becomes (the admission's count; see memory.py)."""
        segments = self._segments(text)
        if self.variant.version == 3:
            segments = [self.frontend.with_system_prompt(s) for s in segments]
        return [len(self.frontend.tokenizer.encode(s)) for s in segments]

    def schedule_mel_frames(self, tokens: int) -> int:
        """Mel frames the flow makes for `tokens` speech tokens."""
        return self.flow.mel_frames(tokens) if self.variant.version == 1 else self.schedule.token_mel_ratio * tokens

    def _cuda_graphs(self, device: torch.device) -> dict[str, bool]:
        """The LM's `cuda_graphs` argument (none for CosyVoice 1's LM); when requested but impossible, log why once."""
        qwen = hasattr(self.llm, "generate_bistream")  # v1's wenet LM has no graphed decode step
        why = None
        if not self.options.compute.cuda_graphs:
            return {"cuda_graphs": False} if qwen else {}
        if not qwen:
            why = "CosyVoice 1's LM has no graphed decode step"
        elif self.options.compute.kv_cache != "static":
            why = "it needs compute.kv_cache=static"
        elif device.type != "cuda":
            why = f"CUDA graphs need a CUDA device, not {device}"
        if why is not None:
            log.warning("compute.cuda_graphs is on but has no effect for the LM: %s; running eagerly", why)
        return {"cuda_graphs": why is None} if qwen else {}

    def _batch_width(self, width: int) -> int:
        """Requests the LM's continuous batch runs at once (compute.batch; CosyVoice 1's LM runs one at a time)."""
        if width > 1 and not isinstance(self.llm, QwenSpeechLM):
            log.warning("CosyVoice 1's LM does not batch: %s runs one request at a time", self.model_dir)
            return 1
        return max(1, width)

    def _sequence(self, device: torch.device) -> Any:
        """The LM as the runtime runs it (Qwen LMs; CosyVoice 1's wenet LM runs its own passes)."""
        if not isinstance(self.llm, QwenSpeechLM):
            return None
        # the LM is built on the CPU and placed later: a batch packs its layers only if it stays there
        return self.llm.sequence(self._graphs_arg.get("cuda_graphs", False), pack=device.type == "cpu",
                                 context=functools.partial(fp16_autocast, self.options.precision))

    def _capabilities(self) -> Capabilities:
        modes = set()
        if self._text_ok:
            if self.presets:
                modes.add("preset")
                if self.variant.instruct_mode == "instruct":
                    modes.add("instruct")
            if self._audio_ok or self.cached:
                modes |= {"clone", "cross_lingual"}
                if self.variant.instruct_mode == "instruct2":
                    modes.add("instruct")
        if self._audio_ok:
            modes.add("vc")
        if not modes:
            missing = ", ".join(self.frontend.missing_files(need_audio=True))
            raise ModelLoadError(f"{self.model_dir} can serve no mode: it lacks {missing}")
        return Capabilities(modes=frozenset(modes), sample_rate=self.sample_rate, stream_out=True,
                            stream_in=self.variant.version >= 2 and bool(modes & {"clone", "instruct"}),
                            languages=LANGUAGES, voice_cache=self._audio_ok)

    def voices(self) -> list[Voice]:
        with self._voices_lock:
            return [Voice(k, "preset") for k in self.presets] + [Voice(k, "cached") for k in self.cached]

    def add_voice(self, voice_id: str, ref_audio: Any, ref_text: str | None = None) -> Voice:
        """Compute a voice prompt once (upstream's add_zero_shot_spk) and keep it under `voice_id`."""
        if not isinstance(voice_id, str) or not voice_id:
            raise InvalidRequest("voice id must be a non-empty string")
        if voice_id in self.presets:
            raise InvalidRequest(f"{voice_id!r} is a preset voice of this model; choose another id")
        if not self._audio_ok:
            raise InvalidRequest(f"{self.model_dir} cannot take voices from audio: it lacks "
                                 f"{', '.join(self.frontend.missing_files(need_audio=True))}")
        prompt = self._frontend(lambda: self.frontend.voice_prompt(ref_audio, ref_text))
        with self._voices_lock:
            self.cached[voice_id] = prompt
        self.capabilities = self._capabilities()
        return Voice(voice_id, "cached")

    def export_voice(self, voice_id: str) -> VoicePrompt:
        """A cached prompt's tensors (tokens, embeddings, prompt mel, transcript tokens)."""
        with self._voices_lock:
            if voice_id not in self.cached:
                raise InvalidRequest(f"no cached voice {voice_id!r} on {self.model_dir.name}")
            return VoicePrompt(dict(self.cached[voice_id]), {"variant": f"cosyvoice{self.variant.version}"})

    def import_voice(self, voice_id: str, prompt: VoicePrompt) -> Voice:
        """Cache an exported prompt as is; the front end does not run."""
        if voice_id in self.presets:
            raise InvalidRequest(f"{voice_id!r} is a preset voice of this model; choose another id")
        missing = sorted(set(PROMPT_KEYS) - set(prompt.tensors))
        extra = sorted(set(prompt.tensors) - set(PROMPT_KEYS) - {"prompt_text"})
        if missing or extra:
            raise InvalidRequest(f"voice {voice_id!r} is not a CosyVoice prompt (missing {missing}, unknown {extra})")
        with self._voices_lock:
            self.cached[voice_id] = dict(prompt.tensors)
        self.capabilities = self._capabilities()
        return Voice(voice_id, "cached")

    def remove_voice(self, voice_id: str) -> None:
        """Forget a cached voice."""
        with self._voices_lock:
            if self.cached.pop(voice_id, None) is None:
                raise InvalidRequest(f"no cached voice {voice_id!r} on {self.model_dir.name}")
        self.capabilities = self._capabilities()

    def close(self) -> None:
        super().close()  # the continuous batch, if it batches
        self.llm = self.flow = self.hift = None

    # -- spk2info ------------------------------------------------------------------------------
    @staticmethod
    def _read_spk2info(path: Path) -> tuple[dict[str, dict], dict[str, dict]]:
        if not path.is_file():
            return {}, {}
        try:
            info = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
        if not isinstance(info, dict):
            raise ModelLoadError(f"{path} is not a speaker table")
        presets, cached = {}, {}
        for spk, entry in info.items():
            if not isinstance(entry, dict) or "embedding" not in entry and "flow_embedding" not in entry:
                raise ModelLoadError(f"{path}: speaker {spk!r} has no embedding")
            # upstream's add_zero_shot_spk stores a whole prompt; SFT speakers only an embedding
            (cached if "flow_prompt_speech_token" in entry else presets)[str(spk)] = entry
        return presets, cached

    # -- synthesis -----------------------------------------------------------------------------
    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """Upstream's inference for the request's mode (the runtime bounds every wait and stage call by the request's
        lease, read from the request's context: `compute` and `decode` take none)."""
        request = check_request(request, self, self.model_dir.name)
        self._check(request)
        inputs = self._inputs(request)  # everything that can fail on bad input, before any audio
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**31 - 1, (1,)))
        lm_gen, voc_gen = request_generators(seed, request.stream, request.mode != "vc")
        synth = self.synthesizer(with_lm=request.mode != "vc")
        return self._chunks(synth, inputs, request, lm_gen, voc_gen)

    def _check(self, request: SynthesisRequest) -> None:
        """CosyVoice's own request rules (the contract's are checked by `check_request`)."""
        if request.stream and request.speed != 1.0:
            raise InvalidRequest("speed can only be changed without streaming (as upstream)", field="speed")
        if request.text_streamed and (self.variant.version < 2 or request.mode not in ("clone", "instruct")):
            raise InvalidRequest("streaming text in needs CosyVoice 2/3 and a reference text (mode clone, "
                                 f"or instruct); got mode {request.mode!r} on CosyVoice {self.variant.version}",
                                 field="text")

    def synthesizer(self, with_lm: bool = True, batched: bool = True, **lm_options: Any) -> Synthesizer:
        """The request runner over this model's own stages (upstream's model.tts for one model input).

        `lm_options` go to the LM's `generate` beside the load options' KV cache and CUDA graphs
        (the bench passes its stop suppression and length ratio here). `batched=False` runs the LM
        by itself in the calling thread even when the model batches (the bench's single-request figures).
        """
        options = {"cache": self.options.compute.kv_cache, **self._graphs_arg, **lm_options}
        return Synthesizer(self.schedule, lm=self.llm if with_lm else None, flow=self.flow, hift=self.hift,
                           compute=self.compute, decode=self.decode, precision=self.options.precision,
                           lm_options=options, token_filter=drop_silent_runs if self.variant.version == 3 else None,
                           alone=not batched)

    def _chunks(self, synth: Synthesizer, inputs: list[dict], request: SynthesisRequest,
                lm_gen: torch.Generator, voc_gen: torch.Generator) -> Iterator[AudioChunk]:
        def pieces() -> Iterator[tuple[torch.Tensor, bool]]:
            for n, model_input in enumerate(inputs, start=1):
                for audio, last in synth.run_marked(model_input, stream=request.stream, speed=request.speed,
                                                    lm_gen=lm_gen, voc_gen=voc_gen):
                    yield audio[0].float().cpu().contiguous(), last and n == len(inputs)

        audio = pieces()
        if not request.stream:
            # upstream yields one output per text segment; a non-streaming request is one chunk
            parts = [a for a, _ in audio]
            audio = iter([(torch.cat(parts), True)])
        index, samples = 0, 0
        for piece, final in audio:
            samples += piece.numel()
            if final and not samples:
                raise MizuotoError(f"{self.model_dir.name} produced no speech: its LM ended before the first "
                                   "speech token (another seed or a longer text may help)")
            yield AudioChunk(piece, self.sample_rate, index, final)
            index += 1

    def _frontend(self, fn: Any) -> Any:
        """fn() on the model's compute thread with the front end's modules placed."""
        return self.compute("frontend", lambda device: fn())

    def _voice(self, request: SynthesisRequest, need_text: bool, aligned: bool = True) -> dict[str, torch.Tensor]:
        voice = request.voice
        if isinstance(voice, Reference):
            if not self._audio_ok:
                raise InvalidRequest(f"{self.model_dir} cannot take voices from audio: it lacks "
                                     f"{', '.join(self.frontend.missing_files(need_audio=True))}")
            return self._frontend(lambda: self.frontend.voice_prompt(voice.audio, voice.text if need_text else None,
                                                                     aligned))
        with self._voices_lock:
            if voice in self.presets:
                return self.presets[voice]
            if voice in self.cached:
                return self.cached[voice]
        raise InvalidRequest(f"unknown voice {voice!r} for {self.model_dir.name}", field="voice")

    def _inputs(self, request: SynthesisRequest) -> list[dict]:
        """Model inputs, one per text segment; the voice and text are checked before returning."""
        mode = request.mode
        if mode == "vc":
            # upstream's frontend_vc keeps the whole reference (no 2:1 mel/token cut)
            prompt = self._voice(request, need_text=False, aligned=False)
            if "flow_prompt_speech_token" not in prompt:
                raise InvalidRequest("voice conversion needs a reference voice, not a preset speaker", field="voice")
            source = self._frontend(lambda: self.frontend.speech_tokens(request.source_audio))
            keep = ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding")
            return [{**{k: prompt[k] for k in keep}, "source_speech_token": source}]
        is_preset = isinstance(request.voice, str) and request.voice in self.presets
        if mode in ("preset", "instruct") and self.variant.instruct_mode == "instruct" and not is_preset:
            raise InvalidRequest(f"CosyVoice 1 {mode} mode needs a preset voice (one of: "
                                 f"{', '.join(self.presets) or 'none'})", field="voice")
        if mode == "preset" and not is_preset:
            raise InvalidRequest(f"{request.voice!r} is not a preset voice of this model", field="voice")
        prompt = self._voice(request, need_text=mode == "clone")
        if mode in ("clone", "cross_lingual", "instruct") and self.variant.instruct_mode == "instruct2" \
                and "flow_prompt_speech_token" not in prompt:
            raise InvalidRequest(f"mode {mode!r} on CosyVoice {self.variant.version} needs a reference "
                                 "or cached voice, not a preset speaker", field="voice")
        if request.text_streamed:
            text = self.frontend.streamed_tokens(iter(request.text))
            return [self.frontend.model_input(mode, text, prompt, request.instruct)]
        segments = self._segments(request.text)
        if mode == "cross_lingual" and self.variant.version == 3:
            segments = [self.frontend.with_system_prompt(s) for s in segments]
        return [self.frontend.model_input(mode, self.frontend.tokens(s), prompt, request.instruct)
                for s in segments]
