"""Inputs, shapes, error classes and serving as TensorFlow's own tests of its TPU embedding API say.

Translated from ``tensorflow/python/tpu/tests/tpu_embedding_base_test.py`` (high-dimensional data),
``tpu_embedding_v2_*_test.py``, ``tpu_embedding_v3_test.py`` and ``tpu_embedding_for_serving_test.py``; the
expected values come from the plain NumPy oracle (``tests/reference.py``), bag by bag.
"""

import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec

from . import reference as ref
from .harness import as_input, assert_unchanged, snapshot

COUNTING = np.arange(32, dtype=np.float32)  # TF's tests: every table initialized to 0, 1, 2, ... row by row
LR = 0.5


def tf_tables():
    """TF's test tables: video 8 x 4 (sum), user 16 x 2 (mean)."""
    return ec.TableConfig(8, 4, combiner="sum", name="video"), ec.TableConfig(16, 2, combiner="mean", name="user")


def counting_engine(feature_config):
    emb = ec.Embedding(feature_config, ec.SGD(LR))
    emb.set_state(tables={name: COUNTING[:t.vocabulary_size * t.dim].reshape(t.vocabulary_size, t.dim)
                          for name, t in emb.tables.items()})
    return emb


def table64(emb, name):
    return np.asarray(emb.embedding_tables[name], np.float64)


# ---------------------------------------------------------------------------------------------------------
# The oracle for high-dimensional ids: bags in C order of the leading shape, each combined by ref.lookup.

def sparse_bags(indices, values, weights, dense_shape):
    """``(ids per bag, weights per bag)`` of a COO batch, bags in C order, ids by position within a bag."""
    leading = tuple(dense_shape[:-1])
    bags = [[] for _ in range(math.prod(leading))]
    for index, value, weight in sorted(zip(map(tuple, np.asarray(indices).tolist()), values, weights)):
        bags[np.ravel_multi_index(index[:-1], leading)].append((int(value), float(weight)))
    return [[v for v, _ in b] for b in bags], [[w for _, w in b] for b in bags]


def oracle_lookup(table, bags, bag_weights, combiner, leading):
    return ref.lookup(table, bags, bag_weights, combiner, 0).reshape(tuple(leading) + (table.shape[1],))


def oracle_sgd(table, bags, bag_weights, combiner, d_act):
    grad = ref.dense_gradient(table.shape[0], table.shape[1], bags, bag_weights, combiner, 0,
                              np.asarray(d_act, np.float64).reshape(len(bags), table.shape[1]))
    return table - LR * grad


@st.composite
def high_dimensional_batches(draw, vocabulary_size):
    """A COO batch of rank 2 to 4 (leading dims 0-3, some bags empty, ids repeating), with weights."""
    leading = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
    width = draw(st.integers(1, 4))
    cells = [c for c in np.ndindex(*leading, width)]
    chosen = draw(st.lists(st.sampled_from(cells), unique=True, max_size=12)) if cells else []
    ids = [draw(st.integers(0, vocabulary_size - 1)) for _ in chosen]
    weights = [draw(st.floats(0.25, 2.0)) for _ in chosen]
    order = draw(st.permutations(range(len(chosen))))  # COO in any order
    indices = np.array([chosen[i] for i in order], np.int64).reshape(len(chosen), len(leading) + 1)
    return indices, np.array([ids[i] for i in order], np.int64), np.array([weights[i] for i in order]), \
        leading + (width,)


@pytest.fixture(scope="module")
def tf_engine():
    video, user = tf_tables()
    return counting_engine({"watched": ec.FeatureConfig(video), "friends": ec.FeatureConfig(user)})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_high_dimensional_sparse_lookups_and_updates_equal_the_oracle(tf_engine, data):
    """Sparse ids of dense_shape (d1, ..., dn, k): activations (d1, ..., dn, dim), one bag per leading
    entry, combined by the table's combiner (weights too); the gradients of that shape update the rows as
    the oracle does."""
    emb = tf_engine
    features, weights, expected, bags = {}, {}, {}, {}
    for name, table in (("watched", "video"), ("friends", "user")):
        indices, values, w, shape = data.draw(high_dimensional_batches(emb.tables[table].vocabulary_size))
        weighted = data.draw(st.booleans())
        features[name] = ec.Sparse(indices, values, shape)
        weights[name] = ec.Sparse(indices, w.astype(np.float32), shape) if weighted else None
        w32 = w.astype(np.float32).astype(np.float64) if weighted else np.ones(len(values))
        bags[name] = sparse_bags(indices, values, w32, shape)
        expected[name] = oracle_lookup(table64(emb, table), *bags[name], emb.tables[table].combiner, shape[:-1])
    acts, ctx = emb(features, weights)
    for name in features:
        assert acts[name].shape == expected[name].shape
        np.testing.assert_allclose(acts[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name)
    grads = {name: data.draw(st.sampled_from([0.5, -1.0])) * np.ones_like(a) + np.arange(a.size).reshape(a.shape)
             % 3 for name, a in acts.items()}
    after = {t: oracle_sgd(table64(emb, t), *bags[f], emb.tables[t].combiner, grads[f])
             for f, t in (("watched", "video"), ("friends", "user"))}
    emb.apply_gradients(grads, ctx)
    for t, table in after.items():
        np.testing.assert_allclose(emb.embedding_tables[t], table, rtol=1e-5, atol=1e-5, err_msg=t)


def test_tensorflows_high_dimensional_data_gives_tensorflows_activations():
    """tpu_embedding_base_test's high-dimensional batch: each 2-D sample set repeated along a new axis
    (dense_shape (4, 4, k)); every slice equals TF's gold activations of the 2-D batch."""
    video, user = tf_tables()
    emb = counting_engine((ec.FeatureConfig(video, name="watched"), ec.FeatureConfig(video, name="favorited"),
                           ec.FeatureConfig(user, name="friends")))
    two_d = {"watched": ([[0, 0], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0]], [0, 0, 1, 0, 1, 1], 2),
             "favorited": ([[0, 0], [0, 1], [1, 0], [2, 0], [3, 0], [3, 1]], [0, 1, 1, 0, 0, 1], 2),
             "friends": ([[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [3, 0], [3, 1], [3, 2]],
                         [3, 0, 1, 2, 3, 0, 1, 2], 3)}
    features = []
    for indices, values, width in two_d.values():
        outer = np.repeat(np.arange(4), len(indices)).reshape(-1, 1)  # TF's create_hight_dimensional_indices
        hd = np.concatenate([outer, np.tile(np.array(indices), (4, 1))], axis=1)
        features.append(ec.Sparse(hd, values * 4, (4, 4, width)))
    acts, _ = emb(tuple(features))
    gold = ([[0, 1, 2, 3], [4, 6, 8, 10]], [[4, 6, 8, 10], [4, 5, 6, 7]], [[6, 7], [2, 3]])  # TF's gold0
    for act, g in zip(acts, gold):
        assert act.shape[:2] == (4, 4)
        for b in range(4):
            np.testing.assert_array_equal(act[b, :2], np.array(g, np.float32))
    flat, _ = emb(tuple(ec.Sparse(indices, values, (4, width)) for indices, values, width in two_d.values()))
    for act, alone in zip(acts, flat):  # the 2-D batch looked up alone, in every slice
        np.testing.assert_array_equal(act, np.broadcast_to(alone, act.shape))


def test_high_dimensional_dense_ids_need_their_leading_shape_as_output_shape():
    """Dense ids [d1, d2, k] are taken when output_shape is (d1, d2) (TF v2's high-dimensional dense
    features are [B, s, 1]: one id per (b, s)); they equal the same batch given as a rank-3 Sparse. Without
    that output_shape they are refused, naming the feature, and nothing changes."""
    video, _ = tf_tables()
    emb = counting_engine({"grid": ec.FeatureConfig(video, output_shape=(2, 3)), "plain": ec.FeatureConfig(video)})
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 8, (2, 3, 2))
    w = rng.uniform(0.5, 2.0, (2, 3, 2)).astype(np.float32)
    acts, ctx = emb({"grid": ids, "plain": ids[0, :, :1].reshape(3)}, {"grid": w, "plain": None})
    cells = np.array(list(np.ndindex(2, 3, 2)))
    sparse, _ = emb({"grid": ec.Sparse(cells, ids.reshape(-1), (2, 3, 2)), "plain": np.array([0])},
                    {"grid": ec.Sparse(cells, w.reshape(-1), (2, 3, 2)), "plain": None})
    assert acts["grid"].shape == (2, 3, 4)
    np.testing.assert_array_equal(acts["grid"], sparse["grid"])
    bags, bag_w = ids.reshape(6, 2).tolist(), w.astype(np.float64).reshape(6, 2).tolist()
    np.testing.assert_allclose(acts["grid"], oracle_lookup(table64(emb, "video"), bags, bag_w, "sum", (2, 3)),
                               rtol=1e-6)
    emb.apply_gradients({"grid": np.ones((2, 3, 4), np.float32), "plain": np.ones((3, 4), np.float32)}, ctx)
    snap = snapshot(emb)
    for bad in (ids.reshape(1, 6, 2), ids.reshape(3, 2, 2), ids[..., None]):
        with pytest.raises(ec.InputError, match=r"dense ids of feature 'grid' .*output_shape to be their leading "
                                                rf"shape .*{re_shape(bad.shape)}"):
            emb({"grid": bad, "plain": np.array([1])})
    with pytest.raises(ec.InputError, match=r"feature 'plain'.*rank 1 \(\[B\]\) or 2"):
        emb({"grid": ids, "plain": ids})
    assert_unchanged(emb, snap)


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_max_sequence_length_is_ignored_for_ids_of_rank_three_with_a_warning():
    """TF: "Input tensor is rank 3 which is above 2, the max_sequence_length setting will be ignored"."""
    _, user = tf_tables()
    emb = counting_engine({"seq": ec.FeatureConfig(user, max_sequence_length=2, name="seq")})
    ids = ec.Sparse([[0, 0, 0], [0, 0, 1], [1, 1, 0]], [1, 3, 5], (2, 2, 2))
    with pytest.warns(UserWarning, match=r"feature 'seq': max_sequence_length 2 is ignored for ids of rank 3"):
        acts, _ = emb({"seq": ids})
    table = table64(emb, "user")
    np.testing.assert_allclose(acts["seq"], [[(table[1] + table[3]) / 2, [0, 0]], [[0, 0], table[5]]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert emb({"seq": [[1, 3], [5]]})[0]["seq"].shape == (2, 2, 2)  # rank 2: a sequence, no warning


def test_ragged_ids_have_one_ragged_dimension():
    """TF: "Only rank 2 ragged tensor is supported"; a ValueError naming the feature, nothing changed."""
    _, user = tf_tables()
    emb = counting_engine({"f": ec.FeatureConfig(user, name="friends")})
    snap = snapshot(emb)
    inner = ec.Ragged([1, 2, 3], [0, 1, 3])
    for bad, fragment in ((ec.Ragged(inner, [0, 1, 2]), "more than one ragged dimension"),
                          (ec.Ragged(np.zeros((3, 2), np.int64), [0, 1, 3]), "1-D values")):
        with pytest.raises(ec.InputError, match=rf"ragged ids of feature 'friends' .*{fragment}") as info:
            emb({"f": bad})
        assert not isinstance(info.value, TypeError)
    assert_unchanged(emb, snap)


# ---------------------------------------------------------------------------------------------------------
# Error classes: TypeError where TF's nest raises it (a container of another type), ValueError for values.

@pytest.fixture(scope="module")
def typed_engine():
    video, user = tf_tables()
    return counting_engine({"watched": ec.FeatureConfig(video), "friends": (ec.FeatureConfig(user),
                                                                            ec.FeatureConfig(user))})


def good_batch():
    return {"watched": np.array([1, 2]), "friends": (ec.Ragged([1, 2, 3], [0, 1, 3]), np.array([[4], [5]]))}


TYPE_ERRORS = {
    "a list for the dict": (lambda f: list(f.values()), r"features at '<root>' must be a dict"),
    "a dict for the tuple": (lambda f: {**f, "friends": dict(enumerate(f["friends"]))},
                             r"features at 'friends' must be a list/tuple of 2"),
    "an array for the tuple": (lambda f: {**f, "friends": np.zeros(2)}, r"features at 'friends' must be a list"),
    "a dict where ids belong": (lambda f: {**f, "watched": {"ids": np.array([1, 2])}}, r"feature 'watched'.*dict"),
    "None where ids belong": (lambda f: {**f, "watched": None}, r"feature 'watched'.*NoneType"),
    "a string where ids belong": (lambda f: {**f, "watched": "1 2"}, r"feature 'watched'.*str"),
}

VALUE_ERRORS = {
    "a tuple one short": (lambda f: {**f, "friends": f["friends"][:1]}, r"list/tuple of 2 entries .* length 1"),
    "a missing key": (lambda f: {"friends": f["friends"]}, r"missing \['watched'\]"),
    "an id out of range": (lambda f: {**f, "watched": np.array([1, 8])}, r"feature 'watched': id 8"),
    "float ids": (lambda f: {**f, "watched": np.array([1.0, 2.0])}, r"feature 'watched' must be integers"),
}


@pytest.mark.parametrize("case", list(TYPE_ERRORS))
def test_wrong_structure_types_raise_type_errors_that_are_input_errors(typed_engine, case):
    edit, pattern = TYPE_ERRORS[case]
    snap = snapshot(typed_engine)
    with pytest.raises(TypeError, match=pattern) as info:
        typed_engine(edit(good_batch()))
    assert isinstance(info.value, ec.InputTypeError) and isinstance(info.value, ec.InputError)
    assert isinstance(info.value, ValueError)  # TF's tests that expect ValueError for these still pass
    assert_unchanged(typed_engine, snap)


@pytest.mark.parametrize("case", list(VALUE_ERRORS))
def test_wrong_values_raise_value_errors_not_type_errors(typed_engine, case):
    edit, pattern = VALUE_ERRORS[case]
    snap = snapshot(typed_engine)
    with pytest.raises(ec.InputError, match=pattern) as info:
        typed_engine(edit(good_batch()))
    assert not isinstance(info.value, TypeError)
    assert_unchanged(typed_engine, snap)


def test_weights_of_another_form_than_their_ids_raise_type_errors_naming_the_feature(typed_engine):
    """TF: "Weight for {} is type {} which does not match type input which is SparseTensor" (a ValueError
    there; InputTypeError is both)."""
    snap = snapshot(typed_engine)
    sparse = {"watched": ec.Sparse([[0, 0], [1, 0]], [1, 2], (2, 1)), "friends": good_batch()["friends"]}
    for weights, pattern in (({"watched": np.ones(2, np.float32), "friends": (None, None)}, "Sparse like its ids"),
                             ({"watched": None, "friends": (np.ones(3, np.float32), None)}, "ragged like its ids"),
                             ({"watched": None, "friends": (None, ec.Ragged([1.0, 1.0], [0, 1, 2]))},
                              "an array like its dense ids"),
                             ({"watched": {"w": 1.0}, "friends": (None, None)}, "None or mirror its ids")):
        with pytest.raises(ec.InputTypeError, match=pattern) as info:
            typed_engine(sparse, weights)
        assert isinstance(info.value, ValueError) and ("'watched'" in str(info.value) or "'friends/" in
                                                       str(info.value))
    assert_unchanged(typed_engine, snap)


def test_gradients_of_another_structure_raise_type_errors(typed_engine):
    """TF's test_pass_non_tensor_to_apply_gradients: a list for the config's tuple is a TypeError; embedcore
    lets lists and tuples stand for each other, so a dict for the tuple is the TypeError here."""
    acts, ctx = typed_engine(good_batch())
    grads = {"watched": np.ones_like(acts["watched"]), "friends": dict(enumerate(np.ones_like(a)
                                                                                 for a in acts["friends"]))}
    snap = snapshot(typed_engine)
    with pytest.raises(ec.InputTypeError, match=r"gradients at 'friends' must be a list/tuple"):
        typed_engine.apply_gradients(grads, ctx)
    with pytest.raises(ec.InputTypeError, match=r"ctx must be the context"):
        typed_engine.apply_gradients({**grads, "friends": list(acts["friends"])}, "not a context")
    assert_unchanged(typed_engine, snap)
    typed_engine.apply_gradients({**grads, "friends": [np.ones_like(a) for a in acts["friends"]]}, ctx)


# ---------------------------------------------------------------------------------------------------------
# Serving as TPUEmbeddingForServing: any batch size; output_shape used where it fits.

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A trained engine whose features carry training output_shapes for B = 4, and its ServingEmbedding."""
    video, user = tf_tables()
    config = {"ragged": ec.FeatureConfig(user, output_shape=(2, 2), name="ragged"),
              "sparse": ec.FeatureConfig(video, output_shape=[4], name="sparse"),
              "dense": ec.FeatureConfig(video, output_shape=(4,), name="dense"),
              "seq": ec.FeatureConfig(user, max_sequence_length=2, output_shape=(8,), name="seq"),
              "plain": ec.FeatureConfig(user, name="plain")}
    emb = counting_engine(config)
    path = tmp_path_factory.mktemp("served") / "ckpt"
    emb.save(path)
    plain = counting_engine({k: ec.FeatureConfig(f.table, max_sequence_length=f.max_sequence_length)
                             for k, f in config.items()})  # the same tables without output_shape
    return emb, ec.ServingEmbedding(path), plain


FRIENDS = [[3], [0, 1, 2], [3], [0, 1, 2]]  # TF's serving test batch (data batch size 4)


def batch_of(samples):
    width = max(len(s) for s in samples)
    padded = [(s * width)[:width] if s else [0] * width for s in samples]
    return {"ragged": ec.Ragged.from_lists(samples), "sparse": as_input(samples, None, "sparse")[0],
            "dense": np.array(padded), "seq": samples, "plain": ec.Ragged.from_lists(samples)}


def test_serving_at_the_training_batch_equals_training(served):
    emb, server, _ = served
    features = batch_of(FRIENDS)
    expected, _ = emb(features)
    got = server.lookup(features)
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert got["ragged"].shape == (2, 2, 2)  # TF's test_cpu_high_dimensional_lookup_ragged


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=st.lists(st.lists(st.integers(0, 7), max_size=3), min_size=1, max_size=7).filter(
    lambda s: len(s) not in (1, 2, 4) and any(s)))
def test_serving_other_batch_sizes_ignores_output_shapes_that_do_not_fit(served, samples):
    """Sparse, dense and sequence features are served at any batch size in their natural shape, equal to
    a lookup without output_shape; TF's test_cpu_high_dimensional_invalid_lookup_ragged: a ragged batch whose
    size does not divide output_shape's is refused (ValueError naming the feature)."""
    _, server, plain = served
    features = batch_of(samples)
    for name in ("sparse", "dense", "seq", "plain"):
        alone = {k: (v if k == name else batch_of([[0]])[k]) for k, v in features.items()}
        alone["ragged"] = ec.Ragged.from_lists([[0]] * 4)
        got = server.lookup(alone)[name]
        expected = plain(alone)[0][name]
        assert got.shape == expected.shape == ((len(samples), 2, 2) if name == "seq" else (len(samples),) +
                                               expected.shape[1:])
        np.testing.assert_array_equal(got, expected, err_msg=name)
    with pytest.raises(ec.InputError, match=r"feature 'ragged': output_shape \(2, 2\) .* neither the batch size"):
        server.lookup({**features, "ragged": ec.Ragged.from_lists(samples)})


def test_serving_reads_a_ragged_output_shape_as_batch_by_sequence_length(served):
    """TF's test_cpu_high_dimensional_sequence_lookup_ragged: output_shape (2, 2) for a ragged batch of 2
    is a sequence of length 2 per sample (truncated, zero padded) shaped (2, 2, dim); of 1, length 4."""
    _, server, _ = served
    table = np.asarray(server.embedding_tables["user"], np.float64)
    for samples, length in (([[0, 1, 2], [3]], 2), ([[5, 6]], 4)):
        features = {**batch_of(FRIENDS), "ragged": ec.Ragged.from_lists(samples)}
        got = server.lookup(features)["ragged"]
        golden = ref.lookup(table, samples, [[1.0] * len(s) for s in samples], "mean", length)
        np.testing.assert_array_equal(got, golden.reshape(2, 2, 2).astype(np.float32))


def test_serving_takes_high_dimensional_dense_ids_without_output_shape(served):
    _, server, plain = served
    ids = np.random.default_rng(0).integers(0, 16, (3, 2, 2))
    features = {**batch_of(FRIENDS), "plain": ids}
    got = server.lookup(features)["plain"]
    bags = ids.reshape(6, 2).tolist()
    np.testing.assert_allclose(got, oracle_lookup(np.asarray(server.embedding_tables["user"], np.float64), bags,
                                                  [[1.0, 1.0]] * 6, "mean", (3, 2)), rtol=1e-6)
    with pytest.raises(ec.InputError, match=r"feature 'plain'.*output_shape to be their leading shape"):
        plain(features)  # training takes them only with that output_shape


def test_serving_looks_up_any_subset_of_a_dict_of_features(served):
    """TF's cpu_embedding_lookup: "The keys of feature_config is a superset of inputs"; the activations
    mirror the features given (weights mirror them too). Unknown keys and short tuples are still refused."""
    emb, server, _ = served
    features = batch_of(FRIENDS)
    expected, _ = emb(features)
    for keys in (["plain"], ["sparse", "seq"], []):
        got = server.lookup({k: features[k] for k in keys}, {k: None for k in keys})
        assert list(got) == keys
        for k in keys:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
    with pytest.raises(ec.InputError, match=r"unexpected \['other'\]"):
        server.lookup({"plain": features["plain"], "other": features["plain"]})
    with pytest.raises(ec.InputError, match=r"weights at '<root>' has keys .* missing \['seq'\]"):
        server.lookup({"plain": features["plain"], "seq": features["seq"]}, {"plain": None})
    with pytest.raises(ec.InputError, match=r"features at '<root>' has keys .* missing \['dense'"):
        emb({"plain": features["plain"]})  # training takes the whole config


def test_an_empty_output_shape_is_no_output_shape():
    """TF tests ``if feature.output_shape:``, so [] is unset; embedcore keeps it as () and reads it alike."""
    _, user = tf_tables()
    emb = counting_engine({"f": ec.FeatureConfig(user, output_shape=[])})
    acts, _ = emb({"f": np.array([1, 2, 3])})
    assert acts["f"].shape == (3, 2)
