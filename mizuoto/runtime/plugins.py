"""Engine registry: built-in engines and entry-point plugins through one pluggy hook, imported lazily.

A plugin that fails to import, register or answer its hook is recorded in `failures` by name
with its error; the other plugins still load.
"""

from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy

from mizuoto.runtime import hookspecs
from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.runtime.hookspecs import EngineRef, hookimpl

ENTRY_POINT_GROUP = "mizuoto.engines"

# Built-in engines: name -> (module, class), imported only when used (vLLM's registry style).
# The patterns are the cheap detector: a directory without such a file never imports the engine.
BUILTIN_ENGINES = {
    "cosyvoice": ("mizuoto.engines.cosyvoice.engine", "CosyVoiceEngine", ("cosyvoice*.yaml",)),
}

# Built-in engines' answers to mizuoto_assets (where their shared resources are installed), by
# module: imported only when a resource is looked up, and each imports cheaply (no torch).
BUILTIN_ASSETS = ("mizuoto.engines.cosyvoice.plugin",)

_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")


class _Builtins:
    """The built-in engines, registered through the same hook as any plugin."""

    @hookimpl
    def mizuoto_engines(self) -> list:
        return [EngineRef(name, module, attr, patterns) for name, (module, attr, patterns) in BUILTIN_ENGINES.items()]

    @hookimpl
    def mizuoto_assets(self) -> dict:
        found: dict[str, list] = {}
        for module in BUILTIN_ASSETS:
            for name, dirs in importlib.import_module(module).mizuoto_assets().items():
                found.setdefault(name, []).extend(dirs)
        return found


@dataclass(frozen=True)
class PluginFailure:
    """A plugin or engine that could not be loaded, and why."""

    plugin: str
    error: str

    def __str__(self) -> str:
        return f"{self.plugin}: {self.error}"


def describe_error(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {e}".splitlines()[0]


class Registry:
    """Engines by name from the built-ins, the `mizuoto.engines` entry points and `extra` plugin objects."""

    def __init__(self, entry_points: bool = True, extra: tuple = (), builtins: bool = True):
        self.pm = pluggy.PluginManager("mizuoto")
        self.pm.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self._sources: dict[str, tuple[str, Any]] = {}  # engine name -> (plugin name, class or EngineRef)
        self._classes: dict[str, type] = {}
        if builtins:
            self._register(_Builtins(), "builtin")
        if entry_points:
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                try:
                    obj = ep.load()
                except Exception as e:  # a broken plugin must not take the others down
                    self.failures.append(PluginFailure(ep.name, f"import failed: {describe_error(e)}"))
                    continue
                self._register(obj, ep.name)
        for i, obj in enumerate(extra):
            self._register(obj, getattr(obj, "__name__", f"extra-{i}"))

    def _register(self, obj: Any, plugin: str) -> None:
        """Register a plugin object (module or instance with hookimpls) or a bare Engine class."""
        from mizuoto.runtime.engine import Engine

        if isinstance(obj, type) and issubclass(obj, Engine):
            self._add(obj, plugin)
            return
        try:
            self.pm.register(obj, name=plugin)
        except Exception as e:
            self.failures.append(PluginFailure(plugin, f"registration failed: {describe_error(e)}"))
            return
        impls = [i for i in self.pm.hook.mizuoto_engines.get_hookimpls() if i.plugin is obj]
        others = [i for hook in (self.pm.hook.mizuoto_assets, self.pm.hook.mizuoto_example_models)
                  for i in hook.get_hookimpls() if i.plugin is obj]
        if not impls and not others:
            self.failures.append(PluginFailure(plugin, "provides no mizuoto hooks"))
        for impl in impls:
            try:
                engines = impl.function()
                if not isinstance(engines, (list, tuple)):
                    raise TypeError(f"mizuoto_engines returned {type(engines).__name__}, not a list")
            except Exception as e:
                self.failures.append(PluginFailure(plugin, f"mizuoto_engines failed: {describe_error(e)}"))
                continue
            for item in engines:
                self._add(item, plugin)

    def _add(self, item: Any, plugin: str) -> None:
        from mizuoto.runtime.engine import Engine

        if isinstance(item, EngineRef):
            name = item.name
        elif isinstance(item, type) and issubclass(item, Engine):
            name = item.name
        else:
            self.failures.append(PluginFailure(plugin, f"{item!r} is neither an Engine subclass nor an EngineRef"))
            return
        if not isinstance(name, str) or not _NAME.match(name):
            self.failures.append(PluginFailure(plugin, f"engine name {name!r} is not a lowercase identifier"))
        elif name in self._sources and self._sources[name][1] is item:
            return  # the same engine offered twice (e.g. by a plugin and by the caller)
        elif name in self._sources:
            self.failures.append(PluginFailure(plugin, f"engine {name!r} is already provided by "
                                                       f"{self._sources[name][0]!r}"))
        else:
            self._sources[name] = (plugin, item)

    def add(self, engine: type, plugin: str = "api") -> None:
        """Register an Engine subclass directly."""
        self._add(engine, plugin)

    def names(self) -> list[str]:
        """Registered engine names (not yet imported), sorted."""
        return sorted(self._sources)

    def plugin_of(self, name: str) -> str:
        """The plugin that provided engine `name`."""
        return self._sources[name][0]

    def engine_class(self, name: str) -> type:
        """The Engine class called `name`, importing it on first use."""
        if name in self._classes:
            return self._classes[name]
        if name not in self._sources:
            known = ", ".join(self.names()) or "none"
            raise InvalidRequest(f"unknown engine {name!r}; registered engines: {known}")
        plugin, item = self._sources[name]
        if isinstance(item, EngineRef):
            from mizuoto.runtime.engine import Engine

            try:
                cls = getattr(importlib.import_module(item.module), item.attr)
                if not (isinstance(cls, type) and issubclass(cls, Engine)):
                    raise TypeError(f"{item.module}.{item.attr} is not an Engine subclass")
                if cls.name != name:
                    raise TypeError(f"{item.module}.{item.attr}.name is {cls.name!r}, registered as {name!r}")
            except Exception as e:
                raise ModelLoadError(f"engine {name!r} (plugin {plugin}) failed to load: {describe_error(e)}") from e
            item = cls
        self._classes[name] = item
        return item

    def detect(self, model_dir: Path, only: str | None = None) -> list[tuple[str, str | None]]:
        """(engine, variant) of every engine that recognises `model_dir`; see `detect_report`."""
        return self.detect_report(model_dir, only)[0]

    def detect_report(self, model_dir: Path, only: str | None = None) -> tuple[list[tuple[str, str | None]], list[str]]:
        """(hits, what was checked): engines whose cheap patterns do not match are not imported."""
        hits, checked = [], []
        for name in [only] if only is not None else self.names():
            item = self._sources[name][1] if name in self._sources else None
            if isinstance(item, EngineRef) and name not in self._classes and not item.may_detect(model_dir):
                checked.append(f"{name}: no (no {' or '.join(item.patterns)})")
                continue
            try:
                cls = self.engine_class(name)
            except ModelLoadError as e:
                if only is not None:
                    raise
                checked.append(f"{name} (unavailable: {e})")
                continue
            try:
                found = cls().detect(model_dir)
            except Exception as e:  # detect must not raise; a buggy one is reported, not fatal
                checked.append(f"{name} (detect raised {describe_error(e)})")
                continue
            checked.append(f"{name}: {'yes' if found else 'no'}")
            if found:
                hits.append((name, found if isinstance(found, str) else None))
        if only is None:
            checked += [f"{f.plugin} (unavailable: {f.error})" for f in self.failures]
        return hits, checked

    def load_all(self) -> dict[str, type]:
        """Import every engine; the ones that fail are added to `failures` and left out."""
        loaded = {}
        for name in self.names():
            try:
                loaded[name] = self.engine_class(name)
            except ModelLoadError as e:
                failure = PluginFailure(self.plugin_of(name), str(e))
                if failure not in self.failures:
                    self.failures.append(failure)
        return loaded

    def _each(self, hook: str) -> list[tuple[str, Any]]:
        """(plugin name, answer) of every implementation of a no-argument hook; failures are recorded."""
        answers = []
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            plugin = self.pm.get_name(impl.plugin)
            try:
                answers.append((plugin, impl.function()))
            except Exception as e:
                failure = PluginFailure(plugin, f"{hook} failed: {describe_error(e)}")
                if failure not in self.failures:
                    self.failures.append(failure)
        return answers

    def asset_candidates(self, resource: str) -> list[Path]:
        """Candidate folders for a shared resource from every plugin's mizuoto_assets hook."""
        return [Path(p) for _, answer in self._each("mizuoto_assets") for p in (answer or {}).get(resource, [])]

    def example_models(self) -> list[Path]:
        """Model directories offered by every plugin's mizuoto_example_models hook."""
        return [Path(p) for _, answer in self._each("mizuoto_example_models") for p in (answer or [])]

    def model_name(self, model_dir: Path) -> str:
        """The default name of the model in `model_dir`: its engine's `model_name` (else the folder's name)."""
        hits = self.detect(Path(model_dir))
        if len(hits) == 1:
            return self.engine_class(hits[0][0]).model_name(Path(model_dir))
        return Path(model_dir).resolve().name

    def named_examples(self) -> dict[str, Path]:
        """The plugins' example model directories by their default name (`-m en_US-joe-medium`)."""
        return {self.model_name(d): d for d in self.example_models() if Path(d).is_dir()}


@functools.lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The registry of built-ins and installed plugins, built once per process."""
    return Registry()


def find_resource(name: str, candidates: list[Path] | None = None) -> Path:
    """Shared resource `name`: $MIZUOTO_HOME/<name>, the caller's `candidates`, then the plugins'; else a clear error."""
    from mizuoto.runtime.assets import resource_dir

    return resource_dir(name, [*(candidates or []), *default_registry().asset_candidates(name)])
