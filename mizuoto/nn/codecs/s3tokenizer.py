"""S3 speech tokenizers (CosyVoice's speech_tokenizer_v1/v2/v3) as torch modules.

A Whisper-style encoder over the 128-bin Whisper log-mel (two strided convolutions + GELU,
pre-LN residual blocks) followed by a quantizer: v1 (50 Hz) adds an absolute positional
embedding and picks the nearest entry of a cosine VQ codebook; v2/v3 (25 Hz) rotate q/k (RoPE),
add an FSMN memory to the attention output and quantize with FSQ (3 levels per channel).
Every size comes from the ONNX file (see runtime/convert/s3tokenizer.py). Numerics follow the exported
graphs, so tokens equal onnxruntime's except on frames that sit on a decision boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.errors import InvalidRequest

# The Whisper log-mel has 100 frames per second (hop 160 at 16 kHz); upstream refuses > 30 s.
FRAMES_PER_SECOND = 100
MAX_SECONDS = 30


def _rope_tables(length: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Same construction as the exported tables (polar of float32 angles, halves repeated).
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    cis = torch.cat((cis, cis), dim=-1)
    return cis.real.contiguous(), cis.imag.contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Multi-head self-attention (key without bias), optionally with RoPE and an FSMN memory."""

    def __init__(self, n_state: int, n_head: int, fsmn_kernel: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)
        self.fsmn_kernel = fsmn_kernel
        if fsmn_kernel:
            self.fsmn = nn.Conv1d(n_state, n_state, fsmn_kernel, groups=n_state, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, d = x.shape
        q = self.query(x).view(b, t, self.n_head, -1)
        k = self.key(x).view(b, t, self.n_head, -1)
        v = self.value(x).view(b, t, self.n_head, -1)
        scale = (d // self.n_head) ** -0.25
        if rope is not None:
            cos, sin = (r[None, :t, None, :] for r in rope)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        memory = None
        if self.fsmn_kernel:
            m = v.reshape(b, t, d) * mask
            left = (self.fsmn_kernel - 1) // 2
            conv = self.fsmn(F.pad(m.transpose(1, 2), (left, self.fsmn_kernel - 1 - left)))
            memory = (conv.transpose(1, 2) + m) * mask
        q = q.permute(0, 2, 1, 3) * scale
        k = k.permute(0, 2, 3, 1) * scale
        w = torch.softmax(q @ k + bias, dim=-1)
        y = self.out((w @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).reshape(b, t, d))
        return y if memory is None else y + memory


class Block(nn.Module):
    """Pre-LN residual block: attention, then a GELU MLP."""

    def __init__(self, n_state: int, n_head: int, n_mlp: int, fsmn_kernel: int,
                 attn_ln_eps: float, mlp_ln_eps: float) -> None:
        super().__init__()
        self.attn_ln = nn.LayerNorm(n_state, eps=attn_ln_eps)
        self.attn = Attention(n_state, n_head, fsmn_kernel)
        self.mlp_ln = nn.LayerNorm(n_state, eps=mlp_ln_eps)
        self.mlp = nn.Sequential(nn.Linear(n_state, n_mlp), nn.GELU(), nn.Linear(n_mlp, n_state))

    def forward(self, x, bias, mask, rope):
        x = x + self.attn(self.attn_ln(x), bias, mask, rope)
        return x + self.mlp(self.mlp_ln(x))


class S3Tokenizer(nn.Module):
    """Speech tokenizer: Whisper log-mel [B, n_mels, T] -> tokens [B, T'] (int64)."""

    def __init__(self, *, n_mels: int, n_state: int, n_head: int, n_layer: int, n_mlp: int,
                 conv_kernel: int, conv_padding: int, conv1_stride: int, conv2_stride: int,
                 attn_ln_eps: float, mlp_ln_eps: float, quantizer: str, n_ctx: int = 0,
                 rope_theta: float = 10000.0, fsmn_kernel: int = 0, codebook_size: int = 0,
                 fsq_dim: int = 0, fsq_levels: int = 3, fsq_scale: float = 1.0) -> None:
        super().__init__()
        if quantizer not in ("vq", "fsq"):
            raise ValueError(f"unknown quantizer {quantizer!r}")
        self.quantizer_kind = quantizer
        self.conv_kernel, self.conv_padding = conv_kernel, conv_padding
        self.strides = (conv1_stride, conv2_stride)
        self.conv1 = nn.Conv1d(n_mels, n_state, conv_kernel, stride=conv1_stride, padding=conv_padding)
        self.conv2 = nn.Conv1d(n_state, n_state, conv_kernel, stride=conv2_stride, padding=conv_padding)
        self.n_ctx = n_ctx
        if n_ctx:
            self.positional_embedding = nn.Parameter(torch.zeros(n_ctx, n_state))
        self.rope_theta = rope_theta
        self.head_dim = n_state // n_head
        self.blocks = nn.ModuleList(
            Block(n_state, n_head, n_mlp, fsmn_kernel, attn_ln_eps, mlp_ln_eps) for _ in range(n_layer))
        if quantizer == "vq":
            self.codebook = nn.Parameter(torch.zeros(codebook_size, n_state))
        else:
            self.project = nn.Linear(n_state, fsq_dim)
            self.fsq_scale = fsq_scale
            self.register_buffer("fsq_powers", fsq_levels ** torch.arange(fsq_dim, dtype=torch.float32),
                                 persistent=False)
        self.max_frames = MAX_SECONDS * FRAMES_PER_SECOND

    def _out_len(self, lengths: torch.Tensor, stride: int) -> torch.Tensor:
        return (lengths + 2 * self.conv_padding - self.conv_kernel) // stride + 1

    def encode(self, mel: torch.Tensor, lengths: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder hidden states [B, T', n_state] and their lengths."""
        if mel.dim() != 3 or mel.shape[1] != self.conv1.in_channels:
            raise InvalidRequest(f"speech tokenizer wants a log-mel [B, {self.conv1.in_channels}, T], "
                                 f"got {tuple(mel.shape)}")
        total = mel.shape[-1]
        if lengths is None:
            lengths = torch.full((mel.shape[0],), total, dtype=torch.long, device=mel.device)
        lengths = lengths.to(device=mel.device, dtype=torch.long)
        longest = max(int(lengths.max()) if lengths.numel() else 0, total)
        if longest > self.max_frames:
            raise InvalidRequest(f"speech tokenizer input is {longest / FRAMES_PER_SECOND:.2f} s "
                                 f"({longest} frames); at most {MAX_SECONDS} s "
                                 f"({self.max_frames} frames) is supported")
        x = mel * _frame_mask(lengths, total)[:, None, :].to(mel.dtype)
        x = F.gelu(self.conv1(x))
        lengths = self._out_len(lengths, self.strides[0])
        x = x * _frame_mask(lengths, x.shape[-1])[:, None, :].to(x.dtype)
        x = F.gelu(self.conv2(x))
        lengths = self._out_len(lengths, self.strides[1])
        valid = _frame_mask(lengths, x.shape[-1]).to(x.dtype)
        x = x.transpose(1, 2)
        bias = ((1.0 - valid) * -1e10)[:, None, None, :]
        rope = None
        if self.n_ctx:
            x = x + self.positional_embedding[: x.shape[1]]
        else:
            rope = tuple(r.to(x.device, x.dtype) for r in
                         _rope_tables(x.shape[1], self.head_dim, self.rope_theta))
        mask = valid[:, :, None]
        for block in self.blocks:
            x = block(x, bias, mask, rope)
        return x, lengths

    def quantize(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T'] (int64) of encoder hidden states."""
        if self.quantizer_kind == "vq":
            x = F.normalize(hidden, p=2.0, dim=-1, eps=1e-12)
            codes = self.codebook.t()
            # distance in the exported order: |x|^2 - (2x)E^T + |E|^2, then argmax of its negation
            dist = x.pow(2).sum(-1, keepdim=True) - (x * 2.0) @ codes + codes.pow(2).sum(0, keepdim=True)
            return torch.argmax(-dist, dim=-1)
        z = torch.tanh(self.project(hidden)) * self.fsq_scale
        return ((torch.round(z) + 1.0) * self.fsq_powers).sum(-1).to(torch.int64)

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, T'] int64, token lengths [B]); frames past a length are padding."""
        hidden, lengths = self.encode(mel, lengths)
        return self.quantize(hidden), lengths


def _frame_mask(lengths: torch.Tensor, total: int) -> torch.Tensor:
    return torch.arange(total, device=lengths.device)[None, :] < lengths[:, None]
