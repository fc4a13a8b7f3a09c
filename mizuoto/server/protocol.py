"""uvicorn's HTTP/1.1 and WebSocket protocols with the bounds this server needs against clients that send slowly,
endlessly or in tiny pieces.

HTTP runs on httptools (llhttp, in C), uvicorn's default parser: the server once forced h11 for its header timeout,
and h11 parsed each chunk header of a chunked body in Python on the event loop (~21 us each, a million one-byte
chunks held /health for 47 s). What h11 gave and httptools lacks is added here: a header timeout, a bound on
the request line and headers' bytes (h11's 16 KiB), and JSON error bodies. A chunked body's chunks are
bounded too. Transfer-Encoding beside Content-Length (a request a proxy may frame differently, RFC 9112 6.3)
is refused by llhttp and the connection closed.

Both subclass uvicorn's private protocol classes (their `loop`, `transport`, `parser`, `cycle`, `conn`);
pyproject pins uvicorn to the versions checked.
"""

from __future__ import annotations

import json
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from mizuoto.server.errors import ApiError

MAX_HEADER_BYTES = 16 << 10  # request line and headers, as h11's default limit was
# A chunked body may have FREE_CHUNKS chunks, and one more per MIN_CHUNK_BYTES of payload: a client that streams
# its body in reasonable pieces never meets it, and one-byte chunks cost at most a few milliseconds of parsing.
FREE_CHUNKS = 1024
MIN_CHUNK_BYTES = 256
MAX_FRAGMENTS = 1024  # frames of one WebSocket message (each is parsed in Python by the websockets library)


class _Refused(Exception):
    """Raised in a parser callback to refuse the request: httptools ends the feed, and the 400 says why."""


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing connections whose request line and headers are not complete within
    `header_timeout` s (from connecting, or from the first byte of a kept-alive connection's next request) or
    exceed MAX_HEADER_BYTES, refusing chunked bodies of too many chunks, and answering malformed HTTP with the
    server's JSON error body.

    uvicorn's keep-alive timer only runs between requests, and any byte resets it: a client that opens a
    connection and sends nothing, or half a request line, would hold it forever.
    """

    header_timeout = 10.0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._awaiting = True  # no complete request line and headers yet
        self._head_bytes = self._chunks = self._payload = 0
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, saying why a request is refused, and bounding the bytes of headers that never end."""
        if self._awaiting:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as e:
            why = e.__context__ if isinstance(e.__context__, _Refused) else e
            self.logger.debug("invalid HTTP request: %s", why)
            self.send_400_response(str(why))
            return
        # counted per read, so a read that also holds the body may overshoot by one read (64 KiB), never more
        if self._awaiting and self._head_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self.send_400_response(f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # the next request of a kept-alive connection: its first byte is here
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._awaiting = False
        self._head_bytes = self._chunks = self._payload = 0
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_headers_complete()

    def on_chunk_header(self) -> None:
        """Called by httptools at each chunk of a chunked body."""
        self._chunks += 1
        if self._chunks > FREE_CHUNKS + self._payload // MIN_CHUNK_BYTES:
            raise _Refused(f"the chunked body has {self._chunks} chunks for {self._payload} bytes; past "
                           f"{FREE_CHUNKS} chunks, each must carry {MIN_CHUNK_BYTES} bytes on average")

    def on_body(self, body: bytes) -> None:
        self._payload += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting, self._head_bytes = True, 0

    def send_400_response(self, msg: str) -> None:
        """A request that is not valid HTTP gets the server's JSON error body, as every other error does, and the
        connection is closed; a request whose app already runs sees its client gone."""
        if self.cycle is not None and not self.cycle.response_complete:
            started = self.cycle.response_started
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            if started:  # the answer has begun: nothing else can be sent
                self.transport.close()
                return
        body = json.dumps(ApiError(400, f"invalid HTTP request: {msg}").body()).encode()
        head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n" % len(body))
        self.transport.write(head + body)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._awaiting and not self.transport.is_closing():
            self.transport.close()


class BoundedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's websockets protocol, closing a connection (1009, message too big) whose message comes in more
    than MAX_FRAGMENTS frames: each frame is parsed in Python on the event loop, and one-byte frames of a 10 MiB
    message would hold it for a minute."""

    _fragments = 0

    def handle_text(self, event: Any) -> None:
        self._fragments = 1
        super().handle_text(event)

    def handle_bytes(self, event: Any) -> None:
        self._fragments = 1
        super().handle_bytes(event)

    def handle_cont(self, event: Any) -> None:
        self._fragments += 1
        if self._fragments > MAX_FRAGMENTS:
            if not self.close_sent:
                self.frames = []
                self.conn.send_close(1009, f"a message may come in at most {MAX_FRAGMENTS} frames")
                self.handle_parser_exception()  # tells the app, sends the close frame and closes the connection
            return
        super().handle_cont(event)
