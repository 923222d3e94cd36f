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


@njit(cache=True, inline="always")
def _truncated_z(k, counter):
    """A standard normal value within two standard deviations, from the element's ``counter`` under ``k``."""
    attempt = np.uint64(0)
    while True:
        u1 = _uniform(k, counter + attempt)
        u2 = _uniform(k, counter + attempt + np.uint64(1))
        z = np.sqrt(-2.0 * np.log(1.0 - u1)) * np.cos(_TWO_PI * u2)
        if abs(z) <= 2.0 or attempt >= np.uint64(254):
            break
        attempt += np.uint64(2)
    return z


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
            out[i, c] = mean + stddev * _truncated_z(k, (base + np.uint64(c)) << _S8)


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


# -- rows of 64-bit keys (dynamic tables) -------------------------------------------------------------------
# Key k's row holds what row 0 of a table keyed by key_stream(stream, k) holds: the kernels below are the
# row-0 case of the ones above, one stream per key.

@njit(cache=True, inline="always")
def _key_stream(key, stream):
    return mix64(mix64(key) ^ stream)


@njit(cache=True, parallel=True)
def key_streams(keys, stream, out):
    """``out[i] = mix64(mix64(keys[i]) ^ stream)`` (uint64): key ``keys[i]``'s own random-stream key, a
    bijection of the key for a given ``stream``."""
    s = np.uint64(stream)
    for i in prange(keys.shape[0]):
        out[i] = _key_stream(np.uint64(keys[i]), s)


@njit(cache=True, parallel=True)
def fill_uniform_keys(out, keys, stream, low, high):
    """``out[i, c] = low + (high - low) * U(key_stream(stream, keys[i]), c)``: row 0 of :func:`fill_uniform`
    under each key's stream."""
    rows, dim = out.shape
    s = np.uint64(stream)
    for i in prange(rows):
        k = _key_stream(np.uint64(keys[i]), s)
        for c in range(dim):
            out[i, c] = low + (high - low) * _uniform(k, np.uint64(c) << _S8)


@njit(cache=True, parallel=True)
def fill_truncated_normal_keys(out, keys, stream, mean, stddev):
    """Row 0 of :func:`fill_truncated_normal` under each key's stream ``key_stream(stream, keys[i])``."""
    rows, dim = out.shape
    s = np.uint64(stream)
    for i in prange(rows):
        k = _key_stream(np.uint64(keys[i]), s)
        for c in range(dim):
            out[i, c] = mean + stddev * _truncated_z(k, np.uint64(c) << _S8)


@njit(cache=True, parallel=True)
def fill_key_values(out, keys, offset):
    """``out[i, c] = keys[i] + offset`` (each key as its int64 value)."""
    rows, dim = out.shape
    for i in prange(rows):
        value = np.float64(keys[i]) + offset
        for c in range(dim):
            out[i, c] = value
