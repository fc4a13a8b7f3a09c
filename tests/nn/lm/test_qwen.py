"""Qwen2 decoder: caches agree bit for bit, decoding agrees with a full forward, sizes from config.json."""

import json
from pathlib import Path

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto.nn.lm.qwen import QwenConfig, QwenDecoder
from mizuoto.testing.fixtures import asset_path, fixtures_root


def _fixture_configs() -> list[Path]:
    found = sorted(fixtures_root().glob("cosyvoice/*/model/CosyVoice-BlankEN/config.json"))
    assert found, "no CosyVoice-BlankEN/config.json in the fixture model dirs"
    return found


def _random_decoder(cfg: QwenConfig, seed: int = 0) -> QwenDecoder:
    model = QwenDecoder(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _small(path: Path) -> QwenConfig:
    # the fixture's sizes with a small vocabulary: the decoder never reads embed_tokens here
    d = json.loads(path.read_text())
    return QwenConfig.from_dict(dict(d, vocab_size=64))


@pytest.mark.parametrize("path", _fixture_configs(), ids=lambda p: p.parts[-4])
def test_config_sizes(path):
    d = json.loads(path.read_text())
    cfg = QwenConfig.from_json(path)
    assert cfg.hidden_size == d["hidden_size"] and cfg.num_hidden_layers == d["num_hidden_layers"]
    assert cfg.head_dim * cfg.num_attention_heads == d["hidden_size"]
    assert cfg.num_key_value_heads == d["num_key_value_heads"]
    model = QwenDecoder(cfg)
    assert model.embed_tokens.weight.shape == (d["vocab_size"], d["hidden_size"])
    assert (model.lm_head is None) == d["tie_word_embeddings"]


def test_real_config_sizes():
    cfg = QwenConfig.from_json(asset_path("cosyvoice", "CosyVoice-BlankEN", "config.json"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size) == (896, 24, 14, 2, 64, 4864)


def test_rope_frequencies_as_transformers():
    cfg = _small(_fixture_configs()[0])
    model = QwenDecoder(cfg)
    steps = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float()
    assert torch.equal(model.inv_freq, 1.0 / (cfg.rope_theta ** (steps / cfg.head_dim)))
    cos, sin = model.rope(torch.arange(3)[None], torch.float32)
    assert cos.shape == (1, 3, cfg.head_dim)
    assert torch.equal(cos[0, 0], torch.ones(cfg.head_dim)) and torch.equal(sin[0, 0], torch.zeros(cfg.head_dim))


@pytest.mark.parametrize("path", _fixture_configs(), ids=lambda p: p.parts[-4])
@pytest.mark.parametrize("chunk", [1, 5])
def test_static_and_dynamic_caches_are_bit_identical(path, chunk):
    cfg = _small(path)
    model = _random_decoder(cfg)
    g = torch.Generator().manual_seed(1)
    dyn, sta = model.new_cache("dynamic"), model.new_cache("static", max_len=200)
    x = torch.randn(1, 23, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        for step in range(30):
            a, b = model(x, dyn), model(x, sta)
            assert torch.equal(a, b), f"step {step}"
            # every fourth step feeds several positions after a non-empty cache (bistream's case)
            n = chunk if step % 4 == 3 else 1
            x = torch.randn(1, n, cfg.hidden_size, generator=g)
    assert dyn.length == sta.length


def test_cached_decoding_matches_a_full_forward():
    cfg = _small(_fixture_configs()[0])
    model = _random_decoder(cfg, seed=3)
    x = torch.randn(1, 40, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = model(x, model.new_cache())
        cache = model.new_cache("static", max_len=40)
        parts = [model(x[:, :25], cache)] + [model(x[:, i:i + 1], cache) for i in range(25, 35)]
        parts.append(model(x[:, 35:], cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_static_cache_overflow_is_refused():
    cfg = _small(_fixture_configs()[0])
    model = QwenDecoder(cfg).eval()
    cache = model.new_cache("static", max_len=4)
    with torch.inference_mode():
        model(torch.zeros(1, 4, cfg.hidden_size), cache)
        with pytest.raises(RuntimeError, match="overflow"):
            model(torch.zeros(1, 1, cfg.hidden_size), cache)


@pytest.mark.parametrize("bad", [{"hidden_act": "gelu"}, {"use_sliding_window": True},
                                 {"rope_scaling": {"type": "linear", "factor": 2.0}}, {"model_type": "llama"}])
def test_unsupported_configs_are_refused(bad):
    d = json.loads(_fixture_configs()[0].read_text())
    with pytest.raises(ModelLoadError):
        QwenConfig.from_dict(dict(d, **bad))
    d.pop("hidden_size")
    with pytest.raises(ModelLoadError, match="hidden_size"):
        QwenConfig.from_dict(d)


def test_kv_bytes_per_position_hand_computed():
    real = QwenConfig.from_json(asset_path("cosyvoice", "CosyVoice-BlankEN", "config.json"))
    # 24 layers x (K + V) x 14 heads x 64 dims x 4 bytes = 172032 bytes per position, repeated
    assert real.kv_bytes_per_position(4, repeated=True) == 172_032
    assert real.kv_bytes_per_position(4, repeated=False) == 24 * 2 * 2 * 64 * 4


def test_caches_agree_under_autocast():
    cfg = _small(_fixture_configs()[0])
    model = _random_decoder(cfg, seed=5)
    x = torch.randn(1, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        dyn, sta = model.new_cache("dynamic"), model.new_cache("static", max_len=16)
        a = [model(x, dyn), model(x[:, :1], dyn)]
        b = [model(x, sta), model(x[:, :1], sta)]
    assert (sta.k.dtype, sta.v.dtype) == (torch.float32, torch.bfloat16)  # RoPE promotes keys
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_attend_matches_attention_over_repeated_heads_with_and_without_autograd():
    """`attend` skips the repeat at CPU inference (SDPA's own GQA); forward and gradients must stay transformers'."""
    import torch.nn.functional as F

    from mizuoto.nn.lm.qwen import attend, repeat_kv

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 37, 16, generator=g) for h in (6, 2, 2))

    def reference(q, k, v):
        out = F.scaled_dot_product_attention(q, repeat_kv(k, 3).contiguous(), repeat_kv(v, 3).contiguous(),
                                             scale=0.25, is_causal=True)
        return out.transpose(1, 2).contiguous()

    with torch.inference_mode():
        assert torch.equal(attend(q, k, v, 3, 0.25, None), reference(q, k, v))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    twins = [t.clone().requires_grad_() for t in (q, k, v)]
    out, ref = attend(*leaves, 3, 0.25, None), reference(*twins)
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, twins, grad)):
        assert torch.equal(a, b)  # SDPA's own GQA would sum the K/V gradients in another order
