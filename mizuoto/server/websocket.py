"""WebSocket /v1/audio/speech/stream: text in as it arrives, audio out as it is produced.

Protocol (JSON text frames from the client, audio as binary frames of PCM16 mono):
  client: {"type": "session.start", "model": ..., "voice": ..., "speed": ..., ...}  (speech fields, no input)
  server: {"type": "session.created", "model": ..., "sample_rate": ..., "format": "pcm16", "stream_in": bool}
  client: {"type": "input_text.append", "text": "..."} any number of times
  client: {"type": "input_text.done"}
  server: binary audio frames, then {"type": "speech.audio.done", "seconds": ..., "chunks": ...}; closes.
Errors: {"type": "error", "error": {...}} and the socket closes with a code that says why (`close_code`). A
client that drops the socket cancels its session at once, whatever it was waiting for (its model's load too:
one Session, session.py, from session.start on). A model that cannot take text in pieces (stream_in false) speaks
once input_text.done arrives. A session takes a job slot only from its first text on; one silent for the idle
timeout, or whose text is not all in within the body timeout of its first piece, is closed with a 408 error.
"""

from __future__ import annotations

import asyncio
import time

from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.jobs import ClientGone, in_time
from mizuoto.server.session import Session
from mizuoto.server.speech import pcm16
from mizuoto.server.state import ServerState
from mizuoto.server.bodies import parse_json
from mizuoto.server.schemas import check_text, checked

# RFC 6455 close codes by the HTTP status of the error that ended a session: 1008 (policy violation) for what the
# client got wrong, 1013 (try again later) when every slot and queue place is taken or the server is shutting
# down, private codes for the deadline (4504) and out of memory (4507), 1011 (internal error) for the server's bugs
CLOSE_CODES = {503: 1013, 504: 4504, 507: 4507}


def close_code(status: int) -> int:
    """The WebSocket close code of a session ended by an error of HTTP `status`."""
    return 1008 if status < 500 else CLOSE_CODES.get(status, 1011)


async def _message(ws, idle: float, end: float | None = None, total: float = 0.0) -> dict:
    """The next JSON message; a session silent for `idle` seconds, or (with `end`, a monotonic time) whose text
    is not all in by then, is ended: it would hold the socket, and from its first text a job slot."""
    message = await in_time(ws.receive(), idle, end, f"the session sent nothing for {idle:g} s",
                            f"the session's text took longer than {total:g} s")
    if message["type"] == "websocket.disconnect":
        from starlette.websockets import WebSocketDisconnect

        raise WebSocketDisconnect(message.get("code", 1000))
    raw = message.get("text")
    if raw is None:
        raise ApiError(400, "binary frames are not accepted: send JSON text messages", "type")
    data = parse_json(raw, "message")  # its values counted before it is parsed (uvicorn bounds its size)
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ApiError(400, "each message must be a JSON object with a 'type'", "type")
    return data


async def _next_text(ws, state: ServerState, end: float | None = None, so_far: int = 0) -> str | None:
    """The next input_text.append's text, or None at input_text.done (refused past `end`, or past the length
    limit with the `so_far` characters before it)."""
    msg = await _message(ws, state.config.idle_timeout, end, state.config.body_timeout)
    if msg["type"] == "input_text.done":
        return None
    if msg["type"] != "input_text.append":
        raise ApiError(400, f"unknown message type {msg['type']!r}", "type")
    text = msg.get("text")
    if not isinstance(text, str):
        raise ApiError(400, "input_text.append needs a string 'text'", "text")
    check_text(text, "text", state.config.max_input_chars, so_far)
    return text


class _Inbox:
    """The client's messages: a receive started while the model loaded (to see the client leave) is taken first."""

    def __init__(self, ws):
        self.ws = ws
        self.ahead: asyncio.Task | None = None

    async def receive(self) -> dict:
        """The next message from the client."""
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            return await ahead
        return await self.ws.receive()

    def left(self) -> asyncio.Future:
        """A future that ends if the client leaves before it sends a message: the message read meanwhile stays
        for `receive` (reading on would hold any number of them)."""
        self.ahead = asyncio.ensure_future(self.ws.receive())
        gone = asyncio.get_running_loop().create_future()

        def read(task: asyncio.Task) -> None:
            if gone.done() or task.cancelled():
                return
            if task.exception() is not None or task.result()["type"] == "websocket.disconnect":
                gone.set_result(None)
        self.ahead.add_done_callback(read)
        return gone


async def _read_text(ws, state: ServerState, into: Session | list, chars: int = 0) -> None:
    """Text messages until input_text.done, into a session's streamed text (ended, or cancelled on an error) or a
    list; the whole text has --body-timeout from now, as a request body has."""
    end = time.monotonic() + state.config.body_timeout
    try:
        while (text := await _next_text(ws, state, end, chars)) is not None:
            chars += len(text)
            (into.append if isinstance(into, list) else into.put)(text)
    except BaseException:
        if not isinstance(into, list):
            into.cancel_text()
        raise
    if not isinstance(into, list):
        into.end_text()


async def _closed(ws) -> None:
    """Returns when the client closes or drops the socket (anything it sends after its text is ignored): the
    session's job is then cancelled at once, not at the next audio it would have sent."""
    while (await ws.receive())["type"] != "websocket.disconnect":
        pass


async def _read_then_watch(ws, state: ServerState, talk: Session, chars: int) -> None:
    await _read_text(ws, state, talk, chars)
    await _closed(ws)


async def session(ws, state: ServerState) -> None:
    """Run one WebSocket session."""
    from starlette.websockets import WebSocketDisconnect

    await ws.accept()
    inbox, talk = _Inbox(ws), None
    try:
        state.authorize(ws.headers.get("authorization"), admin=False)
        start = await _message(inbox, state.config.idle_timeout)
        if start["type"] != "session.start":
            raise ApiError(400, f"the first message must be session.start, got {start['type']!r}", "type")
        p = state.aliases.apply(checked(state.session, {k: v for k, v in start.items() if k != "type"}))
        if p.input is not None:
            raise ApiError(400, "send the text with input_text.append messages, not in session.start", "input")
        if p.stream_format is not None:
            raise ApiError(400, "a session always streams raw PCM16: session.start takes no stream_format",
                           "stream_format")
        state.check_model(p.model)
        talk = Session(state, p, stream=True, gone=inbox.left())
        await talk.load()  # under a slot and the session's lease, as a request's own load; leaving cancels it
        talk.watch(None)
        caps = state.runtime.model(p.model).capabilities
        await ws.send_json({"type": "session.created", "model": p.model, "sample_rate": caps.sample_rate,
                            "format": "pcm16", "stream_in": caps.stream_in})
        if caps.stream_in:
            # a session takes a job slot only once it has text to speak: idle sessions hold none
            first = await _next_text(inbox, state)
            if first is None:
                raise ApiError(400, "no text was sent", "text")
            talk.put(first)
            talk.start_streamed()
            # the reader takes the rest of the text, then watches for the client leaving; its end ends the pull
            reader = asyncio.ensure_future(_read_then_watch(inbox, state, talk, len(first)))
            talk.watch(reader)
            try:
                while (chunk := await talk.next()) is not None:  # audio goes out while text still comes in
                    await ws.send_bytes(pcm16(chunk.samples))
            except ClientGone:  # the feed was cancelled: report why the reader stopped
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception() from None
                raise
            finally:
                if not reader.done():
                    reader.cancel()
        else:
            total: list[str] = []
            await _read_text(inbox, state, total)
            whole_text = "".join(total)
            if not whole_text.strip():
                raise ApiError(400, "no text was sent", "text")
            talk.start(whole_text)
            talk.watch(asyncio.ensure_future(_closed(inbox)))
            while (chunk := await talk.next()) is not None:
                await ws.send_bytes(pcm16(chunk.samples))
        await ws.send_json({"type": "speech.audio.done", "seconds": talk.samples / max(talk.rate, 1),
                            "chunks": talk.count})
        await ws.close(1000)
    except (WebSocketDisconnect, ClientGone):
        pass
    except Exception as e:  # reported to the client, then the socket closes
        error = from_exception(e)
        try:
            await ws.send_json({"type": "error", **error.body(state.private_paths())})
            await ws.close(close_code(error.status))
        except Exception:
            pass
    finally:
        if talk is not None:
            talk.close()
        if inbox.ahead is not None:  # the session ended before it read what came during the load
            inbox.ahead.cancel()
