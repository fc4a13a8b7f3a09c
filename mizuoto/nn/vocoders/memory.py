"""Working memory of one HiFT vocoder call over `frames` mel frames: linear in the samples it makes.

Its harmonic source at the output rate and HIFT_CHANNEL_COPIES of its densest upsampled activation
(channels x positions per sample: 16 floats for the released 512-channel HiFT, under 1 for
CosyVoice's fixture); its short calls' small buffers stay in glibc's arenas, and the heap's
allowance (`nn.memory.HEAP_PACKING_BYTES`) comes on top. Measured with
`mizuoto bench --memory` (docs/memory.md, "Calibration"; Intel Xeon, 2 threads, torch 2.13.0,
2026-12-03); CPU resident growth, an upper bound on CUDA.
"""

from __future__ import annotations

from torch import nn

from mizuoto.nn.memory import FLOAT, HEAP_PACKING_BYTES

HIFT_SOURCE_BYTES, HIFT_CHANNEL_COPIES = 240, 6.9
HIFT_FIXED_BYTES, HIFT_FIXED_PER_CHANNEL = 6.5 * (1 << 20), 0.75 * (1 << 20)


class HiftMemory:
    """The vocoder's call figure over `frames` mel frames."""

    def __init__(self, hift: nn.Module):
        self.samples_per_frame = hift.upsample_scale
        positions, densest = 1, 0.0
        for rate, up in zip(hift.upsample_rates, hift.ups):
            positions *= rate
            densest = max(densest, up.out_channels * positions / self.samples_per_frame)
        self.per_sample = HIFT_SOURCE_BYTES + HIFT_CHANNEL_COPIES * FLOAT * densest
        self.fixed = HIFT_FIXED_BYTES + HIFT_FIXED_PER_CHANNEL * densest + HEAP_PACKING_BYTES

    def __call__(self, frames: int) -> int:
        """Bytes for one vocoder call."""
        return int(self.per_sample * self.samples_per_frame * frames + self.fixed)

