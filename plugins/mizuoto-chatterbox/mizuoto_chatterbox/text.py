"""Chatterbox's text front: upstream's punctuation clean-up, then the model's tokenizer.

The clean-up (`clean`) is the model's upstream `punc_norm`, rule for rule: an empty text becomes a
fixed sentence; a lower-case first letter is capitalised; runs of whitespace become one space;
LLM-style punctuation is replaced in a fixed order (Turbo's `punc_norm` has fewer rules: it keeps
`...`, `;` and ` - `); a text that does not end in . ! ? - or , gets a full stop.
English ids are the characters' BPE (`tokenizer.json`, spaces spelled [SPACE]) between [START] and
[STOP]; Turbo's are GPT-2's byte-level BPE of the text (its `tokenizer.json`, else vocab.json, merges.txt and
added_tokens.json), paralinguistic tags such as [laugh] single ids, cut to the `model_max_length` of
its `tokenizer_config.json` as upstream's `tokenizer(text, truncation=True)` does.
"""

from __future__ import annotations

import json
from pathlib import Path

from mizuoto.errors import ModelLoadError
from mizuoto.text.tokenize.hf_json import load_gpt2_files, load_tokenizer_json

EMPTY_TEXT = "You need to add some text for me to talk."
# (what, replacement), applied in this order: upstream's tts.py (English) and tts_turbo.py (Turbo)
REPLACEMENTS = (("...", ", "), ("\u2026", ", "), (":", ","), (" - ", ", "), (";", ", "), ("\u2014", "-"),
                ("\u2013", "-"), (" ,", ","), ("\u201c", '"'), ("\u201d", '"'), ("\u2018", "'"), ("\u2019", "'"))
TURBO_REPLACEMENTS = tuple(r for r in REPLACEMENTS if r[0] not in ("...", " - ", ";"))  # Turbo keeps these
TOKENIZER_CONFIG = "tokenizer_config.json"
ENDINGS = (".", "!", "?", "-", ",")
SPACE = "[SPACE]"
START, STOP = "[START]", "[STOP]"


def clean(text: str, turbo: bool = False) -> str:
    """Upstream's `punc_norm` of the English model (`tts.py`) or of Turbo (`tts_turbo.py`)."""
    if not text:
        return EMPTY_TEXT
    if text[0].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in TURBO_REPLACEMENTS if turbo else REPLACEMENTS:
        text = text.replace(old, new)
    text = text.rstrip(" ")
    return text if text.endswith(ENDINGS) else text + "."


class TextFront:
    """Text to T3's ids for one model directory (English `tokenizer.json` or Turbo's GPT-2 files)."""

    def __init__(self, model_dir: str | Path, turbo: bool) -> None:
        self.turbo = turbo
        path = Path(model_dir) / "tokenizer.json"
        # Turbo's directory may hold only the slow GPT-2 files (AutoTokenizer reads either)
        self.tokenizer = load_tokenizer_json(path) if path.is_file() or not turbo else load_gpt2_files(model_dir)
        if not turbo:
            specials = self.tokenizer.special_tokens
            missing = [t for t in (START, STOP, SPACE) if t not in specials]
            if missing:
                raise ModelLoadError(f"{model_dir}/tokenizer.json lacks {', '.join(missing)}")
            self.start, self.stop = specials[START], specials[STOP]
        self.max_length, self.cut_left = _truncation(Path(model_dir)) if turbo else (None, False)

    def ids(self, text: str) -> list[int]:
        """T3's text ids for raw text (English: with [START] and [STOP] around them)."""
        text = clean(text, self.turbo)
        if self.turbo:
            ids = self.tokenizer.encode(text)
            if self.max_length is not None and len(ids) > self.max_length:
                ids = ids[-self.max_length:] if self.cut_left else ids[:self.max_length]
            return ids
        return [self.start, *self.tokenizer.encode(text.replace(" ", SPACE)), self.stop]


def _truncation(model_dir: Path) -> tuple[int | None, bool]:
    """(model_max_length, cut from the left) of a Turbo directory's tokenizer_config.json: what upstream's
    `truncation=True` cuts to (no file or no length: transformers' effectively unbounded default)."""
    path = model_dir / TOKENIZER_CONFIG
    if not path.is_file():
        return None, False
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        length, side = config.get("model_max_length"), config.get("truncation_side", "right")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if side not in ("left", "right"):
        raise ModelLoadError(f"{path}: truncation_side must be 'left' or 'right', got {side!r}")
    if length is None:
        return None, side == "left"
    if isinstance(length, bool) or not isinstance(length, (int, float)) or length < 1:
        raise ModelLoadError(f"{path}: model_max_length must be a positive number, got {length!r}")
    return int(length), side == "left"
