"""S3Gen against upstream chatterbox-tts 0.1.7: the flow's mel and the trim-faded wav, torch.equal, on every case.

Inputs are the recorded `s3gen_*` tensors. The random draws are replayed in upstream's order from
`torch.manual_seed(seed)`: T3's draws (T3 runs again and must draw what upstream drew), then the
flow's noise (Turbo: its mean-flow noise first), then HiFT's source.
"""

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto_chatterbox.s3gen import load_s3gen
from mizuoto_chatterbox.weights import S3GEN_FILES, T3_FILES

S3GEN_KEYS = ("s3gen_speech_tokens", "s3gen_prompt_token", "s3gen_prompt_token_len", "s3gen_prompt_feat",
              "s3gen_embedding", "s3gen_mel", "wav_pre_watermark")


_RUNS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _run(case) -> tuple[torch.Tensor, torch.Tensor]:
    """(mel, wav) for the case, the draws before them replayed; computed once per case."""
    if case.name not in _RUNS:
        _RUNS[case.name] = _compute(case)
    return _RUNS[case.name]


def _compute(case) -> tuple[torch.Tensor, torch.Tensor]:
    ref = case.tensors()
    model = load_s3gen(case.model_file(S3GEN_FILES))
    t3 = case.t3()
    torch.manual_seed(case.spec["seed"])
    run = t3.generate_turbo if t3.turbo else t3.generate
    drawn = list(run(ref["t3_cond_emb"], ref["text_tokens"][0].long(), case.t3_options()))
    case.assert_equal(torch.tensor(drawn), "t3_sampled_tokens", "T3's draws differ: the seed state is lost")
    mel = model.mel(ref["s3gen_speech_tokens"], ref["s3gen_prompt_token"], ref["s3gen_prompt_feat"],
                    ref["s3gen_embedding"])
    return mel, model.wav(mel)


def _recorded(case) -> dict | None:
    """The case's tensors, or None where upstream raised before S3Gen (then none of its keys may be there)."""
    ref = case.tensors()
    if "expected_error" in case.spec:
        assert not [k for k in S3GEN_KEYS if k in ref], case.name
        return None
    return ref


def test_mel_equals_upstreams(case):
    ref = _recorded(case)
    if ref is None:
        return
    mel, _ = _run(case)
    assert mel.shape == ref["s3gen_mel"].shape
    case.assert_equal(mel, "s3gen_mel")


def test_wav_equals_upstreams(case):
    ref = _recorded(case)
    if ref is None:
        return
    _, wav = _run(case)
    assert wav.shape == (1, ref["wav_pre_watermark"].numel())
    case.assert_equal(wav[0], "wav_pre_watermark")


def test_a_file_that_is_not_s3gen_is_a_clear_error(case):
    with pytest.raises(ModelLoadError, match="not an S3Gen checkpoint"):
        load_s3gen(case.model_file(T3_FILES))
