"""A clone's voice prompt: what the Base model keeps of a reference clip (upstream's `create_voice_clone_prompt`).

Upstream loads the clip with `librosa.load(path, sr=None)` and resamples it to the codec
encoder's rate (24 kHz; the speaker encoder's must be the same) with `librosa.resample` (soxr HQ) (`mizuoto.nn.dsp.soxr_resample` gives the same
samples); the speaker encoder turns it into an x-vector, and the codec encoder into reference codes,
which only in-context cloning (a transcript given) reads. A prompt is stored, exported and imported
as tensors (a cached voice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mizuoto.errors import AudioError, InvalidRequest
from mizuoto.nn.dsp.soxr_resample import load_resampled
from mizuoto.runtime.engine import VoicePrompt

def load_reference(source: Any, rate: int) -> torch.Tensor:
    """A reference clip (path, bytes or (samples, rate)) as upstream reads it: mono float32 (S,) at `rate`."""
    wav = load_resampled(source, rate)
    if wav.size == 0:
        raise AudioError("the reference clip is empty", field="reference")
    return torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32))


@dataclass(frozen=True)
class ClonePrompt:
    """A cloned voice: its x-vector [H], and for in-context cloning its codes [Tr, 16] and transcript."""

    xvector: torch.Tensor
    ref_codes: torch.Tensor | None = None
    ref_text: str | None = None

    def __post_init__(self) -> None:
        if (self.ref_codes is None) != (self.ref_text is None):
            raise InvalidRequest("a clone prompt has reference codes exactly when it has a transcript")

    @property
    def in_context(self) -> bool:
        """Whether the talker reads the reference's codes and transcript (upstream's ICL mode)."""
        return self.ref_codes is not None

    def export(self) -> VoicePrompt:
        """As tensors and strings, to be stored (`Model.export_voice`)."""
        tensors = {"xvector": self.xvector.contiguous()}
        meta = {"format": "qwen3tts-clone-1"}
        if self.in_context:
            tensors["ref_codes"] = self.ref_codes.contiguous()
            meta["ref_text"] = self.ref_text
        return VoicePrompt(tensors, meta)

    @classmethod
    def from_export(cls, prompt: VoicePrompt, hidden: int, groups: int) -> "ClonePrompt":
        """Back from `export`, checked against the model's sizes (a prompt of another model is refused)."""
        if prompt.meta.get("format") != "qwen3tts-clone-1" or "xvector" not in prompt.tensors:
            raise InvalidRequest("not a Qwen3-TTS voice prompt (format qwen3tts-clone-1)", field="voice")
        xvector = prompt.tensors["xvector"].to(torch.float32)
        if tuple(xvector.shape) != (hidden,):
            raise InvalidRequest(f"the voice prompt's x-vector has shape {tuple(xvector.shape)}, this model's is "
                                 f"({hidden},): it was made by another model", field="voice")
        codes = prompt.tensors.get("ref_codes")
        if codes is not None and (codes.dim() != 2 or codes.shape[1] != groups or codes.dtype != torch.int64):
            raise InvalidRequest(f"the voice prompt's reference codes are {codes.dtype} {tuple(codes.shape)}, not "
                                 f"int64 [frames, {groups}]", field="voice")
        return cls(xvector, codes, prompt.meta.get("ref_text") if codes is not None else None)
