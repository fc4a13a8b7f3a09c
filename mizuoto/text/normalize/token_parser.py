"""Reorder the fields of tagged tokens the way wetext 0.0.4 does between tagger and verbalizer.

The tagger FST writes tokens such as `date { month: "january" day: "five" }`; the verbalizer
expects the fields of some token kinds in a fixed order. A token kind with a fixed order
keeps only the listed fields (others are dropped), unless it carries `preserve_order: "true"`.
"""

from __future__ import annotations

import string

from mizuoto.errors import MizuotoError

# Field orders of wetext 0.0.4's text normalization ("tn") for each language.
_ORDERS: dict[str, dict[str, list[str]]] = {
    "zh": {
        "date": ["year", "month", "day"],
        "fraction": ["denominator", "numerator"],
        "measure": ["denominator", "numerator", "value"],
        "money": ["value", "currency"],
        "time": ["noon", "hour", "minute", "second"],
    },
    "en": {
        "date": ["preserve_order", "text", "day", "month", "year"],
        "money": ["integer_part", "fractional_part", "quantity", "currency_maj"],
    },
}

_KEY_CHARS = frozenset(string.ascii_letters + "_")


class TaggedTextError(MizuotoError):
    """The tagger's output is not a well-formed token sequence."""


def _parse(tagged: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """Tokens as (name, [(key, value), ...]) in input order; duplicate keys are kept."""
    tokens: list[tuple[str, list[tuple[str, str]]]] = []
    n = len(tagged)
    i = 0

    def skip_spaces(i: int) -> int:
        while i < n and tagged[i] == " ":
            i += 1
        return i

    def read_key(i: int) -> tuple[str, int]:
        j = i
        while j < n and tagged[j] in _KEY_CHARS:
            j += 1
        return tagged[i:j], j

    def expect(i: int, chars: str) -> int:
        # wetext consumes each of these characters only where it is present.
        for ch in chars:
            if i < n and tagged[i] == ch:
                i += 1
        return i

    i = skip_spaces(i)
    while i < n:
        name, i = read_key(i)
        i = expect(i, " { ")
        fields: list[tuple[str, str]] = []
        while True:
            i = skip_spaces(i)
            if i >= n:
                break
            if tagged[i] == "}":
                i += 1
                break
            key, i = read_key(i)
            i = expect(i, ': "')
            start = i
            while i < n and tagged[i] != '"':
                i += 2 if tagged[i] == "\\" else 1  # an escaped char never ends the value
            if i >= n:
                raise TaggedTextError(f"unterminated value in tagged text near {tagged[start:start + 40]!r}")
            fields.append((key, tagged[start:i]))
            i += 1
        tokens.append((name, fields))
        i = skip_spaces(i)
    return tokens


def reorder(tagged: str, lang: str) -> str:
    """The tagger output with each token's fields put in the order the `lang` verbalizer expects."""
    orders = _ORDERS[lang]
    out = []
    for name, fields in _parse(tagged):
        values = dict(fields)  # a repeated key keeps its last value, as in wetext
        keys = [k for k, _ in fields]
        if name in orders and values.get("preserve_order") != "true":
            keys = [k for k in orders[name] if k in values]
        body = "".join(f' {k}: "{values[k]}"' for k in keys)
        out.append(f"{name} {{{body} }}")
    return " ".join(out)
