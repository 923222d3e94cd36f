"""16-bit activations (``Embedding(output_dtype=...)``): every lookup's activations are the float32-output
engine's, cast to the format (``.astype``: to nearest, ties to even; float16 overflow to infinity), bit for
bit, whatever the tables' formats, combiners, weights, row lengths, stacking, streaming, dynamic tables and
``training``; the option survives copies, pickles and ``restore``; bad values are refused."""

import copy
import pickle

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import embedcore as ec

from .covering import pairs
from .harness import as_input, random_samples, random_weights

OUTPUTS = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TABLE_DTYPES = ("float32", "float16", "bfloat16")
VOCABULARY = 300


def _features(dim, weights_dtype, dynamic=False):
    """Three tables of one ``dim`` (stacked: same optimizer and storage), one per combiner, and a sequence
    feature; a dynamic table with admission (keys not admitted yet read their initial values) if asked."""
    if dynamic:
        make = lambda combiner: ec.DynamicTableConfig(
            dim, 512, name=combiner, combiner=combiner, weights_dtype=weights_dtype,
            admission=ec.CountAdmission(min_count=2), eviction=ec.LRU())
    else:
        make = lambda combiner: ec.TableConfig(VOCABULARY, dim, name=combiner, combiner=combiner,
                                               weights_dtype=weights_dtype)
    tables = {c: make(c) for c in ("sum", "mean", "sqrtn")}
    features = {c: ec.FeatureConfig(t) for c, t in tables.items()}
    features["seq"] = ec.FeatureConfig(tables["mean"], max_sequence_length=4)
    return features


def _pair(output, dim, weights_dtype, dynamic=False, **options):
    """``(engine with output_dtype=output, the same engine with float32 output)``: same seed, same tables."""
    return tuple(ec.Embedding(_features(dim, weights_dtype, dynamic), ec.Adagrad(0.1), seed=3,
                              output_dtype=out, **options) for out in (output, "float32"))


def _batch(rng, weighted, keys=VOCABULARY):
    """Ragged ids with duplicates and empty samples, weighted or not, for every feature of :func:`_features`."""
    ids, weights = {}, {}
    for f in ("sum", "mean", "sqrtn", "seq"):
        samples = random_samples(rng, 37, keys, 9, rng.integers(0, keys, 3))
        ids[f], weights[f] = as_input(samples, random_weights(rng, samples) if weighted else None, "ragged")
    return ids, (weights if weighted else None)


def _assert_cast(got, want32, output):
    """``got`` is exactly ``want32`` (float32 activations) cast to ``output``, and that cast is not a no-op
    nor a truncation (so a kernel that truncates, or does not round at all, fails)."""
    dtype = OUTPUTS[output]
    assert got.dtype == dtype and want32.dtype == np.float32 and got.shape == want32.shape
    with np.errstate(over="ignore"):
        want = want32.astype(dtype)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    return want


def _rounding_mattered(got, want32, output):
    """Whether some activation is not a 16-bit value and some was rounded up in magnitude (truncating
    would have given another bit pattern)."""
    widened = got.astype(np.float32)
    finite = np.isfinite(widened)
    return bool((widened[finite] != want32[finite]).any() and
                (np.abs(widened[finite]) > np.abs(want32[finite])).any())


# A gather kernel is compiled per (stored format, output format, row length of whole cache lines): those axes
# are covered pairwise (tests/covering.py), not as their full product.
@pytest.mark.parametrize("output,weights_dtype,dim", pairs(sorted(OUTPUTS), TABLE_DTYPES, [5, 16, 24, 64]))
def test_activations_are_the_float32_ones_cast(output, weights_dtype, dim):
    emb, f32 = _pair(output, dim, weights_dtype)
    assert emb.num_physical_tables == 1  # the three tables stacked
    rng = np.random.default_rng(dim)
    rounded = False
    for weighted in (False, True, False):
        ids, weights = _batch(rng, weighted)
        (got, _), (want, _) = emb(ids, weights), f32(ids, weights)
        for f in ids:
            _assert_cast(got[f], want[f], output)
            rounded |= _rounding_mattered(got[f], want[f], output)
    assert rounded


@pytest.mark.parametrize("output", sorted(OUTPUTS))
def test_unstacked_tables_and_read_only_lookups_too(output):
    emb, f32 = _pair(output, 16, "bfloat16", stack_tables=False)
    assert emb.num_physical_tables == 3
    rng = np.random.default_rng(1)
    for training in (True, False):
        ids, weights = _batch(rng, True)
        (got, _), (want, _) = emb(ids, weights, training=training), f32(ids, weights, training=training)
        for f in ids:
            _assert_cast(got[f], want[f], output)


@pytest.mark.parametrize("output,weights_dtype,dim", pairs(sorted(OUTPUTS), TABLE_DTYPES, [5, 16, 64]))
def test_activations_streamed_past_the_caches_are_the_same(output, weights_dtype, dim):
    """``Tuning(stream_activations_min_bytes=0)`` streams every lookup whose rows are whole cache lines of
    float32 (16-bit activation blocks of 16 values are half a line): the same bits."""
    emb, f32 = _pair(output, dim, weights_dtype, tuning=ec.Tuning(stream_activations_min_bytes=0))
    through = ec.Embedding(_features(dim, weights_dtype), ec.Adagrad(0.1), seed=3, output_dtype=output)
    rng = np.random.default_rng(7)
    for weighted in (False, True):
        ids, weights = _batch(rng, weighted)
        (got, _), (want, _), (unstreamed, _) = emb(ids, weights), f32(ids, weights), through(ids, weights)
        for f in ids:
            _assert_cast(got[f], want[f], output)
            assert np.array_equal(got[f].view(np.uint16), unstreamed[f].view(np.uint16))


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("output", sorted(OUTPUTS))
def test_dynamic_tables_round_the_sum_with_the_unadmitted_keys_initial_values(output, weights_dtype):
    """A dynamic table's activation adds the sum of its admitted rows and that of its pending keys' initial
    values in float32, then rounds once: training lookups (which admit keys) and read-only ones alike, the
    two engines admitting, evicting and training in lockstep."""
    emb, f32 = _pair(output, 16, weights_dtype, dynamic=True)
    rng = np.random.default_rng(11)
    for step in range(4):
        ids, weights = _batch(rng, step % 2 == 1, keys=120)
        (got, ctx), (want, ctx32) = emb(ids, weights), f32(ids, weights)
        for f in ids:
            _assert_cast(got[f], want[f], output)
        grads = {f: rng.normal(0, 0.5, a.shape).astype(np.float32) for f, a in want.items()}
        emb.apply_gradients(grads, ctx)
        f32.apply_gradients(grads, ctx32)
        ids, weights = _batch(rng, True, keys=200)
        (got, _), (want, _) = emb(ids, weights, training=False), f32(ids, weights, training=False)
        for f in ids:
            _assert_cast(got[f], want[f], output)


@pytest.mark.parametrize("output", sorted(OUTPUTS))
def test_training_from_16_bit_activations_is_training_from_float32_ones(output):
    """The option changes only what lookups return: the context and the update are the same."""
    emb, f32 = _pair(output, 24, "float32")
    rng = np.random.default_rng(5)
    for _ in range(3):
        ids, weights = _batch(rng, True)
        (got, ctx), (want, ctx32) = emb(ids, weights), f32(ids, weights)
        for f in ids:
            _assert_cast(got[f], want[f], output)
        grads = {f: rng.normal(0, 0.5, a.shape).astype(np.float32) for f, a in want.items()}
        emb.apply_gradients(grads, ctx)
        f32.apply_gradients(grads, ctx32)
    for name, table in f32.embedding_tables.items():
        assert np.array_equal(emb.embedding_tables[name], table)


def _single(values, output, combiner="sum"):
    """An engine over one float32 table holding ``values`` (a ``[rows, dim]`` array) with ``output``."""
    table = ec.TableConfig(values.shape[0], values.shape[1], name="t", combiner=combiner,
                           initializer=lambda shape, dtype: values)
    return ec.Embedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1), output_dtype=output)


@pytest.mark.parametrize("output, mantissa_bits", [("float16", 10), ("bfloat16", 7)])
def test_ties_round_to_even(output, mantissa_bits):
    """Midpoints between two 16-bit neighbours of 1 go to the one with an even last bit, either way:
    ``1 + ulp/2`` down to 1, ``1 + 3 ulp/2`` up to ``1 + 2 ulp``; just above a midpoint rounds up."""
    ulp = 2.0 ** -mantissa_bits
    values = np.float32([[1 + ulp / 2, -(1 + ulp / 2), 1 + 3 * ulp / 2, np.nextafter(np.float32(1 + ulp / 2), 2)]])
    emb = _single(values, output)
    acts, _ = emb({"f": np.zeros((1, 1), np.int64)})
    assert acts["f"].astype(np.float64).tolist() == [[1.0, -1.0, 1 + 2 * ulp, 1 + ulp]]


def test_float16_overflow_is_infinity_as_the_cast_makes_it():
    """A float32 activation beyond float16's range becomes infinity (as ``astype``); bfloat16 keeps it."""
    values = np.float32([[40000.0, -40000.0, 30000.0, 1.0]])
    f16, bf16 = _single(values, "float16"), _single(values, "bfloat16")
    ids = {"f": np.zeros((1, 2), np.int64)}  # each value twice: 80000, -80000, 60000, 2
    assert f16(ids)[0]["f"].astype(np.float32).tolist() == [[np.inf, -np.inf, 60000.0, 2.0]]
    assert bf16(ids)[0]["f"].astype(np.float32).tolist() == [[79872.0, -79872.0, 59904.0, 2.0]]


def test_empty_bags_are_zeros_and_empty_batches_have_the_dtype():
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 16, name="t"))}, output_dtype="bfloat16")
    acts, _ = emb({"f": ec.Ragged.from_lists([[], [3], []], np.int64)})
    assert acts["f"].dtype == OUTPUTS["bfloat16"] and acts["f"].shape == (3, 16)
    assert not acts["f"][[0, 2]].astype(np.float32).any()
    empty, _ = emb({"f": ec.Ragged.from_lists([], np.int64)})
    assert empty["f"].dtype == OUTPUTS["bfloat16"] and empty["f"].shape == (0, 16)


def test_copies_pickles_and_restores_keep_the_option(tmp_path):
    emb = ec.Embedding(_features(16, "float32"), ec.Adagrad(0.1), seed=3, output_dtype="float16")
    assert "output_dtype='float16'" in repr(emb)
    assert "output_dtype" not in repr(ec.Embedding(_features(16, "float32"), ec.Adagrad(0.1)))
    rng = np.random.default_rng(0)
    ids, weights = _batch(rng, True)
    want, _ = emb(ids, weights)
    for other in (copy.deepcopy(emb), pickle.loads(pickle.dumps(emb))):
        assert other.output_dtype == "float16"
        got, _ = other(ids, weights)
        for f in ids:
            assert got[f].dtype == np.float16 and np.array_equal(got[f].view(np.uint16), want[f].view(np.uint16))
    emb.save(str(tmp_path / "ckpt"))
    assert ec.Embedding.restore(str(tmp_path / "ckpt")).output_dtype == "float32"  # a checkpoint stores none
    restored = ec.Embedding.restore(str(tmp_path / "ckpt"), output_dtype="float16")
    got, _ = restored(ids, weights)
    for f in ids:
        assert np.array_equal(got[f].view(np.uint16), want[f].view(np.uint16))


@pytest.mark.parametrize("bad", ["float64", "half", "bf16", "int8", np.float16, None, 16, ""])
def test_other_output_dtypes_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="output_dtype must be one of") as caught:
        ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 4))}, output_dtype=bad)
    assert repr(bad)[:20] in str(caught.value)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(output=st.sampled_from(sorted(OUTPUTS)), weights_dtype=st.sampled_from(TABLE_DTYPES),
       dim=st.sampled_from([1, 3, 16, 24, 32]), combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
       scale=st.sampled_from([1e-6, 1.0, 1e3, 3e4]), data=st.data())
def test_any_lookup_is_the_float32_lookup_cast(output, weights_dtype, dim, combiner, scale, data):
    """Any table format, row length, combiner, magnitude (float16's subnormals to its overflow) and batch."""
    rows = data.draw(st.integers(1, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    values = np.clip(rng.standard_normal((rows, dim)) * scale, -60000, 60000).astype(np.float32)  # a float16 table's
    table = lambda out: ec.Embedding(
        {"f": ec.FeatureConfig(ec.TableConfig(rows, dim, name="t", combiner=combiner, weights_dtype=weights_dtype,
                                              initializer=lambda shape, dtype: values))}, output_dtype=out)
    emb, f32 = table(output), table("float32")
    samples = data.draw(st.lists(st.lists(st.integers(0, rows - 1), max_size=7), min_size=1, max_size=12))
    weighted = data.draw(st.booleans())
    ids, weights = as_input(samples, random_weights(rng, samples) if weighted else None, "ragged")
    (got, _), (want, _) = emb({"f": ids}, None if weights is None else {"f": weights}), \
        f32({"f": ids}, None if weights is None else {"f": weights})
    _assert_cast(got["f"], want["f"], output)
