"""HiFT's checkpoint keys: weight-normed convs folded into plain weights, for the one checkpoint matcher.

Upstream's HiFT (CosyVoice's, Chatterbox's mel2wav) stores each weight-normed conv as
`<name>.parametrizations.weight.original0/original1` (g, v; torch >= 2.1) or legacy
`<name>.weight_g/weight_v`; the modules here hold the folded `<name>.weight`, computed on the
device the module will run on, in its dtype (CosyVoice 3's float64 F0 predictor), exactly as
torch's parametrization would. No weight is transposed: upstream's layers are torch's own.
"""

from __future__ import annotations

import torch
from torch import nn

from mizuoto.errors import ModelLoadError
from mizuoto.nn.vocoders.f0 import f0_device
from mizuoto.nn.vocoders.hift import CausalHiFTGenerator
from mizuoto.nn.vocoders.layers import fold_weight_norm
from mizuoto.runtime.convert.checkpoint import Fold, Src

_PARAM_G, _PARAM_V = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
_LEGACY_G, _LEGACY_V = ".weight_g", ".weight_v"


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
                                 f"the model's sizes need g {g_shape} / v {tuple(shape)}")
        return fold_weight_norm(g.to(target_device), v.to(target_device), dtype)
    return fold


def hift_key_map(model: nn.Module, state: dict[str, torch.Tensor], where: str,
                 device: torch.device | str = "cpu", prefix: str = "") -> dict[str, Src | Fold]:
    """Key map for `model`'s state dict, keys and sources both under `prefix`: weight norm folded, the rest as is."""
    device = torch.device(device)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    key_map: dict[str, Src | Fold] = {prefix + k: Src(prefix + k) for k in shapes}
    for name in model.weight_normed():
        full = prefix + name
        styles = ((full + _PARAM_G, full + _PARAM_V), (full + _LEGACY_G, full + _LEGACY_V))
        g, v = next((pair for pair in styles if all(k in state for k in pair)), styles[0])
        key_map[f"{full}.weight"] = Fold((g, v), _weight_norm_fold(model, name, shapes[f"{name}.weight"], device,
                                                                   where), "weight norm")
    return key_map
