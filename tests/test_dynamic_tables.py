"""Dynamic (hash-keyed) tables: configuration."""

import numpy as np
import pytest

import embedcore as ec


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
