"""The key map's floors and the floor-guided TTL expiry and LRU/LFU eviction, against plain-Python scans.

A random history of insertions, touches (at any step, also earlier ones), removals and direct writes
followed by ``refresh_floors``, with the floors asked for at a random moment; after each operation every
kept floor must bound its block's live rows from below, and ``expired_rows`` / ``pick_victims`` must return
exactly what a scan of every live row returns (lowest ``(score, key)``, ties by the uint64 key).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedcore.kernels.hash_map import FLOOR_BLOCK, KeyRowMap, TableFullError, first_occurrences
from embedcore.tables.policies import LFU, LRU, TTL, expired_rows, pick_victims


def live_rows(m):
    return [r for r in range(m.high_water) if m.counts[r] >= 0]


def scan_expired(m, step, steps):
    return [r for r in live_rows(m) if step - int(m.last_seen[r]) > steps]


def scan_victims(m, policy, n, protected):
    protected = {int(r) for r in protected if r >= 0}
    metric = m.counts if isinstance(policy, LFU) else m.last_seen
    candidates = [r for r in live_rows(m) if r not in protected]
    if len(candidates) < n:
        return None
    return sorted(candidates, key=lambda r: (int(metric[r]), int(m.row_keys[r])))[:n]


def check_floors(m):
    for floor, values in ((m.last_seen_floor, m.last_seen), (m.count_floor, m.counts)):
        if floor.shape[0] == 0:
            continue
        for r in live_rows(m):
            assert floor[r // FLOOR_BLOCK] <= values[r], (r, floor[r // FLOOR_BLOCK], values[r])


op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 60), max_size=12), st.integers(0, 3)),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 200), max_size=8), st.integers(-3, 3)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 60), max_size=6), st.just(0)),
    st.tuples(st.just("write"), st.lists(st.integers(0, 200), max_size=4), st.integers(0, 20)),
    st.tuples(st.just("floors"), st.just([]), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 70), ops=st.lists(op, max_size=25), steps=st.integers(1, 4),
       n=st.integers(1, 20), protect=st.lists(st.integers(0, 200), max_size=10), salt=st.integers(0, 2 ** 64 - 1))
def test_floor_guided_scans_equal_full_scans(capacity, ops, steps, n, protect, salt):
    m = KeyRowMap(capacity, "t")
    step = 0
    for kind, items, arg in ops:
        if kind == "insert":
            step += arg
            keys = np.array([(k * 0x9E3779B97F4A7C15 + salt) % 2 ** 64 for k in items], np.uint64)
            if len(set(keys.tolist()) - set(m.keys().view(np.uint64).tolist())) <= m.free_rows:
                m.find_or_insert(keys, step)
        elif kind == "touch" and len(m):
            live = live_rows(m)
            rows = np.array([live[i % len(live)] for i in items], np.int64)
            m.touch(rows, max(0, step + arg))
            if rows.size and arg == 0:
                m.touch(np.unique(rows), step, np.ones(np.unique(rows).shape[0], np.int64))
        elif kind == "remove":
            m.remove(np.array([(k * 0x9E3779B97F4A7C15 + salt) % 2 ** 64 for k in items], np.uint64))
        elif kind == "write" and len(m):
            live = live_rows(m)
            for i in items:
                m.last_seen[live[i % len(live)]] = arg
                m.counts[live[i % len(live)]] = arg
            m.refresh_floors()
        elif kind == "floors":
            m.floors("last_seen")
            m.floors("counts")
        check_floors(m)
        for at in (step, step + steps + 2):
            assert expired_rows(m, at, steps).tolist() == scan_expired(m, at, steps)
            check_floors(m)
        live = live_rows(m)
        protected = [live[i % len(live)] for i in protect] if live else []
        for policy in (LRU(), LFU(), TTL(steps)):
            expected = scan_victims(m, policy, n, protected + [-1])
            if expected is None:
                with pytest.raises(TableFullError):
                    pick_victims(policy, m, n, protected_rows=protected + [-1], step=step)
            else:
                assert pick_victims(policy, m, n, protected_rows=protected + [-1], step=step).tolist() == expected
            check_floors(m)


def test_floors_kept_after_asked_and_counted_in_nbytes():
    m = KeyRowMap(100, "t")
    m.find_or_insert(np.arange(40, dtype=np.uint64), 5)
    before = m.nbytes
    floor = m.floors("last_seen")
    assert floor[:3].tolist() == [5, 5, 5] and m.nbytes == before + 4 * 3
    m.find_or_insert(np.arange(40, 60, dtype=np.uint64), 9)  # a fresh block (48..63) opens at 9
    assert floor[3] == 9 and floor[2] == 5
    with pytest.raises(ValueError, match="'last_seen' or 'counts'"):
        m.floors("score")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=60))
def test_first_occurrences(values):
    keys = np.array(values, np.uint64)
    expected = [i for i, v in enumerate(values) if v not in values[:i]]
    assert first_occurrences(keys).tolist() == expected


def test_eviction_reads_a_block_whose_floor_ties_the_threshold():
    """Block 0's floor is loose (its rows were touched at 5 after being inserted at 0), block 1's is exact
    (5); every row scores 5, and the smallest key lives in block 1: the search must read block 1 too."""
    m = KeyRowMap(32, "t")
    m.floors("last_seen")
    m.find_or_insert(np.arange(100, 116, dtype=np.uint64), 0)
    m.touch(np.arange(16), 5)
    m.find_or_insert(np.arange(0, 16, dtype=np.uint64), 5)
    assert m.last_seen_floor[:2].tolist() == [0, 5]
    assert pick_victims(LRU(), m, 1).tolist() == [16]
    assert pick_victims(LRU(), m, 3, protected_rows=[16]).tolist() == [17, 18, 19]
