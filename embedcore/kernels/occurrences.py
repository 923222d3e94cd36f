"""Host-side batch kernels: checking a feature's ids and weights, and laying out a table's occurrences.

A physical table's batch is a list of occurrences (see :class:`embedcore.inputs.TableBatch`): occurrence
``o`` reads physical row ``rows[o]`` with gain ``g`` into activation row ``a``; ``out_ptr`` (CSR over
activation rows) lists the occurrences of each activation row. ``a`` and ``g`` travel together as one
64-bit word, ``packed[o] = a << 32 | bits(g)`` (:func:`packed_views` reads them back without copying), so
the sort that groups occurrences by row carries them in one payload. When every gain of a batch is 1 (no
weights, ``sum`` or sequence features: the common case) no payload is written at all (``packed`` is empty):
``out_ptr`` says which activation row each occurrence feeds, the grouping writes those rows, int32, in
grouped order, and the lookup and the update read no gains (:func:`payload_views` reads either kind of
grouped payload). :func:`fill_occurrences` writes one
feature's part of those arrays in a single pass over its ids, range-checking them in the same pass (a
separate check would read every id once more, from memory):

* pooled feature (``seq_len == 0``), sample ``b`` holding ids ``lo..hi``: every id feeds activation row
  ``out_offset + b`` with gain ``w`` (``sum``), ``w / sum(w)`` (``mean``) or ``w / sqrt(sum(w^2))``
  (``sqrtn``), sums in float64 and 0 for a zero sum (``w`` = 1 without weights);
* sequence feature (``seq_len = L > 0``): the id at position ``p < L`` of sample ``b`` feeds activation row
  ``out_offset + b L + p`` with gain ``w``; ids at positions ``>= L`` are dropped.

Activation rows must be below 2**31 (a batch of two billion activation rows would not fit in memory).
"""

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

__all__ = ["first_out_of_range", "first_non_finite", "splits_are_valid", "fill_occurrences", "pack_occurrences",
           "packed_views", "payload_views", "occurrence_views", "holds_rows_alone",
           "activation_rows", "COMBINERS", "ROW_HALF", "GAIN_HALF"]

COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}
_U = np.uint64


@njit(cache=True)
def first_out_of_range(ids, vocabulary_size):
    """Flat index of the first id outside ``[0, vocabulary_size)``, or -1 (ids of any integer type)."""
    n = ids.shape[0]
    if n == 0:
        return -1
    low = high = ids[0]
    for i in range(n):  # min and max first: a loop without an early exit vectorises
        v = ids[i]
        low = min(low, v)
        high = max(high, v)
    if low >= 0 and high < vocabulary_size:
        return -1
    for i in range(n):
        v = ids[i]
        if v < 0 or v >= vocabulary_size:
            return i
    return -1


@njit(cache=True)
def first_non_finite(values):
    """Flat index of the first NaN/Inf, or -1."""
    n = values.shape[0]
    ok = True
    for i in range(n):
        ok = ok & np.isfinite(values[i])
    if ok:
        return -1
    for i in range(n):
        if not np.isfinite(values[i]):
            return i
    return -1


@njit(cache=True)
def splits_are_valid(splits, n_values):
    """Whether ``splits`` starts at 0, never decreases and ends at ``n_values`` (signed integers)."""
    n = splits.shape[0]
    if n == 0 or splits[0] != 0 or splits[n - 1] != n_values:
        return False
    ok = True
    for i in range(1, n):  # no early exit, so the loop vectorises
        ok = ok & (splits[i] >= splits[i - 1])
    return ok


@intrinsic
def _float32_bits(typingctx, value):
    """The bits of a float32 as a uint32 (a reinterpretation, not a conversion)."""
    if not isinstance(value, types.Float) or value.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(value), codegen


@njit(cache=True, inline="always")
def _pack(a, gain):
    return (np.int64(a) << 32) | np.int64(_float32_bits(np.float32(gain)))


@njit(cache=True, inline="always")
def _fill_pooled(ids, splits, weights, combiner, row_offset, out_offset, start, rows, packed, out_ptr, b_lo, b_hi):
    """The occurrences of samples ``b_lo..b_hi`` of a pooled feature (every id kept: occurrence
    ``start + i`` for id ``i``); returns the largest of their ids read as unsigned (a negative id reads as
    one above 2**63, so one comparison with the vocabulary size range-checks them all). Subscripts are
    unsigned (``_U``): Numba adds negative-index wraparound code to signed ones, which tripled the layout's
    time."""
    weighted = weights.shape[0] > 0
    largest = _U(0)
    for i in range(splits[b_lo], splits[b_hi]):
        v = ids[_U(i)]
        rows[_U(start + i)] = v + row_offset
        largest = max(largest, _U(v))
    for b in range(b_lo, b_hi):
        lo, hi = splits[_U(b)], splits[_U(b + 1)]
        a = out_offset + b
        if combiner == 0:
            if weighted:
                for i in range(lo, hi):
                    packed[_U(start + i)] = _pack(a, weights[_U(i)])
            elif packed.shape[0] > 0:  # else no payload: every gain is 1
                one = _pack(a, 1.0)
                for i in range(lo, hi):
                    packed[_U(start + i)] = one
        else:
            total = 0.0
            for i in range(lo, hi):
                w = np.float64(weights[_U(i)]) if weighted else 1.0
                total += w if combiner == 1 else w * w
            denominator = total if combiner == 1 else np.sqrt(total)
            for i in range(lo, hi):
                w = np.float64(weights[_U(i)]) if weighted else 1.0
                packed[_U(start + i)] = _pack(a, 0.0 if denominator == 0.0 else np.float32(w / denominator))
        out_ptr[_U(a + 1)] = start + hi
    return largest


# Ids of a pooled feature from which it is laid out by all threads. The serial layout writes billions of ids
# a second, so waking the workers pays only for larger features, and only while they spin: asleep
# (OMP_WAIT_POLICY=PASSIVE, a busy machine) a wake-up costs more than laying out a typical feature.
PARALLEL_MIN = 1 << 18


@njit(cache=True, parallel=True)
def _fill_pooled_parallel(ids, splits, weights, combiner, row_offset, out_offset, start, rows, packed, out_ptr,
                          n_parts):
    n_samples = splits.shape[0] - 1
    size = (n_samples + n_parts - 1) // n_parts
    largest = np.zeros(n_parts, np.uint64)
    for p in prange(n_parts):
        largest[p] = _fill_pooled(ids, splits, weights, combiner, row_offset, out_offset, start, rows, packed,
                                  out_ptr, min(n_samples, p * size), min(n_samples, (p + 1) * size))
    return largest.max()


def fill_occurrences(ids, splits, weights, positions, combiner, seq_len, row_offset, out_offset, start, rows,
                     packed, out_ptr, vocabulary_size, parallel_min=None):
    """Write one feature's occurrences at ``start`` (and its activation rows' ``out_ptr`` entries); returns
    ``(count, in_range)``: how many it wrote, and whether every id (dropped ones too) lies in
    ``[0, vocabulary_size)``, checked in the same pass (when not, the rows written are meaningless and must
    not be read). ``weights`` and ``positions`` may be empty: weights 1, positions ``i - splits[b]``.
    ``packed`` may be empty (nothing written) for a feature whose gains are all 1.
    Pooled features of at least ``parallel_min`` ids (``Tuning.parallel_layout_min``; None: ``PARALLEL_MIN``)
    are laid out by all threads, each a range of samples; the occurrences are the same either way."""
    if packed.shape[0] == 0 and ids.shape[0] and (weights.shape[0] or (seq_len == 0 and
                                                                      combiner != COMBINERS["sum"])):
        raise ValueError("only a feature whose gains are all 1 may be laid out without payloads")
    threads = numba.get_num_threads()
    if seq_len == 0 and ids.shape[0] >= (PARALLEL_MIN if parallel_min is None else parallel_min) and threads > 1:
        largest = _fill_pooled_parallel(ids, splits, weights, combiner, row_offset, out_offset, start, rows,
                                        packed, out_ptr, 4 * threads)
        count = ids.shape[0]
    else:
        count, largest = _fill_serial(ids, splits, weights, positions, combiner, seq_len, row_offset, out_offset,
                                      start, rows, packed, out_ptr)
    return count, ids.shape[0] == 0 or int(largest) < vocabulary_size


@njit(cache=True)
def _fill_serial(ids, splits, weights, positions, combiner, seq_len, row_offset, out_offset, start, rows,
                 packed, out_ptr):
    n_samples = splits.shape[0] - 1
    weighted = weights.shape[0] > 0
    explicit_positions = positions.shape[0] > 0
    if seq_len == 0:
        return ids.shape[0], _fill_pooled(ids, splits, weights, combiner, row_offset, out_offset, start, rows,
                                          packed, out_ptr, 0, n_samples)
    largest = _U(0)
    at = start
    for b in range(n_samples):
        lo, hi = splits[b], splits[b + 1]
        first = out_offset + b * seq_len
        for p in range(seq_len):
            out_ptr[_U(first + p + 1)] = 0
        for i in range(lo, hi):
            iu = _U(i)
            largest = max(largest, _U(ids[iu]))
            p = positions[iu] if explicit_positions else i - lo
            if p < seq_len:
                rows[_U(at)] = ids[iu] + row_offset
                if packed.shape[0] > 0:
                    packed[_U(at)] = _pack(first + p, weights[iu] if weighted else 1.0)
                out_ptr[_U(first + p + 1)] += 1  # a Sparse batch may repeat a position
                at += 1
        count = out_ptr[_U(first)]
        for p in range(seq_len):
            count += out_ptr[_U(first + p + 1)]
            out_ptr[_U(first + p + 1)] = count
    return at - start, largest


def pack_occurrences(out_row: np.ndarray, gains: np.ndarray) -> np.ndarray:
    """The packed words of separate activation rows and gains (for callers that have them apart)."""
    gains = np.ascontiguousarray(gains, np.float32)
    return (np.asarray(out_row, np.int64) << 32) | gains.view(np.uint32).astype(np.int64)


ROW_HALF, GAIN_HALF = (1, 0) if np.little_endian else (0, 1)  # 32-bit halves of a word, in memory order


def packed_views(packed: np.ndarray):
    """``(out_row, gains)``: the int32 high halves and the float32 low halves of the 64-bit ``packed`` words."""
    return packed.view(np.int32)[ROW_HALF::2], packed.view(np.float32)[GAIN_HALF::2]


def holds_rows_alone(payload) -> bool:
    """Whether a payload array (or its Numba type) holds activation rows alone, every gain 1 (int32), rather
    than packed words (int64)."""
    dtype = payload.dtype
    return dtype == types.int32 if isinstance(dtype, types.Type) else np.dtype(dtype) == np.int32


@njit(cache=True)
def activation_rows(out_ptr, a_lo, a_hi, out):
    """``out[o] = a`` for every occurrence ``o`` of the activation rows ``a_lo <= a < a_hi`` (CSR ``out_ptr``):
    the grouped payload of a batch laid out without one (every gain 1)."""
    for a in range(a_lo, a_hi):
        for o in range(out_ptr[_U(a)], out_ptr[_U(a + 1)]):
            out[_U(o)] = a


def payload_views(payload: np.ndarray):
    """``(out_row, gains)`` of a payload array: :func:`packed_views` of packed words, or ``(payload, None)``
    for activation rows alone (every gain 1; the sums take ``None`` for such gains)."""
    return (payload, None) if holds_rows_alone(payload) else packed_views(payload)


def occurrence_views(payload):
    """:func:`payload_views` in jitted code."""
    raise NotImplementedError("only callable from jitted code")


@overload(occurrence_views, inline="always")
def _occurrence_views_impl(payload):
    if holds_rows_alone(payload):
        return lambda payload: (payload, None)

    def impl(payload):
        n = payload.shape[0]
        return (payload.view(np.int32).reshape((n, 2))[:, ROW_HALF],
                payload.view(np.float32).reshape((n, 2))[:, GAIN_HALF])
    return impl
