"""What a server stores cannot stop it (issue 50): a malformed stored voice of any shape is skipped with a
warning at start-up, and voice listings never fail while voices are added and deleted."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch

from mizuoto.runtime.api import Runtime
from mizuoto.server import voices
from mizuoto.testing.toy import ToneEngine

# Each a change to bob's voice.json (or, for "dtype" and "tensors", to his prompt): every one once stopped the
# server at start-up, or served a voice that answered 400 or 500 for the model, GET /v1/models and the listings.
BROKEN = {
    "id-list": lambda m: {**m, "id": ["bob"]},
    "id-number": lambda m: {**m, "id": 5},
    "meta-text": lambda m: {**m, "meta": "xyz"},
    "fingerprint-list": lambda m: {**m, "fingerprint": ["x"]},
    "text-number": lambda m: {**m, "text": 7},
    "created-text": lambda m: {**m, "created": "yesterday"},
    "id-of-another-folder": lambda m: {**m, "id": "alice"},
    "dtype": None,
    "tensors": None,
}


def _ref(freq: float) -> tuple[torch.Tensor, int]:
    t = torch.arange(32000) / 16000
    return torch.sin(2 * torch.pi * freq * t) * 0.3, 16000


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_malformed_stored_voice_is_skipped_and_the_server_serves(h, tmp_path, monkeypatch, caplog, kind):
    """Finding 4: the server starts, is ready, lists its models and voices and speaks with the good voice; the
    broken one is never served, and the warning names its file."""
    store = tmp_path / "voices"
    model_dir = h.write_model(tmp_path / "tone")
    with Runtime(engines=(ToneEngine,), plugins=False, voices=store) as rt:
        name = rt.load(model_dir, name="tone")
        rt.add_voice(name, "alice", _ref(150.0), "hello")
        rt.add_voice(name, "bob", _ref(300.0), "hi")
    folder = next(store.glob("*/bob"))
    meta_file = folder / "voice.json"
    if kind in ("dtype", "tensors"):
        from safetensors.torch import save_file

        tensors = {"pitch": torch.tensor([300.0], dtype=torch.float32)} if kind == "dtype" \
            else {"pitch": torch.tensor([300.0], dtype=torch.float64), "extra": torch.zeros(1)}
        save_file(tensors, str(folder / "prompt.safetensors"))
    else:
        meta_file.write_text(json.dumps(BROKEN[kind](json.loads(meta_file.read_text()))))
    monkeypatch.setenv("MIZUOTO_VOICE_STORE", str(store))
    with caplog.at_level("WARNING", logger="mizuoto.runtime"):
        server = h.start_server({"tone": model_dir})
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as c:
            assert c.get("/ready").json()["status"] == "ready"
            assert c.get("/v1/models").status_code == 200
            r = c.get("/v1/audio/voices")
            assert r.status_code == 200, r.text
            assert sorted(v["id"] for v in r.json()["data"] if v["kind"] == "cached") == ["alice"], r.json()
            assert c.post("/v1/audio/speech", json={"model": "tone", "input": "abc", "voice": "alice"}).status_code \
                == 200
            r = c.post("/v1/audio/speech", json={"model": "tone", "input": "abc", "voice": "bob"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "voice", r.text
    finally:
        server.stop()
    assert any(str(folder) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


class _ListedWhileChanged(dict):
    """Uploaded voices whose listing pauses after its first voice and runs `change` (another thread's write, joined
    within a bounded wait) before it goes on: the interleaving a listing met during voice churn."""

    change = staticmethod(lambda: None)

    def values(self):
        for i, v in enumerate(super().values()):
            yield v
            if i == 0:
                self.change()


@pytest.mark.parametrize("write", ["delete", "create"])
def test_listing_voices_never_fails_while_voices_are_added_and_deleted(h, tmp_path, write):
    """Finding 5: GET /v1/audio/voices iterated the uploaded voices on the event loop while a thread added or
    deleted one ('dictionary changed size during iteration', a 500). Writes now replace the dict (copy on write),
    so a listing reads a snapshot and neither side waits."""
    server = h.start_server({"tone": h.write_model(tmp_path / "tone")})
    try:
        with httpx.Client(base_url=server.url, timeout=30.0, headers=h.admin) as c:
            for voice_id in ("v1", "v2"):
                r = c.post("/v1/audio/voices", json={"id": voice_id, "audio": h.wav_base64()})
                assert r.status_code == 201, r.text
            state = server.server.config.app.state.mizuoto
            upload = json.dumps({"id": "v3", "audio": h.wav_base64()}).encode()
            writes = {"delete": lambda: voices.delete(state, "v2", None),
                      "create": lambda: voices.register(state, upload, "application/json")}
            writer = threading.Thread(target=writes[write])

            def change() -> None:  # in a thread, as the server runs a delete or a creation
                writer.start()
                writer.join(10)  # bounded: a writer that waited for the listing would not hold the test

            listed = _ListedWhileChanged(state.voices)
            listed.change = change
            state.voices = listed
            r = c.get("/v1/audio/voices")
            assert r.status_code == 200, r.text
            assert not writer.is_alive()
            uploaded = sorted(v["id"] for v in c.get("/v1/audio/voices").json()["data"] if v["kind"] == "uploaded")
            assert uploaded == (["v1"] if write == "delete" else ["v1", "v2", "v3"])
    finally:
        server.stop()


def test_the_store_keeps_dtypes_and_loads_voices_saved_before_them(tmp_path):
    """Voices saved before dtypes were recorded (no 'dtypes' in voice.json) still load; new ones record theirs."""
    from mizuoto.runtime.voicestore import ModelIdentity, VoiceStore
    from mizuoto.runtime.engine import VoicePrompt

    store = VoiceStore(tmp_path)
    saved = store.save("v", ModelIdentity("tone", None, "m", "/x", "f" * 64),
                       VoicePrompt({"pitch": torch.tensor([1.0], dtype=torch.float64)}), None)
    meta_file = Path(saved.folder) / "voice.json"
    meta = json.loads(meta_file.read_text())
    assert meta["dtypes"] == {"pitch": "torch.float64"}
    del meta["dtypes"]
    meta_file.write_text(json.dumps(meta))
    [old] = store.voices()
    assert store.load(old).tensors["pitch"].dtype == torch.float64
