"""Where Mizuoto keeps files: shared resources under $MIZUOTO_HOME, per-model caches, atomic writes."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mizuoto.runtime.errors import ResourceError


def home_dir() -> Path:
    """`$MIZUOTO_HOME`, default `~/.cache/mizuoto`."""
    return Path(os.environ.get("MIZUOTO_HOME", Path.home() / ".cache" / "mizuoto")).expanduser()


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


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; it replaces `path` only if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp makes 0600 files; give the result the mode a plain open() would
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write bytes so a crash never leaves a half file at `path`."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def resource_dir(name: str, candidates: list[Path] | None = None) -> Path:
    """The folder of shared resource `name` (e.g. "cosyvoice/wetext"), or a clear error saying where it looked."""
    looked = [home_dir() / name, *(candidates or [])]
    for path in looked:
        if path.is_dir():
            return path
    where = ", ".join(str(p) for p in looked)
    raise ResourceError(f"shared resource {name!r} not found (looked in: {where}); "
                        f"install it under {home_dir() / name}")
