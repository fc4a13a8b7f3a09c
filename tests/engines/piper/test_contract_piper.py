"""The engine contract suite, run on the piper plugin with its default voice (as a third-party author would)."""

from mizuoto.testing.contract import *  # noqa: F401,F403  (the tests and their parametrization)

CONTRACT_ENGINES = ["piper"]


def CONTRACT_MODELS():
    """The default voice shipped by the plugin's pinned voice package."""
    import mizuoto_piper

    return [mizuoto_piper.default_voice_dir()]
