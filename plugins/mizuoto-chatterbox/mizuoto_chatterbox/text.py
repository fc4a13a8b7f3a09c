"""Chatterbox's text front: upstream's punctuation clean-up, then the model's tokenizer.

The clean-up (`clean`) is upstream's `punc_norm`, rule for rule: an empty text becomes a fixed
sentence; a lower-case first letter is capitalised; runs of whitespace become one space; LLM-style
punctuation is replaced in a fixed order; a text that does not end in . ! ? - or , gets a full stop.
English ids are the characters' BPE (`tokenizer.json`, spaces spelled [SPACE]) between [START] and
[STOP]; Turbo's are GPT-2's byte-level BPE of the text (its `tokenizer.json`, else vocab.json, merges.txt and
added_tokens.json), paralinguistic tags such as [laugh] single ids.
"""

from __future__ import annotations

from pathlib import Path

from mizuoto.errors import ModelLoadError
from mizuoto.text.tokenize.hf_json import load_gpt2_files, load_tokenizer_json

EMPTY_TEXT = "You need to add some text for me to talk."
# (what, replacement), applied in this order
REPLACEMENTS = (("...", ", "), ("\u2026", ", "), (":", ","), (" - ", ", "), (";", ", "), ("\u2014", "-"),
                ("\u2013", "-"), (" ,", ","), ("\u201c", '"'), ("\u201d", '"'), ("\u2018", "'"), ("\u2019", "'"))
ENDINGS = (".", "!", "?", "-", ",")
SPACE = "[SPACE]"
START, STOP = "[START]", "[STOP]"


def clean(text: str) -> str:
    """Upstream's `punc_norm`."""
    if not text:
        return EMPTY_TEXT
    if text[0].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in REPLACEMENTS:
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

    def ids(self, text: str) -> list[int]:
        """T3's text ids for raw text (English: with [START] and [STOP] around them)."""
        text = clean(text)
        if self.turbo:
            return self.tokenizer.encode(text)
        return [self.start, *self.tokenizer.encode(text.replace(" ", SPACE)), self.stop]
