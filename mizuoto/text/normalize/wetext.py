"""wetext 0.0.4's text normalizer (the one upstream CosyVoice pins) on kaldifst.

normalize(text): only a text with a digit is touched; the language is zh when the text has a
CJK ideograph (U+4E00-U+9FFF), else en; tagger FST shortest path -> field reorder ->
verbalizer FST shortest path. The result is not stripped (English output usually ends in a
space), exactly as wetext 0.0.4 returns it.
"""

from __future__ import annotations

import re
from pathlib import Path

import kaldifst

from mizuoto.errors import InvalidRequest, ResourceError
from mizuoto.text.normalize import long_text
from mizuoto.text.normalize.fast_tagger import FastTagger, fast_tagger
from mizuoto.text.normalize.token_parser import reorder

LANGS = ("zh", "en")

_DIGIT = re.compile(r"\d")  # Unicode digits, as wetext's gate
# Pieces of long texts repeat (words, common phrases); their readings are kept up to this many.
_PIECE_CACHE_SIZE = 50_000


def contains_chinese(text: str) -> bool:
    """Whether `text` has a CJK unified ideograph (U+4E00-U+9FFF): the zh/en decision upstream makes."""
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def check_unicode(text: str) -> None:
    """Raise InvalidRequest when `text` cannot be UTF-8 encoded (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"text is not valid Unicode: {text[e.start:e.end]!r} at character {e.start}") from None


class WetextNormalizer:
    """wetext 0.0.4 `Normalizer(lang, operator="tn")` with its FSTs read from `fst_dir`."""

    def __init__(self, fst_dir: str | Path, lang: str = "auto", remove_erhua: bool = False,
                 long_text_chars: int = 400) -> None:
        if lang not in ("auto", *LANGS):
            raise InvalidRequest(f"wetext language must be auto, zh or en, not {lang!r}")
        self.fst_dir = Path(fst_dir)
        self.lang = lang
        # Texts longer than this are normalized piece by piece (see long_text.py).
        self.long_text_chars = long_text_chars
        verbalizer = {"zh": "verbalizer_remove_erhua.fst" if remove_erhua else "verbalizer.fst",
                      "en": "verbalizer.fst"}
        self._taggers: dict[str, kaldifst.TextNormalizer] = {}
        self._verbalizers: dict[str, kaldifst.TextNormalizer] = {}
        self._fast: dict[str, FastTagger] = {}
        self._piece_cache: dict[tuple[str, str], str] = {}
        for code in LANGS:
            if lang in ("auto", code):
                self._taggers[code] = self._load(code, "tagger.fst")
                self._verbalizers[code] = self._load(code, verbalizer[code])

    def _path(self, lang: str, name: str) -> Path:
        return self.fst_dir / lang / "tn" / name

    def _load(self, lang: str, name: str) -> kaldifst.TextNormalizer:
        path = self._path(lang, name)
        if not path.is_file():
            raise ResourceError(f"wetext FST missing: {path} (expected <dir>/{{zh,en}}/tn/{{tagger,verbalizer}}.fst)")
        try:
            return kaldifst.TextNormalizer(str(path))
        except Exception as e:  # kaldifst raises RuntimeError or aborts the read with its own types
            raise ResourceError(f"wetext FST unreadable: {path} ({e})") from None

    def language(self, text: str) -> str:
        """The FST language wetext uses for `text`."""
        if self.lang != "auto":
            return self.lang
        return "zh" if contains_chinese(text) else "en"

    def normalize(self, text: str) -> str:
        """wetext 0.0.4 `Normalizer.normalize`: spoken form of the numbers, dates, units... in `text`."""
        if not _DIGIT.search(text):
            return text
        check_unicode(text)
        lang = self.language(text)
        if len(text) <= self.long_text_chars:
            return self.read(text, lang)
        return "".join(self._normalize_piece(piece, lang) for piece in long_text.pieces(text, lang))

    def read(self, text: str, lang: str) -> str:
        """Tagger -> reorder -> verbalizer on `text` in `lang`, with no digit gate and no cutting."""
        return self._verbalized(self._taggers[lang](text), text, lang)

    def _verbalized(self, tagged: str, text: str, lang: str) -> str:
        if not tagged:
            # No tagger path: wetext 0.0.4 fails an assertion here; keep the text as written.
            return text
        return self._verbalizers[lang](reorder(tagged, lang))

    def _normalize_piece(self, piece: str, lang: str) -> str:
        key = (lang, piece)
        out = self._piece_cache.get(key)
        if out is None:
            if lang not in self._fast:
                self._fast[lang] = fast_tagger(self._path(lang, "tagger.fst"))
            out = self._verbalized(self._fast[lang](piece, long_text.alphabet(piece)), piece, lang)
            if len(self._piece_cache) >= _PIECE_CACHE_SIZE:
                self._piece_cache.clear()
            self._piece_cache[key] = out
        return out
