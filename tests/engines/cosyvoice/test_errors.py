"""Bad directories and bad requests end in one clear MizuotoError naming the offending thing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.errors import AudioError, InvalidRequest, MizuotoError, ModelLoadError

TEXT = "Hello world."
REF_TEXT = "A short reference sentence."


def _copy(model: Path, dest: Path) -> Path:
    """A real copy of an assembled dir (its files may then be changed)."""
    shutil.copytree(model, dest, symlinks=False)
    return dest


def _noise(seconds: float, rate: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(0)
    return (0.1 * torch.randn(int(seconds * rate), generator=g), rate)


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and text
    return text


def test_missing_flow_pt(assembled, variant_dir, tmp_path):
    model = _copy(assembled[variant_dir], tmp_path / "m")
    (model / "flow.pt").unlink()
    with pytest.raises(ModelLoadError, match=r"flow\.pt") as e:
        Runtime().load(model)
    _one_line(e.value)


def test_truncated_flow_pt(assembled, variant_dir, tmp_path):
    model = _copy(assembled[variant_dir], tmp_path / "m")
    data = (model / "flow.pt").read_bytes()
    (model / "flow.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"flow\.pt") as e:
        Runtime().load(model)
    _one_line(e.value)


def test_yaml_of_an_unknown_variant(assembled, variant_dir, tmp_path):
    model = _copy(assembled[variant_dir], tmp_path / "m")
    yaml = next(model.glob("cosyvoice*.yaml"))
    text = yaml.read_text(encoding="utf-8")
    # rename the LM class in its `!new:` tag: not a class this generation is made of
    renamed, n = re.subn(r"^(llm: !new:[\w.]+\.)(\w+)", r"\1FancyNewLM", text, count=1, flags=re.M)
    assert n == 1
    yaml.write_text(renamed, encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"FancyNewLM.*unknown variant") as e:
        Runtime().load(model)
    _one_line(e.value)


def test_two_yamls_are_refused(assembled, variant_dir, tmp_path):
    model = _copy(assembled[variant_dir], tmp_path / "m")
    yaml = next(model.glob("cosyvoice*.yaml"))
    other = "cosyvoice3.yaml" if yaml.name != "cosyvoice3.yaml" else "cosyvoice2.yaml"
    shutil.copy(yaml, model / other)
    with pytest.raises(ModelLoadError, match="several CosyVoice yamls"):
        Runtime().load(model)


def test_reference_over_30_seconds(runtime, variant_dir):
    rt, names = runtime
    name = names[variant_dir]
    long_ref = _noise(31, 16000)
    with pytest.raises(AudioError, match=r"31\.0 s; at most 30 s"):
        rt.add_voice(name, "too-long", long_ref, REF_TEXT)
    with pytest.raises(AudioError, match="at most 30 s"):
        list(rt.synthesize(name, SynthesisRequest(TEXT, voice=Reference(long_ref, REF_TEXT), seed=1)))


def test_8khz_reference(runtime, variant_dir):
    rt, names = runtime
    with pytest.raises(AudioError, match="8000 Hz; at least 16000 Hz"):
        list(rt.synthesize(names[variant_dir], SynthesisRequest(TEXT, voice=Reference(_noise(2, 8000)), seed=1)))


def test_instruct_on_a_model_without_instruct(assembled, preset_dir, clip, tmp_path):
    """A CosyVoice 1 base dir (no spk2info.pt) has no instruct; v1 instruct needs a preset speaker."""
    rt = Runtime()
    full = rt.load(assembled[preset_dir])
    with pytest.raises(InvalidRequest, match="needs a preset voice"):
        list(rt.synthesize(full, SynthesisRequest(TEXT, voice=Reference(str(clip)), instruct="Speak slowly.")))
    base = _copy(assembled[preset_dir], tmp_path / "base")
    (base / "spk2info.pt").unlink()
    name = rt.load(base)
    assert "instruct" not in rt.model(name).capabilities.modes
    with pytest.raises(InvalidRequest, match="does not support mode 'instruct'"):
        rt.synthesize(name, SynthesisRequest(TEXT, voice=Reference(str(clip)), instruct="Speak slowly."))


def test_empty_and_punctuation_only_text(runtime, variant_dir, clip):
    rt, names = runtime
    with pytest.raises(InvalidRequest, match="text is empty"):
        SynthesisRequest("   ", voice=Reference(str(clip)))
    # upstream drops segments of punctuation and symbols only (a space makes a segment speakable)
    for text in ("。！？", "?!...", "——"):
        with pytest.raises(MizuotoError, match="nothing to speak") as e:
            list(rt.synthesize(names[variant_dir], SynthesisRequest(text, voice=Reference(str(clip)), seed=1)))
        _one_line(e.value)


def test_speed_in_streaming(runtime, variant_dir, clip):
    rt, names = runtime
    request = SynthesisRequest(TEXT, voice=Reference(str(clip)), speed=1.5, stream=True)
    with pytest.raises(InvalidRequest, match="speed can only be changed without streaming"):
        list(rt.synthesize(names[variant_dir], request))


def test_unknown_voice_and_preset_misuse(runtime, variant_dir, clip):
    rt, names = runtime
    name = names[variant_dir]
    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'"):
        rt.synthesize(name, SynthesisRequest(TEXT, voice="nobody"))
    with pytest.raises(InvalidRequest, match="preset voice id"):
        SynthesisRequest(TEXT, mode="preset", voice=Reference(str(clip)))
