"""Complete CosyVoice model directories for the engine-level tests, and the fixture clips.

The fixture model dirs hold only yaml + llm/flow/hift (+ spk2info.pt); `assemble_model_dir`
adds the front-end ONNX files and tokenizer files. Dirs and clips are discovered, never named.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mizuoto.engines.cosyvoice.variants import find_variant
from mizuoto.runtime.api import Runtime
from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.fixtures import fixtures_root

MODEL_DIRS = sorted(p for p in fixtures_root().glob("cosyvoice/*/model") if p.is_dir())
MODEL_IDS = [p.parent.name for p in MODEL_DIRS]


def version_of(model_dir: Path) -> int:
    """The CosyVoice generation of a model dir (1, 2 or 3), from its yaml."""
    return find_variant(model_dir).version


# fixture name -> which fixture model dirs it is parametrized over
_DIR_PARAMS = {
    "variant_dir": lambda d: True,
    "stream_in_dir": lambda d: version_of(d) >= 2,               # streaming text in (bistream)
    "no_stream_in_dir": lambda d: version_of(d) < 2,             # upstream streams text only on v2/v3
    "qwen_lm_dir": lambda d: version_of(d) >= 2,                 # a Qwen2 LM with a static KV cache
    # v2's Qwen2LM bistream; v3's raises on any special token but eos/fill, which its tiny
    # random-weight LM draws within a few dozen steps (see test_bistream.py)
    "bistream_dir": lambda d: version_of(d) == 2,
    "preset_dir": lambda d: (d / "spk2info.pt").is_file(),      # preset speakers (v1 SFT/Instruct)
}


def pytest_generate_tests(metafunc) -> None:
    """Parametrize model-dir arguments over the discovered fixture model dirs (ids: the version folder)."""
    for name, keep in _DIR_PARAMS.items():
        if name in metafunc.fixturenames:
            dirs = [d for d in MODEL_DIRS if keep(d)]
            metafunc.parametrize(name, dirs, ids=[d.parent.name for d in dirs])


def clips() -> list[tuple[Path, int, int]]:
    """(wav path, sample rate, samples) of every fixture clip, shortest first."""
    root = fixtures_root() / "frontend"
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    found = [(root / c["wav"], int(c["sample_rate"]), int(c["num_samples"])) for c in manifest["clips"].values()]
    return sorted(found, key=lambda c: c[2] / c[1])


def short_clip() -> Path:
    """The shortest fixture clip (keeps prompts, and so the tests, small)."""
    return clips()[0][0]


@pytest.fixture
def clip() -> Path:
    """The shortest fixture clip."""
    return short_clip()


@pytest.fixture(scope="session")
def assembled(tmp_path_factory) -> dict[Path, Path]:
    """fixture model dir -> a complete model dir assembled from it (once per session)."""
    base = tmp_path_factory.mktemp("cosyvoice-assembled")
    return {d: assemble_model_dir(d, base / d.parent.name / "model") for d in MODEL_DIRS}


@pytest.fixture(scope="session")
def runtime(assembled):
    """One Runtime holding every assembled model, by fixture model dir.

    Its host budget is fixed, not what happens to be free: the tests need the models loaded together
    whatever else the machine runs, and their plans (the flow's planning bound is a 100-token
    segment: about 2 GB of attention scores on these tiny models) are arithmetic.
    """
    rt = Runtime(ram="64GiB")
    names = {d: rt.load(path, name=f"cosyvoice-{d.parent.name}") for d, path in assembled.items()}
    yield rt, names
    rt.close()


def upstream_chunk_count(version: int, tokens: int, flow: dict, prompt_tokens: int) -> int:
    """How many chunks upstream's model.tts streams for one segment of `tokens` speech tokens.

    Written from cosyvoice/cli/model.py: CosyVoice 1 cuts a chunk whenever hop + 20 overlap tokens
    are waiting (hop = 2 s of tokens, fixed); CosyVoice 2/3 whenever hop + look-ahead tokens lie past
    the offset, the first hop padded so the prompt ends on a hop boundary, hops 25 doubling to 100.
    The remaining tokens always make one more (final) chunk.
    """
    count = 0
    if version == 1:
        hop, start = 2 * int(flow["input_frame_rate"]), 0
        while tokens - start >= hop + 20:
            count, start = count + 1, start + hop
        return count + 1
    lookahead = int(flow.get("pre_lookahead_len", 0))
    pad = math.ceil(prompt_tokens / 25) * 25 - prompt_tokens
    hop, offset = 25, 0
    while True:
        this_hop = hop + pad if offset == 0 else hop
        if tokens - offset < this_hop + lookahead:
            return count + 1
        count, offset, hop = count + 1, offset + this_hop, min(100, 2 * hop)


@pytest.fixture
def upstream_chunks():
    """upstream_chunk_count: how many chunks upstream streams for a segment's speech tokens."""
    return upstream_chunk_count


@pytest.fixture
def record_tokens(monkeypatch):
    """record_tokens(model) -> a list that each request's final speech tokens are appended to (on_tokens)."""
    def record(model) -> list[list[int]]:
        seen: list[list[int]] = []
        make = model.synthesizer

        def synthesizer(with_lm: bool = True, **lm_options):
            synth = make(with_lm, **lm_options)
            synth.on_tokens = seen.append
            return synth
        monkeypatch.setattr(model, "synthesizer", synthesizer)
        return seen
    return record
