"""Working-memory formulas the CosyVoice stages declare to the planner.

The LM's is its KV cache at upstream's cap (see lm_working_bytes). The flow and the vocoder work on
whole segments of mel frames; their activations grow linearly with the segment's length. Their
bounds below are estimates, not measurements: the widest activation of each (the flow's CFG
batch of two through its estimator, HiFT's upsampled signal with its harmonic source) times the
longest segment upstream's splitter makes, with a safety factor.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mizuoto.engines.cosyvoice.llm import (LM_OVERHEAD_BYTES, MAX_TOKEN_TEXT_RATIO, PROMPT_POSITIONS_CAP,
                                           QwenSpeechLM, TransformerSpeechLM)
from mizuoto.runtime.engine import SynthesisRequest
from mizuoto.nn.lm.qwen import QwenConfig

# upstream's split_paragraph flushes past 80 tokens and merges tails under 20: a segment rarely
# exceeds 100 text tokens; the LM speaks at most 20 speech tokens per text token.
SEGMENT_TEXT_TOKENS = 100
MAX_SPEECH_TOKENS = 20 * SEGMENT_TEXT_TOKENS
MEL_FRAMES_PER_TOKEN = 2
ACTIVATION_FACTOR = 16  # live activations per widest tensor (residuals, attention, CFG copies)
FLOAT_BYTES = 4


def request_text_tokens(request: SynthesisRequest | None) -> int:
    """Text tokens a request's longest segment may have (characters bound tokens from above)."""
    if request is None or not isinstance(request.text, str):
        return SEGMENT_TEXT_TOKENS
    return max(1, min(len(request.text), SEGMENT_TEXT_TOKENS))


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


def frames_stage_memory(module: nn.Module, sample_rate: int) -> Callable[[SynthesisRequest | None], int]:
    """A frames stage's formula: widest activation x mel frames of the longest segment x factor."""
    width = _widest(module)

    def memory(request: SynthesisRequest | None) -> int:
        frames = MEL_FRAMES_PER_TOKEN * 20 * request_text_tokens(request)
        return 2 * width * frames * FLOAT_BYTES * ACTIVATION_FACTOR
    return memory
