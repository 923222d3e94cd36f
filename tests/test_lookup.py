"""Lookups against the oracle: input forms, combiners, weights, sequences, output shapes, nesting."""

import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embedcore as ec

from . import reference as ref
from .harness import as_input, random_samples, random_weights


@pytest.fixture(scope="module")
def emb():
    t_sum = ec.TableConfig(25, 3, combiner="sum", name="t_sum", initializer=ec.RandomUniform(-1, 1))
    t_mean = ec.TableConfig(9, 3, combiner="mean", name="t_mean", initializer=ec.RandomUniform(-1, 1))
    t_sqrtn = ec.TableConfig(1, 3, combiner="sqrtn", name="t_sqrtn", initializer=ec.RandomUniform(-1, 1))
    features = {"sum": ec.FeatureConfig(t_sum), "mean": ec.FeatureConfig(t_mean),
                "sqrtn": ec.FeatureConfig(t_sqrtn), "seq": ec.FeatureConfig(t_sum, max_sequence_length=2)}
    return ec.Embedding(features, ec.SGD(0.1))


@pytest.mark.parametrize("form,weighted", list(itertools.product(["lists", "ragged", "sparse"], [False, True])))
def test_lookup_matches_oracle_for_every_input_form(emb, form, weighted):
    rng = np.random.default_rng(4)
    batch, weights, expected = {}, {}, {}
    for name, seq in (("sum", 0), ("mean", 0), ("sqrtn", 0), ("seq", 2)):
        table_name = emb._feature_config[name].table.name
        table = emb.embedding_tables[table_name].astype(np.float64)
        samples = random_samples(rng, 9, table.shape[0], 5)
        samples[0] = []  # an empty sample gives zeros
        w = random_weights(rng, samples) if weighted else [[1.0] * len(s) for s in samples]
        batch[name], weights[name] = as_input(samples, w if weighted else None, form)
        expected[name] = ref.lookup(table, samples, w, emb.tables[table_name].combiner, seq)
    acts, _ = emb(batch, weights if weighted else None)
    for name in batch:
        np.testing.assert_allclose(acts[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert acts[name].dtype == np.float32
    np.testing.assert_array_equal(acts["sum"][0], 0.0)
    assert acts["seq"].shape == (9, 2, 3)


def test_dense_inputs_rank_one_and_two(emb):
    table = emb.embedding_tables["t_sum"]
    acts, _ = emb({"sum": np.array([[1, 2], [3, 3]], np.int32), "mean": np.array([4, 5], np.uint8),
                   "sqrtn": np.zeros((2, 2), np.int64), "seq": np.array([[7, 8, 9], [1, 0, 0]])})
    np.testing.assert_allclose(acts["sum"], [table[1] + table[2], 2 * table[3]], rtol=1e-6)
    np.testing.assert_allclose(acts["mean"], emb.embedding_tables["t_mean"][[4, 5]], rtol=1e-6)
    # sqrtn of two equal ids: 2 x / sqrt(2)
    np.testing.assert_allclose(acts["sqrtn"], np.sqrt(2) * np.repeat(emb.embedding_tables["t_sqrtn"], 2, 0),
                               rtol=1e-6)
    np.testing.assert_allclose(acts["seq"], np.stack([table[[7, 8]], table[[1, 0]]]), rtol=1e-6)  # truncated


def test_sequence_feature_is_zero_padded_and_weighted(emb):
    table = emb.embedding_tables["t_sum"]
    acts, _ = emb({"sum": [[1]], "mean": [[1]], "sqrtn": [[0]], "seq": [[5]]},
                  {"sum": [[1.0]], "mean": [[1.0]], "sqrtn": [[1.0]], "seq": [[0.5]]})
    np.testing.assert_allclose(acts["seq"][0, 0], 0.5 * table[5], rtol=1e-6)
    np.testing.assert_array_equal(acts["seq"][0, 1], 0.0)


def test_zero_weight_sum_gives_zero_for_mean_and_sqrtn(emb):
    acts, _ = emb({"sum": [[1]], "mean": [[1, 2]], "sqrtn": [[0]], "seq": [[]]},
                  {"sum": [[1.0]], "mean": [[1.0, -1.0]], "sqrtn": [[0.0]], "seq": [[]]})
    np.testing.assert_array_equal(acts["mean"], 0.0)
    np.testing.assert_array_equal(acts["sqrtn"], 0.0)


def test_nested_structure_and_output_shape_are_mirrored():
    table = ec.TableConfig(10, 2, name="nest", initializer=ec.RowId(), combiner="sum")
    config = {"outer": [ec.FeatureConfig(table), (ec.FeatureConfig(table, output_shape=(2, 3)),)],
              "seq": ec.FeatureConfig(table, max_sequence_length=2, output_shape=[4])}
    emb = ec.Embedding(config, ec.SGD(0.1))
    features = {"outer": [np.array([1, 2]), (np.arange(6),)], "seq": [[1, 2, 9], [4]]}
    acts, ctx = emb(features)
    assert isinstance(acts["outer"], list) and isinstance(acts["outer"][1], tuple)
    assert acts["outer"][0].shape == (2, 2)
    assert acts["outer"][1][0].shape == (2, 3, 2)
    np.testing.assert_array_equal(acts["outer"][1][0][1, 2], [5, 5])
    np.testing.assert_array_equal(acts["seq"][:, 0], [1, 2, 4, 0])
    grads = {"outer": [np.ones((2, 2), np.float32), (np.ones((2, 3, 2), np.float32),)],
             "seq": np.ones((4, 2), np.float32)}
    emb.apply_gradients(grads, ctx)
    # row 1: outer/0 sample 0 (1) + outer/1 id 1 (1) + seq position 0 (1) -> 1 - 0.1 * 3
    np.testing.assert_allclose(emb.embedding_tables["nest"][1], 1 - 0.3, rtol=1e-6)
    np.testing.assert_allclose(emb.embedding_tables["nest"][9], 9.0)  # truncated away: untouched


def test_empty_batch():
    table = ec.TableConfig(5, 2, name="empty", combiner="sum")
    emb = ec.Embedding(ec.FeatureConfig(table), ec.Adagrad(0.1))
    before = emb.embedding_tables["empty"].copy()
    acts, ctx = emb(np.zeros(0, np.int64))
    assert acts.shape == (0, 2)
    emb.apply_gradients(np.zeros((0, 2), np.float32), ctx)
    np.testing.assert_array_equal(emb.embedding_tables["empty"], before)
    assert emb.step == 1


def test_lookups_lease_their_batches_and_give_them_back():
    """Each lookup's occurrences live in a workspace leased from the table's pool: kept while its context
    may still be applied (several may be outstanding), returned once applied or dropped, then reused."""
    import gc
    table = ec.TableConfig(40, 4, name="leased", combiner="sum", initializer=ec.RandomUniform(-1, 1))
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.5))
    pool = emb.physical_tables[0].batch_pool
    ids_a, ids_b = np.array([[1, 2], [3, 3]]), np.array([[7, 1], [5, 9]])
    acts_a, ctx_a = emb({"f": ids_a})
    acts_b, ctx_b = emb({"f": ids_b})
    assert pool.idle == 0  # two contexts outstanding, two workspaces leased
    before = emb.embedding_tables["leased"].copy()
    emb.apply_gradients({"f": np.ones_like(acts_a["f"])}, ctx_a)
    assert pool.idle == 1 and ctx_a.table_batches is None
    with pytest.raises(ec.InputError, match="already applied"):
        emb.apply_gradients({"f": np.ones_like(acts_a["f"])}, ctx_a)
    emb.apply_gradients({"f": np.ones_like(acts_b["f"])}, ctx_b)  # b's batch was not overwritten by a's
    expected = before.copy()
    for ids in (ids_a, ids_b):
        np.subtract.at(expected, ids.reshape(-1), 0.5)
    np.testing.assert_allclose(emb.embedding_tables["leased"], expected, rtol=1e-6)
    assert pool.idle == 2
    _, ctx_c = emb({"f": ids_a})  # reuses an idle workspace
    assert pool.idle == 1
    del ctx_c
    gc.collect()
    assert pool.idle == 2  # a dropped context gives its workspace back


def test_activations_held_are_never_reused_and_released_ones_are():
    """Large activations come from a pool: memory is handed out again only once the caller dropped every
    array (and view, and torch tensor) of it."""
    table = ec.TableConfig(1000, 64, name="pooled", combiner="sum", initializer=ec.RandomUniform(-1, 1))
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1))
    pool = emb.physical_tables[0].activation_pool
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 1000, (8192, 3)) for _ in range(4)]  # 8192 x 64 float32 = 2 MB
    expected = [emb.embedding_tables["pooled"][b].sum(axis=1) for b in batches]
    held = []
    for b, e in zip(batches, expected):
        acts, _ = emb({"f": b})
        held.append(acts["f"][::2])  # a view keeps the whole buffer in use
    for view, e in zip(held, expected):
        np.testing.assert_allclose(view, e[::2], rtol=1e-6)
    assert len({id(v.base) for v in held}) == 4
    del held, acts, view
    sizes = set()
    pooled = {id(buffer) for buffer in pool._buffers}
    assert len(pooled) == 4
    for b, e in zip(batches, expected):
        acts, _ = emb({"f": b})
        np.testing.assert_allclose(acts["f"], e, rtol=1e-6)
        assert id(acts["f"].base) in pooled  # a released buffer, not a new one
        sizes.add(pool.nbytes)
        del acts
    assert len(sizes) == 1


def test_dropped_activations_are_freed_at_once_without_the_garbage_collector():
    """No reference cycle holds the activations: they die with the caller's last reference (a cycle kept
    60 MB activations alive until the collector ran, so every lookup paid a fresh buffer's page faults)."""
    import gc
    import weakref
    table = ec.TableConfig(50, 4, name="cycles", combiner="sum")
    emb = ec.Embedding({"a": ec.FeatureConfig(table), "b": [ec.FeatureConfig(table)]}, ec.SGD(0.1))
    gc.disable()
    try:
        acts, ctx = emb({"a": np.array([1, 2]), "b": [np.array([[3, 4]])]})
        alive = [weakref.ref(acts["a"]), weakref.ref(acts["b"][0])]
        del acts
        assert all(r() is None for r in alive)
        emb.apply_gradients({"a": np.ones((2, 4), np.float32), "b": [np.ones((1, 4), np.float32)]}, ctx)
    finally:
        gc.enable()


def test_a_context_collected_during_a_lookup_does_not_deadlock_the_pool():
    """A context kept alive only by a reference cycle gives its workspace back from a finalizer, which can
    run inside any allocation, the next lookup's included (once a lock held there made that a deadlock:
    found at a collection threshold of 12-14 on the machine this was written on)."""
    import gc
    import threading
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(100, 4, name="t"))}, ec.SGD(0.1))
    ids = {"f": np.arange(8)}
    emb(ids)
    keep = []
    old = gc.get_threshold()
    try:
        for threshold in range(1, 300):
            gc.collect(0)  # the youngest generation only: a full collection of a big suite's heap takes seconds
            acts, ctx = emb(ids)
            holder = {"ctx": ctx}
            holder["self"] = holder  # cyclic: only the collector frees it, from inside some allocation
            del ctx, acts
            gc.disable()
            gc.set_threshold(threshold)
            del holder

            def lookup():
                gc.enable()
                keep.append(emb(ids))
            worker = threading.Thread(target=lookup, daemon=True)
            worker.start()
            worker.join(10)
            assert not worker.is_alive(), f"lookup deadlocked (gc threshold {threshold})"
            keep.clear()
    finally:
        gc.set_threshold(*old)
        gc.enable()


@pytest.mark.parametrize("combiner,weighted", [("sum", False), ("sum", True), ("mean", True), ("sqrtn", False)])
def test_large_pooled_features_are_laid_out_in_parallel_exactly_as_serially(combiner, weighted, monkeypatch):
    """Features of at least PARALLEL_MIN ids are laid out by all threads; the occurrences (rows, packed
    activation rows and gains, out_ptr) are bit-identical to the serial layout's, and lookups match the
    oracle."""
    import numba
    from embedcore.kernels import occurrences as occ
    monkeypatch.setattr(occ, "PARALLEL_MIN", 1 << 15)  # this batch's 45,000 ids take the parallel layout
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 16, 6_000)
    lengths[:50] = 0  # empty samples, among them the first
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, 1_000, splits[-1]).astype(np.int64)
    assert ids.shape[0] >= occ.PARALLEL_MIN
    weights = rng.random(ids.shape[0]).astype(np.float32) if weighted else np.zeros(0, np.float32)
    if weighted:
        weights[:7] = 0.0  # a zero-weight head: mean and sqrtn divide by the sample's sum
    code = occ.COMBINERS[combiner]
    n, n_out = ids.shape[0], splits.shape[0] - 1
    outputs = []
    for parallel in (False, True):
        rows, packed = np.full(n + 5, -1, np.int64), np.full(n + 5, -1, np.int64)
        out_ptr = np.full(n_out + 3 + 1, -1, np.int64)
        out_ptr[3] = 5
        if parallel:
            largest = occ._fill_pooled_parallel(ids, splits, weights, code, 100, 3, 5, rows, packed, out_ptr, 7)
        else:
            count, largest = occ._fill_serial(ids, splits, weights, np.zeros(0, np.int64), code, 0, 100, 3, 5,
                                              rows, packed, out_ptr)
            assert count == n
        assert largest == ids.max()  # what the range check compares with the vocabulary
        outputs.append((rows, packed, out_ptr))
    for serial, parallel in zip(*outputs):
        np.testing.assert_array_equal(parallel, serial)
    assert (outputs[1][0][5:] == ids + 100).all() and (outputs[1][2][4:] == splits[1:] + 5).all()

    table = ec.TableConfig(1_000, 4, combiner=combiner, name="t", initializer=ec.RandomUniform(-1, 1))
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1))
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        acts, _ = emb({"f": ec.Ragged(ids, splits)}, {"f": ec.Ragged(weights, splits)} if weighted else None)
    finally:
        numba.set_num_threads(before)
    samples = [ids[splits[b]:splits[b + 1]].tolist() for b in range(n_out)]
    w = [(weights if weighted else np.ones(n))[splits[b]:splits[b + 1]].tolist() for b in range(n_out)]
    expected = ref.lookup(emb.embedding_tables["t"].astype(np.float64), samples, w, combiner, 0)
    np.testing.assert_allclose(acts["f"], expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 2_000), st.sampled_from(["pooled", "parallel", "sequence"]),
       st.data())
def test_layout_range_checks_every_id_in_its_one_pass(n_bad, vocabulary, kind, data):
    """``fill_occurrences`` reports an id outside ``[0, vocabulary)`` exactly when NumPy finds one: negative
    ids, ids at or above the vocabulary, int64 extremes, in any sample, in the serial and parallel layouts,
    and in a sequence feature at positions past its length (dropped, but still refused)."""
    import numba
    from embedcore.kernels import occurrences as occ
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    n_samples = 8_000 if kind == "parallel" else data.draw(st.integers(0, 40))
    lengths = rng.integers(0, 14 if kind == "parallel" else 6, n_samples)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, vocabulary, splits[-1]).astype(np.int64)
    bad_values = [-1, vocabulary, vocabulary + 7, np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    for _ in range(n_bad if ids.shape[0] else 0):
        ids[rng.integers(0, ids.shape[0])] = bad_values[rng.integers(0, len(bad_values))]
    expected = bool(((ids >= 0) & (ids < vocabulary)).all())
    n, n_out = ids.shape[0], n_samples * (3 if kind == "sequence" else 1)
    rows, packed, out_ptr = np.empty(n, np.int64), np.empty(n, np.int64), np.zeros(n_out + 1, np.int64)
    before, smallest = numba.get_num_threads(), occ.PARALLEL_MIN
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    occ.PARALLEL_MIN = 1 << 15  # this batch's ~52,000 ids take the parallel layout
    try:
        if kind == "parallel":
            assert n >= occ.PARALLEL_MIN
        count, in_range = occ.fill_occurrences(ids, splits, np.zeros(0, np.float32), np.zeros(0, np.int64), 0,
                                               3 if kind == "sequence" else 0, 10, 0, 0, rows, packed, out_ptr,
                                               vocabulary)
    finally:
        numba.set_num_threads(before)
        occ.PARALLEL_MIN = smallest
    assert in_range == expected
    if kind != "sequence":
        assert count == n


def test_out_of_range_id_refused_by_the_layout_names_it_and_leaves_no_trace():
    """The lookup range-checks ids while laying them out (after other checks); an out-of-range id still
    raises InputError naming the feature and the id as given, before any gather, and the leased workspaces
    go back to their pool (a training loop catching the error would otherwise lease new ones every step)."""
    from embedcore.kernels import occurrences as occ
    table = ec.TableConfig(50, 4, name="t", initializer=ec.RandomUniform(-1, 1))
    emb = ec.Embedding({"a": ec.FeatureConfig(table, name="first"),
                        "b": ec.FeatureConfig(table, name="big"),
                        "s": ec.FeatureConfig(table, name="seq", max_sequence_length=2)}, ec.SGD(0.1))
    pool = emb.physical_tables[0].batch_pool
    n_big = occ.PARALLEL_MIN + 100
    good = {"a": np.array([[1], [2]]), "b": ec.Ragged(np.arange(n_big) % 50, np.array([0, n_big // 2, n_big])),
            "s": ec.Ragged(np.array([1, 2, 3]), np.array([0, 3, 3]))}
    acts, ctx = emb(good)
    emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    del ctx
    idle = pool.idle
    table_before = emb.embedding_tables["t"].copy()
    cases = [("b", ec.Ragged(np.r_[np.arange(n_big - 1) % 50, 50], np.array([0, n_big // 2, n_big])), "'big'",
              r"\bid 50\b"),
             ("s", ec.Ragged(np.array([1, 2, -4]), np.array([0, 3, 3])), "'seq'", r"\bid -4\b"),  # position 2: dropped
             ("a", np.array([[1], [2 ** 64 - 1]], np.uint64), "'first'", r"\b18446744073709551615\b")]
    for key, bad, name, value in cases:
        features = dict(good, **{key: bad})
        with pytest.raises(ec.InputError, match=name) as info:
            emb(features)
        assert re.search(value, str(info.value)) and "[0, 50)" in str(info.value)
        assert pool.idle == idle
    assert np.array_equal(emb.embedding_tables["t"], table_before)
    acts, ctx = emb(good)  # the engine still works
    np.testing.assert_array_equal(acts["a"], table_before[[1, 2]])
