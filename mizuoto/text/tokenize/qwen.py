"""Qwen2 byte-level BPE (vocab.json + merges.txt), with CosyVoice's added tokens or only the directory's own.

Upstream (`get_qwen_tokenizer`) loads the directory with `AutoTokenizer` (the fast tokenizer
converted from Qwen2Tokenizer: NFC normalizer, Qwen2 split pattern, byte-level BPE from the
merges, no BOS/EOS) and then adds its special tokens. Added tokens are matched on the raw
text before NFC, never strip neighbouring spaces, and new ones get consecutive ids after
the existing vocabulary.
"""

import json
import unicodedata
from functools import lru_cache
from pathlib import Path

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.text.tokenize.bpe import ByteBPE, byte_alphabet, token_bytes
from mizuoto.text.tokenize.pretokenize import qwen2_pattern

# Qwen2's own added tokens, used when the directory has no tokenizer_config.json.
_QWEN2_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# cosyvoice/tokenizer/tokenizer.py, CosyVoice2Tokenizer: additional_special_tokens, in order.
_COSYVOICE2_SPECIALS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>",
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]",
    "[accent]", "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]",
    "[vocalized-noise]", "[lipsmack]", "[mn]",
)

# CosyVoice3Tokenizer appends <|endofsystem|>, the ARPAbet phones (vowels also with stress
# 0/1/2) and the pinyin initials/toned finals, in upstream's order.
_ARPABET = (
    "AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 "
    "B CH D DH EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 "
    "IY2 JH K L M N NG OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 "
    "UW2 V W Y Z ZH"
)
_PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo "
    "iè ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o "
    "ong ou p q r s sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā "
    "uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng "
    "áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān "
    "āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng "
    "ǒu ǔ ǔn ǘ ǚ ǜ"
)
_COSYVOICE3_SPECIALS = (
    _COSYVOICE2_SPECIALS
    + ("<|endofsystem|>",)
    + tuple(f"[{p}]" for p in _ARPABET.split())
    + tuple(f"[{p}]" for p in _PINYIN.split())
)

# "qwen2": the directory's own added tokens only (tokenizer_config.json), as a plain Qwen2 tokenizer loads them
VERSIONS = {"cosyvoice2": _COSYVOICE2_SPECIALS, "cosyvoice3": _COSYVOICE3_SPECIALS, "qwen2": ()}


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


class QwenTokenizer(ByteBPE):
    """CosyVoice2/3 text tokenizer: Qwen2 BPE plus CosyVoice's special tokens."""

    @classmethod
    def from_dir(cls, blank_en_dir: str | Path, version: str = "cosyvoice2") -> "QwenTokenizer":
        """Load vocab.json + merges.txt (+ tokenizer_config.json) and add `version`'s specials."""
        if version not in VERSIONS:
            raise InvalidRequest(f"unknown Qwen tokenizer version {version!r}: expected one of {sorted(VERSIONS)}")
        return _load(str(Path(blank_en_dir).resolve()), version)

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[str, int]):
        table = byte_alphabet()
        self._vocab = vocab
        encoder = {token_bytes(tok, table): i for tok, i in vocab.items()}
        pair_ranks: dict[tuple[bytes, bytes], int] = {}
        for left, right in merges:
            # Duplicate merge lines keep their first position, as the fast tokenizer ranks them.
            pair_ranks.setdefault((token_bytes(left, table), token_bytes(right, table)), len(pair_ranks))
        super().__init__(encoder, pair_ranks, added, qwen2_pattern(), normalize=_nfc)

    def _regular_token_id(self, token: str) -> int | None:
        return self._vocab.get(token)


@lru_cache(maxsize=4)
def _load(directory: str, version: str) -> QwenTokenizer:
    root = Path(directory)
    vocab_path, merges_path = root / "vocab.json", root / "merges.txt"
    for path in (vocab_path, merges_path):
        if not path.is_file():
            raise ModelLoadError(f"Qwen tokenizer file missing: {path}")
    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        merges = _read_merges(merges_path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"unreadable Qwen tokenizer file in {root}: {exc}") from exc
    added = _base_added_tokens(root / "tokenizer_config.json", len(vocab))
    size = max([*vocab.values(), *added.values()]) + 1
    for token in VERSIONS[version]:
        if token not in added and token not in vocab:
            added[token] = size
            size += 1
    return QwenTokenizer(vocab, merges, added)


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            line = line.strip()
            if not line or (n == 0 and line.startswith("#version:")):
                continue
            left, right = line.split()
            merges.append((left, right))
    return merges


def _base_added_tokens(config_path: Path, vocab_len: int) -> dict[str, int]:
    """The tokens the directory itself adds (Qwen2's three), by id."""
    if not config_path.is_file():
        return {tok: vocab_len + k for k, tok in enumerate(_QWEN2_ADDED)}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"unreadable {config_path}: {exc}") from exc
    decoder = config.get("added_tokens_decoder") or {}
    for entry in decoder.values():
        # Only plain added tokens are implemented: matched verbatim, no neighbour stripping.
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word") or entry.get("normalized"):
            raise ModelLoadError(f"{config_path}: added token {entry['content']!r} uses lstrip/rstrip/"
                                 "single_word/normalized, which this tokenizer does not implement")
    return {entry["content"]: int(i) for i, entry in decoder.items()}
