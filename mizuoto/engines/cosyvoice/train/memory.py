"""`training.memory`: gradient checkpointing over the blocks of the LM or the flow.

Each block's activations are dropped after its forward and recomputed during backward, with
the random state of its forward restored (non-reentrant torch.utils.checkpoint), so dropout
masks, losses, gradients and weights are exactly those of training without it; only the
activations held between forward and backward shrink to the blocks' inputs. Blocks are patched
on the instance (their forward wrapped), so parameter names and checkpoints do not change.
Qwen's decoder layers are checkpointed by the LM's own training forward (lm_loss.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mizuoto.nn.flow.unet1d import BasicTransformerBlock, ResnetBlock1D
from mizuoto.nn.transformer.dit import DiTBlock
from mizuoto.nn.transformer.wenet import ConformerEncoderLayer, TransformerEncoderLayer

BLOCKS = (TransformerEncoderLayer, ConformerEncoderLayer, BasicTransformerBlock, ResnetBlock1D, DiTBlock)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)
    return run


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every block of the model in gradient checkpointing; the number of blocks wrapped."""
    count = 0
    for module in model.modules():
        if isinstance(module, BLOCKS) and "forward" not in module.__dict__:
            module.forward = _checkpointed(module.forward)
            count += 1
    return count


def activation_bytes(model: nn.Module, forward, batch: dict, device: torch.device) -> int:
    """Bytes of the tensors autograd holds for backward after one training forward (parameters excluded).

    Storages are counted once each, so views of one activation count once; this is the memory
    gradient checkpointing trades for recomputation (peak memory of a step is this plus the
    weights, gradients, optimizer state and one block's recomputed activations).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward(batch, device)["loss"]
    del loss
    return sum(held.values())
