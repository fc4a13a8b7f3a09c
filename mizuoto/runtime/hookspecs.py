"""The plugin interface: every pluggy hook, grouped, with its calling convention. Cheap to import (no torch).

Implementers in this repository: `mizuoto_engines` by the built-in engines (runtime/plugins.py),
mizuoto-piper and mizuoto-chatterbox; `mizuoto_assets` by the CosyVoice engine's resources; `mizuoto_example_models`
by mizuoto-piper (its pinned default voice).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pluggy

hookspec = pluggy.HookspecMarker("mizuoto")
hookimpl = pluggy.HookimplMarker("mizuoto")


@dataclass(frozen=True)
class EngineRef:
    """An engine named without importing it: `module:attr` is imported only when the engine is used.

    `patterns` is a cheap detector (vLLM's registry picks a class before importing it): glob
    patterns of which at least one must match a file in a model directory before the engine is
    imported to run its own `detect()`. Empty: the engine is always asked.
    """

    name: str
    module: str
    attr: str
    patterns: tuple[str, ...] = ()

    def may_detect(self, model_dir: Path) -> bool:
        """Whether `model_dir` holds a file matching one of `patterns` (True when there are none)."""
        if not self.patterns:
            return True
        try:
            return any(next(Path(model_dir).glob(p), None) is not None for p in self.patterns)
        except OSError:
            return False


# ---- engines -----------------------------------------------------------------------------------

@hookspec
def mizuoto_engines() -> list:
    """The engines a plugin provides.

    Calling convention: called with no arguments once per plugin for each Registry built (every
    Runtime and every CLI command builds one), when the plugin is registered. Return a list whose items are Engine subclasses or EngineRef
    (preferred: nothing heavy is imported until the engine is used). Each engine's `name` must be
    unique across plugins. An exception or a malformed result is reported as a failure of this
    plugin only; the other plugins still load.
    """


# ---- shared resources -----------------------------------------------------------------------------

@hookspec
def mizuoto_assets() -> dict:
    """Where a plugin's shared resources may be found, e.g. data files bundled in a pinned package.

    Calling convention: called for every plugin, with no arguments, each time a resource is looked
    up (`mizuoto.runtime.plugins.find_resource(name)`, typically while a model loads). Return a
    mapping from resource name (e.g. "cosyvoice/wetext") to a list of candidate folders (str or
    Path); names the plugin does not know are simply absent. Candidates are tried in order after
    `$MIZUOTO_HOME/<name>` and the caller's own; the first existing folder wins, so list only
    folders whose content is right, and let the engine verify what it reads (e.g. by sha256).
    Must be cheap and must not import heavy modules, download or create anything. An exception
    is recorded as a failure of this plugin; the lookup goes on with the others.
    Implementer: `mizuoto.engines.cosyvoice.plugin` (the wetext FSTs and Whisper's vocabulary).
    """


# ---- models for demos and the contract suite -------------------------------------------------------

@hookspec
def mizuoto_example_models() -> list:
    """Model directories a plugin offers for demos and the contract suite.

    Calling convention: called with no arguments, once per plugin each time
    `Registry.example_models()` is asked (the demo, the contract suite's model collection). Return a list of existing directories (str or Path) that one of the
    plugin's engines detects, e.g. a small voice shipped in a pinned package. Must not download
    or create anything; return [] when none is installed.
    """
