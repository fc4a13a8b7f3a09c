"""Training forward passes of the flows over the inference modules (upstream flow.py `forward` + CFM compute_loss).

Draws, in upstream's order: v2/v3 first choose streaming (`random.random() < 0.5`), then every
utterance keeps no prompt condition (`random.random() < 0.5`) or the first
`random.randint(0, int(0.3 * frames))` mel frames; the CFM then draws t (`torch.rand`), the
noise (`randn_like`) and the condition-dropout mask (`torch.rand(b) > training_cfg_rate`).
The loss is the masked squared error summed over frames and mel bins, divided by their count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mizuoto.engines.cosyvoice.flow import cfm_params
from mizuoto.nn.transformer.masks import make_pad_mask
from mizuoto.runtime.hyperyaml import Tagged


@dataclass(frozen=True)
class CfmTraining:
    """The yaml's cfm_params that training uses."""

    sigma_min: float
    training_cfg_rate: float

    @classmethod
    def from_flow_node(cls, flow: Tagged) -> "CfmTraining":
        """Read flow.decoder.cfm_params."""
        content = cfm_params(flow.get("decoder"))
        return cls(float(content.get("sigma_min", 1e-6)), float(content.get("training_cfg_rate", 0.2)))


def _conditions(feat: torch.Tensor, feat_len: torch.Tensor, rng) -> torch.Tensor:
    conds = torch.zeros(feat.shape, device=feat.device)
    for i, j in enumerate(feat_len):
        if rng.random() < 0.5:
            continue
        index = rng.randint(0, int(0.3 * j))
        conds[i, :index] = feat[i, :index]
    return conds.transpose(1, 2)


def cfm_loss(decoder, x1: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
             cond: torch.Tensor, cfm: CfmTraining, streaming: bool) -> torch.Tensor:
    """ConditionalCFM.compute_loss: flow-matching loss of the estimator at a random time."""
    b = mu.shape[0]
    t = torch.rand([b, 1, 1], device=mu.device, dtype=mu.dtype)
    z = torch.randn_like(x1)
    y = (1 - (1 - cfm.sigma_min) * t) * z + t * x1
    u = x1 - (1 - cfm.sigma_min) * z
    if cfm.training_cfg_rate > 0:
        keep = torch.rand(b, device=x1.device) > cfm.training_cfg_rate
        mu = mu * keep.view(-1, 1, 1)
        spks = spks * keep.view(-1, 1)
        cond = cond * keep.view(-1, 1, 1)
    pred = decoder.estimator(y, mask, mu, t.squeeze(), spks, cond, streaming=streaming)
    return F.mse_loss(pred * mask, u * mask, reduction="sum") / (torch.sum(mask) * u.shape[1])


def _embed(flow, token: torch.Tensor, token_len: torch.Tensor, device: torch.device):
    mask = (~make_pad_mask(token_len)).float().unsqueeze(-1).to(device)
    return flow.input_embedding(torch.clamp(token, min=0)) * mask, mask


def flow_loss(flow, batch: dict, device: torch.device, cfm: CfmTraining, rng=random) -> dict[str, torch.Tensor]:
    """{'loss'} of a flow batch for CosyVoice 1 (MaskedDiffWithXvec), 2 (CausalMaskedDiffWithXvec) or 3 (DiT)."""
    token, token_len, feat, feat_len, embedding = (
        batch[k].to(device) for k in ("speech_token", "speech_token_len", "speech_feat", "speech_feat_len", "embedding"))
    kind = type(flow).__name__
    streaming = kind != "MaskedDiffWithXvec" and rng.random() < 0.5
    embedding = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))
    token, token_mask = _embed(flow, token, token_len, device)
    conds = _conditions(feat, feat_len, rng)  # python draws: independent of the modules' torch draws
    if kind == "MaskedDiffWithXvec":
        h, _ = flow.encoder(token, token_len)
        h = flow.encoder_proj(h)
        ylens = feat_len
        regulator_mask = (~make_pad_mask(ylens)).to(h).unsqueeze(-1)
        h = F.interpolate(h.transpose(1, 2).contiguous(), size=int(ylens.max()), mode="linear")
        h = flow.length_regulator.model(h).transpose(1, 2).contiguous() * regulator_mask
        mask = (~make_pad_mask(feat_len)).to(h)
    elif kind == "CausalMaskedDiffWithXvec":
        h, h_masks = flow.encoder(token, token_len, streaming=streaming)
        h = flow.encoder_proj(h)
        mask = (~make_pad_mask(h_masks.sum(dim=-1).squeeze(dim=1))).to(h)
    else:
        h = flow.pre_lookahead_layer(token)
        h = h.repeat_interleave(flow.token_mel_ratio, dim=1)
        mask = token_mask.repeat_interleave(flow.token_mel_ratio, dim=1).squeeze(dim=-1)
    loss = cfm_loss(flow.decoder, feat.transpose(1, 2).contiguous(), mask.unsqueeze(1), h.transpose(1, 2).contiguous(),
                    embedding, conds, cfm, streaming)
    return {"loss": loss}
