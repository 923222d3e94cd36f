"""The dedup kernel against NumPy, and the compiler's decisions on functions that do or do not reduce."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import embedcore as ec
from embedcore.compiler import strip_del
from embedcore.kernels.dedup import unique_rows
from embedcore.kernels.rows import copy_row
from embedcore.split_reductions import sum_of_squares
from embedcore.kernels.workspace import Workspace


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2 ** 40), st.integers(0, 300), st.integers(0, 2 ** 32))
def test_unique_rows_matches_numpy(n_rows, n, seed):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, min(n_rows, max(1, n // 3 + 1)), n).astype(np.int64) * (n_rows // max(1, n // 3 + 1))
    rows = np.minimum(rows, n_rows - 1)
    uniq, ptr, order = unique_rows(rows, n_rows, Workspace())
    expected, counts = np.unique(rows, return_counts=True)
    np.testing.assert_array_equal(uniq, expected)
    np.testing.assert_array_equal(np.diff(ptr), counts)
    np.testing.assert_array_equal(order, np.argsort(rows, kind="stable"))


def test_workspace_grows_and_is_reused():
    ws = Workspace()
    a = ws.array("x", (10, 4), np.float32)
    b = ws.array("x", (5, 4), np.float32)
    assert b.base is a.base or b.base is a
    c = ws.array("x", (100, 4), np.float32)
    assert c.shape == (100, 4)


def with_del(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del slot_variables, hyperparameters
    return embedding_table - learning_rate * gradient


def test_strip_del_keeps_behaviour():
    stripped = strip_del(with_del)
    assert stripped is not with_del
    g, w = np.ones(3, np.float32), np.zeros(3, np.float32)
    np.testing.assert_array_equal(stripped(g, w, (), 0.5, ()), with_del(g, w, (), 0.5, ()))


def _row_fn(expr_kind):
    def mean_sq(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient * np.mean(gradient * gradient)

    def index(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient[0]

    def loop(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        out = embedding_table.copy()
        for j in range(gradient.shape[0]):
            out[j] -= learning_rate * gradient[j]
        return out

    def sum_attr(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient / gradient.size

    def where(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return np.where(gradient > 0, embedding_table - learning_rate * gradient, embedding_table)

    def branch(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        if hyperparameters[0] > 0:
            return embedding_table - learning_rate * np.abs(gradient)
        return embedding_table - learning_rate * gradient

    return {"mean": mean_sq, "index": index, "loop": loop, "size": sum_attr, "where": where, "branch": branch}[
        expr_kind]


@pytest.mark.parametrize("kind,elementwise", [("mean", False), ("index", False), ("loop", False), ("size", False),
                                              ("where", True), ("branch", True)])
def test_elementwise_decision_and_both_paths_match_numpy(kind, elementwise):
    fn = _row_fn(kind)
    opt = ec.CustomOptimizer(fn, learning_rate=0.1, hyperparameters=[1.0])
    compiled = opt.compiled(4)
    assert compiled.elementwise is elementwise, compiled.reason
    table = ec.TableConfig(6, 4, name=f"t_{kind}", combiner="sum", initializer=ec.RandomUniform(-1, 1))
    emb = ec.Embedding(ec.FeatureConfig(table), opt)
    before = emb.embedding_tables[table.name].astype(np.float64)
    acts, ctx = emb(np.array([1, 4, 4]))
    grad = np.random.default_rng(0).normal(size=acts.shape).astype(np.float32)
    emb.apply_gradients(grad, ctx)
    expected = before.copy()
    for row, g in ((1, grad[0]), (4, grad[1] + grad[2])):
        expected[row] = fn(g.astype(np.float64), before[row], (), 0.1, (1.0,))
    np.testing.assert_allclose(emb.embedding_tables[table.name], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_count_non_finite_serial_and_parallel(dtype):
    from embedcore.kernels import rows
    rng = np.random.default_rng(5)
    for n in (0, 1, 1000, rows.PARALLEL_MIN + 3):
        values = rng.standard_normal(n).astype(dtype)
        bad = rng.choice(n, size=min(n, 7), replace=False) if n else np.zeros(0, int)
        values[bad] = rng.choice([np.nan, np.inf, -np.inf], size=bad.size)
        expected = int((~np.isfinite(values)).sum())
        assert rows._count_non_finite_serial(values, np.uint16(0)) == expected
        assert rows._count_non_finite_parallel(values, np.uint16(0)) == expected
        assert rows.count_non_finite(values) == expected


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_count_and_counting_copy_of_every_gradient_dtype(dtype):
    """float16 is counted as its bits; the counting copy gives NumPy's float32 conversion, bit for bit, and
    the count, serially and in parallel, from contiguous and strided sources."""
    from embedcore.kernels import rows
    rng = np.random.default_rng(6)
    for n in (0, 3, rows.PARALLEL_MIN // 8 + 5):
        values = (rng.standard_normal((n, 8)) * 100).astype(dtype)
        flat = values.reshape(-1)
        bad = rng.choice(flat.size, size=min(flat.size, 9), replace=False) if n else np.zeros(0, int)
        flat[bad] = rng.choice([np.nan, np.inf, -np.inf], size=bad.size)
        expected = int((~np.isfinite(values)).sum())
        assert rows.count_non_finite(flat) == expected
        for src in (values, np.repeat(values, 2, axis=1)[:, ::2]):
            out = np.full((n, 8), 7.0, np.float32)
            assert rows.copy_counting_non_finite(src, out) == expected
            np.testing.assert_array_equal(out.view(np.uint32), src.astype(np.float32).view(np.uint32))


# -- grouped occurrences, weighted sums, prefetch -----------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2 ** 40), st.sampled_from([0, 1, 5, 300, 70_000]), st.integers(0, 2 ** 32),
       st.sampled_from([1, 2]), st.sampled_from([np.int32, np.int64]), st.booleans())
def test_group_rows_is_unique_rows_with_the_occurrences_in_grouped_order(n_rows, n, seed, threads, row_type,
                                                                         unit_gains):
    """Rows as int32 (a table batch's, below 2**31 rows) or int64, serial and parallel paths; payloads as
    packed words or (every gain 1) int32 activation rows."""
    import numba
    from embedcore.kernels.dedup import group_rows
    from embedcore.kernels.occurrences import pack_occurrences, packed_views, payload_views
    if row_type == np.int32:
        n_rows = min(n_rows, 2 ** 31)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, min(n_rows, max(1, n // 4 + 1)), n).astype(np.int64) * max(1, n_rows // (n // 4 + 1))
    rows = np.minimum(rows, n_rows - 1).astype(row_type)
    out_row = rng.integers(0, 2 ** 31 - 1, n)
    gains = rng.standard_normal(n).astype(np.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        if unit_gains:
            uniq, ptr, packed = group_rows(rows, n_rows, out_row.astype(np.int32), Workspace())
            assert packed.dtype == np.int32
            src_row, src_gain = payload_views(packed)
            assert src_gain is None
            src_gain = gains = np.ones(n, np.float32)
        else:
            uniq, ptr, packed = group_rows(rows, n_rows, pack_occurrences(out_row, gains), Workspace())
            src_row, src_gain = packed_views(packed)
        u2, p2, order2 = unique_rows(rows, n_rows, Workspace())
    finally:
        numba.set_num_threads(before)
    order = np.argsort(rows, kind="stable")
    np.testing.assert_array_equal(order2, order)
    np.testing.assert_array_equal(u2, uniq)
    np.testing.assert_array_equal(p2, ptr)
    expected, counts = np.unique(rows, return_counts=True)
    np.testing.assert_array_equal(uniq, expected)
    np.testing.assert_array_equal(np.diff(ptr), counts)
    np.testing.assert_array_equal(src_row, out_row[order])
    np.testing.assert_array_equal(src_gain.view(np.uint32), gains[order].view(np.uint32))


def _weighted_sum_reference(gains, sources):
    """rows.weighted_sum's documented order, in float32: groups of four as (t0 + t1) + (t2 + t3), then singles."""
    acc = np.zeros(sources.shape[1], np.float32)
    k = 0
    while k + 3 < len(gains):
        t = [np.float32(gains[k + i]) * sources[k + i] for i in range(4)]
        acc = acc + ((t[0] + t[1]) + (t[2] + t[3]))
        k += 4
    for i in range(k, len(gains)):
        acc = acc + np.float32(gains[i]) * sources[i]
    return acc


@pytest.mark.parametrize("per_bag", [0, 1, 3, 4, 9])
def test_lookup_sums_in_the_documented_order_bit_for_bit(per_bag):
    from embedcore.kernels.rows import gather_combine
    rng = np.random.default_rng(per_bag)
    table = rng.standard_normal((50, 5)).astype(np.float32)
    lengths = rng.integers(per_bag, per_bag + 3, 7) if per_bag else np.zeros(7, int)
    out_ptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    rows = rng.integers(0, 50, out_ptr[-1]).astype(np.int64)
    gains = rng.standard_normal(out_ptr[-1]).astype(np.float32)
    act = np.full((7, 5), np.nan, np.float32)
    gather_combine(table, rows, gains, out_ptr, act)
    for a in range(7):
        lo, hi = out_ptr[a], out_ptr[a + 1]
        np.testing.assert_array_equal(act[a], _weighted_sum_reference(gains[lo:hi], table[rows[lo:hi]]))


@pytest.mark.parametrize("dim", [16, 32, 48, 64, 128])
def test_kernels_compiled_for_a_row_length_compute_the_same_bits(dim):
    """Rows that fill whole cache lines get kernels compiled for their length; the lookup and the update
    they compute are bit-identical to the any-length kernels' (bags of 0-9 ids, duplicates, few rows)."""
    from embedcore.kernels.dedup import group_rows
    from embedcore.kernels.occurrences import pack_occurrences
    from embedcore.kernels.rows import ROWS_AHEAD, _gather_any_dim, fixed_length, gather_combine, gather_kernel
    from embedcore.kernels.update import fused_update_kernel
    assert fixed_length(dim)
    rng = np.random.default_rng(dim)
    n_rows, n_out = 40, 300
    table = rng.standard_normal((n_rows, dim)).astype(np.float32)
    out_ptr = np.concatenate(([0], np.cumsum(rng.integers(0, 10, n_out)))).astype(np.int64)
    rows = rng.integers(0, n_rows, out_ptr[-1]).astype(np.int64)
    gains = rng.standard_normal(out_ptr[-1]).astype(np.float32)
    fixed, unfetched, anyd, any_unfetched = (np.full((n_out, dim), np.nan, np.float32) for _ in range(4))
    gather_combine(table, rows, gains, out_ptr, fixed)
    gather_combine(table, rows, gains, out_ptr, unfetched, prefetch=False)
    _gather_any_dim(table, rows, gains, out_ptr, anyd, ROWS_AHEAD)
    _gather_any_dim(table, rows, gains, out_ptr, any_unfetched, 0)
    assert gather_kernel(dim, prefetch=False) is not gather_kernel(dim)
    for result in (unfetched, anyd, any_unfetched):
        np.testing.assert_array_equal(fixed, result)
    a = 17
    np.testing.assert_array_equal(fixed[a], _weighted_sum_reference(gains[out_ptr[a]:out_ptr[a + 1]],
                                                                    table[rows[out_ptr[a]:out_ptr[a + 1]]]))
    out_row = np.repeat(np.arange(n_out), np.diff(out_ptr))
    d_act = rng.standard_normal((n_out, dim)).astype(np.float32)
    for optimizer in (ec.SGD(0.5), ec.Adagrad(0.5), ec.RowwiseAdagrad(0.5)):
        function = optimizer.compiled(dim)
        results = []
        for kernel in (fused_update_kernel(function, dim=dim), fused_update_kernel(function)):
            uniq, ptr, packed = group_rows(rows, n_rows, pack_occurrences(out_row, gains), Workspace())
            t = table.copy()
            slots = tuple(np.full((n_rows, dim) if d == 2 else n_rows, 0.1, np.float32) for d in optimizer.slot_dims)
            lr, hyper = optimizer.step_values(1)
            assert kernel(t, slots, uniq, ptr, packed, d_act, lr, hyper, np.zeros(uniq.shape[0], np.uint8)) == 0
            results.append((t, slots))
        assert fused_update_kernel(function, dim=dim) is not fused_update_kernel(function)
        np.testing.assert_array_equal(results[0][0], results[1][0])
        for s0, s1 in zip(results[0][1], results[1][1]):
            np.testing.assert_array_equal(s0, s1)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([16, 32, 48, 64, 128]), st.integers(1, 6), st.lists(st.integers(0, 11), min_size=1, max_size=12),
       st.sampled_from([np.int32, np.int64]), st.sampled_from(["array", "packed", "none"]), st.booleans(),
       st.integers(0, 2 ** 32))
def test_sums_in_registers_are_the_in_memory_sums_bit_for_bit(dim, n_rows, lengths, row_type, gain_kind,
                                                              prefetch, seed):
    """The gather compiled for a row length sums each bag in vector registers (kernels/row_vector.py): the
    same bits as the in-memory sum of the any-length kernel and as the documented order, for empty bags,
    bags of 1-11 ids (groups of four and the rest), few distinct rows (duplicates), zero, negative and -0.0
    gains, int32 or int64 rows, gains as an array, read as a strided view of the packed occurrences, or None
    (every gain 1: the sums of gains of 1); each bag's row is written whole and nothing else."""
    from embedcore.kernels.occurrences import pack_occurrences, packed_views
    from embedcore.kernels.rows import ROWS_AHEAD, _gather_any_dim, gather_kernel
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((n_rows, dim)).astype(np.float32)
    table[rng.random(table.shape) < 0.05] = -0.0
    out_ptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    n = int(out_ptr[-1])
    rows = rng.integers(0, n_rows, n).astype(row_type)
    gains = rng.choice(np.array([0.0, -0.0, 1.0, -2.5, 0.3], np.float32), n)
    if gain_kind == "packed":
        gains = packed_views(pack_occurrences(np.zeros(n, np.int64), gains))[1]
        assert n <= 1 or not gains.flags.c_contiguous  # one value: any view is contiguous
    reference_gains = np.ones(n, np.float32) if gain_kind == "none" else gains
    gains = None if gain_kind == "none" else gains
    fixed = np.full((len(lengths) + 1, dim), np.nan, np.float32)  # one row more: never written
    any_length = np.full((len(lengths), dim), np.nan, np.float32)
    gather_kernel(dim, prefetch)(table, rows, gains, out_ptr, fixed[:-1])
    _gather_any_dim(table, rows, gains, out_ptr, any_length, ROWS_AHEAD if prefetch else 0)
    np.testing.assert_array_equal(fixed[:-1].view(np.int32), any_length.view(np.int32))
    assert np.isnan(fixed[-1]).all()
    for a in range(len(lengths)):
        lo, hi = out_ptr[a], out_ptr[a + 1]
        np.testing.assert_array_equal(fixed[a], _weighted_sum_reference(reference_gains[lo:hi],
                                                                        table[rows[lo:hi]]))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["float32", "float16", "bfloat16"]), st.sampled_from([16, 64, 128]), st.integers(1, 6),
       st.lists(st.integers(0, 11), min_size=1, max_size=2100), st.booleans(), st.booleans(), st.integers(0, 2 ** 32))
def test_streaming_gather_writes_the_bits_the_gather_writes(stored, dim, n_rows, lengths, with_gains, prefetch,
                                                            seed):
    """The gather that stores activations past the caches (chunks of ``STREAM_CHUNK`` rows, each fenced)
    writes the same bits as the gather through the caches, for float32 rows and any bits of 16-bit rows
    (NaN, infinities, -0.0), empty bags, bags across chunk ends, gains or none; it writes every activation
    row and nothing past them."""
    from embedcore.kernels.aligned import aligned_empty
    from embedcore.kernels.rows import can_stream, gather_16_kernel, gather_kernel, streaming_gather_kernel
    rng = np.random.default_rng(seed)
    if stored == "float32":
        table = rng.standard_normal((n_rows, dim)).astype(np.float32)
        table[rng.random(table.shape) < 0.05] = -0.0
    else:
        table = rng.integers(0, 1 << 16, (n_rows, dim), dtype=np.uint64).astype(np.uint16)
    out_ptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    n = int(out_ptr[-1])
    rows = rng.integers(0, n_rows, n).astype(np.int64)
    gains = rng.standard_normal(n).astype(np.float32) if with_gains else None
    ahead = 16 if prefetch else 0
    streamed = aligned_empty((len(lengths) + 1, dim), np.float32)
    streamed[:] = np.nan
    assert can_stream(table, streamed[:-1])
    streaming_gather_kernel(stored, dim)(table, rows, gains, out_ptr, streamed[:-1], ahead)
    through = np.empty((len(lengths), dim), np.float32)
    if stored == "float32":
        gather_kernel(dim, prefetch)(table, rows, gains, out_ptr, through)
    else:
        gather_16_kernel(stored, dim)(table, rows, gains, out_ptr, through, ahead)
    np.testing.assert_array_equal(streamed[:-1].view(np.uint32), through.view(np.uint32))
    assert np.isnan(streamed[-1]).all()


def test_activations_that_cannot_be_streamed_are_gathered_through_the_caches():
    """``gather_combine`` streams only activations starting on a cache line, rows of whole lines; other
    arrays take the gather through the caches, with the same sums."""
    from embedcore.kernels.aligned import aligned_empty
    from embedcore.kernels.rows import can_stream, gather_combine
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, 32)).astype(np.float32)
    rows, out_ptr = rng.integers(0, 50, 300), np.arange(0, 301, 3)
    aligned = aligned_empty((100, 32), np.float32)
    shifted = aligned_empty(100 * 32 + 1, np.float32)[1:].reshape(100, 32)  # 4 bytes past a line
    assert can_stream(table, aligned) and not can_stream(table, shifted)
    assert not can_stream(table[:, :20], aligned_empty((100, 20), np.float32))
    gather_combine(table, rows, None, out_ptr, aligned, stream=True)
    gather_combine(table, rows, None, out_ptr, shifted, stream=True)
    np.testing.assert_array_equal(aligned, shifted)
    np.testing.assert_array_equal(aligned, table[rows].reshape(100, 3, 32).sum(axis=1, dtype=np.float32))


def test_sums_over_rows_that_are_not_contiguous_are_summed_in_memory():
    """A kernel compiled for a row length, given a table whose rows are not C-contiguous (a strided view),
    takes the in-memory sum (its register loads assume contiguous rows) and computes the same values; so
    do float64 gains."""
    from embedcore.kernels.rows import gather_kernel
    rng = np.random.default_rng(1)
    base = rng.standard_normal((20, 32)).astype(np.float32)
    table = base[::2]
    out_ptr = np.array([0, 5, 5, 6], np.int64)
    rows = rng.integers(0, 10, 6).astype(np.int64)
    gains = rng.standard_normal(6).astype(np.float32)
    act = np.zeros((3, 32), np.float32)
    gather_kernel(32)(table, rows, gains, out_ptr, act)
    for a in range(3):
        lo, hi = out_ptr[a], out_ptr[a + 1]
        np.testing.assert_array_equal(act[a], _weighted_sum_reference(gains[lo:hi], table[rows[lo:hi]]))
    wide_gains = np.zeros((3, 32), np.float32)  # float64 gains too take the in-memory sum
    gather_kernel(32)(np.ascontiguousarray(table), rows, gains.astype(np.float64), out_ptr, wide_gains)
    for a in range(3):  # products in float64, each partial sum rounded to float32: close to the float64 sum
        lo, hi = out_ptr[a], out_ptr[a + 1]
        exact = gains[lo:hi].astype(np.float64) @ table[rows[lo:hi]].astype(np.float64)
        np.testing.assert_allclose(wide_gains[a], exact, rtol=1e-5, atol=1e-6)


def test_a_kernel_compiled_for_one_row_length_refuses_other_rows():
    from embedcore.kernels.rows import fixed_length, gather_kernel
    from embedcore.kernels.update import fused_update_kernel
    assert [d for d in range(0, 70) if fixed_length(d)] == [16, 32, 48, 64]
    table, act = np.zeros((4, 32), np.float32), np.zeros((1, 32), np.float32)
    with pytest.raises(ValueError, match="rows of 16 values"):
        gather_kernel(16)(table, np.zeros(1, np.int64), np.ones(1, np.float32), np.array([0, 1]), act)
    with pytest.raises(ValueError, match="no gather is compiled for rows of 20 values"):
        gather_kernel(20)  # not whole cache lines: gather_combine uses the any-length kernel
    kernel = fused_update_kernel(ec.SGD(0.1).compiled(16), dim=16)
    with pytest.raises(ValueError, match="rows of 16 values"):
        kernel(table, (), np.zeros(1, np.int64), np.array([0, 1]), np.zeros(1, np.int64), act, np.float32(0.1), (),
               np.zeros(1, np.uint8))


def test_sharded_sums_equal_the_gradient_the_fused_update_applies():
    """sum_gradients (what a rank sends a row's owner) is bit-identical to the fused kernel's own sum:
    SGD with learning rate 1 on a zero table writes exactly -gradient."""
    from embedcore.kernels.dedup import group_rows, unique_rows
    from embedcore.kernels.occurrences import pack_occurrences
    from embedcore.kernels.rows import sum_gradients
    from embedcore.kernels.update import fused_update_kernel
    rng = np.random.default_rng(3)
    n, n_rows, n_out, dim = 5000, 300, 900, 6
    rows = rng.integers(0, n_rows, n).astype(np.int64)
    out_row = np.sort(rng.integers(0, n_out, n)).astype(np.int64)
    gains = rng.standard_normal(n).astype(np.float32)
    d_act = rng.standard_normal((n_out, dim)).astype(np.float32)
    uniq, ptr, order = [a.copy() for a in unique_rows(rows, n_rows, Workspace())]
    sums = np.empty((uniq.shape[0], dim), np.float32)
    sum_gradients(sums, ptr, order, out_row, gains, d_act)
    sgd = ec.CustomOptimizer(lambda gradient, embedding_table, slot_variables, learning_rate, hyperparameters:
                             embedding_table - learning_rate * gradient, learning_rate=1.0)
    table = np.zeros((n_rows, dim), np.float32)
    u2, p2, packed = group_rows(rows, n_rows, pack_occurrences(out_row, gains), Workspace())
    kernel = fused_update_kernel(sgd.compiled(dim))
    assert kernel(table, (), u2, p2, packed, d_act, np.float32(1.0), (), np.zeros(u2.shape[0], np.uint8)) == 0
    np.testing.assert_array_equal(table[uniq], -sums)


def test_rows_stay_cached_needs_reuse_and_a_small_set_of_rows():
    from embedcore.kernels.prefetch import CACHED_BYTES_MAX, REUSE_MIN, rows_stay_cached
    fit = CACHED_BYTES_MAX // 256  # distinct 256-byte rows that fit
    assert rows_stay_cached(REUSE_MIN * 100, 100, 256)
    assert not rows_stay_cached(REUSE_MIN * 100 - 1, 100, 256)      # a little less reuse
    assert rows_stay_cached(REUSE_MIN * fit, fit, 256)
    assert not rows_stay_cached(REUSE_MIN * (fit + 1), fit + 1, 256)  # one row more than fits
    assert not rows_stay_cached(0, 0, 256)


@pytest.mark.parametrize("dim", [16, 5])  # a kernel compiled for the row length, and the any-length kernel
def test_lookup_prefetches_unless_the_last_update_saw_a_hot_set_of_rows(dim, monkeypatch):
    """apply_gradients judges from its batch whether the next lookup's rows will be cached; the lookup then
    skips the prefetch. The activations are the same either way (against a NumPy gather)."""
    from embedcore.tables import storage
    seen = []
    real = storage.gather_combine

    def recording(*args):
        seen.append(args[5])  # prefetch
        return real(*args)
    monkeypatch.setattr(storage, "gather_combine", recording)
    table = ec.TableConfig(50_000, dim, name="t", combiner="sum", initializer=ec.RandomUniform(-1, 1))
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.0))
    weights = emb.embedding_tables["t"]
    rng = np.random.default_rng(dim)
    hot = rng.choice(rng.integers(0, 50_000, 7), (300, 4))   # 1,200 ids from 7 rows: each read ~170 times
    spread = rng.permutation(50_000)[:1200].reshape(300, 4)  # every row once
    for ids, then_prefetch in ((hot, False), (hot, False), (spread, True), (hot, False)):
        acts, ctx = emb({"f": ids})
        np.testing.assert_allclose(acts["f"], weights[ids].astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-6)
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
        assert emb.physical_tables[0].prefetches_rows is then_prefetch
    assert seen == [True, False, False, True]  # the first lookup has seen no batch yet


def test_prefetch_changes_no_value():
    from numba import njit
    from embedcore.kernels.prefetch import prefetch_row

    @njit
    def touch(a, b, idx):
        total = 0.0
        for i in range(idx.shape[0]):
            prefetch_row(a, idx[i])
            prefetch_row(b, idx[i])
            total += a[idx[i], 0] + b[idx[i]]
        return total

    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    b = np.arange(10, dtype=np.float64)
    before = (a.copy(), b.copy())
    idx = np.array([9, 0, 3, 3])
    assert touch(a, b, idx) == float(a[idx, 0].sum() + b[idx].sum())
    np.testing.assert_array_equal(a, before[0])
    np.testing.assert_array_equal(b, before[1])


@pytest.mark.parametrize("dim", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("n_distinct", [1, 3, 4, 5, 300])
def test_update_matches_numpy_around_the_prefetch_distance(dim, n_distinct):
    """The update reads the rows ROWS_AHEAD (4) unique rows ahead of the current one: batches with fewer,
    exactly as many and more distinct rows than that, of narrow and wide rows, update exactly the rows the
    NumPy reference does (Adagrad: a full-row slot; row-wise Adagrad: a one-value slot)."""
    from . import reference as ref

    rng = np.random.default_rng(dim * 1000 + n_distinct)
    vocab = 2 * n_distinct + 3
    rows = np.sort(rng.choice(vocab, n_distinct, replace=False))
    samples = [[int(r)] for r in rng.permutation(np.concatenate([rows, rng.choice(rows, n_distinct)]))]
    d_act = rng.standard_normal((len(samples), dim)).astype(np.float32)
    for optimizer, update, slot in ((ec.Adagrad(0.3), ref.adagrad, "accumulators"),
                                    (ec.RowwiseAdagrad(0.3), ref.rowwise_adagrad, "accumulators")):
        table = ec.TableConfig(vocab, dim, name="t", initializer=ec.RandomUniform(-1, 1, seed=dim))
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, optimizer)
        before = emb.embedding_tables["t"].copy()
        slots_before = emb.slot_variables["t"][slot].copy()
        acts, ctx = emb({"f": ec.Ragged.from_lists(samples)})
        emb.apply_gradients({"f": d_act}, ctx)
        gradient = ref.dense_gradient(vocab, dim, samples, [[1.0]] * len(samples), "sum", 0, d_act.astype(np.float64))
        touched = ref.touched_rows(vocab, samples, 0)
        want, want_slots = ref.apply(update, gradient, before, [slots_before], touched, 0.3, {}, 1)
        np.testing.assert_allclose(emb.embedding_tables["t"], want, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(emb.slot_variables["t"][slot], want_slots[0], rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(emb.embedding_tables["t"][~touched], before[~touched])


@pytest.mark.parametrize("combiner", ["mean", "sum"])
def test_update_kernels_compile_when_the_engine_is_built(combiner):
    """The kernel is compiled for the engine's argument types at construction: apply_gradients never
    compiles (and never fails to compile after updating some tables), whatever the batch size; for batches
    without weights, packed words for a mean table, activation rows alone for a sum table."""
    from embedcore.kernels.update import fused_update_kernel

    def scaled(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - 0.5 * learning_rate * gradient

    a = ec.TableConfig(10, 4, name="a", optimizer=ec.Adam(0.1, lazy_adam=False), combiner=combiner)
    b = ec.TableConfig(10, 16, name="b", optimizer=ec.CustomOptimizer(scaled, 0.1),  # a kernel for its length
                       combiner=combiner)
    emb = ec.Embedding({"fa": ec.FeatureConfig(a), "fb": ec.FeatureConfig(b)})
    kernels = [fused_update_kernel(g.row_function, g.optimizer.lazy, g.dim) for g in emb.physical_tables]
    compiled = [len(k.signatures) for k in kernels]
    assert all(n >= 1 for n in compiled)
    for ids in (np.array([], np.int64), np.array([3]), np.array([1, 2, 2, 9])):  # 0, 1 and more occurrences
        acts, ctx = emb({"fa": ids, "fb": ids})
        emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    assert [len(k.signatures) for k in kernels] == compiled


def test_a_function_returning_complex_numbers_is_refused_at_construction():
    def complex_step(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient * 1j

    table = ec.TableConfig(4, 2, name="c", optimizer=ec.CustomOptimizer(complex_step, 1.0))
    with pytest.raises(ec.RowFunctionError, match="complex_step: the new row must hold real numbers"):
        ec.Embedding({"f": ec.FeatureConfig(table)})


@pytest.mark.parametrize("n_rows, spread", [(1, 1), (5_000_000, 1), (2_000, 2_000), (3_000_000, 3_000_000),
                                            (2 ** 31, 2 ** 31)])
@pytest.mark.parametrize("row_type", [np.int32, np.int64])
def test_parallel_sort_with_no_one_or_several_passes(n_rows, spread, row_type):
    """The parallel word sort when every digit is constant (no pass), one digit varies, or several do, on
    int32 rows (up to 2**31 - 1: the word's row half) and int64 rows."""
    import numba
    from embedcore.kernels.dedup import PARALLEL_MIN, group_rows
    rng = np.random.default_rng(n_rows)
    n = PARALLEL_MIN + 17
    rows = np.minimum(n_rows - 1, rng.integers(0, spread, n) + (n_rows - spread)).astype(row_type)
    packed = rng.integers(-2 ** 62, 2 ** 62, n)
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        uniq, ptr, sorted_packed = group_rows(rows, n_rows, packed, Workspace())
        u2, p2, order = unique_rows(rows, n_rows, Workspace())
    finally:
        numba.set_num_threads(before)
    expected_order = np.argsort(rows, kind="stable")
    np.testing.assert_array_equal(uniq, np.unique(rows))
    np.testing.assert_array_equal(u2, uniq)
    np.testing.assert_array_equal(p2, ptr)
    np.testing.assert_array_equal(order, expected_order)
    np.testing.assert_array_equal(sorted_packed, packed[expected_order])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.sampled_from([1, 2, 3, 10, 1_000, 10 ** 6]), st.integers(1, 9), st.integers(0, 2 ** 32))
def test_runs_of_sorted_words_split_among_parts(n, vocabulary, n_parts, seed):
    """The unique rows and run offsets of sorted words, found in parallel parts, are NumPy's, whether runs
    cross the parts' edges, a part holds no run start, or there are more parts than words."""
    from embedcore.kernels.dedup import _group_words
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.integers(0, vocabulary, n)).astype(np.int64)
    words = (rows << 32) | np.arange(n, dtype=np.int64)
    uniq = np.full(n, -7, np.int64)
    ptr = np.full(n + 1, -7, np.int64)
    n_unique = _group_words(words, uniq, ptr, n_parts)
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if n else np.zeros(0, np.int64)
    assert n_unique == starts.shape[0]
    np.testing.assert_array_equal(uniq[:n_unique], rows[starts])
    np.testing.assert_array_equal(ptr[:n_unique + 1], np.r_[starts, n])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3_000), st.integers(1, 5_000), st.sampled_from([1, 3, 40, 10 ** 6])),
                min_size=1, max_size=9), st.integers(0, 2 ** 32), st.sampled_from([np.int32, np.int64]),
       st.sampled_from([np.int32, np.int64]))
def test_grouping_block_by_block_equals_the_global_sort(spec, seed, row_type, payload_type):
    """Blocks of disjoint, increasing row ranges grouped one by one (hashed, or sorted once a block holds
    too many distinct rows, or empty) give exactly the global sort's unique rows, offsets and payloads,
    for int32 and int64 rows, and payloads of packed words (int64) or activation rows (int32)."""
    from embedcore.kernels import dedup
    rng = np.random.default_rng(seed)
    parts, starts, base = [], [0], 0
    for size, vocabulary, distinct in spec:
        ids = rng.integers(0, min(vocabulary, distinct), size) * max(1, vocabulary // distinct) % vocabulary
        parts.append(base + ids)
        starts.append(starts[-1] + size)
        base += vocabulary
    rows = np.concatenate(parts).astype(row_type)
    blocks = np.array(starts, np.int64)
    packed = rng.integers(np.iinfo(payload_type).min, np.iinfo(payload_type).max, rows.shape[0], payload_type)
    expected = dedup._sort(rows.astype(np.int64), base, packed, False, Workspace())
    assert expected[2].dtype == payload_type
    workspace = Workspace()
    for _ in range(2):  # a second call reuses the workspace's tables
        got = dedup.group_by_blocks(rows, base, packed, blocks, workspace)[:3]
        assert got[2].dtype == payload_type
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(g, e)
    order = np.argsort(rows, kind="stable")
    np.testing.assert_array_equal(got[2], packed[order])
    np.testing.assert_array_equal(got[0], np.unique(rows))


def test_group_rows_takes_the_block_path_only_where_it_pays():
    from embedcore.kernels import dedup
    n = dedup.PARALLEL_MIN
    assert dedup.blocks_worth_it(np.arange(9, dtype=np.int64) * (n // 8), n, 2)
    assert not dedup.blocks_worth_it(np.arange(9, dtype=np.int64) * (n // 8), n, 1)  # one thread
    assert not dedup.blocks_worth_it(np.array([0, n], np.int64), n, 2)  # one block: nothing in parallel
    assert not dedup.blocks_worth_it(np.array([0, 10, n], np.int64), n, 2)  # one block holds nearly all
    assert not dedup.blocks_worth_it(np.array([0, 10, 20], np.int64), 20, 2)  # too small to be parallel
    assert not dedup.blocks_worth_it(None, n, 2)


def test_table_batches_mark_blocks_of_disjoint_row_ranges():
    from embedcore import inputs
    def part(ids, row_offset, vocabulary, out_offset):
        batch = inputs.to_feature_batch(np.array(ids, np.int64), None, "f", vocabulary)
        return batch, "sum", 0, row_offset, out_offset, vocabulary
    tb = inputs.build_table_batch([part([1, 2], 0, 10, 0), part([3], 0, 10, 2), part([4, 5, 6], 10, 7, 3)])
    np.testing.assert_array_equal(tb.blocks, [0, 3, 6])  # two features of one table share a block
    tb = inputs.build_table_batch([part([1], 10, 7, 0), part([3], 0, 10, 1)])
    assert tb.blocks is None  # row ranges decreasing: the global sort
    tb = inputs.build_table_batch([part([1], 0, 10, 0), part([3], 10, 7, 1), part([2], 0, 10, 2)])
    assert tb.blocks is None  # a table's features apart


def test_table_batch_rows_are_int32_below_2_31_rows_and_int64_from_there():
    """Physical rows take 4 bytes while the batch's row ranges end at or below 2**31, else 8; the rows are
    the same either way (a stacked table's offset pushing the last feature's rows past 2**31 - 1)."""
    from embedcore import inputs
    def part(ids, row_offset, vocabulary, out_offset):
        batch = inputs.to_feature_batch(np.array(ids, np.int64), None, "f", vocabulary)
        return batch, "sum", 0, row_offset, out_offset, vocabulary
    tb = inputs.build_table_batch([part([0, 5], 0, 10, 0), part([2 ** 31 - 11], 10, 2 ** 31 - 10, 2)])
    assert tb.rows.dtype == np.int32 and tb.rows.tolist() == [0, 5, 2 ** 31 - 1]
    tb = inputs.build_table_batch([part([0, 5], 0, 10, 0), part([2 ** 31 - 10], 10, 2 ** 31 - 9, 2)])
    assert tb.rows.dtype == np.int64 and tb.rows.tolist() == [0, 5, 2 ** 31]
    workspace = Workspace()  # one workspace, both kinds in turn
    for vocabulary in (2 ** 31 - 10, 2 ** 31, 2 ** 31 - 10):
        tb = inputs.build_table_batch([part([0, 5], 0, 10, 0), part([7], 10, vocabulary, 2)], workspace)
        assert tb.rows.tolist() == [0, 5, 17]
        assert tb.rows.dtype == (np.int64 if vocabulary == 2 ** 31 else np.int32)


def _train_both_ways(monkeypatch, features, steps):
    """Train one engine with the block path allowed and one with it refused, on the same ``steps`` (a list
    of ``(ids, weights or None, gradients)``), with 2 threads; returns each engine's tables and
    accumulators after every step, whether the block path was open on every call, and what each attempt of
    the first engine to sum by blocks gave (True: sums, False: None, the batch grouped instead; a call
    that waits after a refused block does not try)."""
    import numba
    from embedcore.kernels import dedup
    results, calls, summed = [], [], []
    sum_blocks = dedup.sum_blocks

    def recorded(*args):
        got = sum_blocks(*args)
        summed.append(got is not None)
        return got
    monkeypatch.setattr(dedup, "sum_blocks", recorded)

    def state(emb):
        return ({k: v.copy() for k, v in emb.embedding_tables.items()},
                {k: s["accumulators"].copy() for k, s in emb.slot_variables.items()})
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        original = dedup.blocks_worth_it
        for blocks in (True, False):
            monkeypatch.setattr(dedup, "blocks_worth_it",
                                lambda *a, blocks=blocks: calls.append(original(*a)) or (blocks and calls[-1]))
            emb = ec.Embedding(features, ec.Adagrad(0.1))
            assert emb.num_physical_tables == 1
            states = [state(emb)]
            for ids, weights, grads in steps:
                _, ctx = emb.lookup(ids, weights)
                emb.apply_gradients(grads, ctx)
                states.append(state(emb))
            results.append(states)
            if blocks:
                first_engine = list(summed)
    finally:
        numba.set_num_threads(before)
    for blocks_state, sort_state in zip(results[0][1:], results[1][1:]):
        for by_blocks, by_sort in zip(blocks_state, sort_state):
            for name in by_blocks:
                np.testing.assert_array_equal(by_blocks[name], by_sort[name], err_msg=name)
    return results[0], bool(calls) and all(calls), first_engine


def test_stacked_tables_train_the_same_whichever_way_occurrences_are_grouped(monkeypatch):
    """An engine step over stacked tables large enough for the block path equals, bit for bit, the same
    step grouped by the global sort (and both match the dense oracle)."""
    rng = np.random.default_rng(11)
    vocabularies = [5_000, 300, 20_000, 7]
    features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(v, 8, combiner="sum", name=f"t{t}",
                                                        initializer=ec.RandomUniform(-1, 1, seed=t)))
                for t, v in enumerate(vocabularies)}
    # few enough distinct rows per table for every block to be hashed (at most 1/32 of its occurrences)
    batch = {f"f{t}": ec.Ragged(rng.zipf(1.8, 20_000) % v if v > 1_000 else rng.integers(0, v, 20_000),
                                np.arange(0, 20_001, 10)) for t, v in enumerate(vocabularies)}
    grads = {f"f{t}": rng.standard_normal((2_000, 8)).astype(np.float32) for t in range(4)}
    states, blocks_open, summed = _train_both_ways(monkeypatch, features, [(batch, None, grads)])
    assert blocks_open and summed == [True]  # the first engine summed by blocks, the second could have
    (start, _), (tables, _) = states
    for t, v in enumerate(vocabularies):  # the dense oracle: Adagrad on the summed gradient of every row
        ids = batch[f"f{t}"].values
        grad = np.zeros((v, 8))
        np.add.at(grad, ids, np.repeat(grads[f"f{t}"].astype(np.float64), 10, axis=0))
        acc = 0.1 + grad ** 2
        expected = start[f"t{t}"] - 0.1 * grad / np.sqrt(acc)
        np.testing.assert_allclose(tables[f"t{t}"], expected, rtol=1e-4, atol=1e-5)


def test_stacked_tables_with_gains_and_sequences_train_the_same_whichever_way_grouped(monkeypatch):
    """The block path with packed payloads: weighted mean and sqrtn tables (zero weights among them), a
    sequence feature, and two features sharing one table's block, over three steps, one of which holds a
    block of too many distinct rows (it is grouped instead, and later calls wait): bit for bit the
    global sort's tables and accumulators."""
    from embedcore.kernels import dedup
    rng = np.random.default_rng(3)
    tables = [ec.TableConfig(v, 6, combiner=c, name=f"t{t}", initializer=ec.RandomUniform(-1, 1, seed=t))
              for t, (v, c) in enumerate([(400, "mean"), (9, "sqrtn"), (3_000, "sum"), (60_000, "sum")])]
    features = {"mean": ec.FeatureConfig(tables[0]), "sqrtn": ec.FeatureConfig(tables[1]),
                "seq": ec.FeatureConfig(tables[2], max_sequence_length=4),
                "shared_a": ec.FeatureConfig(tables[3]), "shared_b": ec.FeatureConfig(tables[3])}
    n_bags = 2_500

    def step(spread):
        """Zipf ids (few enough distinct rows to hash each block), but ``spread``: uniform ids over the
        shared table for "shared_b", more distinct rows than its block may hash."""
        ids, weights, grads = {}, {}, {}
        for name, feature in features.items():
            lengths = rng.integers(0, 12, n_bags)
            splits = np.concatenate(([0], np.cumsum(lengths)))
            vocabulary = feature.table.vocabulary_size
            values = rng.integers(0, vocabulary, splits[-1]) if spread and name == "shared_b" else \
                rng.zipf(1.8, splits[-1]) % vocabulary
            ids[name] = ec.Ragged(values, splits)
            w = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), splits[-1])
            weights[name] = ec.Ragged(w, splits)
            shape = (n_bags, feature.max_sequence_length, 6) if feature.max_sequence_length else (n_bags, 6)
            grads[name] = rng.standard_normal(shape).astype(np.float32)
        return ids, weights, grads
    steps = [step(False), step(True), step(False)]
    monkeypatch.setattr(dedup, "PARALLEL_MIN", 0)
    states, blocks_open, summed = _train_both_ways(monkeypatch, features, steps)
    assert blocks_open and summed == [True, False]  # after the refused block, the next calls wait (sort)
    for (before, _), (after, _) in zip(states, states[1:]):
        assert any(not np.array_equal(before[k], after[k]) for k in after)  # every step trained


def test_malformed_batches_are_refused_before_any_block_is_summed():
    """sum_by_blocks (whose kernels subscript without bounds checks) refuses, as group_rows does, blocks that
    do not end at the last occurrence, out_ptr that does not, a payload of another length, gradients that do
    not hold out_ptr's activation rows, and a bag that straddles two blocks; a well-formed batch sums."""
    import numba
    from embedcore.kernels import dedup
    n = 40_000
    rows = np.concatenate([np.arange(n) % 10, 100 + np.arange(n) % 10]).astype(np.int32)
    out_ptr = np.arange(2 * n + 1, dtype=np.int64)
    d_act = np.ones((2 * n, 1), np.float32)
    blocks = np.array([0, n, 2 * n], np.int64)
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        if numba.get_num_threads() < 2:
            assert dedup.sum_by_blocks(rows, 110, None, Workspace(), blocks, out_ptr, d_act) is None
            return
        cases = [(None, np.array([0, n, 2 * n - 1000]), out_ptr, d_act, "blocks must be"),
                 (None, blocks, out_ptr[:-1], d_act, "out_ptr must be"),
                 (np.zeros(2 * n - 1, np.int32), blocks, out_ptr, d_act, "payload must be"),
                 (None, blocks, out_ptr, d_act[:-1], "d_act must hold"),
                 (None, blocks, np.r_[np.arange(0, n - 1), np.arange(n + 1, 2 * n + 1)], d_act[:-1],
                  "within one block")]
        for packed, bad_blocks, bad_out_ptr, bad_d_act, message in cases:
            with pytest.raises(ValueError, match=message):
                dedup.sum_by_blocks(rows, 110, packed, Workspace(), bad_blocks, bad_out_ptr, bad_d_act)
        uniq, _, index, sums = dedup.sum_by_blocks(rows, 110, None, Workspace(), blocks, out_ptr, d_act)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(uniq, np.r_[np.arange(10), 100 + np.arange(10)])
    np.testing.assert_array_equal(sums[index][:, 0], np.full(20, n // 10, np.float32))


def test_clustered_hashes_and_many_distinct_rows_fall_back_to_sorting_and_later_calls_sort(monkeypatch):
    """Rows whose hashes share a few slots exhaust a block's probing budget and the block is sorted
    instead (same result); after a call that had to sort a block, the next RETRY_AFTER calls sort."""
    from embedcore.kernels import dedup
    m = 1 << 14
    bits = dedup._table_bits(m)
    candidates = np.arange(1 << 22, dtype=np.uint64)
    slots = (candidates * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits)
    clustered = candidates[slots < 4].astype(np.int64)[:dedup._distinct_limit(m)]
    rng = np.random.default_rng(5)
    rows = np.concatenate([rng.permutation(np.resize(clustered, m)), (1 << 22) + rng.integers(0, 30, m)])
    blocks = np.array([0, m, 2 * m], np.int64)
    workspace = Workspace()
    for row_type, payload_type in ((np.int64, np.int64), (np.int32, np.int64), (np.int32, np.int32)):
        packed = rng.integers(np.iinfo(payload_type).min, np.iinfo(payload_type).max, rows.shape[0], payload_type)
        typed = rows.astype(row_type)
        uniq, ptr, sorted_packed, n_sorted = dedup.group_by_blocks(typed, 1 << 23, packed, blocks, workspace)
        assert n_sorted == 1  # the clustered block; the other hashed
        expected, counts = np.unique(rows, return_counts=True)
        np.testing.assert_array_equal(uniq, expected)
        np.testing.assert_array_equal(np.diff(ptr), counts)
        assert sorted_packed.dtype == payload_type
        np.testing.assert_array_equal(sorted_packed, packed[np.argsort(rows, kind="stable")])
    # Without payloads (one occurrence per activation row): the sorted block takes its activation rows too.
    out_ptr = np.arange(rows.shape[0] + 1, dtype=np.int64)
    uniq, ptr, grouped, n_sorted = dedup.group_by_blocks(rows.astype(np.int32), 1 << 23, None, blocks, workspace,
                                                          out_ptr)
    assert n_sorted == 1 and grouped.dtype == np.int32
    np.testing.assert_array_equal(grouped, np.argsort(rows, kind="stable"))

    # The memory of the fallback, whatever the thread count (the block path itself is forced here).
    monkeypatch.setattr(dedup, "blocks_worth_it", lambda *a: True)
    calls = []
    original = dedup.group_by_blocks
    monkeypatch.setattr(dedup, "group_by_blocks", lambda *a: calls.append(1) or original(*a))
    wide = np.concatenate([rng.integers(0, 40_000, 40_000), 40_000 + rng.integers(0, 40_000, 40_000)])
    for _ in range(dedup.RETRY_AFTER + 2):
        uniq, ptr, _ = dedup.group_rows(wide, 80_000, wide, workspace, np.array([0, 40_000, 80_000], np.int64))
        np.testing.assert_array_equal(uniq, np.unique(wide))
    assert len(calls) == 2  # tried, sorted blocks; RETRY_AFTER calls sorted; tried again


def test_grouper_sums_stacked_blocks_groups_the_rest_and_waits_after_a_refused_block(monkeypatch):
    """The Grouper gives the update what the engine's block sums or grouping give (bit for bit the global
    sort's sums); after a call whose block had too many distinct rows to hash, the next RETRY_AFTER calls
    sort outright, then blocks are tried again. Unstacked tables, and Tuning(sum_by_blocks=False), group."""
    import numba
    from embedcore import inputs
    from embedcore.kernels import dedup
    from embedcore.kernels.grouping import RETRY_AFTER, Grouper
    from embedcore.tuning import Tuning
    rng = np.random.default_rng(21)

    def batch(spread):
        parts = []
        for t, (offset, vocabulary) in enumerate([(0, 300), (300, 40_000)]):
            ids = rng.integers(0, vocabulary, 40_000) if spread and t else rng.zipf(1.8, 40_000) % vocabulary
            fb = inputs.to_feature_batch(ids.astype(np.int64), None, f"f{t}", vocabulary)
            parts.append((fb, "sum", 0, offset, t * 40_000, vocabulary))
        return inputs.build_table_batch(parts)

    def gradient_sums(grouped, dim=3):
        out = np.zeros((grouped.uniq.shape[0], dim), np.float32)
        rows_of = grouped.packed if grouped.packed.dtype == np.int32 else grouped.packed & 0xFFFFFFFF
        for u in range(grouped.uniq.shape[0]):
            for k in range(grouped.ptr[u], grouped.ptr[u + 1]):
                out[u] += grouped.d_act[rows_of[k]]
        return out
    monkeypatch.setattr(dedup, "blocks_worth_it", lambda *a: True)
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        assert not Grouper(Tuning(), stacked=False).sums_by_blocks
        assert not Grouper(Tuning(sum_by_blocks=False), stacked=True).sums_by_blocks
        grouper = Grouper(Tuning(), stacked=True)
        assert grouper.sums_by_blocks == (numba.get_num_threads() > 1)
        kinds = []
        for spread in [False, True] + [False] * (RETRY_AFTER + 1):
            tb = batch(spread)
            d_act = rng.standard_normal((tb.n_out, 3)).astype(np.float32)
            got = grouper.group(tb, 40_300, Workspace(), d_act)
            kinds.append("summed" if got.d_act is not d_act else "grouped")
            if spread:
                assert grouper.sorts_left == RETRY_AFTER
            expected = Grouper(Tuning(sum_by_blocks=False)).group(tb, 40_300, Workspace(), d_act)
            np.testing.assert_array_equal(got.uniq, np.unique(tb.rows))
            np.testing.assert_array_equal(got.uniq, expected.uniq)
            np.testing.assert_array_equal(gradient_sums(got), gradient_sums(expected))
        assert kinds == ["summed", "grouped"] + ["grouped"] * RETRY_AFTER + ["summed"]
    finally:
        numba.set_num_threads(before)


def test_blocks_are_shared_out_largest_first_and_checked():
    from embedcore.kernels import dedup
    schedule, ptr = dedup._schedule(np.array([40, 40, 10, 10]), 2)
    loads = [sum([40, 40, 10, 10][b] for b in schedule[ptr[p]:ptr[p + 1]]) for p in range(2)]
    assert loads == [50, 50] and sorted(schedule.tolist()) == [0, 1, 2, 3]
    rows = np.zeros(10, np.int64)
    for bad in (np.array([0, 5]), np.array([1, 10]), np.array([0, 7, 5, 10]), np.array([0, 10], np.int32),
                np.array([0])):
        with pytest.raises(ValueError, match="blocks must be int64 offsets"):
            dedup.group_rows(rows, 1, rows, Workspace(), bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3_000), max_size=600), st.integers(0, 50), st.sampled_from([1, 4, 256]))
def test_update_chunks_split_the_work_where_a_walk_over_the_rows_would(counts, first, chunk_rows):
    """``balanced_chunks`` puts chunk ``c``'s first row at the first row whose work before it (occurrences
    plus ``ROW_COST`` per row) reaches ``c / m`` of the total, as a walk over every row finds it."""
    from embedcore.kernels.update import ROW_COST, balanced_chunks
    ptr = first + np.r_[0, np.cumsum(counts)].astype(np.int64)
    bounds = balanced_chunks(ptr, chunk_rows)
    n_unique = len(counts)
    n_chunks = min(n_unique, max(16, -(-n_unique // chunk_rows)))
    work_before = [int(ptr[u] - ptr[0]) + ROW_COST * u for u in range(n_unique + 1)]
    total = work_before[-1]
    expected = [0]
    for c in range(1, n_chunks):
        target = total * c // n_chunks
        expected.append(next(u for u in range(n_unique + 1) if u == n_unique or work_before[u] >= target))
    expected.append(n_unique)
    assert bounds.tolist() == (expected if n_unique else [0])


@njit
def _copy_rows_jitted(dst, src):
    for i in range(dst.shape[0]):
        copy_row(dst[i], src[i])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 70), st.sampled_from([np.float32, np.float64]), st.booleans(), st.integers(0, 2 ** 32))
def test_copy_row_copies_every_value_of_rows_of_any_length(n, src_dtype, strided, seed):
    """Whole 16-value lines and the remainder, from float32 or float64 (narrowed like an assignment), from
    contiguous or strided rows, with NaN, Inf and signed zeros kept as they are."""
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal((3, 2 * n)).astype(src_dtype)
    every_seventh = wide.reshape(-1)[::7]
    every_seventh[:] = np.resize(np.array([np.nan, np.inf, -np.inf, -0.0], src_dtype), every_seventh.shape[0])
    src = wide[:, ::2] if strided else np.ascontiguousarray(wide[:, :n])
    dst = np.full((3, n), 7.0, np.float32)
    _copy_rows_jitted(dst, src)
    np.testing.assert_array_equal(dst.view(np.uint32), src.astype(np.float32).view(np.uint32))


def test_block_layout_is_kept_for_the_same_blocks_and_rebuilt_for_others():
    """The hash tables' layout and the threads' shares are kept per workspace for the same block offsets
    and thread count, and recomputed when either changes; grouping stays exact through the changes."""
    import numba
    from embedcore.kernels import dedup
    rng = np.random.default_rng(3)
    workspace = Workspace()
    cases = [np.array([0, 30_000, 40_000, 80_000], np.int64), np.array([0, 50_000, 60_000, 80_000], np.int64)]
    layouts = []
    for blocks in cases + cases:
        rows = np.concatenate([2_000 * k + rng.integers(0, 700, blocks[k + 1] - blocks[k]) for k in range(3)])
        uniq, ptr, sorted_packed, _ = dedup.group_by_blocks(rows, 10_000, rows, blocks, workspace)
        expected, counts = np.unique(rows, return_counts=True)
        np.testing.assert_array_equal(uniq, expected)
        np.testing.assert_array_equal(np.diff(ptr), counts)
        np.testing.assert_array_equal(sorted_packed, np.sort(rows, kind="stable"))
        layouts.append(dedup._block_layout(blocks, numba.get_num_threads(), workspace))
    assert layouts[0] is not layouts[1] and layouts[2] is not layouts[0]  # only the last blocks' layout is kept
    assert dedup._block_layout(cases[1], numba.get_num_threads(), workspace) is layouts[3]
    one_thread = dedup._block_layout(cases[1], 1, workspace)
    assert one_thread is not layouts[3] and one_thread[5].tolist() == [0, 3]  # every block on the one thread


@njit
def _sum_of_squares_jitted(row, low, high):
    return sum_of_squares(row, low, high)


def _sum_of_squares_reference(row, low, high):
    """The documented order in plain Python: eight float64 lanes, the tail into lane 0, a fixed tree."""
    squares = [float(np.float32(v) * np.float32(v)) for v in np.minimum(np.maximum(row, low), high)]
    whole = len(squares) - len(squares) % 8
    lanes = [0.0] * 8
    for j in range(whole):
        lanes[j % 8] += squares[j]
    for j in range(whole, len(squares)):
        lanes[0] += squares[j]
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 80), st.sampled_from([1e-20, 1.0, 1e18, "mixed"]), st.booleans(), st.booleans(),
       st.integers(0, 2 ** 32))
def test_sum_of_squares_is_the_documented_float64_order_bit_for_bit(n, scale, clipped, strided, seed):
    """The vector path (contiguous rows) and the loops (strided rows) both give the eight-lane float64 sum
    of the clipped float32 squares exactly, for every length (whole groups of eight and a tail); rows whose
    values span 30 orders of magnitude make float64 rounding, and so the order, visible."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.uniform(-15, 15, 2 * n) if scale == "mixed" else scale
    scale = 1e15 if scale == "mixed" else scale
    wide = (rng.standard_normal(2 * n) * magnitude).astype(np.float32)
    row = wide[::2] if strided else np.ascontiguousarray(wide[:n])
    low, high = (np.float32(-0.7 * scale), np.float32(0.4 * scale)) if clipped else (np.float32(-np.inf), np.float32(np.inf))
    assert _sum_of_squares_jitted(row, low, high) == _sum_of_squares_reference(row, low, high)


def test_table_batches_carry_activation_rows_alone_when_every_gain_is_1():
    """Without weights, a table whose features sum (or are sequences) is laid out without payloads (its
    activation rows are out_ptr's, no gains); weights, or a mean/sqrtn feature among the table's, give packed
    int64 words. The activation rows are the same either way."""
    from embedcore import inputs
    def part(ids, combiner, out_offset, weights=None, seq_len=0):
        batch = inputs.to_feature_batch(ec.Ragged(np.array(ids, np.int64), [0, len(ids) - 1, len(ids)]),
                                        None if weights is None else
                                        ec.Ragged(np.array(weights, np.float32), [0, len(ids) - 1, len(ids)]),
                                        "f", 10)
        return batch, combiner, seq_len, 0, out_offset, 10
    cases = [([part([1, 2, 3], "sum", 0)], True), ([part([1, 2, 3], "mean", 0, seq_len=2)], True),
             ([part([1, 2, 3], "sum", 0), part([4, 4], "sum", 2)], True),
             ([part([1, 2, 3], "sum", 0, weights=[1, 1, 1])], False), ([part([1, 2, 3], "mean", 0)], False),
             ([part([1, 2, 3], "sqrtn", 0)], False), ([part([1, 2, 3], "sum", 0), part([4, 4], "mean", 2)], False)]
    workspace = Workspace()
    for parts, unit in cases + cases:  # one workspace, both kinds in turn
        tb = inputs.build_table_batch(parts, workspace)
        assert inputs.unit_gains(parts) == unit
        assert tb.packed is None if unit else tb.packed.dtype == np.int64
        assert (tb.gains is None) == unit
        expected = np.repeat(np.arange(tb.n_out), np.diff(tb.out_ptr))
        np.testing.assert_array_equal(tb.out_row, expected)
    with pytest.raises(ValueError, match="without payloads"):
        from embedcore.kernels.occurrences import fill_occurrences
        fill_occurrences(np.array([1, 2]), np.array([0, 2]), np.zeros(0, np.float32), np.zeros(0, np.int64), 1, 0,
                         0, 0, 0, np.zeros(2, np.int32), np.zeros(0, np.int64), np.zeros(2, np.int64), 10)


@pytest.mark.parametrize("dim", [5, 64])
@pytest.mark.parametrize("optimizer", [lambda: ec.SGD(0.3), lambda: ec.Adagrad(0.3), lambda: ec.RowwiseAdagrad(0.3),
                                       lambda: ec.Adam(0.01)])
def test_batches_without_weights_train_bit_for_bit_as_weights_of_1(dim, optimizer):
    """Steps without weights (activation rows alone, no gains: the lookup and the update skip the products)
    give the same activations, tables and slots, bit for bit, as the same steps with weights of 1 (packed
    words), on one engine alternating weighted and unweighted batches, stacked tables large enough for the
    block grouping, duplicates and empty bags; for kernels compiled for a row length (64) and not (5)."""
    import numba
    rng = np.random.default_rng(dim)
    vocabularies = [3_000, 40]
    features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(v, dim, combiner="sum", name=f"t{t}",
                                                        initializer=ec.RandomUniform(-1, 1, seed=t)))
                for t, v in enumerate(vocabularies)}
    engines = [ec.Embedding(features, optimizer()) for _ in range(2)]
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        for step in range(4):
            lengths = rng.integers(0, 9, 10_000)
            batch = {f"f{t}": ec.Ragged(rng.zipf(1.2, lengths.sum()) % v, np.r_[0, np.cumsum(lengths)])
                     for t, v in enumerate(vocabularies)}
            given = None
            if step == 2:  # a weighted step between the others: both engines take packed words
                given = {k: ec.Ragged(rng.standard_normal(r.values.shape[0]).astype(np.float32), r.row_splits)
                         for k, r in batch.items()}
            ones = given or {k: ec.Ragged(np.ones(r.values.shape[0], np.float32), r.row_splits)
                             for k, r in batch.items()}
            grads = {k: rng.standard_normal((10_000, dim)).astype(np.float32) for k in batch}
            acts = []
            for emb, weights in zip(engines, (given, ones)):
                a, ctx = emb.lookup(batch, weights)
                assert (ctx.table_batches[0].packed is None) == (weights is None)
                acts.append(a)
                emb.apply_gradients(grads, ctx)
            for k in batch:
                np.testing.assert_array_equal(acts[0][k].view(np.int32), acts[1][k].view(np.int32))
            for name, table in engines[0].embedding_tables.items():
                np.testing.assert_array_equal(table.view(np.int32), engines[1].embedding_tables[name].view(np.int32))
            for name, slots in engines[0].slot_variables.items():
                for slot, values in slots.items():
                    np.testing.assert_array_equal(values, engines[1].slot_variables[name][slot])
    finally:
        numba.set_num_threads(before)


def test_hash_grouping_takes_narrow_types_where_they_fit_and_wide_ones_elsewhere(monkeypatch):
    """Keys in the rows' type and distinct-row ids as uint16 while no block may hold more than 2**16
    distinct rows, else int32 ids; with either choice (and the int64 keys of rows past 2**31) the blocks
    group exactly as the global sort does."""
    from embedcore.kernels import dedup
    assert dedup.hash_types(np.dtype(np.int32), 1 << 16) == (np.int32, np.uint16)
    assert dedup.hash_types(np.dtype(np.int64), (1 << 16) + 1) == (np.int64, np.int32)
    rng = np.random.default_rng(8)
    rows = np.concatenate([rng.integers(0, 900, 40_000), 1_000 + rng.zipf(1.2, 40_000) % 900])
    blocks = np.array([0, 40_000, 80_000], np.int64)
    payload = rng.integers(0, 2 ** 31 - 1, rows.shape[0]).astype(np.int32)
    uniq, counts = np.unique(rows, return_counts=True)
    expected = (uniq, np.concatenate(([0], np.cumsum(counts))), payload[np.argsort(rows, kind="stable")])
    rule = dedup.hash_types
    for types in (None, (np.int64, np.int32), (np.int32, np.int32), (np.int64, np.uint16)):
        monkeypatch.setattr(dedup, "hash_types", rule if types is None else lambda *a, types=types: types)
        for row_type in (np.int32, np.int64):
            uniq, ptr, grouped, n_sorted = dedup.group_by_blocks(rows.astype(row_type), 2_000, payload, blocks,
                                                                  Workspace())
            assert n_sorted == 0
            for e, g in zip(expected, (uniq, ptr, grouped)):
                np.testing.assert_array_equal(g, e)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2_000), st.integers(0, 25), st.integers(1, 5_000),
                          st.sampled_from([1, 3, 40, 10 ** 6])), min_size=1, max_size=6),
       st.integers(0, 2 ** 32), st.sampled_from([1, 2]))
def test_grouping_without_payloads_writes_each_occurrences_activation_row(spec, seed, threads):
    """A batch laid out without payloads (every gain 1) is grouped with each occurrence's activation row,
    read from out_ptr, as its payload: the same result as the activation rows given as an int32 payload,
    whichever path groups it (blocks hashed or sorted, the global sort; empty bags, empty features)."""
    import numba
    from embedcore.kernels import dedup
    rng = np.random.default_rng(seed)
    lengths, parts, starts, base = [], [], [0], 0
    for bags, longest, vocabulary, distinct in spec:
        bag_lengths = rng.integers(0, longest + 1, bags)
        ids = rng.integers(0, min(vocabulary, distinct), bag_lengths.sum()) * max(1, vocabulary // distinct)
        lengths.append(bag_lengths)
        parts.append(base + ids % vocabulary)
        starts.append(starts[-1] + int(bag_lengths.sum()))
        base += vocabulary
    rows = np.concatenate(parts).astype(np.int32)
    out_ptr = np.concatenate(([0], np.cumsum(np.concatenate(lengths)))).astype(np.int64)
    out_row = np.repeat(np.arange(out_ptr.shape[0] - 1), np.diff(out_ptr)).astype(np.int32)
    blocks = np.array(starts, np.int64)
    order = np.argsort(rows, kind="stable")  # NumPy's stable sort: the grouped order
    uniq, counts = np.unique(rows, return_counts=True)
    expected = (uniq, np.concatenate(([0], np.cumsum(counts))), out_row[order])
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        results = [dedup.group_rows(rows, base, None, Workspace(), blocks, out_ptr),
                   dedup.group_rows(rows, base, None, Workspace(), None, out_ptr),
                   dedup.group_by_blocks(rows, base, None, blocks, Workspace(), out_ptr)[:3]]
    finally:
        numba.set_num_threads(before)
    for got in results:
        assert got[2].dtype == np.int32
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(g, e)
    with pytest.raises(ValueError, match="out_ptr must be"):
        dedup.group_rows(rows, base, None, Workspace(), blocks, np.r_[out_ptr, out_ptr[-1] + 1])


def _sequential_sums_reference(rows, gains, out_row, d_act):
    """The update's documented order: each occurrence's gain * d_act row added to its row's sum one after the
    other, in occurrence order, from -0.0 (the same as starting from the first); distinct rows ascending."""
    uniq = np.unique(rows)
    sums = np.full((uniq.shape[0], d_act.shape[1]), -0.0, np.float32)
    np.add.at(sums, np.searchsorted(uniq, rows), gains[:, None] * d_act[out_row])
    return uniq, sums


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=2, max_size=6), st.integers(1, 60),
       st.sampled_from([1, 5, 16, 64]), st.sampled_from(["none", "rows", "packed"]), st.integers(0, 2 ** 32),
       st.integers(-1, 5))
def test_gradients_summed_block_by_block_are_the_sequential_sums(vocabularies, per_bag, dim, payload_kind, seed,
                                                                 empty_table):
    """dedup.sum_by_blocks (stacked tables: blocks of disjoint row ranges, tiny and larger vocabularies,
    many duplicates, empty bags, a table without occurrences) gives the distinct rows of the batch and, for
    each, the sum of its occurrences' gain * gradient row in occurrence order, bit for bit as np.add.at from
    -0.0, also in a workspace that summed a narrower batch before; it declines (None) with one thread or a
    block of too many distinct rows, and its sums are those the update sums from grouped occurrences
    (rows.sum_gradients)."""
    import numba
    from embedcore.kernels import dedup
    from embedcore.kernels.dedup import sum_by_blocks
    from embedcore.kernels.occurrences import pack_occurrences
    from embedcore.kernels.rows import sum_gradients
    rng = np.random.default_rng(seed)
    rows, starts, offset, bag_lengths = [], [0], 0, []
    for t, vocabulary in enumerate(vocabularies):  # each table's bags within its block, as the lookup lays out
        lengths = rng.integers(0, 2 * per_bag, 300) * (t != empty_table)
        bag_lengths.append(lengths)
        rows.append(offset + rng.integers(0, vocabulary, int(lengths.sum())))
        starts.append(starts[-1] + int(lengths.sum()))
        offset += vocabulary
    rows = np.concatenate(rows).astype(np.int32)
    n = rows.shape[0]
    n_out = 300 * len(vocabularies)
    bag_lengths = np.concatenate(bag_lengths)
    out_ptr = np.concatenate(([0], np.cumsum(bag_lengths))).astype(np.int64)
    out_row = np.repeat(np.arange(n_out), bag_lengths).astype(np.int32)
    d_act = rng.standard_normal((n_out, dim)).astype(np.float32)
    d_act[rng.random(d_act.shape) < 0.05] = -0.0
    gains = np.ones(n, np.float32) if payload_kind != "packed" else \
        rng.choice(np.array([0.5, -0.0, 1.0, -2.5], np.float32), n)
    packed = {"none": None, "rows": out_row, "packed": pack_occurrences(out_row, gains)}[payload_kind]
    blocks = np.array(starts, np.int64)
    before, smallest = numba.get_num_threads(), dedup.PARALLEL_MIN
    try:
        dedup.PARALLEL_MIN = 0  # blocks for batches of any size
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        workspace = Workspace()
        sum_by_blocks(rows, offset, packed, workspace, blocks, out_ptr, np.ascontiguousarray(d_act[:, :1]))
        got = sum_by_blocks(rows, offset, packed, workspace, blocks, out_ptr, d_act)
        if numba.get_num_threads() < 2:
            assert got is None
            return
        numba.set_num_threads(1)
        assert sum_by_blocks(rows, offset, packed, Workspace(), blocks, out_ptr, d_act) is None
    finally:
        numba.set_num_threads(before)
        dedup.PARALLEL_MIN = smallest
    expected_uniq, expected = _sequential_sums_reference(rows, gains, out_row, d_act)
    if got is None:  # blocks too uneven, or one with too many distinct rows to hash: the caller groups
        assert not dedup.blocks_worth_it(blocks, n, 2) or any(len(np.unique(rows[lo:hi])) > max(16, (hi - lo) // 32) for lo, hi in zip(starts, starts[1:]))
        return
    uniq, ptr, index, sums = got
    np.testing.assert_array_equal(uniq, expected_uniq)
    np.testing.assert_array_equal(ptr, np.arange(uniq.shape[0] + 1))
    np.testing.assert_array_equal(sums[index].view(np.int32), expected.view(np.int32))
    counts = np.unique(rows, return_counts=True)[1]
    grouped_ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    order = np.argsort(rows, kind="stable")
    grouped = np.empty_like(expected)
    sum_gradients(grouped, grouped_ptr, order, out_row, None if payload_kind != "packed" else gains, d_act)
    np.testing.assert_array_equal(grouped.view(np.int32), expected.view(np.int32))
