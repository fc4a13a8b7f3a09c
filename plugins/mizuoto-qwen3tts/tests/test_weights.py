"""Reading a model dir's weights: every key and shape must match what its config makes, or the load is refused."""

import json
import shutil

import pytest

from mizuoto.errors import ModelLoadError
from mizuoto_qwen3tts.code_predictor import load_code_predictor
from mizuoto_qwen3tts.talker import load_talker
from mizuoto_qwen3tts.weights import CONFIG, WEIGHTS


def _model_dir(case, tmp_path, edit):
    """A copy of the case's model dir's config and weights, its config edited by `edit(config)`."""
    target = tmp_path / "model"
    target.mkdir()
    shutil.copy(case.model_dir / WEIGHTS, target / WEIGHTS)
    config = json.loads((case.model_dir / CONFIG).read_text(encoding="utf-8"))
    edit(config)
    (target / CONFIG).write_text(json.dumps(config), encoding="utf-8")
    return target


def test_a_config_with_more_layers_than_the_weights_is_refused_naming_the_missing_keys(any_case, tmp_path):
    case = any_case
    layers = lambda c: c["talker_config"].update(num_hidden_layers=c["talker_config"]["num_hidden_layers"] + 1)  # noqa: E731
    with pytest.raises(ModelLoadError, match=r"missing \['decoder\.layers\.\d+\."):
        load_talker(_model_dir(case, tmp_path, layers))


def test_a_weight_of_another_shape_is_refused_naming_it(any_case, tmp_path):
    case = any_case
    wider = lambda c: c["talker_config"]["code_predictor_config"].update(  # noqa: E731
        intermediate_size=c["talker_config"]["code_predictor_config"]["intermediate_size"] * 2)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight is \(\d+, \d+\), the config makes it"):
        load_code_predictor(_model_dir(case, tmp_path, wider))


def test_a_dir_without_a_talker_config_is_no_qwen3_tts_model(any_case, tmp_path):
    with pytest.raises(ModelLoadError, match="no talker_config"):
        load_talker(_model_dir(any_case, tmp_path, lambda c: c.pop("talker_config")))
