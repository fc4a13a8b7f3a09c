"""Streaming text in (upstream's inference_bistream, v2/v3): a text iterator in the request.

Upstream's bistream was not recorded, so these check behaviour: audio arrives while the text is
still being read, the reference text is required, and tokens are deterministic for a seed.
CosyVoice 3's bistream (as upstream's) raises when the LM draws a special token other than
eos / fill; the tiny random-weight v3 LM does so within a few dozen steps, so on it the check
is that the outcome, tokens and error alike, is deterministic and the error is a clear one.
"""

from __future__ import annotations

import pytest
import torch

from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.testing import variation
from mizuoto.testing.cosyvoice_cases import first_speaking_seed

WORDS = variation.text("one two three four five six seven eight nine ten " * 4).split()
REF_TEXT = "A short reference sentence."


class Pieces:
    """A text iterator that counts how many pieces have been read."""

    def __init__(self, words):
        self.words, self.read = list(words), 0

    def __iter__(self):
        for word in self.words:
            self.read += 1
            yield word + " "


def test_audio_arrives_while_text_is_read(runtime, bistream_dir, clip, monkeypatch, upstream_chunks, record_tokens):
    """The first chunk is handed out as soon as the LM has spoken the first hop, text still unread.

    When that is depends on the LM (a random-weight one may draw the fill token early), so it is
    read from the run: how many pieces had been read when each speech token came out.
    """
    rt, names = runtime
    name = names[bistream_dir]
    model = rt.model(name)
    tokens = record_tokens(model)
    read_when_spoken: list[int] = []
    pieces = Pieces(WORDS)
    bistream = model.llm.generate_bistream

    def recording(*args, **kwargs):
        for token in bistream(*args, **kwargs):
            read_when_spoken.append(pieces.read)
            yield token
    monkeypatch.setattr(model.llm, "generate_bistream", recording)
    yaml = load_hyperyaml(next(bistream_dir.glob("cosyvoice*.yaml")))
    prompt_tokens = model.frontend.voice_prompt(str(clip), REF_TEXT)["flow_prompt_speech_token"].shape[1]

    def attempt(seed: int):
        """(chunks, pieces read at the first chunk, pieces read at each token) of one request."""
        nonlocal pieces
        read_when_spoken.clear()
        pieces = Pieces(WORDS)
        request = SynthesisRequest(pieces, voice=Reference(str(clip), REF_TEXT), seed=seed, stream=True)
        assert request.mode is None and request.text_streamed
        read_at, chunks = [], []
        for chunk in rt.synthesize(name, request):
            read_at.append(pieces.read)
            chunks.append(chunk)
        return (chunks, read_at[0], list(read_when_spoken)) if read_when_spoken else None

    seed, first = first_speaking_seed(attempt, variation.seed(21))
    if not first or isinstance(first, MizuotoError):  # no seed lets this LM speak: its outcome repeats
        assert repr(first_speaking_seed(attempt, seed, tries=1)[1]) == repr(first)
        return
    runs = [first, attempt(seed)]
    for chunks, read_first, spoken_at in runs:
        spoken = len(spoken_at)
        assert len(chunks) == upstream_chunks(model.variant.version, spoken, yaml["flow"], prompt_tokens)
        assert chunks[-1].final and not any(c.final for c in chunks[:-1])
        assert all(c.samples.numel() > 0 for c in chunks[:-1])
        if len(chunks) > 1:
            # the first chunk came out when the token that completed the first hop did
            first_hop = next(n for n in range(1, spoken + 1)
                             if upstream_chunks(model.variant.version, n, yaml["flow"], prompt_tokens) > 1)
            assert read_first == spoken_at[first_hop - 1], "the first chunk waited for more text"
    assert tokens[-2] == tokens[-1] and len(tokens[-1]) > 0, "tokens differ for one seed"
    assert all(torch.equal(a.samples, b.samples) for a, b in zip(runs[0][0], runs[1][0]))


def test_instruct_takes_streamed_text(runtime, bistream_dir, clip):
    rt, names = runtime
    name = names[bistream_dir]

    def attempt(seed: int):
        request = SynthesisRequest(Pieces(WORDS), voice=Reference(str(clip)), instruct="Speak slowly.",
                                   seed=seed, stream=True)
        chunks = list(rt.synthesize(name, request))
        assert chunks[-1].final
        return chunks if sum(c.samples.numel() for c in chunks) > 0 else None

    _, chunks = first_speaking_seed(attempt, variation.seed(21))
    # no seed speaking is only right when the LM stops as upstream's does (an error naming the token)
    assert chunks, "streamed instruct text gave no audio and no error for any seed"


def test_tokens_are_deterministic_for_a_seed(runtime, stream_in_dir, clip):
    """Same seed, same outcome (tokens, or the same error after the same tokens); another seed differs."""
    rt, names = runtime
    model = rt.model(names[stream_in_dir])
    prompt = model.frontend.voice_prompt(str(clip), REF_TEXT)

    def decode(seed: int):
        text = model.frontend.streamed_tokens(iter(w + " " for w in WORDS))
        out = []
        try:
            for token in model.llm.generate_bistream(text, prompt["prompt_text"], prompt["llm_prompt_speech_token"],
                                                     generator=torch.Generator().manual_seed(seed)):
                out.append(token)
        except MizuotoError as e:  # v3's special-token stop, as upstream's ValueError
            return out, str(e)
        return out, None

    first = decode(variation.seed(5))
    assert first == decode(variation.seed(5))
    assert first[0] or first[1], "no tokens and no error"
    if first[1] is not None:
        assert "special token" in first[1]
    other = decode(variation.seed(5) + 1)
    if first[0] and other[0]:  # two outcomes with sampled tokens (not an eos or a stop at once)
        assert other != first


def test_without_reference_text_is_refused(runtime, stream_in_dir, clip):
    rt, names = runtime
    name = names[stream_in_dir]
    # no reference text: the mode resolves to cross_lingual, which cannot take streamed text
    with pytest.raises(InvalidRequest, match="reference text"):
        list(rt.synthesize(name, SynthesisRequest(Pieces(WORDS), voice=Reference(str(clip)), stream=True)))
    with pytest.raises(InvalidRequest, match="reference text"):
        SynthesisRequest(Pieces(WORDS), mode="clone", voice=Reference(str(clip)), stream=True)
    rt.add_voice(name, "bistream-no-text", str(clip))
    with pytest.raises(InvalidRequest, match="reference text"):
        list(rt.synthesize(name, SynthesisRequest(Pieces(WORDS), mode="clone", voice="bistream-no-text",
                                                  stream=True)))
    model = rt.model(name)
    with pytest.raises(InvalidRequest, match="reference text"):
        next(model.llm.generate_bistream(iter([]), torch.zeros(1, 0, dtype=torch.int32)))


def test_v1_refuses_streamed_text(runtime, no_stream_in_dir, clip):
    rt, names = runtime
    name = names[no_stream_in_dir]
    assert not rt.model(name).capabilities.stream_in
    with pytest.raises(InvalidRequest, match="streamed text"):
        rt.synthesize(name, SynthesisRequest(Pieces(WORDS), voice=Reference(str(clip), REF_TEXT), stream=True))
