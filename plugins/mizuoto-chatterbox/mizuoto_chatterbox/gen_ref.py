"""S3Gen's clip conditioning: prompt tokens, prompt mel and CAM++ x-vector of a 24 kHz reference.

As upstream's `S3Token2Mel.embed_ref` (chatterbox-tts 0.1.7) computes them from the 24 kHz wav it is
handed (its callers first cut the reference to `REF_SECONDS`):

- the prompt mel: CosyVoice 2's 24 kHz Matcha mel of the wav (`voice.prompt_mel`);
- a 16 kHz copy by torchaudio's default sinc resampler (`mizuoto.nn.dsp.resample`), which feeds
  both of the following (not the librosa/soxr copy T3's prompt and the voice encoder read);
- the x-vector: CAM++ in 3D-Speaker's PyTorch layout, as S3Gen's weights hold it under
  `speaker_encoder.`, on the kaldi fbank (80 bins) less its mean over time;
- the prompt tokens: the S3 tokenizer on the whole 16 kHz copy, cut to half the mel frames when the
  mel has not exactly two frames a token (a clip that is not a multiple of 40 ms).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mizuoto.nn.codecs.s3tokenizer import S3Tokenizer
from mizuoto.nn.dsp.kaldi import kaldi_fbank, mean_normalize
from mizuoto.nn.dsp.resample import resample
from mizuoto.nn.speaker import CAMPPlus
from mizuoto.runtime.convert.campplus import campplus_from_state
from mizuoto_chatterbox.voice import prompt_mel, speech_tokens
from mizuoto_chatterbox.weights import S3GEN_FILES, one_of, read_weights

S3GEN_RATE = 24000  # the reference embed_ref is given, and the prompt mel's rate
S3_RATE = 16000  # the S3 tokenizer's and CAM++'s
REF_SECONDS = 10  # upstream's callers hand embed_ref at most this much of the reference
FBANK_BINS = 80  # CAM++'s extract_feature
PREFIX = "speaker_encoder."


def load_xvector(model_dir: str | Path) -> CAMPPlus:
    """The CAM++ speaker encoder inside the directory's S3Gen weights, sizes from the weights."""
    path = one_of(model_dir, S3GEN_FILES)
    return campplus_from_state(read_weights(path), prefix=PREFIX, where=path)


def xvector_embedding(xvector: CAMPPlus, wav_16k: torch.Tensor) -> torch.Tensor:
    """CAM++ x-vector (1, E) of a 16 kHz wav (N,) or (1, N): mean-normalised kaldi fbank, then the encoder."""
    feats = mean_normalize(kaldi_fbank(wav_16k.reshape(-1).float(), num_mel_bins=FBANK_BINS,
                                       sample_frequency=S3_RATE))
    with torch.inference_mode():
        return xvector(feats.unsqueeze(0))


def gen_reference(wav_24k: torch.Tensor, tokenizer: S3Tokenizer, xvector: CAMPPlus
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt_token (1, T) int64, prompt_feat (1, F, 80), embedding (1, E)) of a 24 kHz reference (N,)."""
    wav = wav_24k.reshape(1, -1).float()
    feat = prompt_mel(wav)
    wav_16k = resample(wav, S3GEN_RATE, S3_RATE)
    embedding = xvector_embedding(xvector, wav_16k)
    tokens = speech_tokens(tokenizer, wav_16k)
    # the flow wants two prompt mel frames a token; where the counts disagree (a clip that is not a
    # multiple of 40 ms) upstream keeps the first F // 2 tokens and the whole mel
    if feat.shape[1] != 2 * tokens.shape[1]:
        tokens = tokens[:, :feat.shape[1] // 2]
    return tokens.long(), feat, embedding
