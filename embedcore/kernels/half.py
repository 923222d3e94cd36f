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

The conversions are built in LLVM IR by :mod:`embedcore.kernels.half_ir` (32-bit lanes, no branch, so the
loops that call them vectorise); the update reads and writes whole 16-bit rows with
:mod:`embedcore.kernels.half_rows`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from . import half_ir
from .random import mix64

__all__ = ["FORMAT_NAMES", "bfloat16", "is_bfloat16", "is_native_16_bit", "stored_dtype", "format_of", "bits_of", "is_16_bit", "f16_to_f32", "bf16_to_f32",
           "f32_to_f16", "f32_to_bf16", "f32_to_f16_stochastic", "f32_to_bf16_stochastic", "rounding_bits",
           "rounding_words", "ROUNDING_LANES",
           "decoder", "encoder", "finite_16", "FORMAT_RANGE", "StoredFormats", "FLOAT32", "rounding_place",
           "slot_key", "step_key"]

FORMAT_NAMES = ("float32", "float16", "bfloat16")
_NUMPY_FORMATS = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}
FORMAT_RANGE = {"float32": float(np.finfo(np.float32).max), "float16": 65504.0,
                "bfloat16": (2.0 - 2.0 ** -7) * 2.0 ** 127}  # 8 significant bits, float32's exponent range


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 dtype, imported on first use: importing ml_dtypes takes 0.5-1 s, which a process
    that never meets a bfloat16 array should not pay (a caller holding one has imported it already)."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is bfloat16 (of either byte order), told without importing ml_dtypes."""
    dtype = np.dtype(dtype)
    # kind and size first: reading ``name`` builds a string, which the per-step checks should not pay
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


def is_native_16_bit(dtype) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 in this machine's byte order (what jitted code reads)."""
    dtype = np.dtype(dtype)
    return dtype.isnative and (dtype == np.float16 or is_bfloat16(dtype))


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
    return bfloat16() if name == "bfloat16" else _NUMPY_FORMATS[name]


def format_of(dtype) -> str:
    """The format name of a stored array's dtype (``ValueError`` for any other dtype)."""
    dtype = np.dtype(dtype)
    for name, d in _NUMPY_FORMATS.items():
        if d == dtype:
            return name
    if is_bfloat16(dtype) and dtype == bfloat16():
        return "bfloat16"
    raise ValueError(f"tables are stored as {sorted(FORMAT_NAMES)}, not {dtype}")


def is_16_bit(name: str) -> bool:
    return name != "float32"


def bits_of(array: np.ndarray) -> np.ndarray:
    """What jitted code reads and writes: the array itself for float32, its ``uint16`` view (same memory)
    for a 16-bit format."""
    return array if array.dtype == np.float32 else array.view(np.uint16)


# The conversions of one value, as jitted functions whose IR comes from kernels/half_ir.py (computed in 32-bit
# lanes without a branch, so the loops over a row that call them become vector code).

def _of_bits(stored, build, result):
    """A jitted function of a value's ``uint16`` bits in format ``stored``: ``build(lanes, bits, stored)``'s
    IR (:mod:`half_ir`), of Numba type ``result``."""
    @intrinsic
    def of_bits(typingctx, bits):
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            h = context.cast(builder, args[0], signature.args[0], types.uint16)
            return build(half_ir.Lanes(builder), h, stored)
        return result(bits), codegen
    return of_bits


def _encoding(stored, stochastic):
    @intrinsic
    def encode(typingctx, value, random):
        if not (isinstance(value, types.Float) and isinstance(random, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            x = context.cast(builder, args[0], signature.args[0], types.float32)
            bits = context.cast(builder, args[1], signature.args[1], types.uint16) if stochastic else None
            return half_ir.encode(half_ir.Lanes(builder), x, bits, stored)
        return types.uint16(value, random), codegen
    return encode


_DECODE = {name: _of_bits(name, half_ir.decode, types.float32) for name in half_ir.FORMATS_16}
_NEAREST = {name: _encoding(name, False) for name in half_ir.FORMATS_16}
_STOCHASTIC = {name: _encoding(name, True) for name in half_ir.FORMATS_16}
_FINITE = {name: _of_bits(name, half_ir.finite, types.boolean) for name in half_ir.FORMATS_16}
_decode_bf16, _decode_f16 = _DECODE["bfloat16"], _DECODE["float16"]
_nearest_bf16, _nearest_f16 = _NEAREST["bfloat16"], _NEAREST["float16"]
_stochastic_bf16, _stochastic_f16 = _STOCHASTIC["bfloat16"], _STOCHASTIC["float16"]
_finite_bf16_bits, _finite_f16_bits = _FINITE["bfloat16"], _FINITE["float16"]


@njit(inline="always")
def bf16_to_f32(bits):
    """The float32 equal to the bfloat16 with these 16 bits (exact)."""
    return _decode_bf16(bits)


@njit(inline="always")
def f16_to_f32(bits):
    """The float32 equal to the float16 with these 16 bits (exact, subnormals, infinities and NaN too)."""
    return _decode_f16(bits)


@njit(inline="always")
def f32_to_bf16(value):
    """``value`` rounded to the nearest bfloat16, ties to even (NaN stays NaN), as 16 bits."""
    return _nearest_bf16(value, 0)


@njit(inline="always")
def f32_to_bf16_stochastic(value, random):
    """``value`` rounded stochastically to bfloat16 (module docstring) with the 16 random bits ``random``."""
    return _stochastic_bf16(value, random)


@njit(inline="always")
def f32_to_f16(value):
    """``value`` rounded to the nearest float16, ties to even, as 16 bits: infinity beyond 65519.99...,
    subnormals below 2**-14, NaN kept."""
    return _nearest_f16(value, 0)


@njit(inline="always")
def f32_to_f16_stochastic(value, random):
    """``value`` rounded stochastically to float16 (module docstring) with the 16 random bits ``random``."""
    return _stochastic_f16(value, random)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(inline="always")
def rounding_bits(key, counter):
    """64 random bits, a pure function of ``(key, counter)``: output ``counter`` of SplitMix64 seeded with
    ``key`` (its finaliser, as the initialisers', of ``key + (counter + 1) * golden``)."""
    return mix64(np.uint64(key) + (np.uint64(counter) + np.uint64(1)) * _GOLDEN)


ROUNDING_LANES = half_ir.WORD_LANES  # words of rounding bits :func:`rounding_words` makes at once


@intrinsic
def rounding_words(typingctx, out, start, key, counter):
    """``out[start + i] = rounding_bits(key, counter + i)`` for ``i < ROUNDING_LANES``, as one vector of
    ``ROUNDING_LANES`` words (the same bits: a scalar loop over a row's few words is unrolled, not
    vectorised). ``out`` is a C-contiguous uint64 array with room for the lanes (not checked)."""
    if not (isinstance(out, types.Array) and out.ndim == 1 and out.layout == "C" and out.dtype == types.uint64
            and all(isinstance(t, types.Integer) for t in (start, key, counter))):
        return None

    def codegen(context, builder, signature, args):
        at, key_v, counter_v = (context.cast(builder, args[i], signature.args[i], t)
                                for i, t in ((1, types.intp), (2, types.uint64), (3, types.uint64)))
        words, = half_ir.rounding_bits(builder, key_v, counter_v, ROUNDING_LANES)
        array = context.make_array(signature.args[0])(context, builder, args[0])
        builder.store(words, builder.bitcast(builder.gep(array.data, [at]), words.type.as_pointer()), align=8)
        return context.get_dummy_value()

    return types.void(out, start, key, counter), codegen


@njit(inline="always")
def _finite_bf16(bits):
    return _finite_bf16_bits(bits)


@njit(inline="always")
def _finite_f16(bits):
    return _finite_f16_bits(bits)


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
