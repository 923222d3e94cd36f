"""16-bit table values: float16 and bfloat16 kept as their bit patterns, float32 for all arithmetic.

A table (or slot) of ``weights_dtype`` ``"float16"`` or ``"bfloat16"`` stores 2 bytes a value: NumPy's
``float16``, or ``ml_dtypes.bfloat16``. Numba has neither type, so jitted code sees the same memory as
``uint16`` (:func:`bits_of`) and converts with the functions here: :func:`f16_to_f32` and
:func:`bf16_to_f32` are exact (every 16-bit value is a float32); rounding a float32 back is either

* to nearest, ties to even (:func:`f32_to_f16`, :func:`f32_to_bf16`): NumPy's and ml_dtypes' own casts, or
* stochastic (:func:`f32_to_f16_stochastic`, :func:`f32_to_bf16_stochastic`): ``x`` between the two 16-bit
  values ``lo < x < hi`` becomes ``hi`` with probability ``(x - lo) / (hi - lo)``, else ``lo`` (magnitudes;
  the sign is kept), so the stored value is unbiased: ``E[stored] = x``. Rounding drops ``k`` bits of the
  float32 (16 for bfloat16; 13 for a float16 normal, more for a subnormal); with 16 random bits ``r`` the
  value rounds up exactly when ``r mod 2**k + dropped >= 2**k`` (``k <= 16``), or, for ``k > 16``, when
  ``r + (the top 16 dropped bits) >= 2**16``: the probability then has 16 bits of resolution, a bias below
  ``2**-16`` of the gap between float16 subnormals (``2**-40``).

The random bits come from :func:`rounding_bits`, a counter-based hash of ``(key, counter)`` giving 64 bits,
four values' worth: the update kernel's key mixes the engine's seed, the table, the slot and the step, and
its counter is the table row id times ``ceil(dim / 4)`` plus the column's group of four (value ``j`` takes
bits ``16 * (j % 4)`` and up), so a value's rounding does not depend on threads, stacking or sharding.

A value too large for the format rounds to infinity, which the update treats like any non-finite result:
the row is left as it was and reported. float16 holds magnitudes up to 65504 (subnormals down to 2**-24);
bfloat16 has float32's range with 8 significant bits.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .random import mix64

__all__ = ["FORMATS", "stored_dtype", "format_of", "bits_of", "is_16_bit", "f16_to_f32", "bf16_to_f32",
           "f32_to_f16", "f32_to_bf16", "f32_to_f16_stochastic", "f32_to_bf16_stochastic", "rounding_bits",
           "decoder", "encoder", "finite_16", "FORMAT_RANGE", "StoredFormats", "FLOAT32", "rounding_place",
           "slot_key", "step_key"]

FORMATS = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
           "bfloat16": np.dtype(ml_dtypes.bfloat16)}
FORMAT_RANGE = {"float32": float(np.finfo(np.float32).max), "float16": 65504.0,
                "bfloat16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)}


class StoredFormats(NamedTuple):
    """How a physical table stores its values: the rows' format, the slots' format, and whether rounding
    to a 16-bit format is stochastic (else to nearest)."""

    weights: str = "float32"
    slots: str = "float32"
    stochastic: bool = True

    @property
    def weights_16(self) -> bool:
        return self.weights != "float32"

    @property
    def slots_16(self) -> bool:
        return self.slots != "float32"

    @property
    def any_16(self) -> bool:
        return self.weights_16 or self.slots_16


FLOAT32 = StoredFormats()


def stored_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a table stored as ``name`` (``"float32"``, ``"float16"`` or ``"bfloat16"``)."""
    return FORMATS[name]


def format_of(dtype) -> str:
    """The format name of a stored array's dtype (``ValueError`` for any other dtype)."""
    dtype = np.dtype(dtype)
    for name, d in FORMATS.items():
        if d == dtype:
            return name
    raise ValueError(f"tables are stored as {sorted(FORMATS)}, not {dtype}")


def is_16_bit(name: str) -> bool:
    return name != "float32"


def bits_of(array: np.ndarray) -> np.ndarray:
    """What jitted code reads and writes: the array itself for float32, its ``uint16`` view (same memory)
    for a 16-bit format."""
    return array if array.dtype == np.float32 else array.view(np.uint16)


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _bits_of_float32(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(value), codegen


_U32 = np.uint32
_TWO_TO_24 = np.float32(2.0 ** 24)
_TWO_TO_MINUS_24 = np.float32(2.0 ** -24)


@njit(inline="always")
def bf16_to_f32(bits):
    """The float32 equal to the bfloat16 with these 16 bits (exact)."""
    return _float32_from_bits(_U32(bits) << _U32(16))


@njit(inline="always")
def f16_to_f32(bits):
    """The float32 equal to the float16 with these 16 bits (exact, subnormals, infinities and NaN too)."""
    h = _U32(bits)
    sign = (h & _U32(0x8000)) << _U32(16)
    exponent = (h >> _U32(10)) & _U32(0x1F)
    mantissa = h & _U32(0x3FF)
    if exponent == _U32(0x1F):  # infinity or NaN: float32's all-ones exponent
        return _float32_from_bits(sign | _U32(0x7F800000) | (mantissa << _U32(13)))
    if exponent == _U32(0):  # zero or subnormal: mantissa * 2**-24, exact in float32
        magnitude = np.float32(mantissa) * _TWO_TO_MINUS_24
        return -magnitude if sign else magnitude
    return _float32_from_bits(sign | ((exponent + _U32(112)) << _U32(23)) | (mantissa << _U32(13)))


@njit(inline="always")
def f32_to_bf16(value):
    """``value`` rounded to the nearest bfloat16, ties to even (NaN stays NaN), as 16 bits."""
    u = _bits_of_float32(np.float32(value))
    if (u & _U32(0x7FFFFFFF)) > _U32(0x7F800000):
        return np.uint16((u >> _U32(16)) | _U32(0x40))  # a quiet NaN
    return np.uint16((u + _U32(0x7FFF) + ((u >> _U32(16)) & _U32(1))) >> _U32(16))


@njit(inline="always")
def f32_to_bf16_stochastic(value, random):
    """``value`` rounded stochastically to bfloat16 (module docstring) with the 16 random bits ``random``."""
    u = _bits_of_float32(np.float32(value))
    if (u & _U32(0x7FFFFFFF)) >= _U32(0x7F800000):
        return f32_to_bf16(value)  # infinity and NaN are kept
    return np.uint16((u + (_U32(random) & _U32(0xFFFF))) >> _U32(16))


@njit(inline="always")
def f32_to_f16(value):
    """``value`` rounded to the nearest float16, ties to even, as 16 bits: infinity beyond 65519.99...,
    subnormals below 2**-14, NaN kept."""
    x = np.float32(value)
    u = _bits_of_float32(x)
    sign = (u >> _U32(16)) & _U32(0x8000)
    a = u & _U32(0x7FFFFFFF)
    if a > _U32(0x7F800000):
        return np.uint16(sign | _U32(0x7E00))
    if a >= _U32(0x477FF000):  # 65520 and above (and infinity) round to infinity
        return np.uint16(sign | _U32(0x7C00))
    if a < _U32(0x38800000):  # below 2**-14: a multiple of 2**-24, rounded as an integer (exact scaling)
        return np.uint16(sign | _U32(np.rint(abs(x) * _TWO_TO_24)))
    v = a - _U32(112 << 23)  # rebias the exponent from 127 to 15
    return np.uint16(sign | ((v + _U32(0xFFF) + ((v >> _U32(13)) & _U32(1))) >> _U32(13)))


@njit(inline="always")
def f32_to_f16_stochastic(value, random):
    """``value`` rounded stochastically to float16 (module docstring) with the 16 random bits ``random``."""
    x = np.float32(value)
    u = _bits_of_float32(x)
    r = _U32(random) & _U32(0xFFFF)
    sign = (u >> _U32(16)) & _U32(0x8000)
    a = u & _U32(0x7FFFFFFF)
    if a >= _U32(0x47800000):  # 2**16 and above, infinity, NaN: no float16 below can be the result
        return f32_to_f16(value)
    if a >= _U32(0x38800000):  # a float16 normal: 13 bits dropped (a carry may reach infinity: overflow)
        v = a - _U32(112 << 23)
        return np.uint16(sign | ((v + (r & _U32(0x1FFF))) >> _U32(13)))
    # A float16 subnormal: |x| = m * 2**(e - 150) in units of 2**-24 is m >> (126 - e), dropping 126 - e bits.
    e = np.int64(a >> _U32(23))
    m = np.uint64(a & _U32(0x7FFFFF))
    if e > 0:
        m = m | np.uint64(0x800000)
    else:
        e = np.int64(1)  # a float32 subnormal: m * 2**-149
    shift = 126 - e  # at least 14
    if shift <= 16:
        mask = (np.uint64(1) << np.uint64(shift)) - np.uint64(1)
        return np.uint16(sign | _U32((m + (np.uint64(r) & mask)) >> np.uint64(shift)))
    if shift - 16 >= 24:  # m < 2**24: no dropped bit among the top 16, the value rounds to zero
        return np.uint16(sign)
    top = m >> np.uint64(shift - 16)  # the integer part, then the top 16 dropped bits
    return np.uint16(sign | _U32((top + np.uint64(r)) >> np.uint64(16)))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(inline="always")
def rounding_bits(key, counter):
    """64 random bits, a pure function of ``(key, counter)``: output ``counter`` of SplitMix64 seeded with
    ``key`` (its finaliser, as the initialisers', of ``key + (counter + 1) * golden``)."""
    return mix64(np.uint64(key) + (np.uint64(counter) + np.uint64(1)) * _GOLDEN)


@njit(inline="always")
def _finite_bf16(bits):
    return (np.uint32(bits) & _U32(0x7F80)) != _U32(0x7F80)


@njit(inline="always")
def _finite_f16(bits):
    return (np.uint32(bits) & _U32(0x7C00)) != _U32(0x7C00)


def decoder(name: str):
    """The jitted ``bits -> float32`` of a 16-bit format."""
    return {"float16": f16_to_f32, "bfloat16": bf16_to_f32}[name]


def encoder(name: str, stochastic: bool):
    """The jitted ``(float32, random) -> bits`` of a 16-bit format (``random`` unused when rounding to
    nearest)."""
    if stochastic:
        return {"float16": f32_to_f16_stochastic, "bfloat16": f32_to_bf16_stochastic}[name]
    return {"float16": _f16_nearest, "bfloat16": _bf16_nearest}[name]


@njit(inline="always")
def _f16_nearest(value, random):
    return f32_to_f16(value)


@njit(inline="always")
def _bf16_nearest(value, random):
    return f32_to_bf16(value)


def finite_16(name: str):
    """The jitted ``bits -> bool``: whether the 16-bit value is finite."""
    return {"float16": _finite_f16, "bfloat16": _finite_bf16}[name]


@njit(inline="always")
def rounding_place(rounding, r):
    """``(table row id, key)`` of physical row ``r``: ``rounding[k] = (offset, first, stride, key)`` for each
    stacked table ``k`` (offsets increasing; the key as int64 bits), physical row ``offset + i`` holding table
    row ``first + i * stride``."""
    k = rounding.shape[0] - 1
    while k > 0 and rounding[k, 0] > r:
        k -= 1
    return rounding[k, 1] + rounding[k, 2] * (r - rounding[k, 0]), np.uint64(rounding[k, 3])


_SLOT_SALT = np.uint64(0xD1B54A32D192ED03)


@njit(inline="always")
def slot_key(key, slot):
    """The rounding key of slot number ``slot`` from its table's key."""
    return mix64(key ^ (_SLOT_SALT * np.uint64(slot + 1)))


_MASK = (1 << 64) - 1


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def step_key(table_key: int, step: int) -> int:
    """The rounding key of one table at one step (as int64 bits, for the kernel's ``rounding`` array)."""
    key = _mix_int(table_key ^ _mix_int((int(step) * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & _MASK))
    return key - (1 << 64) if key >= 1 << 63 else key
