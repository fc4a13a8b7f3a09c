"""Upstream's `text_normalize` on `text/normalize.jsonl` (`normalized`, `segments_v1`, `segments_v2`); bad input."""

import functools
import random
import time

import pytest

from mizuoto.errors import InvalidRequest
from mizuoto.testing.fixtures import asset_path, fixture_path, read_jsonl
from mizuoto.text.normalize.pipeline import TextFrontend
from mizuoto.text.normalize.wetext import WetextNormalizer
from mizuoto.text.tokenize import QwenTokenizer, WhisperTokenizer

_LINES = read_jsonl(fixture_path("text", "normalize.jsonl"))
_IDS = [line["id"] for line in _LINES]


@functools.cache
def _normalizer() -> WetextNormalizer:
    return WetextNormalizer(asset_path("wetext", "fsts"))


@functools.cache
def _frontend(version: str) -> TextFrontend:
    """The front end of a model version: v1 measures English segments with Whisper's tokenizer, v2 with Qwen's."""
    if version == "v1":
        tokenize = WhisperTokenizer.from_file(asset_path("whisper", "multilingual.tiktoken")).encode
    else:
        tokenize = QwenTokenizer.from_dir(asset_path("cosyvoice", "CosyVoice-BlankEN"), version="cosyvoice2").encode
    return TextFrontend(_normalizer(), tokenize)


@pytest.mark.parametrize("line", _LINES, ids=_IDS)
def test_fixture_normalized_equals_upstream(line):
    assert _frontend("v2").text_normalize(line["text"], split=False) == line["normalized"]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("line", _LINES, ids=_IDS)
def test_fixture_segments_equal_upstream(line, version):
    assert _frontend(version).text_normalize(line["text"], split=True) == line[f"segments_{version}"]


@pytest.mark.parametrize("line", _LINES, ids=_IDS)
def test_fixture_skip_rule(line):
    assert TextFrontend.is_skipped(line["text"]) == line["frontend_skipped"]


def test_text_frontend_off_returns_text_as_is():
    text = " 今天是2024年3月15日 "
    assert _frontend("v2").text_normalize(text, split=True, text_frontend=False) == [text]
    assert _frontend("v2").text_normalize(text, split=False, text_frontend=False) == text


def test_without_normalizer_only_string_rules_apply():
    frontend = TextFrontend(None, _frontend("v2").tokenize)
    assert frontend.text_normalize("价格（含税）是12元，", split=False) == "价格含税是12元。"
    assert frontend.text_normalize("I have 2 cats", split=False) == "I have two cats"


# --- bad input -------------------------------------------------------------------------------

def test_empty_text_is_passed_through_like_upstream():
    assert _frontend("v2").text_normalize("", split=True) == [""]
    assert _frontend("v2").text_normalize("", split=False) == ""


@pytest.mark.parametrize("text", ["   ", "\n\t "])
def test_blank_text_gives_no_segment(text):
    """Upstream fails on these (IndexError in split_paragraph); we give nothing to say."""
    assert _frontend("v2").text_normalize(text, split=True) == []
    assert _frontend("v2").text_normalize(text, split=False) == ""


@pytest.mark.parametrize("text", ["！？。", "...", "——", "「」", "$$$###", "，，，", "?!"])
def test_punctuation_only_text_gives_no_segment(text):
    for version in ("v1", "v2"):
        assert _frontend(version).text_normalize(text, split=True) == []
    assert isinstance(_frontend("v2").text_normalize(text, split=False), str)


_EN_WORDS = ("the of and to in is was for that with on as by at from his her they this have had not "
             "but what all were when there can one more out about up many then them these some would "
             "make like him into time has look two write see number way could people than first water "
             "been call who oil its now find long down day did get come made may part").split()
_ZH_CHARS = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子"
             "说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当")


def _prose(lang: str, chars: int, seed: int = 0) -> str:
    """Seeded prose with a number in every 20th sentence (so the whole text is normalized)."""
    rng = random.Random(seed)
    out, total, n = [], 0, 0
    while total < chars:
        n += 1
        if lang == "en":
            sentence = " ".join(rng.choice(_EN_WORDS) for _ in range(rng.randint(5, 15))).capitalize()
            sentence += (f" {rng.randint(2, 3000)}" if n % 20 == 0 else "") + ". "
        else:
            sentence = "".join(rng.choice(_ZH_CHARS) for _ in range(rng.randint(5, 25)))
            sentence += (f"{rng.randint(2, 3000)}年" if n % 20 == 0 else "") + rng.choice("，。！？")
        out.append(sentence)
        total += len(sentence)
    return "".join(out)[:chars]


@pytest.mark.parametrize("lang", ["zh", "en"])
def test_100k_character_text_finishes_in_seconds(lang):
    """A 100,000-character text goes through normalization and splitting in linear time.

    Measured on 2 busy CPU cores: zh ~6 s, en ~12 s (one kaldifst call on the whole text, as
    upstream makes, would need ~10^8 composed states).
    """
    text = _prose(lang, 100_000)
    frontend = TextFrontend(WetextNormalizer(asset_path("wetext", "fsts")), _frontend("v2").tokenize)
    start = time.perf_counter()
    segments = frontend.text_normalize(text, split=True)
    elapsed = time.perf_counter() - start
    assert elapsed < 45, f"100k characters took {elapsed:.1f} s"
    assert len(segments) > 100
    assert not any(ch.isdigit() for ch in "".join(segments))


def test_lone_surrogate_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        _frontend("v2").text_normalize("abc\udcff 12")


@pytest.mark.parametrize("kind", ["capitals", "english_in_chinese"])
def test_100k_text_without_safe_cuts_finishes_in_seconds(kind):
    """Texts with no sentence or word cut (all capitals; English prose in a Chinese text) stay linear.

    Measured: ~4 s each on 2 busy CPU cores.
    """
    rng = random.Random(1)
    words = [w.upper() for w in _EN_WORDS] if kind == "capitals" else _EN_WORDS
    body = " ".join(rng.choice(words) for _ in range(30_000))
    text = ("" if kind == "capitals" else "中文") + body[:99_990] + " 2024"
    normalizer = WetextNormalizer(asset_path("wetext", "fsts"))
    start = time.perf_counter()
    normalized = normalizer.normalize(text)
    elapsed = time.perf_counter() - start
    assert elapsed < 45, f"100k characters took {elapsed:.1f} s"
    assert "2024" not in normalized
