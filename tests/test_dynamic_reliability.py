"""The reliability promises for dynamic tables: bad input is refused naming the feature or table and changes
nothing (compared with :func:`tests.test_dynamic_tables.engine_state`: steps, keys held, rows, slots,
``last_seen``, counts and admission counters, bit for bit); NaN/Inf never reaches a row under either
``non_finite`` policy; a context is refused once stale or used; thread contention is refused with the
documented ``RuntimeError`` or serialised, never corrupting a table; a table too large for memory is refused
before anything is allocated.

Engines here use ``RowId`` initial values and SGD with learning rate 1 where the expected rows are written
out: ``row(key) = key - (sum of its gradients)``, exact in float32 for the small dyadic numbers used.
"""

import threading
import time

import numpy as np
import pytest

import embedcore as ec
from embedcore.kernels.hash_map import MAX_STEP

from .test_dynamic_tables import engine_state

KEYS = [0, -1, 2 ** 63 - 1, -2 ** 63, 5]


def engine(non_finite="raise", optimizer=None, capacity=4, eviction=ec.LRU(), min_count=2):
    """A dynamic table ``dyn`` (features ``f`` pooled, ``q`` a sequence of 2) beside a static table ``st``
    (feature ``g``), trained two steps so that rows, slots, counts and admission counters are not fresh: the
    table holds 0, -1, 2**63 - 1 and 5 (the sequence's second key) after them."""
    admission = ec.CountAdmission(min_count=min_count, sketch_width=4096) if min_count > 1 else None
    dyn = ec.DynamicTableConfig(2, capacity, name="dyn", initializer=ec.RowId(0.0), combiner="sum",
                                admission=admission, eviction=eviction)
    static = ec.TableConfig(6, 2, name="st", combiner="sum", initializer=ec.RowId(0.0))
    emb = ec.Embedding({"f": ec.FeatureConfig(dyn), "q": ec.FeatureConfig(dyn, max_sequence_length=2),
                        "g": ec.FeatureConfig(static)}, optimizer or ec.Adagrad(0.5), non_finite=non_finite)
    for keys in ([[0, 0, -1], [2 ** 63 - 1]], [[0, -1], [2 ** 63 - 1]]):
        step(emb, keys)
    return emb


def batch(keys, static=((1,), (2, 2))):
    return {"f": [list(k) for k in keys], "q": np.array([[keys[0][0], 5]], np.int64), "g": [list(s) for s in static]}


def step(emb, keys, gradient=0.25):
    acts, ctx = emb(batch(keys))
    emb.apply_gradients({f: np.full(a.shape, gradient, np.float32) for f, a in acts.items()}, ctx)
    return acts


def refused(emb, call, error, *fragments):
    """``call()`` raises ``error`` whose message holds every fragment, and ``emb`` is as it was."""
    before = engine_state(emb)
    with pytest.raises(error) as caught:
        call()
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))
    assert engine_state(emb) == before, "a refused call changed the engine"
    return caught.value


# -- bad keys and shapes --------------------------------------------------------------------------------------
BAD_IDS = [
    (np.array([1.5, 2.0]), "must be integers"),
    ([[1.5], [2]], "must be integers"),
    (np.array([1, "a"], object), "holding 'a' of type str"),
    (np.array([1, 2 ** 64 - 1, -1], object), "dtype object"),
    (np.array([True, False]), "must be integers"),
    (np.array(["7"]), "must be integers"),
    ([[2 ** 64]], "does not fit in 64 bits"),
    ([[-2 ** 63 - 1]], "does not fit in 64 bits"),
    (np.zeros((2, 2, 2), np.int64), "rank"),
    (None, "must be a NumPy integer array"),
    (ec.Ragged(np.array([1, 2], np.int64), np.array([0, 3], np.int64)), "feature 'f'"),
    (ec.Sparse(np.array([[0, 2]]), np.array([3]), (1, 2)), "feature 'f'"),
]


@pytest.mark.parametrize("ids, fragment", BAD_IDS, ids=[f"{i}" for i in range(len(BAD_IDS))])
def test_bad_keys_are_refused_naming_the_feature_and_change_nothing(ids, fragment):
    emb = engine()
    good = batch([[3, 3], [4]])
    error = refused(emb, lambda: emb(dict(good, f=ids)), ec.InputError, "feature 'f'", fragment)
    assert error is not None
    emb(good)  # the engine still works


def test_bad_weights_and_sequence_positions_are_refused_naming_the_feature():
    emb = engine()
    good = batch([[3, 3], [4]])
    refused(emb, lambda: emb(good, {"f": [[1.0], [1.0]], "q": None, "g": None}), ec.InputError, "feature 'f'")
    refused(emb, lambda: emb(good, {"f": [[np.nan, 1.0], [1.0]], "q": None, "g": None}), ec.InputError,
            "feature 'f'")
    twice = ec.Sparse(np.array([[0, 1], [0, 1]]), np.array([3, 4]), (1, 2))
    refused(emb, lambda: emb(dict(good, q=twice)), ec.InputError, "feature 'q'", "given twice")


def test_a_static_table_refusing_the_batch_changes_no_dynamic_table():
    emb = engine()
    refused(emb, lambda: emb(batch([[3, 3, 9], [4, 9]], static=((1,), (6,)))), ec.InputError, "feature 'g'",
            "vocabulary")


# -- capacity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eviction", [None, ec.LRU(), ec.LFU(), ec.TTL(steps=5)], ids=repr)
def test_a_batch_beyond_the_capacity_is_refused_naming_the_table_and_changes_nothing(eviction):
    emb = engine(eviction=eviction, min_count=1)
    assert sorted(emb.embedding_tables["dyn"].keys().tolist()) == sorted([0, -1, 2 ** 63 - 1, 5])  # full
    # Four distinct new keys (11 twice), and 5 (the sequence's) held: only three rows could be freed.
    error = refused(emb, lambda: emb(batch([[11, 12, 11], [13, 14]])), ec.InputError, "table 'dyn'",
                    "nothing was changed")
    assert error is not None
    # Keys the batch uses are protected: one held key beside four new ones cannot make room either.
    refused(emb, lambda: emb(batch([[0, 12, 13], [14]])), ec.InputError, "table 'dyn'")
    if eviction is not None:
        step(emb, [[12], [13]])  # 12 and 13 new beside the sequence's 5: two rows freed
        assert len(emb.embedding_tables["dyn"]) == 4 and 12 in emb.embedding_tables["dyn"]


def nan_score_for_large_rows(row, last_seen, count, step):
    return np.nan if row[0] > 10 else row[0]


def raising_score_for_large_rows(row, last_seen, count, step):
    if row[0] > 10:
        raise ValueError("cannot score this row")
    return row[0]


@pytest.mark.parametrize("fn, error, fragments", [
    (nan_score_for_large_rows, ValueError, ("table 'd'", "scored key 20", "NaN")),
    (raising_score_for_large_rows, ec.RowFunctionError, ("table 'd'", "raising_score_for_large_rows",
                                                         "cannot score this row", "nothing was changed")),
])
def test_an_eviction_score_that_is_nan_or_raises_is_refused_naming_the_table_and_changes_nothing(fn, error,
                                                                                                 fragments):
    scored = ec.DynamicTableConfig(1, 2, name="d", initializer=ec.RowId(0.0), combiner="sum",
                                   eviction=ec.EvictByScore(fn))
    counted = ec.DynamicTableConfig(1, 4, name="c", initializer=ec.RowId(0.0),
                                    admission=ec.CountAdmission(min_count=2, sketch_width=64))
    emb = ec.Embedding({"f": ec.FeatureConfig(scored), "h": ec.FeatureConfig(counted)}, ec.SGD(1.0))
    emb({"f": np.array([1, 20]), "h": np.array([1])})
    refused(emb, lambda: emb({"f": np.array([3]), "h": np.array([5])}), error, *fragments)
    emb({"f": np.array([1, 20]), "h": np.array([5])})  # no eviction needed: fine


# -- contexts -------------------------------------------------------------------------------------------------
def test_applying_twice_or_after_an_eviction_is_refused_and_changes_nothing():
    emb = engine(capacity=4, min_count=1)
    acts, ctx = emb(batch([[0], [-1]]))
    grads = {f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}
    emb.apply_gradients(grads, ctx)
    refused(emb, lambda: emb.apply_gradients(grads, ctx), ec.InputError, "already applied")
    acts, old = emb(batch([[0], [-1]]))
    emb(batch([[21, 22], [23]]))  # evicts: the old context's rows may hold other keys now
    old_grads = {f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}
    refused(emb, lambda: emb.apply_gradients(old_grads, old), ec.InputError, "table 'dyn'",
            "evicted or expired rows")


def test_a_refused_lookup_whose_eviction_was_cancelled_leaves_earlier_contexts_current():
    emb = engine(capacity=4, min_count=1)
    acts, ctx = emb(batch([[0], [-1]]))
    # 21, 22, 23 would evict three rows, but the static table refuses the batch: nothing was evicted
    refused(emb, lambda: emb(batch([[21, 22], [23]], static=((1,), (6,)))), ec.InputError, "feature 'g'")
    emb.apply_gradients({f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}, ctx)
    assert emb.step == 3


def test_a_context_is_refused_after_ttl_expired_rows():
    emb = engine(eviction=ec.TTL(steps=1), min_count=1, capacity=8)
    acts, old = emb(batch([[40], [41]]))
    grads = {f: np.zeros(a.shape, np.float32) for f, a in acts.items()}
    for _ in range(2):
        step(emb, [[50], [51]])  # at step 4, 40 and 41 (seen at step 2) expire
    assert 40 not in emb.embedding_tables["dyn"]
    refused(emb, lambda: emb.apply_gradients(grads, old), ec.InputError, "table 'dyn'", "evicted or expired")


# -- non-finite gradients -------------------------------------------------------------------------------------
def test_nan_gradients_are_refused_up_front_under_raise():
    emb = engine()
    acts, ctx = emb(batch([[0, 3], [-1]]))
    for bad in (np.nan, np.inf, -np.inf):
        grads = {f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}
        grads["f"][1, 0] = bad
        refused(emb, lambda: emb.apply_gradients(grads, ctx), ec.InputError, "feature 'f'", "nothing was updated")
    emb.apply_gradients({f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}, ctx)  # still usable


def test_nan_gradients_skip_exactly_the_keys_they_reach_under_skip():
    emb = engine("skip", optimizer=ec.SGD(1.0), min_count=1, capacity=8)
    view = emb.embedding_tables["dyn"]
    before = {k: view[[k]][0].copy() for k in KEYS}
    acts, ctx = emb({"f": [[2 ** 63 - 1, -2 ** 63], [-1], [0]], "q": np.array([[5, 5]]), "g": [[1], [2], [3]]})
    grads = {f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}
    grads["f"][0, 1] = np.nan       # both keys of sample 0
    grads["q"][0, 1] = np.inf       # the second occurrence of 5 (5's summed gradient is Inf)
    report = emb.apply_gradients(grads, ctx)
    skipped = report.skipped["dyn"]["gradient"].tolist()
    assert sorted(skipped) == sorted([2 ** 63 - 1, -2 ** 63, 5])  # keys as int64 bits
    for k in (2 ** 63 - 1, -2 ** 63, 5):
        assert np.array_equal(view[[k]][0], before[k]), k  # -2**63: its initial value, admitted
    np.testing.assert_array_equal(view[[-1, 0]], np.stack([before[-1], before[0]]) - 0.25)
    assert emb.skipped_rows["dyn"] == 3 and emb.step == 3
    for k in view.keys():
        assert np.isfinite(view[[k]]).all()


def test_an_overflowing_gradient_sum_keeps_the_key_and_names_it_under_raise():
    emb = engine(optimizer=ec.SGD(1.0), min_count=1, capacity=8)
    view = emb.embedding_tables["dyn"]
    acts, ctx = emb({"f": [[2 ** 63 - 1, 2 ** 63 - 1], [-1]], "q": np.array([[-1, 5]]), "g": [[1], [2]]})
    start = view[[2 ** 63 - 1, -1]]
    grads = {f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}
    grads["f"][0] = 3e38  # finite, but counted twice it overflows float32
    with pytest.raises(ec.NonFiniteError, match=r"table 'dyn': 1 row\(s\) left unchanged .* 9223372036854775807"):
        emb.apply_gradients(grads, ctx)
    np.testing.assert_array_equal(view[[2 ** 63 - 1]], start[:1])
    np.testing.assert_array_equal(view[[-1]], start[1:] - 0.5)  # the rest of the batch was applied
    assert emb.step == 3


def sqrt_of_row(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """NaN for rows below 0 (the negative keys under RowId)."""
    return embedding_table - learning_rate * gradient * np.sqrt(embedding_table), slot_variables[0] + 1.0


@pytest.mark.parametrize("non_finite", ["raise", "skip"])
def test_rows_the_optimizer_makes_non_finite_keep_their_values_and_are_named_by_key(non_finite):
    t = ec.DynamicTableConfig(2, 8, name="d", initializer=ec.RowId(0.0), combiner="sum")
    optimizer = ec.CustomOptimizer(sqrt_of_row, 0.5, slot_names=["n"], slot_initializers=[0.0])
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, optimizer, non_finite=non_finite)
    acts, ctx = emb({"f": [[4, -1], [-2 ** 63], [9]]})
    grads = {"f": np.ones(acts["f"].shape, np.float32)}
    if non_finite == "raise":
        with pytest.raises(ec.NonFiniteError, match=r"table 'd': 2 row\(s\) left unchanged because the optimizer "
                                                    r"returned NaN/Inf: rows -1, -9223372036854775808"):
            emb.apply_gradients(grads, ctx)
    else:
        report = emb.apply_gradients(grads, ctx)
        assert sorted(report.skipped["d"]["output"].tolist()) == [-2 ** 63, -1]
    view, slot = emb.embedding_tables["d"], emb.slot_variables["d"]["n"]
    keys = np.array([-2 ** 63, -1, 4, 9])
    np.testing.assert_array_equal(view[keys][:, 0], np.float32([-2 ** 63, -1, 4 - 0.5 * 2, 9 - 0.5 * 3]))
    np.testing.assert_array_equal(slot[keys][:, 0], [0, 0, 1, 1])
    assert emb.skipped_rows == {"d": 2} and emb.step == 1


# -- steps ----------------------------------------------------------------------------------------------------
def test_a_lookup_beyond_the_last_step_is_refused_naming_the_table_and_changes_nothing():
    emb = engine(eviction=ec.TTL(steps=1), min_count=1, capacity=8)
    emb.set_state(step=MAX_STEP)
    step(emb, [[60], [61]])  # the last step a lookup may have: every earlier row expired (5 came back)
    assert emb.step == MAX_STEP + 1 and emb.embedding_tables["dyn"].keys().tolist() == [5, 60, 61]
    refused(emb, lambda: emb(batch([[60], [61]])), ec.InputError, "table 'dyn'", f"steps up to {MAX_STEP}")


# -- threads --------------------------------------------------------------------------------------------------
def _thread_batch(thread, i):
    """Thread ``thread``'s batch ``i``: keys of its own (a signed and an unsigned one), one repeated."""
    keys = [thread * 1000 + i % 3, -(thread * 1000 + i % 3) - 1]
    return {"f": np.array([[keys[0], keys[1], keys[0]]], np.int64), "q": np.array([[keys[1], keys[0]]]),
            "g": [[thread % 6]]}


def test_threads_training_one_engine_are_refused_or_serialised_never_corrupting_it():
    """Four threads look up and apply batches on one engine as fast as they can, retrying what is refused
    with the documented ``RuntimeError``. Every batch is applied exactly once, so the tables must be what any
    serial order gives (SGD with learning rate 1 and exact gradients: order-free)."""
    dyn = ec.DynamicTableConfig(2, 64, name="dyn", initializer=ec.RowId(0.0), combiner="sum", eviction=ec.LFU())
    static = ec.TableConfig(6, 2, name="st", combiner="sum", initializer=ec.RowId(0.0))
    emb = ec.Embedding({"f": ec.FeatureConfig(dyn), "q": ec.FeatureConfig(dyn, max_sequence_length=2),
                        "g": ec.FeatureConfig(static)}, ec.SGD(1.0))
    n_threads, n_batches = 4, 12
    refusals, errors = [], []

    def retry(call):
        while True:
            try:
                return call()
            except RuntimeError as error:
                assert "another thread is using this Embedding's state" in str(error), str(error)
                refusals.append(1)
                time.sleep(0)

    def train(thread):
        try:
            for i in range(n_batches):
                acts, ctx = retry(lambda: emb(_thread_batch(thread, i)))
                grads = {f: np.full(a.shape, 0.125, np.float32) for f, a in acts.items()}
                retry(lambda: emb.apply_gradients(grads, ctx))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=train, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert emb.step == n_threads * n_batches
    # Every occurrence got gradient 1/8 (sum combiner): a key's row is its id minus 1/8 per occurrence applied.
    occurrences, static_occurrences = {}, np.zeros(6)
    for thread in range(n_threads):
        for i in range(n_batches):
            b = _thread_batch(thread, i)
            for k in list(b["f"].ravel()) + list(b["q"].ravel()):
                occurrences[int(k)] = occurrences.get(int(k), 0) + 1
            static_occurrences[thread % 6] += 1
    view = emb.embedding_tables["dyn"]
    keys = np.array(sorted(occurrences), np.int64)
    assert view.keys().tolist() == keys.tolist()
    expected = keys.astype(np.float32)[:, None] - 0.125 * np.array([occurrences[k] for k in keys.tolist()])[:, None]
    np.testing.assert_array_equal(view[keys], np.repeat(expected.astype(np.float32), 2, axis=1))
    table = view._table
    _, rows = table.key_map.items()
    counts = dict(zip(table.key_map.row_keys[rows].view(np.int64).tolist(), table.key_map.counts[rows].tolist()))
    assert counts == occurrences
    np.testing.assert_array_equal(emb.embedding_tables["st"][:, 0], np.arange(6) - 0.125 * static_occurrences)


def test_a_dynamic_lookup_while_another_thread_applies_is_refused_and_changes_nothing(monkeypatch):
    emb = engine(min_count=1, capacity=8)
    acts, ctx = emb(batch([[30], [31]]))
    grads = {f: np.full(a.shape, 0.25, np.float32) for f, a in acts.items()}
    inside, release = threading.Event(), threading.Event()
    real_apply = ec.Embedding._apply

    def slow_apply(self, gradients, context):
        inside.set()
        assert release.wait(30)
        return real_apply(self, gradients, context)

    monkeypatch.setattr(ec.Embedding, "_apply", slow_apply)
    worker = threading.Thread(target=emb.apply_gradients, args=(grads, ctx))
    worker.start()
    assert inside.wait(30)
    try:
        refused(emb, lambda: emb(batch([[32], [33]])), RuntimeError, "cannot look up dynamic tables",
                "another thread is using this Embedding's state")
    finally:
        release.set()
        worker.join(30)
    assert emb.step == 3 and ctx.consumed
    emb(batch([[32], [33]]))  # and afterwards it runs


# -- memory ---------------------------------------------------------------------------------------------------
def _map_bytes(capacity, sketch=0):
    """The key map's documented size (16 bytes a row slot, 4 a bucket at its final size) plus the sketch."""
    return 16 * capacity + 4 * (int(capacity / 0.75) + 1) + sketch


def test_a_capacity_too_large_for_the_machine_is_refused_before_allocating():
    capacity, dim = 2 ** 31 - 1, 1024
    start = time.perf_counter()
    nbytes = capacity * dim * 4 * 2 + _map_bytes(capacity)  # rows, an Adagrad slot, the key map
    with pytest.raises(ValueError, match=rf"table\(s\) \['huge'\] \(2,147,483,647 rows x 1,024 float32 values, "
                                         rf"plus 1 slot\(s\)\) would take .*\({nbytes:,} bytes\).*nothing was "
                                         rf"allocated"):
        ec.Embedding({"f": ec.FeatureConfig(ec.DynamicTableConfig(dim, capacity, name="huge"))}, ec.Adagrad(0.1))
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("capacity, admission, extra", [
    (2 ** 20, None, 0),                                           # the rows fit; the key map does not
    (10, ec.CountAdmission(min_count=2, sketch_width=2 ** 24), 4 * 4 * 2 ** 24),  # the admission sketch
])
def test_the_key_map_and_the_admission_sketch_count_against_memory(monkeypatch, capacity, admission, extra):
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(30 << 20))
    nbytes = capacity * 4 * 4 + _map_bytes(capacity, extra)
    assert capacity * 4 * 4 < 30 << 20 < nbytes
    t = ec.DynamicTableConfig(4, capacity, name="d", admission=admission)
    with pytest.raises(ValueError, match=rf"table\(s\) \['d'\] .*\({nbytes:,} bytes\), more than the 30.0 MiB"):
        ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(0.1))
