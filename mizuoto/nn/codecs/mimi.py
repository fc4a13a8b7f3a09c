"""The encoder half of the Mimi codec (Kyutai; transformers' `MimiModel.encode`): waveform -> RVQ codes.

A SEANet convolution stack (causal or centred padding, residual blocks, strided downsampling,
ELU), a pre-LN transformer over the frames (LayerNorm, RoPE, GELU MLP, layer scale), a strided
convolution to the code rate, and a split residual vector quantizer (semantic quantizers, then
acoustic ones, both reading the same embeddings) whose codebooks pick the nearest centroid by
`torch.cdist`. Sizes come from a transformers `MimiConfig` dict (`MimiEncoderConfig.from_dict`).

The order of float operations follows transformers 4.57's sdpa path, so results are bit-equal to
it on the same CPU: attention is one `scaled_dot_product_attention` call with a materialised
boolean causal mask over every frame (transformers never applies the config's `sliding_window`
on that path, and never hands SDPA `is_causal` here), on the un-copied (strided) q, k, v.
Module and parameter names are transformers', so a checkpoint's keys load without renaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.errors import ModelLoadError
from mizuoto.nn.lm.decoder import repeat_kv

# transformers' MimiEuclideanCodebook: cluster usage is clamped here before it divides the sums
CODEBOOK_EPSILON = 1e-5
PAD_MODES = ("constant", "replicate", "reflect")


@dataclass(frozen=True)
class MimiEncoderConfig:
    """The sizes of a Mimi encoder (transformers' `MimiConfig` fields; `ratios` as `upsampling_ratios`)."""

    audio_channels: int
    num_filters: int
    hidden_size: int
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    num_residual_layers: int
    dilation_growth_rate: int
    compress: int
    ratios: tuple[int, ...]
    causal: bool
    pad_mode: str
    conv_shortcut: bool
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    attention_bias: bool
    downsample_kernel: int  # 0: the frame rate is the convolutions' own, no downsampling
    codebook_size: int
    codebook_dim: int
    quantizer_dim: int
    num_quantizers: int
    num_semantic_quantizers: int

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config") -> "MimiEncoderConfig":
        """Read a transformers `MimiConfig` dict; what this encoder cannot reproduce is a ModelLoadError."""
        try:
            ratios = tuple(int(r) for r in cfg["upsampling_ratios"])
            sample_rate = int(cfg["sampling_rate"])
            heads = int(cfg["num_attention_heads"])
            if cfg.get("hidden_act", "gelu") != "gelu":
                raise ModelLoadError(f"{where}: Mimi hidden_act {cfg['hidden_act']!r} is not supported (gelu only)")
            if cfg.get("rope_scaling"):
                raise ModelLoadError(f"{where}: Mimi rope_scaling {cfg['rope_scaling']!r} is not supported")
            if cfg.get("use_streaming"):
                raise ModelLoadError(f"{where}: a streaming Mimi encoder (use_streaming) is not supported")
            if cfg.get("pad_mode", "constant") not in PAD_MODES:
                raise ModelLoadError(f"{where}: Mimi pad_mode {cfg['pad_mode']!r} is not one of {PAD_MODES}")
            # transformers: the convolutions' rate, and the code rate (given, else the convolutions' halved)
            conv_rate = math.ceil(sample_rate / math.prod(ratios))
            frame_rate = cfg.get("_frame_rate") or cfg.get("frame_rate") or sample_rate / (math.prod(ratios) * 2)
            downsample = 2 * int(conv_rate / frame_rate) if frame_rate != conv_rate else 0
            return cls(
                audio_channels=int(cfg["audio_channels"]), num_filters=int(cfg["num_filters"]),
                hidden_size=int(cfg["hidden_size"]), kernel_size=int(cfg["kernel_size"]),
                last_kernel_size=int(cfg["last_kernel_size"]), residual_kernel_size=int(cfg["residual_kernel_size"]),
                num_residual_layers=int(cfg["num_residual_layers"]),
                dilation_growth_rate=int(cfg["dilation_growth_rate"]), compress=int(cfg["compress"]), ratios=ratios,
                causal=bool(cfg["use_causal_conv"]), pad_mode=str(cfg.get("pad_mode", "constant")),
                conv_shortcut=bool(cfg.get("use_conv_shortcut", False)), num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                intermediate_size=int(cfg["intermediate_size"]), norm_eps=float(cfg["norm_eps"]),
                rope_theta=float(cfg["rope_theta"]), attention_bias=bool(cfg.get("attention_bias", False)),
                downsample_kernel=downsample, codebook_size=int(cfg["codebook_size"]),
                codebook_dim=int(cfg["codebook_dim"]),
                quantizer_dim=int(cfg.get("vector_quantization_hidden_dimension") or cfg["hidden_size"]),
                num_quantizers=int(cfg["num_quantizers"]), num_semantic_quantizers=int(cfg["num_semantic_quantizers"]))
        except KeyError as exc:
            raise ModelLoadError(f"{where}: the Mimi config lacks {exc.args[0]!r}") from None


class MimiConv1d(nn.Module):
    """Conv1d padded so that the output has ceil(length / stride) frames (causal: all padding on the left)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, causal: bool = True, pad_mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, bias=bias)
        self.causal, self.pad_mode = causal, pad_mode
        self.stride, self.span = stride, (kernel_size - 1) * dilation + 1
        self.padding_total = self.span - stride

    def extra_padding(self, length: int) -> int:
        """Right padding that completes the last stride (transformers' arithmetic, float32 division included)."""
        # kept as upstream's int64 tensors divided into float32: past 2**24 samples its rounding decides
        stride, span = torch.tensor(self.stride), torch.tensor(self.span)
        total = span - stride
        frames = torch.ceil((length - span + total) / stride + 1).to(torch.int64) - 1
        return int(frames * stride + span - total - length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C', ceil(T / stride))."""
        extra = self.extra_padding(x.shape[-1])
        if self.causal:
            left, right = self.padding_total, extra
        else:
            left, right = self.padding_total - self.padding_total // 2, self.padding_total // 2 + extra
        return self.conv(_pad1d(x, left, right, self.pad_mode))


def _pad1d(x: torch.Tensor, left: int, right: int, mode: str) -> torch.Tensor:
    if mode != "reflect":
        return F.pad(x, (left, right), mode, 0.0)
    # reflection needs more samples than the padding: zeros are appended first, then cut off again
    extra = max(left, right) - x.shape[-1] + 1 if x.shape[-1] <= max(left, right) else 0
    if extra:
        x = F.pad(x, (0, extra))
    padded = F.pad(x, (left, right), mode, 0.0)
    return padded[..., :padded.shape[-1] - extra]


class MimiResnetBlock(nn.Module):
    """SEANet residual unit: ELU, dilated conv to dim // compress, ELU, 1x1 conv back, plus the input."""

    def __init__(self, cfg: MimiEncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        conv = dict(causal=cfg.causal, pad_mode=cfg.pad_mode)
        self.block = nn.ModuleList([
            nn.ELU(), MimiConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, **conv),
            nn.ELU(), MimiConv1d(hidden, dim, 1, **conv)])
        self.shortcut = MimiConv1d(dim, dim, 1, **conv) if cfg.conv_shortcut else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, dim, T) -> (B, dim, T)."""
        y = x
        for layer in self.block:
            y = layer(y)
        return self.shortcut(x) + y


class SeanetEncoder(nn.Module):
    """Waveform (B, channels, S) -> (B, hidden, frames): conv, per ratio residual units then a strided conv, conv."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        conv = dict(causal=cfg.causal, pad_mode=cfg.pad_mode)
        layers: list[nn.Module] = [MimiConv1d(cfg.audio_channels, cfg.num_filters, cfg.kernel_size, **conv)]
        width = cfg.num_filters
        for ratio in reversed(cfg.ratios):
            layers += [MimiResnetBlock(cfg, width, cfg.dilation_growth_rate ** j)
                       for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), MimiConv1d(width, width * 2, ratio * 2, stride=ratio, **conv)]
            width *= 2
        layers += [nn.ELU(), MimiConv1d(width, cfg.hidden_size, cfg.last_kernel_size, **conv)]
        self.layers = nn.ModuleList(layers)  # ELUs keep their places: checkpoint keys count them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, channels, S) -> (B, hidden, frames)."""
        for layer in self.layers:
            x = layer(x)
        return x


class LayerScale(nn.Module):
    """A learnt per-channel scale on a residual branch."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """scale * x."""
        return self.scale * x


class MimiAttention(nn.Module):
    """Causal self-attention with RoPE (rotate-half), through one SDPA call."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, hidden), cos / sin (B, T, head_dim), mask (1, 1, T, T) bool -> (B, T, hidden)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        n_rep = self.heads // self.kv_heads
        # q, k, v stay strided views, as transformers hands them to SDPA on the CPU
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask,
                                             dropout_p=0.0, is_causal=False)
        return self.o_proj(out.transpose(1, 2).contiguous().view(b, t, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MimiMLP(nn.Module):
    """fc1, exact GELU, fc2 (no biases)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner, bias=False)
        self.fc2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, T, hidden)."""
        return self.fc2(F.gelu(self.fc1(x)))


class MimiTransformerLayer(nn.Module):
    """Pre-LN block: x + scale * attention(LN(x)), then + scale * MLP(LN(.))."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = MimiAttention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MimiMLP(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, T, hidden)."""
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class MimiTransformer(nn.Module):
    """The encoder's transformer over frames at positions 0..T-1, each attending to itself and every earlier one."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MimiTransformerLayer(cfg) for _ in range(cfg.num_layers))
        steps = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).to(dtype=torch.float)
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta ** (steps / cfg.head_dim)), persistent=False)

    def rope(self, frames: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (1, T, head_dim) in transformers' order of float32 operations."""
        positions = torch.arange(frames)[None]
        angles = (self.inv_freq[None, :, None].float() @ positions[:, None, :].float()).transpose(1, 2)
        table = torch.cat((angles, angles), dim=-1)
        return table.cos().to(dtype), table.sin().to(dtype)  # transformers' attention_scaling is 1.0 here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, T, hidden)."""
        t = x.shape[1]
        cos, sin = self.rope(t, x.dtype)
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


class EuclideanCodebook(nn.Module):
    """Centroids kept as running sums and usage counts (checkpoint buffers); a vector's code is its nearest."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def centroids(self) -> torch.Tensor:
        """(size, dim): the sums over the clamped usage."""
        return self.embed_sum / self.cluster_usage.clamp(min=CODEBOOK_EPSILON)[:, None]

    def nearest(self, x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> (...) int64: the index of the nearest centroid by Euclidean distance."""
        flat = x.reshape(-1, x.shape[-1])
        distances = torch.cdist(flat[None].float(), centroids[None].float(), p=2)[0]
        return distances.argmin(dim=-1).view(*x.shape[:-1])


class VectorQuantizer(nn.Module):
    """One stage of a residual quantizer (its `codebook`)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = EuclideanCodebook(size, dim)


class ResidualQuantizer(nn.Module):
    """Projected in (1x1 conv where the widths differ), then each stage codes what the earlier ones left."""

    def __init__(self, cfg: MimiEncoderConfig, stages: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantizer(cfg.codebook_size, cfg.codebook_dim) for _ in range(stages))
        self.input_proj = self.output_proj = None
        if cfg.quantizer_dim != cfg.hidden_size:
            self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.quantizer_dim, 1, bias=False)
            # the decoding direction: read with the checkpoint, unused when encoding
            self.output_proj = nn.Conv1d(cfg.quantizer_dim, cfg.hidden_size, 1, bias=False)

    def encode(self, embeddings: torch.Tensor, stages: int) -> torch.Tensor:
        """(B, hidden, T) -> (stages, B, T) codes of the first `stages` stages."""
        residual = embeddings if self.input_proj is None else self.input_proj(embeddings)
        codes = []
        for layer in self.layers[:stages]:
            centroids = layer.codebook.centroids()
            picked = layer.codebook.nearest(residual.permute(0, 2, 1), centroids)
            residual = residual - F.embedding(picked, centroids).permute(0, 2, 1)
            codes.append(picked)
        return torch.stack(codes)


class SplitResidualQuantizer(nn.Module):
    """Semantic stages and acoustic stages, each a residual quantizer of the same embeddings; codes concatenated."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualQuantizer(cfg, cfg.num_semantic_quantizers)
        acoustic = cfg.num_quantizers - cfg.num_semantic_quantizers
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(cfg, acoustic)

    def encode(self, embeddings: torch.Tensor, stages: int) -> torch.Tensor:
        """(B, hidden, T) -> (stages, B, T): the first `stages` codes (semantic first)."""
        # a stage's code depends only on the stages before it: running fewer changes none of these
        codes = self.semantic_residual_vector_quantizer.encode(embeddings, self.semantic)
        if stages > self.semantic:
            acoustic = self.acoustic_residual_vector_quantizer.encode(embeddings, stages - self.semantic)
            codes = torch.cat([codes, acoustic], dim=0)
        return codes[:stages]


class MimiEncoder(nn.Module):
    """Waveform -> pre-quantizer embeddings (`embed`) -> codes (`quantize`)."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = SeanetEncoder(cfg)
        self.encoder_transformer = MimiTransformer(cfg)
        self.downsample = None
        if cfg.downsample_kernel:
            self.downsample = MimiConv1d(cfg.hidden_size, cfg.hidden_size, cfg.downsample_kernel, stride=2,
                                         bias=False, causal=cfg.causal, pad_mode="replicate")
        self.quantizer = SplitResidualQuantizer(cfg)

    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """(B, channels, S) -> (B, hidden, frames): what the quantizer reads."""
        x = self.encoder_transformer(self.encoder(wav).transpose(1, 2)).transpose(1, 2)
        return x if self.downsample is None else self.downsample(x)

    def quantize(self, embeddings: torch.Tensor, stages: int) -> torch.Tensor:
        """(B, hidden, frames) -> (B, stages, frames) int64."""
        if not self.config.num_semantic_quantizers <= stages <= self.config.num_quantizers:
            raise ValueError(f"{stages} quantizer stages asked of a Mimi encoder with "
                             f"{self.config.num_semantic_quantizers}..{self.config.num_quantizers}")
        return self.quantizer.encode(embeddings, stages).transpose(0, 1)
