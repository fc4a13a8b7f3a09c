"""Kaldi fbank (CAM++ input) against torchaudio.compliance.kaldi.fbank as upstream calls it, and its CMN.

Bit-exact: the formula is torchaudio's op for op, and the suite runs MKL on the recording
machine's code paths (the `mizuoto.testing.mkl_intel` plugin), so every fbank and CMN
reference is `torch.equal`. Off those paths MKL's FFT rounds differently (measured on an AMD
EPYC: up to 2.6e-3 in bands emptied by DC removal and pre-emphasis); that is not a formula
difference, and the test then fails, naming the cause.

The references were recorded on one CPU class (mizuoto.testing.cpu_recordings): there they are
`torch.equal`; on a class they were not recorded on, as energies (near-empty bands above), within
the spread upstream's own front end shows between the recorded classes (the full-pipeline kind
`seg.<i>.input.prompt_speech_feat`, a fraction of the largest value).
"""

import pytest
import torch

from mizuoto.nn.dsp import kaldi_fbank, mean_normalize
from mizuoto.errors import InvalidRequest
from mizuoto.testing.cpu_recordings import FRONT_END, tree_comparison



def test_fbank_and_cmn_equal_reference(clip, speech_at, refs, intel_mkl):
    speech = speech_at(16000)
    feats = kaldi_fbank(speech[None], num_mel_bins=80, sample_frequency=16000)
    assert feats.shape == (1 + (speech.shape[0] - 400) // 160, 80)
    for name, ours in (("kaldi_fbank", feats), ("kaldi_fbank_cmn", mean_normalize(feats))):
        ref = refs[name]
        assert ours.shape == ref.shape, f"{clip} {name}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
        tree_comparison("frontend").assert_equal(ours, ref, FRONT_END, f"{clip} {name}", log=True)


def test_cmn_is_exact(clip, refs):
    """The mean normalization alone, applied to the recorded fbank, is bit-identical."""
    assert torch.equal(mean_normalize(refs["kaldi_fbank"]), refs["kaldi_fbank_cmn"])


def test_mel_banks_follow_kaldi():
    """Triangles on 1127 ln(1 + f/700) from 20 Hz to Nyquist, peak 1, last FFT column unused."""
    from mizuoto.nn.dsp.kaldi import kaldi_mel_banks

    banks = kaldi_mel_banks(80, 512, 16000.0, 20.0, 0.0)
    assert banks.shape == (80, 257) and banks.dtype == torch.float32
    assert torch.all(banks[:, -1] == 0) and torch.all(banks >= 0)
    assert torch.all(banks.max(dim=1).values > 0)  # no empty band
    assert banks[:, 0].sum() == 0  # 0 Hz lies below the 20 Hz low edge


def test_short_or_bad_audio_is_rejected():
    with pytest.raises(InvalidRequest, match="shorter than one"):
        kaldi_fbank(torch.zeros(399))
    with pytest.raises(InvalidRequest, match="mono"):
        kaldi_fbank(torch.zeros(2, 1000))
    assert kaldi_fbank(torch.zeros(400)).shape == (1, 80)
