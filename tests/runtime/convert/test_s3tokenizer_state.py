"""The speech tokenizer from the s3tokenizer package's PyTorch layout: every key matched, a foreign dict refused."""

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto.runtime.convert.s3tokenizer import s3tokenizer_from_state


def _package_state(prefix: str = "tokenizer.") -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = {"encoder.conv1.weight": (32, 16, 3), "encoder.conv1.bias": (32,), "encoder.conv2.weight": (32, 32, 3),
              "encoder.conv2.bias": (32,), "quantizer._codebook.project_down.weight": (8, 32),
              "quantizer._codebook.project_down.bias": (8,), "_mel_filters": (16, 201), "window": (400,)}
    for i in range(2):
        b = f"encoder.blocks.{i}."
        shapes.update({b + "attn.query.weight": (32, 32), b + "attn.query.bias": (32,), b + "attn.key.weight": (32, 32),
                       b + "attn.value.weight": (32, 32), b + "attn.value.bias": (32,), b + "attn.out.weight": (32, 32),
                       b + "attn.out.bias": (32,), b + "attn.fsmn_block.weight": (32, 1, 31),
                       b + "attn_ln.weight": (32,), b + "attn_ln.bias": (32,), b + "mlp_ln.weight": (32,),
                       b + "mlp_ln.bias": (32,), b + "mlp.0.weight": (128, 32), b + "mlp.0.bias": (128,),
                       b + "mlp.2.weight": (32, 128), b + "mlp.2.bias": (32,)})
    return {prefix + k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_every_tensor_lands_where_the_package_keeps_it():
    state = _package_state()
    model = s3tokenizer_from_state(state, prefix="tokenizer.", n_head=1, where="test")
    assert len(model.blocks) == 2 and model.conv1.in_channels == 16 and model.project.out_features == 8
    assert torch.equal(model.blocks[1].attn.fsmn.weight, state["tokenizer.encoder.blocks.1.attn.fsmn_block.weight"])
    assert torch.equal(model.project.bias, state["tokenizer.quantizer._codebook.project_down.bias"])
    tokens, lengths = model(torch.randn(1, 16, 40), torch.tensor([40]))
    assert tokens.shape == (1, 10) and int(lengths[0]) == 10 and int(tokens.max()) < 3 ** 8


def test_a_missing_or_extra_tensor_is_named():
    state = _package_state()
    del state["tokenizer.encoder.blocks.0.attn.out.bias"]
    with pytest.raises(ModelLoadError, match="attn.out.bias"):
        s3tokenizer_from_state(state, prefix="tokenizer.", n_head=1, where="test")
    state = _package_state()
    state["tokenizer.encoder.extra"] = torch.zeros(1)
    with pytest.raises(ModelLoadError, match="encoder.extra"):
        s3tokenizer_from_state(state, prefix="tokenizer.", n_head=1, where="test")
