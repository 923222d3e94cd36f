"""Counter-based random numbers for table initialisation.

Each value is a pure function of ``(key, row, column)``: a table initialised whole, or row range by row
range (or every N-th row, ``stride``) on different processes, holds the same numbers. The generator is the
SplitMix64 finaliser applied to a counter (a stateless hash with good avalanche), giving 53-bit uniforms.
"""

import numpy as np
from numba import njit, prange

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S11, _S8 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11), np.uint64(8)
_TWO_PI = 2.0 * np.pi


@njit(cache=True, inline="always")
def mix64(z):
    """The SplitMix64 finaliser: a bijective 64-bit mix with full avalanche (uint64 -> uint64)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def _uniform(key, counter):
    """A float64 in [0, 1) from ``(key, counter)``."""
    bits = mix64(key ^ mix64(counter * _GOLDEN + _GOLDEN))
    return np.float64(bits >> _S11) * (1.0 / 9007199254740992.0)


@njit(cache=True, parallel=True)
def fill_uniform(out, first_row, key, low, high, stride=1):
    """``out[i, c] = low + (high - low) * U(key, first_row + i * stride, c)``."""
    rows, dim = out.shape
    k = np.uint64(key)
    for i in prange(rows):
        base = np.uint64(first_row + i * stride) * np.uint64(dim)
        for c in range(dim):
            u = _uniform(k, (base + np.uint64(c)) << _S8)
            out[i, c] = low + (high - low) * u


@njit(cache=True, parallel=True)
def fill_truncated_normal(out, first_row, key, mean, stddev, stride=1):
    """Normal(mean, stddev) values, redrawn while more than two standard deviations from the mean.

    Box-Muller on two uniforms per attempt; attempt ``a`` of an element uses counters ``2a`` and ``2a + 1``
    under that element's own counter, so a redraw never consumes another element's numbers.
    """
    rows, dim = out.shape
    k = np.uint64(key)
    for i in prange(rows):
        base = np.uint64(first_row + i * stride) * np.uint64(dim)
        for c in range(dim):
            counter = (base + np.uint64(c)) << _S8
            attempt = np.uint64(0)
            while True:
                u1 = _uniform(k, counter + attempt)
                u2 = _uniform(k, counter + attempt + np.uint64(1))
                z = np.sqrt(-2.0 * np.log(1.0 - u1)) * np.cos(_TWO_PI * u2)
                if abs(z) <= 2.0 or attempt >= np.uint64(254):
                    break
                attempt += np.uint64(2)
            out[i, c] = mean + stddev * z


@njit(cache=True, parallel=True)
def fill_row_id(out, first_row, offset, stride=1):
    """``out[i, c] = first_row + i * stride + offset``."""
    rows, dim = out.shape
    for i in prange(rows):
        value = np.float64(first_row + i * stride) + offset
        for c in range(dim):
            out[i, c] = value


@njit(cache=True)
def first_non_finite_row(out):
    """Index of the first row of the 2-D ``out`` that holds NaN or +-Inf, or -1 (one read, no temporaries)."""
    rows, dim = out.shape
    for i in range(rows):
        ok = True
        for c in range(dim):
            ok = ok & np.isfinite(out[i, c])
        if not ok:
            return i
    return -1
