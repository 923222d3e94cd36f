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


def test_workspace_grows_by_doubling_and_restarts_on_another_dtype():
    """Found bug: asking for a name in another dtype doubled its size each time, so a workspace whose rows
    alternate between int32 and int64 grew without bound (80 GiB after some thirty switches)."""
    ws = Workspace()
    assert ws.array("x", 1000, np.int64).shape == (1000,) and ws.nbytes == 8000
    ws.array("x", 1001, np.int64)
    assert ws._buffers["x"].shape == (2000,)  # outgrown: doubled
    for _ in range(40):
        for dtype in (np.int32, np.int64):
            x = ws.array("x", 1000, dtype)
            assert x.dtype == dtype and x.shape == (1000,)
    assert ws.nbytes == 8000  # the size asked for, each switch
    ws.array("x", (10, 2), np.int64)
    assert ws._buffers["x"].shape == (16, 2)  # another row shape: afresh, at least 16 rows


@pytest.mark.parametrize("optimizer", [ec.SGD(0.1), ec.Adagrad(0.1), ec.RowwiseAdagrad(0.1), ec.Adam(0.01)])
def test_engine_tables_slots_and_activations_start_on_a_cache_line(optimizer):
    tables = [ec.TableConfig(5000, 64, name="a"), ec.TableConfig(3000, 16, name="b")]
    emb = ec.Embedding({"f": ec.FeatureConfig(tables[0]), "g": ec.FeatureConfig(tables[1])}, optimizer)
    for group in emb.physical_tables:
        assert is_aligned(group.weights)
        assert all(is_aligned(slot) for slot in group.slots)
    rng = np.random.default_rng(0)
    for _ in range(3):  # the later lookups reuse pooled activations
        features = {"f": rng.integers(0, 5000, (4096, 3)), "g": rng.integers(0, 3000, (4096, 2))}
        acts, ctx = emb.lookup(features)
        assert is_aligned(acts["f"]) and is_aligned(acts["g"])
        emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    for group in emb.physical_tables:
        assert all(is_aligned(b) for b in group.workspace._buffers.values())
