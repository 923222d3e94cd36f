"""A NaN/Inf gradient under the default policy is refused before anything changes, whichever way the
engine reads the gradient rows (in place, or copied from float16, float64, strided or separate arrays, where
the copy counts them), on every table format: the error names the feature and the first offending index, and
tables, slots and ``step`` stay bit-identical."""

import ml_dtypes
import numpy as np
import pytest

import embedcore as ec

from .covering import pairs

DIM = 8
GRADIENT_DTYPES = [np.float32, np.float16, np.float64, ml_dtypes.bfloat16]
TABLE_DTYPES = ["float32", "bfloat16", "float16"]


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint8)


def _snapshot(emb):
    tables = {k: _bits(v).copy() for k, v in emb.embedding_tables.items()}
    slots = {k: {s: _bits(v).copy() for s, v in d.items()} for k, d in emb.slot_variables.items()}
    return tables, slots, emb.step


def _assert_unchanged(emb, snapshot):
    tables, slots, step = snapshot
    assert emb.step == step
    for k, v in emb.embedding_tables.items():
        np.testing.assert_array_equal(_bits(v), tables[k])
    for k, d in emb.slot_variables.items():
        for s, v in d.items():
            np.testing.assert_array_equal(_bits(v), slots[k][s])


def _engine(table_dtype, rows=50, **kwargs):
    table = ec.TableConfig(rows, DIM, name="t", combiner="sum", initializer=ec.RandomUniform(-0.5, 0.5),
                           weights_dtype=table_dtype, slot_dtype=table_dtype)
    other = ec.TableConfig(rows, DIM, name="u", combiner="sum", initializer=ec.RandomUniform(-0.5, 0.5))
    return ec.Embedding({"a": ec.FeatureConfig(other), "f": ec.FeatureConfig(table)},
                        ec.Adam(0.01), seed=3, **kwargs)


def _refused(emb, grads, ctx, feature, index, value):
    before = _snapshot(emb)
    shown = {"nan": "nan", "inf": "inf", "-inf": "-inf"}[value]
    with pytest.raises(ec.InputError, match=rf"gradient of feature '{feature}' holds {shown} at index "
                                            rf"\({', '.join(str(i) for i in index)}\); NaN/Inf gradients are "
                                            r"refused \(nothing was updated\)"):
        emb.apply_gradients(grads, ctx)
    _assert_unchanged(emb, before)


def _position(where, shape):
    n = int(np.prod(shape))
    flat = {"first": 0, "middle": n // 2 + 3, "last": n - 1}[where]
    return tuple(int(i) for i in np.unravel_index(flat, shape))


# Every table format with every gradient dtype, and each of those with every position and value: pairwise
# (tests/covering.py), not the 108 cases of the full product.
@pytest.mark.parametrize("table_dtype,grad_dtype,where,value",
                         pairs(TABLE_DTYPES, GRADIENT_DTYPES, ["first", "middle", "last"], ["nan", "inf", "-inf"]))
def test_non_finite_gradient_is_refused_at_its_index_and_changes_nothing(table_dtype, grad_dtype, where, value):
    emb = _engine(table_dtype)
    ids = np.array([3, 7, 3, 11, 49, 0, 7, 3, 25, 30])  # duplicates: rows summed from several occurrences
    _, ctx = emb({"a": ids, "f": ids})
    grads = {"a": np.ones((10, DIM), np.float32), "f": np.full((10, DIM), 0.25, grad_dtype)}
    at = _position(where, grads["f"].shape)
    grads["f"][at] = float(value)
    _refused(emb, grads, ctx, "f", at, value)
    grads["f"][at] = 0.5
    emb.apply_gradients(grads, ctx)  # the refused call consumed nothing
    assert emb.step == 1


@pytest.mark.parametrize("grad_dtype", GRADIENT_DTYPES)
def test_the_first_of_several_non_finite_values_is_named(grad_dtype):
    emb = _engine("bfloat16")
    _, ctx = emb({"a": np.arange(6), "f": np.arange(6)})
    grads = {"a": np.zeros((6, DIM), np.float32), "f": np.zeros((6, DIM), grad_dtype)}
    grads["f"][4, 1] = np.inf
    grads["f"][2, 5] = np.nan
    grads["f"][5, 0] = np.nan
    _refused(emb, grads, ctx, "f", (2, 5), "nan")


@pytest.mark.parametrize("grad_dtype", GRADIENT_DTYPES)
def test_in_the_gradient_row_of_a_duplicate_id(grad_dtype):
    emb = _engine("float32")
    ids = np.array([5, 9, 5, 5, 1])
    _, ctx = emb({"a": ids, "f": ids})
    grads = {"a": np.ones((5, DIM), np.float32), "f": np.ones((5, DIM), grad_dtype)}
    grads["f"][3, 6] = np.nan  # row 5's third occurrence
    _refused(emb, grads, ctx, "f", (3, 6), "nan")


@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("grad_dtype", GRADIENT_DTYPES)
def test_in_a_feature_with_weights(table_dtype, grad_dtype):
    emb = _engine(table_dtype)
    ids = ec.Ragged(np.array([1, 2, 2, 4, 7, 1]), np.array([0, 2, 2, 5, 6]))
    weights = ec.Ragged(np.array([0.5, 2.0, 0.0, 1.5, 3.0, -1.0], np.float32), np.array([0, 2, 2, 5, 6]))
    _, ctx = emb({"a": np.arange(4), "f": ids}, weights={"a": None, "f": weights})
    grads = {"a": np.ones((4, DIM), np.float32), "f": np.ones((4, DIM), grad_dtype)}
    grads["f"][2, 3] = -np.inf
    _refused(emb, grads, ctx, "f", (2, 3), "-inf")
    # A sample without ids reads no gradient row, and its NaN is still refused (as it always was).
    grads["f"][2, 3] = 1.0
    grads["f"][1, 0] = np.nan
    _refused(emb, grads, ctx, "f", (1, 0), "nan")


@pytest.mark.parametrize("layout", ["strided", "separate", "float16", "float64", "bfloat16", "bfloat16 separate",
                                    "bfloat16 in place", "mixed 16-bit"])
def test_stacked_features_copied_into_one_gradient_are_named(layout):
    """Features of one physical table whose gradients are copied (not read in place) are counted as they
    are copied (16-bit ones of one format into 16-bit rows, a mix into float32 ones), and 16-bit ones read in
    place are counted over their bits; the error still names the right feature and index."""
    features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(40, DIM, name=f"t{t}", combiner="sum",
                                                         weights_dtype="bfloat16")) for t in range(3)}
    emb = ec.Embedding(features, ec.Adagrad(0.1))
    assert emb.num_physical_tables == 1
    _, ctx = emb({f"f{t}": np.arange(7) * (t + 1) for t in range(3)})
    whole = np.ones((7, 3 * DIM), np.float32)
    grads = {f"f{t}": whole[:, t * DIM:(t + 1) * DIM] for t in range(3)}  # strided views
    if layout == "separate":
        grads = {k: v.copy() for k, v in grads.items()}
    elif layout in ("float16", "float64"):
        grads = {k: v.astype(layout) for k, v in grads.items()}
    elif layout == "bfloat16":  # strided
        grads = {k: v for k, v in zip(grads, np.split(whole.astype(ml_dtypes.bfloat16), 3, axis=1))}
    elif layout == "bfloat16 separate":
        grads = {k: v.astype(ml_dtypes.bfloat16) for k, v in grads.items()}
    elif layout == "bfloat16 in place":  # consecutive views of one array
        grads = {f"f{t}": v for t, v in enumerate(np.ones((3, 7, DIM), ml_dtypes.bfloat16))}
    elif layout == "mixed 16-bit":
        grads = {k: v.astype(np.float16 if k == "f1" else ml_dtypes.bfloat16) for k, v in grads.items()}
    grads["f2"][6, DIM - 1] = np.nan
    grads["f1"][0, 0] = np.inf
    _refused(emb, grads, ctx, "f1", (0, 0), "inf")
    grads["f1"][0, 0] = 0.0
    _refused(emb, grads, ctx, "f2", (6, DIM - 1), "nan")


@pytest.mark.parametrize("grad_dtype", GRADIENT_DTYPES)
def test_large_gradients_take_the_parallel_scans(grad_dtype):
    """Gradients of over 2**20 values: the parallel count (in place) and the parallel counting copy."""
    n = (1 << 20) // DIM + 5
    emb = _engine("bfloat16", rows=1000)
    ids = np.arange(n) % 1000
    _, ctx = emb({"a": ids[:4], "f": ids})
    grads = {"a": np.ones((4, DIM), np.float32), "f": np.full((n, DIM), 0.125, grad_dtype)}
    for at in [(n - 1, DIM - 1), (n // 2, 3), (0, 0)]:
        grads["f"][at] = np.nan
        _refused(emb, grads, ctx, "f", at, "nan")
    grads["f"][:] = 0.125
    emb.apply_gradients(grads, ctx)
    assert emb.step == 1


def test_a_dynamic_table_refuses_the_same_and_changes_nothing():
    table = ec.DynamicTableConfig(DIM, 20, name="d", optimizer=ec.Adagrad(0.1), combiner="sum",
                                  initializer=ec.RandomUniform(-1, 1), weights_dtype="bfloat16")
    emb = ec.Embedding({"k": ec.FeatureConfig(table)})
    keys = np.array([10, 2 ** 40, 10, -7])
    _, ctx = emb({"k": keys})
    view = emb.embedding_tables["d"]
    held = view.keys()
    rows = _bits(view[held]).copy()
    for grad_dtype in GRADIENT_DTYPES:
        grads = {"k": np.ones((4, DIM), grad_dtype)}
        grads["k"][2, 4] = np.inf
        with pytest.raises(ec.InputError, match=r"feature 'k' holds inf at index \(2, 4\); NaN/Inf gradients"):
            emb.apply_gradients(grads, ctx)
        assert emb.step == 0
        np.testing.assert_array_equal(view.keys(), held)
        np.testing.assert_array_equal(_bits(view[held]), rows)
    emb.apply_gradients({"k": np.ones((4, DIM), np.float16)}, ctx)
    assert emb.step == 1


@pytest.mark.parametrize("layout", ["in place", "float16", "float64", "strided", "bfloat16", "bfloat16 strided"])
def test_skip_policy_is_the_same_whichever_way_the_rows_are_read(layout):
    """Under ``non_finite="skip"`` nothing counts the copies: the same rows are skipped and the same values
    written as from the float32 gradient read in place."""
    def run(grad):
        emb = _engine("bfloat16", non_finite="skip")
        ids = np.array([3, 7, 3, 11, 49, 0, 7, 3, 25, 30])
        _, ctx = emb({"a": ids, "f": ids})
        report = emb.apply_gradients({"a": np.ones((10, DIM), np.float32), "f": grad}, ctx)
        return report, _snapshot(emb)
    # values that float16 and bfloat16 both hold
    base = np.linspace(-1, 1, 10 * DIM).astype(ml_dtypes.bfloat16).astype(np.float32).reshape(10, DIM)
    assert np.array_equal(base.astype(np.float16).astype(np.float32), base)
    base[1, 2] = np.nan   # row 7 (also touched by occurrence 6)
    base[8, 0] = -np.inf  # row 25
    expected_report, expected = run(base)
    grad = {"in place": base, "float16": base.astype(np.float16), "float64": base.astype(np.float64),
            "strided": np.repeat(base, 2, axis=1)[:, ::2], "bfloat16": base.astype(ml_dtypes.bfloat16),
            "bfloat16 strided": np.repeat(base, 2, axis=1).astype(ml_dtypes.bfloat16)[:, ::2]}[layout]
    report, got = run(grad)
    assert {k: {r: v.tolist() for r, v in d.items()} for k, d in report.skipped.items()} == \
        {k: {r: v.tolist() for r, v in d.items()} for k, d in expected_report.skipped.items()}
    assert sorted(report.skipped["t"]["gradient"].tolist()) == [7, 25]
    for a, b in zip(got[:2], expected[:2]):
        for k in a:
            if isinstance(a[k], dict):
                for s in a[k]:
                    np.testing.assert_array_equal(a[k][s], b[k][s])
            else:
                np.testing.assert_array_equal(a[k], b[k])
    assert ml_dtypes.bfloat16  # the tables above are bfloat16 (ml_dtypes is a dependency)
