"""Bad inputs raise embedcore.InputError naming the feature and the value, and change nothing."""

import re

import numpy as np
import pytest

import embedcore as ec

from .harness import assert_unchanged, snapshot

B = 4  # batch size of every good batch ("shaped" has output_shape (2, 2), i.e. 4 activation rows)


def _config():
    # Table names chosen so their seed-0 random keys are < 2**63 (see test_initializers for that bug).
    user = ec.TableConfig(12, 4, name="user")
    video = ec.TableConfig(16, 4, name="video", combiner="sum", optimizer=ec.Adagrad(0.1))
    return {
        "pooled": ec.FeatureConfig(user),
        "seq": ec.FeatureConfig(video, max_sequence_length=3, name="watch_seq"),
        "shaped": ec.FeatureConfig(video, output_shape=(2, 2)),
        "sparse": ec.FeatureConfig(user),
    }


@pytest.fixture(scope="module")
def emb():
    return ec.Embedding(_config(), optimizer=ec.SGD(0.1))


@pytest.fixture(scope="module")
def other_emb():
    return ec.Embedding(_config(), optimizer=ec.SGD(0.1))


@pytest.fixture(scope="module")
def list_emb():
    t = ec.TableConfig(8, 4, name="other")
    return ec.Embedding([ec.FeatureConfig(t), ec.FeatureConfig(t, validate_weights_and_indices=False)],
                        optimizer=ec.SGD(0.1))


def good_features():
    return {
        "pooled": np.array([[1, 2], [3, 4], [5, 6], [7, 11]]),
        "seq": ec.Ragged(np.array([1, 2, 3, 4, 5, 6, 15]), np.array([0, 2, 3, 3, 7])),
        "shaped": np.array([0, 1, 2, 3]),
        "sparse": ec.Sparse(np.array([[0, 0], [1, 1], [3, 2]]), np.array([1, 2, 3]), (B, 3)),
    }


def no_weights():
    return {"pooled": None, "seq": None, "shaped": None, "sparse": None}






def expect_input_error(e, call, *patterns):
    snap = snapshot(e)
    with pytest.raises(ec.InputError) as info:
        call()
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for p in patterns:
        assert re.search(p, message), f"{p!r} not in {message!r}"
    assert_unchanged(e, snap)
    return message


def good_gradients(acts, scale=1.0):
    return {k: np.full(v.shape, scale, np.float32) for k, v in acts.items()}


def test_good_batch_works_and_changes_state(emb):
    """Sanity: the snapshots used below do see an update."""
    snap = snapshot(emb)
    acts, ctx = emb(good_features())
    assert acts["pooled"].shape == (B, 4) and acts["seq"].shape == (B, 3, 4)
    assert acts["shaped"].shape == (2, 2, 4) and acts["sparse"].shape == (B, 4)
    emb.apply_gradients(good_gradients(acts), ctx)
    assert emb.step == snap[2] + 1
    assert not np.array_equal(emb.embedding_tables["user"], snap[0]["user"])
    assert not np.array_equal(emb.embedding_tables["video"], snap[0]["video"])
    assert not np.array_equal(emb.slot_variables["video"]["accumulators"], snap[1]["video"]["accumulators"])


# ---------------------------------------------------------------------------------------------- ids

I64 = np.iinfo(np.int64)

BAD_IDS = {
    "id_equals_vocabulary": ("pooled", np.array([[1, 2], [3, 12], [5, 6], [7, 8]]),
                             [r"'pooled'", r"\bid 12\b", r"\[0, 12\)"]),
    "id_equals_vocabulary_sequence": ("seq", ec.Ragged(np.array([1, 2, 16, 4]), np.array([0, 1, 2, 3, 4])),
                                      [r"'watch_seq'", r"\bid 16\b", r"\[0, 16\)"]),
    "negative_id": ("seq", ec.Ragged(np.array([1, -1, 3, 4]), np.array([0, 1, 2, 3, 4])),
                    [r"'watch_seq'", r"id -1\b"]),
    "negative_id_list_of_lists": ("seq", [[1], [2, -3], [], [4]], [r"'watch_seq'", r"id -3\b"]),
    "int64_max": ("shaped", np.array([0, 1, 2, I64.max]), [r"'shaped'", rf"id {I64.max}\b"]),
    "int64_min": ("sparse", ec.Sparse(np.array([[0, 0], [1, 1], [3, 2]]), np.array([1, I64.min, 3]), (B, 3)),
                  [r"'sparse'", rf"id {I64.min}\b"]),
    "float_ids": ("pooled", np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]),
                  [r"'pooled'", r"integers", r"float64"]),
    "float_ids_ragged": ("seq", ec.Ragged(np.array([1.0, 2.0, 3.0, 4.0]), np.array([0, 1, 2, 3, 4])),
                         [r"'watch_seq'", r"integers", r"float64"]),
    "float_ids_list": ("shaped", [0.0, 1.5, 2.0, 3.0], [r"'shaped'", r"integers", r"float64"]),
    "bool_ids": ("shaped", np.array([True, False, True, True]), [r"'shaped'", r"integers", r"bool"]),
    "rank3_ids": ("pooled", np.zeros((B, 2, 1), np.int64), [r"'pooled'", r"rank 1 .* or 2", r"\(4, 2, 1\)"]),
    "bad_row_splits": ("seq", ec.Ragged(np.array([1, 2, 3]), np.array([0, 2, 1, 3, 3])),
                       [r"'watch_seq'", r"row_splits", r"\[0, 2, 1, 3, 3\]"]),
    "sparse_index_outside": ("sparse", ec.Sparse(np.array([[0, 0], [1, 3]]), np.array([1, 2]), (B, 3)),
                             [r"'sparse'", r"dense_shape \(4, 3\)"]),
    "not_an_array": ("pooled", {"ids": 1}, [r"'pooled'", r"dict"]),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_bad_ids(emb, case):
    key, value, patterns = BAD_IDS[case]
    features = good_features()
    features[key] = value
    expect_input_error(emb, lambda: emb(features), *patterns)


def test_uint64_id_named_as_given(emb):
    # Found bug: uint64 ids are cast to int64 before the range check, so 2**64 - 1 is reported as "id -1".
    # It is still refused (nothing is read out of range); only the message misnames the value.
    features = good_features()
    features["shaped"] = np.array([0, 1, 2, 2**64 - 1], dtype=np.uint64)
    expect_input_error(emb, lambda: emb(features), r"'shaped'", r"\b18446744073709551615\b")


def test_uint64_ids_in_range_accepted(emb):
    features = good_features()
    features["shaped"] = np.array([0, 1, 2, 15], dtype=np.uint64)
    acts, _ = emb(features)
    assert np.array_equal(acts["shaped"].reshape(B, 4)[3], emb.embedding_tables["video"][15])


# ------------------------------------------------------------------------------------------- weights

BAD_WEIGHTS = {
    "dense_shape_differs": ("pooled", np.ones((B, 3), np.float32),
                            [r"'pooled'", r"shape \(4, 3\)", r"ids have shape \(4, 2\)"]),
    "dense_1d_for_2d_ids": ("pooled", np.ones(B * 2, np.float32), [r"'pooled'", r"shape \(8,\)"]),
    "ragged_row_splits_differ": ("seq", ec.Ragged(np.ones(7, np.float32), np.array([0, 3, 3, 3, 7])),
                                 [r"'watch_seq'", r"row_splits that differ"]),
    "ragged_weights_dense": ("seq", np.ones(7, np.float32), [r"'watch_seq'", r"ragged like its ids", r"ndarray"]),
    "sparse_weights_dense": ("sparse", np.ones(3, np.float32), [r"'sparse'", r"Sparse like its ids", r"ndarray"]),
    "sparse_weights_other_indices": ("sparse", ec.Sparse(np.array([[0, 0], [1, 2], [3, 2]]),
                                                         np.ones(3, np.float32), (B, 3)),
                                     [r"'sparse'", r"indices or dense_shape that differ"]),
    "dense_weights_ragged": ("pooled", ec.Ragged(np.ones(8), np.array([0, 2, 4, 6, 8])),
                             [r"'pooled'", r"array like its dense ids", r"Ragged"]),
    "nan_weight": ("pooled", np.array([[1, 1], [1, np.nan], [1, 1], [1, 1]], np.float32),
                   [r"'pooled'", r"non-finite value nan", r"flat index 3"]),
    "inf_weight_ragged": ("seq", ec.Ragged(np.array([1, 1, 1, 1, 1, np.inf, 1], np.float32),
                                           np.array([0, 2, 3, 3, 7])),
                          [r"'watch_seq'", r"non-finite value inf"]),
    "string_weights": ("shaped", np.array(["a", "b", "c", "d"]), [r"'shaped'", r"floats", r"<U1"]),
}


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_bad_weights(emb, case):
    key, value, patterns = BAD_WEIGHTS[case]
    weights = no_weights()
    weights[key] = value
    expect_input_error(emb, lambda: emb(good_features(), weights), *patterns)


def test_weights_structure_must_mirror(emb):
    weights = no_weights()
    del weights["seq"]
    expect_input_error(emb, lambda: emb(good_features(), weights), r"weights", r"missing \['seq'\]")


def test_unvalidated_feature_still_range_checks_ids_but_allows_nan_weights(list_emb):
    expect_input_error(list_emb, lambda: list_emb([np.array([1, 2]), np.array([1, 8])]), r"'1'", r"\bid 8\b")
    acts, _ = list_emb([np.array([[1]]), np.array([[1]])], [None, np.array([[np.nan]], np.float32)])
    assert np.isnan(acts[1]).all()


# ------------------------------------------------------------------------------------ feature structure

def test_features_missing_key(emb):
    features = good_features()
    del features["shaped"]
    expect_input_error(emb, lambda: emb(features), r"features", r"missing \['shaped'\]")


def test_features_extra_key(emb):
    features = good_features()
    features["extra_feature"] = np.array([1, 2, 3, 4])
    expect_input_error(emb, lambda: emb(features), r"features", r"unexpected \['extra_feature'\]")


def test_features_not_a_dict(emb):
    expect_input_error(emb, lambda: emb(list(good_features().values())), r"must be a dict", r"list")


def test_features_list_wrong_length(list_emb):
    expect_input_error(list_emb, lambda: list_emb([np.array([1, 2])]),
                       r"list/tuple of 2 entries", r"list of length 1")
    expect_input_error(list_emb, lambda: list_emb([np.array([1]), np.array([1]), np.array([1])]),
                       r"list/tuple of 2 entries", r"list of length 3")


def test_output_shape_does_not_match_batch(emb):
    features = good_features()
    features["shaped"] = np.array([0, 1, 2])
    expect_input_error(emb, lambda: emb(features), r"'shaped'", r"output_shape \(2, 2\)", r"holds 4",
                       r"gives 3")


# -------------------------------------------------------------------------------------------- gradients

def _bad_gradient_case(emb, mutate, *patterns):
    acts, ctx = emb(good_features())
    grads = good_gradients(acts)
    mutate(grads)
    expect_input_error(emb, lambda: emb.apply_gradients(grads, ctx), *patterns)
    # The failed call consumed nothing: the same ctx still takes good gradients, exactly once.
    step = emb.step
    emb.apply_gradients(good_gradients(acts, 0.5), ctx)
    assert emb.step == step + 1


def test_gradient_wrong_shape(emb):
    def mutate(g):
        g["seq"] = np.zeros((B, 3, 5), np.float32)
    _bad_gradient_case(emb, mutate, r"'watch_seq'", r"shape \(4, 3, 5\)", r"\(4, 3, 4\)")


def test_gradient_unreshaped_for_output_shape(emb):
    def mutate(g):
        g["shaped"] = np.zeros((B, 4), np.float32)
    _bad_gradient_case(emb, mutate, r"'shaped'", r"shape \(4, 4\)", r"\(2, 2, 4\)")


def test_gradient_int_dtype(emb):
    def mutate(g):
        g["pooled"] = np.ones((B, 4), np.int64)
    _bad_gradient_case(emb, mutate, r"'pooled'", r"floats", r"int64")


def test_gradient_not_an_array(emb):
    # (None is no gradient for the feature, as TensorFlow's apply_gradients takes it: see Embedding.apply_gradients.)
    def mutate(g):
        g["pooled"] = {"gradient": 1.0}
    _bad_gradient_case(emb, mutate, r"'pooled'", r"must be an array", r"dict")


@pytest.mark.parametrize("value, shown", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")])
def test_gradient_non_finite(emb, value, shown):
    # "sparse" is the last feature in order, so earlier features would already be applied by a lazy check.
    def mutate(g):
        g["sparse"][2, 1] = value
    _bad_gradient_case(emb, mutate, r"'sparse'", rf"holds {shown} at index \(2, 1\)", r"nothing was updated")


def test_gradient_non_finite_named_feature(emb):
    def mutate(g):
        g["seq"][3, 2, 0] = np.nan
    _bad_gradient_case(emb, mutate, r"'watch_seq'", r"holds nan at index \(3, 2, 0\)")


def test_gradient_dict_missing_key(emb):
    def mutate(g):
        del g["sparse"]
    _bad_gradient_case(emb, mutate, r"gradients", r"missing \['sparse'\]")


def test_gradient_dict_extra_key(emb):
    def mutate(g):
        g["bogus"] = np.zeros((B, 4), np.float32)
    _bad_gradient_case(emb, mutate, r"gradients", r"unexpected \['bogus'\]")


def test_bad_learning_rate_value_changes_nothing():
    t = ec.TableConfig(8, 4, name="other")
    lr = {"value": 0.1}
    e = ec.Embedding(ec.FeatureConfig(t), optimizer=ec.SGD(lambda: lr["value"]))
    acts, ctx = e(np.array([1, 2]))
    lr["value"] = float("nan")
    snap = snapshot(e)
    with pytest.raises(ValueError, match=r"learning_rate evaluated to nan"):
        e.apply_gradients(np.ones_like(acts), ctx)
    assert_unchanged(e, snap)
    lr["value"] = 0.1
    e.apply_gradients(np.ones_like(acts), ctx)
    assert e.step == 1


def test_same_ctx_twice(emb):
    acts, ctx = emb(good_features())
    emb.apply_gradients(good_gradients(acts), ctx)
    expect_input_error(emb, lambda: emb.apply_gradients(good_gradients(acts), ctx), r"already applied")


def test_ctx_from_another_engine(emb, other_emb):
    acts, ctx = other_emb(good_features())
    expect_input_error(emb, lambda: emb.apply_gradients(good_gradients(acts), ctx),
                       r"ctx must be the context returned by this engine")
    other_snap = snapshot(other_emb)
    assert_unchanged(other_emb, other_snap)
    other_emb.apply_gradients(good_gradients(acts), ctx)  # still good for its own engine
    assert other_emb.step == 1


def test_ctx_not_a_context(emb):
    acts, _ = emb(good_features())
    expect_input_error(emb, lambda: emb.apply_gradients(good_gradients(acts), None), r"ctx must be")


# ------------------------------------------------------------------------------- row function errors

def _not_jittable(x):
    return x.__class__


def _bad_uncompilable(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del slot_variables, hyperparameters
    return embedding_table - learning_rate * _not_jittable(gradient)


def _bad_too_many_outputs(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    acc = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient, acc, acc


def _bad_missing_slot_output(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return embedding_table - learning_rate * gradient


def _bad_rowwise_slot_as_row(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    acc = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / np.sqrt(acc), acc


def _bad_row_length(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return np.concatenate((embedding_table, embedding_table - learning_rate * gradient))


def _bad_slot_length(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return embedding_table - learning_rate * gradient, slot_variables[0][:2]


def _build(optimizer):
    return ec.Embedding(ec.FeatureConfig(ec.TableConfig(8, 4, name="other")), optimizer=optimizer)


def test_uncompilable_function_refused_at_construction():
    with pytest.raises(ec.RowFunctionError, match=r"_bad_uncompilable could not be compiled by Numba") as info:
        _build(ec.CustomOptimizer(_bad_uncompilable))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("fn, slots, dims, pattern", [
    (_bad_too_many_outputs, ["acc"], None, r"_bad_too_many_outputs must return a tuple of 2 values"),
    (_bad_missing_slot_output, ["acc"], None, r"_bad_missing_slot_output must return a tuple of 2 values"),
    (_bad_rowwise_slot_as_row, ["acc"], [1], r"_bad_rowwise_slot_as_row: slot 0 has slot_dims 1 .* scalar"),
    (_bad_row_length, [], None, r"_bad_row_length returned the new row with shape \(8,\); rows have 4 values"),
    (_bad_slot_length, ["acc"], None, r"_bad_slot_length returned slot 0 with shape \(2,\); rows have 4 values"),
])
def test_bad_outputs_refused_at_construction(fn, slots, dims, pattern):
    opt = ec.CustomOptimizer(fn, 0.1, slot_names=slots, slot_initializers=[0.1] * len(slots), slot_dims=dims)
    with pytest.raises(ec.RowFunctionError, match=pattern):
        _build(opt)


def test_float64_inf_gradients_are_skipped_not_refused_in_skip_mode():
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 2, name="t", combiner="sum"))}, ec.SGD(0.1),
                       non_finite="skip")
    acts, ctx = emb({"f": np.array([1, 2])})
    grads = np.array([[np.inf, 0.0], [1.0, 1.0]], np.float64)
    report = emb.apply_gradients({"f": grads}, ctx)
    assert report.skipped["t"]["gradient"].tolist() == [1]
    assert np.isfinite(emb.embedding_tables["t"]).all()


@pytest.mark.parametrize("layout", ["views of one array", "separate", "float64"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_gradient_of_a_stacked_feature_is_named_whichever_way_gradients_are_read(layout, value):
    """Stacked features' gradients are checked for NaN/Inf as the update reads them (in place when they
    follow each other in memory, else copied): the refusal names the feature and its index, changes
    nothing and calls no schedule."""
    calls = []
    def lr():
        calls.append(1)
        return 0.1
    features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(30, 4, name=f"t{t}", initializer=ec.RowId()))
                for t in range(3)}
    emb = ec.Embedding(features, ec.Adagrad(lr))
    assert emb.num_physical_tables == 1
    _, ctx = emb({f"f{t}": np.arange(5) + t for t in range(3)})
    whole = np.ones((3, 5, 4), np.float32)
    grads = {f"f{t}": whole[t] for t in range(3)}
    if layout == "separate":
        grads = {k: v.copy() for k, v in grads.items()}
    elif layout == "float64":
        grads = {k: v.astype(np.float64) for k, v in grads.items()}
    grads["f1"][3, 2] = value
    tables = {k: v.copy() for k, v in emb.embedding_tables.items()}
    shown = "nan" if np.isnan(value) else "inf"
    with pytest.raises(ec.InputError, match=rf"feature 'f1' holds {shown} at index \(3, 2\); NaN/Inf gradients are "
                                            r"refused \(nothing was updated\)"):
        emb.apply_gradients(grads, ctx)
    assert calls == [] and emb.step == 0
    for name, table in emb.embedding_tables.items():
        np.testing.assert_array_equal(table, tables[name])
    grads["f1"][3, 2] = 1.0
    emb.apply_gradients(grads, ctx)  # the refused call consumed nothing
    assert emb.step == 1 and calls == [1]


_SPLITS_DTYPES = [np.int64, np.int32, np.int8, np.uint64, np.dtype(">i8")]


def _splits_ok(splits, n_values):
    """The definition: starts at 0, never decreases, ends at the number of values (exact integers)."""
    values = [int(v) for v in splits]
    return bool(values) and values[0] == 0 and values[-1] == n_values and \
        all(b >= a for a, b in zip(values, values[1:]))


def test_row_splits_accepted_exactly_when_they_start_at_zero_never_decrease_and_end_at_the_values():
    """Ragged row_splits take a one-pass jitted check for int64/int32 and NumPy's for other dtypes; both
    accept exactly the splits of the definition, on random and edge-case splits of every dtype."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from embedcore.inputs import InputError, _check_splits

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(-3, 9), min_size=1, max_size=12), st.integers(0, 9),
           st.sampled_from(_SPLITS_DTYPES), st.booleans())
    def check(entries, n_values, dtype, strided):
        dtype = np.dtype(dtype)
        if dtype.kind == "u":
            entries = [e % 10 for e in entries]
        splits = np.array(entries, dtype=dtype)
        if strided:  # a non-contiguous view of the same entries
            splits = np.repeat(splits, 2)[::2]
        ok = _splits_ok(splits, n_values)
        try:
            out = _check_splits(splits, n_values, "f", "ids")
        except InputError as e:
            assert not ok, f"{splits!r} with {n_values} values refused: {e}"
            assert "'f'" in str(e)
        else:
            assert ok, f"{splits!r} with {n_values} values accepted"
            assert out.dtype == np.int64 and out.tolist() == [int(v) for v in splits]

    check()
    for splits, n in (([0], 0), ([0, 0, 0], 0), ([0, 2**40], 2**40), ([0, 5, 3, 5], 5), ([1, 5], 5), ([0, 4], 5),
                      ([0, -1, 5], 5), ([0, 2**63 - 1], 5)):
        ok = _splits_ok(splits, n)
        try:
            _check_splits(np.array(splits, np.int64), n, "f", "ids")
            assert ok
        except InputError:
            assert not ok
