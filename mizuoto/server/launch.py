"""Running the app under uvicorn: in the foreground for `mizuoto serve`, or in a thread (tests, embedding)."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mizuoto.server.errors import ApiError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing connections that do not finish their request headers in time.

    uvicorn's keep-alive timer only runs between requests, and any byte resets it: a client that
    opens a connection and sends nothing, or half a request line, would hold it forever.
    uvicorn has no public setting for this (timeout_keep_alive starts after a response;
    h11_max_incomplete_event_size bounds the headers' bytes, not their time), so this subclasses
    its private H11Protocol, using its `loop`, `conn` and `transport`: pyproject pins uvicorn to
    the versions checked (0.35 to 0.55 have the same).
    """

    header_timeout = 10.0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        waiting = self.conn.their_state is h11.IDLE  # no complete request line and headers yet
        if not waiting and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        elif waiting and self._header_timer is None and not self.transport.is_closing():
            # the next request on a kept-alive connection: its first byte stopped uvicorn's keep-alive timer
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def send_400_response(self, msg: str) -> None:
        """A request that is not valid HTTP (a malformed header, a bad Content-Length) gets the server's JSON error
        body, as every other error does, instead of uvicorn's plain text."""
        body = json.dumps(ApiError(400, f"invalid HTTP request: {msg}").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def config(app: Any, host: str, port: int, shutdown_timeout: float = 10.0, log_level: str = "warning",
           header_timeout: float | None = None) -> uvicorn.Config:
    """uvicorn settings: graceful shutdown waits `shutdown_timeout` s for in-flight requests, then cancels them.

    `header_timeout` (default: the app's ServerConfig) closes connections that are slow to send a request.
    """
    if header_timeout is None:
        header_timeout = app.state.mizuoto.config.header_timeout
    protocol = type("HeaderTimeoutH11", (_HeaderTimeoutH11,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                          ws="websockets-sansio", lifespan="on", access_log=False, http=protocol)


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
