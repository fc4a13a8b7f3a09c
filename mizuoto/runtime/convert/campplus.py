"""Reading CAM++: campplus.onnx (sizes from the graph, the key map of its weights), or a PyTorch state dict.

The exporter names each node after its module scope (`/xvector/block1/tdnnd1/linear1/Conv`,
`/head/layer1/layer1.0/conv1/Conv`), while the folded conv weights are anonymous
(`onnx::Conv_NNNN`) and identical tensors may be shared through Identity nodes. So every
weight is found through the node of its module: a module at `a.b.0.c` is the node scope
`/a/b/b.0/c`; conv weight/bias are inputs 1/2 of its Conv node, batch-norm scale, bias, mean
and variance inputs 1-4 of its BatchNormalization node. Each conv's stride, padding, dilation
and groups are checked against the graph.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from mizuoto.nn.speaker.campplus import BatchNorm, CAMPPlus
from mizuoto.runtime.convert.onnx import (
    OnnxGraph,
    Src,
    extract_state_dict,
    load_converted,
    load_into,
)
from mizuoto.errors import ModelLoadError
from mizuoto.runtime.convert.checkpoint import DictSource, match_state_dict

LAYOUT = "campplus-1"
_BN_INPUTS = ("weight", "bias", "running_mean", "running_var")


def node_scope(module_path: str) -> str:
    """The ONNX node scope of a module path: `head.layer1.0.conv1` -> `/head/layer1/layer1.0/conv1`."""
    parts: list[str] = []
    for part in module_path.split("."):
        parts.append(f"{parts[-1]}.{part}" if part.isdigit() and parts else part)
    return "/" + "/".join(parts)


def _weight(g: OnnxGraph, node_name: str) -> tuple[int, ...]:
    return g.shape(g.node(node_name).input[1])


def _numbered(g: OnnxGraph, pattern: str) -> list[int]:
    found = sorted({int(m.group(1)) for n in g.nodes if (m := re.match(pattern, n.name))})
    if found != list(range(1, len(found) + 1)):
        raise ModelLoadError(f"{g.path}: nodes matching {pattern!r} are not numbered 1..N: {found}")
    return found


def _config(g: OnnxGraph) -> dict:
    head_layers = []
    for layer in _numbered(g, r"^/head/layer(\d+)/"):
        blocks = sorted({int(m.group(1)) for n in g.nodes
                         if (m := re.match(rf"^/head/layer{layer}/layer{layer}\.(\d+)/conv1/Conv$", n.name))})
        head_layers.append([
            [int(g.attr(g.node(f"/head/layer{layer}/layer{layer}.{j}/conv1/Conv"), "strides")[0]),
             int(f"/head/layer{layer}/layer{layer}.{j}/shortcut/shortcut.0/Conv" in g.node_by_name)]
            for j in blocks])
    tdnn = g.node("/xvector/tdnn/linear/Conv")
    tdnn_w = g.shape(tdnn.input[1])
    blocks, transits = [], []
    for b in _numbered(g, r"^/xvector/block(\d+)/"):
        layers = _numbered(g, rf"^/xvector/block{b}/tdnnd(\d+)/")
        local = g.node(f"/xvector/block{b}/tdnnd1/cam_layer/linear_local/Conv")
        growth, bn_channels, kernel = g.shape(local.input[1])
        blocks.append({
            "layers": len(layers), "growth": growth, "bn_channels": bn_channels, "kernel": kernel,
            "dilation": int(g.attr(local, "dilations", [1])[0]),
            "cam_hidden": _weight(g, f"/xvector/block{b}/tdnnd1/cam_layer/linear1/Conv")[0],
        })
        transit = g.node(f"/xvector/transit{b}/linear/Conv")
        transits.append({"out": g.shape(transit.input[1])[0], "bias": len(transit.input) > 2})
    pools = g.find("AveragePool", "/xvector/")
    if not pools:
        raise ModelLoadError(f"{g.path}: no segment pooling (AveragePool) found")
    eps = {float(g.attr(n, "epsilon", 1e-5)) for n in g.find("BatchNormalization")}
    if len(eps) != 1:
        raise ModelLoadError(f"{g.path}: batch norms use different epsilons {sorted(eps)}")
    feat_dim = next(iter(g.inputs.values()))[-1]
    if not isinstance(feat_dim, int) or feat_dim <= 0:
        raise ModelLoadError(f"{g.path}: the input's feature dimension is not fixed")
    return {
        "feat_dim": feat_dim, "head_channels": _weight(g, "/head/conv1/Conv")[0],
        "head_layers": head_layers,
        "head_conv2_stride": int(g.attr(g.node("/head/conv2/Conv"), "strides")[0]),
        "tdnn": {"out": tdnn_w[0], "kernel": tdnn_w[2], "stride": int(g.attr(tdnn, "strides", [1])[0]),
                 "padding": int(g.attr(tdnn, "pads", [0])[0]),
                 "dilation": int(g.attr(tdnn, "dilations", [1])[0])},
        "blocks": blocks, "transits": transits,
        "embedding_size": _weight(g, "/xvector/dense/linear/Conv")[0],
        "seg_len": int(g.attr(pools[0], "kernel_shape")[0]), "eps": eps.pop(),
        "out_batchnorm": "/xvector/out_nonlinear/batchnorm/BatchNormalization" in g.node_by_name,
    }


def _check_conv(g: OnnxGraph, node, conv: nn.Module) -> None:
    dims = len(conv.kernel_size)
    want = {"strides": list(conv.stride), "dilations": list(conv.dilation),
            "pads": [p for p in conv.padding] * 2, "group": conv.groups}
    got = {"strides": list(g.attr(node, "strides", [1] * dims)),
           "dilations": list(g.attr(node, "dilations", [1] * dims)),
           "pads": list(g.attr(node, "pads", [0] * 2 * dims)), "group": g.attr(node, "group", 1)}
    if want != got:
        raise ModelLoadError(f"{g.path}: node {node.name!r} is {got}, the module expects {want}")


def read_campplus(g: OnnxGraph) -> tuple[dict, dict[str, torch.Tensor]]:
    """(constructor config, state_dict) of a campplus ONNX graph."""
    config = _config(g)
    model = CAMPPlus(**config)
    key_map: dict[str, Src] = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            node = g.node(f"{node_scope(path)}/Conv")
            _check_conv(g, node, module)
            key_map[f"{path}.weight"] = Src(node.input[1])
            if module.bias is not None:
                if len(node.input) < 3:
                    raise ModelLoadError(f"{g.path}: node {node.name!r} has no bias")
                key_map[f"{path}.bias"] = Src(node.input[2])
        elif isinstance(module, BatchNorm):
            node = g.node(f"{node_scope(path)}/BatchNormalization")
            for name, src in zip(_BN_INPUTS, node.input[1:5], strict=True):
                key_map[f"{path}.{name}"] = Src(src)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    return config, extract_state_dict(g, key_map, shapes)


def load_campplus(path: str | Path, progress=None) -> CAMPPlus:
    """An eval-mode CAMPPlus on the CPU with the weights of a campplus.onnx file."""
    config, state = load_converted(path, read_campplus, LAYOUT, progress)
    model = CAMPPlus(**config)
    load_into(model, state, path)
    return model.to(CAMPPlus.fixed_device).eval()


# 3D-Speaker's CAMPPlus literals that its PyTorch weights do not state: 80 fbank bins (its
# extract_feature's); each FCM layer's first block is strided (stride 2 on frequency), and FCM's
# last conv too; the TDNN is strided by 2 and 'same'-padded; the three dense blocks' dilations;
# CAM's segment length; BatchNorm's eps.
TORCH_FEAT_DIM = 80
TORCH_HEAD_STRIDE = 2
TORCH_TDNN_STRIDE = 2
TORCH_DILATIONS = (1, 2, 2)
TORCH_SEG_LEN = 100
TORCH_EPS = 1e-5


def _count(state: dict, prefix: str, pattern: str) -> int:
    found = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + pattern, k))}
    if found != set(range(1, len(found) + 1)) and found != set(range(len(found))):
        raise ModelLoadError(f"{prefix}{pattern}: not numbered consecutively: {sorted(found)}")
    return len(found)


def _torch_config(state: dict, prefix: str) -> dict:
    """CAMPPlus constructor config of a 3D-Speaker PyTorch state dict (sizes from the weights)."""
    def shape(name: str) -> tuple[int, ...]:
        return tuple(state[prefix + name].shape)

    head_channels = shape("head.conv1.weight")[0]
    head_layers = []
    for i in range(1, _count(state, prefix, r"head\.layer(\d+)\.") + 1):
        blocks = _count(state, prefix, rf"head\.layer{i}\.(\d+)\.")
        head_layers.append([[TORCH_HEAD_STRIDE if j == 0 else 1, int(f"{prefix}head.layer{i}.{j}.shortcut.0.weight"
                                                                    in state)] for j in range(blocks)])
    tdnn_out, _, tdnn_kernel = shape("xvector.tdnn.linear.weight")  # its input width is checked on loading
    blocks, transits = [], []
    n_blocks = _count(state, prefix, r"xvector\.block(\d+)\.")
    if n_blocks != len(TORCH_DILATIONS):
        raise ModelLoadError(f"{n_blocks} dense blocks; 3D-Speaker's CAMPPlus has {len(TORCH_DILATIONS)}")
    for b, dilation in enumerate(TORCH_DILATIONS, start=1):
        p = f"xvector.block{b}.tdnnd1."
        growth, bn_channels, kernel = shape(p + "cam_layer.linear_local.weight")
        blocks.append({"layers": _count(state, prefix, rf"xvector\.block{b}\.tdnnd(\d+)\."), "growth": growth,
                       "bn_channels": bn_channels, "kernel": kernel, "dilation": dilation,
                       "cam_hidden": shape(p + "cam_layer.linear1.weight")[0]})
        transits.append({"out": shape(f"xvector.transit{b}.linear.weight")[0],
                         "bias": f"{prefix}xvector.transit{b}.linear.bias" in state})
    return {"feat_dim": TORCH_FEAT_DIM, "head_channels": head_channels, "head_layers": head_layers,
            "head_conv2_stride": TORCH_HEAD_STRIDE,
            "tdnn": {"out": tdnn_out, "kernel": tdnn_kernel, "stride": TORCH_TDNN_STRIDE,
                     "padding": (tdnn_kernel - 1) // 2, "dilation": 1},
            "blocks": blocks, "transits": transits, "embedding_size": shape("xvector.dense.linear.weight")[0],
            "seg_len": TORCH_SEG_LEN, "eps": TORCH_EPS,
            "out_batchnorm": f"{prefix}xvector.out_nonlinear.batchnorm.running_mean" in state, "folded": False,
            "dense_affine": f"{prefix}xvector.dense.nonlinear.batchnorm.weight" in state}


def campplus_from_state(state: dict[str, torch.Tensor], *, prefix: str = "", where: str | Path) -> CAMPPlus:
    """An eval-mode, unfolded CAMPPlus on the CPU from a state dict in 3D-Speaker's PyTorch layout
    (every conv bias-free and followed by a BatchNorm) under `prefix`; sizes from the weights."""
    try:
        config = _torch_config(state, prefix)
        model = CAMPPlus(**config)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{where}: not a CAM++ (3D-Speaker PyTorch) state dict under {prefix!r}: "
                             f"{type(exc).__name__}: {exc}") from None
    mine = {k for k in state if k.startswith(prefix)}
    # BatchNorm's training counter rides along; inference never reads it
    ignore = [k for k in mine if k.endswith(".num_batches_tracked")]
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    matched = match_state_dict(DictSource({k: state[k] for k in mine}), {k: prefix + k for k in shapes}, shapes,
                               where=where, target="a CAM++ speaker encoder (3D-Speaker's PyTorch layout)",
                               ignore=ignore)
    model.load_state_dict(matched)
    return model.to(CAMPPlus.fixed_device).eval()
