"""Cached voices that persist: each model's prompts under `$MIZUOTO_HOME/voices/`, as safetensors + json.

Layout: `voices/<engine>-<fingerprint>/<voice>/{prompt.safetensors, voice.json}`. A voice folder is
written beside its final place and renamed into it, so a crash never leaves half a voice. The
fingerprint names the model's files (names, sizes and the bytes at each end of every file), so
a voice is offered only to the model it was made from, wherever that directory now lies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mizuoto.errors import ResourceError, quoted
from mizuoto.runtime.engine import VoicePrompt

log = logging.getLogger("mizuoto.runtime")
FORMAT = 1
PROMPT_FILE = "prompt.safetensors"
META_FILE = "voice.json"
# A voice id a client registers: safe as a file name, in headers and in logs (other ids are hex-encoded on disk).
# Match it with fullmatch: re's '$' alone lets a trailing newline through.
VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_EDGE = 1 << 20  # bytes hashed at each end of a model file
_MAX_FILES = 4096


@dataclass(frozen=True)
class ModelIdentity:
    """What a stored voice was made for: engine, variant, the model's name and path then, and its fingerprint."""

    engine: str
    variant: str | None
    name: str
    path: str
    fingerprint: str

    @property
    def folder(self) -> str:
        """The store folder of this model's voices."""
        return f"{self.engine}-{self.fingerprint[:20]}"

    def describe(self) -> str:
        """One phrase for messages: `model cosy (cosyvoice, cosyvoice2)`; never the path (messages reach clients,
        and where a model lies on the server is the administrator's business)."""
        kind = f"{self.engine}, {self.variant}" if self.variant else self.engine
        return f"model {self.name} ({kind})"


@dataclass(frozen=True)
class SavedVoice:
    """A voice in the store: its id, transcript, the model it belongs to, and where it lies."""

    id: str
    text: str | None
    model: ModelIdentity
    created: float
    folder: Path


def fingerprint(model_dir: str | Path) -> str:
    """sha256 over a model directory's files: relative names, sizes, and the first and last MiB of each."""
    root = Path(model_dir).resolve()
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if ".mizuoto" not in p.relative_to(root).parts and p.is_file())
    for path in files[:_MAX_FILES]:
        size = path.stat().st_size
        h.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(_EDGE))
            if size > 2 * _EDGE:
                f.seek(size - _EDGE)
                h.update(f.read(_EDGE))
    return h.hexdigest()


def _slug(voice_id: str) -> str:
    """A file name for a voice id: the id itself when it is plain, else its hex."""
    return voice_id if VOICE_ID.fullmatch(voice_id) else "~" + voice_id.encode().hex()[:120]


_TEXT, _MAYBE_TEXT = (str,), (str, type(None))
# voice.json's fields and the types each may take: a hand-edited or foreign file of any other shape is skipped
_FIELDS = {"id": _TEXT, "text": _MAYBE_TEXT, "engine": _TEXT, "variant": _MAYBE_TEXT, "model": _TEXT, "path": _TEXT,
           "fingerprint": _TEXT, "created": (int, float), "tensors": (list,), "meta": (dict, type(None))}


def _check_meta(m: dict, folder: Path) -> None:
    """ValueError unless voice.json `m` has each field of the type it is written with, and names `folder`."""
    for key, types in _FIELDS.items():
        value = m.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise ValueError(f"field {key!r} is {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}")
    if not m["id"] or _slug(m["id"]) != folder.name:
        raise ValueError(f"its id {quoted(m['id'])} does not name its folder {folder.name!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (m["meta"] or {}).items()):
        raise ValueError("its meta must map strings to strings")
    if not all(isinstance(t, str) for t in m["tensors"]):
        raise ValueError("its tensors must be a list of names")
    dtypes = m.get("dtypes", {})
    if not isinstance(dtypes, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in dtypes.items()):
        raise ValueError("its dtypes must map tensor names to dtype names")
    if not math.isfinite(m["created"]):
        raise ValueError("its creation time is not a number")


def _check_prompt(meta: Any, tensors: dict) -> None:
    """ValueError unless the prompt holds the tensors voice.json names, each of the dtype it was saved with."""
    if not isinstance(meta, dict):
        raise ValueError(f"{META_FILE} is not an object")
    if sorted(tensors) != sorted(meta.get("tensors") or []):
        raise ValueError(f"its tensors {sorted(tensors)} are not the ones {META_FILE} names")
    dtypes = meta.get("dtypes")  # voices saved before dtypes were recorded have none: their names are checked
    if dtypes is not None:
        wrong = sorted(k for k, t in tensors.items() if not isinstance(dtypes, dict) or dtypes.get(k) != str(t.dtype))
        if wrong:
            raise ValueError(f"tensors {wrong} are not of the dtypes they were saved with")


class VoiceStore:
    """The voices under one folder (default `$MIZUOTO_HOME/voices`)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def save(self, voice_id: str, model: ModelIdentity, prompt: VoicePrompt, text: str | None) -> SavedVoice:
        """Write a voice atomically (replacing one of the same id for the same model)."""
        from safetensors.torch import save_file

        parent = self.root / model.folder
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=parent))
        except OSError as e:
            raise ResourceError(f"cannot write voices under {parent}: {e}") from None
        created = time.time()
        try:
            # separate, contiguous copies: safetensors refuses tensors that share memory
            tensors = {k: t.detach().to("cpu").contiguous().clone() for k, t in prompt.tensors.items()}
            save_file(tensors, str(tmp / PROMPT_FILE))
            meta = {"format": FORMAT, "id": voice_id, "text": text, "created": created,
                    "engine": model.engine, "variant": model.variant, "model": model.name, "path": model.path,
                    "fingerprint": model.fingerprint, "tensors": sorted(tensors), "meta": prompt.meta,
                    "dtypes": {k: str(t.dtype) for k, t in sorted(tensors.items())}}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False))
            final = parent / _slug(voice_id)
            old = None
            if final.exists():
                old = parent / f".old-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            raise ResourceError(f"cannot write voice {voice_id!r} under {parent}: {e}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return SavedVoice(voice_id, text, model, created, final)

    def load(self, stored: SavedVoice) -> VoicePrompt:
        """The prompt of a stored voice, as the engine exported it."""
        from safetensors.torch import load_file

        try:
            meta = json.loads((stored.folder / META_FILE).read_text())
            tensors = load_file(str(stored.folder / PROMPT_FILE))
            _check_prompt(meta, tensors)
            return VoicePrompt(tensors, dict(meta.get("meta") or {}))
        except Exception as e:  # missing, truncated, foreign or hand-edited files
            raise ResourceError(f"stored voice {stored.id!r} in {stored.folder} is unreadable: {e}") from None

    def voices(self, model: ModelIdentity | None = None) -> list[SavedVoice]:
        """Stored voices, of one model (by its folder) or of all, oldest first."""
        if not self.root.is_dir():
            return []
        folders = [self.root / model.folder] if model is not None else sorted(self.root.iterdir())
        out = []
        for parent in folders:
            if not parent.is_dir():
                continue
            for folder in sorted(parent.iterdir()):
                if folder.name.startswith("."):
                    continue
                try:
                    m = json.loads((folder / META_FILE).read_text())
                    if not isinstance(m, dict) or m.get("format") != FORMAT or not (folder / PROMPT_FILE).is_file():
                        raise ValueError(f"not a {FORMAT} voice, or its {PROMPT_FILE} is missing")
                    _check_meta(m, folder)
                    ident = ModelIdentity(m["engine"], m.get("variant"), m["model"], m["path"], m["fingerprint"])
                    out.append(SavedVoice(m["id"], m.get("text"), ident, float(m["created"]), folder))
                except (OSError, ValueError, KeyError, TypeError) as e:  # one bad entry never hides the others
                    log.warning("stored voice skipped: %s: %s", folder / META_FILE, e)
        return sorted(out, key=lambda v: v.created)

    def find(self, voice_id: str) -> list[SavedVoice]:
        """Every stored voice of this id (one per model at most)."""
        return [v for v in self.voices() if v.id == voice_id]

    def delete(self, stored: SavedVoice) -> None:
        """Remove a stored voice (renamed away first, so a reader never sees half of it)."""
        gone = stored.folder.parent / f".del-{stored.folder.name}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.replace(stored.folder, gone)
        except FileNotFoundError:
            return
        except OSError as e:
            raise ResourceError(f"cannot remove voice {stored.id!r} from {stored.folder}: {e}") from None
        shutil.rmtree(gone, ignore_errors=True)
