"""A loaded Qwen3-TTS model's parts: every module read from the directory, and the two calls a request makes of them.

`prefill(...)` lays out the talker's prompt (`prefill.py`) and `generate(...)` is the frame loop
(`generate.py`) the runtime runs, over `sequence`; the rest are modules the engine's stages hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mizuoto.errors import ModelLoadError
from mizuoto_qwen3tts.code_predictor import CodePredictor, load_code_predictor
from mizuoto_qwen3tts.codec_decoder import CodecDecoder, load_codec_decoder
from mizuoto_qwen3tts.codec_encoder import CodecEncoder, load_codec_encoder
from mizuoto_qwen3tts.layout import ModelLayout
from mizuoto_qwen3tts.prompt import Prompts
from mizuoto_qwen3tts.speaker_encoder import SAMPLE_RATE as SPEAKER_RATE
from mizuoto_qwen3tts.speaker_encoder import SpeakerEncoder, load_speaker_encoder
from mizuoto_qwen3tts.talker import Talker, load_talker


@dataclass
class Parts:
    """The modules of one model directory (the speaker and codec encoders: Base only)."""

    layout: ModelLayout
    prompts: Prompts
    talker: Talker
    predictor: CodePredictor
    codec_decoder: CodecDecoder
    speaker: SpeakerEncoder | None = None
    codec_encoder: CodecEncoder | None = None

    @property
    def voice_per_sample(self) -> int:
        """Floats a clone's front holds per 24 kHz sample at its widest (the codec encoder's full-rate layers)."""
        if self.codec_encoder is None:
            return 0
        return 2 * self.codec_encoder.config.num_filters + 1

    def __post_init__(self) -> None:
        from mizuoto_qwen3tts.generate import FrameLoop
        from mizuoto_qwen3tts.prefill import PrefillBuilder

        ids = self.layout.ids
        self.builder = PrefillBuilder(self.talker, self.predictor, ids, self.prompts)
        self.loop = FrameLoop(self.talker, self.predictor, ids)
        self.sequence = self.loop.sequence()  # what the runtime runs the talker's token loops over

    def prefill(self, text: str, *, language: str, speaker: str | None, instruct: str | None, clone: Any,
                non_streaming: bool) -> Any:
        """The talker's prompt for one request (`prefill.Prefill`); a clone's x-vector, and codes when in context."""
        in_context = clone is not None and clone.in_context
        return self.builder.build(text, language, speaker, instruct,
                                  ref_text=clone.ref_text if in_context else None,
                                  speaker_embedding=clone.xvector if clone is not None else None,
                                  ref_codes=clone.ref_codes if in_context else None, non_streaming_mode=non_streaming)

    def generate(self, prefill: Any, sampling: Any, generator: torch.Generator, steps: Any,
                 ban_stop: bool = False) -> Any:
        """The frame loop over `steps` (the runtime's), each frame a LongTensor [groups] (`ban_stop`: benchmarks)."""
        return self.loop.generate(prefill, sampling, generator, steps, ban_stop=ban_stop)


def load_parts(layout: ModelLayout) -> Parts:
    """Every module of the directory `layout` describes (float32, eval mode)."""
    base = layout.kind == "base"
    parts = Parts(layout, Prompts(layout.model_dir), load_talker(layout.model_dir),
                 load_code_predictor(layout.model_dir), load_codec_decoder(layout.codec_dir),
                 load_speaker_encoder(layout.model_dir) if base else None,
                 load_codec_encoder(layout.codec_dir) if base else None)
    if base and parts.codec_encoder.sample_rate != SPEAKER_RATE:  # one clip, read once, feeds both encoders
        raise ModelLoadError(f"{layout.codec_dir}: the codec encoder reads {parts.codec_encoder.sample_rate} Hz audio, "
                             f"the speaker encoder {SPEAKER_RATE} Hz; a model whose two differ is not supported")
    return parts
