"""NaN/Inf policy: never written to a table; refused (default) or skipped, counted and reported."""

import numpy as np
import pytest

import embedcore as ec

from . import reference as ref


def sqrt_of_slot_minus_one(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Element-wise; NaN wherever the slot is below 1 (rows whose slot was set low)."""
    return embedding_table - learning_rate * gradient * np.sqrt(slot_variables[0] - 1.0), slot_variables[0]


def rowwise_in_place(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Per row (a reduction), editing the row view in place before the result is known to be finite."""
    scale = np.mean(gradient * gradient)
    embedding_table -= learning_rate * gradient / np.sqrt(slot_variables[0] - scale)
    return embedding_table, slot_variables[0]


def doubled_slot(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Element-wise, computing in float64 (the constant 2.0): finite before it is narrowed to float32."""
    return embedding_table - learning_rate * gradient, slot_variables[0] * 2.0


def doubled_rowwise(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Per row (a reduction), in float64: the new row is finite in float64, beyond float32 range."""
    scale = np.mean(gradient * gradient) * 0.0 + 2.0
    return embedding_table * scale, slot_variables[0]


def doubled_scalar_slot(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """A slot_dims=1 slot doubled in float64."""
    return embedding_table - learning_rate * gradient, slot_variables[0] * 2.0


def engine(optimizer, non_finite="raise", vocab=(20, 30), dim=4, stack=True):
    a = ec.TableConfig(vocab[0], dim, name="a", combiner="sum", initializer=ec.RowId())
    b = ec.TableConfig(vocab[1], dim, name="b", combiner="sum", initializer=ec.RowId(0.5))
    return ec.Embedding({"fa": ec.FeatureConfig(a), "fb": ec.FeatureConfig(b)}, optimizer, stack_tables=stack,
                        non_finite=non_finite)


def snapshot(emb):
    return ({k: v.copy() for k, v in emb.embedding_tables.items()},
            {k: {s: v.copy() for s, v in d.items()} for k, d in emb.slot_variables.items()})


def assert_all_finite(emb):
    for name, table in emb.embedding_tables.items():
        assert np.isfinite(table).all(), name
        for slot, value in emb.slot_variables[name].items():
            assert np.isfinite(value).all(), (name, slot)


@pytest.mark.parametrize("stack", [True, False])
def test_overflowing_gradient_sum_keeps_the_row_and_names_it(stack):
    emb = engine(ec.Adagrad(0.1), stack=stack)
    before, _ = snapshot(emb)
    ids = {"fa": np.array([[3, 3], [5, 6]]), "fb": np.array([[7, 7], [8, 9]])}
    acts, ctx = emb(ids)
    grads = {"fa": np.full_like(acts["fa"], 1.0), "fb": np.full_like(acts["fb"], 1.0)}
    grads["fb"][0] = 3e38  # finite, but 3e38 + 3e38 overflows float32 for row 7 of table b
    with pytest.raises(ec.NonFiniteError, match=r"table 'b': 1 row\(s\) left unchanged because its summed "
                                                r"gradient is NaN/Inf.*rows 7\b.*step is now 1"):
        emb.apply_gradients(grads, ctx)
    assert emb.step == 1 and emb.skipped_rows == {"b": 1}
    np.testing.assert_array_equal(emb.embedding_tables["b"][7], before["b"][7])
    for name, rows in (("a", [3, 5, 6]), ("b", [8, 9])):  # the rest of the batch was applied
        assert not np.array_equal(emb.embedding_tables[name][rows], before[name][rows])
    assert_all_finite(emb)
    with pytest.raises(ec.InputError, match="already applied"):
        emb.apply_gradients(grads, ctx)


def test_skip_policy_skips_rows_touched_by_nan_gradients_and_matches_the_oracle():
    emb = engine(ec.Adagrad(0.1, initial_accumulator_value=0.5), non_finite="skip")
    table, slots = snapshot(emb)
    samples = [[1, 2, 2], [4], [], [2, 9], [11, 12]]
    ids = {"fa": ec.Ragged.from_lists(samples), "fb": np.array([0, 1, 2, 3, 4])}
    acts, ctx = emb(ids)
    rng = np.random.default_rng(0)
    d_a = rng.standard_normal(acts["fa"].shape).astype(np.float32)
    d_a[3, 1] = np.nan   # sample 3 touches rows 2 and 9 of table a
    d_a[4, 0] = np.inf   # sample 4 touches rows 11 and 12
    d_b = rng.standard_normal(acts["fb"].shape).astype(np.float32)
    report = emb.apply_gradients({"fa": d_a, "fb": d_b}, ctx)
    assert sorted(report.skipped) == ["a"]
    assert sorted(report.skipped["a"]["gradient"].tolist()) == [2, 9, 11, 12]
    assert report.skipped["a"]["output"].size == 0
    assert emb.skipped_rows == {"a": 4} and emb.step == 1
    # Oracle: rows with a finite summed gradient get Adagrad; the skipped rows keep their values.
    weights = [[1.0] * len(s) for s in samples]
    grad = ref.dense_gradient(20, 4, samples, weights, "sum", 0, d_a.astype(np.float64))
    touched = ref.touched_rows(20, samples, 0) & np.isfinite(grad).all(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):  # the skipped rows' values are discarded by ``touched``
        expected, expected_slots = ref.apply(ref.adagrad, np.nan_to_num(grad), table["a"],
                                             [slots["a"]["accumulators"]], touched, 0.1, {}, 1)
    np.testing.assert_allclose(emb.embedding_tables["a"], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(emb.slot_variables["a"]["accumulators"], expected_slots[0], rtol=1e-6)
    assert_all_finite(emb)


@pytest.mark.parametrize("fn", [sqrt_of_slot_minus_one, rowwise_in_place])
def test_a_row_function_returning_nan_never_writes_it(fn):
    opt = ec.CustomOptimizer(fn, 0.1, ["s"], [2.0])
    for policy in ("raise", "skip"):
        emb = engine(opt, non_finite=policy)
        emb.slot_variables["a"]["s"][[4, 6]] = 0.5
        before, before_slots = snapshot(emb)
        acts, ctx = emb({"fa": np.array([4, 5, 6]), "fb": np.array([1, 2, 3])})
        grads = {k: np.ones_like(v) for k, v in acts.items()}
        if policy == "raise":
            with pytest.raises(ec.NonFiniteError, match=r"table 'a': 2 row\(s\) left unchanged because the "
                                                        r"optimizer returned NaN/Inf: rows 4, 6"):
                emb.apply_gradients(grads, ctx)
        else:
            report = emb.apply_gradients(grads, ctx)
            assert report.skipped["a"]["output"].tolist() == [4, 6]
            assert "rows 4, 6" in repr(report)
        for r in (4, 6):
            np.testing.assert_array_equal(emb.embedding_tables["a"][r], before["a"][r])
            np.testing.assert_array_equal(emb.slot_variables["a"]["s"][r], before_slots["a"]["s"][r])
        assert not np.array_equal(emb.embedding_tables["a"][5], before["a"][5])
        assert_all_finite(emb)


def test_dense_adam_skips_rows_in_skip_mode():
    emb = engine(ec.Adam(0.01, lazy_adam=False), non_finite="skip")
    before, _ = snapshot(emb)
    acts, ctx = emb({"fa": np.array([1, 2]), "fb": np.array([3, 3])})
    grads = {"fa": np.array([[np.nan, 0, 0, 0], [1, 1, 1, 1]], np.float32), "fb": np.ones((2, 4), np.float32)}
    report = emb.apply_gradients(grads, ctx)
    assert list(report.skipped) == ["a"] and report.skipped["a"]["gradient"].tolist() == [1]
    np.testing.assert_array_equal(emb.embedding_tables["a"][1], before["a"][1])
    assert not np.array_equal(emb.embedding_tables["a"][2], before["a"][2])
    np.testing.assert_array_equal(emb.embedding_tables["a"][5], before["a"][5])  # zero gradient, zero moments
    assert_all_finite(emb)


def test_policy_is_validated_and_survives_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="non_finite must be one of"):
        engine(ec.SGD(0.1), non_finite="ignore")
    emb = engine(ec.SGD(0.1), non_finite="skip")
    emb.save(tmp_path / "c")
    assert ec.Embedding.restore(tmp_path / "c").non_finite == "skip"
    acts, ctx = emb({"fa": np.array([1]), "fb": np.array([2])})
    report = emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    assert report.skipped == {} and report.step == 1 and "none" in repr(report)


@pytest.mark.parametrize("fn,slot_dims", [(doubled_slot, [2]), (doubled_rowwise, [2]), (doubled_scalar_slot, [1])])
def test_results_that_overflow_float32_when_stored_are_caught(fn, slot_dims):
    """A float64 result that is finite but beyond float32 range would become Inf when stored: the row is
    checked as it will be stored, so it is left unchanged and reported."""
    opt = ec.CustomOptimizer(fn, 0.1, ["s"], [1.0], slot_dims=slot_dims)
    emb = engine(opt, non_finite="skip")
    emb.slot_variables["a"]["s"][3] = 3e38
    emb.embedding_tables["a"][4] = 3e38
    before, before_slots = snapshot(emb)
    acts, ctx = emb({"fa": np.array([3, 4, 5]), "fb": np.array([1])})
    report = emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    bad = [3] if fn is not doubled_rowwise else [4]
    assert report.skipped["a"]["output"].tolist() == bad
    for r in bad:
        np.testing.assert_array_equal(emb.embedding_tables["a"][r], before["a"][r])
        np.testing.assert_array_equal(emb.slot_variables["a"]["s"][r], before_slots["a"]["s"][r])
    assert_all_finite(emb)
