"""The engine contract suite on the Qwen3-TTS fixture models loaded with a continuous batch (`compute.batch` 3):
concurrency, cancellation and memory with the talker's rows in the batch loop and the code predictor between its
steps (tests/contract runs the suite on the same models at width 1)."""

import os
from pathlib import Path

from mizuoto.testing.contract import *  # noqa: F401,F403  (the tests and their parametrization)

# the tree conftest.py reads ($MIZUOTO_QWEN3TTS_FIXTURES, default fixtures/ here)
_MODELS = Path(os.environ.get("MIZUOTO_QWEN3TTS_FIXTURES", Path(__file__).resolve().parent / "fixtures")) / "models"

CONTRACT_ENGINES = ["qwen3tts"]
CONTRACT_MODELS = sorted(p for p in _MODELS.iterdir() if p.is_dir())
CONTRACT_OPTIONS = {"compute": {"batch": 3}}
