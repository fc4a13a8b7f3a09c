"""`bench --memory` on the Qwen3-TTS fixture models: each stage call of a request reserved with its figure, and
measured within it (the heap's allowance aside), whole and streamed."""

import os
from pathlib import Path

import pytest

from mizuoto.nn.memory import HEAP_PACKING_BYTES
from mizuoto.runtime.bench import BenchSettings
from mizuoto.runtime.bench_memory import MemoryCase, run_case
from mizuoto.runtime.options import parse_options
from mizuoto_qwen3tts.stream import FIRST_FRAMES

# conftest.py's tree (its module is not importable from here)
ROOT = Path(os.environ.get("MIZUOTO_QWEN3TTS_FIXTURES", Path(__file__).parent / "fixtures"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_call_of_a_request_is_reserved_with_its_figure_and_stays_within_it(stream, tmp_path):
    from mizuoto_qwen3tts.bench import bench_driver

    models = sorted(p for p in (ROOT / "models").iterdir() if p.is_dir())
    assert models, f"no model dirs under {ROOT / 'models'}"
    for model_dir in models:
        driver = bench_driver(model_dir, None, parse_options().resolved(), BenchSettings(), tmp_path)
        calls = run_case(driver, MemoryCase(1, stream=stream))
        frames = round(1 * driver.tokens_per_second)
        stages = [c["stage"] for c in calls]
        assert stages[0] == "talker" and set(stages[1:]) == {"codec"}, stages
        talker = calls[0]
        assert talker["sizes"]["positions"] == talker["sizes"]["prefill"] + frames + 1  # N tokens give N - 1 frames
        figures = driver.model.figures
        # streamed, the chunks' decodes are reserved inside the generation's reservation: its plan holds theirs
        nested = talker.get("nested", 0)
        assert talker["planned"] == figures.talker(**talker["sizes"]) + nested
        assert (figures.codec(FIRST_FRAMES) <= nested <= figures.codec_most()) if stream else nested == 0
        assert all(c["planned"] == figures.codec(**c["sizes"]) for c in calls[1:])
        assert sum(c["sizes"]["frames"] for c in calls[1:]) >= frames
        over = [f"{c['stage']} {c['sizes']}: {c['measured']} > {c['planned']}" for c in calls
                if c["measured"] > c["planned"] + HEAP_PACKING_BYTES]
        assert not over, over
        assert all(c["measured"] > 0 for c in calls)
