"""Datasets: the synthetic click log (determinism, streaming, teacher, optimum) and the file readers."""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.app.data import (Batch, CsvClickLog, DataFormatError, FeatureSpec, MovieLens, SyntheticClickLog,
                            feature_configs, rebatch)
from embedcore.app.data.batch import eval_mask, hash_uniform
from embedcore.app.data.csv_log import crc32
from embedcore.app.data.movielens import _parse_chunk, _parse_line
from embedcore.app.data.synthetic import BLOCK, DEFAULT_MULTI_HOT
from embedcore.app.metrics import BinaryMetrics, auc, log_loss


# ----------------------------------------------------------------------------------------------------------
# Helpers

def assert_batches_equal(a: Batch, b: Batch):
    assert len(a) == len(b)
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert (a.teacher_prob is None) == (b.teacher_prob is None)
    if a.teacher_prob is not None:
        np.testing.assert_array_equal(a.teacher_prob, b.teacher_prob)
    assert a.ids.keys() == b.ids.keys() and a.weights.keys() == b.weights.keys()
    for part_a, part_b in ((a.ids, b.ids), (a.weights, b.weights)):
        for k in part_a:
            x, y = part_a[k], part_b[k]
            assert type(x) is type(y), k
            if isinstance(x, ec.Ragged):
                np.testing.assert_array_equal(x.values, y.values, err_msg=k)
                np.testing.assert_array_equal(x.row_splits, y.row_splits, err_msg=k)
            elif x is not None:
                np.testing.assert_array_equal(x, y, err_msg=k)


def check_batch(ds, batch):
    """Shapes, dtypes and ranges of a batch against the dataset's description."""
    n = len(batch)
    assert batch.dense.dtype == np.float32 and batch.dense.shape == (n, ds.n_dense)
    assert np.all(np.isfinite(batch.dense))
    assert batch.labels.dtype == np.float32 and batch.labels.shape == (n,)
    assert set(np.unique(batch.labels)) <= {0.0, 1.0}
    assert list(batch.ids) == [f.name for f in ds.features] and batch.weights.keys() == batch.ids.keys()
    for f in ds.features:
        ids, w = batch.ids[f.name], batch.weights[f.name]
        if f.bag:
            assert isinstance(ids, ec.Ragged)
            assert ids.values.dtype == np.int64 and ids.row_splits.dtype == np.int64
            assert ids.row_splits.shape == (n + 1,) and ids.row_splits[0] == 0
            lengths = np.diff(ids.row_splits)
            assert lengths.min(initial=0) >= 0 and lengths.max(initial=0) <= f.max_ids
            values = ids.values
        else:
            assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.shape == (n,)
            values = ids
        assert values.min(initial=0) >= 0 and values.max(initial=0) < f.vocabulary_size
        if f.weighted:
            assert isinstance(w, ec.Ragged) and w.values.dtype == np.float32
            np.testing.assert_array_equal(w.row_splits, ids.row_splits)
        else:
            assert w is None
    if batch.teacher_prob is not None:
        assert batch.teacher_prob.dtype == np.float64 and batch.teacher_prob.shape == (n,)
        assert np.all((batch.teacher_prob > 0) & (batch.teacher_prob < 1))


def small_log(**kwargs):
    args = dict(n_train=3 * BLOCK + 123, n_eval=BLOCK + 7, seed=3, vocabulary_sizes=[7, 50, 300, 2000, 40],
                n_dense=3, multi_hot={"C2": (4, True), "C4": (3, False)}, n_interactions=2)
    args.update(kwargs)
    return SyntheticClickLog(**args)


@pytest.fixture(scope="module")
def default_log():
    return SyntheticClickLog(n_train=2 * BLOCK, n_eval=60_000)


@pytest.fixture(scope="module")
def small():
    return small_log()


# ----------------------------------------------------------------------------------------------------------
# The synthetic click log

def test_default_configuration_is_criteo_shaped(default_log):
    ds = default_log
    assert len(ds.features) == 26 and ds.n_dense == 13 and ds.name == "synthetic"
    sizes = [f.vocabulary_size for f in ds.features]
    assert min(sizes) == 100 and max(sizes) == 1_000_000
    bags = {f.name: (f.max_ids, f.weighted) for f in ds.features if f.bag}
    assert bags == DEFAULT_MULTI_HOT
    assert all(f.combiner == "mean" for f in ds.features if f.bag)
    assert all(1.05 <= s <= 1.2 for s in ds.zipf_exponents.values())
    assert len(ds.interactions) == 4
    assert ds.n_samples("train") == 2 * BLOCK and ds.n_samples("eval") == 60_000
    for batch in ds.batches(5000):
        check_batch(ds, batch)
        bag = batch.weights["C4"]
        assert bag.values.min() >= 0.25 and bag.values.max() < 2.0


def test_default_teacher_has_criteo_like_difficulty(default_log):
    opt = default_log.optimum("eval")
    assert 0.75 <= opt["auc"] <= 0.80
    assert 0.23 <= opt["click_rate"] <= 0.27
    assert 0.42 <= opt["log_loss"] <= 0.50
    assert default_log.click_rate("eval") == opt["click_rate"]
    # optimum() is the teacher's metrics on exactly these samples, whatever the batching.
    m = BinaryMetrics()
    labels, probs = [], []
    for batch in default_log.batches(7919, "eval"):
        m.update(batch.labels, batch.teacher_prob)
        labels.append(batch.labels)
        probs.append(batch.teacher_prob)
    assert m.result() == opt
    labels, probs = np.concatenate(labels), np.concatenate(probs)
    assert auc(labels, probs) == opt["auc"]
    assert log_loss(labels, probs) == pytest.approx(opt["log_loss"], rel=1e-12)
    assert probs.mean() == pytest.approx(0.25, abs=0.01)          # the calibrated click rate


def test_default_batches_feed_embedding_lookup(default_log):
    emb = ec.Embedding(feature_configs(default_log.features, 2, initializer=ec.Zeros()), ec.SGD(0.1))
    batch = next(default_log.batches(512))
    acts, ctx = emb.lookup(batch.ids, batch.weights)
    assert set(acts) == {f.name for f in default_log.features}
    assert all(a.shape == (512, 2) for a in acts.values())


def test_same_seed_same_data_other_seed_other_data(small):
    again = small_log()
    for a, b in zip(small.batches(1000), again.batches(1000)):
        assert_batches_equal(a, b)
    other = next(small_log(seed=4).batches(1000))
    assert not np.array_equal(other.ids["C5"], next(small.batches(1000)).ids["C5"])
    train, evaluation = next(small.batches(1000)), next(small.batches(1000, "eval"))
    assert not np.array_equal(train.ids["C5"], evaluation.ids["C5"])


@settings(max_examples=15, deadline=None)
@given(batch_size=st.integers(1, 9000), start=st.integers(0, 3 * BLOCK + 123), split=st.sampled_from(["train", "eval"]))
def test_batches_do_not_depend_on_batch_size_or_start(small, batch_size, start, split):
    n = small.n_samples(split)
    start = min(start, n)
    whole = small.samples(0, n, split)
    batches = list(small.batches(batch_size, split, start=start))
    assert all(len(b) == batch_size for b in batches[:-1])
    assert sum(len(b) for b in batches) == n - start
    if batches:
        assert 0 < len(batches[-1]) <= batch_size
        assert_batches_equal(Batch.concat(batches), whole.slice(start, n))


def test_sizes_only_truncate_the_stream(small):
    longer = small_log(n_train=5 * BLOCK)
    assert_batches_equal(next(longer.batches(small.n_samples("train"))), small.samples(0, small.n_samples("train")))
    beyond = small.samples(4 * BLOCK, 4 * BLOCK + 10)         # the stream goes on past n_train
    assert_batches_equal(beyond, longer.samples(4 * BLOCK, 4 * BLOCK + 10))


def test_small_batches_are_well_formed(small):
    for split in ("train", "eval"):
        for batch in small.batches(2048, split):
            check_batch(small, batch)


def sample_ids(batch, f, b):
    """``(ids, float64 weights)`` of sample ``b`` of feature ``f``."""
    ids = batch.ids[f.name]
    if not f.bag:
        return ids[b:b + 1], np.ones(1)
    lo, hi = ids.row_splits[b], ids.row_splits[b + 1]
    w = batch.weights[f.name]
    return ids.values[lo:hi], np.ones(hi - lo) if w is None else w.values[lo:hi].astype(np.float64)


def test_teacher_matches_a_reference_computation(small):
    """The label probability is the documented model of exactly the batch's features."""
    batch = small.samples(100, 160)
    ref = small.bias + batch.dense.astype(np.float64) @ small._dense_w
    for b in range(len(batch)):
        pooled = {}
        for i, f in enumerate(small.features):
            rows, w = sample_ids(batch, f, b)
            ref[b] += small._main_scale[i] * (w @ small._effects[i][rows].astype(np.float64)) / w.sum()
            if i in small._factors:
                pooled[i] = w @ small._factors[i][rows].astype(np.float64) / w.sum()
        for i, j in small._pairs:
            ref[b] += small._inter_scale * pooled[i] @ pooled[j]
    np.testing.assert_allclose(small.teacher_logits(batch), ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(batch.teacher_prob, 1 / (1 + np.exp(-ref)), rtol=1e-9)


def test_ids_follow_the_documented_power_law():
    ds = small_log(vocabulary_sizes=[50], multi_hot={}, n_dense=0, n_interactions=0, n_train=16 * BLOCK,
                   zipf_exponent=1.1)
    all_ids = np.arange(50)
    p = ds.id_probability("C1", all_ids)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    ranks_p = ds.id_probability("C1", ds.ids_by_rank("C1", all_ids))
    assert np.all(np.diff(ranks_p) < 0)                       # rank 0 is the most probable
    ids = np.concatenate([b.ids["C1"] for b in ds.batches(BLOCK)])
    counts = np.bincount(ids, minlength=50)
    expected = p * ids.size
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected) + 5)
    assert ds.ids_by_rank("C1", 0) != 0 or ds.ids_by_rank("C1", 1) != 1    # scattered
    plain = small_log(vocabulary_sizes=[50], multi_hot={}, scatter_ids=False, zipf_exponent=1.1)
    np.testing.assert_array_equal(plain.ids_by_rank("C1", all_ids), all_ids)
    assert np.argmax(np.bincount(next(plain.batches(BLOCK)).ids["C1"])) == 0


def test_a_logistic_model_on_the_batch_features_approaches_the_optimum():
    """With no interactions the teacher is a logistic model of the batch's own features (per-id effects,
    weighted means over bags, linear dense): fitting that family on train approaches the optimum on eval."""
    ds = small_log(vocabulary_sizes=[20, 40, 60], multi_hot={"C2": (3, True)}, n_interactions=0, n_dense=2,
                   variance_shares=(0.8, 0.0, 0.2), n_train=30 * BLOCK, n_eval=10 * BLOCK, logit_std=1.5)
    tables = [np.zeros(f.vocabulary_size) for f in ds.features]
    acc = [np.full(f.vocabulary_size, 1e-8) for f in ds.features]
    coef, acc_coef = np.zeros(ds.n_dense + 1), np.full(ds.n_dense + 1, 1e-8)

    def pooled_parts(batch):
        parts = []
        for f in ds.features:
            ids = batch.ids[f.name]
            if f.bag:
                sample = np.repeat(np.arange(len(batch)), np.diff(ids.row_splits))
                w = batch.weights[f.name].values.astype(np.float64)
                gain = w / np.bincount(sample, w, minlength=len(batch))[sample]
                parts.append((ids.values, sample, gain))
            else:
                parts.append((ids, np.arange(len(batch)), np.ones(len(batch))))
        return parts

    def logits(batch, parts):
        z = np.column_stack([np.ones(len(batch)), batch.dense]) @ coef
        for table, (rows, sample, gain) in zip(tables, parts):
            z += np.bincount(sample, gain * table[rows], minlength=len(batch))
        return z

    for epoch in range(3):
        for batch in ds.batches(512):
            parts = pooled_parts(batch)
            g = 1 / (1 + np.exp(-logits(batch, parts))) - batch.labels
            x = np.column_stack([np.ones(len(batch)), batch.dense])
            gc = x.T @ g
            acc_coef += gc * gc
            coef -= 0.1 * gc / np.sqrt(acc_coef)
            for table, a, (rows, sample, gain) in zip(tables, acc, parts):
                grad = np.bincount(rows, gain * g[sample], minlength=table.size)
                a += grad * grad
                table -= 0.1 * grad / np.sqrt(a)
    m = BinaryMetrics()
    for batch in ds.batches(4096, "eval"):
        m.update(batch.labels, 1 / (1 + np.exp(-logits(batch, pooled_parts(batch)))))
    fitted, opt = m.result(), ds.optimum("eval")
    assert fitted["auc"] >= opt["auc"] - 0.01
    assert fitted["log_loss"] <= opt["log_loss"] + 0.01


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_train=-1), "n_train"),
    (dict(vocabulary_sizes=[0]), "vocabulary size"),
    (dict(multi_hot={"nope": (2, True)}), "unknown features"),
    (dict(multi_hot={"C2": (0, True)}), "max_ids"),
    (dict(zipf_exponent=1.0), "zipf_exponent"),
    (dict(click_rate=1.0), "click_rate"),
    (dict(variance_shares=(0, 0, 0)), "variance_shares"),
    (dict(interaction_dim=0), "interaction_dim"),
])
def test_synthetic_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_log(**kwargs)


def test_synthetic_call_errors(small):
    with pytest.raises(ValueError, match="batch_size"):
        small.batches(0)
    with pytest.raises(ValueError, match="split"):
        small.batches(10, "test")
    with pytest.raises(ValueError, match="start"):
        small.batches(10, start=small.n_samples("train") + 1)
    with pytest.raises(ValueError, match="empty"):
        small_log(n_eval=0).optimum("eval")


# ----------------------------------------------------------------------------------------------------------
# Batch helpers and hashing

def test_rebatch_take_and_hash_helpers(small):
    batch = small.samples(0, 1000)
    rows = np.array([5, 3, 999, 0])
    taken = batch.take(rows)
    for k, r in enumerate(rows):
        assert_batches_equal(taken.slice(k, k + 1), batch.slice(r, r + 1))
    mask = np.zeros(1000, bool)
    mask[[3, 5]] = True
    assert_batches_equal(batch.take(mask), batch.take(np.array([3, 5])))
    pieces = list(rebatch(iter([batch.slice(0, 10), batch.slice(10, 10), batch.slice(10, 1000)]), 300))
    assert [len(p) for p in pieces] == [300, 300, 300, 100]
    assert_batches_equal(Batch.concat(pieces), batch)
    u = hash_uniform(np.arange(100_000), 7)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    np.testing.assert_array_equal(u[:10], hash_uniform(np.arange(10), 7))
    assert eval_mask(np.arange(100_000), 7, 0.1).mean() == pytest.approx(0.1, abs=0.01)
    with pytest.raises(ValueError, match="combiner"):
        FeatureSpec("x", 10, combiner="max")
    with pytest.raises(ValueError, match="vocabulary_size"):
        FeatureSpec("x", 0)


# ----------------------------------------------------------------------------------------------------------
# MovieLens

def write(path, text, mode="w"):
    with open(path, mode, newline="") as f:
        f.write(text)
    return str(path)


DAT = "5::10::5::978300760\n1::20::3::978302109\n5::30::4.5::978301968\n\n2::10::1::978300275\n"
CSV = "userId,movieId,rating,timestamp\n5,10,5.0,978300760\n1,20,3.0,978302109\n5,30,4.5,978301968\n" \
      "2,10,1.0,978300275\n"
U_DATA = "5\t10\t5\t978300760\n1\t20\t3\t978302109\n5\t30\t4.5\t978301968\n\n2\t10\t1\t978300275\n"


@pytest.mark.parametrize("name,text", [("ratings.dat", DAT), ("ratings.csv", CSV), ("u.data", U_DATA),
                                       ("ratings.dat", U_DATA.replace("\n", "\r\n"))])
def test_movielens_every_format(tmp_path, name, text):
    path = write(tmp_path / name, text)
    for source in (path, tmp_path):                          # the file or its directory
        ds = MovieLens(source, threshold=4.0, eval_fraction=0.0)
        assert ds.path == path and ds.n_dense == 0
        np.testing.assert_array_equal(ds.user_ids, [1, 2, 5])            # sorted original ids
        np.testing.assert_array_equal(ds.users, [2, 0, 2, 1])
        np.testing.assert_array_equal(ds.movie_ids, [10, 20, 30])
        np.testing.assert_array_equal(ds.movies, [0, 1, 2, 0])
        np.testing.assert_array_equal(ds.labels, [1, 0, 1, 0])
        np.testing.assert_array_equal(ds.ratings, [5, 3, 4.5, 1])
        assert [(f.name, f.vocabulary_size, f.bag) for f in ds.features] == [("user", 3, False), ("movie", 3, False)]
        assert ds.n_samples("train") == 4 and ds.n_samples("eval") == 0 and ds.click_rate() == 0.5
        batches = list(ds.batches(3, shuffle=False))
        assert [len(b) for b in batches] == [3, 1]
        check_batch(ds, batches[0])
        np.testing.assert_array_equal(batches[0].ids["user"], [2, 0, 2])
        rated = list(ds.batches(3, shuffle=False, ratings=True))  # the ratings themselves, for regression
        np.testing.assert_array_equal(np.concatenate([b.labels for b in rated]), [5, 3, 4.5, 1])
        assert rated[0].labels.dtype == np.float32 and ds.mean_rating() == pytest.approx(3.375)


def test_movielens_directory_prefers_csv_then_dat_then_u_data(tmp_path):
    u_data = write(tmp_path / "u.data", U_DATA)
    assert MovieLens(tmp_path).path == u_data
    dat = write(tmp_path / "ratings.dat", DAT)
    assert MovieLens(tmp_path).path == dat
    assert MovieLens(u_data).path == u_data


def test_movielens_u_data_as_ml_100k_writes_it(tmp_path):
    """ML-100K's layout: 4 tab-separated integer columns, ids from 1, ratings 1..5, no header; a comma in a
    tab-separated file is a bad id, not a separator."""
    rng = np.random.default_rng(2)
    n = 3000
    users, items, ratings = rng.integers(1, 944, n), rng.integers(1, 1683, n), rng.integers(1, 6, n)
    times = rng.integers(874724710, 893286638, n)
    path = write(tmp_path / "u.data", "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in zip(users, items, ratings,
                                                                                             times)))
    ds = MovieLens(path, eval_fraction=0.0)
    np.testing.assert_array_equal(ds.user_ids[ds.users], users)
    np.testing.assert_array_equal(ds.movie_ids[ds.movies], items)
    np.testing.assert_array_equal(ds.ratings, ratings)
    np.testing.assert_array_equal(ds.timestamps, times)
    assert ds.mean_rating() == pytest.approx(ratings.mean())
    with pytest.raises(DataFormatError, match="movie id must be an integer") as info:
        MovieLens(write(tmp_path / "bad.data", "1\t2\t3\t4\n1\t2,5\t3\t4\n"))
    assert info.value.line == 2


def test_movielens_splits(tmp_path):
    rng = np.random.default_rng(0)
    n = 2000
    rows = zip(rng.integers(1, 50, n), rng.integers(1, 80, n), rng.integers(1, 6, n), rng.permutation(n))
    path = write(tmp_path / "ratings.dat", "".join(f"{u}::{m}::{r}::{t}\n" for u, m, r, t in rows))
    ds = MovieLens(path, eval_fraction=0.2, seed=1)
    assert ds.n_samples("train") + ds.n_samples("eval") == n
    assert abs(ds.n_samples("eval") - 400) < 80
    np.testing.assert_array_equal(ds.is_eval, eval_mask(np.arange(n), 1, 0.2))
    train = np.concatenate([b.ids["user"] * 1000 + b.ids["movie"] for b in ds.batches(300)])
    again = np.concatenate([b.ids["user"] * 1000 + b.ids["movie"] for b in ds.batches(300)])
    other = np.concatenate([b.ids["user"] * 1000 + b.ids["movie"] for b in ds.batches(300, epoch=1)])
    np.testing.assert_array_equal(train, again)
    assert not np.array_equal(train, other) and np.array_equal(np.sort(train), np.sort(other))
    expected = np.sort(ds.users[~ds.is_eval].astype(np.int64) * 1000 + ds.movies[~ds.is_eval])
    np.testing.assert_array_equal(np.sort(train), expected)
    by_time = MovieLens(path, eval_fraction=0.25, split="time")
    assert by_time.n_samples("eval") == 500
    assert by_time.timestamps[by_time.is_eval].min() > by_time.timestamps[~by_time.is_eval].max()
    emb = ec.Embedding(feature_configs(ds.features, 3, initializer=ec.Zeros()), ec.SGD(0.1))
    batch = next(ds.batches(64))
    acts, _ = emb.lookup(batch.ids, batch.weights)
    assert acts["movie"].shape == (64, 3)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 10 ** 6), st.sampled_from([0.5, 1, 3.5, 5]),
                          st.integers(-2 ** 40, 2 ** 40)), min_size=1, max_size=30),
       st.sampled_from(["::", ",", "\t"]))
def test_movielens_fast_and_line_by_line_parsers_agree(rows, delimiter):
    lines = [delimiter.join(str(v) for v in row) + "\n" for row in rows]
    users, movies, ratings, times = _parse_chunk(lines, delimiter, "f", 1)
    expected = [_parse_line(line, delimiter, "f", 1) for line in lines]
    np.testing.assert_array_equal(users, [e[0] for e in expected])
    np.testing.assert_array_equal(movies, [e[1] for e in expected])
    np.testing.assert_array_equal(ratings, [e[2] for e in expected])
    np.testing.assert_array_equal(times, [e[3] for e in expected])


@pytest.mark.parametrize("name,text,line,match", [
    ("ratings.dat", "1::2::3::4\n\n1::2::3\n", 3, "expected 4 fields"),
    ("ratings.dat", "1::2::3::4\n1::x::3::4\n", 2, "movie id must be an integer, got 'x'"),
    ("ratings.dat", "1::2::3::4\n1.5::2::3::4\n", 2, "user id must be an integer"),
    ("ratings.dat", "1::2::3::4\n-1::2::3::4\n", 2, "user id must be >= 0"),
    ("ratings.dat", "1::2::3::4\n1::2::nan::4\n", 2, "rating must be a finite number"),
    ("ratings.dat", "1::2::3::4\n1::2,5::3::4\n", 2, "movie id must be an integer"),
    ("ratings.csv", "userId,movieId,rating,timestamp\n1,2,3,4\n1,2,3,4,5\n", 3, "expected 4 fields"),
    ("ratings.csv", "userId,movieId,rating,timestamp\n1,2,good,4\n", 2, "rating must be a finite number"),
    ("ratings.csv", "user,movie,rating,timestamp\n1,2,3,4\n", 1, "expected the header"),
    ("ratings.csv", "\n1,2,3,4\n", 1, "first line is empty"),
    ("u.data", "1\t2\t3\t4\n1\t2\t3\n", 2, "expected 4 fields separated by '\\\\t'"),
    ("u.data", "1\t2\t3\t4\n\n1\tx\t3\t4\n", 3, "movie id must be an integer, got 'x'"),
    ("u.data", "1\t2\t3\t4\n1\t2\tinf\t4\n", 2, "rating must be a finite number"),
    ("u.data", "1\t2\t3\t4\n-3\t2\t3\t4\n", 2, "user id must be >= 0"),
    ("u.data", "1 2 3 4\n", 1, "expected the header .* or a tab-separated"),
])
def test_movielens_errors_name_file_and_line(tmp_path, name, text, line, match):
    path = write(tmp_path / name, text)
    with pytest.raises(DataFormatError, match=match) as info:
        MovieLens(path)
    assert str(info.value).startswith(f"{path}:{line}:") and info.value.line == line


def test_movielens_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError):
        MovieLens(tmp_path / "nothing.dat")
    with pytest.raises(FileNotFoundError, match="no ratings.csv, ratings.dat or u.data"):
        MovieLens(tmp_path)
    with pytest.raises(DataFormatError, match="no ratings"):
        MovieLens(write(tmp_path / "ratings.csv", "userId,movieId,rating,timestamp\n"))
    with pytest.raises(ValueError, match="split"):
        MovieLens(tmp_path / "ratings.csv", split="random")


# ----------------------------------------------------------------------------------------------------------
# CSV click logs

CLICKS = ("label,I1,I2,C1,C2,cat_x\n"
          "1,0.5,3,17,4|9:0.5|9,a\n"
          "0,,-1e1,3,,b|c\n"
          "\n"
          "1,2,2,5,1, a \n")


def test_csv_multi_hot_weights_hashing_and_empty_cells(tmp_path):
    path = write(tmp_path / "clicks.csv", CLICKS)
    ds = CsvClickLog(path, hash_buckets={"cat_x": 100}, eval_fraction=0.0)
    assert ds.n_dense == 2 and ds.dense_names == ["I1", "I2"]
    assert ds.n_samples("train") == 3 and ds.n_samples("eval") == 0
    assert ds.click_rate("train") == pytest.approx(2 / 3)
    assert ds.features == [FeatureSpec("C1", 18, 1, False, "sum"), FeatureSpec("C2", 10, 3, True, "mean"),
                           FeatureSpec("cat_x", 100, 2, False, "mean")]
    (batch,) = list(ds.batches(10))
    check_batch(ds, batch)
    np.testing.assert_array_equal(batch.labels, [1, 0, 1])
    np.testing.assert_array_equal(batch.dense, [[0.5, 3], [0, -10], [2, 2]])
    np.testing.assert_array_equal(batch.ids["C1"], [17, 3, 5])
    np.testing.assert_array_equal(batch.ids["C2"].values, [4, 9, 9, 1])
    np.testing.assert_array_equal(batch.ids["C2"].row_splits, [0, 3, 3, 4])
    np.testing.assert_array_equal(batch.weights["C2"].values, [1, 0.5, 1, 1])
    h = [zlib.crc32(s) % 100 for s in (b"a", b"b", b"c", b"a")]
    np.testing.assert_array_equal(batch.ids["cat_x"].values, h)
    np.testing.assert_array_equal(batch.ids["cat_x"].row_splits, [0, 1, 3, 4])
    assert batch.weights["cat_x"] is None
    emb = ec.Embedding(feature_configs(ds.features, 2, initializer=ec.Zeros()), ec.SGD(0.1))
    acts, _ = emb.lookup(batch.ids, batch.weights)
    assert acts["C2"].shape == (3, 2)


def test_csv_roles_vocabularies_delimiters_and_line_endings(tmp_path):
    text = "\ufeffclick\tage\tuser\titems\r\n1\t3\t2\t\r\n0\t4.5\t0\t7|8\r\n1\t1\t1\t3"   # BOM, CRLF, no final LF
    path = write(tmp_path / "clicks.tsv", text)
    ds = CsvClickLog(path, categorical=["user", "items"], label="click", delimiter="\t",
                     vocabulary_sizes={"user": 10}, eval_fraction=0.0)
    assert ds.dense_names == ["age"]
    assert [(f.name, f.vocabulary_size, f.max_ids, f.bag) for f in ds.features] == \
        [("user", 10, 1, False), ("items", 9, 2, True)]
    (batch,) = list(ds.batches(5))
    np.testing.assert_array_equal(batch.ids["items"].row_splits, [0, 0, 2, 3])
    np.testing.assert_array_equal(batch.dense[:, 0], [3, 4.5, 1])
    only_dense = CsvClickLog(path, dense=["age"], label="click", delimiter="\t")
    assert [f.name for f in only_dense.features] == ["user", "items"]
    hashed = CsvClickLog(path, categorical=["user", "items"], label="click", delimiter="\t", hash_buckets=2 ** 32,
                         eval_fraction=0.0)
    np.testing.assert_array_equal(next(hashed.batches(5)).ids["items"].values,
                                  [zlib.crc32(s) for s in (b"7", b"8", b"3")])
    # One-hot with an empty cell is a bag of at most one id.
    path2 = write(tmp_path / "c.csv", "label,C1\n1,3\n0,\n")
    (spec,) = CsvClickLog(path2).features
    assert spec.bag and spec.max_ids == 1 and not spec.weighted


def csv_cells(draw_rows):
    """Text and expected values of generated rows."""
    lines, expected = [], []
    for label, dense, bag in draw_rows:
        cell = "|".join(str(i) if w is None else f"{i}:{w}" for i, w in bag)
        lines.append(f"{label},{'' if dense is None else repr(dense)},{cell}\n")
        expected.append((label, 0.0 if dense is None else dense, bag))
    return "label,I1,C1\n" + "".join(lines), expected


weights_strategy = st.none() | st.sampled_from([0.5, 2.0, 1e-3])
rows_strategy = st.lists(st.tuples(st.integers(0, 1), st.none() | st.floats(-1e6, 1e6, width=32),
                                   st.lists(st.tuples(st.integers(0, 999), weights_strategy), max_size=4)),
                         min_size=1, max_size=40)


@settings(max_examples=25, deadline=None)
@given(rows_strategy, st.integers(1, 400), st.integers(1, 50))
def test_csv_reads_generated_files_whatever_the_chunking(tmp_path_factory, rows, chunk_bytes, batch_size):
    text, expected = csv_cells(rows)
    path = write(tmp_path_factory.mktemp("csv") / "gen.csv", text)
    ds = CsvClickLog(path, eval_fraction=0.3, chunk_bytes=chunk_bytes, seed=5)
    is_eval = eval_mask(np.arange(len(rows)), 5, 0.3)
    for split, keep in (("train", ~is_eval), ("eval", is_eval)):
        want = [e for e, k in zip(expected, keep) if k]
        assert ds.n_samples(split) == len(want)
        got = list(ds.batches(batch_size, split))
        if not want:
            assert got == []
            continue
        batch = Batch.concat(got)
        check_batch(ds, batch)
        np.testing.assert_array_equal(batch.labels, [e[0] for e in want])
        np.testing.assert_array_equal(batch.dense[:, 0], np.float32([e[1] for e in want]))
        ids = batch.ids["C1"]
        values = ids.values if isinstance(ids, ec.Ragged) else ids
        np.testing.assert_array_equal(values, [i for e in want for i, _ in e[2]])
        if batch.weights["C1"] is not None:
            np.testing.assert_array_equal(batch.weights["C1"].values,
                                          np.float32([1.0 if w is None else w for e in want for _, w in e[2]]))


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=40))
def test_crc32_kernel_equals_zlib(data):
    assert crc32(data) == zlib.crc32(data)


CSV_ERRORS = [
    ("label,I1,C1\n1,2,3\n1,2\n", {}, 3, None, "expected 3 fields"),
    ("label,I1,C1\n1,2,3\n2,2,3\n", {}, 3, "label", "label must be 0 or 1, got '2'"),
    ("label,I1,C1\n1,2,3\n\n,2,3\n", {}, 4, "label", "label must be 0 or 1, got ''"),
    ("label,I1,C1\n1,x,3\n", {}, 2, "I1", "expected a decimal number, got 'x'"),
    ("label,I1,C1\n1,inf,3\n", {}, 2, "I1", "expected a decimal number"),
    ("label,I1,C1\n1,1e999,3\n", {}, 2, "I1", "expected a finite number"),
    ("label,I1,C1\n1,2,3\n0,1,abc\n", {}, 3, "C1", "id 'abc' in cell 'abc' is not a non-negative integer"),
    ("label,I1,C1\n1,2,-3\n", {}, 2, "C1", "negative id -3"),
    ("label,I1,C1\n1,2,1.5\n", {}, 2, "C1", "not a non-negative integer"),
    ("label,I1,C1\n1,2,3\n1,2,10\n", {"vocabulary_sizes": {"C1": 10}}, 3, "C1", "not below the vocabulary size 10"),
    ("label,I1,C1\n1,2,3:x\n", {}, 2, "C1", "bad weight in cell '3:x'"),
    ("label,I1,C1\n1,2,3||4\n", {}, 2, "C1", "empty id in cell '3||4'"),
    ("label,I1,C1\n1,2,a|:2\n", {"hash_buckets": 8}, 2, "C1", "empty id"),
    ("label,I1,C1\n1,2,1234567890123456789\n", {}, 2, "C1", "more than 18 digits"),
    ("label,I1,C1,I1\n", {}, 1, None, "names column 'I1' twice"),
    ("label,,C1\n", {}, 1, None, "empty column name"),
    ("label,I1,X\n1,2,3\n", {}, 1, None, "cannot tell the role of columns \\['X'\\]"),
    ("y,I1,C1\n1,2,3\n", {}, 1, None, "label column 'label' is not in the header"),
    ("\n", {}, 1, None, "expected a header row"),
]


@pytest.mark.parametrize("text,kwargs,line,column,match", CSV_ERRORS)
def test_csv_errors_name_file_line_and_column(tmp_path, text, kwargs, line, column, match):
    path = write(tmp_path / "bad.csv", text)
    with pytest.raises(DataFormatError, match=match) as info:
        CsvClickLog(path, **kwargs)
    assert str(info.value).startswith(f"{path}:{line}:")
    assert info.value.line == line and info.value.column == column
    if column:
        assert f"column '{column}'" in str(info.value)


def test_csv_argument_errors(tmp_path):
    path = write(tmp_path / "ok.csv", "label,I1,C1\n1,2,3\n")
    with pytest.raises(ValueError, match="both a vocabulary size and hash buckets"):
        CsvClickLog(path, vocabulary_sizes={"C1": 5}, hash_buckets={"C1": 5})
    with pytest.raises(ValueError, match="not categorical"):
        CsvClickLog(path, hash_buckets={"I1": 5})
    with pytest.raises(ValueError, match="both categorical and dense"):
        CsvClickLog(path, categorical=["C1"], dense=["C1"])
    with pytest.raises(ValueError, match="delimiter"):
        CsvClickLog(path, delimiter="|")
    with pytest.raises(DataFormatError, match="categorical column 'C9' is not in the header"):
        CsvClickLog(path, categorical=["C9"])
    with pytest.raises(ValueError, match="eval_fraction"):
        CsvClickLog(path, eval_fraction=1.5)
    ds = CsvClickLog(path)
    with pytest.raises(ValueError, match="split"):
        ds.batches(3, "valid")
    assert ds.name == "ok.csv" and ds.n_samples("train") + ds.n_samples("eval") == 1
