"""The plugin interface: pluggy hook specifications and markers. Importing this module is cheap (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import pluggy

hookspec = pluggy.HookspecMarker("mizuoto")
hookimpl = pluggy.HookimplMarker("mizuoto")


@dataclass(frozen=True)
class EngineRef:
    """An engine named without importing it: `module:attr` is imported only when the engine is used."""

    name: str
    module: str
    attr: str


@hookspec
def mizuoto_engines() -> list:
    """The engines a plugin provides.

    Calling convention: called once per plugin, with no arguments, the first time a Runtime or the
    CLI needs the engine list. Return a list whose items are Engine subclasses or EngineRef
    (preferred: nothing heavy is imported until the engine is used). Each engine's `name` must be
    unique across plugins. An exception or a malformed result is reported as a failure of this
    plugin only; the other plugins still load.
    """


@hookspec
def mizuoto_assets() -> dict:
    """Where a plugin's shared resources may be found.

    Calling convention: called once per plugin, with no arguments, when a resource is looked up.
    Return a mapping from resource name (e.g. "cosyvoice/wetext") to a list of candidate folders,
    tried in order after `$MIZUOTO_HOME/<name>`. Must not download or create anything.
    """


@hookspec
def mizuoto_example_models() -> list:
    """Model directories a plugin offers for demos and the contract suite.

    Calling convention: called once per plugin, with no arguments, when the contract suite (or a
    demo) collects models. Return a list of existing directories (str or Path) that one of the
    plugin's engines detects, e.g. a small voice shipped in a pinned package. Must not download
    or create anything; return [] when none is installed.
    """
