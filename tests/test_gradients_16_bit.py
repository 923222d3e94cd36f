"""float16 and bfloat16 gradients: ``apply_gradients`` reads them as they are (in place when it can, else a
16-bit copy), and the result is defined as that of their float32 copy, which holds every 16-bit value
exactly. So every test compares, bit for bit, tables, slots, ``step`` and the report against the same
engine given ``grad.astype(np.float32)``; plain SGD is also checked against an independent NumPy sum, so a
kernel that decoded the bits wrong on both paths would still fail."""

import ml_dtypes
import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.kernels import dedup
from embedcore.tables.physical import PhysicalTable
from .covering import pairs

FORMATS = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
BATCH = 12


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _custom_momentum(g, w, slots, lr, h):
    """A custom row function: heavy-ball momentum with a per-row step size."""
    (m,) = slots
    m = h[0] * m + g
    return w - lr * m / (1.0 + np.abs(m).max()), m


def _optimizer(name):
    return {"sgd": lambda: ec.SGD(0.5),
            "adagrad": lambda: ec.Adagrad(0.1),
            "rowwise_adagrad": lambda: ec.RowwiseAdagrad(0.1),
            "adam": lambda: ec.Adam(0.01),
            "custom": lambda: ec.CustomOptimizer(_custom_momentum, 0.05, ["m"], [0.0], hyperparameters=[0.9])}[name]()


def _engine(dim, table_dtype, optimizer, **kwargs):
    """Three features on one stacked table: ``f0`` sums duplicate ids, ``f1`` has weights (gains) and
    empty bags, ``f2`` reads a table of 3 rows."""
    def table(name, rows):
        return ec.TableConfig(rows, dim, name=name, combiner="sum", initializer=ec.RandomUniform(-0.5, 0.5),
                              weights_dtype=table_dtype)
    big, tiny = table("big", 40), table("tiny", 3)
    features = {"f0": ec.FeatureConfig(big), "f1": ec.FeatureConfig(big), "f2": ec.FeatureConfig(tiny)}
    return ec.Embedding(features, _optimizer(optimizer), seed=7, **kwargs)


def _batch(rng):
    """Ids and weights of the three features, BATCH samples each."""
    lengths = rng.integers(0, 4, BATCH)
    lengths[[2, 5]] = 0  # empty bags: their gradient rows feed no occurrence
    splits = np.concatenate([[0], np.cumsum(lengths)])
    ids1 = rng.integers(0, 40, splits[-1])
    weights1 = rng.uniform(-2, 2, splits[-1]).astype(np.float32)
    ids = {"f0": rng.integers(0, 8, BATCH), "f1": ec.Ragged(ids1, splits), "f2": rng.integers(0, 3, BATCH)}
    return ids, {"f0": None, "f1": ec.Ragged(weights1, splits), "f2": None}


def _gradients(rng, dim, dtype, layout):
    """The features' 16-bit gradients laid out as ``layout``; values of every magnitude the format holds
    (float16 subnormals among them)."""
    scale = np.exp2(rng.integers(-20, 8, (3, BATCH, dim)))
    values = (rng.standard_normal((3, BATCH, dim)) * scale).astype(dtype)
    if layout == "one array":  # consecutive views of one [features, batch, dim] array
        return {f"f{k}": values[k] for k in range(3)}
    if layout == "separate":
        return {f"f{k}": values[k].copy() for k in range(3)}
    if layout == "strided":
        wide = np.repeat(values, 2, axis=2)
        return {f"f{k}": wide[k][:, ::2] for k in range(3)}
    if layout == "mixed":  # one feature of each format: copied into float32
        other = FORMATS["float16"] if dtype == FORMATS["bfloat16"] else FORMATS["bfloat16"]
        return {"f0": values[0], "f1": values[1].astype(other), "f2": values[2]}
    raise ValueError(layout)


def _state(emb):
    tables = {k: _bits(v).copy() for k, v in emb.embedding_tables.items()}
    slots = {k: {s: _bits(v).copy() for s, v in d.items()} for k, d in emb.slot_variables.items()}
    return tables, slots, emb.step, {k: v for k, v in emb.skipped_rows.items()}


def _assert_same_state(got, expected):
    assert got[2:] == expected[2:]
    for k in expected[0]:
        np.testing.assert_array_equal(got[0][k], expected[0][k], err_msg=f"table {k}")
    for k in expected[1]:
        for s in expected[1][k]:
            np.testing.assert_array_equal(got[1][k][s], expected[1][k][s], err_msg=f"slot {k}/{s}")


def _report(report):
    return {k: {r: v.tolist() for r, v in d.items()} for k, d in report.skipped.items()}


def _train(steps, make_engine, cast):
    """Run ``steps`` (``(ids, weights, gradients)``) on a new engine, gradients passed through ``cast``;
    returns the state after every step and the reports."""
    emb = make_engine()
    states, reports = [], []
    for ids, weights, grads in steps:
        _, ctx = emb(ids, weights=weights)
        reports.append(_report(emb.apply_gradients({k: cast(g) for k, g in grads.items()}, ctx)))
        states.append(_state(emb))
    return states, reports


def _as_float32(g):
    return g.astype(np.float32)


def _compare_with_float32(steps, make_engine):
    got, got_reports = _train(steps, make_engine, lambda g: g)
    expected, expected_reports = _train(steps, make_engine, _as_float32)
    assert got_reports == expected_reports
    for a, b in zip(got, expected):
        _assert_same_state(a, b)


@pytest.fixture
def update_gradients(monkeypatch):
    """The gradient rows every ``PhysicalTable.update`` receives: ``(dtype, array)``."""
    seen = []
    update = PhysicalTable.update

    def recording(self, table_batch, d_act, *args, **kwargs):
        seen.append((d_act.dtype, d_act))
        return update(self, table_batch, d_act, *args, **kwargs)
    monkeypatch.setattr(PhysicalTable, "update", recording)
    return seen


def _steps(rng, dim, dtype, layout, n=3):
    return [(*_batch(rng), _gradients(rng, dim, dtype, layout)) for _ in range(n)]


# Each (optimizer, row length, table format, gradient format) compiles kernels of its own: the variant axes
# are covered pairwise (tests/covering.py), not as their full product.
@pytest.mark.parametrize("fmt,table_dtype,dim,optimizer",
                         pairs(sorted(FORMATS), ["float32", "bfloat16"], [5, 16, 24, 64], ["sgd", "adagrad"]))
def test_bit_identical_to_the_float32_copy(fmt, table_dtype, dim, optimizer, update_gradients):
    rng = np.random.default_rng(dim)
    steps = _steps(rng, dim, FORMATS[fmt], "one array")
    _compare_with_float32(steps, lambda: _engine(dim, table_dtype, optimizer))
    # The 16-bit rows reached the update as they are: the user's memory, not a copy.
    sixteen = [d_act for dtype, d_act in update_gradients if dtype == FORMATS[fmt]]
    assert len(sixteen) == len(steps)
    for d_act, (_, _, grads) in zip(sixteen, steps):
        assert np.shares_memory(d_act, grads["f0"])


@pytest.mark.parametrize("fmt,optimizer,dim,table_dtype",
                         pairs(sorted(FORMATS), ["rowwise_adagrad", "adam", "custom"], [64, 5, 24], ["float32", "bfloat16"]))
def test_every_optimizer(fmt, optimizer, dim, table_dtype):
    rng = np.random.default_rng(11)
    _compare_with_float32(_steps(rng, dim, FORMATS[fmt], "one array"), lambda: _engine(dim, table_dtype, optimizer))


@pytest.mark.parametrize("fmt,layout_kept,dim",
                         pairs(sorted(FORMATS), [("separate", True), ("strided", True), ("mixed", False)], [16, 24]))
def test_copied_gradients(fmt, layout_kept, dim, update_gradients):
    """Gradients that cannot be read in place are copied: into rows of their 16-bit format when all share it,
    else into float32 rows; the result is the same either way."""
    layout, kept = layout_kept
    rng = np.random.default_rng(3)
    steps = _steps(rng, dim, FORMATS[fmt], layout)
    _compare_with_float32(steps, lambda: _engine(dim, "bfloat16", "adagrad"))
    first = update_gradients[:len(steps)]
    assert all(dtype == (FORMATS[fmt] if kept else np.float32) for dtype, _ in first)
    for (_, d_act), (_, _, grads) in zip(first, steps):
        assert not any(np.shares_memory(d_act, g) for g in grads.values())


@pytest.mark.parametrize("fmt,stack_tables,sum_by_blocks",
                         pairs(sorted(FORMATS), [True, False], [True, False], must=[("float16", True, True),
                                                                                  ("bfloat16", True, True)]))
def test_stacking_and_grouping(fmt, stack_tables, sum_by_blocks, monkeypatch):
    """Unstacked tables, and stacked ones whose batches are summed block by block (dedup.sum_blocks reads
    the 16-bit rows) or grouped: the same results as float32, with 2 threads so that blocks are summed."""
    summed = []
    sum_blocks = dedup.sum_blocks

    def recorded(*args):
        got = sum_blocks(*args)
        summed.append((args[6].dtype, got is not None))
        return got
    monkeypatch.setattr(dedup, "sum_blocks", recorded)
    monkeypatch.setattr(dedup, "blocks_worth_it", _any_blocks)  # these batches are small
    monkeypatch.setattr(dedup, "HASH_DISTINCT_MAX", 1.0)  # and have few occurrences per distinct row
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        rng = np.random.default_rng(5)
        tuning = ec.Tuning(sum_by_blocks=sum_by_blocks)
        _compare_with_float32(_steps(rng, 16, FORMATS[fmt], "one array", n=4),
                              lambda: _engine(16, "float32", "adagrad", stack_tables=stack_tables, tuning=tuning))
    finally:
        numba.set_num_threads(before)
    if stack_tables and sum_by_blocks and numba.get_num_threads() > 1 and numba.config.NUMBA_NUM_THREADS > 1:
        assert (FORMATS[fmt], True) in summed  # the block path ran on 16-bit rows


def _any_blocks(blocks, n, threads):
    """``dedup.blocks_worth_it`` for batches of any size: at least two blocks and two threads."""
    return blocks is not None and threads > 1 and len(blocks) > 2


def test_sum_blocks_reads_16_bit_rows_as_their_float32_copy(monkeypatch):
    from embedcore.kernels.workspace import Workspace
    monkeypatch.setattr(dedup, "blocks_worth_it", _any_blocks)
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        if numba.get_num_threads() < 2:
            pytest.skip("Numba has 1 thread here: the block-summing path runs only with 2 or more")
        rng = np.random.default_rng(0)
        n_out, dim = 4000, 24
        rows = np.concatenate([rng.integers(0, 50, 2000), 50 + rng.integers(0, 60, 2000)]).astype(np.int64)
        out_ptr = np.arange(n_out + 1, dtype=np.int64)
        blocks = np.array([0, 2000, 4000], np.int64)
        for dtype in FORMATS.values():
            d_act = (rng.standard_normal((n_out, dim)) * 3).astype(dtype)
            got = dedup.sum_blocks(rows, 110, None, Workspace(), blocks, out_ptr, d_act)
            expected = dedup.sum_blocks(rows, 110, None, Workspace(), blocks, out_ptr, d_act.astype(np.float32))
            assert got is not None and expected is not None
            for a, b in zip(got[:3], expected[:3]):  # uniq, ptr, index
                np.testing.assert_array_equal(a, b)
            index = got[2]  # the rows of sums in use (the rest is scratch)
            np.testing.assert_array_equal(_bits(got[3][index]), _bits(expected[3][index]))
            reference = np.zeros((110, dim))
            np.add.at(reference, rows, d_act.astype(np.float64))
            np.testing.assert_allclose(got[3][index], reference[got[0]], rtol=1e-5, atol=1e-5)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dim", [5, 64])
def test_sgd_matches_an_independent_numpy_sum(fmt, dim):
    """SGD on a float32 table: ``w - lr * sum(gain * g)``, the sum taken here in float64 from the 16-bit
    values converted by NumPy / ml_dtypes."""
    rng = np.random.default_rng(21)
    emb = _engine(dim, "float32", "sgd")
    ids, weights = _batch(rng)
    grads = _gradients(rng, dim, FORMATS[fmt], "one array")
    before = {k: v.astype(np.float64) for k, v in emb.embedding_tables.items()}
    _, ctx = emb(ids, weights=weights)
    emb.apply_gradients(grads, ctx)
    dense = {k: np.zeros_like(v) for k, v in before.items()}
    for name, table in (("f0", "big"), ("f1", "big"), ("f2", "tiny")):
        g = grads[name].astype(np.float64)
        if isinstance(ids[name], ec.Ragged):
            splits = ids[name].row_splits
            for b in range(BATCH):
                for o in range(splits[b], splits[b + 1]):
                    dense[table][ids[name].values[o]] += float(weights[name].values[o]) * g[b]
        else:
            for b, i in enumerate(ids[name]):
                dense[table][i] += g[b]
    for k in before:
        np.testing.assert_allclose(emb.embedding_tables[k], before[k] - 0.5 * dense[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt,layout,value",
                         pairs(sorted(FORMATS), ["one array", "separate", "strided", "mixed"], ["nan", "inf", "-inf"]))
def test_non_finite_is_refused_naming_the_feature_and_index(fmt, layout, value):
    rng = np.random.default_rng(1)
    emb = _engine(16, "bfloat16", "adam")
    ids, weights = _batch(rng)
    grads = _gradients(rng, 16, FORMATS[fmt], layout)
    before = _state(emb)
    _, ctx = emb(ids, weights=weights)
    grads["f1"][7, 9] = float(value)
    with pytest.raises(ec.InputError, match=rf"gradient of feature 'f1' holds {value} at index \(7, 9\); NaN/Inf "
                                            r"gradients are refused \(nothing was updated\)"):
        emb.apply_gradients(grads, ctx)
    _assert_same_state(_state(emb), before)
    grads["f1"][7, 9] = 0.5
    emb.apply_gradients(grads, ctx)  # the refused call consumed nothing
    assert emb.step == 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("layout", ["one array", "separate", "strided"])
def test_skip_policy_matches_float32(fmt, layout):
    rng = np.random.default_rng(2)
    steps = _steps(rng, 16, FORMATS[fmt], layout)
    for k, (_, _, grads) in enumerate(steps):
        grads["f0"][k, 3] = np.nan
        grads["f2"][BATCH - 1 - k, 0] = -np.inf
    got, got_reports = _train(steps, lambda: _engine(16, "bfloat16", "adagrad", non_finite="skip"), lambda g: g)
    expected, expected_reports = _train(steps, lambda: _engine(16, "bfloat16", "adagrad", non_finite="skip"),
                                        _as_float32)
    assert got_reports == expected_reports
    assert all(r for r in got_reports)  # rows were skipped, and reported
    for a, b in zip(got, expected):
        _assert_same_state(a, b)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint16, np.complex64, object, np.bool_,
                                   ml_dtypes.float8_e4m3fn])
def test_other_dtypes_are_refused(dtype):
    emb = _engine(8, "float32", "sgd")
    ids, weights = _batch(np.random.default_rng(0))
    _, ctx = emb(ids, weights=weights)
    grads = {k: np.zeros((BATCH, 8), np.float32) for k in ("f0", "f1", "f2")}
    grads["f2"] = np.zeros((BATCH, 8), dtype)
    before = _state(emb)
    with pytest.raises(ec.InputError, match=r"gradient of feature 'f2' must hold floats \(float16, bfloat16, "
                                            r"float32 or float64\), got dtype"):
        emb.apply_gradients(grads, ctx)
    _assert_same_state(_state(emb), before)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), fmt=st.sampled_from(sorted(FORMATS)),
       dim=st.sampled_from([5, 16, 24]), table_dtype=st.sampled_from(["float32", "bfloat16"]),
       layout=st.sampled_from(["one array", "separate", "strided"]), skip=st.booleans())
def test_property_random_batches_match_float32(seed, fmt, dim, table_dtype, layout, skip):
    rng = np.random.default_rng(seed)
    steps = _steps(rng, dim, FORMATS[fmt], layout, n=2)
    if skip:  # a few NaN/Inf, let through and skipped
        for _, _, grads in steps:
            for _ in range(rng.integers(0, 3)):
                grads[f"f{rng.integers(0, 3)}"][rng.integers(0, BATCH), rng.integers(0, dim)] = \
                    rng.choice([np.nan, np.inf, -np.inf])
    policy = "skip" if skip else "raise"
    _compare_with_float32(steps, lambda: _engine(dim, table_dtype, "adagrad", non_finite=policy))


def test_byte_swapped_float16_is_copied_into_float32(update_gradients):
    """A float16 gradient in the other byte order is not read as bits: it is copied into float32 rows, with
    the same result as its float32 copy."""
    rng = np.random.default_rng(4)
    steps = _steps(rng, 16, FORMATS["float16"], "separate")
    for _, _, grads in steps:
        for k in grads:
            grads[k] = grads[k].astype(grads[k].dtype.newbyteorder())
    _compare_with_float32(steps, lambda: _engine(16, "float32", "adagrad"))
    assert all(dtype == np.float32 for dtype, _ in update_gradients)
