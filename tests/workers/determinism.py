"""Train a fixed workload and print SHA-256 digests of every table and slot, for the determinism tests.

``python determinism.py RUNS`` where RUNS is a comma-separated list of ``stack:threads`` (e.g.
``on:2,off:2,on:1``): for each, a fresh engine (``stack_tables`` on or off) is trained for ``STEPS`` steps
with ``numba.set_num_threads(threads)``. The Numba kernels are compiled once per process and shared by the
runs. Prints one JSON line: ``{"numba_threads": NUMBA_NUM_THREADS, "layer": ..., "runs": {RUN: {...}}}``.

The workload covers every update path: built-in element-wise optimizers (SGD, Adagrad, lazy Adam, FTRL),
a dense pass (non-lazy Adam), a custom per-row function with a reduction (``np.mean(g * g)``), a row slot
and a ``slot_dims=1`` slot; per table: duplicate ids, two or more features sharing the table, weights,
ragged ids, a sequence feature (truncated and padded), every combiner, a float64 gradient.
"""

import hashlib
import json
import os
import sys

import numba
import numpy as np

import embedcore as ec

STEPS = 4
BATCH = 300
VOCAB_A, VOCAB_B, DIM = 3000, 700, 8


def momentum_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """A reduction over the row (``np.mean(g * g)``) and a ``slot_dims=1`` slot (one float32 per row): not
    element-wise, so it runs once per row on row views."""
    beta = hyperparameters[0]
    accumulator = slot_variables[1] + np.mean(gradient * gradient)
    momentum = beta * slot_variables[0] + gradient / np.sqrt(accumulator)
    return embedding_table - learning_rate * momentum, momentum, accumulator


def optimizers():
    return [
        ec.SGD(0.1),
        ec.Adagrad(0.05),
        ec.Adam(0.01),
        ec.Adam(0.02, lazy_adam=False),
        ec.FTRL(0.05, l1_regularization_strength=0.001, l2_regularization_strength=0.001),
        ec.CustomOptimizer(momentum_rowwise, 0.05, ["momentum", "accumulator"],
                           [ec.RandomUniform(-0.01, 0.01), 0.1], hyperparameters=[0.9], slot_dims=[2, 1]),
    ]


COMBINERS = ("mean", "sum", "sqrtn")


def make_engine(stack_tables):
    features = {}
    for k, opt in enumerate(optimizers()):
        # k == 0 uses the engine's global optimizer; the others set their own.
        table_opt = None if k == 0 else opt
        a = ec.TableConfig(VOCAB_A, DIM, name=f"t{k}a", optimizer=table_opt, combiner=COMBINERS[k % 3])
        b = ec.TableConfig(VOCAB_B, DIM, name=f"t{k}b", optimizer=table_opt, combiner=COMBINERS[(k + 1) % 3])
        features[f"f{k}"] = {"bag": ec.FeatureConfig(a), "dup": ec.FeatureConfig(a),
                             "seq": ec.FeatureConfig(b, max_sequence_length=4), "one": ec.FeatureConfig(b)}
    return ec.Embedding(features, optimizers()[0], seed=5, stack_tables=stack_tables)


def ragged(rng, vocab, max_len, zipf=None):
    lengths = rng.integers(0, max_len + 1, BATCH)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    n = int(splits[-1])
    values = (rng.zipf(zipf, n) - 1) % vocab if zipf else rng.integers(0, vocab, n)
    return ec.Ragged(values, splits), ec.Ragged(rng.uniform(0.1, 2.0, n).astype(np.float32), splits)


def batch(t, n_opt):
    rng = np.random.default_rng([77, t])
    ids, weights = {}, {}
    for k in range(n_opt):
        bag, bag_w = ragged(rng, VOCAB_A, 8, zipf=1.2)     # heavy-tailed: many duplicates
        seq, seq_w = ragged(rng, VOCAB_B, 7)               # lengths 0..7 against max_sequence_length 4
        dup = rng.integers(0, 40, (BATCH, 6))              # 40 ids only: every row repeated many times
        one = rng.integers(0, VOCAB_B, BATCH)
        ids[f"f{k}"] = {"bag": bag, "dup": dup, "seq": seq, "one": one}
        weights[f"f{k}"] = {"bag": bag_w, "dup": rng.uniform(0.5, 1.5, (BATCH, 6)).astype(np.float32),
                            "seq": seq_w, "one": None}
    return ids, weights


def gradients(t, acts):
    rng = np.random.default_rng([99, t])
    out = {}
    for k, group in acts.items():
        out[k] = {name: rng.standard_normal(a.shape).astype(np.float32) for name, a in group.items()}
    out["f1"]["one"] = out["f1"]["one"].astype(np.float64)  # a float64 gradient is converted, not refused
    return out


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def run(stack_tables):
    emb = make_engine(stack_tables)
    initial = {name: table.copy() for name, table in emb.embedding_tables.items()}
    n_opt = len(emb.feature_config)
    for t in range(STEPS):
        ids, weights = batch(t, n_opt)
        acts, ctx = emb.lookup(ids, weights)
        emb.apply_gradients(gradients(t, acts), ctx)
    ids, weights = batch(STEPS, n_opt)
    acts, _ = emb.lookup(ids, weights)
    tables = {}
    for name, table in emb.embedding_tables.items():
        tables[name] = {"weights": digest(table),
                        "changed_rows": int(np.any(table != initial[name], axis=1).sum()),
                        "slots": {s: digest(v) for s, v in emb.slot_variables[name].items()}}
    return {"step": emb.step, "physical_tables": emb.num_physical_tables, "tables": tables,
            "activations": digest(np.concatenate([a.reshape(-1) for g in acts.values() for a in g.values()]))}


def main():
    runs = {}
    for spec in sys.argv[1].split(","):
        stack, threads = spec.split(":")
        numba.set_num_threads(int(threads))
        runs[spec] = dict(run(stack == "on"), threads_used=numba.get_num_threads())
    elementwise = [opt.compiled(DIM).elementwise for opt in optimizers()]
    print(json.dumps({"numba_threads": numba.config.NUMBA_NUM_THREADS, "layer": numba.threading_layer(),
                      "env": os.environ.get("NUMBA_NUM_THREADS"), "elementwise": elementwise, "runs": runs}))


if __name__ == "__main__":
    main()
