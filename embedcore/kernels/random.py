"""Counter-based random numbers for table initialisation.

Each value is a pure function of ``(key, row, column)``: a table initialised whole, or row range by row
range (or every N-th row, ``stride``) on different processes, holds the same numbers. The generator is the
SplitMix64 finaliser applied to a counter (a stateless hash with good avalanche), giving 53-bit uniforms, one
per value. Truncated normal values are the inverse of the truncated normal's distribution function at that
uniform (a rational approximation: no redraw loop, no library call, so the fill loops vectorise)."""

import numpy as np
from numba import njit, prange

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S11, _S8 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11), np.uint64(8)


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


# The coefficients of P and Q in _truncated_z, fitted by benchmarks/fit_truncated_normal.py.
_P0, _P1, _P2, _P3, _P4, _P5 = (1.1962880359454775, -3.3991281343437265, 3.5767523923376086, -1.6740897714614176,
                                0.3182313262827201, -0.014043641242122146)
_Q1, _Q2, _Q3, _Q4, _Q5 = (-3.0799129650224852, 3.6050112604166937, -1.9651237246574045, 0.4809122748338193,
                           -0.038881741810815516)


@njit(cache=True, inline="always")
def _truncated_z(u):
    """The standard normal truncated to ``[-2, 2]``, by inversion at the uniform ``u`` in ``[0, 1)``.

    ``z = F^-1(u)`` for ``F(z) = (Phi(z) - Phi(-2)) / (Phi(2) - Phi(-2))``, the distribution function of a
    normal value redrawn while beyond two standard deviations (``Phi`` the standard normal's). With ``s = 2u -
    1`` (exact in float64), ``z = sqrt(2) * erfinv(erf(sqrt(2)) * s)``, odd in ``s``, computed as ``s * P(s^2)
    / Q(s^2)`` with ``P``, ``Q`` of degree 5 (``Q(0) = 1``; ``Q >= 0.002`` on ``[0, 1]``) fitted toward the
    least maximum error: the absolute error is below 2.3e-9 (float32's spacing at 1 is 1.2e-7) and ``|z| <
    2`` (at ``s = -1`` it is ``2 - 5.4e-10``). Float64 arithmetic with no branch and no library call.
    """
    s = 2.0 * u - 1.0
    t = s * s
    p = ((((_P5 * t + _P4) * t + _P3) * t + _P2) * t + _P1) * t + _P0
    q = ((((_Q5 * t + _Q4) * t + _Q3) * t + _Q2) * t + _Q1) * t + 1.0
    return s * p / q


# error_model="numpy" on the two truncated-normal fills: Python's model tests every division for a zero
# divisor (Q never is), a branch that keeps LLVM from vectorising the loop.
@njit(cache=True, parallel=True, error_model="numpy")
def fill_truncated_normal(out, first_row, key, mean, stddev, stride=1):
    """``out[i, c] = mean + stddev * z(U(key, first_row + i * stride, c))``: Normal(mean, stddev) with the
    values beyond two standard deviations redrawn, in distribution. ``U`` is :func:`fill_uniform`'s uniform
    of the element and ``z`` the inverse of the truncated standard normal's distribution function
    (:func:`_truncated_z`): one uniform per value, no redraw loop."""
    rows, dim = out.shape
    k = np.uint64(key)
    for i in prange(rows):
        base = np.uint64(first_row + i * stride) * np.uint64(dim)
        for c in range(dim):
            out[i, c] = mean + stddev * _truncated_z(_uniform(k, (base + np.uint64(c)) << _S8))


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


@njit(cache=True, parallel=True, error_model="numpy")
def fill_truncated_normal_keys(out, keys, stream, mean, stddev):
    """Row 0 of :func:`fill_truncated_normal` under each key's stream ``key_stream(stream, keys[i])``."""
    rows, dim = out.shape
    s = np.uint64(stream)
    for i in prange(rows):
        k = _key_stream(np.uint64(keys[i]), s)
        for c in range(dim):
            out[i, c] = mean + stddev * _truncated_z(_uniform(k, np.uint64(c) << _S8))


@njit(cache=True, parallel=True)
def fill_key_values(out, keys, offset):
    """``out[i, c] = keys[i] + offset`` (each key as its int64 value)."""
    rows, dim = out.shape
    for i in prange(rows):
        value = np.float64(keys[i]) + offset
        for c in range(dim):
            out[i, c] = value
