"""The working memory each CosyVoice stage declares, against numbers computed by hand.

LM: upstream's cap (a 300-position prompt, then 20 speech tokens per text token) times the
bytes one position holds, + 512 MiB. Qwen2 (v2/v3) keeps K and V at the real KV width in every
layer, and attention repeats one layer's K and V to the query-head width; the v1 TransformerLM
keeps K and V at its output size in every block.
"""

from __future__ import annotations

import json

from torch import nn

from mizuoto.engines.cosyvoice.memory import (ACTIVATION_FACTOR, ATTENTION_COPIES, FLOW_TOKENS_PER_TEXT_TOKEN,
                                              MEL_FRAMES_PER_TOKEN, SEGMENT_TEXT_TOKENS,
                                              qwen_lm_working_bytes, transformer_lm_working_bytes)
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.nn.lm.qwen import QwenConfig
from mizuoto.testing.fixtures import asset_path

MiB = 1024 ** 2
F32 = 4


def _hand_lm_bytes(variant_dir, text_tokens: int) -> int:
    """The LM formula written out from the directory's own files."""
    positions = 300 + 20 * text_tokens
    yaml = load_hyperyaml(next(variant_dir.glob("cosyvoice*.yaml")))
    if yaml["llm"].cls == "TransformerLM":
        llm = yaml["llm"]["llm"].kwargs
        per_position = int(llm["num_blocks"]) * 2 * int(llm["output_size"])
    else:
        cfg = json.loads((variant_dir / "CosyVoice-BlankEN" / "config.json").read_text())
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        per_position = (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim
                        + 2 * cfg["num_attention_heads"] * head_dim)
    return positions * per_position * F32 + 512 * MiB


def _widest(module: nn.Module) -> int:
    widths = [m.out_channels for m in module.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    return max(widths + [m.out_features for m in module.modules() if isinstance(m, nn.Linear)], default=1)


def test_fixture_stages_declare_the_formulas(runtime, variant_dir, clip):
    rt, names = runtime
    stages = {s.name: s for s in rt.model(names[variant_dir]).stages}
    assert set(stages) == {"frontend", "llm", "flow", "hift"}
    assert stages["frontend"].working_memory(None) == 0
    text = "Hello world, a test."
    request = SynthesisRequest(text, voice=Reference(str(clip)))
    # the planning bound: a segment of 100 text tokens; a request: its characters bound its tokens
    assert stages["llm"].working_memory(None) == _hand_lm_bytes(variant_dir, SEGMENT_TEXT_TOKENS)
    assert stages["llm"].working_memory(request) == _hand_lm_bytes(variant_dir, len(text))
    for name in ("flow", "hift"):
        width = max(_widest(m) for m in stages[name].modules.values())
        heads, copies = max(((m.heads, c) for mod in stages[name].modules.values() for m in mod.modules()
                             for k, c in ATTENTION_COPIES.items() if f"{type(m).__module__}.{type(m).__qualname__}" == k),
                            key=lambda hc: hc[0] * hc[1], default=(0, 0))
        assert (heads > 0) == (name == "flow")  # the flow attends over its frames; HiFT does not
        frames = MEL_FRAMES_PER_TOKEN * FLOW_TOKENS_PER_TEXT_TOKEN * SEGMENT_TEXT_TOKENS + 2 * 300
        want = 2 * width * frames * F32 * ACTIVATION_FACTOR + 2 * heads * copies * frames * frames * F32
        assert stages[name].working_memory(None) == want
        assert stages[name].working_memory(request) < stages[name].working_memory(None)
    # an unpunctuated text is one segment: the flow's figure grows with the square of its length
    one = SynthesisRequest("a" * 400, voice=Reference(str(clip)))
    two = SynthesisRequest("a" * 800, voice=Reference(str(clip)))
    assert stages["flow"].working_memory(two) > 3 * stages["flow"].working_memory(one)
    punctuated = SynthesisRequest("Hello there. " * 60, voice=Reference(str(clip)))
    assert stages["flow"].working_memory(punctuated) < stages["flow"].working_memory(one)


def test_released_cosyvoice2_and_3_lm():
    """CosyVoice2-0.5B / Fun-CosyVoice3-0.5B: Qwen2 0.5B, 24 layers, 14 heads of 64, 2 KV heads."""
    cfg = QwenConfig.from_json(asset_path("cosyvoice", "CosyVoice-BlankEN", "config.json"))
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 14, 2, 64)
    # per position: 24 layers x (K, V) x 2 KV heads x 64 = 6144 floats, + one layer repeated to
    # 14 heads: 2 x 14 x 64 = 1792 floats; 7936 floats = 31744 bytes
    assert qwen_lm_working_bytes(cfg, 100) == 2300 * 31744 + 536870912 == 609882112
    assert qwen_lm_working_bytes(cfg, 10) == 500 * 31744 + 536870912 == 552742912
    assert qwen_lm_working_bytes(cfg, 100, dtype_bytes=2) == 2300 * 15872 + 536870912
    for folder, yaml_name, cls in (("CosyVoice2-0.5B", "cosyvoice2.yaml", "Qwen2LM"),
                                   ("Fun-CosyVoice3-0.5B-2512", "cosyvoice3.yaml", "CosyVoice3LM")):
        assert load_hyperyaml(asset_path("cosyvoice", folder, yaml_name))["llm"].cls == cls


def test_released_cosyvoice1_lm():
    """CosyVoice-300M: TransformerLM over 14 blocks of width 1024."""
    llm = load_hyperyaml(asset_path("cosyvoice", "CosyVoice-300M", "cosyvoice.yaml"))["llm"]["llm"].kwargs
    assert (int(llm["num_blocks"]), int(llm["output_size"])) == (14, 1024)
    # per position: 14 blocks x (K, V) x 1024 = 28672 floats = 114688 bytes
    assert transformer_lm_working_bytes(14, 1024, 100) == 2300 * 114688 + 536870912 == 800653312
    assert transformer_lm_working_bytes(14, 1024, 1) == 320 * 114688 + 536870912


def test_static_cache_fits_the_declared_bound(runtime, qwen_lm_dir):
    """A static KV cache allocated for the planning bound is no larger than what the LM declares.

    Qwen2 LMs only: v1's wenet LM has no static cache (it grows its own), so it is not parametrized.
    """
    rt, names = runtime
    model = rt.model(names[qwen_lm_dir])
    lm = model.llm
    positions = 300 + 20 * SEGMENT_TEXT_TOKENS
    cache = lm.llm.new_cache("static", positions)
    layers, batch, kv_heads, max_len, head_dim = cache.shape
    assert max_len == positions and kv_heads == lm.llm.config.num_key_value_heads
    held = 2 * layers * batch * kv_heads * max_len * head_dim * F32  # K and V buffers
    assert held <= model.stage("llm").working_memory(None) - 512 * MiB
