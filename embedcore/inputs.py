"""Host-side input preparation: features -> per-physical-table occurrence lists.

Accepted forms of one feature's ids (weights, when given, take the same form and structure):

* a NumPy integer array ``[B]`` (one id per sample), ``[B, k]`` (k ids per sample) or, high-dimensional,
  ``[d1, ..., dn, k]`` (k ids in each of the ``d1 x ... x dn`` samples; see below);
* :class:`Ragged` ``(values, row_splits)`` (one ragged dimension, as TensorFlow's rank-2 ``RaggedTensor``),
  or a list of lists of ints;
* :class:`Sparse` ``(indices [N, r], values [N], dense_shape (d1, ..., d(r-1), k))`` in COO form (any order),
  ``r >= 2``.

High-dimensional ids follow TensorFlow's TPU embedding (``tpu_embedding_v2``: an input's output shape is
its shape without the last dimension, which is combined): the samples ("bags") are the entries of the
leading shape ``(d1, ..., dn)`` in C order, each combining the ids along the last dimension, and the
activations are ``(d1, ..., dn, dim)``. A ``max_sequence_length`` applies to rank-2 ids only and is ignored,
with a warning, for higher ranks (as TensorFlow does). Ids of rank 0 are refused; a Ragged with more than one
ragged dimension is refused (TensorFlow supports rank-2 ragged ids only; give such ids as :class:`Sparse`).

Each feature becomes a :class:`FeatureBatch` (CSR over its samples: ids, ``row_splits``, weights, position of
each id in its sample, and the samples' ``leading_shape``); the features of one physical table then become
one :class:`TableBatch` of occurrences, each with its physical row, its gain (combiner weight) and the
activation row it feeds.

Errors follow TensorFlow's classes: a value that is wrong raises :class:`InputError` (a ``ValueError``); a
value of the wrong type or structure (a dict where a feature's ids belong, a list where the feature config
has a dict, weights of another form than their ids) raises :class:`InputTypeError`, which is both an
:class:`InputError` and a ``TypeError``. Every message names the feature (or the path in the structure).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .kernels.occurrences import (COMBINERS, activation_rows, fill_occurrences, first_non_finite, first_out_of_range,
                                 packed_views, splits_are_valid)
from .memory_budget import check_fits
from .tuning import DEFAULT_TUNING, Tuning

__all__ = ["Ragged", "Sparse", "FeatureBatch", "TableBatch", "InputError", "InputTypeError", "to_feature_batch",
           "build_table_batch", "select_occurrences", "flatten", "flatten_like", "unflatten", "restrict"]


class InputError(ValueError):
    """A batch of features, weights or gradients that the engine refuses; nothing was changed."""


class InputTypeError(InputError, TypeError):
    """An :class:`InputError` about a type or a structure: a container where the feature config has another
    (a list for a dict, a dict where a feature's ids belong), ids or weights of an unknown type, weights of
    another form than their ids. It is a ``TypeError`` as TensorFlow's (``nest.assert_same_structure``)
    and still an :class:`InputError` (a ``ValueError``), so ``except InputError`` code catches it."""


def _as_array(value) -> np.ndarray:
    """``value`` as a NumPy array (no copy when it already is one or shares memory with one).

    A framework tensor is recognized by duck typing, without importing its framework: one with ``detach()``
    (PyTorch) is detached first (``requires_grad`` tensors refuse ``__array__``), and one whose dtype NumPy
    lacks (bfloat16) is widened with its ``float()`` method (float32, exact for 16-bit floats).
    """
    if isinstance(value, np.ndarray):
        return value
    detach = getattr(value, "detach", None)
    if callable(detach) and hasattr(value, "__array__"):
        value = detach()
        try:
            return np.asarray(value)
        except TypeError:  # a dtype without a NumPy twin (torch.bfloat16)
            widen = getattr(value, "float", None)
            if not callable(widen):
                raise
            return np.asarray(widen())
    return np.asarray(value)


class Ragged:
    """A ragged batch: sample ``b`` holds ``values[row_splits[b]:row_splits[b + 1]]``.

    ``values`` and ``row_splits``: arrays, or anything NumPy reads, CPU torch tensors included (of any float
    dtype, with ``requires_grad`` or not: detached, bfloat16 widened to float32), without importing torch.
    One ragged dimension only (TensorFlow's rank-2 ``RaggedTensor``): ``values`` that are themselves a
    ``Ragged`` (several ragged dimensions) are kept as given and refused, naming the feature, when looked up.
    """

    def __init__(self, values, row_splits):
        self.values = values if isinstance(values, Ragged) else _as_array(values)
        self.row_splits = _as_array(row_splits)

    @classmethod
    def from_lists(cls, lists, dtype=None):
        lengths = [len(x) for x in lists]
        splits = np.zeros(len(lists) + 1, np.int64)
        np.cumsum(lengths, out=splits[1:])
        flat = [v for x in lists for v in x]
        return cls(np.asarray(flat, dtype=dtype) if flat else np.zeros(0, dtype or np.int64), splits)

    def __repr__(self):
        return f"Ragged(values={self.values!r}, row_splits={self.row_splits!r})"


class Sparse:
    """A COO batch like ``tf.SparseTensor``: ``values[i]`` sits at ``indices[i] = (sample, position)``.

    ``dense_shape`` is ``(batch_size, width)``, two ints >= 0, or high-dimensional ``(d1, ..., dn, width)``
    with ``indices[i] = (i1, ..., in, position)``: the samples are the entries of ``(d1, ..., dn)`` and the
    activations ``(d1, ..., dn, dim)``; anything else (a float such as 2.9, a bool, a negative size, one
    dimension) is kept as given and refused, naming the feature, when the batch is looked up. A sequence
    feature's position holds one id: two entries at one index are refused there too.
    """

    def __init__(self, indices, values, dense_shape):
        self.indices = _as_array(indices)
        self.values = _as_array(values)
        try:
            shape = tuple(dense_shape)
        except TypeError:
            shape = dense_shape
        else:
            shape = tuple(int(d) if _is_int(d) else d for d in shape)
        self.dense_shape = shape

    def __repr__(self):
        return f"Sparse(indices={self.indices!r}, values={self.values!r}, dense_shape={self.dense_shape!r})"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


# ----------------------------------------------------------------------------------------------------------
# Nested structures of features (dicts, lists, tuples), mirrored in the outputs.

def flatten(structure, path=""):
    """``[(path, leaf), ...]`` in a fixed order (dict keys sorted)."""
    if isinstance(structure, dict):
        out = []
        for key in sorted(structure, key=str):
            out += flatten(structure[key], f"{path}/{key}" if path else str(key))
        return out
    if isinstance(structure, (list, tuple)):
        out = []
        for i, item in enumerate(structure):
            out += flatten(item, f"{path}/{i}" if path else str(i))
        return out
    return [(path or "<root>", structure)]


def flatten_like(reference, value, what, path=""):
    """The leaves of ``value`` in the order of ``flatten(reference)``; ``value`` must mirror ``reference``
    (lists and tuples stand for each other). A container of another type than ``reference``'s raises
    :class:`InputTypeError`; missing or unexpected keys, or another length, :class:`InputError`."""
    where = path or "<root>"
    if isinstance(reference, dict):
        if not isinstance(value, dict):
            raise InputTypeError(f"{what} at '{where}' must be a dict like the feature config, got "
                                 f"{type(value).__name__}")
        if set(value) != set(reference):
            missing = sorted(map(str, set(reference) - set(value)))
            extra = sorted(map(str, set(value) - set(reference)))
            raise InputError(f"{what} at '{where}' has keys that differ from the feature config: "
                             f"missing {missing}, unexpected {extra}")
        out = []
        for key in sorted(reference, key=str):
            out += flatten_like(reference[key], value[key], what, f"{path}/{key}" if path else str(key))
        return out
    if isinstance(reference, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(reference):
            got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) \
                else type(value).__name__
            # A container of another type is a TypeError (as TensorFlow's nest); another length a ValueError.
            error = InputError if isinstance(value, (list, tuple)) else InputTypeError
            raise error(f"{what} at '{where}' must be a list/tuple of {len(reference)} entries like the "
                        f"feature config, got {got}")
        out = []
        for i, (r, v) in enumerate(zip(reference, value)):
            out += flatten_like(r, v, what, f"{path}/{i}" if path else str(i))
        return out
    return [value]


def restrict(reference, value):
    """``reference`` with each dict cut to the keys that ``value`` holds at the same place (TensorFlow's
    serving lookup takes any subset of a feature config's dict); lists, tuples and leaves are kept whole,
    and keys that ``reference`` lacks are left for :func:`flatten_like` to refuse."""
    if isinstance(reference, dict) and isinstance(value, dict):
        return {key: restrict(reference[key], value[key]) for key in reference if key in value}
    if isinstance(reference, (list, tuple)) and isinstance(value, (list, tuple)) and len(reference) == len(value):
        items = [restrict(r, v) for r, v in zip(reference, value)]
        return type(reference)(*items) if hasattr(reference, "_fields") else type(reference)(items)
    return reference


def unflatten(reference, leaves):
    """Rebuild ``reference``'s structure with ``leaves`` (in ``flatten`` order)."""
    return _build(reference, iter(leaves))


def _build(node, leaves):
    # A module-level function, not a closure over itself: a self-referencing closure is a reference cycle
    # that would keep the leaves (the activations) alive until the garbage collector runs.
    if isinstance(node, dict):
        built = {key: _build(node[key], leaves) for key in sorted(node, key=str)}
        return {key: built[key] for key in node}  # the caller's key order
    if isinstance(node, list):
        return [_build(item, leaves) for item in node]
    if isinstance(node, tuple):
        items = [_build(item, leaves) for item in node]
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)  # namedtuples too
    return next(leaves)


# ----------------------------------------------------------------------------------------------------------
# One feature.

@dataclass
class FeatureBatch:
    """A feature's ids in CSR form: sample ``b`` owns ``ids[row_splits[b]:row_splits[b + 1]]``.

    The samples are the entries of ``leading_shape`` in C order: ``(B,)`` for ``[B]``/``[B, k]`` arrays,
    Ragged and 2-D Sparse ids, ``(d1, ..., dn)`` for high-dimensional ones; ``kind`` says which form the ids
    came in (``"dense"``, ``"ragged"`` or ``"sparse"``; Python lists of samples are ``"ragged"``).
    """

    ids: np.ndarray          # int64 [N]
    row_splits: np.ndarray   # int64 [B + 1]
    weights: np.ndarray | None   # float32 [N]
    positions: np.ndarray | None  # int64 [N], position of each id within its sample; None: i - row_splits[b]
    name: str = ""           # the feature, for error messages
    given_ids: np.ndarray | None = None  # the ids as the caller gave them (their dtype), for error messages
    repeated: tuple | None = None  # (sample, position, id, id) of the first index given twice (Sparse), or None
    leading_shape: tuple | None = None  # the samples' shape; None: (batch_size,)
    kind: str = ""

    @property
    def batch_size(self) -> int:
        """The number of samples (bags): the size of ``leading_shape``."""
        return self.row_splits.shape[0] - 1

    @property
    def samples_shape(self) -> tuple:
        """``leading_shape``, or ``(batch_size,)`` when it was not given."""
        return (self.batch_size,) if self.leading_shape is None else self.leading_shape


def _int_array(values, name, what):
    values = np.asarray(values)
    if values.dtype == object:
        raise InputError(f"{what} of feature '{name}' must be integers of a NumPy integer dtype, got dtype object"
                         f"{_first_non_int64(values.reshape(-1))}")
    if values.dtype == np.bool_ or values.dtype.kind not in "iu":
        raise InputError(f"{what} of feature '{name}' must be integers, got dtype {values.dtype}")
    return values


def _first_non_int64(flat) -> str:
    """The part of a message that names the first entry of an object array that is no 64-bit integer."""
    for i, v in enumerate(flat):
        if not _is_int(v):
            return f" (holding {v!r:.60} of type {type(v).__name__} at flat index {i})"
        if not -2 ** 63 <= int(v) < 2 ** 64:
            return f" (holding {int(v)!r:.60} at flat index {i}, which does not fit in 64 bits)"
    return " (Python ints: convert them with np.asarray(ids, np.int64))" if len(flat) else ""


def _python_ints(flat):
    """A list of Python/NumPy ints as an int64 array (uint64 when some are >= 2**63 and none negative), so that
    NumPy never turns them into float64 (``np.asarray([1, 2**63])``) or objects; ``ValueError`` naming the
    first id that fits in neither."""
    flat = [int(v) for v in flat]
    low, high = (min(flat), max(flat)) if flat else (0, 0)
    if low >= -2 ** 63 and high < 2 ** 63:
        return np.array(flat, np.int64)
    if low >= 0 and high < 2 ** 64:
        return np.array(flat, np.uint64)  # the range check then names the id
    bad = next((k, v) for k, v in enumerate(flat) if not -2 ** 63 <= v < 2 ** 63)
    raise ValueError(f"id {bad[1]!r:.60} (flat position {bad[0]}) does not fit in 64 bits")


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _float_array(values, name):
    try:
        values = np.asarray(values)
    except (ValueError, TypeError) as e:
        raise InputError(f"weights of feature '{name}' do not form an array: {e}") from None
    if values.dtype.kind not in "fiu" or values.dtype == np.bool_:
        first = ""
        if values.dtype == object and values.size:
            v = values.reshape(-1)[0]
            first = f" (the first is {v!r:.60}, of type {type(v).__name__})"
        raise InputError(f"weights of feature '{name}' must be floats, got dtype {values.dtype}{first}")
    if values.size and values.dtype.itemsize > 4 or values.dtype.kind in "iu":
        wide = values.astype(np.float64).reshape(-1)
        big = np.isfinite(wide) & (np.abs(wide) > _FLOAT32_MAX)
        if big.any():
            at = int(np.flatnonzero(big)[0])
            raise InputError(f"weights of feature '{name}' hold {values.reshape(-1)[at]!r} at flat index {at}, "
                             f"beyond float32 range")
    return values.astype(np.float32, copy=False)


_SIGNED_SPLITS = (np.dtype(np.int64), np.dtype(np.int32))  # checked in one jitted pass; other dtypes by NumPy


def _check_splits(splits, n_values, name, what):
    splits = _int_array(splits, name, f"{what} row_splits")
    if splits.ndim != 1 or splits.shape[0] < 1:
        raise InputError(f"{what} row_splits of feature '{name}' must be a 1-D array of at least one entry")
    if splits.dtype in _SIGNED_SPLITS and splits_are_valid(splits, n_values):  # one pass (NumPy's checks: ~9 us)
        return splits.astype(np.int64, copy=False)
    if splits.min() < 0 or splits.max() > n_values:
        raise InputError(f"{what} row_splits of feature '{name}' must lie in [0, {n_values}] (the number of "
                         f"values); got {splits.tolist()[:16]}")
    splits = splits.astype(np.int64)  # differences in the caller's dtype could wrap (uint64, int8)
    if splits[0] != 0 or splits[-1] != n_values or np.any(np.diff(splits) < 0):
        raise InputError(f"{what} row_splits of feature '{name}' must start at 0, not decrease, and end at "
                         f"{n_values} (the number of values); got {splits.tolist()[:16]}")
    return splits.astype(np.int64, copy=False)


def _sample_ints(sample):
    """One sample's ids as a list of Python ints, or None when it holds anything else (or is not flat)."""
    if isinstance(sample, np.ndarray):
        if sample.ndim != 1:
            return None
        if sample.dtype.kind in "iu" and sample.dtype != np.bool_:
            return sample.tolist()
        sample = sample.tolist() if sample.dtype == object else None
        if sample is None:
            return None
    return list(sample) if all(_is_int(v) for v in sample) else None


def _from_python_lists(ids, weights):
    """A list of samples (each a list/tuple/1-D array of ids) as Ragged, or a flat list as an array."""
    if ids and all(isinstance(x, (list, tuple, np.ndarray)) for x in ids):
        as_ints = [_sample_ints(x) for x in ids]
        if all(x is not None for x in as_ints):
            # Concatenated as Python ints: mixing uint64 and int64 samples (or a Python int of 2**63) must not
            # promote to float64.
            values = _python_ints([v for x in as_ints for v in x])
            lengths = [len(x) for x in as_ints]
            splits = np.zeros(len(as_ints) + 1, np.int64)
            np.cumsum(lengths, out=splits[1:])
            ids = Ragged(values, splits)
        else:
            samples = [np.asarray(x) for x in ids]
            if any(x.ndim != 1 for x in samples):
                raise ValueError("every sample must be a flat sequence of ids")
            ids = Ragged.from_lists(samples)
    else:
        if any(isinstance(x, (list, tuple, np.ndarray)) for x in ids):
            raise ValueError("the list mixes samples (lists) and single ids")
        if ids and all(_is_int(x) for x in ids):
            ids = _python_ints(ids)  # NumPy would make [1, 2**63] float64 and [2**64] objects
        else:
            ids = np.asarray(ids) if ids else np.zeros(0, np.int64)  # [] is a batch of no samples
    if isinstance(weights, list):
        if isinstance(ids, Ragged):
            if len(weights) != ids.row_splits.shape[0] - 1 or \
                    not all(isinstance(x, (list, tuple, np.ndarray)) for x in weights):
                raise ValueError("weights must be a list of samples like the ids")
            weights = Ragged.from_lists(weights, np.float64)  # range-checked before the float32 cast
        else:
            if any(isinstance(x, (list, tuple, np.ndarray)) for x in weights):
                raise ValueError("weights must be a flat list like the ids")
            weights = np.asarray(weights, np.float64)
    elif isinstance(ids, np.ndarray) and weights is not None and not isinstance(weights, np.ndarray):
        raise ValueError(f"weights must be a list or an array like the ids, got {type(weights).__name__}")
    return ids, weights


def to_feature_batch(ids, weights, name: str, vocabulary_size: int, check_weights: bool = True,
                     check_range: bool = True) -> FeatureBatch:
    """Validate one feature's ids (and weights) and return its :class:`FeatureBatch`.

    Ids are range-checked (an out-of-range id would read outside the table) here or, with ``check_range``
    False, by :func:`build_table_batch`, in the pass that lays them out (one read of the ids instead of two:
    the lookup's way); weights must mirror the ids exactly and, when ``check_weights``, be finite.
    """
    _check_weights_type(weights, name)
    if isinstance(ids, list):
        try:
            ids, weights = _from_python_lists(ids, weights)
        except (ValueError, TypeError, OverflowError) as e:
            raise InputError(f"ids or weights of feature '{name}' given as Python lists do not form a batch "
                             f"(a list of samples, each a list of ids, weights mirroring them): {e}") from None
    if isinstance(ids, Ragged):
        if isinstance(ids.values, Ragged):
            raise InputError(f"ragged ids of feature '{name}' have more than one ragged dimension; only one is "
                             f"supported (TensorFlow's rank-2 ragged ids): give them as a Sparse with a dense_shape "
                             f"of rank 3 or more")
        values = _int_array(ids.values, name, "ids")
        if values.ndim != 1:
            raise InputError(f"ragged ids of feature '{name}' must have 1-D values (one ragged dimension, as "
                             f"TensorFlow's rank-2 ragged ids), got shape {values.shape}")
        splits = _check_splits(ids.row_splits, values.shape[0], name, "ids")
        w = None
        if weights is not None:
            if not isinstance(weights, Ragged):
                raise InputTypeError(f"weights of feature '{name}' must be ragged like its ids, got "
                                     f"{type(weights).__name__}")
            wsplits = np.asarray(weights.row_splits)
            if wsplits.shape != splits.shape or np.any(wsplits != splits):
                raise InputError(f"weights of feature '{name}' have row_splits that differ from its ids")
            w = _float_array(weights.values, name)
            if w.shape != values.shape:
                raise InputError(f"weights of feature '{name}' have {w.shape} values, ids have {values.shape}")
        batch = FeatureBatch(values.astype(np.int64, copy=False), splits, w, None, kind="ragged")
    elif isinstance(ids, Sparse):
        batch = _sparse_batch(ids, weights, name)
    elif isinstance(ids, np.ndarray) or (np.isscalar(ids) and not isinstance(ids, (str, bytes))):
        values = _int_array(ids, name, "ids")
        if values.ndim == 0:
            raise InputError(f"dense ids of feature '{name}' must have rank 1 ([B]) or 2 ([B, k]), or more "
                             f"([d1, ..., dn, k]); got a scalar, shape {values.shape}")
        leading = values.shape[:-1] if values.ndim > 1 else values.shape
        k = values.shape[-1] if values.ndim > 1 else 1
        w = None
        if weights is not None:
            if isinstance(weights, (Ragged, Sparse)) or (isinstance(weights, list) and
                                                         any(isinstance(x, (list, tuple)) for x in weights)
                                                         and len({len(x) for x in weights if
                                                                  isinstance(x, (list, tuple))}) > 1):
                raise InputTypeError(f"weights of feature '{name}' must be an array like its dense ids, got "
                                     f"{type(weights).__name__}")
            w = _float_array(weights, name)
            if w.shape != np.shape(ids):
                raise InputError(f"weights of feature '{name}' have shape {w.shape}, ids have shape {np.shape(ids)}")
            w = w.reshape(-1)
        b = math.prod(leading)
        splits = np.arange(0, b * k + 1, max(k, 1), dtype=np.int64) if k else np.zeros(b + 1, np.int64)
        batch = FeatureBatch(values.reshape(-1).astype(np.int64, copy=False), splits, w, None,
                             leading_shape=tuple(int(d) for d in leading), kind="dense")
    else:
        raise InputTypeError(f"ids of feature '{name}' must be a NumPy integer array, a Ragged, a Sparse or a "
                             f"list of lists; got {type(ids).__name__}")
    batch.name = name
    batch.given_ids = ids.values if isinstance(ids, (Ragged, Sparse)) else ids
    if check_range:
        _check_range(batch.ids, name, vocabulary_size, batch.given_ids)
    bad = first_non_finite(batch.weights) if check_weights and batch.weights is not None else -1
    if bad >= 0:
        raise InputError(f"weights of feature '{name}' hold a non-finite value {batch.weights[bad]} at flat "
                         f"index {bad}")
    return batch


_MAX_SAMPLES = 2 ** 40  # a declared dimension, and the samples of a high-dimensional dense_shape, stay below it


def _check_weights_type(weights, name) -> None:
    """Weights of a type no form of ids takes (a dict, a string, a set) raise :class:`InputTypeError`."""
    if isinstance(weights, (dict, set, frozenset, str, bytes)):
        raise InputTypeError(f"weights of feature '{name}' must be None or mirror its ids (an array, a Ragged, a "
                             f"Sparse or lists), got {type(weights).__name__}")


def _sparse_batch(sp: Sparse, weights, name) -> FeatureBatch:
    indices = _int_array(sp.indices, name, "sparse indices")
    values = _int_array(sp.values, name, "ids")
    shape = sp.dense_shape
    if not isinstance(shape, tuple) or len(shape) < 2 or not all(type(d) is int and 0 <= d < _MAX_SAMPLES
                                                                  for d in shape):
        raise InputError(f"sparse ids of feature '{name}' must have a 2-D dense_shape of ints in [0, 2**40), "
                         f"(B, k), or a higher-dimensional one, (d1, ..., dn, k); got {shape!r:.80}")
    leading = shape[:-1]
    b = math.prod(leading)
    if b >= _MAX_SAMPLES:
        raise InputError(f"sparse ids of feature '{name}' with dense_shape {shape} declare {b:,} samples "
                         f"(d1 x ... x dn), more than 2**40")
    # The batch size is declared, not counted: its row_splits (and their counts) must fit before they exist.
    check_fits(16 * b + 8, f"sparse ids of feature '{name}' with dense_shape {shape} (the row splits of "
               f"{b:,} samples)", error=InputError)
    if values.ndim != 1:
        raise InputError(f"sparse ids of feature '{name}' need values of shape [N]; got {values.shape}")
    n = values.shape[0]
    rank = len(shape)
    if indices.shape != (n, rank):
        raise InputError(f"sparse ids of feature '{name}' need indices of shape [N, {rank}] (dense_shape {shape} "
                         f"has {rank} dimensions) and values [N]; got {indices.shape} and {values.shape}")
    if n and ((indices.min(axis=0) < 0).any() or (indices.max(axis=0) >= np.array(shape, np.int64)).any()):
        raise InputError(f"sparse indices of feature '{name}' fall outside dense_shape {sp.dense_shape}")
    w = None
    if weights is not None:
        if not isinstance(weights, Sparse):
            raise InputTypeError(f"weights of feature '{name}' must be Sparse like its ids, got "
                                 f"{type(weights).__name__}")
        if weights.dense_shape != sp.dense_shape or np.shape(weights.indices) != indices.shape or \
                np.any(np.asarray(weights.indices) != indices):
            raise InputError(f"weights of feature '{name}' have indices or dense_shape that differ from its ids")
        w = _float_array(weights.values, name)
        if w.shape != values.shape:
            raise InputError(f"weights of feature '{name}' have {w.shape} values, ids have {values.shape}")
    sample = indices[:, 0].astype(np.int64) if rank == 2 else \
        np.ravel_multi_index(tuple(indices[:, :-1].astype(np.int64).T), leading).astype(np.int64)
    position = indices[:, -1].astype(np.int64)
    order = np.lexsort((position, sample)) if n else np.zeros(0, np.int64)
    rows = sample[order]
    positions = position[order]
    splits = np.zeros(b + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=b), out=splits[1:])
    ids = values[order].astype(np.int64)
    repeated = None
    if n > 1:
        again = np.flatnonzero((rows[1:] == rows[:-1]) & (positions[1:] == positions[:-1]))
        if again.size:
            k = int(again[0])
            repeated = (int(rows[k]), int(positions[k]), values[order[k]], values[order[k + 1]])
    return FeatureBatch(ids, splits, None if w is None else w[order], positions, repeated=repeated,
                        leading_shape=leading, kind="sparse")


def _check_range(ids, name, vocabulary_size, original):
    """Ids must lie in ``[0, vocabulary_size)``; checked on the caller's array so that no cast hides a value
    (a uint64 id of 2**64 - 1 would read as -1 after the cast to int64)."""
    original = np.asarray(ids if original is None else original)
    original = np.ascontiguousarray(original, original.dtype.newbyteorder("=")).reshape(-1)
    limit = np.uint64(vocabulary_size) if original.dtype == np.uint64 else np.int64(vocabulary_size)
    bad_at = first_out_of_range(original, limit)
    if bad_at >= 0:
        raise InputError(f"feature '{name}': id {original[bad_at]} (flat position {bad_at}) is outside the table's "
                         f"vocabulary [0, {vocabulary_size})")


# ----------------------------------------------------------------------------------------------------------
# All features of one physical table.

@dataclass
class TableBatch:
    """Occurrences of one physical table, sorted by the activation row they feed.

    ``act[a] = sum over o in out_ptr[a]:out_ptr[a+1] of gains[o] * table[rows[o]]``.
    """

    rows: np.ndarray      # int32 [N] physical row (int64 from Tuning.row_type_limit rows on)
    packed: np.ndarray    # int64 [N] activation row << 32 | the gain's float32 bits (kernels/occurrences.py), or
                          # None when every gain is 1 (out_ptr tells each occurrence's activation row)
    out_ptr: np.ndarray   # int64 [n_out + 1]
    n_out: int
    blocks: np.ndarray = None  # int64 occurrence offsets [0, ..., N] of blocks whose row ranges are disjoint and
                               # increasing (kernels/dedup.py groups them one by one); None when they are not

    @property
    def gains(self):
        """float32 [N] (a view of ``packed``), or None when every gain is 1 (the sums take None so)."""
        return None if self.packed is None else packed_views(self.packed)[1]

    @property
    def out_row(self) -> np.ndarray:
        """int32 [N] activation row of each occurrence (a view of ``packed``, or made from ``out_ptr``)."""
        if self.packed is not None:
            return packed_views(self.packed)[0]
        out_row = np.empty(self.rows.shape[0], np.int32)
        activation_rows(self.out_ptr, 0, self.n_out, out_row)
        return out_row


def build_table_batch(parts, workspace=None, tuning: Tuning = DEFAULT_TUNING) -> TableBatch:
    """Concatenate features of one physical table (into ``workspace``'s arrays when given, else new ones).

    ``parts``: ``(FeatureBatch, combiner, max_sequence_length, row_offset, out_offset, vocabulary_size)``
    per feature, in increasing ``out_offset``; a feature with ``max_sequence_length = L > 0`` feeds
    activation row ``out_offset + b * L + position`` (positions >= L dropped) with gain = weight, others feed
    ``out_offset + b`` with the combiner's gain (see :mod:`embedcore.kernels.occurrences`). Each feature's
    occurrences form a block of rows ``[row_offset, row_offset + vocabulary_size)``; consecutive features of
    one table share a block. Every id is range-checked as it is laid out: an id outside its vocabulary raises
    :class:`InputError` naming the feature and the id. When every gain is 1 (:func:`unit_gains`) no
    payload is written (``packed`` None: ``out_ptr`` tells each occurrence's activation row), else packed
    int64 words.

    ``tuning`` (speed only, the occurrences are the same): ``row_type_limit`` (rows int32 below it, else
    int64), ``unit_gain_payloads`` (False: packed words even when every gain is 1) and
    ``parallel_layout_min`` (pooled features of at least this many ids laid out by all threads).
    """
    n_out = 0
    n = 0
    rows_end = 0
    for batch, combiner, seq_len, row_offset, out_offset, vocabulary_size in parts:
        if seq_len and batch.repeated is not None:
            sample, position, first, second = batch.repeated
            raise InputError(f"feature '{batch.name}': sparse index ({sample}, {position}) is given twice (ids "
                             f"{first} and {second}); a position of a sequence feature holds one id")
        n += batch.ids.shape[0]
        n_out = out_offset + batch.batch_size * (seq_len if seq_len else 1)
        rows_end = max(rows_end, row_offset + vocabulary_size)
    if parts:
        # A batch's activation rows follow from its declared size (a Sparse dense_shape) times a sequence length.
        check_fits(8 * (n_out + 1), f"the occurrence offsets of {n_out:,} activation rows (features "
                   f"{[p[0].name for p in parts]})", error=InputError)
    rows = _array(workspace, "rows", n, np.int32 if rows_end <= tuning.row_type_limit else np.int64)
    unit = tuning.unit_gain_payloads and unit_gains(parts)
    packed = _NO_PAYLOAD if unit else _array(workspace, "packed", n, np.int64)
    out_ptr = _array(workspace, "out_ptr", n_out + 1, np.int64)
    out_ptr[0] = 0
    at = 0
    starts, ranges = [], []
    for batch, combiner, seq_len, row_offset, out_offset, vocabulary_size in parts:
        if not ranges or ranges[-1] != (row_offset, vocabulary_size):
            starts.append(at)
            ranges.append((row_offset, vocabulary_size))
        weights = _NO_WEIGHTS if batch.weights is None else np.ascontiguousarray(batch.weights, np.float32)
        positions = _NO_POSITIONS if batch.positions is None else np.ascontiguousarray(batch.positions, np.int64)
        count, in_range = fill_occurrences(np.ascontiguousarray(batch.ids, np.int64),
                                           np.ascontiguousarray(batch.row_splits, np.int64), weights, positions,
                                           COMBINERS[combiner], seq_len or 0, row_offset, out_offset, at, rows,
                                           packed, out_ptr, vocabulary_size, tuning.parallel_layout_min)
        if not in_range:
            _check_range(batch.ids, batch.name, vocabulary_size, batch.given_ids)
            raise AssertionError(f"feature '{batch.name}': the layout found an id outside [0, {vocabulary_size}) "
                                 f"that the range check did not")
        at += count
    increasing = all(lo + size <= next_lo for (lo, size), (next_lo, _) in zip(ranges, ranges[1:]))
    blocks = np.array(starts + [at], np.int64) if increasing and ranges else None
    return TableBatch(rows[:at], None if unit else packed[:at], out_ptr, n_out, blocks)


def select_occurrences(table_batch: TableBatch, keep: np.ndarray, rows: np.ndarray | None = None) -> TableBatch:
    """The occurrences of ``table_batch`` where ``keep`` (bool ``[N]``) is True, in order, each with its gain
    and activation row; ``rows`` replaces their rows (default: their own). Activation rows keep their place
    (``n_out`` is unchanged); those that lose every occurrence feed none. A new batch; the original is
    unchanged."""
    tb = table_batch
    kept_before = np.zeros(keep.shape[0] + 1, np.int64)
    np.cumsum(keep, out=kept_before[1:])
    blocks = None if tb.blocks is None else kept_before[tb.blocks]
    return TableBatch(tb.rows[keep] if rows is None else rows, None if tb.packed is None else tb.packed[keep],
                      kept_before[tb.out_ptr], tb.n_out, blocks)


def unit_gains(parts) -> bool:
    """Whether every occurrence of a table batch's ``parts`` has gain 1 (no weights, and
    :func:`gains_are_weights`): then it is laid out without payloads."""
    return all(batch.weights is None and gains_are_weights(combiner, seq_len)
               for batch, combiner, seq_len, *_ in parts)


def gains_are_weights(combiner: str, seq_len: int) -> bool:
    """Whether a feature's gains are its weights as given (a table that sums, or a sequence feature), so
    that without weights every gain is 1; mean and sqrtn divide by each bag's weights."""
    return combiner == "sum" or bool(seq_len)


def _array(workspace, name, shape, dtype):
    return np.empty(shape, dtype) if workspace is None else workspace.array(name, shape, dtype)


_NO_WEIGHTS = np.zeros(0, np.float32)
_NO_POSITIONS = np.zeros(0, np.int64)
_NO_PAYLOAD = np.zeros(0, np.int64)  # a batch whose gains are all 1 is laid out without payloads
