"""The data processors' own rules (the parity tests check them end to end against upstream)."""

from __future__ import annotations

import pytest
import torch

from mizuoto.engines.cosyvoice.train.pipeline import batch, compute_whisper_fbank, padding, sort
from mizuoto.errors import InvalidRequest


def _sample(utt: str, frames: int, samples: int) -> dict:
    return {"utt": utt, "text": utt, "text_token": [1, 2], "speech_feat": torch.zeros(frames, 4),
            "speech": torch.zeros(1, samples), "utt_embedding": torch.ones(3), "spk_embedding": torch.zeros(3),
            "speech_token": [5] * frames}


def test_sort_is_stable_and_dynamic_batches_count_padded_frames():
    data = [_sample("a", 30, 300), _sample("b", 10, 100), _sample("c", 30, 310), _sample("d", 20, 200)]
    ordered = list(sort(iter(data), sort_size=500))
    assert [s["utt"] for s in ordered] == ["b", "d", "a", "c"]
    batches = list(batch(iter(ordered), batch_type="dynamic", max_frames_in_batch=60))
    # a batch closes when its longest clip times its size would pass the limit
    assert [[s["utt"] for s in b] for b in batches] == [["b", "d"], ["a", "c"]]
    for b in batches:
        assert max(s["speech_feat"].size(0) for s in b) * len(b) <= 60


def test_padding_orders_by_audio_length_and_picks_the_embedding():
    samples = [_sample("short", 10, 100), _sample("long", 20, 400)]
    out = next(padding(iter([samples]), use_spk_embedding=True))
    assert out["utts"] == ["long", "short"]
    assert out["speech_token"].shape == (2, 20) and out["speech_token_len"].tolist() == [20, 10]
    assert torch.equal(out["embedding"], out["spk_embedding"])
    out = next(padding(iter([samples]), use_spk_embedding=False))
    assert torch.equal(out["embedding"], out["utt_embedding"])


def test_whisper_features_only_check_alignment():
    good = _sample("a", 2, 960 * 2)
    assert list(compute_whisper_fbank(iter([good]), num_frames=960)) == [good]
    with pytest.raises(InvalidRequest, match="multiple of 960"):
        list(compute_whisper_fbank(iter([_sample("b", 2, 961)]), num_frames=960))


def test_unknown_batch_type_is_refused():
    with pytest.raises(InvalidRequest, match="batch_type"):
        list(batch(iter([_sample("a", 1, 1)]), batch_type="bucket"))
