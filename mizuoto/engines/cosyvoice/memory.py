"""Working-memory formulas the CosyVoice stages declare to the planner.

The LM's is upstream's cap (see llm.lm_working_memory_bytes). The flow and the vocoder work on
whole segments of mel frames; their activations grow linearly with the segment's length. Their
bounds below are estimates, not measurements: the widest activation of each (the flow's CFG
batch of two through its estimator, HiFT's upsampled signal with its harmonic source) times the
longest segment upstream's splitter makes, with a safety factor.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mizuoto.runtime.engine import SynthesisRequest

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


def lm_stage_memory(lm: nn.Module) -> Callable[[SynthesisRequest | None], int]:
    """The LM stage's formula: its KV cache at upstream's length cap for the request, + 512 MiB."""
    def memory(request: SynthesisRequest | None) -> int:
        return int(lm.working_memory_bytes(request_text_tokens(request), FLOAT_BYTES))
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
