"""A third-party style plugin: names its engines lazily, so importing the plugin imports no torch."""

from mizuoto.runtime.hookspecs import EngineRef, hookimpl


@hookimpl
def mizuoto_engines() -> list:
    """The sine-tone engine and the toy batched LM (engine contract v2), each imported only when used."""
    return [EngineRef("tone", "mizuoto.testing.toy", "ToneEngine"),
            EngineRef("toylm", "mizuoto.testing.toy_lm", "ToyLMEngine", patterns=("toylm.json",))]
