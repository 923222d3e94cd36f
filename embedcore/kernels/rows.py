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

__all__ = ["gather_combine", "reduce_gradients"]


@njit(cache=True, parallel=True)
def gather_combine(table, rows, gains, out_ptr, act):
    n_out, dim = act.shape
    for a in prange(n_out):
        for j in range(dim):
            act[a, j] = 0.0
        for o in range(out_ptr[a], out_ptr[a + 1]):
            w = gains[o]
            r = rows[o]
            for j in range(dim):
                act[a, j] += w * table[r, j]


@njit(cache=True, parallel=True)
def reduce_gradients(d_act, gains, out_row, order, ptr, grads):
    n_unique, dim = grads.shape
    for u in prange(n_unique):
        for j in range(dim):
            grads[u, j] = 0.0
        for k in range(ptr[u], ptr[u + 1]):
            o = order[k]
            w = gains[o]
            a = out_row[o]
            for j in range(dim):
                grads[u, j] += w * d_act[a, j]
