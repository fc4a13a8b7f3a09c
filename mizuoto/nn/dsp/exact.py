"""Float arithmetic in the order and rounding of the libraries a reference was computed with.

Some upstream front ends run numpy 1.x and OpenBLAS on float32 data; their last bits depend on
the order of the additions and on fused multiply-adds, and numpy 2 sums in another order. These
helpers reproduce those results from float64 arithmetic, whatever numpy is installed.
"""

from __future__ import annotations

import numpy as np

# numpy 1.x reduces in chunks of its iterator buffer (8192 elements), each summed pairwise
NUMPY1_BUFSIZE = 8192
_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: below it, 8 interleaved accumulators


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as an FMA instruction computes it (broadcasting)."""
    a64, b64, c64 = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    p = a64 * b64  # exact: 24 + 24 significant bits fit in 53
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c == s + err exactly
    out = s.astype(np.float32)
    # Rounding s to float32 is the one rounding of p + c unless s sits exactly halfway between two
    # float32 values and err says on which side the exact sum lies (double rounding).
    r = out.astype(np.float64)
    other = np.nextafter(out, np.where(s > r, np.float32(np.inf), np.float32(-np.inf))).astype(np.float64)
    tie = (s != r) & (np.abs(s - r) == np.abs(other - s)) & (err != 0)
    if np.any(tie):
        nudged = np.nextafter(s, np.where(err > 0, np.inf, -np.inf)).astype(np.float32)
        out = np.where(tie, nudged, out)
    return out


def cabs32(z: np.ndarray) -> np.ndarray:
    """|z| of complex64 as numpy's SIMD absolute computes it: larger * sqrt(fma(ratio, ratio, 1)) in float32."""
    re, im = np.abs(z.real).astype(np.float32), np.abs(z.imag).astype(np.float32)
    larger, smaller = np.maximum(re, im), np.minimum(re, im)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(larger == 0, np.float32(0), smaller / larger).astype(np.float32)
    return (np.sqrt(fma32(ratio, ratio, np.float32(1))) * larger).astype(np.float32)


def _pairwise(a: np.ndarray) -> np.ndarray:
    """numpy's pairwise sum of each row of a (B, n), in a's dtype."""
    n = a.shape[1]
    if n > _PAIRWISE_BLOCK:
        half = n // 2
        half -= half % 8
        return _pairwise(a[:, :half]) + _pairwise(a[:, half:])
    if n < 8:
        res = np.zeros(a.shape[0], a.dtype)
        for i in range(n):
            res = res + a[:, i]
        return res
    r = a[:, :8].copy()
    body = n - n % 8
    for i in range(8, body, 8):
        r += a[:, i:i + 8]
    res = ((r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])) + ((r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7]))
    for i in range(body, n):
        res = res + a[:, i]
    return res


def numpy1_sum(rows: np.ndarray) -> np.ndarray:
    """Each row's sum (B, n) -> (B,) as numpy 1.x's np.sum of a contiguous row gives it (same dtype)."""
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError(f"numpy1_sum: expected rows (B, n), got shape {rows.shape}")
    total = np.zeros(rows.shape[0], rows.dtype)  # add's identity starts the reduction
    for start in range(0, rows.shape[1], NUMPY1_BUFSIZE):
        total = total + _pairwise(rows[:, start:start + NUMPY1_BUFSIZE])
    return total
