"""Dynamic (hash-keyed) tables: configuration, and initial values by key written from the documented formulas."""

import numpy as np
import pytest

import embedcore as ec
from embedcore.initializers import fill_key_rows, stream_key

M = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
EXTREME = [0, -1, 1, 2 ** 63 - 1, -2 ** 63, 7, -7, 2 ** 62 + 7, 12345678901]
SEED = 5
LOW, HIGH = -0.5, 0.5


def mix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M
    return z ^ (z >> 31)


def uniform_row(key, seed, table, dim, low, high):
    """RandomUniform's initial row of ``key`` as the docstrings define it: row 0 of the stream
    ``mix64(mix64(key) ^ stream_key(seed, table))``, ``U = (mix64(k ^ mix64(counter * G + G)) >> 11) / 2**53``
    with ``counter = column << 8``."""
    k = mix64(mix64(key & M) ^ stream_key(seed, table))
    values = []
    for c in range(dim):
        u = (mix64(k ^ mix64(((c << 8) * GOLDEN + GOLDEN) & M)) >> 11) / 2 ** 53
        values.append(low + (high - low) * u)
    return np.float32(values).astype(np.float64)


# -- configuration ------------------------------------------------------------------------------------------
def test_config_validates_prints_and_is_exported():
    t = ec.DynamicTableConfig(16, 1000, name="user", optimizer=ec.Adagrad(0.05), combiner="sum",
                              admission=ec.CountAdmission(min_count=3), eviction=ec.LRU())
    assert isinstance(t, ec.TableConfig) and t.capacity == t.vocabulary_size == 1000 and t.dim == 16
    assert repr(t).startswith("DynamicTableConfig(dim=16, capacity=1000, name='user'")
    assert "admission=CountAdmission(min_count=3" in repr(t) and "eviction=LRU()" in repr(t)
    ec.FeatureConfig(t)
    for bad in (0, -1, 1.5, True, 2 ** 31, "9"):
        with pytest.raises(ValueError, match="DynamicTableConfig 'x': Argument `capacity`"):
            ec.DynamicTableConfig(4, bad, name="x")
    with pytest.raises(ValueError, match="DynamicTableConfig 'x': Argument `dim`"):
        ec.DynamicTableConfig(0, 10, name="x")
    with pytest.raises(ValueError, match="DynamicTableConfig 'x': Argument `combiner`"):
        ec.DynamicTableConfig(4, 10, name="x", combiner="max")
    with pytest.raises(ValueError, match="functions of the key"):
        ec.DynamicTableConfig(4, 10, name="x", initializer=lambda shape, dtype: np.zeros(shape, dtype))
    with pytest.raises(ValueError, match="`admission`"):
        ec.DynamicTableConfig(4, 10, admission=3)
    with pytest.raises(ValueError, match="`eviction`"):
        ec.DynamicTableConfig(4, 10, eviction="lru")
    with pytest.raises(ValueError, match="scores float32 rows"):
        ec.DynamicTableConfig(4, 10, eviction=ec.EvictByScore(lambda e, s, c, t: 0.0), weights_dtype="bfloat16")
    with pytest.raises(ValueError, match="not lazy"):
        ec.DynamicTableConfig(4, 10, optimizer=ec.Adam(0.1, lazy_adam=False))
    with pytest.raises(ValueError, match="weights_dtype"):
        ec.DynamicTableConfig(4, 10, weights_dtype="int8")


# -- initial values -----------------------------------------------------------------------------------------
KEYS = np.array(EXTREME + [3, 4, 5], np.int64)


@pytest.mark.parametrize("init", [ec.RandomUniform(-0.5, 0.5), ec.TruncatedNormal(0.1, 0.3),
                                  ec.RandomUniform(-1, 2, seed=9), ec.Constant(0.25)], ids=repr)
def test_key_rows_are_row_zero_of_each_keys_stream(init):
    """The one-pass kernels give what the generic per-key path (``Initializer.fill_keys``'s default) gives, which
    is the static fill of row 0 under the key's stream."""
    dim = 5
    fast = np.empty((KEYS.shape[0], dim), np.float32)
    fill_key_rows(init, fast, KEYS, 3, "t")
    slow = np.empty_like(fast)
    ec.Initializer.fill_keys(init, slow, KEYS.view(np.uint64), stream_key(getattr(init, "seed", None) or 3, "t"))
    np.testing.assert_array_equal(fast, slow)
    one = np.empty((1, dim), np.float32)
    for i, key in enumerate(KEYS):
        own = getattr(init, "seed", None)
        k = mix64(mix64(int(key) & M) ^ stream_key(3 if own is None else own, "t"))
        init.fill(one, 0, k)
        np.testing.assert_array_equal(fast[i], one[0])
    # ... and the order or company of keys changes nothing
    perm = np.random.default_rng(0).permutation(KEYS.shape[0])
    shuffled = np.empty_like(fast)
    fill_key_rows(init, shuffled, KEYS[perm], 3, "t")
    np.testing.assert_array_equal(shuffled, fast[perm])


def test_uniform_key_rows_match_the_documented_formula_and_row_id_gives_the_key():
    out = np.empty((KEYS.shape[0], 4), np.float32)
    fill_key_rows(ec.RandomUniform(LOW, HIGH), out, KEYS.view(np.uint64), SEED, "t")
    np.testing.assert_array_equal(out, np.stack([uniform_row(int(k), SEED, "t", 4, LOW, HIGH) for k in KEYS]))
    fill_key_rows(ec.RowId(0.5), out, KEYS, SEED, "t")
    np.testing.assert_array_equal(out, np.repeat(np.float32(KEYS.astype(np.float64) + 0.5)[:, None], 4, axis=1))
    other = np.empty_like(out)
    fill_key_rows(ec.RandomUniform(LOW, HIGH), other, KEYS, SEED, "u")  # another table: another stream
    assert not np.any(other == out)
