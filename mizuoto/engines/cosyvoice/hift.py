"""CosyVoice's vocoder stage: build HiFT from the yaml `hift` node and load upstream's hift.pt.

Checkpoint keys are upstream's. Weight-normed convs arrive as
`<name>.parametrizations.weight.original0/original1` (g, v; torch >= 2.1) or legacy
`<name>.weight_g/weight_v`, possibly under a `generator.` prefix (a HiFi-GAN training
checkpoint); they are folded into `<name>.weight` here, on the device the module will run on,
in its dtype (CosyVoice 3's F0 predictor: float64), exactly as torch's parametrization would.
No weight is transposed: upstream's layers are torch's own Conv1d / ConvTranspose1d / Linear,
whose layouts the modules here share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mizuoto.nn.vocoders.f0 import CausalConvRNNF0Predictor, ConvRNNF0Predictor, f0_device
from mizuoto.nn.vocoders.hift import CausalHiFTGenerator, HiFTGenerator
from mizuoto.nn.vocoders.layers import fold_weight_norm
from mizuoto.nn.vocoders.source import FixedSourceNoise
from mizuoto.errors import ModelLoadError
from mizuoto.runtime.convert.checkpoint import DictSource, Fold, Src, match_state_dict, read_checkpoint
from mizuoto.runtime.hyperyaml import Tagged

_GENERATORS = {"HiFTGenerator": HiFTGenerator, "CausalHiFTGenerator": CausalHiFTGenerator}
_F0_PREDICTORS = {"ConvRNNF0Predictor": ConvRNNF0Predictor, "CausalConvRNNF0Predictor": CausalConvRNNF0Predictor}
_HIFT_KEYS = ("in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha", "nsf_sigma",
              "nsf_voiced_threshold", "upsample_rates", "upsample_kernel_sizes", "istft_params",
              "resblock_kernel_sizes", "resblock_dilation_sizes", "source_resblock_kernel_sizes",
              "source_resblock_dilation_sizes", "lrelu_slope", "audio_limit")
_CAUSAL_KEYS = ("conv_pre_look_right",)
_F0_KEYS = ("num_class", "in_channels", "cond_channels")
_PARAM_G, _PARAM_V = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
_LEGACY_G, _LEGACY_V = ".weight_g", ".weight_v"
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


def _weight_norm_fold(model: nn.Module, name: str, shape: torch.Size, device: torch.device, where: str):
    """The Fold function of weight-normed layer `name`: g and v checked, folded where it will run, in its dtype."""
    g_shape = (shape[0],) + (1,) * (len(shape) - 1)
    dtype = model.get_parameter(f"{name}.weight").dtype
    # CosyVoice 3's float64 F0 predictor runs where float64 does (CausalHiFTGenerator.place)
    causal_f0 = name.startswith("f0_predictor.") and isinstance(model, CausalHiFTGenerator)
    target_device = f0_device(device) if causal_f0 else device

    def fold(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if tuple(v.shape) != tuple(shape) or tuple(g.shape) != g_shape:
            raise ModelLoadError(f"{where}: {name} weight norm has g {tuple(g.shape)} / v {tuple(v.shape)}, "
                                 f"the yaml's sizes need g {g_shape} / v {tuple(shape)}")
        return fold_weight_norm(g.to(target_device), v.to(target_device), dtype)
    return fold


def convert_state_dict(state: dict[str, torch.Tensor], model: nn.Module, where: str,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Upstream hift.pt keys -> this model's keys, weight norm folded; strict, with named errors."""
    device = torch.device(device)
    state = {k[len(_PREFIX):] if k.startswith(_PREFIX) else k: v for k, v in state.items()}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    key_map: dict[str, Src | Fold] = {k: Src(k) for k in shapes}
    for name in model.weight_normed():
        styles = ((name + _PARAM_G, name + _PARAM_V), (name + _LEGACY_G, name + _LEGACY_V))
        g, v = next((pair for pair in styles if all(k in state for k in pair)), styles[0])
        key_map[f"{name}.weight"] = Fold((g, v), _weight_norm_fold(model, name, shapes[f"{name}.weight"], device,
                                                                   where), "weight norm")
    return match_state_dict(DictSource(state), key_map, shapes, where=where, target="the yaml's hift")


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
