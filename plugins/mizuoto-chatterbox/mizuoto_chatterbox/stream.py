"""Streamed Chatterbox audio: S3Gen in growing chunks as T3 speaks (upstream 0.1.7 has no streaming).

S3Gen is CosyVoice 2's flow and HiFT, so a stream follows CosyVoice 2's token-to-wav schedule:
once HOP new tokens (then twice as many, up to MAX_HOP) and the flow's look-ahead are there, the
flow runs on every token so far (the last ones serve only as look-ahead) and the mel past what
was sent goes to HiFT with the previous chunk's last MEL_CACHE frames and source, crossfaded over
SOURCE_CACHE samples; the last chunk runs on all tokens. T3 draws from the request's generator
exactly as a whole request does (the same tokens for the same seed); S3Gen draws from a second
one, so a streamed request's audio differs from the whole request's only in S3Gen's noise and at
the chunk joins.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mizuoto.errors import InvalidRequest
from mizuoto.nn.vocoders.crossfade import fade_in_out
from mizuoto.runtime.engine import AudioChunk, SynthesisRequest

HOP, MAX_HOP, GROWTH = 25, 100, 2  # speech tokens per chunk: the first, the largest, the growth
MEL_CACHE = 8  # mel frames HiFT sees again from the previous chunk
SOURCE_CACHE = MEL_CACHE * 480  # samples of the previous chunk's source and audio kept for the join
STREAM_SEED_OFFSET = 1  # S3Gen's generator is seeded with the request's seed + this


class _Vocoder:
    """HiFT over consecutive mel chunks with CosyVoice 2's cache and crossfade, then upstream's trim-fade once."""

    def __init__(self, model: Any, generator: torch.Generator, speed: float) -> None:
        self.model, self.generator, self.speed = model, generator, speed
        self.cache: dict[str, torch.Tensor] | None = None
        self.window = np.hamming(2 * SOURCE_CACHE)
        self.sent = 0

    def __call__(self, mel: torch.Tensor, final: bool) -> torch.Tensor:
        hift = self.model.s3gen.mel2wav
        source = torch.zeros(1, 1, 0)
        if self.cache is not None:
            mel = torch.cat([self.cache["mel"], mel], dim=2)
            source = self.cache["source"]
        if final and self.speed != 1.0:
            mel = F.interpolate(mel, size=max(1, int(mel.shape[2] / self.speed)), mode="linear")
        speech, new_source = hift.inference(mel, source, generator=self.generator)
        if self.cache is not None:
            speech = fade_in_out(speech, self.cache["speech"], self.window)
        if not final:
            self.cache = {"mel": mel[:, :, -MEL_CACHE:], "source": new_source[:, :, -SOURCE_CACHE:],
                          "speech": speech[:, -SOURCE_CACHE:]}
            speech = speech[:, :-SOURCE_CACHE]
        fade = self.model.s3gen.trim_fade
        if self.sent < fade.numel():  # upstream silences and fades in the start of the whole output
            n = min(fade.numel() - self.sent, speech.shape[1])
            speech = speech.clone()
            speech[:, :n] *= fade[self.sent:self.sent + n]
        self.sent += speech.shape[1]
        return speech[0]


def stream_audio(model: Any, request: SynthesisRequest, voice: Any, generator: torch.Generator,
                 seed: int) -> Iterator[AudioChunk]:
    """The request's audio as chunks, each as soon as its tokens are spoken; the last has final=True."""
    from mizuoto_chatterbox.engine import SAMPLE_RATE, SILENCE_TOKEN, TURBO_TAIL

    s3gen_generator = torch.Generator().manual_seed((seed + STREAM_SEED_OFFSET) % (1 << 63))
    vocoder = _Vocoder(model, s3gen_generator, request.speed)
    lookahead = model.s3gen.flow.pre_lookahead_len
    tokens: list[int] = []
    sent_tokens, sent_frames, hop, index = 0, 0, HOP, 0

    def chunk(final: bool) -> torch.Tensor:
        """The audio of the tokens so far past what was sent: the flow on all of them, HiFT on the new mel."""
        speech = tokens + ([SILENCE_TOKEN] * TURBO_TAIL if final and model.turbo else [])
        frames = 2 * (voice.gen_prompt_token.shape[-1] + len(speech))
        vocoded = 2 * (len(speech) - sent_tokens) + MEL_CACHE + 1  # the new mel (at most), HiFT's cache before it

        def run(device: Any) -> torch.Tensor:
            nonlocal sent_frames
            out = model.s3gen.mel(torch.tensor(speech), voice.gen_prompt_token, voice.gen_prompt_feat,
                                  voice.gen_embedding, s3gen_generator, finalize=final)
            # the frames past those sent (a prompt mel of odd length makes them no multiple of the token rate)
            out = out[:, :, sent_frames:]
            sent_frames += out.shape[2]
            return vocoder(out, final)
        return model.compute("s3gen", run, kind="chunk", urgent=index == 0, tokens=frames // 2, frames=frames,
                             vocoded=vocoded)

    def emit(audio: torch.Tensor, final: bool) -> AudioChunk:
        nonlocal index
        out = AudioChunk(model.mark(audio.contiguous()), SAMPLE_RATE, index, final)
        index += 1
        return out

    for token in model._draws(request, voice, generator):
        if token >= 6561:  # the start or stop token, or a token outside S3Gen's vocabulary
            continue
        tokens.append(token)
        if len(tokens) - sent_tokens >= hop + lookahead:
            audio = chunk(final=False)
            sent_tokens = len(tokens) - lookahead
            hop = min(MAX_HOP, hop * GROWTH)
            yield emit(audio, False)  # the last chunk, with final=True, always follows
    if not tokens and not model.turbo:  # as the whole request: Turbo still speaks its silence tail
        raise InvalidRequest("the model spoke no speech tokens for this text", field="text")
    yield emit(chunk(final=True), True)
