"""GET/POST/DELETE /v1/audio/voices: voices registered once by reference audio, used later by id.

With a `model`, the engine computes the voice's prompt once and the Runtime stores it under
`$MIZUOTO_HOME/voices/` (it survives a restart); without one, the audio is kept in memory and
each request computes the prompt from it.
"""

from __future__ import annotations

from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.lease import Lease
from mizuoto.server.audio import MAX_VOICE_RATE, MAX_VOICE_SECONDS, decode_base64, decode_reference
from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.state import ServerState, StoredVoice
from mizuoto.server.bodies import parse_json
from mizuoto.server.schemas import checked, voice_models


def parse_multipart(body: bytes, content_type: str, max_parts: int = 16, max_file_bytes: int = 32 << 20,
                    max_field_bytes: int = 16 << 10) -> tuple[dict[str, str], dict[str, bytes]]:
    """(text fields, file fields) of a multipart/form-data body; a part with a filename is a file."""
    boundary = parse_options_header(content_type.encode("latin-1", "replace"))[1].get(b"boundary")
    if not boundary:
        raise ApiError(400, "multipart/form-data content-type has no boundary")
    # python-multipart reads no preamble: a body that does not open with the boundary was made with another one
    if not body.lstrip(b"\r\n").startswith(b"--" + boundary):
        raise ApiError(400, "multipart body does not start with the boundary its content-type names")
    parts: list[list] = []  # [name, is a file, chunks, size] of each part
    head, key, value = {}, bytearray(), bytearray()

    def begin() -> None:  # counted as they come: thousands of tiny parts stop at the first one too many
        if len(parts) == max_parts:
            raise ApiError(400, f"multipart body has more than {max_parts} parts")
        head.clear()

    def header_end() -> None:
        head[bytes(key).lower()] = bytes(value)
        key.clear(), value.clear()

    def headers_finished() -> None:
        options = parse_options_header(head.get(b"content-disposition"))[1]
        parts.append([options.get(b"name", b"").decode("utf-8", "replace"), b"filename" in options, [], 0])

    def data(chunk: bytes, start: int, end: int) -> None:  # refused before an oversized part is held whole
        part, limit = parts[-1], max_file_bytes if parts[-1][1] else max_field_bytes
        part[3] += end - start
        if part[3] > limit:
            raise ApiError(400, f"multipart part {part[0]!r} exceeds its limit of {limit} bytes")
        part[2].append(chunk[start:end])

    try:  # python-multipart's FormParserError and MultipartParseError are ValueErrors
        parser = MultipartParser(boundary, {
            "on_part_begin": begin, "on_header_field": lambda d, s, e: key.extend(d[s:e]),
            "on_header_value": lambda d, s, e: value.extend(d[s:e]), "on_header_end": header_end,
            "on_headers_finished": headers_finished, "on_part_data": data})
        parser.write(body)
    except ValueError as e:
        raise ApiError(400, f"multipart body could not be parsed: {e}") from None
    if parser.state != MultipartState.END:  # its finalize() does not check that the closing boundary came
        raise ApiError(400, "multipart body ends before its closing boundary")
    fields = {name: b"".join(c).decode("utf-8", errors="replace") for name, is_file, c, _ in parts if not is_file}
    files = {name: b"".join(c) for name, is_file, c, _ in parts if is_file}
    fields.pop("", None), files.pop("", None)  # parts without a name are skipped
    return fields, files


def register(state: ServerState, body: bytes, content_type: str, lease: Lease | None = None) -> dict:
    """A voice from a JSON body ({id, audio: base64, text, model}) or a form upload (id, text, model, file).

    Returns the response body. With `model` the voice is cached (and stored) on that model; without, uploaded.
    The `lease` (the upload's: its deadline, its client leaving) bounds the wait for the model and its front end.
    """
    as_json, as_form = voice_models(state.config.max_input_chars)
    if content_type.startswith("multipart/form-data"):
        # a text field holds at most max_input_chars characters, each at most 4 bytes of UTF-8
        fields, files = parse_multipart(body, content_type, state.config.max_upload_parts,
                                        state.config.max_body_bytes, state.config.max_input_chars * 4)
        voice = checked(as_form, {**fields, **files})
        audio, param = voice.file if voice.file is not None else voice.audio, "file"
        if audio is None:
            raise ApiError(400, "field 'file' (the reference audio upload) is required", "file")
    else:
        voice = checked(as_json, parse_json(body))
        audio, param = decode_base64(voice.audio, "audio"), "audio"
    voice_id, text = voice.id if voice.id is not None else voice.name, voice.text
    model = state.aliases.model(voice.model)
    if voice_id is None:
        raise ApiError(400, "field 'id' is required", "id")
    if model is not None:
        state.check_model(model)
    _reserve(state, voice_id, model)
    try:
        samples, rate = decode_reference(audio, param, MAX_VOICE_SECONDS, MAX_VOICE_RATE)
        seconds = round(samples.numel() / rate, 3)
        if model is not None:
            _cache(state, model, voice_id, samples, rate, text, lease if lease is not None else Lease())
            return {"id": voice_id, "object": "voice", "kind": "cached", "model": model, "sample_rate": rate,
                    "seconds": seconds, "stored": state.runtime.identity(model) is not None}
        state.add_uploaded(StoredVoice(voice_id, samples, rate, text))
        return {"id": voice_id, "object": "voice", "kind": "uploaded", "sample_rate": rate, "seconds": seconds}
    finally:
        with state.voice_lock:
            state.creating.discard(voice_id)


def _reserve(state: ServerState, voice_id: str, model: str | None) -> None:
    """409 unless `voice_id` is free for a new voice of its kind; else reserve it until register() ends.

    One step under the lock: two concurrent creations of an id (uploaded or cached) cannot both pass.
    The same id may be cached on several models (a stored voice made for another model tells the
    client to add it to this one); on `model` itself, when it is not loaded yet, _cache checks after loading.
    """
    with state.voice_lock:
        if voice_id in state.voices or voice_id in state.creating:
            raise ApiError(409, f"voice {voice_id!r} already exists or is being created; delete it first", "id")
        on_models = {m: _voices_of(state, m) for m in state.loaded()}
        if any(v.id == voice_id and v.kind == "preset" for vs in on_models.values() for v in vs):
            raise ApiError(409, f"voice id {voice_id!r} is a model's preset voice; choose another", "id")
        stored = state.runtime.stored_voices()
        if model is None:
            taken = any(v.id == voice_id for vs in on_models.values() for v in vs) \
                or any(s.id == voice_id for s in stored)
        else:
            taken = any(v.id == voice_id for v in on_models.get(model, ()))
        if taken:
            raise ApiError(409, f"voice {voice_id!r} already exists (cached on a model); delete it first", "id")
        # voices being created count: concurrent uploads cannot pass the limit together
        if len(state.voices) + len(stored) + len(state.creating) >= state.config.max_voices:
            raise ApiError(409, f"the server holds its limit of {state.config.max_voices} voices; delete one first")
        state.creating.add(voice_id)


def _voices_of(state: ServerState, model: str) -> list:
    """A loaded model's voices; none when it was unloaded or evicted meanwhile."""
    try:
        return state.runtime.voices(model)
    except MizuotoError:
        return []


def _cache(state: ServerState, model: str, voice_id: str, samples, rate: int, text: str | None,
           lease: Lease) -> None:
    """Compute the voice's prompt on `model` once, each wait bounded by the lease; the Runtime stores it."""
    try:
        state.ensure_loaded(model, lease)  # pinned for the upload from here
        if not state.runtime.model(model).capabilities.voice_cache:
            raise ApiError(400, f"model {model} cannot cache voices; register without 'model' to keep the audio",
                           "model")
        if voice_id in {v.id for v in state.runtime.voices(model)}:
            raise ApiError(409, f"voice {voice_id!r} already exists on model {model}; delete it first", "id")
        state.runtime.add_voice(model, voice_id, (samples, rate), text, lease=lease)
    except Exception as e:
        raise from_exception(e) from None


def delete(state: ServerState, voice_id: str, model: str | None) -> dict:
    """Remove an uploaded voice, or a cached one (from `model`, else from every model) and its stored copy."""
    if model is None and state.drop_uploaded(voice_id):
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
    uploaded = state.voices  # the dict of now: a voice added or deleted meanwhile replaces it (copy on write)
    out = [{"id": v.id, "object": "voice", "kind": "uploaded", "model": None, "sample_rate": v.rate,
            "seconds": round(v.samples.numel() / v.rate, 3), "has_text": v.text is not None}
           for v in uploaded.values()]
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
