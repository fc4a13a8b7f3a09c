"""CosyVoice's vocoder stage: build HiFT from the yaml `hift` node and load upstream's hift.pt.

Checkpoint keys are upstream's, possibly under a `generator.` prefix (a HiFi-GAN training
checkpoint); weight-normed convs are folded by `mizuoto.runtime.convert.hift`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mizuoto.nn.vocoders.f0 import CausalConvRNNF0Predictor, ConvRNNF0Predictor
from mizuoto.nn.vocoders.hift import CausalHiFTGenerator, HiFTGenerator
from mizuoto.nn.vocoders.source import FixedSourceNoise
from mizuoto.errors import ModelLoadError
from mizuoto.runtime.convert.checkpoint import DictSource, match_state_dict, read_checkpoint
from mizuoto.runtime.convert.hift import hift_key_map
from mizuoto.runtime.hyperyaml import Tagged

_GENERATORS = {"HiFTGenerator": HiFTGenerator, "CausalHiFTGenerator": CausalHiFTGenerator}
_F0_PREDICTORS = {"ConvRNNF0Predictor": ConvRNNF0Predictor, "CausalConvRNNF0Predictor": CausalConvRNNF0Predictor}
_HIFT_KEYS = ("in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha", "nsf_sigma",
              "nsf_voiced_threshold", "upsample_rates", "upsample_kernel_sizes", "istft_params",
              "resblock_kernel_sizes", "resblock_dilation_sizes", "source_resblock_kernel_sizes",
              "source_resblock_dilation_sizes", "lrelu_slope", "audio_limit")
_CAUSAL_KEYS = ("conv_pre_look_right",)
_F0_KEYS = ("num_class", "in_channels", "cond_channels")
_PREFIX = "generator."


def _sizes(node: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(node, Tagged):
        raise ModelLoadError(f"yaml `{where}` is not a !new: node")
    missing = [k for k in keys if k not in node.kwargs]
    if missing:
        raise ModelLoadError(f"yaml `{where}` ({node.cls}) lacks {', '.join(missing)}")
    return {k: node.kwargs[k] for k in keys}


def _class(node: Any, classes: dict[str, type], where: str) -> type:
    cls = classes.get(getattr(node, "cls", None))
    if cls is None:
        raise ModelLoadError(f"yaml `{where}` is {getattr(node, 'cls', None) or 'missing'}; "
                             f"expected one of {', '.join(classes)}")
    return cls


def build_hift(config: dict, noise: FixedSourceNoise | None = None) -> nn.Module:
    """An unloaded HiFT as the parsed yaml's `hift` node describes; CosyVoice 3 needs its noise."""
    node = config.get("hift")
    cls = _class(node, _GENERATORS, "hift")
    f0_node = node.get("f0_predictor")
    f0_predictor = _class(f0_node, _F0_PREDICTORS, "hift.f0_predictor")(**_sizes(f0_node, _F0_KEYS, "hift.f0_predictor"))
    kwargs = _sizes(node, _HIFT_KEYS, "hift")
    if cls is CausalHiFTGenerator:
        if noise is None:
            raise ModelLoadError("CosyVoice 3's HiFT needs its construction-time noise (cosyvoice3_noise)")
        # Upstream runs this predictor in float64 (F0 is integrated into phase).
        return cls(**kwargs, **_sizes(node, _CAUSAL_KEYS, "hift"), f0_predictor=f0_predictor.double(),
                   noise=noise)
    return cls(**kwargs, f0_predictor=f0_predictor)


def convert_state_dict(state: dict[str, torch.Tensor], model: nn.Module, where: str,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Upstream hift.pt keys -> this model's keys, weight norm folded; strict, with named errors."""
    state = {k[len(_PREFIX):] if k.startswith(_PREFIX) else k: v for k, v in state.items()}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    return match_state_dict(DictSource(state), hift_key_map(model, state, where, device), shapes, where=where,
                            target="the yaml's hift")


def load_hift(path: str | Path, config: dict, noise: FixedSourceNoise | None = None,
              device: torch.device | str = "cpu") -> nn.Module:
    """Build HiFT from the yaml, load upstream's hift.pt strictly, place it on `device`, eval mode."""
    state = read_checkpoint(path)
    model = build_hift(config, noise)
    model.load_state_dict(convert_state_dict(state, model, str(path), device), strict=True)
    model.eval()
    if isinstance(model, CausalHiFTGenerator):
        return model.place(device)
    return model.to(device)
