"""One CosyVoice request, from model input to audio chunks: upstream's `model.tts` without its LM thread.

The Synthesizer calls the model's stage modules directly through one interface each: the LM's
`generate` / `generate_bistream`, the flow's `token2mel` and the vocoder's `vocode` (each
generation's class implements them), each call stated to the model (`compute(stage, ...)`; the
LM's token loop `decode("llm", ...)`) so the runtime reserves, places and runs it. Chunks stay on
the stage's device between stages.

Upstream runs the LM in a thread and polls its token list; the chunk boundaries depend only on
the token sequence, so running the LM in the request's thread and cutting chunks as tokens
arrive gives the same chunks. Draw order (seeding rule, see docs/engines/cosyvoice.md):

- the LM draws from `Generator(seed)`;
- the flow (v1 noise) and the vocoder draw from the same generator when nothing else draws
  concurrently in upstream (non-streaming, or voice conversion, which has no LM): that is
  upstream's order exactly (LM, flow noise, vocoder noise);
- in LM-driven streaming they draw from their own `Generator(seed + 1)`, because upstream's
  interleaving there depends on thread timing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from mizuoto.engines.cosyvoice.llm import MAX_TOKEN_TEXT_RATIO
from mizuoto.errors import InvalidRequest
from mizuoto.nn.vocoders.crossfade import fade_in_out


class FlowStage(Protocol):
    """Speech tokens (+ voice prompt) -> mel; implemented by every CosyVoice flow class."""

    output_size: int
    input_frame_rate: int

    def token2mel(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, *, streaming: bool, finalize: bool, cache: Any,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, Any]:
        """(mel (1, mels, frames) without the prompt's frames, the next call's cache)."""


class VocoderStage(Protocol):
    """Mel -> audio; implemented by HiFTGenerator and CausalHiFTGenerator."""

    def vocode(self, mel: torch.Tensor, *, cache_source: torch.Tensor | None, finalize: bool,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(speech (1, samples), source (1, 1, samples))."""


@dataclass(frozen=True)
class StreamSchedule:
    """Upstream's streaming constants for one generation (cosyvoice/cli/model.py)."""

    version: int
    token_hop_len: int          # first hop (v2/v3) or fixed hop (v1)
    token_max_hop_len: int
    scale_factor: int           # hop growth per chunk
    token_overlap_len: int = 0  # v1 only
    mel_overlap_len: int = 0    # v1 only: mel crossfade between flow chunks
    mel_cache_len: int = 0      # v1/v2 vocoder cache, in mel frames
    source_cache_len: int = 0   # v1/v2 vocoder cache, in samples
    token_mel_ratio: int = 1    # v2/v3: mel frames per token (the flow's own)
    pre_lookahead_len: int = 0  # v2/v3: look-ahead tokens of a streamed chunk (the flow's own)


def schedule_for(version: int, flow: FlowStage, sample_rate: int) -> StreamSchedule:
    """The streaming constants upstream derives for `version` from the built flow's rates."""
    if version == 1:
        overlap = 20
        # upstream writes 22050 / 256 here whatever the model's rate (CosyVoiceModel.__init__)
        mel_overlap = int(overlap / flow.input_frame_rate * 22050 / 256)
        return StreamSchedule(1, 2 * flow.input_frame_rate, 4 * flow.input_frame_rate, 1, overlap, mel_overlap,
                              20, 20 * 256)
    hop_len = sample_rate // 50  # mel hop: 480 at 24 kHz
    return StreamSchedule(version, 25, 100, 2, 0, 0, 8, 8 * hop_len, flow.token_mel_ratio, flow.pre_lookahead_len)


Compute = Callable[..., Any]  # the model's `compute(stage, fn, kind=..., urgent=..., reserve=..., **sizes)`
Decode = Callable[..., Iterator[int]]  # the model's `decode(stage, loop, alone=..., **sizes)`


class Synthesizer:
    """Runs upstream's token2wav schedule for one generation over the model's LM, flow and vocoder.

    Every piece of heavy work is stated to the model (`compute(stage, fn, **sizes)`: the runtime
    reserves, places and runs it on the model's compute thread) and the LM's tokens come from
    `decode("llm", loop)`, alone or in the model's batch: one path whether the model batches or not.
    """

    def __init__(self, schedule: StreamSchedule, *, lm: Any | None, flow: FlowStage, hift: VocoderStage,
                 compute: Compute, decode: Decode, precision: str = "fp32",
                 lm_options: dict[str, Any] | None = None,
                 token_filter: Callable[[Iterable[int]], Iterator[int]] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, alone: bool = False):
        self.schedule = schedule
        self.lm, self.flow, self.hift = lm, flow, hift
        self.compute = compute
        self.decode = decode
        self.alone = alone  # the LM runs by itself in the calling thread even on a batching model (the bench)
        self.precision = precision
        self.lm_options = dict(lm_options or {})  # generate()'s cache, CUDA-graph and length options
        self.mel_bins = flow.output_size
        self.token_filter = token_filter  # v3 drops long silence runs before the flow
        self.on_tokens = on_tokens  # observer for tests and benchmarks: the final token list
        s = schedule
        self.speech_window = np.hamming(2 * s.source_cache_len) if s.source_cache_len else None
        self.mel_window = np.hamming(2 * s.mel_overlap_len) if s.mel_overlap_len else None

    def _empty_inputs(self) -> dict[str, torch.Tensor]:
        """What upstream's model.tts assumes for keys a mode leaves out: empty prompts."""
        no_tokens = torch.zeros(1, 0, dtype=torch.int32)
        return {"prompt_text": no_tokens, "llm_prompt_speech_token": no_tokens, "flow_prompt_speech_token": no_tokens,
                "prompt_speech_feat": torch.zeros(1, 0, self.mel_bins), "llm_embedding": torch.zeros(0, 192),
                "flow_embedding": torch.zeros(0, 192), "source_speech_token": no_tokens}

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        return fp16_autocast(self.precision, device)

    # -- the three stages ---------------------------------------------------------------------
    def lm_tokens(self, inputs: dict[str, Any], generator: torch.Generator, **sizes: int) -> Iterator[int]:
        """The LM's raw speech tokens for one model input, as the model decodes them (`sizes`: the call's)."""
        if self.lm is None:
            raise InvalidRequest("this model has no LM stage; only voice conversion is possible", field="mode")
        text, prompt_text, prompt_speech = inputs["text"], inputs["prompt_text"], inputs["llm_prompt_speech_token"]

        def loop(steps: Any) -> Iterator[int]:
            if isinstance(text, torch.Tensor):
                return self.lm.generate(text, prompt_text, prompt_speech, generator=generator,
                                        embedding=inputs["llm_embedding"], **self.lm_options, steps=steps)
            # streamed text has no length bound for a static cache: eager steps (on CUDA still the
            # on-device sampler)
            return self.lm.generate_bistream(text, prompt_text, prompt_speech, generator=generator, steps=steps)

        yield from self.decode("llm", loop, alone=self.alone, **sizes)

    def lm_call(self, inputs: dict[str, Any], generator: torch.Generator) -> list[int]:
        """The LM's whole generation for one model input, reserved as one call (`sizes` of "llm") at the
        positions it may fill: the prompt, the text and upstream's cap of speech tokens."""
        text = inputs["text"]
        if not isinstance(text, torch.Tensor):  # streamed text: no length to reserve for (admission's bound)
            return list(self.lm_tokens(inputs, generator))
        ratio = self.lm_options.get("max_token_text_ratio", MAX_TOKEN_TEXT_RATIO)
        prompt = 3 + inputs["prompt_text"].shape[1] + inputs["llm_prompt_speech_token"].shape[1]  # sos, x-vector, task
        prefill = prompt + text.shape[1]
        return list(self.lm_tokens(inputs, generator, positions=prefill + int(text.shape[1] * ratio), rows=1,
                                   prefill=prefill))

    def speech_tokens(self, inputs: dict[str, Any], generator: torch.Generator) -> Iterator[int]:
        """The tokens the flow speaks: the source's (voice conversion) or the LM's, filtered (v3)."""
        source = inputs["source_speech_token"]
        if source.shape[1] > 0:
            yield from (int(t) for t in source.flatten().tolist())
            return
        raw = self.lm_tokens(inputs, generator)
        yield from self.token_filter(raw) if self.token_filter else raw

    def mel(self, token: torch.Tensor, inputs: dict[str, Any], *, streaming: bool, finalize: bool, cache: Any,
            generator: torch.Generator | None) -> tuple[torch.Tensor, Any]:
        """The flow on `token` (1, N) with the input's voice prompt; the mel stays on the flow's device.

        Its working memory is reserved for the call's sizes (flow_call_sizes) before it runs.
        """
        return self.compute("flow", lambda device: self._mel(device, token, inputs, streaming, finalize, cache,
                                                             generator),
                            **self.flow_call_sizes(token.shape[1], inputs))

    def flow_call_sizes(self, tokens: int, inputs: dict[str, Any]) -> dict[str, int]:
        """The flow call's sizes: tokens into its encoder (prompt and speech) and mel frames its decoder runs on."""
        prompt = inputs["flow_prompt_speech_token"].shape[1]
        if self.schedule.version == 1:  # the length regulator maps tokens to the mel rate after the prompt's frames
            frames = inputs["prompt_speech_feat"].shape[1] + self.flow.mel_frames(tokens)
        else:
            frames = self.schedule.token_mel_ratio * (prompt + tokens)
        return {"tokens": prompt + tokens, "frames": frames}

    def _mel(self, device: torch.device, token: torch.Tensor, inputs: dict[str, Any], streaming: bool,
             finalize: bool, cache: Any, generator: torch.Generator | None) -> tuple[torch.Tensor, Any]:
        with self._autocast(device):
            args = [t.to(device) for t in (token, inputs["flow_prompt_speech_token"], inputs["prompt_speech_feat"],
                                           inputs["flow_embedding"])]
            mel, cache = self.flow.token2mel(*args, streaming=streaming, finalize=finalize, cache=cache,
                                             generator=generator)
        return mel.float(), cache

    def speech(self, mel: torch.Tensor, *, cache_source: torch.Tensor | None, finalize: bool,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The vocoder on `mel`; speech and source stay on the vocoder's device (its room reserved first)."""
        return self.compute("hift", lambda device: self._speech(device, mel, cache_source, finalize, generator),
                            kind="vocoder", frames=mel.shape[2])

    def _speech(self, device: torch.device, mel: torch.Tensor, cache_source: torch.Tensor | None, finalize: bool,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        if cache_source is not None:
            cache_source = cache_source.to(device)
        return self.hift.vocode(mel.to(device), cache_source=cache_source, finalize=finalize, generator=generator)

    # -- request ------------------------------------------------------------------------------
    def run(self, inputs: dict[str, Any], *, stream: bool, speed: float, lm_gen: torch.Generator,
            voc_gen: torch.Generator) -> Iterator[torch.Tensor]:
        """Yield float32 [1, N] audio chunks for one model input (upstream's model.tts)."""
        for audio, _ in self.run_marked(inputs, stream=stream, speed=speed, lm_gen=lm_gen, voc_gen=voc_gen):
            yield audio

    def run_marked(self, inputs: dict[str, Any], *, stream: bool, speed: float, lm_gen: torch.Generator,
                   voc_gen: torch.Generator) -> Iterator[tuple[torch.Tensor, bool]]:
        """As run, each chunk paired with whether it is this input's last (known without waiting for more)."""
        inputs = {**self._empty_inputs(), **inputs}
        if not stream:
            if inputs["source_speech_token"].shape[1] > 0:
                all_tokens = list(self.speech_tokens(inputs, lm_gen))
            else:
                all_tokens = self.lm_call(inputs, lm_gen)
                all_tokens = list(self.token_filter(all_tokens)) if self.token_filter else all_tokens
            if self.on_tokens:
                self.on_tokens(all_tokens)
            yield self._token2wav(all_tokens, inputs, _State(), voc_gen, offset=0, streaming=False,
                                  finalize=True, speed=speed), True
            return
        yield from self._stream(self.speech_tokens(inputs, lm_gen), inputs, voc_gen)

    def _stream(self, tokens: Iterator[int], inputs: dict[str, Any], gen: torch.Generator
                ) -> Iterator[tuple[torch.Tensor, bool]]:
        s = self.schedule
        state = _State()
        got: list[int] = []
        if s.version == 1:
            hop, start = s.token_hop_len, 0
            for tok in tokens:
                got.append(tok)
                while len(got) - start >= hop + s.token_overlap_len:
                    chunk = got[start:start + hop + s.token_overlap_len]
                    yield self._token2wav(chunk, inputs, state, gen, offset=0, streaming=True, finalize=False), False
                    start += hop
                    hop = min(s.token_max_hop_len, hop * s.scale_factor)
            if self.on_tokens:
                self.on_tokens(list(got))
            yield self._token2wav(got[start:], inputs, state, gen, offset=0, streaming=False, finalize=True), True
            return
        prompt_len = inputs["flow_prompt_speech_token"].shape[1]
        pad = int(np.ceil(prompt_len / s.token_hop_len) * s.token_hop_len - prompt_len)
        hop, offset = s.token_hop_len, 0
        for tok in tokens:
            got.append(tok)
            while True:
                this_hop = hop + pad if offset == 0 else hop
                if len(got) - offset < this_hop + s.pre_lookahead_len:
                    break
                chunk = got[:offset + this_hop + s.pre_lookahead_len]
                yield self._token2wav(chunk, inputs, state, gen, offset=offset, streaming=True, finalize=False), False
                offset += this_hop
                hop = min(s.token_max_hop_len, hop * s.scale_factor)
        if self.on_tokens:
            self.on_tokens(list(got))
        # upstream's last call passes no `stream`, so the flow runs non-streaming on it
        yield self._token2wav(got, inputs, state, gen, offset=offset, streaming=False, finalize=True), True

    # -- token2wav ----------------------------------------------------------------------------
    def _token2wav(self, tokens: list[int], inputs: dict[str, Any], state: "_State", gen: torch.Generator, *,
                   offset: int, streaming: bool, finalize: bool, speed: float = 1.0) -> torch.Tensor:
        def here(_: Any) -> torch.Tensor:
            return self._token2wav_here(tokens, inputs, state, gen, offset=offset, streaming=streaming,
                                        finalize=finalize, speed=speed)
        if not tokens:
            return here(None)
        # all of a chunk's tensor work (flow, vocoder, crossfades) is one unit on the model's compute thread; a
        # request in a batch reserves its calls first (the loop never waits for room): the flow's exact figure,
        # the vocoder's for at most the flow's frames with its cache, slowed by `speed`
        sizes = self.flow_call_sizes(len(tokens), inputs)
        vocoded = int((sizes["frames"] + self.schedule.mel_cache_len) / min(speed, 1.0)) + 1
        audio = self.compute(None, here, kind="chunk", urgent=not state.chunks,
                             reserve={"flow": sizes, "hift": {"frames": vocoded}})
        state.chunks += 1
        return audio

    def _token2wav_here(self, tokens: list[int], inputs: dict[str, Any], state: "_State", gen: torch.Generator, *,
                        offset: int, streaming: bool, finalize: bool, speed: float = 1.0) -> torch.Tensor:
        s = self.schedule
        if not tokens:
            # The LM may stop at once (a streamed-text final decode allows eos at its first step);
            # upstream's vocoder then fails on an empty mel: this segment simply has no audio.
            return torch.zeros(1, 0)
        token = torch.tensor([tokens], dtype=torch.int32)
        mel, state.flow_cache = self.mel(token, inputs, streaming=streaming, finalize=finalize,
                                         cache=state.flow_cache, generator=gen)
        if s.version == 3:
            return self._vocode_v3(mel[:, :, offset * s.token_mel_ratio:], state, gen, finalize, speed)
        if s.version == 2:
            mel = mel[:, :, offset * s.token_mel_ratio:]
        elif state.mel_overlap is not None:
            mel = fade_in_out(mel, state.mel_overlap, self.mel_window)
        return self._vocode_cached(mel, state, gen, finalize, speed)

    def _vocode_cached(self, mel: torch.Tensor, state: "_State", gen: torch.Generator, finalize: bool,
                       speed: float) -> torch.Tensor:
        s = self.schedule
        if state.hift_cache is not None:
            mel = torch.cat([state.hift_cache["mel"], mel], dim=2)
            cache_source = state.hift_cache["source"]
        else:
            cache_source = torch.zeros(1, 1, 0, device=mel.device)
        if not finalize:
            if s.version == 1:
                state.mel_overlap = mel[:, :, -s.mel_overlap_len:]
                mel = mel[:, :, :-s.mel_overlap_len]
            speech, source = self.speech(mel, cache_source=cache_source, finalize=False, generator=gen)
            if state.hift_cache is not None:
                speech = fade_in_out(speech, state.hift_cache["speech"], self.speech_window)
            state.hift_cache = {"mel": mel[:, :, -s.mel_cache_len:], "source": source[:, :, -s.source_cache_len:],
                                "speech": speech[:, -s.source_cache_len:]}
            return speech[:, :-s.source_cache_len]
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        speech, _ = self.speech(mel, cache_source=cache_source, finalize=True, generator=gen)
        if state.hift_cache is not None:
            speech = fade_in_out(speech, state.hift_cache["speech"], self.speech_window)
        return speech

    def _vocode_v3(self, mel: torch.Tensor, state: "_State", gen: torch.Generator, finalize: bool,
                   speed: float) -> torch.Tensor:
        # CosyVoice 3 re-runs the causal vocoder on all mel so far and cuts what was already sent.
        if state.mel_so_far is not None:
            mel = torch.cat([state.mel_so_far, mel], dim=2)
        state.mel_so_far = mel
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        speech, _ = self.speech(mel, cache_source=None, finalize=finalize, generator=gen)
        speech = speech[:, state.speech_offset:]
        state.speech_offset += speech.shape[1]
        return speech


def fp16_autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Upstream's fp16: `torch.cuda.amp.autocast(fp16)` around the LM and the flow (CUDA only)."""
    return torch.autocast("cuda", dtype=torch.float16, enabled=precision == "fp16" and torch.device(device).type == "cuda")


def request_generators(seed: int, stream: bool, has_lm: bool) -> tuple[torch.Generator, torch.Generator]:
    """(LM generator, flow/vocoder generator) for a request, by the seeding rule in this module's docstring."""
    lm_gen = torch.Generator().manual_seed(seed)
    if stream and has_lm:
        return lm_gen, torch.Generator().manual_seed(seed + 1)
    return lm_gen, lm_gen


class _State:
    """Per-request caches (upstream keeps these in dicts keyed by a uuid)."""

    def __init__(self) -> None:
        self.flow_cache: Any = None
        self.mel_overlap: torch.Tensor | None = None
        self.hift_cache: dict[str, torch.Tensor] | None = None
        self.mel_so_far: torch.Tensor | None = None
        self.speech_offset = 0
        self.chunks = 0  # chunks made so far: the first is the request's first audio
