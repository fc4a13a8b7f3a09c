"""`mizuoto bench` for Qwen3-TTS: the loaded model's own stage calls on one fixed request.

The driver holds a Qwen3TTSModel (a model directory, or `--random qwen3tts[-1.7b|-0.6b]`: full-size
random weights, random_model.py) and times what a request runs: the talker and code predictor's
frame loop (`Qwen3TTSModel.frames`, the stop code banned so exactly `tokens` frames come), the codec
decoder (`Qwen3TTSModel._decode`), and a streamed request (`Qwen3TTSModel.synthesize`). A bench
"token" is one 12.5 Hz frame: a talker step and the code predictor's 15 passes. Qwen3-TTS has no
flow stage: `flow` only stacks the frames (it reads as ~0 ms). The voice is the model's first preset
speaker (CustomVoice), the designed voice with a fixed instruction (VoiceDesign), or a random x-vector
kept as a cached voice (Base, so the request needs no clip).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.engine import SynthesisRequest, check_request
from mizuoto.runtime.memory import tensor_bytes
from mizuoto_qwen3tts.clone import ClonePrompt
from mizuoto_qwen3tts.engine import DESIGN_VOICE, Qwen3TTSEngine, Qwen3TTSModel

FRAME_RATE = 12.5  # frames per second of audio
DESIGN_INSTRUCTION = "A calm, clear voice at an even pace."
BENCH_VOICE = "bench"  # a Base model's cached voice: a random x-vector


class Qwen3TTSBench:
    """The bench driver of one Qwen3-TTS model (see mizuoto.runtime.bench.BenchDriver)."""

    def __init__(self, model: Qwen3TTSModel, settings: Any, label: str) -> None:
        self.model, self.settings = model, settings
        self.device = torch.device("cpu")
        self.sample_rate = model.capabilities.sample_rate
        layout = model.layout
        self.name = f"qwen3tts {layout.kind} {layout.size} ({label}; fp32)"
        extra: dict[str, Any] = {}
        if layout.kind == "custom_voice":
            voice = next(iter(layout.speakers))
        elif layout.kind == "voice_design":
            voice, extra = DESIGN_VOICE, {"instruct": DESIGN_INSTRUCTION}
        else:
            xvector = torch.randn(layout.hidden, generator=torch.Generator().manual_seed(0))
            voice = model._keep(BENCH_VOICE, ClonePrompt(xvector)).id
        self.request = check_request(SynthesisRequest(settings.text, voice=voice, seed=0, **extra), model)
        model.ban_stop = True  # this model is the bench's own: its talker never stops early
        speaker, self.clone = model._voice(self.request)
        o = self.request.options
        prefill = model.parts.prefill(self.request.text, language=o["language"], speaker=speaker,
                                      instruct=self.request.instruct, clone=self.clone,
                                      non_streaming=o["non_streaming_mode"])
        self.prefill_positions = int(prefill.inputs_embeds.shape[1])
        self.batch_width = model.batch_width
        self.use_batch(False)

    def use_batch(self, on: bool) -> None:
        """Route `lm` and `stream` through the talker's batch (the --concurrency sweep) or alone on this thread."""
        self.model.unbatched = not (on and self.model.batch_loop() is not None)

    def loop_seconds(self) -> dict[str, float]:
        """Where the batch loop spent its time so far, by kind of work (none without a batch)."""
        batch = self.model.batch_loop()
        return batch.timings() if batch is not None else {}

    def _exactly(self, tokens: int) -> SynthesisRequest:
        # N talker tokens make N - 1 frames (the last is drawn with no frame after it): one more for `tokens` frames
        return replace(self.request, options={**self.request.options, "max_new_tokens": tokens + 1})

    def lm(self, tokens: int) -> torch.Tensor:
        """Exactly `tokens` frames of codes [tokens, 16] from the talker and code predictor (stop code banned)."""
        frames, _ = self.model.frames(self._exactly(tokens), torch.Generator().manual_seed(0))
        codes = torch.stack(list(frames))
        assert codes.shape[0] == tokens, (codes.shape, tokens)
        return codes

    def lm_bytes_per_step(self, tokens: int) -> int:
        """Bytes one frame reads on average: the talker's layers and head, the code predictor's 15 passes (its
        layers and one head each), and both KV caches."""
        talker, predictor = self.model.parts.talker, self.model.parts.predictor
        passes = len(predictor.heads)
        talker_bytes = tensor_bytes([talker.decoder, talker.head]) - tensor_bytes([talker.decoder.embed_tokens])
        pass_bytes = tensor_bytes([predictor.decoder, predictor.project]) + tensor_bytes([predictor.heads[0]])
        tcfg, pcfg = talker.decoder.config, predictor.decoder.config
        per_position = 2 * 4 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * tcfg.head_dim
        kv = per_position * (self.prefill_positions + tokens / 2)
        # the predictor's cache: 2 to 16 positions over a frame's passes, 9 on average
        kv += passes * 9 * 2 * 4 * pcfg.num_hidden_layers * pcfg.num_key_value_heads * pcfg.head_dim
        return int(talker_bytes + passes * pass_bytes + kv)

    def flow(self, codes: torch.Tensor) -> torch.Tensor:
        """No flow stage in Qwen3-TTS: the frames' codes go to the codec decoder as they are."""
        return codes

    def vocoder(self, codes: torch.Tensor) -> torch.Tensor:
        """The codec decoder's waveform of the frames, as a whole request decodes them."""
        return self.model._decode(codes, self.clone)

    def stream(self, tokens: int) -> Iterator[torch.Tensor]:
        """The request streamed through the model's own `synthesize`, audio chunks as they come."""
        for chunk in self.model.synthesize(replace(self._exactly(tokens), stream=True)):
            yield chunk.samples

    # -- bench --memory ------------------------------------------------------------------------
    tokens_per_second = FRAME_RATE

    def memory_case(self, tokens: int, stream: bool, rows: int) -> None:
        """One request of `tokens` frames through the model's own calls (each inside its reserved room)."""
        if rows != 1:
            raise InvalidRequest("bench --memory: Qwen3-TTS cases run one request (--memory-rows 1)")
        for _ in self.model.synthesize(replace(self._exactly(tokens), stream=stream)):
            pass


def bench_driver(model_dir: Path | None, random: str | None, options: Any, settings: Any,
                 workdir: Path) -> Qwen3TTSBench:
    """The driver of a loaded directory, or of a full-size random model of kind `random` (configs in `workdir`)."""
    if str(getattr(options, "device", "cpu")) not in ("cpu", "auto"):
        raise InvalidRequest("bench: the Qwen3-TTS engine runs on the CPU for now")
    if model_dir is not None:
        return Qwen3TTSBench(Qwen3TTSEngine().load(Path(model_dir), options), settings, Path(model_dir).name)
    if getattr(options, "precision", "fp32") != "fp32":
        raise InvalidRequest("bench: Qwen3-TTS runs in fp32 here")
    from mizuoto_qwen3tts.random_model import random_parts

    parts = random_parts(random, Path(workdir) / random)
    compute = getattr(options, "compute", None)
    model = Qwen3TTSModel(parts.layout, parts, batch=int(getattr(compute, "batch", 1) or 1))
    return Qwen3TTSBench(model, settings, f"{random}, random weights")
