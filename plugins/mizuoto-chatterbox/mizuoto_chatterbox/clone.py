"""A voice from a reference clip, as upstream's `prepare_conditionals` makes it.

The clip is read at 24 kHz and resampled to 16 kHz (`clip.load_clip`); T3 is conditioned on the
voice encoder's embedding of the 16 kHz clip and the S3 tokens of its start; S3Gen on its own
prompt tokens, the 24 kHz prompt mel and a CAM++ x-vector (`gen_ref.gen_reference`), all from the
clip's first 10 s. The clip's transcript is not used.
"""

from __future__ import annotations

from typing import Any

from mizuoto_chatterbox.clip import load_clip, ve_mel
from mizuoto_chatterbox.gen_ref import gen_reference
from mizuoto_chatterbox.voice import VE_RATE, Voice, prompt_tokens

CLONE_EXAGGERATION = 0.5  # what upstream's prepare_conditionals stores unless told otherwise


def clone_voice(model: Any, audio: Any, norm_loudness: bool = True) -> Voice:
    """The conditioning of a clip (a path or (samples, rate)) for a loaded ChatterboxModel (Turbo: loudness gain
    unless norm_loudness is False)."""
    wav_16k, wav_24k = load_clip(audio, model.turbo, norm_loudness)
    speaker = model.ve.embed(ve_mel(wav_16k), rate=VE_RATE)
    prompt = prompt_tokens(model.tokenizer, wav_16k, model.turbo)
    token, feat, embedding = gen_reference(wav_24k, model.tokenizer, model.xvector)
    return Voice(speaker_emb=speaker, prompt_tokens=prompt, exaggeration=CLONE_EXAGGERATION,
                 gen_prompt_token=token, gen_prompt_feat=feat, gen_embedding=embedding)
