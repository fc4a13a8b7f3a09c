"""Keeping the FST normalizer linear on long texts.

kaldifst composes the whole input with the tagger before its shortest path, so one call costs
more per character the longer the text: ~1,000 hypotheses per byte for English, and a 100k
character text would need ~10^8 composed states. Upstream (CosyVoice -> wetext 0.0.4) makes
that one call. Its result on a long text is also not what it reads for the same sentence alone:
path costs are float32 sums, so past ~200 characters small cost differences vanish and ties
break another way (e.g. "102" becomes "one hundred two" instead of "one hundred and two").

A text longer than the normalizer's `long_text_chars` is cut where no token can span the cut
(sentence ends; inside runs of plain ideographs or plain lower-case words), and each piece is
normalized alone, so it reads as upstream reads that piece. The tests check every cut on the
corpus: normalizing two neighbouring pieces together equals normalizing them one by one.
"""

from __future__ import annotations

import re

# A Chinese sentence end followed by a Chinese character: the tagger reads the mark as a lone
# `char` token and starts a fresh token after it.
_ZH_SENTENCE = re.compile(r"(?<=[。！？；])(?=[\u4e00-\u9fff])")
# Inside a run of plain ideographs (儿 excluded: erhua is a whitelist token) every character is
# its own `char` token; three on each side keep any digit, unit or symbol out of reach.
_ZH_PLAIN = "[\u4e00-\u513e\u5140-\u9fff]"
_ZH_INSIDE = re.compile(rf"(?<={_ZH_PLAIN}{{3}})(?={_ZH_PLAIN}{{3}})")
# An English sentence end after a lower-case word, one space, then a capitalized word: the
# tagger emits the mark as a punctuation token that swallows the space. Digits, initials
# ("U.S.", "No. 5") and other spacing stay inside one piece.
_EN_SENTENCE = re.compile(r"(?<=[a-z][a-z][.!?] )(?=[A-Z][a-z])")
# Between two lower-case words (each with a vowel, so never a roman numeral) inside a run of
# four such words joined by single spaces: both are plain `w` tokens. "per" starts a unit
# ("per m" is read as a measure), so no cut touches it.
_EN_WORDS = re.compile(r"(?<![A-Za-z0-9])[a-z]+(?: [a-z]+){3,}(?![A-Za-z0-9])")
_EN_WORD = re.compile(r"[a-z]+")
_VOWEL = re.compile(r"[aeouy]")
_EN_NO_CUT = frozenset({"per"})
_ASCII_DIGITS = re.compile(r"[0-9]")

# A piece with no safe cut (all capitals, a table of numbers, English inside a Chinese text)
# is still cut past this length, after a space or a mark, so the work stays linear; there a
# token may be read differently than upstream's single call, which at such lengths has lost
# its cost precision anyway.
MAX_PIECE_CHARS = 200
_SOFT_CUT = re.compile(r"(?<=[\s，、。！？；：,.!?;:])(?=\S)")


def _en_word_cuts(text: str) -> list[int]:
    cuts = []
    for run in _EN_WORDS.finditer(text):
        words = [(m.start() + run.start(), m.group()) for m in _EN_WORD.finditer(run.group())]
        for (_, left), (start, right) in zip(words[1:-2], words[2:-1]):
            if (len(left) >= 3 and len(right) >= 3 and _VOWEL.search(left) and _VOWEL.search(right)
                    and left not in _EN_NO_CUT and right not in _EN_NO_CUT):
                cuts.append(start)
    return cuts


def cut_points(text: str, lang: str) -> list[int]:
    """Positions where `text` may be cut (sorted)."""
    if lang == "zh":
        cuts = {m.start() for m in _ZH_SENTENCE.finditer(text)} | {m.start() for m in _ZH_INSIDE.finditer(text)}
    else:
        cuts = {m.start() for m in _EN_SENTENCE.finditer(text)} | set(_en_word_cuts(text))
    return sorted(c for c in cuts if 0 < c < len(text))


def pieces(text: str, lang: str) -> list[str]:
    """`text` cut at every boundary where a piece's reading does not depend on its neighbours (and where too long)."""
    bounds = [0, *cut_points(text, lang), len(text)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            out.extend(_bounded(text[a:b]))
    return out


def _bounded(piece: str) -> list[str]:
    out = []
    while len(piece) > MAX_PIECE_CHARS:
        half = MAX_PIECE_CHARS // 2
        soft = [m.start() for m in _SOFT_CUT.finditer(piece, half, MAX_PIECE_CHARS)]
        cut = soft[-1] if soft else MAX_PIECE_CHARS
        out.append(piece[:cut])
        piece = piece[cut:]
    out.append(piece)
    return out


def alphabet(piece: str) -> str:
    """The smallest tagger variant that reads `piece`: "no_ascii", "no_digits" or "full" (see fast_tagger.py)."""
    if not any(ch.isascii() for ch in piece):
        return "no_ascii"
    return "full" if _ASCII_DIGITS.search(piece) else "no_digits"
