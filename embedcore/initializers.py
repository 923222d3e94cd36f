"""Deterministic, partition-independent initializers for tables and slots.

Every initializer fills rows ``[first_row, first_row + n)`` of a conceptual ``[vocabulary, dim]`` table
with values that depend only on ``(seed, table, row, column)``, never on how the table is split over
stacked arrays or processes. Each is also a plain callable ``init(shape, dtype=np.float32)`` returning
the whole array, as TensorFlow's ``TableConfig(initializer=...)`` expects.

Dynamic tables have keys, not row ids: :meth:`Initializer.fill_keys` (and :func:`fill_key_rows`) give key
``k`` the values of row 0 of the conceptual table whose stream key is ``key_stream(stream, k) =
mix64(mix64(k) ^ stream)`` (``mix64`` the SplitMix64 finaliser), so a key's initial value depends only on
``(seed, table, key, column)``: not on its row slot, the order keys arrive in, or the sharding. :class:`RowId`
gives a key its own value instead (``key + offset``, the key read as int64).
"""

from __future__ import annotations

import math
import numbers
import zlib

import numpy as np

from .kernels import random as _random
from .kernels.threads import one_thread_below
from .value_object import ValueObject

__all__ = ["Initializer", "Constant", "Zeros", "TruncatedNormal", "RandomUniform", "RowId", "fill_rows",
           "fill_key_rows", "stream_key", "finite_float32", "FLOAT32_MAX"]

_MASK64 = (1 << 64) - 1

FLOAT32_MAX = float(np.finfo(np.float32).max)


def finite_float32(value, what: str) -> float:
    """``value`` as a Python float, provided it is a real number (not a bool) that stays finite when stored
    as float32; else ``ValueError`` naming ``what`` and the value.

    Every number a user declares that ends up in a table, a slot or a row function's arguments (initial
    values, initial accumulators, learning rates, hyperparameters) passes through this one check: ``1e39``
    is finite in Python but ``inf`` in float32, and one such value would make every update non-finite.
    """
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a float, got {_short(value)}")
    try:
        as_float = float(value)
    except (OverflowError, ValueError, TypeError):  # an int beyond float64, a broken __float__
        raise ValueError(f"{what} must be a finite float32 value, got {_short(value)}") from None
    with np.errstate(over="ignore", invalid="ignore"):
        stored = np.float32(as_float)  # values within half an ulp beyond FLOAT32_MAX round to it; beyond: inf
    if not np.isfinite(stored):
        raise ValueError(f"{what} must be a finite float32 value (|x| <= {FLOAT32_MAX:.7g}), got {_short(value)}")
    return as_float


def _short(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters for a message (an int of 400 digits, say)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 20]}...({len(text):,} characters)"


def _seed(value, owner):
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ValueError(f"{owner}: seed must be an int or None, got {value!r}")
    return None if value is None else int(value)


def stream_key(seed: int, *names: str) -> int:
    """A 64-bit random-stream key from an integer seed and names (table name, slot name)."""
    key = (int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64
    for name in names:
        key = (key * 0x100000001B3 ^ zlib.crc32(name.encode("utf-8"))) & _MASK64
        key = (key ^ (key >> 29)) * 0xBF58476D1CE4E5B9 & _MASK64
    return key


class Initializer(ValueObject):
    """Base class. Subclasses implement :meth:`fill`; equality is by value, as for optimizers."""

    def fill(self, out: np.ndarray, first_row: int, key: int, stride: int = 1) -> None:
        """Write rows ``first_row, first_row + stride, ...`` of the conceptual table into ``out`` in place."""
        raise NotImplementedError

    def fill_keys(self, out: np.ndarray, keys: np.ndarray, stream: int) -> None:
        """Write the rows of 64-bit ``keys`` (uint64 ``[n]``) into ``out`` (float32 ``[n, dim]``) in place: row
        ``i`` is row 0 of the conceptual table of stream key ``key_stream(stream, keys[i])``. This default
        calls :meth:`fill` once per key (a subclass may do it in one pass, with the same values)."""
        streams = np.empty(keys.shape[0], np.uint64)
        _random.key_streams(keys, np.uint64(stream), streams)
        for i in range(keys.shape[0]):
            self.fill(out[i:i + 1], 0, int(streams[i]))

    def __call__(self, shape, dtype=np.float32):
        shape = tuple(int(s) for s in shape)
        if len(shape) == 1:
            return self(shape + (1,), dtype).reshape(shape)
        if len(shape) != 2:
            raise ValueError(f"{type(self).__name__} makes 1-D or 2-D arrays; got shape {shape}")
        out = np.empty(shape, np.float32)
        self.fill(out, 0, stream_key(getattr(self, "seed", None) or 0))
        return out.astype(dtype, copy=False)


class Constant(Initializer):
    """Every value equals ``value``."""

    def __init__(self, value=0.0):
        self.value = finite_float32(value, f"{type(self).__name__}: value")

    def fill(self, out, first_row, key, stride=1):
        out.fill(self.value)

    def fill_keys(self, out, keys, stream):
        out.fill(self.value)


class Zeros(Constant):
    """Every value is 0."""

    def __init__(self):
        super().__init__(0.0)

    def __repr__(self):
        return "Zeros()"


class TruncatedNormal(Initializer):
    """Normal(mean, stddev) truncated at two standard deviations: the distribution of values redrawn while
    beyond them (as TensorFlow's). Each value is that distribution's quantile at the element's own uniform, so
    nothing is actually redrawn (:func:`embedcore.kernels.random.fill_truncated_normal`)."""

    def __init__(self, mean=0.0, stddev=0.05, seed=None):
        mean = finite_float32(mean, "TruncatedNormal: mean")
        if not (isinstance(stddev, numbers.Real) and not isinstance(stddev, bool) and stddev >= 0):
            raise ValueError(f"TruncatedNormal: stddev must be >= 0, got {stddev!r}")
        stddev = finite_float32(stddev, "TruncatedNormal: stddev")
        # Values lie within two standard deviations of the mean: all of that range must be finite in float32.
        finite_float32(abs(mean) + 2.0 * stddev, f"TruncatedNormal: |mean| + 2 stddev (mean={mean!r}, "
                                                 f"stddev={stddev!r})")
        self.mean, self.stddev, self.seed = mean, stddev, _seed(seed, "TruncatedNormal")

    def fill(self, out, first_row, key, stride=1):
        _random.fill_truncated_normal(out, first_row, np.uint64(key), self.mean, self.stddev, stride)

    def fill_keys(self, out, keys, stream):
        _random.fill_truncated_normal_keys(out, keys, np.uint64(stream), self.mean, self.stddev)


class RandomUniform(Initializer):
    """Uniform on ``[minval, maxval)``."""

    def __init__(self, minval=-0.05, maxval=0.05, seed=None):
        minval = finite_float32(minval, "RandomUniform: minval")
        maxval = finite_float32(maxval, "RandomUniform: maxval")
        if not minval <= maxval:
            raise ValueError(f"RandomUniform: minval must be <= maxval, got {minval!r} > {maxval!r}")
        self.minval, self.maxval, self.seed = minval, maxval, _seed(seed, "RandomUniform")

    def fill(self, out, first_row, key, stride=1):
        _random.fill_uniform(out, first_row, np.uint64(key), self.minval, self.maxval, stride)

    def fill_keys(self, out, keys, stream):
        _random.fill_uniform_keys(out, keys, np.uint64(stream), self.minval, self.maxval)


class RowId(Initializer):
    """Row ``r`` holds ``r + offset`` in every column: makes lookups easy to read in tests. In a dynamic table
    key ``k`` holds ``k + offset`` (the key read as int64, rounded to float32)."""

    def __init__(self, offset=0.0):
        self.offset = finite_float32(offset, "RowId: offset")

    def fill(self, out, first_row, key, stride=1):
        _random.fill_row_id(out, first_row, self.offset, stride)

    def fill_keys(self, out, keys, stream):
        _random.fill_key_values(out, keys.view(np.int64), self.offset)


def fill_rows(initializer, out: np.ndarray, first_row: int, vocabulary_size: int, seed: int, *names: str,
              stride: int = 1):
    """Fill ``out`` (rows ``first_row, first_row + stride, ...`` of a ``[vocabulary_size, out.shape[1]]``
    table) in place, with finite float32 values only.

    ``initializer`` is an :class:`Initializer`, a float constant, or any callable ``(shape, dtype)``;
    a plain callable is asked for the whole table and sliced (it must itself be deterministic).
    The random stream is keyed by the initializer's own seed if it has one, else the engine's ``seed``,
    and by ``names`` (table, slot), so two tables never share a stream.

    Raises:
        ValueError: naming the table, the slot and the first row, when what was written holds NaN or a value
            beyond float32 range (a user's callable or :class:`Initializer` subclass; the built-in ones
            refuse such parameters when constructed), or a callable returned no array of numbers of the
            table's shape. ``out`` is then not to be used.
    """
    where = _where(names)
    if isinstance(initializer, (int, float, np.floating, np.integer)) and not isinstance(initializer, bool):
        out.fill(finite_float32(initializer, f"the initial value of {where}"))
        return
    if isinstance(initializer, Initializer):
        own_seed = getattr(initializer, "seed", None)
        initializer.fill(out, first_row, stream_key(seed if own_seed is None else own_seed, *names), stride)
    else:
        full_shape = (vocabulary_size, out.shape[1])
        values = np.asarray(initializer(full_shape, np.float32))
        if values.dtype == np.bool_ or values.dtype.kind not in "iuf":
            raise ValueError(f"initializer {initializer!r} for {'/'.join(names)} returned an array of dtype "
                             f"{values.dtype}, expected real numbers")
        if values.shape != full_shape and values.shape != (vocabulary_size,):
            raise ValueError(f"initializer {initializer!r} for {'/'.join(names)} returned shape {values.shape}, "
                             f"expected {full_shape}")
        values = values.reshape(vocabulary_size, -1)
        with np.errstate(over="ignore", invalid="ignore"):  # beyond float32 range: inf, refused just below
            out[:] = values[first_row::stride][:out.shape[0]]
    bad = _random.first_non_finite_row(out)
    if bad >= 0:
        row = first_row + bad * stride
        values = out[bad]
        value = values[~np.isfinite(values)][0]
        raise ValueError(f"initializer {initializer!r} for {where} wrote {value} to row {row}: initial values "
                         f"must be finite in float32 (|x| <= {FLOAT32_MAX:.7g}); nothing was built")


def fill_key_rows(initializer, out: np.ndarray, keys, seed: int, *names: str) -> None:
    """Fill ``out`` (float32 ``[n, dim]``) in place with the initial rows of 64-bit ``keys`` (int64 or
    uint64 ``[n]``: their bit patterns) of a dynamic table: :meth:`Initializer.fill_keys` under the stream
    keyed as :func:`fill_rows` keys it (the initializer's own seed, else ``seed``, and ``names``: table, slot),
    or a float constant. Only finite float32 values are written.

    Raises:
        ValueError: naming the table and slot, for an initializer that is neither a float nor an
            :class:`Initializer` (a plain callable makes a table of row ids, which keys do not have), or one
            that wrote NaN or a value beyond float32 range (naming the key).
    """
    where = _where(names)
    if isinstance(initializer, (int, float, np.floating, np.integer)) and not isinstance(initializer, bool):
        out.fill(finite_float32(initializer, f"the initial value of {where}"))
        return
    if not isinstance(initializer, Initializer):
        raise ValueError(f"{where} is a dynamic table, whose initial values are functions of the key: its "
                         f"initializer must be a float or an embedcore initializer, got {initializer!r:.80}")
    keys = np.ascontiguousarray(keys).ravel()
    if keys.dtype not in (np.int64, np.uint64):
        raise ValueError(f"the keys of {where} must be int64 or uint64, got dtype {keys.dtype}")
    keys = keys.view(np.uint64)
    own_seed = getattr(initializer, "seed", None)
    with one_thread_below(out.size):   # a step's new keys are often a handful
        initializer.fill_keys(out, keys, stream_key(seed if own_seed is None else own_seed, *names))
    bad = _random.first_non_finite_row(out)
    if bad >= 0:
        values = out[bad]
        value = values[~np.isfinite(values)][0]
        key = int(keys[bad:bad + 1].view(np.int64)[0])
        raise ValueError(f"initializer {initializer!r} for {where} wrote {value} for key {key}: initial values "
                         f"must be finite in float32 (|x| <= {FLOAT32_MAX:.7g})")


def _where(names) -> str:
    if len(names) >= 2:
        return f"slot '{names[1]}' of table '{names[0]}'"
    return f"table '{names[0]}'" if names else "the table"
