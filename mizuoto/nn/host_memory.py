"""Host memory freed by torch given back to the system (glibc's malloc_trim), where the C library can."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; the process's own symbols, no library search
    except (AttributeError, OSError):  # another C library: nothing to give back this way
        return None


def return_freed_memory() -> bool:
    """Give the heap pages glibc keeps after frees back to the system; False where there is no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
