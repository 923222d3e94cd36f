"""Unique rows of a batch, by a stable LSD radix sort of the occurrences' rows (or, for a batch made of
blocks of disjoint row ranges, by hashing each block; see the section on blocks below).

Given the physical row of every occurrence, produce the unique rows in ascending order, and the
occurrences grouped by unique row (CSR: ``order[ptr[u]:ptr[u + 1]]`` are the occurrences of ``uniq[u]``,
in their original order). The sort is stable, so every later sum over a row's occurrences runs in the
same order on every run and thread count.

:func:`group_rows` also lays out, in that grouped order, what the update needs of each occurrence (its
activation row and its gain, packed in one word, or, when every gain is 1, its activation row alone), so
that the update reads them sequentially instead of through ``order``.

The sort makes one pass per 11-bit digit of the row numbers, skipping digits on which all rows agree. Large
batches sort in parallel: each thread counts and then scatters its own contiguous part of the input; the
parts are placed in input order within every digit, which keeps the sort stable (and the result identical
to the serial sort's). There, each element is one 64-bit word, row and occurrence number, and the last pass
writes each word's payload beside it (a sort carrying a separate key and payload moves twice the bytes,
and a separate pass gathering the payloads after the sort reads them all once more).
"""

from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange

from .half_arrays import tagged, value_at
from .occurrences import activation_rows, occurrence_views
from .rows import gain_at


__all__ = ["unique_rows", "group_rows", "sum_by_blocks", "sum_blocks", "group_by_blocks", "group_sorted",
           "blocks_worth_it", "checked_batch", "DIGIT_BITS", "PARALLEL_MIN"]

DIGIT_BITS = 11
_RADIX = 1 << DIGIT_BITS
_U = np.uint64  # subscripts in hot loops: Numba wraps a negative signed subscript around, an unsigned one
                # it does not (that code cost the hash grouping 30%, the word sort 11%)
PARALLEL_MIN = 1 << 16  # below this many occurrences the serial sort is faster than waking threads


@njit(cache=True)
def _digit_is_constant(keys, shift):
    """Whether every key has the same digit at ``shift`` (then that pass can be skipped)."""
    n = keys.shape[0]
    if n == 0:
        return True
    first = (keys[0] >> shift) & (_RADIX - 1)
    for i in range(1, n):
        if ((keys[i] >> shift) & (_RADIX - 1)) != first:
            return False
    return True


@njit(cache=True, inline="always")
def _count(keys, lo, hi, shift, counts):
    counts[:] = 0
    for i in range(lo, hi):
        counts[(keys[_U(i)] >> shift) & (_RADIX - 1)] += 1


@njit(cache=True, inline="always")
def _scatter(keys, payload, index_payload, lo, hi, shift, offsets, out_keys, out_payload):
    """Move ``keys[lo:hi]`` and their payloads (or their indices, when ``index_payload``) to their digit's
    next free slot; ``offsets`` holds each digit's next slot and is advanced."""
    for i in range(lo, hi):
        key = keys[_U(i)]
        d = (key >> shift) & (_RADIX - 1)
        at = _U(offsets[d])
        out_keys[at] = key
        out_payload[at] = i if index_payload else payload[_U(i)]
        offsets[d] = at + _U(1)


@njit(cache=True)
def _sort_serial(keys, payload, index_payload, n_bits, keys_a, payload_a, keys_b, payload_b):
    """Stable sort of ``keys`` carrying ``payload`` (or the indices ``0..n-1``, when ``index_payload``);
    returns the sorted keys and payloads (views of the ``_a``/``_b`` buffers, or of the inputs)."""
    n = keys.shape[0]
    counts = np.empty((1, _RADIX), np.int64)
    src_k, src_p, dst_k, dst_p = keys, payload, keys_a, payload_a
    first = True
    for shift in range(0, n_bits, DIGIT_BITS):
        if _digit_is_constant(src_k, shift):
            continue
        _count(src_k, 0, n, shift, counts[0])
        at = 0
        for d in range(_RADIX):
            c = counts[0, d]
            counts[0, d] = at
            at += c
        _scatter(src_k, src_p, index_payload and first, 0, n, shift, counts[0], dst_k, dst_p)
        first = False
        src_k, src_p = dst_k, dst_p
        dst_k, dst_p = (keys_b, payload_b) if dst_k is keys_a else (keys_a, payload_a)
    if first and index_payload:  # no pass ran: already sorted, the payload is the identity
        for i in range(n):
            payload_a[i] = i
        return keys, payload_a
    return src_k, src_p


@njit(cache=True)
def _group(sorted_keys, uniq, ptr):
    """Unique keys and CSR offsets of their runs in ``sorted_keys``; returns the number of unique keys."""
    n = sorted_keys.shape[0]
    n_unique = 0
    for k in range(n):
        key = sorted_keys[k]
        if k == 0 or key != sorted_keys[k - 1]:
            uniq[n_unique] = key
            ptr[n_unique] = k
            n_unique += 1
    ptr[n_unique] = n
    return n_unique


_LOW = (1 << 32) - 1


@njit(cache=True, inline="always")
def _word_count(rows, words, first, lo, hi, shift, counts):
    counts[:] = 0
    if first:
        for i in range(lo, hi):
            counts[(rows[_U(i)] >> shift) & (_RADIX - 1)] += 1
    else:
        for i in range(lo, hi):
            counts[(words[_U(i)] >> (32 + shift)) & (_RADIX - 1)] += 1


@njit(cache=True, inline="always")
def _word_scatter(rows, words, first, last, payload, index_payload, lo, hi, shift, offsets, out, out_payload):
    """Move part ``lo:hi`` to its digits' next free slots; the last pass also writes each element's
    payload (``payload[i]``, or ``i`` itself when ``index_payload``) beside it, in sorted order. (Unsigned
    subscripts, as in ``_hash_block``.)"""
    if first:
        for i in range(lo, hi):
            key = rows[_U(i)]
            d = (key >> shift) & (_RADIX - 1)
            at = _U(offsets[d])
            out[at] = (np.int64(key) << 32) | i
            if last:
                if index_payload:
                    out_payload[at] = i
                else:
                    out_payload[at] = payload[_U(i)]
            offsets[d] = at + _U(1)
    else:
        for i in range(lo, hi):
            word = words[_U(i)]
            d = (word >> (32 + shift)) & (_RADIX - 1)
            at = _U(offsets[d])
            out[at] = word
            if last:
                if index_payload:
                    out_payload[at] = word & _LOW
                else:
                    out_payload[at] = payload[_U(word & _LOW)]
            offsets[d] = at + _U(1)


@njit(cache=True, parallel=True)
def _sort_words(rows, n_bits, payload, index_payload, words_a, words_b, out_payload, n_parts):
    """Stable sort of the words ``row << 32 | i`` (occurrence ``i``) by row: 8 bytes move per element and
    pass, where a key and a payload moved 16; the last pass writes the payloads in sorted order to
    ``out_payload``. ``n_parts`` contiguous parts are counted and scattered in parallel (1: serially);
    returns the sorted words (a view of one buffer)."""
    n = rows.shape[0]
    size = (n + n_parts - 1) // n_parts
    counts = np.empty((n_parts, _RADIX), np.int64)
    shifts = [shift for shift in range(0, n_bits, DIGIT_BITS)
              if not _digit_is_constant(rows, shift)]  # the rows decide, whatever their order so far
    if len(shifts) == 0:  # the rows are all equal: the words, and the payloads, stay in input order
        for i in prange(n):
            words_a[i] = (np.int64(rows[i]) << 32) | i
            if index_payload:
                out_payload[i] = i
            else:
                out_payload[i] = payload[i]
        return words_a
    src, dst = words_b, words_a
    for pass_number in range(len(shifts)):
        shift = shifts[pass_number]
        first = pass_number == 0
        last = pass_number == len(shifts) - 1
        for p in prange(n_parts):
            _word_count(rows, src, first, p * size, min(n, (p + 1) * size), shift, counts[p])
        at = 0
        for d in range(_RADIX):  # digit-major, part-minor: part p's keys of a digit follow part p - 1's
            for p in range(n_parts):
                c = counts[p, d]
                counts[p, d] = at
                at += c
        for p in prange(n_parts):
            _word_scatter(rows, src, first, last, payload, index_payload, p * size, min(n, (p + 1) * size),
                          shift, counts[p], dst, out_payload)
        src, dst = dst, src
    return src


@njit(cache=True, parallel=True)
def _group_words(words, uniq, ptr, n_parts):
    """Unique rows and CSR offsets of their runs in the sorted ``words``; returns the number of rows.

    ``n_parts`` contiguous parts in parallel: each counts the runs starting in it, then writes them from its
    offset. The writes are branch-free (every word writes its row and position to the next free slot, and
    only a run's first word advances it): with rows repeating at random, a branch per word is mispredicted
    about half the time. A part's writes after its last run start land in the next part's first slot, which is
    rewritten afterwards."""
    n = words.shape[0]
    size = (n + n_parts - 1) // n_parts
    starts = np.zeros(n_parts + 1, np.int64)
    for p in prange(n_parts):
        lo = min(n, p * size)
        hi = min(n, lo + size)
        previous = words[lo - 1] >> 32 if lo > 0 else -1
        runs = 0
        for k in range(lo, hi):
            key = words[_U(k)] >> 32
            runs += key != previous
            previous = key
        starts[p + 1] = runs
    for p in range(n_parts):
        starts[p + 1] += starts[p]
    for p in prange(n_parts):
        lo = min(n, p * size)
        hi = min(n, lo + size)
        previous = words[lo - 1] >> 32 if lo > 0 else -1
        at = starts[p]
        for k in range(lo, hi):
            key = words[_U(k)] >> 32
            uniq[_U(at)] = key
            ptr[_U(at)] = k
            at += key != previous
            previous = key
    for p in range(1, n_parts):  # the first run of every part that has one, over what part p - 1 left there
        if starts[p + 1] > starts[p]:
            lo = p * size
            k = lo
            while words[k] >> 32 == words[lo - 1] >> 32:
                k += 1
            uniq[starts[p]] = words[k] >> 32
            ptr[starts[p]] = k
    total = starts[n_parts]
    ptr[total] = n
    return total


# -- blocks of disjoint row ranges, grouped by hashing ----------------------------------------------------
# A physical table stacks several tables, and the lookup lays out each feature's occurrences in one block;
# when the blocks' row ranges are disjoint and increasing, grouping every block on its own and concatenating
# gives exactly the global result. Blocks are grouped in parallel, each by a hash table of its distinct rows
# (two passes over the occurrences and a sort of the distinct rows alone, quicker than sorting every
# occurrence when blocks repeat rows, as Zipf ids do); a block with more distinct rows than HASH_DISTINCT_MAX of its
# occurrences, or whose rows' hashes cluster, is sorted instead (serially, in parallel with the other
# blocks), and then the next RETRY_AFTER calls use the global sort (their batches are likely alike).
# Blocks are shared out among the threads largest first.

HASH_DISTINCT_MAX = 1 / 32
PROBE_BUDGET = 4      # extra probing steps per occurrence before a block is sorted instead
RETRY_AFTER = 32      # calls that use the global sort after a block had to be sorted, before blocks again
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of row * 2**64 / phi
_EMPTY = -1


class BlockBatch(NamedTuple):
    """A batch of blocks as the block kernels read it."""
    rows: np.ndarray        # int32/int64 physical row of every occurrence
    payload: np.ndarray     # each occurrence's payload (int64 packed word or int32 activation row), or empty
    blocks: np.ndarray      # int64 occurrence offsets [0, ..., n] of blocks of disjoint, increasing row ranges
    implied: bool           # no payload: occurrence o's activation row a has out_ptr[a] <= o < out_ptr[a + 1]
    out_ptr: np.ndarray     # int64 CSR of the activation rows' occurrences (read when ``implied``)
    act_bounds: np.ndarray  # int64 first activation row of every block, and the end (when ``implied``)


class BlockPlan(NamedTuple):
    """How the blocks are hashed and shared out (:func:`_block_layout`; depends on the block sizes alone)."""
    schedule: np.ndarray      # int64 blocks in the order the threads take them
    schedule_ptr: np.ndarray  # int64 thread p takes schedule[schedule_ptr[p]:schedule_ptr[p + 1]]
    limits: np.ndarray        # int64 most distinct rows a block may hash
    table_lo: np.ndarray      # int64 first slot of every block's hash table
    table_bits: np.ndarray    # int64 log2 of every block's hash table size
    n_bits: int               # bits of the largest row (the sort passes)


class HashScratch(NamedTuple):
    """The blocks' hash tables (``keys`` and ``ids``, all blocks' tables side by side) and, from each block's
    first occurrence on, its distinct rows in order of first occurrence and their counts."""
    keys: np.ndarray    # a row per slot, or _EMPTY
    ids: np.ndarray     # the slot's distinct-row number within its block
    sid: np.ndarray     # every occurrence's distinct-row number
    first: np.ndarray   # the distinct rows, in order of first occurrence
    counts: np.ndarray  # occurrences per distinct row, then positions or rows of sums


class SortScratch(NamedTuple):
    """The serial sort's two key buffers and two payload buffers (a block sorts from its first occurrence)."""
    keys_a: np.ndarray
    payload_a: np.ndarray
    keys_b: np.ndarray
    payload_b: np.ndarray


@njit(cache=True, inline="always")
def _slot(row, bits):
    return np.int64((np.uint64(row) * _MULTIPLIER) >> np.uint64(64 - bits))


def _table_bits(n_occurrences):
    """log2 of a block's hash table size: at least twice the distinct rows it may hold."""
    limit = _distinct_limit(n_occurrences)
    return max(4, int(2 * limit - 1).bit_length())


def _distinct_limit(n_occurrences):
    return max(16, int(n_occurrences * HASH_DISTINCT_MAX))


@njit(cache=True, inline="always")
def _hash_count(rows, lo, hi, limit, bits, t, hashing):
    """The hash pass of a block, occurrences ``lo:hi``: each distinct row, in order of first occurrence, to
    ``first[lo:]`` with its number of occurrences in ``counts[lo:]``, and each occurrence's distinct-row id to
    ``sid``; returns the number of distinct rows, or -1 when there are more than ``limit`` or probing took
    more than ``PROBE_BUDGET`` extra steps per occurrence."""
    keys, ids, sid, first, counts = hashing
    mask = (1 << bits) - 1
    keys[t:t + mask + 1] = _EMPTY  # a fresh table, which also brings it into the cache (a kept one came cold)
    n_unique = 0
    probes_left = PROBE_BUDGET * (hi - lo)  # rows whose hashes cluster would make probing quadratic
    for o in range(lo, hi):
        ou = _U(o)  # unsigned subscripts: no negative-index wraparound code (see kernels/rows.py)
        r = rows[ou]
        h = t + _slot(r, bits)
        k = keys[_U(h)]
        while k != r and k != _EMPTY:  # linear probing
            h = t + ((h - t + 1) & mask)
            k = keys[_U(h)]
            probes_left -= 1
        if probes_left < 0:
            return -1
        hu = _U(h)
        if k == _EMPTY:
            if n_unique == limit:
                return -1
            keys[hu] = r
            ids[hu] = n_unique
            first[_U(lo + n_unique)] = r
            counts[_U(lo + n_unique)] = 0
            n_unique += 1
        u = ids[hu]
        sid[ou] = u
        counts[_U(lo + u)] += 1
    return n_unique


@njit(cache=True, inline="always")
def _sort_distinct(first, lo, n_unique, n_bits, sorting):
    """The distinct rows ``first[lo:lo + n_unique]`` of a hashed block, ascending, and the permutation that
    sorts them (the sort's buffers from ``lo`` on)."""
    hi = lo + n_unique
    return _sort_serial(first[lo:hi], sorting.payload_a[lo:hi], True, n_bits, sorting.keys_a[lo:hi],
                        sorting.payload_a[lo:hi], sorting.keys_b[lo:hi], sorting.payload_b[lo:hi])


# The block functions below are called from the parallel loops, not inlined into them: inlined, those loops took
# 1.1-1.5x as long to compile, and the calls (one per block) cost nothing measurable.
@njit(cache=True)
def _hash_block(batch, b, plan, hashing, sorting, uniq, ptr, out):
    """Group block ``b``'s occurrences ``lo:hi`` by hashing (:func:`_hash_count`): distinct rows to
    ``uniq[lo:]`` (ascending), their first occurrence's position to ``ptr[lo:]``, payloads grouped to
    ``out[lo:hi]`` (``batch.implied``: no payload array, each occurrence's activation row instead, from
    ``out_ptr``); returns the number of distinct rows, or -1 (see :func:`_hash_count`)."""
    lo, hi = batch.blocks[b], batch.blocks[b + 1]
    n_unique = _hash_count(batch.rows, lo, hi, plan.limits[b], plan.table_bits[b], plan.table_lo[b], hashing)
    if n_unique < 0:
        return -1
    counts, sid, out_ptr = hashing.counts, hashing.sid, batch.out_ptr
    sorted_rows, perm = _sort_distinct(hashing.first, lo, n_unique, plan.n_bits, sorting)
    at = lo
    for k in range(n_unique):  # counts become each distinct row's next output position
        u = perm[k]
        uniq[lo + k] = sorted_rows[k]
        ptr[lo + k] = at
        c = counts[lo + u]
        counts[lo + u] = at
        at += c
    if batch.implied:
        for a in range(batch.act_bounds[b], batch.act_bounds[b + 1]):
            for o in range(out_ptr[_U(a)], out_ptr[_U(a + 1)]):
                cu = _U(lo + sid[_U(o)])
                at = counts[cu]
                out[_U(at)] = a
                counts[cu] = at + 1
        return n_unique
    payload = batch.payload
    for o in range(lo, hi):
        ou = _U(o)
        cu = _U(lo + sid[ou])
        at = counts[cu]
        out[_U(at)] = payload[ou]
        counts[cu] = at + 1
    return n_unique


@njit(cache=True)
def _sort_block(rows, payload, lo, hi, n_bits, sorting, uniq, ptr, out):
    """Group occurrences ``lo:hi`` by the serial sort, with :func:`_hash_block`'s outputs."""
    sorted_keys, sorted_payload = _sort_serial(rows[lo:hi], payload[lo:hi], False, n_bits, sorting.keys_a[lo:hi],
                                               sorting.payload_a[lo:hi], sorting.keys_b[lo:hi],
                                               sorting.payload_b[lo:hi])
    n_unique = 0
    for k in range(hi - lo):
        out[lo + k] = sorted_payload[k]
        if k == 0 or sorted_keys[k] != sorted_keys[k - 1]:
            uniq[lo + n_unique] = sorted_keys[k]
            ptr[lo + n_unique] = lo + k
            n_unique += 1
    return n_unique


@njit(cache=True, parallel=True)
def _group_blocks(batch, plan, hashing, sorting, out, uniq, ptr):
    """Every block grouped on its own, in parallel, its distinct rows and offsets written to ``uniq`` and
    ``ptr`` at its first occurrence's position, then moved down to follow the previous blocks' (a block
    holds no more distinct rows than occurrences, so nothing is overwritten before it is moved). Returns
    the number of distinct rows and the number of blocks that had to be sorted. Thread ``p`` groups the
    blocks ``plan.schedule[plan.schedule_ptr[p]:plan.schedule_ptr[p + 1]]``."""
    blocks, schedule, schedule_ptr = batch.blocks, plan.schedule, plan.schedule_ptr
    n_blocks = blocks.shape[0] - 1
    n_unique = np.empty(n_blocks, np.int64)
    sorted_blocks = np.zeros(n_blocks, np.int64)
    for p in prange(schedule_ptr.shape[0] - 1):
        for i in range(schedule_ptr[p], schedule_ptr[p + 1]):
            b = schedule[i]
            got = _hash_block(batch, b, plan, hashing, sorting, uniq, ptr, out)
            if got < 0:
                lo, hi = blocks[b], blocks[b + 1]
                if batch.implied:  # the activation rows as the payload, sorted in place (read before written)
                    activation_rows(batch.out_ptr, batch.act_bounds[b], batch.act_bounds[b + 1], out)
                    got = _sort_block(batch.rows, out, lo, hi, plan.n_bits, sorting, uniq, ptr, out)
                else:
                    got = _sort_block(batch.rows, batch.payload, lo, hi, plan.n_bits, sorting, uniq, ptr, out)
                sorted_blocks[b] = 1
            n_unique[b] = got
    total = 0
    for b in range(n_blocks):
        lo = blocks[b]
        for k in range(n_unique[b]):
            uniq[total] = uniq[lo + k]
            ptr[total] = ptr[lo + k]
            total += 1
    ptr[total] = blocks[n_blocks]
    return total, sorted_blocks.sum()


@njit(cache=True)
def _sum_block(batch, b, plan, hashing, sorting, uniq, d_act, sums, s_lo):
    """The gradient sums of block ``b``'s (occurrences ``lo:hi``) distinct rows: the rows to ``uniq[lo:]`` (ascending, as
    :func:`_hash_block`), and the sum of distinct row ``uniq[lo + k]``'s gradient to ``sums[s_lo + k]``,
    every occurrence's ``gain * d_act[activation row]`` added as the occurrences come (the order of
    ``rows.sequential_sum`` over grouped occurrences, from -0.0, which adds exactly as starting from the
    first; ``d_act`` float32 rows or tagged 16-bit ones, each value converted exactly to float32 as it is
    read: :mod:`embedcore.kernels.half_arrays`); returns the number of distinct rows, or -1 (see
    :func:`_hash_count`)."""
    lo, hi = batch.blocks[b], batch.blocks[b + 1]
    n_unique = _hash_count(batch.rows, lo, hi, plan.limits[b], plan.table_bits[b], plan.table_lo[b], hashing)
    if n_unique < 0:
        return -1
    counts, sid, out_ptr = hashing.counts, hashing.sid, batch.out_ptr
    sorted_rows, perm = _sort_distinct(hashing.first, lo, n_unique, plan.n_bits, sorting)
    for k in range(n_unique):  # counts become each distinct row's row of sums
        uniq[lo + k] = sorted_rows[k]
        counts[lo + perm[k]] = s_lo + k
    dim = sums.shape[1]
    for k in range(s_lo, s_lo + n_unique):
        for j in range(dim):
            sums[_U(k), _U(j)] = -0.0
    if batch.implied:  # every gain 1: each activation row's gradient read once, added to its occurrences' rows
        for a in range(batch.act_bounds[b], batch.act_bounds[b + 1]):
            au = _U(a)
            for o in range(out_ptr[au], out_ptr[au + _U(1)]):
                su = _U(counts[_U(lo + sid[_U(o)])])
                for j in range(dim):
                    ju = _U(j)
                    sums[su, ju] += value_at(d_act, au, ju)
        return n_unique
    src_row, src_gain = occurrence_views(batch.payload)
    for o in range(lo, hi):
        ou = _U(o)
        su = _U(counts[_U(lo + sid[ou])])
        au = _U(src_row[ou])
        w = gain_at(src_gain, ou)
        for j in range(dim):
            ju = _U(j)
            sums[su, ju] += w * value_at(d_act, au, ju)
    return n_unique


@njit(cache=True, parallel=True)
def _sum_blocks(batch, plan, hashing, sorting, uniq, index, d_act, sums, sums_lo):
    """:func:`_sum_block` for every block, in parallel (thread ``p`` takes the blocks
    ``plan.schedule[plan.schedule_ptr[p]:plan.schedule_ptr[p + 1]]``), then the distinct rows moved down to
    follow the previous blocks' and ``index[u]``, the row of sums of ``uniq[u]``, written; returns the number
    of distinct rows, or -1 when a block could not be hashed."""
    blocks, schedule, schedule_ptr = batch.blocks, plan.schedule, plan.schedule_ptr
    n_blocks = blocks.shape[0] - 1
    n_unique = np.empty(n_blocks, np.int64)
    for p in prange(schedule_ptr.shape[0] - 1):
        for i in range(schedule_ptr[p], schedule_ptr[p + 1]):
            b = schedule[i]
            n_unique[b] = _sum_block(batch, b, plan, hashing, sorting, uniq, d_act, sums, sums_lo[b])
    if n_unique.min() < 0:
        return -1
    total = 0
    for b in range(n_blocks):
        lo = blocks[b]
        for k in range(n_unique[b]):
            uniq[total] = uniq[lo + k]
            index[total] = sums_lo[b] + k
            total += 1
    return total


def blocks_worth_it(blocks, n, threads):
    """Whether grouping block by block keeps every thread busy: enough blocks, none over its thread's share."""
    if blocks is None or threads < 2 or n < PARALLEL_MIN or len(blocks) - 1 < threads:
        return False
    return int(np.diff(blocks).max()) * threads <= 1.25 * n


def _schedule(sizes, threads):
    """Blocks shared out among threads, largest first to the least loaded (a parallel loop over blocks hands
    each thread a contiguous run of them: sizes .4, .4, .1, .1 left one thread 80% of the work)."""
    loads = [0] * threads
    assigned = [[] for _ in range(threads)]
    for b in sorted(range(len(sizes)), key=lambda b: -int(sizes[b])):
        p = loads.index(min(loads))
        assigned[p].append(b)
        loads[p] += int(sizes[b])
    schedule = np.array([b for part in assigned for b in part], np.int64)
    schedule_ptr = np.zeros(threads + 1, np.int64)
    np.cumsum([len(part) for part in assigned], out=schedule_ptr[1:])
    return schedule, schedule_ptr


def _block_layout(blocks, threads, workspace):
    """``(limits, table_bits, table_lo, n_slots, schedule, schedule_ptr)``: each block's distinct-row limit,
    its hash table's size (log2) and first slot, the slots in all, and the threads' shares of the blocks.
    They depend on the block sizes alone, so the workspace keeps them for the next call with the same
    blocks (a training loop's batches mostly have one shape; computing them took about 20 us of Python)."""
    key = (blocks.tobytes(), threads)
    kept = workspace.state.get("block_layout")
    if kept is not None and kept[0] == key:
        return kept[1]
    sizes = np.diff(blocks)
    limits = np.array([_distinct_limit(int(m)) for m in sizes], np.int64)
    table_bits = np.array([_table_bits(int(m)) for m in sizes], np.int64)
    table_lo = np.zeros(len(sizes), np.int64)
    np.cumsum(np.int64(1) << table_bits[:-1], out=table_lo[1:])
    n_slots = int(table_lo[-1] + (1 << int(table_bits[-1])))
    layout = (limits, table_bits, table_lo, n_slots) + _schedule(sizes, threads)
    workspace.state["block_layout"] = (key, layout)
    return layout


def hash_types(row_type, largest_limit, narrow=True):
    """``(key type, id type)`` of the hash grouping: keys in the rows' type, and the distinct rows' ids (per
    slot and per occurrence) as uint16 where no block may hold more than 2**16 distinct rows, else int32.
    The smaller the types, the fewer bytes the hash table takes in L1 and the occurrences' ids in memory.
    ``narrow`` False (``Tuning.narrow_hash_types``): int64 keys and int32 ids whatever the batch."""
    if not narrow:
        return np.int64, np.int32
    return row_type, (np.uint16 if largest_limit <= 1 << 16 else np.int32)


def _hash_scratch(workspace, n, n_slots, row_type, key_type, id_type) -> HashScratch:
    """The hash grouping's scratch; its counts share the word sort's second buffer (never used at once)."""
    return HashScratch(workspace.array("hash_keys", n_slots, key_type), workspace.array("hash_ids", n_slots, id_type),
                       workspace.array("hash_sid", n, id_type), workspace.array("hash_first", n, row_type),
                       workspace.array("sort_words_b", n, np.int64))


def _sort_scratch(workspace, n, row_type, payload_type) -> SortScratch:
    """The serial sort's buffers, one set per payload type (batches of both kinds in turn reallocate
    nothing); a hashed block sorts its distinct rows' permutation in them."""
    names = _PAYLOAD_BUFFERS[np.dtype(payload_type)]
    return SortScratch(workspace.array("sort_keys_a", n, row_type), workspace.array(names[0], n, payload_type),
                       workspace.array("sort_keys_b", n, row_type), workspace.array(names[1], n, payload_type))


def _blocks_setup(rows, n_rows, payload, blocks, out_ptr, act_bounds, workspace, narrow_types):
    """``(batch, plan, hashing, limits)`` of the block kernels, scratch from ``workspace``."""
    implied = payload is None
    batch = BlockBatch(rows, _NO_ROWS if implied else payload, blocks, implied,
                       _NO_BOUNDS if out_ptr is None or not implied else out_ptr, act_bounds)
    limits, table_bits, table_lo, n_slots, schedule, schedule_ptr = _block_layout(blocks, numba.get_num_threads(),
                                                                                  workspace)
    plan = BlockPlan(schedule, schedule_ptr, limits, table_lo, table_bits, max(1, int(n_rows - 1).bit_length()))
    key_type, id_type = hash_types(rows.dtype, int(limits.max()), narrow_types)
    hashing = _hash_scratch(workspace, rows.shape[0], n_slots, rows.dtype, key_type, id_type)
    return batch, plan, hashing, limits


def group_by_blocks(rows, n_rows, payload, blocks, workspace, out_ptr=None, narrow_types=True):
    """``(uniq, ptr, sorted_payload, n_sorted)``: :func:`group_rows` block by block (``_group_blocks``), for a
    batch :func:`checked_batch` passed; also returns how many blocks had to be sorted instead of hashed."""
    n = rows.shape[0]
    # each block's activation rows, when there is no payload: its occurrences' range in out_ptr
    act_bounds = np.searchsorted(out_ptr, blocks, "left") if payload is None else _NO_BOUNDS
    batch, plan, hashing, _ = _blocks_setup(rows, n_rows, payload, blocks, out_ptr, act_bounds, workspace,
                                            narrow_types)
    p = batch.payload.dtype  # a block that is sorted instead sorts its payload in the payload type's buffers
    sorting = _sort_scratch(workspace, n, rows.dtype, p)
    out = workspace.array(_PAYLOAD_BUFFERS[p][2], n, p)
    uniq = workspace.array("uniq", n, np.int64)
    ptr = workspace.array("ptr", n + 1, np.int64)
    n_unique, n_sorted = _group_blocks(batch, plan, hashing, sorting, out, uniq, ptr)
    return uniq[:n_unique], ptr[:n_unique + 1], out, int(n_sorted)


def sum_by_blocks(rows, n_rows, packed, workspace, blocks, out_ptr, d_act):
    """``(uniq, ptr, index, sums)``, the gradient of every distinct row summed, for a batch that
    :func:`group_rows` would group block by block; else None (one thread, blocks too uneven, a block with
    too many distinct rows, or a recent one: the caller groups with :func:`group_rows`, whose sums are the
    same). ``packed`` and ``out_ptr`` as for :func:`group_rows` (every activation row's occurrences within one
    block, as the lookup lays them out); ``d_act`` the ``[n_out, dim]`` gradients of the activation rows,
    float32, or float16 / bfloat16 (read in place, each value converted exactly to float32 as it is added:
    the sums of their float32 copy); a payload's activation rows must lie below ``n_out`` (they are not
    checked). A batch that is not so raises ValueError before anything is summed.

    ``uniq`` are the distinct rows (ascending), and the gradient of ``uniq[u]`` is ``sums[index[u]]``:
    each occurrence's ``gain * d_act[activation row]`` added to its row's sum as the block's occurrences are
    walked, in order, so a gradient row is read once per activation row (once per occurrence, at random,
    when the update sums grouped occurrences), in the order of :func:`embedcore.kernels.rows.sequential_sum`.
    ``ptr`` is ``0, 1, ..., len(uniq)`` and ``index`` int32: the update kernel takes them as grouped
    occurrences of one occurrence per row (every gain 1), whose sums are the sums themselves."""
    if workspace.state.get("blocks_wait", 0) > 0:
        return None
    return sum_blocks(rows, n_rows, packed, workspace, blocks, out_ptr, d_act)


def sum_blocks(rows, n_rows, packed, workspace, blocks, out_ptr, d_act, narrow_types=True):
    """:func:`sum_by_blocks` whatever the calls before (no retry counter: :class:`~embedcore.kernels.grouping.
    Grouper` keeps it); None when the batch should be grouped instead (one thread, no blocks, blocks too
    uneven, a block with too many distinct rows to hash). ``narrow_types`` as for :func:`hash_types`."""
    if blocks is None or not blocks_worth_it(blocks, rows.shape[0], numba.get_num_threads()):
        return None
    rows, packed, blocks, out_ptr = checked_batch(rows, packed, blocks, out_ptr)
    d_act = np.ascontiguousarray(d_act, d_act.dtype if d_act.dtype.itemsize == 2 else np.float32)
    implied = packed is None
    if implied:
        act_bounds = np.searchsorted(out_ptr, blocks, "left")
        if d_act.ndim != 2 or d_act.shape[0] != out_ptr.shape[0] - 1 or np.any(out_ptr[act_bounds] != blocks):
            raise ValueError(f"d_act must hold the {out_ptr.shape[0] - 1} activation rows of out_ptr, and "
                             f"every activation row's occurrences must lie within one block")
    else:
        if d_act.ndim != 2:
            raise ValueError(f"d_act must be [activation rows, dim], got shape {d_act.shape}")
        act_bounds = out_ptr = _NO_BOUNDS
    payload = packed
    n = rows.shape[0]
    batch, plan, hashing, limits = _blocks_setup(rows, n_rows, payload, blocks, out_ptr, act_bounds, workspace,
                                                 narrow_types)
    sums_lo = np.zeros(limits.shape[0], np.int64)
    np.cumsum(limits[:-1], out=sums_lo[1:])
    sums = workspace.array("block_sums", (int(limits.sum()), d_act.shape[1]), np.float32)
    sorting = _sort_scratch(workspace, n, rows.dtype, np.int32)  # the distinct rows' permutations
    uniq = workspace.array("uniq", n, np.int64)
    index = workspace.array("block_sums_index", n, np.int32)
    total = _sum_blocks(batch, plan, hashing, sorting, uniq, index, tagged(d_act), sums, sums_lo)
    if total < 0:
        return None
    return uniq[:total], np.arange(total + 1, dtype=np.int64), index[:total], sums


def _sort(rows, n_rows, payload, index_payload, workspace):
    n = rows.shape[0]
    n_bits = max(1, int(n_rows - 1).bit_length())
    threads = numba.get_num_threads()
    uniq = workspace.array("uniq", n, np.int64)
    ptr = workspace.array("ptr", n + 1, np.int64)
    if n >= PARALLEL_MIN and threads > 1 and n < 2 ** 32 and n_rows <= 2 ** 31:
        # Large batches: rows and occurrence numbers share one word, sorted in parallel; the payload is
        # written once, in sorted order, by the last pass.
        sorted_payload = workspace.array(_PAYLOAD_BUFFERS[payload.dtype][2], n, payload.dtype)
        words = _sort_words(rows, n_bits, payload, index_payload, workspace.array("sort_words_a", n, np.int64),
                            workspace.array("sort_words_b", n, np.int64), sorted_payload, threads)
        n_unique = _group_words(words, uniq, ptr, threads)
        return uniq[:n_unique], ptr[:n_unique + 1], sorted_payload
    # Small batches (and tables of more than 2**31 rows): a serial sort carrying a key and a payload.
    sorted_keys, sorted_payload = _sort_serial(rows, payload, index_payload, n_bits,
                                               *_sort_scratch(workspace, n, rows.dtype, payload.dtype))
    n_unique = _group(sorted_keys, uniq, ptr)
    return uniq[:n_unique], ptr[:n_unique + 1], sorted_payload


def _row_array(rows):
    """``rows`` as a contiguous int32 or int64 array (the kernels take both; other types become int64)."""
    rows = np.ascontiguousarray(rows)
    return rows if rows.dtype in _ROW_TYPES else rows.astype(np.int64)


_ROW_TYPES = (np.dtype(np.int32), np.dtype(np.int64))
_NO_ROWS = np.zeros(0, np.int32)  # the payload of a batch laid out without one (activation rows from out_ptr)
_NO_BOUNDS = np.zeros(0, np.int64)
_PAYLOAD_TYPES = _ROW_TYPES
# Workspace buffers of payloads, one set per payload type (so that batches of both kinds in turn do not
# reallocate them): the sort's two payload buffers, and the payloads in grouped order.
_PAYLOAD_BUFFERS = {np.dtype(t): tuple(f"{name}_{np.dtype(t).name}" for name in
                                       ("sort_payload_a", "sort_payload_b", "sorted_payload"))
                    for t in (np.int32, np.int64)}
_NO_PAYLOAD = np.zeros(0, np.int64)


def unique_rows(rows: np.ndarray, n_rows: int, workspace):
    """``(uniq, ptr, order)`` for int32 or int64 ``rows`` in ``[0, n_rows)`` (``uniq``, ``ptr`` and ``order``
    int64); buffers come from a ``Workspace``."""
    rows = _row_array(rows)
    return _sort(rows, n_rows, _NO_PAYLOAD, True, workspace)  # the indices are the payload


def checked_batch(rows, packed, blocks, out_ptr):
    """``(rows, packed, blocks, out_ptr)`` as the kernels take them, after the structural checks that keep
    their unchecked subscripts in bounds; raises ValueError for a malformed batch."""
    rows = _row_array(rows)
    n = rows.shape[0]
    if packed is None:
        out_ptr = np.ascontiguousarray(out_ptr, np.int64)
        if out_ptr.ndim != 1 or out_ptr.shape[0] < 1 or out_ptr[0] != 0 or out_ptr[-1] != n or \
                out_ptr.shape[0] - 1 >= 2 ** 31:
            raise ValueError(f"without payloads, out_ptr must be int64 offsets from 0 to {n}")
    else:
        packed = np.ascontiguousarray(packed)
        if packed.dtype not in _PAYLOAD_TYPES or packed.shape != (n,):
            raise ValueError(f"the payload must be {n} int64 packed words or int32 activation rows, got "
                             f"{packed.shape} {packed.dtype}")
    if blocks is not None:
        blocks = np.asarray(blocks)
        if blocks.dtype != np.int64 or blocks.ndim != 1 or blocks.shape[0] < 2 or blocks[0] != 0 or \
                blocks[-1] != n or np.any(blocks[1:] < blocks[:-1]):
            raise ValueError(f"blocks must be int64 offsets from 0 to {n}, never decreasing")
    return rows, packed, blocks, out_ptr


def group_rows(rows: np.ndarray, n_rows: int, packed, workspace, blocks=None, out_ptr=None):
    """``(uniq, ptr, sorted_packed)``: :func:`unique_rows`, with each occurrence's payload (its packed word,
    activation row and gain, or its int32 activation row when every gain is 1; see
    :mod:`embedcore.kernels.occurrences`) in grouped order, in the payload's type: the sort carries the
    payloads, so no pass gathers them through ``order`` (``payload_views(sorted_packed)`` reads them).

    ``packed`` None (a batch whose gains are all 1, laid out without payloads): the payload of occurrence
    ``o`` is its activation row ``a``, ``out_ptr[a] <= o < out_ptr[a + 1]`` (int64 CSR); the result is
    int32 activation rows, which the hash grouping writes straight from ``out_ptr``.

    ``blocks`` (optional, int64 occurrence offsets ``[0, ..., n]``): every block's rows lie below the next
    block's, so the blocks can be grouped independently (see ``_group_blocks``); the result is the same."""
    rows, packed, blocks, out_ptr = checked_batch(rows, packed, blocks, out_ptr)
    # After a call in which a block held too many distinct rows to hash, the next RETRY_AFTER calls sort.
    wait = workspace.state.get("blocks_wait", 0)
    if blocks is not None and wait > 0:
        workspace.state["blocks_wait"] = wait - 1
    elif blocks_worth_it(blocks, rows.shape[0], numba.get_num_threads()):
        uniq, ptr, sorted_packed, n_sorted = group_by_blocks(rows, n_rows, packed, blocks, workspace, out_ptr)
        workspace.state["blocks_wait"] = RETRY_AFTER if n_sorted else 0
        return uniq, ptr, sorted_packed
    return group_sorted(rows, n_rows, packed, workspace, out_ptr)


def group_sorted(rows, n_rows, packed, workspace, out_ptr=None):
    """``(uniq, ptr, sorted_packed)`` of :func:`group_rows` by the global sort, for a batch that
    :func:`checked_batch` passed (``packed`` None: the activation rows of ``out_ptr`` are the payload)."""
    if packed is None:  # the sort carries a payload: the activation rows, written out first
        packed = workspace.array("activation_rows", rows.shape[0], np.int32)
        activation_rows(out_ptr, 0, out_ptr.shape[0] - 1, packed)
    return _sort(rows, n_rows, packed, False, workspace)
