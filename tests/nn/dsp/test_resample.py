"""Sinc resampling equals torchaudio's Resample (as upstream's load_wav uses it) sample for sample.

Sample for sample on the CPU class the references were recorded on; on another class within the
spread upstream's own front end shows between the recorded classes (mizuoto.testing.cpu_recordings,
the full-pipeline kind `seg.<i>.input.prompt_speech_feat`).
"""

import math

import pytest
import torch

from mizuoto.nn.dsp import resample, resampled_length
from mizuoto.nn.dsp.resample import _kernel
from mizuoto.errors import InvalidRequest
from mizuoto.testing.cpu_recordings import FRONT_END, tree_comparison



def test_resample_matches_reference_exactly(clip, clip_info, refs, parse_rate):
    """Every recorded `resampled_<rate>` of the clip, bit for bit (also the clips shorter than 1.3 s)."""
    rate = clip_info["sample_rate"]
    names = [n for n in refs if n.startswith("resampled_")]
    assert names, f"{clip}: no resampling reference"
    for name in names:
        target = parse_rate(name[len("resampled_"):])
        ours = resample(refs["audio"][None], rate, target)[0]
        assert ours.shape == refs[name].shape, name
        tree_comparison("frontend").assert_equal(ours, refs[name], FRONT_END, f"{clip} {name}")


@pytest.mark.parametrize("orig,new,n", [(16000, 24000, 16001), (24000, 16000, 1001), (22050, 24000, 777), (48000, 22050, 10)])
def test_output_length_is_ceil(orig, new, n):
    """Length ceil(N * new / orig) for any N, batch dims kept."""
    x = torch.randn(2, 3, n)
    y = resample(x, orig, new)
    assert y.shape == (2, 3, math.ceil(n * new / orig)) == (2, 3, resampled_length(n, orig, new))


@pytest.mark.parametrize("orig,new,n", [(22050, 16000, 5000), (16000, 24000, 16001), (48000, 22050, 777)])
def test_batch_rows_equal_single_rows(orig, new, n):
    """Channels/batches are resampled independently, bit for bit (one conv1d call per row)."""
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
    y = resample(x, orig, new)
    for i in range(3):
        assert torch.equal(y[i], resample(x[i], orig, new)), f"row {i}"


def test_same_rate_is_identity_and_kernel_is_cached():
    """No work when rates match; the kernel of a rate pair is built once (per dtype/device)."""
    x = torch.randn(100)
    assert resample(x, 16000, 16000) is x
    _kernel.cache_clear()
    resample(torch.randn(1, 1000), 16000, 24000)
    resample(torch.randn(1, 2000), 32000, 48000)  # same reduced pair 2 -> 3
    info = _kernel.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_bad_rates_are_rejected():
    with pytest.raises(InvalidRequest):
        resample(torch.randn(10), 0, 16000)
    with pytest.raises(InvalidRequest):
        resample(torch.randn(10), 16000.5, 16000)
    with pytest.raises(InvalidRequest):
        resample(torch.arange(10), 16000, 24000)
