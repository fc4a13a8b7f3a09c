"""Whisper's multilingual tiktoken encoding, as CosyVoice v1 uses it (`allowed_special='all'`).

The `.tiktoken` file lists base64 token bytes with their ranks; a pair merges when its
concatenation is a token, with that token's rank as priority, and a piece that is itself a
token is taken whole. Whisper appends its special tokens after the ranks in a fixed order.
"""

import base64
import binascii
from functools import lru_cache
from pathlib import Path

from mizuoto.errors import ModelLoadError
from mizuoto.text.tokenize.bpe import ByteBPE
from mizuoto.text.tokenize.pretokenize import gpt2_pattern

# whisper.tokenizer.LANGUAGES key order; the first `num_languages` get a token.
WHISPER_LANGUAGES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no "
    "th ur hr bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw "
    "gl mr pa si km sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl "
    "mg as tt haw ln ha ba jw su yue"
).split()

_TIMESTAMPS = 1501  # 0.00 .. 30.00 s in 0.02 s steps


def whisper_special_tokens(num_languages: int) -> list[str]:
    """Whisper's special tokens in the order it appends them after the ranks."""
    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *(f"<|{lang}|>" for lang in WHISPER_LANGUAGES[:num_languages]),
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
        *(f"<|{k * 0.02:.2f}|>" for k in range(_TIMESTAMPS)),
    ]


class WhisperTokenizer(ByteBPE):
    """CosyVoice v1 text tokenizer: whisper multilingual tiktoken, special tokens allowed."""

    @classmethod
    def from_file(cls, tiktoken_path: str | Path, num_languages: int = 100) -> "WhisperTokenizer":
        """Load a `.tiktoken` rank file; CosyVoice v1's yaml uses 100 languages."""
        return _load(str(Path(tiktoken_path).resolve()), num_languages)

    def __init__(self, ranks: dict[bytes, int], num_languages: int):
        pair_ranks: dict[tuple[bytes, bytes], int] = {}
        for token, rank in ranks.items():
            for cut in range(1, len(token)):
                left, right = token[:cut], token[cut:]
                if left in ranks and right in ranks:
                    pair_ranks[(left, right)] = rank
        first = len(ranks)
        specials = {tok: first + k for k, tok in enumerate(whisper_special_tokens(num_languages))}
        super().__init__(ranks, pair_ranks, specials, gpt2_pattern(), whole_piece_lookup=True)


@lru_cache(maxsize=4)
def _load(path: str, num_languages: int) -> WhisperTokenizer:
    if not 0 <= num_languages <= len(WHISPER_LANGUAGES):
        raise ModelLoadError(f"num_languages {num_languages} outside 0..{len(WHISPER_LANGUAGES)}")
    ranks: dict[bytes, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"tiktoken file missing: {path}") from exc
    except (ValueError, binascii.Error, OSError) as exc:
        raise ModelLoadError(f"unreadable tiktoken file {path}: {exc}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelLoadError(f"tiktoken file {path}: ranks are not 0..{len(ranks) - 1}")
    return WhisperTokenizer(ranks, num_languages)
