"""CosyVoice's flow stage: speech tokens (+ voice prompt) -> mel; the v1 class and every builder.

The v2 class (CausalMaskedDiffWithXvec) is engine-neutral and lives in mizuoto/nn/flow/xvec.py.

`build_flow(config)` reads the yaml's `flow` node (HyperPyYAML tags read as data) and builds
the matching wrapper; `load_flow_weights` loads `flow.pt` by upstream's key names. Flow classes
and estimators are looked up by their yaml class name in FLOWS / ESTIMATORS, which list every
generation's builders (CosyVoice 3's DiT flow class lives in flow_dit.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from mizuoto.engines.cosyvoice.flow_dit import CausalMaskedDiffWithDiT
from mizuoto.errors import ModelLoadError
from mizuoto.nn.flow.cfm import ConditionalCFM
from mizuoto.nn.flow.length_regulator import InterpolateRegulator, mel_frames_for_tokens
from mizuoto.nn.flow.unet1d import ConditionalDecoder
from mizuoto.nn.flow.xvec import CausalMaskedDiffWithXvec, XvecFlow
from mizuoto.nn.transformer.dit import DiT
from mizuoto.nn.transformer.upsample import PreLookaheadLayer, UpsampleConformerEncoder
from mizuoto.nn.transformer.wenet import ConformerEncoder
from mizuoto.runtime.convert.checkpoint import load_checkpoint
from mizuoto.runtime.hyperyaml import Tagged

# CosyVoice 1 streams 100-token chunks overlapping by 20 tokens (cli/model.py token_overlap_len);
# its flow stretches those overlaps to whole mel frames and caches their noise.
V1_OVERLAP_TOKENS = 20


class MaskedDiffWithXvec(XvecFlow):
    """CosyVoice 1's flow: conformer, length regulator to the mel rate, U-Net, per-request noise."""

    def __init__(self, vocab_size: int, input_size: int, output_size: int, spk_embed_dim: int,
                 input_frame_rate: int, mel_sample_rate: int, mel_hop_length: int,
                 encoder: nn.Module, length_regulator: InterpolateRegulator, decoder: ConditionalCFM):
        super().__init__(vocab_size, input_size, output_size, spk_embed_dim, input_frame_rate)
        self.mel_sample_rate = mel_sample_rate
        self.mel_hop_length = mel_hop_length
        self.encoder = encoder
        self.encoder_proj = nn.Linear(encoder.output_size(), output_size)
        self.decoder = decoder  # registered before the regulator: upstream's key order
        self.length_regulator = length_regulator

    def mel_frames(self, tokens: int) -> int:
        """Mel frames upstream generates for `tokens` tokens."""
        return mel_frames_for_tokens(tokens, self.input_frame_rate, self.mel_sample_rate, self.mel_hop_length)

    def token2mel(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, *, streaming: bool, finalize: bool, cache: Any = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, Any]:
        """The stage interface: v1 draws its noise from `generator` and carries the overlap's in `cache`."""
        return self.inference(token, prompt_token, prompt_feat, embedding, flow_cache=cache, generator=generator)

    def empty_cache(self) -> torch.Tensor:
        """The streaming cache a request starts with."""
        return torch.zeros(1, self.output_size, 0, 2)

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, flow_cache: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mel (1, output_size, frames), next flow_cache); noise drawn from `generator`."""
        spks, xs = self.embed_request(token, prompt_token, prompt_feat, embedding)
        if flow_cache is None:
            flow_cache = self.empty_cache()
        token_len1, token_len2 = prompt_token.shape[1], token.shape[1]
        xs_lens = torch.tensor([xs.shape[1]], dtype=torch.int32, device=xs.device)
        h, _ = self.encoder(xs, xs_lens)
        h = self.encoder_proj(h)
        mel_len1, mel_len2 = prompt_feat.shape[1], self.mel_frames(token_len2)
        h = self.length_regulator.inference(h[:, :token_len1], h[:, token_len1:], mel_len1, mel_len2,
                                            V1_OVERLAP_TOKENS, self.mel_frames(V1_OVERLAP_TOKENS))
        conds = self.conditions(prompt_feat, mel_len1 + mel_len2, h)
        mask = self.full_mask(mel_len1 + mel_len2, h)
        feat, flow_cache = self.decoder.forward_cached(
            mu=h.transpose(1, 2).contiguous(), mask=mask, n_timesteps=self.n_timesteps, spks=spks,
            cond=conds, prompt_len=mel_len1, cache=flow_cache.to(h), generator=generator)
        return feat[:, :, mel_len1:].float(), flow_cache


# ---- building from the yaml ------------------------------------------------------------------

# Options upstream accepts that change nothing here: training switches, and the conformer
# convolution module's settings (the module itself is refused when switched on).
_IGNORED_KWARGS = {"gradient_checkpointing", "global_cmvn", "positionwise_conv_kernel_size",
                   "cnn_module_kernel", "cnn_module_norm", "causal"}


def _node(value: Any, where: str) -> Tagged:
    if not isinstance(value, Tagged):
        raise ModelLoadError(f"yaml: {where} must be a !new: node, got {type(value).__name__}")
    return value


def construct(cls: type, node: Tagged, where: str, **extra: Any) -> Any:
    """cls(**node's kwargs, **extra); a kwarg cls does not know is a clear ModelLoadError."""
    kwargs = {k: v for k, v in node.kwargs.items() if k not in _IGNORED_KWARGS}
    kwargs.update(extra)
    params = inspect.signature(cls).parameters
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        raise ModelLoadError(f"yaml: {where} ({node.cls}) has options Mizuoto does not support: {', '.join(unknown)}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise ModelLoadError(f"yaml: cannot build {where} ({node.cls}): {exc}") from None


# The flow node's sizes, and v2/v3's chunking (mel frames per token, look-ahead tokens), with upstream's defaults.
_SIZES = {"vocab_size": 4096, "input_size": 512, "output_size": 80, "spk_embed_dim": 192, "input_frame_rate": 50}
_CHUNKING = {"token_mel_ratio": 2, "pre_lookahead_len": 3}


def _args(flow: Tagged, defaults: dict[str, Any]) -> dict[str, Any]:
    return {k: flow.get(k, default) for k, default in defaults.items()}


def _upsample_conformer(node: Tagged, flow: Tagged) -> nn.Module:
    chunking = _args(flow, _CHUNKING)
    return construct(UpsampleConformerEncoder, node, "flow.encoder", pre_lookahead_len=chunking["pre_lookahead_len"],
                     upsample_stride=chunking["token_mel_ratio"])


ENCODERS: dict[str, Callable[[Tagged, Tagged], nn.Module]] = {
    "ConformerEncoder": lambda node, flow: construct(ConformerEncoder, node, "flow.encoder"),
    "UpsampleConformerEncoder": _upsample_conformer,
}
# Estimator options that only matter for training or for decoding modes upstream never uses here.
_DIT_UNUSED = ("dropout", "out_channels", "num_decoding_left_chunks")


def _dit(node: Tagged) -> nn.Module:
    kwargs = {k: v for k, v in node.kwargs.items() if k not in _DIT_UNUSED}
    return construct(DiT, Tagged(node.kind, node.target, kwargs), "flow.decoder.estimator")


ESTIMATORS: dict[str, Callable[[Tagged], nn.Module]] = {
    "ConditionalDecoder": lambda node: construct(ConditionalDecoder, node, "flow.decoder.estimator"),
    "CausalConditionalDecoder": lambda node: construct(ConditionalDecoder, node, "flow.decoder.estimator", causal=True),
    "DiT": _dit,
}
# CFM class -> whether its noise is upstream's fixed seed-0 buffer.
CFM_CLASSES = {"ConditionalCFM": False, "CausalConditionalCFM": True}


def build_cfm(node: Tagged, overlap_frames: int | None = None) -> ConditionalCFM:
    """The flow-matching decoder of a `flow.decoder` node, with its estimator."""
    if node.cls not in CFM_CLASSES:
        raise ModelLoadError(f"yaml: flow.decoder class {node.cls} is not supported (known: {sorted(CFM_CLASSES)})")
    content = cfm_params(node)
    if content.get("solver", "euler") != "euler":
        raise ModelLoadError(f"yaml: flow solver {content['solver']!r} is not supported (euler)")
    estimator_node = _node(node.get("estimator"), "flow.decoder.estimator")
    if estimator_node.cls not in ESTIMATORS:
        raise ModelLoadError(f"yaml: flow estimator {estimator_node.cls} is not supported (known: {sorted(ESTIMATORS)})")
    try:
        return ConditionalCFM(ESTIMATORS[estimator_node.cls](estimator_node),
                              inference_cfg_rate=float(content.get("inference_cfg_rate", 0.7)),
                              t_scheduler=content.get("t_scheduler", "cosine"),
                              fixed=CFM_CLASSES[node.cls], overlap_frames=overlap_frames)
    except ValueError as exc:
        raise ModelLoadError(f"yaml: flow.decoder: {exc}") from None


def cfm_params(decoder: Any) -> dict[str, Any]:
    """A `flow.decoder` node's cfm_params (an omegaconf DictConfig `content` in upstream's yamls)."""
    params = decoder.get("cfm_params") if isinstance(decoder, Tagged) else None
    content = params.get("content", params.kwargs) if isinstance(params, Tagged) else params
    if not isinstance(content, dict):
        raise ModelLoadError("yaml: flow.decoder.cfm_params is missing")
    return content


def _encoder(flow: Tagged) -> nn.Module:
    node = _node(flow.get("encoder"), "flow.encoder")
    if node.cls not in ENCODERS:
        raise ModelLoadError(f"yaml: flow encoder {node.cls} is not supported (known: {sorted(ENCODERS)})")
    return ENCODERS[node.cls](node, flow)


def _build_causal_xvec(config: dict) -> nn.Module:
    flow = config["flow"]
    return CausalMaskedDiffWithXvec(**_args(flow, _SIZES), **_args(flow, _CHUNKING), encoder=_encoder(flow),
                                    decoder=build_cfm(_node(flow.get("decoder"), "flow.decoder")))


def _build_xvec(config: dict) -> nn.Module:
    flow = config["flow"]
    feat = config.get("feat_extractor")
    if not isinstance(feat, Tagged) or "sampling_rate" not in feat.kwargs or "hop_size" not in feat.kwargs:
        raise ModelLoadError("yaml: feat_extractor with sampling_rate and hop_size is needed for the v1 mel rate")
    sizes = _args(flow, _SIZES)
    overlap_frames = mel_frames_for_tokens(V1_OVERLAP_TOKENS, sizes["input_frame_rate"], feat["sampling_rate"],
                                           feat["hop_size"])
    regulator = construct(InterpolateRegulator, _node(flow.get("length_regulator"), "flow.length_regulator"),
                          "flow.length_regulator")
    return MaskedDiffWithXvec(**sizes, mel_sample_rate=feat["sampling_rate"], mel_hop_length=feat["hop_size"],
                              encoder=_encoder(flow), length_regulator=regulator,
                              decoder=build_cfm(_node(flow.get("decoder"), "flow.decoder"), overlap_frames))


def _build_dit_flow(config: dict) -> nn.Module:
    flow = config["flow"]
    layer = _node(flow.get("pre_lookahead_layer"), "flow.pre_lookahead_layer")
    if layer.cls != "PreLookaheadLayer":
        raise ModelLoadError(f"yaml: flow.pre_lookahead_layer class {layer.cls} is not supported")
    return CausalMaskedDiffWithDiT(**_args(flow, _SIZES), **_args(flow, _CHUNKING),
                                   pre_lookahead_layer=construct(PreLookaheadLayer, layer, "flow.pre_lookahead_layer"),
                                   decoder=build_cfm(_node(flow.get("decoder"), "flow.decoder")))


FLOWS: dict[str, Callable[[dict], nn.Module]] = {
    "CausalMaskedDiffWithXvec": _build_causal_xvec,
    "MaskedDiffWithXvec": _build_xvec,
    "CausalMaskedDiffWithDiT": _build_dit_flow,
}


def build_flow(config: dict) -> nn.Module:
    """The flow module a parsed yaml (load_hyperyaml) describes, with untrained weights, in eval mode."""
    flow = _node(config.get("flow"), "flow")
    if flow.cls not in FLOWS:
        raise ModelLoadError(f"yaml: flow class {flow.cls} is not supported (known: {sorted(FLOWS)})")
    return FLOWS[flow.cls](config).eval()


def load_flow_weights(module: nn.Module, path: str | Path) -> nn.Module:
    """Load upstream's flow.pt into `module` strictly: the same key names, every key present, same shapes."""
    return load_checkpoint(module, path, target="the yaml's flow")
