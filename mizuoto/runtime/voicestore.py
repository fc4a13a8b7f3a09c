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
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mizuoto.errors import ResourceError
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
        """One phrase for messages: `model cosy (cosyvoice, cosyvoice2, at /models/x)`."""
        kind = f"{self.engine}, {self.variant}" if self.variant else self.engine
        return f"model {self.name} ({kind}, at {self.path})"


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
                    "fingerprint": model.fingerprint, "tensors": sorted(tensors), "meta": prompt.meta}
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
        except Exception as e:  # missing, truncated or foreign files
            raise ResourceError(f"stored voice {stored.id!r} in {stored.folder} is unreadable: {e}") from None
        return VoicePrompt(tensors, dict(meta.get("meta") or {}))

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
