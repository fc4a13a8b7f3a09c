"""Frontend fixture access for the DSP tests: clips come from frontend/manifest.json, never by name."""

import json
import re

import pytest
from safetensors.torch import load_file

from mizuoto.testing.fixtures import fixture_path


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


def _check_log_spectrum(ours, ref, bin_dim, depth, near, deep, mean, what, level=None):
    """Log-spectrum parity with FFT-rounding tolerances: `near` for bins within `depth` (log units)
    of their frame's strongest bin in `level` (default ref), `deep` for weaker ones (FFT noise is
    relative to the frame's energy, so deep bins carry more of it), and a bound on the mean error."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    err = (ours - ref).abs()
    level = ref if level is None else level
    is_near = level >= level.amax(dim=bin_dim, keepdim=True) - depth
    assert err[is_near].max().item() <= near, f"{what}: max abs {err[is_near].max().item():.3g} near the frame peak"
    if (~is_near).any():
        assert err[~is_near].max().item() <= deep, f"{what}: max abs {err[~is_near].max().item():.3g} in deep bins"
    assert err.mean().item() <= mean, f"{what}: mean abs {err.mean().item():.3g}"


@pytest.fixture(scope="session")
def check_log_spectrum():
    return _check_log_spectrum
