"""Hypothesis fuzz tests of embedcore's input handling, checked against the NumPy oracle.

Every generated batch either works, and then the activations and the tables and slots after
``apply_gradients`` match ``tests/reference.py``, or it is refused with ``embedcore.InputError`` (a
``ValueError``; plain ``ValueError`` for configuration errors) whose message names the feature (and the
offending value where there is one), with tables, slots and ``step`` bit-identical to before. Any other
exception (``TypeError``, ``IndexError``, ``OverflowError``, a NumPy ``ValueError``...) fails a test.

What is generated (``tests/fuzz_strategies.py``):

* structures: a dict holding a list holding a tuple of features, a single feature at the root, a tuple of
  ``output_shape`` features; inputs given with lists and tuples swapped; weights ``None``, or mirroring
  the features with ``None`` leaves;
* forms: lists of lists (inner lists, tuples or arrays), flat lists, ``[B]`` and ``[B, k]`` arrays,
  ``ec.Ragged``, ``ec.Sparse`` in shuffled order (gapped positions, wide ``dense_shape``); all integer
  dtypes for ids, splits and indices; float16/32/64/longdouble and integer weights; C, Fortran, strided,
  reversed, read-only and byte-swapped arrays;
* batches: B = 0, empty samples, all-duplicate ids, a one-row vocabulary, samples of 10,000 ids, sequence
  features truncated to ``max_sequence_length``, ``output_shape``; weights with zero sums (for ``mean``),
  zeros, negatives, every combiner;
* bad input: ids out of range (``-1``, ``vocabulary_size``, int64/uint64 extremes, uint64 values that are
  negative after a cast), float/bool/complex/object/string/datetime ids, ranks 0 and 3, broken
  ``row_splits`` and sparse indices, weights that do not mirror the ids, NaN/Inf weights, bad weight
  dtypes, broken structures, batches that do not fit ``output_shape``;
* gradients: float16/32/64/longdouble, byte-swapped, Fortran, strided, reversed and read-only arrays; bad:
  NaN/Inf anywhere, wrong shapes and dtypes, non-arrays, broken structures, an already used context;
* configuration values for ``TableConfig``, ``FeatureConfig`` and ``Embedding``.

Besides the random tests, every (input form, corruption) pair, ``vocabulary_size`` and -1 as ids of every
feature in every form, 10,000-id samples and empty batches in every form, zero weight sums with every
combiner and every gradient dtype/layout are checked on each run. All engines use Adagrad (slots), so
one Numba update kernel is compiled per process, and two more for the ``half`` engine: the nested
configuration in 16 bits (issue 28; bfloat16 rows and slots rounded stochastically, stacked; a float16
table rounded to nearest), checked against the same oracle within one 16-bit gap, refusals bit for bit.

Bugs the fuzzer found are fixed; their inputs are back in the random generators, and the
``test_regression_*`` tests keep one minimal case of each bug found and fixed so far.

Runtime: the default run is derandomized (the same examples on every run) and does not shrink; it takes
about 50 s on a loaded 2-core machine, a third of it compiling. A longer run is random, shrinks failures,
and multiplies every ``max_examples`` by ``EMBEDCORE_FUZZ_EXAMPLES`` (x20: about 7,000 examples, 16 min)::

    EMBEDCORE_FUZZ_EXAMPLES=50 python -m pytest -q tests/test_fuzz.py

Engines are built once per process and reused; each example resets the tables and slots to values drawn
from its own seed, so every example is independent and reproducible.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

import embedcore as ec

from . import reference as ref
from .fuzz_strategies import (ARRAY_LAYOUTS, FLOAT_DTYPES, FORMS, HUGE_VALENCY, INT_DTYPES, FeatureSpec, Leaf,
                              corrupt_leaf, gradient_st, layout, leaf_st, make_leaf)
from .harness import assert_unchanged, snapshot

FACTOR = float(os.environ.get("EMBEDCORE_FUZZ_EXAMPLES") or 1)
EPS = 2.0 ** -24   # float32 unit roundoff


def fuzz(n):
    """Settings for a fuzz test of ``n`` examples (times EMBEDCORE_FUZZ_EXAMPLES).

    The default run is derandomized and does not shrink (shrinking these examples can take minutes; the
    failing example is printed and a rerun repeats it); a longer run is random and shrinks.
    """
    extra = dict(derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]) if FACTOR == 1 else {}
    return settings(max_examples=max(1, int(n * FACTOR)), deadline=None, print_blob=True,
                    suppress_health_check=list(HealthCheck), **extra)


# ----------------------------------------------------------------------------------------------------------
# Test engines ("rigs"), built once per process.

# Every rig uses Adagrad (slots; proven element-wise), with a different learning rate per physical table:
# one row function means one Numba update kernel to compile, which is most of this file's runtime.
OPT_ADAGRAD = ec.Adagrad(0.1)
OPT_ONE = ec.Adagrad(0.3)
OPT_ROOT = ec.Adagrad(0.2)
OPT_SHAPED = ec.Adagrad(0.05)
ORACLE = {ec.Adagrad: ("adagrad", ref.adagrad), ec.SGD: ("sgd", ref.sgd),
          ec.RowwiseAdagrad: ("rowwise", ref.rowwise_adagrad)}


def flatten_config(node, path=""):
    """``[(path, FeatureConfig)]`` in the engine's order (dict keys sorted as strings)."""
    if isinstance(node, dict):
        return [x for k in sorted(node, key=str) for x in flatten_config(node[k], f"{path}/{k}" if path else str(k))]
    if isinstance(node, (list, tuple)):
        return [x for i, v in enumerate(node) for x in flatten_config(v, f"{path}/{i}" if path else str(i))]
    return [(path or "<root>", node)]


def mirror(config, leaves, flip=False):
    """``leaves`` arranged like ``config``; ``flip`` swaps lists and tuples."""
    it = iter(leaves)

    def build(node):
        if isinstance(node, dict):
            return {k: build(node[k]) for k in sorted(node, key=str)}
        if isinstance(node, (list, tuple)):
            items = [build(v) for v in node]
            return tuple(items) if isinstance(node, tuple) != flip else items
        return next(it)

    out = build(config)
    assert next(it, StopIteration) is StopIteration
    return out


def leaves_like(config, value):
    """The leaves of ``value`` (which must mirror ``config`` exactly: same container types and keys)."""
    if isinstance(config, dict):
        assert isinstance(value, dict) and set(value) == set(config), (type(value), config)
        return [x for k in sorted(config, key=str) for x in leaves_like(config[k], value[k])]
    if isinstance(config, (list, tuple)):
        assert type(value) is type(config) and len(value) == len(config), (type(value), type(config))
        return [x for c, v in zip(config, value) for x in leaves_like(c, v)]
    return [value]


class Rig:
    """An engine, its feature specs and the oracle of each table."""

    def __init__(self, config, optimizer, **kwargs):
        self.config = config
        self.emb = ec.Embedding(config, optimizer, **kwargs)
        self.specs = []
        for path, fc in flatten_config(config):
            t = fc.table
            self.specs.append(FeatureSpec(path, fc.name or path, t.name, t.vocabulary_size, t.dim, t.combiner,
                                          fc.max_sequence_length, fc.output_shape))
        self.oracle, self.stored = {}, {}
        for _, fc in flatten_config(config):
            opt = fc.table.optimizer or optimizer
            self.oracle[fc.table.name] = ORACLE[type(opt)] + (opt.learning_rate,)
            self.stored[fc.table.name] = (fc.table.weights_dtype, fc.table.slot_dtype)

    def reset(self, seed):
        rng = np.random.default_rng(seed)  # 16-bit tables take the float32 values rounded to nearest
        for table in self.emb.embedding_tables.values():
            table[...] = rng.uniform(-1, 1, table.shape).astype(np.float32)
        for slots in self.emb.slot_variables.values():
            for slot in slots.values():
                slot[...] = rng.uniform(0.1, 1.0, slot.shape).astype(np.float32)


# 16 bits (the "half" rig): user and item (stacked) as bfloat16 rows and slots rounded stochastically, the
# one-row table as float16 rows rounded to nearest (Adagrad moves a row by at most its learning rate, so
# float16 rows never overflow; float16 accumulators would, on the fuzzer's 2**39 weights).
HALF_STORAGE = {"user": dict(weights_dtype="bfloat16", slot_dtype="bfloat16"),
                "item": dict(weights_dtype="bfloat16", slot_dtype="bfloat16"),
                "one": dict(weights_dtype="float16", stochastic_rounding=False)}
MANTISSA_BITS = {"float16": 10, "bfloat16": 7}
SMALLEST_GAP = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}


def gap16(values, dtype):
    """An upper bound of the gap between the 16-bit values of ``dtype`` around ``values`` (0 for float32)."""
    if dtype == "float32":
        return np.zeros_like(values, dtype=np.float64)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.maximum(np.abs(values), SMALLEST_GAP[dtype])))
    return np.maximum(2.0 ** (exponent + 1 - MANTISSA_BITS[dtype]), SMALLEST_GAP[dtype])


def _nested_config(storage=None):
    storage = storage or {}
    user = ec.TableConfig(37, 4, combiner="mean", name="user", **storage.get("user", {}))
    item = ec.TableConfig(20, 4, combiner="sum", name="item", **storage.get("item", {}))
    one = ec.TableConfig(1, 2, combiner="sqrtn", name="one", optimizer=OPT_ONE,  # a one-row vocabulary
                         **storage.get("one", {}))
    return {"user": ec.FeatureConfig(user, name="user_ids"),
            "ctx": [ec.FeatureConfig(item, max_sequence_length=3, name="item_seq"),
                    (ec.FeatureConfig(one), ec.FeatureConfig(item), ec.FeatureConfig(user, max_sequence_length=1))]}


RIG_BUILDERS = {
    # dict / list / tuple; user and item stacked into one physical table, the one-row table apart.
    "nested": lambda: Rig(_nested_config(), OPT_ADAGRAD),
    "nested_unstacked": lambda: Rig(_nested_config(), OPT_ADAGRAD, stack_tables=False),
    "half": lambda: Rig(_nested_config(HALF_STORAGE), OPT_ADAGRAD, seed=5),
    # one feature at the root (its path is "<root>"), sqrtn.
    "root": lambda: Rig(ec.FeatureConfig(ec.TableConfig(13, 3, combiner="sqrtn", name="solo")), OPT_ROOT),
    # output_shape: a pooled and a sequence feature, both needing B = 6.
    "shaped": lambda: Rig((ec.FeatureConfig(ec.TableConfig(9, 2, name="a"), output_shape=(2, 3), name="grid"),
                           ec.FeatureConfig(ec.TableConfig(9, 2, name="a_seq"), max_sequence_length=2,
                                            output_shape=(3, 2, 2), name="seq_grid")), OPT_SHAPED),
}
_RIGS = {}


def rig(key) -> Rig:
    if key not in _RIGS:
        _RIGS[key] = RIG_BUILDERS[key]()
    return _RIGS[key]


# ----------------------------------------------------------------------------------------------------------
# State snapshots and refusals.





def expect_refusal(emb, call, fragments, error=ec.InputError):
    """``call()`` raises ``error`` whose message holds every fragment, and changes nothing."""
    snap = snapshot(emb)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the message {message!r}"
    assert_unchanged(emb, snap)
    return message


# ----------------------------------------------------------------------------------------------------------
# The oracle step.

def _abs_occurrences(leaf, spec):
    """Per sample: (ids, |gain|) of the occurrences that reach the activations (truncated for sequences)."""
    out = []
    for ids, ws in zip(leaf.samples, leaf.oracle_w):
        if spec.seq_len:
            ids, gains = ids[:spec.seq_len], ws[:spec.seq_len]
        else:
            gains = ref.combine_gains(ws, spec.combiner)
        out.append((np.asarray(ids, np.int64), np.abs(np.asarray(gains, np.float64))))
    return out


def _activation_bound(leaf, spec, abs_table):
    """sum of |gain| * |row| per activation entry: the scale of float32 rounding errors."""
    bound = np.zeros(spec.oracle_shape(leaf.batch_size))
    for b, (ids, gains) in enumerate(_abs_occurrences(leaf, spec)):
        terms = gains[:, None] * abs_table[ids]
        if spec.seq_len:
            bound[b, :len(ids)] = terms
        else:
            bound[b] = terms.sum(0)
    return bound


def _gradient_bound(leaf, spec, abs_d_act, bound, count):
    """Add sum of |gain| * |d_act| per table entry to ``bound`` and the occurrences per row to ``count``."""
    for b, (ids, gains) in enumerate(_abs_occurrences(leaf, spec)):
        rows = abs_d_act[b, :len(ids)] if spec.seq_len else abs_d_act[b][None, :]
        np.add.at(bound, ids, gains[:, None] * rows)
        np.add.at(count, ids, 1)


def check_activations(rig_, leaves, acts, tables0):
    for spec, leaf, act in zip(rig_.specs, leaves, acts):
        b = leaf.batch_size
        assert isinstance(act, np.ndarray) and act.dtype == np.float32, (spec.name, type(act))
        assert act.shape == spec.act_shape(b), (spec.name, act.shape, spec.act_shape(b))
        table = tables0[spec.table].astype(np.float64)
        want = ref.lookup(table, leaf.samples, leaf.oracle_w, spec.combiner, spec.seq_len)
        bound = _activation_bound(leaf, spec, np.abs(table))
        n = max([len(s) for s in leaf.samples] + [1])
        tol = 4 * (n + 2) * EPS * bound + 1e-6
        got = act.reshape(spec.oracle_shape(b)).astype(np.float64)
        bad = ~(np.abs(got - want) <= tol)
        assert not bad.any(), (f"activations of {spec.name!r} differ from the oracle at "
                               f"{np.argwhere(bad)[:5].tolist()}: got {got[bad][:5]}, want {want[bad][:5]}; "
                               f"{leaf.describe()}")


def check_update(rig_, leaves, grads64, tables0, slots0, step):
    emb = rig_.emb
    by_table = {}
    for spec, leaf, g in zip(rig_.specs, leaves, grads64):
        by_table.setdefault(spec.table, []).append((spec, leaf, g))
    for tname, table0 in tables0.items():
        kind, update, lr = rig_.oracle[tname]
        vocab, dim = table0.shape
        grad = np.zeros((vocab, dim))
        bound = np.zeros((vocab, dim))
        count = np.zeros(vocab)
        touched = np.zeros(vocab, bool)
        for spec, leaf, g in by_table.get(tname, []):
            g = g.reshape(spec.oracle_shape(leaf.batch_size))
            ref.dense_gradient(vocab, dim, leaf.samples, leaf.oracle_w, spec.combiner, spec.seq_len, g, grad)
            _gradient_bound(leaf, spec, np.abs(g), bound, count)
            ref.touched_rows(vocab, leaf.samples, spec.seq_len, touched)
        w0 = table0.astype(np.float64)
        s0 = [s.astype(np.float64) for s in slots0[tname].values()]
        want_w, want_s = ref.apply(update, grad, w0, s0, touched, lr, {}, step)
        gerr = 4 * (count[:, None] + 2) * EPS * bound
        dw = np.abs(want_w - w0)
        round_w = 8 * EPS * (np.abs(w0) + dw) + 1e-7
        if kind == "sgd":
            tol_w, tol_s = lr * gerr + round_w, []
        elif kind == "adagrad":
            tol_w = lr / np.sqrt(s0[0]) * gerr + round_w
            tol_s = [2 * (np.abs(grad) + gerr) * gerr + 4 * EPS * want_s[0] + 1e-7]
        else:
            tol_w = (1 + math.sqrt(dim)) * lr / np.sqrt(s0[0])[:, None] * gerr.max(1, keepdims=True) + round_w
            tol_s = [np.mean(2 * (np.abs(grad) + gerr) * gerr, 1) + 4 * EPS * want_s[0] + 1e-7]
        weights_dtype, slot_dtype = rig_.stored[tname]  # 16 bits: the stored value is a neighbour of float32's
        tol_w = tol_w + gap16(np.abs(want_w) + tol_w, weights_dtype)
        tol_s = [t + gap16(np.abs(w) + t, slot_dtype) for t, w in zip(tol_s, want_s)]
        got_w = emb.embedding_tables[tname]
        assert got_w[~touched].tobytes() == table0[~touched].tobytes(), f"untouched rows of {tname} changed"
        bad = ~(np.abs(got_w.astype(np.float64) - want_w) <= tol_w)
        assert not bad.any(), (f"table {tname} differs from the oracle at {np.argwhere(bad)[:5].tolist()}: got "
                               f"{got_w[bad][:5]}, want {want_w[bad][:5]}")
        for (sname, got_s), want, tol, before in zip(emb.slot_variables[tname].items(), want_s, tol_s,
                                                      slots0[tname].values()):
            assert got_s[~touched].tobytes() == before[~touched].tobytes(), f"untouched slot rows {tname}/{sname}"
            bad = ~(np.abs(got_s.astype(np.float64) - want) <= tol)
            assert not bad.any(), (f"slot {tname}/{sname} differs from the oracle at {np.argwhere(bad)[:5].tolist()}: "
                                   f"got {got_s[bad][:5]}, want {want[bad][:5]}")


def inputs_of(rig_, leaves, flip=False, weights_style="mirror"):
    features = mirror(rig_.config, [leaf.ids for leaf in leaves], flip)
    w = [leaf.weights for leaf in leaves]
    weights = None if weights_style == "none" and all(x is None for x in w) else mirror(rig_.config, w, flip)
    return features, weights


def _note(message):
    try:
        note(message)
    except Exception:   # outside a Hypothesis test
        pass


def lookup_checked(rig_, leaves, flip=False, weights_style="mirror"):
    emb = rig_.emb
    for leaf in leaves:
        _note(leaf.describe())
    tables0, slots0, step0 = snapshot(emb)
    features, weights = inputs_of(rig_, leaves, flip, weights_style)
    acts, ctx = emb.lookup(features, weights)
    assert emb.step == step0
    act_leaves = leaves_like(rig_.config, acts)
    check_activations(rig_, leaves, act_leaves, tables0)
    return act_leaves, ctx, (tables0, slots0, step0)


def apply_checked(rig_, leaves, grads, grads64, ctx, before, flip=False):
    emb = rig_.emb
    tables0, slots0, step0 = before
    emb.apply_gradients(mirror(rig_.config, grads, flip), ctx)
    assert emb.step == step0 + 1
    check_update(rig_, leaves, grads64, tables0, slots0, emb.step)


@st.composite
def batch_st(draw, rig_, batch_size=None):
    b = draw(st.integers(0, 9)) if batch_size is None else batch_size
    return [draw(leaf_st(spec, spec.fixed_batch if spec.fixed_batch is not None else b)) for spec in rig_.specs]


def draw_gradients(data, act_leaves):
    pairs = [data.draw(gradient_st(a.shape)) for a in act_leaves]
    return [p[0] for p in pairs], [p[1] for p in pairs]


RIG_KEYS = list(RIG_BUILDERS)


# ----------------------------------------------------------------------------------------------------------
# Valid input: activations and updates match the oracle.

@pytest.mark.parametrize("key", RIG_KEYS)
@fuzz(10)
@given(data=st.data())
def test_valid_batches_match_oracle(key, data):
    r = rig(key)
    r.reset(data.draw(st.integers(0, 2 ** 32 - 1), label="state seed"))
    leaves = data.draw(batch_st(r))
    flip = data.draw(st.booleans(), label="lists/tuples swapped")
    acts, ctx, before = lookup_checked(r, leaves, flip, data.draw(st.sampled_from(["none", "mirror"])))
    grads, grads64 = draw_gradients(data, acts)
    apply_checked(r, leaves, grads, grads64, ctx, before, flip)
    # The context is used up: a second apply is refused and changes nothing.
    expect_refusal(r.emb, lambda: r.emb.apply_gradients(mirror(r.config, grads), ctx), ["already applied"])


@fuzz(6)
@given(data=st.data())
def test_interleaved_lookups_match_oracle(data):
    """Two lookups before either update, the updates then applied in either order: each context keeps its
    own batch (nothing shared through the engine's reused workspaces)."""
    r = rig("nested")
    r.reset(data.draw(st.integers(0, 2 ** 32 - 1), label="state seed"))
    first, second = data.draw(batch_st(r)), data.draw(batch_st(r))
    acts1, ctx1, _ = lookup_checked(r, first)
    acts2, ctx2, _ = lookup_checked(r, second)
    grads1, grads1_64 = draw_gradients(data, acts1)
    grads2, grads2_64 = draw_gradients(data, acts2)
    steps = [(first, grads1, grads1_64, ctx1), (second, grads2, grads2_64, ctx2)]
    if data.draw(st.booleans(), label="second first"):
        steps.reverse()
    for leaves, grads, grads64, ctx in steps:
        apply_checked(r, leaves, grads, grads64, ctx, snapshot(r.emb))


# ----------------------------------------------------------------------------------------------------------
# Invalid features and weights: InputError naming the feature, nothing changed, engine still fine.

def _container_paths(node, path=()):
    out = []
    if isinstance(node, dict):
        out.append(path)
        for k in node:
            out += _container_paths(node[k], path + (k,))
    elif isinstance(node, (list, tuple)):
        out.append(path)
        for i, v in enumerate(node):
            out += _container_paths(v, path + (i,))
    return out


def _replace_at(struct, path, fn):
    if not path:
        return fn(struct)
    head, rest = path[0], path[1:]
    if isinstance(struct, dict):
        out = dict(struct)
    else:
        out = list(struct)
    out[head] = _replace_at(struct[head], rest, fn)
    return out if isinstance(struct, (dict, list)) else tuple(out)


@st.composite
def corrupt_structure(draw, config, good, what):
    """``(bad structure, fragments)``: one container of ``good`` (mirroring ``config``) broken."""
    path = draw(st.sampled_from(_container_paths(config)))
    node = config
    for p in path:
        node = node[p]
    where = "/".join(str(p) for p in path) or "<root>"
    head = f"{what} at '{where}'"
    if isinstance(node, dict):
        how = draw(st.sampled_from(["drop", "add", "as_list"]))
        if how == "drop":
            key = draw(st.sampled_from(sorted(node, key=str)))
            return _replace_at(good, path, lambda d: {k: v for k, v in d.items() if k != key}), \
                [head, "missing", repr(str(key))]
        if how == "add":
            return _replace_at(good, path, lambda d: {**d, "bogus_key": None}), [head, "unexpected", "'bogus_key'"]
        return _replace_at(good, path, lambda d: list(d.values())), [head, "must be a dict"]
    how = draw(st.sampled_from(["drop", "append", "as_dict", "as_array"]))
    n = len(node)
    fn = {"drop": lambda v: list(v)[:-1], "append": lambda v: list(v) + [None],
          "as_dict": lambda v: dict(enumerate(v)), "as_array": lambda v: np.zeros(len(v))}[how]
    return _replace_at(good, path, fn), [head, f"list/tuple of {n} entries"]


def _swap(leaves, i, leaf):
    return leaves[:i] + [leaf] + leaves[i + 1:]


@pytest.mark.parametrize("key", RIG_KEYS)
@fuzz(12)
@given(data=st.data())
def test_invalid_features_refused(key, data):
    r = rig(key)
    r.reset(data.draw(st.integers(0, 2 ** 32 - 1), label="state seed"))
    leaves = data.draw(batch_st(r))
    targets = ["leaf"] * 4
    if not isinstance(r.config, ec.FeatureConfig):
        targets += ["features_structure", "weights_structure"]
    if any(s.fixed_batch is not None for s in r.specs):
        targets.append("output_shape")
    target = data.draw(st.sampled_from(targets), label="target")
    event(f"target: {target}")
    features, weights = inputs_of(r, leaves)
    if target == "leaf":
        i = data.draw(st.integers(0, len(leaves) - 1), label="feature")
        ids, w, fragments = data.draw(corrupt_leaf(r.specs[i], leaves[i]), label="corruption")
        bad = Leaf(ids, w, leaves[i].samples, leaves[i].oracle_w, leaves[i].form)
        note(f"feature {r.specs[i].name}: ids={ids!r:.400} weights={w!r:.400}")
        features, weights = inputs_of(r, _swap(leaves, i, bad))
    elif target == "features_structure":
        features, fragments = data.draw(corrupt_structure(r.config, features, "features"))
    elif target == "weights_structure":
        if weights is None:
            weights = mirror(r.config, [None] * len(leaves))
        weights, fragments = data.draw(corrupt_structure(r.config, weights, "weights"))
    else:
        i = data.draw(st.sampled_from([k for k, s in enumerate(r.specs) if s.fixed_batch is not None]))
        spec = r.specs[i]
        b = data.draw(st.integers(0, 9).filter(lambda x: x != spec.fixed_batch), label="wrong batch size")
        features, weights = inputs_of(r, _swap(leaves, i, data.draw(leaf_st(spec, b))))
        fragments = [f"'{spec.name}'", "output_shape"]
    note(f"expected fragments {fragments}")
    expect_refusal(r.emb, lambda: r.emb.lookup(features, weights), fragments)
    if data.draw(st.booleans(), label="then a valid step"):
        acts, ctx, before = lookup_checked(r, leaves)
        grads, grads64 = draw_gradients(data, acts)
        apply_checked(r, leaves, grads, grads64, ctx, before)


LEAF_KINDS = [(form, kind) for form in FORMS for kind in
              ["id_out_of_range", "weight_non_finite", "ids_not_int", "weight_shape", "weight_container", "not_array"]
              + (["row_splits"] if form == "ragged" else []) + (["sparse_indices"] if form == "sparse" else [])
              + (["lists_malformed"] if form in ("lists", "flat_list") else [])
              + (["ids_rank", "weight_dtype"] if form in ("ragged", "sparse", "dense", "dense1d") else [])]


@pytest.mark.parametrize("form, kind", LEAF_KINDS)
@fuzz(2)
@given(data=st.data())
def test_every_corruption_of_every_form(form, kind, data):
    """Each corruption of each input form, on a random feature of the nested engine."""
    r = rig("nested")
    leaves = data.draw(batch_st(r, batch_size=data.draw(st.integers(1, 5))))
    i = data.draw(st.integers(0, len(leaves) - 1), label="feature")
    spec = r.specs[i]
    leaf = data.draw(leaf_st(spec, leaves[i].batch_size, forms=(form,), min_len=1))
    ids, w, fragments = data.draw(corrupt_leaf(spec, leaf, kind))
    note(f"feature {spec.name}: ids={ids!r:.400} weights={w!r:.400}; expected {fragments}")
    features, weights = inputs_of(r, _swap(leaves, i, Leaf(ids, w, leaf.samples, leaf.oracle_w, form)))
    expect_refusal(r.emb, lambda: r.emb.lookup(features, weights), fragments)


@pytest.mark.parametrize("key", RIG_KEYS)
def test_boundary_ids_every_feature_and_form(key):
    """``vocabulary_size`` and -1 as ids of every feature in every form: refused, naming the id. (With
    stacked tables, id == vocabulary_size would silently read the next table's first row.)"""
    r = rig(key)
    for i, spec in enumerate(r.specs):
        b = spec.fixed_batch or 2
        for form in FORMS:
            for value in (spec.vocab, -1):
                samples = [[0]] * (b - 1) + [[value]]
                good = [make_leaf([[0]] * b, None, "lists") for _ in r.specs]
                bad = make_leaf(samples, [[1.0]] * b, form)
                features, weights = inputs_of(r, _swap(good, i, bad))
                expect_refusal(r.emb, lambda: r.emb.lookup(features, weights), [f"'{spec.name}'", f"id {value}"])


# ----------------------------------------------------------------------------------------------------------
# Invalid gradients: InputError naming the feature, nothing changed, the context still usable.

@st.composite
def corrupt_gradients(draw, r, grads):
    """``(bad gradient leaves or structure, fragments, is_structure)``."""
    kinds = ["shape", "dtype", "not_array"]
    if any(g.size for g in grads):
        kinds += ["non_finite", "beyond_float32"]
    if not isinstance(r.config, ec.FeatureConfig):
        kinds.append("structure")
    kind = draw(st.sampled_from(kinds), label="gradient corruption")
    event(f"gradient corruption: {kind}")
    if kind == "structure":
        bad, fragments = draw(corrupt_structure(r.config, mirror(r.config, grads), "gradients"))
        return bad, fragments, True
    candidates = [i for i, g in enumerate(grads) if g.size] if kind in ("non_finite", "beyond_float32") else \
        list(range(len(grads)))
    i = draw(st.sampled_from(candidates), label="feature")
    spec, g = r.specs[i], np.asarray(grads[i])
    name = f"'{spec.name}'"
    if kind == "non_finite":
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        dtype = draw(st.sampled_from(FLOAT_DTYPES))
        j = draw(st.integers(0, g.size - 1))
        bad = np.array(g, dtype, order="C")
        bad.reshape(-1)[j] = value
        at = tuple(int(x) for x in np.unravel_index(j, g.shape))
        bad = layout(bad, draw(st.sampled_from(ARRAY_LAYOUTS)))
        fragments = [name, "nan" if np.isnan(value) else "inf", f"at index {at}"]
    elif kind == "beyond_float32":   # finite, but inf once cast to float32
        value = draw(st.sampled_from([1e39, -1e39, 1e300]))
        dtype = draw(st.sampled_from([np.float64, np.longdouble, ">f8"]))
        j = draw(st.integers(0, g.size - 1))
        bad = np.array(g, dtype, order="C")
        bad.reshape(-1)[j] = value
        at = tuple(int(x) for x in np.unravel_index(j, g.shape))
        bad = layout(bad, draw(st.sampled_from(ARRAY_LAYOUTS)))
        fragments = [name, "float32", f"at index {at}"]
    elif kind == "shape":
        shapes = {g.shape + (1,), g.shape[:-1], (g.shape[0] + 1,) + g.shape[1:], (g.size,), g.shape[::-1],
                  (math.prod(g.shape[:-1]), g.shape[-1])}
        shapes.discard(g.shape)
        shape = draw(st.sampled_from(sorted(shapes)))
        bad = np.zeros(shape, np.float32)
        fragments = [name, "shape"]
    elif kind == "dtype":
        dtype = draw(st.sampled_from([np.int32, np.int64, np.uint8, np.bool_, np.complex64, object, str]))
        bad = g.astype(dtype)
        fragments = [name, "floats"]
    else:
        bad = draw(st.sampled_from([g.tolist(), {"g": 1}, 1.0, "grad"]))  # None: no update (valid)
        fragments = [name]
    return grads[:i] + [bad] + grads[i + 1:], fragments, False


@pytest.mark.parametrize("key", RIG_KEYS)
@fuzz(10)
@given(data=st.data())
def test_invalid_gradients_refused(key, data):
    r = rig(key)
    r.reset(data.draw(st.integers(0, 2 ** 32 - 1), label="state seed"))
    leaves = data.draw(batch_st(r))
    acts, ctx, before = lookup_checked(r, leaves)
    grads, grads64 = draw_gradients(data, acts)
    bad, fragments, is_structure = data.draw(corrupt_gradients(r, grads))
    bad = bad if is_structure else mirror(r.config, bad)
    note(f"expected fragments {fragments}")
    expect_refusal(r.emb, lambda: r.emb.apply_gradients(bad, ctx), fragments)
    # Nothing was consumed: the same context takes the good gradients, exactly once.
    apply_checked(r, leaves, grads, grads64, ctx, before)


# ----------------------------------------------------------------------------------------------------------
# Configuration values.

def _valid_int(v, minimum):
    import numbers
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) and v >= minimum


INT_ARGS = [1, 2, 7, 2 ** 70, np.int64(3), np.int32(4), np.uint8(5), 0, -1, True, False, np.bool_(True), 2.0,
            np.float64(2.0), 1.5, "3", None, [3]]


@fuzz(40)
@given(vocab=st.sampled_from(INT_ARGS), dim=st.sampled_from(INT_ARGS),
       combiner=st.sampled_from(["mean", "sum", "sqrtn", "MEAN", "", None, "max"]),
       name=st.sampled_from([None, "t", "", 3, b"t"]),
       initializer=st.sampled_from([None, ec.Zeros(), lambda shape, dtype: np.zeros(shape, dtype), 3, "zeros"]),
       optimizer=st.sampled_from([None, OPT_ADAGRAD, ec.SGD(0.1), "sgd", 1]))
def test_table_config_values(vocab, dim, combiner, name, initializer, optimizer):
    problems = []
    if not _valid_int(vocab, 1):
        problems.append("vocabulary_size")
    if not _valid_int(dim, 1):
        problems.append("dim")
    if initializer is not None and not callable(initializer):
        problems.append("initializer")
    if combiner not in ("mean", "sum", "sqrtn"):
        problems.append("combiner")
    if name is not None and (not isinstance(name, str) or not name):
        problems.append("name")
    if optimizer is not None and not isinstance(optimizer, ec.Optimizer):
        problems.append("optimizer")
    make = lambda: ec.TableConfig(vocab, dim, initializer=initializer, optimizer=optimizer,  # noqa: E731
                                  combiner=combiner, name=name)
    if not problems:
        t = make()
        assert (t.vocabulary_size, t.dim) == (int(vocab), int(dim))
        assert type(t.vocabulary_size) is int and type(t.dim) is int
        return
    with pytest.raises(ValueError) as info:
        make()
    assert any(f"`{p}`" in str(info.value) for p in problems), (problems, str(info.value))


OUTPUT_SHAPES = [None, (2, 3), [4], np.array([2, 2]), (np.int64(2),), (6,), (0,), (-1, 2), (2.0,), "ab", 5, (True,),
                 (2, None), b"\x02"]


@fuzz(40)
@given(table_ok=st.booleans(), seq=st.sampled_from([0, 3, np.int64(2), -1, True, 2.0, None]),
       validate=st.sampled_from([True, False, np.bool_(True), 1, None]), output_shape=st.sampled_from(OUTPUT_SHAPES),
       name=st.sampled_from([None, "f", "", 3]))
def test_feature_config_values(table_ok, seq, validate, output_shape, name):
    table = ec.TableConfig(5, 2, name="t") if table_ok else "t"
    problems = []
    if not table_ok:
        problems.append("table")
    if not _valid_int(seq, 0):
        problems.append("max_sequence_length")
    if not isinstance(validate, bool):
        problems.append("validate_weights_and_indices")
    if output_shape is not None:
        if isinstance(output_shape, (str, bytes)) or not hasattr(output_shape, "__iter__") or \
                not all(_valid_int(d, 1) for d in output_shape):
            problems.append("output_shape")
    if name is not None and not isinstance(name, str):
        problems.append("name")
    make = lambda: ec.FeatureConfig(table, max_sequence_length=seq, validate_weights_and_indices=validate,  # noqa
                                    output_shape=output_shape, name=name)
    if not problems:
        f = make()
        assert f.output_shape == (None if output_shape is None else tuple(int(d) for d in output_shape))
        assert f.max_sequence_length == int(seq)
        return
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert any(p in message for p in problems), (problems, message)


@st.composite
def feature_nests(draw):
    """A random nest of features (or junk leaves) over a few tables; what Embedding must say about it."""
    n_tables = draw(st.integers(1, 3))
    names = draw(st.lists(st.sampled_from([None, "x", "y"]), min_size=n_tables, max_size=n_tables))
    own_opt = draw(st.lists(st.booleans(), min_size=n_tables, max_size=n_tables))
    tables = [ec.TableConfig(draw(st.integers(1, 6)), draw(st.integers(1, 5)), name=nm,
                             combiner=draw(st.sampled_from(["mean", "sum", "sqrtn"])),
                             optimizer=OPT_ONE if own else None) for nm, own in zip(names, own_opt)]
    junk = draw(st.sampled_from([None, None, None, 3, "feature", tables[0]]))

    def leaf():
        return ec.FeatureConfig(draw(st.sampled_from(tables)), max_sequence_length=draw(st.sampled_from([0, 0, 2])))

    def node(depth):
        kind = draw(st.sampled_from(["leaf", "leaf", "dict", "list", "tuple"] if depth < 2 else ["leaf"]))
        if kind == "leaf":
            return leaf()
        children = [node(depth + 1) for _ in range(draw(st.integers(0, 3)))]
        if kind == "dict":
            return {f"k{i}": c for i, c in enumerate(children)}
        return children if kind == "list" else tuple(children)

    config = node(0)
    if junk is not None and draw(st.booleans()):
        config = {"junk": junk, "rest": config}
    return config, tables


@fuzz(30)
@given(nest=feature_nests(), global_opt=st.sampled_from([None, OPT_ADAGRAD, OPT_ROOT, "adagrad"]))
def test_embedding_construction(nest, global_opt):
    config, _ = nest
    leaves = flatten_config(config)
    used = []
    for _, f in leaves:
        if isinstance(f, ec.FeatureConfig) and all(f.table is not t for t in used):
            used.append(f.table)
    named = [t.name for t in used if t.name is not None]
    if global_opt is not None and not isinstance(global_opt, ec.Optimizer):
        expected = ["optimizer must be"]
    elif not leaves:
        expected = ["holds no FeatureConfig"]
    elif any(not isinstance(f, ec.FeatureConfig) for _, f in leaves):
        path = next(p for p, f in leaves if not isinstance(f, ec.FeatureConfig))
        expected = [f"'{path}'", "must be a FeatureConfig"]
    elif len(named) != len(set(named)):
        expected = ["two different tables are named"]
    elif global_opt is None and any(t.optimizer is None for t in used) and any(t.optimizer is not None for t in used):
        expected = ["no optimizer while"]   # all without one: a lookup-only engine
    else:
        expected = None
    if expected is None:
        emb = ec.Embedding(config, global_opt)
        assert set(emb.embedding_tables) == {t.name for t in used}
        ids = mirror(config, [np.zeros(2, np.int64) for _ in leaves])
        acts, ctx = emb.lookup(ids)
        for (path, f), a in zip(leaves, leaves_like(config, acts)):
            assert a.shape == ((2, f.max_sequence_length, f.table.dim) if f.max_sequence_length else (2, f.table.dim))
        return
    with pytest.raises(ValueError) as info:
        ec.Embedding(config, global_opt)
    for fragment in expected:
        assert fragment in str(info.value), (fragment, str(info.value))


# ----------------------------------------------------------------------------------------------------------
# Deterministic adversarial cases (always run, whatever Hypothesis draws).

def _valid_step(r, leaves, seed=0, grad_dtype=np.float32, grad_layout="C"):
    r.reset(seed)
    acts, ctx, before = lookup_checked(r, leaves)
    rng = np.random.default_rng(seed)
    grads = [layout(rng.normal(size=a.shape).astype(grad_dtype), grad_layout) for a in acts]
    grads64 = [np.asarray(g).astype(np.float32).astype(np.float64) for g in grads]
    apply_checked(r, leaves, grads, grads64, ctx, before)


@pytest.mark.parametrize("form", ["lists", "ragged", "sparse", "dense"])
def test_huge_valency_every_form(form):
    """10,000 ids in one sample (random, and all one id) beside empty samples, weighted, every feature kind."""
    r = rig("nested")
    rng = np.random.default_rng(7)
    leaves = []
    for spec in r.specs:
        if form == "dense":
            samples = [[int(x) for x in rng.integers(0, spec.vocab, HUGE_VALENCY)], [0] * HUGE_VALENCY]
        else:
            samples = [[], [int(x) for x in rng.integers(0, spec.vocab, HUGE_VALENCY)], [spec.vocab - 1] *
                       HUGE_VALENCY, [1 % spec.vocab]]
        weights = [[float(np.float32(w)) for w in rng.uniform(-2, 2, len(s))] for s in samples]
        leaves.append(make_leaf(samples, weights, form, gaps=form == "sparse" and not spec.seq_len))
    _valid_step(r, leaves)


@pytest.mark.parametrize("form", FORMS)
def test_empty_batches_every_form(form):
    """B = 0 for every feature; then B = 3 with every sample empty (not possible for [B] forms)."""
    r = rig("nested")
    _valid_step(r, [make_leaf([], [], form) for _ in r.specs])
    if form not in ("flat_list", "dense1d"):
        _valid_step(r, [make_leaf([[], [], []], [[], [], []], form) for _ in r.specs])


@pytest.mark.parametrize("key", ["nested", "root"])
def test_zero_weight_sums_every_combiner(key):
    """Weights summing to zero (mean: gains 0), all-zero weights (every combiner), negative weights."""
    r = rig(key)
    samples_w = [([0, 1], [1.5, -1.5]), ([2, 0, 1], [0.0, 0.0, 0.0]), ([1], [-2.0]), ([1, 1], [0.25, -0.75]),
                 ([3, 3, 0, 0], [1.0, 1.0, -1.0, -1.0])]
    leaves = []
    for spec in r.specs:
        ids = [[min(i, spec.vocab - 1) for i in s] for s, _ in samples_w]
        leaves.append(make_leaf(ids, [w for _, w in samples_w], "lists"))
    _valid_step(r, leaves)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.longdouble])
@pytest.mark.parametrize("how", ARRAY_LAYOUTS)
def test_gradient_dtypes_and_layouts(dtype, how):
    """Gradients of every float dtype in every layout (a single-feature table takes the no-copy path)."""
    r = rig("root")
    leaves = [make_leaf([[1, 2], [], [12, 12, 0]], None, "lists")]
    _valid_step(r, leaves, grad_dtype=dtype, grad_layout=how)


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_extremes_every_dtype(dtype):
    """The smallest and largest value of every integer dtype, as ids, named exactly in the error."""
    r = rig("root")
    info = np.iinfo(dtype)
    for value in {info.min, info.max} - {0}:
        for form in ("ragged", "sparse", "dense"):
            leaf = make_leaf([[1, 2], [3]] if form != "dense" else [[1], [3]], None, form, id_dtype=dtype)
            arr = np.array(leaf.ids.values if form != "dense" else leaf.ids)
            arr[-1] = value
            ids = {"ragged": lambda: ec.Ragged(arr, leaf.ids.row_splits),
                   "sparse": lambda: ec.Sparse(leaf.ids.indices, arr, leaf.ids.dense_shape),
                   "dense": lambda: arr}[form]()
            expect_refusal(r.emb, lambda: r.emb.lookup(ids), ["'<root>'", f"id {value}"])


def test_context_of_another_engine_refused():
    a, b = rig("nested"), rig("nested_unstacked")
    leaves = [make_leaf([[0]], None, "lists") for _ in a.specs]
    acts, ctx = a.emb.lookup(inputs_of(a, leaves)[0])
    grads = mirror(a.config, [np.zeros_like(x) for x in leaves_like(a.config, acts)])
    expect_refusal(b.emb, lambda: b.emb.apply_gradients(grads, ctx), ["ctx must be the context"])
    expect_refusal(a.emb, lambda: a.emb.apply_gradients(grads, "not a context"), ["ctx must be the context"])


# ----------------------------------------------------------------------------------------------------------
# Regressions: one reproduction of each bug this fuzzer found (fixed in 98cce07). The random generators
# produce these inputs too; these tests keep a minimal case that runs whatever Hypothesis draws.

def _tiny():
    return rig("root")


def _refused_naming_root(ids, weights=None, fragments=()):
    e = _tiny().emb
    expect_refusal(e, lambda: e.lookup(ids, weights), ["'<root>'", *fragments])


@pytest.mark.parametrize("ids", [[[1], 2], [1, [2]], [[1, 2], "ab"]], ids=["list_then_int", "int_then_list",
                                                                            "list_then_str"])
def test_regression_list_of_mixed_samples(ids):
    """Was: NumPy's ValueError (inhomogeneous shape) from np.asarray in to_feature_batch."""
    _refused_naming_root(ids)


@pytest.mark.parametrize("ids", [[[1, [2]]], [np.array(1), np.array([2])], [np.array([[1]]), [2]]],
                         ids=["nested_in_sample", "0d_sample", "2d_sample"])
def test_regression_list_of_lists_bad_sample(ids):
    """Was: NumPy's ValueError / TypeError (len() of unsized object) from Ragged.from_lists."""
    _refused_naming_root(ids)


@pytest.mark.parametrize("ids, weights", [([[1], [2]], [1.0, 1.0]), ([1, 2], [[1.0], [1.0, 2.0]]),
                                          (np.array([1, 2]), [[1.0], [1.0, 2.0]]), ([[1], [2]], [["a"], ["b"]])],
                         ids=["flat_weights_for_lists", "ragged_weights_for_flat_list",
                              "ragged_weights_for_array", "string_weights_in_lists"])
def test_regression_list_weights_not_mirroring(ids, weights):
    """Was: TypeError (len(float)) or NumPy's ValueError (inhomogeneous shape; could not convert string)."""
    _refused_naming_root(ids, weights)


@pytest.mark.parametrize("values, splits", [(np.array([1, 2, 3]), np.array([0, 3, 1, 3], np.uint64)),
                                            (np.zeros(20, np.int64), np.array([0, 100, -100, 20], np.int8))],
                         ids=["uint64", "int8_wraps"])
def test_regression_decreasing_unsigned_row_splits(values, splits):
    """Was: np.diff in the caller's dtype wrapped, the check passed, np.repeat raised NumPy's ValueError."""
    _refused_naming_root(ec.Ragged(values, splits), fragments=["row_splits"])


def test_regression_sparse_scalar_values():
    """Was: IndexError (values.shape[0] read before the rank check)."""
    _refused_naming_root(ec.Sparse(np.zeros((1, 2), np.int64), np.array(1), (2, 1)))


@pytest.mark.parametrize("shape", [(-1, 1), (-5, 1), (2 ** 64, 1), (2, -1), (2 ** 40, 1)])
def test_regression_sparse_dense_shape(shape):
    """Was: NumPy's ValueError (negative / too large dimension), MemoryError, or (2, -1) accepted."""
    _refused_naming_root(ec.Sparse(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), shape))


@pytest.mark.parametrize("dtype", [np.float64, np.longdouble, ">f8"])
@pytest.mark.parametrize("value", [1e39, -1e300])
def test_regression_gradient_beyond_float32(dtype, value):
    """Was: IndexError (longdouble, big-endian float64), or float64 accepted and inf written to the table."""
    r = _tiny()
    r.reset(0)
    acts, ctx = r.emb.lookup(np.array([[1, 2], [3, 4]]))
    grad = np.ones(acts.shape, dtype)
    grad[1, 2] = value
    expect_refusal(r.emb, lambda: r.emb.apply_gradients(grad, ctx), ["'<root>'", "float32", "at index (1, 2)"])
    r.emb.apply_gradients(np.ones(acts.shape, dtype), ctx)   # the context was not used up


@pytest.mark.parametrize("shape, batch", [((2 ** 32, 2 ** 32), 0), ((3, 6148914691236517206), 2)])
def test_regression_output_shape_size_overflow(shape, batch):
    """Was: int(np.prod(output_shape)) wrapped around, the size check passed, the reshape raised."""
    table = ec.TableConfig(5, 3, name="t")
    try:
        feature = ec.FeatureConfig(table, output_shape=shape, name="big")
    except ValueError as e:      # refused up front
        assert "output_shape" in str(e)
        return
    e = ec.Embedding({"big": feature}, OPT_ADAGRAD)
    expect_refusal(e, lambda: e.lookup({"big": np.zeros(batch, np.int64)}), ["'big'", "output_shape"])


def test_regression_output_shape_iterator():
    """Was: the iterator was consumed by the validation and the output_shape became ()."""
    table = ec.TableConfig(5, 3, name="t")
    assert ec.FeatureConfig(table, output_shape=iter([2, 3])).output_shape == (2, 3)
    assert ec.FeatureConfig(table, output_shape=(d for d in (4,))).output_shape == (4,)


@pytest.mark.parametrize("combiner, weights", [("sqrtn", [1e-30]), ("sqrtn", [1e20]), ("sqrtn", [-3e19, 4e19]),
                                               ("mean", [3e38, 3e38])])
def test_regression_extreme_weights_with_combiners(combiner, weights):
    """Was: zero activations (sqrtn squared the weights in float32; mean cast the weight sum to float32)."""
    r = rig({"sqrtn": "root", "mean": "nested"}[combiner])
    r.reset(3)
    leaves = []
    for spec in r.specs:
        samples = [[(i + 1) % spec.vocab for i in range(len(weights))]]
        w = weights if spec.combiner == combiner and not spec.seq_len else [1.0] * len(weights)
        leaves.append(make_leaf(samples, [w], "lists"))
    lookup_checked(r, leaves)


@pytest.mark.parametrize("weights, shown", [(np.array([1e300, 1.0]), "1e+300"),
                                             (np.array([1.0, -1e39], np.longdouble), "e+38"),  # 1e39 in float64
                                             ([1e39, 1.0], "1e+39")])
def test_regression_weight_beyond_float32_named(weights, shown):
    """Was: cast to float32 first and reported as 'inf'."""
    _refused_naming_root(np.array([1, 2]), weights, fragments=[shown, "float32"])


def test_regression_samples_of_mixed_integer_dtypes():
    """Was: np.asarray promoted uint64 and int64 samples to float64: valid ids refused."""
    leaf = make_leaf([[1], [2, 3]], None, "lists")
    leaf.ids = [np.array([1], np.uint64), np.array([2, 3], np.int64)]
    _valid_step(_tiny(), [leaf])


# ----------------------------------------------------------------------------------------------------------
# Bugs the fuzzer found after the first round of fixes, fixed since: kept as regression tests.

def test_regression_mixed_integer_samples_with_an_empty_sample():
    leaf = make_leaf([[1], [], [2]], None, "lists")
    leaf.ids = [np.array([1], np.uint64), [], np.array([2], np.int64)]
    _valid_step(_tiny(), [leaf])


def test_regression_out_of_range_python_id_beside_an_empty_sample_not_named():
    _refused_naming_root([[2 ** 63], [], [1]], fragments=["id 9223372036854775808"])


def test_regression_list_of_lists_weight_beyond_float32_misnamed():
    _refused_naming_root([[1], [2]], [[1e39], [1.0]], fragments=["e+39"])
