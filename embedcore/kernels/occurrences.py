"""Host-side batch kernels: checking a feature's ids and weights, and laying out a table's occurrences.

A physical table's batch is a list of occurrences (see :class:`embedcore.inputs.TableBatch`): occurrence
``o`` reads physical row ``rows[o]`` with gain ``gains[o]`` into activation row ``out_row[o]``; ``out_ptr``
(CSR over activation rows) lists the occurrences of each activation row. :func:`fill_occurrences` writes
one feature's part of those arrays in a single pass over its ids:

* pooled feature (``seq_len == 0``), sample ``b`` holding ids ``lo..hi``: every id feeds activation row
  ``out_offset + b`` with gain ``w`` (``sum``), ``w / sum(w)`` (``mean``) or ``w / sqrt(sum(w^2))``
  (``sqrtn``), sums in float64 and 0 for a zero sum (``w`` = 1 without weights);
* sequence feature (``seq_len = L > 0``): the id at position ``p < L`` of sample ``b`` feeds activation row
  ``out_offset + b L + p`` with gain ``w``; ids at positions ``>= L`` are dropped.
"""

import numpy as np
from numba import njit

__all__ = ["first_out_of_range", "first_non_finite", "fill_occurrences", "COMBINERS"]

COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}


@njit(cache=True)
def first_out_of_range(ids, vocabulary_size):
    """Flat index of the first id outside ``[0, vocabulary_size)``, or -1 (ids of any integer type)."""
    for i in range(ids.shape[0]):
        v = ids[i]
        if v < 0 or v >= vocabulary_size:
            return i
    return -1


@njit(cache=True)
def first_non_finite(values):
    """Flat index of the first NaN/Inf, or -1."""
    for i in range(values.shape[0]):
        if not np.isfinite(values[i]):
            return i
    return -1


@njit(cache=True)
def fill_occurrences(ids, splits, weights, positions, combiner, seq_len, row_offset, out_offset, start, rows,
                     gains, out_row, out_ptr):
    """Write one feature's occurrences at ``start`` (and its activation rows' ``out_ptr`` entries); returns
    how many it wrote. ``weights`` and ``positions`` may be empty: weights 1, positions ``i - splits[b]``."""
    n_samples = splits.shape[0] - 1
    weighted = weights.shape[0] > 0
    explicit_positions = positions.shape[0] > 0
    at = start
    for b in range(n_samples):
        lo, hi = splits[b], splits[b + 1]
        if seq_len == 0:
            denominator = 1.0
            if combiner != 0:
                total = 0.0
                for i in range(lo, hi):
                    w = np.float64(weights[i]) if weighted else 1.0
                    total += w if combiner == 1 else w * w
                denominator = total if combiner == 1 else np.sqrt(total)
            a = out_offset + b
            for i in range(lo, hi):
                rows[at] = ids[i] + row_offset
                if combiner == 0:
                    gains[at] = weights[i] if weighted else np.float32(1.0)
                elif denominator == 0.0:
                    gains[at] = 0.0
                else:
                    w = np.float64(weights[i]) if weighted else 1.0
                    gains[at] = np.float32(w / denominator)
                out_row[at] = a
                at += 1
            out_ptr[a + 1] = at
        else:
            first = out_offset + b * seq_len
            for p in range(seq_len):
                out_ptr[first + p + 1] = 0
            for i in range(lo, hi):
                p = positions[i] if explicit_positions else i - lo
                if p < seq_len:
                    rows[at] = ids[i] + row_offset
                    gains[at] = weights[i] if weighted else np.float32(1.0)
                    out_row[at] = first + p
                    out_ptr[first + p + 1] += 1  # a Sparse batch may repeat a position
                    at += 1
            count = out_ptr[first]
            for p in range(seq_len):
                count += out_ptr[first + p + 1]
                out_ptr[first + p + 1] = count
    return at - start
