"""CosyVoice 3's flow: speech tokens -> look-ahead conv -> repeat to mel rate -> DiT flow matching.

Registers `CausalMaskedDiffWithDiT` and the `DiT` estimator in flow.py's tables, so
`build_flow` builds every generation from its yaml.
"""

from __future__ import annotations

import torch
from torch import nn

from mizuoto.engines.cosyvoice.flow import (ESTIMATORS, FLOWS, N_TIMESTEPS, XvecFlow, _node, build_cfm,
                                            construct)
from mizuoto.nn.flow.cfm import ConditionalCFM
from mizuoto.nn.transformer.dit import DiT
from mizuoto.nn.transformer.upsample import PreLookaheadLayer
from mizuoto.errors import ModelLoadError
from mizuoto.runtime.hyperyaml import Tagged

# Estimator options that only matter for training or for decoding modes upstream never uses here.
_DIT_UNUSED = ("dropout", "out_channels", "num_decoding_left_chunks")


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
        self.check_request(token, prompt_feat, embedding)
        spks = self.speaker(embedding)
        xs = self.embed_tokens(prompt_token, token, spks)
        if finalize:
            h = self.pre_lookahead_layer(xs)
        else:
            h = self.pre_lookahead_layer(xs[:, :-self.pre_lookahead_len], context=xs[:, -self.pre_lookahead_len:])
        h = h.repeat_interleave(self.token_mel_ratio, dim=1)
        mel_len1, mel_len2 = prompt_feat.shape[1], h.shape[1] - prompt_feat.shape[1]
        conds = self.conditions(prompt_feat, mel_len1 + mel_len2, h)
        mask = self.full_mask(mel_len1 + mel_len2, h)
        feat = self.decoder(mu=h.transpose(1, 2).contiguous(), mask=mask, spks=spks, cond=conds,
                            n_timesteps=N_TIMESTEPS, streaming=streaming)
        return feat[:, :, mel_len1:].float()


def _dit(node: Tagged) -> nn.Module:
    kwargs = {k: v for k, v in node.kwargs.items() if k not in _DIT_UNUSED}
    return construct(DiT, Tagged(node.kind, node.target, kwargs), "flow.decoder.estimator")


def _build_dit_flow(config: dict) -> nn.Module:
    flow = config["flow"]
    layer = _node(flow.get("pre_lookahead_layer"), "flow.pre_lookahead_layer")
    if layer.cls != "PreLookaheadLayer":
        raise ModelLoadError(f"yaml: flow.pre_lookahead_layer class {layer.cls} is not supported")
    return CausalMaskedDiffWithDiT(
        vocab_size=flow.get("vocab_size", 4096), input_size=flow.get("input_size", 512),
        output_size=flow.get("output_size", 80), spk_embed_dim=flow.get("spk_embed_dim", 192),
        input_frame_rate=flow.get("input_frame_rate", 50), token_mel_ratio=flow.get("token_mel_ratio", 2),
        pre_lookahead_len=flow.get("pre_lookahead_len", 3),
        pre_lookahead_layer=construct(PreLookaheadLayer, layer, "flow.pre_lookahead_layer"),
        decoder=build_cfm(_node(flow.get("decoder"), "flow.decoder")))


ESTIMATORS["DiT"] = _dit
FLOWS["CausalMaskedDiffWithDiT"] = _build_dit_flow
