"""HiFT generators built from sizes: output lengths, streaming slices, F0 predictor placement."""

import torch

from mizuoto.nn.vocoders import f0 as f0_module
from mizuoto.nn.vocoders.f0 import CausalConvRNNF0Predictor, ConvRNNF0Predictor, f0_device, supports_float64
from mizuoto.nn.vocoders.hift import CausalHiFTGenerator, HiFTGenerator

SIZES = dict(in_channels=20, base_channels=8, nb_harmonics=8, nsf_alpha=0.1, nsf_sigma=0.003,
             nsf_voiced_threshold=10, upsample_kernel_sizes=[16, 11, 7], istft_params={"n_fft": 16, "hop_len": 4},
             resblock_kernel_sizes=[3, 5], resblock_dilation_sizes=[[1, 3], [1, 3]],
             source_resblock_kernel_sizes=[7, 7, 11], source_resblock_dilation_sizes=[[1, 3], [1, 3], [1, 3]],
             lrelu_slope=0.1, audio_limit=0.99, upsample_rates=[8, 5, 3])


class _Noise:
    def rand_ini(self):
        return torch.zeros(1, 9)

    def sine_waves(self, length):
        return torch.rand(1, length, 9, generator=torch.Generator().manual_seed(0))


def _causal() -> CausalHiFTGenerator:
    torch.manual_seed(0)
    f0 = CausalConvRNNF0Predictor(1, 20, 8).double()
    model = CausalHiFTGenerator(**SIZES, sampling_rate=24000, conv_pre_look_right=4, f0_predictor=f0, noise=_Noise())
    with torch.no_grad():
        model.f0_predictor.classifier.bias.fill_(180.0)  # voiced
    return model.eval()


def test_non_causal_lengths_and_cache_source():
    torch.manual_seed(0)
    model = HiFTGenerator(**SIZES, sampling_rate=24000, f0_predictor=ConvRNNF0Predictor(1, 20, 8)).eval()
    mel = torch.randn(1, 20, 12)
    speech, source = model.inference(mel, generator=torch.Generator().manual_seed(1))
    assert speech.shape == (1, 12 * 480) and source.shape == (1, 1, 12 * 480)
    assert speech.abs().max() <= 0.99
    cache = torch.full((1, 1, 100), 0.25)
    _, source2 = model.inference(mel, cache, generator=torch.Generator().manual_seed(1))
    assert torch.equal(source2[:, :, :100], cache) and torch.equal(source2[:, :, 100:], source[:, :, 100:])


def test_sampling_rate_picks_the_sine_generator():
    f0 = ConvRNNF0Predictor(1, 20, 8)
    v1 = HiFTGenerator(**{**SIZES, "upsample_rates": [8, 8], "upsample_kernel_sizes": [16, 16],
                          "source_resblock_kernel_sizes": [7, 11]}, sampling_rate=22050, f0_predictor=f0)
    v2 = HiFTGenerator(**SIZES, sampling_rate=24000, f0_predictor=f0)
    assert type(v1.m_source.l_sin_gen).__name__ == "SineGen"
    assert type(v2.m_source.l_sin_gen).__name__ == "SineGen2"


def test_causal_streaming_is_a_prefix_of_the_final_run():
    model = _causal()
    mel = torch.randn(1, 20, 30, generator=torch.Generator().manual_seed(3))
    full, _ = model.inference(mel)
    part, source = model.inference(mel[:, :, :20], finalize=False)
    # Without finalize the F0 look-ahead (3 frames) and conv_pre's (4) are held back, and one
    # more frame of samples whose iSTFT overlap is not complete yet.
    assert source.shape[2] == (20 - 3) * 480 and part.shape[1] == (20 - 3 - 4 - 1) * 480
    assert torch.allclose(part, full[:, :part.shape[1]], atol=1e-5)


def test_supports_float64():
    assert supports_float64("cpu") and supports_float64(torch.device("cuda", 0))
    assert not supports_float64("mps") and not supports_float64("xpu")
    assert f0_device("mps") == torch.device("cpu") and f0_device("cpu") == torch.device("cpu")


def test_f0_predictor_stays_on_cpu_where_float64_is_missing(monkeypatch):
    model = _causal()
    # Pretend the meta device lacks float64: everything moves but the F0 predictor.
    monkeypatch.setattr(f0_module, "_NO_FLOAT64", frozenset({"meta"}))
    assert model.fixed_modules("meta") == ["f0_predictor"]
    model.place("meta")
    assert all(p.device.type == "cpu" and p.dtype == torch.float64 for p in model.f0_predictor.parameters())
    others = [p for n, p in model.named_parameters() if not n.startswith("f0_predictor.")]
    assert others and all(p.device.type == "meta" for p in others)
    assert model.stft_window.device.type == "meta"


def test_f0_predictor_gets_its_input_on_its_own_device_and_dtype():
    model = _causal()
    assert model.fixed_modules("cpu") == []
    seen = []
    model.f0_predictor.register_forward_pre_hook(lambda m, args: seen.append((args[0].device, args[0].dtype)))
    mel = torch.randn(1, 20, 16, generator=torch.Generator().manual_seed(4))
    speech, source = model.inference(mel)
    assert seen == [(torch.device("cpu"), torch.float64)]
    assert speech.dtype == torch.float32 and source.dtype == torch.float32
