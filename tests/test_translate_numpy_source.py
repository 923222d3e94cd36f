"""embedcore.translate without a framework: the program emitter, the framework rule, and the helpers the
TensorFlow and JAX translation tests share (random rows, compiled comparison bit for bit, engine runs)."""

import inspect

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore import compile_cache
from embedcore.compiler import RowFunctionError, strip_del
from embedcore.translate import SCORE, framework_of, optimizer_contract, to_numpy_row_function
from embedcore.translate.numpy_source import Program, TranslationError, _literal

DIMS = (1, 3, 8, 17)


# ----------------------------------------------------------------------------------------------------------
# Shared helpers.

def random_arguments(rng, dim, slot_dims, n_hyperparameters):
    """One row's arguments: gradient and row ~ N(0, 1), slots positive (some sqrt/log need it), learning
    rate and hyperparameters in (0.1, 0.9): float32 like the engine passes them."""
    g = rng.standard_normal(dim).astype(np.float32)
    row = rng.standard_normal(dim).astype(np.float32)
    slots = tuple(np.abs(rng.standard_normal(dim)).astype(np.float32) + np.float32(0.1) if d == 2 else
                  np.float32(rng.uniform(0.1, 2.0)) for d in slot_dims)
    lr = np.float32(rng.uniform(0.01, 0.5))
    hyper = tuple(np.float32(rng.uniform(0.1, 0.9)) for _ in range(n_hyperparameters))
    return g, row, slots, lr, hyper


def copy_arguments(args):
    g, row, slots, lr, hyper = args
    return g.copy(), row.copy(), tuple(s.copy() if isinstance(s, np.ndarray) else s for s in slots), lr, hyper


def as_outputs(result, n_slots, dim):
    values = result if n_slots else (result,)
    return [np.broadcast_to(np.asarray(v, np.float32), (dim,)) for v in values]


def same_bits(a, b):
    """Equal as float32 bit patterns (NaN equals NaN; -0 differs from +0)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a),
                                                                                         np.signbit(b))


def assert_compiled_equal(translated, reference, slot_dims, n_hyperparameters, dims=DIMS, seed=0, trials=3):
    """``translated`` and ``reference`` compiled by Numba (as the engine compiles row functions) give the
    same bits on random rows of every width in ``dims``; returns the outputs of the last trial."""
    fast, slow = (numba.njit(strip_del(f), error_model="numpy") for f in (translated, reference))
    rng = np.random.default_rng(seed)
    for dim in dims:
        for _ in range(trials):
            args = random_arguments(rng, dim, slot_dims, n_hyperparameters)
            got = as_outputs(fast(*copy_arguments(args)), len(slot_dims), dim)
            want = as_outputs(slow(*copy_arguments(args)), len(slot_dims), dim)
            assert len(got) == len(want)
            for k, (x, y) in enumerate(zip(got, want)):
                assert same_bits(x, y), (f"output {k} at dim {dim}:\n{x}\n{y}\n"
                                         f"{inspect.getsource(translated)}")
    return args, got


def run_engine(optimizer, steps=3, dim=6, seed=7):
    """Tables and slots after ``steps`` lookups and updates of two tables (one stacked pair, repeated ids,
    weights) with ``optimizer``; the batches depend only on ``seed``."""
    big = ec.TableConfig(40, dim, combiner="mean", name="big")
    tiny = ec.TableConfig(7, dim, combiner="sqrtn", name="tiny", initializer=ec.RandomUniform(-0.5, 0.5))
    features = {"a": ec.FeatureConfig(big), "b": ec.FeatureConfig(big, max_sequence_length=3),
                "c": ec.FeatureConfig(tiny)}
    emb = ec.Embedding(features, optimizer, seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = {"a": rng.integers(0, 40, (6, 3)), "b": rng.integers(0, 40, (6, 2)), "c": rng.integers(0, 7, (6, 2))}
        acts, ctx = emb(batch)
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}
        emb.apply_gradients(grads, ctx)
    return ({k: v.copy() for k, v in emb.embedding_tables.items()},
            {t: {s: v.copy() for s, v in d.items()} for t, d in emb.slot_variables.items()})


def assert_engines_equal(a, b):
    tables_a, slots_a = a
    tables_b, slots_b = b
    assert tables_a.keys() == tables_b.keys()
    for name in tables_a:
        assert same_bits(tables_a[name], tables_b[name]), name
        assert slots_a[name].keys() == slots_b[name].keys()
        for slot in slots_a[name]:
            assert same_bits(slots_a[name][slot], slots_b[name][slot]), (name, slot)


# ----------------------------------------------------------------------------------------------------------
# The emitter and the framework rule, without a framework.

def numpy_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator


def test_numpy_function_is_returned_unchanged():
    assert framework_of(numpy_adagrad) == "numpy"
    assert to_numpy_row_function(numpy_adagrad, (2,), 0) is numpy_adagrad
    with pytest.raises(ValueError, match="framework"):
        to_numpy_row_function(numpy_adagrad, (2,), 0, framework="torch")


def _adagrad_program(epsilon):
    p = Program("adagrad_program", "adagrad_program", __name__, "test program", optimizer_contract((2,), 0))
    g, w = p.argument("gradient"), p.argument("embedding_table")
    acc = p.apply("add", p.argument("slot", 0), p.apply("mul", g, g))
    denominator = p.apply("add", p.apply("sqrt", acc), p.constant(np.float32(epsilon)))
    p.set_outputs([p.apply("sub", w, p.apply("div", p.apply("mul", p.argument("learning_rate"), g),
                                                   denominator)), acc])
    return p


def numpy_adagrad_eps(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + gradient * gradient
    return (embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + np.float32(1e-3)),
            accumulator)


def test_program_emits_readable_source_that_compiles_like_the_numpy_function():
    fn = _adagrad_program(1e-3).to_function()
    source = inspect.getsource(fn)
    assert source.startswith("def adagrad_program(gradient, embedding_table, slot_variables, learning_rate,")
    assert "np.sqrt(" in source and "np.float32(0.001)" in source
    assert fn.__module__ == __name__ and fn.__qualname__ == "adagrad_program"
    assert_compiled_equal(fn, numpy_adagrad_eps, (2,), 0)
    optimizer = ec.CustomOptimizer(fn, 0.1, ["accumulator"], [0.1])
    assert optimizer.compiled(4).elementwise
    assert "inlined" in optimizer.explain(4)


def test_fingerprint_follows_the_program():
    a, b = _adagrad_program(1e-3).to_function(), _adagrad_program(1e-3).to_function()
    c = _adagrad_program(2e-3).to_function()
    assert compile_cache.fingerprint(a) == compile_cache.fingerprint(b)
    assert compile_cache.fingerprint(a) != compile_cache.fingerprint(c)


def test_row_constants_are_read_per_row_not_inlined():
    p = Program("scaled", "scaled", __name__, "test program", optimizer_contract())
    p.set_outputs([p.apply("mul", p.argument("embedding_table"), p.constant(np.array([1, 2, 3], np.float32)))])
    fn = p.to_function()
    assert "const_0 = np.array([1.0, 2.0, 3.0], dtype=np.float32)" in inspect.getsource(inspect.getmodule(fn)) \
        or "np.asarray(const_0)" in inspect.getsource(fn)
    compiled = ec.CustomOptimizer(fn, 0.1).compiled(3)
    assert not compiled.elementwise  # a constant row is not one value per element
    out = numba.njit(fn)(np.zeros(3, np.float32), np.ones(3, np.float32), (), np.float32(0.1), ())
    assert out.tolist() == [1.0, 2.0, 3.0]


def test_program_refuses_what_it_cannot_express():
    p = Program("f", "f", __name__, "test program", optimizer_contract())
    with pytest.raises(TranslationError, match="shape"):
        p.constant(np.zeros((2, 2), np.float32))
    with pytest.raises(TranslationError, match="vocabulary"):
        p.apply("tanh", p.argument("gradient"))
    with pytest.raises(TranslationError, match="non-boolean"):
        p.apply("logical_and", p.argument("gradient"), p.argument("embedding_table"))
    with pytest.raises(TranslationError, match="returns nothing"):
        p.set_outputs([])


# ----------------------------------------------------------------------------------------------------------
# Contracts: the optimizer's and EvictByScore's score, without a framework.

def test_contracts_describe_their_arguments():
    assert optimizer_contract((2, 1), 1).describe() == (
        "f(gradient float32 [n], embedding_table float32 [n], slot_variables (float32 [n], float32 []), "
        "learning_rate float32 [], hyperparameters (float32 [],)) -> the new row, or a tuple (new row, new slots...)")
    assert SCORE.describe() == ("f(embedding_table float32 [n], last_seen int64 [], count int64 [], step int64 []) "
                                "-> one real number")
    assert [(leaf.source, leaf.rank, leaf.dtype) for leaf in optimizer_contract((1,), 2).leaves()] == [
        ("gradient", 1, "float32"), ("embedding_table", 1, "float32"), ("slot_variables[0]", 0, "float32"),
        ("learning_rate", 0, "float32"), ("hyperparameters[0]", 0, "float32"), ("hyperparameters[1]", 0, "float32")]
    with pytest.raises(ValueError, match="no argument 'gradient'"):
        Program("f", "f", __name__, "test program", SCORE).argument("gradient")


def _score_program(outputs):
    """A SCORE program: ``outputs(program, row, last_seen, count, step)`` gives the values it returns."""
    p = Program("score", "score", __name__, "test program", SCORE)
    p.set_outputs(outputs(p, *p.arguments()))
    return p


def test_score_program_emits_the_score_signature_and_int64_arithmetic():
    def age_and_norm(p, row, last_seen, count, step):
        age = p.apply("cast", p.apply("sub", step, last_seen), dtype="float32")
        norm = p.apply("sqrt", p.apply("sum", p.apply("mul", row, row)))
        return [p.apply("sub", norm, p.apply("mul", age, p.apply("cast", p.apply("maximum", count,
                                                                                   p.constant(np.int64(2))),
                                                                        dtype="float32")))]

    fn = _score_program(age_and_norm).to_function()
    source = inspect.getsource(fn)
    assert source.startswith("def score(embedding_table, last_seen, count, step):")
    assert "NumPy-level score function" in source and "np.maximum(count, np.int64(2))" in source

    def oracle(row, last_seen, count, step):
        age = np.float32(step - last_seen)
        return np.sqrt(np.sum(row * row)) - age * np.float32(max(count, 2))

    row = np.array([3, -4, 12], np.float32)
    compiled, expected = numba.njit(fn), numba.njit(oracle)
    for args in [(np.int64(5), np.int64(0), np.int64(9)), (np.int64(2 ** 40), np.int64(7), np.int64(2 ** 40 + 3))]:
        assert compiled(row, *args) == expected(row, *args)


@settings(max_examples=200, deadline=None)
@given(st.integers(-2 ** 31, 2 ** 31 - 1), st.integers(-2 ** 31, 2 ** 31 - 1))
def test_narrow_integer_results_wrap_at_their_width(a, b):
    """Numba computes int32 + int32 in int64; the emitted source wraps it back to int32 (as JAX's int32)."""
    def int32_sum(p, row, last_seen, count, step):
        x, y = (p.apply("cast", v, dtype="int32") for v in (last_seen, step))
        return [p.apply("neg", p.apply("add", p.apply("mul", x, y), y))]

    fn = numba.njit(_score_program(int32_sum).to_function())
    wrapped = -((a * b + b + 2 ** 31) % 2 ** 32 - 2 ** 31)
    expected = (wrapped + 2 ** 31) % 2 ** 32 - 2 ** 31  # -(-2**31) wraps too
    assert int(fn(np.zeros(1, np.float32), np.int64(a), np.int64(0), np.int64(b))) == expected


def test_score_program_refuses_rows_several_values_booleans_and_integer_division():
    with pytest.raises(TranslationError, match=r"returns a row .*reduce the row"):
        _score_program(lambda p, row, *_: [p.apply("abs", row)])
    with pytest.raises(TranslationError, match="returns 2 values; a score function returns one number"):
        _score_program(lambda p, row, last_seen, count, step: [count, step])
    with pytest.raises(TranslationError, match="returns a boolean"):
        _score_program(lambda p, row, last_seen, count, step: [p.apply("less", count, step)])
    for op in ("div", "floordiv", "mod", "pow"):
        with pytest.raises(TranslationError, match=f"{op} of int64 values is not supported"):
            _score_program(lambda p, row, last_seen, count, step: [p.apply(op, count, step)])
    with pytest.raises(TranslationError, match="sqrt of int64"):
        _score_program(lambda p, row, last_seen, count, step: [p.apply("sqrt", count)])


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=False), st.sampled_from([np.float32, np.float64]))
def test_literals_read_back_exactly(x, dtype):
    value = dtype(x)
    text = _literal(value)
    back = eval(text, {"np": np})
    assert type(back) is dtype and (back == value) and np.signbit(back) == np.signbit(value), text


def test_literals_of_special_values():
    assert eval(_literal(np.float32(np.inf)), {"np": np}) == np.float32(np.inf)
    assert np.isnan(eval(_literal(np.float32(np.nan)), {"np": np}))
    assert _literal(np.bool_(True)) == "True"
    assert _literal(np.int32(-3)) == "np.int32(-3)"


def test_plain_function_reading_both_frameworks_is_refused():
    import types
    fake_tf, fake_jax = types.ModuleType("tensorflow"), types.ModuleType("jax.numpy")
    namespace = {"tf": fake_tf, "jnp": fake_jax}
    exec("def both(g, w, s, lr, h):\n    return tf.sqrt(g) + jnp.sqrt(w)\n", namespace)
    with pytest.raises(RowFunctionError, match="both TensorFlow and JAX"):
        framework_of(namespace["both"])
    exec("def helper(x):\n    return tf.sqrt(x)\n"
         "def outer(g, w, s, lr, h):\n    return w - helper(g)\n", namespace)
    assert framework_of(namespace["outer"]) == "tensorflow"  # what its own helper reads counts
