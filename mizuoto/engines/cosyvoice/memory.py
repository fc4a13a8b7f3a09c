"""Working-memory formulas the CosyVoice stages declare to the planner.

The LM's is its KV cache at upstream's cap (see lm_working_bytes). The flow and the vocoder work on
whole segments of mel frames. Their activations grow linearly with the segment's length (the widest
activation of each times the frames, with a safety factor), and the flow's attention adds a term
quadratic in the frames (prompt and speech together): scores over every pair of frames, per head,
for the CFG batch of two, times the live copies measured per attention kind (tests measure the
fixture models' peaks against these figures).

A request's segment length is bounded from its text: upstream's splitter cuts at sentence marks and
merges up to 80 tokens, so no segment is longer than 80 tokens plus the longest run without a mark
(characters bound tokens; digits read out as words can exceed that, so it is an estimate). An
unpunctuated text is one segment: its flow attention grows with the square of its length, and a
request past the budget is refused before it starts.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mizuoto.engines.cosyvoice.llm import (LM_OVERHEAD_BYTES, MAX_TOKEN_TEXT_RATIO, PROMPT_POSITIONS_CAP,
                                           QwenSpeechLM, TransformerSpeechLM)
from mizuoto.runtime.engine import SynthesisRequest
from mizuoto.nn.lm.qwen import QwenConfig
from mizuoto.text.normalize.rules import EN_SPLIT_MARKS, ZH_SPLIT_MARKS

# upstream's split_paragraph flushes past 80 tokens and merges tails under 20: the planning bound is
# a segment of 100 text tokens; the LM speaks at most 20 speech tokens per text token.
SEGMENT_TEXT_TOKENS = 100
SPLIT_FLUSH_TOKENS = 80
MAX_SPEECH_TOKENS = 20 * SEGMENT_TEXT_TOKENS
MEL_FRAMES_PER_TOKEN = 2
# The flow's frames come from the tokens the LM actually speaks, ~4-8 per text token in upstream's
# released models; the frames terms use 8 (the LM's KV bound keeps upstream's cap of 20).
FLOW_TOKENS_PER_TEXT_TOKEN = 8
PROMPT_MEL_FRAMES = MEL_FRAMES_PER_TOKEN * PROMPT_POSITIONS_CAP
ACTIVATION_FACTOR = 16  # live activations per widest tensor (residuals, attention, CFG copies)
# Live float copies of a (frames x frames) score matrix per head, by attention class: the U-Net's
# repeats its mask per head and keeps scores and softmax (measured 14-22 on the v2 fixture, 900 to
# 2,500 frames, 2026-12-01, tests/engines/cosyvoice/test_memory_peaks.py); the DiT's goes through
# SDPA's fused kernel (measured under 1).
ATTENTION_COPIES = {"mizuoto.nn.flow.unet1d.Attention": 24, "mizuoto.nn.transformer.dit.Attention": 2}
FLOAT_BYTES = 4
_MARKS = frozenset(ZH_SPLIT_MARKS | EN_SPLIT_MARKS)


def longest_sentence(text: str) -> int:
    """Characters of the longest run of `text` without a sentence mark."""
    longest = run = 0
    for ch in text:
        run = 0 if ch in _MARKS else run + 1
        longest = max(longest, run)
    return longest


def request_text_tokens(request: SynthesisRequest | None) -> int:
    """Text tokens a request's longest segment may have: the planning bound, or from the request's text."""
    if request is None or not isinstance(request.text, str):
        return SEGMENT_TEXT_TOKENS
    return max(1, min(len(request.text), SPLIT_FLUSH_TOKENS + longest_sentence(request.text)))


def lm_positions(text_tokens: int) -> int:
    """Positions upstream's decode can fill: a 300-position prompt, then 20 speech tokens per text token."""
    return PROMPT_POSITIONS_CAP + MAX_TOKEN_TEXT_RATIO * text_tokens


def qwen_lm_working_bytes(cfg: QwenConfig, text_tokens: int, dtype_bytes: int = FLOAT_BYTES) -> int:
    """Qwen2 LM (v2/v3): the KV cache at upstream's cap + 512 MiB.

    The cache is held at the real KV width (num_key_value_heads) in every layer; attention repeats
    one layer's K and V to the query-head width (one copy per head group) while it runs.
    """
    cache = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    repeated = 2 * cfg.num_attention_heads * cfg.head_dim
    return lm_positions(text_tokens) * (cache + repeated) * dtype_bytes + LM_OVERHEAD_BYTES


def transformer_lm_working_bytes(num_blocks: int, output_size: int, text_tokens: int,
                                 dtype_bytes: int = FLOAT_BYTES) -> int:
    """v1 TransformerLM: its wenet K/V cache (K and V at output_size per block) at the cap + 512 MiB.

    forward_chunk rebuilds the cache each step, so up to two more copies live for a moment;
    the 512 MiB covers them up to the released model's size at the cap.
    """
    return lm_positions(text_tokens) * num_blocks * 2 * output_size * dtype_bytes + LM_OVERHEAD_BYTES


def lm_working_bytes(lm: nn.Module, text_tokens: int, dtype_bytes: int = FLOAT_BYTES) -> int:
    """The working memory of a CosyVoice LM (v1 TransformerLM or v2/v3 Qwen2) for `text_tokens`."""
    if isinstance(lm, QwenSpeechLM):
        return qwen_lm_working_bytes(lm.llm.config, text_tokens, dtype_bytes)
    if isinstance(lm, TransformerSpeechLM):
        return transformer_lm_working_bytes(len(lm.llm.encoders), lm.llm.output_size(), text_tokens, dtype_bytes)
    raise TypeError(f"not a CosyVoice LM: {type(lm).__name__}")


def lm_stage_memory(lm: nn.Module) -> Callable[[SynthesisRequest | None], int]:
    """The LM stage's formula: its KV cache at upstream's length cap for the request, + 512 MiB."""
    def memory(request: SynthesisRequest | None) -> int:
        return lm_working_bytes(lm, request_text_tokens(request))
    return memory


def _widest(module: nn.Module) -> int:
    widths = [m.out_channels for m in module.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    widths += [m.out_features for m in module.modules() if isinstance(m, nn.Linear)]
    return max(widths, default=1)


def _attention(module: nn.Module) -> tuple[int, int]:
    """(heads, live score copies) of the widest attention inside `module` (0, 0 when it has none)."""
    found = [(int(m.heads), ATTENTION_COPIES[f"{type(m).__module__}.{type(m).__qualname__}"])
             for m in module.modules() if f"{type(m).__module__}.{type(m).__qualname__}" in ATTENTION_COPIES]
    return max(found, key=lambda hc: hc[0] * hc[1], default=(0, 0))


def frames_working_bytes(width: int, heads: int, copies: int, frames: int) -> int:
    """A frames stage on `frames` mel frames (CFG batch of two): linear activations + attention scores."""
    return 2 * width * frames * FLOAT_BYTES * ACTIVATION_FACTOR + 2 * heads * copies * frames * frames * FLOAT_BYTES


def segment_frames(text_tokens: int) -> int:
    """Mel frames a segment of `text_tokens` makes with the longest prompt the LM bound allows."""
    return MEL_FRAMES_PER_TOKEN * FLOW_TOKENS_PER_TEXT_TOKEN * text_tokens + PROMPT_MEL_FRAMES


def frames_stage_memory(module: nn.Module, sample_rate: int) -> Callable[[SynthesisRequest | None], int]:
    """A frames stage's formula over the longest segment's frames (see frames_working_bytes)."""
    width = _widest(module)
    heads, copies = _attention(module)

    def memory(request: SynthesisRequest | None) -> int:
        return frames_working_bytes(width, heads, copies, segment_frames(request_text_tokens(request)))
    return memory
