"""CAM++ speaker encoder (3D-Speaker), in the exported campplus.onnx graph's shape or PyTorch's.

Folded (`folded=True`, CosyVoice's campplus.onnx): the export folds every batch norm that
directly follows a convolution into that convolution (head convs, shortcuts, the TDNN, each
dense layer's bottleneck, the last transit), so those convolutions carry a bias and the folded
norms are absent; the remaining norms (before ReLUs and the final one) are kept.
Unfolded (`folded=False`, 3D-Speaker's PyTorch module as Chatterbox's S3Gen holds it): every
convolution is bias-free and followed by its own BatchNorm, evaluated in PyTorch's op order, all
in float32 (upstream runs it in torch, so its own rounding is the reference).
Input: the mean-normalized 80-bin kaldi fbank [B, T, F]; output: the speaker embedding [B, E]
(192 in CosyVoice and Chatterbox).

CosyVoice runs it on onnxruntime's CPU provider only, and on a GPU its convolutions move the
embedding by ~2.4e-4, so it is a fixed module: it always runs on the CPU (`fixed_device`).
Folded, `forward` uses torch's kernels (within ~1e-5 of onnxruntime, relative); campplus_ort.py
evaluates the same folded module in onnxruntime's float32 order (its numbers exactly, much
slower), for the training features. Unfolded, `forward` is torch.equal to 3D-Speaker's PyTorch
module on the CPU (Chatterbox's recorded x-vectors).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn


class BatchNorm(nn.Module):
    """Inference batch norm: running mean and variance, and (when affine) scale and bias."""

    def __init__(self, channels: int, eps: float, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.affine = affine
        for name in ("weight", "bias", "running_mean", "running_var") if affine else ("running_mean", "running_var"):
            self.register_buffer(name, torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        weight, bias = (self.weight.to(dt), self.bias.to(dt)) if self.affine else (None, None)
        return F.batch_norm(x, self.running_mean.to(dt), self.running_var.to(dt), weight, bias, False, 0.0, self.eps)


def _bn(norm: BatchNorm | None, x: torch.Tensor) -> torch.Tensor:
    """The norm after a convolution, when it was not folded into it."""
    return x if norm is None else norm(x)


class _Norm(nn.Module):
    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.batchnorm = BatchNorm(channels, eps)

    def forward(self, x):
        return F.relu(self.batchnorm(x))


class ResBlock(nn.Module):
    """FCM residual block: conv-(BN)-ReLU-conv-(BN) plus a (strided 1x1 conv-(BN)) shortcut, then ReLU."""

    def __init__(self, channels: int, stride: int, shortcut: bool, folded: bool = True, eps: float = 1e-5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=(stride, 1), padding=1, bias=folded)
        self.bn1 = None if folded else BatchNorm(channels, eps)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=folded)
        self.bn2 = None if folded else BatchNorm(channels, eps)
        short = [nn.Conv2d(channels, channels, 1, stride=(stride, 1), bias=folded)] if shortcut else []
        if shortcut and not folded:
            short.append(BatchNorm(channels, eps))
        self.shortcut = nn.Sequential(*short)

    def forward(self, x):
        out = F.relu(_bn(self.bn1, self.conv1(x)))
        return F.relu(_bn(self.bn2, self.conv2(out)) + self.shortcut(x))


class FCM(nn.Module):
    """2-D front end over (frequency, time); frequency is folded into channels at the end."""

    def __init__(self, channels: int, layers: list[list[list[int]]], conv2_stride: int, folded: bool = True,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=folded)
        self.bn1 = None if folded else BatchNorm(channels, eps)
        for i, blocks in enumerate(layers, start=1):
            self.add_module(f"layer{i}", nn.Sequential(*(ResBlock(channels, s, bool(sc), folded, eps)
                                                         for s, sc in blocks)))
        self.n_layers = len(layers)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(conv2_stride, 1), padding=1, bias=folded)
        self.bn2 = None if folded else BatchNorm(channels, eps)

    def forward(self, x):
        x = F.relu(_bn(self.bn1, self.conv1(x.unsqueeze(1))))
        for i in range(1, self.n_layers + 1):
            x = getattr(self, f"layer{i}")(x)
        x = F.relu(_bn(self.bn2, self.conv2(x)))
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], x.shape[3])


class CAMLayer(nn.Module):
    """Context-aware masking: a local conv gated by utterance- and segment-level context."""

    def __init__(self, channels: int, out: int, hidden: int, kernel: int, dilation: int, seg_len: int) -> None:
        super().__init__()
        self.seg_len = seg_len
        self.linear_local = nn.Conv1d(channels, out, kernel, padding=(kernel - 1) // 2 * dilation,
                                      dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(channels, hidden, 1)
        self.linear2 = nn.Conv1d(hidden, out, 1)

    def forward(self, x):
        y = self.linear_local(x)
        t = x.shape[-1]
        # segment means (last segment over its valid frames), each repeated over its segment
        seg = F.avg_pool1d(x, self.seg_len, self.seg_len, ceil_mode=True)
        seg = seg.unsqueeze(-1).expand(*seg.shape, self.seg_len).reshape(*seg.shape[:2], -1)[..., :t]
        context = x.mean(-1, keepdim=True) + seg
        return y * torch.sigmoid(self.linear2(F.relu(self.linear1(context))))


class DenseLayer(nn.Module):
    """BN-ReLU, bottleneck 1x1 conv, BN (folded into the conv, or its own) + ReLU, CAM layer."""

    def __init__(self, channels: int, bn_channels: int, growth: int, cam_hidden: int,
                 kernel: int, dilation: int, seg_len: int, eps: float, folded: bool = True) -> None:
        super().__init__()
        self.nonlinear1 = _Norm(channels, eps)
        self.linear1 = nn.Conv1d(channels, bn_channels, 1, bias=folded)
        self.nonlinear2 = None if folded else _Norm(bn_channels, eps)
        self.cam_layer = CAMLayer(bn_channels, growth, cam_hidden, kernel, dilation, seg_len)

    def forward(self, x):
        x = self.linear1(self.nonlinear1(x))
        return self.cam_layer(F.relu(x) if self.nonlinear2 is None else self.nonlinear2(x))


class Transit(nn.Module):
    """BN-ReLU then a 1x1 conv (biased when a following batch norm was folded into it)."""

    def __init__(self, channels: int, out: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.nonlinear = _Norm(channels, eps)
        self.linear = nn.Conv1d(channels, out, 1, bias=bias)

    def forward(self, x):
        return self.linear(self.nonlinear(x))


class CAMPPlus(nn.Module):
    """CAM++: fbank [B, T, F] (or [T, F]) -> speaker embedding [B, E]; always on the CPU."""

    fixed_device = torch.device("cpu")

    def __init__(self, *, feat_dim: int, head_channels: int, head_layers: list[list[list[int]]],
                 head_conv2_stride: int, tdnn: dict, blocks: list[dict], transits: list[dict],
                 embedding_size: int, seg_len: int, eps: float, out_batchnorm: bool = False,
                 folded: bool = True, dense_affine: bool = True) -> None:
        super().__init__()
        self.feat_dim = feat_dim
        self.folded = folded
        self.head = FCM(head_channels, head_layers, head_conv2_stride, folded, eps)
        freq = feat_dim
        for blocks_of_layer in head_layers:
            for stride, _ in blocks_of_layer:
                freq = (freq - 1) // stride + 1
        freq = (freq - 1) // head_conv2_stride + 1
        xvector = nn.Module()
        xvector.tdnn = nn.Module()
        xvector.tdnn.linear = nn.Conv1d(head_channels * freq, tdnn["out"], tdnn["kernel"],
                                        stride=tdnn["stride"], padding=tdnn["padding"],
                                        dilation=tdnn["dilation"], bias=folded)
        if not folded:
            xvector.tdnn.nonlinear = _Norm(tdnn["out"], eps)
        channels = tdnn["out"]
        self.n_blocks = len(blocks)
        for b, (spec, transit) in enumerate(zip(blocks, transits, strict=True), start=1):
            block = nn.Module()
            for i in range(1, spec["layers"] + 1):
                block.add_module(f"tdnnd{i}", DenseLayer(
                    channels, spec["bn_channels"], spec["growth"], spec["cam_hidden"],
                    spec["kernel"], spec["dilation"], seg_len, eps, folded))
                channels += spec["growth"]
            xvector.add_module(f"block{b}", block)
            xvector.add_module(f"transit{b}", Transit(channels, transit["out"], transit["bias"], eps))
            channels = transit["out"]
        if out_batchnorm:
            xvector.out_nonlinear = _Norm(channels, eps)
        xvector.dense = nn.Module()
        xvector.dense.linear = nn.Conv1d(channels * 2, embedding_size, 1, bias=False)
        xvector.dense.nonlinear = nn.Module()
        xvector.dense.nonlinear.batchnorm = BatchNorm(embedding_size, eps, affine=dense_affine)
        self.xvector = xvector
        self.out_batchnorm = out_batchnorm

    @property
    def device(self) -> torch.device:
        """Where the weights are; the engine keeps this module on `fixed_device`."""
        return next(self.parameters()).device

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Embedding [B, E] of mean-normalized fbank features [B, T, F]; computed on the module's device."""
        if feats.dim() == 2:
            feats = feats.unsqueeze(0)
        if feats.dim() != 3 or feats.shape[-1] != self.feat_dim:
            raise ValueError(f"CAM++ wants fbank [B, T, {self.feat_dim}], got {tuple(feats.shape)}")
        xv = self.xvector
        weight = self.head.conv1.weight
        x = self.head(feats.to(weight.device, weight.dtype).transpose(1, 2))
        x = xv.tdnn.linear(x)
        x = F.relu(x) if self.folded else xv.tdnn.nonlinear(x)
        for b in range(1, self.n_blocks + 1):
            for layer in getattr(xv, f"block{b}").children():
                x = torch.cat([x, layer(x)], dim=1)
            x = getattr(xv, f"transit{b}")(x)
        x = xv.out_nonlinear(x) if self.out_batchnorm else F.relu(x)
        if not self.folded:
            # PyTorch's statistics pooling (unbiased std) and 1x1 projection, in float32 as upstream
            stats = torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)
            return xv.dense.nonlinear.batchnorm(xv.dense.linear(stats.unsqueeze(-1)).squeeze(-1))
        # The last norm divides by sqrt(running_var), which magnifies float32 rounding of the
        # pooled statistics and of the 1x1 projection; both are cheap, so they run in float64.
        x = x.double()
        n = x.shape[-1]
        centered = x - x.mean(-1, keepdim=True)
        std = torch.sqrt((centered * centered).mean(-1) * n / (n - 1))  # unbiased, as exported
        stats = torch.cat([x.mean(-1), std], dim=-1)
        emb = F.conv1d(stats.unsqueeze(-1), xv.dense.linear.weight.double()).squeeze(-1)
        return xv.dense.nonlinear.batchnorm(emb).to(weight.dtype)
