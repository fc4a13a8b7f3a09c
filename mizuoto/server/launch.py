"""Running the app under uvicorn: in the foreground for `mizuoto serve`, or in a thread (tests, embedding)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from mizuoto.server.protocol import BoundedHttpTools, BoundedWebSocket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def config(app: Any, host: str, port: int, shutdown_timeout: float = 10.0, log_level: str = "warning",
           header_timeout: float | None = None, access_log: bool = False) -> uvicorn.Config:
    """uvicorn settings: graceful shutdown waits `shutdown_timeout` s for in-flight requests, then cancels them.

    `header_timeout` (default: the app's ServerConfig) closes connections that are slow to send a request.
    `access_log`: uvicorn's line per request (on stdout, at level info), which `mizuoto serve` turns on.
    A WebSocket message is at most what a speech body may hold, uncompressed: permessage-deflate would let a
    few KiB inflate to the whole limit, parsed on the event loop.
    """
    state = app.state.mizuoto
    if header_timeout is None:
        header_timeout = state.config.header_timeout
    protocol = type("BoundedHttpTools", (BoundedHttpTools,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                          ws=BoundedWebSocket, ws_max_size=state.speech_body_bytes, ws_per_message_deflate=False,
                          lifespan="on", access_log=access_log, http=protocol)


class Server(uvicorn.Server):
    """uvicorn's server with a drain: on SIGTERM/SIGINT the app reports not ready before the listener closes."""

    def __init__(self, config: uvicorn.Config, state: Any) -> None:
        super().__init__(config)
        self.state = state
        self._drain: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        """First signal: /ready answers 503 for drain_seconds, then a graceful stop; a second signal stops now."""
        if self._drain is None and self.state.config.drain_seconds > 0 and not self.should_exit:
            self.state.closing = True
            self._drain = threading.Timer(self.state.config.drain_seconds, super().handle_exit, (sig, frame))
            self._drain.daemon = True
            self._drain.start()
            return
        if self._drain is not None:
            self._drain.cancel()
        super().handle_exit(sig, frame)


class ServerThread:
    """A real server on `host`:`port` in a background thread; `stop()` shuts it down gracefully."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None, shutdown_timeout: float = 5.0):
        self.host, self.port = host, port or free_port(host)
        self.server = Server(config(app, self.host, self.port, shutdown_timeout), app.state.mizuoto)
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
        """Graceful shutdown, then wait for the thread (a drain still counting down is cut short)."""
        if self.server._drain is not None:
            self.server._drain.cancel()
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
