"""An error's request field is data it carries (MizuotoError.field), mapped to the API's names; never guessed from
the words of its message."""

import pytest

from mizuoto.errors import AudioError, InvalidRequest
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.server.errors import PARAMS, from_exception


def test_the_param_is_the_errors_field_in_the_apis_names_and_none_without_one():
    misleading = InvalidRequest("this mentions a voice, a speed and some text", field="instruct")
    assert from_exception(misleading).param == "instructions"
    assert from_exception(InvalidRequest("the voice is unknown")).param is None  # no field: no guess
    assert from_exception(AudioError("bad clip", field="reference")).param == "ref_audio"
    assert from_exception(InvalidRequest("x", field="voice"), "model").param == "model"  # the caller's wins


@pytest.mark.parametrize("fields, field", [
    (dict(text="hi", speed=9.0), "speed"),
    (dict(text="hi", seed=-1), "seed"),
    (dict(text="", voice="v"), "text"),
    (dict(text="hi", voice=""), "voice"),
    (dict(text="hi", mode="sing"), "mode"),
    (dict(text="hi", mode="instruct", voice="v"), "instruct"),
])
def test_a_requests_own_checks_name_their_field(fields, field):
    with pytest.raises(InvalidRequest) as caught:
        SynthesisRequest(**fields)
    assert caught.value.field == field and field in PARAMS


def test_a_bad_reference_names_the_reference():
    with pytest.raises(AudioError) as caught:
        Reference(("not audio", 16000))
    assert caught.value.field == "reference"
