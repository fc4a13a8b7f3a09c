"""A streamed chunk is handed out as soon as it is made: the first one before the second flow call."""

from __future__ import annotations

from mizuoto.runtime.engine import Reference, SynthesisRequest

# long enough for several streaming hops on every generation (>= 2 speech tokens per text token)
TEXT = "This sentence is long enough to need several streaming chunks from the model before it ends."


def test_first_chunk_comes_before_the_second_flow_call(runtime, variant_dir, clip):
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    calls = []
    flow = model.flow
    original = flow.inference

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    flow.inference = counting
    try:
        voice = Reference(str(clip), "A short reference.")
        request = SynthesisRequest(TEXT, voice=voice, mode="cross_lingual", stream=True, seed=3)
        chunks = rt.synthesize(name, request)
        first = next(chunks)
        seen_at_first = len(calls)
        rest = list(chunks)
    finally:
        flow.inference = original
    assert seen_at_first == 1, f"the first chunk waited for {seen_at_first} flow calls"
    assert len(calls) == 1 + len(rest)
    # CosyVoice 1 streams 100-token hops, more than this text's random-weight LM may speak
    assert (first.final and not rest) or (rest[-1].final and not first.final)
