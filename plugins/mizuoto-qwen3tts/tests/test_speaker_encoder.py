"""The speaker encoder (ECAPA-TDNN of mizuoto.nn) and its mel give upstream's x-vector of each clone case's clip.

The network is checked on the recorded mel as well as on our own, so a mel difference cannot hide
(or cancel) one of the network's.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mizuoto.errors import ModelLoadError
from mizuoto_qwen3tts.speaker_encoder import PREFIX, load_speaker_encoder, speaker_mel
from mizuoto_qwen3tts.weights import CONFIG, WEIGHTS

CLONE_KEYS = ("ref_wav_24k", "speaker_mel", "speaker_embedding")


@torch.inference_mode()
def test_the_clips_mel_and_x_vector_are_upstreams(case):
    recorded = case.tensors()
    encoder = load_speaker_encoder(case.model_dir)
    if "speaker_mel" not in recorded:  # no clip: upstream embedded nothing, and a model without an encoder has none
        assert "ref_audio" not in case.kwargs
        assert not [key for key in CLONE_KEYS if key in recorded]
        if json.loads((case.model_dir / CONFIG).read_text(encoding="utf-8")).get("tts_model_type") != "base":
            assert encoder is None
        return
    assert encoder is not None, f"{case.name}: a clone case whose model has no speaker encoder"
    wav, mel, xvec = (recorded[key] for key in CLONE_KEYS)
    ours_mel = speaker_mel(wav)
    case.cpu.assert_equal(ours_mel, mel, "speaker_mel", f"{case.name} speaker_mel", log=True)
    case.cpu.assert_equal(encoder.embed_mel(mel), xvec, "speaker_embedding",
                          f"{case.name} speaker_embedding of the recorded mel")
    case.cpu.assert_equal(encoder.embed(wav), xvec, "speaker_embedding",
                          f"{case.name} speaker_embedding of the recorded wav")


def _models(any_case) -> list[Path]:
    """Every model dir the tree's cases use."""
    cases_dir = any_case.path.parent  # <tree>/cases/<case>; case.json paths are relative to <tree>
    specs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(cases_dir.glob("*/case.json"))]
    return sorted({cases_dir.parent / s["model_dir"] for s in specs})


def _type(model_dir: Path) -> str | None:
    return json.loads((model_dir / CONFIG).read_text(encoding="utf-8")).get("tts_model_type")


@pytest.fixture
def base_model_dir(any_case) -> Path:
    """A model dir of the tree with a speaker encoder (tts_model_type base)."""
    found = [d for d in _models(any_case) if _type(d) == "base"]
    assert found, "the fixture tree has no base model: nothing to check the speaker encoder's loading on"
    return found[0]


def test_models_other_than_base_have_no_speaker_encoder(any_case):
    others = [d for d in _models(any_case) if _type(d) != "base"]
    for model_dir in others:
        assert load_speaker_encoder(model_dir) is None, model_dir
    for model_dir in set(_models(any_case)) - set(others):
        assert load_speaker_encoder(model_dir) is not None, model_dir


def _copy(model_dir: Path, target: Path, drop: str | None = None, edit=None) -> Path:
    """A copy of a model dir's config and weights, one weight dropped and the config edited."""
    target.mkdir()
    config = json.loads((model_dir / CONFIG).read_text(encoding="utf-8"))
    if edit:
        edit(config)
    (target / CONFIG).write_text(json.dumps(config), encoding="utf-8")
    if drop is None:
        shutil.copy(model_dir / WEIGHTS, target / WEIGHTS)
    else:
        weights = load_file(str(model_dir / WEIGHTS))
        del weights[drop]
        save_file(weights, str(target / WEIGHTS))
    return target


def test_a_missing_speaker_encoder_weight_is_refused_naming_it(base_model_dir, tmp_path):
    keys = sorted(k for k in load_file(str(base_model_dir / WEIGHTS)) if k.startswith(PREFIX))
    assert keys, f"{base_model_dir}: a base model without {PREFIX} weights"
    dropped = keys[len(keys) // 2]
    name = dropped[len(PREFIX):]
    with pytest.raises(ModelLoadError, match=rf"missing \['{name}'\]"):
        load_speaker_encoder(_copy(base_model_dir, tmp_path / "model", drop=dropped))


def test_a_speaker_encoder_weight_of_another_shape_is_refused_naming_it(base_model_dir, tmp_path):
    def wider(config):
        config["speaker_encoder_config"]["enc_se_channels"] *= 2
    with pytest.raises(ModelLoadError, match=r"speaker_encoder\.blocks\.\d+\.se_block\.conv\d\.\w+ is \("):
        load_speaker_encoder(_copy(base_model_dir, tmp_path / "model", edit=wider))


def test_a_base_config_without_encoder_sizes_is_refused(base_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=r"speaker_encoder_config lacks \['enc_dim'\]"):
        load_speaker_encoder(_copy(base_model_dir, tmp_path / "model",
                                   edit=lambda c: c["speaker_encoder_config"].pop("enc_dim")))
