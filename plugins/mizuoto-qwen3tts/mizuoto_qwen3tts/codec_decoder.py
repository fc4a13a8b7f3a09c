"""The 12 Hz codec's decoder: 16 codes a frame -> 24 kHz waveform, as upstream's speech tokenizer decodes one item.

Read from a model dir's `speech_tokenizer/` (`config.json`'s `decoder_config`, the `decoder.*`
weights of `model.safetensors`). The network: split residual dequantizer (1 semantic + the
acoustic quantizers), causal conv (kernel 3) to the latent width, sliding-window transformer,
transposed-conv + ConvNeXt upsamplers (`upsampling_ratios`), then a conv to `decoder_dim` and
SnakeBeta upsampling blocks (`upsample_rates`, halving the channels each time) down to one
channel; the waveform is clamped to [-1, 1]. Every layer is causal.

Upstream's `decode` of one item: codes below 0 count as padding for the length ((codes[:, 0] > -1)
frames x `decode_upsample_rate` samples are kept) and are clamped to 0 before decoding; decoding runs
in windows of at most `CHUNK_FRAMES` new frames, each after up to `LEFT_CONTEXT_FRAMES` frames of left
context whose samples are dropped. Windows are decoded independently (positions restart at 0), so
a sequence longer than one chunk does not decode like one forward over all of it.

Streaming: the window plan is prefix-stable (`chunk_windows`): the chunk of new frames
[s, s + CHUNK_FRAMES) is decoded from codes [s - context, s + CHUNK_FRAMES) whatever follows, so
its samples are final, equal to what the whole `decode` gives there, as soon as frame
s + CHUNK_FRAMES - 1 exists (`decode_window`). Finer streaming is not exact by construction:
within one chunk, upstream decodes all frames in one forward, and a forward over a prefix rounds
differently (other GEMM / SDPA / conv shapes).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from mizuoto.errors import ModelLoadError
from mizuoto.nn.codecs.causal_conv import CausalConv1d, CausalConvTranspose1d
from mizuoto.nn.vocoders.snake_beta import SnakeBeta
from mizuoto_qwen3tts.codec_blocks import ConvNeXtBlock, SlidingWindowTransformer, SplitDequantizer, UpsampleBlock
from mizuoto_qwen3tts.weights import load_into, read_config

PREFIX = "decoder."
# upstream's decoder fixes one semantic quantizer (the config has no field for it); the weight
# check refuses a checkpoint with another split
SEMANTIC_QUANTIZERS = 1
# upstream's chunked decode (its defaults, not config values)
CHUNK_FRAMES = 300
LEFT_CONTEXT_FRAMES = 25
# the quantizers' input projections serve encoding only
ENCODER_ONLY = ("quantizer.rvq_first.input_proj.", "quantizer.rvq_rest.input_proj.")
# upstream's names after PREFIX -> ours, by start (the codebooks' own names are mapped in `_renamed`)
MOVED = {"quantizer.rvq_first.": "quantizer.semantic.", "quantizer.rvq_rest.": "quantizer.acoustic."}
# the reference config class's defaults, used where config.json leaves a field out
DEFAULTS = {"codebook_size": 2048, "hidden_size": 1024, "latent_dim": 1024, "rope_theta": 10000,
            "num_attention_heads": 16, "num_key_value_heads": 16, "attention_bias": False, "sliding_window": 72,
            "intermediate_size": 3072, "hidden_act": "silu", "rms_norm_eps": 1e-5, "num_hidden_layers": 8,
            "num_quantizers": 16, "upsample_rates": (8, 5, 4, 3), "upsampling_ratios": (2, 2), "decoder_dim": 1536}


def chunk_windows(frames: int, chunk: int = CHUNK_FRAMES, context: int = LEFT_CONTEXT_FRAMES
                  ) -> list[tuple[int, int, int]]:
    """Upstream's decode windows for `frames` frames: (start, end, context), new frames [start, end) after context."""
    windows, start = [], 0
    while start < frames:
        end = min(start + chunk, frames)
        # the full context only once there is more than that before the chunk (upstream's test is `>`)
        windows.append((start, end, context if start - context > 0 else start))
        start = end
    return windows


class CodecDecoder(nn.Module):
    """Qwen3-TTS's 12 Hz codec decoder (float32, eval mode once loaded)."""

    def __init__(self, cfg: dict, decode_upsample_rate: int, sample_rate: int) -> None:
        super().__init__()
        self.num_quantizers = int(cfg["num_quantizers"])
        self._samples_per_frame, self._sample_rate = decode_upsample_rate, sample_rate
        half, width, latent = int(cfg["codebook_dim"]) // 2, int(cfg["codebook_dim"]), int(cfg["latent_dim"])
        self.quantizer = SplitDequantizer(SEMANTIC_QUANTIZERS, self.num_quantizers - SEMANTIC_QUANTIZERS,
                                          int(cfg["codebook_size"]), half, width)
        self.pre_conv = CausalConv1d(width, latent, kernel_size=3)
        heads = int(cfg["num_attention_heads"])
        self.pre_transformer = SlidingWindowTransformer(
            latent, int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"]), heads,
            int(cfg["num_key_value_heads"]), int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            bool(cfg["attention_bias"]), float(cfg["rms_norm_eps"]), float(cfg["rope_theta"]),
            int(cfg["sliding_window"]))
        ratios, rates = [int(r) for r in cfg["upsampling_ratios"]], [int(r) for r in cfg["upsample_rates"]]
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(latent, latent, ratio, ratio), ConvNeXtBlock(latent)])
            for ratio in ratios)
        dim = int(cfg["decoder_dim"])
        blocks: list[nn.Module] = [CausalConv1d(latent, dim, kernel_size=7)]
        blocks += [UpsampleBlock(dim // 2 ** i, dim // 2 ** (i + 1), rate) for i, rate in enumerate(rates)]
        blocks += [SnakeBeta(dim // 2 ** len(rates)), CausalConv1d(dim // 2 ** len(rates), 1, kernel_size=7)]
        self.decoder = nn.ModuleList(blocks)
        # samples one frame becomes in the network (upstream's `total_upsample`: it trims context with it)
        self.total_upsample = math.prod(rates + ratios)

    @property
    def samples_per_frame(self) -> int:
        """Samples kept per frame (`decode_upsample_rate` of the speech tokenizer's config)."""
        return self._samples_per_frame

    @property
    def sample_rate(self) -> int:
        """Output sample rate (`output_sample_rate`)."""
        return self._sample_rate

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (B, quantizers, T), all >= 0 -> clamped waveform (B, 1, T * total_upsample), one pass."""
        if codes.shape[1] != self.num_quantizers:
            raise ValueError(f"expected {self.num_quantizers} codes a frame, got {codes.shape[1]}")
        hidden = self.pre_conv(self.quantizer(codes)).transpose(1, 2)
        hidden = self.pre_transformer(hidden).permute(0, 2, 1)
        for stage in self.upsample:
            for block in stage:
                hidden = block(hidden)
        for block in self.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)

    def decode_window(self, codes: torch.LongTensor, context: int) -> torch.Tensor:
        """One decode window: codes [context + n, quantizers] -> the n new frames' samples [n * total_upsample]."""
        wav = self(torch.clamp(codes, min=0).unsqueeze(0).transpose(1, 2))
        return wav[..., context * self.total_upsample:][0, 0]

    def decode(self, codes: torch.LongTensor) -> torch.Tensor:
        """Codes [T, quantizers] (negative = padding) -> waveform [(codes[:, 0] > -1).sum() * samples_per_frame]."""
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [frames, {self.num_quantizers}], got {tuple(codes.shape)}")
        if codes.shape[0] == 0:
            # upstream's chunked decode concatenates no window and fails (torch.cat of an empty list)
            raise ValueError("no frames to decode: upstream's speech tokenizer fails on an empty code sequence")
        length = int((codes[:, 0] > -1).sum()) * self.samples_per_frame
        wav = torch.cat([self.decode_window(codes[start - context:end], context)
                         for start, end, context in chunk_windows(codes.shape[0])], dim=-1)
        return wav[:length]


def _renamed(quantizers: int) -> dict[str, str]:
    """Upstream's codebook names -> ours (its `vq.layers.N._codebook.X` is our `codebooks.N.X`)."""
    out = {}
    for group, ours, count in (("rvq_first", "semantic", SEMANTIC_QUANTIZERS),
                               ("rvq_rest", "acoustic", quantizers - SEMANTIC_QUANTIZERS)):
        for i in range(count):
            for leaf in ("cluster_usage", "embedding_sum"):
                out[f"quantizer.{group}.vq.layers.{i}._codebook.{leaf}"] = f"quantizer.{ours}.codebooks.{i}.{leaf}"
    return out


def decoder_config(config: dict, where: str) -> dict:
    """The decoder's sizes: `decoder_config` over the reference defaults, checked for what this port supports."""
    if "decoder_config" not in config:
        raise ModelLoadError(f"{where}: no decoder_config (not a Qwen3-TTS 12 Hz speech tokenizer?)")
    cfg = {**DEFAULTS, **config["decoder_config"]}
    if "codebook_dim" not in cfg:
        raise ModelLoadError(f"{where}: decoder_config lacks 'codebook_dim'")
    if cfg["hidden_act"] != "silu":
        raise ModelLoadError(f"{where}: decoder hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" or \
            float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{where}: decoder RoPE other than the default is not supported")
    if int(cfg["num_quantizers"]) <= SEMANTIC_QUANTIZERS:
        raise ModelLoadError(f"{where}: decoder num_quantizers must exceed {SEMANTIC_QUANTIZERS}")
    return cfg


def load_codec_decoder(speech_tokenizer_dir: Path) -> CodecDecoder:
    """The codec decoder from a model dir's `speech_tokenizer/` (float32, eval mode)."""
    config = read_config(speech_tokenizer_dir)
    where = str(Path(speech_tokenizer_dir) / "config.json")
    cfg = decoder_config(config, where)
    decoder = CodecDecoder(cfg, int(config.get("decode_upsample_rate", 1920)),
                           int(config.get("output_sample_rate", 24000))).eval()
    load_into(decoder, speech_tokenizer_dir, PREFIX, _renamed(decoder.num_quantizers), ENCODER_ONLY, MOVED)
    return decoder
