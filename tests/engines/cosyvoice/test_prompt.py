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
"""

from __future__ import annotations

import pytest
import torch

from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.cosyvoice_cases import list_cases, load_case
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
    prompt = _prompt(frontend, wav, want_tokens, monkeypatch)
    assert prompt["prompt_speech_feat"].shape == want_feat.shape
    assert torch.equal(prompt["prompt_speech_feat"], want_feat), \
        f"max abs {(prompt['prompt_speech_feat'] - want_feat).abs().max().item():.3g}"
    assert torch.equal(prompt["flow_prompt_speech_token"], want_tokens)
    assert torch.equal(prompt["llm_prompt_speech_token"], want_tokens)

    # upstream aligns only for 24 kHz models: min(frames // 2, tokens), two frames per token
    aligned = int(load_hyperyaml(ref.yaml_path)["sample_rate"]) == 24000
    full = frontend.prompt_mel((wav[0], 24000))
    assert torch.equal(full[:, :want_feat.shape[1]], want_feat)
    n = want_tokens.shape[1]
    extra = torch.arange(5, dtype=torch.int32)[None]
    for tokens in (want_tokens[:, :n - 3], torch.cat([want_tokens, extra], dim=1)):
        prompt = _prompt(frontend, wav, tokens, monkeypatch)
        if aligned:
            k = min(full.shape[1] // 2, tokens.shape[1])
            assert torch.equal(prompt["flow_prompt_speech_token"], tokens[:, :k])
            assert torch.equal(prompt["prompt_speech_feat"], full[:, :2 * k])
            if k <= n:  # these frames are upstream's own
                assert torch.equal(prompt["prompt_speech_feat"], want_feat[:, :2 * k])
        else:
            assert torch.equal(prompt["flow_prompt_speech_token"], tokens)
            assert torch.equal(prompt["prompt_speech_feat"], want_feat)
