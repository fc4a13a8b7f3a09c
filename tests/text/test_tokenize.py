"""Tokenizer parity with upstream on `text/tokenize.jsonl` and the fixture models' yaml.

Every key of a line that names `ids_cv<N>_<tokenizer>` is checked: the text it was made
from is the key's prefix field (`normalized_ids_...` -> `normalized`, `segments_v2_ids_...`
-> each element of `segments_v2`), or `text` when there is no prefix.
"""

import re

import pytest

from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.fixtures import asset_path, fixture_path, fixtures_root, read_jsonl
from mizuoto.text.tokenize import QwenTokenizer, WhisperTokenizer

_IDS_KEY = re.compile(r"^(?P<prefix>.*?)_?ids_cv(?P<version>\d+)_(?P<tokenizer>[a-z0-9]+)$")
_LINES = read_jsonl(fixture_path("text", "tokenize.jsonl"))


def test_fixture_lines_were_found():
    assert _LINES and any(_IDS_KEY.match(key) for line in _LINES for key in line)


def _tokenizer(version: str, name: str):
    if name == "whisper":
        return WhisperTokenizer.from_file(asset_path("whisper", "multilingual.tiktoken"))
    if name == "qwen":
        return QwenTokenizer.from_dir(asset_path("cosyvoice", "CosyVoice-BlankEN"), version=f"cosyvoice{version}")
    raise AssertionError(f"fixture names an unknown tokenizer {name!r}")


@pytest.mark.parametrize("line", _LINES, ids=[str(line.get("id", n)) for n, line in enumerate(_LINES)])
def test_fixture_ids_equal_upstream(line):
    checked = 0
    for key, expected in line.items():
        found = _IDS_KEY.match(key)
        if found is None:
            continue
        tok = _tokenizer(found["version"], found["tokenizer"])
        source = line[found["prefix"] or "text"]
        if isinstance(source, list):
            got = [tok.encode(s) for s in source]
        else:
            got = tok.encode(source)
        assert got == expected, f"{key} differs for {source!r}"
        checked += 1
    assert checked, f"line {line.get('id')} has no ids_cv* field"


def _fixture_yamls():
    return sorted(fixtures_root().glob("cosyvoice/*/model/*.yaml"))


@pytest.mark.parametrize("path", _fixture_yamls(), ids=lambda p: p.parent.parent.name)
def test_yaml_tokenizer_loads_with_its_settings(path):
    """Each fixture model's `get_tokenizer` maps onto ours; v1's id count is the LM's text vocab."""
    config = load_hyperyaml(path)
    spec = config["get_tokenizer"]
    if spec.cls == "get_tokenizer":
        assert spec.get("multilingual") is True
        tok = WhisperTokenizer.from_file(asset_path("whisper", "multilingual.tiktoken"),
                                         num_languages=spec["num_languages"])
        assert len(tok) == config["llm"]["text_token_size"]
        assert config["allowed_special"] == "all"
    else:
        assert spec.cls == "get_qwen_tokenizer"
        tok = QwenTokenizer.from_dir(asset_path("cosyvoice", "CosyVoice-BlankEN"),
                                     version=spec.get("version", "cosyvoice2"))
        assert tok.token_to_id("<|endofprompt|>") == len(tok) - len(_new_specials(tok))


def _new_specials(tok):
    """Specials CosyVoice added beyond Qwen2's own three."""
    base = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    return [s for s in tok.special_tokens if s not in base]


def _ids_of_specials_in_fixtures(tok, key_pattern):
    """(special, id) pairs seen in fixture lines: a special alone between ordinary text."""
    pairs = set()
    for line in _LINES:
        for key, ids in line.items():
            found = _IDS_KEY.match(key)
            if not found or not re.fullmatch(key_pattern, f"cv{found['version']}_{found['tokenizer']}"):
                continue
            source = line[found["prefix"] or "text"]
            texts, id_lists = (source, ids) if isinstance(source, list) else ([source], [ids])
            for text, id_list in zip(texts, id_lists):
                for special, sid in tok.special_tokens.items():
                    if special in text:
                        assert sid in id_list, f"{special} in {text!r} but {sid} not in upstream ids"
                        pairs.add((special, sid))
    return pairs


@pytest.mark.parametrize("version", ["cosyvoice2", "cosyvoice3"])
def test_special_ids_seen_in_fixtures(version):
    tok = QwenTokenizer.from_dir(asset_path("cosyvoice", "CosyVoice-BlankEN"), version=version)
    pattern = "cv2_qwen" if version == "cosyvoice2" else "cv3_qwen"
    # upstream's ids where a fixture line holds a special (the corpus may hold none), and every special alone
    pairs = _ids_of_specials_in_fixtures(tok, pattern) | set(tok.special_tokens.items())
    assert pairs, "the tokenizer defines no special token"
    for special, sid in pairs:
        assert tok.encode(special) == [sid]
