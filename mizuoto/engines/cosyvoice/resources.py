"""Shared resources CosyVoice needs beyond a model directory: the wetext FSTs and Whisper's vocabulary.

Each is looked up as a runtime resource ($MIZUOTO_HOME/<name> first), then in installed
packages that bundle it, found without importing them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

from mizuoto.errors import ResourceError
from mizuoto.runtime.assets import resource_dir

WETEXT = "cosyvoice/wetext"
WHISPER = "whisper"
# wetext wheels that bundle the same ModelScope FST snapshot upstream downloads (0.1.1+ ship
# a rebuilt set with different output).
_WHEEL_VERSIONS = ((0, 0, 7), (0, 1, 0))


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(m) for m in re.findall(r"\d+", version)[:3])


def _wheel_fst_dirs() -> list[Path]:
    """The `fsts` folder of an installed wetext wheel of a matching version, found without importing it."""
    try:
        spec = importlib.util.find_spec("wetext")
        version = importlib.metadata.version("wetext")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    low, high = _WHEEL_VERSIONS
    if not low <= _version_tuple(version) <= high:
        return []
    return [Path(loc) / "fsts" for loc in spec.submodule_search_locations]


def default_fst_dir() -> Path:
    """The FST folder (`{zh,en}/tn/*.fst`): $MIZUOTO_HOME/cosyvoice/wetext, else a wetext 0.0.7-0.1.0 wheel's."""
    try:
        return resource_dir(WETEXT, candidates=_wheel_fst_dirs())
    except ResourceError as e:
        raise ResourceError(f"{e}, or `pip install wetext==0.1.0` for its bundled FSTs") from None



def _whisper_candidates() -> list[Path]:
    # An installed openai-whisper ships the vocabulary in its assets folder; found without importing it.
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(loc) / "assets" for loc in spec.submodule_search_locations]


def whisper_vocab_dir(model_dir: Path) -> Path:
    """The folder holding CosyVoice 1's multilingual.tiktoken: $MIZUOTO_HOME/whisper, the model dir, openai-whisper."""
    return resource_dir(WHISPER, [Path(model_dir), *_whisper_candidates()])
