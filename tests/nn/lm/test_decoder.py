"""The decoder in its Qwen2, Llama and GPT-2 configurations: caches agree bit for bit, decoding agrees with a
full forward, sizes from config.json, GPT-2's names mapped onto its own."""

import json
from pathlib import Path

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto.nn.lm.decoder import DecoderConfig, Decoder
from mizuoto.testing.fixtures import asset_path, fixtures_root


def _fixture_configs() -> list[Path]:
    found = sorted(fixtures_root().glob("cosyvoice/*/model/CosyVoice-BlankEN/config.json"))
    assert found, "no CosyVoice-BlankEN/config.json in the fixture model dirs"
    return found


def _random_decoder(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    model = Decoder(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _small(path: Path) -> DecoderConfig:
    # the fixture's sizes with a small vocabulary: the decoder never reads embed_tokens here
    d = json.loads(path.read_text())
    return DecoderConfig.from_dict(dict(d, vocab_size=64))


@pytest.mark.parametrize("path", _fixture_configs(), ids=lambda p: p.parts[-4])
def test_config_sizes(path):
    d = json.loads(path.read_text())
    cfg = DecoderConfig.from_json(path)
    assert cfg.hidden_size == d["hidden_size"] and cfg.num_hidden_layers == d["num_hidden_layers"]
    assert cfg.head_dim * cfg.num_attention_heads == d["hidden_size"]
    assert cfg.num_key_value_heads == d["num_key_value_heads"]
    model = Decoder(cfg)
    assert model.embed_tokens.weight.shape == (d["vocab_size"], d["hidden_size"])
    assert (model.lm_head is None) == d["tie_word_embeddings"]


def test_real_config_sizes():
    cfg = DecoderConfig.from_json(asset_path("cosyvoice", "CosyVoice-BlankEN", "config.json"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size) == (896, 24, 14, 2, 64, 4864)


def test_rope_frequencies_as_transformers():
    cfg = _small(_fixture_configs()[0])
    model = Decoder(cfg)
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
    model = Decoder(cfg).eval()
    cache = model.new_cache("static", max_len=4)
    with torch.inference_mode():
        model(torch.zeros(1, 4, cfg.hidden_size), cache)
        with pytest.raises(RuntimeError, match="overflow"):
            model(torch.zeros(1, 1, cfg.hidden_size), cache)


@pytest.mark.parametrize("bad", [{"hidden_act": "gelu"}, {"use_sliding_window": True},
                                 {"rope_scaling": {"type": "linear", "factor": 2.0}}, {"model_type": "mistral"}])
def test_unsupported_configs_are_refused(bad):
    d = json.loads(_fixture_configs()[0].read_text())
    with pytest.raises(ModelLoadError):
        DecoderConfig.from_dict(dict(d, **bad))
    d.pop("hidden_size")
    with pytest.raises(ModelLoadError, match="hidden_size"):
        DecoderConfig.from_dict(d)


def test_kv_bytes_per_position_hand_computed():
    real = DecoderConfig.from_json(asset_path("cosyvoice", "CosyVoice-BlankEN", "config.json"))
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

    from mizuoto.nn.lm.decoder import attend, repeat_kv

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


# Small configurations of each kind, in the transformers config formats they are read from
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 8, "head_dim": 16, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
         "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
GPT2 = {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 30,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
QWEN3 = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 12, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000.0, "attention_bias": False, "tie_word_embeddings": False}
KINDS = {"qwen2": None, "qwen3": QWEN3, "llama": LLAMA, "gpt2": GPT2}


def _config(kind: str) -> DecoderConfig:
    if KINDS[kind] is None:
        return _small(_fixture_configs()[0])
    return DecoderConfig.from_dict(KINDS[kind])


def test_qwen3_normalizes_each_heads_q_and_k_before_rope():
    """Qwen3: no q/k/v biases unless attention_bias, and a q_norm / k_norm over head_dim (head_dim given, here
    not hidden / heads) whose weights change the attention."""
    cfg = DecoderConfig.from_dict(QWEN3)
    assert (cfg.arch, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias, cfg.head_dim) == ("qwen3", True, False, False, 16)
    assert DecoderConfig.from_dict(dict(QWEN3, attention_bias=True)).qkv_bias
    model = _random_decoder(cfg, seed=3)
    attn = model.layers[0].self_attn
    assert attn.q_proj.bias is None and attn.q_norm.weight.shape == (16,) and attn.k_norm.weight.shape == (16,)
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= set(model.upstream_keys())
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        before = model(x, model.new_cache())
        attn.k_norm.weight.mul_(2.0)
        after = model(x, model.new_cache())
    assert not torch.equal(before, after)
    assert not _small(_fixture_configs()[0]).qk_norm  # Qwen2 has none


def test_llama_config_reads_biases_and_llama3_scaling():
    cfg = DecoderConfig.from_dict(dict(LLAMA, attention_bias=True, mlp_bias=True))
    assert (cfg.arch, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.head_dim) == ("llama", True, True, True, 16)
    assert cfg.rope_scaling == (8.0, 1.0, 4.0, 8192.0)
    model = Decoder(cfg)
    assert model.layers[0].self_attn.o_proj.bias is not None and model.layers[0].mlp.gate_proj.bias is not None
    assert Decoder(DecoderConfig.from_dict(LLAMA)).layers[0].self_attn.q_proj.bias is None


def test_llama3_scaling_keeps_short_wavelengths_divides_long_ones_and_blends_between():
    import math

    cfg = DecoderConfig.from_dict(LLAMA)
    plain = DecoderConfig.from_dict({k: v for k, v in LLAMA.items() if k != "rope_scaling"})
    base, scaled = Decoder(plain).inv_freq, Decoder(cfg).inv_freq
    factor, low, high, context = cfg.rope_scaling
    wavelen = 2 * math.pi / base
    short, long_ = wavelen < context / high, wavelen > context / low
    assert short.any() and long_.any() and (~short & ~long_).any(), "the sizes should reach all three bands"
    assert torch.equal(scaled[short], base[short])
    assert torch.equal(scaled[long_], base[long_] / factor)
    between = ~short & ~long_
    assert bool(((scaled[between] > base[between] / factor) & (scaled[between] < base[between])).all())


def test_unsupported_rope_scaling_and_gpt2_features_are_refused():
    with pytest.raises(ModelLoadError, match="rope_scaling"):
        DecoderConfig.from_dict(dict(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        DecoderConfig.from_dict(dict(LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    for bad in ({"activation_function": "relu"}, {"scale_attn_by_inverse_layer_idx": True},
                {"reorder_and_upcast_attn": True}, {"add_cross_attention": True}):
        with pytest.raises(ModelLoadError):
            DecoderConfig.from_dict(dict(GPT2, **bad))


def test_gpt2_names_map_onto_gpt2model_keys_one_to_one():
    from mizuoto.runtime.convert.checkpoint import DictSource, match_state_dict

    cfg = DecoderConfig.from_dict(GPT2)
    model = Decoder(cfg)
    assert model.lm_head is None and cfg.intermediate_size == 4 * 48
    keys = model.upstream_keys("tfmr.")
    hidden, inner = 48, 4 * 48
    # GPT2Model's state dict, written out: Conv1D weights are (in, out)
    upstream = {"tfmr.wte.weight": (30, hidden), "tfmr.wpe.weight": (64, hidden),
                "tfmr.ln_f.weight": (hidden,), "tfmr.ln_f.bias": (hidden,)}
    for i in range(2):
        h = f"tfmr.h.{i}."
        upstream.update({h + "ln_1.weight": (hidden,), h + "ln_1.bias": (hidden,), h + "ln_2.weight": (hidden,),
                         h + "ln_2.bias": (hidden,), h + "attn.c_attn.weight": (hidden, 3 * hidden),
                         h + "attn.c_attn.bias": (3 * hidden,), h + "attn.c_proj.weight": (hidden, hidden),
                         h + "attn.c_proj.bias": (hidden,), h + "mlp.c_fc.weight": (hidden, inner),
                         h + "mlp.c_fc.bias": (inner,), h + "mlp.c_proj.weight": (inner, hidden),
                         h + "mlp.c_proj.bias": (hidden,)})
    assert sorted(keys.values()) == sorted(upstream)
    g = torch.Generator().manual_seed(0)
    source = DictSource({k: torch.randn(shape, generator=g) for k, shape in upstream.items()})
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    matched = match_state_dict(source, keys, shapes, where="gpt2", target="a GPT-2 decoder")
    model.load_state_dict(matched)
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, source["tfmr.h.1.attn.c_attn.weight"])


def test_gpt2_adds_learned_positions_and_projects_as_conv1d():
    cfg = DecoderConfig.from_dict(GPT2)
    model = _random_decoder(cfg, seed=7)
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    layer = model.layers[0]
    with torch.inference_mode():
        h = layer.input_layernorm(x + model.embed_positions.weight[:5])
        q, k, v = model.layer_pre(0, x + model.embed_positions.weight[:5], None, None)
        fused = torch.addmm(layer.self_attn.qkv_proj.bias, h[0], layer.self_attn.qkv_proj.weight)
        assert torch.equal(q[0].transpose(0, 1).reshape(5, -1), fused[:, :48])
        assert torch.equal(v[0].transpose(0, 1).reshape(5, -1), fused[:, 96:])
        # a sequence shifted by one position is another sequence: the positions are in the output
        a = model(x, model.new_cache())
        cache = model.new_cache()
        model(x[:, :1], cache)
        b = model(x, cache)
    assert not torch.equal(a[:, 1:], b[:, :-1])


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_decodes_as_a_full_forward_and_caches_agree(kind):
    cfg = _config(kind)
    model = _random_decoder(cfg, seed=11)
    x = torch.randn(1, 30, cfg.hidden_size, generator=torch.Generator().manual_seed(12)) * 0.3
    with torch.inference_mode():
        full = model(x, model.new_cache())
        dyn, sta = model.new_cache("dynamic"), model.new_cache("static", max_len=30)
        parts = []
        for a, b in ((0, 20), *((i, i + 1) for i in range(20, 26)), (26, 30)):
            parts.append(model(x[:, a:b], dyn))
            assert torch.equal(parts[-1], model(x[:, a:b], sta))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_step_rows_is_each_rows_own_step(kind):
    cfg = _config(kind)
    model = _random_decoder(cfg, seed=13)
    g = torch.Generator().manual_seed(14)
    with torch.inference_mode():
        caches = []
        for n in (3, 7):  # rows at different positions
            cache = model.new_cache()
            model(torch.randn(1, n, cfg.hidden_size, generator=g), cache)
            caches.append(cache)
        x = torch.randn(2, 1, cfg.hidden_size, generator=g)
        alone = [model(x[r:r + 1], _copy(c)) for r, c in enumerate(caches)]
        rows = model.step_rows(x, caches)
    for r in range(2):
        torch.testing.assert_close(rows[r:r + 1], alone[r], rtol=1e-5, atol=1e-5)
    assert [c.length for c in caches] == [4, 8]


def _copy(cache):
    import copy

    return copy.deepcopy(cache)
