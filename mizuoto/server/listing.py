"""What the server says about its models: GET /v1/models' entries (aliases included), and the start-up loads' lines."""

from __future__ import annotations

import logging
import re
import time

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.api import ModelInfo
from mizuoto.server.state import ServerState

log = logging.getLogger("mizuoto.server")
# a language the way engines name it: en, en_US, en-us, yue, es_419
_LANGUAGE = re.compile(r"([A-Za-z]{2,3})(?:[_-]([A-Za-z]{2}|[0-9]{3}))?")


def language_tag(name: str) -> str:
    """A language as a BCP 47 tag (`en_US` -> `en-US`, `EN` -> `en`); a name of another shape is kept as is."""
    m = _LANGUAGE.fullmatch(name)
    if m is None:
        return name
    return m[1].lower() + (f"-{m[2].upper()}" if m[2] else "")


def model_entry(state: ServerState, name: str, admin: bool = True, info: ModelInfo | None = None) -> dict:
    """A model as GET /v1/models lists it; `info` from one listing of the loaded models (else looked up now).

    A model evicted or unloaded after that listing is shown as not loaded (never an error).
    """
    if info is None:
        info = next((i for i in state.runtime.models() if i.name == name), None)
    voices = None
    if info is not None:
        try:
            voices = [v.id for v in state.runtime.voices(name)]
        except InvalidRequest:  # unloaded meanwhile
            info = None
    entry = {"id": name, "object": "model", "created": 0, "loaded": info is not None}
    if admin:  # where a model lies on the server is the administrator's business only
        entry["path"] = str(state.catalogue.get(name, ""))
    if info is not None:
        caps = info.capabilities
        entry.update(owned_by=info.engine, engine=info.engine, variant=info.variant, device=info.device,
                     state=info.state, strategy=info.strategy, sample_rate=caps.sample_rate, modes=sorted(caps.modes),
                     stream_out=caps.stream_out, stream_in=caps.stream_in,
                     languages=[language_tag(x) for x in caps.languages],
                     voices=voices, options=[{"name": o.name, **o.schema()} for o in caps.options])
    else:
        entry["owned_by"] = "mizuoto"
    aliases, voice_aliases = state.aliases.of_model(name), state.aliases.voices_of(name)
    if aliases:
        entry["aliases"] = aliases
    if voice_aliases:
        entry["voice_aliases"] = voice_aliases
    return entry


def model_list(state: ServerState, admin: bool) -> dict:
    """GET /v1/models' body: the loaded models, as one listing saw them, then the catalogue's others, then each
    model alias (an entry of its own, so clients that only read ids find it, with `alias_of` its target)."""
    infos = {i.name: i for i in state.runtime.models()}
    names = list(dict.fromkeys([*infos, *state.catalogue]))
    data = [model_entry(state, n, admin, infos.get(n)) for n in names]
    by_id = {e["id"]: e for e in data}
    for alias, target in sorted(state.aliases.models.items()):
        of = by_id.get(target, {})
        data.append({"id": alias, "object": "model", "created": 0, "loaded": of.get("loaded", False),
                     "owned_by": of.get("owned_by", "mizuoto"), "alias_of": target})
    return {"object": "list", "data": data}


def preload(state: ServerState) -> None:
    """Load every catalogue model that is not loaded, one after another, each with a line when it is loaded
    (its name, engine, device and the seconds it took); a model that fails stops the start (its error, raised)."""
    for name in list(state.catalogue):
        if name in state.loaded():
            continue
        log.info("loading model %s ...", name)
        start = time.monotonic()
        state.ensure_loaded(name)
        info = next((i for i in state.runtime.models() if i.name == name), None)
        what = f"{info.engine}{f' {info.variant}' if info.variant else ''} on {info.device}" if info else "evicted"
        log.info("loaded model %s (%s) in %.1f s", name, what, time.monotonic() - start)
