"""The LSTM speaker encoder's windows and embedding, on hand-made sizes."""

import pytest
import torch

from mizuoto.nn.speaker import LSTMSpeakerEncoder


def _encoder() -> LSTMSpeakerEncoder:
    torch.manual_seed(0)
    return LSTMSpeakerEncoder(mels=8, hidden=12, layers=2, size=6).eval()


@pytest.mark.parametrize("frames, expected", [
    (100, (1, 77, 160)),   # shorter than a window: one, padded
    (160, (1, 77, 160)),   # one window; a second would cover (0 + 83) / 160 = 0.52 < 0.8 of itself
    (237, (2, 77, 237)),   # exactly two windows
    (300, (3, 77, 314)),   # a third would cover (63 + 83) / 160 = 0.91 >= 0.8: taken, padded
])
def test_windows_follow_the_coverage_rule(frames, expected):
    assert _encoder().windows(frames, rate=1.3, min_coverage=0.8) == expected


def test_embedding_is_the_normed_mean_of_its_windows():
    enc = _encoder()
    mel = torch.rand(300, 8)
    count, step, length = enc.windows(300, 1.3, 0.8)
    padded = torch.cat([mel, torch.zeros(max(length - 300, 0), 8)])[:length]
    with torch.inference_mode():
        windows = enc(torch.stack([padded[i * step:i * step + 160] for i in range(count)]))
        mean = windows.mean(0, keepdim=True)
        torch.testing.assert_close(enc.embed(mel), mean / mean.norm(dim=1, keepdim=True))
        assert torch.allclose(enc.embed(mel).norm(), torch.tensor(1.0))


def test_an_empty_mel_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        _encoder().embed(torch.zeros(0, 8))
