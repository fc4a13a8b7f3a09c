"""Shared resources CosyVoice needs beyond a model directory: the wetext FSTs and Whisper's vocabulary.

Each is found as a runtime resource (`$MIZUOTO_HOME/<name>`, then the `mizuoto_assets`
candidates, see plugin.py) and verified by sha256 before use: a different FST set normalizes
differently, so it is refused by name rather than used.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from mizuoto.engines.cosyvoice.plugin import FETCH_WHISPER, INSTALL, WETEXT, WHISPER
from mizuoto.errors import ResourceError
from mizuoto.runtime.plugins import find_resource

WHISPER_TIKTOKEN = "multilingual.tiktoken"

# The FSTs CosyVoice loads (`Normalizer(remove_erhua=False)` and `Normalizer()`, both languages),
# as bundled by wetext 0.0.7-0.1.0 (= shared/assets/wetext/fsts).
FST_SHA256 = {
    "zh/tn/tagger.fst": "63f3abeafe64fc3e9232099ab8ef6efd44c5198319193854af3ac2716d7c27a7",
    "zh/tn/verbalizer.fst": "9fcadad76cafddb2e96b92d892d18249f0ba5fbe60e4d4fc51f466cb6bc7ade9",
    "en/tn/tagger.fst": "bb804f88030153999f154f01950c18dbfd64de2c4cfc5035e21371d4eb4ead8a",
    "en/tn/verbalizer.fst": "33ad65460a3e8f7fe313994ff0204a218c0fcb5dec9c09b24aeeaa30ef21d67b",
}
# openai-whisper's assets/multilingual.tiktoken (identical from v20231117, which CosyVoice pins, to 20250625);
# `mizuoto fetch whisper-vocab` installs it (mizuoto/cli/fetch.py)
WHISPER_SHA256 = {WHISPER_TIKTOKEN: "b34b360dbb493e781e479794586d661700670d65564001f23024971d1f2fa126"}


@functools.lru_cache(maxsize=64)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    # keyed by size and mtime too, so a file replaced in place is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(folder: Path, expected: dict[str, str], what: str, install: str = INSTALL) -> Path:
    """`folder` when each listed file has its sha256; else a ResourceError naming the first that differs."""
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            raise ResourceError(f"{what} at {folder} lacks {name}; remove that folder or reinstall with `{install}`")
        st = path.stat()
        if _sha256(path.resolve(), st.st_size, st.st_mtime_ns) != digest:
            raise ResourceError(f"{what}: {path} is not the pinned file (sha256 differs), and another file would "
                                f"change the output; remove it or reinstall with `{install}`")
    return folder


def _find(name: str, what: str, extra: list[Path] | None = None, install: str = INSTALL) -> Path:
    try:
        return find_resource(name, extra)
    except ResourceError as e:
        raise ResourceError(f"{what} ({name!r}) not found: run `{install}` ({e})") from None


def fst_dir() -> Path:
    """The verified wetext FST folder (`{zh,en}/tn/*.fst`) for CosyVoice's text normalization."""
    return verify(_find(WETEXT, "the wetext FSTs"), FST_SHA256, "the wetext FSTs")


def whisper_vocab_dir(model_dir: Path) -> Path:
    """The verified folder holding CosyVoice 1's multilingual.tiktoken ($MIZUOTO_HOME, the model dir, packages)."""
    local = [Path(model_dir)] if (Path(model_dir) / WHISPER_TIKTOKEN).is_file() else []
    return verify(_find(WHISPER, "the Whisper vocabulary", local, FETCH_WHISPER), WHISPER_SHA256,
                  "the Whisper vocabulary", FETCH_WHISPER)
