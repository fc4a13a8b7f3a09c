"""Mimi's encoder half (mizuoto.nn.codecs.mimi): padding arithmetic, causality, config reading.

Equality with transformers' Mimi is checked by the Qwen3-TTS plugin against upstream's recording
(plugins/mizuoto-qwen3tts/tests/test_codec_encoder.py); these check the block on its own sizes.
"""

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto.nn.codecs.mimi import MimiConv1d, MimiEncoder, MimiEncoderConfig

CONFIG = {  # a transformers MimiConfig dict, tiny
    "audio_channels": 1, "num_filters": 2, "hidden_size": 8, "kernel_size": 7, "last_kernel_size": 3,
    "residual_kernel_size": 3, "num_residual_layers": 1, "dilation_growth_rate": 2, "compress": 2,
    "upsampling_ratios": [4, 2], "use_causal_conv": True, "pad_mode": "constant", "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 16, "norm_eps": 1e-5,
    "rope_theta": 10000.0, "codebook_size": 16, "codebook_dim": 4, "vector_quantization_hidden_dimension": 4,
    "num_quantizers": 4, "num_semantic_quantizers": 1, "sampling_rate": 800, "hidden_act": "gelu",
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("stride", [1, 2, 5])
def test_a_conv_gives_ceil_length_over_stride_frames(causal, stride):
    conv = MimiConv1d(1, 1, 2 * stride + 1, stride=stride, causal=causal)
    for length in range(1, 23):
        assert conv(torch.zeros(1, 1, length)).shape[-1] == -(-length // stride)


def test_the_embeddings_of_a_frame_do_not_depend_on_later_samples():
    torch.manual_seed(0)
    encoder = MimiEncoder(MimiEncoderConfig.from_dict(CONFIG)).eval()
    for p in encoder.parameters():
        p.data.normal_(0, 0.3)
    hop = 4 * 2 * 2  # the ratios, then the downsampling stride
    wav = torch.randn(1, 1, 10 * hop)
    changed = wav.clone()
    changed[..., 6 * hop:] += 1.0
    with torch.inference_mode():
        a, b = encoder.embed(wav), encoder.embed(changed)
    assert a.shape == (1, 8, 10)
    assert torch.equal(a[..., :6], b[..., :6]) and not torch.equal(a[..., 6:], b[..., 6:])


def test_the_config_decides_the_downsampling_and_refuses_what_it_cannot_reproduce():
    assert MimiEncoderConfig.from_dict(CONFIG).downsample_kernel == 4  # 100 Hz convolutions -> 50 Hz codes
    assert MimiEncoderConfig.from_dict(CONFIG | {"_frame_rate": 100}).downsample_kernel == 0
    with pytest.raises(ModelLoadError, match="lacks 'num_filters'"):
        MimiEncoderConfig.from_dict({k: v for k, v in CONFIG.items() if k != "num_filters"})
    with pytest.raises(ModelLoadError, match="rope_scaling"):
        MimiEncoderConfig.from_dict(CONFIG | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
