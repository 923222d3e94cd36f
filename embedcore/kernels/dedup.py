"""Unique rows of a batch by LSD radix sort.

Given the physical row of every occurrence, produce the unique rows in ascending order, and the
occurrences grouped by unique row (CSR: ``order[ptr[u]:ptr[u + 1]]`` are the occurrences of ``uniq[u]``,
in their original order). The sort is stable, so every later sum over a row's occurrences runs in the
same order on every run and thread count.
"""

import numpy as np
from numba import njit

__all__ = ["unique_rows", "DIGIT_BITS"]

DIGIT_BITS = 11
_RADIX = 1 << DIGIT_BITS


@njit(cache=True)
def _radix_sort(keys, n_bits, order, scratch_order):
    """Stable sort of occurrence indices ``0..n-1`` by ``keys``; result in ``order``."""
    n = keys.shape[0]
    for i in range(n):
        order[i] = i
    counts = np.empty(_RADIX + 1, np.int64)
    shift = 0
    src, dst = order, scratch_order
    while shift < n_bits:
        counts[:] = 0
        for i in range(n):
            counts[((keys[i] >> shift) & (_RADIX - 1)) + 1] += 1
        if counts[1:].max() != n:  # skip a digit on which all keys agree
            for d in range(_RADIX):
                counts[d + 1] += counts[d]
            for i in range(n):
                o = src[i]
                d = (keys[o] >> shift) & (_RADIX - 1)
                dst[counts[d]] = o
                counts[d] += 1
            src, dst = dst, src
        shift += DIGIT_BITS
    if src is not order:
        order[:] = src


@njit(cache=True)
def _group(keys, order, uniq, ptr):
    n = keys.shape[0]
    n_unique = 0
    previous = -1
    for k in range(n):
        key = keys[order[k]]
        if k == 0 or key != previous:
            uniq[n_unique] = key
            ptr[n_unique] = k
            n_unique += 1
            previous = key
    ptr[n_unique] = n
    return n_unique


def unique_rows(rows: np.ndarray, n_rows: int, workspace):
    """``(uniq, ptr, order)`` for int64 ``rows`` in ``[0, n_rows)``; buffers come from a ``Workspace``."""
    n = rows.shape[0]
    order = workspace.array("order", n, np.int64)
    scratch = workspace.array("scratch_order", n, np.int64)
    uniq = workspace.array("uniq", n, np.int64)
    ptr = workspace.array("ptr", n + 1, np.int64)
    n_bits = max(1, int(n_rows - 1).bit_length())
    _radix_sort(rows, n_bits, order, scratch)
    n_unique = _group(rows, order, uniq, ptr)
    return uniq[:n_unique], ptr[:n_unique + 1], order

