"""Configuration validation: TableConfig, FeatureConfig, optimizers, CustomOptimizer, Embedding construction."""

import re

import numpy as np
import pytest

import embedcore as ec


def _sgd_like(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del slot_variables, hyperparameters
    return embedding_table - learning_rate * gradient


def _with_slot(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del hyperparameters
    acc = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / np.sqrt(acc), acc


# ---------------------------------------------------------------------------------------------- TableConfig

@pytest.mark.parametrize("value", [0, -1, 1.0, 2.5, "10", None, True, False, np.float32(3)])
def test_table_vocabulary_size_rejected(value):
    with pytest.raises(ValueError, match=r"`vocabulary_size` must be an int and must be >= 1"):
        ec.TableConfig(vocabulary_size=value, dim=4)


@pytest.mark.parametrize("value", [0, -3, 4.0, "4", None, True])
def test_table_dim_rejected(value):
    with pytest.raises(ValueError, match=r"`dim` \(embedding dimension\) must be an int and must be >= 1"):
        ec.TableConfig(vocabulary_size=10, dim=value)


def test_table_accepts_numpy_ints_and_stores_python_ints():
    t = ec.TableConfig(vocabulary_size=np.int64(10), dim=np.int32(4))
    assert t.vocabulary_size == 10 and type(t.vocabulary_size) is int
    assert t.dim == 4 and type(t.dim) is int
    assert t.combiner == "mean" and t.name is None and t.initializer is None and t.optimizer is None


@pytest.mark.parametrize("value", [0.5, "zeros", [1.0], np.zeros(3)])
def test_table_initializer_not_callable(value):
    with pytest.raises(ValueError, match=r"`initializer` must be a callable"):
        ec.TableConfig(10, 4, initializer=value)


def test_table_initializer_callables_accepted():
    ec.TableConfig(10, 4, initializer=ec.Zeros())
    ec.TableConfig(10, 4, initializer=lambda shape, dtype: np.zeros(shape, dtype))


@pytest.mark.parametrize("value", ["max", "MEAN", "", None, 1])
def test_table_bad_combiner(value):
    with pytest.raises(ValueError, match=r"`combiner` must be one of \['mean', 'sum', 'sqrtn'\]"):
        ec.TableConfig(10, 4, combiner=value)


@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
def test_table_good_combiners(combiner):
    assert ec.TableConfig(10, 4, combiner=combiner).combiner == combiner


@pytest.mark.parametrize("value", ["", 3, b"t", ["t"]])
def test_table_bad_name(value):
    with pytest.raises(ValueError, match=r"`name` must be a non-empty string or None"):
        ec.TableConfig(10, 4, name=value)


@pytest.mark.parametrize("value", ["sgd", 0.1, ec.SGD])
def test_table_bad_optimizer(value):
    with pytest.raises(ValueError, match=r"`optimizer` must be an embedcore optimizer"):
        ec.TableConfig(10, 4, optimizer=value)


def test_table_repr():
    r = repr(ec.TableConfig(17, 5, combiner="sqrtn", name="video", optimizer=ec.Adagrad(0.3)))
    for part in ("TableConfig(", "vocabulary_size=17", "dim=5", "combiner='sqrtn'", "name='video'",
                 "Adagrad(", "learning_rate=0.3"):
        assert part in r


# -------------------------------------------------------------------------------------------- FeatureConfig

_T = ec.TableConfig(10, 4, name="t")


@pytest.mark.parametrize("value", [None, "t", 10, {"vocabulary_size": 10}])
def test_feature_table_not_tableconfig(value):
    with pytest.raises(ValueError, match=r"`table` has invalid type .*TableConfig expected"):
        ec.FeatureConfig(value)


@pytest.mark.parametrize("value", [-1, -100, 1.0, 2.5, "3", None, True])
def test_feature_max_sequence_length_rejected(value):
    with pytest.raises(ValueError, match=r"`max_sequence_length` must be an int and must be >= 0"):
        ec.FeatureConfig(_T, max_sequence_length=value)


def test_feature_max_sequence_length_ok():
    assert ec.FeatureConfig(_T).max_sequence_length == 0
    assert ec.FeatureConfig(_T, max_sequence_length=np.int64(7)).max_sequence_length == 7


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.bool_(True)])
def test_feature_validate_weights_and_indices_not_bool(value):
    with pytest.raises(ValueError, match=r"`validate_weights_and_indices` must be a boolean"):
        ec.FeatureConfig(_T, validate_weights_and_indices=value)


@pytest.mark.parametrize("value", [5, 3.0, object()])
def test_feature_output_shape_not_a_sequence(value):
    with pytest.raises(ValueError, match=r"`output_shape` must be a sequence of ints or None"):
        ec.FeatureConfig(_T, output_shape=value)


@pytest.mark.parametrize("value", [(0,), (2, -1), [4, 0, 2]])
def test_feature_output_shape_nonpositive(value):
    with pytest.raises(ValueError, match=r"`output_shape` must hold positive ints"):
        ec.FeatureConfig(_T, output_shape=value)


@pytest.mark.parametrize("value", [(2.5, 2), (True, 4), ("a", 2)])
def test_feature_output_shape_non_int_entries_rejected(value):
    # Found bug: entries are passed through int(), so 2.5 is silently truncated to 2, True becomes 1 and
    # "a" raises a bare ValueError from int() instead of the `output_shape` message.
    with pytest.raises(ValueError, match=r"`output_shape`"):
        ec.FeatureConfig(_T, output_shape=value)


def test_feature_output_shape_normalised_to_tuple():
    assert ec.FeatureConfig(_T, output_shape=[2, np.int64(3)]).output_shape == (2, 3)
    assert ec.FeatureConfig(_T).output_shape is None


@pytest.mark.parametrize("value", [3, b"x", ["x"]])
def test_feature_bad_name(value):
    with pytest.raises(ValueError, match=r"`name` must be a string or None"):
        ec.FeatureConfig(_T, name=value)


def test_feature_repr():
    r = repr(ec.FeatureConfig(_T, max_sequence_length=3, output_shape=(2, 6), name="clicks"))
    for part in ("FeatureConfig(", "table='t'", "max_sequence_length=3", "output_shape=(2, 6)", "name='clicks'"):
        assert part in r
    assert "<unnamed table>" in repr(ec.FeatureConfig(ec.TableConfig(3, 2)))


# ----------------------------------------------------------------------------------------------- optimizers

@pytest.mark.parametrize("value", [0, 0.0, -0.1, "0.1", None, True])
def test_adagrad_initial_accumulator_value(value):
    with pytest.raises(ValueError, match=r"Adagrad initial_accumulator_value must be a positive float"):
        ec.Adagrad(0.1, initial_accumulator_value=value)


@pytest.mark.parametrize("name", ["beta_1", "beta_2"])
@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, "0.9", None])
def test_adam_betas(name, value):
    with pytest.raises(ValueError, match=rf"Adam: {name} must be in \[0, 1\)"):
        ec.Adam(**{name: value})


def test_adam_beta_zero_allowed():
    ec.Adam(beta_1=0.0, beta_2=0.0)


@pytest.mark.parametrize("value", [0.0, -1e-7, None])
def test_adam_epsilon(value):
    with pytest.raises(ValueError, match=r"Adam: epsilon must be positive"):
        ec.Adam(epsilon=value)


def test_adam_non_lazy_needs_gradient_accumulation():
    with pytest.raises(ValueError, match=r"use_gradient_accumulation.* is False, lazy_adam must be True"):
        ec.Adam(lazy_adam=False, use_gradient_accumulation=False)
    assert ec.Adam(lazy_adam=False).lazy is False
    assert ec.Adam(use_gradient_accumulation=False).lazy is True


@pytest.mark.parametrize("value", [0, -1e-10, None])
def test_adagrad_momentum_epsilon(value):
    with pytest.raises(ValueError, match=r"Adagrad momentum: epsilon must be positive"):
        ec.AdagradMomentum(epsilon=value)


@pytest.mark.parametrize("value", [0, -2, None])
def test_adagrad_momentum_exponent(value):
    with pytest.raises(ValueError, match=r"Adagrad momentum: Precondition exponent must be > 0"):
        ec.AdagradMomentum(exponent=value)


@pytest.mark.parametrize("value", [0, 0.0, -0.5])
def test_ftrl_initial_accumulator_value(value):
    with pytest.raises(ValueError, match=r"FTRL: initial_accumulator_value must be a positive float"):
        ec.FTRL(initial_accumulator_value=value)


@pytest.mark.parametrize("value", [0.1, 1.0])
def test_ftrl_learning_rate_power_positive(value):
    with pytest.raises(ValueError, match=r"FTRL: learning_rate_power must be <= 0"):
        ec.FTRL(learning_rate_power=value)
    ec.FTRL(learning_rate_power=0.0)


@pytest.mark.parametrize("name", ["l1_regularization_strength", "l2_regularization_strength", "beta"])
def test_ftrl_negative_regularization(name):
    with pytest.raises(ValueError, match=rf"FTRL: {name} must be a float >= 0"):
        ec.FTRL(**{name: -0.01})
    ec.FTRL(**{name: 0.5})


def test_rowwise_adagrad_both_zero():
    with pytest.raises(ValueError, match=r"RowwiseAdagrad: initial_accumulator_value and epsilon cannot both be 0"):
        ec.RowwiseAdagrad(initial_accumulator_value=0.0, epsilon=0.0)
    ec.RowwiseAdagrad(initial_accumulator_value=0.0, epsilon=1e-8)
    ec.RowwiseAdagrad(initial_accumulator_value=0.1, epsilon=0.0)
    with pytest.raises(ValueError, match=r"RowwiseAdagrad: epsilon must be a float >= 0"):
        ec.RowwiseAdagrad(epsilon=-1.0)
    with pytest.raises(ValueError, match=r"RowwiseAdagrad: initial_accumulator_value must be a float >= 0"):
        ec.RowwiseAdagrad(initial_accumulator_value=-1.0)


_ALL = [ec.SGD, ec.Adagrad, ec.AdagradMomentum, ec.Adam, ec.FTRL, ec.RowwiseAdagrad]
_WITH_SLOT_FN = [ec.Adagrad, ec.AdagradMomentum, ec.Adam, ec.FTRL]


@pytest.mark.parametrize("cls", _ALL)
def test_clipvalue_needs_gradient_accumulation(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: when `use_gradient_accumulation` is False, gradient "
                                         r"clipping cannot be used"):
        cls(use_gradient_accumulation=False, clipvalue=1.0)
    cls(use_gradient_accumulation=False)


@pytest.mark.parametrize("cls", _ALL)
def test_clipvalue_forms(cls):
    o = cls(clipvalue=2.0)
    assert (o.clip_gradient_min, o.clip_gradient_max) == (-2.0, 2.0)
    o = cls(clipvalue=(-1.0, 3.0))
    assert (o.clip_gradient_min, o.clip_gradient_max) == (-1.0, 3.0)
    o = cls(clipvalue=(None, 3.0))
    assert (o.clip_gradient_min, o.clip_gradient_max) == (None, 3.0)
    o = cls(clipvalue=(-1.0, None))
    assert (o.clip_gradient_min, o.clip_gradient_max) == (-1.0, None)
    o = cls()
    assert (o.clip_gradient_min, o.clip_gradient_max) == (None, None)
    hyper = o.hyperparameter_values(1, np.float32(0.1))
    assert hyper[0] == -np.inf and hyper[1] == np.inf


@pytest.mark.parametrize("cls", _ALL)
def test_clipvalue_bad_forms(cls):
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"{name}: clipvalue minimum 2.0 is greater than its maximum 1.0"):
        cls(clipvalue=(2.0, 1.0))
    with pytest.raises(ValueError, match=rf"{name}: clipvalue must be a float or a \(min, max\) tuple"):
        cls(clipvalue=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match=rf"{name}: a scalar clipvalue must be a float >= 0"):
        cls(clipvalue=-1.0)
    with pytest.raises(ValueError, match=rf"{name}: a scalar clipvalue must be a float >= 0"):
        cls(clipvalue="1")
    with pytest.raises(ValueError, match=rf"{name}: clipvalue must be a float or None"):
        cls(clipvalue=("a", 1.0))


@pytest.mark.parametrize("cls", _ALL)
def test_clip_weight_order(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: clip_weight_min \(1.0\) is greater than "
                                         r"clip_weight_max \(-1.0\)"):
        cls(clip_weight_min=1.0, clip_weight_max=-1.0)
    cls(clip_weight_min=-1.0, clip_weight_max=1.0)
    cls(clip_weight_min=1.0)
    with pytest.raises(ValueError, match=rf"{cls.__name__}: clip_weight_max must be a float or None"):
        cls(clip_weight_max="1")


@pytest.mark.parametrize("cls", _ALL)
def test_negative_weight_decay(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: weight_decay_factor must be a float >= 0 or None"):
        cls(weight_decay_factor=-0.1)
    cls(weight_decay_factor=0.0)


@pytest.mark.parametrize("cls", _WITH_SLOT_FN)
def test_slot_variable_creation_fn_rejected(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: slot_variable_creation_fn .* not supported"):
        cls(slot_variable_creation_fn=lambda *a: None)


@pytest.mark.parametrize("cls", _ALL)
@pytest.mark.parametrize("value", ["0.1", None, True, [0.1]])
def test_builtin_bad_learning_rate(cls, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: learning_rate must be a float or a zero-argument callable"):
        cls(learning_rate=value)


@pytest.mark.parametrize("cls", _ALL)
def test_builtin_callable_learning_rate(cls):
    o = cls(learning_rate=lambda: 0.25)
    assert callable(o.learning_rate)


# ------------------------------------------------------------------------------------------ CustomOptimizer

@pytest.mark.parametrize("value", [None, 1.0, "f"])
def test_custom_computation_not_callable(value):
    with pytest.raises(ValueError, match=r"custom_computation must be callable"):
        ec.CustomOptimizer(value)


def test_custom_slot_names_initializers_mismatch():
    with pytest.raises(ValueError, match=r"number of slot_names \(2\) must match the number of slot_initializers \(1\)"):
        ec.CustomOptimizer(_with_slot, slot_names=["a", "b"], slot_initializers=[0.1])
    with pytest.raises(ValueError, match=r"number of slot_names \(0\) must match the number of slot_initializers \(1\)"):
        ec.CustomOptimizer(_with_slot, slot_initializers=[0.1])


def test_custom_slot_dims_mismatch():
    with pytest.raises(ValueError, match=r"number of slot_dims \(2\) must match the number of slot_names \(1\)"):
        ec.CustomOptimizer(_with_slot, slot_names=["a"], slot_initializers=[0.1], slot_dims=[2, 2])
    with pytest.raises(ValueError, match=r"number of slot_dims \(1\) must match the number of slot_names \(0\)"):
        ec.CustomOptimizer(_sgd_like, slot_dims=[1])


@pytest.mark.parametrize("dims", [[0], [3], [True], ["2"], [-1]])
def test_custom_slot_dims_values(dims):
    with pytest.raises(ValueError, match=r"slot_dims entries must be 1 .* or 2"):
        ec.CustomOptimizer(_with_slot, slot_names=["a"], slot_initializers=[0.1], slot_dims=dims)


def test_custom_slot_dims_defaults_and_ints():
    o = ec.CustomOptimizer(_with_slot, slot_names=["a", "b"], slot_initializers=[0.1, 0.0])
    assert o.slot_dims == (2, 2)
    o = ec.CustomOptimizer(_with_slot, slot_names=["a", "b"], slot_initializers=[0.1, 0.0],
                           slot_dims=[np.int64(1), 2])
    assert o.slot_dims == (1, 2) and all(type(d) is int for d in o.slot_dims)


def test_custom_duplicate_slot_names():
    with pytest.raises(ValueError, match=r"slot_names must be unique. Received: \['acc', 'acc'\]"):
        ec.CustomOptimizer(_with_slot, slot_names=["acc", "acc"], slot_initializers=[0.1, 0.1])


@pytest.mark.parametrize("name", ["", 1, None])
def test_custom_bad_slot_name(name):
    with pytest.raises(ValueError, match=r"slot_names must be non-empty strings"):
        ec.CustomOptimizer(_with_slot, slot_names=[name], slot_initializers=[0.1])


@pytest.mark.parametrize("value", ["0.1", None, [0.1], True])
def test_custom_bad_slot_initializer(value):
    with pytest.raises(ValueError, match=r"slot_initializers\[0\] must be a float, an embedcore initializer"):
        ec.CustomOptimizer(_with_slot, slot_names=["a"], slot_initializers=[value])


def test_custom_slot_initializer_forms():
    o = ec.CustomOptimizer(_with_slot, slot_names=["a", "b", "c"],
                           slot_initializers=[1, ec.Constant(0.5), lambda shape, dtype: np.zeros(shape, dtype)])
    assert o.slot_initializers[0] == 1.0 and type(o.slot_initializers[0]) is float
    assert o.slot_initializers[1] == ec.Constant(0.5)


@pytest.mark.parametrize("value", ["0.1", None, [1.0], True, np.array([1.0])])
def test_custom_bad_hyperparameter(value):
    with pytest.raises(ValueError, match=r"hyperparameters\[1\] must be a float or a zero-argument callable"):
        ec.CustomOptimizer(_sgd_like, hyperparameters=[0.5, value])


@pytest.mark.parametrize("value", ["0.1", None, True])
def test_custom_bad_learning_rate(value):
    with pytest.raises(ValueError, match=r"learning_rate must be a float or a zero-argument callable"):
        ec.CustomOptimizer(_sgd_like, learning_rate=value)


def test_custom_callable_learning_rate_and_hyperparameters():
    calls = []

    def lr():
        calls.append("lr")
        return 0.5

    o = ec.CustomOptimizer(_sgd_like, learning_rate=lr, hyperparameters=[0.1, lambda: 2, np.float32(3)])
    lr_value, hyper = o.step_values(1)
    assert calls == ["lr"]
    assert lr_value == np.float32(0.5) and isinstance(lr_value, np.float32)
    assert hyper == (np.float32(0.1), np.float32(2.0), np.float32(3.0))
    assert all(isinstance(h, np.float32) for h in hyper)


def test_custom_learning_rate_callable_must_give_finite_float():
    o = ec.CustomOptimizer(_sgd_like, learning_rate=lambda: float("nan"))
    with pytest.raises(ValueError, match=r"learning_rate evaluated to nan"):
        o.step_values(1)
    o = ec.CustomOptimizer(_sgd_like, learning_rate=lambda: "fast")
    with pytest.raises(ValueError, match=r"learning_rate must evaluate to a float, got 'fast'"):
        o.step_values(1)


# ---------------------------------------------------------------------------------------- equality / hash

def test_builtin_equality_by_value():
    assert ec.Adagrad(0.1) == ec.Adagrad(0.1)
    assert hash(ec.Adagrad(0.1)) == hash(ec.Adagrad(0.1))
    assert ec.Adagrad(0.1) != ec.Adagrad(0.2)
    assert ec.Adagrad(0.1) != ec.Adagrad(0.1, initial_accumulator_value=0.2)
    assert ec.Adagrad(0.1) != ec.Adagrad(0.1, clipvalue=1.0)
    assert ec.SGD(0.1) != ec.Adagrad(0.1)
    assert ec.Adam(0.1) == ec.Adam(0.1) and ec.Adam(0.1) != ec.Adam(0.1, lazy_adam=False)
    assert ec.FTRL(0.1, beta=0.5) == ec.FTRL(0.1, beta=0.5) != ec.FTRL(0.1)
    assert len({ec.Adagrad(0.1), ec.Adagrad(0.1), ec.Adagrad(0.2)}) == 2
    assert ec.SGD(0.1) != "SGD(0.1)"


def test_builtin_equality_callable_lr_by_identity():
    lr = lambda: 0.1  # noqa: E731
    assert ec.SGD(lr) == ec.SGD(lr) and hash(ec.SGD(lr)) == hash(ec.SGD(lr))
    assert ec.SGD(lambda: 0.1) != ec.SGD(lambda: 0.1)


def test_custom_equality_by_value_functions_by_identity():
    hp = lambda: 0.3  # noqa: E731
    a = ec.CustomOptimizer(_with_slot, 0.1, ["acc"], [0.1], hyperparameters=[0.5, hp])
    b = ec.CustomOptimizer(_with_slot, 0.1, ["acc"], [0.1], hyperparameters=[0.5, hp])
    assert a == b and hash(a) == hash(b)
    assert a != ec.CustomOptimizer(_with_slot, 0.2, ["acc"], [0.1], hyperparameters=[0.5, hp])
    assert a != ec.CustomOptimizer(_with_slot, 0.1, ["acc"], [0.2], hyperparameters=[0.5, hp])
    assert a != ec.CustomOptimizer(_with_slot, 0.1, ["acc2"], [0.1], hyperparameters=[0.5, hp])
    assert a != ec.CustomOptimizer(_with_slot, 0.1, ["acc"], [0.1], hyperparameters=[0.5, lambda: 0.3])
    assert a != ec.CustomOptimizer(_with_slot, 0.1, ["acc"], [0.1], hyperparameters=[0.5, hp], slot_dims=[1])
    f1 = lambda g, w, s, lr, h: w - lr * g  # noqa: E731
    f2 = lambda g, w, s, lr, h: w - lr * g  # noqa: E731
    assert ec.CustomOptimizer(f1) == ec.CustomOptimizer(f1)
    assert hash(ec.CustomOptimizer(f1)) == hash(ec.CustomOptimizer(f1))
    assert ec.CustomOptimizer(f1) != ec.CustomOptimizer(f2)
    assert ec.CustomOptimizer(_with_slot, 0.1, ["a"], [ec.Constant(0.5)]) == \
        ec.CustomOptimizer(_with_slot, 0.1, ["a"], [ec.Constant(0.5)])


# ----------------------------------------------------------------------------------------------------- reprs

def test_optimizer_reprs():
    r = repr(ec.Adagrad(0.25, initial_accumulator_value=0.5, clipvalue=1.5))
    assert r.startswith("Adagrad(")
    for part in ("learning_rate=0.25", "initial_accumulator_value=0.5", "clip_gradient_max=1.5"):
        assert part in r
    r = repr(ec.Adam(0.01, beta_1=0.8, lazy_adam=False))
    for part in ("Adam(", "learning_rate=0.01", "beta_1=0.8", "lazy_adam=False"):
        assert part in r
    r = repr(ec.FTRL(l1_regularization_strength=0.5))
    assert "FTRL(" in r and "l1_regularization_strength=0.5" in r
    r = repr(ec.CustomOptimizer(_with_slot, 0.5, ["accumulators"], [0.1], hyperparameters=[0.7]))
    for part in ("CustomOptimizer(", "_with_slot", "learning_rate=0.5", "accumulators", "0.7"):
        assert part in r


def test_initializer_reprs():
    assert repr(ec.Zeros()) == "Zeros()"
    r = repr(ec.TruncatedNormal(0.5, 0.2, seed=3))
    assert "TruncatedNormal(" in r and "mean=0.5" in r and "stddev=0.2" in r and "seed=3" in r
    r = repr(ec.RandomUniform(-1, 2))
    assert "minval=-1.0" in r and "maxval=2.0" in r


# --------------------------------------------------------------------------------- Embedding construction
# These fail before any Numba compilation, so they are cheap.

def test_engine_table_without_optimizer_named():
    a = ec.TableConfig(10, 4, name="has_opt", optimizer=ec.SGD(0.1))
    b = ec.TableConfig(10, 4, name="orphan")
    with pytest.raises(ValueError, match=r"table 'orphan' has no optimizer"):
        ec.Embedding({"a": ec.FeatureConfig(a), "b": ec.FeatureConfig(b)})


def test_engine_unnamed_table_without_optimizer_named():
    t = ec.TableConfig(10, 4)
    with pytest.raises(ValueError, match=r"table 'table_0' has no optimizer"):
        ec.Embedding([ec.FeatureConfig(t), ec.FeatureConfig(ec.TableConfig(10, 4, optimizer=ec.SGD(0.1)))])
    # No optimizer anywhere: a lookup-only engine, as TensorFlow's TPUEmbedding(optimizer=None)
    assert ec.Embedding(ec.FeatureConfig(ec.TableConfig(10, 4))).lookup_only


def test_engine_duplicate_table_names():
    a = ec.TableConfig(10, 4, name="same")
    b = ec.TableConfig(12, 4, name="same")
    with pytest.raises(ValueError, match=r"two different tables are named 'same'"):
        ec.Embedding({"a": ec.FeatureConfig(a), "b": ec.FeatureConfig(b)}, optimizer=ec.SGD(0.1))


@pytest.mark.parametrize("entry", [ec.TableConfig(10, 4, name="x"), 3, "feature", None])
def test_engine_entry_not_feature_config(entry):
    with pytest.raises(ValueError, match=r"feature_config entry 'bad' must be a FeatureConfig"):
        ec.Embedding({"good": ec.FeatureConfig(ec.TableConfig(10, 4, name="g")), "bad": entry},
                     optimizer=ec.SGD(0.1))


def test_engine_nested_entry_path_in_message():
    t = ec.TableConfig(10, 4, name="g")
    with pytest.raises(ValueError, match=r"feature_config entry 'outer/1' must be a FeatureConfig"):
        ec.Embedding({"outer": [ec.FeatureConfig(t), 7]}, optimizer=ec.SGD(0.1))


def test_engine_empty_and_bad_optimizer():
    with pytest.raises(ValueError, match=r"feature_config holds no FeatureConfig"):
        ec.Embedding({}, optimizer=ec.SGD(0.1))
    with pytest.raises(ValueError, match=r"optimizer must be an embedcore optimizer or None"):
        ec.Embedding(ec.FeatureConfig(ec.TableConfig(10, 4)), optimizer="sgd")


def test_engine_unnamed_tables_get_unique_names():
    # Zeros initializers keep this test about naming (see test_initializers for the random-key bug).
    user = ec.TableConfig(5, 4, name="table_0", initializer=ec.Zeros())
    u1 = ec.TableConfig(6, 4, initializer=ec.Zeros())
    u2 = ec.TableConfig(7, 4, initializer=ec.Zeros())
    shared = ec.FeatureConfig(u1)
    emb = ec.Embedding({"a": ec.FeatureConfig(user), "b": shared, "c": ec.FeatureConfig(u2),
                        "d": ec.FeatureConfig(u1)}, optimizer=ec.SGD(0.1))
    names = [user.name, u1.name, u2.name]
    assert user.name == "table_0"
    assert len(set(names)) == 3
    assert set(emb.tables) == set(names)
    assert emb.tables["table_0"] is user
    assert emb.embedding_tables[u1.name].shape == (6, 4)
    assert emb.embedding_tables[u2.name].shape == (7, 4)
    assert emb.embedding_tables["table_0"].shape == (5, 4)
    r = repr(emb)
    assert "4 features" in r and "step=0" in r and "SGD" in r
    for name in names:
        assert name in r
