"""One decoder-only LM in four configurations: Qwen2, Qwen3, Llama (with llama3 RoPE scaling) and GPT-2.

Each computes what its transformers model computes on the SDPA path (Qwen2 as 4.51, the version
CosyVoice's upstream pins), because sampled tokens depend on the last bit:
- Positions: RoPE (Qwen2, Llama): inv_freq in float32 from int64 arange (llama3 scaling applied
  to it as transformers' `_compute_llama3_parameters` does); angles by a float32 matmul of
  inv_freq and the positions; cos/sin of the concatenated angles, cast to the activations' dtype.
  GPT-2: a learned position embedding added to the inputs.
- Norms: RMSNorm (variance in float32, then `weight * normed.to(input_dtype)`), or LayerNorm (GPT-2);
  Qwen3 also RMS-normalizes each head's q and k (`q_norm`, `k_norm`, over head_dim) before RoPE.
- Projections: `nn.Linear` (Qwen2: q/k/v biased; Llama: `attention_bias`, `mlp_bias`); GPT-2's
  `Conv1D` keeps its (in, out) weights and multiplies with `addmm`, its q/k/v fused in one
  product as upstream does (transposed into `nn.Linear` the GEMM reads another operand layout).
- MLP: SiLU-gated (gate, up, down), or GPT-2's `gelu_new` written as transformers writes it.
- Attention: KV heads repeated (`repeat_kv`; at CPU inference SDPA's bit-identical
  `enable_gqa`), q/k/v contiguous, SDPA with scale head_dim**-0.5 (GPT-2: SDPA's own default
  scale, as transformers leaves it); no mask and `is_causal=True` on a prefill of an empty
  cache, no mask and `is_causal=False` for a single-token step, and transformers' additive
  float mask (finfo.min above the diagonal) when several positions follow a non-empty cache.
- Parameter names mirror `Qwen2Model` / `LlamaModel` (embed_tokens, layers.N.self_attn.q_proj,
  ..., norm) in every configuration; `upstream_keys` maps a GPT2Model's names onto them. The
  output head is tied to embed_tokens when the config says so.

A layer is split around the attention call (`layer_pre`: norm, projections, RoPE; the cache
write; `attend`; `layer_post`: output projection, residuals, MLP) so that a single-token step
with a static cache can be captured as CUDA graphs on both sides of the one call whose length
varies (RoPE configurations; GPT-2's learned positions decode eagerly).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.errors import ModelLoadError
from mizuoto.nn.lm.kv_cache import DynamicKVCache, KVCache, StaticKVCache

ARCHS = ("qwen2", "qwen3", "llama", "gpt2")
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class DecoderConfig:
    """The sizes and kind of a decoder, as its transformers config states them (`from_dict`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    arch: str = "qwen2"
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple[float, ...] | None = None
    max_positions: int = 0  # learned absolute positions (GPT-2's n_positions)
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_attention_heads, as transformers derives it
    qkv_bias: bool = True
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: each head's q and k RMS-normalized before RoPE

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown decoder arch {self.arch!r} (one of {', '.join(ARCHS)})")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.learned_positions and self.max_positions <= 0:
            raise ValueError("a GPT-2 decoder needs max_positions (its n_positions)")

    @property
    def learned_positions(self) -> bool:
        """GPT-2: positions are a learned embedding added to the inputs, not RoPE."""
        return self.arch == "gpt2"

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config") -> "DecoderConfig":
        """Read a transformers config dict (model_type qwen2, llama or gpt2); refuse what is not implemented."""
        kind = cfg.get("model_type", "qwen2")
        try:
            if kind == "gpt2":
                return cls._gpt2(cfg, where)
            if kind not in ("qwen2", "qwen3", "llama"):
                raise ModelLoadError(f"{where}: model_type {kind!r} is not one of {', '.join(ARCHS)}")
            if cfg.get("hidden_act", "silu") != "silu":
                raise ModelLoadError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
            if cfg.get("use_sliding_window", False):
                raise ModelLoadError(f"{where}: use_sliding_window is not supported")
            llama, qwen3 = kind == "llama", kind == "qwen3"
            bias = bool(cfg.get("attention_bias", False))  # Llama's and Qwen3's (Qwen2's q/k/v are always biased)
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=int(cfg["num_attention_heads"]),
                num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                vocab_size=int(cfg["vocab_size"]),
                arch=kind,
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(cfg.get("rope_scaling"), kind, where),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                head_dim=int(cfg.get("head_dim") or 0),
                qkv_bias=bias if llama or qwen3 else True,
                o_bias=bias if llama or qwen3 else False,
                mlp_bias=bool(cfg.get("mlp_bias", False)) if llama else False,
                qk_norm=qwen3,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{where}: missing {exc.args[0]!r}") from None

    @classmethod
    def _gpt2(cls, cfg: dict, where: str) -> "DecoderConfig":
        if cfg.get("activation_function", "gelu_new") != "gelu_new":
            raise ModelLoadError(f"{where}: activation_function {cfg['activation_function']!r} is not supported "
                                 "(only gelu_new)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if cfg.get(flag, False):
                raise ModelLoadError(f"{where}: {flag} is not supported")
        if not cfg.get("scale_attn_weights", True):
            raise ModelLoadError(f"{where}: scale_attn_weights=false is not supported")
        hidden = int(cfg.get("n_embd") or cfg["hidden_size"])
        heads = int(cfg.get("n_head") or cfg["num_attention_heads"])
        return cls(
            hidden_size=hidden, intermediate_size=int(cfg.get("n_inner") or 4 * hidden),
            num_hidden_layers=int(cfg.get("n_layer") or cfg["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=heads, vocab_size=int(cfg["vocab_size"]),
            arch="gpt2", norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            max_positions=int(cfg.get("n_positions") or cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=True, o_bias=True,
            mlp_bias=True)

    @classmethod
    def from_json(cls, path: str | Path) -> "DecoderConfig":
        """Read a model directory's config.json."""
        path = Path(path)
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(cfg, str(path))

    def kv_bytes_per_position(self, dtype_bytes: int = 4, repeated: bool = True) -> int:
        """K and V bytes of one position over all layers (`repeated`: at the query-head width)."""
        heads = self.num_attention_heads if repeated else self.num_key_value_heads
        return self.num_hidden_layers * 2 * heads * self.head_dim * dtype_bytes


def _rope_scaling(scaling: dict | None, kind: str, where: str) -> tuple[float, ...] | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama" or rope_type != "llama3":
        raise ModelLoadError(f"{where}: rope_scaling {rope_type!r} is not supported (llama3 on a llama model only)")
    try:
        return tuple(float(scaling[k]) for k in LLAMA3_SCALING)
    except KeyError as exc:
        raise ModelLoadError(f"{where}: llama3 rope_scaling lacks {exc.args[0]!r}") from None


def rope_frequencies(cfg: DecoderConfig) -> torch.Tensor:
    """inv_freq (head_dim / 2,) float32: transformers' default RoPE, with llama3 scaling when configured."""
    steps = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).to(dtype=torch.float)
    inv_freq = 1.0 / (cfg.rope_theta ** (steps / cfg.head_dim))
    if cfg.rope_scaling is None:
        return inv_freq
    factor, low, high, context = cfg.rope_scaling
    # transformers' order of operations: long wavelengths divided by factor, the band between smoothed
    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """Qwen2RMSNorm / LlamaRMSNorm: variance in float32, weight applied after casting back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Conv1D(nn.Module):
    """GPT-2's projection: weight stored (in, out), `addmm(bias, x, weight)` as transformers' Conv1D."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], self.weight.shape[1])


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, op for op (torch's tanh-approximate gelu rounds differently)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GatedMLP(nn.Module):
    """SiLU-gated feed-forward (Qwen2, Llama)."""

    def __init__(self, hidden: int, inner: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """GPT-2's feed-forward: up (c_fc), gelu_new, down (c_proj)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up_proj = Conv1D(hidden, inner)
        self.down_proj = Conv1D(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_new(self.up_proj(x)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hkv * n_rep, L, D), each KV head repeated for its query group."""
    if n_rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int, scale: float | None,
           mask: torch.Tensor | None) -> torch.Tensor:
    """transformers 4.51 `sdpa_attention_forward` (sdpa_gqa=False): returns (B, T, H, D).

    At inference on the CPU the KV heads go to SDPA unrepeated (`enable_gqa`): measured
    bit-identical to attending over repeated copies, without copying each layer's whole K and V
    at the query heads' width every step (a third of a batched step's time). Elsewhere they are
    repeated, as transformers does: under autograd the gradient of the repeat sums the heads in
    another order than SDPA's own (training parity with upstream's trainer is bit-exact).
    """
    gqa = n_rep > 1 and q.device.type == "cpu" and not (q.requires_grad or k.requires_grad)
    if not gqa:
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    causal = q.shape[2] > 1 and mask is None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale,
                                         is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


class Attention(nn.Module):
    """Projections of one attention block; the attention call itself is `attend`."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.fused = d, cfg.learned_positions
        if self.fused:  # GPT-2's c_attn: q, k, v from one product, split after
            self.qkv_proj = Conv1D(cfg.hidden_size, 3 * h * d)
            self.o_proj = Conv1D(h * d, cfg.hidden_size)
            return
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated when cos/sin are given) and v as (B, heads, T, D)."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        if self.fused:
            q, k, v = (t.view(shape).transpose(1, 2) for t in self.qkv_proj(x).chunk(3, dim=-1))
        else:
            q, k = self.q_proj(x).view(shape), self.k_proj(x).view(shape)
            if self.q_norm is not None:  # Qwen3: per head, over head_dim, before the heads move forward
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = self.v_proj(x).view(shape).transpose(1, 2)
        if cos is None:
            return q, k, v
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        return q, k, v


class Layer(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        if cfg.learned_positions:
            self.mlp: nn.Module = GeluMLP(cfg.hidden_size, cfg.intermediate_size)
            self.input_layernorm: nn.Module = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
            self.post_attention_layernorm: nn.Module = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class Decoder(nn.Module):
    """Qwen2Model / Qwen3Model / LlamaModel / GPT2Model (+ the tied output head): embeddings, layers, final norm."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_positions, cfg.hidden_size) if cfg.learned_positions else None
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if cfg.learned_positions \
            else RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        # GPT-2 leaves the scale to SDPA (1 / sqrt(D) computed there), the others pass head_dim ** -0.5
        self.scale = None if cfg.learned_positions else cfg.head_dim ** -0.5
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def upstream_keys(self, prefix: str = "") -> dict[str, str]:
        """Each state_dict key of this decoder -> its name in the transformers model (under `prefix`).

        Qwen2, Qwen3 and Llama use these very names. GPT2Model's are renamed; its Conv1D weights keep
        their (in, out) layout (`Conv1D`), so nothing is transposed.
        """
        own = [k for k in self.state_dict() if not k.startswith("lm_head.")]
        if not self.config.learned_positions:
            return {k: prefix + k for k in own}
        fixed = {"embed_tokens": "wte", "embed_positions": "wpe", "norm": "ln_f"}
        parts = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attn.qkv_proj": "attn.c_attn",
                 "self_attn.o_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
        out = {}
        for key in own:
            head, _, leaf = key.rpartition(".")
            if head in fixed:
                out[key] = f"{prefix}{fixed[head]}.{leaf}"
                continue
            _, index, part = head.split(".", 2)  # layers.N.<part>
            out[key] = f"{prefix}h.{index}.{parts[part]}.{leaf}"
        return out

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos, sin (B, T, D) for positions (B, T), in transformers' order of float32 ops (None, None: GPT-2)."""
        if self.config.learned_positions:
            return None, None
        inv = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1)
        device_type = "cpu" if positions.device.type == "mps" else positions.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            angles = (inv.float() @ positions[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((angles, angles), dim=-1)
            cos, sin = emb.cos(), emb.sin()  # transformers multiplies by attention_scaling = 1.0
        return cos.to(dtype), sin.to(dtype)

    def add_positions(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, hidden) plus the learned embeddings of positions (B, T) (GPT-2; x itself otherwise)."""
        if self.embed_positions is None:
            return x
        return x + self.embed_positions(positions)

    def new_cache(self, kind: str = "dynamic", max_len: int = 0) -> KVCache:
        """A "dynamic" cache, or a "static" one preallocated for max_len positions."""
        if kind == "dynamic":
            return DynamicKVCache()
        if kind == "static":
            if max_len <= 0:
                raise ValueError("a static KV cache needs max_len > 0")
            return StaticKVCache(self.config.num_hidden_layers, self.config.num_key_value_heads,
                                 self.config.head_dim, max_len)
        raise ValueError(f"unknown KV cache kind {kind!r} (dynamic or static)")

    def _mask(self, t: int, past: int, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        # transformers drops the mask (relying on is_causal / no mask) for a single position or a
        # prefill of an empty cache; otherwise it builds this additive mask. (Its sliding-window
        # term only matters past `sliding_window` = 32768 positions, beyond any CosyVoice cap.)
        if t == 1 or past == 0:
            return None
        total = past + t
        mask = torch.full((t, total), torch.finfo(dtype).min, dtype=dtype, device=positions.device)
        mask *= torch.arange(total, device=positions.device) > positions.reshape(-1, 1)
        return mask[None, None]

    def layer_pre(self, i: int, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i up to the attention call: q, k, v (B, heads, T, D) from its input x."""
        layer = self.layers[i]
        return layer.self_attn.project(layer.input_layernorm(x), cos, sin)

    def layer_post(self, i: int, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer i after the attention call: its output from its input and attention (B, T, H, D)."""
        layer = self.layers[i]
        x = residual + layer.self_attn.o_proj(attn.reshape(*residual.shape[:-1], -1).contiguous())
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def forward(self, inputs_embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run (B, T, hidden) embeddings after the cache's positions; return the normed hidden states."""
        t, past = inputs_embeds.shape[1], cache.length
        positions = torch.arange(past, past + t, device=inputs_embeds.device)
        cos, sin = self.rope(positions.unsqueeze(0), inputs_embeds.dtype)
        mask = self._mask(t, past, positions, inputs_embeds.dtype)
        x = self.add_positions(inputs_embeds, positions.unsqueeze(0))
        for i in range(len(self.layers)):
            q, k, v = self.layer_pre(i, x, cos, sin)
            k, v = cache.update(i, k, v, positions)
            x = self.layer_post(i, x, attend(q, k, v, self.n_rep, self.scale, mask))
        cache.advance(t)
        return self.norm(x)

    def step_rows(self, x: torch.Tensor, caches: list[KVCache | None]) -> torch.Tensor:
        """One position for each of B sequences: x (B, 1, hidden), row r after `caches[r]` (None: an empty row).

        The projections and the MLP run on all B rows at once (a fixed B gives every row the same
        kernels whatever the other rows hold); attention runs per row over that row's own cache,
        as a one-sequence step does. Returns the normed hidden states (B, 1, hidden).
        """
        pos = self.row_positions(caches, x.device)
        cos, sin = self.rope(pos[:, None], x.dtype)
        x = self.add_positions(x, pos[:, None])
        for i in range(len(self.layers)):
            q, k, v = self.layer_pre(i, x, cos, sin)
            attn = torch.zeros(q.shape[0], 1, q.shape[1], q.shape[3], dtype=q.dtype, device=q.device)
            x = self.layer_post(i, x, self.attend_rows(i, q, k, v, caches, pos, attn))
        self.advance_rows(caches)
        return self.norm(x)

    @staticmethod
    def row_positions(caches: list[KVCache | None], device: torch.device) -> torch.Tensor:
        """Each row's next position (B,): its cache's length, 0 for an empty row."""
        return torch.tensor([c.length if c is not None else 0 for c in caches], device=device)

    def attend_rows(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    caches: list[KVCache | None], pos: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Layer i's attention row by row: row r's k, v written into caches[r] at pos[r], its output into out[r].

        q, k, v are (B, heads, 1, D) and out (B, 1, heads, D); an empty row's out is left as it is.
        """
        for r, cache in enumerate(caches):
            if cache is not None:
                kr, vr = cache.update(i, k[r:r + 1], v[r:r + 1], pos[r:r + 1])
                out[r:r + 1] = attend(q[r:r + 1], kr, vr, self.n_rep, self.scale, None)
        return out

    @staticmethod
    def advance_rows(caches: list[KVCache | None]) -> None:
        """Mark one more position filled in every row's cache (after a step of all layers)."""
        for cache in caches:
            if cache is not None:
                cache.advance(1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head (tied to embed_tokens unless the config unties it)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

