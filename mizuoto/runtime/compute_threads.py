"""The compute threads' settings, fixed in one place for every process the runtime runs in.

torch's reductions split their work by the intra-op thread count, and MKL, left to itself, picks
a count per call ("dynamic" threading) unless `torch.set_num_threads` was called: that call also
turns MKL's dynamic threading off, in this thread and in every thread torch starts later. So two
processes with the same count give other last bits when only one of them made the call (a seeded
request differed by a PCM16 step between a server and its client). Every Runtime makes the call
once when it starts, with the count asked for, `$MIZUOTO_THREADS`, or the count torch has now;
the server, the CLI, workers and tests all go through here, so a seeded request gives the same
bytes in each of them at the same count. The setting is the process's: the last Runtime wins.
"""

from __future__ import annotations

import os

import torch

from mizuoto.errors import InvalidRequest

THREADS_ENV = "MIZUOTO_THREADS"


def requested(threads: int | str | None = None) -> int:
    """The intra-op thread count to use: `threads`, else `$MIZUOTO_THREADS`, else torch's current count."""
    value: int | str | None = threads if threads is not None else os.environ.get(THREADS_ENV) or None
    if value is None:
        return torch.get_num_threads()
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or str(count) != str(value).strip():
        where = f"${THREADS_ENV}" if threads is None else "threads"
        raise InvalidRequest(f"{where} must be a positive whole number of threads, got {value!r}")
    return count


def fix_compute_threads(threads: int | str | None = None) -> int:
    """Set torch's intra-op thread count (and with it MKL's dynamic threading off) for this process; the count."""
    count = requested(threads)
    torch.set_num_threads(count)  # always called, also at the same count: the call is what fixes MKL
    return count


def set_compute_threads(threads: int | str) -> int:
    """Fix `threads` for this process and for every Runtime and child process it starts later; the count."""
    count = requested(threads)
    os.environ[THREADS_ENV] = str(count)
    return fix_compute_threads(count)
