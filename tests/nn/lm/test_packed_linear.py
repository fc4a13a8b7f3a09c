"""Packed linear layers (nn.lm.packed_linear): what a fixed-width batch needs of them."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from mizuoto.nn.lm import packed_linear
from mizuoto.nn.lm.packed_linear import BLOCK, PackedLinear, pack_linears, packing_available
from mizuoto.nn.lm.decoder import DecoderConfig, Decoder
from mizuoto.runtime.memory import tensor_bytes

CFG = DecoderConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=50)


def _decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CFG).eval()


@torch.inference_mode()
@pytest.mark.parametrize("rows", [2, 3, 4, 7, 8, 9, 13, 16])
def test_a_row_depends_neither_on_the_other_rows_nor_on_its_place(rows):
    """At any row count (also those that leave a partial panel of MKL's AVX2 kernel: 7-9, 13), on every CPU."""
    torch.manual_seed(rows)
    layer = PackedLinear(nn.Linear(96, 7 * BLOCK - 3))  # the last block zero-filled
    x = torch.randn(rows, 96)
    out = layer(x)
    for r in range(rows):
        other = torch.randn(rows, 96)
        other[(r + 1) % rows] = x[r]  # the same row, elsewhere, among other rows
        assert torch.equal(layer(other)[(r + 1) % rows], out[r])


@torch.inference_mode()
def test_packed_layers_compute_the_linear_map_in_the_same_bytes():
    dec = _decoder()
    dense_bytes = tensor_bytes([dec])
    x = torch.randn(4, 3, CFG.hidden_size)
    dense = [layer.mlp.down_proj(x.new_ones(4, 3, CFG.intermediate_size)) for layer in dec.layers]
    n = pack_linears(dec.layers)
    assert n == 7 * CFG.num_hidden_layers  # q, k, v, o, gate, up, down in each layer
    assert not any(isinstance(m, nn.Linear) for m in dec.layers.modules())
    assert tensor_bytes([dec]) == dense_bytes  # the packed weight replaces the dense one
    for layer, ref in zip(dec.layers, dense):
        got = layer.mlp.down_proj(x.new_ones(4, 3, CFG.intermediate_size))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # another kernel: not bit-equal
    q = dec.layers[0].self_attn.q_proj
    assert q.bias is not None and f"block={BLOCK}" in repr(q)
    assert pack_linears(dec.layers) == 0  # nothing left to pack


def test_only_float32_on_the_cpu_is_packed():
    assert packing_available(torch.zeros(BLOCK, 3))
    assert not packing_available(torch.zeros(BLOCK, 3, dtype=torch.float64))
    model = nn.Sequential(nn.Linear(4, BLOCK).double(), nn.Linear(4, BLOCK))
    assert pack_linears(model) == 1
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)


@torch.inference_mode()
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out", [8, 2 * BLOCK, 2 * BLOCK + 5])
def test_any_width_any_leading_shape_and_the_bias(out, bias):
    torch.manual_seed(out)
    dense = nn.Linear(24, out, bias=bias)
    layer = PackedLinear(dense)
    x = torch.randn(3, 5, 24)
    got = layer(x)
    assert got.shape == (3, 5, out) and got.is_contiguous()
    torch.testing.assert_close(got, dense(x), rtol=1e-5, atol=1e-6)  # another kernel: not bit-equal
    assert layer.packed.numel() == -(-out // BLOCK) * BLOCK * 24  # whole blocks, the last one zero-filled


def test_each_dense_layer_is_gone_before_its_memory_is_given_back(monkeypatch):
    dec = _decoder()
    dense = [weakref.ref(m) for m in dec.layers.modules() if isinstance(m, nn.Linear)]
    alive_at_each_trim = []
    monkeypatch.setattr(packed_linear, "_return_freed_memory",
                        lambda: alive_at_each_trim.append(sum(r() is not None for r in dense)))
    assert pack_linears(dec.layers) == len(dense)
    # one layer freed before each trim: the process never holds more than one dense copy extra
    assert alive_at_each_trim == list(range(len(dense) - 1, -1, -1))


_ON_MKL_AVX2 = """
import torch
from torch import nn
from mizuoto.nn.lm.packed_linear import PackedLinear
torch.set_num_threads(2)
bad = []
with torch.inference_mode():
    for rows in (7, 8, 9, 13):
        torch.manual_seed(rows)
        layer = PackedLinear(nn.Linear(200, 100))
        x = torch.randn(rows, 200)
        out = layer(x)
        for r in range(rows):
            other = torch.randn(rows, 200)
            other[(r + 1) % rows] = x[r]
            if not torch.equal(layer(other)[(r + 1) % rows], out[r]):
                bad.append((rows, r))
print(bad)
"""


def test_rows_are_place_invariant_on_mkls_avx2_kernels_too():
    """The same check with MKL capped to its AVX2 kernels (those it takes on an AVX2-only CPU), in a fresh process."""
    import subprocess
    import sys

    if not torch.cpu._is_avx2_supported():
        pytest.fail("no AVX2 on this CPU: MKL's AVX2 kernels cannot be run here")
    env = dict(__import__("os").environ, MKL_ENABLE_INSTRUCTIONS="AVX2")
    done = subprocess.run([sys.executable, "-c", _ON_MKL_AVX2], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"rows that depend on their place (rows, row): {done.stdout}"
