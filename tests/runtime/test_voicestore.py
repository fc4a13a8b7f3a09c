"""Cached voices that persist: the store's layout and atomic writes, restore on load, refusal by another model."""

import json

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import VoicePrompt
from mizuoto.runtime.voicestore import ModelIdentity, VoiceStore, fingerprint
from mizuoto.testing.toy import ToneEngine, ToneModel, write_model


def _ref(freq: float = 200.0, rate: int = 16000) -> tuple[torch.Tensor, int]:
    t = torch.arange(2 * rate) / rate
    return torch.sin(2 * torch.pi * freq * t) * 0.3, rate


def _runtime(store) -> Runtime:
    return Runtime(engines=(ToneEngine,), plugins=False, voices=store)


def test_layout_safetensors_and_json(tmp_path):
    """One folder per model (engine + fingerprint), one per voice: prompt.safetensors and voice.json."""
    model_dir = write_model(tmp_path / "tone")
    with _runtime(tmp_path / "voices") as rt:
        name = rt.load(model_dir)
        rt.add_voice(name, "alice", _ref(), "hello there")
    files = sorted(p.relative_to(tmp_path / "voices").as_posix() for p in (tmp_path / "voices").rglob("*")
                   if p.is_file())
    folder = f"tone-{fingerprint(model_dir)[:20]}"
    assert files == [f"{folder}/alice/prompt.safetensors", f"{folder}/alice/voice.json"]
    meta = json.loads((tmp_path / "voices" / folder / "alice" / "voice.json").read_text())
    assert meta["text"] == "hello there" and meta["engine"] == "tone" and meta["model"] == "tone"
    assert meta["fingerprint"] == fingerprint(model_dir) and meta["tensors"] == ["pitch"]


def test_odd_ids_are_hex_on_disk(tmp_path):
    """An id that is not a plain file name (a trailing newline included) is stored under its hex, and restored."""
    model_dir = write_model(tmp_path / "tone")
    with _runtime(tmp_path / "voices") as rt:
        rt.add_voice(rt.load(model_dir), "alice\n", _ref(), None)
    folders = [p.name for p in (tmp_path / "voices").glob("*/*")]
    assert folders == ["~" + "alice\n".encode().hex()]
    with _runtime(tmp_path / "voices") as rt:
        assert "alice\n" in {v.id for v in rt.voices(rt.load(model_dir))}


def test_restore_without_the_front_end(tmp_path, monkeypatch):
    """A new Runtime lists and uses the stored voice; the front end (the tone engine's _listen) never runs."""
    model_dir = write_model(tmp_path / "tone")
    with _runtime(tmp_path / "voices") as rt:
        name = rt.load(model_dir)
        rt.add_voice(name, "alice", _ref(), "hi")
        before = next(iter(rt.synthesize(name, "abc", voice="alice", seed=3))).samples
    calls = []
    listen = ToneModel._listen
    monkeypatch.setattr(ToneModel, "_listen", lambda self, *a: calls.append(1) or listen(self, *a))
    with _runtime(tmp_path / "voices") as rt:
        name = rt.load(model_dir)
        assert [(v.id, v.kind) for v in rt.voices(name) if v.kind == "cached"] == [("alice", "cached")]
        after = next(iter(rt.synthesize(name, "abc", voice="alice", seed=3))).samples
    assert calls == [] and torch.equal(before, after)


def test_other_model_refuses_with_a_clear_message(tmp_path):
    """A voice made for one model is refused by a different model, naming the model it was made for."""
    a, b = write_model(tmp_path / "a", seed=0), write_model(tmp_path / "b", seed=1)
    assert fingerprint(a) != fingerprint(b)
    with _runtime(tmp_path / "voices") as rt:
        rt.add_voice(rt.load(a), "alice", _ref())
        other = rt.load(b)
        with pytest.raises(InvalidRequest, match=r"voice 'alice' was made for model a \(tone.*model b cannot use it"):
            rt.synthesize(other, "abc", voice="alice")
    with _runtime(tmp_path / "voices") as rt:  # after a restart, too
        other = rt.load(b)
        assert "alice" not in [v.id for v in rt.voices(other)]
        with pytest.raises(InvalidRequest, match="was made for model a"):
            rt.synthesize(other, "abc", voice="alice")


def test_moved_model_keeps_its_voices(tmp_path):
    """The identity is the files, not the path: a copied model directory finds its voices."""
    import shutil

    a = write_model(tmp_path / "a")
    with _runtime(tmp_path / "voices") as rt:
        rt.add_voice(rt.load(a), "alice", _ref())
    shutil.copytree(a, tmp_path / "moved")
    with _runtime(tmp_path / "voices") as rt:
        assert "alice" in [v.id for v in rt.voices(rt.load(tmp_path / "moved"))]


def test_remove_and_replace(tmp_path):
    """remove_voice drops the loaded and stored copies; adding an id again replaces it; unknown ids are refused."""
    a = write_model(tmp_path / "a")
    with _runtime(tmp_path / "voices") as rt:
        name = rt.load(a)
        rt.add_voice(name, "v", _ref(150.0))
        rt.add_voice(name, "v", _ref(300.0))
        assert len(rt.stored_voices()) == 1
        pitch = rt.model(name).export_voice("v").tensors["pitch"].item()
        assert pitch > 250
        assert rt.remove_voice("v") == 2
        assert rt.stored_voices() == [] and "v" not in [x.id for x in rt.voices(name)]
        with pytest.raises(InvalidRequest, match="no cached voice 'v'"):
            rt.remove_voice("v")


def test_memory_only_runtime_writes_nothing(tmp_path, monkeypatch):
    """voices=False keeps cached voices in memory; persist=False skips one voice."""
    monkeypatch.delenv("MIZUOTO_VOICE_STORE", raising=False)
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "home"))
    a = write_model(tmp_path / "a")
    with Runtime(engines=(ToneEngine,), plugins=False, voices=False) as rt:
        rt.add_voice(rt.load(a), "v", _ref())
    with _runtime(None) as rt:
        rt.add_voice(rt.load(a), "w", _ref(), persist=False)
        assert rt.stored_voices() == []
    assert not (tmp_path / "home" / "voices").exists()


def test_store_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails half way leaves no voice and no stray folder; the old copy of a replaced id survives."""
    store = VoiceStore(tmp_path)
    ident = ModelIdentity("tone", None, "m", "/x", "f" * 64)
    store.save("v", ident, VoicePrompt({"pitch": torch.tensor([1.0])}), None)
    import mizuoto.runtime.voicestore as vs

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(vs.os, "replace", broken)
    with pytest.raises(Exception, match="disk full"):
        store.save("v", ident, VoicePrompt({"pitch": torch.tensor([2.0])}), None)
    monkeypatch.undo()
    [saved] = store.voices()
    assert store.load(saved).tensors["pitch"].item() == 1.0
    assert [p.name for p in (tmp_path / ident.folder).iterdir()] == ["v"]


def test_shared_tensors_are_stored(tmp_path):
    """Prompts whose entries share one tensor (CosyVoice's llm/flow tokens) are written and read back."""
    store = VoiceStore(tmp_path)
    t = torch.arange(6, dtype=torch.int32).reshape(1, 6)
    ident = ModelIdentity("e", "v", "m", "/x", "a" * 64)
    saved = store.save("s", ident, VoicePrompt({"a": t, "b": t, "c": t[:, 2:]}), "text")
    back = store.load(saved).tensors
    assert torch.equal(back["a"], t) and torch.equal(back["b"], t) and torch.equal(back["c"], t[:, 2:])


def test_voices_env_names_the_store(tmp_path, monkeypatch):
    """$MIZUOTO_VOICE_STORE (e.g. a folder shared by replicas) overrides $MIZUOTO_HOME/voices."""
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MIZUOTO_VOICE_STORE", str(tmp_path / "shared"))
    with _runtime(None) as rt:
        rt.add_voice(rt.load(write_model(tmp_path / "a")), "v", _ref())
    assert len(list((tmp_path / "shared").rglob("voice.json"))) == 1 and not (tmp_path / "home").exists()


@pytest.mark.parametrize("bad", ["[1, 2]", "{not json", '{"format": 1, "engine": "tone"}', '"a string"'])
def test_a_malformed_entry_is_skipped_with_a_warning_naming_it_and_the_others_load(tmp_path, caplog, bad):
    model_dir = write_model(tmp_path / "tone")
    with _runtime(tmp_path / "voices") as rt:
        name = rt.load(model_dir)
        rt.add_voice(name, "alice", _ref(), "hello")
        rt.add_voice(name, "bob", _ref(300.0), "hi")
    broken = next((tmp_path / "voices").glob("*/bob")) / "voice.json"
    broken.write_text(bad)
    with caplog.at_level("WARNING", logger="mizuoto.runtime"), _runtime(tmp_path / "voices") as rt:
        assert {v.id for v in rt.voices(rt.load(model_dir)) if v.kind == "cached"} == {"alice"}
    assert any(str(broken) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
