"""embedcore behaves as TensorFlow's own tests of ``tf.tpu.experimental.embedding`` say (issue 25, section 3):
Adam without bias correction, ``None`` gradients, lookup-only engines, and the optimizer arguments TensorFlow
validates. Numbers are checked against the NumPy oracle (tests/reference.py) or TensorFlow's test formulas."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

import embedcore as ec
from embedcore.checkpoint import CheckpointError

from . import reference as ref
from .harness import as_input, assert_unchanged, random_samples, random_weights, rewrite_manifest, snapshot

# ----------------------------------------------------------------------------------------------------------
# Adam: TensorFlow's TPU Adam has no bias correction.


@pytest.mark.parametrize("sum_inside_sqrt", [False, True])
def test_adam_first_step_is_tensorflows_test_formula(sum_inside_sqrt):
    """TensorFlow's ``_check_embedding_and_slot_variables_for_adam``: from zero slots, one step gives
    ``m = (1 - b1) g``, ``v = (1 - b2) g^2``, ``w -= lr m / (sqrt(v) + eps)`` with ``lr_modifier = 1`` ("TPU
    Embeddings don't have the LR decay factor for Adam"); g summed over the samples of each id."""
    adam = ec.Adam(0.1, sum_inside_sqrt=sum_inside_sqrt)
    table = ec.TableConfig(5, 3, name="video", combiner="sum", initializer=ec.RandomUniform(-1, 1, seed=2))
    emb = ec.Embedding({"watched": ec.FeatureConfig(table)}, adam)
    before = emb.embedding_tables["video"].astype(np.float64)
    ids = np.array([0, 3, 0, 1, 3, 3])
    grads = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    _, ctx = emb({"watched": ids})
    emb.apply_gradients({"watched": grads}, ctx)
    g = np.zeros((5, 3))
    np.add.at(g, ids, grads.astype(np.float64))
    m, v = g * (1 - adam.beta_1), g ** 2 * (1 - adam.beta_2)
    denominator = np.sqrt(v + adam.epsilon ** 2) if sum_inside_sqrt else np.sqrt(v) + adam.epsilon
    expected = before - adam.learning_rate * m / denominator
    touched = np.isin(np.arange(5), ids)
    expected[~touched] = before[~touched]
    # TensorFlow's rtol: the float32 hyperparameters alone (1 - 0.999 in float32) differ by 1.3e-5.
    np.testing.assert_allclose(emb.embedding_tables["video"], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(emb.slot_variables["video"]["momenta"], np.where(touched[:, None], m, 0), rtol=1e-4)
    np.testing.assert_allclose(emb.slot_variables["video"]["velocities"], np.where(touched[:, None], v, 0),
                               rtol=1e-4)


def _tf_first_step(optimizer, w, g):
    """TensorFlow's tests' formulas for one step from initial slots (tpu_embedding_base_test)."""
    if isinstance(optimizer, ec.Adagrad):
        accumulator = optimizer.initial_accumulator_value + g ** 2
        return w - optimizer.learning_rate * g / np.sqrt(accumulator), {"accumulators": accumulator}
    if isinstance(optimizer, ec.AdagradMomentum):
        accumulator = g ** 2
        power = (accumulator + optimizer.epsilon) ** (-1.0 / optimizer.exponent)
        momenta = g * power
        update = optimizer.momentum * momenta + g * power if optimizer.use_nesterov else momenta
        return w - optimizer.learning_rate * update, {"accumulators": accumulator, "momenta": momenta}
    p, a0, lr = -optimizer.learning_rate_power, optimizer.initial_accumulator_value, optimizer.learning_rate
    accumulator = a0 + g ** 2
    sigma = (accumulator ** p - a0 ** p) / lr
    linear = g - sigma * w
    return -linear / (accumulator ** p / lr), {"accumulators": accumulator, "linears": linear}


@pytest.mark.parametrize("optimizer", [ec.Adagrad(0.1, initial_accumulator_value=0.5),
                                       ec.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, exponent=3.0),
                                       ec.FTRL(0.1, learning_rate_power=-0.5, initial_accumulator_value=0.2)],
                         ids=["adagrad", "adagrad-momentum", "ftrl"])
def test_first_step_is_tensorflows_test_formula(optimizer):
    table = ec.TableConfig(5, 3, name="video", combiner="sum", initializer=ec.RandomUniform(-1, 1, seed=2))
    emb = ec.Embedding({"watched": ec.FeatureConfig(table)}, optimizer)
    before = emb.embedding_tables["video"].astype(np.float64)
    ids = np.array([0, 3, 0, 1, 3, 3])
    grads = np.random.default_rng(4).normal(size=(6, 3)).astype(np.float32)
    _, ctx = emb({"watched": ids})
    emb.apply_gradients({"watched": grads}, ctx)
    g = np.zeros((5, 3))
    np.add.at(g, ids, grads.astype(np.float64))
    touched = np.isin(np.arange(5), ids)
    expected, slots = _tf_first_step(optimizer, before, g)
    np.testing.assert_allclose(emb.embedding_tables["video"][touched], expected[touched], rtol=5e-5, atol=1e-6)
    for name, values in slots.items():
        np.testing.assert_allclose(emb.slot_variables["video"][name][touched], values[touched], rtol=5e-4, atol=1e-6)


def test_bias_correction_is_tensorflows_learning_rate_callable():
    """TensorFlow's users fold the correction into a learning-rate callable (optimization_parameters.proto:
    "user learning_rate * sqrt(1 - beta2^t) / (1 - beta1^t)"); ``bias_correction=True`` is that callable."""
    b1, b2 = 0.8, 0.9
    engines = {}

    def corrected_rate():
        t = engines["callable"].step + 1
        return 0.05 * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)

    for kind, adam in (("callable", ec.Adam(corrected_rate, beta_1=b1, beta_2=b2)),
                       ("option", ec.Adam(0.05, beta_1=b1, beta_2=b2, bias_correction=True))):
        table = ec.TableConfig(9, 4, name="t", initializer=ec.RandomUniform(-1, 1, seed=5))
        engines[kind] = ec.Embedding({"f": ec.FeatureConfig(table)}, adam)
    rng = np.random.default_rng(1)
    for _ in range(4):
        ids = rng.integers(0, 9, (5, 2))
        grads = rng.normal(size=(5, 4)).astype(np.float32)
        for emb in engines.values():
            _, ctx = emb({"f": ids})
            emb.apply_gradients({"f": grads}, ctx)
    np.testing.assert_allclose(engines["callable"].embedding_tables["t"], engines["option"].embedding_tables["t"],
                               rtol=1e-6, atol=1e-7)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(beta_1=st.floats(0.0, 0.99), beta_2=st.floats(0.0, 0.999), epsilon=st.floats(1e-6, 1e-1),
       sum_inside_sqrt=st.booleans(), bias_correction=st.booleans(), lazy=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_adam_every_form_matches_the_oracle(beta_1, beta_2, epsilon, sum_inside_sqrt, bias_correction, lazy, seed):
    adam = ec.Adam(0.05, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, sum_inside_sqrt=sum_inside_sqrt,
                   bias_correction=bias_correction, lazy_adam=lazy)
    params = dict(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, sum_inside_sqrt=sum_inside_sqrt,
                  bias_correction=bias_correction)
    run = NoneGradientRun(adam, (ref.adam, params, 0.05, lazy), np.random.default_rng(seed))
    for _ in range(3):
        run.step(none_probability=0.0)


def test_adam_equality_hash_and_repr_know_bias_correction():
    assert ec.Adam(0.1) == ec.Adam(0.1, bias_correction=False) and hash(ec.Adam(0.1)) == hash(ec.Adam(0.1))
    assert ec.Adam(0.1) != ec.Adam(0.1, bias_correction=True)
    assert hash(ec.Adam(0.1)) != hash(ec.Adam(0.1, bias_correction=True))
    assert "bias_correction=True" in repr(ec.Adam(0.1, bias_correction=True))
    # Unequal optimizers never share a physical table.
    a = ec.TableConfig(4, 2, name="a", optimizer=ec.Adam(0.1))
    b = ec.TableConfig(4, 2, name="b", optimizer=ec.Adam(0.1, bias_correction=True))
    assert ec.Embedding([ec.FeatureConfig(a), ec.FeatureConfig(b)]).num_physical_tables == 2
    with pytest.raises(ValueError, match="Adam: bias_correction must be True or False; got 'yes'"):
        ec.Adam(bias_correction="yes")


def _drop_bias_correction(text):
    """A manifest as an embedcore from before ``bias_correction`` wrote it: no such argument anywhere."""
    def strip(node):
        if isinstance(node, dict):
            if node.get("optimizer") == "Adam":
                node["args"].pop("bias_correction")
            for v in node.values():
                strip(v)
        elif isinstance(node, list):
            for v in node:
                strip(v)
    manifest = json.loads(text)
    strip(manifest["config"])
    return json.dumps(manifest)


def test_a_checkpoint_from_before_the_option_is_read_as_bias_corrected(tmp_path):
    """Checkpoints written before ``bias_correction`` existed were trained with the corrected rate: they
    restore as ``bias_correction=True``, load strictly into such an engine, continue as it would, and are
    refused (strictly) by an engine of TensorFlow's form."""
    def engine(adam):
        big = ec.TableConfig(12, 3, name="big", optimizer=adam)
        small = ec.TableConfig(5, 3, name="small")
        return ec.Embedding({"a": ec.FeatureConfig(big), "b": ec.FeatureConfig(small)}, adam, seed=4)

    def step(emb, rng):
        ids = {"a": rng.integers(0, 12, (4, 2)), "b": rng.integers(0, 5, (4, 1))}
        acts, ctx = emb(ids)
        emb.apply_gradients({k: rng.normal(size=v.shape).astype(np.float32) for k, v in acts.items()}, ctx)

    corrected = ec.Adam(0.1, bias_correction=True)
    emb = engine(corrected)
    rng = np.random.default_rng(3)
    for _ in range(2):
        step(emb, rng)
    emb.save(tmp_path / "ckpt")
    rewrite_manifest(tmp_path / "ckpt", _drop_bias_correction)
    restored = ec.Embedding.restore(tmp_path / "ckpt")
    assert restored.optimizer == corrected and restored.tables["big"].optimizer == corrected
    loaded = engine(ec.Adam(0.1, bias_correction=True))
    loaded.load(tmp_path / "ckpt")  # strict: the old configuration reads as equal
    with pytest.raises(CheckpointError, match="bias_correction"):
        engine(ec.Adam(0.1)).load(tmp_path / "ckpt")
    for other in (restored, loaded):
        state = np.random.default_rng(9)
        step(other, state)
    step(emb, np.random.default_rng(9))
    for other in (restored, loaded):
        for name, table in emb.embedding_tables.items():
            np.testing.assert_array_equal(other.embedding_tables[name], table)


# ----------------------------------------------------------------------------------------------------------
# None gradients: no update for that feature.

class NoneGradientRun:
    """An engine and the NumPy oracle stepped side by side, with a random set of features' gradients None.

    Features: ``a`` (pooled) and ``s`` (a sequence of 3) on table ``big``, ``c`` on ``tiny`` (2 ids of a
    vocabulary of 3, so ids repeat); the oracle sums only the features with a gradient and touches only
    their rows; when every gradient is None nothing changes.
    """

    FEATURES = (("a", "big", 0), ("s", "big", 3), ("c", "tiny", 0))

    def __init__(self, optimizer, update, rng, stack=True, engine=None):
        big = ec.TableConfig(20, 4, name="big", combiner="mean")
        tiny = ec.TableConfig(3, 4, name="tiny", combiner="sqrtn", initializer=ec.RandomUniform(-0.5, 0.5))
        self.emb = engine or ec.Embedding({"a": ec.FeatureConfig(big),
                                           "s": ec.FeatureConfig(big, max_sequence_length=3),
                                           "c": ec.FeatureConfig(tiny)}, optimizer, stack_tables=stack)
        self.update, self.rng = update, rng
        self.tables = {n: t.astype(np.float64) for n, t in self.emb.embedding_tables.items()}
        self.slots = {n: [s.astype(np.float64) for s in d.values()] for n, d in self.emb.slot_variables.items()}

    def step(self, none_probability=0.5, without=None, form="ragged"):
        rng, emb = self.rng, self.emb
        configs = emb.tables
        batch, weights, samples = {}, {}, {}
        for name, table, seq_len in self.FEATURES:
            vocab = configs[table].vocabulary_size
            s = random_samples(rng, 7, vocab, 4, hot=rng.integers(0, vocab, 2))
            w = random_weights(rng, s)
            samples[name] = (s, w, seq_len, table)
            batch[name], weights[name] = as_input(s, w, form)
        if without is None:
            without = {name for name, _, _ in self.FEATURES if rng.random() < none_probability}
        acts, ctx = emb(batch, weights)
        grads = {name: None if name in without else rng.normal(size=act.shape).astype(np.float32)
                 for name, act in acts.items()}
        step_before = emb.step
        emb.apply_gradients(grads, ctx)
        assert emb.step == step_before + 1
        dense = {n: [np.zeros_like(t), np.zeros(t.shape[0], bool)] for n, t in self.tables.items()}
        for name, (s, w, seq_len, table) in samples.items():
            if grads[name] is not None:
                cfg = configs[table]
                ref.dense_gradient(cfg.vocabulary_size, cfg.dim, s, w, cfg.combiner, seq_len,
                                   grads[name].astype(np.float64), dense[table][0])
                ref.touched_rows(cfg.vocabulary_size, s, seq_len, dense[table][1])
        if len(without) < len(self.FEATURES):
            update, params, lr, lazy = self.update
            for table, (g, touched) in dense.items():
                self.tables[table], self.slots[table] = ref.apply(update, g, self.tables[table], self.slots[table],
                                                                  touched, lr, params, emb.step, lazy)
        for table in self.tables:
            np.testing.assert_allclose(emb.embedding_tables[table], self.tables[table], rtol=2e-5, atol=2e-5,
                                       err_msg=f"table {table} at step {emb.step}, without {sorted(without)}")
            for (slot, values), expected in zip(emb.slot_variables[table].items(), self.slots[table]):
                np.testing.assert_allclose(values, expected, rtol=2e-5, atol=2e-5,
                                           err_msg=f"slot {table}/{slot} at step {emb.step}")


NONE_CASES = {
    "sgd": (ec.SGD(0.3), (ref.sgd, {}, 0.3, True)),
    "adagrad": (ec.Adagrad(0.2, initial_accumulator_value=0.3), (ref.adagrad, {}, 0.2, True)),
    "adam": (ec.Adam(0.05, beta_1=0.5, beta_2=0.7), (ref.adam, dict(beta_1=0.5, beta_2=0.7), 0.05, True)),
    "adam-non-lazy-corrected": (ec.Adam(0.05, lazy_adam=False, bias_correction=True),
                                (ref.adam, dict(bias_correction=True), 0.05, False)),
    "ftrl-decay": (ec.FTRL(0.5, l1_regularization_strength=0.05, initial_accumulator_value=0.2,
                           weight_decay_factor=0.1),
                   (ref.ftrl, dict(l1=0.05, weight_decay=0.1), 0.5, True)),
}


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "apart"])
@pytest.mark.parametrize("case", sorted(NONE_CASES))
def test_none_gradients_match_the_oracle(case, stack):
    optimizer, update = NONE_CASES[case]
    run = NoneGradientRun(optimizer, update, np.random.default_rng(abs(hash(case)) % 997), stack=stack)
    for without, form in ((set(), "ragged"), ({"a"}, "sparse"), ({"s"}, "lists"), ({"a", "s"}, "ragged"),
                          ({"c"}, "sparse"), ({"a", "s", "c"}, "ragged"), ({"a", "c"}, "lists")):
        run.step(without=without, form=form)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 20), probability=st.sampled_from([0.3, 0.7]))
def test_none_gradients_at_random_match_the_oracle(seed, probability):
    optimizer, update = NONE_CASES["adam"]
    run = NoneGradientRun(optimizer, update, np.random.default_rng(seed))
    for _ in range(3):
        run.step(none_probability=probability)


def test_a_row_looked_up_only_by_a_feature_without_gradient_is_not_touched():
    """A lazy Adam changes a row even for a zero gradient (its moments decay, its weights move); a None
    gradient touches nothing, while the same row looked up by a feature with a gradient is updated."""
    table = ec.TableConfig(10, 2, name="t", combiner="sum")
    emb = ec.Embedding({"a": ec.FeatureConfig(table), "b": ec.FeatureConfig(table)}, ec.Adam(0.1))
    _, ctx = emb({"a": np.array([1, 2]), "b": np.array([3, 4])})
    emb.apply_gradients({"a": np.ones((2, 2), np.float32), "b": np.ones((2, 2), np.float32)}, ctx)
    snap = snapshot(emb)
    _, ctx = emb({"a": np.array([1, 4]), "b": np.array([3, 4])})
    emb.apply_gradients({"a": None, "b": np.zeros((2, 2), np.float32)}, ctx)
    changed = np.flatnonzero((emb.embedding_tables["t"] != snap[0]["t"]).any(1))
    assert changed.tolist() == [3, 4]  # b's rows (4 also a's), by a zero gradient; row 1, only a's, untouched


def test_every_gradient_none_changes_no_row_and_advances_step():
    calls = []

    def lr():
        calls.append(1)
        return 0.1

    big = ec.TableConfig(6, 2, name="big")
    other = ec.TableConfig(4, 2, name="other", optimizer=ec.Adam(0.1, lazy_adam=False))
    emb = ec.Embedding({"a": ec.FeatureConfig(big), "b": ec.FeatureConfig(other)}, ec.SGD(lr))
    acts, ctx = emb({"a": np.array([1, 2]), "b": np.array([0, 3])})
    tables, slots, step = snapshot(emb)
    report = emb.apply_gradients({"a": None, "b": None}, ctx)
    assert_unchanged(emb, (tables, slots, step + 1))
    assert report.step == emb.step == 1 and len(calls) == 1
    with pytest.raises(ec.InputError, match="already applied"):
        emb.apply_gradients(acts, ctx)


def test_a_none_gradient_keeps_checking_the_others():
    table = ec.TableConfig(6, 2, name="t")
    emb = ec.Embedding({"a": ec.FeatureConfig(table), "b": ec.FeatureConfig(table)}, ec.SGD(0.1))
    _, ctx = emb({"a": np.array([1, 2]), "b": np.array([0, 3])})
    snap = snapshot(emb)
    with pytest.raises(ec.InputError, match="gradient of feature 'b' has shape"):
        emb.apply_gradients({"a": None, "b": np.ones((3, 2), np.float32)}, ctx)
    with pytest.raises(ec.InputError, match="gradient of feature 'b' holds nan"):
        emb.apply_gradients({"a": None, "b": np.full((2, 2), np.nan, np.float32)}, ctx)
    assert_unchanged(emb, snap)


# ----------------------------------------------------------------------------------------------------------
# Lookup-only engines (TensorFlow's TPUEmbedding(optimizer=None)).

def _lookup_only_engine(**kwargs):
    video = ec.TableConfig(8, 4, name="video", combiner="sum", initializer=ec.RandomUniform(-1, 1, seed=1))
    user = ec.TableConfig(16, 2, name="user", combiner="mean", initializer=ec.RandomUniform(-1, 1, seed=2))
    features = (ec.FeatureConfig(video, name="watched"), ec.FeatureConfig(video, name="favorited"),
                ec.FeatureConfig(user, name="friends"))
    return ec.Embedding(features, None, **kwargs)


def test_lookup_only_engine_looks_up_and_has_no_slots():
    """TensorFlow's ``test_cpu_no_optimizer``: only the parameters, no slot variables."""
    emb = _lookup_only_engine()
    assert emb.lookup_only and emb.optimizer is None
    assert emb.slot_variables == {"video": {}, "user": {}}
    assert "lookup-only" in repr(emb)
    samples = [[[0], [0, 1], [0, 1], [1]], [[0, 1], [1], [0], [0, 1]], [[3], [0, 1, 2], [3], [0, 1, 2]]]
    acts, _ = emb(tuple(ec.Ragged.from_lists(s, np.int64) for s in samples))
    for act, s, (table, combiner) in zip(acts, samples, (("video", "sum"), ("video", "sum"), ("user", "mean"))):
        expected = ref.lookup(emb.embedding_tables[table].astype(np.float64), s, [[1.0] * len(x) for x in s],
                              combiner, 0)
        np.testing.assert_allclose(act, expected, rtol=1e-6)


def test_lookup_only_apply_gradients_raises_runtime_error_and_changes_nothing():
    emb = _lookup_only_engine()
    acts, ctx = emb(tuple(np.array([0, 1]) for _ in range(3)))
    snap = snapshot(emb)
    with pytest.raises(RuntimeError, match=r"apply_gradients is not valid on a lookup-only Embedding.*"
                                           r"optimizer=None.*\['user', 'video'\]"):
        emb.apply_gradients(acts, ctx)
    assert_unchanged(emb, snap)


def test_lookup_only_engine_saves_loads_restores_and_copies(tmp_path):
    import copy
    import pickle
    emb = _lookup_only_engine(seed=5)
    ids = (np.array([[0, 7]]), np.array([[3, 3]]), np.array([[15, 0]]))
    acts, _ = emb(ids)
    emb.save(tmp_path / "ckpt")
    restored = ec.Embedding.restore(tmp_path / "ckpt")
    other = _lookup_only_engine(seed=9)
    other.load(tmp_path / "ckpt")
    for engine in (restored, other, copy.deepcopy(emb), pickle.loads(pickle.dumps(emb))):
        assert engine.lookup_only
        for a, b in zip(engine(ids)[0], acts):
            np.testing.assert_array_equal(a, b)
    served = ec.ServingEmbedding(tmp_path / "ckpt")
    for a, b in zip(served(ids), acts):  # serving returns the activations alone
        np.testing.assert_array_equal(a, b)
    # A trained engine's checkpoint (slots and all) does not load into a lookup-only one, strict or not.
    trained = ec.Embedding(emb.feature_config, ec.Adagrad(0.1))
    trained.save(tmp_path / "trained")
    for strict in (True, False):
        with pytest.raises(CheckpointError):
            _lookup_only_engine().load(tmp_path / "trained", strict=strict)


def test_some_tables_with_an_optimizer_and_some_without_are_refused():
    trained = ec.TableConfig(4, 2, name="trained", optimizer=ec.SGD(0.1))
    frozen = ec.TableConfig(4, 2, name="frozen")
    with pytest.raises(ValueError, match=r"table 'frozen' has no optimizer while table\(s\) \['trained'\] have one"):
        ec.Embedding({"a": ec.FeatureConfig(trained), "b": ec.FeatureConfig(frozen)})
    other = ec.TableConfig(4, 2, name="other")
    with pytest.raises(ValueError, match=r"tables \['frozen', 'other'\] have no optimizer while"):
        ec.Embedding({"a": ec.FeatureConfig(trained), "b": ec.FeatureConfig(frozen), "c": ec.FeatureConfig(other)})
    # The engine's optimizer serves the tables without their own: an ordinary trained engine.
    emb = ec.Embedding({"a": ec.FeatureConfig(trained), "b": ec.FeatureConfig(frozen)}, ec.Adagrad(0.1))
    assert not emb.lookup_only and list(emb.slot_variables["frozen"]) == ["accumulators"]


# ----------------------------------------------------------------------------------------------------------
# Optimizer arguments as TensorFlow's tpu_embedding_v2_utils_test checks them.

OPTIMIZERS = [ec.SGD, ec.Adagrad, ec.Adam, ec.FTRL]


@pytest.mark.parametrize("optimizer", [ec.Adagrad, ec.Adam, ec.FTRL])
def test_grad_clip_with_accumulation_off(optimizer):
    with pytest.raises(ValueError, match="accumulation"):
        optimizer(use_gradient_accumulation=False, clipvalue=0.0)
    with pytest.raises(ValueError, match="accumulation"):
        optimizer(use_gradient_accumulation=False, clipvalue=(None, 1.0))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_grad_clip_with_tuple_single_value_and_none(optimizer):
    opt = optimizer(clipvalue=(-1.0, 1.0))
    assert (opt.clip_gradient_min, opt.clip_gradient_max) == (-1.0, 1.0)
    opt = optimizer(clipvalue=1.0)
    assert (opt.clip_gradient_min, opt.clip_gradient_max) == (-1.0, 1.0)
    opt = optimizer(clipvalue=(None, 1))
    assert opt.clip_gradient_min is None and opt.clip_gradient_max == 1.0


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_equal_and_hash_function(optimizer):
    assert optimizer(0.1) == optimizer(0.1) and hash(optimizer(0.1)) == hash(optimizer(0.1))
    assert optimizer(0.1) != optimizer(0.2) and hash(optimizer(0.1)) != hash(optimizer(0.2))


def test_variable_learning_rate():
    """TensorFlow's ``test_variable_learning_rate``: an SGD learning rate read from a step counter each step
    (1.0, 0.95, ... down to 0.5); with a gradient of one, row 0 holds minus the partial sums of the rates."""
    counter = {"step": 0.0}

    def lr_function():
        return max(0.5, 1.0 + (0.5 - 1.0) * counter["step"] / 10.0)

    table = ec.TableConfig(1, 4, name="table", combiner="sum", initializer=ec.Constant(0.0))
    emb = ec.Embedding({"feature": ec.FeatureConfig(table, name="feature")}, ec.SGD(learning_rate=lr_function))
    results = []
    for _ in range(10):
        acts, ctx = emb({"feature": np.zeros((1, 1), np.int32)})
        results.append(acts["feature"].copy())
        emb.apply_gradients({"feature": np.ones_like(acts["feature"])}, ctx)
        counter["step"] += 1.0
    rates = [1.0 - 0.5 / 10 * j for j in range(10)]
    goldens = [[[-sum(rates[:j])] * 4] for j in range(10)]
    np.testing.assert_allclose(results, goldens, rtol=1e-6, atol=1e-6)


def test_unsupported_optimizer_class():
    """TensorFlow's ``test_unsupported_optimizer``: ``ValueError``, "is an unsupported optimizer class"."""
    table = ec.TableConfig(4, 2, name="t")

    class NotAnOptimizer:
        learning_rate = 0.1

    for bad in (NotAnOptimizer(), "adagrad"):
        with pytest.raises(ValueError, match="is an unsupported optimizer class"):
            ec.Embedding({"a": ec.FeatureConfig(table)}, bad)


# ----------------------------------------------------------------------------------------------------------
# The sharded engine: None gradients and lookup-only engines over MPI ranks.

WORKERS = os.path.join(os.path.dirname(__file__), "workers")


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_none_gradients_and_lookup_only(world, tmp_path):
    pytest.importorskip("mpi4py", reason="needs the mpi extra: pip install 'embedcore[mpi]'")
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpi4py is installed but no mpiexec was found")
    sys.path.insert(0, WORKERS)
    import none_gradients as worker
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                      os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "tables.npz"
    proc = subprocess.run([mpiexec, "-n", str(world), sys.executable, os.path.join(WORKERS, "none_gradients.py"),
                           str(out)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["step"] == worker.STEPS
    if world > 1:  # None for different features on different ranks
        assert facts["mismatch"] == "refused" and facts["unchanged"] and facts["step_after_refusal"] == worker.STEPS
    assert facts["lookup_only"].startswith("RuntimeError: apply_gradients is not valid on a lookup-only "
                                           "ShardedEmbedding")
    assert facts["restored_lookup_only"] and facts["restored_equal"]
    # One process fed the whole batches, with None for the same features, holds the same tables.
    one = ec.Embedding(worker.features(), seed=3)
    for (ids, grads), without in zip(worker.batches(world), worker.WITHOUT):
        _, ctx = one.lookup(ids)
        one.apply_gradients({k: None if k in without else v for k, v in grads.items()}, ctx)
    stored = np.load(out)
    for name, table in one.embedding_tables.items():
        np.testing.assert_allclose(stored[f"{name}/weights"], table, rtol=1e-5, atol=1e-6, err_msg=name)
        for slot, values in one.slot_variables[name].items():
            np.testing.assert_allclose(stored[f"{name}/{slot}"], values, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}/{slot}")
