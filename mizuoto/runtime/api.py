"""Runtime: the public API. Loads models with their engines, plans their memory, runs requests."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mizuoto.runtime.admission import Admission, MemoryManager, Rehearsal
from mizuoto.runtime.compute_threads import fix_compute_threads
from mizuoto.runtime.engine import AudioChunk, Model, SynthesisRequest, Voice, check_request
from mizuoto.runtime.hub import is_repo_id, resolve_model
from mizuoto.runtime.voicestore import ModelIdentity, SavedVoice, VoiceStore
from mizuoto.errors import (InvalidRequest, MemoryBudgetError, MizuotoError, ModelBusy, ModelLoadError,
                             ModelUnloaded, RequestCancelled, RequestTooLarge)
from mizuoto.runtime.executor import Executor
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.loaded import LoadedModel, ModelInfo
from mizuoto.runtime.memory import Eviction, Plan, parse_bytes
from mizuoto.runtime.options import parse_options
from mizuoto.runtime.plugins import Registry, describe_error
from mizuoto.runtime.request import RequestInfo
from mizuoto.runtime.voices import Voices
from mizuoto.runtime.scheduler import Scheduler


class Runtime:
    """Hosts models of any registered engine within device (`vram`) and host (`ram`) budgets.

    Budgets are sizes like "6GiB" or byte counts; None means what is free when a device is first used.
    `engines` adds Engine classes beside the plugins; `plugins=False` uses only those.
    `voices` is where cached voices persist (default `$MIZUOTO_VOICE_STORE` or `$MIZUOTO_HOME/voices`, read now);
    False keeps them in memory. `threads` is torch's intra-op thread count for the process (default
    `$MIZUOTO_THREADS`, else torch's current count), set now so that results are the same bits in
    every process and thread at that count (`runtime.compute_threads`).
    """

    def __init__(self, vram: str | int | None = None, ram: str | int | None = None, engines: tuple = (),
                 plugins: bool = True, voices: str | Path | bool | None = None, threads: int | None = None):
        # First: the compute threads' settings decide the last bits of every result (compute_threads)
        self.threads = fix_compute_threads(threads)
        vram, ram = (None if b is None else parse_bytes(b) for b in (vram, ram))
        self.registry = Registry(entry_points=plugins, builtins=plugins)
        for engine in engines:
            self.registry.add(engine)
        # The lease authority: one lock owns the loaded set, the pins (leases holding a model against
        # eviction), and, through the memory manager that shares it, the pools' admission and the models'
        # placement targets. Nothing waits on a model while holding it: modules move and evicted models
        # close after it is released.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified when a lease lets go or a model goes
        self._models: dict[str, LoadedModel] = {}
        self._pins: dict[str, set[Lease]] = {}  # model name -> the leases pinning it
        self._gone: dict[str, str] = {}  # model name -> why it was unloaded by the runtime
        # budgets, pools, plans, admission and call reservations: decided under this runtime's lock
        self.memory = MemoryManager(self._changed, vram, ram, loaded=self._loaded, pins=self._pin_sets,
                                    current=self._current, evict=self._evict, pin=self._pin, wake=self._wake_lines)
        self.closed = False  # close() was called: loads are refused, a load finishing late is closed
        # loading threads whose load a cancelled request left: each closes what it loaded and ends; joined at close()
        self._abandoned: list[Executor] = []
        self._loading: set[Executor] = set()  # loading threads of loads in progress
        if voices is None or voices is True:
            from mizuoto.runtime.assets import voices_dir

            voices = voices_dir()
        self.voice_store = VoiceStore(voices) if voices is not False else None
        self.voice_service = Voices(self.voice_store, self._get, self._loaded, self._run_alone)

    # ---- voices (runtime.voices.Voices) ------------------------------------------------------
    def add_voice(self, model: str, voice_id: str, ref_audio: Any, ref_text: str | None = None,
                  persist: bool = True, lease: Lease | None = None) -> Voice:
        """Cache a voice prompt on the model for later requests by id, stored unless `persist` is False (Voices)."""
        return self.voice_service.add_voice(model, voice_id, ref_audio, ref_text, persist, lease)

    def remove_voice(self, voice_id: str, model: str | None = None) -> int:
        """Forget a cached voice on `model` (or everywhere) and in the store; copies removed (`Voices.remove_voice`)."""
        return self.voice_service.remove_voice(voice_id, model)

    def identity(self, model: str) -> ModelIdentity | None:
        """What a loaded model's stored voices are keyed by (None when its voices are not stored)."""
        return self.voice_service.identity(model)

    def stored_voices(self) -> list[SavedVoice]:
        """Every voice in the store, for any model (loaded or not), oldest first."""
        return self.voice_service.stored_voices()

    def foreign_voice(self, model: str, voice_id: str) -> str | None:
        """Why `model` cannot use `voice_id` when that id is stored for another model only; else None."""
        return self.voice_service.foreign_voice(model, voice_id)

    def _loaded(self) -> list[LoadedModel]:
        """The loaded models now, copied under the lock (a load or an eviction may change the set meanwhile)."""
        with self._lock:
            return list(self._models.values())

    def _run_alone(self, loaded: LoadedModel, fn: Any, lease: Lease) -> Any:
        """fn() on the model's compute thread in the model's turn, waiting with the lease."""
        with self.memory.turn(loaded, loaded.plan, None, lease):
            return loaded.scheduler.executor.call(fn, lease)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engines -------------------------------------------------------------------------------
    def engines(self) -> dict[str, type]:
        """Importable engines by name; the others are in `failures`."""
        return self.registry.load_all()

    @property
    def failures(self) -> list:
        """Plugins and engines that failed to load, with their errors."""
        return self.registry.failures

    def detect(self, path: str | Path) -> list[tuple[str, str | None]]:
        """(engine, variant) of every engine that recognises `path` (a directory or a repo id)."""
        return self.registry.detect(resolve_model(path))

    # ---- models --------------------------------------------------------------------------------
    def load(self, path: str | Path, engine: str | None = None, name: str | None = None, *,
             wait: float | None = None, lease: Lease | None = None, **options: Any) -> str:
        """Load a model directory (or a Hugging Face repo id `org/name[@rev]`) and return its name.

        The engine is detected unless given; a repo id is the default name of its model. When the
        memory it needs is held by models running requests in other threads, `wait` seconds are
        given to those to finish (None: fail at once with MemoryBudgetError). With a `lease`, the
        model is pinned for it as it is admitted (no other request can evict it before it runs),
        and its cancel or deadline ends the wait.
        """
        self._check_open()
        opts = parse_options(**options).resolved()
        if name is None and isinstance(path, str) and is_repo_id(path):
            name = path.partition("@")[0]
        path = resolve_model(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        picked, checked = self.registry.detect_report(path, engine)
        if not picked:
            if engine is not None:
                raise ModelLoadError(f"engine {engine!r} does not recognise {path} ({checked[0]})")
            raise ModelLoadError(f"no engine recognises {path} (checked: {'; '.join(checked)})")
        if len(picked) > 1:
            raise ModelLoadError(f"{path} is recognised by several engines ({', '.join(h[0] for h in picked)});"
                                 " choose one with engine=...")
        engine, variant = picked[0]
        # The load runs on the thread that will compute for the model (its OpenMP team is then the
        # only one its requests meet; docs/performance.md, "Threads"); a batching model runs on its batch
        # loop (made as it loads, Model.batch_loop), and the loading thread ends.
        executor = Executor(f"loading-{path.name}")
        with self._lock:
            self._check_open()
            self._loading.add(executor)  # close() joins it
        try:
            def build() -> Any:
                made = self.registry.engine_class(engine)().load(path, opts)
                if isinstance(made, Model):
                    made.batch_loop()  # a batching model's batch is made (its layers packed) as it loads
                return made
            model = self._load_on(executor, build, lease)
            if not isinstance(model, Model):
                raise ModelLoadError(f"engine {engine!r} returned a {type(model).__name__}, not a Model")
        except BaseException as e:
            if not isinstance(e, RequestCancelled):  # a cancelled load's thread ends on its own (_load_on)
                executor.close()
            if isinstance(e, MizuotoError) or not isinstance(e, Exception):
                raise
            raise ModelLoadError(f"engine {engine!r} failed to load {path}: {describe_error(e)}") from e
        finally:
            with self._lock:
                self._loading.discard(executor)
        if model.executor is not None:
            executor.close()
            executor = None
        end = None if wait is None else time.monotonic() + wait
        waiter = lease if lease is not None else Lease(wait)
        loaded = None
        try:
            with self._lock:
                self._check_open()  # close() came while the engine loaded: the model goes
                name = self._unique(name or self.registry.engine_class(engine).model_name(path))
                loaded = LoadedModel(name, engine, variant, path, opts, model, None, None)
                loaded.scheduler = Scheduler(model, opts.device, name=name, executor=executor, cond=self._changed,
                                             room=functools.partial(self.memory.reserve, loaded),
                                             released=self.memory.freed)
                loaded.plan = self.memory.plan_for(loaded, None)
                self._models[name] = loaded
            # the model's compute loop (the loading thread, or its batch) is named after it; its condition is never
            # taken under the runtime's lock (lock order)
            loaded.scheduler.executor.rename(name)
            while True:
                since = self.memory.since()
                if self.memory.try_admit(loaded, loaded.plan, waitable=end is not None and time.monotonic() < end,
                                         lease=lease):
                    break
                self.memory.wait_for_room(waiter, since, end)
        except BaseException:
            with self._lock:
                if loaded is not None and self._models.get(name) is loaded:
                    self.memory.release(loaded)  # admitted before its modules failed to move: its room goes too
                    self._forget(loaded)
            if loaded is not None:
                loaded.scheduler.close()
                self.memory.freed()  # its room, if it was admitted, is free again
            elif executor is not None:
                executor.close()
            model.close()
            raise
        self.voice_service.restore(loaded)
        return name

    def _load_on(self, executor: Executor, load: Any, lease: Lease | None) -> Model:
        """load() on the loading thread, waited for until the lease's end; a load its request left goes on
        there, and that thread closes what it loaded and ends (joined by close())."""
        job = executor.post(load, lease, "load")
        try:
            executor.wait_for(job.done, lease, "while its model loaded")
        except RequestCancelled:
            def discard() -> None:
                if isinstance(job.result, Model):
                    job.result.close()
                executor.close()  # on its own thread: the loop ends after this call
            with self._lock:
                self._abandoned.append(executor)
            executor.post(discard, None, "discard")
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def _check_open(self) -> None:
        if self.closed:
            raise ModelLoadError("the runtime was closed; make a new Runtime to load models")

    def _unique(self, base: str) -> str:
        name, i = base, 2
        while name in self._models:
            name, i = f"{base}-{i}", i + 1
        self._gone.pop(name, None)
        return name

    def unload(self, model: str) -> None:
        """Close a model and free its memory."""
        with self._lock:
            loaded = self._get(model)
            if not loaded.admitted:  # its load owns it until it returns, and closes it if it fails
                raise ModelBusy(f"model {model} is still loading; unload it once load() has returned")
            if self._pins.get(model) or loaded.scheduler.busy:
                raise ModelBusy(f"model {model} is running a request; finish or close it first")
            self.memory.release(loaded)
            self._forget(loaded)
        self._close(loaded)
        self.memory.freed()  # its room is free: another model's first in line may fit now

    def _forget(self, loaded: LoadedModel) -> None:
        """Take a model out of the loaded set (under the lock); `_close` it after the lock is released."""
        del self._models[loaded.name]
        self._pins.pop(loaded.name, None)
        self._changed.notify_all()

    def _current(self, loaded: LoadedModel) -> None:
        """ModelUnloaded unless `loaded` is in the loaded set now (a load of the same name later is another)."""
        with self._lock:
            if self._models.get(loaded.name) is not loaded:
                raise ModelUnloaded(f"model {loaded.name} was unloaded: {self._gone.get(loaded.name, 'by its owner')}")

    def _evict(self, eviction: Eviction, by: str) -> Callable[[], None]:
        """Take a model out as the memory manager evicts it to admit `by` (under the lock); returns its move or
        close, which the manager runs after the lock is released."""
        victim = self._models[eviction.model]
        if eviction.action == "offload":
            victim.scheduler.target = None
            return victim.scheduler.sync
        self._forget(victim)
        self._gone[victim.name] = f"evicted to make room for {by}"
        return functools.partial(self._close, victim)

    @staticmethod
    def _close(loaded: LoadedModel) -> None:
        """Stop the model's executor and close it (joins what they started; outside the lock)."""
        loaded.scheduler.close()
        loaded.model.close()

    def close(self) -> None:
        """Cancel the requests still running, then unload every model (joining their threads); loads are refused
        from now on, and one still running is closed when it ends."""
        with self._lock:
            self.closed = True
            abandoned, self._abandoned = self._abandoned + list(self._loading), []
            leases = [lease for pins in self._pins.values() for lease in pins]
            dropped = list(self._models.values())
            for loaded in dropped:
                self.memory.release(loaded)
                self._forget(loaded)
        for lease in leases:
            lease.cancel("because the runtime is closing")
        for loaded in dropped:
            self._close(loaded)
        for executor in abandoned:
            executor.close()  # joins it: its load ends, then the model it made is closed

    # ---- leases --------------------------------------------------------------------------------
    def pin(self, model: str, lease: Lease) -> bool:
        """Pin a loaded model for `lease` until it is released (never evicted meanwhile); False if it is not
        loaded, or still loading (a load that then fails would take the pinned model with it)."""
        with self._lock:
            if model not in self._models or not self._models[model].admitted:
                return False
            self._pin(model, lease)
            return True

    def _pin(self, name: str, lease: Lease) -> None:
        pins = self._pins.setdefault(name, set())
        if lease in pins:
            return
        pins.add(lease)
        lease.model = name
        lease.on_release(lambda: self._unpin(name, lease))

    def _unpin(self, name: str, lease: Lease) -> None:
        with self._changed:
            pins = self._pins.get(name)
            if pins is not None:
                pins.discard(lease)
            self.memory.released(lease)
            self._changed.notify_all()
        self.memory.freed()  # what it pinned may be what another model's first in line waits for

    def _wake_lines(self) -> None:
        """Have every loaded model's loop look at its line again (memory was let go); never under the lock."""
        for loaded in self._loaded():
            loaded.scheduler.wake()

    def _pin_sets(self) -> dict[str, set[Lease]]:
        """The leases pinning each model, copied under the lock (for the memory manager)."""
        with self._lock:
            return {name: set(pins) for name, pins in self._pins.items()}

    def pins(self, model: str) -> int:
        """Leases pinning a model now (requests admitted to it and not yet ended)."""
        with self._lock:
            return len(self._pins.get(model, ()))

    def models(self) -> list[ModelInfo]:
        """The loaded models (as they were when called: a load or an eviction beside it changes the next call's)."""
        return [self._info(m) for m in self._loaded()]  # one copy: a load or an eviction may change the set meanwhile

    def info(self, model: str) -> ModelInfo:
        """What a loaded model is and where it stands."""
        return self._info(self._get(model))

    def _info(self, m: LoadedModel) -> ModelInfo:
        return ModelInfo(m.name, m.engine, m.variant, m.path, m.options.device,
                         self.memory.pool(m.options.device).state(m.name) or "host", m.plan.strategy,
                         m.model.capabilities, m.model.batch_width, m.scheduler.running,
                         m.scheduler.executor.failures, m.scheduler.executor.pending())

    def requests(self, model: str | None = None, finished: bool = False) -> list[RequestInfo]:
        """The requests in line or holding a model (every loaded model's without one), each with its status and
        the stage it runs now (`runtime.request`); with `finished`, each model's last ended ones and how they ended."""
        targets = [self._get(model)] if model is not None else self._loaded()
        return [info for loaded in targets for info in loaded.scheduler.requests(finished)]

    def model(self, model: str) -> Model:
        """The engine's Model object of a loaded model (its stages, capabilities)."""
        return self._get(model).model

    def voices(self, model: str) -> list[Voice]:
        """Preset and cached voices of a model."""
        return self._get(model).model.voices()

    def _get(self, model: str) -> LoadedModel:
        with self._lock:  # an unload or eviction beside it takes the model out of the set
            if model in self._models:
                return self._models[model]
            if model in self._gone:
                raise ModelUnloaded(f"model {model} was unloaded: {self._gone[model]}")
            raise InvalidRequest(f"no model {model!r} is loaded; loaded: {', '.join(self._models) or 'none'}")

    # ---- memory (runtime.admission.MemoryManager) ----------------------------------------------
    @property
    def vram(self) -> int | None:
        """The device budget in bytes (None: what is free when a device is first used)."""
        return self.memory.vram

    @property
    def ram(self) -> int | None:
        """The host budget in bytes (None: what is free when it is first used)."""
        return self.memory.ram

    @property
    def evictions(self) -> int:
        """Models offloaded or unloaded by the planner to admit others, so far."""
        return self.memory.evictions

    def plan(self, model: str | None = None, stream: bool = False) -> Plan | dict[str, Plan]:
        """A model's plan for any request (its working-memory bound), or every loaded model's plan by name."""
        if model is None:
            return {m.name: self.memory.plan_for(m, None, stream) for m in self._loaded()}
        return self.memory.plan_for(self._get(model), None, stream)

    def rehearse(self, device: str | None = None, stream: bool = False, vram: str | int | None = None,
                 ram: str | int | None = None) -> Rehearsal:
        """What loading every loaded model on `device` would do, in load order: plans and evictions. Nothing moves.

        `device` defaults to where a request would run (CUDA when present, else the CPU); `vram` and
        `ram` default to the runtime's budgets. Planning a GPU that is not present needs a `vram` budget.
        """
        return self.memory.rehearse(device, stream, vram, ram)

    # ---- requests ------------------------------------------------------------------------------
    def synthesize(self, model: str, request: Any = None, *, cancel: threading.Event | None = None,
                   lease: Lease | None = None, **fields: Any) -> Iterator[AudioChunk]:
        """Check the request now, then return an iterator of audio chunks (run as it is consumed).

        `request` is a SynthesisRequest, or the text (string or iterator of pieces) with `fields` beside it.
        Setting `cancel` (from any thread) stops the request at its next stage call with
        RequestCancelled, even inside a non-streaming request's single chunk. A `lease` (instead of
        `cancel`) carries the request's cancel and deadline into every wait; it may already pin the
        model (`pin`). The request ends, and the lease is released, when the iterator ends or is closed.
        """
        if lease is not None and cancel is not None:
            raise InvalidRequest("pass either cancel or a lease, not both")
        if not isinstance(request, SynthesisRequest):  # text (a string or an iterator of pieces) or None
            try:
                request = SynthesisRequest(text=request, **fields)
            except TypeError as e:
                raise InvalidRequest(f"bad request field: {e}") from None
        elif fields:
            raise InvalidRequest("pass either a SynthesisRequest or fields, not both")
        loaded = self._get(model)
        if isinstance(request.voice, str):
            self.voice_service.check_owner(loaded, request.voice)
        request = check_request(request, loaded.model, f"model {model}")
        try:
            plan = self.memory.plan_for(loaded, request)
        except MemoryBudgetError as e:  # the model fits; this request's working memory does not
            raise RequestTooLarge(f"request refused before it started: {e}") from None
        return self._stream(loaded, plan, request, lease if lease is not None else Lease(cancel=cancel))

    def _stream(self, loaded: LoadedModel, plan: Plan, request: SynthesisRequest, lease: Lease) -> Iterator[AudioChunk]:
        lease.plan = plan
        try:
            with self.memory.turn(loaded, plan, request, lease):
                try:
                    yield from loaded.scheduler.execute(request, lease)
                except BaseException as e:  # its reason once it has finished (Runtime.requests)
                    if not isinstance(e, GeneratorExit) and not (isinstance(e, RequestCancelled) and lease.cancelled):
                        loaded.scheduler.failed(lease, e)  # a cancel or deadline: its lease says how it ended
                    raise
        finally:
            lease.release()


__all__ = ["Runtime", "ModelInfo", "Admission", "Rehearsal", "RequestInfo", "SynthesisRequest", "MemoryBudgetError"]
