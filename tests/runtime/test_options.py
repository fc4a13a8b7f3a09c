"""Load options: known keys in their spellings, bad values and unknown keys rejected."""

import argparse

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.options import (ComputeOptions, LoadOptions, add_load_arguments, options_from_args,
                                     parse_options)


def test_defaults_and_spellings():
    assert parse_options() == LoadOptions("auto", "fp32", ComputeOptions("dynamic", False, False))
    want = LoadOptions("cpu", "fp16", ComputeOptions("static", True, True))
    assert parse_options(device="cpu", precision="fp16", compute={"kv_cache": "static", "cuda_graphs": True,
                                                                  "compile": "yes"}) == want
    assert parse_options({"compute.kv_cache": "static", "compute.cuda_graphs": "1", "compute.compile": "true"},
                         device="cpu", precision="fp16") == want
    assert parse_options(compute_kv_cache="static", compute_cuda_graphs=True, compute_compile=True,
                         device="cpu", precision="fp16") == want


def test_the_kv_cache_is_static_for_a_batched_model_unless_named():
    # auto: a batched model's rows take caches allocated once (their figure holds: docs/memory.md)
    assert parse_options().compute.kv_cache == "dynamic"
    assert parse_options({"compute.batch": 8}).compute.kv_cache == "static"
    assert parse_options({"compute.batch": "2", "compute.kv_cache": "auto"}).compute.kv_cache == "static"
    assert parse_options({"compute.batch": 8, "compute.kv_cache": "dynamic"}).compute.kv_cache == "dynamic"
    assert parse_options({"compute.batch": 1, "compute.kv_cache": "static"}).compute.kv_cache == "static"
    # resolved once: the options round-trip as the engine sees them
    options = parse_options({"compute.batch": 8})
    assert parse_options(**options.as_dict()) == options


@pytest.mark.parametrize("options,match", [
    ({"colour": "red"}, "unknown option 'colour'"),
    ({"compute.turbo": True}, "unknown option 'compute.turbo'"),
    ({"compute": {"kv": "static"}}, "unknown option 'compute.kv'"),
    ({"precision": "int8"}, "precision must be one of fp32, fp16"),
    ({"compute.kv_cache": "paged"}, "kv_cache must be one of auto, dynamic, static"),
    ({"compute.cuda_graphs": "maybe"}, "cuda_graphs must be true or false"),
    ({"compute.reference": "approximate"}, "reference must be one of exact, fast"),
    ({"device": "gpu0"}, "not a device name"),
    ({"device": 0}, "device must be a string"),
])
def test_rejected(options, match):
    with pytest.raises(InvalidRequest, match=match):
        parse_options(options)


def test_reference_analysis_is_exact_unless_asked_fast():
    assert parse_options().compute.reference == "exact"
    assert parse_options({"compute.reference": "fast"}).compute.reference == "fast"
    assert parse_options(compute={"reference": "fast"}).as_dict()["compute"]["reference"] == "fast"


def test_resolved_device():
    assert parse_options(device="cpu").resolved().device == "cpu"
    auto = parse_options().resolved().device
    assert auto == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match="CUDA is not available"):
            parse_options(device="cuda:0").resolved()


def _parsed(argv, environ=None):
    parser = argparse.ArgumentParser()
    add_load_arguments(parser, environ)
    return parser.parse_args(argv)


def test_the_command_line_parser():
    assert options_from_args(_parsed([])) == LoadOptions()
    args = _parsed(["--option", "compute.kv_cache=static", "--option", "device=cpu", "--device", "meta",
                    "--precision", "fp16", "--option", " compute.compile = on "])
    assert options_from_args(args) == LoadOptions("meta", "fp16", ComputeOptions("static", False, True))  # flags win
    with pytest.raises(InvalidRequest, match="--option takes KEY=VALUE, got 'kv_cache'"):
        options_from_args(_parsed(["--option", "kv_cache"]))
    with pytest.raises(InvalidRequest, match="unknown option 'colour'"):
        options_from_args(_parsed(["--option", "colour=red"]))


def test_the_parser_reads_defaults_from_the_environment_when_asked():
    environ = {"MIZUOTO_DEVICE": "cpu", "MIZUOTO_PRECISION": "fp16", "MIZUOTO_OPTIONS": "compute.kv_cache=static"}
    assert options_from_args(_parsed([], environ)) == LoadOptions("cpu", "fp16", ComputeOptions("static"))
    args = _parsed(["--device", "meta", "--option", "compute.compile=1"], environ)
    assert options_from_args(args) == LoadOptions("meta", "fp16", ComputeOptions("static", False, True))
    assert options_from_args(_parsed([])) == LoadOptions()  # without environ, the environment is not read


def test_as_dict_round_trips():
    options = LoadOptions("cpu", "fp16", ComputeOptions("static", True, False))
    assert parse_options(**options.as_dict()) == options
