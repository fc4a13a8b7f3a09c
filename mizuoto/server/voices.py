"""GET/POST/DELETE /v1/audio/voices: voices registered once by reference audio, used later by id."""

from __future__ import annotations

import email.message
import email.parser
import email.policy
import re

from mizuoto.server.audio import decode_base64, decode_reference
from mizuoto.server.errors import ApiError
from mizuoto.server.state import ServerState, StoredVoice
from mizuoto.server.validation import parse_json, text_field

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_multipart(body: bytes, content_type: str, max_parts: int = 16) -> tuple[dict[str, str], dict[str, bytes]]:
    """(text fields, file fields) of a multipart/form-data body, read with the standard library's MIME parser.

    The parts are counted before parsing: a body of thousands of tiny parts is refused, not parsed.
    """
    boundary = email.message.Message()
    boundary["content-type"] = content_type
    mark = boundary.get_param("boundary")
    if isinstance(mark, str) and body.count(b"--" + mark.encode("latin-1", "replace")) - 1 > max_parts:
        raise ApiError(400, f"multipart body has more than {max_parts} parts")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise ApiError(400, "multipart body could not be parsed (missing or wrong boundary)")
    fields, files = {}, {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        payload = part.get_payload(decode=True) or b""
        if part.get_filename() is not None:
            files[name] = payload
        else:
            fields[name] = payload.decode("utf-8", errors="replace")
    return fields, files


def register(state: ServerState, body: bytes, content_type: str) -> StoredVoice:
    """A voice from a JSON body ({id, audio: base64, text}) or a form upload (id, text, file)."""
    if content_type.startswith("multipart/form-data"):
        fields, files = parse_multipart(body, content_type, state.config.max_upload_parts)
        audio = files.get("file") or files.get("audio")
        if audio is None:
            raise ApiError(400, "field 'file' (the reference audio upload) is required", "file")
        param = "file"
    else:
        fields = parse_json(body)
        raw = text_field(fields, "audio", required=True)
        audio, param = decode_base64(raw, "audio"), "audio"
    voice_id = text_field({"id": fields.get("id", fields.get("name"))}, "id", required=True)  # "name" as an alias
    if not _ID.match(voice_id):
        raise ApiError(400, f"voice id {voice_id!r} must be 1-64 letters, digits, '_', '.' or '-'", "id")
    text = text_field(fields, "text", limit=state.config.max_input_chars)
    if voice_id in state.voices:
        raise ApiError(409, f"voice {voice_id!r} already exists; delete it first", "id")
    presets = {v.id for m in state.loaded() for v in state.runtime.voices(m)}
    if voice_id in presets:
        raise ApiError(409, f"voice id {voice_id!r} is a model's preset voice; choose another", "id")
    if len(state.voices) >= state.config.max_voices:
        raise ApiError(409, f"the server holds its limit of {state.config.max_voices} voices; delete one first")
    samples, rate = decode_reference(audio, param)
    voice = StoredVoice(voice_id, samples, rate, text)
    state.voices[voice_id] = voice
    return voice


def listing(state: ServerState, model: str | None) -> list[dict]:
    """Uploaded voices, then each loaded model's preset and cached voices."""
    if model is not None:
        state.check_model(model)
    out = [{"id": v.id, "object": "voice", "kind": "uploaded", "model": None, "sample_rate": v.rate,
            "seconds": round(v.samples.numel() / v.rate, 3), "has_text": v.text is not None}
           for v in state.voices.values()]
    for name in state.loaded():
        if model is None or name == model:
            out += [{"id": v.id, "object": "voice", "kind": v.kind, "model": name, "description": v.description}
                    for v in state.runtime.voices(name)]
    return out
