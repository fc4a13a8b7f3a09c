"""Frontend fixture access for the DSP tests (clips from frontend/manifest.json, never by name) and the MKL guard."""

import json
import re

import pytest
from safetensors.torch import load_file

from mizuoto.testing.fixtures import fixture_path
from mizuoto.testing.mkl_intel import require_intel_path

def _manifest() -> dict:
    with open(fixture_path("frontend", "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def pytest_generate_tests(metafunc):
    if "clip" in metafunc.fixturenames:
        clips = sorted(_manifest()["clips"])
        assert clips, "frontend/manifest.json lists no clips"
        metafunc.parametrize("clip", clips)


@pytest.fixture(scope="session")
def manifest() -> dict:
    return _manifest()


@pytest.fixture
def clip_info(manifest, clip) -> dict:
    return manifest["clips"][clip]


@pytest.fixture
def wav_path(clip_info):
    return fixture_path("frontend", clip_info["wav"])


@pytest.fixture
def refs(clip) -> dict:
    return load_file(str(fixture_path("frontend", "refs", f"{clip}.safetensors")))


def rate_tag(rate: int) -> str:
    """The suffix the references use for a rate: 16000 -> "16k", 22050 -> "22050"."""
    return f"{rate // 1000}k" if rate % 1000 == 0 else str(rate)


def parse_rate_tag(tag: str) -> int:
    """Inverse of rate_tag: "24k" -> 24000, "22050" -> 22050."""
    m = re.fullmatch(r"(\d+)(k?)", tag)
    assert m, f"not a rate tag: {tag!r}"
    return int(m.group(1)) * (1000 if m.group(2) else 1)


@pytest.fixture
def speech_at(refs, clip_info):
    """Upstream's input at a rate: the clip itself at its own rate, else the recorded resampling."""

    def get(rate: int):
        if rate == clip_info["sample_rate"]:
            return refs["audio"]
        name = f"resampled_{rate_tag(rate)}"
        assert name in refs, f"reference {name} missing for a clip at {clip_info['sample_rate']} Hz"
        return refs[name]

    return get


@pytest.fixture(scope="session")
def parse_rate():
    return parse_rate_tag


@pytest.fixture
def intel_mkl() -> None:
    """Fail, not skip, an exact parity check where MKL runs other kernels than the recording machine's."""
    require_intel_path()
