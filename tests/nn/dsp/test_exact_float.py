"""exact.py: one-rounding FMA and numpy 1.x's summation order."""

import numpy as np

from mizuoto.nn.dsp.exact import fma32, numpy1_sum


def test_fma32_rounds_once_where_float64_lands_on_a_float32_tie():
    a, b, c = np.float32(1 + 2**-23), np.float32(2**-24 * (1 - 2**-23)), np.float32(1 + 2**-23)
    # the exact sum lies just below the tie 1 + 2^-23 + 2^-24; float64 rounds it onto the tie
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1 + 2**-22)
    assert fma32(a, b, c) == np.float32(1 + 2**-23)


def test_numpy1_sum_adds_pairwise_not_one_by_one():
    # 1e8 absorbs a lone 1.0 in float32 (ulp 8) but not a chunk's pairwise partial sum of 8 ones
    x = np.float32([1e8] + [0.0] * 8191 + [1.0] * 8)
    assert numpy1_sum(x[None])[0] == np.float32(1e8 + 8)
    assert numpy1_sum(np.arange(100, dtype=np.float32)[None])[0] == np.float32(4950)
