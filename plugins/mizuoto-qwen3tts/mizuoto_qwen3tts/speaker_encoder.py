"""The speaker encoder of a Base (voice clone) model: the x-vector of a reference clip at 24 kHz.

Upstream builds it only for `tts_model_type` "base" (CustomVoice and VoiceDesign carry a
`speaker_encoder_config` but no weights for it), an ECAPA-TDNN (`mizuoto.nn.speaker.ecapa`) sized
by `speaker_encoder_config` and read from the `speaker_encoder.` keys of `model.safetensors`.
Its input is upstream's own log-mel of the clip, whose parameters upstream fixes in code (not in
the config): they are the constants below. It is Matcha's mel recipe (reflect pad, STFT,
magnitude with a 1e-9 floor, Slaney filters, log of the 1e-5 clamp), so `matcha_mel` computes it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.nn.dsp.mel import MatchaMelConfig, matcha_mel
from mizuoto.nn.speaker.ecapa import ECAPATDNN
from mizuoto_qwen3tts.weights import load_into, read_config

PREFIX = "speaker_encoder."
# upstream's `extract_speaker_embedding` accepts 24 kHz audio only, whatever the config says
SAMPLE_RATE = 24000
# upstream's mel_spectrogram arguments there
MEL = MatchaMelConfig(n_fft=1024, num_mels=128, sampling_rate=SAMPLE_RATE, hop_size=256, win_size=1024,
                      fmin=0, fmax=12000)
# the config's keys -> ECAPATDNN's arguments
SIZES = {"mel_dim": "mels", "enc_dim": "embed_dim", "enc_channels": "channels", "enc_kernel_sizes": "kernel_sizes",
         "enc_dilations": "dilations", "enc_attention_channels": "attention_channels",
         "enc_res2net_scale": "res2net_scale", "enc_se_channels": "se_channels"}


def speaker_mel(wav_24k: torch.Tensor) -> torch.Tensor:
    """Upstream's speaker-encoder log-mel [1, T, 128] of a mono 24 kHz float32 wav [S]."""
    if wav_24k.dim() != 1:
        raise InvalidRequest(f"speaker_mel: expected a mono wav [samples], got shape {tuple(wav_24k.shape)}")
    # Upstream computes the mel of a batch of one, [1, 128, T], and hands the encoder its transpose.
    return matcha_mel(wav_24k.unsqueeze(0), MEL).transpose(1, 2)


class SpeakerEncoder(nn.Module):
    """The Base model's ECAPA-TDNN; `embed` gives upstream's x-vector of a 24 kHz clip."""

    def __init__(self, network: ECAPATDNN) -> None:
        super().__init__()
        self.network = network

    @torch.inference_mode()
    def embed_mel(self, mel: torch.Tensor) -> torch.Tensor:
        """The x-vector [enc_dim] of one clip's speaker mel [1, T, 128]."""
        return self.network(mel)[0]

    def embed(self, wav_24k: torch.Tensor) -> torch.Tensor:
        """The x-vector [enc_dim] of a mono 24 kHz float32 wav [S] (upstream's `extract_speaker_embedding`)."""
        return self.embed_mel(speaker_mel(wav_24k))


def speaker_encoder_sizes(config: dict, where: str = "config.json") -> dict:
    """ECAPATDNN's arguments from a model dir's `speaker_encoder_config`."""
    cfg = config.get("speaker_encoder_config")
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where}: a base model without a speaker_encoder_config")
    missing = [key for key in SIZES if key not in cfg]
    if missing:
        raise ModelLoadError(f"{where}: speaker_encoder_config lacks {missing}")
    if int(cfg.get("sample_rate", SAMPLE_RATE)) != SAMPLE_RATE:
        raise ModelLoadError(f"{where}: speaker encoder sample_rate {cfg['sample_rate']} is not supported "
                             f"(upstream embeds {SAMPLE_RATE} Hz audio only)")
    if int(cfg["mel_dim"]) != MEL.num_mels:
        raise ModelLoadError(f"{where}: speaker encoder mel_dim {cfg['mel_dim']} is not supported "
                             f"(upstream's mel has {MEL.num_mels} bins)")
    sizes = {ours: cfg[key] for key, ours in SIZES.items()}
    return {k: [int(x) for x in v] if isinstance(v, list) else int(v) for k, v in sizes.items()}


def load_speaker_encoder(model_dir: str | Path) -> SpeakerEncoder | None:
    """The speaker encoder of `model_dir` (float32, eval mode); None unless its tts_model_type is "base"."""
    where = str(Path(model_dir) / "config.json")
    config = read_config(model_dir)
    if config.get("tts_model_type") != "base":
        return None
    try:
        network = ECAPATDNN(**speaker_encoder_sizes(config, where))
    except ValueError as exc:
        raise ModelLoadError(f"{where}: speaker_encoder_config: {exc}") from None
    encoder = SpeakerEncoder(network).eval()
    load_into(encoder.network, model_dir, PREFIX)
    return encoder
