"""The RandomNormalLike rewrite: noise comes from an input, shaped like the node's input, scaled and shifted."""

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper


def _graph(**attrs) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3, None])
    node = helper.make_node("RandomNormalLike", ["x"], ["n"], dtype=TensorProto.FLOAT, **attrs)
    add = helper.make_node("Add", ["x", "n"], ["y"])
    return helper.make_model(helper.make_graph([node, add], "g", [x], [y]), opset_imports=[helper.make_opsetid("", 15)])


def _run(model, x, noise):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "mizuoto_noise_0": noise})


def test_noise_from_input_scaled():
    """y = x + (noise * scale + mean), the noise taken in order and reshaped; `need` is the element count."""
    from mizuoto_piper.noise import make_seedable

    model = _graph(mean=2.0, scale=3.0)
    assert make_seedable(model) == 1
    x = np.zeros((1, 3, 5), np.float32)
    noise = np.arange(20, dtype=np.float32)
    y, need = _run(model, x, noise)
    assert int(need) == 15
    np.testing.assert_array_equal(y, (noise[:15] * 3 + 2).reshape(1, 3, 5))


def test_short_noise_is_tiled_and_reported():
    """Too little noise still runs (tiled) and `need` tells the caller to redraw with enough."""
    from mizuoto_piper.noise import draw, make_seedable

    model = _graph()
    make_seedable(model)
    x = np.zeros((1, 3, 4), np.float32)
    y, need = _run(model, x, np.arange(5, dtype=np.float32))
    assert int(need) == 12 and y.shape == (1, 3, 4)
    np.testing.assert_array_equal(y.reshape(-1), np.tile(np.arange(5, dtype=np.float32), 3)[:12])
    a, b = draw(7, 0, 1, 12), draw(7, 0, 1, 12)
    assert np.array_equal(a, b) and not np.array_equal(a, draw(7, 1, 1, 12))
