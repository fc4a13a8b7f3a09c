"""Text to T3's ids against upstream on every recorded case, and the clean-up's rules."""

import pytest

from mizuoto_chatterbox.text import EMPTY_TEXT, TextFront, clean


def test_text_ids_equal_upstreams(case):
    ref = case.tensors()
    front = TextFront(case.model_dir, turbo=case.spec["class"] == "ChatterboxTurboTTS")
    assert front.ids(case.spec["text"]) == ref["text_tokens"][0].tolist()


@pytest.mark.parametrize("raw, cleaned", [
    ("", EMPTY_TEXT),
    ("hello   there", "Hello there."),
    ("Wait... what: no; yes \u2014 ok", "Wait,  what, no,  yes - ok."),  # upstream keeps the doubled spaces
    ("\u201cquoted\u201d it\u2019s", "\"quoted\" it's."),
    ("Ends with a comma ,", "Ends with a comma,"),
    ("Question?  ", "Question?"),
])
def test_clean_follows_upstreams_rules(raw, cleaned):
    assert clean(raw) == cleaned


@pytest.mark.parametrize("raw, cleaned", [  # Turbo's punc_norm (tts_turbo.py) has no "...", ";" or " - " rule
    ("", EMPTY_TEXT),
    ("Wait... what: no; yes \u2014 ok - fine", "Wait... what, no; yes - ok - fine."),
    ("so\u2026 \u201cquoted\u201d it\u2019s ,", "So,  \"quoted\" it's,"),
])
def test_turbo_clean_follows_upstreams_turbo_rules(raw, cleaned):
    assert clean(raw, turbo=True) == cleaned


def test_turbo_cuts_a_long_text_as_its_tokenizer_config_says(case, tmp_path):
    """model_max_length and truncation_side of tokenizer_config.json, as transformers' truncation=True reads them."""
    import json
    import shutil

    from mizuoto.errors import ModelLoadError

    if case.spec["class"] != "ChatterboxTurboTTS":
        return
    source = case.model_dir
    for name in ("vocab.json", "merges.txt", "added_tokens.json"):
        shutil.copy(source / name, tmp_path / name)
    text = "one two three four five six seven eight nine ten"
    whole = TextFront(tmp_path, turbo=True).ids(text)  # no config: not cut
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"model_max_length": 5}))
    assert TextFront(tmp_path, turbo=True).ids(text) == whole[:5]
    config.write_text(json.dumps({"model_max_length": 5, "truncation_side": "left"}))
    assert TextFront(tmp_path, turbo=True).ids(text) == whole[-5:]
    config.write_text(json.dumps({"model_max_length": "long"}))
    with pytest.raises(ModelLoadError, match="model_max_length"):
        TextFront(tmp_path, turbo=True)
