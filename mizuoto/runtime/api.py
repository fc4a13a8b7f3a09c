"""Runtime: the public API. Loads models with their engines, plans their memory, runs requests."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mizuoto.runtime.compute_threads import fix_compute_threads
from mizuoto.runtime.engine import (AudioChunk, Capabilities, Model, SynthesisRequest, Voice, check_request)
from mizuoto.runtime.hub import is_repo_id, resolve_model
from mizuoto.runtime.voicestore import ModelIdentity, SavedVoice, VoiceStore
from mizuoto.errors import (InvalidRequest, MemoryBudgetError, MizuotoError, ModelBusy, ModelLoadError,
                             ModelUnloaded, RequestCancelled, RequestTooLarge)
from mizuoto.runtime.executor import Executor
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.memory import Eviction, Plan, Pool, detect_budget, measure, parse_bytes, peak_of, plan_model
from mizuoto.runtime.options import LoadOptions, parse_options
from mizuoto.runtime.plugins import Registry, describe_error
from mizuoto.runtime.request import RequestInfo
from mizuoto.runtime.voices import Voices
from mizuoto.runtime.scheduler import Scheduler

log = logging.getLogger("mizuoto.runtime")
ROOM_POLL_S = 0.05  # how often a request waiting for memory held by other models looks again


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model as `Runtime.models()` lists it."""

    name: str
    engine: str
    variant: str | None
    path: Path
    device: str
    state: str  # "device" (active) | "host" (offloaded)
    strategy: str  # "resident" | "turns"
    capabilities: Capabilities
    batch_width: int = 1  # requests it runs at once (compute.batch, where its engine batches)
    running: int = 0  # requests running on it now
    loop_failures: int = 0  # failures of its compute loop itself (each answered to its waiters; the loop goes on)
    compute_pending: int = 0  # calls waiting on or running in its compute loop (Executor.pending)


@dataclass(frozen=True)
class Admission:
    """One model of a rehearsal: its plan (None when refused), why it was refused, what admitting it evicts."""

    model: str
    plan: Plan | None
    refused: str | None = None
    evictions: tuple[Eviction, ...] = ()


@dataclass(frozen=True)
class Rehearsal:
    """What loading the models on one device would do (`Runtime.rehearse`); nothing was moved."""

    device: str
    budget: int
    admissions: tuple[Admission, ...]
    in_use: int
    active: tuple[str, ...]
    offloaded: tuple[str, ...]


@dataclass
class _Loaded:
    name: str
    engine: str
    variant: str | None
    path: Path
    options: LoadOptions
    model: Model
    scheduler: Scheduler
    plan: Plan
    identity: ModelIdentity | None = None  # set when the model can import voices (see voicestore)
    admitted: bool = False  # admitted to its device once: until then its load may still fail (nothing pins it)
    # its stages' weights and fixed bytes as loaded: every plan reads these (buffers a model makes later, a
    # batch's scratch, must not change the figures one request is planned and refused with)
    sizes: tuple | None = None


def _device_key(device: str) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


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
        self.vram = None if vram is None else parse_bytes(vram)
        self.ram = None if ram is None else parse_bytes(ram)
        self.registry = Registry(entry_points=plugins, builtins=plugins)
        for engine in engines:
            self.registry.add(engine)
        # The lease authority: one lock owns the loaded set, the pins (leases holding a model against
        # eviction), the pools' admission and the models' placement targets. Nothing waits on a model
        # while holding it: modules move and evicted models close after it is released.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified when a lease lets go or a model goes
        self._models: dict[str, _Loaded] = {}
        self._pins: dict[str, set[Lease]] = {}  # model name -> the leases pinning it
        self._room_waits: dict[Lease, set[str]] = {}  # a lease waiting for room -> the pinned models in its way
        self._calls: dict[Lease, dict[str, int]] = {}  # a lease -> the working memory of its calls reserved now
        self._pools: dict[str, Pool] = {}
        self._gone: dict[str, str] = {}  # model name -> why it was unloaded by the runtime
        self.evictions = 0  # models offloaded or unloaded by the planner to admit others, so far
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

    def _loaded(self) -> list[_Loaded]:
        """The loaded models now, copied under the lock (a load or an eviction may change the set meanwhile)."""
        with self._lock:
            return list(self._models.values())

    def _run_alone(self, loaded: _Loaded, fn: Any, lease: Lease) -> Any:
        """fn() on the model's compute thread in the model's turn, waiting with the lease."""
        with self._turn(loaded, loaded.plan, None, lease):
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
                loaded = _Loaded(name, engine, variant, path, opts, model, None, None)
                loaded.scheduler = Scheduler(model, opts.device, name=name, executor=executor, cond=self._changed,
                                             room=functools.partial(self._reserve, loaded))
                loaded.plan = self._plan_for(loaded, None)
                self._models[name] = loaded
            # the model's compute loop (the loading thread, or its batch) is named after it; its condition is never
            # taken under the runtime's lock (lock order)
            loaded.scheduler.executor.rename(name)
            while not self._try_admit(loaded, loaded.plan, waitable=end is not None and time.monotonic() < end,
                                      lease=lease):
                self._wait_for_room(waiter)
        except BaseException:
            with self._lock:
                if loaded is not None and self._models.get(name) is loaded:
                    self._forget(loaded)
            if loaded is not None:
                loaded.scheduler.close()
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
            if self._pins.get(model) or loaded.scheduler.busy:
                raise ModelBusy(f"model {model} is running a request; finish or close it first")
            self._pool(loaded.options.device).release(loaded.name)
            self._forget(loaded)
        self._close(loaded)

    def _forget(self, loaded: _Loaded) -> None:
        """Take a model out of the loaded set (under the lock); `_close` it after the lock is released."""
        del self._models[loaded.name]
        self._pins.pop(loaded.name, None)
        self._changed.notify_all()

    @staticmethod
    def _close(loaded: _Loaded) -> None:
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
                self._pool(loaded.options.device).release(loaded.name)
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
            self._room_waits.pop(lease, None)
            self._calls.pop(lease, None)
            self._changed.notify_all()

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

    def _info(self, m: _Loaded) -> ModelInfo:
        return ModelInfo(m.name, m.engine, m.variant, m.path, m.options.device,
                         self._pool(m.options.device).state(m.name) or "host", m.plan.strategy,
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

    def _get(self, model: str) -> _Loaded:
        with self._lock:  # an unload or eviction beside it takes the model out of the set
            if model in self._models:
                return self._models[model]
            if model in self._gone:
                raise ModelUnloaded(f"model {model} was unloaded: {self._gone[model]}")
            raise InvalidRequest(f"no model {model!r} is loaded; loaded: {', '.join(self._models) or 'none'}")

    # ---- memory --------------------------------------------------------------------------------
    def _pool(self, device: str) -> Pool:
        key = _device_key(device)
        if key not in self._pools:
            self._pools[key] = self._new_pool(key, self.vram, self.ram)
        return self._pools[key]

    @staticmethod
    def _new_pool(device: str, vram: int | None, ram: int | None) -> Pool:
        """An empty pool for `device`: the budgets given, or what is free now."""
        ram = ram if ram is not None else detect_budget("cpu")
        if torch.device(device).type == "cpu":
            return Pool(ram, None)
        return Pool(vram if vram is not None else detect_budget(device), ram)

    def _plan_for(self, loaded: _Loaded, request: SynthesisRequest | None, stream: bool = False) -> Plan:
        """The plan for `request`, or for any request (streaming or not) when it is None."""
        budget = self._pool(loaded.options.device).device_budget
        if loaded.sizes is None:
            loaded.sizes = measure(loaded.model.stages, None, loaded.options.device)
        sizes = tuple(replace(size, working=stage.working_memory(request))
                      for size, stage in zip(loaded.sizes, loaded.model.stages))
        stream = request.stream if request is not None else stream
        return plan_model(loaded.name, sizes, budget, loaded.options.device, stream)

    def plan(self, model: str | None = None, stream: bool = False) -> Plan | dict[str, Plan]:
        """A model's plan for any request (its working-memory bound), or every loaded model's plan by name."""
        if model is None:
            return {m.name: self._plan_for(m, None, stream) for m in self._loaded()}
        return self._plan_for(self._get(model), None, stream)

    def rehearse(self, device: str | None = None, stream: bool = False, vram: str | int | None = None,
                 ram: str | int | None = None) -> Rehearsal:
        """What loading every loaded model on `device` would do, in load order: plans and evictions. Nothing moves.

        `device` defaults to where a request would run (CUDA when present, else the CPU); `vram` and
        `ram` default to the runtime's budgets. Planning a GPU that is not present needs a `vram` budget.
        """
        target = device if device is not None else parse_options().resolved().device
        vram = parse_bytes(vram) if vram is not None else self.vram
        ram = parse_bytes(ram) if ram is not None else self.ram
        kind = torch.device(target).type
        if kind != "cpu" and vram is None and not (kind == "cuda" and torch.cuda.is_available()):
            raise InvalidRequest(f"no {kind} device on this machine to read a budget from;"
                                 f" give a vram budget to plan for {target}")
        pool = self._new_pool(target, vram, ram)
        admissions = []
        with self._lock:
            for loaded in self._models.values():
                here = loaded.options.device == target
                sizes = measure(loaded.model.stages, None, target if here else None)
                try:
                    plan = plan_model(loaded.name, sizes, pool.device_budget, target, stream)
                    evictions = pool.admit(loaded.name, plan.peak, plan.fixed, plan.movable, plan.waiting)
                except MemoryBudgetError as e:
                    admissions.append(Admission(loaded.name, None, str(e)))
                    continue
                admissions.append(Admission(loaded.name, plan, None, tuple(evictions)))
        held = pool.order()
        return Rehearsal(target, pool.device_budget, tuple(admissions), pool.used()[0],
                         tuple(n for n in held if pool.state(n) == "device"),
                         tuple(n for n in held if pool.state(n) == "host"))

    def _try_admit(self, loaded: _Loaded, plan: Plan, others: int = 0, waitable: bool = False,
                   lease: Lease | None = None) -> bool:
        """Make room on the device for `plan` (+ `others`: what requests already running hold) and apply it
        (True). False when the room is held by models other leases pin and `waitable`; otherwise the
        MemoryBudgetError. With a `lease`, the model is pinned for it in the same step.

        Decided under the lock (membership, pins, the pool, the targets); the victims' moves and
        closes and this model's own moves happen after it is released.
        """
        victims: list[tuple[_Loaded, str]] = []
        with self._lock:
            if self._models.get(loaded.name) is not loaded:
                raise ModelUnloaded(f"model {loaded.name} was unloaded: {self._gone.get(loaded.name, 'by its owner')}")
            busy = {n for n, m in self._models.items()
                    if m is not loaded and (self._pins.get(n, set()) - {lease} or m.scheduler.busy)}
            pool = self._pool(loaded.options.device)
            try:
                evictions = pool.admit(loaded.name, plan.peak + others, plan.fixed, plan.movable, plan.waiting, busy)
            except MemoryBudgetError:
                if waitable and busy and plan.peak + others <= pool.device_budget:
                    if lease is not None:
                        self._check_cycle(loaded.name, lease, busy)
                        self._room_waits[lease] = busy
                    return False
                raise
            self._room_waits.pop(lease, None)
            self.evictions += len(evictions)
            for ev in evictions:
                victim = self._models[ev.model]
                if ev.action == "offload":
                    victim.scheduler.target = None
                else:
                    self._forget(victim)
                    self._gone[victim.name] = f"evicted to make room for {loaded.name}"
                victims.append((victim, ev.action))
            loaded.scheduler.target = plan
            loaded.admitted = True
            if lease is not None:
                self._pin(loaded.name, lease)
        for victim, action in victims:
            if action == "offload":
                victim.scheduler.sync()
            else:
                self._close(victim)
        loaded.scheduler.sync(lease)
        return True

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
            plan = self._plan_for(loaded, request)
        except MemoryBudgetError as e:  # the model fits; this request's working memory does not
            raise RequestTooLarge(f"request refused before it started: {e}") from None
        return self._stream(loaded, plan, request, lease if lease is not None else Lease(cancel=cancel))

    def _stream(self, loaded: _Loaded, plan: Plan, request: SynthesisRequest, lease: Lease) -> Iterator[AudioChunk]:
        lease.plan = plan
        try:
            with self._turn(loaded, plan, request, lease):
                try:
                    yield from loaded.scheduler.execute(request, lease)
                except BaseException as e:  # its reason once it has finished (Runtime.requests)
                    if not isinstance(e, GeneratorExit) and not (isinstance(e, RequestCancelled) and lease.cancelled):
                        loaded.scheduler.failed(lease, e)  # a cancel or deadline: its lease says how it ended
                    raise
        finally:
            lease.release()

    @contextlib.contextmanager
    def _turn(self, loaded: _Loaded, plan: Plan, request: SynthesisRequest | None, lease: Lease) -> Iterator[None]:
        """Pin the model for the lease, hold it, make room for `plan` and apply it.

        A batched model runs several requests at once: one joins only while every request running,
        itself included, still fits its plan's peak beside the others' sequence-stage working memory
        (their KV caches) in the device budget; the model is admitted for what they need together.
        When the room is held by models other requests pin, the request waits for them, holding
        its pin and its place in the model's line (no later request on the model overtakes it), until
        its lease's cancel or deadline.
        """
        reserve, budget, bound = 0, None, None
        if loaded.model.batch_width > 1 and request is not None:
            budget = self._pool(loaded.options.device).device_budget
            reserve = sum(s.working_memory(request) for s in loaded.model.stages if s.kind == "sequence")
            bound = self._bound_peak(loaded, plan, request)
        with self._lock:
            if self._models.get(loaded.name) is not loaded:
                raise ModelUnloaded(f"model {loaded.name} was unloaded: "
                                    f"{self._gone.get(loaded.name, 'by its owner')}")
            if not loaded.admitted:  # its load may still fail, taking the model away from under the request
                raise InvalidRequest(f"model {loaded.name} is still loading; use it once load() has returned")
            self._pin(loaded.name, lease)
        try:
            while True:
                with loaded.scheduler.hold(lease, f"model {loaded.name}", reserve, plan.peak, budget, bound):
                    others = loaded.scheduler.together() - plan.peak
                    if self._try_admit(loaded, plan, others, waitable=True, lease=lease):
                        try:
                            yield
                        finally:
                            with self._changed:
                                self._changed.notify_all()
                        return
                    loaded.scheduler.keep_place(lease)  # no later request on this model overtakes it meanwhile
                self._wait_for_room(lease)
        finally:
            loaded.scheduler.leave_line(lease)

    @contextlib.contextmanager
    def _reserve(self, loaded: _Loaded, stage: str, lease: Lease, working: int, sizes: dict) -> Iterator[None]:
        """Room for one `stage` call of `working` bytes beside what `lease` was admitted with, for the block.

        The request's plan is made again with the figures of its calls reserved now (its placement
        may change to make room) and admitted as `_turn` admits it: evicting idle models, or waiting
        for room other requests hold, until the lease's end. A reservation inside another one for
        the same stage that it covers adds nothing (a batched model's call reserved by its request's
        thread, then entered again on the compute loop, never waits there). A call the budget can
        never hold is RequestTooLarge, before it runs. After the block the request's plan is back to
        what its other open reservations need.
        """
        base = lease.plan
        if base is None or lease.model != loaded.name:
            yield  # not a runtime request
            return
        with self._lock:
            held = self._calls.setdefault(lease, {})
            covered = working <= max(held.get(stage, 0), base.stage(stage).working)
            if not covered:
                previous, held[stage] = held.get(stage), working
        if covered:
            yield
            return
        try:
            # on a batched model's compute loop nothing may wait (every other row would wait with it):
            # room is made there only by evicting idle models
            on_loop = loaded.model.batch_width > 1 and loaded.scheduler.executor.running_lease() is not None
            self._admit_held(loaded, self._call_plan(loaded, base, held, stage, sizes), lease, wait=not on_loop)
            yield
        finally:
            def let_go() -> None:
                with self._lock:
                    if previous is None:
                        held.pop(stage, None)
                    else:
                        held[stage] = previous
                    if not held:
                        self._calls.pop(lease, None)
                plan = self._call_plan(loaded, base, held, stage, sizes)
                loaded.scheduler.resize(lease, plan.peak)
                try:
                    self._try_admit(loaded, plan, loaded.scheduler.together() - plan.peak, lease=lease)
                except RequestCancelled:  # its modules move at the next sync or stage call
                    pass
                except MizuotoError as e:  # smaller than what was just admitted: only an unload beside it gets here
                    log.warning("%s: the request's plan after its %s call: %s", loaded.name, stage, e)
            # the call's memory stays reserved while it runs: a request that stopped waiting for a call still
            # on the compute loop lets go when that call has ended (on the loop's thread)
            lease.after_work(let_go)

    @staticmethod
    def _bound_peak(loaded: _Loaded, plan: Plan, request: SynthesisRequest) -> int:
        """The peak of `plan` with every stage at the most one of its calls may need (`Stage.bound_memory`)."""
        bounds = {s.name: s.bound_memory(request) for s in loaded.model.stages if s.bound_memory is not None}
        if not bounds:
            return plan.peak
        stages = tuple(replace(s, working=max(s.working, bounds.get(s.name, 0))) for s in plan.stages)
        return peak_of(stages, set(plan.pinned), plan.groups)

    @staticmethod
    def _call_plan(loaded: _Loaded, base: Plan, held: dict[str, int], stage: str, sizes: dict) -> Plan:
        """`base` with the working memory of the calls in `held` (RequestTooLarge when the budget cannot hold it)."""
        stages = tuple(replace(s, working=max(s.working, held[s.name])) if s.name in held else s for s in base.stages)
        try:
            return plan_model(loaded.name, stages, base.budget, loaded.options.device, base.stream)
        except MemoryBudgetError as e:
            sizes_text = ", ".join(f"{k} {v}" for k, v in sizes.items())
            raise RequestTooLarge(f"request refused at its {stage} call ({sizes_text}): {e}") from None

    def _admit_held(self, loaded: _Loaded, plan: Plan, lease: Lease, wait: bool = True) -> None:
        """Admit a held model for `plan` beside the requests running with it, waiting for room until the lease
        ends (`wait=False`: MemoryBudgetError at once when only others' requests could make room)."""
        loaded.scheduler.resize(lease, plan.peak, self._pool(loaded.options.device).device_budget, wait)
        while not self._try_admit(loaded, plan, loaded.scheduler.together() - plan.peak, waitable=wait, lease=lease):
            self._wait_for_room(lease)

    def _check_cycle(self, name: str, lease: Lease, busy: set[str]) -> None:
        """MemoryBudgetError when the models in the way are pinned by requests that themselves wait for room a
        model this lease pins holds (under the lock): each would wait for the other until its deadline."""
        mine, seen, todo = {m for m, pins in self._pins.items() if lease in pins}, set(), list(busy)
        while todo:
            for other in self._pins.get(todo.pop(), set()) - {lease} - seen:
                seen.add(other)
                waits = self._room_waits.get(other, set()) if not other.cancelled else set()
                if waits & mine:
                    raise MemoryBudgetError(
                        f"model {name} waits for memory held by {', '.join(sorted(busy))}, whose requests wait for "
                        f"memory this one holds; it gives way (retry, or raise the budget)")
                todo.extend(waits)

    def _wait_for_room(self, lease: Lease) -> None:
        """Wait a little for a lease to let go of a model (the lease's end: RequestCancelled)."""
        where = "while waiting for memory held by other models"
        with self._changed:
            lease.check(where)
            self._changed.wait(ROOM_POLL_S)
        lease.check(where)


__all__ = ["Runtime", "ModelInfo", "Admission", "Rehearsal", "RequestInfo", "SynthesisRequest", "MemoryBudgetError"]
