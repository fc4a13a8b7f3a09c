"""The host allocator: memory freed after a request goes back to the system, so resident memory follows the plans."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("mizuoto.runtime")

# glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def tune_malloc(mmap_threshold: int | None, max_arenas: int | None) -> bool:
    """Keep request memory from staying resident after the request (glibc); False where that is not possible.

    glibc raises its mmap threshold each time it frees a mapped block (up to 32 MiB), so later
    tensors of that size come from the heap arenas instead; and worker threads spread their
    buffers over up to 8 arenas per core. Request after request, those arenas fragment: resident
    memory climbed by 50-230 MiB per burst of requests with no live allocation behind it, which
    malloc_trim cannot give back. A fixed threshold (which also fixes the trim threshold) keeps
    large buffers out of the arenas, and few arenas keep the small ones packed.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = True
    for param, value, what in ((M_MMAP_THRESHOLD, mmap_threshold, "M_MMAP_THRESHOLD"),
                               (M_ARENA_MAX, max_arenas, "M_ARENA_MAX")):
        if value is not None and not mallopt(param, int(value)):
            log.warning("mallopt(%s, %d) was refused; request memory may stay resident", what, value)
            ok = False
    return ok
