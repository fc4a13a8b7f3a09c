"""GET/POST/DELETE /v1/audio/voices: voices registered once by reference audio, used later by id.

With a `model`, the engine computes the voice's prompt once and the Runtime stores it under
`$MIZUOTO_HOME/voices/` (it survives a restart); without one, the audio is kept in memory and
each request computes the prompt from it.
"""

from __future__ import annotations

import email.message
import email.parser
import email.policy

from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.voicestore import VOICE_ID
from mizuoto.server.audio import decode_base64, decode_reference
from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.state import ServerState, StoredVoice
from mizuoto.server.validation import name_field, parse_json, text_field


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


def register(state: ServerState, body: bytes, content_type: str) -> dict:
    """A voice from a JSON body ({id, audio: base64, text, model}) or a form upload (id, text, model, file).

    Returns the response body. With `model` the voice is cached (and stored) on that model; without, uploaded.
    """
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
    if not VOICE_ID.fullmatch(voice_id):
        raise ApiError(400, f"voice id {voice_id!r} must be 1-64 letters, digits, '_', '.' or '-'", "id")
    text = text_field(fields, "text", limit=state.config.max_input_chars)
    given = fields.get("model")
    model = name_field({"model": None if given == "" else given}, "model")  # a form's empty field: no model
    if model is not None:
        state.check_model(model)
    if voice_id in state.voices:
        raise ApiError(409, f"voice {voice_id!r} already exists; delete it first", "id")
    presets = {v.id for m in state.loaded() for v in state.runtime.voices(m) if v.kind == "preset"}
    if voice_id in presets:
        raise ApiError(409, f"voice id {voice_id!r} is a model's preset voice; choose another", "id")
    if len(state.voices) + len(state.runtime.stored_voices()) >= state.config.max_voices:
        raise ApiError(409, f"the server holds its limit of {state.config.max_voices} voices; delete one first")
    samples, rate = decode_reference(audio, param)
    seconds = round(samples.numel() / rate, 3)
    if model is not None:
        _cache(state, model, voice_id, samples, rate, text)
        return {"id": voice_id, "object": "voice", "kind": "cached", "model": model, "sample_rate": rate,
                "seconds": seconds, "stored": state.runtime.identity(model) is not None}
    cached = {v.id for m in state.loaded() for v in state.runtime.voices(m)}
    if voice_id in cached or voice_id in {v.id for v in state.runtime.stored_voices()}:
        raise ApiError(409, f"voice {voice_id!r} already exists (cached on a model); delete it first", "id")
    state.voices[voice_id] = StoredVoice(voice_id, samples, rate, text)
    return {"id": voice_id, "object": "voice", "kind": "uploaded", "sample_rate": rate, "seconds": seconds}


def _cache(state: ServerState, model: str, voice_id: str, samples, rate: int, text: str | None) -> None:
    """Compute the voice's prompt on `model` once; the Runtime stores it for later runs."""
    try:
        state.ensure_loaded(model)
        if not state.runtime.model(model).capabilities.voice_cache:
            raise ApiError(400, f"model {model} cannot cache voices; register without 'model' to keep the audio",
                           "model")
        if voice_id in {v.id for v in state.runtime.voices(model)}:
            raise ApiError(409, f"voice {voice_id!r} already exists on model {model}; delete it first", "id")
        state.runtime.add_voice(model, voice_id, (samples, rate), text)
    except Exception as e:
        raise from_exception(e) from None


def delete(state: ServerState, voice_id: str, model: str | None) -> dict:
    """Remove an uploaded voice, or a cached one (from `model`, else from every model) and its stored copy."""
    if model is None and voice_id in state.voices:
        del state.voices[voice_id]
        return {"id": voice_id, "object": "voice", "deleted": True}
    if model is not None:
        state.check_model(model)
        if model not in state.loaded():
            raise ApiError(409, f"model {model!r} is not loaded; load it, or delete the voice without ?model=",
                           "model")
    try:
        state.runtime.remove_voice(voice_id, model)
    except InvalidRequest:
        raise ApiError(404, "no uploaded or cached voice of that id; GET /v1/audio/voices lists them",
                       "voice_id") from None
    return {"id": voice_id, "object": "voice", "deleted": True}


def listing(state: ServerState, model: str | None) -> list[dict]:
    """Uploaded voices, then each loaded model's preset and cached voices, then stored voices of models not loaded."""
    if model is not None:
        state.check_model(model)
    out = [{"id": v.id, "object": "voice", "kind": "uploaded", "model": None, "sample_rate": v.rate,
            "seconds": round(v.samples.numel() / v.rate, 3), "has_text": v.text is not None}
           for v in state.voices.values()]
    stored = state.runtime.stored_voices()
    loaded_prints = set()
    for name in state.loaded():
        try:
            ident = state.runtime.identity(name)
        except MizuotoError:  # unloaded or evicted meanwhile
            continue
        mine = {s.id for s in stored if ident is not None and s.model.fingerprint == ident.fingerprint}
        if ident is not None:
            loaded_prints.add(ident.fingerprint)
        if model is None or name == model:
            out += [{"id": v.id, "object": "voice", "kind": v.kind, "model": name, "description": v.description,
                     **({"stored": v.id in mine} if v.kind == "cached" else {})}
                    for v in state.runtime.voices(name)]
    for s in stored:  # voices stored for a model that is not loaded now
        if s.model.fingerprint not in loaded_prints and (model is None or s.model.name == model):
            out.append({"id": s.id, "object": "voice", "kind": "cached", "model": s.model.name, "stored": True,
                        "loaded": False, "has_text": s.text is not None})
    return out
