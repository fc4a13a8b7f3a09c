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

- 2-D head convolutions: the NCHWc transformer's convolutions (MLAS's block: 16 channels on an
  AVX-512 CPU, 8 on an AVX2/FMA3 one, as the CPU reports it; see `_nchwc_block`): per
  output, a fused multiply-add chain from 0 over (kernel row, kernel column, channel) within each
  kernel call (one call per input block; the pointwise shortcut takes up to 128
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

These rules hold for onnxruntime's AVX-512 (AVX512F) and AVX2/FMA3 MLAS kernels, which differ here
only in the NCHWc block (checked bit for bit on the AVX-512 host and under qemu-user -cpu
Haswell-noTSX); a CPU without FMA3 gets MLAS's AVX or SSE kernels (no fused multiply-adds), which
this evaluation does not reproduce, so it refuses to run there.

The chains advance one K step at a time, so the cost is thousands of small tensor operations:
independent chains (a GEMM's K slices, a convolution's kernel calls, the rows of a mean) step
together, one operation for all of them. About half a second for a clip of a few seconds, 1.2 s for
12 s (docs/performance.md, "Reference voices"); new voices' embeddings (compute.reference=exact)
and the training features stage use it, `CAMPPlus.forward` is the fast path.
"""

from __future__ import annotations

import functools
import os
import platform

import torch
import torch.nn.functional as F
from torch import Tensor

from mizuoto.nn.speaker.campplus import BatchNorm, CAMPPlus

NCHWC_BLOCK_ENV = "MIZUOTO_ORT_NCHWC_BLOCK"


def _nchwc_block() -> int:
    """MLAS's NCHWc block on this CPU: 16 where it runs its AVX512F kernels, else 8 (its FMA3 ones).

    From CPUID through torch's cpuinfo (which also checks that the OS saves the AVX-512 state), not
    torch's dispatch capability (ATEN_CPU_CAPABILITY can lower that) nor /proc/cpuinfo. MLAS wants
    only AVX512F; torch's test also wants VL/BW/DQ, which every AVX512F CPU but Xeon Phi has.
    `$MIZUOTO_ORT_NCHWC_BLOCK` (16 or 8) takes another CPU's block instead: embeddings equal to
    those onnxruntime gives there (never set by the runtime or the test suite: upstream runs
    onnxruntime with this CPU's block, so this CPU's block equals upstream here).
    """
    steered = os.environ.get(NCHWC_BLOCK_ENV)
    if steered:
        if steered not in ("8", "16"):
            raise ValueError(f"${NCHWC_BLOCK_ENV} must be 8 or 16, got {steered!r}")
        return int(steered)
    return 16 if torch.cpu._is_avx512_supported() else 8


def reproducible_here() -> bool:
    """Whether this CPU runs onnxruntime's kernels these rules reproduce (MLAS's AVX2/FMA3 or AVX-512 ones)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.cpu._is_avx2_supported()


NCHWC_BLOCK = _nchwc_block()  # this CPU's, as onnxruntime picks it here
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
        (torch.full((2, 19, 37), c), a.expand(2, 19, 1), a.expand(2, 1, 37)),
        (torch.full((2, 5, 9, 21), c), a.expand(2, 1, 9, 21), a.expand(2, 5, 1, 1)),
    ]
    return all(bool((torch.addcmul(acc, x, y) == 2.0 ** -24).all()) for acc, x, y in cases)


def _chain_operand(t: Tensor) -> Tensor:
    """A chain's multiplicand: float32 when addcmul is fused, else float64."""
    return t.float() if _fused_addcmul() else t.double()


def _fma_chains(a: Tensor, b: Tensor) -> Tensor:
    """sum_k a[g, :, k] * b[g, k, :] for each g, one fused multiply-add at a time from 0: G
    independent chains of equal length stepped together (a zero-padded step adds nothing)."""
    a = _chain_operand(a).permute(2, 0, 1).contiguous()  # [K, G, M]: step k's column of every chain
    b = _chain_operand(b).transpose(0, 1).contiguous()  # [K, G, N]
    acc = torch.zeros(a.shape[1], a.shape[2], b.shape[2])
    for k in range(a.shape[0]):
        torch.addcmul(acc, a[k].unsqueeze(2), b[k].unsqueeze(1), out=acc)  # float32 result, rounded once
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
    step = min(_k_slice(n, k), k)
    slices = -(-k // step)
    pad = slices * step - k
    # the K slices are independent chains: stepped together, then added in order
    parts = _fma_chains(F.pad(a, (0, pad)).reshape(a.shape[0], slices, step).transpose(0, 1),
                        F.pad(b, (0, 0, 0, pad)).reshape(slices, step, b.shape[1]))
    out = parts[0]
    for part in parts[1:]:
        out = part + out
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


def conv2d_nchwc(x: Tensor, conv: torch.nn.Conv2d, relu: bool, residual: Tensor | None = None) -> Tensor:
    """One item's Conv2d [C, H, W] (stride along H only, as in CAM++'s head) through onnxruntime's
    NCHWc convolution, with its fused residual Add and ReLU."""
    weight = conv.weight.float()
    out_channels, channels, kh_n, kw_n = weight.shape
    (stride_h, stride_w), (pad_h, pad_w) = conv.stride, conv.padding
    if out_channels % NCHWC_BLOCK or (channels >= NCHWC_BLOCK and channels % NCHWC_BLOCK) or stride_w != 1:
        raise ValueError(f"CAM++ head conv {tuple(weight.shape)} stride {conv.stride}: not an NCHWc "
                         "convolution this evaluation reproduces")
    if channels < NCHWC_BLOCK:  # NCHW-input kernel: one call per input channel
        per_call = 1
    elif kh_n == kw_n == 1 and pad_h == pad_w == 0:  # pointwise kernel: up to 128 channels per call
        per_call = min(channels, 128)
    else:
        per_call = NCHWC_BLOCK
    calls = -(-channels // per_call)
    extra = calls * per_call - channels  # zero channels: a short last call's chain adds nothing more
    xp = _chain_operand(F.pad(x, (pad_w, pad_w, pad_h, pad_h, 0, extra)))
    xp = xp.reshape(calls, per_call, *xp.shape[1:])
    weight = _chain_operand(F.pad(weight, (0, 0, 0, 0, 0, extra))).reshape(out_channels, calls, per_call, kh_n, kw_n)
    h_out = (x.shape[1] + 2 * pad_h - kh_n) // stride_h + 1
    w_out = x.shape[2] + 2 * pad_w - kw_n + 1
    # each kernel call is a fused multiply-add chain over (row, column, channel) from 0; the calls'
    # chains are independent, so they step together
    acc = torch.zeros(calls, out_channels, h_out, w_out)
    for kh in range(kh_n):
        for kw in range(kw_n):
            for c in range(per_call):
                taps = xp[:, c, kh: kh + stride_h * (h_out - 1) + 1: stride_h, kw: kw + w_out]
                torch.addcmul(acc, taps.unsqueeze(1), weight[:, :, c, kh, kw].t()[:, :, None, None], out=acc)
    out = residual
    for part in acc:
        out = part if out is None else part + out
    if conv.bias is not None:
        out = out + conv.bias.float()[:, None, None]
    return F.relu(out) if relu else out


def row_means(x: Tensor, first_row: int = 0) -> Tensor:
    """Mean of each row of x [R, N] (a contiguous tensor's rows `first_row`...): Eigen's sum
    (SSE packets of 4 from the row's first 16-byte aligned element, two accumulators, pairwise
    lane reduction, leftovers added one by one), then a division by N.

    Rows start at different alignments, so each row's packets are gathered into one layout and
    stepped together; a packet a row does not have is zeros, and adding zeros leaves a float
    sum as it is.
    """
    rows, n = x.shape
    r = torch.arange(rows)
    start = torch.clamp((-(first_row + r) * n) % 4, max=n)  # first aligned element of each row
    vec = (n - start) // 4 * 4  # elements in whole packets
    pairs = torch.where(vec > 4, (n - start) // 8 * 8, 0)  # elements in the two accumulators' steps
    extra = (vec > 4) & (vec > pairs)  # one packet more, added after the accumulators meet
    lane = torch.arange(4)

    def take(index: Tensor, keep: Tensor) -> Tensor:
        """x[row, index] where `keep`, else 0."""
        return torch.where(keep, x.gather(1, index.clamp(0, n - 1)), torch.zeros(()))

    col = torch.arange(max(n, 8))
    packets = take(start[:, None] + col, col < pairs[:, None])
    # a row too short for a packet sums from its first element: it is that element's lane 0
    p0 = take(torch.where(vec[:, None] > 0, start[:, None] + lane, lane), (vec[:, None] > 0) | (lane == 0))
    p1 = packets[:, 4:8]
    for i in range(8, int(pairs.max()), 8):
        p0 = p0 + packets[:, i:i + 4]
        p1 = p1 + packets[:, i + 4:i + 8]
    p0 = (p0 + p1) + take(start[:, None] + pairs[:, None] + lane, extra[:, None])
    res = (p0[:, 0] + p0[:, 2]) + (p0[:, 1] + p0[:, 3])
    # leftovers in order: before the first aligned element, then after the packets
    left = torch.where(vec > 0, n - vec, n - 1)
    for j in range(int(left.max())):
        index = torch.where(vec > 0, torch.where(j < start, j, vec + j), 1 + j)
        res = res + take(index[:, None], (j < left)[:, None])[:, 0]
    return res / torch.tensor(float(n))


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
    if not model.folded:  # onnxruntime only ever runs the exported (folded) graph
        raise ValueError("forward_ort_order evaluates the folded (campplus.onnx) layout only")
    if feats.dim() == 2:
        feats = feats.unsqueeze(0)
    if feats.dim() != 3 or feats.shape[-1] != model.feat_dim:
        raise ValueError(f"CAM++ wants fbank [B, T, {model.feat_dim}], got {tuple(feats.shape)}")
    if not reproducible_here():
        raise RuntimeError("onnxruntime runs its AVX/SSE kernels (no fused multiply-add) on a CPU "
                           "without AVX2/FMA3: forward_ort_order does not reproduce them")
    feats = feats.detach().to("cpu", torch.float32)
    return torch.stack([_item(model, feats[i], i) for i in range(feats.shape[0])])
