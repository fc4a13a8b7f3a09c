"""Seedable noise for Piper's ONNX graph.

onnxruntime seeds a RandomNormalLike kernel once, when the session is built, and its state then
runs on across calls, so a request's seed could not make its audio repeatable. Each such node is
rewritten here to read its noise from a new graph input instead, sliced (and reshaped) to the
node's shape; the noise is drawn per request from numpy with the request's seed. The graph also
reports how many values each node needed, so a too-short input is detected and redrawn.
"""

from __future__ import annotations

import numpy as np

NOISE_INPUT = "mizuoto_noise_{}"
NEED_OUTPUT = "mizuoto_noise_need_{}"


def make_seedable(model) -> int:
    """Rewrite every RandomNormalLike node of an onnx ModelProto in place; returns how many there were."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    count = 0
    nodes = []
    for node in graph.node:
        if node.op_type != "RandomNormalLike":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("dtype", TensorProto.FLOAT) != TensorProto.FLOAT:
            raise ValueError(f"{node.name}: only float32 RandomNormalLike can be made seedable")
        k, x, y = count, node.input[0], node.output[0]
        src, need = NOISE_INPUT.format(k), NEED_OUTPUT.format(k)
        p = f"mizuoto_noise/{k}/"
        graph.input.append(helper.make_tensor_value_info(src, TensorProto.FLOAT, [None]))
        graph.output.append(helper.make_tensor_value_info(need, TensorProto.INT64, []))
        graph.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), p + "one_shape"),
                                  numpy_helper.from_array(np.array([0], np.int64), p + "zero"),
                                  numpy_helper.from_array(np.array(1, np.int64), p + "one")])
        scaled = f"{p}raw" if (attrs.get("scale", 1.0), attrs.get("mean", 0.0)) != (1.0, 0.0) else y
        nodes += [
            helper.make_node("Size", [x], [need]),
            helper.make_node("Size", [src], [p + "have"]),
            # repeats = ceil(need / have): the slice never runs short, and `need` says when to redraw.
            helper.make_node("Add", [need, p + "have"], [p + "sum"]),
            helper.make_node("Sub", [p + "sum", p + "one"], [p + "sum1"]),
            helper.make_node("Div", [p + "sum1", p + "have"], [p + "reps0"]),
            helper.make_node("Reshape", [p + "reps0", p + "one_shape"], [p + "reps"]),
            helper.make_node("Tile", [src, p + "reps"], [p + "tiled"]),
            helper.make_node("Reshape", [need, p + "one_shape"], [p + "end"]),
            helper.make_node("Slice", [p + "tiled", p + "zero", p + "end"], [p + "flat"]),
            helper.make_node("Shape", [x], [p + "shape"]),
            helper.make_node("Reshape", [p + "flat", p + "shape"], [scaled]),
        ]
        if scaled != y:
            scale, mean = (np.array(attrs.get(k, d), np.float32) for k, d in (("scale", 1.0), ("mean", 0.0)))
            graph.initializer.extend([numpy_helper.from_array(scale, p + "scale"),
                                      numpy_helper.from_array(mean, p + "mean")])
            nodes += [helper.make_node("Mul", [scaled, p + "scale"], [p + "mul"]),
                      helper.make_node("Add", [p + "mul", p + "mean"], [y])]
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def draw(seed: int, part: int, k: int, size: int) -> np.ndarray:
    """`size` standard-normal float32 values of noise input `k` for sentence part `part` of a request."""
    return np.random.default_rng([seed, part, k]).standard_normal(size, dtype=np.float32)
