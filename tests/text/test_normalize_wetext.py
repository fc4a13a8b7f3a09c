"""wetext 0.0.4 parity on `text/normalize.jsonl` (field `wetext`), long-text cutting, FST lookup."""

import functools
import random

import pytest

from mizuoto.errors import InvalidRequest, ResourceError
from mizuoto.testing.fixtures import asset_path, fixture_path, read_jsonl
from mizuoto.text.normalize import long_text
from mizuoto.text.normalize.wetext import WetextNormalizer, contains_chinese

_LINES = read_jsonl(fixture_path("text", "normalize.jsonl"))
# Lines upstream ran through wetext (the front end skips the others and records null).
_NORMALIZED = [line for line in _LINES if line["wetext"] is not None]


def test_fixture_lines_were_found():
    assert _LINES and _NORMALIZED


@functools.cache
def _normalizer(long_text_chars: int = 400) -> WetextNormalizer:
    return WetextNormalizer(asset_path("wetext", "fsts"), long_text_chars=long_text_chars)


@pytest.mark.parametrize("line", _NORMALIZED, ids=[line["id"] for line in _NORMALIZED])
def test_fixture_wetext_equals_upstream(line):
    assert _normalizer().normalize(line["text"]) == line["wetext"]


@pytest.mark.parametrize("line", _NORMALIZED, ids=[line["id"] for line in _NORMALIZED])
def test_fixture_wetext_when_cut_into_pieces(line):
    """Forcing the long-text path on every line (cut at every allowed boundary) changes nothing."""
    assert _normalizer(long_text_chars=0).normalize(line["text"]) == line["wetext"]


def test_fixture_language_field_matches_auto_language():
    for line in _LINES:
        assert ("zh" if contains_chinese(line["text"]) else "en") == line["lang"], line["id"]


_PROSE_WORDS = {
    "en": ("the of and to in is was for that with on as by at from his her they this have had not but what "
           "all were when there can more out about up many then some would make like him into time has look "
           "per cent miles hour feet pounds dollars minutes hours mix civil vivid dim million hundred half "
           "first second street road mount saint doctor plus minus times over point zero may march").split(),
    "zh": list("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产"
               "两点半个号分秒比加减乘除等于约米克元千万亿百零负儿儿子女儿第之十三"),
}


def _validation_text(lang: str, seed: int = 0) -> str:
    """The corpus lines of one language joined, then seeded prose rich in unit, number and roman-looking words."""
    rng = random.Random(seed)
    corpus = [line["text"] for line in _NORMALIZED if line["lang"] == lang]
    words = _PROSE_WORDS[lang]
    sentences = []
    for n in range(40 if lang == "en" else 120):
        picked = [rng.choice(words) for _ in range(rng.randint(4, 14))]
        if lang == "en":
            sentences.append(" ".join(picked).capitalize() + (f" {n * 37}" if n % 7 == 0 else "") + ". ")
        else:
            sentences.append("".join(picked) + (f"{n * 37}年" if n % 7 == 0 else "") + rng.choice("，。！？"))
    joiner = "" if lang == "zh" else " "
    return joiner.join(corpus) + joiner + "".join(sentences)


@pytest.mark.parametrize("lang", ["zh", "en"])
def test_long_text_cuts_do_not_change_readings(lang):
    """Three neighbouring pieces read together == each read alone, for every window (no token spans a cut)."""
    normalizer = _normalizer()
    text = _validation_text(lang)
    pieces = long_text.pieces(text, lang)
    assert "".join(pieces) == text and len(pieces) > 100
    alone = [normalizer.read(piece, lang) for piece in pieces]
    for i in range(len(pieces) - 2):
        window = "".join(pieces[i:i + 3])
        assert normalizer.read(window, lang) == "".join(alone[i:i + 3]), window


@pytest.mark.parametrize("lang", ["zh", "en"])
def test_long_text_is_read_piece_by_piece_with_fast_taggers(lang):
    """normalize() on a long text == kaldifst's tagger on each piece (the fast machines read alike)."""
    normalizer = WetextNormalizer(asset_path("wetext", "fsts"))
    text = _validation_text(lang)
    assert len(text) > normalizer.long_text_chars
    expected = "".join(normalizer.read(piece, lang) for piece in long_text.pieces(text, lang))
    assert normalizer.normalize(text) == expected
    used = set(normalizer._fast[lang]._machines)
    assert used >= ({"no_ascii", "no_digits", "full"} if lang == "zh" else {"no_digits", "full"})


def test_text_without_digit_is_returned_unchanged():
    text = "Dr. Smith lives on Baker St.  "  # the tagger would rewrite it; the digit gate stops it
    assert _normalizer().normalize(text) == text


def test_fixed_language_and_bad_language():
    en_only = WetextNormalizer(asset_path("wetext", "fsts"), lang="en")
    assert en_only.language("今天3点") == "en"
    with pytest.raises(InvalidRequest):
        WetextNormalizer(asset_path("wetext", "fsts"), lang="fr")


def test_missing_fst_is_a_clear_error(tmp_path):
    with pytest.raises(ResourceError, match="tagger.fst"):
        WetextNormalizer(tmp_path)
