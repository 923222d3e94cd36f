"""Per-row functions that reduce over the row, rewritten into loops that allocate nothing (split_reductions)."""

import numpy as np
import pytest
from numba.core.runtime import _nrt_python

import embedcore as ec
from embedcore.split_reductions import NotSplittable, split_reductions


def rowwise_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + np.mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + hyperparameters[0]), accumulator


def normalized_momentum(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del hyperparameters
    scale = np.float32(1.0) / np.sqrt(np.mean(gradient * gradient) + np.float32(1e-6))
    momentum = np.float32(0.9) * slot_variables[0] + gradient * scale
    return embedding_table - learning_rate * momentum, momentum


def lamb(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    beta1, beta2, eps, wd = hyperparameters
    m = beta1 * slot_variables[0] + (1 - beta1) * gradient
    v = beta2 * slot_variables[1] + (1 - beta2) * gradient * gradient
    update = m / (np.sqrt(v) + eps) + wd * embedding_table
    ratio = np.sqrt(np.sum(embedding_table * embedding_table)) / np.sqrt((update * update).sum())
    return embedding_table - learning_rate * ratio * update, m, v


def centered(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Methods, sizes, a reduction inside a row expression, a scalar slot and a row slot together."""
    g = gradient - gradient.mean()
    energy = np.sum(g * g) / g.size + np.maximum(slot_variables[0], 0.0)
    step = np.where(g > 0, g, 0.5 * g) / np.sqrt(energy + gradient.shape[0]) + slot_variables[1]
    return embedding_table - learning_rate * step, slot_variables[0] + energy, step


def clipped_rowwise_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """np.clip, which Numba takes on arrays only, in the element loops of the split form."""
    low, high, epsilon = hyperparameters
    g = np.clip(gradient, -low, high)
    accumulator = slot_variables[0] + np.mean(g * g)
    return np.clip(embedding_table - learning_rate * g / (np.sqrt(accumulator) + epsilon), -0.1, 0.1), accumulator


CASES = {
    "rowwise_adagrad": (rowwise_adagrad, [1], [1e-8]),
    "clipped_rowwise_adagrad": (clipped_rowwise_adagrad, [1], [0.3, 0.5, 1e-8]),
    "normalized_momentum": (normalized_momentum, [2], []),
    "lamb": (lamb, [2, 2], [0.9, 0.999, 1e-6, 0.01]),
    "centered": (centered, [1, 2], []),
}


def _trial(slot_dims, n_hyper, dim, seed):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(dim).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    slots = tuple(np.abs(rng.standard_normal(dim)).astype(np.float32) + 0.1 if d == 2 else np.float32(0.5)
                  for d in slot_dims)
    hyper = tuple(np.float32(x) for x in rng.uniform(0.1, 0.9, n_hyper))
    return g, w, slots, np.float32(0.05), hyper


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dim", [1, 7, 64])
def test_split_form_is_bit_identical_to_the_function(name, dim):
    fn, slot_dims, hyper = CASES[name]
    opt = ec.CustomOptimizer(fn, 0.05, slot_names=[f"s{k}" for k in range(len(slot_dims))],
                             slot_initializers=[0.1] * len(slot_dims), slot_dims=slot_dims, hyperparameters=hyper)
    compiled = opt.compiled(dim)
    assert compiled.split and not compiled.elementwise, compiled.reason
    assert "in place" in opt.explain(dim)
    original = ec.compiler._DISPATCHERS[fn]
    for seed in range(5):
        args = _trial(slot_dims, len(hyper), dim, seed)
        expected = original(*args)
        copies = (args[0].copy(), args[1].copy(), tuple(np.copy(s) for s in args[2]), args[3], args[4])
        got = compiled.dispatcher(*copies)
        for e, o in zip(expected, got):  # what the kernel stores: float32
            assert np.array_equal(np.float32(e), np.float32(o), equal_nan=True)


def _not_splittable():
    def loops(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        total = 0.0
        for j in range(gradient.shape[0]):
            total += gradient[j]
        return embedding_table - learning_rate * total

    def indexing(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient[0] * np.mean(gradient)

    def other_reduction(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient / np.max(np.abs(gradient))

    def reassigned(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        g = gradient * np.mean(gradient)
        g = g + 1.0
        return embedding_table - learning_rate * g

    def branch(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        if np.sum(gradient) > 0:
            return embedding_table - learning_rate * gradient
        return embedding_table

    return {"loop": loops, "indexing": indexing, "np.max": other_reduction, "assigned twice": reassigned,
            "If": branch}


@pytest.mark.parametrize("what", sorted(_not_splittable()))
def test_what_is_not_split_still_runs_per_row_and_says_why(what):
    fn = _not_splittable()[what]
    with pytest.raises(NotSplittable, match=what if what != "loop" else "For"):
        split_reductions(fn, ())
    opt = ec.CustomOptimizer(fn, 0.1)
    compiled = opt.compiled(4)
    assert not compiled.split and "not split" in compiled.reason
    emb = ec.Embedding(ec.FeatureConfig(ec.TableConfig(6, 4, name=f"t_{what}".replace(" ", "_").replace(".", "_"),
                                                       combiner="sum", initializer=ec.RandomUniform(-1, 1))), opt)
    table = next(iter(emb.embedding_tables.values()))
    before = table.astype(np.float64)
    acts, ctx = emb(np.array([1, 4, 4]))
    grad = np.random.default_rng(0).normal(size=acts.shape).astype(np.float32)
    emb.apply_gradients(grad, ctx)
    expected = before.copy()
    for row, g in ((1, grad[0]), (4, grad[1] + grad[2])):
        expected[row] = fn(g.astype(np.float64), before[row], (), 0.1, ())
    np.testing.assert_allclose(table, expected, rtol=1e-5, atol=1e-6)


def _allocations_per_apply(fn, slot_dims, hyper, rows=2000):
    opt = ec.CustomOptimizer(fn, 0.05, slot_names=[f"s{k}" for k in range(len(slot_dims))],
                             slot_initializers=[0.1] * len(slot_dims), slot_dims=slot_dims, hyperparameters=hyper)
    emb = ec.Embedding(ec.FeatureConfig(ec.TableConfig(rows, 16, name="t", combiner="sum")), opt)
    ids = np.arange(rows)
    grads = np.random.default_rng(1).standard_normal((rows, 16)).astype(np.float32)
    for _ in range(2):  # compile, fill the workspaces
        _, ctx = emb(ids)
        emb.apply_gradients(grads, ctx)
    _, ctx = emb(ids)
    was_enabled = _nrt_python.memsys_stats_enabled()
    _nrt_python.memsys_enable_stats()
    try:
        before = _nrt_python.memsys_get_stats_alloc()
        emb.apply_gradients(grads, ctx)
        return _nrt_python.memsys_get_stats_alloc() - before
    finally:
        if not was_enabled:
            _nrt_python.memsys_disable_stats()


def test_a_split_function_allocates_nothing_per_row():
    def unsplittable_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        accumulator = slot_variables[0] + np.mean(gradient * gradient)
        scale = np.max(np.abs(gradient))  # np.max is not split: every row pays its temporaries
        return embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + scale), accumulator

    split = _allocations_per_apply(rowwise_adagrad, [1], [1e-8])
    unsplit = _allocations_per_apply(unsplittable_rowwise, [1], [])
    assert unsplit >= 2000  # at least one temporary per row
    assert split < 100      # the kernel's per-chunk scratch rows and flags only
