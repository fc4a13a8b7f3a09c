"""Working memory of the CosyVoice stages: each call's figure from its sizes, and what a request is admitted with.

Each figure models what runs on the CPU (resident growth of the process while the call runs, with
the runtime's allocator settings: runtime.malloc) and is an upper bound on CUDA, whose fused
attention kernels hold no more. The constants below were measured with `mizuoto bench --memory`
on the fixture models and full-size random models (docs/memory.md, "Calibration"; Intel Xeon,
2 threads, torch 2.13.0, 2026-12-03). Every figure also carries `nn.memory.HEAP_PACKING_BYTES`
(through FIXED_BYTES), the allowance for how the process's heap packs a call's small buffers:

- **LM** (`positions`, `rows`, `prefill`): per row, the KV cache of every layer at `positions`,
  held LM_CACHE_COPIES times while it grows (Qwen2's dynamic cache is grown by concatenation, and
  its growing buffers fragment glibc's arenas), STATIC_CACHE_COPIES times when it is allocated once
  (`compute.kv_cache=static`, a batched model's default), WENET_CACHE_COPIES for v1's wenet cache
  (rebuilt per block each step and stacked: three copies, with the arenas' share); the prefill's
  activations (LM_PREFILL_WIDTHS of its widest layer per prompt position) and each row's logits.
- **Flow** and **vocoder**: `mizuoto.nn.flow.memory.FlowMemory` and `mizuoto.nn.vocoders.memory.HiftMemory`
  (the blocks' own figures, shared with other engines built from them).

A request is admitted with the LM's bound (its KV cache at upstream's length cap for the longest
segment's text tokens, counted with the model's own tokenizer) and with what its flow and vocoder
certainly need: upstream's LM speaks at least MIN_TOKEN_TEXT_RATIO tokens per text token (v1/v2;
CosyVoice 3 drops silent runs after the LM, so there nothing is certain). Each flow and vocoder
call then reserves its own figure (Model.room) once the LM has spoken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from mizuoto.engines.cosyvoice.llm import (MAX_TOKEN_TEXT_RATIO, MIN_TOKEN_TEXT_RATIO, PROMPT_POSITIONS_CAP,
                                           QwenSpeechLM, TransformerSpeechLM)
from mizuoto.nn.flow.memory import FlowMemory
from mizuoto.nn.memory import FIXED_BYTES, FLOAT
from mizuoto.nn.vocoders.memory import HiftMemory
from mizuoto.runtime.engine import SynthesisRequest

# the LM: its cache 1.5 times while it grows (the old beside the new; growing buffers fragment
# glibc's arenas); a prefill's activations per position, in widths of its widest layer
LM_CACHE_COPIES = 1.5
LM_PREFILL_WIDTHS = 6
# a static cache: its one buffer, and what each step's attention copies beside it (the valid part of
# one layer's K and V made contiguous for SDPA) with the arenas' share of those step-sized copies:
# 1.03-1.06 copies measured with 8 rows, 0.9-1.14 with one, at 220-845 positions (full-size CosyVoice 2,
# AMD EPYC, 2026-12-05)
STATIC_CACHE_COPIES = 1.15
# CosyVoice 1's wenet cache: rebuilt per block each step and stacked (three copies), and the arenas' share
# of those step-sized buffers: 3.1-3.3 copies measured at full size (146-1596 positions, AMD EPYC, 2026-12-04)
WENET_CACHE_COPIES = 3.3
BOUND_TEXT_TOKENS = 100  # a request of unknown text (streamed, or the planning figure): upstream's segment size


def _widest(module: nn.Module) -> int:
    widths = [m.out_channels for m in module.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    widths += [m.out_features for m in module.modules() if isinstance(m, nn.Linear)]
    return max(widths, default=1)


# ---- the LM ---------------------------------------------------------------------------------------

class LmMemory:
    """The LM's call figure: `rows` requests of `positions` positions each, their prompts `prefill` positions.

    `static`: the model's KV caches are allocated once (its `compute.kv_cache`); text streamed in
    still grows a dynamic cache (its length is not known in advance), counted with `grown=True`.
    """

    def __init__(self, lm: nn.Module, static: bool = False):
        if isinstance(lm, QwenSpeechLM):  # its dynamic cache grows one layer at a time (torch.cat)
            cfg = lm.llm.config
            self.per_position = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * FLOAT
            self.width, self.grown_copies = max(cfg.intermediate_size, cfg.hidden_size), LM_CACHE_COPIES
            self.copies = STATIC_CACHE_COPIES if static else LM_CACHE_COPIES
        elif isinstance(lm, TransformerSpeechLM):  # wenet's forward_chunk rebuilds every block's cache and stacks them
            self.per_position = len(lm.llm.encoders) * 2 * lm.llm.output_size() * FLOAT
            self.width, self.copies = _widest(lm.llm), WENET_CACHE_COPIES
            self.grown_copies = self.copies
        else:
            raise TypeError(f"not a CosyVoice LM: {type(lm).__name__}")
        self.vocab = _widest(lm.llm_decoder) if hasattr(lm, "llm_decoder") else self.width

    def __call__(self, positions: int, rows: int = 1, prefill: int = 0, grown: bool = False) -> int:
        """Bytes for `rows` requests of `positions` positions each, `prefill` of them fed at once.

        A batch runs its prefills one at a time (runtime.batching), so one prefill's activations count.
        """
        cache = (self.grown_copies if grown else self.copies) * self.per_position * positions
        # the head scores each row's last position only
        activations = (max(prefill, rows) * LM_PREFILL_WIDTHS * self.width + rows * self.vocab) * FLOAT
        return int(rows * cache + activations + FIXED_BYTES)

    def bound(self, text_tokens: int, grown: bool = False) -> int:
        """Its figure at upstream's cap: a prompt of PROMPT_POSITIONS_CAP, MAX_TOKEN_TEXT_RATIO speech tokens per text token."""
        prefill = PROMPT_POSITIONS_CAP + text_tokens
        return self(prefill + MAX_TOKEN_TEXT_RATIO * text_tokens, prefill=prefill, grown=grown)


# ---- what a request is admitted with --------------------------------------------------------------

SegmentTokens = Callable[[str], Sequence[int]]  # text -> text tokens of each of its segments


def admission(lm: LmMemory, flow: FlowMemory, hift: HiftMemory, segment_tokens: SegmentTokens,
              version: int, mel_frames: Callable[[int], int]) -> dict[str, Callable[[SynthesisRequest | None], int]]:
    """The stages' `memory(request)` (the LM's bound, the least its flow and vocoder calls need), and the most
    those calls may need (`flow_bound`, `hift_bound`: a batched model's rows join on them)."""

    def tokens(request: SynthesisRequest | None) -> int:
        """Text tokens of the request's longest segment (0 when they cannot be known yet)."""
        if request is None or not isinstance(request.text, str):
            return 0
        try:
            return max(segment_tokens(request.text), default=0)
        except Exception:  # the request fails on its text when it runs; admission is not where to say so
            return 0

    def least_speech(request: SynthesisRequest | None) -> int:
        return 0 if version == 3 else MIN_TOKEN_TEXT_RATIO * tokens(request)

    def llm(request: SynthesisRequest | None) -> int:
        text = tokens(request) or BOUND_TEXT_TOKENS
        # text streamed in (or not known yet) grows a dynamic cache, whatever the model's kind
        return lm.bound(text, grown=request is None or not isinstance(request.text, str))

    def flow_least(request: SynthesisRequest | None) -> int:
        speech = least_speech(request)
        return flow(speech, mel_frames(speech))

    def hift_least(request: SynthesisRequest | None) -> int:
        return hift(mel_frames(least_speech(request)))

    def most_speech(request: SynthesisRequest | None) -> int:
        """Speech tokens a call may run on: upstream's cap for the text, and a voice prompt at the LM's prompt cap."""
        return MAX_TOKEN_TEXT_RATIO * (tokens(request) or BOUND_TEXT_TOKENS) + PROMPT_POSITIONS_CAP

    def flow_most(request: SynthesisRequest | None) -> int:
        speech = most_speech(request)
        return flow(speech, mel_frames(speech))

    def hift_most(request: SynthesisRequest | None) -> int:
        return hift(mel_frames(most_speech(request)))

    return {"llm": llm, "flow": flow_least, "hift": hift_least, "flow_bound": flow_most, "hift_bound": hift_most}
