"""mizuoto-chatterbox: Chatterbox and Chatterbox-Turbo (Resemble AI, MIT) as a Mizuoto engine, from `mizuoto.nn` blocks.

Registered through the `mizuoto.engines` entry point. Importing this package is cheap: the engine
is imported only when a directory holding a T3 checkpoint is detected or loaded.
"""

from __future__ import annotations

from mizuoto.runtime.hookspecs import EngineRef, hookimpl

__all__ = ["mizuoto_engines"]


@hookimpl
def mizuoto_engines() -> list:
    """The Chatterbox engine, imported on first use, and only for directories holding a T3 checkpoint."""
    return [EngineRef("chatterbox", "mizuoto_chatterbox.engine", "ChatterboxEngine",
                      patterns=("t3_cfg.safetensors", "t3_turbo_v1.safetensors"))]
