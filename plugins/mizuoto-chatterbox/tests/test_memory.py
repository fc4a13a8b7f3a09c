"""`bench --memory` on a Chatterbox directory: T3's call and S3Gen's reserved with their figures, and measured."""

import functools

from mizuoto.runtime.bench import BenchSettings
from mizuoto.runtime.bench_memory import MemoryCase, run_case
from mizuoto.runtime.options import parse_options


@functools.lru_cache(maxsize=None)
def _calls(model_dir):
    from mizuoto_chatterbox.bench import bench_driver

    driver = bench_driver(model_dir, None, parse_options().resolved(), BenchSettings())
    return driver, run_case(driver, MemoryCase(1, stream=False))


def test_a_whole_request_reserves_t3_once_at_its_static_cache_and_s3gen_once(case):
    driver, calls = _calls(case.model_dir)
    assert [c["stage"] for c in calls] == ["t3", "s3gen"]
    t3, s3gen = calls
    figures, tokens = driver.model.figures, round(1 * driver.tokens_per_second)
    # the unbatched path's cache is allocated once, for the prompt and exactly the draws asked for
    assert t3["sizes"]["grown"] == 0 and t3["sizes"]["positions"] == t3["sizes"]["prefill"] + tokens
    assert t3["planned"] == figures.t3_call(**t3["sizes"]) < figures.t3_call(**{**t3["sizes"], "grown": 1})
    # HiFT speaks the request's own mel only, not the voice prompt's (at speed 1: two frames a token S3Gen speaks, and one)
    prompt = driver.voice.gen_prompt_token.shape[-1]
    assert s3gen["planned"] == figures.s3gen(**s3gen["sizes"])
    assert s3gen["sizes"]["vocoded"] == s3gen["sizes"]["frames"] - 2 * prompt + 1 < s3gen["sizes"]["frames"]
    assert all(c["measured"] > 0 for c in calls) and driver.model.executor is None
