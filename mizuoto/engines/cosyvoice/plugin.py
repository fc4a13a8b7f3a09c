"""CosyVoice's answer to the `mizuoto_assets` hook: shared resources bundled in installed packages.

Registered by the runtime beside the built-in engines; importing it must stay cheap (no torch,
and the packages are found without importing them). What is offered here is only a
candidate: `resources.py` verifies every file it uses by sha256 before use.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

from mizuoto.runtime.hookspecs import hookimpl

WETEXT = "cosyvoice/wetext"   # {zh,en}/tn/{tagger,verbalizer}.fst, the set upstream's wetext 0.0.4 downloads
WHISPER = "whisper"           # multilingual.tiktoken, CosyVoice 1's text vocabulary
# wetext wheels 0.0.7-0.1.0 bundle the ModelScope FST snapshot upstream downloads; 0.1.1+ ship
# a rebuilt set whose output differs.
WETEXT_VERSIONS = ((0, 0, 7), (0, 1, 0))
INSTALL = "pip install 'mizuoto-runtime[cosyvoice]'"
FETCH_WHISPER = "mizuoto fetch whisper-vocab"  # Whisper's vocabulary: fetched once, explicitly (never at run time)


def environment_data_dir() -> Path:
    """`<sys.prefix>/share/mizuoto`: where `mizuoto fetch` installs data files for this environment."""
    return Path(sys.prefix) / "share" / "mizuoto"


def version_tuple(version: str) -> tuple[int, ...]:
    """`"0.0.9"` -> (0, 0, 9); trailing tags ignored."""
    return tuple(int(m) for m in re.findall(r"\d+", version)[:3])


def _package_dirs(name: str) -> list[Path]:
    """The folders of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(loc) for loc in spec.submodule_search_locations]


def wetext_fst_dirs() -> list[Path]:
    """The `fsts` folder of an installed wetext wheel of versions 0.0.7-0.1.0 (others ship other FSTs)."""
    try:
        version = importlib.metadata.version("wetext")
    except importlib.metadata.PackageNotFoundError:
        return []
    low, high = WETEXT_VERSIONS
    if not low <= version_tuple(version) <= high:
        return []
    return [d / "fsts" for d in _package_dirs("wetext")]


def whisper_asset_dirs() -> list[Path]:
    """Where `mizuoto fetch whisper-vocab` put multilingual.tiktoken in this environment, then the `assets`
    folder of an installed openai-whisper (no longer a dependency: used where it happens to be installed)."""
    return [environment_data_dir() / WHISPER, *(d / "assets" for d in _package_dirs("whisper"))]


@hookimpl
def mizuoto_assets() -> dict:
    """Candidate folders of CosyVoice's shared resources in installed packages."""
    return {WETEXT: wetext_fst_dirs(), WHISPER: whisper_asset_dirs()}
