"""A C library's lines on the process's stderr, turned into log records while a call into it runs.

libsndfile decodes MP3 through libmpg123, which prints what it notices about a file ("Note: Illegal
Audio-MPEG-Header 0x00000000 at offset 2998.", "Warning: Xing stream size off by more than 1%")
straight to file descriptor 2: in a server, a raw line in its log about a client's file. While a
decode runs, descriptor 2 is a temporary file; its libmpg123 lines become debug records of the
given logger, and anything else written meanwhile (another thread's log line) goes on to stderr
unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()  # one redirection at a time: descriptor 2 belongs to the whole process
_NATIVE = re.compile(r"(Note|Warning|Error): |\[[^\]]*libmpg123")


@contextlib.contextmanager
def routed_stderr(log: logging.Logger, what: str) -> Iterator[None]:
    """Within the block, libmpg123's stderr lines become `log.debug` records prefixed with `what`."""
    with _LOCK:
        _flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:  # a file, not a pipe: a chatty decoder can never block on it
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                _flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                text = captured.read().decode("utf-8", "replace")
    others = []
    for line in text.splitlines(keepends=True):
        if _NATIVE.match(line):
            log.debug("%s: %s", what, line.rstrip())
        else:
            others.append(line)
    if others:
        os.write(2, "".join(others).encode())


def _flush() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no stderr, or a closed one
        pass
