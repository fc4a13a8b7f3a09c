"""A third-party style plugin: names its engine lazily, so importing the plugin imports no torch."""

from mizuoto.runtime.hookspecs import EngineRef, hookimpl


@hookimpl
def mizuoto_engines() -> list:
    """The sine-tone engine, imported only when used."""
    return [EngineRef("tone", "mizuoto.testing.toy", "ToneEngine")]
