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

No NaN or Inf is ever written: a row whose summed gradient is not finite (float32 overflow of large
gradients, or NaN/Inf let through on purpose) is not updated, and neither is a row for which ``f`` returns a
non-finite value. The new values are computed into per-chunk scratch rows, checked, then stored; each
skipped row gets a code in ``status`` (per unique row when lazy, per table row when not):

    STATUS_GRADIENT (1)  the summed gradient holds NaN/Inf; the row, its slots untouched
    STATUS_OUTPUT (2)    f returned NaN/Inf; the row, its slots untouched
    STATUS_LENGTH (3)    f returned a row of the wrong length (a programming error, reported by the engine)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types  # noqa: F401  (prange is used by the generated source)
from numba.extending import overload

from .rows import sum_gradient

__all__ = ["update_kernel", "CHUNK_ROWS", "STATUS_GRADIENT", "STATUS_OUTPUT", "STATUS_LENGTH"]

CHUNK_ROWS = 256
STATUS_GRADIENT, STATUS_OUTPUT, STATUS_LENGTH = 1, 2, 3


def all_finite(value):
    """Whether every value of a row (or a scalar) is finite."""
    raise NotImplementedError("only callable from jitted code")


@overload(all_finite, inline="always")
def _all_finite_impl(value):
    if isinstance(value, types.Array):
        def impl(value):
            for j in range(value.shape[0]):
                if not np.isfinite(value[j]):
                    return False
            return True
        return impl

    def impl_scalar(value):
        return np.isfinite(value)
    return impl_scalar


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
def kernel(table, slots, uniq, ptr, order, out_row, gains, d_act, learning_rate, hyperparameters, status):
{unpack}
    n_unique = uniq.shape[0]
    dim = table.shape[1]
{loop}
'''

# Per chunk: one scratch row for the gradient and one for each new row / slot row (none per table row).
_SCRATCH = '''        g_row = np.empty(dim, np.float32)
        w_new = np.empty(dim, np.float32)
{slot_scratch}'''

# Lazy: unique rows in chunks.
_LAZY_LOOP = '''
    n_chunks = (n_unique + CHUNK - 1) // CHUNK
    for c in prange(n_chunks):
{scratch}
        for u in range(c * CHUNK, min(n_unique, (c + 1) * CHUNK)):
            r = uniq[u]
            item = u
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
{scratch}
        u = np.searchsorted(uniq, lo)
        for r in range(lo, hi):
            item = r
            if u < n_unique and uniq[u] == r:
                sum_gradient(g_row, u, ptr, order, out_row, gains, d_act)
                u += 1
            else:
                g_row[:] = 0.0
{body}
'''


def _indent(lines, depth):
    return "\n".join(" " * (4 * depth) + line for line in lines)


def _scratch(slot_dims):
    lines = [f"        n{k} = np.empty(dim, np.float32)" for k, d in enumerate(slot_dims) if d == 2]
    return _SCRATCH.format(slot_scratch="\n".join(lines) + ("\n" if lines else ""))


def _body(slot_dims, elementwise):
    """Compute the new row and slots into scratch, check them, then store them (or record a status)."""
    n = len(slot_dims)
    lines = ["if not all_finite(g_row):", "    status[item] = STATUS_GRADIENT", "    continue", "ok = True"]
    if elementwise:
        slot_args = "".join(f"s{k}[r, j], " for k in range(n))
        lines.append("for j in range(dim):")
        call = f"fn(g_row[j], table[r, j], ({slot_args}), learning_rate, hyperparameters)"
        if n == 0:
            lines += [f"    w_new[j] = {call}", "    ok = ok & np.isfinite(w_new[j])"]
        else:
            lines += [f"    out = {call}", "    w_new[j] = out[0]", "    ok = ok & np.isfinite(out[0])"]
            for k in range(n):
                lines += [f"    n{k}[j] = out[{k + 1}]", f"    ok = ok & np.isfinite(out[{k + 1}])"]
        lines += ["if not ok:", "    status[item] = STATUS_OUTPUT", "    continue", "for j in range(dim):",
                  "    table[r, j] = w_new[j]"]
        lines += [f"    s{k}[r, j] = n{k}[j]" for k in range(n)]
        return lines
    # Per row: the function gets scratch copies, so in-place edits reach the table only once checked.
    lines.append("w_new[:] = table[r]")
    lines += [f"n{k}[:] = s{k}[r]" for k, d in enumerate(slot_dims) if d == 2]
    slot_args = "".join(f"n{k}, " if d == 2 else f"s{k}[r], " for k, d in enumerate(slot_dims))
    lines.append(f"out = fn(g_row, w_new, ({slot_args}), learning_rate, hyperparameters)")
    outputs = ["out"] if n == 0 else [f"out[{k}]" for k in range(n + 1)]
    lines.append("if not (" + " and ".join(f"all_finite({o})" for o in outputs) + "):")
    lines += ["    status[item] = STATUS_OUTPUT", "    continue"]
    lines.append(f"if store_row(table[r], {outputs[0]}) == 0:")
    lines.append("    status[item] = STATUS_LENGTH")
    for k, d in enumerate(slot_dims):
        if d == 1:
            lines.append(f"s{k}[r] = out[{k + 1}]")
        else:
            lines.append(f"if store_row(s{k}[r], out[{k + 1}]) == 0:")
            lines.append("    status[item] = STATUS_LENGTH")
    return lines


_KERNELS: dict = {}


def update_kernel(row_function, lazy=True):
    """The jitted update kernel for a :class:`~embedcore.compiler.CompiledRowFunction`.

    ``kernel(table, slots, uniq, ptr, order, out_row, gains, d_act, learning_rate, hyperparameters, status)``
    updates ``table`` rows ``uniq`` (sorted, unique); the gradient of ``uniq[u]`` is summed on the fly from
    the activation gradients ``d_act`` (see :func:`~embedcore.kernels.rows.sum_gradient`), so it is never
    written to memory. ``status`` (uint8, zeroed, one entry per unique row when lazy, per table row when
    not) receives the code of every row that was not updated (see the module docstring).
    """
    key = (row_function.dispatcher, row_function.slot_dims, row_function.elementwise, lazy)
    kernel = _KERNELS.get(key)
    if kernel is None:
        slot_dims = row_function.slot_dims
        unpack = [f"s{k} = slots[{k}]" for k in range(len(slot_dims))] or ["pass"]
        depth = 3
        loop = (_LAZY_LOOP if lazy else _DENSE_LOOP).format(
            scratch=_scratch(slot_dims), body=_indent(_body(slot_dims, row_function.elementwise), depth))
        source = _TEMPLATE.format(unpack=_indent(unpack, 1), loop=loop)
        namespace = {"np": np, "prange": prange, "fn": row_function.dispatcher, "store_row": store_row,
                     "all_finite": all_finite, "sum_gradient": sum_gradient, "CHUNK": CHUNK_ROWS,
                     "STATUS_GRADIENT": STATUS_GRADIENT, "STATUS_OUTPUT": STATUS_OUTPUT,
                     "STATUS_LENGTH": STATUS_LENGTH}
        exec(compile(source, f"<embedcore update kernel for {row_function.python_function!r}>", "exec"),
             namespace)
        kernel = njit(parallel=True, error_model="numpy")(namespace["kernel"])
        kernel.source = source
        _KERNELS[key] = kernel
    return kernel
