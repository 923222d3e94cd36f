"""EvictByScore score functions written in TensorFlow or JAX, translated under the score contract
``f(embedding_table, last_seen, count, step) -> number`` (row float32, the others int64): each gives exactly the
scores of the NumPy function written the same way and those of its framework itself, on random rows and
metadata; a dynamic table evicting with it picks exactly the keys the NumPy-function policy picks; what
cannot be translated (other ops, a row or several values returned, mixed dtypes) is refused at construction,
naming the function."""

import copy
import functools
import inspect
import pickle
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

tf = pytest.importorskip("tensorflow")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore.compiler import RowFunctionError  # noqa: E402
from embedcore.translate import SCORE, framework_of, to_numpy_function  # noqa: E402

f32 = np.float32
I64 = tf.TensorSpec([], tf.int64)


# ----------------------------------------------------------------------------------------------------------
# Score functions: TensorFlow (tf.function and plain TF ops), JAX (plain and jax.jit), and NumPy functions
# written the same way (the oracle). tf.norm and jnp.linalg.norm trace to sqrt(sum(x * x)).

@tf.function
def tf_lru(embedding_table, last_seen, count, step):
    return -(step - last_seen)


@tf.function(input_signature=[tf.TensorSpec([None], tf.float32), I64, I64, I64])
def tf_lfu(embedding_table, last_seen, count, step):
    return count


def tf_norm(embedding_table, last_seen, count, step):
    return tf.norm(embedding_table)


def tf_mix(embedding_table, last_seen, count, step):
    age = step - last_seen
    recent = tf.where(age > 3, tf.minimum(age, 100), tf.zeros_like(age))
    return (tf.norm(embedding_table) * 0.5 + tf.cast(tf.maximum(count, 2), tf.float32)
            - tf.cast(recent, tf.float32) * 0.25)


def jax_lru(embedding_table, last_seen, count, step):
    return jnp.negative(step - last_seen)


@jax.jit
def jax_lfu(embedding_table, last_seen, count, step):
    return count


def jax_norm(embedding_table, last_seen, count, step):
    return jnp.linalg.norm(embedding_table)


def jax_mix(embedding_table, last_seen, count, step):
    age = step - last_seen
    recent = jnp.where(age > 3, jnp.minimum(age, 100), 0)
    return jnp.linalg.norm(embedding_table) * 0.5 + jnp.maximum(count, 2) - recent * 0.25  # JAX promotes


def np_lru(embedding_table, last_seen, count, step):
    return -(step - last_seen)


def np_lfu(embedding_table, last_seen, count, step):
    return count


def np_norm(embedding_table, last_seen, count, step):
    return np.sqrt(np.sum(embedding_table * embedding_table))


def np_mix(embedding_table, last_seen, count, step):
    age = step - last_seen
    recent = min(age, 100) if age > 3 else 0
    norm = np.sqrt(np.sum(embedding_table * embedding_table))
    return norm * f32(0.5) + f32(max(count, 2)) - f32(recent) * f32(0.25)


CASES = {
    "tf-lru-tf.function": (tf_lru, np_lru),
    "tf-lfu-input_signature": (tf_lfu, np_lfu),
    "tf-norm-plain": (tf_norm, np_norm),
    "tf-mix-cast-plain": (tf_mix, np_mix),
    "jax-lru-plain": (jax_lru, np_lru),
    "jax-lfu-jit": (jax_lfu, np_lfu),
    "jax-norm-plain": (jax_norm, np_norm),
    "jax-mix-promotion-plain": (jax_mix, np_mix),
}


@functools.lru_cache(maxsize=None)
def compiled_pair(case):
    """(the policy's compiled score, the NumPy function compiled by Numba) of ``case``."""
    fn, numpy_fn = CASES[case]
    return ec.EvictByScore(fn).compiled(), numba.njit(numpy_fn)


def framework_score(fn, row, last_seen, count, step):
    """``fn`` run by its framework itself on the same values (JAX jitted: it converts the int64 arguments as
    ``jax.jit`` does)."""
    if framework_of(fn) == "tensorflow":
        return np.asarray(fn(tf.constant(row), *(tf.constant(np.int64(v)) for v in (last_seen, count, step))))
    return np.asarray(jax.jit(fn)(row, np.int64(last_seen), np.int64(count), np.int64(step)))


@st.composite
def rows_and_metadata(draw):
    """A float32 row of 1..17 values and int64 metadata as a table holds them (0 <= last_seen <= step < 2**31)."""
    values = draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=17))
    step = draw(st.integers(0, 2 ** 31 - 1))
    last_seen = draw(st.integers(0, step))
    count = draw(st.integers(0, 2 ** 31 - 1))
    return np.array(values, np.float32), np.int64(last_seen), np.int64(count), np.int64(step)


@pytest.mark.parametrize("case", sorted(CASES))
def test_framework_is_recognised_and_fn_is_kept(case):
    fn, _ = CASES[case]
    policy = ec.EvictByScore(fn)
    assert policy.fn is fn
    assert framework_of(fn) == {"tf": "tensorflow", "jax": "jax"}[case.split("-")[0]]
    assert policy == ec.EvictByScore(fn) and hash(policy) == hash(ec.EvictByScore(fn))
    assert policy != ec.EvictByScore(np_lru)
    framework, kind = case.split("-")[:2]
    assert repr(policy) == f"EvictByScore({__name__}.{framework}_{kind})"
    source = inspect.getsource(to_numpy_function(fn, SCORE))
    assert "def " in source and "(embedding_table, last_seen, count, step):" in source
    assert copy.deepcopy(policy) == policy  # a traced tf.function cannot be deep-copied: the policy is shared


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=40, deadline=None)
@given(rows_and_metadata())
def test_scores_equal_the_numpy_function_and_the_framework(case, example):
    row, last_seen, count, step = example
    translated, numpy_version = compiled_pair(case)
    got = translated(row, last_seen, count, step)
    want = numpy_version(row, last_seen, count, step)
    assert np.float64(got) == np.float64(want) and np.isfinite(np.float64(got)), (got, want)
    framework = framework_score(CASES[case][0], row, last_seen, count, step)
    if np.issubdtype(framework.dtype, np.integer):
        assert int(got) == int(framework)
    else:
        np.testing.assert_allclose(np.float64(got), np.float64(framework), rtol=2e-6, atol=1e-6)


# int64 values whose int32 truncations and differences overflow (hypothesis favours small integers)
wide_int = st.one_of(st.sampled_from([-2 ** 63, -2 ** 32 - 7, -2 ** 31 - 1, -2 ** 31, -1, 0, 1, 2 ** 31 - 1, 2 ** 31,
                                      2 ** 32 + 5, 2 ** 40 + 3, 2 ** 63 - 1]),
                     st.integers(-2 ** 31, 2 ** 31 - 1), st.integers(-2 ** 63, 2 ** 63 - 1))


@settings(max_examples=80, deadline=None)
@given(wide_int, wide_int, wide_int)
@example(-2 ** 31, 0, 2 ** 31 - 1)
def test_integers_wrap_as_the_framework_wraps_them(last_seen, count, step):
    """Metadata no table holds (beyond int32, negative): TensorFlow's int64 and JAX's int32 (no jax_enable_x64:
    int64 arguments are converted, wrapping) arithmetic, exactly."""
    row = np.ones(3, np.float32)
    for fn in (tf_lru, jax_lru, jax_lfu):
        translated = ec.EvictByScore(fn).compiled()
        got = translated(row, np.int64(last_seen), np.int64(count), np.int64(step))
        assert int(got) == int(framework_score(fn, row, last_seen, count, step)), fn


# ----------------------------------------------------------------------------------------------------------
# A dynamic table evicting with a translated score picks exactly the keys the NumPy-function policy picks.

def dynamic_run(score, steps=14, seed=5):
    """The keys a 24-row dynamic table holds after each of ``steps`` batches of Zipf-distributed keys (from
    97), evicting with ``EvictByScore(score)``, and its final rows."""
    table = ec.DynamicTableConfig(4, 24, name="t", combiner="sum", eviction=ec.EvictByScore(score))
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.5), seed=seed)
    view = emb.embedding_tables["t"]
    rng = np.random.default_rng(seed)
    held = []
    for _ in range(steps):
        ids = (rng.zipf(1.3, (6, 3)) * 7919 % 97).astype(np.int64)
        acts, ctx = emb({"f": ids})
        emb.apply_gradients({"f": rng.standard_normal(acts["f"].shape).astype(np.float32)}, ctx)
        held.append(view.keys().tolist())
    return held, view[view.keys()]


@functools.lru_cache(maxsize=None)
def numpy_run(numpy_fn):
    return dynamic_run(numpy_fn)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dynamic_table_evicts_the_keys_the_numpy_policy_evicts(case):
    fn, numpy_fn = CASES[case]
    held, rows = dynamic_run(fn)
    want_held, want_rows = numpy_run(numpy_fn)
    assert held == want_held
    np.testing.assert_array_equal(rows, want_rows)


def test_the_run_evicts_and_tells_the_scores_apart():
    runs = {fn.__name__: numpy_run(fn)[0] for fn in (np_lru, np_lfu, np_norm, np_mix)}
    for held in runs.values():
        evicted = sum(len(set(a) - set(b)) for a, b in zip(held, held[1:]))
        assert len(held[-1]) == 24 and evicted >= 10
    assert len({str(held) for held in runs.values()}) == len(runs)  # each score picks other keys


def test_an_engine_with_a_plain_tf_score_pickles_and_evicts_alike():
    """Pickled as a checkpoint: the plain function is stored by import path and translated again."""
    table = ec.DynamicTableConfig(4, 24, name="t", eviction=ec.EvictByScore(tf_mix))
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.5))
    emb({"f": np.arange(20)})
    back = pickle.loads(pickle.dumps(emb))
    for engine in (emb, back):
        for ids in (np.arange(20, 30), np.arange(35, 45)):
            acts, ctx = engine({"f": ids})
            engine.apply_gradients({"f": np.full(acts["f"].shape, 0.5, np.float32)}, ctx)
    assert back.embedding_tables["t"].keys().tolist() == emb.embedding_tables["t"].keys().tolist()
    assert len(emb.embedding_tables["t"]) == 24


# ----------------------------------------------------------------------------------------------------------
# Refused at construction, naming the function and the cause.

def tf_tanh(embedding_table, last_seen, count, step):
    return tf.math.tanh(tf.reduce_sum(embedding_table))


def jax_tanh(embedding_table, last_seen, count, step):
    return jnp.tanh(jnp.sum(embedding_table))


def tf_row(embedding_table, last_seen, count, step):
    return tf.abs(embedding_table)


def jax_row(embedding_table, last_seen, count, step):
    return jnp.abs(embedding_table) + count


def tf_two(embedding_table, last_seen, count, step):
    return tf.norm(embedding_table), count


def tf_bool(embedding_table, last_seen, count, step):
    return tf.greater(count, 3)


def tf_int_division(embedding_table, last_seen, count, step):
    return tf.cast((step - last_seen) // 10, tf.float32)


def jax_int_division(embedding_table, last_seen, count, step):
    return (step - last_seen) // 10 + jnp.sum(embedding_table)


def tf_mixed_dtypes(embedding_table, last_seen, count, step):
    return tf.norm(embedding_table) + count  # TensorFlow wants tf.cast


def tf_three_arguments(embedding_table, count, step):
    return tf.cast(count, tf.float32)


@tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] + [tf.TensorSpec([], tf.int32)] * 3)
def tf_int32_signature(embedding_table, last_seen, count, step):
    return count


REFUSED = [
    (tf_tanh, r"tf_tanh cannot be translated from TensorFlow: TensorFlow op Tanh \('Tanh'\) is not supported\. "
              r"Supported: Abs, "),
    (jax_tanh, r"jax_tanh cannot be translated from JAX: JAX primitive tanh is not supported\. Supported: abs, "),
    (tf_row, r"tf_row cannot be translated from TensorFlow: it returns a row \(one value per element, shape \[n\]\); "
             r"a score function returns one number per table row: reduce the row \(a sum, a norm, a maximum\)$"),
    (jax_row, r"jax_row cannot be translated .*: it returns a row"),
    (tf_two, r"tf_two cannot be translated .*: it returns 2 values"),
    (tf_bool, r"tf_bool cannot be translated .*: it returns a boolean"),
    (tf_int_division, r"tf_int_division .*floordiv of int64 values is not supported.*cast to a float"),
    (jax_int_division, r"jax_int_division .*: div of int32 values is not supported"),
    (tf_mixed_dtypes, r"tf_mixed_dtypes could not be traced by TensorFlow for the contract "
                      r"f\(embedding_table float32 \[n\], last_seen int64 \[\], count int64 \[\], step int64 \[\]\)"),
    (tf_three_arguments, r"tf_three_arguments could not be traced by TensorFlow"),
    (tf_int32_signature, r"tf_int32_signature .*is int32 \(an input_signature\?\).* passes last_seen as int64"),
]


@pytest.mark.parametrize("fn, message", REFUSED, ids=[fn.__name__ for fn, _ in REFUSED])
def test_what_cannot_be_translated_is_refused_at_construction(fn, message):
    with pytest.raises(RowFunctionError, match=rf"^EvictByScore: score function {__name__}\." + message):
        ec.EvictByScore(fn)


def test_numpy_functions_import_no_framework():
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import embedcore as ec
        policy = ec.EvictByScore(lambda embedding_table, last_seen, count, step: float(np.sum(embedding_table)))
        table = ec.DynamicTableConfig(2, 3, name="t", eviction=policy)
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1))
        for ids in ([1, 2, 3], [4, 5]):
            acts, ctx = emb({"f": np.array(ids)})
            emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
        assert len(emb.embedding_tables["t"]) == 3 and {4, 5} <= set(emb.embedding_tables["t"].keys().tolist())
        print(sorted(m for m in ("tensorflow", "jax") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
