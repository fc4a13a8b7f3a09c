"""The engine's voice prompt against what upstream fed the model: the prompt mel and its alignment.

Each case with `input.prompt_wav_24k` records the 24 kHz waveform and the `prompt_speech_feat`
upstream's frontend made of it (the yaml's feat_extractor, then for 24 kHz models, CosyVoice 2
and 3, `frontend_zero_shot`'s alignment: token_len = min(frames // 2, tokens), feat cut to
2 * token_len frames, tokens to token_len). The cases' prompt tokens are random, not the
tokenizer's, so the engine's speech tokenizer is replaced by the recorded tokens here; the mel and
the cut are then the engine's own and must equal upstream's.

MKL caveat (tests/nn/dsp/test_mel.py): the thread count decides how MKL splits the K=961
reduction of the 1920-point mel product (CosyVoice 2/3). The frontend references of test_mel are
bit-exact at one thread; these cases were recorded at the thread count their json records (2),
and measured on this machine they are bit-exact at exactly that count (1, 3 and 4 threads move
the 24 kHz mels by 2.4e-7 to 4.8e-7; CosyVoice 1's 1024-point mel is equal at any count). So the
check runs at the case's own recorded thread count.

The cases were recorded on one CPU class (mizuoto.testing.cpu_recordings): there the prompt mel is
`torch.equal`; on a class they were not recorded on, within the spread upstream's own prompt mel
shows between the recorded classes (full-pipeline kind `seg.<i>.input.prompt_speech_feat`). Tokens
and the cut (integers, shapes) are equal everywhere, and so is the engine's mel against itself.
"""

from __future__ import annotations

import pytest
import torch

from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.cosyvoice_cases import list_cases, load_case
from mizuoto.testing.cpu_recordings import FRONT_END, tree_comparison
from mizuoto.testing.mkl_intel import require_intel_path

PROMPT_CASES = [r for r in list_cases() if r.has("input.prompt_wav_24k", "input.prompt_speech_feat",
                                                 "input.flow_prompt_speech_token")]


def test_prompt_cases_were_found():
    assert PROMPT_CASES


@pytest.fixture
def threads():
    """Set the torch thread count for one test (restored after)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _frontend(runtime, model_dir):
    rt, names = runtime
    by_dir = {d.resolve(): name for d, name in names.items()}
    return rt.model(by_dir[model_dir.resolve()]).frontend


def _prompt(frontend, wav: torch.Tensor, tokens: torch.Tensor, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(frontend, "speech_tokens", lambda audio: tokens.clone())
    return frontend.voice_prompt((wav[0], 24000), None)


@pytest.mark.parametrize("ref", PROMPT_CASES, ids=[r.id for r in PROMPT_CASES])
def test_prompt_mel_and_alignment_equal_upstream(runtime, ref, monkeypatch, threads):
    require_intel_path()
    case = load_case(ref)
    threads(int(case.meta["threads"]))
    frontend = _frontend(runtime, ref.model_dir)
    wav, want_feat = case.input("prompt_wav_24k"), case.input("prompt_speech_feat")
    want_tokens = case.input("flow_prompt_speech_token").to(torch.int32)
    cpu = tree_comparison("cosyvoice")
    prompt = _prompt(frontend, wav, want_tokens, monkeypatch)
    assert prompt["prompt_speech_feat"].shape == want_feat.shape
    cpu.assert_equal(prompt["prompt_speech_feat"], want_feat, FRONT_END, f"{ref.id} prompt mel")
    assert torch.equal(prompt["flow_prompt_speech_token"], want_tokens)
    assert torch.equal(prompt["llm_prompt_speech_token"], want_tokens)

    # upstream aligns only for 24 kHz models: min(frames // 2, tokens), two frames per token
    aligned = int(load_hyperyaml(ref.yaml_path)["sample_rate"]) == 24000
    full = frontend.prompt_mel((wav[0], 24000))
    cpu.assert_equal(full[:, :want_feat.shape[1]], want_feat, FRONT_END, f"{ref.id} whole prompt mel's first frames")
    n = want_tokens.shape[1]
    extra = torch.arange(5, dtype=torch.int32)[None]
    for tokens in (want_tokens[:, :n - 3], torch.cat([want_tokens, extra], dim=1)):
        prompt = _prompt(frontend, wav, tokens, monkeypatch)
        if aligned:
            k = min(full.shape[1] // 2, tokens.shape[1])
            assert torch.equal(prompt["flow_prompt_speech_token"], tokens[:, :k])
            assert torch.equal(prompt["prompt_speech_feat"], full[:, :2 * k])
            if k <= n:  # these frames are upstream's own
                cpu.assert_equal(prompt["prompt_speech_feat"], want_feat[:, :2 * k], FRONT_END,
                                 f"{ref.id} prompt mel cut to {k} tokens")
        else:
            assert torch.equal(prompt["flow_prompt_speech_token"], tokens)
            cpu.assert_equal(prompt["prompt_speech_feat"], want_feat, FRONT_END,
                             f"{ref.id} prompt mel with {tokens.shape[1]} tokens")


def test_reference_embedding_is_onnxruntimes_unless_fast(runtime, clip, monkeypatch, caplog):
    """New voices get CAM++ in onnxruntime's order (compute.reference=exact, the default); `fast` (or a
    CPU whose onnxruntime kernels are not reproduced, with a warning) takes torch's kernels."""
    import logging

    from mizuoto.engines.cosyvoice.frontend import FBANK_BINS, SPEECH_TOKEN_RATE
    from mizuoto.nn.dsp.kaldi import kaldi_fbank, mean_normalize
    from mizuoto.nn.dsp.wav import load_wav
    from mizuoto.nn.speaker import campplus_ort

    rt, names = runtime
    frontend = rt.model(next(iter(names.values()))).frontend
    assert frontend.exact_embedding
    feats = mean_normalize(kaldi_fbank(load_wav(str(clip), SPEECH_TOKEN_RATE), num_mel_bins=FBANK_BINS,
                                       sample_frequency=SPEECH_TOKEN_RATE)).unsqueeze(0)
    exact = campplus_ort.forward_ort_order(frontend.campplus, feats).reshape(1, -1)
    with torch.inference_mode():
        fast = frontend.campplus(feats).reshape(1, -1)
    assert not torch.equal(exact, fast)
    assert torch.equal(frontend.speaker_embedding(str(clip)), exact)
    assert torch.equal(frontend.speaker_embedding(str(clip), onnxruntime_order=False), fast)
    monkeypatch.setattr(frontend, "exact_embedding", False)
    assert torch.equal(frontend.speaker_embedding(str(clip)), fast)
    monkeypatch.setattr(frontend, "exact_embedding", True)
    monkeypatch.setattr(campplus_ort, "reproducible_here", lambda: False)
    monkeypatch.setattr(frontend, "_warned_inexact", False)
    with caplog.at_level(logging.WARNING, logger="mizuoto.cosyvoice"):
        assert torch.equal(frontend.speaker_embedding(str(clip)), fast)
    assert "AVX2" in caplog.text


def test_the_fast_reference_option_reaches_the_frontend(runtime, tmp_path):
    rt, names = runtime
    model = rt.model(next(iter(names.values())))
    fast = rt.model(rt.load(model.model_dir, name="prompt-fast", compute={"reference": "fast"}))
    try:
        assert fast.frontend.exact_embedding is False and model.frontend.exact_embedding is True
    finally:
        rt.unload("prompt-fast")


def test_a_clip_sent_again_reuses_its_embedding(runtime, clip, monkeypatch):
    """A reference sent with every request pays for CAM++ once: the embedding is kept by the clip's samples."""
    from mizuoto.engines.cosyvoice import frontend as frontend_module
    from mizuoto.engines.cosyvoice.frontend import EMBEDDINGS_KEPT
    from mizuoto.nn.dsp.wav import load_wav
    from mizuoto.nn.speaker import campplus_ort

    rt, names = runtime
    frontend = rt.model(next(iter(names.values()))).frontend
    monkeypatch.setattr(frontend_module, "_EMBEDDINGS", type(frontend_module._EMBEDDINGS)())
    calls = []
    real = campplus_ort.forward_ort_order
    monkeypatch.setattr(campplus_ort, "forward_ort_order", lambda *a: calls.append(1) or real(*a))
    first = frontend.speaker_embedding(str(clip))
    samples = load_wav(str(clip), 16000)[0]
    again = frontend.speaker_embedding((samples.clone(), 16000))  # the same samples, given as an array
    assert torch.equal(first, again) and len(calls) == 1
    again.zero_()  # a caller's copy: the kept one is not changed
    assert torch.equal(frontend.speaker_embedding(str(clip)), first) and len(calls) == 1
    frontend.speaker_embedding((samples * 0.5, 16000))  # other samples: computed
    assert len(calls) == 2
    for i in range(EMBEDDINGS_KEPT):  # the oldest go first
        frontend.speaker_embedding((samples[: 1600 + 16 * i], 16000), onnxruntime_order=False)
    assert len(frontend_module._EMBEDDINGS) == EMBEDDINGS_KEPT
    frontend.speaker_embedding(str(clip))
    assert len(calls) == 3


def test_a_missing_campplus_is_named(tmp_path, clip):
    """A directory without campplus.onnx: embedding a clip is the loader's clear error, not an OSError."""
    from mizuoto.errors import ModelLoadError
    from mizuoto.runtime.api import Runtime
    from mizuoto.testing.cosyvoice_cases import assemble_model_dir

    source = PROMPT_CASES[0].model_dir
    dest = assemble_model_dir(source, tmp_path / "model")
    (dest / "campplus.onnx").unlink()
    rt = Runtime()
    try:
        frontend = rt.model(rt.load(dest)).frontend
        with pytest.raises(ModelLoadError, match="campplus.onnx is missing"):
            frontend.speaker_embedding(str(clip))
    finally:
        rt.close()
