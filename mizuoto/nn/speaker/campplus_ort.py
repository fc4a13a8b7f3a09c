"""CAM++ evaluated in onnxruntime's CPU float32 order: upstream's training embeddings, number for number.

Upstream's tools/extract_embedding.py runs campplus.onnx on onnxruntime's CPU provider with every
graph optimisation (ORT_ENABLE_ALL) on one intra-op thread. The network is sensitive to float32
rounding: its last batch norm scales values near the running mean by up to ~10 (the fixture
models), so a one-ulp change anywhere upstream reaches the embedding amplified. `CAMPPlus.forward`
(torch's kernels) ends up ~2.4e-5 (max abs) from onnxruntime, and onnxruntime itself with its
graph optimisations off is ~2e-5 from its optimised self: neither order stays within 6e-6. So
`forward_ort_order` performs every float32 operation the way onnxruntime's optimised graph does on
x86-64 (MLAS and Eigen kernels; each rule below was checked against onnxruntime 1.32's
intermediate tensors):

- 2-D head convolutions: the NCHWc transformer's convolutions (16-channel blocks, AVX-512): per
  output, a fused multiply-add chain from 0 over (kernel row, kernel column, channel) within each
  kernel call (one call per 16-channel input block; the pointwise shortcut takes up to 128
  channels per call, the 1-channel first conv one call), calls added in order; the residual Add is
  fused (the output starts as the shortcut), then bias, then ReLU.
- 1-D convolutions: MLAS SGEMM (weights x im2col, channel-major rows): a fused multiply-add chain
  from 0 over each K slice (128 wide; 256, 512, 1024 for outputs of at most 64, 32, 16 frames),
  slices added; then bias, then the fused activation. A one-frame output (the pooled statistics) takes
  the matrix-vector kernel instead: 8 lanes of multiply-then-add, lanes reduced in its order.
- sigmoid: MLAS's rational approximation (Eigen's coefficients, its FMA3 kernel's order), not exp.
- means over time: Eigen's vectorised sum (4-lane packets from the row's first 16-byte aligned
  element, two accumulators, pairwise lane reduction), then one division.
- segment means (AveragePool, ceil mode): sequential sums, divided by the frames present.
- batch norm: y = x * s + (beta - mean * s) with s = gamma * (1 / sqrt(var + eps)), each rounded.
- sqrt is the correctly rounded one (onnxruntime's is; torch's float32 CPU sqrt is not).

The chains use torch's float32 addcmul where this build fuses it (checked once at run time); else
each step is computed in float64 and rounded (as the logistic's multiply-adds always are), which
matches a hardware fused multiply-add unless the float64 sum was itself rounded and landed exactly
on a float32 half-way point (rare; never seen on the fixtures). On the training and front-end
fixtures every embedding equals onnxruntime's bit for bit, as on random inputs of 3 to 511 frames
and on batches.

It costs about a second per utterance of a few seconds (the chains advance one K step at a time;
run it unthreaded), so only the training features stage uses it; inference keeps `CAMPPlus.forward`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from mizuoto.nn.speaker.campplus import BatchNorm, CAMPPlus

NCHWC_BLOCK = 16  # onnxruntime's NCHWc block on AVX-512 CPUs (the fixtures were recorded on one)
_SGEMM_STRIDE = 128  # MLAS's default N and K slice of a GEMM

# MLAS logistic: p(x) / q(x) + 0.5 on x clamped to [-18, 18] (Eigen's rational approximation).
_LOGISTIC_RANGE = 18.0
_ALPHA = tuple(float(torch.tensor(c, dtype=torch.float32)) for c in (  # x^9 .. x^1, as float32
    4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05, 8.51377133304701e-03, 2.48287947061529e-01))
_BETA = tuple(float(torch.tensor(c, dtype=torch.float32)) for c in (  # x^10 .. x^0, as float32
    6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06, 1.70198817374094e-03, 1.16817656904453e-01,
    9.93151921023180e-01))


def _fma(a: Tensor, b, c) -> Tensor:
    """float32 fused multiply-add round(a * b + c) of float32 tensors (or float32-valued numbers),
    through float64 (the product is exact there)."""
    a64 = a.double()
    b64 = b.double() if isinstance(b, Tensor) else b
    c64 = c.double() if isinstance(c, Tensor) else c
    return (a64 * b64 + c64).float()


def _sqrt(x: Tensor) -> Tensor:
    """Correctly rounded float32 sqrt (torch's float32 CPU sqrt is not: ~0.7% of values are one ulp
    off); through float64, whose rounding back to float32 is exact for a square root."""
    return torch.sqrt(x.double()).float()


def _k_slice(n: int, k: int) -> int:
    """The K slice of an MLAS GEMM (or convolution) with n output columns: 128, doubled for each
    halving of the N slice (128 down to 16) that n still fits in when n < K. (When n >= K, MLAS
    only narrows the slice below 128 while K fits in half of it, which cannot split K.)"""
    stride_n, stride_k = _SGEMM_STRIDE, _SGEMM_STRIDE
    if n < k:
        while stride_n > 16 and stride_n // 2 >= n:
            stride_k *= 2
            stride_n //= 2
    return stride_k


@functools.cache
def _fused_addcmul() -> bool:
    """Whether torch's float32 addcmul rounds once (is a fused multiply-add) on this build and CPU,
    for the operand layouts the chains use (broadcast column x row, strided taps, vector tails).
    If so the chains run in float32; else each step is computed in float64 and stored rounded,
    which gives the same numbers about ten times slower."""
    a = torch.tensor(1.0 + 2.0 ** -12)  # a * a = 1 + 2^-11 + 2^-24: its float32 rounding loses 2^-24
    c = -(1.0 + 2.0 ** -11)
    cases = [
        (torch.full((19, 37), c), a.expand(19, 1), a.expand(1, 37)),
        (torch.full((5, 9, 21), c), torch.full((9, 44), float(a))[:, 1:43:2], a.expand(5, 1, 1)),
        (torch.full((3,), c), a.expand(3), a.expand(3)),
    ]
    return all(bool((torch.addcmul(acc, x, y) == 2.0 ** -24).all()) for acc, x, y in cases)


def _chain_operand(t: Tensor) -> Tensor:
    """A chain's multiplicand: float32 when addcmul is fused, else float64."""
    return t.float() if _fused_addcmul() else t.double()


def _fma_chain(a: Tensor, b: Tensor, k0: int, k1: int) -> Tensor:
    """sum_k a[:, k] * b[k, :] for k in [k0, k1), one fused multiply-add at a time, from 0."""
    a, b = _chain_operand(a), _chain_operand(b)
    acc = torch.zeros(a.shape[0], b.shape[1])
    for k in range(k0, k1):
        torch.addcmul(acc, a[:, k:k + 1], b[k:k + 1, :], out=acc)  # float32 result, rounded once
    return acc


def _gemv(a: Tensor, x: Tensor) -> Tensor:
    """a [M, K] @ x [K]: MLAS's one-column kernel (AVX): 8 lane sums (multiply, then add), then
    the lanes of 4 (2, 1) rows at a time reduced in the kernel's order."""
    m, k = a.shape
    pad = (-k) % 8
    a8 = F.pad(a, (0, pad)).reshape(m, -1, 8)
    x8 = F.pad(x, (0, pad)).reshape(-1, 8)
    lanes = torch.zeros(m, 8)
    for j in range(a8.shape[1]):
        lanes = lanes + a8[:, j] * x8[j]
    out = torch.empty(m)
    rows4 = m - m % 4
    lo, hi = lanes[:rows4, :4], lanes[:rows4, 4:]
    out[:rows4] = (((lo[:, 0] + lo[:, 1]) + lo[:, 2]) + lo[:, 3]) + (((hi[:, 0] + hi[:, 1]) + hi[:, 2]) + hi[:, 3])
    r = rows4
    if m - r >= 2:
        v = lanes[r:r + 2]
        out[r:r + 2] = (((v[:, 2] + v[:, 0]) + (v[:, 6] + v[:, 4])) + ((v[:, 3] + v[:, 1]) + (v[:, 7] + v[:, 5])))
        r += 2
    if m - r == 1:
        v = lanes[r]
        out[r] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
    return out + 0.0  # the kernel adds the (zeroed) output


def _gemm(a: Tensor, b: Tensor, n_columns: int | None = None) -> Tensor:
    """a [M, K] @ b [K, N] as MLAS's SGEMM orders it; `n_columns` is the N the slicing is chosen
    for when b holds only some (distinct) columns of the real operand."""
    n = b.shape[1] if n_columns is None else n_columns
    k = a.shape[1]
    if n == 1:
        return _gemv(a, b[:, 0]).unsqueeze(1)
    step = _k_slice(n, k)
    out = None
    for k0 in range(0, k, step):
        part = _fma_chain(a, b, k0, min(k, k0 + step))
        out = part if out is None else part + out
    return out


def logistic(x: Tensor) -> Tensor:
    """MLAS's float32 logistic, in its FMA3 kernel's operation order (no upper clamp)."""
    v = x.clamp(-_LOGISTIC_RANGE, _LOGISTIC_RANGE)
    v2 = v * v
    p = _fma(v2, _ALPHA[0], _ALPHA[1])
    for c in _ALPHA[2:]:
        p = _fma(p, v2, c)
    q = _fma(v2, _BETA[0], _BETA[1])
    for c in _BETA[2:]:
        q = _fma(q, v2, c)
    return (v * p / q + 0.5).clamp(min=0.0)


def conv1d(x: Tensor, conv: torch.nn.Conv1d, activation: str | None = None,
           n_columns: int | None = None) -> Tensor:
    """One item's Conv1d [C, T] -> [O, T'] as onnxruntime's CPU Conv / FusedConv computes it."""
    weight = conv.weight.float()
    out_channels, _, kernel = weight.shape
    (stride,), (pad,), (dilation,) = conv.stride, conv.padding, conv.dilation
    if kernel == 1 and stride == 1 and pad == 0:
        cols = x
    else:
        xp = F.pad(x, (pad, pad))
        t_out = (x.shape[1] + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
        taps = [xp[:, j * dilation: j * dilation + stride * (t_out - 1) + 1: stride] for j in range(kernel)]
        cols = torch.stack(taps, 1).reshape(-1, t_out)  # rows: channel-major, kernel tap minor
    y = _gemm(weight.reshape(out_channels, -1), cols, n_columns)
    if conv.bias is not None:
        y = y + conv.bias.float()[:, None]
    if activation == "relu":
        return F.relu(y)
    if activation == "sigmoid":
        return logistic(y)
    return y


def _nchwc_chain(taps, weight: Tensor, channels: range, kh_n: int, kw_n: int) -> Tensor:
    """One NCHWc kernel call: a fused multiply-add chain over (row, column, channel) from 0."""
    weight = _chain_operand(weight)
    acc = None
    for kh in range(kh_n):
        for kw in range(kw_n):
            for c in channels:
                w = weight[:, c, kh, kw, None, None]
                if acc is None:
                    acc = (taps(c, kh, kw) * w).float()
                else:
                    torch.addcmul(acc, taps(c, kh, kw), w, out=acc)
    return acc


def conv2d_nchwc(x: Tensor, conv: torch.nn.Conv2d, relu: bool, residual: Tensor | None = None) -> Tensor:
    """One item's Conv2d [C, H, W] (stride along H only, as in CAM++'s head) through onnxruntime's
    NCHWc convolution, with its fused residual Add and ReLU."""
    weight = conv.weight.float()
    out_channels, channels, kh_n, kw_n = weight.shape
    (stride_h, stride_w), (pad_h, pad_w) = conv.stride, conv.padding
    if out_channels % NCHWC_BLOCK or (channels >= NCHWC_BLOCK and channels % NCHWC_BLOCK) or stride_w != 1:
        raise ValueError(f"CAM++ head conv {tuple(weight.shape)} stride {conv.stride}: not an NCHWc "
                         "convolution this evaluation reproduces")
    xp = _chain_operand(F.pad(x, (pad_w, pad_w, pad_h, pad_h)))
    h_out = (x.shape[1] + 2 * pad_h - kh_n) // stride_h + 1
    w_out = x.shape[2] + 2 * pad_w - kw_n + 1

    def taps(c: int, kh: int, kw: int) -> Tensor:
        return xp[c, kh: kh + stride_h * (h_out - 1) + 1: stride_h, kw: kw + w_out]

    if channels < NCHWC_BLOCK:  # NCHW-input kernel: one call per input channel
        calls = [range(c, c + 1) for c in range(channels)]
    elif kh_n == kw_n == 1 and pad_h == pad_w == 0:  # pointwise kernel: up to 128 channels per call
        calls = [range(c, min(channels, c + 128)) for c in range(0, channels, 128)]
    else:
        calls = [range(c, c + NCHWC_BLOCK) for c in range(0, channels, NCHWC_BLOCK)]
    out = residual
    for chans in calls:
        part = _nchwc_chain(taps, weight, chans, kh_n, kw_n)
        out = part if out is None else part + out
    if conv.bias is not None:
        out = out + conv.bias.float()[:, None, None]
    return F.relu(out) if relu else out


def row_means(x: Tensor, first_row: int = 0) -> Tensor:
    """Mean of each row of x [R, N] (a contiguous tensor's rows `first_row`...): Eigen's sum
    (SSE packets of 4 from the row's first 16-byte aligned element, two accumulators, pairwise
    lane reduction, leftovers added one by one), then a division by N."""
    rows, n = x.shape
    sums = torch.empty(rows)
    for start in range(4):
        idx = [r for r in range(rows) if min((-(first_row + r) * n) % 4, n) == start]
        if not idx:
            continue
        xs = x[idx]
        vec = ((n - start) // 4) * 4
        if vec == 0:
            res = xs[:, 0]
            for i in range(1, n):
                res = res + xs[:, i]
        else:
            p0 = xs[:, start:start + 4]
            if vec > 4:
                pairs = ((n - start) // 8) * 8
                p1 = xs[:, start + 4:start + 8]
                for i in range(start + 8, start + pairs, 8):
                    p0 = p0 + xs[:, i:i + 4]
                    p1 = p1 + xs[:, i + 4:i + 8]
                p0 = p0 + p1
                if vec > pairs:
                    p0 = p0 + xs[:, start + pairs:start + pairs + 4]
            res = (p0[:, 0] + p0[:, 2]) + (p0[:, 1] + p0[:, 3])
            for i in list(range(start)) + list(range(start + vec, n)):
                res = res + xs[:, i]
        sums[idx] = res
    return sums / torch.tensor(float(n))


def batch_norm(x: Tensor, bn: BatchNorm) -> Tensor:
    """onnxruntime's inference BatchNormalization on [C, T] (or [C]), every step rounded to float32."""
    eps = torch.tensor(bn.eps, dtype=torch.float32)
    scale = (torch.ones(()) / _sqrt(bn.running_var.float() + eps)) * bn.weight.float()
    shift = bn.bias.float() - bn.running_mean.float() * scale
    if x.dim() == 2:
        scale, shift = scale[:, None], shift[:, None]
    return x * scale + shift


def _segment_means(x: Tensor, seg_len: int) -> Tensor:
    """AveragePool(kernel = stride = seg_len, ceil_mode): each segment's frames summed in order,
    divided by their count (the last segment may be short; its zero padding adds nothing)."""
    t = x.shape[1]
    n_seg = -(-t // seg_len)
    padded = F.pad(x, (0, n_seg * seg_len - t)).reshape(x.shape[0], n_seg, seg_len)
    acc = padded[:, :, 0]
    for i in range(1, seg_len):
        acc = acc + padded[:, :, i]
    return acc / torch.tensor([float(min(seg_len, t - s * seg_len)) for s in range(n_seg)])


def _dense_layer(layer, x: Tensor, first_row: int) -> Tensor:
    """tdnnd: BN-ReLU, 1x1 conv (+ folded BN) + ReLU, then the CAM layer."""
    h = conv1d(F.relu(batch_norm(x, layer.nonlinear1.batchnorm)), layer.linear1, "relu")
    cam = layer.cam_layer
    t = h.shape[1]
    local = conv1d(h, cam.linear_local)
    seg = _segment_means(h, cam.seg_len)  # [C, n_seg]; the graph repeats each over its frames
    context = row_means(h, first_row)[:, None] + seg
    # The context is constant within a segment, so its 1x1 convs run on one column per segment;
    # MLAS slices K for the graph's T columns, and each column's sum does not depend on the others.
    gate = conv1d(F.relu(conv1d(context, cam.linear1, "relu", n_columns=t)), cam.linear2, "sigmoid", n_columns=t)
    gate = gate.repeat_interleave(cam.seg_len, dim=1)[:, :t]
    return local * gate


def _item(model: CAMPPlus, feats: Tensor, item: int) -> Tensor:
    """One utterance's embedding [E]; `item` is its index in the batch (row alignment of means)."""
    head = model.head
    x = conv2d_nchwc(feats.transpose(0, 1).unsqueeze(0), head.conv1, relu=True)
    for i in range(1, head.n_layers + 1):
        for block in getattr(head, f"layer{i}"):
            h = conv2d_nchwc(x, block.conv1, relu=True)
            short = conv2d_nchwc(x, block.shortcut[0], relu=False) if len(block.shortcut) else x
            x = conv2d_nchwc(h, block.conv2, relu=True, residual=short)
    x = conv2d_nchwc(x, head.conv2, relu=True)
    x = x.reshape(-1, x.shape[-1])
    xv = model.xvector
    x = conv1d(x, xv.tdnn.linear, "relu")
    for b in range(1, model.n_blocks + 1):
        for layer in getattr(xv, f"block{b}").children():
            x = torch.cat([x, _dense_layer(layer, x, item * layer.linear1.out_channels)], dim=0)
        transit = getattr(xv, f"transit{b}")
        h = F.relu(batch_norm(x, transit.nonlinear.batchnorm))
        last = b == model.n_blocks and not model.out_batchnorm
        x = conv1d(h, transit.linear, "relu" if last else None)  # the graph fuses the final ReLU here
    if model.out_batchnorm:
        x = F.relu(batch_norm(x, xv.out_nonlinear.batchnorm))
    # Statistics pooling as exported: mean; unbiased std = sqrt(mean((x - mean)^2) * n / (n - 1)).
    channels, n = x.shape
    mean = row_means(x, item * channels)
    centered = x - mean[:, None]
    count = torch.tensor(float(n))
    var = row_means(centered * centered, item * channels) * count / (count - 1)
    stats = torch.cat([mean, _sqrt(var)])
    emb = _gemm(xv.dense.linear.weight.float()[:, :, 0], stats[:, None])[:, 0]
    return batch_norm(emb, xv.dense.nonlinear.batchnorm)


@torch.no_grad()
def forward_ort_order(model: CAMPPlus, feats: Tensor) -> Tensor:
    """CAM++ embedding [B, E] of mean-normalized fbank [B, T, F] (or [T, F]) as onnxruntime's CPU
    provider computes it with its default (all) graph optimisations; on the CPU, float32."""
    if feats.dim() == 2:
        feats = feats.unsqueeze(0)
    if feats.dim() != 3 or feats.shape[-1] != model.feat_dim:
        raise ValueError(f"CAM++ wants fbank [B, T, {model.feat_dim}], got {tuple(feats.shape)}")
    feats = feats.detach().to("cpu", torch.float32)
    return torch.stack([_item(model, feats[i], i) for i in range(feats.shape[0])])
