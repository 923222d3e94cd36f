"""The front of a key map's rows in ``(metric, key)`` order: what LRU, TTL and LFU evict and expire, found in time
proportional to what is found, not to the table.

An :class:`OrderIndex` watches a :class:`~embedcore.kernels.hash_map.KeyRowMap` for one per-row metric
(``"last_seen"`` or ``"counts"``, int32) and answers

* :meth:`OrderIndex.lowest` ``(n, protected)``: the ``n`` live rows not in ``protected`` with the lowest
  ``(metric, key)``, keys compared as uint64, in that order (the victims of LRU and TTL: ``last_seen``; of LFU:
  ``counts``);
* :meth:`OrderIndex.below` ``(limit)``: the live rows with ``metric < limit``, in that order (TTL's expired rows).

Pools. A pool holds entries ``(value, key, row)``, below an exclusive bound ``(value, key)``, such that

    (*) every live row whose ``(metric, key)`` is below the bound has an entry holding that ``(metric, key)``.

The pool that serves reads is a binary min-heap by ``(value, key)``; a refill's pool (below) only gathers its
entries, unordered, and is made a heap (``O(P)``) when it replaces the serving one. An entry is *valid* while
its row is live and still holds its key and metric; a read pops entries from the top, keeps the valid ones
(pushed back when it ends: a read changes no row) and drops the others and repeats, so removing or re-keying a
row costs the index nothing until a read meets the entry. The key map tells the index of every row it inserts
or touches (:meth:`KeyRowMap.watch`); a row written below a pool's bound gets an entry, which keeps (*). A
pool holds at most ``2 * target`` entries (``target = max(MIN_TARGET, high_water // SHARE)`` when it is built,
``high_water`` the row slots the map has used); a full pool first drops its stale entries, then, if more
than half of it is left, keeps the lower half and lowers its bound to the lowest entry it dropped, which
keeps (*) too (a refill's pool skips the first step: its entries were valid when its scan read them).

Refill without stopping the world. When the pool that serves reads holds fewer than ``target / 2`` entries
(and does not hold every row: its bound is not open), a second pool is built by a scan of the row slots in
order, ``FLOOR_BLOCK`` rows a block, lowering its bound as it fills; the scan skips the blocks whose floor
(:meth:`KeyRowMap.floors`) lies above the bound and sets the floors of the blocks it reads to their exact
minima. Its bound starts open, or for ``last_seen`` at ``(latest step written, 0)``: the rows written while it
scans are newer than any a read will want before the next refill, so they need no entry. Each read advances
the scan by ``MIN_BLOCKS + RATE * blocks * dropped / target`` blocks (``dropped``: the entries the read
dropped, by which the serving pool shrank), so the scan ends after about ``target / RATE`` entries were used
up, long before the serving pool runs dry; rows written behind the scan reach the new pool as writes, so (*)
holds for it when it replaces the old one. A scan that ends with its bound still open holds every live row;
it closes the bound just above the largest value held, ``(largest + 1, 0)``, so that the rows written above
it later need no entry either (until a read reaches the bound and a refill takes them).

A read that finds its pool dry all the same (all of it read, short of its answer) finishes the refill at
once (or scans anew); if that pool is dry too and did not take every row, it scans again with pools twice
as large until its answer fits (an expiry or a batch of victims larger than a pool), then builds one of the
usual size: passes bounded by the table.

First build. An index made at once (the first time it is asked for) scans every row used. One made with
``build_now=False`` (a dynamic table starts it when half full:
:func:`~embedcore.tables.policies.keep_order_index`) starts with a pool that holds no row and a refill sized
for the full map, which its owner advances a share at a time (:meth:`OrderIndex.build_ahead`); rows written
meanwhile reach the refill as writes, as for any refill, and a read before the scan ends finishes it.

Cost (``H`` the row slots used, ``T = target >= H / SHARE``, ``P <= 2 T`` the entries of a pool): a read pops and
pushes back its answer and the protected entries it meets, and pops the stale entries it meets,
``O(log P)`` each; a write of ``w`` rows costs ``O(w)`` checks against the bound and ``O(log P)`` per entry
it adds (for ``last_seen``, a write at a step above every bound costs ``O(1)``); a refill scans ``O(RATE * H /
T) = O(RATE * SHARE)`` rows per entry used up. Which rows are found does not depend on any of this: exactly
those a sort of every live row by ``(metric, key)`` would give.

Memory: two pools of ``2 * target`` entries of 16 bytes (value int32, row int32, key uint64), and a bit per
row slot (the protected rows of a read, the rows of a write, each once): ``64 T / H + 1 / 8`` bytes a row slot
used, 1.125 at ``SHARE = 64`` (pages committed as they fill).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..kernels.hash_map import FLOOR_BLOCK, FLOOR_SHIFT

__all__ = ["OrderIndex", "value_key_at_rank", "METRICS", "SHARE", "MIN_TARGET", "RATE", "MIN_BLOCKS", "index_bytes"]

METRICS = ("last_seen", "counts")
SHARE = 64        # target entries per pool: high_water / SHARE (at least MIN_TARGET)
MIN_TARGET = 256
RATE = 4          # a refill scans the table while RATE * (entries used up) reach the target
MIN_BLOCKS = 16   # blocks a read advances a refill at least

_COUNT, _BOUND, _HEAP = 0, 1, 2   # a pool's meta: entries held, bound value, whether they form a heap
_OPEN = 2 ** 31            # a bound value above every int32: the pool holds every live row
_NONE = -(2 ** 31) - 1     # a bound value below every int32: the pool holds no row
_NO_FLOOR = 2 ** 31 - 1
_DONE, _DRY = 0, 1         # how a read ended: its answer complete, or every entry of its pool read


def index_bytes(capacity: int) -> int:
    """The bytes an :class:`OrderIndex` of a key map of ``capacity`` rows takes at most (at its usual target)."""
    return 2 * 2 * max(MIN_TARGET, capacity // SHARE) * 16 + 8 * -(-capacity // 64)


# -- one pool: (values int32, keys uint64, rows int32, meta int64 [count, bound value, heap], bound key uint64
#    [1]), its first ``count`` entries a min-heap of (value, key) when it serves reads (``heap``); a refill's
#    pool only gathers them (appends, halvings), and becomes a heap when it replaces the serving one ----------
def _new_pool(size: int) -> tuple:
    return (np.empty(size, np.int32), np.empty(size, np.uint64), np.empty(size, np.int32),
            np.array([0, _OPEN, 0], np.int64), np.zeros(1, np.uint64))


@njit(cache=True, inline="always")
def _before(v1, k1, v2, k2):
    """``(v1, k1) < (v2, k2)``."""
    return v1 < v2 or (v1 == v2 and k1 < k2)


@njit(cache=True, inline="always")
def _in_bound(v, k, meta, bound_key):
    return _before(np.int64(v), k, meta[_BOUND], bound_key[0])


@njit(cache=True, inline="always")
def _row_in_bound(v, row_keys, r, meta, bound_key):
    """Whether row ``r`` (value ``v``) lies below the bound; its key is read only on a tie of values."""
    b = meta[_BOUND]
    return v < b or (v == b and row_keys[r] < bound_key[0])


@njit(cache=True, inline="always")
def _less(vals, keys, i, j):
    return _before(vals[i], keys[i], vals[j], keys[j])


@njit(cache=True, inline="always")
def _swap(vals, keys, rows, i, j):
    vals[i], vals[j] = vals[j], vals[i]
    keys[i], keys[j] = keys[j], keys[i]
    rows[i], rows[j] = rows[j], rows[i]


@njit(cache=True, inline="always")
def _sift_down(vals, keys, rows, i, n):
    while True:
        least = i
        child = 2 * i + 1
        if child < n and _less(vals, keys, child, least):
            least = child
        if child + 1 < n and _less(vals, keys, child + 1, least):
            least = child + 1
        if least == i:
            return
        _swap(vals, keys, rows, i, least)
        i = least


@njit(cache=True, inline="always")
def _sift_up(vals, keys, rows, i):
    while i > 0:
        parent = (i - 1) >> 1
        if not _less(vals, keys, i, parent):
            return
        _swap(vals, keys, rows, i, parent)
        i = parent


@njit(cache=True)
def value_key_at_rank(vals, keys, n, kth):
    """The ``(value, key)`` at position ``kth`` (from 0) of the first ``n`` entries in ``(value, key)`` order
    (keys distinct, compared as uint64): a selection of the value, then of the key among its ties, ``O(n)``."""
    tv = np.partition(vals[:n], kth)[kth]
    below = 0
    tied = 0
    for i in range(n):
        if vals[i] < tv:
            below += 1
        elif vals[i] == tv:
            tied += 1
    ties = np.empty(tied, np.uint64)
    t = 0
    for i in range(n):
        if vals[i] == tv:
            ties[t] = keys[i]
            t += 1
    return tv, np.partition(ties, kth - below)[kth - below]


@njit(cache=True, inline="always")
def _valid(v, k, r, metric, counts, row_keys):
    """Whether an entry ``(v, k, r)`` still describes its row: live, holding key ``k`` and metric ``v``."""
    return counts[r] >= 0 and row_keys[r] == k and metric[r] == v


@njit(cache=True)
def _shrink(vals, keys, rows, meta, bound_key, metric, counts, row_keys):
    """Drop the stale entries of a heap (those a refill gathered were valid when read: checking them, at
    random rows, would cost more than they take); if more than half the pool is left, keep the lower half and
    lower the bound to the lowest entry dropped (a heap again, if it was one). The pool comes unpacked, as in
    :func:`_push`."""
    w = meta[_COUNT]
    if meta[_HEAP]:
        w = 0
        for i in range(meta[_COUNT]):
            if _valid(np.int64(vals[i]), keys[i], rows[i], metric, counts, row_keys):
                if i != w:
                    _swap(vals, keys, rows, i, w)
                w += 1
    half = vals.shape[0] // 2
    if w > half:
        v, tk = value_key_at_rank(vals, keys, w, half)
        tv = np.int64(v)
        n = w
        w = 0
        for i in range(n):
            if _before(np.int64(vals[i]), keys[i], tv, tk):
                if i != w:
                    _swap(vals, keys, rows, i, w)
                w += 1
        meta[_BOUND] = tv
        bound_key[0] = tk
    meta[_COUNT] = w
    if meta[_HEAP]:
        _heapify(vals, keys, rows, meta)


@njit(cache=True)
def _heapify(vals, keys, rows, meta):
    """Make a pool's entries a heap (and the pool one that keeps them so)."""
    n = meta[_COUNT]
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(vals, keys, rows, i, n)
    meta[_HEAP] = 1


@njit(cache=True, inline="always")
def _push(vals, keys, rows, meta, bound_key, v, k, r, metric, counts, row_keys):
    """Give row ``r`` (value ``v``, key ``k``, below the bound) an entry, shrinking a full pool first. The pool's
    arrays come unpacked (``vals`` .. ``bound_key``): unpacking the tuple per entry costs reference counts
    (atomic operations) that dwarf the entry's own work."""
    if meta[_COUNT] == vals.shape[0]:
        _shrink(vals, keys, rows, meta, bound_key, metric, counts, row_keys)
        if not _in_bound(v, k, meta, bound_key):
            return
    e = meta[_COUNT]
    vals[e] = v
    keys[e] = k
    rows[e] = r
    meta[_COUNT] = e + 1
    if meta[_HEAP]:
        _sift_up(vals, keys, rows, e)


@njit(cache=True)
def _grown(a, n):
    """``a`` (holding ``n`` entries) in an array twice as long."""
    b = np.empty(max(2 * n, 16), a.dtype)
    b[:n] = a[:n]
    return b


@njit(cache=True)
def _add_written(pool, written, below_row, metric, counts, row_keys, seen):
    """Entries for the rows of ``written`` (those below row ``below_row``, each once: ``seen``, zero bits on
    entry and on return, marks them) whose ``(metric, key)`` is below the bound."""
    vals, keys, rows, meta, bound_key = pool
    one = np.uint64(1)
    distinct = np.empty(min(written.shape[0], 1024), np.int64)
    n = 0
    for i in range(written.shape[0]):
        r = written[i]
        bit = one << np.uint64(r & 63)
        if r >= below_row or seen[r >> 6] & bit:
            continue
        seen[r >> 6] |= bit
        if n == distinct.shape[0]:
            distinct = _grown(distinct, n)
        distinct[n] = r
        n += 1
        v = np.int64(metric[r])
        if _row_in_bound(v, row_keys, r, meta, bound_key):
            _push(vals, keys, rows, meta, bound_key, v, row_keys[r], np.int32(r), metric, counts, row_keys)
    for i in range(n):
        seen[distinct[i] >> 6] = np.uint64(0)


@njit(cache=True)
def _scan(pool, metric, counts, row_keys, floor, high, start, blocks):
    """Give entries to the live rows below the bound of blocks ``start .. start + blocks - 1`` (those below the
    high water ``high``), skipping blocks whose floor lies above the bound, setting the floors of those read to
    their exact minima; returns the next block. The pool is a refill's (not a heap): its entries are appended,
    the count kept in a local (through :func:`_push`, ~150 ns an entry, against ~10 here)."""
    vals, keys, rows, meta, bound_key = pool
    stop = min((high + FLOOR_BLOCK - 1) >> FLOOR_SHIFT, start + blocks)
    e = meta[_COUNT]
    for b in range(start, stop):
        if np.int64(floor[b]) > meta[_BOUND]:
            continue
        least = np.int32(_NO_FLOOR)
        for r in range(b << FLOOR_SHIFT, min((b + 1) << FLOOR_SHIFT, high)):
            if counts[r] < 0:
                continue
            v = metric[r]
            least = min(least, v)
            if not _row_in_bound(np.int64(v), row_keys, r, meta, bound_key):
                continue
            if e == vals.shape[0]:
                meta[_COUNT] = e
                _shrink(vals, keys, rows, meta, bound_key, metric, counts, row_keys)
                e = meta[_COUNT]
                if not _row_in_bound(np.int64(v), row_keys, r, meta, bound_key):
                    continue
            vals[e] = v
            keys[e] = row_keys[r]
            rows[e] = r
            e += 1
        floor[b] = least
    meta[_COUNT] = e
    return max(start, stop)


@njit(cache=True)
def _close(pool):
    """Lower an open bound to just above the largest value held, ``(largest + 1, 0)`` (a pool holding every live
    row: the rows written above it later need no entry until a read reaches them); an empty pool stays open."""
    vals, meta, bound_key = pool[0], pool[3], pool[4]
    if meta[_BOUND] == _OPEN and meta[_COUNT]:
        meta[_BOUND] = np.int64(vals[:meta[_COUNT]].max()) + 1
        bound_key[0] = 0


@njit(cache=True)
def _walk(pool, metric, counts, row_keys, protected, n, limit, out):
    """Pop entries in ``(value, key)`` order: the valid ones not protected (bit set in ``protected``, uint64
    words) go to ``out`` until ``n`` are there or an entry's value reaches ``limit``; the valid ones are pushed
    back at the end, the stale ones and repeats dropped. ``(out, found, dropped, how it ended)``."""
    vals, keys, rows, meta, _ = pool
    kept_v, kept_k, kept_r = np.empty(64, np.int64), np.empty(64, np.uint64), np.empty(64, np.int64)
    m = 0
    n_kept = 0
    dropped = 0
    state = _DONE
    while m < n:
        if meta[_COUNT] == 0:
            state = _DRY
            break
        v, k, r = np.int64(vals[0]), keys[0], np.int64(rows[0])
        if v >= limit:
            break
        last = meta[_COUNT] - 1
        vals[0], keys[0], rows[0] = vals[last], keys[last], rows[last]
        meta[_COUNT] = last
        _sift_down(vals, keys, rows, 0, last)
        repeat = n_kept > 0 and v == kept_v[n_kept - 1] and k == kept_k[n_kept - 1]
        if repeat or not _valid(v, k, r, metric, counts, row_keys):
            dropped += 1
            continue
        if n_kept == kept_v.shape[0]:
            kept_v, kept_k, kept_r = _grown(kept_v, n_kept), _grown(kept_k, n_kept), _grown(kept_r, n_kept)
        kept_v[n_kept], kept_k[n_kept], kept_r[n_kept] = v, k, r
        n_kept += 1
        if not (protected[r >> 6] >> np.uint64(r & 63)) & np.uint64(1):
            if m == out.shape[0]:
                out = _grown(out, m)
            out[m] = r
            m += 1
    for i in range(n_kept):  # room for them all: as many were popped
        e = meta[_COUNT]
        vals[e], keys[e], rows[e] = kept_v[i], kept_k[i], kept_r[i]
        meta[_COUNT] = e + 1
        _sift_up(vals, keys, rows, e)
    return out, m, dropped, state


@njit(cache=True)
def _mark(bits, rows, high, on):
    """Set (``on``) the bits of ``rows`` (those in ``0 .. high - 1``), or clear the words holding them."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if 0 <= r < high:
            if on:
                bits[r >> 6] |= np.uint64(1) << np.uint64(r & 63)
            else:
                bits[r >> 6] = np.uint64(0)


class OrderIndex:
    """The lowest rows of ``key_map`` by ``(metric, key)``; see the module docstring. Built (one scan of the
    rows used) when made, and registered with :meth:`KeyRowMap.watch`, which tells it of every write.

    Args:
        key_map: the map.
        metric: ``"last_seen"`` or ``"counts"``.
        target: entries a pool is sized for (default: ``max(MIN_TARGET, high_water // SHARE)`` when the pool
            is built, ``high_water`` the rows the map has used).
        min_blocks: blocks a read advances a refill at least (default ``MIN_BLOCKS``).
    """

    def __init__(self, key_map, metric: str, target: int | None = None, min_blocks: int = MIN_BLOCKS,
                 build_now: bool = True):
        if metric not in METRICS:
            raise ValueError(f"table '{key_map.name}': an order index of {' or '.join(METRICS)}, not {metric!r}")
        self.metric = metric
        self.fixed_target = None if target is None else max(1, int(target))
        self.min_blocks = max(1, int(min_blocks))
        self.bits = np.zeros(-(-key_map.capacity // 64), np.uint64)  # protected rows of a read; rows of a write
        self.pool = None        # the pool reads use
        self.spare = None       # the arrays of the pool replaced last, for the next refill
        self.refill = None      # the pool being built, or None
        self.cursor = 0         # the next block its scan reads
        self.blocks_scanned = 0  # by every scan so far (what the refills cost)
        self.step = -1           # the latest step written
        self.high_water_seen = key_map.high_water  # by the last build_ahead (its caller's measure of growth)
        if build_now:
            self._finish_refill(key_map, self.target(key_map))
        else:  # a pool holding no row, and a refill sized for the full map, scanned by build_ahead
            self.pool = _new_pool(0)
            self.pool[3][_BOUND] = _NONE
            self._start_refill(self.target(key_map, key_map.capacity))
        key_map.watch(self)

    @property
    def building(self) -> bool:
        """Whether this index, made with ``build_now=False``, is still being built (no pool serves reads yet;
        the first read finishes the build at once)."""
        return self.pool[0].shape[0] == 0 and self.pool[3][_BOUND] == _NONE

    def build_ahead(self, key_map, blocks: int) -> None:
        """Advance the build of an index made with ``build_now=False`` by ``blocks`` blocks of rows (nothing
        once it is built)."""
        if self.building and self.refill is not None:
            self._scan(key_map, max(0, int(blocks)))

    def target(self, key_map, rows: int | None = None) -> int:
        """The entries a pool built now is sized for (it holds twice as many at most): for the row slots used,
        or ``rows``."""
        if self.fixed_target is not None:
            return self.fixed_target
        return max(MIN_TARGET, (key_map.high_water if rows is None else rows) // SHARE)

    @property
    def nbytes(self) -> int:
        pools = [p for p in (self.pool, self.spare, self.refill) if p is not None]
        return self.bits.nbytes + sum(sum(a.nbytes for a in p) for p in pools)

    def _pools(self):
        return (self.pool,) if self.refill is None else (self.pool, self.refill)

    # -- writes -------------------------------------------------------------------------------------------
    def written(self, key_map, rows, step: int) -> None:
        """``rows`` (int64, maybe repeated) of ``key_map`` were inserted or touched at ``step``."""
        self.step = max(self.step, step)
        if self.metric == "last_seen" and all(step > p[3][_BOUND] or (step == p[3][_BOUND] and p[4][0] == 0)
                                              for p in self._pools()):
            return  # they all hold last_seen == step, at or above every bound
        metric = getattr(key_map, self.metric)
        for pool, below_row in ((self.pool, key_map.capacity), (self.refill, self.cursor << FLOOR_SHIFT)):
            if pool is not None and pool[3][_BOUND] != _NONE and below_row > 0:  # else no row can be below
                _add_written(pool, rows, below_row, metric, key_map.counts, key_map.row_keys, self.bits)

    # -- reads --------------------------------------------------------------------------------------------
    def lowest(self, key_map, n: int, protected_rows: np.ndarray) -> np.ndarray:
        """The ``n`` live rows not in ``protected_rows`` (int64; entries out of range ignored) with the lowest
        ``(metric, key)``, in that order; all of them (fewer than ``n``) when fewer are not protected."""
        _mark(self.bits, protected_rows, key_map.high_water, True)
        try:
            return self._read(key_map, int(n), np.iinfo(np.int64).max, protected_rows.shape[0])
        finally:
            _mark(self.bits, protected_rows, key_map.high_water, False)

    def below(self, key_map, limit: int) -> np.ndarray:
        """The live rows with ``metric < limit``, in ``(metric, key)`` order."""
        return self._read(key_map, np.iinfo(np.int64).max, int(limit), 0)

    def _read(self, key_map, n, limit, n_protected):
        metric = getattr(key_map, self.metric)
        out = np.empty(min(n, 1024), np.int64)
        dropped, target = 0, self.target(key_map)
        size, whole = 0, False
        while True:
            out, m, d, state = _walk(self.pool, metric, key_map.counts, key_map.row_keys, self.bits, n, limit,
                                     out)
            dropped += d
            bound = self.pool[3][_BOUND]
            if state == _DONE or whole or bound == _OPEN or bound >= limit:
                break  # complete: enough found, or every row the answer can hold was read
            size = target if size == 0 else \
                min(max(2 * size, 4 * m, 2 * min(n, len(key_map)) + n_protected), key_map.capacity)
            whole = self._finish_refill(key_map, size)
        if size > target:
            self._finish_refill(key_map, target)
        else:
            self._advance(key_map, dropped, target)
        return out[:m]

    # -- refill -------------------------------------------------------------------------------------------
    def _advance(self, key_map, used: int, target: int) -> None:
        """Start a refill when the pool runs low; scan in proportion to the entries ``used`` up."""
        meta = self.pool[3]
        if self.refill is None:
            if meta[_BOUND] == _OPEN or meta[_COUNT] >= target // 2:
                return
            # last_seen: the rows written from now on are newer than any a read will want before the next refill
            self._start_refill(target, self.step if self.metric == "last_seen" and self.step >= 0 else _OPEN)
        blocks = -(-key_map.high_water // FLOOR_BLOCK)
        self._scan(key_map, self.min_blocks + -(-RATE * blocks * used // (self.refill[0].shape[0] // 2)))

    def _start_refill(self, target: int, bound: int = _OPEN) -> None:
        """A new refill of ``2 * target`` entries, its bound ``(bound, 0)`` (open: it may take every row)."""
        size = 2 * target
        spare, self.spare = self.spare, None
        if spare is None or spare[0].shape[0] != size:
            spare = _new_pool(size)
        spare[3][:] = (0, bound, 0)
        spare[4][0] = 0
        self.refill, self.cursor = spare, 0

    def _scan(self, key_map, blocks: int) -> bool:
        """Advance the refill by ``blocks``; when its scan is over it replaces the pool. Whether it did, holding
        every live row."""
        start = self.cursor
        self.cursor = _scan(self.refill, getattr(key_map, self.metric), key_map.counts, key_map.row_keys,
                            key_map.floors(self.metric), key_map.high_water, self.cursor, blocks)
        self.blocks_scanned += self.cursor - start
        if self.cursor << FLOOR_SHIFT < key_map.high_water:
            return False
        whole = self.refill[3][_BOUND] == _OPEN
        _close(self.refill)
        _heapify(*self.refill[:4])
        self.pool, self.spare, self.refill = self.refill, self.pool, None
        return whole

    def _finish_refill(self, key_map, target: int) -> bool:
        """Scan the rest of the table now: the refill running if its pool is of ``target``, else a new one;
        whether the new pool holds every live row (as :meth:`_scan`)."""
        if self.refill is not None and self.refill[0].shape[0] < 2 * target:
            self.spare, self.refill = self.refill, None
        if self.refill is None:
            self._start_refill(target)
        return self._scan(key_map, -(-key_map.high_water // FLOOR_BLOCK))
