"""`mizuoto bench --memory`: each stage call's planned working memory against the peak it was measured at.

A case is one request of a length (seconds of audio), whole or streamed, with its LM decoding
`rows` requests at once; a served case runs those rows as a server does (`MemoryCase.served`).
It runs in a fresh process (`run_case_process`), so no other case's heap or thread pools are in
its figures, with the allocator settings the server uses (runtime.malloc). There the engine's
bench driver runs the request (`BenchDriver`'s `memory_case`) and every call it makes inside
`Model.room(stage, **sizes)` is measured (runtime.memprobe): the planned figure is the stage's
`call_memory(**sizes)`, the measured one the peak the call added.
One warm-up request first pays the one-time allocations (thread pools, kernel workspaces).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.nn.memory import HEAP_PACKING_BYTES
from mizuoto.runtime.compute_threads import set_compute_threads
from mizuoto.runtime.engine import stage_device
from mizuoto.runtime.executor import Executor
from mizuoto.runtime.malloc import tune_malloc
from mizuoto.runtime.memory import format_bytes
from mizuoto.runtime.memprobe import measure_peak

SECONDS = (1, 5, 15, 30, 60)  # the lengths that matter (the calibration set)
WARMUP_SECONDS = 1
TURN_WAIT_S = 3600.0  # the longest a served call waits for the one measured before it (a full-size call: minutes)


@dataclass(frozen=True)
class MemoryCase:
    """One request: `seconds` of audio, whole or streamed, its LM decoding `rows` requests at once.

    `served`: the rows are `rows` whole requests of lengths spread up to `seconds` (the k-th of n
    speaks k/n of it), each running its flow and vocoder calls on the batch loop's thread as soon as
    its LM is done, beside the rows still decoding: the calls as a server runs them.
    """

    seconds: float
    stream: bool = False
    rows: int = 1
    served: bool = False

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.rows < 1:
            raise InvalidRequest(f"bench --memory: a case needs seconds > 0 and rows >= 1, got {self}")
        if self.served and (self.stream or self.rows < 2):
            raise InvalidRequest(f"bench --memory: a served case is whole requests in 2 or more rows, got {self}")

    @property
    def label(self) -> str:
        """E.g. "15 s streamed", "5 s whole x8" or "60 s whole x8 served"."""
        rows = f" x{self.rows}" if self.rows > 1 else ""
        return f"{self.seconds:g} s {'streamed' if self.stream else 'whole'}{rows}{' served' if self.served else ''}"

    @classmethod
    def of(cls, call: dict[str, Any]) -> MemoryCase:
        """The case a recorded call (`run_case`'s dicts) was made in."""
        return cls(call["seconds"], call["stream"], call["rows"], call.get("served", False))


class CallRecorder:
    """The placement `bench --memory` gives the model's executor: stages run where their modules are,
    and each call reservation (`Model.room`) is measured.

    The probe sees the whole process, so one call is measured at a time: a reservation made while
    another is open (the rows of a batch inside the batch's own, a streamed chunk's decode inside the
    LM's generation) is part of that one, not recorded; the largest such reservation is added to that
    one's planned figure (`nested`), as both are held at once.
    In a served case (`unmeasured`: the sequence stages) the rows' own reservations span their
    whole decoding, across the other requests' calls: they are not measured, and a call of another
    stage is measured while they are open (what the rows' steps add while it waits is in its figure).
    Two requests' calls there take turns, so neither is lost as nested: the second waits for the
    first's reservation to end, which it does once its call, already on the batch loop, has run
    (on its request's cancel or deadline where it has a lease, and at most `turn_timeout` seconds).
    """

    def __init__(self, model: Any, device: Any, unmeasured: frozenset[str] = frozenset()):
        self.model, self.device, self.unmeasured = model, device, unmeasured
        self.calls: list[dict[str, Any]] = []
        self.on_call: Callable[[dict[str, Any]], None] | None = None  # told of each call as it is recorded
        self._lock = threading.Lock()
        self._open = 0
        self.turn_timeout = TURN_WAIT_S
        self._turn = threading.Condition()
        self._owner: int | None = None  # the thread whose call is measured now (its nested calls re-enter)
        self._depth = 0
        self._nested = 0  # the largest reservation made inside the call measured now

    @contextlib.contextmanager
    def place(self, stage: str, lease: Any = None) -> Iterator[Any]:
        yield stage_device(self.model.stage(stage))

    @contextlib.contextmanager
    def reserve(self, stage: str, lease: Any, working: int, sizes: dict[str, int]) -> Iterator[None]:
        if stage in self.unmeasured:
            yield
            return
        with self._taking_turns(stage, lease):
            with self._lock:
                self._open += 1
                outer = self._open == 1
                if outer:
                    self._nested = 0
                else:  # reserved while the outer one is held: its work is in the outer's peak, and so is its plan
                    self._nested = max(self._nested, int(working))
            try:
                if not outer:
                    yield
                    return
                with measure_peak(self.device) as peak:
                    yield
                call = {"stage": stage, "sizes": dict(sizes), "planned": int(working) + self._nested,
                        "measured": peak[0]}
                if self._nested:
                    call["nested"] = self._nested
                self.calls.append(call)
                if self.on_call is not None:
                    self.on_call(call)
            finally:
                with self._lock:
                    self._open -= 1

    @contextlib.contextmanager
    def _taking_turns(self, stage: str, lease: Any) -> Iterator[None]:
        """In a served case: the block once no other thread's call is being measured (re-entered by nested calls)."""
        if not self.unmeasured:
            yield
            return
        me = threading.get_ident()
        with self._turn:
            def free() -> bool:
                return self._owner in (None, me)
            if lease is not None:
                lease.wait_for(self._turn, free, f"while its {stage} call waited for its turn to be measured")
            elif not self._turn.wait_for(free, self.turn_timeout):
                raise MizuotoError(f"bench --memory: a {stage} call waited more than {self.turn_timeout:g} s for "
                                   "the call measured before it to end")
            self._owner, self._depth = me, self._depth + 1
        try:
            yield
        finally:
            with self._turn:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._turn.notify_all()


def run_case(driver: Any, case: MemoryCase,
             on_call: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run `case` through the driver in this process; the measured calls (after a warm-up request), each
    also given to `on_call` as it ends (a long case's progress).

    The model's stage calls go through its executor (its own, or one made for the case), whose
    placement is the recorder; the case itself runs in this thread.
    """
    for need in ("model", "tokens_per_second", "memory_case"):
        if not hasattr(driver, need):
            raise InvalidRequest(f"bench --memory: the driver of {driver.name} has no {need!r}")
    model = driver.model
    served = {"served": True} if case.served else {}
    if served and "served" not in inspect.signature(driver.memory_case).parameters:
        raise InvalidRequest(f"bench --memory: the driver of {driver.name} runs no served case")
    own = model.executor
    executor = own if own is not None else Executor(f"bench-{driver.name}")
    sequence = frozenset(s.name for s in model.stages if s.kind == "sequence") if served else frozenset()
    recorder = CallRecorder(model, driver.device, sequence)
    model.executor, executor.placement = executor, recorder
    try:
        driver.memory_case(max(1, round(WARMUP_SECONDS * driver.tokens_per_second)), case.stream, case.rows, **served)
        recorder.calls.clear()
        recorder.on_call = on_call
        driver.memory_case(max(1, round(case.seconds * driver.tokens_per_second)), case.stream, case.rows, **served)
    finally:
        executor.placement = None
        if own is None:
            executor.close()
            model.executor = None
    return [{**call, **asdict(case)} for call in recorder.calls]


def memory_cases(seconds: Sequence[float], modes: Sequence[bool], rows: Sequence[int],
                 served: bool = False) -> list[MemoryCase]:
    """`bench --memory`'s cases: each length in each mode (True: streamed), whole ones at each of `rows` LM rows
    (`served`: the batched ones as a server runs them, instead of one batch of equal rows)."""
    cases = [MemoryCase(s, stream) for s in seconds for stream in modes if stream or 1 in rows]
    batched = [n for n in sorted(set(rows)) if n > 1] if False in modes else []
    return cases + [MemoryCase(s, False, n, served) for s in seconds for n in batched]


def run_case_process(spec: dict[str, Any], timeout: float | None = None) -> list[dict[str, Any]]:
    """Run one case in a fresh Python process (`python -m mizuoto.cli.memory_case SPEC`); its calls.

    The process writes its progress (a line per measured call) and any warning to this process's
    stderr as it runs, and its result (or its error) as one JSON line on stdout.
    """
    proc = subprocess.run([sys.executable, "-m", "mizuoto.cli.memory_case", json.dumps(spec)], stdout=subprocess.PIPE,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines or "calls" not in lines[-1]:
        why = lines[-1].get("error") if lines else None
        raise MizuotoError(f"bench --memory: the case {spec.get('case')} failed: "
                           f"{why or f'exit status {proc.returncode}; its traceback is above'}")
    return lines[-1]["calls"]


def call_line(call: dict[str, Any], allowance: int = HEAP_PACKING_BYTES) -> str:
    """One measured call as a progress line: its stage and sizes, planned and measured, the band's ratio."""
    sizes = " ".join(f"{k}={v}" for k, v in call["sizes"].items())
    ratio = (call["planned"] - allowance) / call["measured"] if call["measured"] else float("inf")
    return (f"bench --memory:   {call['stage']} {sizes}: planned {format_bytes(call['planned'])}, measured "
            f"{format_bytes(call['measured'])} ({ratio:.2f}{'' if call['measured'] <= call['planned'] else ', ABOVE'})")


def case_process_main(driver_factory: Any, spec: dict[str, Any]) -> int:
    """The fresh process's side: tune the allocator as the server does, build the driver, run, print JSON."""
    tune_malloc(1 << 20, 2)  # the server's settings (ServerConfig.mmap_threshold, malloc_arenas)
    if spec.get("threads"):  # cases run side by side each take a share of the cores
        set_compute_threads(int(spec["threads"]))
    driver = driver_factory()
    calls = run_case(driver, MemoryCase(**spec["case"]), lambda call: print(call_line(call), file=sys.stderr,
                                                                             flush=True))
    print(json.dumps({"driver": driver.name, "calls": calls}))
    return 0


def summarize(calls: Sequence[dict[str, Any]], ratio: float = 1.3,
              allowance: int = HEAP_PACKING_BYTES) -> list[dict[str, Any]]:
    """Per (case, stage): calls, the largest planned and measured figures, and the range of the band's ratio.

    The band's ratio is the figure less the heap's `allowance` (which every figure carries) over the
    measured peak; a group is within when every call measured at most its figure and at most `ratio`.
    """
    groups: dict[tuple[MemoryCase, str], list[dict[str, Any]]] = {}
    for c in calls:
        groups.setdefault((MemoryCase.of(c), c["stage"]), []).append(c)
    rows = []
    for (case, stage), cs in groups.items():
        ratios = [(c["planned"] - allowance) / c["measured"] if c["measured"] else float("inf") for c in cs]
        rows.append({"case": case.label, "stage": stage, "calls": len(cs),
                     "planned": max(c["planned"] for c in cs), "measured": max(c["measured"] for c in cs),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "within": all(c["measured"] <= c["planned"] for c in cs) and max(ratios) <= ratio})
    return rows


def format_memory(rows: Sequence[dict[str, Any]], title: str) -> str:
    """The calibration table: per case and stage, planned vs measured and the ratio's range."""
    lines = [title, f"  {'case':<21} {'stage':<8} {'calls':>5} {'planned':>12} {'measured':>12}  (planned - "
                    f"{HEAP_PACKING_BYTES >> 20} MiB)/measured"]
    for r in rows:
        mark = "" if r["within"] else "  (measured above the figure, or the band above 1.3)"
        lines.append(f"  {r['case']:<21} {r['stage']:<8} {r['calls']:>5} {format_bytes(r['planned']):>12}"
                     f" {format_bytes(r['measured']):>12}  {r['ratio_min']:.2f}-{r['ratio_max']:.2f}{mark}")
    return "\n".join(lines)
