"""The GPT-2 and Qwen2 pre-tokenizer patterns, rebuilt on the standard `re` module.

Upstream splits text with `\\p{L}`, `\\p{N}` and `\\s` (Oniguruma in HF tokenizers, the
Rust regex crate in tiktoken). Both engines, in the versions the fixtures were recorded
with, use Unicode 16.0 and the White_Space property for `\\s`. `re` has no `\\p{..}`, so the
classes are built here as explicit code-point ranges from `unicodedata`, plus the letters
and numbers assigned between Python's Unicode version and 16.0 (Python 3.11 ships 14.0).
`re` and those engines share leftmost-first, backtracking semantics, so the same pattern
text gives the same pieces.
"""

import re
import unicodedata
from functools import lru_cache

# Unicode White_Space. Python's own `\s` also takes U+001C..U+001F, which the engines do not.
_WHITESPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
               (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
               (0x3000, 0x3000)]

# General category L* / N* code points that are unassigned in Unicode 14.0 and assigned in
# 15.0-16.0 (checked against unicodedata2 16.0.0 and against both upstream engines).
_NEW_LETTERS = (
    "1C89-1C8A A7CB-A7CD A7DA-A7DC 105C0-105F3 10D4A-10D65 10D6F-10D85 10EC2-10EC4 "
    "1123F-11240 11380-11389 1138B 1138E 11390-113B5 113B7 113D1 113D3 11BC0-11BE0 11F02 "
    "11F04-11F10 11F12-11F33 1342F 13441-13446 13460-143FA 16100-1611D 16D40-16D6C 18CFF "
    "1B132 1B155 1DF25-1DF2A 1E030-1E06D 1E4D0-1E4EB 1E5D0-1E5ED 1E5F0 2B739 2EBF0-2EE5D "
    "31350-323AF"
)
_NEW_NUMBERS = (
    "10D40-10D49 116D0-116E3 11BF0-11BF9 11F50-11F59 16130-16139 16D70-16D79 1CCF0-1CCF9 "
    "1D2C0-1D2D3 1E4F0-1E4F9 1E5F1-1E5FA"
)


def _parse_ranges(spec: str) -> list[tuple[int, int]]:
    out = []
    for item in spec.split():
        lo, _, hi = item.partition("-")
        out.append((int(lo, 16), int(hi or lo, 16)))
    return out


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


@lru_cache(maxsize=None)
def _category_ranges() -> dict[str, list[tuple[int, int]]]:
    """Code-point ranges of `\\p{L}` and `\\p{N}` (one pass over the code space, cached)."""
    found: dict[str, list[tuple[int, int]]] = {"L": [], "N": []}
    category = unicodedata.category
    start, current = 0, None
    # Planes 4-13 hold no assigned character and 15-16 are private use, so the scan skips
    # them; the sentinel closes the last open range.
    for cp in (*range(0x40000), *range(0xE0000, 0xF0000), 0x110000):
        major = category(chr(cp))[0] if cp <= 0x10FFFF else None
        kind = major if major in ("L", "N") else None
        if kind != current:
            if current is not None:
                found[current].append((start, cp - 1))
            start, current = cp, kind
    found["L"] = _merge(found["L"] + _parse_ranges(_NEW_LETTERS))
    found["N"] = _merge(found["N"] + _parse_ranges(_NEW_NUMBERS))
    return found


def _class_body(ranges: list[tuple[int, int]]) -> str:
    """The inside of a `[...]` for these ranges, every code point escaped."""
    return "".join(
        f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges
    )


@lru_cache(maxsize=None)
def _classes() -> tuple[str, str, str]:
    ranges = _category_ranges()
    return _class_body(ranges["L"]), _class_body(ranges["N"]), _class_body(_WHITESPACE)


def _split(*alternatives: str) -> re.Pattern:
    """A byte-level BPE split regex: `alternatives` (L, N, S stand for the classes), then the
    whitespace rules both patterns end with: a run that leaves its last space to the next piece,
    else the whole run."""
    L, N, S = _classes()
    tail = ("[{S}]+(?![^{S}])", "[{S}]+")
    return re.compile("|".join(a.format(L=L, N=N, S=S) for a in (*alternatives, *tail)))


@lru_cache(maxsize=None)
def qwen2_pattern() -> re.Pattern:
    """Qwen2's split regex: case-insensitive contractions, letter runs with one optional
    leading non-letter, single digits, punctuation runs with trailing newlines, whitespace."""
    return _split("(?i:'s|'t|'re|'ve|'m|'ll|'d)", "[^\\r\\n{L}{N}]?[{L}]+", "[{N}]", " ?[^{S}{L}{N}]+[\\r\\n]*",
                  "[{S}]*[\\r\\n]+")


@lru_cache(maxsize=None)
def gpt2_pattern() -> re.Pattern:
    """GPT-2's split regex as whisper's tiktoken encoding uses it (case-sensitive contractions)."""
    return _split("'s|'t|'re|'ve|'m|'ll|'d", " ?[{L}]+", " ?[{N}]+", " ?[^{S}{L}{N}]+")


@lru_cache(maxsize=None)
def whitespace_pattern() -> re.Pattern:
    """HF tokenizers' `Whitespace` pre-tokenizer, `\\w+|[^\\w\\s]+`, with Oniguruma's Unicode `\\w`.

    Oniguruma's word class is letters, marks, decimal digits and connector punctuation
    (L, M, Nd, Pc); Python's `\\w` differs (no marks, any numeric), so the class is built here.
    Marks assigned after Python's Unicode version are not in it.
    """
    word: list[tuple[int, int]] = []
    category = unicodedata.category
    start = None
    for cp in (*range(0x40000), *range(0xE0000, 0xF0000), 0x110000):
        inside = cp <= 0x10FFFF and (category(chr(cp))[0] in "LM" or category(chr(cp)) in ("Nd", "Pc"))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            word.append((start, cp - 1))
            start = None
    body = _class_body(_merge(word + _parse_ranges(_NEW_LETTERS)))
    space = _class_body(_WHITESPACE)
    return re.compile(f"[{body}]+|[^{body}{space}]+")
