"""`mizuoto fetch NAME`: install a pinned data file a model needs, checked by sha256, once and on request.

Nothing is ever downloaded while a model loads or speaks: a missing file is a load error that
names this command. Today it knows one file, CosyVoice 1's text vocabulary (Whisper's
`multilingual.tiktoken`, ~800 KB): read from openai-whisper's source archive on PyPI (pinned by
its own sha256; nothing of the package is installed) or, offline, `--from` a copy of the file or
of that archive. It lands in this environment's `<sys.prefix>/share/mizuoto/` (where the
CosyVoice engine looks), or under `$MIZUOTO_HOME` with `--home`.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mizuoto.errors import InvalidRequest, MizuotoError


@dataclass(frozen=True)
class Pinned:
    """A data file and the one archive it is read from, both pinned by sha256."""
    resource: str      # the resource folder it belongs in (runtime.plugins.find_resource's name)
    file: str          # its name in that folder
    sha256: str
    url: str           # the archive on PyPI's file host
    archive_sha256: str
    member: str        # its path inside the archive
    what: str


PINNED = {
    "whisper-vocab": Pinned(
        resource="whisper", file="multilingual.tiktoken",
        sha256="b34b360dbb493e781e479794586d661700670d65564001f23024971d1f2fa126",
        url="https://files.pythonhosted.org/packages/35/8e/"
            "d36f8880bcf18ec026a55807d02fe4c7357da9f25aebd92f85178000c0dc/openai_whisper-20250625.tar.gz",
        archive_sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
        member="openai_whisper-20250625/whisper/assets/multilingual.tiktoken",
        what="CosyVoice 1's text vocabulary (Whisper's multilingual.tiktoken, from openai-whisper 20250625)"),
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download(url: str, progress: Callable[[str], None]) -> bytes:
    """The bytes at `url` (the only network access of the package; tests replace it)."""
    import urllib.request

    progress(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.read()
    except OSError as e:
        raise MizuotoError(f"cannot download {url} ({e}); on a machine without the network, copy the file there"
                           " and pass --from FILE") from None


def extract(pin: Pinned, data: bytes, source: str) -> bytes:
    """The pinned file from `data`: the file itself, or the pinned archive holding it."""
    if _sha256(data) == pin.sha256:
        return data
    if _sha256(data) != pin.archive_sha256:
        raise MizuotoError(f"{source} is neither {pin.file} nor the pinned archive (sha256 {_sha256(data)[:16]}...);"
                           " nothing was installed")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.extractfile(pin.member)
        file = member.read() if member is not None else b""
    if _sha256(file) != pin.sha256:
        raise MizuotoError(f"{pin.member} in {source} is not the pinned file; nothing was installed")
    return file


def destination(pin: Pinned, home: bool) -> Path:
    """Where the file goes: this environment's share/mizuoto/<resource>, or $MIZUOTO_HOME/<resource>."""
    from mizuoto.engines.cosyvoice.plugin import environment_data_dir
    from mizuoto.runtime.assets import home_dir

    return (home_dir() if home else environment_data_dir()) / pin.resource / pin.file


def fetch(name: str, source: str | None = None, home: bool = False,
          progress: Callable[[str], None] | None = None) -> Path:
    """Install pinned file `name` (from `source`, a local file, or else its pinned URL); returns its path."""
    from mizuoto.files import atomic_write_bytes

    say = progress or (lambda line: print(f"mizuoto fetch: {line}", file=sys.stderr, flush=True))
    try:
        pin = PINNED[name]
    except KeyError:
        raise InvalidRequest(f"fetch: unknown file {name!r} (known: {', '.join(PINNED)})") from None
    target = destination(pin, home)
    if target.is_file() and _sha256(target.read_bytes()) == pin.sha256:
        say(f"{pin.what} is already installed at {target}")
        return target
    if source is not None:
        path = Path(source)
        if not path.is_file():
            raise InvalidRequest(f"fetch --from: no such file {source}")
        say(f"reading {path}")
        data = extract(pin, path.read_bytes(), str(path))
    else:
        data = extract(pin, download(pin.url, say), pin.url)
    try:
        atomic_write_bytes(target, data)
    except OSError as e:
        raise MizuotoError(f"cannot write {target} ({e}); try --home to install under $MIZUOTO_HOME") from None
    say(f"installed {pin.what} at {target} (sha256 checked)")
    return target


def add_fetch_arguments(p: argparse.ArgumentParser) -> None:
    """The fetch command's arguments."""
    p.add_argument("name", choices=sorted(PINNED), help="the file to install: whisper-vocab (CosyVoice 1)")
    p.add_argument("--from", dest="source", metavar="FILE",
                   help="read the file (or openai-whisper's 20250625 source archive) from here instead of the network")
    p.add_argument("--home", action="store_true",
                   help="install under $MIZUOTO_HOME instead of this environment's share/mizuoto")


def run_fetch(args: argparse.Namespace) -> int:
    """Install the file; one line per step on stderr, its path on stdout."""
    print(fetch(args.name, args.source, args.home))
    return 0
