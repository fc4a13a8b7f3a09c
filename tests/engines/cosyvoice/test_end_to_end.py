"""Whole requests through the public Runtime API on assembled model dirs: every mode, every stage.

Random weights: the checks are shapes, determinism for a seed and which stages ran, not
intelligibility. Which stages ran is seen by forward hooks on each declared stage's modules.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing import variation

TEXT = variation.text("Hello world, this is a short test.")
REF_TEXT = "A short reference sentence."
INSTRUCT = "Speak slowly and calmly."


@contextlib.contextmanager
def stages_run(model):
    """Yield a set that collects the names of the stages whose modules ran a forward pass."""
    ran: set[str] = set()
    handles = []
    for stage in model.stages:
        for module in stage.modules.values():
            for sub in module.modules():
                handles.append(sub.register_forward_hook(lambda *_, name=stage.name: ran.add(name)))
    try:
        yield ran
    finally:
        for h in handles:
            h.remove()


def hop_samples(variant_dir: Path) -> int:
    """Output samples per mel frame, from the yaml: HiFT's upsampling times its iSTFT hop."""
    yaml = next(variant_dir.glob("cosyvoice*.yaml"))
    hift = load_hyperyaml(yaml)["hift"].kwargs
    return math.prod(hift["upsample_rates"]) * int(hift["istft_params"]["hop_len"])


def run(rt, name, request):
    chunks = list(rt.synthesize(name, request))
    for i, c in enumerate(chunks):
        assert c.index == i and c.final == (i == len(chunks) - 1)
        assert c.samples.dtype == torch.float32 and c.samples.dim() == 1
        assert torch.isfinite(c.samples).all()
    return chunks


def one(rt, name, request) -> torch.Tensor:
    chunks = run(rt, name, request)
    assert len(chunks) == 1, f"a non-streaming request gave {len(chunks)} chunks"
    assert chunks[0].samples.numel() > 0
    return chunks[0].samples


def test_clone_runs_every_stage_and_is_deterministic(runtime, variant_dir, clip):
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    yaml = next(variant_dir.glob("cosyvoice*.yaml"))
    assert model.capabilities.sample_rate == int(load_hyperyaml(yaml)["sample_rate"])
    request = SynthesisRequest(TEXT, voice=Reference(str(clip), REF_TEXT), seed=variation.seed(7))
    with stages_run(model) as ran:
        first = one(rt, name, request)
    assert ran == {s.name for s in model.stages}, f"stages that ran: {sorted(ran)}"
    assert first.numel() % hop_samples(variant_dir) == 0
    assert first.abs().max() > 0
    assert torch.equal(first, one(rt, name, request)), "same seed, different audio"
    other = one(rt, name, SynthesisRequest(TEXT, voice=Reference(str(clip), REF_TEXT), seed=variation.seed(8)))
    assert not (other.shape == first.shape and torch.equal(other, first)), "another seed gave the same audio"


def test_cross_lingual_and_speed(runtime, variant_dir, clip):
    rt, names = runtime
    name = names[variant_dir]
    request = SynthesisRequest(TEXT, voice=Reference(str(clip)), seed=variation.seed(3))
    assert request.mode is None  # inferred: no reference text -> cross_lingual
    audio = one(rt, name, request)
    fast = one(rt, name, SynthesisRequest(TEXT, mode="cross_lingual", voice=Reference(str(clip)), seed=variation.seed(3),
                                          speed=2.0))
    hop = hop_samples(variant_dir)
    # speed interpolates the same mel to int(frames / speed) frames (same seed: same tokens)
    assert fast.numel() == int(audio.numel() // hop / 2.0) * hop


def test_instruct_with_a_reference(runtime, variant_dir, clip):
    """v2/v3 instruct2 takes a reference voice; v1's instruct refuses one: it needs a preset speaker."""
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    request = SynthesisRequest(TEXT, voice=Reference(str(clip)), instruct=INSTRUCT, seed=variation.seed(5))
    if model.variant.instruct_mode != "instruct2":
        with pytest.raises(InvalidRequest, match="preset"):
            list(rt.synthesize(name, request))
        return
    with stages_run(model) as ran:
        audio = one(rt, name, request)
    assert ran == {s.name for s in model.stages}
    assert torch.equal(audio, one(rt, name, request))


def test_preset_and_preset_instruct_skip_the_front_end(runtime, preset_dir):
    rt, names = runtime
    name = names[preset_dir]
    model = rt.model(name)
    presets = [v.id for v in rt.voices(name) if v.kind == "preset"]
    assert presets and "preset" in model.capabilities.modes
    for request in (SynthesisRequest(TEXT, voice=presets[0], seed=variation.seed(2)),
                    SynthesisRequest(TEXT, voice=presets[-1], instruct=INSTRUCT, seed=variation.seed(2))):
        with stages_run(model) as ran:
            audio = one(rt, name, request)
        assert "frontend" not in ran and {"llm", "flow", "hift"} <= ran
        assert torch.equal(audio, one(rt, name, request))


def test_voice_conversion_runs_no_lm(runtime, variant_dir, clip):
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    source = next(p for p in sorted(clip.parent.glob("*.wav")) if p != clip)
    request = SynthesisRequest(voice=Reference(str(clip)), source_audio=str(source), seed=variation.seed(4))
    with stages_run(model) as ran:
        audio = one(rt, name, request)
    assert ran == {"frontend", "flow", "hift"}, f"stages that ran: {sorted(ran)}"
    source_tokens = model.frontend.speech_tokens(str(source)).shape[1]
    if model.variant.version >= 2:
        # two mel frames per token, prompt and source, less the whole reference mel upstream's
        # frontend_vc keeps (not cut to two frames per prompt token)
        prompt_tokens = model.frontend.speech_tokens(str(clip)).shape[1]
        prompt_frames = model.frontend.prompt_mel(str(clip)).shape[1]
        frames = 2 * (source_tokens + prompt_tokens) - prompt_frames
        assert audio.numel() == frames * hop_samples(variant_dir)
    assert torch.equal(audio, one(rt, name, request))


def test_cached_voice_reuses_the_prompt_without_the_front_end(runtime, variant_dir, clip):
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    with stages_run(model) as ran:
        voice = rt.add_voice(name, "e2e-cached", str(clip), REF_TEXT)
    assert ran == {"frontend"} and voice.kind == "cached"
    assert "e2e-cached" in [v.id for v in rt.voices(name)]
    by_ref = one(rt, name, SynthesisRequest(TEXT, voice=Reference(str(clip), REF_TEXT), seed=variation.seed(9)))
    with stages_run(model) as ran:
        by_id = one(rt, name, SynthesisRequest(TEXT, voice="e2e-cached", seed=variation.seed(9)))
    assert "frontend" not in ran
    assert torch.equal(by_id, by_ref), "a cached voice must speak exactly as its reference"


def test_streaming_out(runtime, variant_dir, clip, upstream_chunks, record_tokens):
    """A long sentence streams as upstream would chunk the tokens the LM spoke (read from the run:
    a random-weight LM may stop early on a stop id, so how many chunks is not assumed)."""
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    spoken = record_tokens(model)
    words = " ".join(["one two three four five six seven eight nine ten"] * 7) + "."
    request = SynthesisRequest(words, voice=Reference(str(clip), REF_TEXT), seed=variation.seed(11), stream=True)
    with stages_run(model) as ran:
        chunks = run(rt, name, request)
    assert ran == {s.name for s in model.stages}
    yaml = load_hyperyaml(next(variant_dir.glob("cosyvoice*.yaml")))
    prompt_tokens = model.frontend.voice_prompt(str(clip), REF_TEXT)["flow_prompt_speech_token"].shape[1]
    assert spoken, "no segment was spoken"
    expected = sum(upstream_chunks(model.variant.version, len(t), yaml["flow"], prompt_tokens) for t in spoken)
    assert len(chunks) == expected, f"{[len(t) for t in spoken]} tokens: {len(chunks)} chunks, upstream {expected}"
    assert all(c.sample_rate == model.capabilities.sample_rate for c in chunks)
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    again = run(rt, name, request)
    assert len(again) == len(chunks) and all(torch.equal(a.samples, b.samples) for a, b in zip(chunks, again))


# CosyVoice3Model.__init__ (upstream ace7c47) lists these FSQ ids as silent/breath tokens, and its
# llm_job passes at most five in a row to the flow; CosyVoice and CosyVoice2 models list none.
UPSTREAM_V3_SILENT = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)


def test_silent_runs_reach_the_flow_as_upstream(runtime, variant_dir, clip, monkeypatch):
    """A constructed LM stream with long silent runs: only CosyVoice 3 drops the sixth and later of a run."""
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    s = UPSTREAM_V3_SILENT
    stream = [100, 101, *s[:8], 300, *[s[9]] * 3, *[s[10]] * 4, 7, 8, *[s[4]] * 6]
    v3 = load_hyperyaml(next(variant_dir.glob("cosyvoice*.yaml")))["llm"].cls == "CosyVoice3LM"
    want = ([100, 101, *s[:5], 300, *[s[9]] * 3, *[s[10]] * 2, 7, 8, *[s[4]] * 5] if v3 else stream)
    monkeypatch.setattr(model.llm, "generate", lambda *args, **kwargs: iter(stream))
    seen = []
    token2mel = model.flow.token2mel

    def flow(token, *args, **kwargs):
        seen.append(token.flatten().tolist())
        return token2mel(token, *args, **kwargs)
    monkeypatch.setattr(model.flow, "token2mel", flow)
    one(rt, name, SynthesisRequest("Hello.", voice=Reference(str(clip)), seed=variation.seed(1)))
    assert seen == [want]
