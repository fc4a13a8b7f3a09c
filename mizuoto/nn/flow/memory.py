"""Working memory of one call of a token-to-mel flow (conformer encoder + U-Net or DiT estimator).

The figure models what runs on the CPU (resident growth of the process while the call runs, with
the runtime's allocator settings: runtime.malloc) and is an upper bound on CUDA, whose fused
attention kernels hold no more. Constants measured with `mizuoto bench --memory` on CosyVoice's
fixture and full-size random models (docs/memory.md, "Calibration"; Intel Xeon, 2 threads,
torch 2.13.0, 2026-12-03; the U-Net's terms refitted on CosyVoice 1's on an AMD EPYC, 2026-12-05). `tokens` go into the encoder, `frames` are what the decoder runs on:
the encoder and the decoder run one after the other, so the call needs the larger of the two. Each
holds (T x T) float matrices: the conformer's relative-position attention RELPOS_SQUARE per head,
and RELPOS_LINEAR floats per position and head (T = tokens before the upsampling, frames after);
the U-Net's one per CFG row and head (its additive mask repeated per head) and UNET_ROW_COPIES per
row; the DiT's DIT_COPIES per CFG row (its boolean mask broadcast over heads). The estimator's
activations linear in the frames: copies of its stacked input and of its width per frame and row,
and a part whatever the frames (per channel of the U-Net's width, per unit of the DiT's). FIXED_BYTES
(`nn.memory`) adds the heap's allowance to every call.
"""

from __future__ import annotations

from torch import nn

from mizuoto.nn.flow.unet1d import Attention as UNetAttention
from mizuoto.nn.memory import FIXED_BYTES, FLOAT
from mizuoto.nn.transformer.attention import RelPositionMultiHeadedAttention
from mizuoto.nn.transformer.dit import Attention as DiTAttention

CFG_ROWS = 2  # the flow's estimator runs the conditioned and the unconditioned row together
# conformer self-attention with relative positions, per head (batch of one): (T x T) floats live at
# once (scores, position scores, their sum, softmax, masked copies) and per-position buffers
RELPOS_SQUARE, RELPOS_LINEAR = 6.8, 1900
UNET_ROW_COPIES = 1.2  # U-Net attention per CFG row: the mask repeated per head (one copy each), + this
DIT_COPIES = 1.3  # DiT attention per CFG row: its boolean mask broadcast over heads, and its float form
# the estimator's activations per frame and CFG row, in copies of its stacked input (320 channels
# in every released and fixture model) and of its width: the U-Net's widest convolution (80 and 256
# channels), the DiT's model width (32 and 1024); fitted on the fixture and the full-size models (the U-Net's
# width term and its fixed part on CosyVoice 1's full-size estimator, measured alone: 18, 53 and 200 MiB at
# 215, 559 and 1421 frames, AMD EPYC 2026-12-05; a fixed 3 MiB and 11.7 copies left it 6-16 MiB short there)
UNET_INPUT_COPIES, UNET_CHANNEL_COPIES = 1.9, 18.5
UNET_FIXED_PER_WIDTH = 36 << 10  # its timestep embedding, per-block buffers and kernel workspaces: 9 MiB at width 256
DIT_INPUT_COPIES, DIT_WIDTH_COPIES = 4.1, 7.6
DIT_FIXED_PER_WIDTH = 12 << 10  # whatever the frames: 12 MiB at the released width (its weights' kernel workspaces)


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
            self.fixed = UNET_FIXED_PER_WIDTH * convs
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

