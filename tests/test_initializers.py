"""Initializers: deterministic, keyed by (seed, table), partition independent; the engine's use of them.

Table names and seeds here are mostly chosen so their random-stream keys are < 2**63, so that these tests
do not depend on the key-overflow bug that ``test_random_keys_above_2_63_after_small_keys`` pins down.
"""

import math
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

import embedcore as ec
from embedcore.initializers import fill_key_rows, fill_rows, stream_key
from embedcore.kernels import random as _random
from embedcore.kernels.threads import SMALL_WORK, one_thread_below

V, D = 64, 4


def _fill(init, n_rows=V, dim=D, first_row=0, vocabulary_size=V, seed=0, name="t"):
    out = np.full((n_rows, dim), np.nan, np.float32)
    fill_rows(init, out, first_row, vocabulary_size, seed, name)
    return out


RANDOM = [ec.TruncatedNormal(0.0, 1.0), ec.RandomUniform(-1.0, 1.0)]


@pytest.mark.parametrize("init", RANDOM, ids=repr)
def test_deterministic(init):
    a, b = _fill(init), _fill(init)
    assert a.dtype == np.float32 and np.isfinite(a).all()
    assert np.array_equal(a, b)
    assert np.unique(a).size > V * D // 2  # really random-looking, not constant
    assert np.array_equal(init((V, D)), init((V, D)))


@pytest.mark.parametrize("init", RANDOM, ids=repr)
def test_names_and_seeds_give_different_streams(init):
    base = _fill(init, name="t")
    assert not np.any(base == _fill(init, name="other"))
    assert not np.any(base == _fill(init, seed=1))
    assert stream_key(0, "t") != stream_key(0, "other") != stream_key(1, "t")
    assert stream_key(0, "t", "accumulators") != stream_key(0, "t")


def test_own_seed_wins_over_engine_seed():
    init = ec.TruncatedNormal(0.0, 1.0, seed=3)
    assert np.array_equal(_fill(init, seed=0, name="user"), _fill(init, seed=1, name="user"))
    assert not np.array_equal(_fill(init, name="user"), _fill(init, name="video"))


@pytest.mark.parametrize("init", RANDOM + [ec.RowId(0.5)], ids=repr)
@pytest.mark.parametrize("a, b", [(0, 1), (5, 23), (23, 64), (63, 64), (0, 64)])
def test_partition_independent(init, a, b):
    whole = _fill(init)
    part = _fill(init, n_rows=b - a, first_row=a)
    assert np.array_equal(part, whole[a:b])


@pytest.mark.parametrize("init", RANDOM + [ec.RowId()], ids=repr)
def test_partition_independent_chunks_and_direct_fill(init):
    whole = _fill(init)
    pieces = [_fill(init, n_rows=hi - lo, first_row=lo) for lo, hi in [(0, 7), (7, 8), (8, 40), (40, 64)]]
    assert np.array_equal(np.concatenate(pieces), whole)
    key = stream_key(0, "t")
    out = np.empty((10, D), np.float32)
    init.fill(out, 30, key)
    assert np.array_equal(out, whole[30:40])


def test_row_id_values():
    out = _fill(ec.RowId(0.5), n_rows=3, first_row=10)
    assert np.array_equal(out, np.repeat(np.array([[10.5], [11.5], [12.5]], np.float32), D, axis=1))


def test_truncated_normal_bounds_and_moments():
    mean, std = 0.5, 2.0
    x = _fill(ec.TruncatedNormal(mean, std), n_rows=25_000, vocabulary_size=25_000).astype(np.float64)
    assert x.size == 100_000
    assert np.all(np.abs(x - mean) <= 2 * std * (1 + 1e-6))
    assert abs(x.mean() - mean) < 0.03
    # Normal truncated at two standard deviations: std = 0.8796 * stddev.
    assert abs(x.std() - 0.8796 * std) < 0.03
    # Not just clipped: hardly any values pile up at the bounds.
    assert np.mean(np.abs(x - mean) > 1.99 * std) < 0.002
    # The shape: E[z^4] of the truncated normal (1.4162; a normal clipped at 2 sigma or a uniform of the same
    # variance is far off) and the Kolmogorov-Smirnov distance to its distribution function, below the 1%
    # critical value (1.63 / sqrt(n)).
    z = np.sort((x.ravel() - mean) / std)
    assert abs(np.mean(z ** 4) - _truncated_moment(4)) < 0.04
    cdf = _truncated_normal_cdf(z)
    n = z.size
    assert max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n)) < 1.63 / np.sqrt(n)


_PHI_2 = math.exp(-2.0) / math.sqrt(2.0 * math.pi)  # the standard normal density at 2
_MASS = math.erf(math.sqrt(2.0))                     # Phi(2) - Phi(-2)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _truncated_moment(k):
    """E[z^k] of the standard normal truncated to [-2, 2] (k even): M_k = (k - 1) M_(k-2) - 2 * 2^(k-1)
    phi(2) / (Phi(2) - Phi(-2)), by parts."""
    return 1.0 if k == 0 else (k - 1) * _truncated_moment(k - 2) - 2.0 * 2.0 ** (k - 1) * _PHI_2 / _MASS


def _truncated_normal_cdf(z):
    """(Phi(z) - Phi(-2)) / (Phi(2) - Phi(-2)) for z in [-2, 2]."""
    return (_erf(z / math.sqrt(2.0)) / _MASS + 1.0) / 2.0


def _truncated_normal_quantile(u):
    """The inverse of :func:`_truncated_normal_cdf` at u in [0, 1), independently of embedcore's rational
    approximation: sqrt(2) * erfinv(erf(sqrt(2)) * (2u - 1)), erfinv by Newton's method on math.erf from 0
    (monotone for the concave/convex halves of erf), to float64 precision."""
    target = _MASS * (2.0 * u - 1.0)
    y = np.zeros_like(target)
    for _ in range(60):
        step = (_erf(y) - target) / (2.0 / math.sqrt(math.pi) * np.exp(-y * y))
        y = y - step
        if np.max(np.abs(step)) < 1e-15:
            break
    return math.sqrt(2.0) * y


def test_truncated_normal_is_the_truncated_quantile_of_the_elements_uniform():
    """Each value is mean + stddev * F^-1(U), F the truncated normal's distribution function and U the uniform
    RandomUniform(0, 1) gives the same element under the same key: float32 rounding of the exact value, off
    by at most the approximation's 2.3e-9 (times stddev)."""
    mean, std, key = 0.5, 2.0, stream_key(0, "t")
    x = np.empty((5_000, 4), np.float32)
    ec.TruncatedNormal(mean, std).fill(x, 7, key, stride=3)
    u = np.empty(x.shape, np.float64)
    _random.fill_uniform(u, 7, np.uint64(key), 0.0, 1.0, 3)
    expected = mean + std * _truncated_normal_quantile(u)
    np.testing.assert_allclose(x, expected, rtol=2.0 ** -24, atol=std * 2.5e-9)
    keys = np.arange(1_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    rows = np.empty((1_000, 6), np.float32)
    fill_key_rows(ec.TruncatedNormal(mean, std), rows, keys, 0, "t")
    streams = np.empty(1_000, np.uint64)
    _random.key_streams(keys, np.uint64(stream_key(0, "t")), streams)
    u = np.empty(rows.shape, np.float64)
    for i, stream in enumerate(streams):
        _random.fill_uniform(u[i:i + 1], 0, stream, 0.0, 1.0)
    np.testing.assert_allclose(rows, mean + std * _truncated_normal_quantile(u), rtol=2.0 ** -24, atol=std * 2.5e-9)


def test_truncated_normal_stays_within_two_sigma_at_the_most_extreme_uniforms():
    """The rational approximation never leaves [-2, 2], even for the 2**22 smallest and largest uniforms u =
    m / 2**53 (beyond those, |z| is at least 8e-9 below 2, more than the approximation's error). The kernel
    computes ``_truncated_z`` with the same float64 operations as its Python function run on NumPy arrays
    (no fast-math, no contraction into FMAs), so this checks what the kernel computes."""
    z = _random._truncated_z.py_func
    m = np.arange(1 << 22, dtype=np.float64)
    low, high = z(m * 2.0 ** -53), z(1.0 - (m + 1.0) * 2.0 ** -53)
    assert np.all(np.abs(low) < 2.0) and np.all(np.abs(high) < 2.0)
    assert -2.0 < low[0] < -2.0 + 1e-9 and 2.0 - 1e-9 < high[0] < 2.0
    assert np.all(low < -1.99999) and np.all(high > 1.99999)
    np.testing.assert_array_equal(z(m * 2.0 ** -53), -z(1.0 - m * 2.0 ** -53))  # odd: u and 1 - u


def test_truncated_normal_zero_stddev_and_validation():
    assert np.all(_fill(ec.TruncatedNormal(1.25, 0.0)) == 1.25)
    with pytest.raises(ValueError, match=r"TruncatedNormal: stddev must be >= 0, got -1"):
        ec.TruncatedNormal(0.0, -1)


def test_random_uniform_range_and_moments():
    x = _fill(ec.RandomUniform(-3.0, 5.0), n_rows=25_000, vocabulary_size=25_000).astype(np.float64)
    assert np.all((x >= -3.0) & (x <= 5.0))
    assert abs(x.mean() - 1.0) < 0.05
    assert abs(x.std() - 8.0 / np.sqrt(12.0)) < 0.05
    assert x.min() < -2.9 and x.max() > 4.9
    with pytest.raises(ValueError, match=r"RandomUniform: minval must be <= maxval"):
        ec.RandomUniform(1.0, 0.0)


def test_constant_and_zeros():
    assert np.all(_fill(ec.Constant(1.5)) == 1.5)
    assert np.all(_fill(ec.Zeros()) == 0.0)
    assert np.all(_fill(0.25) == 0.25)
    assert np.all(_fill(np.float32(-2)) == -2.0)
    c = ec.Constant(3)((5, 2))
    assert c.shape == (5, 2) and c.dtype == np.float32 and np.all(c == 3.0)
    z = ec.Zeros()((7,), np.float64)
    assert z.shape == (7,) and z.dtype == np.float64 and not z.any()
    assert ec.Constant(1.0) == ec.Constant(1) and hash(ec.Constant(1.0)) == hash(ec.Constant(1))
    assert ec.Constant(1.0) != ec.Constant(2.0)
    with pytest.raises(ValueError, match=r"1-D or 2-D"):
        ec.Zeros()((2, 2, 2))


def test_callable_initializer_fill_rows():
    def init(shape, dtype):
        return np.arange(np.prod(shape), dtype=dtype).reshape(shape)
    whole = _fill(init)
    assert np.array_equal(whole, np.arange(V * D, dtype=np.float32).reshape(V, D))
    assert np.array_equal(_fill(init, n_rows=5, first_row=10), whole[10:15])
    column = _fill(lambda shape, dtype: np.arange(shape[0], dtype=dtype))
    assert np.array_equal(column, np.repeat(np.arange(V, dtype=np.float32)[:, None], D, axis=1))
    with pytest.raises(ValueError, match=r"returned shape \(3, 3\), expected \(64, 4\)"):
        _fill(lambda shape, dtype: np.zeros((3, 3), dtype))


# ---------------------------------------------------------------------------------------------- engine

def _engine(tables, seed=0, stack_tables=True):
    """One pooled feature per table, keyed by table name."""
    return ec.Embedding({t.name: ec.FeatureConfig(t) for t in tables}, optimizer=ec.Adagrad(0.1), seed=seed,
                        stack_tables=stack_tables)


def test_engine_callable_initializer():
    t = ec.TableConfig(6, D, name="t", initializer=lambda shape, dtype: np.full(shape, 7.0, dtype) *
                       np.arange(shape[0], dtype=dtype)[:, None])
    e = _engine([t])
    assert np.array_equal(e.embedding_tables["t"], 7.0 * np.repeat(np.arange(6, dtype=np.float32)[:, None], D, 1))
    bad = ec.TableConfig(6, D, name="other", initializer=lambda shape, dtype: np.zeros((2, 2), dtype))
    with pytest.raises(ValueError, match=r"for other returned shape \(2, 2\), expected \(6, 4\)"):
        _engine([bad])


def test_engine_initializer_objects():
    e = _engine([ec.TableConfig(6, D, name="t", initializer=ec.RowId()),
                 ec.TableConfig(5, D, name="other", initializer=ec.Constant(0.5))])
    assert np.array_equal(e.embedding_tables["t"][:, 0], np.arange(6, dtype=np.float32))
    assert np.all(e.embedding_tables["other"] == 0.5)
    assert np.all(e.slot_variables["t"]["accumulators"] == np.float32(0.1))


def test_default_initializer_is_truncated_normal():
    dim = 16
    e = _engine([ec.TableConfig(6250, dim, name="t")])
    x = e.embedding_tables["t"]
    expected = _fill(ec.TruncatedNormal(0.0, 1.0 / np.sqrt(dim)), n_rows=6250, dim=dim, vocabulary_size=6250)
    assert np.array_equal(x, expected)
    x = x.astype(np.float64)
    assert x.size == 100_000
    assert np.all(np.abs(x) <= 2.0 / np.sqrt(dim) * (1 + 1e-6))
    assert abs(x.mean()) < 0.005
    assert abs(x.std() - 0.88 / np.sqrt(dim)) < 0.01


def test_engine_same_seed_same_tables_different_seed_different():
    def build(seed):
        return _engine([ec.TableConfig(20, D, name="t"), ec.TableConfig(30, D, name="other")], seed=seed)
    a, b, c = build(0), build(0), build(1)
    for name in ("t", "other"):
        assert np.array_equal(a.embedding_tables[name], b.embedding_tables[name])
        assert not np.array_equal(a.embedding_tables[name], c.embedding_tables[name])
    assert not np.array_equal(a.embedding_tables["t"][:20], a.embedding_tables["other"][:20])


def test_table_values_independent_of_other_tables_and_stacking():
    def tables(*names):
        sizes = {"t": 20, "other": 30, "ids": 25, "seq": 10}
        return [ec.TableConfig(sizes[n], D, name=n) for n in names]

    alone = _engine(tables("t"))
    reference = alone.embedding_tables["t"].copy()
    reference_slots = alone.slot_variables["t"]["accumulators"].copy()
    for names in [("ids", "t"), ("t", "other", "seq"), ("seq", "ids", "other", "t")]:
        for stack in (True, False):
            e = _engine(tables(*names), stack_tables=stack)
            assert e.num_physical_tables == (1 if stack else len(names))
            assert np.array_equal(e.embedding_tables["t"], reference), (names, stack)
            assert np.array_equal(e.slot_variables["t"]["accumulators"], reference_slots)
    stacked = _engine(tables("t", "other", "ids"))
    unstacked = _engine(tables("t", "other", "ids"), stack_tables=False)
    for name in ("t", "other", "ids"):
        assert np.array_equal(stacked.embedding_tables[name], unstacked.embedding_tables[name])


def test_random_keys_above_2_63_after_small_keys():
    """Found bug: stream keys are Python ints in [0, 2**64). Numba types a key < 2**63 as int64 and one above
    as uint64; once the int64 specialisation exists, a key >= 2**63 is forced through it and raises
    ``OverflowError: int too big to convert``. About half of all (seed, table name) pairs give such a key, so
    building an Embedding fails depending on the table names and on which table was initialised first in the
    process. Run in a fresh interpreter so the order is controlled."""
    script = textwrap.dedent("""
        import numpy as np
        import embedcore as ec
        from embedcore.initializers import stream_key
        out = np.empty((4, 4), np.float32)
        for init in (ec.TruncatedNormal(), ec.RandomUniform()):
            init.fill(out, 0, 5)
            init.fill(out, 0, 2**63 + 5)
        assert stream_key(0, "user") < 2**63 <= stream_key(0, "a")
        ec.Embedding({"a": ec.FeatureConfig(ec.TableConfig(8, 4, name="user")),
                      "b": ec.FeatureConfig(ec.TableConfig(8, 4, name="a"))}, optimizer=ec.SGD(0.1))
        print("OK")
    """)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("init", [ec.TruncatedNormal(0.0, 1.0), ec.RandomUniform(-1, 1), ec.RowId(0.5),
                                  ec.Constant(2.0), 0.25, lambda shape, dtype: np.arange(np.prod(shape),
                                                                                          dtype=dtype).reshape(shape)])
@pytest.mark.parametrize("first, stride", [(0, 1), (2, 3), (4, 5), (0, 7)])
def test_strided_rows_equal_the_whole_table(init, first, stride):
    """Every stride-th row from ``first`` (a shard of a table split over processes) equals the whole table's."""
    from embedcore.initializers import fill_rows
    whole = np.empty((23, 5), np.float32)
    fill_rows(init, whole, 0, 23, 11, "t")
    n = len(range(first, 23, stride))
    part = np.empty((n, 5), np.float32)
    fill_rows(init, part, first, 23, 11, "t", stride=stride)
    np.testing.assert_array_equal(part, whole[first::stride])


@pytest.mark.parametrize("init", [ec.TruncatedNormal(0.0, 0.3), ec.RandomUniform(-1.0, 2.0), ec.RowId(0.5)])
def test_key_rows_equal_whether_filled_on_one_thread_or_all(init):
    """Small fills run on the calling thread alone (``one_thread_below``): the same values as one large
    parallel fill of the same keys, row by row."""
    dim = 8
    keys = np.random.default_rng(4).integers(-2 ** 63, 2 ** 63, 2 * SMALL_WORK // dim, dtype=np.int64)
    whole = np.empty((keys.shape[0], dim), np.float32)
    fill_key_rows(init, whole, keys, 9, "t")
    if not isinstance(init, ec.RowId):  # the base class's route: fill() of row 0 under each key's own stream
        reference = np.empty_like(whole)
        with one_thread_below(0):   # a fill of one row per key: no thread team
            ec.Initializer.fill_keys(init, reference, keys.view(np.uint64), stream_key(9, "t"))
        np.testing.assert_array_equal(whole, reference)
    for lo in range(0, keys.shape[0], 7):   # 7 keys a fill: each below SMALL_WORK
        part = np.empty((min(7, keys.shape[0] - lo), dim), np.float32)
        fill_key_rows(init, part, keys[lo:lo + 7], 9, "t")
        np.testing.assert_array_equal(part, whole[lo:lo + 7])


def test_one_thread_below_restores_the_thread_count():
    before = numba.get_num_threads()
    with one_thread_below(10 ** 9):
        assert numba.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with one_thread_below(1):
            assert numba.get_num_threads() == 1
            raise RuntimeError("inside")
    assert numba.get_num_threads() == before
