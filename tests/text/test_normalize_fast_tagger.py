"""The chain-compressed, reduced tagger machines read exactly as kaldifst's TextNormalizer on the tagger."""

import functools

import kaldifst
import pytest

from mizuoto.testing.fixtures import asset_path, fixture_path, read_jsonl
from mizuoto.text.normalize import long_text
from mizuoto.text.normalize.fast_tagger import FastTagger, fast_tagger

_LINES = [line for line in read_jsonl(fixture_path("text", "normalize.jsonl")) if line["wetext"] is not None]


def test_fixture_lines_were_found():
    assert _LINES


@functools.cache
def _taggers(lang: str) -> tuple[kaldifst.TextNormalizer, FastTagger]:
    path = asset_path("wetext", "fsts", lang, "tn", "tagger.fst")
    return kaldifst.TextNormalizer(str(path)), fast_tagger(path)


@pytest.mark.parametrize("line", _LINES, ids=[line["id"] for line in _LINES])
def test_fixture_text_and_its_pieces_tag_alike(line):
    reference, fast = _taggers(line["lang"])
    assert fast(line["text"]) == reference(line["text"])
    for piece in long_text.pieces(line["text"], line["lang"]):
        assert fast(piece, long_text.alphabet(piece)) == reference(piece), piece


@pytest.mark.parametrize("text,lang,variant", [
    ("Could people than make like him into time. ", "en", "no_digits"),
    ("这本书很好看，我们都很喜欢。", "zh", "no_ascii"),
    ("收到Zoom的邀请。", "zh", "no_digits"),
    ("1" * 40, "en", "full"),
    ("", "zh", "full"),
])
def test_variants_tag_alike(text, lang, variant):
    reference, fast = _taggers(lang)
    assert long_text.alphabet(text) in (variant, "no_ascii")
    assert fast(text, variant) == reference(text)


def test_fast_taggers_are_shared_per_file():
    path = asset_path("wetext", "fsts", "zh", "tn", "tagger.fst")
    assert fast_tagger(path) is fast_tagger(path)
    assert isinstance(fast_tagger(path), FastTagger)
