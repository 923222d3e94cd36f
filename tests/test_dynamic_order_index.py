"""The order index of LRU, TTL and LFU (embedcore.tables.order_index) against a plain sort of every live row.

Tiny pools (a target of 1 to 16 entries) and refills that advance a block at a time, so that full pools,
lowered bounds, refills in flight, writes behind and ahead of a refill's scan, stale entries and repeats all
happen within a few operations; every answer must equal the sort's, and after every operation each pool
must hold an entry for every live row below its bound (the index's invariant).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedcore.kernels.hash_map import FLOOR_BLOCK, KeyRowMap, TableFullError, touch_in_maps
from embedcore.tables.order_index import METRICS, MIN_BLOCKS, RATE, SHARE, OrderIndex, index_bytes
from embedcore.tables.policies import LFU, LRU, TTL, expired_rows, keep_order_index, order_index, pick_victims


def live(m):
    return [r for r in range(m.high_water) if m.counts[r] >= 0]


def in_order(m, metric, rows):
    values = getattr(m, metric)
    return sorted(rows, key=lambda r: (int(values[r]), int(m.row_keys[r])))


def check_pools(index, m):
    """(*): every live row below a pool's bound has a valid entry there. A pool is (values, keys, rows,
    [count, bound value], [bound key]) (the module's layout)."""
    values = getattr(m, index.metric)
    for pool, upto in ((index.pool, m.high_water), (index.refill, index.cursor * FLOOR_BLOCK)):
        if pool is None:
            continue
        vals, keys, rows, meta, bound_key = pool
        count, bound = int(meta[0]), (int(meta[1]), int(bound_key[0]))
        held = set(zip(vals[:count].tolist(), keys[:count].tolist(), rows[:count].tolist()))
        for r in live(m):
            if r < upto and (int(values[r]), int(m.row_keys[r])) < bound:
                assert (int(values[r]), int(m.row_keys[r]), r) in held, (r, bound)


op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 400), max_size=24), st.integers(0, 2)),
    st.tuples(st.just("insert"), st.lists(st.integers(0, 400), min_size=40, max_size=120), st.just(2)),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 10 ** 4), max_size=30), st.integers(-4, 2)),
    st.tuples(st.just("touch_counted"), st.lists(st.integers(0, 10 ** 4), max_size=12), st.integers(0, 3)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 400), max_size=10), st.just(0)),
    st.tuples(st.just("evict"), st.lists(st.integers(0, 10 ** 4), max_size=12), st.integers(0, 30)),
    st.tuples(st.just("lowest"), st.lists(st.integers(0, 10 ** 4), max_size=12), st.integers(0, 60)),
    st.tuples(st.just("below"), st.just([]), st.integers(-2, 6)),
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 300), metric=st.sampled_from(METRICS), target=st.integers(1, 24),
       ops=st.lists(op, max_size=40), salt=st.integers(0, 2 ** 64 - 1))
def test_answers_equal_a_sort_of_every_live_row(capacity, metric, target, ops, salt):
    m = KeyRowMap(capacity, "t", initial_buckets=4)
    index = OrderIndex(m, metric, target=target, min_blocks=1)
    assert order_index(m, metric) is index
    step = 0
    for kind, items, arg in ops:
        rows_now = live(m)
        pick = [rows_now[i % len(rows_now)] for i in items] if rows_now else []
        if kind == "insert":
            step += arg
            keys = np.array([(k * 0x9E3779B97F4A7C15 + salt) % 2 ** 64 for k in items], np.uint64)
            new = set(keys.tolist()) - set(m.keys().view(np.uint64).tolist())
            if len(new) <= m.free_rows:
                m.find_or_insert(keys, step)
                if arg == 2 and len(m):  # the engine's pattern: insert, then touch every occurrence
                    m.touch_found(m.find(keys), step)
        elif kind == "touch" and pick:
            m.touch(np.array(pick, np.int64), max(0, step + arg))
        elif kind == "touch_counted" and pick:
            unique = np.unique(np.array(pick, np.int64))
            m.touch(unique, step, np.full(unique.shape[0], arg, np.int64))
        elif kind == "remove":
            m.remove(np.array([(k * 0x9E3779B97F4A7C15 + salt) % 2 ** 64 for k in items], np.uint64))
        elif kind in ("evict", "lowest"):
            protected = set(pick[: len(pick) // 2])
            free = [r for r in rows_now if r not in protected]
            expected = in_order(m, metric, free)[:arg]
            got = index.lowest(m, arg, np.array(sorted(protected) + [-1], np.int64))
            assert got.tolist() == expected
            if kind == "evict":
                m.remove_rows(got)
        elif kind == "below":
            limit = step + arg
            expected = in_order(m, metric, [r for r in rows_now if getattr(m, metric)[r] < limit])
            assert index.below(m, limit).tolist() == expected
        check_pools(index, m)


def steady_steps(capacity, metric, target, seed):
    """A full table evicting a few rows a step while its batches insert and touch rows, every answer checked;
    returns how many reads left a refill in flight (its scan short of the high water)."""
    rng = np.random.default_rng(seed)
    m = KeyRowMap(capacity, "t")
    index = OrderIndex(m, metric, target=target, min_blocks=1)
    fresh = iter(rng.permutation(2 ** 20).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    for step in range(4):
        rows, _ = m.find_or_insert(np.array([next(fresh) for _ in range(capacity // 4)], np.uint64), step)
        m.touch_found(rows, step)
    in_flight = 0
    for step in range(4, 80):
        held = live(m)
        seen = [held[i] for i in rng.integers(0, len(held), rng.integers(0, 6))]
        new = np.array([next(fresh) for _ in range(rng.integers(0, 3))], np.uint64)
        expected = in_order(m, metric, [r for r in held if r not in set(seen)])[:new.shape[0]]
        victims = index.lowest(m, new.shape[0], np.array(seen, np.int64))
        assert victims.tolist() == expected
        in_flight += index.refill is not None and index.cursor * FLOOR_BLOCK < m.high_water
        m.remove_rows(victims)
        rows, _ = m.find_or_insert(new, step)
        m.touch_found(np.concatenate([rows, np.array(seen, np.int64)]), step)
        check_pools(index, m)
        if step in (50, 79):  # late: an expiry of most rows runs the pool dry (a full scan)
            limit = step - 3
            expected = in_order(m, metric, [r for r in live(m) if getattr(m, metric)[r] < limit])
            assert index.below(m, limit).tolist() == expected
            check_pools(index, m)
    return in_flight


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(64, 400), metric=st.sampled_from(METRICS), target=st.integers(24, 64),
       seed=st.integers(0, 2 ** 32))
def test_refills_in_flight_keep_the_answers_exact(capacity, metric, target, seed):
    """Refills that run over many steps (a block a read at least), writes landing behind and ahead of their
    scan: the answers stay the sort's."""
    steady_steps(capacity, metric, target, seed)


@pytest.mark.parametrize("n_maps", [1, 3])
@pytest.mark.parametrize("metric", METRICS)
def test_touches_of_stacked_maps_reach_their_indexes(metric, n_maps):
    """touch_in_maps (the stack's maps touched in one pass) tells each map's index of its rows, as touch_found
    does: the pools keep an entry for every row below their bound (touched at older steps too, so that
    ``last_seen`` lands below the bounds), and the answers stay the sort's."""
    rng = np.random.default_rng(n_maps)
    maps = [KeyRowMap(200, f"t{i}") for i in range(n_maps)]
    indexes = []
    for i, m in enumerate(maps):
        keys = rng.permutation(2 ** 20)[:200].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15 + 2 * i)
        for step in range(4):
            m.touch_found(m.find_or_insert(keys[step * 50:(step + 1) * 50], step)[0], step)
        indexes.append(OrderIndex(m, metric, target=64, min_blocks=1))
    for step in range(4, 30):
        touched = [rng.choice(m.high_water, rng.integers(1, 40)).astype(np.int64) for m in maps]
        touch_in_maps(maps, touched, int(rng.integers(0, step + 1)))
        for m, index in zip(maps, indexes):
            check_pools(index, m)
            assert index.lowest(m, 12, np.array([-1], np.int64)).tolist() == in_order(m, metric, live(m))[:12]
            check_pools(index, m)


@pytest.mark.parametrize("metric", METRICS)
def test_reads_leave_refills_in_flight(metric):
    """The case above does reach refills left in flight across steps (for these sizes)."""
    assert steady_steps(400, metric, 48, 0) > 0


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(20, 200), target=st.integers(1, 8), n=st.integers(1, 40),
       protect=st.lists(st.integers(0, 199), max_size=30), seed=st.integers(0, 2 ** 32))
def test_the_policies_read_the_index_and_refuse_too_few(capacity, target, n, protect, seed):
    """pick_victims and expired_rows answer through the map's index (a small one here), as the model says."""
    rng = np.random.default_rng(seed)
    m = KeyRowMap(capacity, "user")
    OrderIndex(m, "last_seen", target=target, min_blocks=1)
    OrderIndex(m, "counts", target=target, min_blocks=1)
    m.find_or_insert(rng.integers(-2 ** 63, 2 ** 63 - 1, capacity, dtype=np.int64, endpoint=True), 0)
    for step in range(1, 6):
        rows = live(m)
        m.touch(np.array(rows, np.int64)[rng.integers(0, len(rows), capacity // 3)], step)
    protected = [live(m)[p % len(m)] for p in protect]
    for policy, metric in ((LRU(), "last_seen"), (TTL(2), "last_seen"), (LFU(), "counts")):
        free = in_order(m, metric, [r for r in live(m) if r not in set(protected)])
        if len(free) < n:
            with pytest.raises(TableFullError, match=f"cannot free {n} rows.* only {len(free)} of"):
                pick_victims(policy, m, n, protected_rows=protected, step=6)
        else:
            assert pick_victims(policy, m, n, protected_rows=protected, step=6).tolist() == free[:n]
    for step in range(4, 9):
        assert expired_rows(m, step, 2).tolist() == [r for r in live(m) if step - int(m.last_seen[r]) > 2]


def test_a_steady_table_at_capacity_never_scans_it_whole():
    """LFU at capacity with every row tied at the lowest count (the case that read every row each step before
    the index): once the first read built the index, no step's refill scans more than a share of the table in
    proportion to the step's own work (victims, rows written), and the victims stay exactly the sort's."""
    rng = np.random.default_rng(5)
    capacity, n = 1 << 17, 20
    m = KeyRowMap(capacity, "t")
    keys = rng.integers(0, 2 ** 64, capacity + 400 * n, dtype=np.uint64)
    rows, _ = m.find_or_insert(keys[:capacity], 0)
    m.touch_found(rows, 0)  # every row counted once
    index = order_index(m, "counts")
    blocks = capacity // FLOOR_BLOCK
    scanned = []
    for step in range(1, 400):
        batch = keys[capacity + step * n:capacity + (step + 1) * n]
        before = index.blocks_scanned
        victims = pick_victims(LFU(), m, n, protected_rows=m.find(batch), step=step)
        scanned.append(index.blocks_scanned - before)
        if step % 40 == 0:
            values = np.where(m.counts[:m.high_water] >= 0, m.counts[:m.high_water], 2 ** 31)
            assert victims.tolist() == np.lexsort((m.row_keys[:m.high_water], values))[:n].tolist()
        m.remove_rows(victims)
        new, _ = m.find_or_insert(batch, step)
        m.touch_found(new, step)
    assert sum(scanned) > 0 and max(scanned) < blocks // 4, (max(scanned), blocks)


def test_memory_per_key_stays_within_the_bound():
    """The key map with its floor and order index at capacity: within the issue's 24 bytes a key."""
    capacity = 1 << 16
    m = KeyRowMap(capacity, "t")
    rows, _ = m.find_or_insert(np.arange(capacity, dtype=np.uint64), 0)
    m.touch_found(rows, 1)
    pick_victims(LRU(), m, 10)
    assert m.nbytes <= index_bytes(capacity) + 16 * capacity + m.index.nbytes + 4 * capacity // FLOOR_BLOCK
    assert m.nbytes / capacity <= 24, m.nbytes / capacity


@pytest.mark.parametrize("batch", [300, 1000])
def test_memory_stays_within_24_bytes_a_key_of_capacity_while_filling_and_evicting(batch):
    """A TTL-style map (floors and an order index from its first step) filled batch by batch through its
    growths, then evicting under LRU at capacity: at every step within 24 bytes a key of capacity (batches
    evicting at most the 1 / SHARE of the rows an order index pool is sized for)."""
    capacity = 1 << 16
    m = KeyRowMap(capacity, "t")
    worst = 0.0
    for step in range(1, capacity // batch + 60):
        keys = (np.arange(batch, dtype=np.uint64) + np.uint64(step * batch)) * np.uint64(0x9E3779B97F4A7C15)
        assert expired_rows(m, step + 2000, 1000).size == 0  # builds and reads the last_seen index
        if m.free_rows < batch:
            m.remove_rows(pick_victims(LRU(), m, batch - m.free_rows))
        rows, _ = m.find_or_insert(keys, step + 2000)
        m.touch_found(rows, step + 2000)
        worst = max(worst, m.nbytes / capacity)
    assert len(m) == capacity and m.nbytes / capacity <= 22.8
    assert worst <= 24, worst


def test_an_unknown_metric_is_refused():
    with pytest.raises(ValueError, match="table 't': an order index of last_seen or counts, not 'score'"):
        OrderIndex(KeyRowMap(4, "t"), "score")


def test_refresh_floors_forgets_the_index_and_the_next_read_rebuilds_it():
    m = KeyRowMap(40, "t")
    m.find_or_insert(np.arange(40, dtype=np.uint64), 3)
    first = order_index(m, "last_seen")
    m.last_seen[:20] = 1  # a direct write, which the index was not told of
    m.refresh_floors()
    assert pick_victims(LRU(), m, 2).tolist() == [0, 1] and order_index(m, "last_seen") is not first


@pytest.mark.parametrize("metric, policy", [("last_seen", LRU()), ("counts", LFU())])
def test_an_index_built_ahead_spares_the_first_eviction_a_scan_of_every_row(metric, policy):
    """keep_order_index, called once a step as a dynamic table does: the index is started when the map is half
    full and built a share a step (its first scan spread over the steps that fill the map), so no step, the
    first eviction included, scans more than a share of a refill in proportion to the entries it used up, and
    the victims stay exactly the sort's."""
    capacity, batch = 1 << 15, 32
    m = KeyRowMap(capacity, "t")
    blocks = capacity // FLOOR_BLOCK
    index, filling, evicting = None, [], []
    for step in range(1, capacity // batch + 80):
        before = index.blocks_scanned if index is not None else 0
        keep_order_index(policy, m)
        index = next((w for w in m.watchers if isinstance(w, OrderIndex)), None)
        assert (index is not None) == (2 * len(m) >= capacity)
        full = m.free_rows < batch
        if full:
            assert not index.building
            victims = pick_victims(policy, m, batch - m.free_rows, step=step)
            if step % 25 == 0:
                values = np.where(m.counts[:m.high_water] >= 0, getattr(m, metric)[:m.high_water], 2 ** 31)
                assert victims.tolist() == np.lexsort((m.row_keys[:m.high_water], values))[:victims.size].tolist()
            m.remove_rows(victims)
        keys = (np.arange(batch, dtype=np.uint64) + np.uint64(step * batch)) * np.uint64(0x9E3779B97F4A7C15)
        rows, _ = m.find_or_insert(keys, step)
        m.touch_found(rows, step)
        if index is not None:
            (evicting if full else filling).append(index.blocks_scanned - before)
    assert len(m) == capacity and sum(filling) >= blocks // 2 and len(evicting) >= 79
    assert max(filling) <= MIN_BLOCKS + 2 * batch // FLOOR_BLOCK, max(filling)
    assert max(evicting) <= MIN_BLOCKS + RATE * blocks * 2 * batch // (capacity // SHARE), (max(evicting), blocks)


@pytest.mark.parametrize("eviction", [LRU(), LFU(), TTL(10 ** 6), None], ids=repr)
def test_a_dynamic_table_builds_its_index_ahead_of_its_first_eviction(eviction):
    import embedcore as ec

    capacity, batch = 1024, 16
    table = ec.DynamicTableConfig(dim=4, capacity=capacity, name="t", optimizer=ec.SGD(0.1), eviction=eviction)
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, seed=0)
    key_map = emb.dynamic_tables["t"].key_map
    for step in range(capacity // batch):
        held = len(key_map)
        acts, ctx = emb.lookup({"f": (np.arange(batch) + step * batch).reshape(-1, 1)})
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
        indexes = [w for w in key_map.watchers if isinstance(w, OrderIndex)]
        assert len(indexes) == (eviction is not None and 2 * held >= capacity), (step, held)
    assert len(key_map) == capacity
    assert all(not index.building for index in indexes)
