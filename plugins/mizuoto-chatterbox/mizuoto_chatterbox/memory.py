"""Working memory of Chatterbox's stages, from the loaded modules' sizes.

- **T3**: the KV cache of every layer for each row (two with classifier-free guidance, one for
  Turbo) over its positions (conditioning, text, start, up to upstream's 1000 speech tokens):
  allocated once at that cap on the unbatched path, grown by concatenation in a batch's rows (then
  counted LM_CACHE_COPIES times), plus the prompt's activations (LM_PREFILL_WIDTHS of its widest
  layer per position) and the logits. A request is admitted with the grown figure at the cap; a
  whole request's T3 call reserves its own (`t3_call`), which `bench --memory` measures.
- **S3Gen**: CosyVoice 2's flow and HiFT, measured by the blocks' own figures
  (`mizuoto.nn.flow.memory`, `mizuoto.nn.vocoders.memory`); they run one after the other, so a
  call needs the larger. A request is admitted with what any call needs (the voice prompt's
  frames) and each call reserves its own figure once T3 has spoken (`Model.room`).
- **Voice** (a clone's front: voice encoder, S3 tokenizer, CAM++ on at most 10 s of audio): a
  fixed VOICE_BYTES.
"""

from __future__ import annotations

from torch import nn

from mizuoto.nn.flow.memory import FlowMemory
from mizuoto.nn.memory import FIXED_BYTES, FLOAT
from mizuoto.nn.vocoders.memory import HiftMemory

LM_CACHE_COPIES = 1.5
LM_PREFILL_WIDTHS = 7  # at 6 the full-size unbatched call measured 0.1 MiB over its figure (AMD, 2026-12-04)
MAX_SPEECH_TOKENS = 1000  # upstream's cap of T3's draws (English and Turbo)
TEXT_IDS_BOUND = 300  # text ids of a request whose text is not known yet (the planning figure)
PROMPT_TOKENS_BOUND = {False: 150, True: 375}  # T3's speech prompt at most (English, Turbo)
GEN_PROMPT_TOKENS = 250  # S3Gen's prompt: 10 s of reference at 25 tokens a second
TEXT_BYTES = 8 << 20
VOICE_BYTES = 160 << 20


class Figures:
    """The call figures of one loaded model."""

    def __init__(self, t3: nn.Module, s3gen: nn.Module) -> None:
        cfg = t3.tfmr.config
        self.rows = 1 if t3.turbo else 2
        self.per_position = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * FLOAT
        self.width = max(cfg.hidden_size, cfg.intermediate_size)
        self.vocab = t3.speech_head.out_features
        self.cond = 2 + t3.cond_enc.perceiver.pre_attention_query.shape[1] if t3.cond_enc.perceiver is not None \
            else None  # Turbo's conditioning is its speech prompt (and the speaker row)
        self.flow = FlowMemory(s3gen.flow)
        self.hift = HiftMemory(s3gen.mel2wav)

    def t3(self, text_ids: int, prompt_tokens: int) -> int:
        """Bytes T3 needs for a request of `text_ids` text ids with a speech prompt of `prompt_tokens` (its bound)."""
        prefill = self.t3_prefill(text_ids, prompt_tokens)
        return self.t3_call(prefill + MAX_SPEECH_TOKENS, prefill, grown=1)

    def t3_prefill(self, text_ids: int, prompt_tokens: int) -> int:
        """Positions of T3's prompt: conditioning, text (with its start and stop) and the speech start."""
        cond = self.cond if self.cond is not None else 1 + prompt_tokens
        return cond + text_ids + 2

    def t3_call(self, positions: int, prefill: int, grown: int = 0) -> int:
        """Bytes one T3 call needs: each row's cache over `positions`, allocated once (`grown` 0) or grown by
        concatenation (1), the prompt's activations over `prefill` positions and the logits."""
        cache = (LM_CACHE_COPIES if grown else 1) * self.per_position * positions
        activations = (prefill * LM_PREFILL_WIDTHS * self.width + self.vocab) * FLOAT
        return int(self.rows * (cache + activations) + FIXED_BYTES)

    def s3gen(self, tokens: int, frames: int, vocoded: int | None = None) -> int:
        """Bytes one S3Gen call needs: its flow over `tokens` (prompt and speech) into `frames`, then HiFT over
        `vocoded` mel frames (None: all of them; a streamed chunk's: its new frames and HiFT's cache)."""
        return max(self.flow(tokens, frames), self.hift(frames if vocoded is None else vocoded))

    def s3gen_least(self) -> int:
        """What any S3Gen call needs whatever its sizes (a voice's prompt may be short)."""
        return self.s3gen(1, 2)

    def s3gen_most(self) -> int:
        """The most one S3Gen call may need: upstream's cap of speech tokens after the longest prompt."""
        tokens = GEN_PROMPT_TOKENS + MAX_SPEECH_TOKENS + 3
        return self.s3gen(tokens, 2 * tokens)
