"""The dedup kernel against NumPy, and the compiler's decisions on functions that do or do not reduce."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.compiler import strip_del
from embedcore.kernels.dedup import unique_rows
from embedcore.kernels.workspace import Workspace


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2 ** 40), st.integers(0, 300), st.integers(0, 2 ** 32))
def test_unique_rows_matches_numpy(n_rows, n, seed):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, min(n_rows, max(1, n // 3 + 1)), n).astype(np.int64) * (n_rows // max(1, n // 3 + 1))
    rows = np.minimum(rows, n_rows - 1)
    uniq, ptr, order = unique_rows(rows, n_rows, Workspace())
    expected, counts = np.unique(rows, return_counts=True)
    np.testing.assert_array_equal(uniq, expected)
    np.testing.assert_array_equal(np.diff(ptr), counts)
    np.testing.assert_array_equal(order, np.argsort(rows, kind="stable"))


def test_workspace_grows_and_is_reused():
    ws = Workspace()
    a = ws.array("x", (10, 4), np.float32)
    b = ws.array("x", (5, 4), np.float32)
    assert b.base is a.base or b.base is a
    c = ws.array("x", (100, 4), np.float32)
    assert c.shape == (100, 4)


def with_del(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del slot_variables, hyperparameters
    return embedding_table - learning_rate * gradient


def test_strip_del_keeps_behaviour():
    stripped = strip_del(with_del)
    assert stripped is not with_del
    g, w = np.ones(3, np.float32), np.zeros(3, np.float32)
    np.testing.assert_array_equal(stripped(g, w, (), 0.5, ()), with_del(g, w, (), 0.5, ()))


def _row_fn(expr_kind):
    def mean_sq(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient * np.mean(gradient * gradient)

    def index(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient[0]

    def loop(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        out = embedding_table.copy()
        for j in range(gradient.shape[0]):
            out[j] -= learning_rate * gradient[j]
        return out

    def sum_attr(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient / gradient.size

    def where(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return np.where(gradient > 0, embedding_table - learning_rate * gradient, embedding_table)

    def branch(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        if hyperparameters[0] > 0:
            return embedding_table - learning_rate * np.abs(gradient)
        return embedding_table - learning_rate * gradient

    return {"mean": mean_sq, "index": index, "loop": loop, "size": sum_attr, "where": where, "branch": branch}[
        expr_kind]


@pytest.mark.parametrize("kind,elementwise", [("mean", False), ("index", False), ("loop", False), ("size", False),
                                              ("where", True), ("branch", True)])
def test_elementwise_decision_and_both_paths_match_numpy(kind, elementwise):
    fn = _row_fn(kind)
    opt = ec.CustomOptimizer(fn, learning_rate=0.1, hyperparameters=[1.0])
    compiled = opt.compiled(4)
    assert compiled.elementwise is elementwise, compiled.reason
    table = ec.TableConfig(6, 4, name=f"t_{kind}", combiner="sum", initializer=ec.RandomUniform(-1, 1))
    emb = ec.Embedding(ec.FeatureConfig(table), opt)
    before = emb.embedding_tables[table.name].astype(np.float64)
    acts, ctx = emb(np.array([1, 4, 4]))
    grad = np.random.default_rng(0).normal(size=acts.shape).astype(np.float32)
    emb.apply_gradients(grad, ctx)
    expected = before.copy()
    for row, g in ((1, grad[0]), (4, grad[1] + grad[2])):
        expected[row] = fn(g.astype(np.float64), before[row], (), 0.1, (1.0,))
    np.testing.assert_allclose(emb.embedding_tables[table.name], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_count_non_finite_serial_and_parallel(dtype):
    from embedcore.kernels import rows
    rng = np.random.default_rng(5)
    for n in (0, 1, 1000, rows.PARALLEL_MIN + 3):
        values = rng.standard_normal(n).astype(dtype)
        bad = rng.choice(n, size=min(n, 7), replace=False) if n else np.zeros(0, int)
        values[bad] = rng.choice([np.nan, np.inf, -np.inf], size=bad.size)
        expected = int((~np.isfinite(values)).sum())
        assert rows._count_non_finite_serial(values) == expected
        assert rows._count_non_finite_parallel(values) == expected
        assert rows.count_non_finite(values) == expected
