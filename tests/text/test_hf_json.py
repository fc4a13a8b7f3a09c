"""tokenizer.json reading: the character-level and byte-level BPE layouts, and what is refused."""

import json

import pytest

from mizuoto.errors import ModelLoadError
from mizuoto.text.tokenize.hf_json import load_tokenizer_json
from mizuoto.text.tokenize.pretokenize import whitespace_pattern


def _write(tmp_path, **spec):
    base = {"added_tokens": [], "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
            "model": {"type": "BPE", "vocab": {}, "merges": [], "unk_token": None}}
    base.update(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(base))
    return path


def test_character_bpe_merges_by_rank_and_maps_unknown_characters_to_unk(tmp_path):
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "abc": 5, ".": 6, "é": 7}
    path = _write(tmp_path, added_tokens=[{"id": 8, "content": "[SPACE]"}],
                  model={"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"], "unk_token": "[UNK]"})
    tok = load_tokenizer_json(path)
    assert tok.encode("abc[SPACE]abz.") == [5, 8, 4, 0, 6]
    assert tok.encode("é") == [7], "characters, not bytes, are the units"


def test_whitespace_pretokenizer_keeps_marks_in_words_and_splits_punctuation():
    assert whitespace_pattern().findall("cafe\u0301 don't, x_1!") == ["cafe\u0301", "don", "'", "t", ",", "x_1", "!"]


def test_byte_level_bpe_reads_gpt2_spelling(tmp_path):
    vocab = {"h": 0, "i": 1, "\u0120": 2, "hi": 3, "\u0120hi": 4}
    path = _write(tmp_path, pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
                  added_tokens=[{"id": 5, "content": "[laugh]"}],
                  model={"type": "BPE", "vocab": vocab, "merges": [["h", "i"], ["\u0120", "hi"]]})
    assert load_tokenizer_json(path).encode("hi hi[laugh]") == [3, 4, 5]


@pytest.mark.parametrize("spec, what", [
    ({"model": {"type": "WordPiece", "vocab": {}}}, "WordPiece"),
    ({"normalizer": {"type": "NFKC"}}, "NFKC"),
    ({"pre_tokenizer": {"type": "Metaspace"}}, "Metaspace"),
    ({"model": {"type": "BPE", "vocab": {}, "merges": [], "dropout": 0.1}}, "dropout"),
])
def test_unsupported_features_are_named(tmp_path, spec, what):
    with pytest.raises(ModelLoadError, match=what):
        load_tokenizer_json(_write(tmp_path, **spec))
