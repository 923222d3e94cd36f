"""The key -> row map of a dynamic (hash-keyed) table: open addressing in Numba, any 64-bit key.

A :class:`KeyRowMap` maps 64-bit keys (all ``2**64`` bit patterns; int64 and uint64 views of the same bits are
the same key) to row slots ``0 .. capacity - 1``; the rows themselves (values and slots) live in a storage
elsewhere, indexed by these slots. It also keeps, per row, what the eviction policies read
(:mod:`embedcore.tables.policies`): the last step the row was seen and how often it was seen.

Layout
------
Per row slot (arrays of ``capacity`` entries, allocated once with ``np.empty``: the operating system commits
their pages only as rows are first used, so a table holding ``n`` keys touches about ``16 n`` bytes of them):

* ``row_keys`` uint64: the row's key; for a free row, the next free row (an intrusive free list: no array).
* ``last_seen`` int32: the last step :meth:`KeyRowMap.touch` saw the row (steps must stay below ``2**31``).
* ``counts`` int32: how many occurrences ``touch`` counted (saturating at ``2**31 - 1``); ``-1`` marks a
  free row, so no key value is reserved to mean "empty" and liveness costs no extra array.

Floors, per block of ``FLOOR_BLOCK = 16`` row slots, kept only once a scan asks for them
(:meth:`KeyRowMap.floors`): ``last_seen_floor[b]`` (``count_floor[b]``), an int32 at most the ``last_seen``
(``counts``) of every live row of block ``b`` (``2**31 - 1`` for a block without one). Every method that
writes ``last_seen`` or ``counts`` keeps them so (an insertion or a touch can only lower a floor; a removal
or a count's increase leaves it a valid, perhaps loose, bound); a scan that reads a whole block may set its
floor to the exact minimum. They let the scans that refill the order index of TTL expiry and LRU/LFU
eviction (:mod:`embedcore.tables.order_index`) skip every block that cannot hold a row they look for. Code
that writes ``last_seen`` or ``counts`` other than through this class (a bulk load) must call
:meth:`KeyRowMap.refresh_floors` afterwards (which also forgets the watchers: :meth:`KeyRowMap.watch`).

The index is an array of uint32 buckets, linear probing. A bucket is 0 when empty, else
``tag << row_bits | (row + 1)``, ``row_bits = capacity.bit_length()``; the tag is the low ``32 - row_bits``
bits of the key's hash, so most probes that meet another key are rejected without reading ``row_keys``
(a random access). The hash is the SplitMix64 finaliser (a bijection of 64-bit words, so keys colliding in
their low bits spread like any others); a key's home bucket is ``(hash >> 32) * n_buckets >> 32``, which
lets the index have any size, not only powers of two.

Memory beyond the rows and their slots. A key takes ``key 8 + last_seen 4 + count 4`` bytes and a share of
the index, ``4 / load`` bytes; the load is at most ``MAX_LOAD = 0.75`` and, just after a growth by ``GROWTH =
1.5``, at least 0.5. Each floor kept adds 4 / 16 = 0.25 bytes a row slot, and the order index of LRU, LFU
and TTL (:mod:`embedcore.tables.order_index`, a watcher) 1.125 (a TTL table keeps both from its first expiry or from half full, an
LRU or LFU table the index from half full). A full table (``capacity`` keys, the index at its final size
``capacity / 0.75``) so takes ``16 + 5.3 = 21.3`` bytes a key, 22.7 with a floor and an order index. That is
the most the map ever takes, per key of its capacity: below capacity it holds fewer keys in a smaller index.
While a growth is migrated (below) the old index lives beside the new one, for the few batches the migration
takes (while up to a quarter more keys arrive); a growth that would leave the last one (to the final size)
smaller than ``LAST_GROWTH_MIN = 1.5`` times goes to the final size at once, so that even then the map takes
at most ``(16 * 0.75 * 1.25 / 1.5 + 4 / 1.5 + 4) / 0.75 + 1.375 = 23.6`` bytes a key of capacity. Per key
actually held, a table below capacity can take more (just after the last growth the load can be 1 / 3: 16 +
12 + 1.375 bytes a key; the first index's 64 buckets and the order index's smallest pools weigh on a map of
a few keys).

Deletion: backward shift, not tombstones. A dynamic table at capacity removes keys all the time (every
eviction); tombstones would pile up and lengthen every probe until a rebuild (a stop-the-world pass).
Backward-shift deletion leaves the index exactly as if the removed key had never been inserted, so probe
lengths depend only on the load; it moves at most the rest of the removed key's cluster (a few buckets at
load <= 0.75).

Growth without stopping the world: when a batch would push the load past ``MAX_LOAD``, a new index of
``GROWTH`` times the size (or the final size) starts empty and the old one is kept; lookups probe the new
index, then the old; insertions go to the new one; removals remove from both. Each
:meth:`~KeyRowMap.find_or_insert` then migrates a bounded number of rows (``MIGRATE_PER_KEY`` per key of its
batch, at least ``MIGRATE_MIN``), scanning row slots in order, and the old index is dropped when the scan
passes the highest row ever used. At that rate the migration ends long before the new index fills (it can
take ``0.375 n`` more keys, the scan covers ``n`` rows four times faster), so no batch does more than a
constant times its own size of rehash work. (If a single huge batch outruns it, that batch finishes the
migration at once: a pass bounded by the capacity.)

Row assignment is deterministic (the same for any thread count and on every rerun): a batch's new keys,
in the order of their first occurrence, take the most recently freed rows first (a stack), then the never
used rows in increasing order. A batch with more distinct new keys than free rows is refused before
anything changes (its distinct new keys are counted, by a sort, only when its absent occurrences outnumber the
free rows). :meth:`~KeyRowMap.find` runs in parallel (it only reads) on batches of ``PARALLEL_MIN`` keys or
more; insertions, removals and migration run serially in batch order, since linear probing's layout depends on
insertion order.

A find looks each key up first in a direct-mapped cache of the rows it found for earlier keys of the same
piece of ``PIECE`` keys (``2**RECENT_BITS`` entries, slot ``(key ^ key >> 29) mod 2**RECENT_BITS``, no hash; a
scratch array, so the result is the index's whatever the cache holds): a skewed batch (the same keys over and
over, as Zipf ids are) probes the index about once per distinct key and piece, and its repeats cost a load and
a compare however large and full the index; a piece whose first ``RECENT_TRIAL`` keys hit the cache less than
1 time in 8 (keys mostly distinct, or colliding in their low bits) probes the rest directly.

How a dynamic table uses it (:mod:`embedcore.tables.dynamic` does this)
------------------------------------------------------------------------
A :class:`~embedcore.tables.dynamic.DynamicTable` is a map and ``capacity`` rows of a stacked storage. Lookup
maps the batch's keys to rows *before* ``inputs.build_table_batch`` groups occurrences, so grouping, gathering
and the update kernel see ordinary row ids:

1. ``rows = map.find(keys)`` (the stack's tables together: :func:`find_in_maps`); the keys still absent go
   through the table's admission (:class:`embedcore.tables.policies.AdmissionSketch`); an unadmitted key's
   occurrences read the key's initial value (a function of the seed, the table and the key only:
   :func:`embedcore.initializers.fill_key_rows`) and get no gradient;
2. if the admitted new keys outnumber ``map.free_rows``, the eviction policy picks victims among the live
   rows not in ``rows`` (:func:`embedcore.tables.policies.pick_victims`), ``map.remove`` frees them (TTL
   removes expired rows first: :func:`embedcore.tables.policies.expired_rows`); still too many: refuse the
   batch (:class:`TableFullError`, to be raised as ``InputError`` naming the table) before anything changed;
3. ``rows, inserted = map.find_or_insert(admitted keys, step)``; the storage fills ``rows[inserted]`` with each
   new key's initial value and fresh slots;
4. ``map.touch_found(rows, step)`` with the rows the batch uses, one count per occurrence (the stack's tables
   together: :func:`touch_in_maps`; at the lookup, not after the update: a lookup is a sighting, and touched
   rows are protected from later lookups).

Checkpoints save :meth:`~KeyRowMap.state` (keys in increasing order, their row slots and metadata, and the free
list) and rebuild the map with :meth:`~KeyRowMap.load`: the same rows, free list and high-water mark, so the
loaded map assigns the same rows to later keys as the saved one would (its index may be sized differently,
which no lookup can tell).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .random import mix64  # the SplitMix64 finaliser (the tree's one copy)

__all__ = ["KeyRowMap", "TableFullError", "as_keys", "MAX_LOAD", "GROWTH", "LAST_GROWTH_MIN", "MIGRATE_PER_KEY", "MIGRATE_MIN",
           "MAX_CAPACITY", "MAX_STEP", "FLOOR_BLOCK", "FLOOR_SHIFT", "PARALLEL_MIN", "PIECE", "first_occurrences",
           "find_in_maps", "touch_in_maps"]

MAX_LOAD = 0.75        # keys per bucket at most
GROWTH = 1.5           # index size factor per growth
LAST_GROWTH_MIN = 1.5   # the last growth (to the final size) is at least this factor
MIGRATE_PER_KEY = 4    # rows migrated per key of a find_or_insert batch during a growth
MIGRATE_MIN = 4096     # ... and at least this many
MAX_CAPACITY = 2 ** 31 - 1
MAX_STEP = 2 ** 31 - 1
_COUNT_MAX = 2 ** 31 - 1
FLOOR_SHIFT = 4                # rows per floor block: 2**FLOOR_SHIFT
FLOOR_BLOCK = 1 << FLOOR_SHIFT
_NO_FLOOR = 2 ** 31 - 1        # the floor of a block without live rows
PARALLEL_MIN = 1 << 14         # batches of fewer keys are looked up on one thread
PIECE = 1 << 13                # keys a thread looks up at a time
RECENT_BITS = 12               # a lookup's cache of the rows it found: 2**RECENT_BITS entries per piece
RECENT_TRIAL = 1024            # ... kept for the rest of a piece if 1 in 8 of its first keys hit it
_INITIAL_BUCKETS = 64

_U = np.uint64
_LOW32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_HASH_OFFSET = np.uint64(0x632BE59BD9B4E019)
_FOLD = np.uint64(29)  # a key's cache slot: its low bits xor those 29 above


class TableFullError(ValueError):
    """A batch brings more new keys than the table has free rows; nothing was changed."""


# -- the index ------------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _hash(key):
    return mix64(key + _HASH_OFFSET)


@njit(cache=True, inline="always")
def _home(h, n):
    return ((h >> _S32) * n) >> _S32


@njit(cache=True, inline="always")
def _tag(h, row_bits):
    return (h << row_bits) & _LOW32


@njit(cache=True, inline="always")
def _bucket_of(index, row_keys, key, h, row_bits):
    """The bucket of ``index`` holding ``key`` (hash ``h``), or ``n_buckets`` when absent."""
    n = _U(index.shape[0])
    if n == _U(0):
        return n
    row_mask = (_U(1) << row_bits) - _U(1)
    tag = _tag(h, row_bits)
    b = _home(h, n)
    while True:
        e = _U(index[b])
        if e == _U(0):
            return n
        if (e & ~row_mask) == tag and row_keys[(e & row_mask) - _U(1)] == key:
            return b
        b += _U(1)
        if b == n:
            b = _U(0)


@njit(cache=True, inline="always")
def _row_in(index, row_keys, key, h, row_bits):
    b = _bucket_of(index, row_keys, key, h, row_bits)
    if b == _U(index.shape[0]):
        return np.int64(-1)
    return np.int64((_U(index[b]) & ((_U(1) << row_bits) - _U(1))) - _U(1))


@njit(cache=True, inline="always")
def _place(index, h, row, row_bits):
    """Write ``row`` into the first empty bucket from the home of hash ``h`` (the key is known absent)."""
    n = _U(index.shape[0])
    b = _home(h, n)
    while index[b] != 0:
        b += _U(1)
        if b == n:
            b = _U(0)
    index[b] = np.uint32(_tag(h, row_bits) | (_U(row) + _U(1)))


@njit(cache=True, inline="always")
def _delete_at(index, row_keys, b, row_bits):
    """Empty bucket ``b`` by backward shift: later entries of its cluster that may live at or before the hole
    move into it, so the index is as if the removed entry had never been inserted."""
    n = _U(index.shape[0])
    row_mask = (_U(1) << row_bits) - _U(1)
    hole = b
    j = b
    while True:
        j += _U(1)
        if j == n:
            j = _U(0)
        e = _U(index[j])
        if e == _U(0):
            break
        home = _home(_hash(row_keys[(e & row_mask) - _U(1)]), n)
        # The entry at j may move to the hole unless its home lies cyclically in (hole, j].
        if hole <= j:
            movable = home <= hole or home > j
        else:
            movable = home <= hole and home > j
        if movable:
            index[hole] = index[j]
            hole = j
    index[hole] = 0


# -- batch kernels ------------------------------------------------------------------------------------------
# state: [live, high_water, free_head, cursor]
_LIVE, _HIGH, _FREE, _CURSOR = 0, 1, 2, 3


# The probe is written out in both loops below: behind one more inlined function (a ``_find_one`` calling
# ``_row_in``) a loop ran ~10x slower (~50 ns a key instead of ~4); ``migrating`` is tested outside the loops
# for the same reason.
@njit(cache=True)
def _find_direct(keys, lo, hi, row_keys, index, old, row_bits, out):
    """The row of each of ``keys[lo:hi]`` into ``out[lo:hi]`` (-1 where absent); how many are absent."""
    migrating = old.shape[0] > 0
    misses = 0
    for i in range(lo, hi):
        key = keys[i]
        h = _hash(key)
        r = _row_in(index, row_keys, key, h, row_bits)
        if r < 0 and migrating:
            r = _row_in(old, row_keys, key, h, row_bits)
        out[i] = r
        if r < 0:
            misses += 1
    return misses


@njit(cache=True)
def _find_recent(keys, lo, hi, row_keys, index, old, row_bits, out, recent_keys, recent_rows):
    """:func:`_find_direct`, each key first looked for in the cache ``recent_keys``, ``recent_rows`` (filled as
    keys are probed; -2 marks an empty entry); ``(absent, cache hits)``."""
    migrating = old.shape[0] > 0
    slot_mask = _U(recent_rows.shape[0] - 1)
    misses = 0
    hits = 0
    for i in range(lo, hi):
        key = keys[i]
        slot = (key ^ (key >> _FOLD)) & slot_mask  # no hash: a hit costs a load and a compare
        r = recent_rows[slot]
        if r != -2 and recent_keys[slot] == key:
            hits += 1
        else:
            h = _hash(key)
            r = _row_in(index, row_keys, key, h, row_bits)
            if r < 0 and migrating:
                r = _row_in(old, row_keys, key, h, row_bits)
            recent_keys[slot] = key
            recent_rows[slot] = r
        out[i] = r
        if r < 0:
            misses += 1
    return misses, hits


@njit(cache=True)
def _find_range(keys, lo, hi, row_keys, index, old, row_bits, out):
    """:func:`_find_direct` of ``keys[lo:hi]``, through a cache of the rows found (see ``RECENT_BITS``) as long
    as it pays: kept past the first ``RECENT_TRIAL`` keys if they hit it 1 time in 8."""
    recent_keys = np.empty(1 << RECENT_BITS, np.uint64)
    recent_rows = np.full(1 << RECENT_BITS, -2, np.int64)
    trial = min(hi, lo + RECENT_TRIAL)
    misses, hits = _find_recent(keys, lo, trial, row_keys, index, old, row_bits, out, recent_keys, recent_rows)
    if 8 * hits >= trial - lo:
        return misses + _find_recent(keys, trial, hi, row_keys, index, old, row_bits, out, recent_keys,
                                     recent_rows)[0]
    return misses + _find_direct(keys, trial, hi, row_keys, index, old, row_bits, out)


@njit(cache=True, parallel=True)
def _find_pieces_parallel(keys, row_keys, index, old, row_bits, out, pieces, misses):
    """For each piece ``(m, lo, hi)`` of ``pieces``: :func:`_find_range` of ``keys[m][lo:hi]`` in map ``m`` (its
    arrays ``row_keys[m]``, ...; tuples of one array per map), misses into ``misses[piece]``."""
    for c in prange(pieces.shape[0]):
        m = pieces[c, 0]
        misses[c] = _find_range(keys[m], pieces[c, 1], pieces[c, 2], row_keys[m], index[m], old[m], row_bits[m],
                                out[m])


@njit(cache=True)
def _find_pieces_serial(keys, row_keys, index, old, row_bits, out, pieces, misses):
    """:func:`_find_pieces_parallel` on one thread."""
    for c in range(pieces.shape[0]):
        m = pieces[c, 0]
        misses[c] = _find_range(keys[m], pieces[c, 1], pieces[c, 2], row_keys[m], index[m], old[m], row_bits[m],
                                out[m])


def find_in_maps(maps, keys) -> list:
    """``[(rows, absent)]``: :meth:`KeyRowMap.find_counted` of ``keys[m]`` (uint64, flat) in ``maps[m]`` for
    every map, in one pass: all threads share the pieces of ``PIECE`` keys of every map when there are
    ``PARALLEL_MIN`` keys or more in all (one parallel region however many maps), else one thread. Changes
    nothing."""
    keys = [k if k.flags.writeable and k.flags.c_contiguous else np.array(k) for k in keys]  # one array type
    rows = [np.empty(k.shape[0], np.int64) for k in keys]
    pieces = np.array([(m, lo, min(lo + PIECE, k.shape[0])) for m, k in enumerate(keys)
                       for lo in range(0, k.shape[0], PIECE)], np.int64).reshape(-1, 3)
    misses = np.zeros(pieces.shape[0], np.int64)
    if pieces.shape[0]:
        total = sum(k.shape[0] for k in keys)
        find = _find_pieces_parallel if total >= PARALLEL_MIN else _find_pieces_serial
        find(tuple(keys), tuple(m.row_keys for m in maps), tuple(m.index for m in maps), tuple(m.old for m in maps),
             np.array([m.row_bits for m in maps], np.uint64), tuple(rows), pieces, misses)
    absent = np.bincount(pieces[:, 0], misses, minlength=len(keys)).astype(np.int64)
    return [(r, int(a)) for r, a in zip(rows, absent)]


@njit(cache=True, inline="always")
def _lower_floor(floor, r, value, fresh):
    """Keep ``floor`` (when kept: not empty) at most ``value`` for row ``r``; ``fresh``: ``r`` opens its block
    (the first row of a block beyond the high water), whose floor held nothing yet."""
    if floor.shape[0]:
        b = r >> FLOOR_SHIFT
        if fresh or value < floor[b]:
            floor[b] = value


@njit(cache=True)
def _insert_absent(keys, rows, inserted, row_keys, last_seen, counts, index, row_bits, state, step, seen_floor,
                   count_floor):
    """Give each key of ``keys`` with ``rows[i] < 0`` a row (its batch duplicates the same row), marking the
    first occurrence in ``inserted``; the caller has checked that enough rows are free."""
    for i in range(keys.shape[0]):
        if rows[i] >= 0:
            continue
        key = keys[i]
        h = _hash(key)
        r = _row_in(index, row_keys, key, h, row_bits)
        if r < 0:
            fresh = False
            if state[_FREE] >= 0:
                r = state[_FREE]
                state[_FREE] = np.int64(row_keys[r])
            else:
                r = state[_HIGH]
                state[_HIGH] += 1
                fresh = (r & (FLOOR_BLOCK - 1)) == 0
            row_keys[r] = key
            counts[r] = 0
            last_seen[r] = step
            _lower_floor(seen_floor, r, step, fresh)
            _lower_floor(count_floor, r, np.int32(0), fresh)
            _place(index, h, r, row_bits)
            inserted[i] = True
            state[_LIVE] += 1
        rows[i] = r


@njit(cache=True)
def _remove(keys, freed, row_keys, counts, index, old, row_bits, state):
    for i in range(keys.shape[0]):
        key = keys[i]
        h = _hash(key)
        r = np.int64(-1)
        b = _bucket_of(index, row_keys, key, h, row_bits)
        if b != _U(index.shape[0]):
            r = np.int64((_U(index[b]) & ((_U(1) << row_bits) - _U(1))) - _U(1))
            _delete_at(index, row_keys, b, row_bits)
        b = _bucket_of(old, row_keys, key, h, row_bits)
        if b != _U(old.shape[0]):
            r = np.int64((_U(old[b]) & ((_U(1) << row_bits) - _U(1))) - _U(1))
            _delete_at(old, row_keys, b, row_bits)
        freed[i] = r
        if r >= 0:
            counts[r] = -1
            row_keys[r] = _U(state[_FREE])
            state[_FREE] = r
            state[_LIVE] -= 1


@njit(cache=True)
def _migrate(n_rows, row_keys, counts, index, row_bits, state):
    """Insert the live rows of slots ``cursor .. cursor + n_rows - 1`` that ``index`` lacks; True when the
    scan has passed the highest row used (the migration is over)."""
    end = min(state[_CURSOR] + n_rows, state[_HIGH])
    for r in range(state[_CURSOR], end):
        if counts[r] >= 0:
            key = row_keys[r]
            h = _hash(key)
            if _row_in(index, row_keys, key, h, row_bits) < 0:
                _place(index, h, r, row_bits)
    state[_CURSOR] = max(end, state[_CURSOR])
    return state[_CURSOR] >= state[_HIGH]


@njit(cache=True)
def _touch(rows, step, last_seen, counts, seen_floor):
    for i in range(rows.shape[0]):
        r = rows[i]
        last_seen[r] = step
        if counts[r] < _COUNT_MAX:
            counts[r] += 1
        _lower_floor(seen_floor, r, step, False)


@njit(cache=True, parallel=True)
def _touch_maps(rows, step, last_seen, counts, seen_floor):
    """:func:`_touch` of ``rows[m]`` in map ``m`` for every map (tuples of one array per map), a map per
    thread."""
    for m in prange(len(rows)):
        _touch(rows[m], step, last_seen[m], counts[m], seen_floor[m])


def touch_in_maps(maps, rows, step: int) -> None:
    """:meth:`KeyRowMap.touch_found` of ``rows[m]`` in ``maps[m]`` for every map, the maps shared out among the
    threads (each map's rows on one thread, in order); then each map's watchers (:meth:`KeyRowMap.watch`) hear
    of its rows."""
    step = np.int32(step)
    rows = [np.ascontiguousarray(r, np.int64) for r in rows]
    if len(maps) == 1:
        _touch(rows[0], step, maps[0].last_seen, maps[0].counts, maps[0].last_seen_floor)
    elif maps:
        _touch_maps(tuple(rows), step, tuple(m.last_seen for m in maps), tuple(m.counts for m in maps),
                    tuple(m.last_seen_floor for m in maps))
    for m, r in zip(maps, rows):
        if m.watchers:
            m._tell(r, step)


@njit(cache=True, parallel=True)
def _touch_unique(rows, occurrences, step, last_seen, counts, seen_floor):
    for i in prange(rows.shape[0]):
        r = rows[i]
        last_seen[r] = step
        counts[r] = np.int32(min(np.int64(counts[r]) + occurrences[i], _COUNT_MAX))
    for i in range(rows.shape[0]):  # serially: rows of one block share its floor
        _lower_floor(seen_floor, rows[i], step, False)


@njit(cache=True)
def _exact_floors(values, counts, high, floor):
    """Set ``floor`` of every block below the high water to the least ``values`` of its live rows."""
    for b in range((high + FLOOR_BLOCK - 1) >> FLOOR_SHIFT):
        least = np.int32(_NO_FLOOR)
        for r in range(b << FLOOR_SHIFT, min((b + 1) << FLOOR_SHIFT, high)):
            if counts[r] >= 0 and values[r] < least:
                least = values[r]
        floor[b] = least


@njit(cache=True)
def _first_positions(keys, out):
    """Write into ``out`` the positions of the first occurrence of each distinct key of ``keys``, in
    increasing order; returns how many (a scratch open-addressing set of positions, at most half full)."""
    n = keys.shape[0]
    size = 1
    while size < 2 * n:
        size *= 2
    table = np.full(size, -1, np.int64)
    mask = _U(size - 1)
    m = 0
    for i in range(n):
        key = keys[i]
        b = _hash(key) & mask
        while True:
            j = table[b]
            if j < 0:
                table[b] = i
                out[m] = i
                m += 1
                break
            if keys[j] == key:
                break
            b = (b + _U(1)) & mask
    return m


@njit(cache=True)
def _rows_out_of_range(rows, high, counts):
    """Position of the first row that is not a live row, or -1."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0 or r >= high or counts[r] < 0:
            return i
    return -1


@njit(cache=True)
def _free_rows_in_order(next_free, top, out):
    """Walk the free list from ``top`` (``next_free``: ``row_keys`` read as int64, -1 ends it) into ``out``;
    the number of rows walked (at most ``out``'s size)."""
    r = top
    i = 0
    while r >= 0 and i < out.shape[0]:
        out[i] = r
        i += 1
        r = next_free[r]
    return i


@njit(cache=True)
def _place_loaded(keys, rows, row_keys, index, row_bits):
    """Index ``keys`` at ``rows`` (``row_keys[rows]`` already holds them); the position of the first key that
    is already indexed (a duplicate), or -1."""
    for i in range(keys.shape[0]):
        key = keys[i]
        h = _hash(key)
        if _row_in(index, row_keys, key, h, row_bits) >= 0:
            return i
        _place(index, h, rows[i], row_bits)
    return -1


def is_partition(values: np.ndarray) -> bool:
    """Whether the integers ``values`` are exactly ``0 .. len(values) - 1``, each once (one pass, no sort)."""
    n = values.shape[0]
    if n == 0:
        return True
    if values.min() < 0 or values.max() >= n:
        return False
    seen = np.zeros(n, np.bool_)
    seen[values] = True
    return bool(seen.all())  # n values in range covering all n slots: each once


# -- the Python face ----------------------------------------------------------------------------------------
def first_occurrences(keys) -> np.ndarray:
    """Positions (int64, increasing) of the first occurrence of each distinct value of ``keys`` (uint64
    ``[n]``): ``keys[first_occurrences(keys)]`` are the distinct keys in the order they first appear. O(n)."""
    keys = np.ascontiguousarray(keys, np.uint64)
    out = np.empty(keys.shape[0], np.int64)
    return out[:_first_positions(keys, out)]


def as_keys(keys, what: str = "keys") -> np.ndarray:
    """``keys`` (any integer array-like) as a flat uint64 array of their 64-bit patterns: signed values are
    taken as int64 (``-1`` is ``0xFFFF_FFFF_FFFF_FFFF``), unsigned ones as uint64. Anything else (floats,
    bools, strings: hash strings with :func:`embedcore.keys.hash_keys`) raises ``ValueError`` naming
    ``what``."""
    array = np.asarray(keys)
    if not isinstance(keys, np.ndarray) and array.dtype.kind not in "iu":  # [2**64 - 1, -1] is float64 there
        array = np.asarray(keys, object)
    if array.dtype == object:  # Python ints beyond one NumPy integer type (-1 beside 2**63, say)
        values = array.ravel()
        for k in values:
            if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
                raise ValueError(f"{what} must be integers (64-bit keys), got {type(k).__name__} {k!r}")
            if not -2 ** 63 <= int(k) < 2 ** 64:
                raise ValueError(f"{what}: key {int(k)} does not fit in 64 bits")
        return np.array([int(k) & 0xFFFF_FFFF_FFFF_FFFF for k in values], np.uint64)
    if array.dtype == np.bool_ or array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers (64-bit keys), got dtype {array.dtype}")
    if array.dtype.kind == "i":
        return np.ascontiguousarray(array.astype(np.int64, copy=False).ravel()).view(np.uint64)
    return np.ascontiguousarray(array.astype(np.uint64, copy=False).ravel())


class KeyRowMap:
    """A map from 64-bit keys to row slots ``0 .. capacity - 1``, with per-row ``last_seen`` and ``counts``
    metadata; see the module docstring for the layout, the growth and the row assignment.

    Args:
        capacity: the most keys (rows) it holds, ``1 .. 2**31 - 1``.
        name: the table's name, for error messages.
        initial_buckets: the index's first size (default 64; it grows as keys arrive).
    """

    def __init__(self, capacity: int, name: str = "table", initial_buckets: int | None = None):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or \
                not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"table '{name}': capacity must be an int in 1 .. {MAX_CAPACITY}, got {capacity!r}")
        self.capacity = int(capacity)
        self.name = name
        self.row_bits = np.uint64(self.capacity.bit_length())
        self.row_keys = np.empty(self.capacity, np.uint64)
        self.last_seen = np.empty(self.capacity, np.int32)
        self.counts = np.empty(self.capacity, np.int32)
        self.final_buckets = math.floor(self.capacity / MAX_LOAD) + 1
        first = _INITIAL_BUCKETS if initial_buckets is None else int(initial_buckets)
        self.index = np.zeros(min(max(first, 2), self.final_buckets), np.uint32)
        self.old = np.zeros(0, np.uint32)
        self._state = np.array([0, 0, -1, 0], np.int64)
        self.last_seen_floor = np.zeros(0, np.int32)  # kept once floors("last_seen") is asked for
        self.count_floor = np.zeros(0, np.int32)      # kept once floors("counts") is asked for
        self.watchers = []                            # told of every insertion and touch (watch)

    # -- sizes --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._state[_LIVE])

    @property
    def free_rows(self) -> int:
        return self.capacity - len(self)

    @property
    def high_water(self) -> int:
        """One more than the highest row slot ever used (rows at or beyond it were never touched)."""
        return int(self._state[_HIGH])

    @property
    def migrating(self) -> bool:
        """Whether a growth of the index is being migrated (an old index is still kept)."""
        return self.old.shape[0] > 0

    @property
    def nbytes(self) -> int:
        """Bytes in use: the index (and the old one while migrating), and 16 a row slot up to ``high_water``
        (key, last_seen, count; the pages beyond it are allocated but never touched)."""
        floors = (self.last_seen_floor.nbytes > 0) + (self.count_floor.nbytes > 0)
        return self.index.nbytes + self.old.nbytes + 16 * self.high_water + \
            4 * floors * (-(-self.high_water // FLOOR_BLOCK)) + sum(w.nbytes for w in self.watchers)

    def __repr__(self):
        return (f"KeyRowMap(name={self.name!r}, capacity={self.capacity}, keys={len(self)}, "
                f"buckets={self.index.shape[0]}{', migrating' if self.migrating else ''})")

    # -- lookups ------------------------------------------------------------------------------------------
    def find(self, keys) -> np.ndarray:
        """The row of each key (int64, shaped like ``keys``), -1 where absent. Changes nothing."""
        shape = np.shape(keys)
        return self.find_counted(keys)[0].reshape(shape)

    def find_counted(self, keys) -> tuple:
        """``(rows, absent)``: :meth:`find` of ``keys`` flattened, and how many of them are absent."""
        return find_in_maps([self], [as_keys(keys, f"table '{self.name}': keys")])[0]

    def __contains__(self, key) -> bool:
        return np.ndim(key) == 0 and bool(self.find([key])[0] >= 0)

    def find_or_insert(self, keys, step: int = 0):
        """``(rows, inserted)``: each key's row, a new row for each distinct absent key (its ``last_seen`` set
        to ``step``, its count to 0); ``inserted`` (bool, shaped like ``keys``) is True at the first
        occurrence of each key given a row by this call, so ``rows[inserted]`` are the new rows in the order
        they were assigned.

        Raises:
            TableFullError: the batch has more distinct new keys than :attr:`free_rows`; nothing changed.
        """
        shape = np.shape(keys)
        k = as_keys(keys, f"table '{self.name}': keys")
        step = self._checked_step(step)
        rows, absent = self.find_counted(k)
        inserted = np.zeros(k.shape[0], np.bool_)
        if absent > self.free_rows:  # only then can the batch be too big: count its distinct new keys
            new = int(np.unique(k[rows < 0]).shape[0])
            if new > self.free_rows:
                raise TableFullError(
                    f"table '{self.name}': the batch brings {new} new keys but only {self.free_rows} rows are free "
                    f"(capacity {self.capacity}, {len(self)} keys held); nothing was changed")
        if absent:
            self._make_room(len(self) + min(absent, self.free_rows))
            _insert_absent(k, rows, inserted, self.row_keys, self.last_seen, self.counts, self.index, self.row_bits,
                           self._state, step, *self._floors())
            if self.watchers:
                self._tell(rows[inserted], step)
        if self.migrating:
            self.migrate(max(MIGRATE_MIN, MIGRATE_PER_KEY * k.shape[0]))
        return rows.reshape(shape), inserted.reshape(shape)

    def _floors(self):
        return self.last_seen_floor, self.count_floor

    def _checked_step(self, step) -> np.int32:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"table '{self.name}': step must be an int in 0 .. {MAX_STEP}, got {step!r}")
        return np.int32(step)

    # -- removal ------------------------------------------------------------------------------------------
    def remove(self, keys) -> np.ndarray:
        """Remove the keys (absent ones are ignored); returns the row each freed (int64, shaped like ``keys``,
        -1 where absent or a repeat). Freed rows are reused first, the last freed first."""
        shape = np.shape(keys)
        k = as_keys(keys, f"table '{self.name}': keys")
        freed = np.empty(k.shape[0], np.int64)
        _remove(k, freed, self.row_keys, self.counts, self.index, self.old, self.row_bits, self._state)
        return freed.reshape(shape)

    def remove_rows(self, rows) -> np.ndarray:
        """Remove the keys of live ``rows`` (as :meth:`remove`; ``ValueError`` naming a row that is not live,
        before anything changed)."""
        rows = self._live_rows(rows)
        return self.remove(self.row_keys[rows])

    # -- metadata -----------------------------------------------------------------------------------------
    def touch(self, rows, step: int, occurrences=None) -> None:
        """Record that ``rows`` were seen at ``step``: ``last_seen[r] = step``, ``counts[r] +=`` one per
        occurrence of ``r`` in ``rows`` (saturating at ``2**31 - 1``). With ``occurrences`` (int64, one per
        row), ``rows`` must be distinct (a grouping's unique rows) and ``counts[r] += occurrences[i]``, in
        parallel. ``ValueError`` naming a row that is not live, before anything changed."""
        step = self._checked_step(step)
        rows = self._live_rows(rows)
        if occurrences is None:
            _touch(rows, step, self.last_seen, self.counts, self.last_seen_floor)
        else:
            occurrences = np.ascontiguousarray(occurrences, np.int64).ravel()
            if occurrences.shape != rows.shape or (occurrences.size and occurrences.min() < 0):
                raise ValueError(f"table '{self.name}': touch needs one occurrence count >= 0 per row")
            _touch_unique(rows, occurrences, step, self.last_seen, self.counts, self.last_seen_floor)
        self._tell(rows, step)

    def touch_found(self, rows, step: int) -> None:
        """:meth:`touch` (one count per occurrence) of rows that :meth:`find` or :meth:`find_or_insert` just
        returned for keys held (int64, all live: not checked again)."""
        touch_in_maps([self], [rows], self._checked_step(step))

    def watch(self, watcher) -> None:
        """Tell ``watcher`` of every later insertion and touch: ``watcher.written(map, rows, step)`` once the
        ``rows`` (int64, maybe repeated) hold their new key (an insertion) and metadata, ``last_seen == step``.
        Removals are not told (a watcher checks that a row is live). :meth:`refresh_floors` forgets every
        watcher (direct writes were not told), as does :meth:`load` (a new map)."""
        self.watchers.append(watcher)

    def _tell(self, rows, step) -> None:
        for watcher in self.watchers:
            watcher.written(self, rows, int(step))

    def _live_rows(self, rows) -> np.ndarray:
        rows = np.asarray(rows)
        if rows.dtype == np.bool_ or rows.dtype.kind not in "iu":
            raise ValueError(f"table '{self.name}': rows must be integers, got dtype {rows.dtype}")
        rows = np.ascontiguousarray(rows.astype(np.int64).ravel())
        bad = _rows_out_of_range(rows, self._state[_HIGH], self.counts)
        if bad >= 0:
            raise ValueError(f"table '{self.name}': row {int(rows[bad])} holds no key")
        return rows

    def floors(self, which: str) -> np.ndarray:
        """The floors of ``which`` (``"last_seen"`` or ``"counts"``), int32 per block of ``FLOOR_BLOCK`` rows
        (valid for the blocks below the high water; see the module docstring), kept from now on; the first
        call computes them (one pass over the rows used). A scan may tighten them (lower bounds still)."""
        if which not in ("last_seen", "counts"):
            raise ValueError(f"table '{self.name}': floors of 'last_seen' or 'counts', not {which!r}")
        attr = "last_seen_floor" if which == "last_seen" else "count_floor"
        floor = getattr(self, attr)
        if floor.shape[0] == 0:
            floor = np.empty(-(-self.capacity // FLOOR_BLOCK), np.int32)
            _exact_floors(self.last_seen if which == "last_seen" else self.counts, self.counts, self._state[_HIGH],
                          floor)
            setattr(self, attr, floor)
        return floor

    def refresh_floors(self) -> None:
        """Recompute the floors kept from ``last_seen`` and ``counts`` (after writing those directly), and forget
        the watchers (:meth:`watch`), which were not told of those writes."""
        self.watchers = []
        for values, floor in ((self.last_seen, self.last_seen_floor), (self.counts, self.count_floor)):
            if floor.shape[0]:
                _exact_floors(values, self.counts, self._state[_HIGH], floor)

    def live_rows(self) -> np.ndarray:
        """The rows holding a key, increasing (int64)."""
        return np.flatnonzero(self.counts[:self.high_water] >= 0).astype(np.int64)

    def items(self):
        """``(keys, rows)`` of every key held, in increasing row order: keys as int64 (their bits), rows int64."""
        rows = self.live_rows()
        return self.row_keys[rows].view(np.int64), rows

    def keys(self) -> np.ndarray:
        return self.items()[0]

    # -- state (checkpoints) ------------------------------------------------------------------------------
    def free_list(self) -> np.ndarray:
        """The free rows below :attr:`high_water`, in the order they will be reused (the last freed first;
        int64). With the live rows they are exactly ``0 .. high_water - 1``."""
        out = np.empty(self.high_water - len(self), np.int64)
        walked = _free_rows_in_order(self.row_keys.view(np.int64), int(self._state[_FREE]), out)
        assert walked == out.shape[0], "the free list is shorter than the free rows"
        return out

    def state(self) -> tuple:
        """``(keys, rows, last_seen, counts, free)``: every key held (uint64, increasing), its row slot (int64),
        its metadata (int32) and :meth:`free_list`; copies. :meth:`load` rebuilds an equal map from them."""
        live = self.live_rows()
        order = np.argsort(self.row_keys[live], kind="stable")
        rows = live[order]
        return (self.row_keys[rows].copy(), rows, self.last_seen[rows].copy(), self.counts[rows].copy(),
                self.free_list())

    def load(self, keys, last_seen, counts, rows=None, free=None) -> None:
        """Replace the whole map with ``keys`` (distinct 64-bit keys) at row slots ``rows`` (default ``0 .. n -
        1``), with their ``last_seen`` (``0 .. MAX_STEP``) and ``counts`` (>= 0), and the free list ``free``
        (rows reused first to last; default none). ``rows`` and ``free`` together must be exactly ``0 .. h -
        1`` for some ``h <= capacity`` (the new :attr:`high_water`), so the map then assigns rows, removes and
        grows exactly as the map they were taken from (:meth:`state`). Everything is checked first:
        ``ValueError`` naming the table and the offending value, and nothing changes."""
        k = as_keys(keys, f"table '{self.name}': keys")
        n = k.shape[0]
        rows = np.arange(n, dtype=np.int64) if rows is None else self._int_array(rows, "rows")
        free = np.zeros(0, np.int64) if free is None else self._int_array(free, "free")
        last_seen = self._int_array(last_seen, "last_seen")
        counts = self._int_array(counts, "counts")
        for what, array in (("rows", rows), ("last_seen", last_seen), ("counts", counts)):
            if array.shape[0] != n:
                raise ValueError(f"table '{self.name}': {n} keys but {array.shape[0]} {what}")
        high = n + free.shape[0]
        if high > self.capacity:
            raise ValueError(f"table '{self.name}': {n} keys and {free.shape[0]} free rows need {high} row slots; "
                             f"the capacity is {self.capacity}")
        if not is_partition(np.concatenate([rows, free])):
            raise ValueError(f"table '{self.name}': the rows and free rows must be exactly 0 .. {high - 1}, each "
                             f"once")
        if last_seen.size and (last_seen.min() < 0 or last_seen.max() > MAX_STEP):
            raise ValueError(f"table '{self.name}': last_seen must be steps in 0 .. {MAX_STEP}, got "
                             f"{int(last_seen.min() if last_seen.min() < 0 else last_seen.max())}")
        if counts.size and (counts.min() < 0 or counts.max() > _COUNT_MAX):
            raise ValueError(f"table '{self.name}': counts must be in 0 .. {_COUNT_MAX}, got "
                             f"{int(counts.min() if counts.min() < 0 else counts.max())}")
        fresh = KeyRowMap(self.capacity, self.name, initial_buckets=max(_INITIAL_BUCKETS,
                                                                        math.floor(n / MAX_LOAD) + 1))
        fresh.row_keys[rows] = k
        duplicate = _place_loaded(k, rows, fresh.row_keys, fresh.index, fresh.row_bits)
        if duplicate >= 0:
            raise ValueError(f"table '{self.name}': key {int(k[duplicate:duplicate + 1].view(np.int64)[0])} is "
                             f"given twice")
        fresh.last_seen[rows] = last_seen
        fresh.counts[rows] = counts
        fresh.counts[free] = -1
        links = np.append(free[1:], -1).astype(np.int64)
        fresh.row_keys[free] = links.view(np.uint64)
        fresh._state[:] = (n, high, free[0] if free.size else -1, 0)
        self.__dict__.update(fresh.__dict__)

    def _int_array(self, values, what: str) -> np.ndarray:
        array = np.asarray(values)
        if array.dtype == np.bool_ or array.dtype.kind not in "iu" or array.ndim != 1:
            raise ValueError(f"table '{self.name}': {what} must be a 1-d integer array, got "
                             f"{array.dtype} of shape {array.shape}")
        if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
            raise ValueError(f"table '{self.name}': {what} holds {int(array.max())}, out of range")
        return np.ascontiguousarray(array.astype(np.int64))

    # -- growth -------------------------------------------------------------------------------------------
    def _make_room(self, n_keys: int) -> None:
        """Make the index able to take ``n_keys`` keys within ``MAX_LOAD``."""
        if n_keys <= MAX_LOAD * self.index.shape[0]:
            return
        if self.migrating:  # a batch that outran the migration: finish it now
            self.migrate(self.capacity)
        self.grow(max(math.ceil(GROWTH * self.index.shape[0]), math.floor(n_keys / MAX_LOAD) + 1))

    def grow(self, n_buckets: int | None = None) -> None:
        """Start a growth of the index to ``n_buckets`` (default ``GROWTH`` times its size; at most the final
        size ``floor(capacity / MAX_LOAD) + 1``), migrated by later batches (or :meth:`migrate`). A growth
        still being migrated is finished first. Lookups see no difference."""
        if self.migrating:
            self.migrate(self.capacity)
        size = math.ceil(GROWTH * self.index.shape[0]) if n_buckets is None else int(n_buckets)
        if size * LAST_GROWTH_MIN > self.final_buckets:
            size = self.final_buckets
        if size <= self.index.shape[0]:
            return
        self.old, self.index = self.index, np.zeros(size, np.uint32)
        self._state[_CURSOR] = 0
        self.migrate(0)

    def migrate(self, n_rows: int) -> bool:
        """Migrate up to ``n_rows`` more row slots of a growth; True when no growth is left to migrate."""
        if not self.migrating:
            return True
        if _migrate(int(n_rows), self.row_keys, self.counts, self.index, self.row_bits, self._state):
            self.old = np.zeros(0, np.uint32)
            return True
        return False
