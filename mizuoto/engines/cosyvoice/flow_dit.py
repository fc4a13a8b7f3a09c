"""CosyVoice 3's flow: speech tokens -> look-ahead conv -> repeat to mel rate -> DiT flow matching.

Built from the yaml by flow.py's builder tables, like the v1/v2 flows.
"""

from __future__ import annotations

import torch
from torch import nn

from mizuoto.nn.flow.cfm import ConditionalCFM
from mizuoto.nn.flow.xvec import XvecFlow


class CausalMaskedDiffWithDiT(XvecFlow):
    """CosyVoice 3's flow: no conformer; a causal look-ahead conv feeds the DiT estimator."""

    def __init__(self, vocab_size: int, input_size: int, output_size: int, spk_embed_dim: int,
                 input_frame_rate: int, token_mel_ratio: int, pre_lookahead_len: int,
                 pre_lookahead_layer: nn.Module, decoder: ConditionalCFM):
        super().__init__(vocab_size, input_size, output_size, spk_embed_dim, input_frame_rate)
        self.token_mel_ratio = token_mel_ratio
        self.pre_lookahead_len = pre_lookahead_len
        self.pre_lookahead_layer = pre_lookahead_layer
        self.decoder = decoder

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True) -> torch.Tensor:
        """Mel (1, output_size, frames) for `token`, the prompt's frames cut off (see CausalMaskedDiffWithXvec)."""
        spks, xs = self.embed_request(token, prompt_token, prompt_feat, embedding)
        if finalize:
            h = self.pre_lookahead_layer(xs)
        else:
            h = self.pre_lookahead_layer(xs[:, :-self.pre_lookahead_len], context=xs[:, -self.pre_lookahead_len:])
        return self.decode(h.repeat_interleave(self.token_mel_ratio, dim=1), prompt_feat, spks, streaming)
