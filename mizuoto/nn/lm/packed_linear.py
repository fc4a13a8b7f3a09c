"""Linear layers whose weights are reordered once for oneDNN, for a CPU batch of fixed width.

A batched decode step multiplies W rows at once. On the CPU, MKL's small matrix-matrix product
behind `F.linear` is far from bound by reading the weights; oneDNN's product over a weight
reordered in advance for that row count is much closer. Measured on the 2-vCPU Xeon this was
written on (torch 2.13.0, the 168 products of Qwen2-0.5B's layers): 8 rows 130 ms with `F.linear`,
74 ms packed; a 94-position prefill 297 vs 218 ms; one row 50 vs 61 ms, so the unbatched path
keeps `F.linear` (and upstream's numerics). At the packed width a row's result depends neither on
the other rows nor on its position (tests/nn/lm/test_packed_linear.py), which is what the batch
needs. The packed weight replaces the dense one: the same bytes, held as a buffer.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed here: float32 on the CPU of a torch built with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`linear` with its weight in oneDNN's layout for `rows`-row inputs (any row count still works)."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rows = linear.in_features, linear.out_features, rows
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.rows}"


def pack_linears(module: nn.Module, rows: int) -> int:
    """Replace each float32 CPU nn.Linear under `module` by a PackedLinear for `rows` rows; how many were."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and packing_available(child.weight):
                setattr(parent, name, PackedLinear(child, rows))
                count += 1
    return count
