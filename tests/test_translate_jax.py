"""JAX custom computations (functions over jax.numpy, as jax-tpu-embedding users write optimizers)
translated through their jaxpr to NumPy-level row functions: every primitive family against the NumPy
version of the same function (bit for bit, compiled as the engine compiles it) and against JAX itself,
refused primitives, kernel paths, the fingerprint across processes, and whole engine runs."""

import inspect
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore import compile_cache  # noqa: E402
from embedcore.compiler import RowFunctionError  # noqa: E402
from embedcore.translate import framework_of, to_numpy_row_function  # noqa: E402

from .test_translate_numpy_source import (  # noqa: E402
    DIMS, as_outputs, assert_compiled_equal, assert_engines_equal, copy_arguments, random_arguments, run_engine)

f32 = np.float32


def jax_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del hyperparameters
    accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / jnp.sqrt(accumulator), accumulator


def numpy_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator


def jax_eager(fn, args):
    g, row, slots, lr, hyper = args
    out = fn(jnp.asarray(g), jnp.asarray(row), tuple(jnp.asarray(s) for s in slots), jnp.asarray(lr),
             tuple(jnp.asarray(h) for h in hyper))
    return [np.asarray(v) for v in (out if isinstance(out, (tuple, list)) else (out,))]


def assert_matches_jax(fn, translated, slot_dims, n_hyperparameters, rtol=1e-5, atol=1e-5):
    rng = np.random.default_rng(1)
    for dim in DIMS:
        args = random_arguments(rng, dim, slot_dims, n_hyperparameters)
        with np.errstate(all="ignore"):
            got = as_outputs(translated(*copy_arguments(args)), len(slot_dims), dim)
        want = [np.broadcast_to(v, (dim,)) for v in jax_eager(fn, args)]
        for x, y in zip(got, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jax.jit"])
def test_adagrad_translates(jit):
    fn = jax.jit(jax_adagrad) if jit else jax_adagrad
    assert framework_of(fn) == "jax"
    translated = to_numpy_row_function(fn, (2,), 0)
    assert translated.__name__ == "jax_adagrad"
    assert "np.sqrt(" in inspect.getsource(translated)
    assert_compiled_equal(translated, numpy_adagrad, (2,), 0)
    assert_matches_jax(fn, translated, (2,), 0)


# ----------------------------------------------------------------------------------------------------------
# One case per primitive family: (JAX function, NumPy version, slot_dims, number of hyperparameters).

def jax_arithmetic(g, w, s, lr, h):
    a = g + w - g * w / (s[0] + 1.0)
    b = -a + lax.rem(g, 0.3) + jnp.fmod(w, h[0])
    return w - lr * b, s[0] + a / 3.0


def np_arithmetic(g, w, s, lr, h):
    a = g + w - g * w / (s[0] + f32(1.0))
    b = -a + np.fmod(g, f32(0.3)) + np.fmod(w, h[0])
    return w - lr * b, s[0] + a / f32(3.0)


def jax_unary(g, w, s, lr, h):
    x = jnp.abs(g) + 0.5
    y = (jnp.sqrt(x) + lax.rsqrt(x) + jnp.square(g) + x ** 3 + x ** -2 + jnp.power(x, h[0]) + jnp.exp(-x)
         + jnp.log(x) + jnp.sign(g))
    return w - lr * y


def np_unary(g, w, s, lr, h):
    x = np.abs(g) + f32(0.5)
    y = (np.sqrt(x) + f32(1.0) / np.sqrt(x) + g * g + x * (x * x) + f32(1.0) / (x * x) + np.power(x, h[0])
         + np.exp(-x) + np.log(x) + np.sign(g))
    return w - lr * y


def jax_min_max_clamp(g, w, s, lr, h):
    a = (jnp.maximum(g, w) - jnp.minimum(g, h[0]) + jnp.clip(g, -0.5, 0.5) + lax.clamp(-h[0], w, h[1]))
    return w - lr * a, jnp.minimum(s[0], a)


def np_min_max_clamp(g, w, s, lr, h):
    a = (np.maximum(g, w) - np.minimum(g, h[0]) + np.minimum(f32(0.5), np.maximum(f32(-0.5), g))
         + np.minimum(np.maximum(w, -h[0]), h[1]))
    return w - lr * a, np.minimum(s[0], a)


def jax_select_compare_logic(g, w, s, lr, h):
    keep = jnp.logical_and(g > -0.5, jnp.logical_not(g == w))
    either = jnp.logical_or(g <= h[0], w >= 0.0)
    flags = (g < w).astype(jnp.float32) + (g != 0.0).astype(jnp.float32)
    update = jnp.where(keep, g, 0.0) + lax.select(either, w, g) + flags
    return w - lr * update, jnp.where(s[0] > 1.0, s[0] * 0.5, s[0] + lr)


def np_select_compare_logic(g, w, s, lr, h):
    keep = np.logical_and(g > f32(-0.5), np.logical_not(g == w))
    either = np.logical_or(g <= h[0], w >= f32(0.0))
    flags = np.where(g < w, f32(1.0), f32(0.0)) + np.where(g != f32(0.0), f32(1.0), f32(0.0))
    update = np.where(keep, g, f32(0.0)) + np.where(either, w, g) + flags
    return w - lr * update, (s[0] * f32(0.5) if s[0] > f32(1.0) else s[0] + lr)


def jax_convert(g, w, s, lr, h):
    steps = (g * 10.0).astype(jnp.int32)
    return w - lr * steps.astype(jnp.float32) * 0.1


def np_convert(g, w, s, lr, h):
    steps = (g * f32(10.0)).astype(np.int32)
    return w - lr * steps.astype(np.float32) * f32(0.1)


def jax_reductions(g, w, s, lr, h):
    accumulator = s[0] + jnp.mean(g * g)
    spread = jnp.max(w) - jnp.min(w, keepdims=True)[0]
    norms = jnp.linalg.norm(g) * jnp.sum(jnp.abs(w))
    return w - lr * g / jnp.sqrt(accumulator) + spread * 0.01 + norms * 0.001, accumulator


def np_reductions(g, w, s, lr, h):
    accumulator = s[0] + np.sum(g * g) / f32(g.size)
    spread = np.max(w) - np.min(w)
    norms = np.sqrt(np.sum(g * g)) * np.sum(np.abs(w))
    return w - lr * g / np.sqrt(accumulator) + spread * f32(0.01) + norms * f32(0.001), accumulator


@jax.jit
def _scaled(x, factor):
    return x * factor


@jax.custom_vjp
def _halve(x):
    return x * 0.5


_halve.defvjp(lambda x: (x * 0.5, None), lambda _, ct: (ct * 0.5,))


def jax_structure(g, w, s, lr, h):
    a = _scaled(g, h[1])                              # pjit / jit
    b = jax.nn.relu(w)                                # custom_jvp_call around a jit
    c = jax.checkpoint(lambda x: x * x)(g)            # remat
    d = _halve(s[0])                                  # custom_vjp_call
    scalar = jnp.reshape(jnp.reshape(s[1], (1,)), ())  # reshape of a scalar
    e = jnp.broadcast_to(lr, g.shape)                 # broadcast_in_dim of a scalar
    return w - e * a + b + c, d, scalar + jnp.sum(c)


def np_structure(g, w, s, lr, h):
    c = g * g
    return w - lr * (g * h[1]) + np.maximum(w, f32(0.0)) + c, s[0] * f32(0.5), s[1] + np.sum(c)


def jax_scalar_slot_broadcast(g, w, s, lr, h):
    accumulator = s[0] + jnp.sum(g * g)
    momentum = 0.9 * s[1] + g / jnp.sqrt(accumulator)
    return w - lr * momentum, accumulator, momentum


def np_scalar_slot_broadcast(g, w, s, lr, h):
    accumulator = s[0] + np.sum(g * g)
    momentum = f32(0.9) * s[1] + g / np.sqrt(accumulator)
    return w - lr * momentum, accumulator, momentum


FAMILIES = {
    "arithmetic": (jax_arithmetic, np_arithmetic, (2,), 1),
    "unary": (jax_unary, np_unary, (), 1),
    "min-max-clamp": (jax_min_max_clamp, np_min_max_clamp, (2,), 2),
    "select-compare-logic": (jax_select_compare_logic, np_select_compare_logic, (1,), 1),
    "convert": (jax_convert, np_convert, (), 0),
    "reductions": (jax_reductions, np_reductions, (1,), 0),
    "structure": (jax_structure, np_structure, (2, 1), 2),
    "scalar-slot-broadcast": (jax_scalar_slot_broadcast, np_scalar_slot_broadcast, (1, 2), 0),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_primitive_family_equals_numpy_version(family):
    jax_fn, np_fn, slot_dims, n_hyper = FAMILIES[family]
    translated = to_numpy_row_function(jax_fn, slot_dims, n_hyper)
    assert_compiled_equal(translated, np_fn, slot_dims, n_hyper)
    assert_matches_jax(jax_fn, translated, slot_dims, n_hyper)


def test_the_families_cover_the_primitives():
    from embedcore.translate import optimizer_contract
    from embedcore.translate.jaxpr import trace

    def names(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
                body = eqn.params.get(key)
                if body is not None:
                    yield from names(body if hasattr(body, "eqns") else body.jaxpr)

    seen = set()
    for jax_fn, _, slot_dims, n_hyper in FAMILIES.values():
        seen |= set(names(trace(jax_fn, optimizer_contract(slot_dims, n_hyper)).jaxpr))
    expected = {"add", "sub", "mul", "div", "neg", "rem", "sqrt", "rsqrt", "integer_pow", "pow", "exp", "log",
                "abs", "sign", "max", "min", "clamp", "select_n", "lt", "le", "gt", "ge", "eq", "ne", "and", "or",
                "not", "convert_element_type", "reduce_sum", "reduce_max", "reduce_min", "broadcast_in_dim",
                "reshape", "custom_jvp_call", "dim_as_value"}
    assert expected <= seen, expected - seen
    assert seen & {"pjit", "jit"} and seen & {"remat", "remat2", "checkpoint"} and seen & {"custom_vjp_call",
                                                                                 "custom_vjp_call_jaxpr"}


# ----------------------------------------------------------------------------------------------------------
# Refusals, kernel paths.

def jax_tanh(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return embedding_table - learning_rate * jnp.tanh(gradient)


def test_unsupported_primitive_names_primitive_and_function():
    with pytest.raises(RowFunctionError, match=r"jax_tanh.*JAX primitive tanh is not supported"):
        to_numpy_row_function(jax_tanh, (), 0)


def test_row_indexing_is_refused():
    def indexes(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - jnp.asarray(gradient)[0]

    with pytest.raises(RowFunctionError, match=r"indexes.*JAX primitive"):
        to_numpy_row_function(indexes, (), 0)


def jax_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + jnp.mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / (jnp.sqrt(accumulator) + hyperparameters[0]), accumulator


def np_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + np.sum(gradient * gradient) / f32(gradient.size)
    return embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + hyperparameters[0]), accumulator


def test_elementwise_translation_is_inlined_and_reducing_one_split():
    inlined = ec.CustomOptimizer(to_numpy_row_function(jax_adagrad, (2,), 0), 0.1, ["a"], [0.1])
    assert inlined.compiled(8).elementwise and "inlined" in inlined.explain(8)
    split = ec.CustomOptimizer(to_numpy_row_function(jax_rowwise, (1,), 1), 0.1, ["a"], [0.1], slot_dims=[1],
                               hyperparameters=[1e-3])
    assert split.compiled(8).split, split.compiled(8).reason
    assert "its reductions first" in split.explain(8)


# ----------------------------------------------------------------------------------------------------------
# Fingerprints across processes; engine runs bit for bit.

MODULE = textwrap.dedent('''
    import jax.numpy as jnp

    def jax_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        accumulator = slot_variables[0] + gradient * gradient
        return embedding_table - learning_rate * gradient / jnp.sqrt(accumulator), accumulator
''')

WORKER = textwrap.dedent('''
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import jax_row_module
    import embedcore as ec
    from embedcore import compile_cache
    from embedcore.kernels.update import fused_update_kernel
    from embedcore.translate import to_numpy_row_function

    row_function = to_numpy_row_function(jax_row_module.jax_adagrad, (2,), 0)
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
    (tmp_path / "jax_row_module.py").write_text(MODULE)
    (tmp_path / "worker.py").write_text(WORKER)
    env = dict(os.environ, EMBEDCORE_CACHE_DIR=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(tmp_path)], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["fingerprint"] == runs[1]["fingerprint"]
    assert runs[0]["table"] == runs[1]["table"]
    assert runs[1]["kernel_misses"] == 0 and runs[1]["kernel_hits"] > 0


def test_fingerprint_differs_for_another_constant():
    def with_epsilon(epsilon):
        def adagrad_eps(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
            accumulator = slot_variables[0] + gradient * gradient
            return embedding_table - learning_rate * gradient / (jnp.sqrt(accumulator) + epsilon), accumulator
        return adagrad_eps

    a, b, c = (to_numpy_row_function(with_epsilon(e), (2,), 0) for e in (1e-3, 1e-3, 1e-4))
    assert compile_cache.fingerprint(a) == compile_cache.fingerprint(b) != compile_cache.fingerprint(c)


ENGINE_CASES = {
    "adagrad": (jax_adagrad, numpy_adagrad, dict(slot_names=["accumulators"], slot_initializers=[0.1])),
    "rowwise-split": (jax_rowwise, np_rowwise, dict(slot_names=["accumulators"], slot_initializers=[0.1],
                                                    slot_dims=[1], hyperparameters=[1e-3])),
    "per-row-logic": (jax_select_compare_logic, np_select_compare_logic,
                      dict(slot_names=["s"], slot_initializers=[0.5], slot_dims=[1], hyperparameters=[0.2])),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_with_translated_optimizer_equals_numpy_optimizer(case):
    jax_fn, np_fn, options = ENGINE_CASES[case]
    slot_dims = options.get("slot_dims", [2] * len(options.get("slot_names", ())))
    translated = to_numpy_row_function(jax_fn, slot_dims, len(options.get("hyperparameters", ())))
    got = run_engine(ec.CustomOptimizer(translated, learning_rate=0.2, **options))
    want = run_engine(ec.CustomOptimizer(np_fn, learning_rate=0.2, **options))
    assert_engines_equal(got, want)
