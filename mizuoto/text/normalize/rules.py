"""The string rules of upstream CosyVoice's text front end (cosyvoice/utils/frontend_utils.py)."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

ZH_SPLIT_MARKS = frozenset("。？！；：、.?!;")
EN_SPLIT_MARKS = frozenset(".?!;:")
COMMA_MARKS = frozenset("，,")
CLOSING_QUOTES = frozenset('"”')


def replace_blank(text: str) -> str:
    """Drop each space unless both neighbours are non-space ASCII characters."""
    out = []
    last = len(text) - 1
    for i, ch in enumerate(text):
        if ch != " ":
            out.append(ch)
            continue
        # Upstream looks at text[i - 1], which wraps to the last character for i == 0, and
        # fails past the end; a trailing space has no right neighbour, so it goes.
        if i == last:
            continue
        after, before = text[i + 1], text[i - 1]
        if after.isascii() and after != " " and before.isascii() and before != " ":
            out.append(ch)
    return "".join(out)


def replace_corner_mark(text: str) -> str:
    """Superscript two and three read as 平方 / 立方."""
    return text.replace("²", "平方").replace("³", "立方")


def remove_bracket(text: str) -> str:
    """Delete full-width round and lenticular brackets and backticks; an em-dash pair becomes a space."""
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    return text.replace("——", " ")


def spell_out_number(text: str, number_to_words: Callable[[str], str]) -> str:
    """Each maximal run of `str.isdigit()` characters replaced by `number_to_words(run)`."""
    out = []
    run_start = None
    for i, ch in enumerate(text):
        if ch.isdigit():
            if run_start is None:
                run_start = i
            continue
        if run_start is not None:
            out.append(number_to_words(text[run_start:i]))
            run_start = None
        out.append(ch)
    if run_start is not None:
        out.append(number_to_words(text[run_start:]))
    return "".join(out)


def is_only_punctuation(text: str) -> bool:
    """Whether every character is Unicode punctuation (P*) or a symbol (S*); true for ''."""
    return all(unicodedata.category(ch)[0] in "PS" for ch in text)


def split_paragraph(text: str, tokenize: Callable[[str], list[int]], lang: str = "zh",
                    token_max_n: int = 80, token_min_n: int = 60, merge_len: int = 20,
                    comma_split: bool = False) -> list[str]:
    """Upstream's sentence split and greedy merge (zh length = characters, en = tokens)."""
    if not text:
        return []

    def length(s: str) -> int:
        return len(s) if lang == "zh" else len(tokenize(s))

    marks = ZH_SPLIT_MARKS if lang == "zh" else EN_SPLIT_MARKS
    if comma_split:
        marks = marks | COMMA_MARKS
    if text[-1] not in marks:
        text += "。" if lang == "zh" else "."

    sentences: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch not in marks:
            continue
        if i > start:
            sentences.append(text[start:i + 1])
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            # The quote joins the last sentence, even one that ended before this mark;
            # upstream fails when there is none yet, we start one.
            previous = sentences.pop() if sentences else ""
            sentences.append(previous + text[i + 1])
            start = i + 2
        else:
            start = i + 1

    merged: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > token_max_n and length(current) > token_min_n:
            merged.append(current)
            current = ""
        current += sentence
    if current:
        if length(current) < merge_len and merged:
            merged[-1] += current
        else:
            merged.append(current)
    return merged
