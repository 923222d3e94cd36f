"""The key -> row map (embedcore.kernels.hash_map) against a plain Python model: a dict of key -> row, a stack
of freed rows and the per-row metadata, with the documented row assignment."""

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedcore.kernels.hash_map import (MAX_LOAD, PARALLEL_MIN, PIECE, RECENT_TRIAL, KeyRowMap, TableFullError,
                                        as_keys, find_in_maps, touch_in_maps)
from embedcore.tables.policies import LFU, LRU, pick_victims

MASK = (1 << 64) - 1
EXTREME = [0, -1, 1, 2 ** 63 - 1, -2 ** 63, 2 ** 32, 2 ** 33, 3 * 2 ** 32, -2 ** 32, 2 ** 62 + 7, 12345678901]


class ModelMap:
    """What a KeyRowMap promises, written for clarity: keys are their uint64 bit patterns."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.rows = {}          # key -> row
        self.freed = []         # stack of freed rows, last freed on top
        self.high_water = 0
        self.last_seen = {}     # row -> step
        self.counts = {}        # row -> occurrences

    def find(self, keys):
        return [self.rows.get(k & MASK, -1) for k in keys]

    def find_or_insert(self, keys, step):
        keys = [k & MASK for k in keys]
        new = list(dict.fromkeys(k for k in keys if k not in self.rows))
        if len(new) > self.capacity - len(self.rows):
            raise TableFullError("full")
        inserted, first = [], set()
        for k in keys:
            if k in self.rows:
                inserted.append(False)
                continue
            if k in first:
                inserted.append(False)
                continue
            row = self.freed.pop() if self.freed else self.high_water
            if row == self.high_water:
                self.high_water += 1
            self.rows[k] = row
            self.last_seen[row], self.counts[row] = step, 0
            first.add(k)
            inserted.append(True)
        return [self.rows[k] for k in keys], inserted

    def remove(self, keys):
        freed = []
        for k in keys:
            row = self.rows.pop(k & MASK, -1)
            if row >= 0:
                self.freed.append(row)
                del self.last_seen[row], self.counts[row]
            freed.append(row)
        return freed

    def touch(self, rows, step):
        for r in rows:
            self.last_seen[r] = step
            self.counts[r] = min(self.counts[r] + 1, 2 ** 31 - 1)

    def items(self):
        pairs = sorted((row, key) for key, row in self.rows.items())
        return [k for _, k in pairs], [r for r, _ in pairs]


def signed(keys):
    return [k - (1 << 64) if k >= 1 << 63 else k for k in (k & MASK for k in keys)]


def check_same(m, model, probe_keys):
    assert len(m) == len(model.rows)
    assert m.free_rows == model.capacity - len(model.rows)
    assert m.find(np.array(signed(probe_keys), np.int64)).tolist() == model.find(probe_keys)
    keys, rows = m.items()
    expected_keys, expected_rows = model.items()
    assert rows.tolist() == expected_rows
    assert keys.view(np.uint64).tolist() == expected_keys
    assert m.last_seen[rows].tolist() == [model.last_seen[r] for r in expected_rows]
    assert m.counts[rows].tolist() == [model.counts[r] for r in expected_rows]
    assert len(m) <= MAX_LOAD * m.index.shape[0]


def snapshot(m):
    keys, rows = m.items()
    return (m.index.copy(), m.old.copy(), m._state.copy(), keys.copy(), rows.copy(), m.last_seen[rows].copy(),
            m.counts[rows].copy(), m.row_keys[:m.high_water].copy())


def assert_unchanged(before, after):
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


key_values = st.one_of(st.sampled_from(EXTREME), st.integers(-2 ** 63, 2 ** 64 - 1),
                       st.integers(0, 40).map(lambda k: k << 40), st.integers(0, 30))
batches = st.lists(key_values, min_size=0, max_size=30)
operations = st.lists(st.one_of(
    st.tuples(st.just("insert"), batches),
    st.tuples(st.just("find"), batches),
    st.tuples(st.just("remove"), batches),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 1000), max_size=20)),
    st.tuples(st.just("grow"), st.integers(0, 3)),
    st.tuples(st.just("migrate"), st.integers(0, 5)),
    st.tuples(st.just("evict"), st.tuples(st.booleans(), st.integers(0, 6), st.lists(st.integers(0, 40), max_size=6))),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(2, 8), operations)
def test_matches_the_model(capacity, initial_buckets, ops):
    m, model = KeyRowMap(capacity, "t", initial_buckets=initial_buckets), ModelMap(capacity)
    seen = set(EXTREME)
    step = 0
    for op, arg in ops:
        step += 1
        if op == "insert":
            seen.update(arg)
            keys = np.array(signed(arg), np.int64)
            try:
                expected = model.find_or_insert(arg, step)
            except TableFullError:
                before = snapshot(m)
                with pytest.raises(TableFullError, match="table 't'.*new keys.*nothing was changed"):
                    m.find_or_insert(keys, step)
                assert_unchanged(before, snapshot(m))
            else:
                rows, inserted = m.find_or_insert(keys, step)
                assert rows.tolist() == expected[0]
                assert inserted.tolist() == expected[1]
        elif op == "find":
            assert m.find(np.array(signed(arg), np.int64)).tolist() == model.find(arg)
        elif op == "remove":
            assert m.remove(np.array(signed(arg), np.int64)).tolist() == model.remove(arg)
        elif op == "touch":
            live = sorted(model.rows.values())
            rows = [live[i % len(live)] for i in arg] if live else []
            m.touch(np.array(rows, np.int64), step)
            model.touch(rows, step)
        elif op == "evict":  # LRU or LFU victims, protected rows spared, removed by row
            lru, n, protect = arg
            score = model.last_seen if lru else model.counts
            candidates = sorted((r for r in model.rows.values() if r not in protect),
                                key=lambda r: (score[r], next(k for k, v in model.rows.items() if v == r)))
            if len(candidates) < n:
                with pytest.raises(TableFullError):
                    pick_victims(LRU() if lru else LFU(), m, n, protect, step)
            else:
                victims = pick_victims(LRU() if lru else LFU(), m, n, protect, step)
                assert victims.tolist() == candidates[:n]
                by_row = {r: k for k, r in model.rows.items()}
                assert m.remove_rows(victims).tolist() == model.remove([by_row[r] for r in candidates[:n]])
        elif op == "grow":
            m.grow(m.index.shape[0] + arg if arg else None)
        else:
            m.migrate(arg)
        check_same(m, model, sorted(seen))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), batches, batches, st.booleans(), st.lists(st.integers(0, 1000))),
                min_size=0, max_size=4), st.integers(0, 3))
def test_maps_looked_up_and_touched_together_as_one_by_one(tables, step):
    """find_in_maps / touch_in_maps of several maps at once (held keys, absent ones, a growth being migrated,
    read-only key arrays) give each map what its own find and touch give, and its model."""
    maps, models, probes = [], [], []
    for capacity, held, probe, grow, touched in tables:
        m, model = KeyRowMap(capacity, "t", initial_buckets=2), ModelMap(capacity)
        held = [k for k in dict.fromkeys(k & MASK for k in held)][:capacity]
        m.find_or_insert(np.array(signed(held), np.int64))
        model.find_or_insert(held, 0)
        if grow:
            m.grow()  # migrated by no one: lookups probe the new index, then the old
        keys = np.array(signed(probe + held[:3]), np.int64).view(np.uint64)
        keys.flags.writeable = len(maps) % 2 == 0
        maps.append(m), models.append(model), probes.append(keys)
    found = find_in_maps(maps, probes)
    assert len(found) == len(maps)
    for m, model, keys, (rows, absent) in zip(maps, models, probes, found):
        expected = model.find(keys.tolist())
        assert rows.tolist() == expected and absent == expected.count(-1)
    live = [[r for r in rows if r >= 0] for rows, _ in found]
    touch_in_maps(maps, [np.array(r, np.int64) for r in live], step)
    for m, model, rows in zip(maps, models, live):
        model.touch(rows, step)
        check_same(m, model, [])


def test_maps_looked_up_together_on_every_thread_count_alike():
    """Batches beyond PARALLEL_MIN keys in all, split into pieces of PIECE keys (skewed ones, which keep the
    cache of recent rows, and distinct ones, which give it up after RECENT_TRIAL keys): each key's row as the
    map's items say, and the same rows and touches on one thread and on all of them."""
    rng = np.random.default_rng(3)
    sizes = (PARALLEL_MIN // 2 + 3, PIECE + 5, 3 * RECENT_TRIAL, 1, 0)
    pools = [rng.integers(-2 ** 63, 2 ** 63 - 1, 40_000, dtype=np.int64, endpoint=True) for _ in sizes]
    skewed = [np.minimum(rng.zipf(1.2, size), 4000) - 1 for size in sizes]  # a few keys very often
    keys = [pool[picks].view(np.uint64) for pool, picks in zip(pools, skewed)]
    keys[2] = pools[2][rng.permutation(40_000)[:sizes[2]]].view(np.uint64)  # distinct keys, half of them held
    results = []
    threads = numba.get_num_threads()
    try:
        for n in sorted({1, threads}):
            numba.set_num_threads(n)
            maps = [KeyRowMap(40_000, f"t{k}") for k in range(len(sizes))]
            for m, pool in zip(maps, pools):
                m.find_or_insert(pool[::2])
            found = find_in_maps(maps, keys)
            for m, k, (rows, absent) in zip(maps, keys, found):
                held = dict(zip(*(a.tolist() for a in m.items())))
                expected = [held.get(key, -1) for key in k.view(np.int64).tolist()]
                assert rows.tolist() == expected and absent == expected.count(-1)
            touch_in_maps(maps, [rows[rows >= 0] for rows, _ in found], 9)
            results.append([(rows, m.last_seen[:m.high_water].copy(), m.counts[:m.high_water].copy())
                            for m, (rows, _) in zip(maps, found)])
    finally:
        numba.set_num_threads(threads)
    assert sum(sizes) >= PARALLEL_MIN
    for other in results[1:]:
        for a, b in zip(results[0], other):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


def test_growth_is_migrated_in_bounded_steps_and_lookups_never_miss():
    rng = np.random.default_rng(1)
    capacity = 200_000
    m = KeyRowMap(capacity, "user")
    model = {}
    growths = 0
    for batch in range(60):
        keys = rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64, endpoint=True)
        keys[::7] = keys[::7] & ~np.int64(0xFFFFFFFF)  # many keys that agree in their low 32 bits
        was_migrating = m.migrating
        rows, inserted = m.find_or_insert(keys, batch)
        growths += m.migrating and not was_migrating
        for k, r in zip(keys.tolist(), rows.tolist()):
            assert model.setdefault(k, r) == r
        if batch % 5 == 0:
            gone = keys[:500]
            m.remove(gone)
            for k in gone.tolist():
                model.pop(k, None)
        all_keys = np.array(list(model), np.int64)
        np.testing.assert_array_equal(m.find(all_keys), [model[k] for k in all_keys.tolist()])
    assert growths >= 3
    assert len(m) == len(model)


def test_memory_at_most_24_bytes_a_key_of_capacity_at_every_batch_growths_included():
    """The budget a table's capacity sets: 24 bytes a key of capacity beyond the rows, while the index grows
    (an old index kept beside the new one included), and 21.3 a key once full."""
    for capacity in (1, 100, 10_000, 150_001):
        m = KeyRowMap(capacity, "t")
        keys = np.arange(capacity, dtype=np.int64) * 1_000_003 - 2 ** 62
        for part in np.array_split(keys, 25):
            m.find_or_insert(part)
            assert m.nbytes <= 24 * capacity + 4 * 64  # + the first index (64 buckets) of a small map
        m.migrate(capacity)
        assert m.index.shape[0] == m.final_buckets or len(m) < capacity
        if capacity >= 100:
            assert m.nbytes <= 16 * len(m) + 4 * (len(m) / MAX_LOAD + 1)  # a full table: 21.3 bytes a key


def test_same_rows_and_index_for_any_thread_count():
    rng = np.random.default_rng(7)
    batches = [rng.integers(-2 ** 63, 2 ** 63 - 1, 40_000, dtype=np.int64, endpoint=True) % 2 ** 62 - 2 ** 61
               for _ in range(6)]
    results = []
    threads = numba.get_num_threads()
    try:
        for n in sorted({1, threads}):
            numba.set_num_threads(n)
            m = KeyRowMap(300_000, "t")
            out = []
            for step, keys in enumerate(batches):
                rows, inserted = m.find_or_insert(keys, step)
                m.touch(rows[::3], step)
                uniq, occurrences = np.unique(rows[1::3], return_counts=True)
                m.touch(uniq, step, occurrences)
                m.remove(keys[::11])
                out.append((rows, inserted, m.find(keys)))
            results.append((out, m.index.copy(), m.items(), m.counts[:m.high_water].copy()))
    finally:
        numba.set_num_threads(threads)
    first = results[0]
    for other in results[1:]:
        for (a, b, c), (x, y, z) in zip(first[0], other[0]):
            np.testing.assert_array_equal(a, x)
            np.testing.assert_array_equal(b, y)
            np.testing.assert_array_equal(c, z)
        np.testing.assert_array_equal(first[1], other[1])
        np.testing.assert_array_equal(first[2][0], other[2][0])
        np.testing.assert_array_equal(first[3], other[3])


def test_int64_and_uint64_views_are_the_same_key():
    m = KeyRowMap(10, "t")
    rows, _ = m.find_or_insert(np.array([-1, -2 ** 63, 5], np.int64))
    same = np.array([2 ** 64 - 1, 2 ** 63, 5], np.uint64)
    np.testing.assert_array_equal(m.find(same), rows)
    np.testing.assert_array_equal(m.find([2 ** 64 - 1, -2 ** 63, 5]), rows)  # Python ints of both ranges
    assert -1 in m and 2 ** 64 - 1 in m and 6 not in m
    np.testing.assert_array_equal(m.find(np.array([5], np.int32)), rows[2:])
    assert m.find(np.array([[5, -1]])).shape == (1, 2)


def test_a_full_batch_is_refused_naming_the_table_and_counts():
    m = KeyRowMap(5, "user")
    m.find_or_insert([1, 2, 3])
    before = snapshot(m)
    with pytest.raises(TableFullError, match=r"table 'user'.* 4 new keys but only 2 rows are free"):
        m.find_or_insert([1, 10, 11, 12, 10, 13])
    assert_unchanged(before, snapshot(m))
    rows, inserted = m.find_or_insert([10, 1, 11])
    assert rows.tolist() == [3, 0, 4] and inserted.tolist() == [True, False, True]


def test_refused_batch_after_removals_restores_the_free_stack():
    m, model = KeyRowMap(6, "t", initial_buckets=2), ModelMap(6)
    for keys in ([1, 2, 3, 4, 5, 6], ):
        m.find_or_insert(keys)
        model.find_or_insert(keys, 0)
    m.remove([2, 5, 4])
    model.remove([2, 5, 4])
    with pytest.raises(TableFullError):
        m.find_or_insert([7, 8, 9, 10])
    rows, _ = m.find_or_insert([7, 8, 9])
    assert rows.tolist() == model.find_or_insert([7, 8, 9], 0)[0] == [3, 4, 1]


@pytest.mark.parametrize("bad, message", [
    (np.array([1.5]), "dtype float64"), (np.array([True]), "dtype bool"), (["a"], "str 'a'"),
    (np.array(["a"]), "dtype <U1"), ([1.0], "float 1.0"),
    ([2 ** 64], "does not fit in 64 bits"), ([-2 ** 63 - 1, 1], "does not fit"), ([1, "x", 2 ** 64 - 1], "str"),
])
def test_bad_keys_are_refused_naming_the_table(bad, message):
    m = KeyRowMap(4, "user")
    for op in (m.find, m.find_or_insert, m.remove):
        with pytest.raises(ValueError, match=f"table 'user'.*{message}" if "fit" not in message else message):
            op(bad)
    assert len(m) == 0


def test_bad_arguments():
    for capacity in (0, -1, 2 ** 31, 1.5, True):
        with pytest.raises(ValueError, match="capacity"):
            KeyRowMap(capacity, "user")
    m = KeyRowMap(4, "user")
    rows, _ = m.find_or_insert([1, 2])
    with pytest.raises(ValueError, match="row 3 holds no key"):
        m.touch([0, 3], 1)
    with pytest.raises(ValueError, match="step"):
        m.touch([0], -1)
    with pytest.raises(ValueError, match="step"):
        m.find_or_insert([9], 2 ** 31)
    with pytest.raises(ValueError, match="occurrence"):
        m.touch([0, 1], 1, [1])
    assert m.counts[rows].tolist() == [0, 0] and len(m) == 2
    assert "capacity=4" in repr(m)


def test_as_keys():
    assert as_keys(np.array([-1], np.int8)).tolist() == [2 ** 64 - 1]
    assert as_keys(np.array([255], np.uint8)).tolist() == [255]
    assert as_keys([]).dtype == np.uint64
