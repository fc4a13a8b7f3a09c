"""Reading speech_tokenizer_v{1,2,3}.onnx: sizes from the graph, and the key map of its weights.

The released files name few tensors (s3tokenizer 0.3.0's converters document what they rely
on): linear weights are anonymous `onnx::MatMul_*` initializers found through the nodes that
consume them (`/blocks.{i}/attn/query/MatMul`, ...), stored [in, out] and so transposed here;
LayerNorms are fused `LayerNormalization` nodes (v2) or decomposed Mul/Add chains (v1, v3);
v3's biases may be Constant nodes. Sizes come from tensor shapes and node attributes, the
head count from the constant of the head-split Reshape.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mizuoto.nn.codecs.s3tokenizer import S3Tokenizer
from mizuoto.runtime.convert.onnx import (
    OnnxGraph,
    Src,
    extract_state_dict,
    load_converted,
    load_into,
)
from mizuoto.errors import ModelLoadError
from mizuoto.runtime.convert.checkpoint import DictSource, match_state_dict

LAYOUT = "s3tokenizer-1"
_LINEARS = {"attn.query": "attn/query", "attn.key": "attn/key", "attn.value": "attn/value",
            "attn.out": "attn/out", "mlp.0": "mlp/mlp.0", "mlp.2": "mlp/mlp.2"}


def _one_tensor(g: OnnxGraph, node) -> str:
    names = g.tensor_inputs(node)
    if len(names) != 1:
        raise ModelLoadError(f"{g.path}: node {node.name!r} has {len(names)} weight inputs, expected 1")
    return names[0]


def _layer_norm(g: OnnxGraph, prefix: str) -> tuple[str, str, float, list[str]]:
    """(weight, bias, eps, constants read) of a fused or decomposed LayerNorm under `prefix`."""
    fused = g.node_by_name.get(f"{prefix}/LayerNormalization")
    if fused is not None:
        return fused.input[1], fused.input[2], float(g.attr(fused, "epsilon", 1e-5)), []
    weight = _one_tensor(g, g.node(f"{prefix}/Mul"))
    bias, eps, eps_name = None, None, None
    for add in g.find("Add", f"{prefix}/Add"):
        for name in g.tensor_inputs(add):
            if len(g.array(name).reshape(-1)) == 1:
                eps, eps_name = float(g.array(name).reshape(-1)[0]), name
            else:
                bias = name
    if bias is None or eps is None:
        raise ModelLoadError(f"{g.path}: cannot find the bias and epsilon of LayerNorm {prefix!r}")
    return weight, bias, eps, [eps_name]


def _heads(g: OnnxGraph) -> int:
    """Head count: the constant third entry of the [B, T, heads, -1] shape q/k/v are split to."""
    for reshape in g.find("Reshape", "/blocks.0/attn/"):
        shape = reshape.input[1]
        if g.has_tensor(shape):
            dims = g.array(shape).reshape(-1)
            if len(dims) == 4 and dims[3] == -1 and dims[2] > 0:
                return int(dims[2])
            continue
        producer = g.producer(shape)
        if producer is not None and producer.op_type == "Concat" and len(producer.input) == 4:
            head, rest = producer.input[2], producer.input[3]
            if g.has_tensor(head) and g.has_tensor(rest) and int(g.array(rest).reshape(-1)[0]) == -1:
                return int(g.array(head).reshape(-1)[0])
    raise ModelLoadError(f"{g.path}: cannot read the attention head count")


def _only(g: OnnxGraph, nodes: list, what: str):
    if len(nodes) != 1:
        raise ModelLoadError(f"{g.path}: expected one {what}, found {len(nodes)}")
    return nodes[0]


def _fsq(g: OnnxGraph) -> dict:
    """Projection weight/bias, tanh scale and level base of the FSQ quantizer, found around its Tanh."""
    tanh = _only(g, g.find("Tanh"), "Tanh (FSQ)")
    add = g.producer(tanh.input[0])
    matmul = next((g.producer(n) for n in (add.input if add is not None else [])
                   if g.producer(n) is not None and g.producer(n).op_type == "MatMul"), None)
    if add is None or add.op_type != "Add" or matmul is None:
        raise ModelLoadError(f"{g.path}: the FSQ tanh is not fed by a projection MatMul + Add")
    weight, bias = _one_tensor(g, matmul), _one_tensor(g, add)
    scale_mul = _only(g, [n for n in g.consumers.get(tanh.output[0], []) if n.op_type == "Mul"],
                      "FSQ scale after tanh")
    scale_name = _one_tensor(g, scale_mul)
    dim = g.shape(weight)[1]
    powers_name = next((n for node in g.find("Mul") if node is not scale_mul
                        for n in g.tensor_inputs(node) if g.array(n).size == dim > 1), None)
    if powers_name is None:
        raise ModelLoadError(f"{g.path}: cannot find the FSQ level weights")
    powers = g.array(powers_name).reshape(-1)
    levels = int(round(float(powers[1])))
    if not all(float(p) == float(levels ** i) for i, p in enumerate(powers)):
        raise ModelLoadError(f"{g.path}: FSQ level weights {powers.tolist()} are not powers of {levels}")
    return {"weight": weight, "bias": bias, "dim": dim, "levels": levels,
            "scale": float(g.array(scale_name).reshape(-1)[0]), "constants": [scale_name, powers_name]}


def read_s3tokenizer(g: OnnxGraph) -> tuple[dict, dict[str, torch.Tensor]]:
    """(constructor config, state_dict) of a speech tokenizer ONNX graph."""
    convs = [n for n in g.find("Conv") if not n.name.startswith("/blocks.")]
    if len(convs) != 2:
        raise ModelLoadError(f"{g.path}: expected 2 front convolutions, found {len(convs)}")
    (c1, c2) = convs
    n_state, n_mels, kernel = g.shape(c1.input[1])
    pads = list(g.attr(c1, "pads", [0, 0]))
    layers = sorted({int(m.group(1)) for n in g.nodes if (m := re.match(r"/blocks\.(\d+)/", n.name))})
    if not layers or layers != list(range(len(layers))):
        raise ModelLoadError(f"{g.path}: transformer blocks not found (node names /blocks.N/...)")
    key_map: dict[str, Src] = {}
    for key, node in (("conv1", c1), ("conv2", c2)):
        key_map[f"{key}.weight"] = Src(node.input[1])
        if len(node.input) > 2 and node.input[2]:
            key_map[f"{key}.bias"] = Src(node.input[2])
    constants: list[str] = []
    eps = {"attn_ln": set(), "mlp_ln": set()}
    fsmn_kernel = 0
    for i in layers:
        p = f"/blocks.{i}"
        for ln in ("attn_ln", "mlp_ln"):
            w, b, e, read = _layer_norm(g, f"{p}/{ln}")
            key_map[f"blocks.{i}.{ln}.weight"], key_map[f"blocks.{i}.{ln}.bias"] = Src(w), Src(b)
            eps[ln].add(e)
            constants += read
        for key, scope in _LINEARS.items():
            key_map[f"blocks.{i}.{key}.weight"] = Src(_one_tensor(g, g.node(f"{p}/{scope}/MatMul")),
                                                      transpose=True)
            add = g.node_by_name.get(f"{p}/{scope}/Add")
            if add is not None:
                key_map[f"blocks.{i}.{key}.bias"] = Src(_one_tensor(g, add))
        fsmn = g.node_by_name.get(f"{p}/attn/fsmn_block/Conv")
        name = fsmn.input[1] if fsmn is not None and g.has_tensor(fsmn.input[1]) \
            else f"blocks.{i}.attn.fsmn_block.weight"
        if g.has_tensor(name):
            key_map[f"blocks.{i}.attn.fsmn.weight"] = Src(name)
            fsmn_kernel = g.shape(name)[-1]
    if any(len(v) != 1 for v in eps.values()):
        raise ModelLoadError(f"{g.path}: LayerNorm epsilons differ across blocks: {eps}")
    config = {
        "n_mels": n_mels, "n_state": n_state, "n_head": _heads(g), "n_layer": len(layers),
        "n_mlp": g.shape(key_map["blocks.0.mlp.0.weight"].name)[1],
        "conv_kernel": kernel, "conv_padding": int(pads[0]),
        "conv1_stride": int(g.attr(c1, "strides", [1])[0]),
        "conv2_stride": int(g.attr(c2, "strides", [1])[0]),
        "attn_ln_eps": eps["attn_ln"].pop(), "mlp_ln_eps": eps["mlp_ln"].pop(),
        "fsmn_kernel": fsmn_kernel,
    }
    positional = [n for n in g.initializers if n.endswith("positional_embedding")]
    if positional:
        key_map["positional_embedding"] = Src(positional[0])
        config["n_ctx"] = g.shape(positional[0])[0]
    if g.find("Tanh"):  # the encoder's GELUs are erf-based: a tanh means FSQ
        fsq = _fsq(g)
        key_map["project.weight"] = Src(fsq["weight"], transpose=True)
        key_map["project.bias"] = Src(fsq["bias"])
        constants += fsq["constants"]
        config.update(quantizer="fsq", fsq_dim=fsq["dim"], fsq_levels=fsq["levels"],
                      fsq_scale=fsq["scale"])
    else:
        books = [name for node in g.find("MatMul", "/quantizer/") for name in g.tensor_inputs(node)]
        if len(books) != 1:
            raise ModelLoadError(f"{g.path}: expected one VQ codebook, found {len(books)}")
        # scalars the quantizer's ops may hold as initializers (e.g. 2.0, the norm's eps) are
        # constants of the computation, not weights
        constants += [name for node in g.find(None, "/quantizer/") for name in node.input
                      if name in g.initializers and g.array(name).size == 1]
        key_map["codebook"] = Src(books[0], transpose=True)  # stored E^T [n_state, K]
        config.update(quantizer="vq", codebook_size=g.shape(books[0])[1])
    if not positional and config["quantizer"] == "vq":
        raise ModelLoadError(f"{g.path}: VQ tokenizer without a positional embedding")
    model = S3Tokenizer(**config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    return config, extract_state_dict(g, key_map, shapes, read_as_config=constants)


def load_s3tokenizer(path: str | Path, progress=None) -> S3Tokenizer:
    """An eval-mode S3Tokenizer with the weights of a speech_tokenizer_v*.onnx file."""
    config, state = load_converted(path, read_s3tokenizer, LAYOUT, progress)
    model = S3Tokenizer(**config)
    load_into(model, state, path)
    return model.eval()


def s3tokenizer_from_state(state: dict[str, torch.Tensor], *, prefix: str = "", n_head: int, where: str | Path
                           ) -> S3Tokenizer:
    """A v2 (FSQ) speech tokenizer from a PyTorch state dict in the `s3tokenizer` package's layout
    (`S3TokenizerV2`: encoder.*, quantizer._codebook.project_down.*) under `prefix`; the head count is
    not in the weights. The package's fixed sizes (kernel 3, padding 1, strides 2, LayerNorm eps 1e-5,
    FSQ of 3 levels scaled by 0.999) are its constructor's."""
    def t(name: str) -> torch.Tensor:
        return state[prefix + name]

    try:
        layers = len({k[len(prefix):].split(".")[2] for k in state if k.startswith(prefix + "encoder.blocks.")})
        n_state, n_mels, kernel = t("encoder.conv1.weight").shape
        config = {"n_mels": n_mels, "n_state": n_state, "n_head": n_head, "n_layer": layers,
                  "n_mlp": t("encoder.blocks.0.mlp.0.weight").shape[0], "conv_kernel": kernel, "conv_padding": 1,
                  "conv1_stride": 2, "conv2_stride": 2, "attn_ln_eps": 1e-5, "mlp_ln_eps": 1e-5, "quantizer": "fsq",
                  "fsmn_kernel": t("encoder.blocks.0.attn.fsmn_block.weight").shape[-1],
                  "fsq_dim": t("quantizer._codebook.project_down.weight").shape[0], "fsq_levels": 3,
                  "fsq_scale": 0.9990000128746033}
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{where}: not an s3tokenizer v2 state dict under {prefix!r}: {exc}") from None
    model = S3Tokenizer(**config)
    key_map: dict[str, str] = {"conv1.weight": "encoder.conv1.weight", "conv1.bias": "encoder.conv1.bias",
                               "conv2.weight": "encoder.conv2.weight", "conv2.bias": "encoder.conv2.bias",
                               "project.weight": "quantizer._codebook.project_down.weight",
                               "project.bias": "quantizer._codebook.project_down.bias"}
    for key in model.state_dict():
        if key.startswith("blocks."):
            key_map[key] = "encoder." + key.replace(".attn.fsmn.", ".attn.fsmn_block.")
    mine = {k for k in state if k.startswith(prefix)}
    # the package's mel filters and window buffers ride along; the log-mel is computed here
    ignore = [k for k in mine if k[len(prefix):] in ("_mel_filters", "window")]
    source = DictSource({k: v for k, v in state.items() if k in mine})
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    model.load_state_dict(match_state_dict(source, {k: prefix + v for k, v in key_map.items()}, shapes,
                                           where=where, target="an s3tokenizer v2 speech tokenizer", ignore=ignore))
    return model.eval()
