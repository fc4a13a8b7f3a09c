"""Working memory of the CosyVoice stages: each call's figure from its sizes, and what a request is admitted with.

Each figure models what runs on the CPU (resident growth of the process while the call runs, with
the runtime's allocator settings: runtime.malloc) and is an upper bound on CUDA, whose fused
attention kernels hold no more. The constants below were measured with `mizuoto bench --memory`
on the fixture models and full-size random models (docs/memory.md, "Calibration"; Intel Xeon,
2 threads, torch 2.13.0, 2026-12-03):

- **LM** (`positions`, `rows`, `prefill`): per row, the KV cache of every layer at `positions`,
  held LM_CACHE_COPIES times while it grows (Qwen2's cache is grown by concatenation, and its
  growing buffers fragment glibc's arenas; v1's wenet cache is rebuilt per block each step and
  stacked: three copies), the prefill's activations (LM_PREFILL_WIDTHS of its widest layer per
  prompt position) and each row's logits.
- **Flow** (`tokens` into the encoder, `frames` the decoder runs on): the encoder and the decoder
  run one after the other, so the call needs the larger of the two. Each holds (T x T) float
  matrices: the conformer's relative-position attention RELPOS_SQUARE per head, and RELPOS_LINEAR
  floats per position and head (T = tokens before the upsampling, frames after; the same on the
  fixture and the released sizes); the U-Net's one per CFG row and head (its additive mask repeated
  per head) and UNET_ROW_COPIES per row; the DiT's DIT_COPIES per CFG row (its boolean mask
  broadcast over heads). The estimator's activations linear in the frames: copies of its stacked
  input and of its width per frame and row (UNET_*_COPIES, DIT_*_COPIES).
- **Vocoder** (`frames` of mel): linear in the samples it makes: the harmonic source at the
  output rate and its densest upsampled activation.

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
from mizuoto.nn.flow.unet1d import Attention as UNetAttention
from mizuoto.nn.transformer.attention import RelPositionMultiHeadedAttention
from mizuoto.nn.transformer.dit import Attention as DiTAttention
from mizuoto.runtime.engine import SynthesisRequest

FLOAT = 4
CFG_ROWS = 2  # the flow's estimator runs the conditioned and the unconditioned row together
# conformer self-attention with relative positions, per head (batch of one): (T x T) floats live at
# once (scores, position scores, their sum, softmax, masked copies) and per-position buffers
RELPOS_SQUARE, RELPOS_LINEAR = 6.8, 1900
UNET_ROW_COPIES = 1.2  # U-Net attention per CFG row: the mask repeated per head (one copy each), + this
DIT_COPIES = 1.3  # DiT attention per CFG row: its boolean mask broadcast over heads, and its float form
# the estimator's activations per frame and CFG row, in copies of its stacked input (320 channels
# in every released and fixture model) and of its width: the U-Net's widest convolution (80 and 256
# channels), the DiT's model width (32 and 1024); fitted on the fixture and the full-size models
UNET_INPUT_COPIES, UNET_CHANNEL_COPIES = 1.9, 11.7
UNET_FIXED_BYTES = 3 << 20  # its timestep embedding and per-block buffers, whatever the frames
DIT_INPUT_COPIES, DIT_WIDTH_COPIES = 4.1, 7.6
DIT_FIXED_PER_WIDTH = 12 << 10  # whatever the frames: 12 MiB at the released width (its weights' kernel workspaces)
# the vocoder per output sample: its harmonic source, and HIFT_CHANNEL_COPIES of its densest
# upsampled activation (channels x positions per sample: 16 floats for the released 512-channel
# HiFT, under 1 for the fixture's); its short calls' small buffers stay in glibc's arenas
HIFT_SOURCE_BYTES, HIFT_CHANNEL_COPIES = 240, 6.9
HIFT_FIXED_BYTES, HIFT_FIXED_PER_CHANNEL = 6.5 * (1 << 20), 0.75 * (1 << 20)
# the LM: its cache 1.5 times while it grows (the old beside the new; growing buffers fragment
# glibc's arenas); a prefill's activations per position, in widths of its widest layer
LM_CACHE_COPIES = 1.5
LM_PREFILL_WIDTHS = 6
FIXED_BYTES = 1 << 20  # what any call allocates whatever its size (kernel workspaces, small buffers)


def _widest(module: nn.Module) -> int:
    widths = [m.out_channels for m in module.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    widths += [m.out_features for m in module.modules() if isinstance(m, nn.Linear)]
    return max(widths, default=1)


# ---- the LM ---------------------------------------------------------------------------------------

class LmMemory:
    """The LM's call figure: `rows` requests of `positions` positions each, their prompts `prefill` positions."""

    def __init__(self, lm: nn.Module):
        if isinstance(lm, QwenSpeechLM):  # its dynamic cache grows one layer at a time (torch.cat)
            cfg = lm.llm.config
            self.per_position = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * FLOAT
            self.width, self.copies = max(cfg.intermediate_size, cfg.hidden_size), LM_CACHE_COPIES
        elif isinstance(lm, TransformerSpeechLM):  # wenet's forward_chunk rebuilds every block's cache and stacks them
            self.per_position = len(lm.llm.encoders) * 2 * lm.llm.output_size() * FLOAT
            self.width, self.copies = _widest(lm.llm), 3
        else:
            raise TypeError(f"not a CosyVoice LM: {type(lm).__name__}")
        self.vocab = _widest(lm.llm_decoder) if hasattr(lm, "llm_decoder") else self.width

    def __call__(self, positions: int, rows: int = 1, prefill: int = 0) -> int:
        """Bytes for `rows` requests of `positions` positions each, `prefill` of them fed at once.

        A batch runs its prefills one at a time (runtime.batching), so one prefill's activations count.
        """
        cache = self.copies * self.per_position * positions
        # the head scores each row's last position only
        activations = (max(prefill, rows) * LM_PREFILL_WIDTHS * self.width + rows * self.vocab) * FLOAT
        return int(rows * cache + activations + FIXED_BYTES)

    def bound(self, text_tokens: int) -> int:
        """Its figure at upstream's cap: a prompt of PROMPT_POSITIONS_CAP, MAX_TOKEN_TEXT_RATIO speech tokens per text token."""
        prefill = PROMPT_POSITIONS_CAP + text_tokens
        return self(prefill + MAX_TOKEN_TEXT_RATIO * text_tokens, prefill=prefill)


# ---- the flow -------------------------------------------------------------------------------------

class FlowMemory:
    """The flow's call figure over `tokens` encoder tokens and `frames` decoder frames (see the module docstring)."""

    def __init__(self, flow: nn.Module):
        self.encoder_sites: list[tuple[str, int]] = []  # (rate, heads) of each conformer attention stack
        encoder = getattr(flow, "encoder", None)
        if encoder is not None:
            for stack, rate in (("encoders", "tokens"), ("up_encoders", "frames")):
                heads = [m.h for m in getattr(encoder, stack, nn.ModuleList()).modules()
                         if isinstance(m, RelPositionMultiHeadedAttention)]
                if heads:
                    self.encoder_sites.append((rate, max(heads)))
        estimator = flow.decoder.estimator
        unet = [m.heads for m in estimator.modules() if isinstance(m, UNetAttention)]
        dit = [m for m in estimator.modules() if isinstance(m, DiTAttention)]
        if unet:
            convs = max(m.out_channels for m in estimator.modules() if isinstance(m, nn.Conv1d))
            self.copies, self.kind = max(unet) + UNET_ROW_COPIES, "unet"
            self.per_frame = UNET_INPUT_COPIES * estimator.in_channels + UNET_CHANNEL_COPIES * convs
            self.fixed = UNET_FIXED_BYTES
        elif dit:
            proj = estimator.input_embed.proj
            self.copies, self.kind = DIT_COPIES, "dit"
            self.per_frame = DIT_INPUT_COPIES * proj.in_features + DIT_WIDTH_COPIES * proj.out_features
            self.fixed = DIT_FIXED_PER_WIDTH * proj.out_features
        else:
            raise TypeError(f"no known attention in the flow estimator {type(estimator).__name__}")

    def encoder(self, tokens: int, frames: int) -> float:
        """Bytes the encoder needs (0 without one): its widest attention site."""
        sizes = {"tokens": tokens, "frames": frames}
        return max((FLOAT * heads * (RELPOS_SQUARE * sizes[rate] ** 2 + RELPOS_LINEAR * sizes[rate])
                    for rate, heads in self.encoder_sites), default=0.0)

    def decoder(self, frames: int) -> float:
        """Bytes the estimator needs on `frames` (both CFG rows)."""
        return FLOAT * CFG_ROWS * (self.copies * frames ** 2 + self.per_frame * frames) + self.fixed

    def __call__(self, tokens: int, frames: int) -> int:
        """Bytes for one flow call."""
        return int(max(self.encoder(tokens, frames), self.decoder(frames)) + FIXED_BYTES)


# ---- the vocoder ----------------------------------------------------------------------------------

class HiftMemory:
    """The vocoder's call figure over `frames` mel frames."""

    def __init__(self, hift: nn.Module):
        self.samples_per_frame = hift.upsample_scale
        positions, densest = 1, 0.0
        for rate, up in zip(hift.upsample_rates, hift.ups):
            positions *= rate
            densest = max(densest, up.out_channels * positions / self.samples_per_frame)
        self.per_sample = HIFT_SOURCE_BYTES + HIFT_CHANNEL_COPIES * FLOAT * densest
        self.fixed = HIFT_FIXED_BYTES + HIFT_FIXED_PER_CHANNEL * densest

    def __call__(self, frames: int) -> int:
        """Bytes for one vocoder call."""
        return int(self.per_sample * self.samples_per_frame * frames + self.fixed)


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

    bound_tokens = 100  # a request of unknown text (streamed, or the planning figure): upstream's segment size

    def llm(request: SynthesisRequest | None) -> int:
        text = tokens(request) or bound_tokens
        return lm.bound(text)

    def flow_least(request: SynthesisRequest | None) -> int:
        speech = least_speech(request)
        return flow(speech, mel_frames(speech))

    def hift_least(request: SynthesisRequest | None) -> int:
        return hift(mel_frames(least_speech(request)))

    def most_speech(request: SynthesisRequest | None) -> int:
        """Speech tokens a call may run on: upstream's cap for the text, and a voice prompt at the LM's prompt cap."""
        return MAX_TOKEN_TEXT_RATIO * (tokens(request) or bound_tokens) + PROMPT_POSITIONS_CAP

    def flow_most(request: SynthesisRequest | None) -> int:
        speech = most_speech(request)
        return flow(speech, mel_frames(speech))

    def hift_most(request: SynthesisRequest | None) -> int:
        return hift(mel_frames(most_speech(request)))

    return {"llm": llm, "flow": flow_least, "hift": hift_least, "flow_bound": flow_most, "hift_bound": hift_most}
