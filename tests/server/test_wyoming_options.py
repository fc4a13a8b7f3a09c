"""`mizuoto wyoming --param NAME=VALUE`: engine request options for clients that cannot send them (Home Assistant)."""

import pytest

from mizuoto.errors import InvalidRequest
from mizuoto.server.state import ServerConfig, ServerState
from mizuoto.server.wyoming_service import VoiceEntry, WyomingService


@pytest.fixture
def state(h, tmp_path):
    state = ServerState(h.make_runtime(), ServerConfig(), {"tone": h.write_model(tmp_path / "tone")})
    yield state
    state.runtime.close()


def test_each_request_gets_the_options_its_engine_declares(state):
    service = WyomingService(state, params=("transpose=5",))
    tone = VoiceEntry("tone/low", "tone", "low", "tone", ())
    assert service.params(tone).options == {"transpose": 5}
    piper = VoiceEntry("piper/joe", "piper", "joe", "piper", ())
    assert not service.params(piper).options  # piper declares none: nothing is passed, nothing refused
    assert WyomingService(state).params(tone).options is None


def test_a_name_no_engine_declares_or_a_bad_value_is_refused_at_start(state):
    with pytest.raises(InvalidRequest, match="no installed engine declares 'octave'.*transpose"):
        WyomingService(state, params=("octave=1",))
    with pytest.raises(InvalidRequest, match="transpose"):
        WyomingService(state, params=("transpose=99",))
    with pytest.raises(InvalidRequest, match="name=value"):
        WyomingService(state, params=("transpose",))
