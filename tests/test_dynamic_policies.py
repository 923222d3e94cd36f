"""Admission, eviction and string keys of dynamic tables (embedcore.tables.policies, embedcore.keys) against plain
Python models: sorted candidate lists for the victims, a count-min sketch written with Python ints, hashlib."""

import fractions
import hashlib
import math

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedcore.compiler import RowFunctionError
from embedcore.initializers import stream_key
from embedcore.keys import hash_key, hash_keys
from embedcore.kernels.hash_map import PARALLEL_MIN, KeyRowMap, TableFullError
from embedcore.tables.policies import (LFU, LRU, TTL, AdmissionSketch, CountAdmission, EvictByScore, expired_rows,
                                       lowest_scores, pick_victims)

MASK = (1 << 64) - 1


# -- configuration ----------------------------------------------------------------------------------------
def test_configs_validate_compare_and_print():
    assert CountAdmission(min_count=3) == CountAdmission(3) != CountAdmission(4)
    assert hash(CountAdmission(3)) == hash(CountAdmission(3))
    assert repr(CountAdmission(3)) == "CountAdmission(min_count=3, sketch_width=1048576, sketch_depth=4)"
    assert LRU() == LRU() and LRU() != LFU() and hash(LFU()) == hash(LFU())
    assert TTL(steps=5) == TTL(5) != TTL(6) and repr(TTL(5)) == "TTL(steps=5)"
    assert repr(LRU()) == "LRU()"
    for bad in (0, -1, 1.5, True, 2 ** 32, "3"):
        with pytest.raises(ValueError, match="CountAdmission: min_count"):
            CountAdmission(min_count=bad)
    with pytest.raises(ValueError, match="sketch_depth"):
        CountAdmission(2, sketch_depth=17)
    with pytest.raises(ValueError, match="sketch_width"):
        CountAdmission(2, sketch_width=0)
    for bad in (0, -3, 2.0, None, False):
        with pytest.raises(ValueError, match="TTL: steps"):
            TTL(steps=bad)


def norm_score(embedding_table, last_seen, count, step):
    return float(np.sum(embedding_table * embedding_table)) + 0.5 * count


def test_evict_by_score_checks_its_function():
    policy = EvictByScore(norm_score)
    assert policy == EvictByScore(norm_score) and hash(policy) == hash(EvictByScore(norm_score))
    assert policy != EvictByScore(lambda embedding_table, last_seen, count, step: 0.0)
    assert "norm_score" in repr(policy)
    for bad in (print, int, 3):
        with pytest.raises(RowFunctionError, match="not a Python function"):
            EvictByScore(bad)
    with pytest.raises(RowFunctionError, match="four arguments"):
        EvictByScore(lambda row, step: 0.0)

    def returns_a_row(embedding_table, last_seen, count, step):
        return embedding_table * 2

    def does_not_compile(embedding_table, last_seen, count, step):
        return {"a": embedding_table}.popitem(3)

    with pytest.raises(RowFunctionError, match="returns_a_row must return a real number"):
        EvictByScore(returns_a_row).compiled()
    with pytest.raises(RowFunctionError, match="does_not_compile.*cannot be compiled"):
        EvictByScore(does_not_compile).compiled()


def test_evict_by_score_checks_its_reserve():
    policy = EvictByScore(norm_score, reserve=0.25)
    assert policy == EvictByScore(norm_score, 0.25) and hash(policy) == hash(EvictByScore(norm_score, 0.25))
    assert policy != EvictByScore(norm_score) and EvictByScore(norm_score) == EvictByScore(norm_score, 0.01)
    assert EvictByScore(norm_score, 0) == EvictByScore(norm_score, 0.0) and EvictByScore(norm_score, 0).reserve == 0.0
    assert repr(policy) == f"EvictByScore({__name__}.norm_score, reserve=0.25)"
    assert repr(EvictByScore(norm_score)) == f"EvictByScore({__name__}.norm_score)"  # the default, unshown
    assert policy._params() == (("fn", norm_score), ("reserve", 0.25))
    for bad in (-0.01, 1, 1.0, 2.5, float("nan"), float("inf"), True, "0.1", None, 1j):
        with pytest.raises(ValueError, match=r"EvictByScore: reserve must be a real number in \[0, 1\)"):
            EvictByScore(norm_score, reserve=bad)
    # ceil(reserve * capacity), the reserve read as the decimal it prints as
    assert [EvictByScore(norm_score, r).reserve_rows(c) for r, c in
            [(0.07, 100), (0.01, 10 ** 6), (0, 10 ** 6), (0.5, 3), (0.01, 1), (0.999, 7), (1e-9, 5)]] == \
        [7, 10 ** 4, 0, 2, 1, 7, 1]


# -- victims ----------------------------------------------------------------------------------------------
def model_victims(scores_by_row, keys_by_row, n, protected):
    """The n unprotected rows with the lowest (score, key as uint64), in that order."""
    candidates = [r for r in scores_by_row if r not in protected]
    if len(candidates) < n:
        raise TableFullError("too few")
    return sorted(candidates, key=lambda r: (scores_by_row[r], keys_by_row[r] & MASK))[:n]


def filled_map(capacity, keys, touches, removes):
    m = KeyRowMap(capacity, "user", initial_buckets=4)
    m.find_or_insert(np.array(keys, np.int64), 0)
    for step, picks in enumerate(touches, start=1):
        live = m.live_rows()
        if live.size:
            m.touch(live[np.array(picks, np.int64) % live.size], step)
    m.remove(np.array(removes, np.int64))
    return m


key_pool = st.sampled_from([0, -1, 1, 2, 2 ** 63 - 1, -2 ** 63, 2 ** 32, -2 ** 32, 7 << 40, 3, 99, -99, 12345])
map_state = st.tuples(st.integers(1, 30), st.lists(st.one_of(key_pool, st.integers(-2 ** 63, 2 ** 63 - 1)),
                                                   max_size=30, unique=True),
                      st.lists(st.lists(st.integers(0, 100), max_size=8), max_size=6),
                      st.lists(key_pool, max_size=4))


@settings(max_examples=120, deadline=None)
@given(map_state, st.sampled_from(["lru", "lfu", "ttl", "score"]), st.integers(0, 32), st.lists(st.integers(0, 40)),
       st.integers(0, 2 ** 32))
def test_victims_match_the_model(state, kind, n, protected, seed):
    capacity, keys, touches, removes = state
    capacity = max(capacity, len(keys))
    m = filled_map(capacity, keys, touches, removes)
    weights = np.random.default_rng(seed).integers(-2, 3, (capacity, 3)).astype(np.float32)  # many ties
    policy = {"lru": LRU(), "lfu": LFU(), "ttl": TTL(3), "score": EvictByScore(norm_score)}[kind]
    live = m.live_rows().tolist()
    if kind in ("lru", "ttl"):
        scores = {r: int(m.last_seen[r]) for r in live}
    elif kind == "lfu":
        scores = {r: int(m.counts[r]) for r in live}
    else:
        scores = {r: float(np.sum(weights[r].astype(np.float64) ** 2)) + 0.5 * int(m.counts[r]) for r in live}
    row_keys = {r: int(m.row_keys[r]) for r in live}
    protected_rows = [p if p % 5 else -1 for p in protected]
    picks_as_modelled(policy, m, n, protected_rows, weights,
                      lambda: model_victims(scores, row_keys, n, set(protected_rows)))


def picks_as_modelled(policy, m, n, protected_rows, weights, model):
    """``pick_victims`` gives what ``model()`` gives, or refuses as it does (TableFullError), and changes
    nothing; returns the victims (None when refused)."""
    try:
        expected = model()
    except TableFullError:
        with pytest.raises(TableFullError, match="table 'user': cannot free"):
            pick_victims(policy, m, n, protected_rows, step=9, weights=weights)
        return None
    before = m.items()
    got = pick_victims(policy, m, n, protected_rows, step=9, weights=weights)
    assert got.tolist() == expected
    np.testing.assert_array_equal(m.items()[0], before[0])  # picking changes nothing
    return got


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, np.inf, -np.inf, 1e300, -3.5]), max_size=40),
       st.integers(0, 45), st.integers(0, 2 ** 32))
def test_lowest_scores_is_a_sort_by_score_then_key(scores, n, seed):
    keys = np.random.default_rng(seed).permutation(2 ** 20)[:len(scores)].astype(np.uint64) * np.uint64(2 ** 40 + 1)
    got = lowest_scores(np.array(scores, np.float64), keys, n)
    expected = sorted(range(len(scores)), key=lambda i: (scores[i], int(keys[i])))[:n]
    assert got.tolist() == expected


def model_batched_victims(scores_by_row, keys_by_row, n, protected, reserve, capacity):
    """EvictByScore's rule: the lowest max(n, ceil(reserve * capacity)) unprotected rows (all there are when
    fewer), refused when fewer than n; nothing when n is 0."""
    if n <= 0:
        return []
    target = max(n, math.ceil(fractions.Fraction(repr(float(reserve))) * capacity))
    candidates = [r for r in scores_by_row if r not in protected]
    if len(candidates) < n:
        raise TableFullError("too few")
    return sorted(candidates, key=lambda r: (scores_by_row[r], keys_by_row[r] & MASK))[:target]


@settings(max_examples=150, deadline=None)
@given(map_state, st.integers(0, 32), st.lists(st.integers(0, 40)),
       st.one_of(st.sampled_from([0, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.9, 0.999]), st.floats(0, 1, exclude_max=True)),
       st.integers(0, 2 ** 32))
def test_batched_victims_match_the_model(state, n, protected, reserve, seed):
    capacity, keys, touches, removes = state
    capacity = max(capacity, len(keys))
    m = filled_map(capacity, keys, touches, removes)
    weights = np.random.default_rng(seed).integers(-2, 3, (capacity, 3)).astype(np.float32)  # many ties
    live = m.live_rows().tolist()
    scores = {r: float(np.sum(weights[r].astype(np.float64) ** 2)) + 0.5 * int(m.counts[r]) for r in live}
    row_keys = {r: int(m.row_keys[r]) for r in live}
    protected_rows = [p if p % 5 else -1 for p in protected]
    policy = EvictByScore(norm_score, reserve=reserve)
    got = picks_as_modelled(policy, m, n, protected_rows, weights,
                            lambda: model_batched_victims(scores, row_keys, n, set(protected_rows), reserve, capacity))
    if got is None:
        return
    assert not set(got.tolist()) & set(protected_rows)
    if n and len(live) - len(set(protected_rows) & set(live)) >= policy.reserve_rows(capacity):
        assert got.shape[0] == max(n, policy.reserve_rows(capacity))


def large_map(rows=60_000, seed=4):
    """A map above PARALLEL_MIN rows (scanned on Numba's threads), a few removed, metadata with many ties."""
    assert rows >= PARALLEL_MIN
    rng = np.random.default_rng(seed)
    m = KeyRowMap(rows, "big")
    found, _ = m.find_or_insert(rng.integers(-2 ** 63, 2 ** 63 - 1, rows, dtype=np.int64, endpoint=True))
    live = m.live_rows()
    for step in range(1, 12):
        m.touch(live[rng.integers(0, live.size, 3000)], step)
    m.remove_rows(found[rng.integers(0, rows, 500)])
    weights = rng.integers(-3, 4, (rows, 4)).astype(np.float32)
    return m, found, weights, rng


def decayed(embedding_table, last_seen, count, step):
    return count * 0.5 ** ((step - last_seen) / 4.0) + 0.25 * embedding_table[0]


@pytest.mark.parametrize("reserve", [0, 0.01, 0.2])
def test_the_parallel_scan_picks_the_model_victims_for_any_thread_count(reserve):
    m, found, weights, rng = large_map()
    protected = np.concatenate([found[rng.integers(0, found.size, 20_000)], [-1, -5]])
    policy = EvictByScore(decayed, reserve=reserve)
    live = m.live_rows()
    candidates = live[~np.isin(live, protected)]
    score = np.array([decayed(weights[r], np.int64(m.last_seen[r]), np.int64(m.counts[r]), np.int64(12))
                      for r in candidates])
    target = max(37, policy.reserve_rows(m.capacity))
    expected = candidates[np.lexsort((m.row_keys[candidates], score))][:target]
    threads = numba.get_num_threads()
    try:
        for t in sorted({1, threads}):
            numba.set_num_threads(t)
            got = pick_victims(policy, m, 37, protected, step=12, weights=weights)
            np.testing.assert_array_equal(got, expected)
    finally:
        numba.set_num_threads(threads)
    with pytest.raises(TableFullError, match=f"cannot free {candidates.size + 1} rows.* only {candidates.size} "):
        pick_victims(policy, m, candidates.size + 1, protected, step=12, weights=weights)
    assert pick_victims(policy, m, candidates.size, protected, step=12, weights=weights).size == candidates.size


def raises_on_large_rows(embedding_table, last_seen, count, step):
    if embedding_table[0] > 2.5:
        raise ValueError("row too large to score")
    return float(count)


def nan_on_large_rows(embedding_table, last_seen, count, step):
    return np.nan if embedding_table[0] > 2.5 else float(count)


def test_the_parallel_scan_names_the_first_nan_and_what_the_function_raised():
    m, found, weights, _ = large_map()
    before = m.items()
    first = int(m.live_rows()[weights[m.live_rows(), 0] > 2.5][0])
    key = int(m.row_keys[first:first + 1].view(np.int64)[0])
    with pytest.raises(ValueError, match=rf"table 'big': EvictByScore\(.*nan_on_large_rows\) scored key {key} "
                                         rf"\(row {first}\) NaN"):
        pick_victims(EvictByScore(nan_on_large_rows), m, 3, weights=weights)
    with pytest.raises(RowFunctionError, match=r"table 'big': EvictByScore\(.*raises_on_large_rows\) raised "
                                               r"ValueError while scoring rows for eviction: row too large to score; "
                                               r"nothing was changed"):
        pick_victims(EvictByScore(raises_on_large_rows), m, 3, weights=weights)
    np.testing.assert_array_equal(m.items()[0], before[0])
    np.testing.assert_array_equal(m.items()[1], before[1])
    weights[:, 0] = 0  # no row raises or scores NaN now
    assert pick_victims(EvictByScore(raises_on_large_rows, 0), m, 3, weights=weights).size == 3


@pytest.mark.parametrize("pattern", ["random", "ties", "one_value", "increasing", "decreasing", "strided"])
@pytest.mark.parametrize("n", [1, 150, 5000, 39_999])
def test_lowest_scores_of_many_entries_narrowed_by_a_sample_stay_exact(pattern, n):
    """From 2**15 entries the selection first keeps those under a bound read off a strided sample; patterns
    the sample misjudges (every strided entry low) must fall back to the whole array."""
    m = 40_000
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 2 ** 64, m, dtype=np.uint64, endpoint=False)
    assert np.unique(keys).shape[0] == m
    scores = {"random": rng.normal(size=m), "ties": rng.integers(0, 3, m).astype(np.float64),
              "one_value": np.full(m, 2.5), "increasing": np.arange(m, dtype=np.float64),
              "decreasing": -np.arange(m, dtype=np.float64),
              "strided": np.where(np.arange(m) % (m // 4096) == 0, -1.0, rng.random(m))}[pattern]
    got = lowest_scores(scores, keys, n)
    assert got.tolist() == np.lexsort((keys, scores))[:n].tolist()


def test_a_nan_score_is_refused_naming_the_table_and_key():
    m = KeyRowMap(4, "items")
    m.find_or_insert([5, -7])
    weights = np.zeros((4, 2), np.float32)
    weights[1] = np.nan
    with pytest.raises(ValueError, match=r"table 'items': EvictByScore\(.*norm_score\) scored key -7 \(row 1\) NaN"):
        pick_victims(EvictByScore(norm_score), m, 1, weights=weights)
    with pytest.raises(ValueError, match="float32 values"):
        pick_victims(EvictByScore(norm_score), m, 1)


def test_protected_rows_are_never_picked_and_too_few_is_refused():
    m = KeyRowMap(8, "user")
    rows, _ = m.find_or_insert(np.arange(8))
    assert pick_victims(LRU(), m, 3, protected_rows=rows[:5]).tolist() == [5, 6, 7]
    with pytest.raises(TableFullError, match="cannot free 4 rows.* only 3 of its 8 keys are not used by the batch"):
        pick_victims(LRU(), m, 4, protected_rows=rows[:5])
    assert pick_victims(LFU(), m, 0).tolist() == []


@settings(max_examples=60, deadline=None)
@given(map_state, st.integers(0, 12), st.integers(1, 5))
def test_expired_rows_match_the_model(state, step, steps):
    capacity, keys, touches, removes = state
    m = filled_map(max(capacity, len(keys)), keys, touches, removes)
    live = m.live_rows().tolist()
    expected = [r for r in live if step - int(m.last_seen[r]) > steps]
    assert expired_rows(m, step, steps).tolist() == expected


def test_victims_are_the_same_for_any_thread_count():
    rng = np.random.default_rng(3)
    m = KeyRowMap(50_000, "t")
    rows, _ = m.find_or_insert(rng.integers(-2 ** 63, 2 ** 63 - 1, 50_000, dtype=np.int64, endpoint=True))
    live = m.live_rows()
    for step in range(1, 20):
        m.touch(live[rng.integers(0, live.size, 5000)], step)
    threads = numba.get_num_threads()
    picked = []
    try:
        for n in sorted({1, threads}):
            numba.set_num_threads(n)
            picked.append([pick_victims(p, m, 7000, rows[:100], 20).tolist() for p in (LRU(), LFU())])
    finally:
        numba.set_num_threads(threads)
    assert all(p == picked[0] for p in picked)


# -- admission --------------------------------------------------------------------------------------------
def mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK
    return z ^ (z >> 31)


class ModelSketch:
    """A count-min sketch with conservative update, as documented, in Python ints."""

    def __init__(self, min_count, width, depth, seed, table):
        self.min_count, self.width = min_count, width
        self.salts = [stream_key(seed, table, "admission", str(d)) for d in range(depth)]
        self.counters = [[0] * width for _ in range(depth)]

    def columns(self, key):
        return [((mix((key & MASK) ^ salt) >> 32) * self.width) >> 32 for salt in self.salts]

    def estimate(self, key):
        return min(row[c] for row, c in zip(self.counters, self.columns(key)))

    def observe(self, keys):
        for key in keys:
            new = self.estimate(key) + 1
            for row, c in zip(self.counters, self.columns(key)):
                row[c] = max(row[c], new)
        return [self.estimate(k) >= self.min_count for k in keys]


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 4), st.integers(0, 99),
       st.lists(st.lists(st.one_of(key_pool, st.integers(0, 20)), max_size=25), max_size=6))
def test_admission_matches_the_model_and_never_undercounts(min_count, width, depth, seed, batches):
    sketch = CountAdmission(min_count, sketch_width=width, sketch_depth=depth).sketch(seed, "user")
    model = ModelSketch(min_count, width, depth, seed, "user")
    seen = {}
    for batch in batches:
        admitted = sketch.observe(np.array(batch, np.int64))
        if min_count > 1:
            assert admitted.tolist() == model.observe(batch)
        else:
            assert admitted.all()
        for k in batch:
            seen[k] = seen.get(k, 0) + 1
        if min_count > 1 and seen:
            keys = list(seen)
            estimates = sketch.estimate(np.array(keys, np.int64)).tolist()
            assert estimates == [model.estimate(k) for k in keys]
            assert all(e >= seen[k] for e, k in zip(estimates, keys))


def test_a_wide_sketch_counts_exactly_and_admits_at_min_count():
    sketch = AdmissionSketch(min_count=3, width=1 << 16, depth=4, seed=1, table="user")
    assert sketch.nbytes == 4 * 4 << 16
    assert sketch.observe([10, 20, 10]).tolist() == [False, False, False]
    assert sketch.observe([10, 30, 20]).tolist() == [True, False, False]
    assert sketch.observe(np.array([[20, 20]])).tolist() == [[True, True]]
    assert sketch.estimate([10, 20, 30, 40]).tolist() == [3, 4, 1, 0]
    with pytest.raises(ValueError, match="table 'user'"):
        sketch.observe([1.5])


# -- string keys ------------------------------------------------------------------------------------------
def test_hash_keys_is_pinned():
    """These values are part of the saved-table format: they must never change."""
    assert hash_keys(["", "a", "alice"]).tolist() == [-5426141060434712860, 3405396810240292928,
                                                      -8513398901633652147]
    expected = int.from_bytes(hashlib.blake2b(b"bob", digest_size=8).digest(), "little", signed=True)
    assert hash_keys("bob") == expected == hash_key(b"bob")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=300), st.text(alphabet="abc", max_size=140)), max_size=30))
def test_hash_keys_equal_hashlib_for_every_input_form(strings):
    expected = [int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little", signed=True)
                for s in strings]
    assert hash_keys(strings).tolist() == expected
    assert hash_keys(tuple(s.encode("utf-8") for s in strings)).tolist() == expected
    assert hash_keys(np.array(strings, object)).tolist() == expected
    representable = [s for s in strings if not s.endswith("\x00")]  # NumPy's U and S drop trailing NULs
    want = [e for s, e in zip(strings, expected) if not s.endswith("\x00")]
    assert hash_keys(np.array(representable, dtype=str)).tolist() == want
    assert hash_keys(np.array([s.encode("utf-8") for s in representable], dtype="S")).tolist() == want
    assert hash_keys(np.array(strings + ["x"], object)).dtype == np.int64


def test_hash_keys_shapes_and_errors():
    assert hash_keys([]).shape == (0,) and hash_keys(np.array([], "U3")).shape == (0,)
    grid = np.array([["a", "bb"], ["ccc", ""]])
    assert hash_keys(grid).shape == (2, 2) and hash_keys(grid)[1, 1] == hash_keys("")
    with pytest.raises(ValueError, match="item 1 is a int"):
        hash_keys(["a", 5])
    with pytest.raises(ValueError, match="dtype int64"):
        hash_keys(np.array([1, 2]))


def test_hash_keys_same_for_any_thread_count():
    ids = [f"item-{i}" * (i % 7) for i in range(5000)]
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = hash_keys(ids)
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(one, hash_keys(ids))
