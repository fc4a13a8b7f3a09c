"""The 12 Hz codec's encoder: a 24 kHz reference clip -> its codes [frames, 16], for ICL voice cloning.

Upstream's speech tokenizer (`Qwen3TTSTokenizerV2Model`) encodes with transformers' Mimi encoder
half (`mizuoto.nn.codecs.mimi`), sized by its `config.json`'s `encoder_config`, then keeps the
first `encoder_valid_num_quantizers` codes of each frame and the first ceil(S / 1920) frames
(`encode_downsample_rate`): the convolutions' last, partial frame counts, the extra frame their
padding can add does not. One clip is encoded alone, so upstream's padding mask is all ones and
changes nothing. Weights: the `encoder.*` keys of the speech tokenizer's `model.safetensors` (the
`decoder.*` keys are the codec decoder's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.nn.codecs.mimi import MimiEncoder, MimiEncoderConfig
from mizuoto_qwen3tts.weights import load_into, read_config

PREFIX = "encoder."


class CodecEncoder(MimiEncoder):
    """Mimi's encoder half with the speech tokenizer's cut: `encode(wav) -> [frames, valid quantizers]`."""

    def __init__(self, cfg: MimiEncoderConfig, quantizers: int, samples_per_frame: int, sample_rate: int) -> None:
        super().__init__(cfg)
        self.quantizers, self.samples_per_frame, self.sample_rate = quantizers, samples_per_frame, sample_rate

    def embeddings(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [S] float32 at `sample_rate` -> the quantizer's input [1, hidden, frames] (all frames computed)."""
        _check_wav(wav)
        return self.embed(wav.reshape(1, 1, -1))

    @torch.inference_mode()
    def encode(self, wav_24k: torch.Tensor) -> torch.Tensor:
        """wav [S] float32 at `sample_rate` -> codes [ceil(S / samples_per_frame), quantizers] int64."""
        codes = self.quantize(self.embeddings(wav_24k), self.quantizers)[0]
        frames = -(-wav_24k.shape[0] // self.samples_per_frame)
        return codes[:, :frames].transpose(0, 1)


def _check_wav(wav: torch.Tensor) -> None:
    if not isinstance(wav, torch.Tensor) or wav.dim() != 1 or wav.dtype != torch.float32:
        kind = f"a {wav.dim()}-D {wav.dtype} tensor" if isinstance(wav, torch.Tensor) else type(wav).__name__
        raise InvalidRequest(f"the codec encoder takes a 1-D float32 waveform, got {kind}")
    if wav.shape[0] == 0:
        raise InvalidRequest("the reference audio is empty: the codec encoder needs at least one sample")


def load_codec_encoder(speech_tokenizer_dir: str | Path) -> CodecEncoder:
    """The codec encoder from a model dir's `speech_tokenizer/` (float32, eval mode)."""
    config = read_config(speech_tokenizer_dir)
    where = str(Path(speech_tokenizer_dir) / "config.json")
    try:
        mimi = MimiEncoderConfig.from_dict(config["encoder_config"], f"{where} encoder_config")
        quantizers = int(config["encoder_valid_num_quantizers"])
        samples_per_frame = int(config["encode_downsample_rate"])
        sample_rate = int(config["input_sample_rate"])
    except KeyError as exc:
        raise ModelLoadError(f"{where}: no {exc.args[0]!r} (not a Qwen3-TTS 12 Hz speech tokenizer?)") from None
    if not mimi.num_semantic_quantizers <= quantizers <= mimi.num_quantizers:
        raise ModelLoadError(f"{where}: encoder_valid_num_quantizers {quantizers} is outside the encoder's "
                             f"{mimi.num_semantic_quantizers}..{mimi.num_quantizers} quantizers")
    model = CodecEncoder(mimi, quantizers, samples_per_frame, sample_rate).eval()
    load_into(model, speech_tokenizer_dir, PREFIX)
    return model
