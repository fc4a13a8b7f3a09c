"""One loaded model as its runtime holds it (`LoadedModel`), and `ModelInfo`, what `Runtime.models()` lists.

The record is shared by the runtime's two parts: its model registry (`runtime.api.Runtime`: the
loaded set, pins, loads and unloads) and its memory manager (`runtime.admission.MemoryManager`:
plans, admission, call reservations), which reads and sets the fields named for it below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mizuoto.runtime.engine import Capabilities, Model
from mizuoto.runtime.memory import Plan
from mizuoto.runtime.options import LoadOptions
from mizuoto.runtime.scheduler import Scheduler
from mizuoto.runtime.voicestore import ModelIdentity


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


@dataclass
class LoadedModel:
    """A model in (or on its way into) a runtime's loaded set: what was loaded, its scheduler and its plan."""

    name: str
    engine: str
    variant: str | None
    path: Path
    options: LoadOptions
    model: Model
    scheduler: Scheduler
    plan: Plan
    identity: ModelIdentity | None = None  # set when the model can import voices (see voicestore)
    # admitted to its device once (set by the memory manager): until then its load may still fail (nothing pins it)
    admitted: bool = False
    # its stages' weights and fixed bytes as loaded (measured by the memory manager's first plan): every plan
    # reads these (buffers a model makes later, a batch's scratch, must not change the figures one request
    # is planned and refused with)
    sizes: tuple | None = None
