"""Every built-in optimizer and option, and custom computations, against the NumPy oracle."""

import itertools

import numpy as np
import pytest

import embedcore as ec
from embedcore.kernels.update import update_kernel
from embedcore.app.quickstart import custom_adagrad, custom_sgd

from . import reference as ref
from .harness import OracleRun

# (embedcore optimizer, oracle update, oracle params, learning rate, lazy)
CASES = {
    "sgd": (ec.SGD(0.3), ref.sgd, {}, 0.3, True),
    "sgd-options": (ec.SGD(0.3, clipvalue=0.5, clip_weight_min=-0.2, clip_weight_max=0.25, weight_decay_factor=0.1),
                    ref.sgd, dict(clip_min=-0.5, clip_max=0.5, w_min=-0.2, w_max=0.25, weight_decay=0.1), 0.3, True),
    "adagrad": (ec.Adagrad(0.2, initial_accumulator_value=0.3), ref.adagrad, {}, 0.2, True),
    "adagrad-options": (ec.Adagrad(0.2, clipvalue=(-0.3, None), weight_decay_factor=0.5,
                                   multiply_weight_decay_factor_by_learning_rate=True, clip_weight_max=0.1),
                        ref.adagrad, dict(clip_min=-0.3, weight_decay=0.5, decay_by_lr=True, w_max=0.1), 0.2, True),
    "adagrad-momentum": (ec.AdagradMomentum(0.1, momentum=0.9), ref.adagrad_momentum, dict(momentum=0.9), 0.1, True),
    "adagrad-momentum-nesterov": (
        ec.AdagradMomentum(0.1, momentum=0.8, use_nesterov=True, exponent=3, beta2=0.95, epsilon=1e-3),
        ref.adagrad_momentum, dict(momentum=0.8, nesterov=True, exponent=3, beta2=0.95, epsilon=1e-3), 0.1, True),
    "adam": (ec.Adam(0.05), ref.adam, {}, 0.05, True),
    "adam-outside-sqrt": (ec.Adam(0.05, beta_1=0.8, beta_2=0.9, epsilon=1e-3, sum_inside_sqrt=False, clipvalue=1.0),
                          ref.adam, dict(beta_1=0.8, beta_2=0.9, epsilon=1e-3, sum_inside_sqrt=False,
                                         clip_min=-1.0, clip_max=1.0), 0.05, True),
    "adam-non-lazy": (ec.Adam(0.05, lazy_adam=False), ref.adam, {}, 0.05, False),
    "adam-bias-corrected": (ec.Adam(0.05, bias_correction=True), ref.adam, dict(bias_correction=True), 0.05, True),
    "adam-bias-corrected-non-lazy": (ec.Adam(0.05, beta_1=0.7, beta_2=0.8, lazy_adam=False, bias_correction=True),
                                     ref.adam, dict(beta_1=0.7, beta_2=0.8, bias_correction=True), 0.05, False),
    "ftrl": (ec.FTRL(0.5, initial_accumulator_value=0.2), ref.ftrl, {}, 0.5, True),
    "ftrl-regularized": (ec.FTRL(0.5, learning_rate_power=-0.6, l1_regularization_strength=0.05,
                                 l2_regularization_strength=0.1, beta=0.3, initial_accumulator_value=0.2),
                         ref.ftrl, dict(learning_rate_power=-0.6, l1=0.05, l2=0.1, beta=0.3), 0.5, True),
    "ftrl-multiply-linear": (ec.FTRL(0.5, l1_regularization_strength=0.05, l2_regularization_strength=0.1, beta=0.3,
                                     multiply_linear_by_learning_rate=True, initial_accumulator_value=0.2),
                             ref.ftrl, dict(l1=0.05, l2=0.1, beta=0.3, multiply_linear_by_lr=True), 0.5, True),
    "rowwise-adagrad": (ec.RowwiseAdagrad(0.2), ref.rowwise_adagrad, {}, 0.2, True),
    "rowwise-adagrad-options": (ec.RowwiseAdagrad(0.2, initial_accumulator_value=0.0, epsilon=1e-2, clipvalue=0.4,
                                                  weight_decay_factor=0.05, clip_weight_min=-0.3),
                                ref.rowwise_adagrad, dict(epsilon=1e-2, clip_min=-0.4, clip_max=0.4,
                                                          weight_decay=0.05, w_min=-0.3), 0.2, True),
}


def _engine(optimizer, combiner="mean", vocab=(40, 7), dim=5, stack=True, seed=3):
    big = ec.TableConfig(vocab[0], dim, combiner=combiner, name="big")
    tiny = ec.TableConfig(vocab[1], dim, combiner="sqrtn", name="tiny", initializer=ec.RandomUniform(-0.5, 0.5))
    features = {"a": ec.FeatureConfig(big), "b": ec.FeatureConfig(big, max_sequence_length=3),
                "c": ec.FeatureConfig(tiny)}
    return ec.Embedding(features, optimizer, seed=seed, stack_tables=stack), \
        [("a", "big", 0), ("b", "big", 3), ("c", "tiny", 0)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_builtin_matches_reference(case):
    optimizer, update, params, lr, lazy = CASES[case]
    emb, features = _engine(optimizer)
    run = OracleRun(emb, features, {"big": (update, params, lr, lazy), "tiny": (update, params, lr, lazy)},
                    np.random.default_rng(abs(hash(case)) % 1000))
    for form in ("ragged", "lists", "sparse"):
        run.step(form=form)
    run.step(weighted=False)


def test_untouched_rows_never_change():
    emb, _ = _engine(ec.Adam(0.1))
    before = {k: v.copy() for k, v in emb.embedding_tables.items()}
    acts, ctx = emb({"a": np.array([1, 3]), "b": [[3, 5], []], "c": np.array([[0], [0]])})
    emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    big = emb.embedding_tables["big"]
    changed = np.flatnonzero((big != before["big"]).any(axis=1))
    assert changed.tolist() == [1, 3, 5]
    assert np.flatnonzero((emb.embedding_tables["tiny"] != before["tiny"]).any(axis=1)).tolist() == [0]


def test_non_lazy_adam_moves_untouched_rows():
    emb, _ = _engine(ec.Adam(0.1, lazy_adam=False))
    for _ in range(2):
        acts, ctx = emb({"a": np.array([1]), "b": [[2]], "c": np.array([[0]])})
        emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    momenta = emb.slot_variables["big"]["momenta"]
    assert np.all(momenta[1] != 0) and np.all(momenta[10] == 0)
    # Step 2 gave row 1 a zero gradient: its momentum decayed by beta_1 from step 1's (1 - beta_1) * g.
    acts, ctx = emb({"a": np.array([7]), "b": [[]], "c": np.array([[0]])})
    m1 = momenta[1].copy()
    w1 = emb.embedding_tables["big"][1].copy()
    emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    np.testing.assert_allclose(momenta[1], 0.9 * m1, rtol=1e-6)
    assert np.all(emb.embedding_tables["big"][1] != w1)


# ----------------------------------------------------------------------------------------------------------
# TensorFlow's documented custom computations.

# The quickstart holds them exactly as TensorFlow documents them (del statements included).
tf_doc_sgd, tf_doc_adagrad = custom_sgd, custom_adagrad


def test_tensorflow_documented_custom_computations_global_and_override():
    custom_sgd = ec.CustomOptimizer(tf_doc_sgd, learning_rate=1.0)
    custom_adagrad = ec.CustomOptimizer(tf_doc_adagrad, learning_rate=1.0, slot_names=["accumulators"],
                                        slot_initializers=[ec.Constant(0.1)])
    video = ec.TableConfig(30, 4, name="video", combiner="sum")
    user = ec.TableConfig(20, 4, name="user", optimizer=custom_adagrad)
    features = {"watched": ec.FeatureConfig(video), "favorite": ec.FeatureConfig(video),
                "user": ec.FeatureConfig(user)}
    emb = ec.Embedding(features, optimizer=custom_sgd)
    assert emb.slot_variables["video"] == {}
    np.testing.assert_array_equal(emb.slot_variables["user"]["accumulators"], np.float32(0.1))
    run = OracleRun(emb, [("watched", "video", 0), ("favorite", "video", 0), ("user", "user", 0)],
                    {"video": (ref.sgd, {}, 1.0, True), "user": (ref.adagrad, {}, 1.0, True)},
                    np.random.default_rng(0))
    for _ in range(4):
        run.step(atol=1e-4, rtol=1e-4)
    assert emb.step == 4


def test_custom_adagrad_equals_builtin_adagrad():
    custom = ec.CustomOptimizer(tf_doc_adagrad, learning_rate=0.2, slot_names=["accumulators"],
                                slot_initializers=[0.3])
    results = []
    for optimizer in (custom, ec.Adagrad(0.2, initial_accumulator_value=0.3)):
        emb, features = _engine(optimizer)
        rng = np.random.default_rng(11)
        run = OracleRun(emb, features, {}, rng)
        for _ in range(3):
            run.step()
        results.append((emb.embedding_tables, emb.slot_variables))
    for name in ("big", "tiny"):
        np.testing.assert_allclose(results[0][0][name], results[1][0][name], atol=1e-6, rtol=0)
        np.testing.assert_allclose(results[0][1][name]["accumulators"], results[1][1][name]["accumulators"],
                                   atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# Both kernel paths: element-wise inlined and per row.

def reducing_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Adagrad with a row-mean term: reduces over the row, so it must run per row."""
    accumulator = slot_variables[0] + gradient * gradient + hyperparameters[0] * np.mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator


def scalar_slot_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + np.mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator


def test_reducing_function_runs_per_row_and_matches_reference():
    optimizer = ec.CustomOptimizer(reducing_adagrad, 0.2, ["accumulators"], [0.1], hyperparameters=[0.5])
    assert not optimizer.compiled(5).elementwise
    assert "mean" in optimizer.compiled(5).reason

    def oracle(g, w, slots, lr, p, step):
        a = slots[0] + g ** 2 + 0.5 * (g ** 2).mean(axis=1, keepdims=True)
        return w - lr * g / np.sqrt(a), [a]

    emb, features = _engine(optimizer)
    run = OracleRun(emb, features, {"big": (oracle, {}, 0.2, True), "tiny": (oracle, {}, 0.2, True)},
                    np.random.default_rng(5))
    for _ in range(3):
        run.step()


def test_scalar_slot_custom_rowwise_matches_builtin_reference():
    optimizer = ec.CustomOptimizer(scalar_slot_rowwise, 0.2, ["accumulators"], [0.1], slot_dims=[1])
    emb, features = _engine(optimizer)
    assert emb.slot_variables["big"]["accumulators"].shape == (40,)
    run = OracleRun(emb, features, {"big": (ref.rowwise_adagrad, {}, 0.2, True),
                                    "tiny": (ref.rowwise_adagrad, {}, 0.2, True)}, np.random.default_rng(6))
    for _ in range(3):
        run.step()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "ftrl", "adagrad-momentum-nesterov"])
def test_elementwise_and_per_row_kernels_agree(name):
    """The same element-wise function, run through both kernel paths, gives the same tables and slots."""
    optimizer = CASES[name][0]
    compiled = optimizer.compiled(6)
    assert compiled.elementwise, compiled.reason
    from dataclasses import replace
    per_row = replace(compiled, elementwise=False)
    rng = np.random.default_rng(2)
    table = rng.normal(size=(30, 6)).astype(np.float32)
    slots = tuple(np.abs(rng.normal(size=(30, 6))).astype(np.float32) + 0.1 for _ in compiled.slot_dims)
    uniq = np.array([0, 3, 4, 17, 29], np.int64)
    grads = rng.normal(size=(5, 6)).astype(np.float32)
    lr, hyper = optimizer.step_values(3)
    outputs = []
    for variant in (compiled, per_row):
        t, s = table.copy(), tuple(x.copy() for x in slots)
        n = uniq.shape[0]  # one occurrence per unique row, gain 1: the summed gradient of uniq[u] is grads[u]
        update_kernel(variant)(t, s, uniq, np.arange(n + 1), np.arange(n), np.arange(n), np.ones(n, np.float32),
                               grads, lr, hyper, np.zeros(n, np.uint8))
        outputs.append((t, s))
    np.testing.assert_allclose(outputs[0][0], outputs[1][0], rtol=1e-6, atol=1e-7)
    for a, b in zip(outputs[0][1], outputs[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    untouched = np.setdiff1d(np.arange(30), uniq)
    np.testing.assert_array_equal(outputs[0][0][untouched], table[untouched])


def test_stacking_gives_bit_identical_results():
    results = []
    for stack in (True, False):
        emb, features = _engine(ec.Adagrad(0.1), stack=stack)
        assert emb.num_physical_tables == (1 if stack else 2)
        run = OracleRun(emb, features, {}, np.random.default_rng(9))
        for _ in range(3):
            run.step()
        results.append(emb)
    for name in ("big", "tiny"):
        np.testing.assert_array_equal(results[0].embedding_tables[name], results[1].embedding_tables[name])
        np.testing.assert_array_equal(results[0].slot_variables[name]["accumulators"],
                                      results[1].slot_variables[name]["accumulators"])


def test_callables_are_evaluated_once_per_apply_gradients():
    calls = {"lr": 0, "h": 0}

    def lr():
        calls["lr"] += 1
        return 0.1 * calls["lr"]

    def h():
        calls["h"] += 1
        return 0.0

    def fn(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient + hyperparameters[0]

    emb, _ = _engine(ec.CustomOptimizer(fn, learning_rate=lr, hyperparameters=[h]))
    before = emb.embedding_tables["big"][2].copy()
    for step in (1, 2):
        acts, ctx = emb({"a": np.array([2]), "b": [[]], "c": np.array([[1]])})
        emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
        assert calls == {"lr": step, "h": step}
    # learning rates 0.1 then 0.2, gradient 1 (one id, mean combiner)
    np.testing.assert_allclose(emb.embedding_tables["big"][2], before - 0.3, rtol=1e-6)


def test_equal_optimizers_share_a_physical_table_and_distinct_ones_do_not():
    a = ec.TableConfig(10, 4, name="a", optimizer=ec.Adagrad(0.1))
    b = ec.TableConfig(10, 4, name="b", optimizer=ec.Adagrad(0.1))
    c = ec.TableConfig(10, 4, name="c", optimizer=ec.Adagrad(0.2))
    d = ec.TableConfig(10, 8, name="d", optimizer=ec.Adagrad(0.1))
    emb = ec.Embedding([ec.FeatureConfig(t) for t in (a, b, c, d)])
    assert emb.num_physical_tables == 3
    assert set(emb.embedding_tables) == {"a", "b", "c", "d"}


@pytest.mark.parametrize("combiner,weighted", list(itertools.product(["sum", "mean", "sqrtn"], [True, False])))
def test_every_combiner_through_a_training_step(combiner, weighted):
    emb, features = _engine(ec.SGD(0.5), combiner=combiner)
    run = OracleRun(emb, features, {"big": (ref.sgd, {}, 0.5, True), "tiny": (ref.sgd, {}, 0.5, True)},
                    np.random.default_rng(7))
    run.step(weighted=weighted)
    run.step(weighted=weighted, form="sparse")


def test_a_learning_rate_callable_is_called_once_even_when_weight_decay_uses_it():
    calls = []

    def lr():
        calls.append(1)
        return 0.1
    opt = ec.Adam(lr, weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True)
    lr_value, hyper = opt.step_values(1)
    assert len(calls) == 1
    assert hyper[2] == np.float32(0.5 * 0.1)  # the decay, scaled by the configured learning rate
    assert lr_value == np.float32(0.1)  # TensorFlow's TPU Adam: no bias correction
    corrected = ec.Adam(lr, weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True,
                        bias_correction=True)
    lr_value, hyper = corrected.step_values(1)
    assert len(calls) == 2 and hyper[2] == np.float32(0.5 * 0.1)  # the decay scales the configured rate
    assert np.isclose(lr_value, 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9))  # the bias correction on top


@pytest.mark.parametrize("layout", ["one array", "swapped", "gap", "strided", "float64"])
def test_gradients_consecutive_in_memory_are_used_in_place_and_others_copied(layout):
    """Stacked features whose float32 gradients are consecutive views of one array are read in place;
    any other arrangement is copied; every arrangement gives the same tables, bit for bit."""
    rng = np.random.default_rng(3)
    features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(50, 4, name=f"t{t}", initializer=ec.RandomUniform(-1, 1,
                                                                                                       seed=t)))
                for t in range(3)}
    batch = {f"f{t}": rng.integers(0, 50, (6, 2)) for t in range(3)}
    big = rng.standard_normal((3, 7, 4)).astype(np.float32)
    separate = {f"f{t}": big[t, :6].copy() for t in range(3)}
    if layout == "one array":
        whole = big[:, :6].copy()
        grads = {f"f{t}": whole[t] for t in range(3)}
    elif layout == "swapped":
        whole = np.stack([separate["f1"], separate["f0"], separate["f2"]])
        grads = {"f0": whole[1], "f1": whole[0], "f2": whole[2]}
    elif layout == "gap":  # rows 0..5 of each of 7: one row between them
        grads = {f"f{t}": big[t, :6] for t in range(3)}
    elif layout == "strided":
        wide = np.zeros((3, 6, 8), np.float32)
        wide[:, :, ::2] = np.stack([separate[f"f{t}"] for t in range(3)])
        grads = {f"f{t}": wide[t, :, ::2] for t in range(3)}
    else:
        grads = {k: v.astype(np.float64) for k, v in separate.items()}
    results = []
    for g in (separate, grads):
        emb = ec.Embedding(features, ec.Adagrad(0.1))
        assert emb.num_physical_tables == 1
        _, ctx = emb.lookup(batch)
        emb.apply_gradients(g, ctx)
        results.append({k: v.copy() for k, v in emb.embedding_tables.items()})
        copied = "d_act" in emb.physical_tables[0].workspace._buffers
    assert copied == (layout != "one array")
    for name in results[0]:
        np.testing.assert_array_equal(results[1][name], results[0][name])
