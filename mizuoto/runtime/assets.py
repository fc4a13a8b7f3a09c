"""Where Mizuoto keeps files: shared resources under $MIZUOTO_HOME and per-model caches."""

from __future__ import annotations

import os
from pathlib import Path

from mizuoto.errors import ResourceError


def home_dir() -> Path:
    """`$MIZUOTO_HOME`, default `~/.cache/mizuoto`."""
    return Path(os.environ.get("MIZUOTO_HOME", Path.home() / ".cache" / "mizuoto")).expanduser()


def voices_dir() -> Path:
    """Where cached voices persist: `$MIZUOTO_VOICE_STORE`, default `$MIZUOTO_HOME/voices`."""
    given = os.environ.get("MIZUOTO_VOICE_STORE")
    return Path(given).expanduser() if given else home_dir() / "voices"


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def model_cache_dir(model_dir: str | Path) -> Path:
    """`<model>/.mizuoto/`, or a per-model folder under $MIZUOTO_HOME when the model dir is read-only."""
    model_dir = Path(model_dir).resolve()
    local = model_dir / ".mizuoto"
    if _writable(local):
        return local
    fallback = home_dir() / "models" / str(model_dir).strip("/").replace("/", "__")
    if not _writable(fallback):
        raise ResourceError(f"no writable cache for {model_dir}: neither {local} nor {fallback}")
    return fallback


def resource_dir(name: str, candidates: list[Path] | None = None) -> Path:
    """The folder of shared resource `name` (e.g. "cosyvoice/wetext"), or a clear error saying where it looked."""
    looked = [home_dir() / name, *(candidates or [])]
    for path in looked:
        if path.is_dir():
            return path
    where = ", ".join(str(p) for p in looked)
    raise ResourceError(f"shared resource {name!r} not found (looked in: {where}); "
                        f"install it under {home_dir() / name}")
