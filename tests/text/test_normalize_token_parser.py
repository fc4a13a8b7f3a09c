"""Field reordering between tagger and verbalizer, as wetext 0.0.4's TokenParser does it."""

import pytest

from mizuoto.text.normalize.token_parser import TaggedTextError, reorder


def test_fixed_order_and_unlisted_fields_dropped():
    tagged = 'date { month: "january" day: "five" extra: "x" year: "twenty" } '
    assert reorder(tagged, "en") == 'date { day: "five" month: "january" year: "twenty" }'


def test_preserve_order_keeps_every_field():
    tagged = 'date { preserve_order: "true" month: "may" day: "one" }'
    assert reorder(tagged, "en") == tagged


def test_kinds_without_order_keep_theirs_and_spacing_is_normalized():
    tagged = '  char { value: "今" }   measure { value: "三月" } '
    assert reorder(tagged, "zh") == 'char { value: "今" } measure { value: "三月" }'


def test_zh_orders():
    assert reorder('money { currency: "元" value: "十" }', "zh") == 'money { value: "十" currency: "元" }'
    assert reorder('time { minute: "五分" hour: "三点" noon: "下午" }', "zh") == \
        'time { noon: "下午" hour: "三点" minute: "五分" }'


def test_escaped_quote_stays_inside_value():
    tagged = 'w { v: "say \\"hi" }'
    assert reorder(tagged, "en") == tagged


def test_repeated_key_keeps_last_value_in_both_places():
    assert reorder('w { v: "a" v: "b" }', "en") == 'w { v: "b" v: "b" }'


def test_empty_and_unterminated():
    assert reorder("", "zh") == ""
    with pytest.raises(TaggedTextError):
        reorder('w { v: "open', "en")
