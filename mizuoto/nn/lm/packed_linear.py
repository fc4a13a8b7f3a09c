"""Linear layers whose weights are stored in column blocks, for a CPU batch of fixed width.

A batched decode step multiplies W rows at once. On the CPU, MKL's small matrix-matrix product
behind `F.linear` is far from bound by reading the weights. Stored as (out / BLOCK, in, BLOCK)
blocks, each contiguous, the same product is one `bmm` of the rows against every block, much
closer to it. Measured 2026-12-01 on the 2-vCPU Xeon this was written on (torch 2.13.0, the 168
products of Qwen2-0.5B's layers alone, 1.43 GB; a plain read of as many bytes ~47 ms): 8 rows
131 ms with `F.linear`, 72 ms with the weights reordered for oneDNN (`_reorder_linear_weight`,
which this module used before), 65 ms in blocks; 2 / 4 / 16 rows 56 / 62 / 84 ms in blocks
against 64 / 63 / 90 ms reordered. In a whole width-8 step of that model the blocks save less
than the products alone suggest (86 vs 87-88 ms with one row busy, 95-96 vs 97-99 ms with eight;
a 95-position prefill 240-247 vs 252-256 ms), and they need no private oneDNN operator. One row
stays with `F.linear` (50 ms) and upstream's numerics in the unbatched path. At a fixed row count
a row's result depends neither on the other rows nor on its position
(tests/nn/lm/test_packed_linear.py), which is what the batch needs: MKL's sgemm takes the rows in
panels, and a row in a partial last panel goes through an edge kernel that sums in another order
(its AVX2 kernels: panels of ROW_PANEL rows, rows 7-9 of 9 differ by place), so the rows are
zero-padded to whole panels first (on AVX-512 no row depends on its place at any count; 8 rows
now multiply 12, the figures above predate that). The blocks replace the dense weight: the same
bytes, as a buffer (plus zero columns that fill the last block when `out` is not a multiple of BLOCK).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.nn.host_memory import return_freed_memory

BLOCK = 32  # output columns per block; at 8 rows, blocks of 8 / 16 / 32 / 64 / 128 took 97 / 68 / 63 / 86 / 90 ms
ROW_PANEL = 6  # rows per panel of MKL's AVX2 sgemm kernel (6 x 16): rows are padded to whole panels


def packing_available(weight: torch.Tensor) -> bool:
    """Whether `weight` (out, in) is stored in blocks here: float32 on the CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


class PackedLinear(nn.Module):
    """`linear` with its weight as (out / BLOCK, in, BLOCK) contiguous blocks: one `bmm` per call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight, fill = linear.weight.detach(), -self.out_features % BLOCK
            if fill:  # zero columns fill the last block (F.pad copies even when it adds nothing)
                weight = F.pad(weight, (0, 0, 0, fill))
            blocks = weight.reshape(-1, BLOCK, self.in_features).transpose(1, 2).contiguous()
        self.register_buffer("packed", blocks)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        if n % ROW_PANEL:  # every row in a whole panel: its bits depend neither on its place nor on n
            rows = F.pad(rows, (0, 0, 0, -n % ROW_PANEL))
        # (blocks, N, in) @ (blocks, in, BLOCK): the rows are broadcast, each block read once
        out = torch.bmm(rows.expand(self.packed.shape[0], *rows.shape), self.packed)
        out = out.transpose(0, 1)[:n].reshape(*x.shape[:-1], -1)
        if out.shape[-1] != self.out_features:
            out = out[..., :self.out_features].contiguous()
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={BLOCK}"


def _return_freed_memory() -> None:
    # glibc keeps freed heap pages mapped: without this, the dense weights freed while packing
    # stay in the process's memory beside their blocks (measured: +0.55 GiB for Qwen2-0.5B)
    return_freed_memory()


def pack_linears(module: nn.Module) -> int:
    """Replace each nn.Linear under `module` whose weight `packing_available` allows by a PackedLinear; how many were.

    Each dense weight is freed, and its memory given back, before the next is packed, so the
    process never holds much more than one copy of the layers.
    """
    places = [(parent, name) for parent in module.modules() for name, child in parent.named_children()
              if isinstance(child, nn.Linear) and packing_available(child.weight)]
    for parent, name in places:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
        _return_freed_memory()  # the dense layer has no reference left
    return len(places)
