"""From raw text and wav files to audio, against upstream's public classes run end to end (fixtures `full/`).

Each case's model dir is assembled here from its manifest (`assembled_model_dir`, plus its
`model_modification` applied to a copy of llm.pt); shared resources (FSTs, Whisper vocabulary)
come from the installed `cosyvoice` extra. The request goes through the public Runtime; every
intermediate is recorded by wrapping the model's parts on the instance. Nothing is substituted:
CAM++ runs in onnxruntime's float order (the default, compute.reference=exact), so every stage
is upstream's, bit for bit; a second run with compute.reference=fast (torch's CAM++ kernels)
prints the audio's SNR. Tensors that depend on the CPU are compared with this CPU's recording
(`mizuoto.testing.cpu_recordings`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from mizuoto.errors import MizuotoError
from mizuoto.runtime.api import Runtime
from mizuoto.testing.cosyvoice_full import (assemble, list_full_cases, load_full_case, request_for,
                                            snr_db)
from mizuoto.testing.mkl_intel import require_intel_path

MEL_ATOL = 1e-6       # prompt mel, max abs (upstream's librosa mel basis vs ours)
EMBEDDING_REL = 1e-5  # CAM++ with torch's kernels (compute.reference=fast): max|ours - upstream| / max|upstream|
TOKEN_KEYS = ("text", "prompt_text", "llm_prompt_speech_token", "flow_prompt_speech_token", "source_speech_token")
EMBEDDING_KEYS = ("llm_embedding", "flow_embedding")

CASES = list_full_cases()


def test_cases_are_found():
    assert CASES, "no full-pipeline case under $MIZUOTO_FIXTURES/full/*/cases/"


@pytest.fixture(scope="module", params=CASES, ids=[f"{p.parent.parent.name}-{p.stem}" for p in CASES])
def case(request):
    return load_full_case(request.param)


class _Models:
    """One loaded model per distinct (assembly, modification), assembled on first use."""

    def __init__(self, base: Path):
        self.base, self.rt, self.names, self.dirs = base, Runtime(), {}, {}

    def get(self, meta: dict[str, Any], reference: str = "exact"):
        """(runtime, model name) of the case's model loaded with compute.reference=`reference`."""
        key = json.dumps([meta["assembled_model_dir"], meta.get("model_modification")], sort_keys=True)
        if key not in self.dirs:
            self.dirs[key] = assemble(meta, self.base / f"model-{len(self.dirs)}" / "model")
        if (key, reference) not in self.names:
            self.names[key, reference] = self.rt.load(self.dirs[key], name=f"full-{len(self.names)}",
                                                      compute={"reference": reference})
        return self.rt, self.names[key, reference]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    m = _Models(tmp_path_factory.mktemp("full-pipeline"))
    yield m
    m.rt.close()


@dataclass
class Run:
    """What one request did: every recorded call, in order."""

    chunks: list[torch.Tensor] = field(default_factory=list)
    normalize_calls: list[tuple[str, bool, Any]] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    streamed_text: list[torch.Tensor] = field(default_factory=list)
    embeddings: list[torch.Tensor] = field(default_factory=list)
    lm: list[list[int]] = field(default_factory=list)
    flow: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    hift: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def upstream_embedding(case) -> torch.Tensor | None:
    """The CAM++ embedding upstream computed from the case's prompt wav (None: no wav, e.g. a preset)."""
    if "prompt_wav" not in case.meta["raw_inputs"]:
        return None
    for i in range(len(case.segments)):
        for key in EMBEDDING_KEYS:
            found = case.seg(i, f"input.{key}")
            if found is not None:
                return found
    raise AssertionError(f"{case.id}: a prompt wav but no recorded embedding")


def run(models, case, monkeypatch, reference: str) -> Run:
    """Synthesize the case's request on the model loaded with compute.reference=`reference`, recording every call."""
    rt, name = models.get(case.meta, reference)
    model = rt.model(name)
    rec = Run()
    front = model.frontend
    text_frontend = front.text_frontend

    def wrap(obj, attr, record):
        orig = getattr(obj, attr)
        monkeypatch.setattr(obj, attr, lambda *a, **k: record(orig, *a, **k))

    def normalize(orig, text, split=True, text_frontend=True):
        out = orig(text, split, text_frontend)
        rec.normalize_calls.append((text, split, out))
        return out

    def speaker_embedding(orig, audio):
        own = orig(audio)
        rec.embeddings.append(own.clone())
        return own

    def inputs(orig, request, *rest):
        found = orig(request, *rest)
        for d in found:
            if not isinstance(d.get("text"), torch.Tensor) and "text" in d:
                d["text"] = streamed(d["text"])
        rec.inputs.extend(found)
        return found

    def streamed(pieces):
        for piece in pieces:
            rec.streamed_text.append(piece.clone())
            yield piece

    def lm(orig, *a, **k):
        tokens = []
        rec.lm.append(tokens)
        for t in orig(*a, **k):
            tokens.append(int(t))
            yield t

    def flow(orig, *a, **k):
        out = orig(*a, **k)
        rec.flow.append((a[0].clone(), (out[0] if isinstance(out, tuple) else out).clone()))
        return out

    def hift(orig, *a, **k):
        out = orig(*a, **k)
        rec.hift.append((a[0].clone(), out[0].clone()))
        return out

    wrap(text_frontend, "text_normalize", normalize)
    wrap(front, "speaker_embedding", speaker_embedding)
    wrap(model, "_inputs", inputs)
    for attr in ("generate", "generate_bistream"):
        if hasattr(model.llm, attr):
            wrap(model.llm, attr, lm)
    wrap(model.flow, "inference", flow)
    wrap(model.hift, "inference", hift)
    torch.manual_seed(0)  # nothing may draw from the global generator: a wrong draw shows as a mismatch
    rec.chunks = [c.samples.clone() for c in rt.synthesize(name, request_for(case.meta))]
    monkeypatch.undo()
    return rec


_RUNS: dict = {}  # (case id, compute.reference) -> Run, each made once


def get_run(runs, models, case, reference: str = "exact") -> Run:
    if upstream_embedding(case) is None:
        reference = "exact"  # no CAM++ runs (a preset speaker): both runs are the same
    key = (case.id, reference)
    if key not in runs:
        with pytest.MonkeyPatch.context() as mp:
            runs[key] = run(models, case, mp, reference)
    return runs[key]


def upstream_chunks(case) -> list[tuple[str, torch.Tensor]]:
    """Every recorded chunk with its tensor name, in segment and chunk order."""
    return [(f"seg.{i}.chunk.{k}", c.flatten()) for i in range(len(case.segments))
            for k, c in enumerate(case.numbered(i, "chunk"))]


# ---- text front end ------------------------------------------------------------------------------
def test_wetext_calls(models, case):
    """Every wetext call upstream made gives the same output with Mizuoto's normalizer."""
    rt, name = models.get(case.meta)
    normalizer = rt.model(name).frontend.text_frontend.normalizer
    for call in case.meta["wetext_normalize_calls"]:
        assert normalizer.normalize(call["input"]) == call["output"], call["normalizer"]


def test_text_normalize_calls(models, case):
    """Every text_normalize call upstream made (generator input aside) gives the same segments or text."""
    rt, name = models.get(case.meta)
    frontend = rt.model(name).frontend.text_frontend
    for call in case.meta["text_normalize_calls"]:
        if call["input"] == "<generator>":
            continue  # upstream returns a generator untouched; Mizuoto never normalizes streamed text
        assert frontend.text_normalize(call["input"], call["split"], call.get("text_frontend_arg", True)) \
            == call["output"], call["input"]


def test_request_normalizes_what_upstream_does(models, case):
    """The request normalizes exactly the texts upstream did (instruct2 and streamed text never), same output."""
    got = get_run(_RUNS, models, case)
    expected = {(c["input"], c["split"]): c["output"] for c in case.meta["text_normalize_calls"]
                if c["input"] != "<generator>"}
    seen = {(text, split): out for text, split, out in got.normalize_calls}
    assert seen == expected


# ---- model input ---------------------------------------------------------------------------------
def test_model_input(models, case):
    """Text ids, prompt text ids, speech tokens and CAM++ embeddings equal; prompt mel within 1e-6."""
    got = get_run(_RUNS, models, case)
    assert len(got.inputs) == len(case.segments), "segment count"
    for i, (ours, seg) in enumerate(zip(got.inputs, case.segments)):
        assert set(ours) - {"text"} == set(seg["model_input_keys"]) - {"text"}, f"segment {i} keys"
        if seg.get("normalized_text") is not None and isinstance(ours.get("text"), torch.Tensor):
            segments = [out for _, split, out in got.normalize_calls if split]
            assert len(segments) == 1 and segments[0][i] == seg["normalized_text"], f"segment {i} text"
        for key in TOKEN_KEYS:
            want = case.seg(i, f"input.{key}")
            if want is None:
                continue
            assert isinstance(ours[key], torch.Tensor), f"segment {i} {key}: not token ids"
            assert ours[key].dtype == torch.int32 and torch.equal(ours[key], want), f"segment {i} {key}"
        streamed = case.seg(i, "input.text_streamed")
        if streamed is not None:
            assert got.streamed_text, "streamed text ids were never consumed"
            assert torch.equal(torch.cat(got.streamed_text, dim=1), streamed), f"segment {i} streamed text ids"
        feat = case.seg(i, "input.prompt_speech_feat")
        if feat is not None:
            assert ours["prompt_speech_feat"].shape == feat.shape, f"segment {i} prompt mel frames"
            diff = (ours["prompt_speech_feat"] - feat).abs().max().item()
            limit = MEL_ATOL + case.cpu.bound(f"seg.{i}.input.prompt_speech_feat", feat)  # upstream's own spread here
            assert diff <= limit, f"segment {i} prompt mel max abs diff {diff:.2e} > {limit:.2e}"
    embedding = upstream_embedding(case)
    if embedding is None:
        for i, ours in enumerate(got.inputs):  # a preset speaker's embedding is read, not computed
            for key in EMBEDDING_KEYS:
                if case.seg(i, f"input.{key}") is not None:
                    assert torch.equal(ours[key], case.seg(i, f"input.{key}")), f"segment {i} {key}"
        return
    assert got.embeddings, "CAM++ never ran"
    for i, ours in enumerate(got.inputs):
        for key in EMBEDDING_KEYS:
            if case.seg(i, f"input.{key}") is not None:
                case.cpu.assert_equal(ours[key], case.seg(i, f"input.{key}"), f"seg.{i}.input.{key}",
                                      f"segment {i} {key} (exact CAM++)")


# ---- stages ----------------------------------------------------------------------------------------
def test_every_stage_equal(models, case):
    """LM tokens, every flow and HiFT call and every chunk are torch.equal to upstream's, and so the sha256."""
    require_intel_path()
    got = get_run(_RUNS, models, case)
    n = len(case.segments)
    want_lm = [case.seg(i, "lm.tokens_raw").flatten().tolist() for i in range(n)
               if case.seg(i, "lm.tokens_raw") is not None and case.seg(i, "lm.tokens_raw").numel()]
    assert [t for t in got.lm if t] == want_lm, "LM tokens (segments that spoke)"
    if case.lm_only:
        return
    flows = [(case.tensors[f"seg.{i}.flow.{j}.token"], case.tensors[f"seg.{i}.flow.{j}.mel"], f"seg.{i}.flow.{j}.mel")
             for i in range(n) for j in range(len(case.numbered(i, "flow", ".mel")))]
    assert len(got.flow) == len(flows), "flow calls"
    for j, ((token, mel), (want_token, want_mel, name)) in enumerate(zip(got.flow, flows)):
        assert torch.equal(token.to(want_token.dtype), want_token), f"flow call {j} tokens"
        case.cpu.assert_equal(mel, want_mel, name, f"flow call {j} mel")
    hifts = [(case.tensors[f"seg.{i}.hift.{j}.mel"], case.tensors[f"seg.{i}.hift.{j}.speech"], f"seg.{i}.hift.{j}.speech")
             for i in range(n) for j in range(len(case.numbered(i, "hift", ".speech")))]
    if hifts:  # recorded for non-streaming cases
        assert len(got.hift) == len(hifts), "HiFT calls"
        for j, ((mel, speech), (want_mel, want_speech, name)) in enumerate(zip(got.hift, hifts)):
            case.cpu.assert_equal(mel, want_mel, name.replace(".speech", ".mel"), f"HiFT call {j} mel")
            case.cpu.assert_equal(speech, want_speech, name, f"HiFT call {j} speech")
    want = upstream_chunks(case)
    assert want, "the case records no chunk"
    if case.meta.get("stream"):
        assert len(got.chunks) == len(want), "chunk count"
        for k, (ours, (name, theirs)) in enumerate(zip(got.chunks, want)):
            case.cpu.assert_equal(ours, theirs, name, f"chunk {k}")
    else:
        assert len(got.chunks) == 1, "a non-streaming request is one chunk"
        start = 0
        for name, theirs in want:  # the one chunk is upstream's chunks end to end
            case.cpu.assert_equal(got.chunks[0][start:start + theirs.numel()], theirs, name, f"audio ({name})")
            start += theirs.numel()
        assert got.chunks[0].numel() == start, "audio length"
    audio = torch.cat(got.chunks).contiguous()
    digest = hashlib.sha256(audio.numpy().tobytes()).hexdigest()
    if case.cpu.exact:
        assert digest == case.meta["sha256_tts_speech_f32"], "audio sha256"
    else:
        print(f"\n{case.id}: no recording for this CPU; audio sha256 {digest} not checkable")


# ---- with Mizuoto's own embedding ----------------------------------------------------------------
def test_fast_reference(models, case):
    """compute.reference=fast (torch's CAM++ kernels): the embedding within 1e-5 relative, v2/v3 LM
    tokens equal (their LM never sees it); the audio's SNR against upstream's is printed."""
    got = get_run(_RUNS, models, case, "fast")
    rt, name = models.get(case.meta, "fast")
    embedding = upstream_embedding(case)
    spread = max(case.cpu.bound(f"seg.0.input.{k}", embedding) for k in EMBEDDING_KEYS) \
        if embedding is not None else 0.0  # upstream's own, where unrecorded
    for own in got.embeddings:
        rel = ((own - embedding).abs().max() / embedding.abs().max()).item()
        limit = EMBEDDING_REL + spread / embedding.abs().max().item()
        assert rel <= limit, f"CAM++ max|ours-upstream|/max|upstream| = {rel:.2e} > {limit:.2e}"
    n = len(case.segments)
    want_lm = [case.seg(i, "lm.tokens_raw").flatten().tolist() for i in range(n)
               if case.seg(i, "lm.tokens_raw") is not None and case.seg(i, "lm.tokens_raw").numel()]
    if rt.model(name).variant.version >= 2:
        assert [t for t in got.lm if t] == want_lm, "LM tokens (segments that spoke)"
    if case.lm_only:
        print(f"\n{case.id}: LM tokens only, {sum(map(len, got.lm))} tokens equal")
        return
    want = torch.cat([c for _, c in upstream_chunks(case)])
    ours = torch.cat(got.chunks)
    if ours.shape != want.shape:
        print(f"\n{case.id}: fast-reference audio has {ours.numel()} samples, upstream {want.numel()}")
        assert rt.model(name).variant.version == 1, "only CosyVoice 1's LM sees the embedding"
        return
    print(f"\n{case.id}: SNR with the fast CAM++ (compute.reference=fast): {snr_db(want, ours):.1f} dB")



# ---- an LM token upstream rejects ----------------------------------------------------------------
def _force_rejected(llm_path: Path, model) -> None:
    """Rewrite llm.pt so the LM's every draw is a special token upstream's bistream decode rejects."""
    lm = model.llm
    n, rows = lm.speech_token_size, lm.llm_decoder.weight.shape[0]
    rejected = [t for t in range(n, rows) if t not in (lm.eos_token, lm.fill_token)]
    sd = torch.load(llm_path, map_location="cpu", weights_only=True)
    w = sd["llm_decoder.weight"]
    bias = sd.get("llm_decoder.bias")
    base = w[0].clone()
    w.zero_()
    if bias is not None:
        bias.zero_()
        bias[rejected[0]] = 1e4
    else:
        # no bias: two rejected rows of opposite sign, so one of them wins whatever the hidden state
        assert len(rejected) >= 2
        w[rejected[0]] = base * 1e4
        w[rejected[1]] = -base * 1e4
    llm_path.unlink()
    torch.save(sd, llm_path)


STREAMED = [p for p in CASES if "tts_pieces" in json.loads(p.read_text(encoding="utf-8"))["raw_inputs"]]


def test_streamed_text_cases_are_found():
    assert STREAMED, "no full-pipeline case streams its text (raw_inputs.tts_pieces)"


@pytest.mark.parametrize("path", STREAMED, ids=[f"{p.parent.parent.name}-{p.stem}" for p in STREAMED])
def test_rejected_lm_token_is_a_clear_error(tmp_path, path):
    """An LM that emits a token upstream's bistream rejects ends the request with a MizuotoError, promptly."""
    meta = load_full_case(path).meta
    model_dir = assemble({**meta, "model_modification": None}, tmp_path / "model")
    rt = Runtime()
    _force_rejected(model_dir / "llm.pt", rt.model(rt.load(model_dir)))
    rt.close()
    rt = Runtime()
    name = rt.load(model_dir)
    outcome: list[BaseException | None] = []

    def consume():
        try:
            list(rt.synthesize(name, request_for(meta, stream=True)))
            outcome.append(None)
        except BaseException as e:  # handed to the test thread
            outcome.append(e)

    worker = threading.Thread(target=consume, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the request hangs"
    assert isinstance(outcome[0], MizuotoError), f"expected a MizuotoError, got {outcome[0]!r}"
    assert "special token" in str(outcome[0])
    rt.close()
