"""Mizuoto: a speech runtime hosting several TTS engines behind one API."""

from mizuoto.errors import MizuotoError

__version__ = "0.2.0"

__all__ = ["MizuotoError", "__version__"]
