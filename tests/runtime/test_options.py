"""Load options: known keys in their spellings, bad values and unknown keys rejected."""

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.options import ComputeOptions, LoadOptions, parse_options


def test_defaults_and_spellings():
    assert parse_options() == LoadOptions("auto", "fp32", ComputeOptions("dynamic", False, False))
    want = LoadOptions("cpu", "fp16", ComputeOptions("static", True, True))
    assert parse_options(device="cpu", precision="fp16", compute={"kv_cache": "static", "cuda_graphs": True,
                                                                  "compile": "yes"}) == want
    assert parse_options({"compute.kv_cache": "static", "compute.cuda_graphs": "1", "compute.compile": "true"},
                         device="cpu", precision="fp16") == want
    assert parse_options(compute_kv_cache="static", compute_cuda_graphs=True, compute_compile=True,
                         device="cpu", precision="fp16") == want


@pytest.mark.parametrize("options,match", [
    ({"colour": "red"}, "unknown option 'colour'"),
    ({"compute.turbo": True}, "unknown option 'compute.turbo'"),
    ({"compute": {"kv": "static"}}, "unknown option 'compute.kv'"),
    ({"precision": "int8"}, "precision must be one of fp32, fp16"),
    ({"compute.kv_cache": "paged"}, "kv_cache must be one of dynamic, static"),
    ({"compute.cuda_graphs": "maybe"}, "cuda_graphs must be true or false"),
    ({"device": "gpu0"}, "not a device name"),
    ({"device": 0}, "device must be a string"),
])
def test_rejected(options, match):
    with pytest.raises(InvalidRequest, match=match):
        parse_options(options)


def test_resolved_device():
    assert parse_options(device="cpu").resolved().device == "cpu"
    auto = parse_options().resolved().device
    assert auto == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match="CUDA is not available"):
            parse_options(device="cuda:0").resolved()
