"""Progress lines for slow work (loading, converting, synthesizing, benchmarking), on stderr.

Off unless turned on: the command line turns it on when stderr is a terminal (or with
`--progress`), so library use, pipes and logs stay quiet. Any layer may report through it
(it imports only the standard library); what it prints is one line per step, a line that
updates in place while a step runs, and nothing at all when off.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

_lock = threading.Lock()
_stream: TextIO | None = None   # where lines go; None: off
_open = False                   # a line is being updated in place (no newline yet)


def enable(stream: TextIO | None = None) -> None:
    """Report progress on `stream` (default: stderr)."""
    global _stream
    _stream = stream if stream is not None else sys.stderr


def disable() -> None:
    """Report nothing."""
    global _stream, _open
    with _lock:
        if _stream is not None and _open:
            _stream.write("\n")
            _stream.flush()
        _stream, _open = None, False


def enabled() -> bool:
    """Whether progress is being reported."""
    return _stream is not None


def wanted(flag: bool | None, stream: TextIO | None = None) -> bool:
    """`--progress` (True), `--no-progress` (False), or neither (None): on when `stream` (stderr) is a terminal."""
    if flag is not None:
        return flag
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _write(text: str, final: bool) -> None:
    global _open
    with _lock:
        out = _stream
        if out is None:
            return
        # an updating line is redrawn in place; a final one ends with a newline
        out.write(("\r\033[K" if _open else "") + text + ("\n" if final else ""))
        out.flush()
        _open = not final


def interrupt() -> None:
    """End a line being updated, so that other output (a log line, an error) starts on a line of its own."""
    global _open
    with _lock:
        if _stream is not None and _open:
            _stream.write("\n")
            _stream.flush()
            _open = False


def line(text: str) -> None:
    """A finished step: one line."""
    _write(text, True)


def update(text: str) -> None:
    """The state of a running step: replaces the previous update on the same line."""
    _write(text, False)


def bytes_progress(what: str) -> Callable[[str, int, int], None]:
    """A `progress(stage, done, total)` callback (as runtime.convert.onnx takes) that reports MiB done."""
    def report(stage: str, done: int, total: int) -> None:
        text = f"{what}: {stage} {done >> 20}/{max(total, 1) >> 20} MiB" if total > 1 else f"{what}: {stage}"
        (line if done >= total else update)(text)
    return report


@contextlib.contextmanager
def step(what: str, done: str | Callable[[float], str] | None = None, tick: float = 1.0,
         status: Callable[[], str] | None = None) -> Iterator[None]:
    """Report `what` while the block runs (its elapsed seconds updated every `tick`), then a closing line.

    `done`: the closing line, or a function of the elapsed seconds giving it (default: what, in N s).
    `status`: what has been done so far, added to each update. Nothing is printed (and no thread
    started) when progress is off.
    """
    if not enabled():
        yield
        return
    start = time.monotonic()
    stop = threading.Event()

    def ticker() -> None:
        while not stop.wait(tick):
            extra = status() if status is not None else ""
            update(f"{what} ... {time.monotonic() - start:.0f} s" + (f", {extra}" if extra else ""))

    update(f"{what} ...")
    thread = threading.Thread(target=ticker, name="mizuoto-progress", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join()
        elapsed = time.monotonic() - start
        if not ok:
            line(f"{what}: stopped after {elapsed:.1f} s")
        elif callable(done):
            line(done(elapsed))
        else:
            line(done or f"{what}: done in {elapsed:.1f} s")
