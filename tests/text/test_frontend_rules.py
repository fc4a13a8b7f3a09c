"""The string rules of upstream's text front end, one by one (expected values follow frontend_utils.py @ ace7c47)."""

import pytest

from mizuoto.text.normalize import rules


def _chars(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def test_replace_blank_keeps_space_only_between_ascii():
    assert rules.replace_blank("他说 OK 然后") == "他说OK然后"
    assert rules.replace_blank("Wi-Fi 六 and so on") == "Wi-Fi六and so on"
    assert rules.replace_blank("a  b") == "ab"  # neither space has two non-space neighbours


def test_replace_blank_edges():
    # Upstream reads text[-1] as the left neighbour of a leading space.
    assert rules.replace_blank(" ab") == " ab"
    assert rules.replace_blank(" 中b") == "中b"
    # Upstream fails on a trailing space (no right neighbour); it goes.
    assert rules.replace_blank("ab ") == "ab"


def test_corner_marks_and_brackets():
    assert rules.replace_corner_mark("5m²与3m³") == "5m平方与3m立方"
    assert rules.remove_bracket("（注）【一】`x`——完") == "注一x 完"


def test_spell_out_number_runs():
    spoken = {"12": "twelve", "3": "three"}
    assert rules.spell_out_number("a12b3", spoken.__getitem__) == "atwelvebthree"
    assert rules.spell_out_number("", spoken.__getitem__) == ""


def test_is_only_punctuation():
    assert rules.is_only_punctuation("")
    assert rules.is_only_punctuation("！？。$+^")
    assert not rules.is_only_punctuation("。 ")
    assert not rules.is_only_punctuation("a.")


def test_split_adds_final_mark_and_keeps_closing_quote():
    assert rules.split_paragraph("你好", _chars, "zh") == ["你好。"]
    assert rules.split_paragraph('He said "hi." Then left', _chars, "en", 5, 3, 1) == \
        ['He said "hi."', " Then left."]


def test_split_quote_after_empty_sentence_joins_previous():
    # "!" right after "." makes an empty sentence; the quote still goes to the last one.
    assert rules.split_paragraph('a.!"b', _chars, "en", 1, 0, 0) == ['a."', "b."]
    assert rules.split_paragraph('!"', _chars, "en", 1, 0, 0) == ['"']  # upstream: IndexError


def test_split_merges_greedily_and_appends_short_tail():
    text = "一二三四五。" * 4 + "六。"
    # max 12 / min 8 characters: flush once the current piece is over 8 and the next would pass 12.
    assert rules.split_paragraph(text, _chars, "zh", 12, 8, 3) == ["一二三四五。一二三四五。", "一二三四五。一二三四五。六。"]


def test_split_en_measures_with_the_tokenizer():
    calls = []

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return text.split()

    text = "one two three. four five six. seven."
    assert rules.split_paragraph(text, tokenize, "en", 4, 2, 2) == ["one two three.", " four five six. seven."]
    assert calls  # lengths come from the tokenizer, not from characters


@pytest.mark.parametrize("marks,lang", [("。？！；：、.?!;", "zh"), (".?!;:", "en")])
def test_split_marks(marks, lang):
    text = "".join(f"x{m}" for m in marks)
    assert rules.split_paragraph(text, _chars, lang, 1, 0, 0) == [f"x{m}" for m in marks]


def test_split_empty_text():
    assert rules.split_paragraph("", _chars, "zh") == []
