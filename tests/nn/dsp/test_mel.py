"""Whisper log-mel (speech tokenizer input) and Matcha mel (prompt mel) against the recorded references.

Why tolerances and not torch.equal: both are op-for-op the upstream formula, and the float32
Slaney filterbank we compute equals Whisper's shipped mel_filters.npz bit for bit; but the
references were recorded where MKL ran its Intel code paths, and MKL's FFT rounds differently on
other CPUs (AMD here). Forcing MKL's Intel path on this machine (an LD_PRELOAD shim answering
`mkl_serv_intel_cpu_true() = 1`) makes every Whisper log-mel and every CosyVoice 1 mel reference
bit-identical (max 0.0); the 1920-point FFT of the CosyVoice 2/3 configs still differs by one
float32 ulp of the log (4.8e-7) at four bins (240, 384, 480, 720: n/8, n/5, n/4, 3n/8), a
twiddle-factor detail of the recording CPU's MKL build. What remains is FFT rounding, not a
formula difference. FFT noise is relative to a frame's energy, so the bounds are split between
bands near their frame's strongest band and deep ones. Without the shim, measured over the five
public clips:

- Whisper (80 and 128 bins, output (log10 + 4) / 4): max 2.2e-6 within 1 (4 decades of power)
  of the frame peak, 3.9e-5 deeper; mean 1.8e-7. The reference is as far from a float64
  evaluation of the formula (up to 2.0e-5) as we are (up to 2.7e-5).
- Matcha (natural log of magnitude): max 3.2e-5 within 8 of the frame peak; 5.1e-4 deeper, all
  of it in the 8-12 kHz bands of CosyVoice 3's fmax=None config on audio resampled from 16 kHz
  (empty bands, magnitudes at the sqrt(1e-9) floor); mean 1.9e-6.

Bounds: near the peak the tolerances facts.json suggests (Whisper 1e-5, Matcha 1e-4); deep bands
about 2.5x the measured maximum (Whisper 1e-4, Matcha 1e-3); mean 1e-6 (Whisper), 1e-5 (Matcha).
"""

import re
from pathlib import Path

import pytest
import torch

from mizuoto.nn.dsp import MatchaMelConfig, matcha_mel, slaney_mel_filters, whisper_log_mel
from mizuoto.runtime.errors import InvalidRequest, ModelLoadError
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.fixtures import fixture_path

PROMPT_MEL_RATE = 24000  # every CosyVoice version computes its prompt mel on 24 kHz audio


WHISPER_TOLERANCE = dict(bin_dim=-2, depth=1.0, near=1e-5, deep=1e-4, mean=1e-6)
MATCHA_TOLERANCE = dict(bin_dim=-2, depth=8.0, near=1e-4, deep=1e-3, mean=1e-5)


def _yaml_mel_configs() -> dict[Path, MatchaMelConfig]:
    paths = sorted(fixture_path("cosyvoice").glob("*/model/*.yaml"))
    assert paths, "no model yaml under fixtures/cosyvoice/*/model/"
    return {p: MatchaMelConfig.from_kwargs(load_hyperyaml(p)["feat_extractor"].kwargs) for p in paths}


@pytest.fixture(scope="module")
def mel_configs(manifest) -> dict[str, MatchaMelConfig]:
    """The manifest's mel config names, each resolved to the model yaml whose feat_extractor it is."""
    from_yaml = _yaml_mel_configs()
    named = {}
    for key, kwargs in manifest["mel_configs"].items():
        wanted = MatchaMelConfig.from_kwargs(kwargs)
        assert wanted in from_yaml.values(), f"mel config {key} matches no model yaml's feat_extractor"
        named[key] = wanted
    assert set(named.values()) == set(from_yaml.values()), "a model yaml's feat_extractor has no reference"
    return named


@pytest.mark.parametrize("n_mels", [80, 128])
def test_whisper_log_mel_matches_reference(clip, speech_at, refs, n_mels, check_log_spectrum):
    speech = speech_at(16000)
    ours = whisper_log_mel(speech[None], n_mels)
    assert ours.shape == (1, n_mels, speech.shape[0] // 160)
    ref = refs[f"whisper_logmel{n_mels}"]
    check_log_spectrum(ours, ref, what=f"{clip} whisper_logmel{n_mels}", **WHISPER_TOLERANCE)


def test_matcha_mel_matches_reference_for_every_model_config(
    clip, clip_info, speech_at, refs, mel_configs, parse_rate, check_log_spectrum
):
    """Every recorded `mel_<config>[_on<rate>|_native...]`: the yaml's feat_extractor on that audio."""
    checked = 0
    for key, config in mel_configs.items():
        for name in refs:
            m = re.fullmatch(rf"mel_{key}(?:_on(\w+)|_native\w*)?", name)
            if not m:
                continue
            if name.startswith(f"mel_{key}_native"):
                rate = clip_info["sample_rate"]
            else:
                rate = parse_rate(m.group(1)) if m.group(1) else PROMPT_MEL_RATE
            ours = matcha_mel(speech_at(rate)[None], config)
            check_log_spectrum(ours, refs[name], what=f"{clip} {name}", **MATCHA_TOLERANCE)
            checked += 1
    assert checked >= len(mel_configs), f"{clip}: a mel config has no reference"


def test_configs_with_equal_fmax_do_not_share_a_filterbank(manifest, mel_configs):
    """Upstream caches the basis by fmax only; ours is keyed by the whole config, in any call order."""
    configs = list(mel_configs.values())
    same_fmax = [(a, b) for a in configs for b in configs if a != b and a.fmax == b.fmax]
    assert same_fmax, "fixture configs no longer share an fmax; this test needs such a pair"
    x = torch.randn(1, 24000, generator=torch.Generator().manual_seed(0)) * 0.1
    for a, b in same_fmax:
        first = matcha_mel(x, a)
        matcha_mel(x, b)
        assert torch.equal(matcha_mel(x, a), first)
        assert slaney_mel_filters(a.sampling_rate, a.n_fft, a.num_mels, a.fmin, a.fmax).shape[1] == a.n_fft // 2 + 1


def test_slaney_filterbank_shape_and_norm():
    """Slaney-normalized triangles: each filter's area is about 1 in Hz (2 / band width peak)."""
    fb = slaney_mel_filters(24000, 1920, 80, 0, None)
    assert fb.shape == (80, 961) and fb.dtype == torch.float32 and torch.all(fb >= 0)
    area = fb.sum(dim=1) * (24000 / 1920)
    assert torch.allclose(area, torch.ones(80), atol=0.1)


def test_bad_config_and_audio_are_rejected():
    with pytest.raises(ModelLoadError, match="incomplete"):
        MatchaMelConfig.from_kwargs({"n_fft": 1024, "num_mels": 80})
    with pytest.raises(ModelLoadError, match="unknown"):
        MatchaMelConfig.from_kwargs({"n_fft": 1024, "num_mels": 80, "sampling_rate": 22050, "hop_size": 256,
                                     "win_size": 1024, "fmin": 0, "fmax": 8000, "center": False, "power": 2})
    config = MatchaMelConfig(n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920)
    with pytest.raises(InvalidRequest, match="too short"):
        matcha_mel(torch.zeros(1, 100), config)
    x = torch.randn(2, 4800, generator=torch.Generator().manual_seed(0)) * 0.1
    # Unbatched input gives the batched row (MKL may round a batch of one differently: allclose).
    assert torch.allclose(matcha_mel(x[1], config), matcha_mel(x, config)[1], atol=1e-5)
    with pytest.raises(InvalidRequest, match="empty"):
        whisper_log_mel(torch.zeros(1, 0), 128)
