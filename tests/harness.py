"""Shared test helpers: random batches in every input form, and engine-vs-oracle stepping."""

import hashlib
import json
import os

import numpy as np

import embedcore as ec

from . import reference as ref


def random_samples(rng, batch_size, vocabulary_size, max_len, hot=None):
    """``batch_size`` lists of ids (some empty when max_len allows 0), with many duplicates."""
    samples = []
    for _ in range(batch_size):
        n = int(rng.integers(0, max_len + 1))
        if hot is not None and rng.random() < 0.5:
            samples.append([int(x) for x in rng.choice(hot, n)])
        else:
            samples.append([int(x) for x in rng.integers(0, vocabulary_size, n)])
    return samples


def random_weights(rng, samples):
    return [[float(x) for x in rng.uniform(0.1, 2.0, len(s))] for s in samples]


def unit_weights(samples):
    return [[1.0] * len(s) for s in samples]


def as_input(samples, weights, form):
    """The same batch as engine input of ``form``: lists, ragged, sparse or dense (equal lengths only)."""
    if form == "lists":
        return samples, weights
    if form == "ragged":
        ids = ec.Ragged.from_lists(samples, np.int64)
        w = None if weights is None else ec.Ragged(np.asarray([v for s in weights for v in s], np.float32),
                                                   ids.row_splits)
        return ids, w
    if form == "sparse":
        idx = np.array([(b, p) for b, s in enumerate(samples) for p in range(len(s))], np.int64).reshape(-1, 2)
        vals = np.array([v for s in samples for v in s], np.int64)
        width = max([len(s) for s in samples] + [1])
        perm = np.random.default_rng(1).permutation(len(vals))  # COO in any order
        ids = ec.Sparse(idx[perm], vals[perm], (len(samples), width))
        w = None if weights is None else ec.Sparse(idx[perm], np.array([v for s in weights for v in s],
                                                                        np.float32)[perm], ids.dense_shape)
        return ids, w
    if form == "dense":
        ids = np.array(samples, np.int64).reshape(len(samples), -1)
        w = None if weights is None else np.array(weights, np.float32).reshape(ids.shape)
        return ids, w
    raise ValueError(form)


class OracleRun:
    """Steps an engine and the NumPy oracle side by side on the same random batches.

    ``tables``: list of (name, vocabulary_size, dim, combiner, update_fn, params, lazy); ``features``:
    list of (feature name, table name, max_sequence_length).
    """

    def __init__(self, emb, features, updates, rng, max_len=4, hot_fraction=True):
        self.emb, self.features, self.updates, self.rng, self.max_len = emb, features, updates, rng, max_len
        self.tables = {n: t.astype(np.float64) for n, t in emb.embedding_tables.items()}
        self.slots = {n: [s.astype(np.float64) for s in d.values()] for n, d in emb.slot_variables.items()}
        self.configs = emb.tables
        self.hot = hot_fraction

    def step(self, batch_size=12, weighted=True, form="ragged", atol=2e-5, rtol=2e-5):
        rng, emb = self.rng, self.emb
        batch, weights, samples = {}, {}, {}
        for fname, tname, seq_len in self.features:
            vocab = self.configs[tname].vocabulary_size
            hot = rng.integers(0, vocab, 3) if self.hot else None
            s = random_samples(rng, batch_size, vocab, self.max_len, hot)
            w = random_weights(rng, s) if weighted else unit_weights(s)
            samples[fname] = (s, w, seq_len, tname)
            batch[fname], weights[fname] = as_input(s, w if weighted else None, form)
        acts, ctx = emb(batch, weights if weighted else None)
        grads, dense = {}, {}
        for fname, (s, w, seq_len, tname) in samples.items():
            cfg = self.configs[tname]
            expected = ref.lookup(self.tables[tname], s, w, cfg.combiner, seq_len)
            np.testing.assert_allclose(acts[fname], expected, rtol=rtol, atol=atol, err_msg=f"lookup {fname}")
            grads[fname] = rng.normal(0, 1, acts[fname].shape).astype(np.float32)
            dense.setdefault(tname, [np.zeros_like(self.tables[tname]), np.zeros(cfg.vocabulary_size, bool)])
            ref.dense_gradient(cfg.vocabulary_size, cfg.dim, s, w, cfg.combiner, seq_len,
                               grads[fname].astype(np.float64), dense[tname][0])
            ref.touched_rows(cfg.vocabulary_size, s, seq_len, dense[tname][1])
        emb.apply_gradients(grads, ctx)
        for tname in self.tables.keys() - self.updates.keys():  # no oracle asked for: follow the engine
            self.tables[tname] = emb.embedding_tables[tname].astype(np.float64)
        for tname, (update, params, lr, lazy) in self.updates.items():
            g, touched = dense.get(tname, (np.zeros_like(self.tables[tname]),
                                           np.zeros(self.configs[tname].vocabulary_size, bool)))
            self.tables[tname], self.slots[tname] = ref.apply(update, g, self.tables[tname], self.slots[tname],
                                                              touched, lr, params, emb.step, lazy)
            self.check(tname, atol, rtol)

    def check(self, tname, atol=2e-5, rtol=2e-5):
        np.testing.assert_allclose(self.emb.embedding_tables[tname], self.tables[tname], rtol=rtol, atol=atol,
                                   err_msg=f"table {tname} at step {self.emb.step}")
        for (slot_name, slot), expected in zip(self.emb.slot_variables[tname].items(), self.slots[tname]):
            np.testing.assert_allclose(slot, expected, rtol=rtol, atol=atol,
                                       err_msg=f"slot {tname}/{slot_name} at step {self.emb.step}")


def snapshot(emb):
    """An engine's tables, slots and step, copied: ``(tables, slots, step)``."""
    return ({n: t.copy() for n, t in emb.embedding_tables.items()},
            {n: {s: v.copy() for s, v in d.items()} for n, d in emb.slot_variables.items()}, emb.step)


def assert_unchanged(emb, snap):
    """``emb`` holds exactly ``snap`` (:func:`snapshot`), bit for bit (a NaN or -0.0 included)."""
    tables, slots, step = snap
    assert emb.step == step, f"step changed: {step} -> {emb.step}"
    now, now_slots = emb.embedding_tables, emb.slot_variables
    assert now.keys() == tables.keys() and now_slots.keys() == slots.keys()
    for n, t in tables.items():
        assert now[n].tobytes() == t.tobytes(), f"table {n} changed"
        assert now_slots[n].keys() == slots[n].keys()
        for s, v in slots[n].items():
            assert now_slots[n][s].tobytes() == v.tobytes(), f"slot {n}/{s} changed"


def rewrite_manifest(path, edit, serving=False):
    """Edit a checkpoint's (``serving``: a serving export's) manifest (``edit(text) -> text``) and re-sign it
    in ``CURRENT``, as someone who controls the directory could: only the checks beyond the hash chain stand
    in the way."""
    from embedcore.checkpoint import open_snapshot
    snap = open_snapshot(path, serving=serving)
    manifest = os.path.join(snap.dir, "manifest.json")
    with open(manifest) as f:
        text = edit(f.read())
    with open(manifest, "w") as f:
        f.write(text)
    pointer = {"snapshot": snap.name, "manifest_sha256": hashlib.sha256(text.encode()).hexdigest()}
    with open(os.path.join(path, "CURRENT"), "w") as f:
        f.write(json.dumps(pointer))
