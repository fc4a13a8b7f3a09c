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
