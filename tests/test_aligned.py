"""Aligned arrays (kernels/aligned.py): what they start on, and that the engine's arrays are made of them.

Tables of 256-byte rows that start mid-line spread every row over five cache lines instead of four; these
tests hold the engine's tables, slots, scratch arrays and activations to a 64-byte start. The engine's
arrays here are large enough that ``malloc`` serves them by ``mmap``, 16 bytes into a page, so an array
made by plain ``np.empty`` would fail them.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.kernels.aligned import CACHE_LINE, HUGE_MIN, HUGE_PAGE, aligned_empty, aligned_zeros, is_aligned
from embedcore.kernels.workspace import ArrayPool, Workspace


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 70), min_size=1, max_size=3),
       dtype=st.sampled_from([np.float32, np.float64, np.int64, np.int32, np.uint8]))
def test_aligned_empty_is_a_c_ordered_array_on_a_cache_line(shape, dtype):
    a = aligned_empty(tuple(shape), dtype)
    assert a.shape == tuple(shape) and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    assert is_aligned(a, CACHE_LINE)
    z = aligned_zeros(tuple(shape), dtype)
    assert z.shape == tuple(shape) and not z.any() and is_aligned(z)


def test_large_arrays_start_on_a_huge_page_and_own_their_memory():
    a = aligned_empty((HUGE_MIN // 4,), np.float32)
    assert is_aligned(a, HUGE_PAGE)
    a[:] = 1.0
    b = aligned_empty((HUGE_MIN // 4,), np.float32)
    b[:] = 2.0
    assert a[0] == 1.0 and a[-1] == 1.0  # separate memory
    assert aligned_empty(7, np.int64).shape == (7,)  # an int shape, as np.empty takes


def test_workspace_and_array_pool_hand_out_aligned_arrays():
    ws = Workspace()
    for n in (1, 5, 1000, 100_000, 300_000):  # grows, each time to a new buffer
        assert is_aligned(ws.array("x", (n, 3), np.float32))
    pool = ArrayPool(capacity=2)
    held = []
    for shape in [(5000, 64), (8000, 64), (5000, 64), (10, 3), (70_000, 64)]:  # pooled from 1 MB
        held.append(pool.empty(shape, np.float32))
        assert is_aligned(held[-1]) and held[-1].shape == shape
    held.clear()
    reused = pool.empty((5000, 64), np.float32)  # a pooled buffer, free again
    assert is_aligned(reused) and any(np.shares_memory(reused, b) for b in pool._buffers)


@pytest.mark.parametrize("optimizer", [ec.SGD(0.1), ec.Adagrad(0.1), ec.RowwiseAdagrad(0.1), ec.Adam(0.01)])
def test_engine_tables_slots_and_activations_start_on_a_cache_line(optimizer):
    tables = [ec.TableConfig(5000, 64, name="a"), ec.TableConfig(3000, 16, name="b")]
    emb = ec.Embedding({"f": ec.FeatureConfig(tables[0]), "g": ec.FeatureConfig(tables[1])}, optimizer)
    for group in emb._groups:
        assert is_aligned(group.weights)
        assert all(is_aligned(slot) for slot in group.slots)
    rng = np.random.default_rng(0)
    for _ in range(3):  # the later lookups reuse pooled activations
        features = {"f": rng.integers(0, 5000, (4096, 3)), "g": rng.integers(0, 3000, (4096, 2))}
        acts, ctx = emb.lookup(features)
        assert is_aligned(acts["f"]) and is_aligned(acts["g"])
        emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    for group in emb._groups:
        assert all(is_aligned(b) for b in group.workspace._buffers.values())
