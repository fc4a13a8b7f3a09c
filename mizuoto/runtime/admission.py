"""The runtime's memory manager: device pools and budgets, plans, admission, call reservations, evictions.

A `Runtime` holds one `MemoryManager`, and the scheduler of each model it loads reserves a stage
call's memory through it (`reserve`, the scheduler's `room`). The manager takes no lock of its own:
it is given the runtime's condition, whose lock owns the loaded set, the pins, the pools and the
models' placement targets together (docs/architecture.md, "Locks"). It decides under that lock and
acts after releasing it (modules move, evicted models close). It sees the runtime's models only
through what it is given: the loaded models (`loaded`), the leases pinning each (`pins`), a check
that a model is still loaded (`current`), the runtime's bookkeeping of one eviction (`evict`) and
a pin (`pin`); it reads no private state of the runtime.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from mizuoto.errors import InvalidRequest, MemoryBudgetError, MizuotoError, RequestCancelled, RequestTooLarge
from mizuoto.runtime.engine import SynthesisRequest
from mizuoto.runtime.executor import RoomLater
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.loaded import LoadedModel
from mizuoto.runtime.memory import Eviction, Plan, Pool, detect_budget, measure, parse_bytes, peak_of, plan_model
from mizuoto.runtime.options import parse_options

log = logging.getLogger("mizuoto.runtime")


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


def _device_key(device: str) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


class MemoryManager:
    """Plans and admits a runtime's models within its device (`vram`) and host (`ram`) budgets, in bytes.

    A model is the runtime's record of it (`runtime.loaded.LoadedModel`); its `sizes` are measured
    at its first plan here, and it is marked `admitted` once first admitted here. `cond` is the
    runtime's condition (its lock shared, never held across a model call or a module move);
    `loaded()` the records loaded now; `pins()` a copy of the leases pinning each model, by name;
    `current(record)` raises ModelUnloaded when the record is no longer the loaded one;
    `evict(eviction, by)` takes a model out for an eviction that admits `by` (under the lock) and
    returns its move or close, run after the lock is released; `pin(name, lease)` pins a model;
    `wake()` has every model's loop look at its line again (called after memory was let go, outside the lock).
    """

    def __init__(self, cond: threading.Condition, vram: int | None, ram: int | None, *,
                 loaded: Callable[[], list[LoadedModel]], pins: Callable[[], dict[str, set[Lease]]],
                 current: Callable[[LoadedModel], None], evict: Callable[[Eviction, str], Callable[[], None]],
                 pin: Callable[[str, Lease], None], wake: Callable[[], None] = lambda: None) -> None:
        self.vram, self.ram = vram, ram  # None: what is free when a device is first used
        self._cond = cond
        self._loaded, self._pins, self._current, self._evict, self._pin = loaded, pins, current, evict, pin
        self._wake = wake  # every model's line looks again (memory was let go); called outside the lock
        self._freed = 0  # memory let go so far (`freed`): a wait for room ends when it moves
        self._pools: dict[str, Pool] = {}
        self._room_waits: dict[Lease, set[str]] = {}  # a lease waiting for room -> the pinned models in its way
        self._calls: dict[Lease, dict[str, int]] = {}  # a lease -> the working memory of its calls reserved now
        self.evictions = 0  # models offloaded or unloaded to admit others, so far

    # ---- pools and plans -----------------------------------------------------------------------
    def pool(self, device: str) -> Pool:
        """The pool of `device`, made with the runtime's budgets when it is first used."""
        key = _device_key(device)
        with self._cond:  # two first users of a device would each make one, and admit into different pools
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

    def release(self, loaded: LoadedModel) -> None:
        """Forget a model's admission (under the lock, as it leaves the loaded set)."""
        self.pool(loaded.options.device).release(loaded.name)

    def released(self, lease: Lease) -> None:
        """Forget a released lease's wait for room and its call reservations (under the lock)."""
        self._room_waits.pop(lease, None)
        self._calls.pop(lease, None)

    def plan_for(self, loaded: LoadedModel, request: SynthesisRequest | None, stream: bool = False) -> Plan:
        """The plan for `request`, or for any request (streaming or not) when it is None."""
        budget = self.pool(loaded.options.device).device_budget
        if loaded.sizes is None:
            loaded.sizes = measure(loaded.model.stages, None, loaded.options.device)
        sizes = tuple(replace(size, working=stage.working_memory(request))
                      for size, stage in zip(loaded.sizes, loaded.model.stages))
        stream = request.stream if request is not None else stream
        return plan_model(loaded.name, sizes, budget, loaded.options.device, stream)

    def rehearse(self, device: str | None, stream: bool, vram: str | int | None, ram: str | int | None) -> Rehearsal:
        """What loading every loaded model on `device` would do, in load order (`Runtime.rehearse`)."""
        target = device if device is not None else parse_options().resolved().device
        vram = parse_bytes(vram) if vram is not None else self.vram
        ram = parse_bytes(ram) if ram is not None else self.ram
        kind = torch.device(target).type
        if kind != "cpu" and vram is None and not (kind == "cuda" and torch.cuda.is_available()):
            raise InvalidRequest(f"no {kind} device on this machine to read a budget from;"
                                 f" give a vram budget to plan for {target}")
        pool = self._new_pool(target, vram, ram)
        admissions = []
        with self._cond:
            for loaded in self._loaded():
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

    # ---- admission -----------------------------------------------------------------------------
    def try_admit(self, loaded: LoadedModel, plan: Plan, others: int = 0, waitable: bool = False,
                  lease: Lease | None = None, evict: bool = True) -> bool:
        """Make room on the device for `plan` (+ `others`: what requests already running hold) and apply it
        (True). False when the room is held by models other leases pin and `waitable`; otherwise the
        MemoryBudgetError. With a `lease`, the model is pinned for it in the same step. Without `evict`,
        no other model is moved or closed for it (MemoryBudgetError when that would be needed).

        Decided under the lock (membership, pins, the pool, the targets); the victims' moves and
        closes and this model's own moves happen after it is released.
        """
        with self._cond:
            self._current(loaded)
            pins = self._pins()
            busy = {m.name for m in self._loaded()
                    if m is not loaded and (not evict or pins.get(m.name, set()) - {lease} or m.scheduler.busy)}
            pool = self.pool(loaded.options.device)
            try:
                evictions = pool.admit(loaded.name, plan.peak + others, plan.fixed, plan.movable, plan.waiting, busy)
            except MemoryBudgetError:
                if waitable and busy and plan.peak + others <= pool.device_budget:
                    if lease is not None:
                        self._check_cycle(loaded.name, lease, busy, pins)
                        self._room_waits[lease] = busy
                    return False
                raise
            self._room_waits.pop(lease, None)
            self.evictions += len(evictions)
            after = [self._evict(ev, loaded.name) for ev in evictions]  # each victim's move or close
            loaded.scheduler.target = plan
            loaded.admitted = True
            if lease is not None:
                self._pin(loaded.name, lease)
        for act in after:
            act()
        loaded.scheduler.sync(lease)
        return True

    @contextlib.contextmanager
    def turn(self, loaded: LoadedModel, plan: Plan, request: SynthesisRequest | None, lease: Lease) -> Iterator[None]:
        """Pin the model for the lease and have its loop admit the request: hold it, make room for `plan`, apply it.

        A batched model runs several requests at once: one joins only while every request running,
        itself included, still fits its plan's peak beside the others' sequence-stage working memory
        (their KV caches) in the device budget; the model is admitted for what they need together.
        When the room is held by models other requests pin, the request waits for them at the head of
        its model's line, holding its pin (no later request on the model overtakes it), until its
        lease's cancel or deadline; the loop tries again whenever a request anywhere lets go.
        """
        reserve, budget, bound = 0, None, None
        if loaded.model.batch_width > 1 and request is not None:
            budget = self.pool(loaded.options.device).device_budget
            reserve = sum(s.working_memory(request) for s in loaded.model.stages if s.kind == "sequence")
            bound = self._bound_peak(loaded, plan, request)
        with self._cond:
            self._current(loaded)
            if not loaded.admitted:  # its load may still fail, taking the model away from under the request
                raise InvalidRequest(f"model {loaded.name} is still loading; use it once load() has returned")
            self._pin(loaded.name, lease)

        def admit(others: int) -> bool:  # on the model's loop (Scheduler.schedule)
            return self.try_admit(loaded, plan, others, waitable=True, lease=lease)
        with loaded.scheduler.hold(lease, f"model {loaded.name}", reserve, plan.peak, budget, bound, admit=admit):
            try:
                yield
            finally:
                with self._cond:
                    self._cond.notify_all()

    def _admit_held(self, loaded: LoadedModel, plan: Plan, lease: Lease, aside: bool = False) -> None:
        """Admit a held model for `plan` beside the requests running with it, waiting for room until the lease
        ends (`aside`, on a compute loop: RoomLater at once when only others' requests could make room)."""
        loaded.scheduler.resize(lease, plan.peak, self.pool(loaded.options.device).device_budget, wait=not aside)
        while True:
            since = self.since()
            if self.try_admit(loaded, plan, loaded.scheduler.together() - plan.peak, waitable=True, lease=lease):
                return
            if aside:
                raise RoomLater(f"model {loaded.name}: room held by other models' requests")
            self.wait_for_room(lease, since)

    def _check_cycle(self, name: str, lease: Lease, busy: set[str], pins: dict[str, set[Lease]]) -> None:
        """MemoryBudgetError when the models in the way are pinned by requests that themselves wait for room a
        model this lease pins holds (under the lock): each would wait for the other until its deadline."""
        mine, seen, todo = {m for m, held in pins.items() if lease in held}, set(), list(busy)
        while todo:
            for other in pins.get(todo.pop(), set()) - {lease} - seen:
                seen.add(other)
                waits = self._room_waits.get(other, set()) if not other.cancelled else set()
                if waits & mine:
                    raise MemoryBudgetError(
                        f"model {name} waits for memory held by {', '.join(sorted(busy))}, whose requests wait for "
                        f"memory this one holds; it gives way (retry, or raise the budget)")
                todo.extend(waits)

    def since(self) -> int:
        """How often memory was let go so far: read it before a `try_admit`, and wait for room from it."""
        return self._freed

    def freed(self) -> None:
        """Memory was let go (a lease released, a request ended, a model or a call's room gone): every wait for
        room looks again, and every model's loop looks at its line. Never under the lock."""
        with self._cond:
            self._freed += 1
            self._cond.notify_all()
        self._wake()

    def wait_for_room(self, lease: Lease, since: int, until: float | None = None) -> None:
        """Until memory is let go after `since` (`freed`), the monotonic time `until`, or the lease's end
        (RequestCancelled): it looks again when something let go, never on a timer."""
        def ready() -> bool:
            return self._freed != since or (until is not None and time.monotonic() >= until)
        with self._cond:
            lease.wait_for(self._cond, ready, "while waiting for memory held by other models")

    # ---- call reservations (Model.room) ----------------------------------------------------------
    @contextlib.contextmanager
    def reserve(self, loaded: LoadedModel, stage: str, lease: Lease, working: int, sizes: dict) -> Iterator[None]:
        """Room for one `stage` call of `working` bytes beside what `lease` was admitted with, for the block.

        The request's plan is made again with the figures of its calls reserved now (its placement
        may change to make room) and admitted as `turn` admits it: evicting idle models, or waiting
        for room other requests hold, until the lease's end. On a batched model's compute loop,
        which never waits (every other row would wait with it), a call whose room others hold now
        raises `RoomLater` instead: the loop puts it aside and runs it again when memory is let go.
        A reservation inside another one for the same stage that it covers adds nothing. A call the
        budget can never hold is RequestTooLarge, before it runs. After the block the request's
        plan is back to what its other open reservations need.
        """
        base = lease.plan
        if base is None or lease.model != loaded.name:
            yield  # not a runtime request
            return
        with self._cond:
            held = self._calls.setdefault(lease, {})
            covered = working <= max(held.get(stage, 0), base.stage(stage).working)
            if not covered:
                previous, held[stage] = held.get(stage), working
        if covered:
            yield
            return

        def let_go(ran: bool = True) -> None:
            with self._cond:
                if previous is None:
                    held.pop(stage, None)
                else:
                    held[stage] = previous
                if not held:
                    self._calls.pop(lease, None)
            plan = self._call_plan(loaded, base, held, stage, sizes)
            loaded.scheduler.resize(lease, plan.peak)
            try:
                # smaller than what the call had: nothing to evict, and an eviction here would close a
                # model on this model's compute loop (let_go runs where the call's work ended)
                self.try_admit(loaded, plan, loaded.scheduler.together() - plan.peak, lease=lease, evict=False)
            except RequestCancelled:  # its modules move at the next sync or stage call
                pass
            except MizuotoError as e:  # smaller than what was just admitted: only an unload beside it gets here
                log.warning("%s: the request's plan after its %s call: %s", loaded.name, stage, e)
            if ran:  # a call that never ran frees nothing anyone waited for (and a wake would retry it at once)
                self.freed()  # the call's room is free again
        try:
            on_loop = loaded.model.batch_width > 1 and loaded.scheduler.executor.running_lease() is not None
            self._admit_held(loaded, self._call_plan(loaded, base, held, stage, sizes), lease, aside=on_loop)
        except BaseException:
            let_go(ran=False)  # nothing ran: what was reserved for it goes back now
            raise
        try:
            yield
        finally:
            # the call's memory stays reserved while it runs: a request that stopped waiting for a call still
            # on the compute loop lets go when that call has ended (on the loop's thread)
            lease.after_work(let_go)

    @staticmethod
    def _bound_peak(loaded: LoadedModel, plan: Plan, request: SynthesisRequest) -> int:
        """The peak of `plan` with every stage at the most one of its calls may need (`Stage.bound_memory`)."""
        bounds = {s.name: s.bound_memory(request) for s in loaded.model.stages if s.bound_memory is not None}
        if not bounds:
            return plan.peak
        stages = tuple(replace(s, working=max(s.working, bounds.get(s.name, 0))) for s in plan.stages)
        return peak_of(stages, set(plan.pinned), plan.groups)

    @staticmethod
    def _call_plan(loaded: LoadedModel, base: Plan, held: dict[str, int], stage: str, sizes: dict) -> Plan:
        """`base` with the working memory of the calls in `held` (RequestTooLarge when the budget cannot hold it)."""
        stages = tuple(replace(s, working=max(s.working, held[s.name])) if s.name in held else s for s in base.stages)
        try:
            return plan_model(loaded.name, stages, base.budget, loaded.options.device, base.stream)
        except MemoryBudgetError as e:
            sizes_text = ", ".join(f"{k} {v}" for k, v in sizes.items())
            raise RequestTooLarge(f"request refused at its {stage} call ({sizes_text}): {e}") from None
