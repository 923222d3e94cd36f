"""What users declare and pass in (issue 24, items 4, 5, 12 and 14): every value that would put NaN/Inf into a
table, slot or row function is refused where it is declared, naming what and the value; a row function that
Numba could never compile is a ``RowFunctionError``; ids, dense shapes and sequence positions that the old
code truncated, summed or reported without the value are refused naming feature and value; and an engine
built after a global of its row function changed runs the new value. Refusals change nothing."""

import functools
import importlib
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore import compiler
from embedcore.compiler import RowFunctionError
from embedcore.initializers import fill_rows
from embedcore.inputs import InputError

from .harness import assert_unchanged, snapshot

F32_MAX = float(np.finfo(np.float32).max)
HUGE = [float("nan"), float("inf"), float("-inf"), 1e39, -1e39, 10 ** 400]
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _finite_in_float32(v) -> bool:
    """The oracle: NumPy's own float32 rounding of the value."""
    try:
        f = float(v)
    except OverflowError:
        return False
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.float32(f)))






def _sgd_row(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    return embedding_table - learning_rate * gradient


def _acc_row(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    acc = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * hyperparameters[0] * gradient / np.sqrt(acc), acc


# ------------------------------------------------------------------------------------- item 4: initial values

@pytest.mark.parametrize("value", HUGE, ids=repr)
@pytest.mark.parametrize("make, argument", [
    (lambda v: ec.Constant(v), "Constant: value"),
    (lambda v: ec.RandomUniform(v, 1.0) if v == v and v < 0 else ec.RandomUniform(-1.0, v), "RandomUniform: m"),
    (lambda v: ec.TruncatedNormal(mean=v), "TruncatedNormal: mean"),
    (lambda v: ec.TruncatedNormal(stddev=abs(v) if v == v else v), "TruncatedNormal: stddev"),
    (lambda v: ec.RowId(v), "RowId: offset"),
], ids=["constant", "uniform", "normal_mean", "normal_stddev", "row_id"])
def test_initializers_refuse_values_not_finite_in_float32(make, argument, value):
    with pytest.raises(ValueError, match=argument):
        make(value)


def test_truncated_normal_range_must_stay_finite_and_the_float32_maximum_is_fine():
    with pytest.raises(ValueError, match=r"TruncatedNormal: \|mean\| \+ 2 stddev .* got 4e\+38"):
        ec.TruncatedNormal(2e38, 1e38)
    with pytest.raises(ValueError, match=r"RandomUniform: minval .* got -1e\+39"):
        ec.RandomUniform(-1e39, 1e39)
    out = np.empty((3, 2), np.float32)
    fill_rows(ec.Constant(F32_MAX), out, 0, 3, 0, "t")
    assert np.all(out == np.float32(F32_MAX))
    fill_rows(ec.RandomUniform(-F32_MAX, F32_MAX), out, 0, 3, 0, "t")
    assert np.isfinite(out).all()


@SETTINGS
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 1100, 2 ** 1100),
                       st.floats(3.3e38, 3.5e38), st.floats(-3.5e38, -3.3e38)))
def test_a_constant_is_accepted_exactly_when_float32_holds_it(value):
    if _finite_in_float32(value):
        out = np.empty((2, 3), np.float32)
        fill_rows(ec.Constant(value), out, 0, 2, 0, "t")
        assert np.all(out == np.float32(float(value)))
        fill_rows(value, out, 0, 2, 0, "t", "slot")
        assert np.all(out == np.float32(float(value)))
    else:
        with pytest.raises(ValueError, match=r"Constant: value must be a finite float32 value"):
            ec.Constant(value)
        with pytest.raises(ValueError, match=r"initial value of slot 'slot' of table 't'"):
            fill_rows(value, np.empty((2, 3), np.float32), 0, 2, 0, "t", "slot")


@pytest.mark.parametrize("value", [float("nan"), 1e39, float("inf")], ids=repr)
@pytest.mark.parametrize("make, argument", [
    (lambda v: ec.Adagrad(0.1, initial_accumulator_value=v), "Adagrad: initial_accumulator_value"),
    (lambda v: ec.FTRL(0.1, initial_accumulator_value=v), "FTRL: initial_accumulator_value"),
    (lambda v: ec.RowwiseAdagrad(0.1, initial_accumulator_value=v), "RowwiseAdagrad: initial_accumulator_value"),
    (lambda v: ec.CustomOptimizer(_acc_row, 0.1, ["acc"], [v], [1.0]), r"slot_initializers\[0\]"),
], ids=["adagrad", "ftrl", "rowwise", "custom_slot"])
def test_initial_accumulators_must_be_finite_in_float32(make, argument, value):
    with pytest.raises(ValueError, match=argument):
        make(value)


def test_positive_values_must_stay_positive_in_float32():
    with pytest.raises(ValueError, match=r"Adam: epsilon must be positive in float32, got 1e-50"):
        ec.Adam(epsilon=1e-50)
    with pytest.raises(ValueError, match=r"Adagrad: initial_accumulator_value must be positive in float32"):
        ec.Adagrad(initial_accumulator_value=1e-60)
    with pytest.raises(ValueError, match=r"RowwiseAdagrad: initial_accumulator_value and epsilon cannot both be 0 "
                                         r"in float32"):
        ec.RowwiseAdagrad(initial_accumulator_value=1e-60, epsilon=1e-60)


def _engine(initializer=None, slot_initializer=0.1, vocabulary=6, dim=3):
    table = ec.TableConfig(vocabulary, dim, name="t", initializer=initializer)
    opt = ec.CustomOptimizer(_acc_row, 0.1, ["acc"], [slot_initializer], [1.0])
    return ec.Embedding({"f": ec.FeatureConfig(table, name="f")}, opt)


def _bad_at(row, value):
    def init(shape, dtype):
        out = np.zeros(shape, np.float64)
        out[row, -1] = value
        return out
    return init


@pytest.mark.parametrize("value", [float("nan"), 1e39, -float("inf")], ids=repr)
def test_a_callable_initializer_writing_non_finite_values_is_refused_naming_table_and_row(value):
    with pytest.raises(ValueError, match=r"for table 't' wrote .* to row 4"):
        _engine(initializer=_bad_at(4, value))
    with pytest.raises(ValueError, match=r"for slot 'acc' of table 't' wrote .* to row 2"):
        _engine(slot_initializer=_bad_at(2, value))
    # Every N-th row (a shard): the row named is the table's row, not the shard's.
    out = np.empty((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"for table 't' wrote .* to row 4"):
        fill_rows(_bad_at(4, value), out, 0, 6, 0, "t", stride=2)
    fill_rows(_bad_at(3, value), out, 0, 6, 0, "t", stride=2)  # row 3 is another shard's
    assert np.array_equal(out, np.zeros((3, 2), np.float32))


def test_an_initializer_subclass_and_non_numeric_callables_are_checked_by_what_they_write():
    class Broken(ec.initializers.Initializer):
        def fill(self, out, first_row, key, stride=1):
            out.fill(0.0)
            out[-1, 0] = np.inf

    with pytest.raises(ValueError, match=r"for table 't' wrote inf to row 5"):
        _engine(initializer=Broken())
    with pytest.raises(ValueError, match=r"returned an array of dtype <U1, expected real numbers"):
        _engine(initializer=lambda shape, dtype: np.full(shape, "x"))


# ----------------------------------------------------------------- item 14a: learning rates, hyperparameters

BUILTINS = [ec.SGD, ec.Adagrad, ec.AdagradMomentum, ec.Adam, ec.FTRL, ec.RowwiseAdagrad]


@pytest.mark.parametrize("cls", BUILTINS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", HUGE, ids=repr)
def test_constant_learning_rates_not_finite_in_float32_are_refused(cls, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: learning_rate must be a finite float32 value"):
        cls(learning_rate=value)
    with pytest.raises(ValueError, match=r"CustomOptimizer\(.*_sgd_row\): learning_rate must be a finite float32"):
        ec.CustomOptimizer(_sgd_row, learning_rate=value)
    with pytest.raises(ValueError, match=r"CustomOptimizer\(.*_acc_row\): hyperparameters\[0\] must be a finite"):
        ec.CustomOptimizer(_acc_row, 0.1, ["acc"], [0.1], [value])


@SETTINGS
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(3.3e38, 3.5e38)))
def test_a_learning_rate_is_accepted_exactly_when_float32_holds_it(value):
    if _finite_in_float32(value):
        lr, _ = ec.SGD(learning_rate=value).step_values(1)
        assert lr == np.float32(value)
    else:
        with pytest.raises(ValueError, match="SGD: learning_rate"):
            ec.SGD(learning_rate=value)


@pytest.mark.parametrize("make, fragment", [
    (lambda: ec.SGD(0.1, clip_weight_max=1e39), r"SGD: clip_weight_max must be a finite float32 value.*1e\+39"),
    (lambda: ec.Adagrad(0.1, clipvalue=(float("nan"), 1.0)), r"Adagrad: clipvalue_min must be a finite"),
    (lambda: ec.Adam(0.1, weight_decay_factor=float("inf")), r"weight_decay_factor must be a finite"),
    (lambda: ec.FTRL(0.1, beta=1e39), r"FTRL: beta must be a finite"),
    (lambda: ec.AdagradMomentum(0.1, momentum=float("nan")), r"Adagrad momentum: momentum must be a finite"),
    # Derived values, checked at construction: -1/exponent, Adam's bias-corrected rate, decay times the rate.
    (lambda: ec.AdagradMomentum(0.1, exponent=1e-39), r"-1 / exponent \(hyperparameter 7 of its row function\) evaluated to -1\.0*1?e\+39"),
    (lambda: ec.Adam(1e38, beta_1=0.999999, bias_correction=True), r"the learning rate of step 1 evaluated to"),
    (lambda: ec.SGD(1e30, weight_decay_factor=1e30, multiply_weight_decay_factor_by_learning_rate=True),
     r"weight_decay_factor \(times the learning rate\) evaluated to 1\.0*\d*e\+60"),
])
def test_hyperparameters_not_finite_in_float32_are_refused_at_construction(make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()


@pytest.mark.parametrize("make, fragment", [
    (lambda bad: ec.CustomOptimizer(_sgd_row, learning_rate=bad), r"CustomOptimizer.*learning_rate evaluated to"),
    (lambda bad: ec.CustomOptimizer(_acc_row, 0.1, ["acc"], [0.1], [bad]), r"hyperparameters\[0\] evaluated to"),
    (lambda bad: ec.Adagrad(learning_rate=bad), r"Adagrad.*learning_rate evaluated to"),
    # The rate is finite; the decay times the rate (1e30 * 1e30) is not, in float32 or at all.
    (lambda bad: ec.SGD(lambda: 1e30 if bad() else 0.0, weight_decay_factor=1e30,
                        multiply_weight_decay_factor_by_learning_rate=True),
     r"SGD.*weight_decay_factor \(times the learning rate\) evaluated to"),
], ids=["custom_lr", "custom_hyper", "adagrad_lr", "sgd_decay"])
@pytest.mark.parametrize("value", [1e39, float("nan"), -float("inf")], ids=repr)
def test_callables_evaluating_to_non_finite_values_are_refused_before_anything_changes(make, fragment, value):
    opt = make(lambda: value)
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(5, 2, name="t"), name="f")}, opt)
    acts, ctx = emb({"f": np.array([1, 3])})
    before = snapshot(emb)
    with pytest.raises(ValueError, match=fragment):
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
    assert_unchanged(emb, before)


# -------------------------------------------------------------- item 14b: what cannot be a row function at all

class _CallableObject:
    def __call__(self, gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table


@pytest.mark.parametrize("fn, fragment", [
    (print, r"builtins\.print is a builtin_function_or_method, not a Python function"),
    (len, r"builtins\.len is a builtin"),
    (np.add, r"is a ufunc, not a Python function"),
    (functools.partial(_sgd_row), r"is a partial, not a Python function"),
    (_CallableObject(), r"is a _CallableObject, not a Python function"),
    (dict, r"is a type, not a Python function"),
    (lambda g, w: w, r"<lambda> cannot be called with the five arguments .*too many positional"),
    (lambda g, w, s, lr, h, extra: w, r"<lambda> cannot be called with the five arguments .*missing"),
])
def test_what_numba_could_never_compile_is_a_row_function_error_at_construction(fn, fragment):
    with pytest.raises(RowFunctionError, match=fragment):
        ec.CustomOptimizer(fn)
    with pytest.raises(RowFunctionError, match=fragment):
        compiler.compile_row_function(fn, (), 0, 4)


def test_a_row_function_raising_on_a_trial_row_is_a_row_function_error():
    def raises(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        if learning_rate > 0:
            raise ValueError("no")
        return embedding_table

    with pytest.raises(RowFunctionError, match=r"raises.* raised ValueError on a trial row of 4 values"):
        compiler.compile_row_function(raises, (), 0, 4)


# ------------------------------------------------------------------------- item 5: the in-process kernel cache

MODULE = textwrap.dedent('''
    SCALE = 1.0

    def scaled(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - SCALE * learning_rate * gradient
''')


def test_a_new_engine_on_a_function_whose_global_changed_runs_the_new_value(tmp_path, monkeypatch):
    (tmp_path / "reliability_scaled_row.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("reliability_scaled_row")
    compiles = []
    real = compiler.compile_row_function
    monkeypatch.setattr(compiler, "compile_row_function", lambda *a: compiles.append(a[0]) or real(*a))

    def one_step():
        opt = ec.CustomOptimizer(module.scaled, learning_rate=0.5)
        table = ec.TableConfig(6, 3, name="t", initializer=ec.Zeros())
        emb = ec.Embedding({"f": ec.FeatureConfig(table, name="f")}, opt)
        acts, ctx = emb({"f": np.array([1, 4, 4])})
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
        return emb.embedding_tables["t"]

    def oracle(scale):
        counts = np.bincount([1, 4, 4], minlength=6).astype(np.float32)
        return np.repeat((-np.float32(scale) * np.float32(0.5) * counts)[:, None], 3, axis=1)

    try:
        np.testing.assert_array_equal(one_step(), oracle(1.0))
        first = len(compiles)
        np.testing.assert_array_equal(one_step(), oracle(1.0))
        assert len(compiles) == first  # unchanged: served from the in-process cache
        module.SCALE = 3.0
        np.testing.assert_array_equal(one_step(), oracle(3.0))
        assert len(compiles) == first + 1
        np.testing.assert_array_equal(one_step(), oracle(3.0))
        assert len(compiles) == first + 1
    finally:
        sys.modules.pop("reliability_scaled_row", None)


# ------------------------------------------------------------------------------- items 14c-e: batches

def _feature_engine():
    features = {"pooled": ec.FeatureConfig(ec.TableConfig(10, 2, name="p", initializer=ec.RowId(), combiner="sum"),
                                           name="pooled"),
                "seq": ec.FeatureConfig(ec.TableConfig(10, 2, name="s", initializer=ec.RowId()),
                                        max_sequence_length=3, name="seq")}
    return ec.Embedding(features, ec.SGD(0.1))


GOOD_SEQ = ec.Sparse([[0, 0]], [1], (1, 3))


@pytest.mark.parametrize("ids", [[1, 2 ** 64], [[1], [2 ** 64]], np.array([1, 2 ** 64], dtype=object),
                                 [[-2 ** 64]], [3, 10 ** 30]],
                         ids=["flat_list", "nested_list", "object_array", "negative", "huge"])
def test_ids_beyond_64_bits_are_refused_naming_feature_and_value(ids):
    emb = _feature_engine()
    before = snapshot(emb)
    flat = [v for x in ids for v in (x if isinstance(x, list) else [x])]
    bad = next(int(v) for v in flat if not -2 ** 63 <= int(v) < 2 ** 64)
    with pytest.raises(InputError, match=rf"feature 'pooled'.*{bad}.*does not fit in 64 bits"):
        emb({"pooled": ids, "seq": GOOD_SEQ})
    assert_unchanged(emb, before)


@pytest.mark.parametrize("ids", [[1, 2 ** 63], [[1, 2 ** 63]], [[2 ** 64 - 1]]])
def test_ids_of_64_bits_are_range_checked_as_ints_not_floats(ids):
    """Was: NumPy made ``[1, 2**63]`` float64, refused as 'must be integers, got dtype float64'."""
    bad = max(v for x in ids for v in (x if isinstance(x, list) else [x]))
    with pytest.raises(InputError, match=rf"feature 'pooled': id {bad} .*outside the table's vocabulary"):
        _feature_engine()({"pooled": ids, "seq": GOOD_SEQ})


@pytest.mark.parametrize("shape", [(2.9, 3), (2, 3.0), (True, 3), (2, np.bool_(True)), (-1, 3), (2, -3),
                                   (2,), (1, 2.0, 3), 5, "ab", (2 ** 40, 1), (2, 2 ** 40, 3)], ids=repr)
def test_bad_dense_shapes_are_refused_naming_the_feature(shape):
    emb = _feature_engine()
    with pytest.raises(InputError, match=r"sparse ids of feature 'pooled' must have a 2-D dense_shape of ints"):
        emb({"pooled": ec.Sparse([[0, 0]], [1], shape), "seq": GOOD_SEQ})


def test_a_high_dimensional_dense_shape_needs_indices_of_its_rank():
    """A dense_shape of rank 3 is a high-dimensional batch (tests/test_tensorflow_inputs.py): its indices
    have 3 columns; 2 are refused, naming the feature, as are samples beyond 2**40 in all."""
    emb = _feature_engine()
    with pytest.raises(InputError, match=r"feature 'pooled' need indices of shape \[N, 3\]"):
        emb({"pooled": ec.Sparse([[0, 0]], [1], (1, 2, 3)), "seq": GOOD_SEQ})
    with pytest.raises(InputError, match=r"feature 'pooled' with dense_shape \(1048576, 1048576, 1\) declare "
                                         r"1,099,511,627,776 samples"):
        emb({"pooled": ec.Sparse([[0, 0, 0]], [1], (2 ** 20, 2 ** 20, 1)), "seq": GOOD_SEQ})


def test_a_dense_shape_beyond_memory_is_refused_before_allocating(monkeypatch):
    import resource
    emb = _feature_engine()
    before = snapshot(emb)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"feature 'pooled' with dense_shape \(549755813888, 1\).*would take 8\.0 TiB"):
        emb({"pooled": ec.Sparse([[0, 0]], [1], (2 ** 39, 1)), "seq": GOOD_SEQ})
    took = time.perf_counter() - t0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 10_000  # KiB: nothing was allocated
    print(f"\ndense_shape (2**39, 1) refused in {took * 1e3:.2f} ms")
    # A sequence length times a declared batch size drives the occurrence offsets: checked the same way.
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(1 << 21))  # the row splits (1.6 MB) fit, 300,000 rows not
    with pytest.raises(InputError, match=r"occurrence offsets of 300,001 activation rows \(features \[.pooled., .seq.\]\) would take"):
        emb({"pooled": np.array([1]), "seq": ec.Sparse([[0, 0]], [1], (100_000, 3))})
    assert_unchanged(emb, before)


def test_a_sequence_position_given_twice_is_refused_and_pooled_duplicates_still_sum():
    emb = _feature_engine()
    before = snapshot(emb)
    dup = ec.Sparse([[1, 2], [0, 0], [1, 2]], [4, 5, 7], (2, 3))
    with pytest.raises(InputError, match=r"feature 'seq': sparse index \(1, 2\) is given twice \(ids 4 and 7\)"):
        emb({"pooled": np.array([1, 2]), "seq": dup})
    assert_unchanged(emb, before)
    acts, _ = emb({"pooled": dup, "seq": GOOD_SEQ})  # a bag: both ids count (table row r holds r)
    np.testing.assert_array_equal(acts["pooled"], np.array([[5, 5], [11, 11]], np.float32))


# ------------------------------------------------------------------------------ item 12: TableConfig sizes

@pytest.mark.parametrize("vocabulary, dim, fragment", [
    (2.0, 4, "vocabulary_size` must be an int"), (True, 4, "vocabulary_size` must be an int"),
    (0, 4, "vocabulary_size` must be an int and must be >= 1"), (-5, 4, ">= 1"),
    (10, 16.0, "`dim`"), (10, np.bool_(True), "`dim`"), (10, 0, "`dim`"), ("10", 4, "vocabulary_size"),
])
def test_table_sizes_are_refused_naming_the_table(vocabulary, dim, fragment):
    with pytest.raises(ValueError, match=rf"TableConfig 'users': .*{fragment}"):
        ec.TableConfig(vocabulary, dim, name="users")


def test_big_but_sane_table_configs_are_accepted_by_the_config():
    """Whether they fit in memory is the engine's question, asked when it allocates."""
    t = ec.TableConfig(10 ** 12, 16, name="big")
    assert (t.vocabulary_size, t.dim) == (10 ** 12, 16)
    assert ec.TableConfig(2 ** 70, 2 ** 40).vocabulary_size == 2 ** 70  # as tests/test_fuzz.py pins
    with pytest.raises(ValueError, match=r"max_sequence_length` must be an int and must be >= 0"):
        ec.FeatureConfig(t, max_sequence_length=2 ** 31)


def test_a_callable_learning_rate_must_take_no_arguments():
    with pytest.raises(ValueError, match=r"SGD: learning_rate must be a float or a zero-argument callable; .* cannot "
                                         r"be called without arguments"):
        ec.SGD(learning_rate=lambda step: 0.1)
    with pytest.raises(ValueError, match=r"hyperparameters\[0\] must be a float or a zero-argument callable"):
        ec.CustomOptimizer(_acc_row, 0.1, ["acc"], [0.1], [lambda a, b: 1.0])
    assert ec.SGD(learning_rate=lambda scale=2.0: 0.1 * scale).step_values(1)[0] == np.float32(0.2)
