"""The working memory each CosyVoice stage declares: its call figures and what a request is admitted with.

The LM is admitted on its bound: its KV cache at upstream's cap (a 300-position prompt, then the
segment's text and 20 speech tokens per text token), counted with the model's own tokenizer. The
flow and the vocoder are admitted with what upstream's LM certainly makes them run on (2 speech
tokens per text token; nothing on CosyVoice 3, which drops silent runs after its LM) and reserve
each call's own figure when it runs (test_memory_calls.py measures those figures).
"""

from __future__ import annotations

import json

import pytest

from mizuoto.engines.cosyvoice.memory import (BOUND_TEXT_TOKENS, LM_CACHE_COPIES, STATIC_CACHE_COPIES,
                                              WENET_CACHE_COPIES, LmMemory, admission)
from mizuoto.nn.flow.memory import FlowMemory
from mizuoto.nn.memory import FIXED_BYTES, HEAP_PACKING_BYTES
from mizuoto.nn.vocoders.memory import HIFT_FIXED_BYTES, HiftMemory
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.fixtures import asset_path

F32 = 4


def _kv_bytes_per_position(variant_dir) -> int:
    """K and V of every layer for one position, from the directory's own files."""
    yaml = load_hyperyaml(next(variant_dir.glob("cosyvoice*.yaml")))
    if yaml["llm"].cls == "TransformerLM":
        llm = yaml["llm"]["llm"].kwargs
        return int(llm["num_blocks"]) * 2 * int(llm["output_size"]) * F32
    cfg = json.loads((variant_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * F32


def test_the_lm_is_admitted_on_its_bound_counted_with_the_models_tokenizer(runtime, variant_dir, clip):
    rt, names = runtime
    model = rt.model(names[variant_dir])
    llm = model.stage("llm")
    text = "Hello world, a test."
    tokens = max(model._segment_tokens(text))
    assert 0 < tokens < len(text)  # tokens, not characters
    per_position = _kv_bytes_per_position(variant_dir)
    request = SynthesisRequest(text, voice=Reference(str(clip)))
    assert llm.working_memory(request) == llm.call_working(positions=300 + 21 * tokens, prefill=300 + tokens)
    # the cache is the figure's largest part, at every length: held 1.5 times while it grows (Qwen2's,
    # grown by concatenation in fragmenting arenas), over three times for v1's wenet cache (rebuilt per
    # block each step, then stacked)
    copies = LM_CACHE_COPIES if model.variant.version > 1 else WENET_CACHE_COPIES
    assert copies >= (1.5 if model.variant.version > 1 else 3)
    for positions in (100, 1000, 10000):
        figure = llm.call_working(positions=positions)
        assert per_position * positions < figure - FIXED_BYTES <= copies * per_position * positions + (1 << 20)
    assert llm.call_working(positions=1000, rows=8) > 7 * (llm.call_working(positions=1000) - FIXED_BYTES)


def test_a_static_cache_is_counted_once_with_its_attention_copies_and_streamed_text_as_grown(runtime, variant_dir,
                                                                                             clip):
    rt, names = runtime
    model = rt.model(names[variant_dir])
    per_position = _kv_bytes_per_position(variant_dir)
    dynamic, static = LmMemory(model.llm), LmMemory(model.llm, static=True)
    if model.variant.version == 1:  # the wenet LM keeps its own cache whatever the option says
        assert static(1000, rows=8) == dynamic(1000, rows=8)
        return
    assert 1 < STATIC_CACHE_COPIES < LM_CACHE_COPIES
    for positions, rows in ((100, 1), (1000, 1), (1000, 8)):
        saved = dynamic(positions, rows=rows) - static(positions, rows=rows)
        assert saved == pytest.approx((LM_CACHE_COPIES - STATIC_CACHE_COPIES) * rows * per_position * positions, abs=2)
        assert static(positions, rows=rows, grown=True) == dynamic(positions, rows=rows)
    # text streamed in grows a dynamic cache on any model: admitted as grown; a whole text as the model's kind
    assert static.bound(50, grown=True) == dynamic.bound(50) > static.bound(50)
    admitted = admission(static, FlowMemory(model.flow), HiftMemory(model.hift), model._segment_tokens,
                         model.variant.version, model.schedule_mel_frames)["llm"]
    text = "Hello world, a test."
    tokens = max(model._segment_tokens(text))
    assert admitted(SynthesisRequest(text, voice=Reference(str(clip)))) == static.bound(tokens)
    streamed = SynthesisRequest(iter([text]), voice=Reference(str(clip)))
    assert admitted(streamed) == admitted(None) == static.bound(BOUND_TEXT_TOKENS, grown=True)


def test_the_flow_and_vocoder_are_admitted_with_what_the_lm_certainly_makes(runtime, variant_dir, clip):
    rt, names = runtime
    model = rt.model(names[variant_dir])
    flow, hift = model.stage("flow"), model.stage("hift")
    request = SynthesisRequest("a b c " * 40, voice=Reference(str(clip)))
    least = 0 if model.variant.version == 3 else 2 * max(model._segment_tokens(request.text))
    frames = model.schedule_mel_frames(least)
    assert flow.working_memory(request) == flow.call_working(tokens=least, frames=frames)
    assert hift.working_memory(request) == hift.call_working(frames=frames)
    # the planning figure (no request) is the least of any request: nothing certain but the heap's allowance
    assert flow.working_memory(None) == flow.call_working(tokens=0, frames=0) < (8 << 20) + HEAP_PACKING_BYTES
    # every call's figure carries the allowance for the heap's packing, however small the call
    for stage, sizes in (("llm", {"positions": 1}), ("flow", {"tokens": 1, "frames": 1}), ("hift", {"frames": 1})):
        assert model.stage(stage).call_working(**sizes) > HEAP_PACKING_BYTES
    longer = SynthesisRequest("a b c " * 80, voice=Reference(str(clip)))
    assert (flow.working_memory(longer) > flow.working_memory(request)) == (model.variant.version < 3)


def test_a_flow_call_grows_with_the_square_of_its_frames_and_a_vocoder_call_with_its_samples(runtime, variant_dir):
    rt, names = runtime
    model = rt.model(names[variant_dir])
    flow, hift = model.stage("flow"), model.stage("hift")
    one, two = flow.call_working(tokens=500, frames=1000), flow.call_working(tokens=1000, frames=2000)
    assert 2 * (one - FIXED_BYTES) < two - FIXED_BYTES <= 4 * (one - FIXED_BYTES)  # more than linear
    figure = HiftMemory(model.hift)
    per_frame = (hift.call_working(frames=2000) - hift.call_working(frames=1000)) / 1000
    assert per_frame > 0 and per_frame == pytest.approx((hift.call_working(frames=1000) - figure.fixed) / 1000, abs=1)
    assert figure.fixed >= HIFT_FIXED_BYTES and figure.per_sample * figure.samples_per_frame == pytest.approx(per_frame, abs=1)


def test_the_released_models_flow_attention():
    """The flow figures read their sizes from the modules: the released CosyVoice 2 flow's encoder
    attends with 8 heads before and after its upsampling, its U-Net with 8 heads."""
    from mizuoto.engines.cosyvoice.flow import build_flow
    from mizuoto.engines.cosyvoice.variants import find_variant, load_config

    folder = asset_path("cosyvoice", "CosyVoice2-0.5B", "cosyvoice2.yaml").parent
    figure = FlowMemory(build_flow(load_config(folder, find_variant(folder))))
    assert figure.encoder_sites == [("tokens", 8), ("frames", 8)] and figure.kind == "unet"

