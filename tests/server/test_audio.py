"""server.audio: checks that run on the event loop stay off torch's thread teams."""

from __future__ import annotations

import pytest
import torch

from mizuoto.server.audio import check_finite
from mizuoto.server.errors import ApiError
from mizuoto.testing.omp_teams import supported, threads_left_by


@pytest.mark.skipif(not supported(), reason="counts threads by name: Linux only")
def test_check_finite_refuses_nan_and_leaves_no_team():
    utterance = torch.zeros(24000 * 30)  # a non-streamed response: one chunk of the whole audio
    assert threads_left_by(lambda: check_finite(utterance)) == 0  # the event loop's thread keeps none
    utterance[-1] = float("nan")
    with pytest.raises(ApiError) as e:
        check_finite(utterance)
    assert e.value.status == 500


@pytest.mark.skipif(not supported(), reason="counts threads by name: Linux only")
def test_an_inline_reference_is_decoded_without_leaving_a_team_in_the_job(h):
    from types import SimpleNamespace

    from mizuoto.server.session import inline_reference

    state, params = SimpleNamespace(voices={}), SimpleNamespace(ref_audio=h.clip_base64(), ref_text=h.ref_text)
    got: list = []
    # the job's thread would keep the decode's team (a mean over the whole clip) for its request
    assert threads_left_by(lambda: got.append(inline_reference(state, params))) == 0
    (samples, rate), text = got[0].audio, got[0].text
    assert samples.ndim == 1 and samples.numel() > rate and text == h.ref_text


def test_server_cli_and_wyoming_carry_the_same_pcm16(tmp_path):
    """The server's wav/pcm/flac bodies, nn.dsp's PCM_16 WAV, `say`'s PCM16 WAV and Wyoming's chunks: one PCM16."""
    import io
    from types import SimpleNamespace

    import numpy as np
    import soundfile

    from mizuoto.cli.main import write_wav as say_wav
    from mizuoto.nn.dsp.wav import read_audio, to_pcm16, write_wav
    from mizuoto.server.audio import encode

    wyoming = pytest.importorskip("mizuoto.server.wyoming")
    # off the grid, exact half steps (rounded to even), full scale and past it
    x = torch.from_numpy(np.concatenate([np.random.default_rng(0).uniform(-1.2, 1.2, 4000),
                                         [0.5, 1.5, -2.5, 32767.5, 32768, -32768, -40000] / np.float64(32768)])
                         .astype(np.float32))
    pcm = encode(x, 24000, "pcm")
    assert pcm == to_pcm16(x) == to_pcm16(x.numpy())
    assert encode(x, 24000, "wav")[44:] == pcm
    write_wav(tmp_path / "pcm16.wav", x, 24000, "PCM_16")
    data = (tmp_path / "pcm16.wav").read_bytes()
    assert data[data.index(b"data") + 8:] == pcm
    assert soundfile.read(io.BytesIO(encode(x, 24000, "flac")), dtype="int16")[0].astype("<i2").tobytes() == pcm
    # `mizuoto say` writes the server's PCM16 WAV (nn/dsp/encode.py): it reads back to the same PCM16
    say_wav(tmp_path / "say.wav", [SimpleNamespace(samples=x, sample_rate=24000)])
    assert to_pcm16(read_audio(tmp_path / "say.wav")[0][0]) == pcm
    assert wyoming.to_pcm16 is to_pcm16  # Wyoming's audio-chunk payloads are consecutive slices of its bytes
