"""ONNX -> state_dict conversion: the asserted key map, the cache and its failure modes."""

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file, save_file

import mizuoto.runtime.assets as assets
import mizuoto.runtime.convert.onnx as conv
from mizuoto.errors import ModelLoadError


def _write_model(path: Path, scale: float = 1.0) -> None:
    """A tiny graph y = x @ W + b, with a Constant-node vector c feeding a Mul."""
    w = numpy_helper.from_array((np.arange(12, dtype=np.float32).reshape(3, 4) * scale), "onnx::MatMul_7")
    b = numpy_helper.from_array(np.ones(4, dtype=np.float32), "lin.bias")
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
        np.full(4, 2.0, dtype=np.float32)))
    nodes = [helper.make_node("MatMul", ["x", "onnx::MatMul_7"], ["h"], name="/lin/MatMul"),
             helper.make_node("Add", ["lin.bias", "h"], ["a"], name="/lin/Add"),
             const, helper.make_node("Mul", ["a", "c"], ["y"], name="/scale/Mul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w, b])
    onnx.save(helper.make_model(graph), str(path))


class Lin(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        self.register_buffer("scale", torch.zeros(n_out))


def _convert(g: conv.OnnxGraph):
    n_in, n_out = g.shape(g.node("/lin/MatMul").input[1])
    config = {"n_in": n_in, "n_out": n_out}
    key_map = {"lin.weight": conv.Src("onnx::MatMul_7", transpose=True), "lin.bias": conv.Src("lin.bias"),
               "scale": conv.Src(g.tensor_inputs(g.node("/scale/Mul"))[0])}
    shapes = {k: v.shape for k, v in Lin(**config).state_dict().items()}
    return config, conv.extract_state_dict(g, key_map, shapes)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model" / "tiny.onnx"
    path.parent.mkdir()
    _write_model(path)
    return path


@pytest.fixture
def parses(monkeypatch):
    calls = []
    real = conv._parse_onnx

    def counting(path, progress):
        calls.append(path)
        return real(path, progress)

    monkeypatch.setattr(conv, "_parse_onnx", counting)
    return calls


def _cache_files(model_dir: Path) -> list[Path]:
    return sorted((model_dir / ".mizuoto").glob("converted-*.safetensors"))


def test_key_map_transposes_and_reads_folded_constants(model):
    config, sd = _convert(conv.load_graph(model))
    assert config == {"n_in": 3, "n_out": 4}
    assert torch.equal(sd["lin.weight"], torch.arange(12.0).reshape(3, 4).t())
    assert torch.equal(sd["scale"], torch.full((4,), 2.0))


def test_converts_once_then_reads_the_cache(model, parses):
    first = conv.load_converted(model, _convert, "tiny-1")
    second = conv.load_converted(model, _convert, "tiny-1")
    assert len(parses) == 1
    assert first[0] == second[0]
    assert all(torch.equal(first[1][k], second[1][k]) for k in first[1])
    files = _cache_files(model.parent)
    assert len(files) == 1 and files[0].name.startswith("converted-")


def test_changed_onnx_bytes_or_layout_change_the_key(model, parses):
    key = conv.cache_key(model, "tiny-1")
    assert conv.cache_key(model, "tiny-2") != key
    conv.load_converted(model, _convert, "tiny-1")
    _write_model(model, scale=3.0)
    assert conv.cache_key(model, "tiny-1") != key
    _, sd = conv.load_converted(model, _convert, "tiny-1")
    assert len(parses) == 2
    assert torch.equal(sd["lin.weight"], (torch.arange(12.0).reshape(3, 4) * 3).t())
    assert len(_cache_files(model.parent)) == 2


def test_safetensors_beside_the_onnx_file_wins(model, parses):
    mine = {"lin.weight": torch.full((4, 3), 7.0), "lin.bias": torch.zeros(4), "scale": torch.ones(4)}
    save_file(mine, str(model.with_suffix(".safetensors")), metadata={"mizuoto.config": '{"n_in": 3, "n_out": 4}'})
    config, sd = conv.load_converted(model, _convert, "tiny-1")
    assert config == {"n_in": 3, "n_out": 4} and torch.equal(sd["lin.weight"], mine["lin.weight"])
    assert parses == [] and _cache_files(model.parent) == []
    # without sizes in its metadata, the sizes come from the graph; the weights still from the file
    save_file(mine, str(model.with_suffix(".safetensors")))
    config, sd = conv.load_converted(model, _convert, "tiny-1")
    assert config == {"n_in": 3, "n_out": 4} and torch.equal(sd["lin.weight"], mine["lin.weight"])


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-9])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00garbage" * 50)


def _flip_a_weight(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def _foreign(path: Path) -> None:
    save_file({"lin.weight": torch.zeros(4, 3)}, str(path))


@pytest.mark.parametrize("damage", [_truncate, _garbage, _flip_a_weight, _foreign])
def test_a_damaged_or_foreign_cache_file_is_rebuilt(model, parses, damage):
    _, good = conv.load_converted(model, _convert, "tiny-1")
    (cached,) = _cache_files(model.parent)
    damage(cached)
    _, again = conv.load_converted(model, _convert, "tiny-1")
    assert len(parses) == 2
    assert all(torch.equal(good[k], again[k]) for k in good)
    assert torch.equal(load_file(str(cached))["lin.weight"], good["lin.weight"])
    conv.load_converted(model, _convert, "tiny-1")
    assert len(parses) == 2


@pytest.mark.parametrize("damage", [_truncate, _garbage])
def test_a_corrupt_onnx_file_is_an_error_naming_it(model, damage):
    damage(model)
    with pytest.raises(ModelLoadError, match=str(model)):
        conv.load_converted(model, _convert, "tiny-1")
    assert _cache_files(model.parent) == []


def test_a_failed_conversion_leaves_no_file(model):
    def broken(g):
        raise ModelLoadError("no")

    with pytest.raises(ModelLoadError):
        conv.load_converted(model, broken, "tiny-1")
    assert list((model.parent / ".mizuoto").glob("*")) == []


def test_a_read_only_model_dir_falls_back_to_mizuoto_home(model, tmp_path, monkeypatch, parses):
    home = tmp_path / "home"
    monkeypatch.setenv("MIZUOTO_HOME", str(home))
    model_dir = model.parent.resolve()
    model_dir.chmod(0o555)
    if os.geteuid() == 0:  # root ignores permission bits: make the check see what a user would
        real_access = os.access
        monkeypatch.setattr(assets.os, "access", lambda p, mode: False if (
            mode & os.W_OK and Path(p).resolve().is_relative_to(model_dir)) else real_access(p, mode))
    try:
        conv.load_converted(model, _convert, "tiny-1")
        conv.load_converted(model, _convert, "tiny-1")
    finally:
        model_dir.chmod(0o755)
    files = list(home.rglob("converted-*.safetensors"))
    assert len(files) == 1 and len(parses) == 1
    assert not list(model_dir.glob(".mizuoto/converted-*"))


def test_progress_is_reported(model):
    stages = []
    conv.load_converted(model, _convert, "tiny-1", progress=lambda s, d, t: stages.append(s))
    assert {"hash", "parse", "write"} <= set(stages)


def _extract(g, key_map, shapes=None):
    shapes = shapes or {"lin.weight": (4, 3), "lin.bias": (4,), "scale": (4,)}
    return conv.extract_state_dict(g, key_map, shapes)


def test_the_key_map_is_asserted(model):
    g = conv.load_graph(model)
    c = g.tensor_inputs(g.node("/scale/Mul"))[0]
    good = {"lin.weight": conv.Src("onnx::MatMul_7", True), "lin.bias": conv.Src("lin.bias"), "scale": conv.Src(c)}
    _extract(g, good)
    with pytest.raises(ModelLoadError, match="no source for scale"):
        _extract(g, {k: v for k, v in good.items() if k != "scale"})
    with pytest.raises(ModelLoadError, match=r"onnx::MatMul_7 has shape \(\d+, \d+\), expected \(\d+, \d+\) for lin.weight"):
        _extract(g, {**good, "lin.weight": conv.Src("onnx::MatMul_7")})
    with pytest.raises(ModelLoadError, match="mapped twice"):
        _extract(g, {**good, "scale": conv.Src("lin.bias")})
    with pytest.raises(ModelLoadError, match="unexpected keys: lin.bias"):
        _extract(g, {"lin.weight": good["lin.weight"], "lin.bias": conv.Src(c)},
                 {"lin.weight": (4, 3), "lin.bias": (4,)})
    with pytest.raises(ModelLoadError, match="missing keys: nope"):
        _extract(g, {**good, "scale": conv.Src("nope")})


def test_stderr_progress_reports_large_files_only(capsys):
    conv.stderr_progress("hash", 1, 10)
    assert capsys.readouterr().err == ""
    conv.stderr_progress("hash", 128 << 20, 128 << 20)
    assert "128/128 MiB" in capsys.readouterr().err


def test_weights_that_do_not_fit_name_their_file(model):
    beside = model.with_suffix(".safetensors")
    save_file({"lin.weight": torch.zeros(4, 3)}, str(beside))
    _, sd = conv.load_converted(model, _convert, "tiny-1")
    with pytest.raises(ModelLoadError, match=str(beside)):
        conv.load_into(Lin(3, 4), sd, model)
