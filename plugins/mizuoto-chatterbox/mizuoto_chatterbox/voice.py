"""A Chatterbox voice: what T3 and S3Gen are conditioned on, from a preset (`conds.pt`) or a clip.

T3 takes the voice encoder's embedding, the S3 tokens of the clip's start and the exaggeration;
S3Gen takes its own prompt tokens, the prompt's 24 kHz mel and a CAM++ x-vector. A preset voice is
upstream's `conds.pt` (read as tensors only, never unpickled code).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mizuoto.errors import ModelLoadError
from mizuoto.nn.codecs.s3tokenizer import S3Tokenizer
from mizuoto.nn.dsp.mel import MatchaMelConfig, matcha_mel, whisper_log_mel
from mizuoto.nn.speaker import LSTMSpeakerEncoder
from mizuoto.runtime.convert.checkpoint import DictSource, match_state_dict
from mizuoto.runtime.convert.s3tokenizer import s3tokenizer_from_state
from mizuoto_chatterbox.weights import S3GEN_FILES, one_of, read_weights, reduced_config

S3_HEADS = 20  # the released S3 tokenizer's (s3tokenizer's ModelConfig)
# T3's speech prompt: the clip's first seconds at 16 kHz, and at most this many tokens (English, Turbo)
PROMPT_SECONDS = {False: 6, True: 15}
PROMPT_TOKENS = {False: 150, True: 375}
VE_RATE = 1.3  # the voice encoder's windows per second (Resemble's default, as upstream calls it)
# S3Gen's prompt mel: CosyVoice 2's 24 kHz Matcha mel
PROMPT_MEL = MatchaMelConfig(n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920, fmin=0,
                             fmax=8000)


@dataclass
class Voice:
    """T3's and S3Gen's conditioning of one voice."""

    speaker_emb: torch.Tensor         # (1, 256) voice-encoder embedding
    prompt_tokens: torch.Tensor       # (1, P) S3 tokens of the clip's start, T3's speech prompt
    exaggeration: float               # the voice's own; a request may set another
    gen_prompt_token: torch.Tensor    # (1, Tp) S3Gen's prompt tokens
    gen_prompt_feat: torch.Tensor     # (1, F, 80) S3Gen's prompt mel (24 kHz)
    gen_embedding: torch.Tensor       # (1, 192) CAM++ x-vector


def load_preset(path: str | Path) -> Voice:
    """Upstream's `conds.pt` ({"t3": T3Cond fields, "gen": S3Gen's reference dict}) as a Voice."""
    path = Path(path)
    try:
        conds = torch.load(path, map_location="cpu", weights_only=True)
        t3, gen = conds["t3"], conds["gen"]
        return Voice(speaker_emb=t3["speaker_emb"], prompt_tokens=t3["cond_prompt_speech_tokens"],
                     exaggeration=float(t3["emotion_adv"].flatten()[0]), gen_prompt_token=gen["prompt_token"],
                     gen_prompt_feat=gen["prompt_feat"], gen_embedding=gen["embedding"])
    except (OSError, RuntimeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{path} is not a Chatterbox preset voice (conds.pt): {type(exc).__name__}: {exc}") \
            from None


def load_voice_encoder(path: str | Path) -> LSTMSpeakerEncoder:
    """Upstream's `ve.safetensors` as an LSTM speaker encoder, sizes from the weights."""
    path = Path(path)
    state = read_weights(path)
    try:
        layers = len({m.group(1) for k in state if (m := re.fullmatch(r"lstm\.weight_ih_l(\d+)", k))})
        hidden, mels = state["lstm.weight_hh_l0"].shape[1], state["lstm.weight_ih_l0"].shape[1]
        size = state["proj.weight"].shape[0]
    except Exception as exc:  # a truncated or foreign file fails in many ways
        raise ModelLoadError(f"cannot read {path} as a voice encoder: {type(exc).__name__}: {exc}") from None
    model = LSTMSpeakerEncoder(mels, hidden, layers, size)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    # the GE2E training loss's scale and offset ride along in the file
    matched = match_state_dict(DictSource(state), {k: k for k in shapes}, shapes, where=path,
                               target="Chatterbox's voice encoder", ignore=("similarity_weight", "similarity_bias"))
    model.load_state_dict(matched)
    return model.eval()


def prompt_mel(wav_24k: torch.Tensor) -> torch.Tensor:
    """S3Gen's prompt mel (1, frames, 80) of a 24 kHz reference (N,), as upstream's `embed_ref` makes it."""
    return matcha_mel(wav_24k.reshape(1, -1).float(), PROMPT_MEL).transpose(1, 2)


def load_s3_tokenizer(model_dir: str | Path) -> S3Tokenizer:
    """The S3 tokenizer inside the directory's S3Gen weights (mizuoto's block, the package's layout)."""
    path = one_of(model_dir, S3GEN_FILES)
    heads = reduced_config(model_dir).get("s3_tokenizer", {}).get("n_audio_head", S3_HEADS)
    return s3tokenizer_from_state(read_weights(path), prefix="tokenizer.", n_head=heads, where=path)


def prompt_tokens(tokenizer: S3Tokenizer, wav_16k: torch.Tensor, turbo: bool) -> torch.Tensor:
    """T3's speech prompt (1, P) from a 16 kHz clip: the S3 tokens of its start."""
    return speech_tokens(tokenizer, wav_16k[..., :PROMPT_SECONDS[turbo] * 16000], PROMPT_TOKENS[turbo])


def speech_tokens(tokenizer: S3Tokenizer, wav_16k: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
    """S3 tokens (1, T) of a 16 kHz clip (N,), the first `max_tokens` only, as upstream's S3Tokenizer.forward."""
    mel = whisper_log_mel(wav_16k.reshape(1, -1).float(), tokenizer.conv1.in_channels)
    if max_tokens is not None:
        mel = mel[..., :max_tokens * 4]  # four mel frames a token
    with torch.inference_mode():
        tokens, _ = tokenizer(mel, torch.tensor([mel.shape[-1]]))
    return tokens
