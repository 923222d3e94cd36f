"""Train a fixed workload on dynamic tables (eviction and admission at work, 16-bit rows with stochastic
rounding) and print SHA-256 digests of everything, for ``tests/test_dynamic_determinism.py``.

``python dynamic_determinism.py THREADS`` where THREADS is a comma-separated list of thread counts (e.g.
``2,1``): for each, a fresh engine is trained for ``STEPS`` steps with ``numba.set_num_threads(n)``; the
kernels are compiled once per process. Prints one JSON line: ``{"numba_threads": NUMBA_NUM_THREADS, "env":
..., "runs": {THREADS: {...}}}``; each run gives, per table, digests of the keys held, the row slot of each
key, its rows, slots, ``last_seen`` and counts (a static table: its rows and slots), how many keys it holds
and how many times it evicted or expired rows; and a digest of the activations of one more lookup.

The workload: four tables of 8 values a row over one engine, each read by a weighted pooled ragged feature, a
sequence feature (lengths 0 .. 6 against ``max_sequence_length`` 3) and a dense one, 400 samples a batch:

* ``score``: float32, lazy Adam, ``EvictByScore`` (on the row's values), admission after 2 sightings;
* ``lfu16``: bfloat16 rows and float16 slots with stochastic rounding, Adagrad, LFU;
* ``ttl16``: float16 rows, stochastic rounding, SGD, ``TTL(2)`` (keys idle for 3 steps expire);
* ``static``: a static bfloat16 table beside them, Adagrad.

Step ``t`` draws keys (64-bit: hashed from a sliding window of ids, so most of a batch's keys are new to a
table of ``CAPACITY`` rows and eviction runs every step) with heavy duplication.
"""

import hashlib
import json
import os
import sys

import numba
import numpy as np

import embedcore as ec

STEPS = 6
BATCH = 400
CAPACITY = 600
WINDOW = 500          # ids in use at a step (fewer distinct keys than CAPACITY: a batch always fits)
DIM = 8
STATIC_VOCAB = 300


def keep_large_rows(embedding_table, last_seen, count, step):
    """EvictByScore: rows with a large first value, seen lately and often, stay."""
    return embedding_table[0] + 0.01 * count - 0.1 * (step - last_seen)


def make_engine():
    tables = {
        "score": ec.DynamicTableConfig(DIM, CAPACITY, name="score", optimizer=ec.Adam(0.02), combiner="mean",
                                       admission=ec.CountAdmission(min_count=2, sketch_width=2 ** 16),
                                       eviction=ec.EvictByScore(keep_large_rows)),
        "lfu16": ec.DynamicTableConfig(DIM, CAPACITY, name="lfu16", optimizer=ec.Adagrad(0.05), combiner="sqrtn",
                                       eviction=ec.LFU(), weights_dtype="bfloat16", slot_dtype="float16"),
        "ttl16": ec.DynamicTableConfig(DIM, CAPACITY, name="ttl16", optimizer=ec.SGD(0.1), combiner="sum",
                                       eviction=ec.TTL(steps=2), weights_dtype="float16"),
        "static": ec.TableConfig(STATIC_VOCAB, DIM, name="static", optimizer=ec.Adagrad(0.05),
                                 weights_dtype="bfloat16"),
    }
    features = {name: {"bag": ec.FeatureConfig(t), "seq": ec.FeatureConfig(t, max_sequence_length=3),
                       "dense": ec.FeatureConfig(t)} for name, t in tables.items()}
    return ec.Embedding(features, ec.SGD(0.1), seed=11)


def to_key(ids, table):
    """64-bit keys from small ids: the same id gives the same key; keys spread over all 2**64 patterns."""
    salt = np.uint64(sum(map(ord, table)))
    z = (ids.astype(np.uint64) + salt) * np.uint64(0x9E3779B97F4A7C15)
    return (z ^ (z >> np.uint64(29))).view(np.int64)


def ids_at(rng, t, n, table):
    if table == "static":
        return rng.integers(0, STATIC_VOCAB, n)
    return to_key(t * 150 + (rng.zipf(1.3, n) - 1) % WINDOW, table)


def batch(t, tables):
    rng = np.random.default_rng([2027, t])
    ids, weights = {}, {}
    for table in tables:
        lengths = rng.integers(0, 7, BATCH)
        splits = np.concatenate([[0], np.cumsum(lengths)])
        bag = ec.Ragged(ids_at(rng, t, int(splits[-1]), table), splits)
        bag_w = ec.Ragged(rng.uniform(0.1, 2.0, int(splits[-1])).astype(np.float32), splits)
        lengths = rng.integers(0, 7, BATCH)
        splits = np.concatenate([[0], np.cumsum(lengths)])
        seq = ec.Ragged(ids_at(rng, t, int(splits[-1]), table), splits)
        dense = ids_at(rng, t, BATCH * 2, table).reshape(BATCH, 2)
        if table != "static":
            dense = dense.view(np.uint64)  # the same keys as unsigned
        ids[table] = {"bag": bag, "seq": seq, "dense": dense}
        weights[table] = {"bag": bag_w, "seq": None, "dense": None}
    return ids, weights


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def describe(emb, name):
    view, slots = emb.embedding_tables[name], emb.slot_variables[name]
    if isinstance(view, np.ndarray):
        return {"weights": digest(view), "slots": {s: digest(v) for s, v in slots.items()}}
    table = view._table
    keys = view.keys()
    rows = table.key_map.find(keys)
    return {"keys": digest(keys), "row_slots": digest(rows), "weights": digest(view[keys]),
            "slots": {s: digest(v[keys]) for s, v in slots.items()},
            "last_seen": digest(table.key_map.last_seen[rows]), "counts": digest(table.key_map.counts[rows]),
            "held": int(keys.shape[0]), "removals": table.removals, "dtype": str(view.dtype)}


def run():
    emb = make_engine()
    tables = list(emb.feature_config)
    for t in range(STEPS):
        ids, weights = batch(t, tables)
        acts, ctx = emb.lookup(ids, weights)
        rng = np.random.default_rng([99, t])
        grads = {k: {f: rng.standard_normal(a.shape).astype(np.float32) for f, a in group.items()}
                 for k, group in acts.items()}
        emb.apply_gradients(grads, ctx)
    ids, weights = batch(STEPS, tables)
    acts, _ = emb.lookup(ids, weights)
    return {"step": emb.step, "tables": {name: describe(emb, name) for name in tables},
            "activations": digest(np.concatenate([a.reshape(-1) for g in acts.values() for a in g.values()]))}


def main():
    runs = {}
    for threads in sys.argv[1].split(","):
        numba.set_num_threads(int(threads))
        runs[threads] = dict(run(), threads_used=numba.get_num_threads())
    print(json.dumps({"numba_threads": numba.config.NUMBA_NUM_THREADS, "env": os.environ.get("NUMBA_NUM_THREADS"),
                      "runs": runs}))


if __name__ == "__main__":
    main()
