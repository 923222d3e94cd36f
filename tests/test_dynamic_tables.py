"""Dynamic (hash-keyed) tables in the engine, against a plain Python model: a dict of rows per key with the same
admission and eviction rules (exact counts, sorted candidate lists), initial values written from the documented
formulas, and the NumPy optimizer oracle of ``tests/reference.py``."""

import collections
import fractions
import math
import os
import tempfile

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.app.quickstart import custom_adagrad
from embedcore.checkpoint import open_snapshot
from embedcore.initializers import fill_key_rows, stream_key

from . import reference as ref
from .test_optimizers import CASES

M = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
EXTREME = [0, -1, 1, 2 ** 63 - 1, -2 ** 63, 7, -7, 2 ** 62 + 7, 12345678901]


# -- the model ----------------------------------------------------------------------------------------------
def mix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M
    return z ^ (z >> 31)


def uniform_row(key, seed, table, dim, low, high):
    """RandomUniform's initial row of ``key`` as the docstrings define it: row 0 of the stream
    ``mix64(mix64(key) ^ stream_key(seed, table))``, ``U = (mix64(k ^ mix64(counter * G + G)) >> 11) / 2**53``
    with ``counter = column << 8``."""
    k = mix64(mix64(key & M) ^ stream_key(seed, table))
    values = []
    for c in range(dim):
        u = (mix64(k ^ mix64(((c << 8) * GOLDEN + GOLDEN) & M)) >> 11) / 2 ** 53
        values.append(low + (high - low) * u)
    return np.float32(values).astype(np.float64)


def as_signed(key):
    key &= M
    return key - (1 << 64) if key >= 1 << 63 else key


class Model:
    """One dynamic table as a dict: ``key (uint64 int) -> [row, slots]``, ``last_seen``, ``count``; admission
    counts exact. ``initial(key)`` gives the initial row; slots start at ``slot_values``. A static table is one
    that admits every key at once and never needs to evict (:func:`static_model`)."""

    def __init__(self, capacity, initial, slot_values=(), min_count=1, eviction=None, vocabulary=None):
        self.capacity, self.initial, self.slot_values = capacity, initial, list(slot_values)
        self.vocabulary = vocabulary  # a static table's: keys at or beyond it are refused
        self.min_count, self.eviction = min_count, eviction
        self.rows, self.last_seen, self.count = {}, {}, {}
        self.seen = collections.Counter()
        self.removals = 0  # keys evicted or expired so far (a context looked up before one is stale)
        self.filled = False  # whether a lookup ever left it full

    def remove(self, key):
        for d in (self.rows, self.last_seen, self.count):
            del d[key]
        self.removals += 1

    def score(self, key, step):
        e = self.eviction
        if isinstance(e, (ec.LRU, ec.TTL)):
            return self.last_seen[key]
        if isinstance(e, ec.LFU):
            return self.count[key]
        return float(e.fn(self.rows[key][0].astype(np.float32), self.last_seen[key], self.count[key], step))

    def to_evict(self, need):
        """How many rows an eviction for ``need`` rows frees: ``need``, or for ``EvictByScore(fn, reserve)`` the
        larger of ``need`` and ``ceil(reserve * capacity)`` (the reserve as the decimal it prints as)."""
        if not isinstance(self.eviction, ec.EvictByScore):
            return need
        return max(need, math.ceil(fractions.Fraction(repr(self.eviction.reserve)) * self.capacity))

    def expire(self, step):
        """TTL: remove the keys unseen for more than ``steps`` steps at ``step``."""
        if isinstance(self.eviction, ec.TTL):
            for key in [k for k in self.rows if step - self.last_seen[k] > self.eviction.steps]:
                self.remove(key)

    def state(self):
        """A copy of everything a lookup or an update changes, for :meth:`restore`."""
        rows = {k: [r.copy(), [s.copy() for s in slots]] for k, (r, slots) in self.rows.items()}
        return rows, dict(self.last_seen), dict(self.count), self.seen.copy(), self.removals

    def restore(self, state):
        rows, last_seen, count, seen, self.removals = state
        self.rows, self.last_seen, self.count, self.seen = rows, dict(last_seen), dict(count), seen.copy()

    def lookup(self, keys, step):
        """Apply a lookup of ``keys`` (uint64 ints, every occurrence in order) at ``step``; False (and nothing
        changed but TTL expiry) when the table must refuse it."""
        if self.vocabulary is not None and any(k >= self.vocabulary for k in keys):
            return False
        self.expire(step)
        in_batch = set(keys)
        absent = [k for k in keys if k not in self.rows]
        before = self.seen.copy()
        if self.min_count > 1:
            self.seen.update(absent)
        admitted = [k for k in dict.fromkeys(absent) if self.min_count <= 1 or self.seen[k] >= self.min_count]
        need = len(admitted) - (self.capacity - len(self.rows))
        if need > 0:
            candidates = [k for k in self.rows if k not in in_batch]
            if self.eviction is None or len(candidates) < need:
                self.seen = before
                return False
            for key in sorted(candidates, key=lambda k: (self.score(k, step), k))[:self.to_evict(need)]:
                self.remove(key)
        for key in admitted:
            self.rows[key] = [self.initial(key), [np.full_like(self.initial(key), v) for v in self.slot_values]]
            self.count[key] = 0
        self.filled = self.filled or len(self.rows) == self.capacity
        for key in keys:
            if key in self.rows:
                self.last_seen[key] = step
                self.count[key] += 1
        return True

    def value(self, key):
        return self.rows[key][0] if key in self.rows else self.initial(key)

    def held(self, step=None):
        if step is not None and isinstance(self.eviction, ec.TTL):
            return sorted(as_signed(k) for k in self.rows if step - self.last_seen[k] <= self.eviction.steps)
        return sorted(as_signed(k) for k in self.rows)


# -- stepping the engine beside the model --------------------------------------------------------------------
def occurrences(samples, seq_len):
    return [k & M for s in samples for k in (s[:seq_len] if seq_len else s)]


def model_activations(value, samples, weights, combiner, seq_len, dim):
    if seq_len:
        out = np.zeros((len(samples), seq_len, dim))
        for b, ids in enumerate(samples):
            for p, key in enumerate(ids[:seq_len]):
                out[b, p] += weights[b][p] * value(key & M)
        return out
    out = np.zeros((len(samples), dim))
    for b, ids in enumerate(samples):
        for g, key in zip(ref.combine_gains(weights[b], combiner), ids):
            out[b] += g * value(key & M)
    return out


def model_gradients(samples, weights, combiner, seq_len, d_act, into):
    for b, ids in enumerate(samples):
        if seq_len:
            for p, key in enumerate(ids[:seq_len]):
                into[key & M] = into.get(key & M, 0) + weights[b][p] * d_act[b, p].astype(np.float64)
        else:
            for g, key in zip(ref.combine_gains(weights[b], combiner), ids):
                into[key & M] = into.get(key & M, 0) + g * d_act[b].astype(np.float64)


def ragged(samples, weights):
    values = np.array([as_signed(k) for s in samples for k in s], np.int64)
    splits = np.cumsum([0] + [len(s) for s in samples]).astype(np.int64)
    w = None if weights is None else ec.Ragged(np.array([v for s in weights for v in s], np.float32), splits)
    return ec.Ragged(values, splits), w


def static_model(emb, table):
    """A static table as a :class:`Model`: every key in range is admitted at once and never evicted, its
    initial row is the engine's row at construction (the static oracle's start)."""
    start = np.asarray(emb.embedding_tables[table], np.float64).copy()
    slot_values = [float(v) for v in emb.optimizer.slot_initializers] if emb.optimizer is not None else []
    return Model(start.shape[0], lambda key: start[key].copy(), slot_values, vocabulary=start.shape[0])


def lookup_models(models, keys_by_table, step):
    """Look ``keys_by_table`` (table -> uint64 occurrences) up in every model at ``step``, all or nothing:
    the tables that refuse (sorted), every model restored (TTL expiry aside) when any does."""
    saved = {table: model.state() for table, model in models.items()}
    refused = sorted(table for table, model in models.items() if not model.lookup(keys_by_table.get(table, []), step))
    if refused:
        for table, model in models.items():
            model.restore(saved[table])
            model.expire(step)
    return refused


def engine_state(emb):
    """Everything of ``emb`` a call may change, as bytes: step; per table its rows and slots (a dynamic table:
    the keys held, their rows, slots, ``last_seen`` and counts, and its admission counters)."""
    state = {"step": emb.step}
    slots = emb.slot_variables
    for name, view in emb.embedding_tables.items():
        if isinstance(view, np.ndarray):
            state[name] = (view.tobytes(), [s.tobytes() for s in slots[name].values()])
            continue
        table = view._table
        keys, rows = table.key_map.items()
        keep = table.held_rows(rows)
        order = np.argsort(keys[keep], kind="stable")
        keys, rows = keys[keep][order], rows[keep][order]
        sketch = None if table.sketch is None else table.sketch.counters.tobytes()
        state[name] = (keys.tobytes(), view[keys].tobytes(), [s[keys].tobytes() for s in slots[name].values()],
                       table.key_map.last_seen[rows].tobytes(), table.key_map.counts[rows].tobytes(), sketch)
    return state


def assert_same_state(a, b):
    """Two state dicts (names -> arrays or plain values) are equal, entry by entry (arrays exactly)."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


def default_render(feature, samples, weights):
    return ragged(samples, weights)


class Run:
    """An engine and one :class:`Model` per table (dynamic ones; static ones from :func:`static_model`), stepped
    on the same batches (features: name -> (table, seq_len)); ``update``: table -> (oracle update, params,
    lr); ``render(feature, samples, weights or None) -> (ids, weights)``: the engine's input form (ragged)."""

    def __init__(self, emb, models, features, update=None, render=default_render):
        self.emb, self.models, self.features, self.update = emb, models, features, update or {}
        self.render = render

    def step(self, batch, rng, weighted=True, apply=True, atol=2e-5, rtol=2e-5):
        """``batch``: feature -> samples (lists of keys). Returns False when the model refuses the lookup (and
        checks the engine refused it too, naming a table that refuses, with nothing changed); else True, or
        ``(activations, context)`` of the lookup when ``apply`` is False (nothing applied)."""
        emb, step = self.emb, self.emb.step
        weights = {f: [[float(x) for x in rng.uniform(0.2, 2.0, len(s))] for s in samples] if weighted
                   else [[1.0] * len(s) for s in samples] for f, samples in batch.items()}
        keys_by_table = collections.defaultdict(list)
        for f in sorted(batch):  # the engine lays features out in sorted path order
            table, seq_len = self.features[f]
            keys_by_table[table] += occurrences(batch[f], seq_len)
        refused = lookup_models(self.models, keys_by_table, step)
        inputs = {f: self.render(f, batch[f], weights[f] if weighted else None) for f in batch}
        ids = {f: v[0] for f, v in inputs.items()}
        w = {f: v[1] for f, v in inputs.items()} if weighted else None
        if refused:  # a dynamic table's refusal names it; a static one's names the feature of the bad id
            names = [f"table '{t}'" for t in refused if self.models[t].vocabulary is None] + [
                f"feature '{f}'" for f, (t, _) in self.features.items() if t in refused and self.models[t].vocabulary]
            before = engine_state(emb)
            with pytest.raises(ec.InputError, match="|".join(names)):
                emb(ids, w)
            assert engine_state(emb) == before, f"a refused lookup at step {step} changed the engine"
            return False
        acts, ctx = emb(ids, w)
        grads, dense = {}, collections.defaultdict(dict)
        for f, samples in batch.items():
            table, seq_len = self.features[f]
            cfg = emb.tables[table]
            expected = model_activations(self.models[table].value, samples, weights[f], cfg.combiner, seq_len,
                                         cfg.dim)
            np.testing.assert_allclose(acts[f], expected, rtol=rtol, atol=atol, err_msg=f"lookup {f} at step {step}")
            grads[f] = rng.normal(0, 1, acts[f].shape).astype(np.float32)
            model_gradients(samples, weights[f], cfg.combiner, seq_len, grads[f], dense[table])
        if not apply:
            return acts, ctx
        emb.apply_gradients(grads, ctx)
        for table, (update, params, lr) in self.update.items():
            model = self.models[table]
            touched = [k for k in dense[table] if k in model.rows]
            if touched:  # the model keeps every slot as a full row; a slot of one value a row repeats it
                slot_dims = emb.optimizer.slot_dims
                g = np.stack([dense[table][k] for k in touched])
                w0 = np.stack([model.rows[k][0] for k in touched])
                s0 = [np.stack([model.rows[k][1][i] for k in touched]) for i in range(len(slot_dims))]
                s0 = [s if d == 2 else s[:, 0] for s, d in zip(s0, slot_dims)]
                w1, s1 = update(g, w0, s0, lr, params, emb.step)
                for i, k in enumerate(touched):
                    model.rows[k] = [w1[i], [s[i] if s.ndim == 2 else np.full(w1.shape[1], s[i]) for s in s1]]
            self.check(table, atol, rtol)
        return True

    def check(self, table, atol=2e-5, rtol=2e-5):
        model, view = self.models[table], self.emb.embedding_tables[table]
        slots = self.emb.slot_variables[table]
        if isinstance(view, np.ndarray):  # a static table: every row
            keys = range(view.shape[0])
            np.testing.assert_allclose(view, np.stack([model.value(k) for k in keys]), rtol=rtol, atol=atol,
                                       err_msg=f"rows of {table} at step {self.emb.step}")
            for i, (name, slot) in enumerate(slots.items()):
                expected = np.stack([model.rows[k][1][i] if k in model.rows else
                                     np.full(view.shape[1], model.slot_values[i]) for k in keys])
                np.testing.assert_allclose(slot, expected if slot.ndim == 2 else expected[:, 0], rtol=rtol,
                                           atol=atol, err_msg=f"slot {name} of {table} at step {self.emb.step}")
            return
        held = model.held(self.emb.step)
        assert len(view) == len(held) <= view.capacity, f"size of {table} at step {self.emb.step}"
        assert view.keys().tolist() == held, f"keys of {table} at step {self.emb.step}"
        if not held:
            return
        keys = np.array(held, np.int64)
        np.testing.assert_allclose(view[keys], np.stack([model.rows[k & M][0] for k in held]), rtol=rtol, atol=atol,
                                   err_msg=f"rows of {table} at step {self.emb.step}")
        for i, (name, slot) in enumerate(slots.items()):
            expected = np.stack([model.rows[k & M][1][i] for k in held])
            got = slot[keys]
            np.testing.assert_allclose(got, expected if got.ndim == 2 else expected[:, 0], rtol=rtol, atol=atol,
                                       err_msg=f"slot {name} of {table} at step {self.emb.step}")


def random_batch(rng, pool, batch_size=6, max_len=4):
    samples = []
    for _ in range(batch_size):
        n = int(rng.integers(0, max_len + 1))
        samples.append([int(k) for k in rng.choice(pool, n)])
    return samples


SEED, DIM = 5, 3
LOW, HIGH = -0.5, 0.5


def uniform_initial(table, dim=DIM, seed=SEED):
    return lambda key: uniform_row(key, seed, table, dim, LOW, HIGH)


# -- configuration ------------------------------------------------------------------------------------------
def test_config_validates_prints_and_is_exported():
    t = ec.DynamicTableConfig(16, 1000, name="user", optimizer=ec.Adagrad(0.05), combiner="sum",
                              admission=ec.CountAdmission(min_count=3), eviction=ec.LRU())
    assert isinstance(t, ec.TableConfig) and t.capacity == t.vocabulary_size == 1000 and t.dim == 16
    assert repr(t).startswith("DynamicTableConfig(dim=16, capacity=1000, name='user'")
    assert "admission=CountAdmission(min_count=3" in repr(t) and "eviction=LRU()" in repr(t)
    ec.FeatureConfig(t)
    for bad in (0, -1, 1.5, True, 2 ** 31, "9"):
        with pytest.raises(ValueError, match="DynamicTableConfig 'x': Argument `capacity`"):
            ec.DynamicTableConfig(4, bad, name="x")
    with pytest.raises(ValueError, match="DynamicTableConfig 'x': Argument `dim`"):
        ec.DynamicTableConfig(0, 10, name="x")
    with pytest.raises(ValueError, match="DynamicTableConfig 'x': Argument `combiner`"):
        ec.DynamicTableConfig(4, 10, name="x", combiner="max")
    with pytest.raises(ValueError, match="functions of the key"):
        ec.DynamicTableConfig(4, 10, name="x", initializer=lambda shape, dtype: np.zeros(shape, dtype))
    with pytest.raises(ValueError, match="`admission`"):
        ec.DynamicTableConfig(4, 10, admission=3)
    with pytest.raises(ValueError, match="`eviction`"):
        ec.DynamicTableConfig(4, 10, eviction="lru")
    with pytest.raises(ValueError, match="scores float32 rows"):
        ec.DynamicTableConfig(4, 10, eviction=ec.EvictByScore(lambda e, s, c, t: 0.0), weights_dtype="bfloat16")
    with pytest.raises(ValueError, match="not lazy"):
        ec.DynamicTableConfig(4, 10, optimizer=ec.Adam(0.1, lazy_adam=False))
    with pytest.raises(ValueError, match="weights_dtype"):
        ec.DynamicTableConfig(4, 10, weights_dtype="int8")


def test_engine_refuses_configurations_and_dense_views_of_dynamic_tables():
    t = ec.DynamicTableConfig(2, 10, name="d")
    with pytest.raises(ValueError, match="table 'd' is dynamic: its optimizer Adam is not lazy"):
        ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adam(0.1, lazy_adam=False))
    custom = ec.CustomOptimizer(custom_adagrad, 0.1, slot_names=["a"],
                                slot_initializers=[lambda shape, dtype: np.ones(shape, dtype)])
    with pytest.raises(ValueError, match="slot 'a' must be a float or an embedcore initializer"):
        ec.Embedding({"f": ec.FeatureConfig(t)}, custom)
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(0.1))
    with pytest.raises(ValueError, match="table 'd' is dynamic: set_state"):
        emb.set_state({"d": np.zeros((10, 2), np.float32)})
    with pytest.raises(TypeError, match="no dense array"):
        np.asarray(emb.embedding_tables["d"])


# -- initial values -----------------------------------------------------------------------------------------
KEYS = np.array(EXTREME + [3, 4, 5], np.int64)


@pytest.mark.parametrize("init", [ec.RandomUniform(-0.5, 0.5), ec.TruncatedNormal(0.1, 0.3),
                                  ec.RandomUniform(-1, 2, seed=9), ec.Constant(0.25)], ids=repr)
def test_key_rows_are_row_zero_of_each_keys_stream(init):
    """The one-pass kernels give what the generic per-key path (``Initializer.fill_keys``'s default) gives, which
    is the static fill of row 0 under the key's stream."""
    dim = 5
    fast = np.empty((KEYS.shape[0], dim), np.float32)
    fill_key_rows(init, fast, KEYS, 3, "t")
    slow = np.empty_like(fast)
    ec.Initializer.fill_keys(init, slow, KEYS.view(np.uint64), stream_key(getattr(init, "seed", None) or 3, "t"))
    np.testing.assert_array_equal(fast, slow)
    one = np.empty((1, dim), np.float32)
    for i, key in enumerate(KEYS):
        own = getattr(init, "seed", None)
        k = mix64(mix64(int(key) & M) ^ stream_key(3 if own is None else own, "t"))
        init.fill(one, 0, k)
        np.testing.assert_array_equal(fast[i], one[0])
    # ... and the order or company of keys changes nothing
    perm = np.random.default_rng(0).permutation(KEYS.shape[0])
    shuffled = np.empty_like(fast)
    fill_key_rows(init, shuffled, KEYS[perm], 3, "t")
    np.testing.assert_array_equal(shuffled, fast[perm])


def test_uniform_key_rows_match_the_documented_formula_and_row_id_gives_the_key():
    out = np.empty((KEYS.shape[0], 4), np.float32)
    fill_key_rows(ec.RandomUniform(LOW, HIGH), out, KEYS.view(np.uint64), SEED, "t")
    np.testing.assert_array_equal(out, np.stack([uniform_row(int(k), SEED, "t", 4, LOW, HIGH) for k in KEYS]))
    fill_key_rows(ec.RowId(0.5), out, KEYS, SEED, "t")
    np.testing.assert_array_equal(out, np.repeat(np.float32(KEYS.astype(np.float64) + 0.5)[:, None], 4, axis=1))
    other = np.empty_like(out)
    fill_key_rows(ec.RandomUniform(LOW, HIGH), other, KEYS, SEED, "u")  # another table: another stream
    assert not np.any(other == out)


# -- lookups and updates against the model -----------------------------------------------------------------
OPTIMIZERS = {name: case for name, case in CASES.items() if case[4]}  # lazy ones (non-lazy: refused above)
OPTIMIZERS["custom-adagrad"] = (ec.CustomOptimizer(custom_adagrad, 0.2, slot_names=["acc"], slot_initializers=[0.3]),
                                ref.adagrad, {}, 0.2, True)


def _slot_values(optimizer):
    return [float(v) for v in optimizer.slot_initializers]


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_every_optimizer_trains_keys_as_the_model_does(case):
    optimizer, update, params, lr, _ = OPTIMIZERS[case]
    user = ec.DynamicTableConfig(DIM, 8, name="user", initializer=ec.RandomUniform(LOW, HIGH), combiner="sum",
                                 eviction=ec.LRU())
    features = {"a": ec.FeatureConfig(user), "b": ec.FeatureConfig(user, max_sequence_length=3)}
    emb = ec.Embedding(features, optimizer, seed=SEED)
    model = Model(8, uniform_initial("user"), _slot_values(optimizer), eviction=ec.LRU())
    run = Run(emb, {"user": model}, {"a": ("user", 0), "b": ("user", 3)}, {"user": (update, params, lr)})
    rng = np.random.default_rng(1)
    pool = np.array(EXTREME, dtype=object)
    done = 0
    for _ in range(6):
        done += run.step({"a": random_batch(rng, pool, 3, 2), "b": random_batch(rng, pool, 2, 4)}, rng)
    assert done >= 3 and emb.step == done


def test_mean_combiner_duplicates_empty_samples_and_unadmitted_keys():
    t = ec.DynamicTableConfig(DIM, 50, name="t", initializer=ec.RandomUniform(LOW, HIGH), combiner="mean",
                              admission=ec.CountAdmission(min_count=2))
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adagrad(0.3, initial_accumulator_value=0.1), seed=SEED)
    model = Model(50, uniform_initial("t"), [0.1], min_count=2)
    run = Run(emb, {"t": model}, {"f": ("t", 0)}, {"t": (ref.adagrad, {}, 0.3)})
    rng = np.random.default_rng(2)
    batches = [[[1, 1, 2], [], [3, -1, -1]], [[1], [2, 2], []], [[], [], []], [[5, 1, 5, 5]], [[3], [-1]]]
    for samples in batches:
        assert run.step({"f": samples}, rng)
    assert emb.embedding_tables["t"].keys().tolist() == [-1, 1, 2, 3, 5]


def test_static_and_dynamic_tables_in_one_engine():
    static = ec.TableConfig(8, DIM, initializer=ec.RandomUniform(LOW, HIGH), name="static", combiner="sum")
    dyn = ec.DynamicTableConfig(DIM, 6, name="dyn", initializer=ec.RandomUniform(LOW, HIGH), combiner="sum",
                                eviction=ec.LFU())
    emb = ec.Embedding({"s": ec.FeatureConfig(static), "d": ec.FeatureConfig(dyn)}, ec.SGD(0.5), seed=SEED)
    assert emb.num_physical_tables == 2  # a dynamic table never stacks, even with an equal static one
    model = Model(6, uniform_initial("dyn"), eviction=ec.LFU())  # batches of <= 6 keys: never refused
    run = Run(emb, {"dyn": model}, {"d": ("dyn", 0)}, {"dyn": (ref.sgd, {}, 0.5)})
    rng = np.random.default_rng(3)
    table = emb.embedding_tables["static"].astype(np.float64)
    for _ in range(5):
        s_samples = random_batch(rng, np.arange(8), 3, 3)
        d_samples = random_batch(rng, np.array(EXTREME, dtype=object), 3, 2)
        ones, d_ones = [[1.0] * len(s) for s in s_samples], [[1.0] * len(s) for s in d_samples]
        acts, ctx = emb({"s": s_samples, "d": ragged(d_samples, None)[0]})
        if not model.lookup(occurrences(d_samples, 0), emb.step):
            raise AssertionError("the model refused a batch the engine took")
        np.testing.assert_allclose(acts["s"], ref.lookup(table, s_samples, ones, "sum", 0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(acts["d"], model_activations(model.value, d_samples, d_ones, "sum", 0, DIM),
                                   rtol=1e-6, atol=1e-6)
        grads = {"s": rng.normal(size=acts["s"].shape).astype(np.float32),
                 "d": rng.normal(size=acts["d"].shape).astype(np.float32)}
        emb.apply_gradients(grads, ctx)
        gradient = ref.dense_gradient(8, DIM, s_samples, ones, "sum", 0, grads["s"].astype(np.float64))
        table, _ = ref.apply(ref.sgd, gradient, table, [], ref.touched_rows(8, s_samples, 0), 0.5, {}, emb.step)
        np.testing.assert_allclose(emb.embedding_tables["static"], table, rtol=2e-5, atol=1e-5)
        dense = {}
        model_gradients(d_samples, d_ones, "sum", 0, grads["d"], dense)
        for k, g in dense.items():
            if k in model.rows:
                model.rows[k][0] = model.rows[k][0] - 0.5 * g
        run.check("dyn")


# -- keys ---------------------------------------------------------------------------------------------------
def test_extreme_keys_in_every_form_and_both_signednesses():
    t = ec.DynamicTableConfig(2, 20, name="t", initializer=ec.RowId(0.0), combiner="sum")
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(0.1))
    signed = np.array([0, -1, 2 ** 63 - 1, -2 ** 63], np.int64)
    acts, _ = emb({"f": signed})
    np.testing.assert_array_equal(acts["f"][:, 0], signed.astype(np.float64).astype(np.float32))
    unsigned = signed.view(np.uint64)  # the same bits: the same keys, the same rows
    acts2, _ = emb({"f": unsigned})
    np.testing.assert_array_equal(acts2["f"], acts["f"])
    assert len(emb.embedding_tables["t"]) == 4
    view = emb.embedding_tables["t"]
    assert 2 ** 64 - 1 in view and -1 in view and np.uint64(2 ** 63) in view and 5 not in view
    np.testing.assert_array_equal(view[[2 ** 64 - 1]], view[[-1]])
    emb({"f": [[2 ** 64 - 1, 2 ** 63], []]})  # Python ints: uint64 in a list of samples
    emb({"f": ec.Sparse(np.array([[0, 0], [1, 2]]), signed[:2], (2, 3))})
    emb({"f": ec.hash_keys(["alice", "bob"])})
    assert len(emb.embedding_tables["t"]) == 6
    assert int(ec.hash_keys("alice")) in emb.embedding_tables["t"]


def test_views_read_rows_slots_and_initial_values_of_unknown_keys():
    t = ec.DynamicTableConfig(DIM, 10, name="t", initializer=ec.RandomUniform(LOW, HIGH))
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adagrad(0.1, initial_accumulator_value=0.2), seed=SEED)
    view, slot = emb.embedding_tables["t"], emb.slot_variables["t"]["accumulators"]
    assert len(view) == 0 and view.keys().tolist() == [] and 3 not in view
    unknown = view[np.array([[3, -3]])]
    assert unknown.shape == (1, 2, DIM) and unknown.dtype == np.float32
    np.testing.assert_array_equal(unknown[0], np.stack([uniform_row(k, SEED, "t", DIM, LOW, HIGH) for k in (3, -3)]))
    np.testing.assert_array_equal(slot[[3]], np.full((1, DIM), 0.2, np.float32))
    acts, ctx = emb({"f": np.array([3])})
    np.testing.assert_array_equal(acts["f"][0], unknown[0, 0])  # the lookup's value is the view's
    emb.apply_gradients({"f": np.ones((1, DIM), np.float32)}, ctx)
    assert view.keys().tolist() == [3] and list(view) == [3] and len(view) == 1
    assert np.all(view[3] < unknown[0, 0]) and view[3].shape == (DIM,)
    np.testing.assert_allclose(slot[[3]], 1.2)
    with pytest.raises(ValueError, match="table 't': keys must be integers"):
        view[[1.5]]
    assert "DynamicTableView(table 't': 1 keys of 10" in repr(view)


# -- admission and eviction --------------------------------------------------------------------------------
def _single_key_engine(capacity, **kwargs):
    t = ec.DynamicTableConfig(1, capacity, name="t", initializer=ec.RowId(0.0), combiner="sum", **kwargs)
    return ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(1.0))


def _step(emb, keys):
    acts, ctx = emb({"f": np.array(keys, np.int64)})
    emb.apply_gradients({"f": np.ones(acts["f"].shape, np.float32)}, ctx)
    return acts["f"][:, 0]


def test_admission_counts_occurrences_and_unadmitted_keys_get_no_update():
    emb = _single_key_engine(10, admission=ec.CountAdmission(min_count=3))
    view = emb.embedding_tables["t"]
    np.testing.assert_array_equal(_step(emb, [7, 8]), [7, 8])   # counted once each: no rows
    assert len(view) == 0
    np.testing.assert_array_equal(_step(emb, [7, 9]), [7, 9])   # 7 twice: still not admitted, not updated
    assert 7 not in view
    np.testing.assert_array_equal(_step(emb, [7, 7]), [7, 7])   # 7 seen 4 times: admitted, starts fresh
    assert view.keys().tolist() == [7]
    np.testing.assert_array_equal(view[7], [7 - 2])              # both occurrences' gradient applied
    np.testing.assert_array_equal(_step(emb, [8, 8, 8]), [8, 8, 8])  # 8: 1 + 3 occurrences
    np.testing.assert_array_equal(view[[7, 8]][:, 0], [5, 5])


def test_lru_evicts_the_least_recently_seen_never_the_batch():
    emb = _single_key_engine(3, eviction=ec.LRU())
    for keys in ([1], [2], [3], [1]):
        _step(emb, keys)
    view = emb.embedding_tables["t"]
    _step(emb, [4])              # 2 is the least recently seen
    assert view.keys().tolist() == [1, 3, 4]
    _step(emb, [3, 5, 6])        # needs two: 1 and 4 go (3 is in the batch, though seen before 4)
    assert view.keys().tolist() == [3, 5, 6]
    np.testing.assert_array_equal(view[[5]], [[4]])  # 5 started from its initial value
    np.testing.assert_array_equal(_step(emb, [2]), [2])  # an evicted key comes back fresh (its row was 1)
    assert view.keys().tolist() == [2, 5, 6]  # 3, 5, 6 tied (seen at step 5): the smallest key went


def test_lfu_evicts_the_least_often_seen_ties_by_key():
    emb = _single_key_engine(3, eviction=ec.LFU())
    _step(emb, [1, 1, 1, 2, 3, 3])
    _step(emb, [4])              # 2 was seen once
    assert emb.embedding_tables["t"].keys().tolist() == [1, 3, 4]
    _step(emb, [5, -9])          # 4 (once) and 3 (twice) go
    assert emb.embedding_tables["t"].keys().tolist() == [-9, 1, 5]
    _step(emb, [6])              # -9 and 5 seen once each: the smaller uint64, 5, goes
    assert emb.embedding_tables["t"].keys().tolist() == [-9, 1, 6]


def test_ttl_expires_rows_unseen_for_more_than_steps_everywhere():
    emb = _single_key_engine(10, eviction=ec.TTL(steps=2))
    view = emb.embedding_tables["t"]
    _step(emb, [1, 2])           # looked up at step 0
    _step(emb, [2])              # step 1
    assert view.keys().tolist() == [1, 2] and 1 in view  # at step 2, 1 is unseen for 2 steps: held
    _step(emb, [3])              # step 2
    assert view.keys().tolist() == [2, 3] and 1 not in view and len(view) == 2  # at step 3: 1 expired
    np.testing.assert_array_equal(view[[1]], [[1]])  # an expired key reads its initial value (its row was 0)
    _step(emb, [3])              # step 3: the lookup removes 1
    assert view.keys().tolist() == [3] and emb.step == 4  # at step 4, 2 (seen at 1) expired too
    np.testing.assert_array_equal(_step(emb, [2]), [2])  # and comes back fresh (its row was 0)
    assert view.keys().tolist() == [2, 3]


def test_evict_by_score_uses_the_rows_values():
    emb = _single_key_engine(2, eviction=ec.EvictByScore(lambda row, last_seen, count, step: -abs(row[0])))
    _step(emb, [10, 20])
    _step(emb, [30])             # rows 9 and 19 score -9 and -19: the lowest, 20's, goes
    assert emb.embedding_tables["t"].keys().tolist() == [10, 30]


def test_evict_by_score_frees_its_reserve_at_once():
    def by_last_seen(row, last_seen, count, step):
        return float(last_seen)

    for reserve, held in ((0.3, [[4, 5, 6, 7, 8, 9, 10, 11], list(range(4, 14)), [4] + list(range(8, 15))]),
                          (0, [list(range(2, 12)), list(range(4, 14)), [4] + list(range(6, 15))])):
        emb = _single_key_engine(10, eviction=ec.EvictByScore(by_last_seen, reserve=reserve))
        view = emb.embedding_tables["t"]
        _step(emb, list(range(1, 11)))  # full, every row last seen at step 0
        _step(emb, [11])                # 0.3 x 10: the 3 lowest (ties: smaller keys) go, 2 rows stay free
        assert sorted(view.keys().tolist()) == held[0]
        _step(emb, [12, 13])            # into the free rows (reserve 0: 2 more evictions)
        assert sorted(view.keys().tolist()) == held[1]
        _step(emb, [14, 4])             # 4 is in the batch: never evicted
        assert sorted(view.keys().tolist()) == held[2]


def test_a_batch_with_more_new_keys_than_the_table_can_take_changes_nothing():
    emb = _single_key_engine(3, eviction=ec.LRU(), admission=ec.CountAdmission(min_count=2))
    _step(emb, [1, 1, 2, 2])
    view = emb.embedding_tables["t"]
    table = view._table
    counters = table.sketch.counters.copy()
    keys, rows = view.keys(), view[view.keys()]
    with pytest.raises(ec.InputError, match="table 't'.*nothing was changed"):
        emb({"f": np.array([1, 5, 5, 6, 6, 7, 7])})  # 3 admitted new keys, 2 rows to take: 1 is in the batch
    np.testing.assert_array_equal(table.sketch.counters, counters)
    assert view.keys().tolist() == keys.tolist() and np.array_equal(view[keys], rows) and emb.step == 1
    full = _single_key_engine(2)
    _step(full, [1, 2])
    with pytest.raises(ec.InputError, match="table 't': the batch brings 1 new keys but only 0 rows are free"):
        full({"f": np.array([3])})
    static = ec.TableConfig(4, 1, name="s")
    both = ec.Embedding({"f": ec.FeatureConfig(ec.DynamicTableConfig(1, 5, name="d")), "g": ec.FeatureConfig(static)},
                        ec.SGD(0.1))
    with pytest.raises(ec.InputError, match="outside the table's vocabulary"):
        both({"f": np.array([1]), "g": np.array([9])})  # another table refuses the batch: no key is added
    assert len(both.embedding_tables["d"]) == 0
    a = ec.DynamicTableConfig(1, 5, name="a", admission=ec.CountAdmission(min_count=2))
    b = ec.DynamicTableConfig(1, 1, name="b")
    two = ec.Embedding({"a": ec.FeatureConfig(a), "b": ec.FeatureConfig(b)}, ec.SGD(0.1))
    counters = two.embedding_tables["a"]._table.sketch.counters.copy()
    with pytest.raises(ec.InputError, match="table 'b'"):  # b refuses: a's keys and counts are as they were
        two({"a": np.array([4, 4, 5]), "b": np.array([1, 2])})
    assert len(two.embedding_tables["a"]) == 0
    np.testing.assert_array_equal(two.embedding_tables["a"]._table.sketch.counters, counters)
    two({"a": np.array([4, 4, 5]), "b": np.array([1, 1])})
    assert two.embedding_tables["a"].keys().tolist() == [4] and two.embedding_tables["b"].keys().tolist() == [1]


def test_a_context_is_refused_once_a_later_lookup_evicted_rows():
    emb = _single_key_engine(2, eviction=ec.LRU())
    _, first = emb({"f": np.array([1, 2])})
    _, second = emb({"f": np.array([3])})   # evicts 1
    with pytest.raises(ec.InputError, match="a later lookup evicted or expired rows"):
        emb.apply_gradients({"f": np.ones((2, 1), np.float32)}, first)
    emb.apply_gradients({"f": np.ones((1, 1), np.float32)}, second)
    np.testing.assert_array_equal(emb.embedding_tables["t"][[2, 3]][:, 0], [2, 2])


def test_16_bit_rows_and_slots_start_rounded_and_train():
    t = ec.DynamicTableConfig(4, 8, name="t", initializer=ec.RandomUniform(LOW, HIGH), weights_dtype="bfloat16",
                              slot_dtype="float16", combiner="sum")
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adagrad(0.1, initial_accumulator_value=0.5), seed=SEED)
    view, slot = emb.embedding_tables["t"], emb.slot_variables["t"]["accumulators"]
    start = view[[11, -11]]
    assert start.dtype == view.dtype and view.dtype.itemsize == 2 and slot[[11]].dtype == np.float16
    expected = np.stack([uniform_row(k, SEED, "t", 4, LOW, HIGH) for k in (11, -11)]).astype(np.float32)
    np.testing.assert_array_equal(start.astype(np.float32), expected.astype(view.dtype).astype(np.float32))
    acts, ctx = emb({"f": np.array([11, -11])})
    np.testing.assert_array_equal(acts["f"], start.astype(np.float32))
    emb.apply_gradients({"f": np.ones((2, 4), np.float32)}, ctx)
    assert np.all(view[[11, -11]].astype(np.float32) < start.astype(np.float32))
    np.testing.assert_array_equal(slot[[11]].astype(np.float32), 1.5)


def test_non_finite_rows_are_reported_by_key():
    t = ec.DynamicTableConfig(2, 5, name="t", initializer=ec.RowId(0.0), combiner="sum")
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(1.0), non_finite="skip")
    acts, ctx = emb({"f": np.array([2 ** 40, -5])})
    report = emb.apply_gradients({"f": np.array([[np.nan, 0], [1, 1]], np.float32)}, ctx)
    assert report.skipped["t"]["gradient"].tolist() == [2 ** 40]


# -- determinism and random sequences ----------------------------------------------------------------------
def _train(threads):
    numba.set_num_threads(threads)
    try:
        t = ec.DynamicTableConfig(4, 40, name="t", eviction=ec.LRU(), admission=ec.CountAdmission(min_count=2))
        emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adam(0.05), seed=1)
        rng = np.random.default_rng(9)
        for _ in range(8):
            keys = rng.integers(-2 ** 63, 2 ** 63 - 1, 30, dtype=np.int64, endpoint=True) % 97 * 104729
            acts, ctx = emb({"f": keys.reshape(10, 3)})
            emb.apply_gradients({"f": rng.normal(size=acts["f"].shape).astype(np.float32)}, ctx)
        view = emb.embedding_tables["t"]
        keys = view.keys()
        return keys, view[keys], emb.slot_variables["t"]["momenta"][keys]
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_bit_identical_across_thread_counts_and_reruns():
    one, many, again = _train(1), _train(numba.config.NUMBA_NUM_THREADS), _train(numba.config.NUMBA_NUM_THREADS)
    for a, b, c in zip(one, many, again):
        assert a.tobytes() == b.tobytes() == c.tobytes()


POLICIES = st.sampled_from([None, ec.LRU(), ec.LFU(), ec.TTL(steps=1), ec.TTL(steps=3)])


def _stacking_engine(stack, configs, dtype):
    """Four dynamic tables (three of one storage, which stack; one bfloat16, rounded stochastically) read by
    interleaved features (a, b, a again, a sequence of c; d), and a static table of equal shape."""
    tables = [ec.DynamicTableConfig(2, capacity, name=name, initializer=ec.RandomUniform(LOW, HIGH), combiner="sum",
                                    admission=ec.CountAdmission(min_count) if min_count > 1 else None,
                                    eviction=eviction, weights_dtype=dtype if name == "d" else "float32",
                                    slot_dtype=dtype if name == "d" else "float32")
              for name, (capacity, min_count, eviction) in zip("abcd", configs)]
    static = ec.TableConfig(4, 2, name="s", initializer=ec.RandomUniform(LOW, HIGH), combiner="sum")
    a, b, c, d = tables
    features = {"f0": ec.FeatureConfig(a), "f1": ec.FeatureConfig(b), "f2": ec.FeatureConfig(a),
                "f3": ec.FeatureConfig(c, max_sequence_length=2), "f4": ec.FeatureConfig(d),
                "f5": ec.FeatureConfig(static)}
    return ec.Embedding(features, ec.Adagrad(0.3, initial_accumulator_value=0.1), seed=SEED, stack_tables=stack)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 2), POLICIES), min_size=4, max_size=4),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), data=st.data())
def test_stacked_dynamic_tables_are_bit_identical_to_unstacked_ones(configs, dtype, data):
    """Dynamic tables of one shape share a physical table (never with the static one); every lookup,
    refusal, stale context, update and view is what unstacked tables give, bit for bit (pending keys,
    eviction, TTL, 16-bit stochastic rounding keyed by each table's own row slots)."""
    stacked, alone = _stacking_engine(True, configs, dtype), _stacking_engine(False, configs, dtype)
    assert stacked.num_physical_tables == (2 if dtype == "float32" else 3) and alone.num_physical_tables == 5
    pool = st.sampled_from(EXTREME[:5])
    pending = []
    for _ in range(data.draw(st.integers(1, 6))):
        batch = {f: data.draw(st.lists(st.lists(pool, max_size=3), min_size=2, max_size=2)) for f in
                 ("f0", "f1", "f2", "f3", "f4")}
        batch["f5"] = data.draw(st.lists(st.lists(st.integers(0, 4), max_size=2), min_size=2, max_size=2))
        outcomes = []
        for emb in (stacked, alone):
            try:
                outcomes.append(emb(batch))
            except ec.InputError as e:
                outcomes.append(str(e))
        if isinstance(outcomes[0], str) or isinstance(outcomes[1], str):
            assert outcomes[0] == outcomes[1]
        else:
            (acts, ctx), (acts_alone, ctx_alone) = outcomes
            for f in acts:
                assert acts[f].tobytes() == acts_alone[f].tobytes(), f
            pending.append((ctx, ctx_alone, {f: np.float32(0.5) * np.cos(a + 3 * len(pending)) for f, a in
                                             acts.items()}))
        if pending and data.draw(st.booleans()):  # apply an earlier context, or see both refuse it as stale
            ctx, ctx_alone, grads = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            results = []
            for emb, c in ((stacked, ctx), (alone, ctx_alone)):
                try:
                    report = emb.apply_gradients(grads, c)
                    results.append((report.skipped, report.failed))
                except ec.InputError as e:
                    results.append(str(e))
            assert results[0] == results[1]
        assert_same_state(engine_state(stacked), engine_state(alone))
    with tempfile.TemporaryDirectory() as tmp:  # both save the same files (one per table), and load each other's
        for name, emb in (("stacked", stacked), ("alone", alone)):
            emb.save(os.path.join(tmp, name))
        files = [open_snapshot(os.path.join(tmp, name)).manifest["files"] for name in ("stacked", "alone")]
        assert files[0] == files[1] and sum(f.startswith("dynamic-") for f in files[0]) == 4
        for emb, other in ((stacked, "alone"), (alone, "stacked")):
            loaded = _stacking_engine(emb is stacked, configs, dtype)
            loaded.load(os.path.join(tmp, other))
            assert_same_state(engine_state(loaded), engine_state(emb))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(1, 5), eviction=POLICIES, min_count=st.integers(1, 3), data=st.data())
def test_random_sequences_match_the_model(capacity, eviction, min_count, data):
    admission = ec.CountAdmission(min_count=min_count) if min_count > 1 else None
    t = ec.DynamicTableConfig(2, capacity, name="t", initializer=ec.RandomUniform(LOW, HIGH), combiner="sqrtn",
                              admission=admission, eviction=eviction)
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adagrad(0.2, initial_accumulator_value=0.1), seed=SEED)
    model = Model(capacity, uniform_initial("t", 2), [0.1], min_count=min_count, eviction=eviction)
    run = Run(emb, {"t": model}, {"f": ("t", 0)}, {"t": (ref.adagrad, {}, 0.2)})
    keys = st.sampled_from(EXTREME[:6])
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    for _ in range(data.draw(st.integers(1, 6))):
        samples = data.draw(st.lists(st.lists(keys, max_size=3), min_size=1, max_size=3))
        run.step({"f": samples}, rng)
