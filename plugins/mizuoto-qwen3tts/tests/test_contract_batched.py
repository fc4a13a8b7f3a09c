"""The engine contract suite on the Qwen3-TTS fixture models loaded with a continuous batch (`compute.batch` 3):
concurrency, cancellation and memory with the talker's rows in the batch loop and the code predictor between its
steps (tests/contract runs the suite on the same models at width 1)."""

from pathlib import Path

from mizuoto.testing.contract import *  # noqa: F401,F403  (the tests and their parametrization)

# the committed models, as tests/contract takes them: the suite's requests speak until the talker stops or reaches
# the model's default max_new_tokens (8192 frames), which another tree's random talker may never do in a test's time
_MODELS = Path(__file__).resolve().parent / "fixtures" / "models"

CONTRACT_ENGINES = ["qwen3tts"]
CONTRACT_MODELS = sorted(p for p in _MODELS.iterdir() if p.is_dir())
CONTRACT_OPTIONS = {"compute": {"batch": 3}}
