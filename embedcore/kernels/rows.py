"""Gather-and-combine (lookup) and per-row gradient reduction.

A batch for one physical table is a list of occurrences: occurrence ``o`` reads physical row
``rows[o]`` with gain ``gains[o]`` into activation row ``out_row[o]``; occurrences are sorted by activation
row, so ``out_ptr`` (CSR) lists the occurrences of each activation row.

* lookup:    ``act[a] = sum over o in a of gains[o] * table[rows[o]]``
* gradient:  ``grad[u] = sum over occurrences o of uniq[u] (in order) of gains[o] * d_act[out_row[o]]``

Sums run in a fixed order, so results do not depend on the number of threads.
"""

import numpy as np
from numba import njit, prange

from .prefetch import prefetch_row

__all__ = ["gather_combine", "sum_gradient", "sum_gradients", "count_non_finite"]


ROWS_AHEAD = 8  # occurrences whose table rows a lookup prefetches ahead of the current one


@njit(cache=True, parallel=True)
def gather_combine(table, rows, gains, out_ptr, act):
    """``act[a] = sum over o in out_ptr[a]:out_ptr[a + 1] (in order) of gains[o] * table[rows[o]]``."""
    n_out, dim = act.shape
    n = rows.shape[0]
    for a in prange(n_out):
        for j in range(dim):
            act[a, j] = 0.0
        for o in range(out_ptr[a], out_ptr[a + 1]):
            if o + ROWS_AHEAD < n:
                prefetch_row(table, rows[o + ROWS_AHEAD])
            w = gains[o]
            r = rows[o]
            for j in range(dim):
                act[a, j] += w * table[r, j]


@njit(cache=True, inline="always")
def sum_gradient(g_row, u, ptr, order, out_row, gains, d_act):
    """``g_row = sum over occurrences o of unique row u (in order) of gains[o] * d_act[out_row[o]]``."""
    dim = g_row.shape[0]
    for j in range(dim):
        g_row[j] = 0.0
    for k in range(ptr[u], ptr[u + 1]):
        o = order[k]
        w = gains[o]
        a = out_row[o]
        for j in range(dim):
            g_row[j] += w * d_act[a, j]


@njit(cache=True)
def _count_non_finite_serial(values):
    bad = 0
    for i in range(values.shape[0]):
        if not np.isfinite(values[i]):
            bad += 1
    return bad


@njit(cache=True, parallel=True)
def _count_non_finite_parallel(values):
    bad = 0
    for i in prange(values.shape[0]):
        if not np.isfinite(values[i]):
            bad += 1
    return bad


PARALLEL_MIN = 1 << 20  # below this, waking the worker threads costs more than the scan


def count_non_finite(values) -> int:
    """Number of NaN/Inf entries of a flat float array (no temporary array, unlike ``np.isfinite``)."""
    kernel = _count_non_finite_parallel if values.shape[0] >= PARALLEL_MIN else _count_non_finite_serial
    return int(kernel(values))


@njit(cache=True, parallel=True)
def sum_gradients(out, ptr, order, out_row, gains, d_act):
    """``out[u] = sum_gradient(u)`` for every unique row ``u``: the per-row gradients a process sends to the
    rows' owners when tables are sharded (each row summed in the same fixed order as the fused kernel)."""
    for u in prange(out.shape[0]):
        sum_gradient(out[u], u, ptr, order, out_row, gains, d_act)
