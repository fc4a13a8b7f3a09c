"""Every recorded upstream call, replayed through the engine's request runner: tokens, mel, audio.

For each case the stored model input (what upstream's frontend_<mode> returned) goes through
the same Synthesizer a request uses, with the LM, flow and vocoder stages recorded. Every
intermediate must be `torch.equal` to upstream's: LM tokens, each flow call's tokens and mel,
each vocoder call's speech, each output chunk. Non-streaming draws follow upstream's order on one
generator seeded with the case seed; streams are recorded only where upstream is deterministic
(voice conversion, CosyVoice 3), and there the recorded chunks are the target.

The cases were recorded on one CPU class (mizuoto.testing.cpu_recordings): there every intermediate
is `torch.equal`; on a class they were not recorded on, tokens stay equal and each float within
the spread upstream itself shows between the recorded classes for its full-pipeline kind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.engine import CosyVoiceEngine
from mizuoto.engines.cosyvoice.synthesis import request_generators
from mizuoto.runtime.options import LoadOptions
from mizuoto.testing.cosyvoice_cases import CaseRef, assemble_model_dir, list_cases, load_case
from mizuoto.testing.cpu_recordings import CHUNK, FLOW_MEL, HIFT_MEL, SPEECH, tree_comparison

CASES = list_cases()
_MODELS: dict[Path, object] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    def get(model_dir: Path):
        if model_dir not in _MODELS:
            dest = assemble_model_dir(model_dir, tmp_path_factory.mktemp(model_dir.parent.name))
            _MODELS[model_dir] = CosyVoiceEngine().load(dest, LoadOptions(device="cpu"))
        return _MODELS[model_dir]
    yield get
    _MODELS.clear()


class Recorder:
    """Wraps a model's request runner and keeps what each stage received and returned."""

    def __init__(self, synth):
        self.raw_tokens: list[int] = []
        self.flow: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.hift: list[tuple[torch.Tensor, torch.Tensor]] = []
        lm, flow, hift = synth.lm_tokens, synth.mel, synth.speech

        def lm_rec(*args, **sizes):
            for tok in lm(*args, **sizes):
                self.raw_tokens.append(tok)
                yield tok

        def flow_rec(token, *args, **kwargs):
            mel, cache = flow(token, *args, **kwargs)
            self.flow.append((token.clone(), mel.clone()))
            return mel, cache

        def hift_rec(mel, **kwargs):
            speech, source = hift(mel, **kwargs)
            self.hift.append((mel.clone(), speech.clone()))
            return speech, source

        # the Synthesizer's own stage calls, observed on this instance only
        synth.lm_tokens, synth.mel, synth.speech = lm_rec, flow_rec, hift_rec


def _run(model, case, stream: bool):
    inputs = {k: case.input(k) for k in case.meta["model_input_keys"]}
    has_lm = "source_speech_token" not in inputs
    synth = model.synthesizer(with_lm=has_lm)
    rec = Recorder(synth)
    lm_gen, voc_gen = request_generators(case.seed, stream, has_lm)
    chunks = list(synth.run(inputs, stream=stream, speed=case.meta.get("speed", 1.0), lm_gen=lm_gen,
                            voc_gen=voc_gen))
    return rec, chunks


def _equal(ours: torch.Tensor, want: torch.Tensor, what: str, kind: str | None = None) -> None:
    """`torch.equal`; a float of full-pipeline `kind` on an unrecorded CPU class: within its measured spread."""
    assert ours.shape == want.shape, f"{what}: shape {tuple(ours.shape)}, upstream {tuple(want.shape)}"
    if kind is not None:
        tree_comparison("cosyvoice").assert_equal(ours.to(want.dtype), want, kind, f"{what}, against upstream")
        return
    diff = (ours.float() - want.float()).abs().max().item() if ours.numel() else 0.0
    assert torch.equal(ours.to(want.dtype), want), f"{what}: differs from upstream, max abs err {diff:.3g}"


@pytest.mark.parametrize("ref", CASES, ids=[r.id for r in CASES])
def test_case_matches_upstream(models, ref: CaseRef):
    case = load_case(ref)
    rec, chunks = _run(models(ref.model_dir), case, stream=bool(case.meta["stream"]))
    raw = case.get("lm.tokens_raw")
    if raw is not None and raw.numel():
        _equal(torch.tensor(rec.raw_tokens, dtype=torch.int32), raw.to(torch.int32).flatten(), "LM tokens")
    assert len(rec.flow) == len(case.meta["flow_calls"]), "number of flow calls"
    for i, (token, mel) in enumerate(rec.flow):
        _equal(token, case.get(f"flow.{i}.token").to(torch.int32), f"flow call {i} tokens")
        _equal(mel, case.get(f"flow.{i}.mel"), f"flow call {i} mel", FLOW_MEL)
    assert len(rec.hift) == len(case.meta["hift_calls"]), "number of vocoder calls"
    for i, (mel, speech) in enumerate(rec.hift):
        _equal(mel, case.get(f"hift.{i}.mel"), f"vocoder call {i} mel", HIFT_MEL)
        _equal(speech, case.get(f"hift.{i}.speech"), f"vocoder call {i} speech", SPEECH)
    assert len(chunks) == case.meta["n_chunks"], "number of chunks"
    for i, chunk in enumerate(chunks):
        _equal(chunk, case.get(f"output.chunk.{i}"), f"chunk {i}", CHUNK)


LM_CASES = [r for r in CASES if r.has("lm.tokens_raw", "input.text") and not load_case(r).meta["stream"]]


@pytest.mark.parametrize("ref", LM_CASES, ids=[r.id for r in LM_CASES])
def test_streaming_keeps_the_tokens_and_is_reproducible(models, ref: CaseRef):
    """LM-driven streaming: tokens equal the non-streaming request's; audio is the same run to run."""
    case = load_case(ref)
    model = models(ref.model_dir)
    rec1, chunks1 = _run(model, case, stream=True)
    rec2, chunks2 = _run(model, case, stream=True)
    want = case.get("lm.tokens_raw").to(torch.int32).flatten()
    _equal(torch.tensor(rec1.raw_tokens, dtype=torch.int32), want, "streamed LM tokens")
    assert len(chunks1) == len(chunks2) >= 1
    for a, b in zip(chunks1, chunks2):
        assert torch.equal(a, b), "streaming audio is not reproducible for a seed"
