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


@hookspec
def mizuoto_example_models() -> list:
    """Model directories a plugin offers for demos and the contract suite.

    Calling convention: called once per plugin, with no arguments, when the contract suite (or a
    demo) collects models. Return a list of existing directories (str or Path) that one of the
    plugin's engines detects, e.g. a small voice shipped in a pinned package. Must not download
    or create anything; return [] when none is installed.
    """
