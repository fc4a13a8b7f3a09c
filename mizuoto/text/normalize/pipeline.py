"""Upstream CosyVoice's `text_normalize` (cosyvoice/cli/frontend.py) with the wetext normalizer."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

from mizuoto.text.normalize import rules
from mizuoto.text.normalize.wetext import check_unicode, contains_chinese

# Upstream's sentence split limits: 80/60 tokens (characters for zh) per segment, merge a
# tail shorter than 20.
TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20

_TRAILING_COMMAS = re.compile(r"[，,、]+$")


class Normalizer(Protocol):
    """What the front end needs of a normalizer (WetextNormalizer)."""

    def normalize(self, text: str) -> str: ...


class TextFrontend:
    """Text normalization and sentence splitting as upstream's frontend does with wetext.

    `normalizer` is the wetext normalizer (None: upstream without any text front-end tool);
    `tokenize` is the model's text tokenizer, used to measure English segment lengths.
    """

    def __init__(self, normalizer: Normalizer | None, tokenize: Callable[[str], list[int]]) -> None:
        self.normalizer = normalizer
        self.tokenize = tokenize
        self._spell: Callable[[str], str] | None = None

    @staticmethod
    def is_skipped(text: str) -> bool:
        """Upstream leaves text with a `<|...|>` marker (e.g. CosyVoice3's `<|endofprompt|>`) untouched."""
        return "<|" in text and "|>" in text

    def number_to_words(self, digits: str) -> str:
        """inflect 7.3.1's English reading of a digit run (upstream's `spell_out_number`)."""
        if self._spell is None:
            import inflect  # slow to import (typeguard); only the English path needs it

            self._spell = inflect.engine().number_to_words
        return self._spell(digits)

    def normalize_text(self, text: str) -> tuple[str, str]:
        """(normalized text, "zh" or "en") for a text the front end does not skip (steps 3-5 upstream)."""
        text = text.strip()
        if contains_chinese(text):
            if self.normalizer is not None:
                text = self.normalizer.normalize(text)
            text = text.replace("\n", "")
            text = rules.replace_blank(text)
            text = rules.replace_corner_mark(text)
            text = text.replace(".", "。")
            text = text.replace(" - ", "，")
            text = rules.remove_bracket(text)
            text = _TRAILING_COMMAS.sub("。", text)
            return text, "zh"
        if self.normalizer is not None:
            text = self.normalizer.normalize(text)
        return rules.spell_out_number(text, self.number_to_words), "en"

    def split(self, text: str, lang: str) -> list[str]:
        """Upstream's sentence segments of a normalized text, punctuation-only ones dropped."""
        segments = rules.split_paragraph(text, self.tokenize, lang, token_max_n=TOKEN_MAX_N,
                                         token_min_n=TOKEN_MIN_N, merge_len=MERGE_LEN, comma_split=False)
        return [s for s in segments if not rules.is_only_punctuation(s)]

    def text_normalize(self, text: str, split: bool = True, text_frontend: bool = True) -> list[str] | str:
        """Upstream `CosyVoiceFrontEnd.text_normalize`: segments (split=True) or the normalized text."""
        if not text_frontend or text == "" or self.is_skipped(text):
            return [text] if split else text
        check_unicode(text)
        normalized, lang = self.normalize_text(text)
        if not split:
            return normalized
        return self.split(normalized, lang)
