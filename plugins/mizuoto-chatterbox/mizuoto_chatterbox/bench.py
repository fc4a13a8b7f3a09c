"""`mizuoto bench` for Chatterbox: the loaded model's own stage calls on one fixed request.

The driver holds a ChatterboxModel (a model directory, or `--random chatterbox[-turbo]`: full-size
random weights, random_model.py) and times what a request runs: T3's draws (`_draws`, the stop
token suppressed so exactly `tokens` come), S3Gen's flow (`S3Gen.mel`) and HiFT (`S3Gen.wav`), and
a streamed request (`stream.stream_audio`). The request is the settings' text with the model's
preset voice; a directory without one gets a random voice prompt.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.engine import SynthesisRequest, check_request
from mizuoto.runtime.memory import tensor_bytes
from mizuoto_chatterbox.engine import PRESET_VOICE, ChatterboxEngine, ChatterboxModel
from mizuoto_chatterbox.stream import stream_audio


class ChatterboxBench:
    """The bench driver of one Chatterbox model (see mizuoto.runtime.bench.BenchDriver)."""

    def __init__(self, model: ChatterboxModel, settings: Any, label: str) -> None:
        self.model, self.settings = model, settings
        self.device = torch.device("cpu")
        self.sample_rate = 24000
        self.name = f"{'chatterbox-turbo' if model.turbo else 'chatterbox'} ({label}; fp32, upstream's loop)"
        if not model.presets:
            raise InvalidRequest("bench: the Chatterbox directory has no preset voice (conds.pt)")
        self.request = check_request(SynthesisRequest(settings.text, voice=PRESET_VOICE, seed=0), model)
        self.voice = model.presets[PRESET_VOICE]
        self.batch_width = model.batch_width
        self.use_batch(False)

    def use_batch(self, on: bool) -> None:
        """Route `lm` and `stream` through T3's batch (the --concurrency sweep) or upstream's loop here."""
        self.model.unbatched = not (on and self.model.batch_loop() is not None)

    def loop_seconds(self) -> dict[str, float]:
        """Where the batch loop spent its time so far, by kind of work (none without a batch)."""
        batch = self.model.batch_loop()
        return batch.timings() if batch is not None else {}

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def _exactly(self, tokens: int) -> SynthesisRequest:
        self.model.bench_tokens = tokens
        return self.request

    def lm(self, tokens: int) -> list[int]:
        """Exactly `tokens` speech tokens from T3 (the stop token suppressed)."""
        out = list(self.model._draws(self._exactly(tokens), self.voice, self._generator(0)))
        assert len(out) == tokens, (len(out), tokens)
        return [t % 6561 for t in out]  # the rare start token drawn by random weights stands in as a speech token

    def lm_bytes_per_step(self, tokens: int) -> int:
        """Bytes one decode step reads on average: the backbone, T3's head and embeddings, the KV cache."""
        t3 = self.model.t3
        cfg = t3.tfmr.config
        rows = 1 if t3.turbo else 2
        positions = len(self.model.text.ids(self.settings.text)) + self.voice.prompt_tokens.shape[-1] + tokens / 2
        kv = rows * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * positions
        return int(tensor_bytes([t3.tfmr, t3.speech_head]) + kv)

    def flow(self, tokens: list[int]) -> torch.Tensor:
        """Tokens -> mel in one call (a whole request's)."""
        v = self.voice
        return self.model.s3gen.mel(torch.tensor(tokens), v.gen_prompt_token, v.gen_prompt_feat, v.gen_embedding,
                                    self._generator(1))

    def vocoder(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel -> audio in one call, with upstream's trim-fade."""
        return self.model.s3gen.wav(mel, self._generator(2))

    def stream(self, tokens: int) -> Iterator[torch.Tensor]:
        """The request streamed by the engine's chunk schedule, audio chunks as they come."""
        request = replace(self._exactly(tokens), stream=True)
        for chunk in stream_audio(self.model, request, self.voice, self._generator(0), 0):
            yield chunk.samples

    # -- bench --memory ------------------------------------------------------------------------
    tokens_per_second = 25.0  # S3 speech tokens per second of audio

    def memory_case(self, tokens: int, stream: bool, rows: int) -> None:
        """One request of `tokens` speech tokens through the engine's own calls (S3Gen's inside `Model.room`)."""
        if rows != 1:
            raise InvalidRequest("bench --memory: Chatterbox cases run one request (--memory-rows 1)")
        if stream:
            for _ in self.stream(tokens):
                pass
            return
        tokens_out = self.model.speech_tokens(self._exactly(tokens), self.voice, self._generator(0))
        self.model._to_audio(tokens_out, self.voice, self._generator(1), 1.0)


def bench_driver(model_dir: Path | None, random: str | None, options: Any, settings: Any) -> ChatterboxBench:
    """The driver of a loaded directory, or of a full-size random model of kind `random`."""
    if str(getattr(options, "device", "cpu")) not in ("cpu", "auto"):
        raise InvalidRequest("bench: the Chatterbox engine runs on the CPU for now")
    if model_dir is not None:
        return ChatterboxBench(ChatterboxEngine().load(model_dir, options), settings, Path(model_dir).name)
    from mizuoto_chatterbox.random_model import random_parts

    parts = random_parts(random)
    compute = getattr(options, "compute", None)
    model = ChatterboxModel(Path(random), parts["t3"], parts["s3gen"], parts["text"],
                            parts["ve"], parts["tokenizer"], parts["xvector"], parts["preset"],
                            batch=int(getattr(compute, "batch", 1) or 1))
    return ChatterboxBench(model, settings, "random weights")

