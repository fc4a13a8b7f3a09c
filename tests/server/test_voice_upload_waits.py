"""A voice upload cached on a model waits for that model with the upload's lease: its cancel (the client left) or
deadline ends the wait within a second (it waited with a lease of its own that nothing ended)."""

import base64
import contextlib
import io
import json

import numpy as np
import soundfile as sf

from mizuoto.errors import RequestCancelled
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.lease import Lease
from mizuoto.server import voices
from mizuoto.server.errors import ApiError
from mizuoto.server.state import ServerConfig, ServerState
from mizuoto.testing.toy import ToneEngine, write_model
from mizuoto.testing.waits import cancel_during, held_elsewhere


def _wav() -> str:
    buf = io.BytesIO()
    t = np.arange(16000 * 2) / 16000
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 16000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def test_an_upload_cached_on_a_busy_model_stops_waiting_when_its_lease_is_cancelled(tmp_path):
    with Runtime(engines=[ToneEngine], plugins=False, voices=False) as rt:
        state = ServerState(rt, ServerConfig(load_options={"device": "cpu"}), {"tone": write_model(tmp_path / "t")})
        state.ensure_loaded("tone")

        def busy():  # a streamed request that has begun speaking holds the model's turn until it is closed
            chunks = rt.synthesize("tone", "a long enough text", voice="low", seed=1, stream=True)
            next(chunks)
            return contextlib.closing(chunks)
        body = json.dumps({"id": "mine", "audio": _wav(), "text": "a clip", "model": "tone"}).encode()
        with held_elsewhere(busy):
            lease = Lease()
            error, took = cancel_during(lambda: voices.register(state, body, "application/json", lease), lease,
                                        lambda: rt.info("tone").running == 1 and rt.pins("tone") == 2, settle=0.2)
        assert took < 1.0 and isinstance(error, (ApiError, RequestCancelled)) and "cancelled" in str(error)
        assert "mine" not in [v.id for v in rt.voices("tone")] and rt.pins("tone") == 0
