"""Integrated loudness (ITU-R BS.1770-4, K-weighted, gated) as pyloudnorm 0.2's Meter measures it.

Chatterbox-Turbo scales a reference clip to -27 LUFS with pyloudnorm before anything else sees it,
so the gain must be pyloudnorm's to the last bit: its RBJ-cookbook K-weighting biquads run as
scipy's lfilter (direct form II transposed, float64) and are written back into the caller's float32
array after each stage; each 400 ms block's mean square is numpy 1.x's float32 sum; the gain
multiplies the float32 samples in float32 (numpy 1.x's scalar casting).

One step is not reproducible bit for bit: numpy 1.x on AVX-512 CPUs takes float64 log10 from
SVML, which differs from the C library's log10 by an ulp on ~8% of inputs; math.log10 is used
here. That moves the loudness by ~1e-15 dB, so the float32 gain can only differ when the float64
gain lies within a few ulps of a float32 rounding tie (`gain_margin_ulps` measures it).
"""

from __future__ import annotations

import math

import numpy as np

from mizuoto.nn.dsp.exact import numpy1_sum

BLOCK_SECONDS = 0.4
OVERLAP = 0.75
ABSOLUTE_GATE = -70.0  # LKFS
CHANNEL_GAINS = (1.0, 1.0, 1.0, 1.41, 1.41)  # L, R, C, Ls, Rs


def k_weighting(rate: float) -> list[tuple[tuple[float, float, float], tuple[float, float, float]]]:
    """The two K-weighting biquads (b, a) at `rate`: a 4 dB high shelf at 1.5 kHz, a 38 Hz high pass."""
    def normalised(b, a):
        return tuple(v / a[0] for v in b), tuple(v / a[0] for v in a)

    # high shelf, G = 4 dB, Q = 1/sqrt(2), fc = 1500 Hz (the cookbook's formula, pyloudnorm's operand order)
    big_a = 10 ** (4.0 / 40.0)
    w0 = 2.0 * math.pi * (1500.0 / rate)
    alpha = math.sin(w0) / (2.0 * (1 / math.sqrt(2)))
    cos, root = math.cos(w0), 2 * math.sqrt(big_a)
    shelf = normalised(
        (big_a * ((big_a + 1) + (big_a - 1) * cos + root * alpha), -2 * big_a * ((big_a - 1) + (big_a + 1) * cos),
         big_a * ((big_a + 1) + (big_a - 1) * cos - root * alpha)),
        ((big_a + 1) - (big_a - 1) * cos + root * alpha, 2 * ((big_a - 1) - (big_a + 1) * cos),
         (big_a + 1) - (big_a - 1) * cos - root * alpha))
    # high pass, Q = 0.5, fc = 38 Hz
    w0 = 2.0 * math.pi * (38.0 / rate)
    alpha = math.sin(w0) / (2.0 * 0.5)
    cos = math.cos(w0)
    high_pass = normalised(((1 + cos) / 2, -(1 + cos), (1 + cos) / 2), (1 + alpha, -2 * cos, 1 - alpha))
    return [shelf, high_pass]


def biquad(b: tuple[float, float, float], a: tuple[float, float, float], x: np.ndarray) -> np.ndarray:
    """scipy.signal.lfilter(b, a, x) of one biquad (a[0] == 1) in float64, in scipy's operation order."""
    b0, b1, b2 = (float(v) for v in b)
    a1, a2 = float(a[1]), float(a[2])
    out = np.empty(len(x), dtype=np.float64)
    z0 = z1 = 0.0
    # a sample loop: the recursion is sequential, and Python floats are IEEE doubles without FMA
    for k, xn in enumerate(np.asarray(x, dtype=np.float64).tolist()):
        yn = z0 + b0 * xn
        z0 = z1 + xn * b1 - yn * a1
        z1 = xn * b2 - yn * a2
        out[k] = yn
    return out


def _log10(v: float) -> float:
    return math.log10(v) if v > 0 else (-math.inf if v == 0 else math.nan)


def _mean(values: list[float]) -> float:
    # np.mean of a float64 list: numpy 1.x's pairwise sum, then one division
    if not values:
        return math.nan
    return float(numpy1_sum(np.asarray(values, dtype=np.float64)[None])[0]) / len(values)


def integrated_loudness(samples: np.ndarray, rate: float) -> float:
    """Gated loudness (LUFS) of float samples (N,) or (N, channels <= 5), as pyloudnorm's Meter(rate)."""
    data = np.array(samples, copy=True)  # the filters write back in the input's dtype, as pyloudnorm's copy
    if not np.issubdtype(data.dtype, np.floating):
        raise ValueError("integrated_loudness: samples must be floating point")
    if data.ndim == 1:
        data = data[:, None]
    if data.ndim != 2 or data.shape[1] > len(CHANNEL_GAINS):
        raise ValueError(f"integrated_loudness: expected (N,) or (N, <= 5) samples, got {samples.shape}")
    n, channels = data.shape
    if n < BLOCK_SECONDS * rate:
        raise ValueError("integrated_loudness: audio must be longer than one 400 ms block")
    for b, a in k_weighting(rate):
        for ch in range(channels):
            data[:, ch] = biquad(b, a, data[:, ch])
    step = 1.0 - OVERLAP
    blocks = int(round((n / rate - BLOCK_SECONDS) / (BLOCK_SECONDS * step))) + 1
    bounds = [(int(BLOCK_SECONDS * (j * step) * rate), int(BLOCK_SECONDS * (j * step + 1) * rate))
              for j in range(blocks)]
    scale = 1.0 / (BLOCK_SECONDS * rate)
    z = np.zeros((channels, blocks))
    for ch in range(channels):
        squares = np.square(data[:, ch])
        for length in {min(u, n) - min(l, n) for l, u in bounds}:  # equal-length blocks summed together
            js = [j for j, (l, u) in enumerate(bounds) if min(u, n) - min(l, n) == length]
            rows = np.stack([squares[bounds[j][0]:bounds[j][0] + length] for j in js])
            # the float32 sum times a Python float is float64 in numpy 1.x
            z[ch, js] = [scale * float(s) for s in numpy1_sum(rows)]

    def weighted(values) -> float:  # np.sum of the per-channel list: sequential from 0 for <= 5 terms
        total = 0.0
        for g, v in zip(CHANNEL_GAINS, values):
            total = total + g * v
        return total

    loud = [-0.691 + 10.0 * _log10(weighted(z[:, j])) for j in range(blocks)]
    gated = [j for j, lj in enumerate(loud) if lj >= ABSOLUTE_GATE]
    relative = -0.691 + 10.0 * _log10(weighted([_mean([z[c, j] for j in gated]) for c in range(channels)])) - 10.0
    gated = [j for j, lj in enumerate(loud) if lj > relative and lj > ABSOLUTE_GATE]
    means = [_mean([z[c, j] for j in gated]) for c in range(channels)]
    means = [0.0 if math.isnan(m) else m for m in means]  # np.nan_to_num
    return -0.691 + 10.0 * _log10(weighted(means))


def loudness_gain(samples: np.ndarray, rate: float, target_lufs: float) -> float | None:
    """The linear gain that brings samples to target_lufs, or None where it is not finite and positive."""
    try:
        loudness = integrated_loudness(samples, rate)
    except ValueError:
        return None
    if math.isnan(loudness) or math.isinf(loudness):
        return None
    gain = math.pow(10.0, (target_lufs - loudness) / 20.0)
    return gain if math.isfinite(gain) and gain > 0.0 else None


def gain_margin_ulps(gain: float) -> float:
    """How many float64 ulps the gain lies from the nearest float32 rounding tie (small: rounding is fragile)."""
    near = np.float32(gain)
    up = np.nextafter(near, np.float32(np.inf)).astype(np.float64)
    down = np.nextafter(near, np.float32(-np.inf)).astype(np.float64)
    g = np.float64(gain)
    tie = (near + up) / 2 if g >= near else (near + down) / 2
    return float(abs(g - tie) / np.spacing(g))


def normalize_loudness(samples: np.ndarray, rate: float, target_lufs: float) -> np.ndarray:
    """float32 samples scaled to target_lufs in float32, unchanged where the loudness gives no usable gain."""
    samples = np.asarray(samples, dtype=np.float32)
    gain = loudness_gain(samples, rate, target_lufs)
    return samples if gain is None else samples * np.float32(gain)
