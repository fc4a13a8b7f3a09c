"""mizuoto-qwen3tts: Qwen3-TTS 12 Hz (Alibaba Qwen, Apache-2.0) as a Mizuoto engine, from `mizuoto.nn` blocks.

Registered through the `mizuoto.engines` entry point. Importing this package is cheap: the engine
is imported only when a directory holding a 12 Hz codec (`speech_tokenizer/`) is detected or loaded.
"""

from __future__ import annotations

from mizuoto.runtime.hookspecs import EngineRef, hookimpl

__all__ = ["mizuoto_engines"]


@hookimpl
def mizuoto_engines() -> list:
    """The Qwen3-TTS engine, imported on first use, and only for directories holding a speech tokenizer."""
    return [EngineRef("qwen3tts", "mizuoto_qwen3tts.engine", "Qwen3TTSEngine",
                      patterns=("speech_tokenizer/config.json",))]
