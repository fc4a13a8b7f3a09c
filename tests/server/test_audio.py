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

    from mizuoto.server.speech import inline_reference

    state, params = SimpleNamespace(voices={}), SimpleNamespace(ref_audio=h.clip_base64(), ref_text=h.ref_text)
    got: list = []
    # the job's thread would keep the decode's team (a mean over the whole clip) for its request
    assert threads_left_by(lambda: got.append(inline_reference(state, params))) == 0
    (samples, rate), text = got[0].audio, got[0].text
    assert samples.ndim == 1 and samples.numel() > rate and text == h.ref_text
