"""``ec.CustomOptimizer(custom_computation=<TensorFlow or JAX function>)`` directly, as TensorFlow's page writes it.

The translation itself is tested in tests/test_translate_tensorflow.py and tests/test_translate_jax.py through
``to_numpy_row_function``; these tests check that ``CustomOptimizer`` hands such functions to it.
"""

import inspect

import pytest

tf = pytest.importorskip("tensorflow")
jax = pytest.importorskip("jax")

import embedcore as ec  # noqa: E402
from embedcore.compiler import RowFunctionError  # noqa: E402

from .test_translate_numpy_source import assert_engines_equal, run_engine  # noqa: E402
from .test_translate_tensorflow import (adagrad_optimizer_computation, np_rowwise, numpy_adagrad,  # noqa: E402
                                       tf_rowwise)
from .test_translate_jax import jax_adagrad  # noqa: E402


def test_wiring_documented_tf_function_directly():
    optimizer = ec.CustomOptimizer(
        custom_computation=adagrad_optimizer_computation,
        learning_rate=1.0,
        slot_names=['accumulators'],
        slot_initializers=[0.1],
    )
    assert optimizer.custom_computation is adagrad_optimizer_computation
    assert "np.sqrt(" in inspect.getsource(optimizer.row_function())
    assert "element by element, inlined" in optimizer.explain(8)
    assert "adagrad_optimizer_computation" in optimizer.explain(8)
    again = ec.CustomOptimizer(adagrad_optimizer_computation, 1.0, ['accumulators'], [0.1])
    assert again == optimizer and hash(again) == hash(optimizer)  # may share one stacked table
    assert_engines_equal(run_engine(optimizer),
                         run_engine(ec.CustomOptimizer(numpy_adagrad, 1.0, ['accumulators'], [0.1])))


def test_wiring_plain_tf_function_with_a_scalar_slot_is_split():
    options = dict(learning_rate=0.2, slot_names=["a"], slot_initializers=[0.1], slot_dims=[1],
                   hyperparameters=[1e-3])
    optimizer = ec.CustomOptimizer(tf_rowwise, **options)
    assert optimizer.compiled(8).split
    assert_engines_equal(run_engine(optimizer), run_engine(ec.CustomOptimizer(np_rowwise, **options)))


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jax.jit"])
def test_wiring_jax_function_directly(jit):
    fn = jax.jit(jax_adagrad) if jit else jax_adagrad
    optimizer = ec.CustomOptimizer(fn, 0.5, ["a"], [0.1])
    assert optimizer.compiled(8).elementwise
    assert_engines_equal(run_engine(optimizer), run_engine(ec.CustomOptimizer(numpy_adagrad, 0.5, ["a"], [0.1])))


def test_wiring_numpy_function_is_its_own_row_function():
    assert ec.CustomOptimizer(numpy_adagrad, 0.5, ["a"], [0.1]).row_function() is numpy_adagrad


def test_wiring_untranslatable_function_is_refused_at_construction():
    def uses_tanh(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * tf.math.tanh(gradient)

    with pytest.raises(RowFunctionError, match="uses_tanh.*Tanh"):
        ec.CustomOptimizer(uses_tanh, 0.1)


@jax.jit  # as a user writes it: the module attribute is the decorated function's own name
def jitted_jax_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return jax_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)


@pytest.mark.parametrize("fn", [adagrad_optimizer_computation, jitted_jax_adagrad], ids=["tf.function", "jax.jit"])
def test_wiring_framework_functions_pickle_and_restore_by_import_path(fn, tmp_path):
    """A module-level ``tf.function`` / ``jax.jit`` custom computation is named by its import path like a def:
    pickling and ``restore(allow_import=True)`` import the same object, and the engines go on equally."""
    import copy
    import pickle

    import numpy as np

    from embedcore.checkpoint import CheckpointError

    def train_step(emb):
        acts, ctx = emb({"f": [[1, 3], [3], []]})
        emb.apply_gradients({"f": acts["f"] * 0.5 + 0.25}, ctx)

    engine = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(12, 4, name="t"))},
                          ec.CustomOptimizer(fn, 0.5, ["a"], [0.1]))
    train_step(engine)
    engine.save(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="never imports code on its own"):
        ec.Embedding.restore(tmp_path / "ckpt")
    twins = [pickle.loads(pickle.dumps(engine)), ec.Embedding.restore(tmp_path / "ckpt", allow_import=True)]
    train_step(engine)
    for twin in twins:
        assert twin.optimizer.custom_computation is fn
        train_step(twin)
        np.testing.assert_array_equal(twin.embedding_tables["t"], engine.embedding_tables["t"])
        np.testing.assert_array_equal(twin.slot_variables["t"]["a"], engine.slot_variables["t"]["a"])
    assert copy.deepcopy(engine).optimizer is engine.optimizer
