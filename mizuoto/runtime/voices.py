"""Cached voices as a service: added to loaded models, removed, and kept in the voice store across runs.

A `Runtime` holds one `Voices` and forwards its voice methods to it. The service sees the runtime
only through what it is given: the loaded model of a name (`model_of`), the loaded models
(`loaded`), and a call run on a model in its turn under a request's lease (`run`); it reads no
private state of the runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.engine import Model, Voice
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.voicestore import ModelIdentity, SavedVoice, VoiceStore, fingerprint

log = logging.getLogger("mizuoto.runtime")


class Voices:
    """Cached voices of a runtime's loaded models and its voice store (None: voices stay in memory).

    `model_of(name)` is the runtime's record of a loaded model (its `model`, `name`, `engine`,
    `variant`, `path` and `identity`); `loaded()` every one; `run(record, fn, lease)` runs fn() on
    that model's compute thread in its turn, waiting with the lease.
    """

    def __init__(self, store: VoiceStore | None, model_of: Callable[[str], Any], loaded: Callable[[], list],
                 run: Callable[[Any, Callable[[], Any], Lease], Any]) -> None:
        self.voice_store = store
        self._model_of, self._loaded, self._run = model_of, loaded, run

    def restore(self, loaded: Any) -> None:
        """Import the stored voices made for this model (no front end runs); an unreadable one is skipped."""
        if self.voice_store is None or type(loaded.model).import_voice is Model.import_voice:
            return
        loaded.identity = ModelIdentity(loaded.engine, loaded.variant, loaded.name, str(loaded.path.resolve()),
                                        fingerprint(loaded.path))
        for saved in self.voice_store.voices(loaded.identity):
            if saved.model.engine != loaded.engine or saved.model.fingerprint != loaded.identity.fingerprint:
                continue
            try:
                loaded.model.import_voice(saved.id, self.voice_store.load(saved))
            except MizuotoError as e:
                log.warning("stored voice %r not restored into %s: %s", saved.id, loaded.name, e)

    def add_voice(self, model: str, voice_id: str, ref_audio: Any, ref_text: str | None = None,
                  persist: bool = True, lease: Lease | None = None) -> Voice:
        """Cache a voice prompt on the model, to be used later by id; stored for later runs unless `persist` is False.

        A voice of the same id on the same model is replaced. The stored voice holds the engine's
        prompt (tensors), the transcript and the model's identity, and is restored when the same
        model is loaded again, without running the front end. A `lease` carries the caller's cancel
        and deadline into the wait for the model's turn and its front end (it is released here).
        """
        loaded = self._model_of(model)
        if not loaded.model.capabilities.voice_cache:
            raise InvalidRequest(f"model {model} cannot cache voices")
        if not isinstance(voice_id, str) or not voice_id:
            raise InvalidRequest("voice id must be a non-empty string")
        lease = lease if lease is not None else Lease()
        try:
            voice = self._run(loaded, lambda: loaded.model.add_voice(voice_id, ref_audio, ref_text), lease)
        finally:
            lease.release()
        if persist and loaded.identity is not None:
            try:
                self.voice_store.save(voice_id, loaded.identity, loaded.model.export_voice(voice_id), ref_text)
            except MizuotoError:
                loaded.model.remove_voice(voice_id)
                raise
        return voice

    def remove_voice(self, voice_id: str, model: str | None = None) -> int:
        """Forget a cached voice: on `model` (and its stored copy), or on every loaded model and in the store.

        Returns how many copies went (loaded and stored); none is an InvalidRequest.
        """
        targets = [self._model_of(model)] if model is not None else self._loaded()
        removed = 0
        for loaded in targets:
            if any(v.id == voice_id and v.kind == "cached" for v in loaded.model.voices()):
                loaded.model.remove_voice(voice_id)
                removed += 1
        if self.voice_store is not None:
            for saved in self.voice_store.find(voice_id):
                if model is None or (targets[0].identity is not None
                                     and saved.model.fingerprint == targets[0].identity.fingerprint):
                    self.voice_store.delete(saved)
                    removed += 1
        if not removed:
            where = f"model {model}" if model is not None else "any loaded model or the voice store"
            raise InvalidRequest(f"no cached voice {voice_id!r} on {where}")
        return removed

    def identity(self, model: str) -> ModelIdentity | None:
        """What a loaded model's stored voices are keyed by (None when its voices are not stored)."""
        return self._model_of(model).identity

    def stored_voices(self) -> list[SavedVoice]:
        """Every voice in the store, for any model (loaded or not), oldest first."""
        return self.voice_store.voices() if self.voice_store is not None else []

    def foreign_voice(self, model: str, voice_id: str) -> str | None:
        """Why `model` cannot use `voice_id` when that id is stored for another model only; else None."""
        loaded = self._model_of(model)
        if self.voice_store is None or any(v.id == voice_id for v in loaded.model.voices()):
            return None
        owners = self.voice_store.find(voice_id)
        if not owners:
            return None
        return (f"voice {voice_id!r} was made for {owners[0].model.describe()}; model {loaded.name} cannot use it"
                " (add it to this model from its reference audio)")

    def check_owner(self, loaded: Any, voice_id: str) -> None:
        """InvalidRequest when `voice_id` is stored for another model only (`foreign_voice`)."""
        why = self.foreign_voice(loaded.name, voice_id)
        if why is not None:
            raise InvalidRequest(why)
