"""Builders and Hypothesis strategies for ``tests/test_fuzz.py``.

A feature's batch is generated as plain Python samples (lists of ids, optional weights), the form the NumPy
oracle in ``tests/reference.py`` takes, and then rendered into one of the engine's input forms:

* ``lists``: a list of samples, each a list, tuple or NumPy array of ids (weights likewise);
* ``flat_list``: one id per sample as a flat Python list (``[B]`` ids);
* ``ragged``: ``ec.Ragged(values, row_splits)`` with any integer dtype for values and splits;
* ``sparse``: ``ec.Sparse(indices, values, dense_shape)`` in shuffled COO order, optionally with gaps
  between the positions of a pooled feature's ids, and a ``dense_shape`` wider than needed;
* ``dense``: a ``[B, k]`` array; ``dense1d``: a ``[B]`` array.

Arrays come in every integer (ids) or float/int (weights) dtype and in C, Fortran, strided, reversed
(negative strides), read-only and byte-swapped layouts. Weight values are chosen so that the engine and the
oracle see exactly the same numbers (values representable in the weights' dtype and in float32).

``corrupt_leaf`` turns one feature's valid batch into an invalid one and says which fragments the
resulting ``InputError`` message must contain.

Not generated (yet): an empty Python sample (``[]``) beside samples given as arrays of different integer
dtypes, and list-of-lists weights beyond float32 range (only required to be refused). Both were library
bugs, now fixed and covered by the ``test_regression_*`` tests in ``tests/test_fuzz.py``; the bugs found
earlier (malformed lists, unsigned ``row_splits``, sparse ``dense_shape`` and scalar values, values beyond
float32, extreme weights with ``sqrtn``/``mean``, mixed integer sample dtypes) are generated again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

import embedcore as ec

INT_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
FLOAT_DTYPES = (np.float16, np.float32, np.float64, np.longdouble)
WEIGHT_INT_DTYPES = (np.int8, np.int32, np.int64, np.uint8)
ARRAY_LAYOUTS = ("C", "F", "strided", "reversed", "readonly", "byteswap")
FORMS = ("lists", "flat_list", "ragged", "sparse", "dense", "dense1d")
HUGE_VALENCY = 10_000
I64 = np.iinfo(np.int64)


# ----------------------------------------------------------------------------------------------------------
# What a feature is, and one feature's batch.

@dataclass(frozen=True)
class FeatureSpec:
    """One feature of a test engine, in the engine's flatten order."""

    path: str
    name: str               # what error messages call it: FeatureConfig.name or its path
    table: str
    vocab: int
    dim: int
    combiner: str
    seq_len: int = 0
    output_shape: tuple | None = None

    @property
    def fixed_batch(self):
        """The only batch size ``output_shape`` allows, or None."""
        if self.output_shape is None:
            return None
        return math.prod(self.output_shape) // max(self.seq_len, 1)

    def act_shape(self, batch_size):
        if self.output_shape is not None:
            return self.output_shape + (self.dim,)
        return (batch_size, self.seq_len, self.dim) if self.seq_len else (batch_size, self.dim)

    def oracle_shape(self, batch_size):
        return (batch_size, self.seq_len, self.dim) if self.seq_len else (batch_size, self.dim)


@dataclass
class Leaf:
    """One feature's batch: what the engine is given and what the oracle is given."""

    ids: object
    weights: object          # None: unweighted
    samples: list            # oracle ids, per sample, in position order
    oracle_w: list           # oracle weights (the float32 values the engine sees), ones when unweighted
    form: str
    params: dict = field(default_factory=dict)   # make_leaf's arguments, to rebuild variants

    @property
    def batch_size(self):
        return len(self.samples)

    @property
    def n_ids(self):
        return sum(len(s) for s in self.samples)

    def describe(self):
        p = {k: (v.__name__ if isinstance(v, type) else v) for k, v in self.params.items()
             if k not in ("samples", "weights")}
        lengths = [len(s) for s in self.samples]
        return f"form={self.form} B={len(lengths)} lengths={lengths[:12]} weighted={self.weights is not None} {p}"


def layout(arr: np.ndarray, how: str) -> np.ndarray:
    """The same values as ``arr`` in memory layout ``how``."""
    arr = np.asarray(arr)
    if how == "C" or arr.ndim == 0:
        return np.ascontiguousarray(arr)
    if how == "F":
        return np.asfortranarray(arr)
    if how == "strided":
        big = np.zeros(arr.shape[:-1] + (2 * arr.shape[-1],), arr.dtype)
        big[..., ::2] = arr
        return big[..., ::2]
    if how == "reversed":
        return np.ascontiguousarray(arr[::-1])[::-1]
    if how == "readonly":
        out = arr.copy()
        out.flags.writeable = False
        return out
    if how == "byteswap":
        return arr.astype(arr.dtype.newbyteorder())
    raise ValueError(how)


def _splits(samples):
    splits = np.zeros(len(samples) + 1, np.int64)
    np.cumsum([len(s) for s in samples], out=splits[1:])
    return splits


def _fits(dtype, *values):
    info = np.iinfo(dtype)
    return all(info.min <= v <= info.max for v in values)


def make_leaf(samples, weights, form, *, id_dtype=np.int64, split_dtype=np.int64, idx_dtype=np.int64,
              w_dtype=np.float32, id_layout="C", w_layout="C", inner="list", w_inner="list", gaps=False,
              extra_width=0, perm_seed=0, shape_as="tuple") -> Leaf:
    """Render ``samples`` (lists of ints) and ``weights`` (lists of floats exactly representable in
    ``w_dtype`` and float32, or None) as engine input of ``form``."""
    params = dict(samples=samples, weights=weights, form=form, id_dtype=id_dtype, split_dtype=split_dtype,
                  idx_dtype=idx_dtype, w_dtype=w_dtype, id_layout=id_layout, w_layout=w_layout, inner=inner,
                  w_inner=w_inner, gaps=gaps, extra_width=extra_width, perm_seed=perm_seed, shape_as=shape_as)
    b = len(samples)
    flat = [i for s in samples for i in s]
    wflat = None if weights is None else [v for s in weights for v in s]
    with np.errstate(over="ignore"):
        oracle_w = [[1.0] * len(s) for s in samples] if weights is None else [
            np.asarray(s, np.float64).astype(np.float32).tolist() for s in weights]
    wtype = w_dtype if w_dtype is not None else np.float32

    def id_array(values, shape=None):
        arr = np.asarray(values, np.int64).astype(id_dtype)
        return arr if shape is None else arr.reshape(shape)

    def w_array(values, shape=None):
        with np.errstate(over="ignore"):
            arr = np.asarray(values, np.float64).astype(wtype)
        return arr if shape is None else arr.reshape(shape)

    def seq(values, kind, to_array):
        if kind == "tuple":
            return tuple(values)
        if kind == "array":
            return to_array(values)
        return list(values)

    if form == "lists" and inner == "mixed":   # each sample its own container and integer dtype
        pick = np.random.default_rng(perm_seed + 1)
        ids = []
        for s in samples:
            kind, dtype = pick.choice(["list", "tuple", "array"]), INT_DTYPES[pick.integers(len(INT_DTYPES))]
            # an empty Python sample beside mixed dtypes is a known bug (test_fuzz): empty samples as arrays
            ids.append(np.asarray(s, np.int64).astype(dtype) if kind == "array" or not s else
                       tuple(s) if kind == "tuple" else list(s))
        w = None if weights is None else [seq(s, w_inner, w_array) for s in weights]
    elif form == "lists":
        ids = [seq(s, inner, id_array) for s in samples]
        w = None if weights is None else [seq(s, w_inner, w_array) for s in weights]
    elif form == "flat_list":
        assert all(len(s) == 1 for s in samples)
        ids = [int(s[0]) for s in samples]
        w = None if weights is None else [float(s[0]) for s in weights]
    elif form == "ragged":
        splits = _splits(samples)
        ids = ec.Ragged(layout(id_array(flat), id_layout), splits.astype(split_dtype))
        w = None if weights is None else ec.Ragged(layout(w_array(wflat), w_layout), splits.copy())
    elif form == "sparse":
        rng = np.random.default_rng(perm_seed)
        width = max([len(s) for s in samples] + [0]) + extra_width
        positions = []
        for s in samples:
            if gaps and len(s):
                positions.append(sorted(int(p) for p in rng.choice(width, len(s), replace=False)))
            else:
                positions.append(list(range(len(s))))
        idx = np.array([(i, p) for i, ps in enumerate(positions) for p in ps], np.int64).reshape(-1, 2)
        perm = rng.permutation(len(flat))
        indices = idx[perm].astype(idx_dtype)
        values = layout(id_array(flat)[perm], id_layout)
        shape = (b, width)
        if shape_as == "numpy":
            shape = (np.int64(b), np.uint32(width))
        elif shape_as == "list":
            shape = [b, width]
        ids = ec.Sparse(indices, values, shape)
        w = None if weights is None else ec.Sparse(indices.copy(), layout(w_array(wflat)[perm], w_layout), shape)
    elif form in ("dense", "dense1d"):
        k = len(samples[0]) if samples else (0 if form == "dense" else 1)
        assert all(len(s) == k for s in samples)
        shape = (b,) if form == "dense1d" else (b, k)
        ids = layout(id_array(flat, shape), id_layout)
        w = None if weights is None else layout(w_array(wflat, shape), w_layout)
    else:
        raise ValueError(form)
    return Leaf(ids, w, [list(s) for s in samples], oracle_w, form, params)


def rebuild(leaf: Leaf, **changes) -> Leaf:
    """``leaf`` rendered again with some of ``make_leaf``'s arguments changed."""
    params = dict(leaf.params)
    params.update(changes)
    samples, weights, form = params.pop("samples"), params.pop("weights"), params.pop("form")
    return make_leaf(samples, weights, form, **params)


# ----------------------------------------------------------------------------------------------------------
# Strategies.

def _ids(rng, vocab, n, mode, hot):
    if mode == "uniform":
        return [int(x) for x in rng.integers(0, vocab, n)]
    if mode == "hot":
        return [int(x) for x in rng.choice(hot, n)]
    if mode == "single":
        return [int(hot[0])] * n
    return [int(x) for x in rng.choice([0, vocab - 1], n)]   # edges


def _weights(rng, lengths, mode, w_dtype):
    unsigned = np.dtype(w_dtype).kind == "u"
    out = []
    for n in lengths:
        if mode == "random":
            raw = rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-10, 3, n)
        elif mode == "cancel":      # w, -w pairs: a zero sum for "mean"
            half = 2.0 ** rng.uniform(-4, 2, n // 2)
            raw = np.concatenate([np.stack([half, -half], 1).reshape(-1), np.zeros(n % 2)])
        elif mode == "scaled":      # one binade range per sample, anywhere in 2**-60 .. 2**39
            raw = rng.choice([-1.0, 1.0], n) * rng.uniform(1, 8, n) * 2.0 ** int(rng.integers(-60, 37))
        elif mode == "zeros":
            raw = np.zeros(n)
        elif mode == "ones":
            raw = np.ones(n)
        else:                       # small integers
            raw = rng.integers(0 if unsigned else -3, 4, n).astype(np.float64)
        vals = np.asarray(raw).astype(w_dtype).astype(np.float32)
        out.append([float(v) for v in vals])
    return out


@st.composite
def leaf_st(draw, spec: FeatureSpec, batch_size: int, weighted=None, forms=FORMS, min_len=0):
    """A valid batch of ``batch_size`` samples for ``spec``, in any form, dtype and layout (samples of at
    least ``min_len`` ids where the form allows)."""
    form = draw(st.sampled_from(forms))
    event(f"form: {form}")
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    huge = batch_size > 0 and draw(st.integers(0, 59)) == 0   # test_huge_valency_every_form always runs it
    if form in ("flat_list", "dense1d"):
        lengths = [1] * batch_size
    elif form == "dense":
        k = HUGE_VALENCY if huge and batch_size <= 2 else draw(st.integers(min_len, 5))
        lengths = [k] * batch_size
    else:
        lengths = draw(st.lists(st.integers(min_len, 6), min_size=batch_size, max_size=batch_size))
        if huge:
            lengths[draw(st.integers(0, batch_size - 1))] = HUGE_VALENCY
    mode = draw(st.sampled_from(["uniform", "uniform", "hot", "single", "edges"]))
    hot = rng.integers(0, spec.vocab, draw(st.integers(1, 3)))
    samples = [_ids(rng, spec.vocab, n, mode, hot) for n in lengths]
    weighted = draw(st.booleans()) if weighted is None else weighted
    weights = None
    w_dtype = np.float32
    if weighted:
        w_mode = draw(st.sampled_from(["random", "random", "cancel", "scaled", "zeros", "ones", "int"]))
        w_dtype = draw(st.sampled_from(FLOAT_DTYPES[1:] if w_mode == "scaled" else FLOAT_DTYPES + (
            WEIGHT_INT_DTYPES if w_mode in ("int", "zeros", "ones") else ())))
        weights = _weights(rng, lengths, w_mode, w_dtype)
    total = sum(lengths)
    width_extra = draw(st.integers(0, 3))
    width = max(lengths + [0]) + width_extra
    leaf = make_leaf(
        samples, weights, form,
        id_dtype=draw(st.sampled_from(INT_DTYPES)),
        split_dtype=draw(st.sampled_from([d for d in INT_DTYPES if _fits(d, total)])),
        idx_dtype=draw(st.sampled_from([d for d in INT_DTYPES if _fits(d, batch_size, width)])),
        w_dtype=w_dtype,
        id_layout=draw(st.sampled_from(ARRAY_LAYOUTS)),
        w_layout=draw(st.sampled_from(ARRAY_LAYOUTS)),
        inner=draw(st.sampled_from(["list", "tuple", "array", "mixed"])),
        w_inner=draw(st.sampled_from(["list", "tuple", "array"])),
        gaps=spec.seq_len == 0 and draw(st.booleans()),
        extra_width=width_extra,
        perm_seed=int(rng.integers(0, 2 ** 31)),
        shape_as=draw(st.sampled_from(["tuple", "numpy", "list"])),
    )
    return leaf


GRAD_DTYPES = (np.float32, np.float32, np.float64, np.float16, np.longdouble)


@st.composite
def gradient_st(draw, shape):
    """(gradient as given to the engine, the float64 values the oracle uses)."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    dtype = draw(st.sampled_from(GRAD_DTYPES))
    how = draw(st.sampled_from(ARRAY_LAYOUTS + ("C", "C")))
    scale = 10.0 ** draw(st.integers(-3, 1))
    values = (rng.normal(size=shape) * scale).astype(dtype)
    return layout(values, how), values.astype(np.float32).astype(np.float64)


# ----------------------------------------------------------------------------------------------------------
# Corruptions: one feature's valid batch made invalid.

def _bad_ids_for(dtype, vocab):
    """Out-of-range ids representable in ``dtype`` (or Python ints when dtype is None)."""
    if dtype is None:   # the boundaries first and twice: they are the likely off-by-one bugs
        return [vocab, -1, vocab, -1, vocab + 1, 2 ** 31, I64.max, I64.min]
    info = np.iinfo(dtype)
    cands = [vocab, -1, vocab, -1, vocab + 1, info.min, info.max, -(2 ** 31), 2 ** 31, 2 ** 63, 2 ** 64 - 1,
             2 ** 63 + vocab]
    return [c for c in cands if info.min <= c <= info.max and (c < 0 or c >= vocab)]


def _set_flat(arr, j, value, dtype=None):
    out = np.array(arr, dtype=dtype if dtype is not None else np.asarray(arr).dtype, copy=True, order="C")
    out.reshape(-1)[j] = value
    return out


def _array_of(leaf):
    """The id array the engine sees for array forms (values of Ragged/Sparse)."""
    ids = leaf.ids
    if isinstance(ids, (ec.Ragged, ec.Sparse)):
        return ids.values
    return ids


def _with_values(leaf, values):
    ids = leaf.ids
    if isinstance(ids, ec.Ragged):
        return ec.Ragged(values, ids.row_splits)
    if isinstance(ids, ec.Sparse):
        return ec.Sparse(ids.indices, values, ids.dense_shape)
    return values


def corruption_kinds(spec: FeatureSpec, leaf: Leaf):
    """The corruptions that apply to this leaf (the most telling first: Hypothesis favours early ones)."""
    n, form = leaf.n_ids, leaf.form
    kinds = []
    if n:
        kinds += ["id_out_of_range", "weight_non_finite"]
    if form == "ragged":
        kinds.append("row_splits")
    if form == "sparse":
        kinds.append("sparse_indices")
    if form in ("lists", "flat_list") and leaf.batch_size:
        kinds.append("lists_malformed")
    if form in ("ragged", "sparse", "dense", "dense1d") or n:
        kinds.append("ids_not_int")
    if form in ("ragged", "dense", "dense1d", "sparse"):
        kinds += ["ids_rank", "weight_dtype"]
    return kinds + ["weight_shape", "weight_container", "not_array"]


@st.composite
def corrupt_leaf(draw, spec: FeatureSpec, leaf: Leaf, kind=None):
    """``(ids, weights, fragments)``: an invalid version of ``leaf`` (by ``kind``, or any corruption that
    applies) and what the error must say."""
    name = f"'{spec.name}'"
    if kind is None:
        kind = draw(st.sampled_from(corruption_kinds(spec, leaf)))
    assert kind in corruption_kinds(spec, leaf), (kind, leaf.describe())
    event(f"corruption: {kind} of {leaf.form}")
    n, b, form = leaf.n_ids, leaf.batch_size, leaf.form
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    weights = leaf.weights

    if kind == "not_array":
        bad = draw(st.sampled_from([None, {"ids": [1]}, {1, 2}, (1, 2), "abc", b"ab", 1.5, 3, True, object()]))
        return bad, weights, [name]

    if kind == "id_out_of_range":
        j = draw(st.integers(0, n - 1))
        if form in ("lists", "flat_list"):
            value = draw(st.sampled_from(_bad_ids_for(None, spec.vocab)))
            samples = [list(s) for s in leaf.samples]
            k = j
            for s in samples:
                if k < len(s):
                    s[k] = value
                    break
                k -= len(s)
            bad = rebuild(leaf, samples=samples, inner="list", id_dtype=np.int64)
            return bad.ids, bad.weights, [name, f"id {value}"]
        dtype = draw(st.sampled_from([np.asarray(_array_of(leaf)).dtype.type, np.int64, np.uint64, np.int8,
                                      np.uint32]))
        value = draw(st.sampled_from(_bad_ids_for(dtype, spec.vocab)))
        values = _set_flat(np.asarray(_array_of(leaf)).astype(dtype), j, value)
        return _with_values(leaf, values), weights, [name, f"id {value}"]

    if kind == "lists_malformed":
        if form == "flat_list":
            return [s[0] for s in leaf.samples] + [[0]], weights, [name]
        samples = [list(x) for x in leaf.samples]
        variants = ["scalar_among_samples", "0d_sample", "2d_sample", "string_sample"] + (
            ["nested_in_sample"] if n else [])
        how = draw(st.sampled_from(variants))
        j = draw(st.integers(0, b - 1))
        if how == "scalar_among_samples":
            samples.append(0)
        elif how == "0d_sample":
            samples[j] = np.array(0)
        elif how == "2d_sample":
            samples[j] = np.zeros((1, 1), np.int64)
        elif how == "string_sample":
            samples.append("ab")
        else:
            j = next(i for i, x in enumerate(samples) if x)
            samples[j] = samples[j] + [[0]]
        return samples, weights, [name]

    if kind == "ids_not_int":
        if form in ("lists", "flat_list"):
            value = draw(st.sampled_from([2.5, 1.0, "7", None, 3 + 0j]))
            ids = [list(s) for s in leaf.samples] if form == "lists" else [s[0] for s in leaf.samples]
            j = draw(st.integers(0, n - 1))
            if form == "flat_list":
                ids[j] = value
            else:
                for s in ids:
                    if j < len(s):
                        s[j] = value
                        break
                    j -= len(s)
            return ids, weights, [name, "integers"]
        to = draw(st.sampled_from(["float16", "float32", "float64", "bool", "complex64", "object", "str",
                                   "bytes", "datetime64[D]", "timedelta64[s]"]))
        arr = np.asarray(_array_of(leaf))
        converted = {"str": lambda a: a.astype(str), "bytes": lambda a: a.astype(bytes)}.get(
            to, lambda a: a.astype(to))(arr)
        return _with_values(leaf, converted), weights, [name, "integers"]

    if kind == "ids_rank":
        arr = np.asarray(_array_of(leaf))
        zero_d = np.array(arr.reshape(-1)[0]) if arr.size else np.array(0, arr.dtype)
        if form == "sparse":
            choices = [arr.reshape(-1, 1)]
        elif form == "ragged":
            choices = [arr.reshape(-1, 1), arr.reshape(1, -1), zero_d]
        else:   # [B] or [B, k] made rank 3, or rank 0
            pad = (1,) * (3 - arr.ndim)
            choices = [arr.reshape(arr.shape + pad), arr.reshape(pad + arr.shape), zero_d]
        return _with_values(leaf, choices[draw(st.integers(0, len(choices) - 1))]), weights, [name]

    if kind == "row_splits":
        splits = np.asarray(leaf.ids.row_splits).astype(np.int64)
        variants = ["start", "end", "empty", "2d", "float", "bool"]
        if b >= 2:
            variants += ["decrease", "decrease_unsigned", "negative"]
        how = draw(st.sampled_from(variants))
        if how == "start":
            bad = splits + 1
        elif how == "end":
            bad = splits.copy()
            bad[-1] += 1
        elif how == "empty":
            bad = np.zeros(0, np.int64)
        elif how == "2d":
            bad = splits.reshape(1, -1)
        elif how == "float":
            bad = splits.astype(np.float64)
        elif how == "bool":
            bad = splits.astype(bool)
        elif how == "decrease":
            bad = splits.copy()
            bad[1] = splits[-1] + 1
        elif how == "decrease_unsigned":   # np.diff of unsigned splits used to wrap around
            bad = splits.astype(np.uint64)
            bad[1] = splits[-1] + 1
        else:
            bad = splits.copy()
            bad[1] = -1
            if splits[-1] <= 127:   # np.diff of int8 splits used to wrap around
                bad = bad.astype(np.int8)
        return ec.Ragged(leaf.ids.values, bad), weights, [name, "row_splits"]

    if kind == "sparse_indices":
        sp = leaf.ids
        idx = np.asarray(sp.indices).astype(np.int64)
        bsz, width = sp.dense_shape
        variants = ["shape_n3", "shape_1d", "float", "rank1_shape", "rank3_shape", "values_2d", "values_0d",
                    "negative_shape", "huge_shape", "float_shape", "bool_shape"]
        if n:
            variants += ["row_outside", "col_outside", "negative"]
        if n and spec.seq_len:
            variants.append("repeated_position")
        how = draw(st.sampled_from(variants))
        event(f"sparse_indices: {how}")
        values, shape = sp.values, sp.dense_shape
        if how == "repeated_position":  # a sequence position holds one id: a second one is refused, not summed
            j = draw(st.integers(0, n - 1))
            idx = np.concatenate([idx, idx[j:j + 1]])
            values = np.concatenate([np.asarray(values).reshape(-1), np.asarray(values).reshape(-1)[j:j + 1]])
            return ec.Sparse(idx, values, shape), None, [name, "given twice"]
        if how == "float_shape":  # was: silently truncated by int()
            k = draw(st.integers(0, 1))
            shape = tuple(d + 0.5 if i == k else d for i, d in enumerate(shape))
        elif how == "bool_shape":
            shape = (True, width) if draw(st.booleans()) else (bsz, np.bool_(True))
        elif how == "row_outside":
            idx[draw(st.integers(0, n - 1)), 0] = bsz + draw(st.integers(0, 2))
        elif how == "col_outside":
            idx[draw(st.integers(0, n - 1)), 1] = width + draw(st.integers(0, 2))
        elif how == "negative":
            idx[draw(st.integers(0, n - 1)), draw(st.integers(0, 1))] = -draw(st.integers(1, 3))
        elif how == "shape_n3":
            idx = np.concatenate([idx, np.zeros((n, 1), np.int64)], 1)
        elif how == "shape_1d":
            idx = idx[:, 0].copy()
        elif how == "float":
            idx = idx.astype(np.float64)
        elif how == "rank1_shape":
            shape = (bsz,)
        elif how == "rank3_shape":
            shape = (bsz, width, 1)
        elif how == "negative_shape":
            shape = draw(st.sampled_from([(-1, width), (-bsz - 1, width), (bsz, -1)]))
        elif how == "huge_shape":
            shape = draw(st.sampled_from([(2 ** 40, width), (2 ** 64, width), (bsz, 2 ** 63), (2 ** 62, 2 ** 62)]))
        elif how == "values_0d":
            values = np.array(np.asarray(values).reshape(-1)[0] if n else 0)
        else:
            values = np.asarray(values).reshape(-1, 1)
        return ec.Sparse(idx, values, shape), weights, [name]

    if kind == "weight_non_finite":   # NaN, Inf, or finite but beyond float32
        bad_value = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e39, -1e300]))
        j = draw(st.integers(0, n - 1))
        w = [list(s) for s in leaf.oracle_w]
        k = j
        for s in w:
            if k < len(s):
                s[k] = bad_value
                break
            k -= len(s)
        w_dtype = leaf.params["w_dtype"]
        if np.isfinite(bad_value):
            w_dtype = draw(st.sampled_from([np.float64, np.longdouble]))
            # list-of-lists weights beyond float32 are named 'inf' (a known bug, see test_fuzz)
            fragments = [name] if form == "lists" else [name, "float32"]
        else:
            if np.dtype(w_dtype).kind != "f":
                w_dtype = draw(st.sampled_from(FLOAT_DTYPES))
            fragments = [name, "non-finite", "nan" if np.isnan(bad_value) else "inf"]
        bad = rebuild(leaf, weights=w, w_dtype=w_dtype)
        return bad.ids, bad.weights, fragments

    # The rest replace the weights.
    ones = [[1.0] * len(s) for s in leaf.samples]
    good = leaf if leaf.weights is not None else rebuild(leaf, weights=ones)

    if kind == "weight_shape":
        if form in ("dense", "dense1d"):
            a = np.asarray(good.weights)
            shapes = [a.shape + (1,), (a.size + 1,), (a.shape[0] + 1,) + a.shape[1:]]
            if a.ndim == 2:
                shapes += [(a.size,), (a.shape[0], a.shape[1] + 1)]
            shape = shapes[draw(st.integers(0, len(shapes) - 1))]
            return good.ids, np.ones(shape, np.float32), [name]
        if form == "flat_list":
            return good.ids, [1.0] * (b + 1), [name]
        if form == "lists":
            if b == 0:
                return good.ids, [[1.0]], [name]
            w = [list(s) for s in ones]
            if draw(st.booleans()):
                w[draw(st.integers(0, b - 1))].append(1.0)
            else:
                w = w[:-1]
            return good.ids, w, [name]
        if form == "ragged":
            splits = np.asarray(good.ids.row_splits)
            if draw(st.booleans()):
                return good.ids, ec.Ragged(np.ones(n + 1, np.float32), np.append(splits[:-1], n + 1)), [name]
            return good.ids, ec.Ragged(np.ones(n + 1, np.float32), splits), [name]
        sp = good.weights
        bsz, width = sp.dense_shape
        how = draw(st.sampled_from(["wider", "longer"] + (["other_indices"] if n else [])))
        if how == "wider":
            return good.ids, ec.Sparse(sp.indices, sp.values, (bsz, width + 1)), [name]
        if how == "longer":
            idx = np.concatenate([np.asarray(sp.indices), np.zeros((1, 2), np.asarray(sp.indices).dtype)])
            return good.ids, ec.Sparse(idx, np.ones(n + 1, np.float32), sp.dense_shape), [name]
        idx = np.array(sp.indices, np.int64)
        idx[0, 1] = width + 1   # differs from the ids' indices
        return good.ids, ec.Sparse(idx, sp.values, sp.dense_shape), [name]

    if kind == "weight_container":
        flat = np.ones(n, np.float32)
        splits = _splits(leaf.samples)
        ragged_list = [[1.0], [1.0, 1.0]] + [[1.0]] * max(b - 2, 0)      # samples of different lengths
        if form in ("dense", "dense1d", "flat_list") or (form == "lists" and b == 0):
            choices = [ec.Ragged(flat, splits),
                       ec.Sparse(np.zeros((0, 2), np.int64), np.zeros(0, np.float32), (b, 1)), ragged_list]
            return good.ids, choices[draw(st.integers(0, len(choices) - 1))], [name]
        if form in ("ragged", "lists"):
            choices = [flat, ec.Sparse(np.zeros((0, 2), np.int64), np.zeros(0, np.float32), (b, 1)),
                       {"w": 1.0}, 1.0]
            if form == "lists":
                choices += [[1.0] * max(n, 1), [["a"] * len(x) if x else ["a"] for x in leaf.samples],
                            [np.array(1.0)] * b]
            return good.ids, choices[draw(st.integers(0, len(choices) - 1))], [name]
        choices = [flat, ec.Ragged(flat, splits), [list(s) for s in ones]]
        return good.ids, choices[draw(st.integers(0, len(choices) - 1))], [name]

    assert kind == "weight_dtype", kind
    to = draw(st.sampled_from(["str", "complex64", "object", "bool", "datetime64[D]"]))
    arr = np.asarray(good.weights.values if isinstance(good.weights, (ec.Ragged, ec.Sparse)) else good.weights)
    converted = arr.astype(str) if to == "str" else arr.astype(to) if to != "datetime64[D]" else \
        arr.astype(np.int64).astype(to)
    if isinstance(good.weights, ec.Ragged):
        return good.ids, ec.Ragged(converted, good.weights.row_splits), [name, "floats"]
    if isinstance(good.weights, ec.Sparse):
        return good.ids, ec.Sparse(good.weights.indices, converted, good.weights.dense_shape), [name, "floats"]
    return good.ids, converted, [name, "floats"]


__all__ = ["FeatureSpec", "Leaf", "make_leaf", "rebuild", "layout", "leaf_st", "gradient_st", "corrupt_leaf",
           "corruption_kinds", "INT_DTYPES", "FLOAT_DTYPES", "FORMS", "HUGE_VALENCY"]
