"""The peak memory a block of work adds: resident growth of the process on the CPU, the allocator's peak on CUDA.

CPU: glibc's freed heap is given back first (malloc_trim), the kernel's high-water mark of the
process's resident set is reset (Linux: writing 5 to /proc/self/clear_refs), and the block's
figure is that mark afterwards over the resident size before. Every thread of the process counts,
so nothing else may run beside the block. CUDA: the allocator's peak of allocated bytes over
what was allocated before (its cached, unallocated blocks are not counted).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from mizuoto.errors import MizuotoError
from mizuoto.nn.host_memory import return_freed_memory

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    if m is None:
        raise MizuotoError(f"memory probe: /proc/self/status has no {key}")
    return int(m.group(1)) * 1024


def probe_available(device: torch.device | str) -> str | None:
    """Why the peak of a block cannot be measured on `device` here (None: it can)."""
    if torch.device(device).type == "cuda":
        return None
    if not _CLEAR_REFS.exists():
        return "measuring resident peaks needs Linux's /proc/self/clear_refs"
    return None


@contextlib.contextmanager
def measure_peak(device: torch.device | str) -> Iterator[list[int]]:
    """Measure the block; the yielded list holds its peak in bytes once the block ends."""
    device = torch.device(device)
    why = probe_available(device)
    if why is not None:
        raise MizuotoError(f"memory probe: {why}")
    out: list[int] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out.append(max(0, torch.cuda.max_memory_allocated(device) - base))
        return
    return_freed_memory()
    _CLEAR_REFS.write_text("5")
    base = _status_bytes("VmRSS")
    yield out
    out.append(max(0, _status_bytes("VmHWM") - base))
