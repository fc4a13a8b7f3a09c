"""Packed linear layers (nn.lm.packed_linear): what a fixed-width batch needs of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mizuoto.nn.lm.packed_linear import PackedLinear, pack_linears, packing_available
from mizuoto.nn.lm.qwen import QwenConfig, QwenDecoder
from mizuoto.runtime.memory import tensor_bytes

CFG = QwenConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=50)

pytestmark = pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="this torch has no oneDNN")


def _decoder() -> QwenDecoder:
    torch.manual_seed(0)
    return QwenDecoder(CFG).eval()


@torch.inference_mode()
@pytest.mark.parametrize("rows", [2, 4, 8])
def test_a_row_depends_neither_on_the_other_rows_nor_on_its_place(rows):
    torch.manual_seed(rows)
    layer = PackedLinear(nn.Linear(96, 200), rows)
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
    n = pack_linears(dec.layers, 4)
    assert n == 7 * CFG.num_hidden_layers  # q, k, v, o, gate, up, down in each layer
    assert not any(isinstance(m, nn.Linear) for m in dec.layers.modules())
    assert tensor_bytes([dec]) == dense_bytes  # the packed weight replaces the dense one
    for layer, ref in zip(dec.layers, dense):
        got = layer.mlp.down_proj(x.new_ones(4, 3, CFG.intermediate_size))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # another kernel: not bit-equal
    q = dec.layers[0].self_attn.q_proj
    assert q.bias is not None and "rows=4" in repr(q)
    assert pack_linears(dec.layers, 4) == 0  # nothing left to pack


def test_only_float32_on_the_cpu_is_packed():
    assert not packing_available(torch.zeros(1, dtype=torch.float64))
    model = nn.Sequential(nn.Linear(4, 4).double(), nn.Linear(4, 4))
    assert pack_linears(model, 2) == 1
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)
