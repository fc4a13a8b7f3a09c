"""A Hugging Face `tokenizer.json` with a BPE model, read without the `tokenizers` package.

Two layouts are read, each encoding as `tokenizers` does: added tokens cut out of the raw text
first (leftmost, longest), then the pre-tokenizer, then BPE merges by rank within each piece:
- byte-level (GPT-2 and its descendants): pre-tokenizer `ByteLevel` with its regex and no prefix
  space; pieces are UTF-8 bytes spelled in GPT-2's byte alphabet (`mizuoto.text.tokenize.bpe`);
- character-level: pre-tokenizer `Whitespace` (or none); pieces are characters, and one missing
  from the vocabulary becomes the model's `unk_token` (dropped when it has none).
No normalizer, no dropout, no subword prefix or suffix: a file using one is refused, named.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mizuoto.errors import ModelLoadError
from mizuoto.text.tokenize.bpe import ByteBPE, byte_alphabet, merge_pieces, token_bytes
from mizuoto.text.tokenize.pretokenize import gpt2_pattern, whitespace_pattern


class CharBPE(ByteBPE):
    """BPE over characters (no byte alphabet): what `tokenizers` does for a non-byte-level BPE model."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], specials: dict[str, int],
                 pattern: re.Pattern | None, unk: int | None) -> None:
        super().__init__({t.encode("utf-8"): i for t, i in vocab.items()}, {}, specials,
                         pattern if pattern is not None else re.compile(r"(?s).+"))
        self._vocab, self._unk = vocab, unk
        self._char_ranks = {pair: rank for rank, pair in enumerate(merges)}

    def _encode_piece(self, piece: bytes) -> list[int]:
        parts = merge_pieces(piece.decode("utf-8"), self._char_ranks)  # type: ignore[arg-type]
        ids = (self._vocab.get(p, self._unk) for p in parts)
        return [i for i in ids if i is not None]


def _merges(model: dict, where: Path) -> list[tuple[str, str]]:
    out = []
    for m in model.get("merges", []):
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
        if len(pair) != 2:
            raise ModelLoadError(f"{where}: a merge is not a pair: {m!r}")
        out.append(pair)
    return out


def load_tokenizer_json(path: str | Path) -> ByteBPE:
    """The tokenizer a BPE `tokenizer.json` describes (see the module's docstring for what is read)."""
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec["model"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {path} as a tokenizer.json: {exc}") from None
    if model.get("type") != "BPE":
        raise ModelLoadError(f"{path}: model type {model.get('type')!r} is not supported (BPE only)")
    for feature in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(feature):
            raise ModelLoadError(f"{path}: BPE {feature} is not supported")
    if spec.get("normalizer"):
        raise ModelLoadError(f"{path}: normalizer {spec['normalizer'].get('type')!r} is not supported")
    specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])}
    vocab = {str(k): int(v) for k, v in model.get("vocab", {}).items()}
    merges = _merges(model, path)
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise ModelLoadError(f"{path}: ByteLevel with add_prefix_space or without its regex is not supported")
        table = byte_alphabet()
        encoder = {token_bytes(t, table): i for t, i in vocab.items()}
        ranks = {(token_bytes(a, table), token_bytes(b, table)): r for r, (a, b) in enumerate(merges)}
        return ByteBPE(encoder, ranks, specials, gpt2_pattern())
    if pre.get("type") not in (None, "Whitespace"):
        raise ModelLoadError(f"{path}: pre_tokenizer {pre.get('type')!r} is not supported (ByteLevel, Whitespace)")
    unk = model.get("unk_token")
    unk_id = vocab.get(unk, specials.get(unk)) if unk else None
    pattern = whitespace_pattern() if pre.get("type") == "Whitespace" else None
    return CharBPE(vocab, merges, specials, pattern, unk_id)


def load_gpt2_files(directory: str | Path) -> ByteBPE:
    """A GPT-2 style byte-level BPE from a slow tokenizer's files: vocab.json, merges.txt and added_tokens.json.

    What `tokenizer.json` would say for such a directory (ByteLevel, no prefix space): the added tokens
    (e.g. `<|endoftext|>`, tags such as `[laugh]`) are matched verbatim as single ids.
    """
    root = Path(directory)
    try:
        vocab = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
        merges = []
        for n, line in enumerate((root / "merges.txt").read_text(encoding="utf-8").splitlines()):
            if not line.strip() or (n == 0 and line.startswith("#version:")):
                continue
            left, right = line.split()
            merges.append((left, right))
        added_path = root / "added_tokens.json"
        added = json.loads(added_path.read_text(encoding="utf-8")) if added_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the GPT-2 tokenizer files in {root}: {exc}") from None
    table = byte_alphabet()
    specials = {str(t): int(i) for t, i in added.items()}
    specials.update({t: int(i) for t, i in vocab.items() if t == "<|endoftext|>"})
    encoder = {token_bytes(t, table): int(i) for t, i in vocab.items()}
    ranks = {(token_bytes(a, table), token_bytes(b, table)): r for r, (a, b) in enumerate(merges)}
    return ByteBPE(encoder, ranks, specials, gpt2_pattern())
