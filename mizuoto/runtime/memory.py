"""Memory planner: budgets, stage sizes, placement of one model's stages, and LRU admission of several models.

Everything here is arithmetic over declared sizes; nothing is moved. See docs/memory.md.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from mizuoto.errors import InvalidRequest, MemoryBudgetError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int) -> int:
    """Bytes from an int or a string such as "6GiB", "512MB", "1.5 GiB" (KB/MB/GB are powers of 1000)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise InvalidRequest(f"not a memory size: {value!r} (examples: 6GiB, 512MB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """A size in binary units with two decimals ("1.50 GiB")."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def detect_budget(device: str | torch.device) -> int:
    """Free bytes on `device` now: torch.cuda.mem_get_info for CUDA, available host RAM otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def tensor_bytes(modules: Iterable[torch.nn.Module], dtype: torch.dtype | None = None) -> int:
    """Bytes of the modules' parameters and buffers, each tensor once; floating tensors counted at `dtype` if given."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            size = t.element_size()
            if dtype is not None and t.is_floating_point():
                size = torch.empty((), dtype=dtype).element_size()
            total += t.numel() * size
    return total


@dataclass(frozen=True)
class StageSize:
    """Declared sizes of one stage: movable weights, fixed weights on the planned device, working memory."""

    name: str
    kind: str
    weights: int
    fixed: int = 0
    working: int = 0


def _on_device(module: torch.nn.Module, device: torch.device) -> bool:
    for t in [*module.parameters(), *module.buffers()]:
        return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
    return False


def measure(stages: Sequence, request, device: str | torch.device | None,
            dtype: torch.dtype | None = None) -> tuple[StageSize, ...]:
    """StageSizes of a model's stages for `request` (None: the planning bound) on `device`.

    Fixed modules count only where they live on `device` (elsewhere they use none of its budget);
    `device=None` counts them all, for planning a device the model is not loaded on.
    """
    device = torch.device(device) if device is not None else None
    sizes = []
    for s in stages:
        fixed = [m for k, m in s.modules.items() if k in s.fixed and (device is None or _on_device(m, device))]
        sizes.append(StageSize(s.name, s.kind, tensor_bytes(s.movable().values(), dtype),
                               tensor_bytes(fixed, dtype), s.working_memory(request)))
    return tuple(sizes)


def run_groups(stages: Sequence[StageSize], stream: bool) -> tuple[tuple[str, ...], ...]:
    """Stages that run together. Streaming interleaves every non-frontend stage chunk by chunk."""
    if not stream:
        return tuple((s.name,) for s in stages)
    front = tuple((s.name,) for s in stages if s.kind == "frontend")
    rest = tuple(s.name for s in stages if s.kind != "frontend")
    return front + ((rest,) if rest else ())


@dataclass(frozen=True)
class Plan:
    """Where one model's stages live on one device: pinned stages stay, the others take turns by group."""

    model: str
    device: str
    budget: int
    stream: bool
    stages: tuple[StageSize, ...]
    pinned: tuple[str, ...]
    groups: tuple[tuple[str, ...], ...]
    peak: int

    @property
    def strategy(self) -> str:
        """"resident" when every stage stays on the device, else "turns"."""
        return "resident" if len(self.pinned) == len(self.stages) else "turns"

    @property
    def fixed(self) -> int:
        """Bytes of fixed modules on the device."""
        return sum(s.fixed for s in self.stages)

    @property
    def movable(self) -> int:
        """Bytes of all movable weights."""
        return sum(s.weights for s in self.stages)

    @property
    def waiting(self) -> int:
        """Bytes of movable weights that wait in host memory while not their turn."""
        return sum(s.weights for s in self.stages if s.name not in self.pinned)

    def stage(self, name: str) -> StageSize:
        """The sizes of the stage called `name`."""
        for s in self.stages:
            if s.name == name:
                return s
        raise InvalidRequest(f"plan of {self.model!r} has no stage {name!r}")

    def group_of(self, stage: str) -> tuple[str, ...]:
        """The stages that must be on the device while `stage` runs."""
        for g in self.groups:
            if stage in g:
                return tuple(dict.fromkeys((*self.pinned, *g)))
        raise InvalidRequest(f"plan of {self.model!r} has no stage {stage!r}")

    def table(self) -> str:
        """The plan as a small text table."""
        mode = "streaming" if self.stream else "non-streaming"
        lines = [f"model {self.model} on {self.device}, {mode}: {self.strategy}, peak {format_bytes(self.peak)}"
                 f" of {format_bytes(self.budget)}",
                 f"  {'stage':<12} {'kind':<9} {'weights':>12} {'fixed':>12} {'working':>12}  placement"]
        for s in self.stages:
            where = "resident" if s.name in self.pinned else "turn " + "+".join(
                n for n in next(g for g in self.groups if s.name in g) if n not in self.pinned)
            lines.append(f"  {s.name:<12} {s.kind:<9} {format_bytes(s.weights):>12} {format_bytes(s.fixed):>12}"
                         f" {format_bytes(s.working):>12}  {where}")
        return "\n".join(lines)


def peak_of(stages: Sequence[StageSize], pinned: set[str], groups: Sequence[tuple[str, ...]]) -> int:
    """Device bytes at the busiest moment: fixed and pinned weights, and the largest group's turn."""
    by = {s.name: s for s in stages}
    base = sum(s.fixed for s in stages) + sum(by[n].weights for n in pinned)
    return base + max((sum(by[n].weights for n in g if n not in pinned) + sum(by[n].working for n in g)
                       for g in groups), default=0)


def floor(stages: Sequence[StageSize], stream: bool = False) -> int:
    """The smallest budget any plan fits: every stage taking turns."""
    return peak_of(stages, set(), run_groups(stages, stream))


def plan_model(model: str, stages: Sequence[StageSize], budget: int, device: str = "cuda",
               stream: bool = False) -> Plan:
    """All stages resident if they fit; else pin what fits (smallest first) and let the rest take turns; else refuse."""
    stages = tuple(stages)
    groups = run_groups(stages, stream)
    pinned = {s.name for s in stages}
    if peak_of(stages, pinned, groups) > budget:
        pinned = set()
        if peak_of(stages, pinned, groups) > budget:
            raise MemoryBudgetError(_refusal(model, stages, budget, device, stream, groups))
        for s in sorted(stages, key=lambda s: s.weights):  # stable: ties keep stage order
            if peak_of(stages, pinned | {s.name}, groups) <= budget:
                pinned.add(s.name)
    order = tuple(s.name for s in stages if s.name in pinned)
    return Plan(model, str(device), budget, stream, stages, order, groups, peak_of(stages, pinned, groups))


def _refusal(model: str, stages: Sequence[StageSize], budget: int, device: str, stream: bool,
             groups: Sequence[tuple[str, ...]]) -> str:
    parts = ", ".join(f"{s.name} {format_bytes(s.weights + s.fixed)} + {format_bytes(s.working)} working"
                      for s in stages)
    together = [g for g in groups if len(g) > 1]
    why = f"; streaming keeps {'+'.join(together[0])} together" if together else ""
    need = floor(stages, stream)
    return (f"model {model} does not fit {format_bytes(budget)} on {device}: {parts}; with stages taking turns"
            f" it needs {format_bytes(need)}{why}")


@dataclass(frozen=True)
class Eviction:
    """A model moved out to admit another: "offload" (weights to host memory) or "unload" (dropped)."""

    model: str
    action: str


@dataclass
class _Entry:
    need: int      # device bytes while active (the plan's peak)
    fixed: int     # device bytes that stay even when offloaded
    host: int      # host bytes when offloaded (its movable weights)
    reserve: int   # host bytes while active (stages waiting for their turn)
    state: str = "device"


class Pool:
    """Admission of several models to one device, least recently used evicted first.

    `host_budget=None` means the device *is* the host (CPU): evicted models are unloaded.
    """

    def __init__(self, device_budget: int, host_budget: int | None = None):
        self.device_budget = device_budget
        self.host_budget = host_budget
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def state(self, name: str) -> str | None:
        """"device", "host", or None when not admitted."""
        e = self._entries.get(name)
        return e.state if e else None

    def used(self) -> tuple[int, int]:
        """(device bytes, host bytes) in use."""
        dev = sum(e.need if e.state == "device" else e.fixed for e in self._entries.values())
        host = sum(e.reserve if e.state == "device" else e.host for e in self._entries.values())
        return dev, host

    def order(self) -> list[str]:
        """Admitted models, least recently used first."""
        return list(self._entries)

    def release(self, name: str) -> None:
        """Forget a model (unloaded by its owner)."""
        self._entries.pop(name, None)

    def admit(self, name: str, need: int, fixed: int = 0, host: int = 0, reserve: int = 0,
              busy: Iterable[str] = ()) -> list[Eviction]:
        """Make `name` active on the device, evicting idle LRU models as needed; returns what was evicted."""
        if need > self.device_budget:
            raise MemoryBudgetError(f"model {name} needs {format_bytes(need)} on the device;"
                                    f" the budget is {format_bytes(self.device_budget)}")
        busy = set(busy) - {name}
        before = type(self._entries)((n, replace(e)) for n, e in self._entries.items())
        try:
            return self._admit(name, need, fixed, host, reserve, busy)
        except MemoryBudgetError:
            self._entries = before  # all or nothing: the caller applies evictions only on success
            raise

    def _admit(self, name: str, need: int, fixed: int, host: int, reserve: int, busy: set[str]) -> list[Eviction]:
        self._entries.pop(name, None)
        evictions: list[Eviction] = []
        while self.used()[0] + need > self.device_budget:
            victim = self._lru("device", busy) or self._lru("host", busy, with_fixed=True)
            if victim is None:
                raise MemoryBudgetError(self._stuck(name, need, busy))
            if self._entries[victim].state == "device":
                self._offload(victim, busy, evictions)
            else:
                self._unload(victim, evictions)
        while self.host_budget is not None and self.used()[1] + reserve > self.host_budget:
            victim = self._lru("host", busy)
            if victim is None:
                raise MemoryBudgetError(f"model {name} needs {format_bytes(reserve)} of host memory for stages"
                                        f" waiting their turn; host budget {format_bytes(self.host_budget)} is in use")
            self._unload(victim, evictions)
        self._entries[name] = _Entry(need, fixed, host, reserve)
        return evictions

    def _lru(self, state: str, busy: set[str], with_fixed: bool = False) -> str | None:
        for n, e in self._entries.items():
            if e.state == state and n not in busy and (not with_fixed or e.fixed > 0):
                return n
        return None

    def _offload(self, victim: str, busy: set[str], evictions: list[Eviction]) -> None:
        if self.host_budget is None:
            self._unload(victim, evictions)
            return
        e = self._entries[victim]
        while self.used()[1] - e.reserve + e.host > self.host_budget:
            other = self._lru("host", busy | {victim})
            if other is None:
                self._unload(victim, evictions)
                return
            self._unload(other, evictions)
        e.state = "host"
        evictions.append(Eviction(victim, "offload"))

    def _unload(self, victim: str, evictions: list[Eviction]) -> None:
        del self._entries[victim]
        evictions.append(Eviction(victim, "unload"))

    def _stuck(self, name: str, need: int, busy: set[str]) -> str:
        held = ", ".join(sorted(n for n in busy if n in self._entries)) or "fixed modules"
        return (f"model {name} needs {format_bytes(need)} on the device but {format_bytes(self.used()[0])} of"
                f" {format_bytes(self.device_budget)} is held by {held}")
