"""Full-size Chatterbox and Chatterbox-Turbo models with random weights, for `mizuoto bench --random`.

No released weights can be downloaded on the machines the benchmarks run on, so the modules are
built at the released sizes (upstream 0.1.7's configs: T3's Llama 520M or GPT-2 medium, S3Gen's
conformer, U-Net and HiFT, the voice encoder, the S3 tokenizer v2 and CAM++) with PyTorch's
default initialisation, and a random preset voice. Timing does not depend on the values: the
benchmark suppresses the stop token so every run speaks exactly the tokens asked for.
"""

from __future__ import annotations

import torch

from mizuoto.nn.codecs.s3tokenizer import S3Tokenizer
from mizuoto.nn.flow.cfm import ConditionalCFM
from mizuoto.nn.flow.unet1d import ConditionalDecoder
from mizuoto.nn.flow.xvec import CausalMaskedDiffWithXvec
from mizuoto.nn.lm.decoder import DecoderConfig
from mizuoto.nn.speaker import LSTMSpeakerEncoder
from mizuoto.nn.speaker.campplus import CAMPPlus
from mizuoto.nn.transformer.upsample import UpsampleConformerEncoder
from mizuoto.nn.vocoders.f0 import ConvRNNF0Predictor
from mizuoto.nn.vocoders.hift import HiFTGenerator
from mizuoto_chatterbox.s3gen import CFG_RATE, HIFT, MEANFLOW_STEPS, SAMPLE_RATE, STEPS, TOKEN_RATE, S3Gen
from mizuoto_chatterbox.t3 import LLAMA, PERCEIVER_HEADS, T3, Perceiver
from mizuoto_chatterbox.voice import Voice

KINDS = ("chatterbox", "chatterbox-turbo")
# upstream's T3Config and model configs (chatterbox-tts 0.1.7)
ENGLISH_T3 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 30, "num_attention_heads": 16,
              "num_key_value_heads": 16, "vocab_size": 8}
TURBO_T3 = {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 8196, "n_inner": 4096,
            "vocab_size": 50276}
TEXT_VOCAB = {False: 704, True: 50276}
SPEECH_VOCAB = {False: 8194, True: 6563}
POSITIONS = (2048 + 2, 4096 + 4)  # learned text and speech positions (English)
PERCEIVER_QUERIES = 32
SPEAKER, XVECTOR, MELS = 256, 192, 80
PROMPT_TOKENS = {False: 150, True: 375}  # T3's speech prompt
GEN_PROMPT_TOKENS = 150  # S3Gen's prompt: 6 s of reference


def _t3(turbo: bool) -> T3:
    if turbo:
        return T3(DecoderConfig.from_dict(TURBO_T3), TEXT_VOCAB[True], SPEECH_VOCAB[True], None)
    backbone = DecoderConfig.from_dict({**LLAMA, **ENGLISH_T3, "head_dim": 64})
    return T3(backbone, TEXT_VOCAB[False], SPEECH_VOCAB[False],
              Perceiver(PERCEIVER_QUERIES, ENGLISH_T3["hidden_size"], PERCEIVER_HEADS), *POSITIONS)


def _s3gen(turbo: bool) -> S3Gen:
    encoder = UpsampleConformerEncoder(
        input_size=512, output_size=512, attention_heads=8, linear_units=2048, num_blocks=6, num_up_blocks=4,
        dropout_rate=0.0, positional_dropout_rate=0.0, input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
        macaron_style=False, use_cnn_module=False, pre_lookahead_len=3, upsample_stride=2)
    estimator = ConditionalDecoder(in_channels=320, out_channels=MELS, channels=[256], dropout=0.0,
                                   attention_head_dim=64, n_blocks=4, num_mid_blocks=12, num_heads=8, act_fn="gelu",
                                   causal=True, meanflow=turbo)
    decoder = ConditionalCFM(estimator, inference_cfg_rate=CFG_RATE, t_scheduler="cosine", meanflow=turbo)
    flow = CausalMaskedDiffWithXvec(vocab_size=6561, input_size=512, output_size=MELS, spk_embed_dim=XVECTOR,
                                    input_frame_rate=TOKEN_RATE, token_mel_ratio=2, pre_lookahead_len=3,
                                    encoder=encoder, decoder=decoder, n_timesteps=MEANFLOW_STEPS if turbo else STEPS)
    dilations = [list(HIFT["dilations"])] * 3
    hift = HiFTGenerator(
        in_channels=MELS, base_channels=512, nb_harmonics=8, sampling_rate=SAMPLE_RATE, nsf_alpha=HIFT["nsf_alpha"],
        nsf_sigma=HIFT["nsf_sigma"], nsf_voiced_threshold=HIFT["nsf_voiced_threshold"],
        upsample_rates=list(HIFT["upsample_rates"]), upsample_kernel_sizes=[16, 11, 7],
        istft_params={"n_fft": 16, "hop_len": HIFT["hop_len"]}, resblock_kernel_sizes=[3, 7, 11],
        resblock_dilation_sizes=dilations, source_resblock_kernel_sizes=[7, 7, 11],
        source_resblock_dilation_sizes=dilations, lrelu_slope=HIFT["lrelu_slope"], audio_limit=HIFT["audio_limit"],
        f0_predictor=ConvRNNF0Predictor(1, MELS, 512), sine2=False)
    return S3Gen(flow, hift, turbo)


def _tokenizer() -> S3Tokenizer:
    return S3Tokenizer(n_mels=128, n_state=1280, n_head=20, n_layer=6, n_mlp=5120, conv_kernel=3, conv_padding=1,
                       conv1_stride=2, conv2_stride=2, attn_ln_eps=1e-5, mlp_ln_eps=1e-5, quantizer="fsq",
                       fsmn_kernel=31, fsq_dim=8, fsq_levels=3, fsq_scale=0.9990000128746033)


def _xvector() -> CAMPPlus:
    """3D-Speaker's CAM++ (growth 32, bottleneck 4, 128 initial channels, blocks of 12, 24 and 16 layers)."""
    blocks = [{"layers": n, "growth": 32, "bn_channels": 128, "kernel": 3, "dilation": d, "cam_hidden": 64}
              for n, d in ((12, 1), (24, 2), (16, 2))]
    channels, transits = 128, []
    for spec in blocks:
        channels = (channels + spec["layers"] * spec["growth"]) // 2
        transits.append({"out": channels, "bias": False})
    return CAMPPlus(feat_dim=80, head_channels=32, head_layers=[[[2, 1], [1, 0]], [[2, 1], [1, 0]]],
                    head_conv2_stride=2, tdnn={"out": 128, "kernel": 5, "stride": 2, "padding": 2, "dilation": 1},
                    blocks=blocks, transits=transits, embedding_size=XVECTOR, seg_len=100, eps=1e-5,
                    out_batchnorm=True, folded=False, dense_affine=False).eval()


def _preset(turbo: bool, g: torch.Generator) -> Voice:
    return Voice(speaker_emb=torch.randn(1, SPEAKER, generator=g),
                 prompt_tokens=torch.randint(0, 6561, (1, PROMPT_TOKENS[turbo]), generator=g),
                 exaggeration=0.5,
                 gen_prompt_token=torch.randint(0, 6561, (1, GEN_PROMPT_TOKENS), generator=g),
                 gen_prompt_feat=torch.randn(1, 2 * GEN_PROMPT_TOKENS, MELS, generator=g),
                 gen_embedding=torch.randn(1, XVECTOR, generator=g))


class CharText:
    """Text ids for a random model: one id per character (the released tokenizers are not here)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def ids(self, text: str) -> list[int]:
        """One id per character, inside the vocabulary."""
        return [1 + ord(c) % (self.vocab - 2) for c in text]


def random_parts(kind: str, seed: int = 0) -> dict:
    """The modules, text ids and preset voice of a full-size random model of `kind` (KINDS), as ChatterboxModel
    takes them."""
    if kind not in KINDS:
        raise ValueError(f"unknown random Chatterbox kind {kind!r}; known: {', '.join(KINDS)}")
    turbo = kind.endswith("turbo")
    torch.manual_seed(seed)
    with torch.no_grad():
        parts = {"t3": _t3(turbo).eval(), "s3gen": _s3gen(turbo).eval(),
                 "ve": LSTMSpeakerEncoder(40, 256, 3, SPEAKER).eval(), "tokenizer": _tokenizer().eval(),
                 "xvector": _xvector()}
    parts["preset"] = _preset(turbo, torch.Generator().manual_seed(seed + 1))
    parts["text"] = CharText(TEXT_VOCAB[turbo])
    return parts
