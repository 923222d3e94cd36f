"""16-bit tables (float16, bfloat16): the conversions against NumPy's and ml_dtypes' own, the update as float32
math then the rounding rule (against the NumPy oracle), stochastic rounding unbiased and deterministic, lookups
equal to float32 lookups of the same values, overflow refused like NaN, checkpoints in the native dtype."""

import ml_dtypes
import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import njit

import embedcore as ec
from embedcore.checkpoint.tensor_file import read_header
from embedcore.kernels import half

from . import reference as ref
from .covering import pairs
from .harness import as_input, random_samples, random_weights, rewrite_manifest

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
MANTISSA_BITS = {"float16": 10, "bfloat16": 7}


@njit
def _decode_all(decode, bits, out):
    for i in range(bits.shape[0]):
        out[i] = decode(bits[i])


@njit
def _encode_all(encode, values, random, out):
    for i in range(values.shape[0]):
        out[i] = encode(values[i], random[i])


def _encode(name, values, stochastic, random=None):
    values = np.ascontiguousarray(values, np.float32)
    random = np.zeros(values.shape[0], np.uint64) if random is None else random
    out = np.empty(values.shape[0], np.uint16)
    _encode_all(half.encoder(name, stochastic), values, random, out)
    return out


# -- the conversions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_16_bit_pattern_decodes_to_the_float32_numpy_gives(name):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.shape[0], np.float32)
    _decode_all(half.decoder(name), bits, out)
    expected = bits.view(DTYPES[name]).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))  # -0.0 included


def _interesting_float32(rng):
    """Random values of every magnitude, every 16-bit value, its float32 neighbours and the midpoints
    between 16-bit values (the ties)."""
    scales = 10.0 ** np.arange(-12, 40, 3)
    values = [rng.standard_normal(20_000) * s for s in scales]
    for name, dtype in DTYPES.items():
        every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype).astype(np.float32)
        every = every[np.isfinite(every)]
        ordered = np.sort(every)
        values += [every, np.nextafter(every, np.float32(np.inf)), np.nextafter(every, np.float32(-np.inf)),
                   (ordered[:-1].astype(np.float64) + ordered[1:]) / 2]
    with np.errstate(over="ignore"):
        return np.concatenate(values).astype(np.float32)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_rounding_to_nearest_is_numpys_cast(name):
    values = _interesting_float32(np.random.default_rng(0))
    values = np.concatenate([values, np.float32([np.inf, -np.inf, 0.0, -0.0, 65504, 65519.996, 65520, 3.4e38])])
    with np.errstate(over="ignore"):
        expected = values.astype(DTYPES[name]).view(np.uint16)
    assert np.array_equal(_encode(name, values, stochastic=False), expected)


def _stochastic_reference(name, x, random):
    """The rule, from the definition: ``x`` (float32, normal) between the 16-bit values ``lo`` and ``hi``
    (magnitudes) is ``dropped`` float32 steps above ``lo`` in a gap of ``2**k`` steps (``k`` <= 16 here); it
    becomes ``hi`` exactly when the low ``k`` of the 16 random bits plus ``dropped`` reach ``2**k``."""
    dtype = DTYPES[name]
    a = np.abs(x.astype(np.float64))
    nearest = np.abs(x.astype(dtype).astype(np.float64))
    other = np.abs(np.nextafter(np.abs(x.astype(dtype)), dtype(np.where(nearest > a, 0, np.inf))).astype(np.float64))
    lo, hi = np.minimum(nearest, other), np.maximum(nearest, other)
    exact = nearest == a
    step = np.spacing(np.abs(x)).astype(np.float64)  # the float32 step at x
    k = np.round(np.log2((hi - lo) / step)).astype(np.uint64)
    dropped = np.round((a - lo) / step).astype(np.uint64)
    low_bits = random & ((np.uint64(1) << k) - np.uint64(1))
    up = (low_bits + dropped >= (np.uint64(1) << k)) & ~exact
    magnitude = np.where(exact, a, np.where(up, hi, lo))
    return (np.sign(x) * magnitude).astype(dtype).view(np.uint16)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_stochastic_rounding_follows_its_rule(name):
    rng = np.random.default_rng(1)
    values = _interesting_float32(rng)
    tiny = 2.0 ** -14 if name == "float16" else float(np.finfo(np.float32).tiny)
    limit = 65504 if name == "float16" else 3e38
    values = values[np.isfinite(values) & (np.abs(values) >= tiny) & (np.abs(values) < limit)]
    assert values.shape[0] > 300_000
    random = rng.integers(0, 1 << 16, values.shape[0], dtype=np.uint64)
    got = _encode(name, values, True, random)
    assert np.array_equal(got, _stochastic_reference(name, values, random))


def test_stochastic_rounding_of_float16_subnormals_is_unbiased():
    """Below 2**-14 a float16 keeps fewer bits; the rounding stays exact in expectation."""
    rng = np.random.default_rng(2)
    for value in (3e-8, 1.7e-6, 5.9604645e-08 * 0.3, 2 ** -14 * 0.999):
        x = np.full(200_000, value, np.float32)
        got = _encode("float16", x, True, rng.integers(0, 1 << 16, x.shape[0], dtype=np.uint64))
        mean = got.view(np.float16).astype(np.float64).mean()
        gap = 2.0 ** -24
        assert abs(mean - float(np.float32(value))) < 5 * gap / np.sqrt(x.shape[0]), value


def test_stochastic_rounding_of_float16_subnormals_follows_its_rule():
    """Below 2**-14, ``|x|`` in units of 2**-24 is ``q`` with ``k`` >= 14 fractional bits: it rounds up exactly
    when the low ``min(k, 16)`` random bits plus the top ``min(k, 16)`` fractional bits reach ``2**min(k, 16)``
    (every float32 subnormal included)."""
    rng = np.random.default_rng(4)
    magnitudes = np.concatenate([rng.integers(1, 0x38800000, 400_000, dtype=np.uint64).astype(np.uint32),
                                 np.arange(1, 1 << 16, dtype=np.uint32) << np.uint32(7)])  # float32 subnormals too
    signs = rng.integers(0, 2, magnitudes.shape[0], dtype=np.uint64).astype(np.uint32) << np.uint32(31)
    x = (magnitudes | signs).view(np.float32)
    random = rng.integers(0, 1 << 16, x.shape[0], dtype=np.uint64)
    exponent = (magnitudes >> np.uint32(23)).astype(np.int64)
    significand = (magnitudes & np.uint32(0x7FFFFF)).astype(np.uint64) | np.where(exponent > 0, 1 << 23, 0).astype(
        np.uint64)
    k = 126 - np.maximum(exponent, 1)  # fractional bits of q = significand / 2**k
    kept = np.minimum(k, 16).astype(np.uint64)
    top = significand >> (k - kept.astype(np.int64)).clip(0, 63).astype(np.uint64)  # q with kept fractional bits
    top = np.where(k - kept.astype(np.int64) > 40, 0, top)
    magnitude = (top + (random & ((np.uint64(1) << kept) - np.uint64(1)))) >> kept
    expected = (magnitude.astype(np.uint32) | ((magnitudes | signs) >> np.uint32(16)) & np.uint32(0x8000))
    assert np.array_equal(_encode("float16", x, True, random), expected.astype(np.uint16))


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False), st.integers(0, 2 ** 16 - 1))
def test_stochastic_rounding_gives_one_of_the_two_neighbours(value, random):
    for name, dtype in DTYPES.items():
        x = np.float32([value])
        with np.errstate(over="ignore"):
            got = _encode(name, x, True, np.uint64([random])).view(dtype).astype(np.float64)[0]
            down = np.float64(x[0])
            candidates = {float(x.astype(dtype).astype(np.float64)[0])}
            near = x.astype(dtype)
            candidates.add(float(np.nextafter(near, dtype(np.inf)).astype(np.float64)[0]))
            candidates.add(float(np.nextafter(near, dtype(-np.inf)).astype(np.float64)[0]))
        if np.isinf(got):
            assert abs(down) > half.FORMAT_RANGE[name] * (1 - 2.0 ** -(MANTISSA_BITS[name] + 1)), (name, value)
            continue
        below = max(c for c in candidates if c <= down)
        above = min(c for c in candidates if c >= down)
        assert got in (below, above), (name, value, got)


# -- the engine -----------------------------------------------------------------------------------------

def _gap(values, name):
    """The larger gap between 16-bit values around each of ``values`` (float64)."""
    dtype = DTYPES[name]
    v = np.abs(values).astype(dtype)
    with np.errstate(over="ignore"):
        up = np.nextafter(v, dtype(np.inf)).astype(np.float64) - v.astype(np.float64)
        down = v.astype(np.float64) - np.nextafter(v, dtype(0)).astype(np.float64)
    return np.maximum(np.where(np.isfinite(up), up, down), down)


CASES = {
    "sgd": (lambda: ec.SGD(0.3), ref.sgd, {}, 0.3, True),
    "adagrad": (lambda: ec.Adagrad(0.2, initial_accumulator_value=0.3), ref.adagrad, {}, 0.2, True),
    "rowwise-adagrad": (lambda: ec.RowwiseAdagrad(0.2), ref.rowwise_adagrad, {}, 0.2, True),
    "adam": (lambda: ec.Adam(0.05), ref.adam, {}, 0.05, True),
    "adam-non-lazy": (lambda: ec.Adam(0.05, lazy_adam=False), ref.adam, {}, 0.05, False),
    "ftrl": (lambda: ec.FTRL(0.5, initial_accumulator_value=0.2), ref.ftrl, {}, 0.5, True),
    "custom-per-row": (lambda: ec.CustomOptimizer(_custom_rowwise, learning_rate=0.2, slot_names=["acc"],
                                                  slot_initializers=[0.1], slot_dims=[1]),
                       None, {}, 0.2, True),
}
# (weights, slots, stochastic): each 16-bit format as rows and as slots, both roundings (a kernel compiles
# for each combination, so not every product is run)
STORAGE = [("bfloat16", "float32", True), ("float16", "float16", False), ("bfloat16", "bfloat16", False),
           ("float16", "float32", True), ("float32", "bfloat16", True)]
# Every optimizer with every storage: each pair of (optimizer, rows' format, slots' format, rounding) values
# at least once (tests/covering.py); the all-float32 cases the covering adds check the oracle on float32 too.
UPDATE_CASES = pairs(sorted(CASES), ["bfloat16", "float16", "float32"], ["float32", "float16", "bfloat16"],
                     [True, False], must=[("adam", *STORAGE[2]), ("custom-per-row", *STORAGE[1])])


def _custom_rowwise(g, w, slots, lr, hyper):
    """A per-row function (a reduction over the row): row-wise Adagrad written out."""
    acc = slots[0] + np.mean(g * g)
    return w - lr * g / np.sqrt(acc), acc


def _custom_reference(g, w, slots, lr, p, step):
    (acc,) = slots
    acc = acc + (g * g).mean(axis=1)
    return w - lr * g / np.sqrt(acc)[:, None], [acc]


def _allowed(expected, previous, name, stochastic):
    """How far a stored value may be from the float64 oracle: the rounding (half a gap to nearest, a whole
    gap stochastically) plus float32 arithmetic, whose error scales with the operands (``previous`` and
    the update: a result near zero from two values near 0.05 carries their float32 error)."""
    float32_slack = 1e-5 * (np.abs(expected) + np.abs(previous)) + 1e-6
    if name == "float32":
        return float32_slack + 2e-5
    return _gap(expected, name) * (1.0 if stochastic else 0.5) + float32_slack


@pytest.mark.parametrize("case, weights_dtype, slot_dtype, stochastic", UPDATE_CASES)
def test_update_is_float32_math_then_the_rounding_rule(case, weights_dtype, slot_dtype, stochastic):
    """Each step, from the values the table holds: the oracle's update in float64, then the rounding; rows
    the batch did not touch (lazy optimizers) keep their bits."""
    make, update, params, lr, lazy = CASES[case]
    update = update or _custom_reference
    stored = dict(weights_dtype=weights_dtype, slot_dtype=slot_dtype, stochastic_rounding=stochastic)
    big = ec.TableConfig(60, 16, combiner="mean", name="big", **stored)
    tiny = ec.TableConfig(5, 16, combiner="sum", name="tiny", initializer=ec.RandomUniform(-0.5, 0.5), **stored)
    features = [("a", "big", 0), ("b", "big", 3), ("c", "tiny", 0)]
    configs = {"big": big, "tiny": tiny}
    emb = ec.Embedding({f: ec.FeatureConfig(configs[t], max_sequence_length=L) for f, t, L in features}, make(),
                       seed=4)
    assert emb.embedding_tables["big"].dtype == np.dtype(DTYPES.get(weights_dtype, np.float32))
    rng = np.random.default_rng(hash((case, weights_dtype, slot_dtype)) % 1000)
    for step in range(4):
        before = {n: t.astype(np.float64) for n, t in emb.embedding_tables.items()}
        before_bits = {n: t.copy() for n, t in emb.embedding_tables.items()}
        slots = {n: [s.astype(np.float64) for s in d.values()] for n, d in emb.slot_variables.items()}
        batch, weights, samples = {}, {}, {}
        for fname, tname, seq_len in features:
            s = random_samples(rng, 10, configs[tname].vocabulary_size, 4, rng.integers(0, 5, 2))
            w = random_weights(rng, s)
            samples[fname] = (s, w, seq_len, tname)
            batch[fname], weights[fname] = as_input(s, w, "ragged")
        acts, ctx = emb(batch, weights)
        grads, dense = {}, {n: [np.zeros_like(before[n]), np.zeros(configs[n].vocabulary_size, bool)] for n in configs}
        for fname, (s, w, seq_len, tname) in samples.items():
            expected = ref.lookup(before[tname], s, w, configs[tname].combiner, seq_len)
            np.testing.assert_allclose(acts[fname], expected, rtol=2e-5, atol=2e-5)
            grads[fname] = rng.normal(0, 1, acts[fname].shape).astype(np.float32)
            ref.dense_gradient(configs[tname].vocabulary_size, 16, s, w, configs[tname].combiner, seq_len,
                               grads[fname].astype(np.float64), dense[tname][0])
            ref.touched_rows(configs[tname].vocabulary_size, s, seq_len, dense[tname][1])
        emb.apply_gradients(grads, ctx)
        for name in configs:
            g, touched = dense[name]
            want, want_slots = ref.apply(update, g, before[name], slots[name], touched, lr, params, emb.step, lazy)
            got = emb.embedding_tables[name].astype(np.float64)
            bad = np.abs(got - want) > _allowed(want, before[name], weights_dtype, stochastic)
            assert not bad.any(), (name, step, got[bad][:4], want[bad][:4], before[name][bad][:4])
            for got_slot, want_slot, old in zip(emb.slot_variables[name].values(), want_slots, slots[name]):
                got_slot = got_slot.astype(np.float64)
                assert np.all(np.abs(got_slot - want_slot) <= _allowed(want_slot, old, slot_dtype, stochastic)), \
                    (name, step)
            if lazy:
                untouched = ~touched
                assert np.array_equal(emb.embedding_tables[name][untouched].view(np.uint8),
                                      before_bits[name][untouched].view(np.uint8))


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_stochastic_rounding_keeps_updates_that_rounding_to_nearest_loses(name):
    """Many updates far below the table's resolution: to nearest they vanish (1 - 1e-4 rounds back to 1);
    stochastically the table moves by their sum on average."""
    steps, lr_g = 60, 2e-4  # the gap below 1.0 is 2**-8 (bfloat16) or 2**-11 (float16)
    moved = {}
    for stochastic in (False, True):
        table = ec.TableConfig(2048, 16, name="t", combiner="sum", initializer=ec.Constant(1.0), weights_dtype=name,
                               stochastic_rounding=stochastic)
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(1.0))
        ids = np.arange(2048)[:, None]
        for _ in range(steps):
            acts, ctx = emb({"f": ids})
            emb.apply_gradients({"f": np.full(acts["f"].shape, lr_g, np.float32)}, ctx)
        moved[stochastic] = 1.0 - emb.embedding_tables["t"].astype(np.float64)
    assert np.all(moved[False] == 0)
    expected = steps * lr_g
    gap = 2.0 ** -(MANTISSA_BITS[name] + 1)
    p = lr_g / gap
    standard_error = np.sqrt(steps * p * (1 - p)) * gap / np.sqrt(moved[True].size)
    assert abs(moved[True].mean() - expected) < 5 * standard_error, (moved[True].mean(), expected)


def _train(emb, steps=5, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = {f: rng.integers(0, 300, (64, 3)) for f in ("a", "b")}
        acts, ctx = emb(batch)
        emb.apply_gradients({f: rng.normal(0, 0.3, a.shape).astype(np.float32) for f, a in acts.items()}, ctx)
    return {n: t.copy() for n, t in emb.embedding_tables.items()}, \
        {n: {s: v.copy() for s, v in d.items()} for n, d in emb.slot_variables.items()}


def _two_tables(stack, **stored):
    tables = {f: ec.TableConfig(300, 16, name=f"t_{f}", combiner="sum", **stored) for f in ("a", "b")}
    return ec.Embedding({f: ec.FeatureConfig(t) for f, t in tables.items()}, ec.Adagrad(0.3), seed=7,
                        stack_tables=stack)


def _same_bits(x, y):
    for name in x[0]:
        assert np.array_equal(x[0][name].view(np.uint16), y[0][name].view(np.uint16)), name
        for slot in x[1][name]:
            assert np.array_equal(x[1][name][slot].view(np.uint8), y[1][name][slot].view(np.uint8)), (name, slot)


@pytest.mark.parametrize("storage", [("bfloat16", "bfloat16"), ("float16", "float32")])
def test_stochastic_rounding_is_the_same_on_any_thread_count_stacked_or_not(storage):
    stored = dict(weights_dtype=storage[0], slot_dtype=storage[1])
    reference = _train(_two_tables(True, **stored))
    emb = _two_tables(True, **stored)
    assert emb.num_physical_tables == 1
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        _same_bits(_train(emb), reference)
    finally:
        numba.set_num_threads(threads)
    separate = _two_tables(False, **stored)
    assert separate.num_physical_tables == 2
    _same_bits(_train(separate), reference)


def test_tables_of_different_storage_never_stack():
    optimizer = ec.Adagrad(0.1)
    tables = [ec.TableConfig(10, 8, name="f32"), ec.TableConfig(10, 8, name="bf16", weights_dtype="bfloat16"),
              ec.TableConfig(10, 8, name="bf16_nearest", weights_dtype="bfloat16", stochastic_rounding=False),
              ec.TableConfig(10, 8, name="bf16_b", weights_dtype="bfloat16"),
              ec.TableConfig(10, 8, name="bf16_slots", weights_dtype="bfloat16", slot_dtype="bfloat16")]
    emb = ec.Embedding({t.name: ec.FeatureConfig(t) for t in tables}, optimizer)
    assert sorted(sorted(p.table_names) for p in emb.physical_tables) == \
        [["bf16", "bf16_b"], ["bf16_nearest"], ["bf16_slots"], ["f32"]]


@pytest.mark.parametrize("dim", [16, 5])
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_lookups_equal_float32_lookups_of_the_same_values_bit_for_bit(name, dim):
    half_table = ec.TableConfig(200, dim, name="t", combiner="sqrtn", weights_dtype=name)
    features = lambda t: {"pooled": ec.FeatureConfig(t), "seq": ec.FeatureConfig(t, max_sequence_length=4)}
    emb = ec.Embedding(features(half_table), ec.SGD(0.1), seed=2)
    values = emb.embedding_tables["t"].astype(np.float32)
    f32 = ec.Embedding(features(ec.TableConfig(200, dim, name="t", combiner="sqrtn",
                                               initializer=lambda shape, dtype: values)), ec.SGD(0.1))
    rng = np.random.default_rng(dim)
    for _ in range(3):
        samples = random_samples(rng, 40, 200, 9, rng.integers(0, 200, 3))
        w = random_weights(rng, samples)
        ids, weights = as_input(samples, w, "ragged")
        batch = {"pooled": ids, "seq": ids}
        got, _ = emb(batch, {"pooled": weights, "seq": weights})
        want, _ = f32(batch, {"pooled": weights, "seq": weights})
        for f in batch:
            assert got[f].dtype == np.float32
            assert np.array_equal(got[f].view(np.uint32), want[f].view(np.uint32)), f


@pytest.mark.parametrize("dim", [64, 5])
@pytest.mark.parametrize("name", ["float32", *sorted(DTYPES)])
def test_lookups_streamed_past_the_caches_are_the_lookups_through_them(name, dim):
    """``Tuning.stream_activations_min_bytes`` changes where activations are written, never their bits
    (rows of whole cache lines are streamed; others are not, whatever the tuning)."""
    table = ec.TableConfig(300, dim, name="t", combiner="mean", weights_dtype=name)
    engines = [ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1), seed=4, tuning=ec.Tuning(**tuning))
               for tuning in ({"stream_activations_min_bytes": 0}, {"stream_activations_min_bytes": None})]
    rng = np.random.default_rng(dim)
    for _ in range(3):
        samples = random_samples(rng, 3000, 300, 6, rng.integers(0, 300, 3))
        ids, weights = as_input(samples, random_weights(rng, samples), "ragged")
        (streamed, _), (through, _) = (emb({"f": ids}, {"f": weights}) for emb in engines)
        assert np.array_equal(streamed["f"].view(np.uint32), through["f"].view(np.uint32))
    assert not ec.Tuning(stream_activations_min_bytes=None).streams(1 << 40)
    assert ec.Tuning(stream_activations_min_bytes=64).streams(64) and not ec.Tuning().streams(64)


def test_initial_values_are_the_float32_ones_rounded_to_nearest():
    for name, dtype in DTYPES.items():
        for init in (None, ec.RandomUniform(-0.3, 0.3, seed=5), ec.Constant(0.1), lambda s, d: np.full(s, 0.7)):
            t16 = ec.TableConfig(1000, 24, name="t", initializer=init, weights_dtype=name, slot_dtype=name)
            t32 = ec.TableConfig(1000, 24, name="t", initializer=init)
            e16 = ec.Embedding({"f": ec.FeatureConfig(t16)}, ec.Adagrad(0.1, initial_accumulator_value=0.3), seed=9)
            e32 = ec.Embedding({"f": ec.FeatureConfig(t32)}, ec.Adagrad(0.1, initial_accumulator_value=0.3), seed=9)
            assert np.array_equal(e16.embedding_tables["t"].view(np.uint16),
                                  e32.embedding_tables["t"].astype(dtype).view(np.uint16))
            assert np.array_equal(e16.slot_variables["t"]["accumulators"].astype(np.float32),
                                  np.float32(0.3).astype(dtype).astype(np.float32) * np.ones((1000, 24), np.float32))


def test_an_initial_value_beyond_float16_range_is_refused_naming_the_table():
    table = ec.TableConfig(10, 4, name="wide", initializer=ec.Constant(1e5), weights_dtype="float16")
    with pytest.raises(ValueError, match=r"wide.*wrote 100000.0 to row 0, beyond the range of float16"):
        ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1))


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_result_beyond_float16_range_is_treated_like_a_non_finite_one(policy):
    """65504 is float16's largest value: an update landing beyond it is not stored, the row is reported,
    the other rows are updated (as for a NaN result)."""
    table = ec.TableConfig(8, 4, name="t", combiner="sum", initializer=ec.Constant(60000.0), weights_dtype="float16",
                           stochastic_rounding=False)
    emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(1.0), non_finite=policy)
    acts, ctx = emb({"f": np.array([[1], [2]])})
    grad = np.zeros_like(acts["f"])
    grad[0] = -10000.0  # row 1: 70000, beyond float16
    grad[1] = 1000.0    # row 2: 59000
    if policy == "raise":
        with pytest.raises(ec.NonFiniteError, match=r"'t'.*\b1\b"):
            emb.apply_gradients({"f": grad}, ctx)
    else:
        report = emb.apply_gradients({"f": grad}, ctx)
        assert report.skipped["t"]["output"].tolist() == [1]
    table_now = emb.embedding_tables["t"].astype(np.float32)
    assert table_now[1].tolist() == [60000.0] * 4
    assert table_now[2].tolist() == [59008.0] * 4  # 59000 to nearest float16 (a gap of 32)
    assert emb.step == 1


def test_16_bit_tables_take_half_the_bytes():
    for name in DTYPES:
        table = ec.TableConfig(10_000, 32, name="t", weights_dtype=name, slot_dtype=name)
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, ec.Adam(0.1))
        assert emb.embedding_tables["t"].nbytes == 10_000 * 32 * 2
        assert all(s.nbytes == 10_000 * 32 * 2 for s in emb.slot_variables["t"].values())


def test_config_refuses_unknown_dtypes():
    with pytest.raises(ValueError, match=r"TableConfig 't': Argument `weights_dtype` must be one of"):
        ec.TableConfig(10, 4, name="t", weights_dtype="int8")
    with pytest.raises(ValueError, match=r"Argument `slot_dtype` must be one of"):
        ec.TableConfig(10, 4, slot_dtype=np.float16)
    with pytest.raises(ValueError, match=r"Argument `stochastic_rounding` must be a boolean"):
        ec.TableConfig(10, 4, stochastic_rounding=1)


# -- checkpoints ----------------------------------------------------------------------------------------

def test_checkpoints_store_the_native_dtype_and_restore_it_bit_for_bit(tmp_path):
    emb = _two_tables(True, weights_dtype="bfloat16", slot_dtype="float16")
    tables, slots = _train(emb, steps=2)
    path = tmp_path / "c"
    emb.save(path)
    header, _, _ = read_header(str(next((tmp_path / "c").glob("*/table-0000.safetensors"))))
    assert header["weights"]["dtype"] == np.dtype(ml_dtypes.bfloat16)
    assert header["slot/accumulators"]["dtype"] == np.float16
    back = ec.Embedding.restore(path)
    _same_bits((back.embedding_tables, back.slot_variables), (tables, slots))
    assert back.tables["t_a"].weights_dtype == "bfloat16" and back.tables["t_a"].slot_dtype == "float16"
    # training goes on identically after the restore
    _same_bits(_train(back, steps=2, seed=1), _train(emb, steps=2, seed=1))


def test_loading_into_another_dtype_is_an_explicit_conversion(tmp_path):
    emb = _two_tables(True, weights_dtype="bfloat16")
    _train(emb, steps=1)
    emb.save(tmp_path / "c")
    f32 = _two_tables(True)
    before = _train(f32, steps=0)
    with pytest.raises(ec.CheckpointError, match="weights_dtype"):
        f32.load(tmp_path / "c")
    with pytest.raises(ec.CheckpointError, match=r"'t_a' weights is stored as bfloat16; the engine's is float32.*"
                                                 r"convert_dtypes=True"):
        f32.load(tmp_path / "c", strict=False)
    _same_bits((f32.embedding_tables, f32.slot_variables), before)
    f32.load(tmp_path / "c", convert_dtypes=True)
    assert np.array_equal(f32.embedding_tables["t_a"], emb.embedding_tables["t_a"].astype(np.float32))
    # and back: float32 values rounded to nearest into float16 tables; beyond its range is refused
    f32.embedding_tables["t_a"][3, 2] = 1e6
    f32.save(tmp_path / "big")
    f16 = _two_tables(True, weights_dtype="float16")
    with pytest.raises(ec.CheckpointError, match=r"'t_a' weights converted to float16.*rows \[3\]"):
        f16.load(tmp_path / "big", convert_dtypes=True)


def test_a_manifest_whose_dtypes_contradict_its_configuration_is_refused(tmp_path):
    emb = _two_tables(True, weights_dtype="float16")
    path = tmp_path / "c"
    emb.save(path)
    rewrite_manifest(tmp_path / "c", lambda text: text.replace('"weights_dtype": "float16"',
                                                               '"weights_dtype": "bfloat16"'))
    with pytest.raises(ec.CheckpointError, match=r"stores its weights as float16; its configuration says "
                                                 r"weights_dtype='bfloat16'"):
        ec.Embedding.restore(path)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_the_gather_in_registers_sums_as_the_gather_in_memory(name):
    """Rows of whole cache lines are summed in vector registers, converted as they are loaded; any bits
    (subnormals, infinities, NaN, -0.0) give the sums the element-by-element gather gives."""
    from embedcore.kernels.rows import gather_16_kernel
    rng = np.random.default_rng(3)
    for dim in (16, 32, 64, 128, 48):
        bits = rng.integers(0, 1 << 16, (300, dim), dtype=np.uint64).astype(np.uint16)
        rows = rng.integers(0, 300, 2000).astype(np.int64)
        ptr = np.sort(rng.integers(0, 2001, 201))
        ptr[0], ptr[-1] = 0, 2000
        for gains in (rng.normal(size=2000).astype(np.float32), None):
            fixed, any_length = np.empty((200, dim), np.float32), np.empty((200, dim), np.float32)
            gather_16_kernel(name, dim)(bits, rows, gains, ptr, fixed, 16)
            gather_16_kernel(name, None)(bits, rows, gains, ptr, any_length, 0)
            same = (fixed.view(np.uint32) == any_length.view(np.uint32)) | (np.isnan(fixed) & np.isnan(any_length))
            assert same.all(), (dim, gains is None)


def _row_kernels(name, stochastic):
    from embedcore.kernels.half_rows import row_loader, row_storer
    store, load = row_storer(name, stochastic), row_loader(name)

    @njit
    def in_registers(bits, values, out, keys):  # a constant row length of whole lines: vector registers
        stored = np.zeros(values.shape[0], np.bool_)
        for r in range(values.shape[0]):
            stored[r] = store(bits, r, values[r], keys[r], np.uint64(r * 5), None, None, 32)
            load(out[r], bits, r, 32)
        return stored

    @njit
    def value_by_value(bits, values, out, keys, dim):
        random_words, encoded = np.empty(8, np.uint64), np.empty(dim, np.uint16)
        stored = np.zeros(values.shape[0], np.bool_)
        for r in range(values.shape[0]):
            stored[r] = store(bits, r, values[r], keys[r], np.uint64(r * 5), random_words, encoded, dim)
            load(out[r], bits, r, dim)
        return stored
    return in_registers, value_by_value


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_rows_rounded_in_registers_are_the_rows_rounded_value_by_value(name, stochastic):
    """The update's 16-bit rows of whole cache lines are rounded, checked and stored in vector registers: the
    same bits as value by value (:func:`half.rounding_bits` words for the random bits), nothing stored when a
    value rounds to infinity or is not finite, and rows read back as float32 exactly."""
    in_registers, value_by_value = _row_kernels(name, stochastic)
    rng = np.random.default_rng(5)
    values = _interesting_float32(rng)[:64 * 32 * 40].astype(np.float32)
    rng.shuffle(values)
    values = values.reshape(-1, 32)
    values[::7, 5] = rng.choice(np.float32([np.inf, -np.inf, np.nan, 7e4, -1e38, 65519.0, 65520.0]), values[::7].shape[0])
    keys = rng.integers(0, 1 << 63, values.shape[0], dtype=np.uint64)
    start = rng.integers(0, 1 << 16, values.shape, dtype=np.uint64).astype(np.uint16)
    got, want = start.copy(), start.copy()
    out_got, out_want = np.empty(values.shape, np.float32), np.empty(values.shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        stored_got = in_registers(got, values, out_got, keys)
        stored_want = value_by_value(want, values, out_want, keys, np.int64(32))
    assert np.array_equal(stored_got, stored_want)
    assert 0 < stored_got.sum() < stored_got.shape[0]
    assert np.array_equal(got, want)
    assert np.array_equal(got[~stored_got], start[~stored_got])
    assert np.array_equal(out_got.view(np.uint32), out_want.view(np.uint32))
    decoded = got.view(DTYPES[name]).astype(np.float32)
    assert np.array_equal(np.isnan(decoded), np.isnan(out_got))
    assert np.array_equal(decoded[~np.isnan(decoded)].view(np.uint32), out_got[~np.isnan(out_got)].view(np.uint32))
