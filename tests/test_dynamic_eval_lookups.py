"""Read-only lookups (``emb(features, training=False)``) against the dict model of ``tests/test_dynamic_tables.py``:
training steps and read-only lookups interleaved, a read-only lookup must leave a dynamic table's whole state
unchanged (keys, rows, slots, last_seen, counts, row slots, free list, admission sketch, removal counter) and give
the activations the model gives (held keys their rows; absent, unadmitted and TTL-expired keys their initial
values); its context cannot be applied; static tables read as in training."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec

from . import reference as ref
from .test_dynamic_tables import EXTREME, LOW, HIGH, M, SEED, Model, Run, assert_same_state, model_activations, \
    ragged, uniform_initial


def whole_state(emb):
    """Everything a lookup could change, per dynamic table, as copies."""
    out = {"step": emb.step}
    for t in emb.dynamic_tables.values():
        s = t.state()
        out.update({f"{t.name}/{k}": np.copy(getattr(s, k)) for k in ("keys", "weights", "last_seen", "counts",
                                                                       "rows", "free")})
        out.update({f"{t.name}/slot/{k}": np.copy(v) for k, v in s.slots.items()})
        out[f"{t.name}/sketch"] = None if t.sketch is None else t.sketch.counters.copy()
        out[f"{t.name}/removals"] = t.removals
        out[f"{t.name}/map"] = (len(t.key_map), t.key_map.free_rows, t.key_map.high_water)
    for t in emb.physical_tables:
        if not t.dynamic:
            out.update({f"{t.table_names[0]}/static/{k}": np.array(w).copy()
                        for k, w in enumerate((t.weights,) + tuple(t.slots))})
    return out


def read_only_value(model, step):
    """The model's read: a held key not expired at ``step`` its row, any other its initial value."""
    def value(key):
        live = key in model.rows and not (isinstance(model.eviction, ec.TTL) and
                                          step - model.last_seen[key] > model.eviction.steps)
        return model.rows[key][0] if live else model.initial(key)
    return value


def check_read_only(emb, model, samples, table="t", feature="f", seq_len=0, weights=None):
    """A read-only lookup of ``samples``: state unchanged, activations as the model reads, context refused."""
    before = whole_state(emb)
    ids, w = ragged(samples, weights)
    acts, ctx = emb({feature: ids}, None if weights is None else {feature: w}, training=False)
    assert_same_state(before, whole_state(emb))
    cfg = emb.tables[table]
    ones = weights or [[1.0] * len(s) for s in samples]
    want = model_activations(read_only_value(model, emb.step), samples, ones, cfg.combiner, seq_len, cfg.dim)
    np.testing.assert_allclose(acts[feature], want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ec.InputError, match="training=False.*cannot be applied.*nothing was updated"):
        emb.apply_gradients({feature: np.ones_like(acts[feature])}, ctx)
    assert_same_state(before, whole_state(emb))


POLICIES = st.sampled_from([None, ec.LRU(), ec.LFU(), ec.TTL(steps=1), ec.TTL(steps=2)])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(1, 5), eviction=POLICIES, min_count=st.integers(1, 3), data=st.data())
def test_read_only_lookups_change_nothing_and_read_what_the_model_reads(capacity, eviction, min_count, data):
    admission = ec.CountAdmission(min_count=min_count) if min_count > 1 else None
    t = ec.DynamicTableConfig(2, capacity, name="t", initializer=ec.RandomUniform(LOW, HIGH), combiner="sqrtn",
                              admission=admission, eviction=eviction)
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adagrad(0.2, initial_accumulator_value=0.1), seed=SEED)
    model = Model(capacity, uniform_initial("t", 2), [0.1], min_count=min_count, eviction=eviction)
    run = Run(emb, {"t": model}, {"f": ("t", 0)}, {"t": (ref.adagrad, {}, 0.2)})
    keys = st.sampled_from(EXTREME[:6])
    batches = st.lists(st.lists(keys, max_size=3), min_size=1, max_size=4)  # empty samples, duplicates
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    for _ in range(data.draw(st.integers(1, 5))):
        run.step({"f": data.draw(batches)}, rng)
        check_read_only(emb, model, data.draw(batches))
    run.step({"f": data.draw(batches)}, rng)  # training goes on as if the reads never happened


def test_read_only_lookup_of_keys_absent_unadmitted_and_expired_reads_initial_values():
    t = ec.DynamicTableConfig(3, 4, name="t", initializer=ec.RandomUniform(LOW, HIGH), combiner="sum",
                              admission=ec.CountAdmission(min_count=2), eviction=ec.TTL(steps=1))
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(0.5), seed=SEED)
    model = Model(4, uniform_initial("t", 3), min_count=2, eviction=ec.TTL(steps=1))
    run = Run(emb, {"t": model}, {"f": ("t", 0)}, {"t": (ref.sgd, {}, 0.5)})
    rng = np.random.default_rng(0)
    assert run.step({"f": [[1, 1], [-7]]}, rng)      # step 0: 1 admitted (seen twice), -7 counted once
    assert run.step({"f": [[2, 2], [5, 5]]}, rng)    # step 1: 2 and 5 admitted
    assert run.step({"f": [[2]]}, rng)               # step 2: 1 removed (unseen for 2 > 1 steps)
    held = emb.dynamic_tables["t"].key_map.keys().view(np.int64).tolist()
    assert held == [2, 5] and emb.embedding_tables["t"].keys().tolist() == [2]  # at step 3, 5 is expired
    samples = [[1, 2], [-7, 99], [], [2, 5, 2]]
    check_read_only(emb, model, samples, weights=[[0.5, 2.0], [1.0, 1.0], [], [1.0, 0.25, 3.0]])
    acts, _ = emb({"f": ragged([[1], [-7], [99], [5], [2]], None)[0]}, training=False)
    initial = uniform_initial("t", 3)
    for row, key in zip(acts["f"], (1, -7, 99, 5)):
        np.testing.assert_allclose(row, initial(key & M), rtol=1e-6)
    np.testing.assert_allclose(acts["f"][4], model.rows[2][0], rtol=1e-6)
    assert not np.allclose(model.rows[5][0], initial(5))  # 5's row was trained: expired, it reads its initial value
    assert not np.allclose(model.rows[2][0], initial(2))  # 2 was trained: its row, not its initial value


def test_static_tables_read_alike_and_a_mixed_context_is_refused():
    static = ec.TableConfig(6, 2, initializer=ec.RandomUniform(LOW, HIGH), name="static", combiner="sum")
    dyn = ec.DynamicTableConfig(2, 3, name="dyn", initializer=ec.RandomUniform(LOW, HIGH), eviction=ec.LRU())
    emb = ec.Embedding({"s": ec.FeatureConfig(static), "d": ec.FeatureConfig(dyn)}, ec.SGD(0.5), seed=SEED)
    for step in range(3):
        acts, ctx = emb({"s": np.array([[step, 5]]), "d": np.array([[step, step + 10]], np.int64)})
        emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    before = whole_state(emb)
    features = {"s": np.array([[0, 1], [5, 5]]), "d": np.array([[0, 99], [12, 12]], np.int64)}
    read, ctx = emb(features, training=False)
    assert_same_state(before, whole_state(emb))
    table = np.asarray(emb.embedding_tables["static"])
    np.testing.assert_array_equal(read["s"], table[[0, 5]] + table[[1, 5]])
    with pytest.raises(ec.InputError, match="training=False"):
        emb.apply_gradients({k: np.ones_like(v) for k, v in read.items()}, ctx)
    trained, _ = emb(features)  # a training lookup of the same batch: static alike, dynamic keys admitted
    np.testing.assert_array_equal(trained["s"], read["s"])
    np.testing.assert_array_equal(trained["d"], read["d"])  # new keys' rows hold their initial values
    dynamic = emb.dynamic_tables["dyn"]
    assert len(emb.embedding_tables["dyn"]) == 3 and dynamic.removals > before["dyn/removals"]


@pytest.mark.parametrize("bad", [None, 0, "no", 1.0])
def test_training_must_be_a_bool(bad):
    t = ec.DynamicTableConfig(2, 3, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(0.1))
    with pytest.raises(TypeError, match="training must be True or False"):
        emb({"f": np.array([1], np.int64)}, training=bad)
    assert len(emb.embedding_tables["t"]) == 0


# -- ShardedEmbedding ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_read_only_lookups_change_nothing_and_equal_one_process(tmp_path, world):
    """K ranks trained on slices of the batches, then a read-only lookup (worker ``mpi_dynamic_read.py``: on
    every rank no table changed and the context is refused): the activations one process reads after the
    same training (no eviction there: the tables hold the same keys)."""
    pytest.importorskip("mpi4py", reason="needs the mpi extra: pip install 'embedcore[mpi]'")
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    import mpi_dynamic
    import mpi_dynamic_read
    from tests.test_distributed import mpirun
    out = str(tmp_path / "read")
    proc = mpirun(world, "mpi_dynamic_read.py", out, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
    t = mpi_dynamic_read.TRAINED
    emb, _ = mpi_dynamic.reference(world, stop=t)
    before = whole_state(emb)
    slices = mpi_dynamic.assignment(t, world)
    features, weights = mpi_dynamic.take(mpi_dynamic.global_batch(t), np.concatenate(slices))
    acts, _ = emb.lookup(features, weights, training=False)
    assert_same_state(before, whole_state(emb))
    tolerance = {"rtol": 0, "atol": 0} if world == 1 else {"rtol": 1e-5, "atol": 1e-6}
    at = 0
    for k, rows in enumerate(slices):
        got = np.load(f"{out}.rank{k}.npz")
        for name, whole in acts.items():
            np.testing.assert_allclose(got[name], whole[at:at + len(rows)], err_msg=f"rank {k} {name}", **tolerance)
        at += len(rows)
