"""A stateful property test: any interleaving of lookups, applies, saves, loads, restores, serving opens and
bad calls leaves the engine equal to a plain NumPy model of it, and every refused call changes nothing.

The model (:class:`Model`) holds the tables, slots and step that the engine must have. After an accepted
``apply_gradients`` the model computes the update from ``tests/reference.py`` (float64, dense gradient,
untouched rows restored), checks the engine against it within float32 rounding, then adopts the engine's exact
values, so later refused calls are checked bit for bit. Contexts are tracked with the model's generation: a
``load`` or ``restore`` makes every earlier context stale, an applied one is consumed, and both are refused.

Two of the tables are 16-bit (issue 28): bfloat16 rows rounded stochastically with float16 accumulators,
stacked. They are checked within one 16-bit gap of the model after an update and bit for bit everywhere
else; a gradient that drives their float16 accumulators beyond 65504 is refused like a NaN result for those
rows (left as they were, the others updated, ``step`` advanced). Saved checkpoints are also exported for
serving (float32, float16, bfloat16, int8), served against the model, and refused by ``load``/``restore``.

CI runs it derandomized; ``EMBEDCORE_STATE_EXAMPLES=200 python -m pytest tests/test_state_machine.py`` runs longer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import embedcore as ec

from . import reference as ref

TABLES = {  # name -> (vocabulary, dim, combiner, reference update, learning rate)
    "items": (6, 3, "sum", ref.sgd, 0.25),
    "tags": (3, 3, "mean", ref.sgd, 0.25),        # stacks with "items": equal optimizer and dim
    "users": (4, 2, "sqrtn", ref.adagrad, 0.5),
    "codes": (5, 2, "sum", ref.adagrad, 0.5),     # 16 bits (STORED); not stacked with "users" (other storage)
    "badges": (3, 2, "sqrtn", ref.adagrad, 0.5),  # stacks with "codes"
}
STORED = {name: dict(weights_dtype="bfloat16", slot_dtype="float16", stochastic_rounding=True)
          for name in ("codes", "badges")}
FEATURES = {"clicked": ("items", 0), "liked": ("items", 0), "tag": ("tags", 0), "user": ("users", 0),
            "history": ("items", 3), "code": ("codes", 0), "code_seq": ("codes", 2),
            "badge": ("badges", 0)}  # (table, max_sequence_length)
ADAGRAD_START = 0.1
MANTISSA_BITS = {"float16": 10, "bfloat16": 7}


def allowed(values, dtype):
    """How far a stored value may be from the float64 model: float32 rounding, plus (16 bits) at most one gap
    between the stored format's values around it (stochastic rounding picks one of the two neighbours)."""
    slack = 1e-5 * np.abs(values) + 1e-6
    if dtype == "float32":
        return slack
    smallest = 2.0 ** -24 if dtype == "float16" else 2.0 ** -133
    exponent = np.floor(np.log2(np.maximum(np.abs(values) + slack, smallest)))
    return slack + np.maximum(2.0 ** (exponent + 1 - MANTISSA_BITS[dtype]), smallest)


def build_engine():
    sgd = ec.SGD(0.25)
    configs = {name: ec.TableConfig(v, d, combiner=c, name=name,
                                    optimizer=sgd if update is ref.sgd else ec.Adagrad(lr, ADAGRAD_START),
                                    initializer=ec.RandomUniform(-1.0, 1.0, seed=3), **STORED.get(name, {}))
               for name, (v, d, c, update, lr) in TABLES.items()}
    features = {f: ec.FeatureConfig(configs[t], max_sequence_length=L, name=f) for f, (t, L) in FEATURES.items()}
    return ec.Embedding(features, seed=11)


class Model:
    """What the engine must hold: float32 tables and slots, ``step``, and a generation per table replacement."""

    def __init__(self, emb):
        self.adopt(emb)
        self.generation = 0

    def adopt(self, emb):
        self.tables = {n: t.copy() for n, t in emb.embedding_tables.items()}
        self.slots = {n: [s.copy() for s in d.values()] for n, d in emb.slot_variables.items()}
        self.step = emb.step

    def snapshot(self):
        return ({n: t.copy() for n, t in self.tables.items()},
                {n: [s.copy() for s in v] for n, v in self.slots.items()}, self.step)

    def restore(self, snap):
        tables, slots, self.step = snap
        self.tables = {n: t.copy() for n, t in tables.items()}
        self.slots = {n: [s.copy() for s in v] for n, v in slots.items()}
        self.generation += 1

    def assert_equal(self, emb, why):
        """Bit-for-bit: used after refused calls, loads and restores."""
        assert emb.step == self.step, f"{why}: step {emb.step} != {self.step}"
        for n, t in self.tables.items():
            assert np.array_equal(emb.embedding_tables[n], t), f"{why}: table {n} changed"
            for s, expected in zip(emb.slot_variables[n].values(), self.slots[n]):
                assert np.array_equal(s, expected), f"{why}: a slot of {n} changed"

    def activations(self, batch, tables=None):
        tables = self.tables if tables is None else tables
        out = {}
        for f, (samples, weights) in batch.items():
            t, seq_len = FEATURES[f]
            out[f] = ref.lookup(tables[t].astype(np.float64), samples, weights, TABLES[t][2], seq_len)
        return out

    def apply(self, batch, grads):
        """The reference update of every table for ``batch`` and activation gradients ``grads``; returns the
        tables and slots before it."""
        before = self.snapshot()[:2]
        self.step += 1
        for t, (vocab, dim, combiner, update, lr) in TABLES.items():
            g = np.zeros((vocab, dim))
            touched = np.zeros(vocab, bool)
            for f, (samples, weights) in batch.items():
                if FEATURES[f][0] == t:
                    seq_len = FEATURES[f][1]
                    ref.dense_gradient(vocab, dim, samples, weights, combiner, seq_len, grads[f].astype(np.float64), g)
                    ref.touched_rows(vocab, samples, seq_len, touched)
            table, slots = self.tables[t], self.slots[t]
            if t in STORED:  # float64 math (NumPy computes bfloat16 with bfloat16 in bfloat16)
                table, slots = table.astype(np.float64), [s.astype(np.float64) for s in slots]
            new_table, new_slots = ref.apply(update, g, table, slots, touched, lr, {}, self.step)
            self.tables[t], self.slots[t] = new_table, new_slots
        return before

    def assert_close(self, emb, why):
        """The engine within rounding of the model (:func:`allowed`)."""
        for n, t in self.tables.items():
            stored = STORED.get(n, {})
            weights_dtype, slot_dtype = stored.get("weights_dtype", "float32"), stored.get("slot_dtype", "float32")
            got = emb.embedding_tables[n].astype(np.float64)
            bad = np.abs(got - t) > allowed(t, weights_dtype)
            assert not bad.any(), f"{why}: table {n} at {np.argwhere(bad)[:4].tolist()}: {got[bad][:4]} != {t[bad][:4]}"
            for s, expected in zip(emb.slot_variables[n].values(), self.slots[n]):
                got = s.astype(np.float64)
                bad = np.abs(got - expected) > allowed(expected, slot_dtype)
                assert not bad.any(), f"{why}: a slot of {n} at {np.argwhere(bad)[:4].tolist()}"


@st.composite
def batches(draw):
    """A valid batch: per feature, lists of ids per sample (some empty, many repeated) and their weights.

    Drawn from a seed, so a step costs hypothesis a few choices and a run reaches its full length."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    batch_size = draw(st.integers(0, 5))
    weighted = draw(st.booleans())
    batch = {}
    for f, (t, _) in FEATURES.items():
        vocab = TABLES[t][0]
        samples = [[int(i) for i in rng.integers(0, vocab, rng.integers(0, 5))] for _ in range(batch_size)]
        weights = [[float(rng.choice([0.5, 1.0, 2.0])) if weighted else 1.0 for _ in s] for s in samples]
        batch[f] = (samples, weights)
    return batch, weighted


def as_engine_input(batch, weighted):
    ids = {f: ec.Ragged.from_lists(s, np.int64) for f, (s, _) in batch.items()}
    if not weighted:
        return ids, None
    weights = {f: ec.Ragged(np.asarray([v for row in w for v in row], np.float32), ids[f].row_splits)
               for f, (_, w) in batch.items()}
    return ids, weights


def _in_metadata(path, at):
    """Whether byte ``at`` of the safetensors file ``path`` lies in its header's ``__metadata__`` (informational
    strings, which neither the manifest's SHA-256 of each tensor nor the header checks cover)."""
    with open(path, "rb") as f:
        raw = f.read(1 << 16)
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n]
    start = header.find(b'"__metadata__"')
    return start >= 0 and 8 + start <= at < 8 + len(header.rstrip())


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="embedcore-state-")
        self.emb = build_engine()
        self.model = Model(self.emb)
        self.contexts = []      # [ctx, batch, generation, consumed]
        self.saved = {}         # checkpoint path -> model snapshot
        self.corrupt = []       # checkpoint paths that must be refused
        self.count = 0

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def _path(self):
        self.count += 1
        return os.path.join(self.dir, f"ckpt{self.count}")

    # -- accepted calls ------------------------------------------------------------------------------------
    @rule(data=batches())
    def lookup(self, data):
        batch, weighted = data
        ids, weights = as_engine_input(batch, weighted)
        acts, ctx = self.emb(ids, weights)
        expected = self.model.activations(batch)
        for f in FEATURES:
            np.testing.assert_allclose(acts[f], expected[f], rtol=1e-5, atol=1e-6, err_msg=f"lookup {f}")
        self.model.assert_equal(self.emb, "a lookup")
        self.contexts.append([ctx, batch, self.model.generation, False])
        if len(self.contexts) > 4:
            self.contexts.pop(0)

    def _gradients(self, batch, seed):
        rng = np.random.default_rng(seed)
        grads = {}
        for f, (samples, _) in batch.items():
            seq_len = FEATURES[f][1]
            dim = TABLES[FEATURES[f][0]][1]
            shape = (len(samples), seq_len, dim) if seq_len else (len(samples), dim)
            grads[f] = rng.normal(0, 1, shape).astype(np.float32)
        return grads

    @precondition(lambda self: self.contexts)
    @rule(data=st.data(), seed=st.integers(0, 2 ** 16))
    def apply(self, data, seed):
        entry = data.draw(st.sampled_from(self.contexts))
        ctx, batch, generation, consumed = entry
        grads = self._gradients(batch, seed)
        if consumed or generation != self.model.generation:
            with pytest.raises(ec.InputError):
                self.emb.apply_gradients(grads, ctx)
            self.model.assert_equal(self.emb, "an apply with a consumed or stale context")
            return
        self.emb.apply_gradients(grads, ctx)
        entry[3] = True
        self.model.apply(batch, grads)
        assert self.emb.step == self.model.step
        self.model.assert_close(self.emb, "an apply")
        self.model.adopt(self.emb)

    def _live(self):
        return [c for c in self.contexts if not c[3] and c[2] == self.model.generation and c[1]["code"][0]]

    @precondition(lambda self: self._live())
    @rule(data=st.data(), seed=st.integers(0, 2 ** 16))
    def overflowing_apply(self, data, seed):
        """A gradient of 1000 on one sample of "code" takes its rows' float16 accumulators beyond 65504: those
        rows are left exactly as they were (NonFiniteError naming the table), every other row is updated,
        ``step`` advances and the context is consumed."""
        entry = data.draw(st.sampled_from(self._live()))
        ctx, batch = entry[0], entry[1]
        grads = self._gradients(batch, seed)
        sample = data.draw(st.integers(0, len(batch["code"][0]) - 1))
        grads["code"][sample] = 1000.0
        hit = bool(batch["code"][0][sample])  # an empty sample: nothing overflows
        with pytest.raises(ec.NonFiniteError, match="'codes'") if hit else contextlib.nullcontext():
            self.emb.apply_gradients(grads, ctx)
        entry[3] = True
        tables, slots = self.model.apply(batch, grads)
        overflow = (self.model.slots["codes"][0] > 65504).any(axis=1)
        assert overflow.any() == hit
        assert not ((self.model.slots["codes"][0] > 60000) & ~overflow[:, None]).any()  # no borderline row
        self.model.tables["codes"][overflow] = tables["codes"][overflow]
        self.model.slots["codes"][0][overflow] = slots["codes"][0][overflow]
        assert self.emb.step == self.model.step
        self.model.assert_close(self.emb, "an apply overflowing float16")
        assert np.array_equal(self.emb.embedding_tables["codes"][overflow], tables["codes"][overflow])
        assert np.array_equal(self.emb.slot_variables["codes"]["accumulators"][overflow], slots["codes"][0][overflow])
        self.model.adopt(self.emb)

    @rule()
    def save(self):
        path = self._path()
        self.emb.save(path)
        self.saved[path] = self.model.snapshot()
        self.model.assert_equal(self.emb, "a save")

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def load(self, data):
        path = data.draw(st.sampled_from(sorted(self.saved)))
        self.emb.load(path)
        self.model.restore(self.saved[path])
        self.model.assert_equal(self.emb, f"load of {path}")

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data):
        path = data.draw(st.sampled_from(sorted(self.saved)))
        self.emb = ec.Embedding.restore(path)
        self.model.restore(self.saved[path])
        self.model.assert_equal(self.emb, f"restore of {path}")

    @precondition(lambda self: self.saved)
    @rule(data=st.data(), batch=batches())
    def serve(self, data, batch):
        path = data.draw(st.sampled_from(sorted(self.saved)))
        server = ec.ServingEmbedding(path)
        tables, _, step = self.saved[path]
        assert server.step == step
        ids, weights = as_engine_input(*batch)
        acts = server.lookup(ids, weights)
        expected = self.model.activations(batch[0], tables)
        for f in FEATURES:
            np.testing.assert_allclose(acts[f], expected[f], rtol=1e-5, atol=1e-6, err_msg=f"serving {f}")

    @precondition(lambda self: self.saved)
    @rule(data=st.data(), batch=batches(), dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8"]))
    def export_and_serve(self, data, batch, dtype):
        """An export serves the saved tables (rounded to nearest for 16 bits; int8 within half a quantization
        step per occurrence); training readers refuse it and change nothing."""
        source = data.draw(st.sampled_from(sorted(self.saved)))
        path = self._path()
        ec.export_for_serving(source, path, dtype=dtype)
        server = ec.ServingEmbedding(path)
        assert server.dtype == dtype
        tables = self.saved[source][0]
        ids, weights = as_engine_input(*batch)
        acts = server.lookup(ids, weights)
        for f, (samples, w) in batch[0].items():
            t, seq_len = FEATURES[f]
            table = tables[t].astype(np.float32)
            if dtype in ("float16", "bfloat16"):
                table = table.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
            table = table.astype(np.float64)
            combiner = TABLES[t][2]
            expected = ref.lookup(table, samples, w, combiner, seq_len)
            slack = 1e-5 * ref.lookup(np.abs(table), samples, w, combiner, seq_len) + 1e-6
            if dtype == "int8":  # half a step, (max - min) / 255 / 2, per occurrence, times its |gain|
                half_step = (table.max(axis=1) - table.min(axis=1)) / 510 * (1 + 1e-6)
                slack += ref.lookup(np.repeat(half_step[:, None], table.shape[1], 1), samples, w, combiner, seq_len)
            assert (np.abs(acts[f] - expected) <= slack).all(), f"serving {f} from a {dtype} export"
        for how in ("load", "restore"):
            with pytest.raises(ec.CheckpointError, match="serving export"):
                self.emb.load(path) if how == "load" else ec.Embedding.restore(path)
            self.model.assert_equal(self.emb, f"a {how} of a serving export")

    # -- refused calls -------------------------------------------------------------------------------------
    @rule(data=batches(), feature=st.sampled_from(sorted(FEATURES)),
          bad=st.sampled_from(["too large", "negative", "float ids", "missing feature", "NaN weight"]))
    def bad_lookup(self, data, feature, bad):
        batch, _ = data
        ids, weights = as_engine_input(batch, True)
        vocab = TABLES[FEATURES[feature][0]][0]
        if bad == "too large":
            ids[feature] = ec.Ragged(np.array([vocab], np.int64), np.array([0, 1]))
        elif bad == "negative":
            ids[feature] = ec.Ragged(np.array([-1], np.int64), np.array([0, 1]))
        elif bad == "float ids":
            ids[feature] = np.array([[0.5]])
        elif bad == "missing feature":
            del ids[feature]
        else:
            ids[feature] = ec.Ragged(np.array([0], np.int64), np.array([0, 1]))
        if bad in ("too large", "negative", "NaN weight"):
            weights[feature] = ec.Ragged(np.array([np.nan if bad == "NaN weight" else 1.0], np.float32),
                                         np.array([0, 1]))
            for f in FEATURES:  # one sample in every feature, so the batch sizes agree
                if f != feature:
                    ids[f] = ec.Ragged(np.array([0], np.int64), np.array([0, 1]))
                    weights[f] = ec.Ragged(np.array([1.0], np.float32), np.array([0, 1]))
        with pytest.raises((ec.InputError, ValueError)):
            self.emb(ids, weights if bad != "missing feature" else None)
        self.model.assert_equal(self.emb, f"a refused lookup ({bad})")

    @precondition(lambda self: self.contexts)
    @rule(data=st.data(), bad=st.sampled_from(["NaN", "Inf", "wrong shape", "int dtype", "missing feature"]))
    def bad_apply(self, data, bad):
        entry = data.draw(st.sampled_from(self.contexts))
        ctx, batch = entry[0], entry[1]
        grads = self._gradients(batch, 0)
        feature = data.draw(st.sampled_from(sorted(FEATURES)))
        g = grads[feature]
        if bad in ("NaN", "Inf"):
            if g.size == 0:
                return
            g.reshape(-1)[data.draw(st.integers(0, g.size - 1))] = np.nan if bad == "NaN" else np.inf
        elif bad == "wrong shape":
            grads[feature] = np.zeros((g.shape[0] + 1,) + g.shape[1:], np.float32)
        elif bad == "int dtype":
            grads[feature] = g.astype(np.int32)
        else:
            del grads[feature]
        with pytest.raises(ec.InputError):
            self.emb.apply_gradients(grads, ctx)
        self.model.assert_equal(self.emb, f"a refused apply ({bad})")

    @rule()
    def foreign_context(self):
        other = build_engine()
        _, ctx = other({f: np.zeros((1, 1), np.int64) for f in FEATURES})
        with pytest.raises(ec.InputError):
            self.emb.apply_gradients({f: np.zeros((1, L, TABLES[t][1]) if L else (1, TABLES[t][1]), np.float32)
                                      for f, (t, L) in FEATURES.items()}, ctx)
        self.model.assert_equal(self.emb, "an apply with another engine's context")

    @precondition(lambda self: self.saved)
    @rule(data=st.data(), where=st.sampled_from(["tensor", "manifest", "CURRENT"]))
    def corrupt_checkpoint(self, data, where):
        source = data.draw(st.sampled_from(sorted(self.saved)))
        path = self._path()
        shutil.copytree(source, path)
        files = []
        for root, _, names in os.walk(path):
            files += [os.path.join(root, n) for n in names]
        if where == "CURRENT":
            target = os.path.join(path, "CURRENT")
        elif where == "manifest":
            target = next(f for f in files if f.endswith("manifest.json"))
        else:
            target = max((f for f in files if not f.endswith(".json") and os.path.basename(f) != "CURRENT"),
                         key=os.path.getsize)
        with open(target, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            at = data.draw(st.integers(0, max(size - 1, 0)))
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([(byte[0] if byte else 0) ^ 0x5A]))
        self.corrupt.append((path, source, where == "tensor" and _in_metadata(target, at)))

    @precondition(lambda self: self.corrupt)
    @rule(data=st.data(), how=st.sampled_from(["load", "restore", "serve"]))
    def open_corrupt(self, data, how):
        path, source, in_metadata = data.draw(st.sampled_from(self.corrupt))
        if how == "serve":  # serving reads no slots: a flipped slot byte may be served around, never served
            try:
                server = ec.ServingEmbedding(path)
            except ec.CheckpointError:
                return
            for n, t in self.saved[source][0].items():
                assert np.array_equal(np.asarray(server.embedding_tables[n]), t), f"serving {n} from {path}"
            return
        if in_metadata:  # a safetensors header's __metadata__ is neither hashed nor checked: refused, or the same
            try:
                if how == "load":
                    self.emb.load(path)
                    self.model.restore(self.saved[source])
                    self.model.assert_equal(self.emb, f"a load of {path}, its tensor metadata flipped")
                else:
                    back = ec.Embedding.restore(path)
                    tables, slots, step = self.saved[source]
                    assert back.step == step and all(np.array_equal(back.embedding_tables[n], t)
                                                     for n, t in tables.items())
                return
            except ec.CheckpointError:
                pass
        else:
            with pytest.raises(ec.CheckpointError):
                if how == "load":
                    self.emb.load(path)
                else:
                    ec.Embedding.restore(path)
        self.model.assert_equal(self.emb, f"a refused {how} of a corrupt checkpoint")

    @invariant()
    def step_agrees(self):
        assert self.emb.step == self.model.step


EngineMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("EMBEDCORE_STATE_EXAMPLES", "12")), stateful_step_count=25,
    derandomize=not os.environ.get("EMBEDCORE_STATE_EXAMPLES"), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
test_engine_state_machine = EngineMachine.TestCase
