"""Chatterbox's S3Gen: speech tokens and a voice prompt to 24 kHz audio, on `mizuoto.nn` blocks.

S3Gen is CosyVoice 2's causal flow (upsampling conformer, causal U-Net estimator) followed by HiFT,
as upstream's `S3Token2Wav.inference` (chatterbox-tts 0.1.7) runs them:

- English: the flow's noise is a fresh `randn_like(mu)` from torch's default generator (not
  CosyVoice 2's fixed buffer), 10 Euler steps on the cosine schedule with guidance 0.7.
- Turbo (`s3gen_meanflow.safetensors`): a mean-flow estimator, 2 unguided steps on a linear
  schedule; upstream first draws `randn(1, 80, 2 T)` for the new frames, then the flow's own
  `randn_like(mu)`, whose frames past the prompt that first draw replaces.
- HiFT at 24 kHz with the original SineGen (phase drawn per call, then the sine and uv noise), and
  upstream's trim-fade: the first 20 ms silenced, the next 20 ms faded in by a raised cosine.

Sizes come from the weights; what the weights do not hold (the estimator's head count, strides,
dilations) from a `reduced_config.json` beside reduced test weights, else upstream's literals.
The S3 tokenizer and CAM++ inside the file are not read here (clip conditioning is separate).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mizuoto.errors import ModelLoadError
from mizuoto.nn.flow.cfm import ConditionalCFM
from mizuoto.nn.flow.unet1d import ConditionalDecoder
from mizuoto.nn.flow.xvec import CausalMaskedDiffWithXvec
from mizuoto.nn.transformer.upsample import UpsampleConformerEncoder
from mizuoto.nn.vocoders.f0 import ConvRNNF0Predictor
from mizuoto.nn.vocoders.hift import HiFTGenerator
from mizuoto.runtime.convert.checkpoint import DictSource, Src, match_state_dict
from mizuoto.runtime.convert.hift import hift_key_map

from mizuoto_chatterbox.weights import count_children, read_weights, reduced_config

SAMPLE_RATE = 24000
TOKEN_RATE = 25  # S3 tokens per second
CFG_RATE = 0.7
STEPS, MEANFLOW_STEPS = 10, 2
# Read from the file by other code (clip conditioning), not by S3Gen's flow or vocoder.
NOT_READ = ("tokenizer.", "speaker_encoder.")
# Upstream's literals the weights do not state.
ESTIMATOR_HEADS = 8
HIFT = {"upsample_rates": [8, 5, 3], "hop_len": 4, "dilations": [1, 3, 5], "nsf_alpha": 0.1, "nsf_sigma": 0.003,
        "nsf_voiced_threshold": 10, "lrelu_slope": 0.1, "audio_limit": 0.99}


def trim_fade(sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Upstream's gain over the first 40 ms: 20 ms of zeros, then a raised-cosine fade-in."""
    n = sample_rate // 50
    fade = torch.zeros(2 * n)
    fade[n:] = (torch.cos(torch.linspace(torch.pi, 0, n)) + 1) / 2
    return fade


class S3Gen(nn.Module):
    """Upstream's S3Token2Wav at inference: `flow` (tokens -> mel) and `mel2wav` (HiFT), keys as upstream's."""

    def __init__(self, flow: CausalMaskedDiffWithXvec, mel2wav: HiFTGenerator, meanflow: bool) -> None:
        super().__init__()
        self.flow = flow
        self.mel2wav = mel2wav
        self.meanflow = meanflow
        self.register_buffer("trim_fade", trim_fade(), persistent=False)

    @torch.inference_mode()
    def mel(self, tokens: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
            embedding: torch.Tensor, generator: torch.Generator | None = None, *, finalize: bool = True,
            streaming: bool = False) -> torch.Tensor:
        """Mel (1, 80, M) past the prompt for tokens (T,) or (1, T); draws from `generator` (None: torch's default).

        finalize=False: the last tokens serve only as the encoder's look-ahead (a streamed chunk).
        """
        tokens = tokens.reshape(1, -1)
        noise = None
        if self.meanflow:  # drawn before the flow's own noise, as upstream's flow_inference does
            noise = torch.randn(1, self.flow.output_size, tokens.size(-1) * self.flow.token_mel_ratio,
                                generator=generator)
        return self.flow.inference(tokens, prompt_token, prompt_feat, embedding, streaming=streaming,
                                   finalize=finalize, noise_tail=noise, generator=generator)

    @torch.inference_mode()
    def wav(self, mel: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Audio (1, 480 M) for mel (1, 80, M): HiFT, then the trim-fade; draws as upstream's HiFT."""
        wav, _ = self.mel2wav.inference(mel, generator=generator)
        wav[:, :len(self.trim_fade)] *= self.trim_fade
        return wav


def _encoder(state: dict) -> UpsampleConformerEncoder:
    p = "flow.encoder."
    embed = state[p + "embed.out.0.weight"]
    look = state[p + "pre_lookahead_layer.conv1.weight"].shape[2] - 1
    return UpsampleConformerEncoder(
        input_size=embed.shape[1], output_size=embed.shape[0],
        attention_heads=state[p + "encoders.0.self_attn.pos_bias_u"].shape[0],  # one relative-position bias row a head
        linear_units=state[p + "encoders.0.feed_forward.w_1.weight"].shape[0],
        num_blocks=count_children(state, p + "encoders."), num_up_blocks=count_children(state, p + "up_encoders."),
        dropout_rate=0.0, positional_dropout_rate=0.0, input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
        macaron_style=False, use_cnn_module=False, pre_lookahead_len=look,
        upsample_stride=(state[p + "up_layer.conv.weight"].shape[2] - 1) // 2)


def _estimator(state: dict, reduced: dict) -> ConditionalDecoder:
    p = "flow.decoder.estimator."
    heads = reduced.get("num_heads", ESTIMATOR_HEADS)
    inner = state[p + "down_blocks.0.1.0.attn1.to_q.weight"].shape[0]
    return ConditionalDecoder(
        in_channels=state[p + "time_mlp.linear_1.weight"].shape[1],
        out_channels=state[p + "final_proj.weight"].shape[0],
        channels=[state[f"{p}down_blocks.{i}.0.block1.block.0.weight"].shape[0]
                  for i in range(count_children(state, p + "down_blocks."))],
        dropout=0.0, attention_head_dim=inner // heads, n_blocks=count_children(state, p + "down_blocks.0.1."),
        num_mid_blocks=count_children(state, p + "mid_blocks."), num_heads=heads, act_fn="gelu", causal=True,
        meanflow=p + "time_embed_mixer.weight" in state)


def _hift(state: dict) -> HiFTGenerator:
    p = "mel2wav."
    ups = count_children(state, p + "ups.")
    kernels = count_children(state, p + "resblocks.") // ups
    dilations = [list(HIFT["dilations"])] * kernels
    source_kernels = [state[f"{p}source_resblocks.{i}.convs1.0.parametrizations.weight.original1"].shape[2]
                      for i in range(count_children(state, p + "source_resblocks."))]
    f0 = state[p + "f0_predictor.condnet.0.parametrizations.weight.original1"]
    mels = state[p + "conv_pre.parametrizations.weight.original1"]
    return HiFTGenerator(
        in_channels=mels.shape[1], base_channels=mels.shape[0],
        nb_harmonics=state[p + "m_source.l_linear.weight"].shape[1] - 1, sampling_rate=SAMPLE_RATE,
        nsf_alpha=HIFT["nsf_alpha"], nsf_sigma=HIFT["nsf_sigma"], nsf_voiced_threshold=HIFT["nsf_voiced_threshold"],
        upsample_rates=list(HIFT["upsample_rates"]),
        upsample_kernel_sizes=[state[f"{p}ups.{i}.parametrizations.weight.original1"].shape[2] for i in range(ups)],
        istft_params={"n_fft": state[p + "conv_post.bias"].shape[0] - 2, "hop_len": HIFT["hop_len"]},
        resblock_kernel_sizes=[state[f"{p}resblocks.{j}.convs1.0.parametrizations.weight.original1"].shape[2]
                               for j in range(kernels)],
        resblock_dilation_sizes=dilations, source_resblock_kernel_sizes=source_kernels,
        source_resblock_dilation_sizes=[list(HIFT["dilations"])] * len(source_kernels),
        lrelu_slope=HIFT["lrelu_slope"], audio_limit=HIFT["audio_limit"],
        f0_predictor=ConvRNNF0Predictor(state[p + "f0_predictor.classifier.weight"].shape[0], f0.shape[1], f0.shape[0]),
        sine2=False)


def load_s3gen(path: str | Path) -> S3Gen:
    """S3Gen from upstream's `s3gen.safetensors` (English) or `s3gen_meanflow.safetensors` (Turbo)."""
    path = Path(path)
    state = read_weights(path)
    try:
        encoder = _encoder(state)
        estimator = _estimator(state, reduced_config(path.parent).get("flow_estimator", {}))
        mel2wav = _hift(state)
        embedding = state["flow.input_embedding.weight"]
        speaker = state["flow.spk_embed_affine_layer.weight"]
    except KeyError as exc:
        raise ModelLoadError(f"{path} is not an S3Gen checkpoint: no {exc.args[0]}") from None
    meanflow = estimator.time_embed_mixer is not None
    decoder = ConditionalCFM(estimator, inference_cfg_rate=CFG_RATE, t_scheduler="cosine", meanflow=meanflow)
    flow = CausalMaskedDiffWithXvec(
        vocab_size=embedding.shape[0], input_size=embedding.shape[1], output_size=speaker.shape[0],
        spk_embed_dim=speaker.shape[1], input_frame_rate=TOKEN_RATE,
        token_mel_ratio=encoder.up_layer.stride, pre_lookahead_len=encoder.pre_lookahead_layer.pre_lookahead_len,
        encoder=encoder, decoder=decoder, n_timesteps=MEANFLOW_STEPS if meanflow else STEPS)
    model = S3Gen(flow, mel2wav, meanflow)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    keys: dict = {k: Src(k) for k in shapes if k.startswith("flow.")}
    keys.update(hift_key_map(model.mel2wav, state, str(path), prefix="mel2wav."))
    ignore = [k for k in state if k.startswith(NOT_READ)]
    matched = match_state_dict(DictSource(state), keys, shapes, where=path, target="Chatterbox's S3Gen", ignore=ignore)
    model.load_state_dict(matched)
    return model.eval()

