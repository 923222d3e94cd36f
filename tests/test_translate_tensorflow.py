"""TensorFlow custom computations, as TensorFlow's users write them, translated to NumPy-level row functions:
TensorFlow's documented examples verbatim, every op family against the NumPy version of the same function
(bit for bit, compiled as the engine compiles it) and against TensorFlow itself, the refusal of other ops,
the kernel path each translation takes, the fingerprint across processes, and whole engine runs."""

import inspect
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from tensorflow.python.eager import def_function  # noqa: E402  (TensorFlow's own documentation uses these)
from tensorflow.python.ops import math_ops  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore import compile_cache  # noqa: E402
from embedcore.compiler import RowFunctionError  # noqa: E402
from embedcore.translate import framework_of, to_numpy_row_function  # noqa: E402

from .test_translate_numpy_source import (  # noqa: E402
    DIMS, as_outputs, assert_compiled_equal, assert_engines_equal, copy_arguments, random_arguments, run_engine)


# ----------------------------------------------------------------------------------------------------------
# TensorFlow's documented examples (tf.tpu.experimental.embedding.CustomOptimizer), verbatim.

@tf.function
def sgd_optimizer_computation(
    gradient,
    embedding_table,
    slot_variables,
    learning_rate,
    hyperparameters,
):
  del slot_variables, hyperparameters
  return embedding_table - gradient * learning_rate


@def_function.function
def adagrad_optimizer_computation(
    gradient,
    embedding_table,
    slot_variables,
    learning_rate,
    hyperparameters,
):
  del hyperparameters
  accumulator = slot_variables[0]
  new_accumulator = accumulator + gradient * gradient
  updated_embedding_table = (
      embedding_table
      - learning_rate * gradient / math_ops.sqrt(new_accumulator)
  )
  return (updated_embedding_table, new_accumulator)


# The same function as plain Python over TensorFlow ops (what a user writes without the decorator).
plain_adagrad_optimizer_computation = adagrad_optimizer_computation.python_function


def numpy_sgd(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return embedding_table - gradient * learning_rate


def numpy_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    new_accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / np.sqrt(new_accumulator), new_accumulator


def tf_eager(fn, args):
    """``fn`` run by TensorFlow itself on the same float32 values."""
    g, row, slots, lr, hyper = args
    c = tf.constant
    out = fn(c(g), c(row), tuple(c(s) for s in slots), c(lr), tuple(c(h) for h in hyper))
    return [np.asarray(v) for v in (out if isinstance(out, (tuple, list)) else (out,))]


def assert_matches_tensorflow(fn, translated, slot_dims, n_hyperparameters, rtol=2e-6, atol=1e-6):
    rng = np.random.default_rng(1)
    for dim in DIMS:
        args = random_arguments(rng, dim, slot_dims, n_hyperparameters)
        with np.errstate(all="ignore"):  # the generated Python run by NumPy itself (div_no_nan divides by 0)
            got = as_outputs(translated(*copy_arguments(args)), len(slot_dims), dim)
        want = [np.broadcast_to(v, (dim,)) for v in tf_eager(fn, args)]
        for x, y in zip(got, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("fn", [adagrad_optimizer_computation, plain_adagrad_optimizer_computation],
                         ids=["tf.function", "plain"])
def test_documented_adagrad_translates_verbatim(fn):
    assert framework_of(fn) == "tensorflow"
    translated = to_numpy_row_function(fn, (2,), 0)
    source = inspect.getsource(translated)
    assert "np.sqrt(" in source and "del " not in source
    assert translated.__name__ == fn.__name__ if not hasattr(fn, "python_function") else True
    assert_compiled_equal(translated, numpy_adagrad, (2,), 0)
    assert_matches_tensorflow(fn, translated, (2,), 0)
    assert to_numpy_row_function(fn, (2,), 0) is translated  # remembered: one row function per function


def test_documented_sgd_translates_verbatim():
    translated = to_numpy_row_function(sgd_optimizer_computation, (), 0)
    assert_compiled_equal(translated, numpy_sgd, (), 0)
    assert_matches_tensorflow(sgd_optimizer_computation, translated, (), 0)


# ----------------------------------------------------------------------------------------------------------
# One case per op family: (TensorFlow function, the NumPy version of the same function, slot_dims,
# number of hyperparameters). The NumPy versions write TensorFlow's float32 constants as np.float32.

f32 = np.float32


def tf_arithmetic(g, w, s, lr, h):
    a = g + w - g * w / (s[0] + 1.0)
    d = tf.where(g > 0.0, w, 0.0)
    b = -a + tf.math.divide_no_nan(g, d)
    c = tf.math.floordiv(g, 0.3) + tf.math.floormod(w, 0.7) + tf.add_n([a, b, g])
    return w - lr * c, s[0] + tf.math.truediv(a, 3.0)


def np_arithmetic(g, w, s, lr, h):
    a = g + w - g * w / (s[0] + f32(1.0))
    d = np.where(g > f32(0.0), w, f32(0.0))
    b = -a + np.where(d == f32(0.0), f32(0.0), g / d)
    c = np.floor_divide(g, f32(0.3)) + np.mod(w, f32(0.7)) + (a + b + g)
    return w - lr * c, s[0] + a / f32(3.0)


def tf_unary(g, w, s, lr, h):
    x = tf.abs(g) + 0.5
    y = (tf.sqrt(x) + tf.math.rsqrt(x) + tf.square(g) + tf.pow(x, h[0]) + tf.exp(-x) + tf.math.log(x)
         + tf.sign(g) + tf.math.reciprocal(x))
    return w - lr * y


def np_unary(g, w, s, lr, h):
    x = np.abs(g) + f32(0.5)
    y = (np.sqrt(x) + f32(1.0) / np.sqrt(x) + np.square(g) + np.power(x, h[0]) + np.exp(-x) + np.log(x)
         + np.sign(g) + np.reciprocal(x))
    return w - lr * y


def tf_min_max_clip(g, w, s, lr, h):
    a = (tf.maximum(g, w) - tf.minimum(g, h[0]) + tf.clip_by_value(g, -0.5, 0.5)
         + tf.raw_ops.ClipByValue(t=w, clip_value_min=-h[0], clip_value_max=h[1]))
    return w - lr * a, tf.minimum(s[0], a)


def np_min_max_clip(g, w, s, lr, h):
    a = (np.maximum(g, w) - np.minimum(g, h[0]) + np.maximum(np.minimum(g, f32(0.5)), f32(-0.5))
         + np.maximum(np.minimum(w, h[1]), -h[0]))
    return w - lr * a, np.minimum(s[0], a)


def tf_select_compare_logic(g, w, s, lr, h):
    keep = tf.logical_and(g > -0.5, tf.logical_not(tf.equal(g, w)))
    either = tf.logical_or(g <= h[0], w >= 0.0)
    flags = tf.cast(g < w, tf.float32) + tf.cast(tf.not_equal(g, 0.0), tf.float32)
    update = tf.where(keep, g, 0.0) + tf.raw_ops.Select(condition=either, x=w, y=g) + flags
    return w - lr * update, tf.where(s[0] > 1.0, s[0] * 0.5, s[0] + lr)


def np_select_compare_logic(g, w, s, lr, h):
    keep = np.logical_and(g > f32(-0.5), np.logical_not(g == w))
    either = np.logical_or(g <= h[0], w >= f32(0.0))
    flags = np.where(g < w, f32(1.0), f32(0.0)) + np.where(g != f32(0.0), f32(1.0), f32(0.0))
    update = np.where(keep, g, f32(0.0)) + np.where(either, w, g) + flags
    return w - lr * update, (s[0] * f32(0.5) if s[0] > f32(1.0) else s[0] + lr)


def tf_cast(g, w, s, lr, h):
    x = tf.cast(g, tf.float64) * tf.cast(lr, tf.float64)
    return w - tf.cast(x, tf.float32)


def np_cast(g, w, s, lr, h):
    x = g.astype(np.float64) * np.float64(lr)
    return w - x.astype(np.float32)


def tf_reductions(g, w, s, lr, h):
    n = tf.cast(tf.size(g), tf.float32)
    accumulator = s[0] + tf.reduce_sum(g * g) / n
    spread = tf.reduce_max(w, axis=0) - tf.reduce_min(w, keepdims=True)
    norms = tf.norm(g) * tf.math.reduce_euclidean_norm(w)
    centred = g - tf.reduce_mean(g, axis=-1)
    return w - lr * centred / tf.sqrt(accumulator) + spread * 0.01 + norms * 0.001, accumulator


def np_reductions(g, w, s, lr, h):
    n = f32(g.size)
    accumulator = s[0] + np.sum(g * g) / n
    spread = np.max(w) - np.min(w)
    norms = np.sqrt(np.sum(g * g)) * np.sqrt(np.sum(w * w))
    centred = g - np.mean(g)
    return w - lr * centred / np.sqrt(accumulator) + spread * f32(0.01) + norms * f32(0.001), accumulator


def tf_structure(g, w, s, lr, h):
    first, second = tf.unstack(tf.stack([s[0], g]))
    hs = tf.stack(h)
    decay = hs[1]
    a, b = tf.identity_n([first, second])
    c = tf.stop_gradient(a)
    scalar = tf.squeeze(tf.reshape(s[1], [1]))
    return w - tf.identity(lr) * b * decay + c * tf.gather(hs, 0), a + b, scalar + tf.reduce_sum(b)


def np_structure(g, w, s, lr, h):
    return w - lr * g * h[1] + s[0] * h[0], s[0] + g, s[1] + np.sum(g)


def tf_scalar_slot_broadcast(g, w, s, lr, h):
    accumulator = s[0] + tf.reduce_mean(g * g)
    momentum = 0.9 * s[1] + g / tf.sqrt(accumulator)
    return w - lr * momentum, accumulator, momentum


def np_scalar_slot_broadcast(g, w, s, lr, h):
    accumulator = s[0] + np.mean(g * g)
    momentum = f32(0.9) * s[1] + g / np.sqrt(accumulator)
    return w - lr * momentum, accumulator, momentum


FAMILIES = {
    "arithmetic": (tf_arithmetic, np_arithmetic, (2,), 0),
    "unary": (tf_unary, np_unary, (), 1),
    "min-max-clip": (tf_min_max_clip, np_min_max_clip, (2,), 2),
    "select-compare-logic": (tf_select_compare_logic, np_select_compare_logic, (1,), 1),
    "cast": (tf_cast, np_cast, (), 0),
    "reductions": (tf_reductions, np_reductions, (1,), 0),
    "structure": (tf_structure, np_structure, (2, 1), 2),
    "scalar-slot-broadcast": (tf_scalar_slot_broadcast, np_scalar_slot_broadcast, (1, 2), 0),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_op_family_equals_numpy_version(family):
    tf_fn, np_fn, slot_dims, n_hyper = FAMILIES[family]
    translated = to_numpy_row_function(tf_fn, slot_dims, n_hyper)
    assert_compiled_equal(translated, np_fn, slot_dims, n_hyper)
    # and TensorFlow computes the same (up to its own float32 rounding: reductions sum in another order)
    assert_matches_tensorflow(tf_fn, translated, slot_dims, n_hyper, rtol=1e-5, atol=1e-5)


def test_the_families_cover_the_ops():
    seen = set()
    for tf_fn, _, slot_dims, n_hyper in FAMILIES.values():
        row, scalar = tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.float32)
        concrete = tf.function(tf_fn).get_concrete_function(
            row, row, tuple(row if d == 2 else scalar for d in slot_dims), scalar, (scalar,) * n_hyper)
        seen |= {op.type for op in concrete.graph.get_operations()}
    expected = {"AddV2", "Sub", "Mul", "RealDiv", "DivNoNan", "FloorDiv", "FloorMod", "Neg", "AddN", "Sqrt",
                "Rsqrt", "Square", "Pow", "Exp", "Log", "Abs", "Sign", "Reciprocal", "Maximum", "Minimum",
                "ClipByValue", "Select", "SelectV2", "Less", "LessEqual", "Greater", "GreaterEqual", "Equal",
                "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "Cast", "Sum", "Mean", "Max", "Min",
                "EuclideanNorm", "Size", "Squeeze", "Reshape", "Identity", "IdentityN", "StopGradient", "Const",
                "Pack", "Unpack", "StridedSlice", "GatherV2", "Placeholder"}
    assert expected <= seen, expected - seen


def test_row_constant():
    @tf.function
    def weighted(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient * tf.constant([1.0, 0.5, 0.25])

    def numpy_weighted(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient * np.array([1.0, 0.5, 0.25], np.float32)

    translated = to_numpy_row_function(weighted, (), 0)
    assert "np.array([1.0, 0.5, 0.25], dtype=np.float32)" in inspect.getsource(inspect.getmodule(translated)) \
        or "const_0" in inspect.getsource(translated)
    assert_compiled_equal(translated, numpy_weighted, (), 0, dims=(3,))


@tf.function
def tf_scaled_square(x, scale):
    return scale * tf.square(x)


@tf.function
def tf_rms_with_a_helper(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del hyperparameters
    accumulator = slot_variables[0] + tf_scaled_square(gradient, 0.5)  # a call of another tf.function
    return embedding_table - learning_rate * gradient * tf.math.rsqrt(accumulator), accumulator


@pytest.mark.parametrize("fn", [tf_rms_with_a_helper, tf.function(adagrad_optimizer_computation)],
                         ids=["helper", "wrapped-twice"])
def test_calls_of_other_tf_functions_are_translated_in_place(fn):
    """A tf.function that calls another (a decorated helper, or TensorFlow's decorated example wrapped again)
    traces as a call op; the called graph is translated in place and computes what TensorFlow computes."""
    graph = fn.get_concrete_function(*_row_specs((2,), 0)).graph
    assert any(op.type in ("PartitionedCall", "StatefulPartitionedCall") for op in graph.get_operations())
    translated = to_numpy_row_function(fn, (2,), 0)
    assert_matches_tensorflow(fn, translated, (2,), 0, rtol=1e-5)
    if fn is not tf_rms_with_a_helper:
        assert_compiled_equal(translated, numpy_adagrad, (2,), 0)


def _row_specs(slot_dims, n_hyper):
    row, scalar = tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.float32)
    return row, row, tuple(row if d == 2 else scalar for d in slot_dims), scalar, (scalar,) * n_hyper


# ----------------------------------------------------------------------------------------------------------
# What cannot be translated is refused, naming the op and the function.

def tf_tanh(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return embedding_table - learning_rate * tf.math.tanh(gradient)


def test_unsupported_op_names_op_and_function():
    with pytest.raises(RowFunctionError, match=r"tf_tanh.*TensorFlow op Tanh \('Tanh'\) is not supported"):
        to_numpy_row_function(tf_tanh, (), 0)


def test_variable_read_is_refused_with_advice():
    scale = tf.Variable(0.5)

    @tf.function
    def reads_variable(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - scale * gradient

    with pytest.raises(RowFunctionError, match="tf.Variable.*hyperparameter"):
        to_numpy_row_function(reads_variable, (), 0)


def test_branch_on_tensor_and_row_indexing_are_refused():
    def branches(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        if tf.reduce_sum(gradient) > 0:  # autograph makes this a tf.cond
            return embedding_table - gradient
        return embedding_table

    def indexes(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - gradient[0]

    with pytest.raises(RowFunctionError, match=r"branches.*TensorFlow op (StatelessIf|If)"):
        to_numpy_row_function(branches, (), 0)
    assert framework_of(indexes) == "numpy"  # it reads no TensorFlow name: say so
    with pytest.raises(RowFunctionError, match=r"indexes.*StridedSlice.*indexes or slices a row"):
        to_numpy_row_function(indexes, (), 0, framework="tensorflow")


def test_tracing_error_names_the_function():
    def wrong_slots(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - tf.identity(slot_variables[3])

    with pytest.raises(RowFunctionError, match="wrong_slots could not be traced by TensorFlow"):
        to_numpy_row_function(wrong_slots, (2,), 0)


# ----------------------------------------------------------------------------------------------------------
# The translation takes the kernel path a NumPy function would.

def tf_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + tf.reduce_mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / (tf.sqrt(accumulator) + hyperparameters[0]), accumulator


def np_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + np.mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + hyperparameters[0]), accumulator


def test_elementwise_translation_is_inlined():
    optimizer = ec.CustomOptimizer(to_numpy_row_function(adagrad_optimizer_computation, (2,), 0), 0.1,
                                   ["accumulators"], [0.1])
    assert optimizer.compiled(8).elementwise
    assert "element by element, inlined" in optimizer.explain(8)
    assert "adagrad_optimizer_computation" in optimizer.explain(8)


def test_reducing_translation_is_split():
    optimizer = ec.CustomOptimizer(to_numpy_row_function(tf_rowwise, (1,), 1), 0.1, ["accumulators"], [0.1],
                                   slot_dims=[1], hyperparameters=[1e-3])
    compiled = optimizer.compiled(8)
    assert not compiled.elementwise and compiled.split, compiled.reason
    assert "its reductions first" in optimizer.explain(8)


def test_translation_with_logic_runs_per_row():
    optimizer = ec.CustomOptimizer(to_numpy_row_function(tf_select_compare_logic, (1,), 1), 0.1, ["s"], [0.5],
                                   slot_dims=[1], hyperparameters=[0.2])
    compiled = optimizer.compiled(8)
    assert not compiled.elementwise and not compiled.split
    assert "once per row" in optimizer.explain(8)


# ----------------------------------------------------------------------------------------------------------
# Fingerprints: the same function, the same fingerprint in every process; another constant, another one.

MODULE = textwrap.dedent('''
    import tensorflow as tf
    from tensorflow.python.eager import def_function
    from tensorflow.python.ops import math_ops

''') + inspect.getsource(adagrad_optimizer_computation.python_function)  # TF's example, decorator included

WORKER = textwrap.dedent('''
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import tf_row_module
    import embedcore as ec
    from embedcore import compile_cache
    from embedcore.kernels.update import fused_update_kernel
    from embedcore.translate import to_numpy_row_function

    row_function = to_numpy_row_function(tf_row_module.adagrad_optimizer_computation, (2,), 0)
    opt = ec.CustomOptimizer(row_function, learning_rate=0.5, slot_names=["a"], slot_initializers=[0.1])
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(20, 8, name="t", initializer=ec.Zeros()))}, opt)
    acts, ctx = emb({"f": np.array([1, 3, 3, 7])})
    emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
    group = emb.physical_tables[0]
    kernel = fused_update_kernel(group.row_function, dim=group.dim)
    print(json.dumps({"fingerprint": compile_cache.fingerprint(row_function),
                      "table": emb.embedding_tables["t"].tolist(),
                      "kernel_hits": sum(kernel.stats.cache_hits.values()),
                      "kernel_misses": sum(kernel.stats.cache_misses.values())}))
''')


def test_fingerprint_is_stable_across_processes_and_the_disk_cache_serves_it(tmp_path):
    (tmp_path / "tf_row_module.py").write_text(MODULE)
    (tmp_path / "worker.py").write_text(WORKER)
    env = dict(os.environ, EMBEDCORE_CACHE_DIR=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(tmp_path)], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["fingerprint"] == runs[1]["fingerprint"]
    assert runs[0]["table"] == runs[1]["table"]
    assert runs[1]["kernel_misses"] == 0 and runs[1]["kernel_hits"] > 0  # compiled once, loaded the second time


def test_fingerprint_differs_for_another_constant_or_op():
    def with_epsilon(epsilon):
        def adagrad_eps(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
            accumulator = slot_variables[0] + gradient * gradient
            return embedding_table - learning_rate * gradient / (tf.sqrt(accumulator) + epsilon), accumulator
        return adagrad_eps

    a = to_numpy_row_function(with_epsilon(1e-3), (2,), 0)
    b = to_numpy_row_function(with_epsilon(1e-3), (2,), 0)
    c = to_numpy_row_function(with_epsilon(1e-4), (2,), 0)
    d = to_numpy_row_function(plain_adagrad_optimizer_computation, (2,), 0)
    assert compile_cache.fingerprint(a) == compile_cache.fingerprint(b)
    assert compile_cache.fingerprint(a) != compile_cache.fingerprint(c)
    assert compile_cache.fingerprint(a) != compile_cache.fingerprint(d)


# ----------------------------------------------------------------------------------------------------------
# Whole engine runs: the translated optimizer equals the same NumPy optimizer bit for bit.

ENGINE_CASES = {
    "documented-adagrad": (adagrad_optimizer_computation, numpy_adagrad,
                           dict(slot_names=["accumulators"], slot_initializers=[0.1])),
    "documented-sgd": (sgd_optimizer_computation, numpy_sgd, {}),
    "rowwise-split": (tf_rowwise, np_rowwise, dict(slot_names=["accumulators"], slot_initializers=[0.1],
                                                   slot_dims=[1], hyperparameters=[1e-3])),
    "per-row-logic": (tf_select_compare_logic, np_select_compare_logic,
                      dict(slot_names=["s"], slot_initializers=[0.5], slot_dims=[1], hyperparameters=[0.2])),
    "min-max-clip": (tf_min_max_clip, np_min_max_clip, dict(slot_names=["m"], slot_initializers=[0.3],
                                                            hyperparameters=[0.2, lambda: 0.4])),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_with_translated_optimizer_equals_numpy_optimizer(case):
    tf_fn, np_fn, options = ENGINE_CASES[case]
    slot_dims = options.get("slot_dims", [2] * len(options.get("slot_names", ())))
    translated = to_numpy_row_function(tf_fn, slot_dims, len(options.get("hyperparameters", ())))
    got = run_engine(ec.CustomOptimizer(translated, learning_rate=0.2, **options))
    want = run_engine(ec.CustomOptimizer(np_fn, learning_rate=0.2, **options))
    assert_engines_equal(got, want)
