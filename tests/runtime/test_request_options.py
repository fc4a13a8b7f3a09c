"""Engine-declared request options: declaration, checking, defaults filled in, parsing from text."""

import pytest

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.engine import Capabilities, SynthesisRequest
from mizuoto.runtime.request_options import RequestOption, parse_settings, resolve_options

WEIGHT = RequestOption("weight", "float", 0.5, "how much", 0.0, 2.0)
STEPS = RequestOption("steps", "int", 10, "how many", 1, 100)
FAST = RequestOption("fast", "bool", False)
STYLE = RequestOption("style", "str", "plain", choices=("plain", "bright"))


def test_every_declared_option_is_filled_in_and_given_ones_are_checked():
    got = resolve_options((WEIGHT, STEPS, FAST, STYLE), {"weight": 1, "style": "bright"})
    assert got == {"weight": 1.0, "steps": 10, "fast": False, "style": "bright"}
    assert isinstance(got["weight"], float)


@pytest.mark.parametrize("option, value", [(WEIGHT, 2.5), (WEIGHT, "1"), (WEIGHT, True), (WEIGHT, float("nan")),
                                           (STEPS, 1.5), (STEPS, 0), (FAST, 1), (STYLE, "dark"), (STYLE, 3)])
def test_a_bad_value_names_the_option(option, value):
    with pytest.raises(InvalidRequest, match=repr(option.name)):
        resolve_options((option,), {option.name: value})


def test_an_unknown_option_lists_the_known_ones():
    with pytest.raises(InvalidRequest, match="no option 'wieght'; its options: steps, weight"):
        resolve_options((WEIGHT, STEPS), {"wieght": 1.0})
    with pytest.raises(InvalidRequest, match="its options: none"):
        resolve_options((), {"weight": 1.0})


def test_an_error_names_a_few_unknown_options_and_quotes_a_short_prefix_of_a_value():
    """A request may send a million names or a megabyte value: the message names three and says how many more,
    and quotes 40 characters of a value with its length (issue 50)."""
    with pytest.raises(InvalidRequest) as e:
        resolve_options((WEIGHT,), {f"o{i:06d}": 0 for i in range(100_000)})
    assert str(e.value) == "model has no option 'o000000', 'o000001', 'o000002' and 99997 more; its options: weight"
    with pytest.raises(InvalidRequest) as e:
        resolve_options((STYLE,), {"style": "x" * (1 << 20)})
    assert len(str(e.value)) < 200 and "(1048576 characters)" in str(e.value)


def test_text_settings_are_parsed_by_type():
    got = parse_settings((WEIGHT, STEPS, FAST, STYLE), ["weight=0.25", "steps=3", "fast=yes", "style=bright"])
    assert got == {"weight": 0.25, "steps": 3, "fast": True, "style": "bright"}
    for bad in (["weight"], ["weight=lots"], ["steps=2.5"], ["fast=maybe"], ["nope=1"]):
        with pytest.raises(InvalidRequest):
            parse_settings((WEIGHT, STEPS, FAST, STYLE), bad)


def test_declarations_are_checked():
    with pytest.raises(InvalidRequest, match="default"):
        RequestOption("weight", "float", 3.0, maximum=2.0)
    with pytest.raises(InvalidRequest, match="name"):
        RequestOption("Weight", "float", 1.0)
    with pytest.raises(InvalidRequest, match="type"):
        RequestOption("weight", "complex", 1.0)
    with pytest.raises(InvalidRequest, match="twice"):
        Capabilities(modes={"preset"}, sample_rate=16000, options=(WEIGHT, WEIGHT))


def test_the_schema_states_type_range_default_and_help():
    assert WEIGHT.schema() == {"type": "number", "default": 0.5, "description": "how much", "minimum": 0.0,
                               "maximum": 2.0}
    assert STYLE.schema()["enum"] == ["plain", "bright"]
    assert "weight: float in [0, 2], default 0.5; how much" == WEIGHT.describe()


def test_a_request_takes_a_mapping_of_options():
    assert SynthesisRequest("hi", options={"weight": 1.0}).options == {"weight": 1.0}
    with pytest.raises(InvalidRequest, match="mapping"):
        SynthesisRequest("hi", options=[("weight", 1.0)])
