"""TensorFlow's ``tf.tpu.experimental.embedding`` config objects converted by ``embedcore.tensorflow.convert``.

Checked against TensorFlow's own objects: every argument carried over (each TF optimizer equals the embedcore
optimizer built with the same arguments), tables named and shared as TensorFlow's engines name and share them
(TensorFlow's ``TPUEmbeddingForServing`` names them in place: the oracle), short training runs through
``ec.Embedding`` against the plain NumPy oracle of ``tests/reference.py`` fed with TensorFlow's parameters,
callable learning rates reading a ``tf.Variable``, initializers against TensorFlow's values (exact) or
distribution (two-sample Kolmogorov-Smirnov), and the refusals, which name the table or feature.
"""

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="needs the tensorflow extra: pip install 'embedcore[tensorflow]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore import inputs  # noqa: E402
from embedcore.tensorflow import convert  # noqa: E402

from . import reference  # noqa: E402
from .test_translate_tensorflow import adagrad_optimizer_computation  # noqa: E402

E = tf.tpu.experimental.embedding


# ----------------------------------------------------------------------------------------------------------
# Tables and feature nests.

def test_table_carries_every_argument():
    tf_table = E.TableConfig(vocabulary_size=7, dim=3,
                             initializer=tf.constant_initializer(0.25, support_partition=True),
                             optimizer=E.SGD(0.5), combiner="sqrtn", name="users")
    table = convert.table(tf_table)
    assert (table.vocabulary_size, table.dim, table.combiner, table.name) == (7, 3, "sqrtn", "users")
    assert table.initializer == ec.Constant(0.25)
    assert table.optimizer == ec.SGD(0.5)
    assert convert.table(tf_table, name="other").name == "other"
    assert tf_table.name == "users"  # the given config is not changed
    mine = ec.TableConfig(4, 2)
    assert convert.table(mine) is mine


def test_table_default_initializer_is_tensorflows_truncated_normal():
    tf_table = E.TableConfig(vocabulary_size=5, dim=16, name="t")
    table = convert.table(tf_table)
    assert table.initializer == ec.TruncatedNormal(0.0, 1 / math.sqrt(16))
    assert table.optimizer is None


def test_features_keep_the_nest_share_tables_and_name_them_as_tensorflow():
    def build():
        shared = E.TableConfig(10, 4)
        named = E.TableConfig(5, 2, name="items")
        other = E.TableConfig(3, 2)
        return {"b": E.FeatureConfig(shared, name="watched"),
                "a": [E.FeatureConfig(named), (E.FeatureConfig(shared, output_shape=[2, 3]),)],
                "c": E.FeatureConfig(other, max_sequence_length=4, validate_weights_and_indices=False)}

    tf_config = build()
    E.TPUEmbeddingForServing(tf_config, optimizer=None)  # TensorFlow names its tables in place
    given = build()
    converted = convert.features(given)
    # first-seen order of the flattened nest, dict keys sorted: a/0 (items), a/1/0 (shared), c (other)
    assert [t.name for t, _ in converted.tables] == ["items", None, None]  # nothing given was changed
    assert [t.name for _, t in converted.tables] == [t.name for t in _unique_tables(tf_config)]
    assert list(converted.features) == ["b", "a", "c"]  # the caller's key order
    f = converted.features
    assert isinstance(f["a"], list) and isinstance(f["a"][1], tuple)
    assert f["b"].table is f["a"][1][0].table is converted.tables[1][1]
    assert f["b"].name == "watched" and f["a"][0].name is None
    assert f["a"][1][0].output_shape == (2, 3) and f["b"].output_shape is None
    assert f["c"].max_sequence_length == 4 and f["c"].validate_weights_and_indices is False
    assert [given_table for given_table, _ in converted.tables] == _unique_tables(given)


def _unique_tables(nest):
    tables = []
    for _, feature in inputs.flatten(nest):
        if not any(feature.table is t for t in tables):
            tables.append(feature.table)
    return tables


def test_unique_tables_helper_is_first_seen_order():
    a, b = E.TableConfig(2, 2), E.TableConfig(2, 2)
    assert _unique_tables([E.FeatureConfig(b), E.FeatureConfig(a), E.FeatureConfig(b)]) == [b, a]


def test_a_single_feature_and_embedcore_features_mixed():
    tf_feature = E.FeatureConfig(E.TableConfig(4, 2))
    converted = convert.features(tf_feature)
    assert isinstance(converted.features, ec.FeatureConfig)
    assert converted.features.table.name == "table_0"
    mine = ec.FeatureConfig(ec.TableConfig(6, 2, name="mine"))
    mixed = convert.features([mine, tf_feature])
    assert mixed.features[0] is mine
    assert mixed.tables[0] == (mine.table, mine.table)
    assert mixed.features[1].table.name == "table_1"  # TensorFlow's index counts every table


def test_a_shared_optimizer_becomes_one_embedcore_optimizer_and_one_stacked_table():
    adagrad = E.Adagrad(0.1)
    converted = convert.features([E.FeatureConfig(E.TableConfig(8, 4, optimizer=adagrad)),
                                  E.FeatureConfig(E.TableConfig(5, 4, optimizer=adagrad))])
    first, second = (t for _, t in converted.tables)
    assert first.optimizer is second.optimizer
    assert ec.Embedding(converted.features).num_physical_tables == 1


# The nest, and the tables' names, against TensorFlow's own engine (which names them in place).
_NAMES = st.sampled_from([None, None, "a", "table_0", "table_1"])


def _nests(leaf):
    return st.recursive(leaf, lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["x", "y", "z", "w"]), children, min_size=1, max_size=3)), max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nest=_nests(st.integers(0, 3)), names=st.lists(_NAMES, min_size=4, max_size=4))
def test_nests_and_names_match_tensorflows(nest, names):
    def build():
        tables = [E.TableConfig(3 + k, 2, name=names[k]) for k in range(4)]
        return _map(nest, lambda k: E.FeatureConfig(tables[k]))

    tf_config = build()
    try:
        E.TPUEmbeddingForServing(tf_config, optimizer=None)
    except ValueError as tf_error:
        with pytest.raises(ValueError, match="unique name"):
            convert.features(build())
        assert "unique name" in str(tf_error)
        return
    converted = convert.features(build())
    ours = inputs.flatten(converted.features)
    theirs = inputs.flatten(tf_config)
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    for (_, mine), (_, their) in zip(ours, theirs):
        assert mine.table.name == their.table.name
        assert mine.table.vocabulary_size == their.table.vocabulary_size
    for (_, a), (_, b) in zip(ours, ours[1:]):
        assert (a.table is b.table) == (a.table.name == b.table.name)


def _map(nest, fn):
    if isinstance(nest, dict):
        return {k: _map(v, fn) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(_map(v, fn) for v in nest)
    return fn(nest)


# ----------------------------------------------------------------------------------------------------------
# Optimizers: every argument carried over (embedcore's built-ins take TensorFlow's argument names).

COMMON = dict(use_gradient_accumulation=True, clip_weight_min=-2.0, clip_weight_max=3.0, weight_decay_factor=0.01,
              multiply_weight_decay_factor_by_learning_rate=True, clipvalue=(-0.5, 0.25),
              low_dimensional_packing_status=True)

OPTIMIZER_ARGUMENTS = [
    ("SGD", dict(learning_rate=0.2)),
    ("SGD", dict(learning_rate=0.2, **COMMON)),
    ("SGD", dict(learning_rate=0.2, use_gradient_accumulation=False)),
    ("Adagrad", dict(learning_rate=0.3, initial_accumulator_value=0.25, **COMMON)),
    ("AdagradMomentum", dict(learning_rate=0.1, momentum=0.8, use_nesterov=True, exponent=3.0, beta2=0.9,
                             epsilon=1e-6, **COMMON)),
    ("Adam", dict(learning_rate=0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-4, lazy_adam=False, sum_inside_sqrt=False,
                  **COMMON)),
    ("FTRL", dict(learning_rate=0.2, learning_rate_power=-0.7, l1_regularization_strength=0.01,
                  l2_regularization_strength=0.02, beta=0.1, initial_accumulator_value=0.3,
                  multiply_linear_by_learning_rate=True, allow_zero_accumulator=True, **COMMON)),
]


@pytest.mark.parametrize("name, arguments", OPTIMIZER_ARGUMENTS,
                         ids=[f"{n}-{len(a)}" for n, a in OPTIMIZER_ARGUMENTS])
def test_optimizer_carries_every_argument(name, arguments):
    converted = convert.optimizer(getattr(E, name)(**arguments))
    expected = getattr(ec, name)(**arguments, **({"bias_correction": False} if name == "Adam" else {}))
    assert type(converted) is type(expected)
    assert converted == expected, f"{converted!r} != {expected!r}"


def test_scalar_clipvalue_is_tensorflows_symmetric_pair():
    converted = convert.optimizer(E.Adagrad(0.1, clipvalue=0.5))
    assert (converted.clip_gradient_min, converted.clip_gradient_max) == (-0.5, 0.5)
    one_sided = convert.optimizer(E.SGD(0.1, clipvalue=(None, 0.5)))
    assert (one_sided.clip_gradient_min, one_sided.clip_gradient_max) == (None, 0.5)


def test_adam_has_no_bias_correction():
    converted = convert.optimizer(E.Adam(0.1))
    assert getattr(converted, "bias_correction", False) is False
    for step in (1, 2, 10):
        assert converted.step_values(step)[0] == np.float32(0.1)


def test_embedcore_optimizers_pass_through_and_none_stays_none():
    mine = ec.Adam(0.1)
    assert convert.optimizer(mine) is mine
    assert convert.optimizer(None) is None


def test_custom_optimizer_as_tensorflows_page_writes_it():
    tf_optimizer = E.CustomOptimizer(
        custom_computation=adagrad_optimizer_computation,
        learning_rate=1.0,
        slot_names=["accumulators"],
        slot_initializers=[tf.constant_initializer(0.1, support_partition=True)],
        hyperparameters=[0.5, lambda: tf.constant(0.25)],
        slot_dims=[2],
    )
    converted = convert.optimizer(tf_optimizer)
    assert isinstance(converted, ec.CustomOptimizer)
    assert converted.custom_computation is adagrad_optimizer_computation
    assert converted.slot_names == ("accumulators",)
    assert converted.slot_initializers == (ec.Constant(0.1),)
    assert converted.slot_dims == (2,)
    assert converted.learning_rate == 1.0
    learning_rate, hyperparameters = converted.step_values(1)
    assert learning_rate == np.float32(1.0) and hyperparameters == (np.float32(0.5), np.float32(0.25))
    assert "element by element, inlined" in converted.explain(8)
    again = convert.optimizer(E.CustomOptimizer(adagrad_optimizer_computation, 1.0, ["accumulators"],
                                                [tf.constant_initializer(0.1)]))
    assert again.slot_dims == (2,)  # TensorFlow's default: full rows


# ----------------------------------------------------------------------------------------------------------
# Short training runs through ec.Embedding against the NumPy oracle, fed with TensorFlow's parameters.

def _oracle_parameters(opt):
    """``tests/reference.py``'s parameters, read from TensorFlow's optimizer by TensorFlow's names."""
    p = {"clip_min": opt.clip_gradient_min, "clip_max": opt.clip_gradient_max,
         "weight_decay": opt.weight_decay_factor, "decay_by_lr": opt.multiply_weight_decay_factor_by_learning_rate,
         "w_min": opt.clip_weight_min, "w_max": opt.clip_weight_max}
    if isinstance(opt, E.AdagradMomentum):
        p.update(momentum=opt.momentum, nesterov=opt.use_nesterov, exponent=opt.exponent, beta2=opt.beta2,
                 epsilon=opt.epsilon)
    if isinstance(opt, E.Adam):
        p.update(beta_1=opt.beta_1, beta_2=opt.beta_2, epsilon=opt.epsilon, sum_inside_sqrt=opt.sum_inside_sqrt)
    if isinstance(opt, E.FTRL):
        p.update(learning_rate_power=opt.learning_rate_power, l1=opt.l1_regularization_strength,
                 l2=opt.l2_regularization_strength, beta=opt.beta,
                 multiply_linear_by_lr=opt.multiply_linear_by_learning_rate)
    return p


def _oracle_update(opt):
    if isinstance(opt, E.CustomOptimizer):
        return reference.adagrad  # the documented computation is Adagrad
    return {E.SGD: reference.sgd, E.Adagrad: reference.adagrad, E.AdagradMomentum: reference.adagrad_momentum,
            E.Adam: reference.adam, E.FTRL: reference.ftrl}[type(opt)]


TRAINED = {
    "sgd": lambda: E.SGD(0.3),
    "sgd-options": lambda: E.SGD(0.2, clipvalue=0.05, weight_decay_factor=0.1,
                                 multiply_weight_decay_factor_by_learning_rate=True, clip_weight_min=-0.3,
                                 clip_weight_max=0.3),
    "adagrad": lambda: E.Adagrad(0.3, initial_accumulator_value=0.2),
    "adagrad-one-sided-clip": lambda: E.Adagrad(0.3, clipvalue=(None, 0.02), weight_decay_factor=0.05),
    "adagrad-momentum": lambda: E.AdagradMomentum(0.1, momentum=0.5),
    "adagrad-momentum-nesterov": lambda: E.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, exponent=3.0,
                                                           beta2=0.9, epsilon=1e-6),
    "adam": lambda: E.Adam(0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-3, sum_inside_sqrt=False),
    "adam-not-lazy": lambda: E.Adam(0.05, lazy_adam=False),
    "ftrl": lambda: E.FTRL(0.2, learning_rate_power=-0.7, l1_regularization_strength=0.01,
                           l2_regularization_strength=0.02, beta=0.1, initial_accumulator_value=0.3),
    "ftrl-linear-by-lr": lambda: E.FTRL(0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                                        beta=0.1, multiply_linear_by_learning_rate=True),
    "custom-tf-function": lambda: E.CustomOptimizer(
        custom_computation=adagrad_optimizer_computation, learning_rate=0.4, slot_names=["accumulators"],
        slot_initializers=[tf.constant_initializer(0.1, support_partition=True)]),
}

# Two features on one table (one sums, one averages over its own table), duplicates and empty samples.
BATCHES = [
    {"clicks": [[1, 1, 4], [], [4, 7]], "views": [[0], [9, 9]]},
    {"clicks": [[2], [2, 2, 2], [10]], "views": [[], [3, 1]]},
    {"clicks": [[5, 0], [5], [1]], "views": [[10, 10], [4]]},
]


def _train_and_check(tf_optimizer, learning_rates=None, on_step=None):
    vocabulary, dim = 11, 3
    clicks = E.TableConfig(vocabulary, dim, initializer=tf.random_uniform_initializer(-0.5, 0.5, seed=7),
                           optimizer=tf_optimizer, combiner="sum", name="clicks")
    views = E.TableConfig(4 * vocabulary, dim, optimizer=tf_optimizer, name="views")  # TF's default initializer
    converted = convert.features({"clicks": E.FeatureConfig(clicks), "views": E.FeatureConfig(views)})
    engine = ec.Embedding(converted.features)
    slot_names = tf_optimizer._slot_names()
    tables = {name: engine.embedding_tables[name].astype(np.float64) for name in ("clicks", "views")}
    slots = {name: [engine.slot_variables[name][s].astype(np.float64) for s in slot_names] for name in tables}
    for name, table_config in (("clicks", clicks), ("views", views)):  # slots start as TensorFlow's initializers say
        for slot, init in zip(slots[name], tf_optimizer._slot_initializers()):
            np.testing.assert_array_equal(slot, init(slot.shape, tf.float32).numpy())
    update, params = _oracle_update(tf_optimizer), _oracle_parameters(tf_optimizer)
    lazy = not isinstance(tf_optimizer, E.Adam) or tf_optimizer.lazy_adam
    combiners = {"clicks": "sum", "views": "mean"}
    rng = np.random.default_rng(3)
    for step, batch in enumerate(BATCHES, start=1):
        if on_step is not None:
            on_step(step)
        activations, ctx = engine(batch)
        for name, samples in batch.items():
            ones = [[1.0] * len(s) for s in samples]
            expected = reference.lookup(tables[name], samples, ones, combiners[name], 0)
            np.testing.assert_allclose(activations[name], expected, rtol=1e-5, atol=1e-6)
        grads = {name: rng.normal(size=(len(samples), dim)).astype(np.float32) for name, samples in batch.items()}
        engine.apply_gradients(grads, ctx)
        lr = learning_rates[step - 1] if learning_rates else tf_optimizer.learning_rate
        for name, samples in batch.items():
            ones = [[1.0] * len(s) for s in samples]
            table_size = tables[name].shape[0]
            gradient = reference.dense_gradient(table_size, dim, samples, ones, combiners[name], 0, grads[name])
            touched = reference.touched_rows(table_size, samples, 0)
            tables[name], slots[name] = reference.apply(update, gradient, tables[name], slots[name], touched, lr,
                                                        params, step, lazy=lazy)
            # float32 against float64: updates of ~0.1 that cancel leave float32 rounding of ~1e-6
            np.testing.assert_allclose(engine.embedding_tables[name], tables[name], rtol=2e-5, atol=1e-5,
                                       err_msg=f"table {name} after step {step}")
            for slot_name, expected_slot in zip(slot_names, slots[name]):
                np.testing.assert_allclose(engine.slot_variables[name][slot_name], expected_slot, rtol=2e-5,
                                           atol=1e-5, err_msg=f"slot {slot_name} of {name} after step {step}")


@pytest.mark.parametrize("case", list(TRAINED))
def test_training_run_matches_the_oracle(case):
    _train_and_check(TRAINED[case]())


def test_learning_rate_reading_a_variable_changes_between_steps():
    rate = tf.Variable(0.1)
    rates = [0.1, 0.5, 0.02]
    _train_and_check(E.Adagrad(lambda: rate), learning_rates=rates, on_step=lambda step: rate.assign(rates[step - 1]))


def test_learning_rate_given_as_a_variable_is_read_each_step():
    rate = tf.Variable(0.3)
    rates = [0.3, 0.05, 0.2]
    _train_and_check(E.SGD(rate), learning_rates=rates, on_step=lambda step: rate.assign(rates[step - 1]))


def test_learning_rate_callable_returning_a_tensor():
    step = tf.Variable(0.0)
    schedule = lambda: 0.4 / (1.0 + step)  # noqa: E731  (a tf.Tensor each call)
    rates = [0.4 / (1.0 + k) for k in range(3)]
    _train_and_check(E.FTRL(schedule, initial_accumulator_value=0.2), learning_rates=rates,
                     on_step=lambda k: step.assign(float(k - 1)))


def test_learning_rate_callable_called_on_graph_tensors_says_why_it_cannot_work():
    """Eagerly (and while an update op runs, with the value the graph computed) the callable gives a value;
    called while a graph is traced it would return a symbolic tensor, which cannot be a step's float."""
    rate = tf.Variable(0.1)
    converted = convert.optimizer(E.SGD(lambda: rate * 2.0))
    assert converted.step_values(1)[0] == np.float32(0.2)

    @tf.function
    def in_graph():
        return converted.step_values(1)[0]

    with pytest.raises(ValueError, match="returned a symbolic tensor"):
        in_graph()


def test_given_values_replace_the_callables_on_this_thread_only():
    rate = tf.Variable(0.1)
    converted = convert.optimizer(E.SGD(lambda: rate * 2.0))
    callables = convert.tensor_callables([converted, None, converted])
    assert callables == [converted.learning_rate]
    seen = []
    with convert.given_values(callables, [0.5]):
        assert converted.step_values(1)[0] == np.float32(0.5)
        import threading
        other = threading.Thread(target=lambda: seen.append(converted.step_values(1)[0]))
        other.start()
        other.join()
    assert seen == [np.float32(0.2)]
    assert converted.step_values(1)[0] == np.float32(0.2)


def test_learning_rate_callable_with_a_step_argument_is_refused_naming_the_table():
    with pytest.raises(ValueError, match=r"TableConfig 'fast'.*cannot be called without arguments"):
        convert.table(E.TableConfig(4, 2, name="fast", optimizer=E.SGD(lambda step: 0.1)))


def test_learning_rate_callable_returning_an_array_is_refused_when_called():
    converted = convert.optimizer(E.SGD(lambda: tf.constant([0.1, 0.2])))
    with pytest.raises(ValueError, match="must return a scalar"):
        converted.step_values(1)


def test_callable_learning_rates_compare_by_the_function():
    schedule = lambda: 0.1  # noqa: E731
    assert convert.optimizer(E.SGD(schedule)) == convert.optimizer(E.SGD(schedule))
    assert convert.optimizer(E.SGD(schedule)) != convert.optimizer(E.SGD(lambda: 0.1))


# ----------------------------------------------------------------------------------------------------------
# Initializers.

SHAPE = (160, 125)  # 20,000 values


def _ks_statistic(a, b):
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = np.sort(np.ravel(a)), np.sort(np.ravel(b))
    grid = np.concatenate([a, b])
    return np.max(np.abs(np.searchsorted(a, grid, side="right") / a.size
                         - np.searchsorted(b, grid, side="right") / b.size))


KS_LIMIT = 1.95 * math.sqrt(2 / math.prod(SHAPE))  # the 0.1% critical value for two samples of this size


def _values(init, shape=SHAPE):
    out = np.empty(shape, np.float32)
    ec.initializers.fill_rows(init, out, 0, shape[0], 0, "t")
    return out


def test_constants_are_exact():
    assert convert.initializer(tf.constant_initializer(0.1, support_partition=True)) == ec.Constant(0.1)
    np.testing.assert_array_equal(_values(convert.initializer(tf.constant_initializer(0.1)), (3, 4)),
                                  tf.constant_initializer(0.1)((3, 4), tf.float32).numpy())
    assert convert.initializer(tf.zeros_initializer()) == ec.Zeros()
    assert convert.initializer(tf.ones_initializer()) == ec.Constant(1.0)
    assert convert.initializer(tf.keras.initializers.Zeros()) == ec.Zeros()
    assert convert.initializer(tf.keras.initializers.Ones()) == ec.Constant(1.0)
    assert convert.initializer(tf.keras.initializers.Constant(-2.5)) == ec.Constant(-2.5)
    listed = tf.constant_initializer(list(range(12)))
    np.testing.assert_array_equal(_values(convert.initializer(listed), (3, 4)), listed((3, 4), tf.float32).numpy())
    row = tf.keras.initializers.Constant(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(_values(convert.initializer(row), (2, 3)), row((2, 3), "float32"))


def test_row_id_initializer():
    assert convert.initializer(E.RowIdInitializer(offset=3)) == ec.RowId(3)
    np.testing.assert_array_equal(_values(convert.initializer(E.RowIdInitializer(offset=3)), (5, 2)),
                                  E.RowIdInitializer(offset=3)((5, 2), tf.float32).numpy())


def _support(init):
    """The interval the values of an embedcore initializer lie in (None: unbounded)."""
    if isinstance(init, ec.RandomUniform):
        return init.minval, init.maxval
    if isinstance(init, ec.TruncatedNormal):
        return init.mean - 2 * init.stddev, init.mean + 2 * init.stddev
    return None


@pytest.mark.parametrize("init, expected", [
    (tf.random_uniform_initializer(-0.3, 0.7, seed=5), ec.RandomUniform(-0.3, 0.7, seed=5)),
    (tf.keras.initializers.RandomUniform(-0.3, 0.7), ec.RandomUniform(-0.3, 0.7)),
    (tf.keras.initializers.TruncatedNormal(0.5, 2.0, seed=1), ec.TruncatedNormal(0.5, 2.0, seed=1)),
    (tf.initializers.TruncatedNormal(0.0, 0.1), ec.TruncatedNormal(0.0, 0.1)),
    (E.TableConfig(3, 64, name="t").initializer, ec.TruncatedNormal(0.0, 1 / 8)),
    (tf.random_normal_initializer(1.0, 0.5, seed=2), convert.RandomNormal(1.0, 0.5, seed=2)),
    (tf.keras.initializers.RandomNormal(1.0, 0.5), convert.RandomNormal(1.0, 0.5)),
], ids=["uniform", "keras-uniform", "keras-truncated", "tf.initializers-truncated", "table-default", "normal",
        "keras-normal"])
def test_random_initializers_have_tensorflows_distribution(init, expected):
    converted = convert.initializer(init)
    assert converted == expected
    ours = _values(converted)
    theirs = np.asarray(init(SHAPE, dtype=tf.float32))
    assert _ks_statistic(ours, theirs) < KS_LIMIT
    support = _support(converted)
    if support is not None:
        low, high = support
        assert low <= ours.min() and ours.max() <= high
        assert low <= theirs.min() and theirs.max() <= high


def test_random_normal_is_not_truncated_and_is_partition_independent():
    values = _values(convert.RandomNormal(0.0, 1.0, seed=4))
    assert np.mean(np.abs(values) > 2.0) > 0.03  # 4.6% of a normal lies beyond two standard deviations
    assert abs(values.mean()) < 0.03 and abs(values.std() - 1.0) < 0.02
    init = convert.RandomNormal(0.0, 1.0, seed=4)
    every_third = np.empty((SHAPE[0] // 3 + 1, SHAPE[1]), np.float32)
    init.fill(every_third, 1, ec.initializers.stream_key(4, "t"), stride=3)
    np.testing.assert_array_equal(every_third[:-1], values[1::3][:every_third.shape[0] - 1])


def test_other_callables_return_numpy():
    glorot = tf.keras.initializers.GlorotUniform(seed=3)
    converted = convert.initializer(glorot)
    assert isinstance(converted, convert.TensorInitializer)
    np.testing.assert_array_equal(converted((6, 4)), glorot((6, 4), dtype=tf.float32).numpy())
    fill = lambda shape, dtype: tf.fill(shape, tf.constant(0.75, dtype))  # noqa: E731
    np.testing.assert_array_equal(_values(convert.initializer(fill), (4, 3)), np.full((4, 3), 0.75, np.float32))
    features = convert.features(E.FeatureConfig(E.TableConfig(4, 3, initializer=fill, name="f"))).features
    engine = ec.Embedding(features, optimizer=convert.optimizer(E.SGD(0.1)))
    np.testing.assert_array_equal(engine.embedding_tables["f"], np.full((4, 3), 0.75, np.float32))


def test_none_and_embedcore_initializers_pass_through():
    assert convert.initializer(None) is None
    mine = ec.RandomUniform(0.0, 1.0)
    assert convert.initializer(mine) is mine


# ----------------------------------------------------------------------------------------------------------
# Refusals: TensorFlow's error classes, messages naming the table or feature; nothing given is changed.

def test_unknown_optimizer_is_refused_naming_the_table():
    with pytest.raises(ValueError, match=r"TableConfig 'ads'.*unsupported optimizer class"):
        convert.features(E.FeatureConfig(E.TableConfig(4, 2, name="ads", optimizer=tf.keras.optimizers.SGD())))
    with pytest.raises(ValueError, match="unsupported optimizer class"):
        convert.optimizer("sgd")


def test_unknown_initializer_is_refused_naming_the_table():
    tf_table = E.TableConfig(4, 2)
    tf_table.initializer = 3.0  # TensorFlow refuses it in the constructor; set afterwards
    with pytest.raises(ValueError, match=r"TableConfig 'table_0'.*must be a callable"):
        convert.features([E.FeatureConfig(tf_table)])
    assert tf_table.name is None


def test_constant_values_of_another_size_are_refused_naming_the_table():
    with pytest.raises(TypeError, match=r"TableConfig 'small'.*6 elements, shape is \(4, 2\) with 8"):
        convert.table(E.TableConfig(4, 2, name="small", initializer=tf.constant_initializer([1, 2, 3, 4, 5, 6])))


def test_slot_variable_creation_fn_is_refused_naming_the_table():
    tf_optimizer = E.Adagrad(0.1, slot_variable_creation_fn=lambda table, names, initializers: {})
    with pytest.raises(ValueError, match=r"TableConfig 'q'.*slot_variable_creation_fn.*cannot be honoured"):
        convert.table(E.TableConfig(4, 2, name="q", optimizer=tf_optimizer))


@pytest.mark.parametrize("what, arguments", [
    ("combiner", dict(combiner=E.CustomCombiner(lambda valency, vectors: vectors[0], max_valency=4))),
    ("quantization_config", dict(quantization_config=E.QuantizationConfig(num_buckets=4, lower=-1.0, upper=1.0))),
    ("dtype int32", dict(dtype=tf.int32)),
])
def test_what_embedcore_cannot_honour_is_refused_naming_the_table(what, arguments):
    with pytest.raises(ValueError, match=rf"TableConfig 'z': {what}"):
        convert.table(E.TableConfig(4, 2, name="z", **arguments))


def test_bad_values_are_refused_naming_the_table():
    with pytest.raises(ValueError, match=r"TableConfig 'neg': SGD: clipvalue minimum 1.0 is greater"):
        convert.table(E.TableConfig(4, 2, name="neg", optimizer=E.SGD(0.1, clipvalue=-1.0)))


def test_partial_output_shape_is_refused_naming_the_feature():
    with pytest.raises(ValueError, match=r"feature 'ratings': output_shape \(None, 2\) is not fully defined"):
        convert.features({"ratings": E.FeatureConfig(E.TableConfig(4, 2), output_shape=[None, 2])})


def test_a_leaf_that_is_not_a_feature_config_is_a_type_error_naming_its_path():
    with pytest.raises(TypeError, match=r"feature_config at 'b/1' must be"):
        convert.features({"a": E.FeatureConfig(E.TableConfig(4, 2)), "b": [E.FeatureConfig(E.TableConfig(4, 2)), 3]})
    with pytest.raises(TypeError, match="TableConfig"):
        convert.table("table")


def test_deepcopy_of_an_engine_shares_tf_functions_and_the_variables_its_rates_read():
    """A copy trains as the original: its CustomOptimizer's ``tf.function`` (which cannot be deep-copied) is
    shared, and its learning rate goes on reading the same ``tf.Variable`` (a copied variable would never see
    the user's ``assign``)."""
    import copy

    rate = tf.Variable(0.5)
    tf_optimizer = E.CustomOptimizer(tf.function(adagrad_optimizer_computation), learning_rate=lambda: rate,
                                     slot_names=["accumulators"], slot_initializers=[tf.constant_initializer(0.1)])
    table = E.TableConfig(6, 3, initializer=tf.constant_initializer(0.25), optimizer=tf_optimizer, name="t")
    engine = ec.Embedding(convert.features({"f": E.FeatureConfig(table)}).features)
    twin = copy.deepcopy(engine)
    assert twin.optimizer is engine.optimizer and twin.tables["t"].optimizer is engine.tables["t"].optimizer
    ids = np.array([1, 4, 4], np.int64)
    for value in (0.5, 0.125):
        rate.assign(value)
        for emb in (engine, twin):
            acts, ctx = emb({"f": ids})
            emb.apply_gradients({"f": np.full_like(acts["f"], 0.5)}, ctx)
    np.testing.assert_array_equal(twin.embedding_tables["t"], engine.embedding_tables["t"])
    np.testing.assert_array_equal(twin.slot_variables["t"]["accumulators"],
                                  engine.slot_variables["t"]["accumulators"])
    assert twin.embedding_tables["t"] is not engine.embedding_tables["t"]
    # the oracle: two Adagrad steps of the documented computation with the rates assigned
    expected = np.full((6, 3), 0.25, np.float32)
    accumulators = np.full((6, 3), 0.1, np.float32)
    for lr in (0.5, 0.125):
        for i, g in ((1, 0.5), (4, 1.0)):
            accumulators[i] += np.float32(g) * np.float32(g)
            expected[i] -= np.float32(lr) * np.float32(g) / np.sqrt(accumulators[i])
    np.testing.assert_allclose(engine.embedding_tables["t"], expected, rtol=1e-6)
