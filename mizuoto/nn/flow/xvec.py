"""Token-to-mel flows conditioned on an x-vector: what every such flow shares, and CosyVoice 2's causal flow.

`XvecFlow` holds the token embedding, the x-vector projection and the stage interface;
`CausalMaskedDiffWithXvec` (CosyVoice 2, also Chatterbox's S3Gen) runs an upsampling conformer and a
flow-matching decoder. Sizes and the decoder's step count are arguments.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.errors import InvalidRequest
from mizuoto.nn.flow.cfm import FIXED_NOISE_SHAPE, ConditionalCFM
from mizuoto.nn.transformer.masks import make_pad_mask

N_TIMESTEPS = 10  # CosyVoice's flow.inference always asks the decoder for 10 Euler steps


class XvecFlow(nn.Module):
    """What every CosyVoice flow shares: token embedding and the x-vector projection."""

    def __init__(self, vocab_size: int, input_size: int, output_size: int, spk_embed_dim: int,
                 input_frame_rate: int, n_timesteps: int = N_TIMESTEPS):
        super().__init__()
        self.output_size = output_size
        self.n_timesteps = n_timesteps
        self.input_frame_rate = input_frame_rate
        self.input_embedding = nn.Embedding(vocab_size, input_size)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, output_size)

    def speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        """(1, spk_embed_dim) x-vector -> (1, output_size), normalized first as upstream."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def embed_tokens(self, prompt_token: torch.Tensor, token: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Prompt tokens then target tokens -> (1, P + N, input_size)."""
        token = torch.concat([prompt_token, token], dim=1)
        length = torch.tensor([token.shape[1]], dtype=torch.int32, device=token.device)
        mask = (~make_pad_mask(length)).unsqueeze(-1).to(like)
        return self.input_embedding(torch.clamp(token, min=0)) * mask

    def conditions(self, prompt_feat: torch.Tensor, frames: int, like: torch.Tensor) -> torch.Tensor:
        """(1, output_size, frames): the prompt's mel in front, zeros after."""
        conds = torch.zeros([1, frames, self.output_size], device=like.device).to(like.dtype)
        conds[:, :prompt_feat.shape[1]] = prompt_feat
        return conds.transpose(1, 2)

    @staticmethod
    def full_mask(frames: int, like: torch.Tensor) -> torch.Tensor:
        """(1, 1, frames) ones in like's dtype."""
        return (~make_pad_mask(torch.tensor([frames]))).to(like).unsqueeze(1)

    def embed_request(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                      embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(speaker projection, embedded prompt + target tokens) of a request whose shapes are checked first."""
        self.check_request(token, prompt_feat, embedding)
        spks = self.speaker(embedding)
        return spks, self.embed_tokens(prompt_token, token, spks)

    def decode(self, h: torch.Tensor, prompt_feat: torch.Tensor, spks: torch.Tensor, streaming: bool,
               noise_tail: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """v2/v3: mel (1, output_size, frames) from mel-rate features h (1, frames, output_size), prompt cut off.

        noise_tail: noise drawn by the caller for the frames past the prompt (Chatterbox Turbo's mean flow);
        generator: where a flow without a fixed noise buffer draws its noise (None: torch's default).
        """
        frames = h.shape[1]
        extra = {} if noise_tail is None else {"noise_tail": noise_tail}
        if generator is not None:
            extra["generator"] = generator
        feat = self.decoder(mu=h.transpose(1, 2).contiguous(), mask=self.full_mask(frames, h), spks=spks,
                            cond=self.conditions(prompt_feat, frames, h), n_timesteps=self.n_timesteps,
                            streaming=streaming, **extra)
        return feat[:, :, prompt_feat.shape[1]:].float()

    def check_frames(self, frames: int) -> None:
        """A request longer than the fixed noise buffer (v2/v3) is refused, as upstream cannot run it."""
        if getattr(self.decoder, "fixed", False) and frames > FIXED_NOISE_SHAPE[2]:
            raise InvalidRequest(f"prompt and speech together make {frames} mel frames; the flow "
                                 f"handles at most {FIXED_NOISE_SHAPE[2]} at once")

    def token2mel(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, *, streaming: bool, finalize: bool, cache: Any = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, Any]:
        """The stage interface (synthesis.FlowStage): v2/v3 flows draw no noise and keep no cache."""
        return self.inference(token, prompt_token, prompt_feat, embedding, streaming=streaming,
                              finalize=finalize), cache

    @staticmethod
    def check_request(token: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor) -> None:
        """Batch-1 shapes, as upstream's flow supports."""
        if token.dim() != 2 or token.shape[0] != 1:
            raise InvalidRequest(f"flow tokens must be shaped (1, N), got {tuple(token.shape)}")
        if prompt_feat.dim() != 3 or prompt_feat.shape[0] != 1:
            raise InvalidRequest(f"prompt mel must be shaped (1, frames, mels), got {tuple(prompt_feat.shape)}")
        if embedding.dim() != 2 or embedding.shape[0] != 1:
            raise InvalidRequest(f"speaker embedding must be shaped (1, dim), got {tuple(embedding.shape)}")


class CausalMaskedDiffWithXvec(XvecFlow):
    """CosyVoice 2's flow: upsampling conformer, causal U-Net, chunked streaming (Chatterbox's S3Gen flow too)."""

    def __init__(self, vocab_size: int, input_size: int, output_size: int, spk_embed_dim: int,
                 input_frame_rate: int, token_mel_ratio: int, pre_lookahead_len: int,
                 encoder: nn.Module, decoder: ConditionalCFM, n_timesteps: int = N_TIMESTEPS):
        super().__init__(vocab_size, input_size, output_size, spk_embed_dim, input_frame_rate, n_timesteps)
        self.token_mel_ratio = token_mel_ratio
        self.pre_lookahead_len = pre_lookahead_len
        self.encoder = encoder
        self.encoder_proj = nn.Linear(encoder.output_size(), output_size)
        self.decoder = decoder

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True,
                  noise_tail: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Mel (1, output_size, frames) for `token`, the prompt's frames cut off.

        finalize=False: the last pre_lookahead_len tokens only serve as look-ahead (a streaming
        chunk that more tokens will follow); streaming=True: chunked attention; noise_tail, generator: see decode.
        """
        spks, xs = self.embed_request(token, prompt_token, prompt_feat, embedding)
        xs_lens = torch.tensor([xs.shape[1]], dtype=torch.int32, device=xs.device)
        if finalize:
            h, _ = self.encoder(xs, xs_lens, streaming=streaming)
        else:
            xs, context = xs[:, :-self.pre_lookahead_len], xs[:, -self.pre_lookahead_len:]
            h, _ = self.encoder(xs, xs_lens, context=context, streaming=streaming)
        self.check_frames(h.shape[1])
        return self.decode(self.encoder_proj(h), prompt_feat, spks, streaming, noise_tail, generator)
