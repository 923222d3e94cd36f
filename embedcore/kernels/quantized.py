"""Lookups from 8-bit row-wise quantized tables, dequantized inside the gather (no float32 copy of the table).

The layout is FBGEMM's fused 8-bit row-wise one: a table of ``dim`` values a row is a ``uint8`` array
``[n_rows, dim + 8]``, each row its ``dim`` codes followed by its float32 ``scale`` and float32 ``bias``
(little endian, at byte offsets ``dim`` and ``dim + 4``, so not necessarily 4-byte aligned); value ``j`` of
row ``r`` is ``scale_r * code_r[j] + bias_r``. :mod:`embedcore.export` writes such tables
(:func:`embedcore.export.quantize_int8_rows`).

The gather computes what :func:`embedcore.kernels.rows.weighted_sum` computes over the dequantized rows,
rearranged so each code costs one multiply-add: for activation row ``a``

    act[a, j] = sum over o of (gain[o] * scale[rows[o]]) * code[rows[o], j]  +  sum over o of gain[o] * bias[rows[o]]

the first sum grouped four occurrences at a time as ``weighted_sum`` groups them, the second (one number
per activation row) added to every value at the end. The result differs from summing ``gain * (scale * code
+ bias)`` only by float32 rounding; an activation row with no occurrence is zeros.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..compile_cache import jit_source
from .prefetch import prefetch
from .rows import ROWS_AHEAD, fixed_length, gain_at

__all__ = ["FUSED_EXTRA_BYTES", "gather_fused8", "fused8_kernel"]

FUSED_EXTRA_BYTES = 8  # a fused row's float32 scale and float32 bias, after its codes
_U = np.uint64
_LINE_BYTES = 64


@intrinsic
def load_float32(typingctx, array, row, col):
    """The float32 whose 4 bytes start at ``array[row, col]`` (a 2-D ``uint8`` array; any alignment)."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype == types.uint8
            and isinstance(row, types.Integer) and isinstance(col, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        ary = context.make_array(array_type)(context, builder, args[0])
        index = [context.cast(builder, args[1], signature.args[1], types.intp),
                 context.cast(builder, args[2], signature.args[2], types.intp)]
        pointer = cgutils.get_item_pointer2(context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
                                            cgutils.unpack_tuple(builder, ary.strides), array_type.layout, index,
                                            wraparound=False, boundscheck=False)
        return builder.load(builder.bitcast(pointer, ir.FloatType().as_pointer()), align=1)

    return types.float32(array, row, col), codegen


@njit(inline="always")
def _prefetch_fused(table, rows, k, n, ahead, count):
    """Prefetch every cache line of the fused rows of occurrences ``k + ahead .. k + ahead + count - 1``."""
    width = table.shape[1]
    for i in range(count):
        if k + ahead + i < n:
            r = rows[k + ahead + i]
            for j in range(0, width, _LINE_BYTES):
                prefetch(table, r, j)
            prefetch(table, r, width - 1)


@njit(inline="always")
def fused8_sum(act, a, lo, hi, rows, gains, table, ahead, dim):
    """``act[a] = sum over k in [lo, hi) of gains[k] * dequantized(table[rows[k]])`` (module docstring);
    ``gains`` None: every gain 1. Occurrences ``ahead`` places on are prefetched (0: none)."""
    du = _U(a)
    if hi <= lo:
        for j in range(dim):
            act[du, _U(j)] = 0.0
        return
    n = rows.shape[0]
    ds = _U(dim)
    db = _U(dim + 4)
    bias_sum = np.float32(0.0)
    k = lo
    if hi - lo >= 4:
        if ahead:
            _prefetch_fused(table, rows, k, n, ahead, 4)
        ku = _U(k)
        r0, r1, r2, r3 = _U(rows[ku]), _U(rows[ku + _U(1)]), _U(rows[ku + _U(2)]), _U(rows[ku + _U(3)])
        w0, w1 = gain_at(gains, ku), gain_at(gains, ku + _U(1))
        w2, w3 = gain_at(gains, ku + _U(2)), gain_at(gains, ku + _U(3))
        s0, s1 = w0 * load_float32(table, r0, ds), w1 * load_float32(table, r1, ds)
        s2, s3 = w2 * load_float32(table, r2, ds), w3 * load_float32(table, r3, ds)
        bias_sum = (w0 * load_float32(table, r0, db) + w1 * load_float32(table, r1, db)) + \
            (w2 * load_float32(table, r2, db) + w3 * load_float32(table, r3, db))
        for j in range(dim):
            ju = _U(j)
            act[du, ju] = (s0 * np.float32(table[r0, ju]) + s1 * np.float32(table[r1, ju])) + \
                (s2 * np.float32(table[r2, ju]) + s3 * np.float32(table[r3, ju]))
        k += 4
        while k + 3 < hi:
            if ahead:
                _prefetch_fused(table, rows, k, n, ahead, 4)
            ku = _U(k)
            r0, r1, r2, r3 = _U(rows[ku]), _U(rows[ku + _U(1)]), _U(rows[ku + _U(2)]), _U(rows[ku + _U(3)])
            w0, w1 = gain_at(gains, ku), gain_at(gains, ku + _U(1))
            w2, w3 = gain_at(gains, ku + _U(2)), gain_at(gains, ku + _U(3))
            s0, s1 = w0 * load_float32(table, r0, ds), w1 * load_float32(table, r1, ds)
            s2, s3 = w2 * load_float32(table, r2, ds), w3 * load_float32(table, r3, ds)
            bias_sum += (w0 * load_float32(table, r0, db) + w1 * load_float32(table, r1, db)) + \
                (w2 * load_float32(table, r2, db) + w3 * load_float32(table, r3, db))
            for j in range(dim):
                ju = _U(j)
                act[du, ju] += (s0 * np.float32(table[r0, ju]) + s1 * np.float32(table[r1, ju])) + \
                    (s2 * np.float32(table[r2, ju]) + s3 * np.float32(table[r3, ju]))
            k += 4
    else:  # fewer than four: the first occurrence starts the sum
        if ahead:
            _prefetch_fused(table, rows, k, n, ahead, 1)
        ku = _U(k)
        r = _U(rows[ku])
        w = gain_at(gains, ku)
        s = w * load_float32(table, r, ds)
        bias_sum = w * load_float32(table, r, db)
        for j in range(dim):
            ju = _U(j)
            act[du, ju] = s * np.float32(table[r, ju])
        k += 1
    while k < hi:
        if ahead:
            _prefetch_fused(table, rows, k, n, ahead, 1)
        ku = _U(k)
        r = _U(rows[ku])
        w = gain_at(gains, ku)
        s = w * load_float32(table, r, ds)
        bias_sum += w * load_float32(table, r, db)
        for j in range(dim):
            ju = _U(j)
            act[du, ju] += s * np.float32(table[r, ju])
        k += 1
    for j in range(dim):
        act[du, _U(j)] += bias_sum


@njit(cache=True, parallel=True)
def _gather_fused8_any_dim(table, rows, gains, out_ptr, act, ahead):
    dim = act.shape[1]
    for a in prange(act.shape[0]):
        fused8_sum(act, a, out_ptr[a], out_ptr[a + 1], rows, gains, table, ahead, dim)


# Compiled for one row length (a whole number of 64-byte float32 lines of activations), as the float32 gather
# is: a constant ``dim`` lets LLVM drop the row loops' trip-count checks and vectorise them in full.
_FIXED_SOURCE = '''
def gather(table, rows, gains, out_ptr, act):
    if table.shape[1] != {dim} + {extra} or act.shape[1] != {dim}:
        raise ValueError("int8 gather kernel compiled for rows of {dim} values called with other rows")
    for a in prange(act.shape[0]):
        fused8_sum(act, a, out_ptr[a], out_ptr[a + 1], rows, gains, table, {ahead}, {dim})
'''

_KERNELS: dict = {}


def fused8_kernel(dim: int, prefetch_rows: bool = True):
    """The jitted int8 gather compiled for rows of ``dim`` values (a :func:`~embedcore.kernels.rows.fixed_length`),
    ``gather(table, rows, gains, out_ptr, act)``, cached on disk like the other generated kernels."""
    if not fixed_length(dim):
        raise ValueError(f"no int8 gather is compiled for rows of {dim} values; gather_fused8 takes any length")
    ahead = ROWS_AHEAD if prefetch_rows else 0
    kernel = _KERNELS.get((dim, ahead))
    if kernel is None:
        namespace = {"prange": prange, "fused8_sum": fused8_sum}
        source = _FIXED_SOURCE.format(dim=dim, ahead=ahead, extra=FUSED_EXTRA_BYTES)
        kernel = _KERNELS[dim, ahead] = jit_source(source, namespace, "gather", ("int8 gather kernel", dim, ahead),
                                                   f"embedcore int8 gather kernel, dim {dim}, {ahead} ahead",
                                                   parallel=True)
    return kernel


def gather_fused8(table, rows, gains, out_ptr, act, prefetch_rows: bool = True) -> None:
    """``act[a] = sum over o in out_ptr[a]:out_ptr[a + 1] of gains[o] * dequantized(table[rows[o]])`` for a
    fused 8-bit row-wise ``table`` (``uint8 [n_rows, dim + 8]``, C-contiguous; ``act`` float32 ``[n_out, dim]``;
    ``gains`` None: every gain 1). The caller checks that ``rows`` are in range."""
    dim = act.shape[1]
    if table.ndim != 2 or table.dtype != np.uint8 or table.shape[1] != dim + FUSED_EXTRA_BYTES:
        raise ValueError(f"an int8 gather into rows of {dim} values needs a uint8 table of {dim + FUSED_EXTRA_BYTES} "
                         f"bytes a row, got {table.dtype} {table.shape}")
    if fixed_length(dim):
        fused8_kernel(dim, prefetch_rows)(table, rows, gains, out_ptr, act)
    else:
        _gather_fused8_any_dim(table, rows, gains, out_ptr, act, ROWS_AHEAD if prefetch_rows else 0)
