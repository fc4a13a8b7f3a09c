"""A streamed chunk is handed out as soon as it is made: the first one before the second flow call.

The LM is given a constructed token stream (its length is the test's, not a random LM's), long
enough for several streaming hops on every generation: upstream's first chunk needs at most two
seconds of tokens plus overlap or look-ahead (v1: 2 s + 20 tokens; v2/v3: 1 s, padded to the
prompt, + 3), and the stream is six seconds of tokens at the flow's token rate.
"""

from __future__ import annotations

from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.runtime.hyperyaml import load_hyperyaml


def test_first_chunk_comes_before_the_second_flow_call(runtime, variant_dir, clip, monkeypatch):
    rt, names = runtime
    name = names[variant_dir]
    model = rt.model(name)
    rate = int(load_hyperyaml(next(variant_dir.glob("cosyvoice*.yaml")))["flow"]["input_frame_rate"])
    size = model.llm.speech_token_size
    # consecutive ids 97 apart: never a run of CosyVoice 3's silent ids for its filter to drop
    stream = [(97 * i) % size for i in range(6 * rate)]
    monkeypatch.setattr(model.llm, "generate", lambda *args, **kwargs: iter(stream))
    calls = []
    original = model.flow.token2mel

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(model.flow, "token2mel", counting)
    voice = Reference(str(clip), "A short reference.")
    request = SynthesisRequest("Hello.", voice=voice, mode="cross_lingual", stream=True, seed=3)
    chunks = rt.synthesize(name, request)
    first = next(chunks)
    seen_at_first = len(calls)
    rest = list(chunks)
    assert len(rest) >= 2, f"{len(stream)} tokens gave {1 + len(rest)} chunks"
    assert seen_at_first == 1, f"the first chunk waited for {seen_at_first} flow calls"
    assert len(calls) == 1 + len(rest)
    assert not first.final and rest[-1].final and not any(c.final for c in rest[:-1])
