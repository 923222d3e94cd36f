"""The fused, in-place optimizer update over the rows a batch touched.

For each unique row ``r`` (in parallel), its gradient ``g`` is summed into a scratch row, then::

    row[r], slot_0[r], ... = f(g, row[r], (slot_0[r], ...), learning_rate, hyperparameters)

``f`` is the user's per-row function, compiled by :mod:`embedcore.compiler`. Two ways to call it:

* element-wise (when proven so): ``f`` runs on float32 scalars, once per column, inlined into the loop, so
  no temporary row is ever made;
* per row: ``f`` runs on row views of the table and slots; what it returns is copied back. A function may
  also update the row views in place and return them, which costs no allocation.

``lazy=False`` visits every row of the table, with a zero gradient for rows the batch did not touch
(non-lazy Adam). A kernel is generated per (function, slot layout, mode) and kept for the process.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types  # noqa: F401  (prange is used by the generated source)
from numba.extending import overload

from .rows import sum_gradient

__all__ = ["update_kernel", "CHUNK_ROWS"]

CHUNK_ROWS = 256


def store_row(dst, value):
    """Copy ``value`` (a row or a scalar broadcast to the row) into the row view ``dst``; 0 on a length mismatch."""
    raise NotImplementedError("only callable from jitted code")


@overload(store_row, inline="always")
def _store_row_impl(dst, value):
    if isinstance(value, types.Array):
        def impl(dst, value):
            n = dst.shape[0]
            if value.shape[0] != n:
                return 0
            for j in range(n):
                dst[j] = value[j]
            return 1
        return impl

    def impl_scalar(dst, value):
        for j in range(dst.shape[0]):
            dst[j] = value
        return 1
    return impl_scalar


_TEMPLATE = '''
def kernel(table, slots, uniq, ptr, order, out_row, gains, d_act, learning_rate, hyperparameters, errors):
{unpack}
    n_unique = uniq.shape[0]
    dim = table.shape[1]
{loop}
'''

# Lazy: unique rows in chunks (one scratch gradient row per chunk, none per row).
_LAZY_LOOP = '''
    n_chunks = (n_unique + CHUNK - 1) // CHUNK
    for c in prange(n_chunks):
        g_row = np.empty(dim, np.float32)
        for u in range(c * CHUNK, min(n_unique, (c + 1) * CHUNK)):
            r = uniq[u]
            sum_gradient(g_row, u, ptr, order, out_row, gains, d_act)
{body}
'''

# Dense: every row of the table, in chunks; rows the batch did not touch get a zero gradient.
_DENSE_LOOP = '''
    n_rows = table.shape[0]
    n_chunks = (n_rows + CHUNK - 1) // CHUNK
    for c in prange(n_chunks):
        lo = c * CHUNK
        hi = min(n_rows, lo + CHUNK)
        g_row = np.empty(dim, np.float32)
        u = np.searchsorted(uniq, lo)
        for r in range(lo, hi):
            if u < n_unique and uniq[u] == r:
                sum_gradient(g_row, u, ptr, order, out_row, gains, d_act)
                u += 1
            else:
                g_row[:] = 0.0
{body}
'''


def _indent(lines, depth):
    return "\n".join(" " * (4 * depth) + line for line in lines)


def _body(slot_dims, elementwise):
    n = len(slot_dims)
    lines = []
    if elementwise:
        slot_args = "".join(f"s{k}[r, j], " for k in range(n))
        lines.append("for j in range(dim):")
        call = f"fn(g_row[j], table[r, j], ({slot_args}), learning_rate, hyperparameters)"
        if n == 0:
            lines.append(f"    table[r, j] = {call}")
        else:
            lines.append(f"    out = {call}")
            lines.append("    table[r, j] = out[0]")
            lines += [f"    s{k}[r, j] = out[{k + 1}]" for k in range(n)]
        return lines
    slot_args = "".join(f"s{k}[r], " for k in range(n))
    lines.append("w = table[r]")
    lines.append(f"out = fn(g_row, w, ({slot_args}), learning_rate, hyperparameters)")
    if n == 0:
        lines.append("if store_row(w, out) == 0:")
        lines.append("    errors[0] = 1")
        return lines
    lines.append("if store_row(w, out[0]) == 0:")
    lines.append("    errors[0] = 1")
    for k, d in enumerate(slot_dims):
        if d == 1:
            lines.append(f"s{k}[r] = out[{k + 1}]")
        else:
            lines.append(f"if store_row(s{k}[r], out[{k + 1}]) == 0:")
            lines.append("    errors[0] = 1")
    return lines


_KERNELS: dict = {}


def update_kernel(row_function, lazy=True):
    """The jitted update kernel for a :class:`~embedcore.compiler.CompiledRowFunction`.

    ``kernel(table, slots, uniq, ptr, order, out_row, gains, d_act, learning_rate, hyperparameters, errors)``
    updates ``table`` rows ``uniq`` (sorted, unique); the gradient of ``uniq[u]`` is summed on the fly from
    the activation gradients ``d_act`` (see :func:`~embedcore.kernels.rows.sum_gradient`), so it is never
    written to memory; ``errors[0]`` is set to 1 if the function
    returned a row of the wrong length for some row (those rows are left as the function's in-place edits made them).
    """
    key = (row_function.dispatcher, row_function.slot_dims, row_function.elementwise, lazy)
    kernel = _KERNELS.get(key)
    if kernel is None:
        slot_dims = row_function.slot_dims
        unpack = [f"s{k} = slots[{k}]" for k in range(len(slot_dims))] or ["pass"]
        depth = 3
        loop = (_LAZY_LOOP if lazy else _DENSE_LOOP).format(
            body=_indent(_body(slot_dims, row_function.elementwise), depth))
        source = _TEMPLATE.format(unpack=_indent(unpack, 1), loop=loop)
        namespace = {"np": np, "prange": prange, "fn": row_function.dispatcher, "store_row": store_row,
                     "sum_gradient": sum_gradient, "CHUNK": CHUNK_ROWS}
        exec(compile(source, f"<embedcore update kernel for {row_function.python_function!r}>", "exec"),
             namespace)
        kernel = njit(parallel=True, error_model="numpy")(namespace["kernel"])
        kernel.source = source
        _KERNELS[key] = kernel
    return kernel
