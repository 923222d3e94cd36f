"""16-bit arrays handed to cached jitted code with their format in their Numba type.

Numba has neither float16 rows it can vectorise nor bfloat16 at all, so jitted code reads a 16-bit array
as its ``uint16`` bits (:func:`embedcore.kernels.half.bits_of`); but bits alone do not say which format
they hold. A generated kernel binds the decoder it needs when it is generated (the update kernel does). A
function compiled once and cached on disk (``njit(cache=True)``) cannot: a decoder passed as an argument
makes Numba compile it again in every process. So such functions take a 16-bit array *tagged*: the bits in
a one-field named tuple whose class names the format (:class:`Float16Bits`, :class:`BFloat16Bits`), a
Numba type that is cached like any other, and read a value with :func:`value_at`, which for a tagged array
decodes its bits exactly to float32 (every 16-bit value is a float32) and for a float32 array reads the
value itself. One compiled variant exists per format.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import types
from numba.extending import overload

from .half import bf16_to_f32, f16_to_f32, format_of

__all__ = ["Float16Bits", "BFloat16Bits", "tagged", "value_at", "EXPONENT_MASK"]

# The exponent field of each 16-bit format: a value is NaN or Inf exactly when its exponent is all ones.
EXPONENT_MASK = {"float16": np.uint16(0x7C00), "bfloat16": np.uint16(0x7F80)}


class Float16Bits(NamedTuple):
    """The ``uint16`` bits of a float16 array, tagged as float16."""

    bits: np.ndarray


class BFloat16Bits(NamedTuple):
    """The ``uint16`` bits of a bfloat16 array, tagged as bfloat16."""

    bits: np.ndarray


_TAGS = {"float16": Float16Bits, "bfloat16": BFloat16Bits}
_DECODERS = {Float16Bits: f16_to_f32, BFloat16Bits: bf16_to_f32}


def tagged(array: np.ndarray):
    """``array`` as cached jitted code takes it: a float32 array itself, a 16-bit one as its tagged bits."""
    if array.dtype == np.float32:
        return array
    return _TAGS[format_of(array.dtype)](array.view(np.uint16))


def value_at(rows, i, j):
    """``rows[i, j]`` as float32, for ``rows`` a float32 array or a tagged 16-bit array (decoded exactly;
    jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(value_at, inline="always")
def _value_at_impl(rows, i, j):
    if isinstance(rows, types.Array):
        return lambda rows, i, j: rows[i, j]
    decode = _DECODERS.get(getattr(rows, "instance_class", None))
    if decode is None:
        return None
    return lambda rows, i, j: decode(rows.bits[i, j])
