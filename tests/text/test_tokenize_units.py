"""Tokenizer pieces: pre-tokenizer semantics, the BPE core, special tokens, decode, robustness.

The expected splits below were checked against HF tokenizers (Oniguruma) and tiktoken
(Rust regex) on a fuzz corpus covering every code point; they pin the behaviour that
differs from Python's own `re` classes.
"""

import json
import random
import time
import unicodedata

import numpy as np
import pytest

from mizuoto.testing.fixtures import asset_path, fixture_path, read_jsonl
from mizuoto.text.tokenize import QwenTokenizer, WhisperTokenizer
from mizuoto.text.tokenize.bpe import _merge_by_scan, _merge_with_heap
from mizuoto.text.tokenize.pretokenize import gpt2_pattern, qwen2_pattern


@pytest.fixture(scope="module")
def qwen2():
    return QwenTokenizer.from_dir(asset_path("cosyvoice", "CosyVoice-BlankEN"), version="cosyvoice2")


@pytest.fixture(scope="module")
def qwen3():
    return QwenTokenizer.from_dir(asset_path("cosyvoice", "CosyVoice-BlankEN"), version="cosyvoice3")


@pytest.fixture(scope="module")
def whisper():
    return WhisperTokenizer.from_file(asset_path("whisper", "multilingual.tiktoken"))


def _texts():
    lines = read_jsonl(fixture_path("text", "tokenize.jsonl"))
    out = []
    for line in lines:
        for value in line.values():
            if isinstance(value, str):
                out.append(value)
            elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                out.extend(value)
    return out


@pytest.mark.parametrize("text, pieces", [
    ("I'M here", ["I", "'M", " here"]),            # contractions ignore case
    ("x'ſam", ["x", "'ſ", "am"]),                  # ... by Unicode case folding
    ("2024年", ["2", "0", "2", "4", "年"]),         # one digit per piece
    ("  hello", [" ", " hello"]),                  # last space joins the word
    ("\thello", ["\thello"]),                      # any non-letter may lead a word
    ("a, b!!\n\nc", ["a", ",", " b", "!!\n\n", "c"]),
    ("a \n\n b", ["a", " \n\n", " b"]),
    ("a\x1c\x1c!", ["a", "\x1c\x1c!"]),              # U+001C is not White_Space
    ("a\u00a0b", ["a", "\u00a0b"]),
    ("x\U00031350y", ["x\U00031350y"]),            # CJK Ext. H (Unicode 15) is a letter
    ("end  ", ["end", "  "]),
])
def test_qwen2_pretokenizer(text, pieces):
    assert qwen2_pattern().findall(text) == pieces


@pytest.mark.parametrize("text, pieces", [
    ("I'M here", ["I", "'", "M", " here"]),         # contractions are case-sensitive
    ("it's 2024", ["it", "'s", " 2024"]),           # digit runs stay together
    ("  hello", [" ", " hello"]),
    ("\thello", ["\t", "hello"]),
    ("a\x1c\x1c!", ["a", "\x1c\x1c!"]),
    ("\U00010D40\U00010D41", ["\U00010D40\U00010D41"]),  # Garay digits (Unicode 16) are numbers
])
def test_gpt2_pretokenizer(text, pieces):
    assert gpt2_pattern().findall(text) == pieces


def test_pretokenizers_cover_every_character():
    """The split never drops text: every code point lands in some piece."""
    rng = random.Random(0)
    chars = [chr(c) for c in rng.sample(range(0x30000), 20000) if not 0xD800 <= c < 0xE000]
    text = "".join(ch + rng.choice(["", " ", "\n", "a", "1", "'s"]) for ch in chars)
    for pattern in (qwen2_pattern(), gpt2_pattern()):
        assert "".join(pattern.findall(text)) == text


@pytest.mark.parametrize("name", ["qwen2", "whisper"])
def test_heap_merge_equals_scan_merge(name, request):
    tok = request.getfixturevalue(name)
    rng = random.Random(1)
    pieces = [t.encode("utf-8") for t in _texts()]
    pieces += [bytes(rng.choice(b"abcdeth ing") for _ in range(rng.randint(2, 300))) for _ in range(200)]
    pieces += [p * rng.randint(2, 5) for p in pieces[:50]]
    for piece in pieces:
        assert _merge_with_heap(piece, tok._pair_ranks) == _merge_by_scan(piece, tok._pair_ranks)


def test_qwen_specials_follow_vocab_in_order(qwen2, qwen3):
    vocab = json.loads(asset_path("cosyvoice", "CosyVoice-BlankEN", "vocab.json").read_text(encoding="utf-8"))
    base = len(vocab) + 3  # Qwen2's <|endoftext|>, <|im_start|>, <|im_end|>
    for tok in (qwen2, qwen3):
        ids = list(tok.special_tokens.values())
        assert ids == list(range(len(vocab), len(tok)))
        assert tok.token_to_id("<|endoftext|>") == len(vocab)
        assert tok.token_to_id("<|endofprompt|>") == base
    v2 = qwen2.special_tokens
    assert all(qwen3.special_tokens[s] == i for s, i in v2.items())
    extra = [s for s in qwen3.special_tokens if s not in v2]
    assert extra[0] == "<|endofsystem|>" and qwen3.token_to_id("<|endofsystem|>") == len(qwen2)
    arpabet = [s for s in extra[1:] if s[1:-1].isupper() or s[1:-1][:-1].isupper()]
    pinyin = extra[1 + len(arpabet):]
    assert extra[1:1 + len(arpabet)] == arpabet and all(s[1:-1].islower() for s in pinyin)
    assert arpabet[0] == "[AA]" and pinyin[-1] == "[ǜ]"


def test_every_special_encodes_alone_and_round_trips(qwen3, whisper):
    for tok in (qwen3, whisper):
        for special, sid in tok.special_tokens.items():
            assert tok.encode(special) == [sid]
            assert tok.token_to_id(special) == sid
            assert tok.decode([sid]) == special
            assert tok.decode([sid], skip_special_tokens=True) == ""


def test_specials_keep_neighbouring_spaces(qwen3):
    """Added tokens neither strip spaces nor need word boundaries."""
    ids = qwen3.encode(" [breath] a[AA1]b")
    breath, aa1 = qwen3.token_to_id("[breath]"), qwen3.token_to_id("[AA1]")
    assert ids[1] == breath and aa1 in ids
    assert qwen3.decode(ids) == " [breath] a[AA1]b"


def test_special_is_matched_before_nfc(qwen3):
    """HF matches non-normalized added tokens on the raw text, then NFC's the rest."""
    composed, decomposed = "[ià]", "[i" + "a\u0300" + "]"
    assert qwen3.encode(composed) == [qwen3.token_to_id(composed)]
    assert qwen3.token_to_id(composed) not in qwen3.encode(decomposed)
    assert qwen3.encode(decomposed) == qwen3.encode("[i") + qwen3.encode("à]")


def test_whisper_special_layout(whisper):
    specials = list(whisper.special_tokens)
    first = whisper.token_to_id("<|endoftext|>")
    assert specials[:3] == ["<|endoftext|>", "<|startoftranscript|>", "<|en|>"]
    assert specials[-1] == "<|30.00|>" and whisper.token_to_id("<|30.00|>") == len(whisper) - 1
    assert whisper.token_to_id("<|0.02|>") == whisper.token_to_id("<|0.00|>") + 1
    assert whisper.token_to_id("<|notimestamps|>") == whisper.token_to_id("<|0.00|>") - 1
    assert whisper.token_to_id("<|yue|>") == first + 1 + 100
    assert whisper.token_to_id("<|translate|>") == first + 2 + 100


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "whisper"])
def test_decode_inverts_encode(name, request):
    tok = request.getfixturevalue(name)
    for text in _texts():
        expected = unicodedata.normalize("NFC", text) if name.startswith("qwen") else text
        assert tok.decode(tok.encode(text)) == expected


def test_regular_token_lookup(qwen2, whisper):
    assert qwen2.token_to_id("Ġthe") == qwen2.encode(" the")[0]
    assert whisper.token_to_id(" the") == whisper.encode(" the")[0]
    for tok in (qwen2, whisper):
        with pytest.raises(KeyError):
            tok.token_to_id("<|no such token|>")
        with pytest.raises(KeyError):
            tok.decode([len(tok)])


def test_odd_input_does_not_raise(qwen2, whisper):
    for tok in (qwen2, whisper):
        assert tok.encode("") == []
        assert tok.decode([]) == ""
        assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"  # lone surrogate -> U+FFFD
        assert tok.encode("！？。")


_CJK = "今天是北京时间你好我们的一二三四五六七八九十"


def _cjk(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_CJK) for _ in range(n))


def _encode_cpu_seconds(tok, rng: random.Random, n: int) -> float:
    """The least CPU time of three encodes of fresh n-character texts (fresh: pieces are cached;
    CPU time: other processes on the machine do not count)."""
    best = float("inf")
    for _ in range(3):
        text = _cjk(rng, n)
        start = time.process_time()
        tok.encode(text)
        best = min(best, time.process_time() - start)
    return best


def test_long_unbroken_text_is_not_quadratic(qwen2, whisper):
    """An unbroken CJK run is one pre-token piece; the heap merge keeps encoding it linearithmic.

    Growth is measured as a slope: CPU time at 2.5k to 20k characters, fitted on log-log axes.
    Measured 2026-12-01 (2-vCPU dev machine, four runs): exponent 1.18-1.23 for this encoder, 2.01
    for the pair-scan merge the heap replaced; the bound sits between them. A 100k-character run
    also round-trips.
    """
    rng = random.Random(2)
    text = _cjk(rng, 100_000)
    sizes = [2_500, 5_000, 10_000, 20_000]
    for tok in (qwen2, whisper):
        assert tok.decode(tok.encode(text)) == text
        seconds = [_encode_cpu_seconds(tok, rng, n) for n in sizes]
        exponent = float(np.polyfit(np.log(sizes), np.log(seconds), 1)[0])
        assert exponent < 1.6, f"{type(tok).__name__}: encode time grows as n^{exponent:.2f} ({seconds})"