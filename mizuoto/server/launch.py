"""Running the app under uvicorn: in the foreground for `mizuoto serve`, or in a thread (tests, embedding)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def config(app: Any, host: str, port: int, shutdown_timeout: float = 10.0,
           log_level: str = "warning") -> uvicorn.Config:
    """uvicorn settings: graceful shutdown waits `shutdown_timeout` s for in-flight requests, then cancels them."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                          ws="websockets-sansio", lifespan="on", access_log=False)


class ServerThread:
    """A real server on `host`:`port` in a background thread; `stop()` shuts it down gracefully."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None, shutdown_timeout: float = 5.0):
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(config(app, self.host, self.port, shutdown_timeout))
        self.thread = threading.Thread(target=self.server.run, name="mizuoto-server", daemon=True)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8000."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start and wait until the server accepts requests (models in the catalogue are loaded by then)."""
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown, then wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
