"""Whole rows of a 16-bit array read and written by the update kernel.

* ``load_row(dst, src, r, dim)``: ``dst[:] = src[r]`` as float32 (exact);
* ``store_row(dst, r, values, key, counter, random_words, encoded, dim) -> bool``: ``dst[r] = values``
  rounded to the array's format, stochastically with the bits of :func:`~embedcore.kernels.half.rounding_bits`
  (value ``j`` takes bits ``16 * (j % 4)`` and up of word ``counter + j // 4`` under ``key``) or to nearest,
  stored only if every rounded value is finite; returns whether it stored.

:func:`row_loader` and :func:`row_storer` make them for one format (and rounding), ``dim`` being the rows'
length. When ``dim`` is a constant multiple of 16 (the kernels compiled for one row length) and the arrays are
C-contiguous, the row is converted in vector registers (one LLVM intrinsic: :mod:`embedcore.kernels.half_ir`'s
conversions on all its values at once, the random words hashed as one vector, the rounded row checked and
stored without a scratch copy). Else element by element through ``random_words`` (uint64, at least
``ceil(ceil(dim / 4) / ROUNDING_LANES) * ROUNDING_LANES``) and ``encoded`` (uint16, ``dim``), which the
register form does not touch. The two compute the same bits.

Why registers: a rounded row written to scratch by 16-byte vector stores and copied out by 32-byte loads
stalls each load until the stores retire (a store cannot forward its data to a wider load), which cost a
bfloat16 update ~25 ns a row, more than its arithmetic. For the same reason the register form reads the
float32 values, which the row function has just written, ``_CHUNK`` at a time: as one vector of the whole
row LLVM would load them in 64-byte registers, wider than the 32-byte stores of the loops that wrote them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import half_ir
from .half import ROUNDING_LANES, decoder, encoder, finite_16, rounding_words

__all__ = ["row_loader", "row_storer", "in_registers"]

_LINE_VALUES = 16  # the register form's rows are whole 64-byte lines of float32


def in_registers(dim, *arrays) -> bool:
    """Whether rows of length ``dim`` (a Numba type) of these arrays (Numba types) are converted in registers."""
    return (isinstance(dim, types.IntegerLiteral) and dim.literal_value > 0
            and dim.literal_value % _LINE_VALUES == 0
            and all(isinstance(a, types.Array) and a.layout == "C" for a in arrays))


def _row_pointer(context, builder, array_type, array, indices):
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer2(context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
                                     cgutils.unpack_tuple(builder, ary.strides), array_type.layout, indices,
                                     wraparound=False, boundscheck=False)


def _load_intrinsic(stored):
    @intrinsic
    def load_registers(typingctx, dst, src, r, dim):
        if not in_registers(dim, dst, src):
            return None
        n = dim.literal_value

        def codegen(context, builder, signature, args):
            row = context.cast(builder, args[2], signature.args[2], types.intp)
            bits_type = ir.VectorType(ir.IntType(16), n)
            zero = context.get_constant(types.intp, 0)
            source = _row_pointer(context, builder, signature.args[1], args[1], [row, zero])
            bits = builder.load(builder.bitcast(source, bits_type.as_pointer()), align=2)
            values = half_ir.decode(half_ir.Lanes(builder, n), bits, stored)
            target = _row_pointer(context, builder, signature.args[0], args[0], [zero])
            builder.store(values, builder.bitcast(target, values.type.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(dst, src, r, dim), codegen
    return load_registers


_CHUNK = 8  # values converted per vector: loads no wider than the stores that wrote them (see below)


def _store_intrinsic(stored, stochastic):
    @intrinsic
    def store_registers(typingctx, dst, r, values, key, counter, dim):
        if not (in_registers(dim, dst, values) and all(isinstance(t, types.Integer) for t in (r, key, counter))):
            return None
        n = dim.literal_value

        def codegen(context, builder, signature, args):
            lanes = half_ir.Lanes(builder, _CHUNK)
            row = context.cast(builder, args[1], signature.args[1], types.intp)
            zero = context.get_constant(types.intp, 0)
            source = builder.bitcast(_row_pointer(context, builder, signature.args[2], args[2], [zero]),
                                     lanes.of(ir.FloatType()).as_pointer())
            if stochastic:
                key_v, counter_v = (context.cast(builder, args[i], signature.args[i], types.uint64) for i in (3, 4))
                words = half_ir.rounding_bits(builder, key_v, counter_v, n // 4)
            chunks, finite = [], None
            for c in range(0, n, _CHUNK):
                x = builder.load(builder.gep(source, [ir.IntType(32)(c // _CHUNK)]), align=4)
                bits = half_ir.random_lanes(builder, words, c, _CHUNK) if stochastic else None
                encoded, ok = half_ir.encode_checked(lanes, x, bits, stored)
                chunks.append(encoded)
                finite = ok if finite is None else builder.and_(finite, ok)
            finite = half_ir.all_true(lanes, finite)
            with builder.if_then(finite, likely=True):
                target = builder.bitcast(_row_pointer(context, builder, signature.args[0], args[0], [row, zero]),
                                         lanes.of(ir.IntType(16)).as_pointer())
                for i, chunk in enumerate(chunks):
                    builder.store(chunk, builder.gep(target, [ir.IntType(32)(i)]), align=2)
            return finite
        return types.boolean(dst, r, values, key, counter, dim), codegen
    return store_registers


_LOADERS: dict = {}
_STORERS: dict = {}


def row_loader(stored: str):
    """The jitted ``load_row(dst, src, r, dim)`` of rows in format ``stored`` (module docstring)."""
    if stored not in _LOADERS:
        registers, decode = _load_intrinsic(stored), decoder(stored)

        def load_row(dst, src, r, dim):
            raise NotImplementedError("only callable from jitted code")

        @overload(load_row, inline="always", prefer_literal=True)
        def _load_row_impl(dst, src, r, dim):
            if in_registers(dim, dst, src):
                return lambda dst, src, r, dim: registers(dst, src, r, dim)

            def impl(dst, src, r, dim):
                for j in range(dim):
                    dst[j] = decode(src[r, j])
            return impl
        _LOADERS[stored] = load_row
    return _LOADERS[stored]


def row_storer(stored: str, stochastic: bool):
    """The jitted ``store_row(dst, r, values, key, counter, random_words, encoded, dim) -> bool`` of rows in
    format ``stored``, rounding stochastically or to nearest (module docstring)."""
    if (stored, stochastic) not in _STORERS:
        registers, encode, finite = _store_intrinsic(stored, stochastic), encoder(stored, stochastic), finite_16(stored)

        def store_row(dst, r, values, key, counter, random_words, encoded, dim):
            raise NotImplementedError("only callable from jitted code")

        @njit
        def value_by_value(dst, r, values, key, counter, random_words, encoded, dim):
            random_16 = random_words.view(np.uint16)
            if stochastic:
                for q in range(0, (dim + 3) // 4, ROUNDING_LANES):
                    rounding_words(random_words, q, key, counter + np.uint64(q))
            ok = True
            for j in range(dim):
                encoded[j] = encode(values[j], random_16[j])
                ok = ok & finite(encoded[j])
            if ok:
                for j in range(dim):
                    dst[r, j] = encoded[j]
            return ok

        # (value_by_value is called, not inlined: Numba's inliner mislabels its variables when it inlines the
        # same loops twice in one kernel, as an update of 16-bit rows and 16-bit slots does)
        @overload(store_row, inline="always", prefer_literal=True)
        def _store_row_impl(dst, r, values, key, counter, random_words, encoded, dim):
            if in_registers(dim, dst, values):
                return lambda dst, r, values, key, counter, random_words, encoded, dim: \
                    registers(dst, r, values, key, counter, dim)
            return lambda dst, r, values, key, counter, random_words, encoded, dim: \
                value_by_value(dst, r, values, key, counter, random_words, encoded, dim)
        _STORERS[stored, stochastic] = store_row
    return _STORERS[stored, stochastic]
