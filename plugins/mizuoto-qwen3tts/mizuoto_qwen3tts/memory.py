"""Working memory of Qwen3-TTS's stages, from the loaded modules' sizes (what `bench --memory` measures).

- **Talker** (a whole generation): the talker's KV cache over its positions (the prefill and one a
  step, up to `max_new_tokens`), allocated once when the request runs alone, grown by concatenation
  in a batch's rows (then counted LM_CACHE_COPIES times); the prefill's activations (LM_PREFILL_WIDTHS
  of the widest layer per position) and the logits; the code predictor's cache and logits per frame.
- **Codec** (one decode of `frames`): the decoder's activations, the widest of its stages at its
  length (channels x samples) CODEC_WIDTHS times, bounded by upstream's chunk of 300 frames plus 25 of
  context (the decoder never runs on more at once), and the codebooks each call makes of its EMA sums.
- **Voice** (a clone's front over `samples` at 24 kHz): the codec encoder's first convolutions at the
  full rate and the speaker encoder's layers over the mel frames.
"""

from __future__ import annotations

from typing import Any

from mizuoto.nn.memory import FIXED_BYTES, FLOAT

LM_CACHE_COPIES = 1.5
LM_PREFILL_WIDTHS = 7
TEXT_IDS_BOUND = 600  # prefill positions of a request whose text is not known yet (the planning figure)
CODEC_CHUNK = 300 + 25  # the decoder's largest input (upstream's chunk and its left context)
CODEC_WIDTHS = 6
VOICE_WIDTHS = 6
VOICE_SECONDS_BOUND = 30  # the planning bound of a reference clip


def codec_per_frame(layout: Any) -> int:
    """Floats per frame of the codec decoder's widest activation: channels x its rate, over its stages."""
    from mizuoto_qwen3tts.codec_decoder import decoder_config
    from mizuoto_qwen3tts.weights import read_config

    cfg = decoder_config(read_config(layout.codec_dir), str(layout.codec_dir / "config.json"))
    latent, dim = int(cfg["latent_dim"]), int(cfg["decoder_dim"])
    rate, widest = 1, int(cfg["hidden_size"]) * 4
    for ratio in cfg["upsampling_ratios"]:
        rate *= int(ratio)
        widest = max(widest, 4 * latent * rate)  # a ConvNeXt block's inner layer is 4 x its channels
    widest = max(widest, dim * rate)
    for i, up in enumerate(cfg["upsample_rates"]):
        rate *= int(up)
        widest = max(widest, (dim >> i) * rate // int(up), (dim >> (i + 1)) * rate)
    return widest


class Figures:
    """The call figures of one loaded model."""

    def __init__(self, parts: Any, layout: Any) -> None:
        cfg = parts.talker.decoder.config
        self.per_position = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * FLOAT
        self.width = max(cfg.hidden_size, cfg.intermediate_size)
        self.vocab = cfg.vocab_size
        pcfg = parts.predictor.decoder.config
        self.predictor = ((layout.groups + 1) * pcfg.num_hidden_layers * 2 * pcfg.num_key_value_heads * pcfg.head_dim
                          + 2 * max(pcfg.hidden_size, pcfg.intermediate_size) + pcfg.vocab_size) * FLOAT
        self.default_new_tokens = int(layout.generation.get("max_new_tokens", 2048))
        codec = parts.codec_decoder
        self.codec_per_frame = codec_per_frame(layout)
        self.codebooks = sum(t.numel() for n, t in codec.named_parameters() if n.endswith("embedding_sum")) * FLOAT
        self.rate = codec.sample_rate
        self.voice_per_sample = getattr(parts, "voice_per_sample", 0)

    # -- talker ------------------------------------------------------------------------------------
    def talker_sizes(self, prefill: int, new_tokens: int) -> dict[str, int]:
        """A generation's call sizes: its positions (prefill and every step), its prefill's, and that its cache
        grows (alone on the CPU as in a batch's rows: `generate.FrameLoop._attach`)."""
        return {"positions": prefill + new_tokens, "prefill": prefill, "grown": 1}

    def talker(self, positions: int, prefill: int, grown: int = 0) -> int:
        """Bytes one generation needs over `positions` with a prefill of `prefill` positions."""
        cache = (LM_CACHE_COPIES if grown else 1) * self.per_position * positions
        activations = (prefill * LM_PREFILL_WIDTHS * self.width + self.vocab) * FLOAT
        return int(cache + activations + self.predictor + FIXED_BYTES)

    def talker_request(self, request: Any) -> int:
        """What a request is admitted with for the talker (its bound: the most steps it may take)."""
        new = self.default_new_tokens
        if request is not None:
            new = int(request.options.get("max_new_tokens", new))
        return self.talker(TEXT_IDS_BOUND + new, TEXT_IDS_BOUND, grown=1)

    # -- codec -------------------------------------------------------------------------------------
    def codec(self, frames: int) -> int:
        """Bytes one decode of `frames` frames needs: its activations, and the codebooks it makes of its EMA sums
        (each call divides them by their usage)."""
        activations = CODEC_WIDTHS * self.codec_per_frame * min(max(frames, 1), CODEC_CHUNK) * FLOAT
        return int(activations + self.codebooks + FIXED_BYTES)

    def codec_least(self) -> int:
        """What any decode needs."""
        return self.codec(1)

    def codec_most(self) -> int:
        """The most one decode needs (the decoder runs at most a chunk and its context at once)."""
        return self.codec(CODEC_CHUNK)

    # -- voice -------------------------------------------------------------------------------------
    def voice(self, samples: int) -> int:
        """Bytes a clone's front needs over a clip of `samples` at 24 kHz."""
        return int(VOICE_WIDTHS * self.voice_per_sample * max(samples, 1) * FLOAT + FIXED_BYTES)

    def voice_least(self) -> int:
        """What any clone's front needs."""
        return self.voice(1)

    def voice_most(self) -> int:
        """A clone's front over the planning bound of a clip."""
        return self.voice(VOICE_SECONDS_BOUND * self.rate)
