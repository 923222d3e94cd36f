"""Admission and eviction policies of dynamic (hash-keyed) tables, and the kernels that apply them.

Configuration (what a ``DynamicTableConfig`` takes; validated when made, equal by value, with a readable repr):

* :class:`CountAdmission` ``(min_count=...)``: a new key gets a row once it has been seen ``min_count`` times;
  until then it reads its initial value and is only counted, in an :class:`AdmissionSketch`.
* eviction, when a batch brings more admitted new keys than free rows: the rows with the lowest score go
  first, never a row the current batch uses; ties are broken by the key (its uint64 bit pattern, smaller
  first), so the choice depends neither on the row slots nor on the thread count.

  - :class:`LRU`: score = the last step the row was seen;
  - :class:`LFU`: score = how many occurrences were counted (:meth:`KeyRowMap.touch`);
  - :class:`TTL` ``(steps=...)``: a row unseen for more than ``steps`` steps (``step - last_seen > steps``)
    expires (:func:`expired_rows`: removed before the step's lookup, so it is gone from lookups, views and
    saves alike); when the table is full of unexpired rows, the least recently seen go first (as LRU);
  - :class:`EvictByScore` ``(fn, reserve=0.01)``: ``fn(embedding_table, last_seen, count, step) -> float``, a
    user's score of one row (its values, float32 ``[dim]``; its metadata and the current step, int64),
    compiled with Numba (``njit``) the first time it scores; NaN refused. It sees the row's values, not its
    slots (the integration passes float32 rows; slots and 16-bit rows are for it to add). When it must evict
    ``n`` rows it evicts the lowest ``max(n, ceil(reserve * capacity))`` (as many as the batch leaves, at least
    ``n``), so the rows left free take the next batches' new keys without scoring again.

  Cost: LRU, LFU and TTL find their victims and expired rows through the key map's order index of their metric
  (:func:`order_index`; :mod:`embedcore.tables.order_index`), in time proportional to what they find
  (amortized), whatever the table's size; :class:`EvictByScore` scores every live row at each eviction (one
  pass on Numba's threads, then a selection), since its score may change with the step alone; its
  ``reserve`` makes evictions, and so scans, rare: one per ``reserve * capacity`` new keys.

How the integration uses them: at each step of a dynamic table, (1) ``TTL``: ``map.remove_rows(expired_rows(
map, step, ttl.steps))``; (2) ``rows = map.find(keys)``; the absent keys' ``AdmissionSketch.observe`` says which
are admitted; (3) if the distinct admitted new keys ``k`` exceed ``map.free_rows``: ``map.remove_rows(
pick_victims(policy, map, k - map.free_rows, protected_rows=rows[rows >= 0], step=step, weights=...))``
(that many rows, more for an ``EvictByScore`` with a reserve), which refuses (``TableFullError``, before
anything changed) when too few rows are unprotected; (4)
``map.find_or_insert(admitted keys, step)``. See :mod:`embedcore.kernels.hash_map`.

Memory of admission: an :class:`AdmissionSketch` is a count-min sketch of ``sketch_depth`` rows of
``sketch_width`` uint32 counters (default 4 x 2**20: 16 MiB, whatever the number of keys). Its counts never
undercount a key; collisions may overcount it, so a key can be admitted early (the chance falls with the
width; with conservative update, as here, a count is inflated only when all of a key's counters are). Counts
do not decay: a key seen ``min_count`` times ever is admitted, and an evicted key that comes back is admitted
at once (with a fresh row).
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import numba
import numpy as np
from numba import njit, prange, types

from .. import translate
from ..compile_cache import Uncacheable, fingerprint
from ..compiler import RowFunctionError, check_python_function, describe
from ..initializers import stream_key
from ..kernels.hash_map import FLOOR_BLOCK, PARALLEL_MIN, KeyRowMap, TableFullError, as_keys
from ..kernels.random import mix64  # the SplitMix64 finaliser (the tree's one copy)
from ..value_object import ValueObject
from .order_index import MIN_BLOCKS, OrderIndex, index_bytes, value_key_at_rank

__all__ = ["CountAdmission", "AdmissionSketch", "EvictionPolicy", "LRU", "LFU", "TTL", "EvictByScore",
           "pick_victims", "expired_rows", "lowest_scores", "order_index", "eviction_bytes"]

_U = np.uint64
_S32 = np.uint64(32)
_COUNTER_MAX = np.uint32(2 ** 32 - 1)


def _int_in(value, what: str, low: int, high: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ValueError(f"{what} must be an int in {low} .. {high}, got {value!r}")
    return int(value)


class _Policy(ValueObject):
    """A dynamic table's admission or eviction policy: configuration, compared by value."""


# -- admission ----------------------------------------------------------------------------------------------
class CountAdmission(_Policy):
    """Admit a key once it has been seen ``min_count`` times (1: at once), counted in a count-min sketch of
    ``sketch_depth`` x ``sketch_width`` uint32 counters (``4 * depth * width`` bytes)."""

    def __init__(self, min_count: int = 1, sketch_width: int = 2 ** 20, sketch_depth: int = 4):
        self.min_count = _int_in(min_count, "CountAdmission: min_count", 1, 2 ** 32 - 1)
        self.sketch_width = _int_in(sketch_width, "CountAdmission: sketch_width", 1, 2 ** 32 - 1)
        self.sketch_depth = _int_in(sketch_depth, "CountAdmission: sketch_depth", 1, 16)

    def sketch(self, seed: int = 0, table: str = "table") -> "AdmissionSketch":
        """A fresh :class:`AdmissionSketch` for ``table`` (its hashes keyed by the engine's seed and the name)."""
        return AdmissionSketch(self.min_count, self.sketch_width, self.sketch_depth, seed, table)


@njit(cache=True, inline="always")
def _column(key, salt, width):
    return ((mix64(key ^ salt) >> _S32) * width) >> _S32


@njit(cache=True, inline="always")
def _smallest_counter(key, salts, counters, w):
    """The count-min estimate of ``key``: the smallest of its counters, one per sketch row."""
    smallest = _COUNTER_MAX
    for d in range(counters.shape[0]):
        smallest = min(smallest, counters[d, _column(key, salts[d], w)])
    return smallest


@njit(cache=True)
def _count_occurrences(keys, salts, counters):
    """Conservative update, occurrence by occurrence in batch order: each of the key's counters becomes at
    least (the smallest of them) + 1."""
    depth, width = counters.shape
    w = _U(width)
    for i in range(keys.shape[0]):
        smallest = _smallest_counter(keys[i], salts, counters, w)
        if smallest == _COUNTER_MAX:
            continue
        new = np.uint32(smallest + np.uint32(1))
        for d in range(depth):
            c = _column(keys[i], salts[d], w)
            if counters[d, c] < new:
                counters[d, c] = new


@njit(cache=True, parallel=True)
def _estimates_parallel(keys, salts, counters, out):
    w = _U(counters.shape[1])
    for i in prange(keys.shape[0]):
        out[i] = _smallest_counter(keys[i], salts, counters, w)


@njit(cache=True)
def _estimates_serial(keys, salts, counters, out):
    w = _U(counters.shape[1])
    for i in range(keys.shape[0]):
        out[i] = _smallest_counter(keys[i], salts, counters, w)


def _estimates(keys, salts, counters, out):
    """Each key's count-min estimate into ``out``; below ``PARALLEL_MIN`` keys on one thread."""
    (_estimates_parallel if keys.shape[0] >= PARALLEL_MIN else _estimates_serial)(keys, salts, counters, out)


@njit(cache=True)
def _columns_of(keys, salts, width, out):
    w = _U(width)
    for d in range(salts.shape[0]):
        for i in range(keys.shape[0]):
            out[d, i] = np.int64(_column(keys[i], salts[d], w))


class AdmissionSketch:
    """The counts of keys that have no row yet, in bounded memory (see the module docstring).

    Key ``k``'s counter in sketch row ``d`` is column ``(mix(k ^ salt_d) >> 32) * width >> 32``, ``mix`` the
    SplitMix64 finaliser and ``salt_d = stream_key(seed, table, "admission", str(d))``; its estimate is the
    smallest of its ``depth`` counters.
    """

    def __init__(self, min_count: int, width: int, depth: int, seed: int = 0, table: str = "table"):
        self.min_count, self.table = int(min_count), table
        self.salts = np.array([stream_key(seed, table, "admission", str(d)) for d in range(depth)], np.uint64)
        self.counters = np.zeros((depth, width), np.uint32)

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes

    def observe(self, keys) -> np.ndarray:
        """Count every occurrence of ``keys`` (keys without a row), then say which occurrences are admitted
        (bool, shaped like ``keys``): those whose key's estimate reached ``min_count``."""
        shape = np.shape(keys)
        k = as_keys(keys, f"table '{self.table}': keys")
        if self.min_count <= 1:
            return np.ones(shape, np.bool_)
        _count_occurrences(k, self.salts, self.counters)
        return (self._estimate(k) >= self.min_count).reshape(shape)

    def snapshot(self, keys) -> tuple:
        """What :meth:`restore` needs to undo an :meth:`observe` of ``keys``: their counters' columns and values."""
        k = as_keys(keys, f"table '{self.table}': keys")
        columns = np.empty((self.counters.shape[0], k.shape[0]), np.int64)
        _columns_of(k, self.salts, self.counters.shape[1], columns)
        return columns, np.take_along_axis(self.counters, columns, axis=1)

    def restore(self, snapshot: tuple) -> None:
        """Put back the counters a :meth:`snapshot` saved (undoing the observations made since)."""
        columns, values = snapshot
        np.put_along_axis(self.counters, columns, values, axis=1)

    def estimate(self, keys) -> np.ndarray:
        """Each key's count estimate (int64, shaped like ``keys``; never below its true count)."""
        return self._estimate(as_keys(keys, f"table '{self.table}': keys")).reshape(np.shape(keys))

    def _estimate(self, k) -> np.ndarray:
        out = np.empty(k.shape[0], np.uint32)
        _estimates(k, self.salts, self.counters, out)
        return out.astype(np.int64)


# -- eviction -----------------------------------------------------------------------------------------------
class EvictionPolicy(_Policy):
    """The base of the eviction policies: :meth:`scores` of candidate rows, lowest evicted first."""

    def scores(self, key_map: KeyRowMap, rows: np.ndarray, step: int, weights=None) -> np.ndarray:
        """float64 score of each of ``rows`` (live rows of ``key_map``)."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Evict the least recently seen rows first (score: the last step seen)."""

    def scores(self, key_map, rows, step, weights=None):
        return key_map.last_seen[rows].astype(np.float64)


class LFU(EvictionPolicy):
    """Evict the least often seen rows first (score: occurrences counted)."""

    def scores(self, key_map, rows, step, weights=None):
        return key_map.counts[rows].astype(np.float64)


class TTL(EvictionPolicy):
    """Rows unseen for more than ``steps`` steps expire (:func:`expired_rows`); when the table is full of
    unexpired rows, the least recently seen go first (as :class:`LRU`)."""

    def __init__(self, steps: int):
        self.steps = _int_in(steps, "TTL: steps", 1, 2 ** 31 - 1)

    def scores(self, key_map, rows, step, weights=None):
        return key_map.last_seen[rows].astype(np.float64)


_SCORE_CONTRACT = "(embedding_table, last_seen, count, step)"
DEFAULT_RESERVE = 0.01  # EvictByScore's: the share of the capacity an eviction frees at least
_SCORE_SIGNATURE = (types.Array(types.float32, 1, "A"), types.int64, types.int64, types.int64)


class EvictByScore(EvictionPolicy):
    """Evict the rows with the lowest ``fn(embedding_table, last_seen, count, step)`` first: ``embedding_table``
    the row's float32 values ``[dim]``, the others int64; ``fn`` returns a real number (NaN refused; what it raises
    becomes a ``RowFunctionError`` naming the table). ``fn`` is a Python function over NumPy (def or lambda, or
    one decorated with ``numba.njit``), or one written in TensorFlow (a ``tf.function`` or a plain function of
    TF ops) or ``jax.numpy``, recognised as ``CustomOptimizer`` recognises them and translated here, at
    construction, into a NumPy-level function (:func:`embedcore.translate.to_numpy_function` with the
    :data:`~embedcore.translate.SCORE` contract; an unsupported op, or a result that is not one number, is a
    ``RowFunctionError`` naming ``fn``). That function, or ``fn`` itself, is compiled with Numba the first time
    it scores (:meth:`compiled`). ``.fn`` stays the object given; equal when ``fn`` is the same object and the
    reserves are equal.

    ``reserve``: the share of the capacity freed at once, ``0 <= reserve < 1`` (default 0.01). A score may
    change with the step alone, so no index can keep the rows in score order: finding the lowest means scoring
    every row. So when a batch's admitted new keys need ``n`` rows more than are free, the table evicts the
    ``max(n, reserve_rows(capacity))`` lowest-scored rows the batch does not use, ``reserve_rows(capacity) =
    ceil(reserve * capacity)`` (``reserve`` read as the decimal it prints as, so ``0.07`` of 100 rows is 7):
    all of them if fewer are unprotected (but at least ``n``, else the batch is refused), and the rows left free
    take the next batches' new keys without a scan. A table of ``C`` rows then scores its rows once per about
    ``reserve * C`` new keys, instead of at every step that brings one; the price is up to ``reserve * C``
    rows evicted earlier than they had to be (they would have been the next to go under the scores of that
    step). ``reserve=0`` evicts exactly the ``n`` rows needed, at every such step."""

    def __init__(self, fn, reserve: float = DEFAULT_RESERVE):
        framework = translate.framework_of(fn)
        if framework == "numpy":
            check_python_function(fn, "EvictByScore:", _SCORE_CONTRACT, "four")
        self.fn = fn
        self.reserve = _reserve(reserve)
        self._score_function = translate.to_numpy_function(fn, translate.SCORE, framework)  # fn if NumPy

    def __hash__(self):
        return hash((EvictByScore, id(self.fn), self.reserve))

    def __eq__(self, other):
        return type(other) is EvictByScore and other.fn is self.fn and other.reserve == self.reserve

    def __repr__(self):
        shown = "" if self.reserve == DEFAULT_RESERVE else f", reserve={self.reserve!r}"
        return f"EvictByScore({describe(translate.python_function(self.fn))}{shown})"

    def __deepcopy__(self, memo):
        return self  # immutable configuration, functions shared (a traced tf.function cannot be deep-copied)

    def reserve_rows(self, capacity: int) -> int:
        """``ceil(reserve * capacity)``, ``reserve`` taken as the decimal its repr shows (exact: no binary
        rounding pushes ``0.07 * 100`` to 8)."""
        return math.ceil(Fraction(repr(self.reserve)) * int(capacity))

    def compiled(self):
        """The Numba dispatcher of ``fn``, compiled for the contract's argument types (``RowFunctionError``
        naming ``fn`` when it does not compile or returns no real number)."""
        dispatcher = self.__dict__.get("_dispatcher")
        if dispatcher is not None:
            return dispatcher
        fn = self._score_function
        digest = _fingerprint(fn)
        known = _SCORE_DISPATCHERS.get(fn)
        if digest is not None and known is not None and known[0] == digest:
            self._dispatcher = known[1]
            return known[1]
        dispatcher = fn if isinstance(fn, numba.core.registry.CPUDispatcher) else numba.njit(fn)
        try:
            dispatcher.compile(_SCORE_SIGNATURE)
            returned = dispatcher.overloads[_SCORE_SIGNATURE].signature.return_type
        except Exception as exc:  # numba's typing and lowering errors
            raise RowFunctionError(f"EvictByScore: {describe(fn)} {_SCORE_CONTRACT} cannot be compiled by Numba: "
                                   f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        if not isinstance(returned, (types.Integer, types.Float)) or isinstance(returned, types.Boolean):
            raise RowFunctionError(f"EvictByScore: {describe(fn)} must return a real number, it returns {returned}")
        self._dispatcher = dispatcher
        if digest is not None:
            _SCORE_DISPATCHERS[fn] = (digest, dispatcher)
        return dispatcher

    def _params(self):
        return (("fn", self.fn), ("reserve", self.reserve))

    def _check_weights(self, key_map, weights):
        if weights is None or np.ndim(weights) != 2 or weights.dtype != np.float32:
            raise ValueError(f"table '{key_map.name}': {self!r} scores rows from their float32 values "
                             f"(weights [rows, dim]), got {None if weights is None else weights.dtype}")
        if weights.shape[0] < key_map.high_water:
            raise ValueError(f"table '{key_map.name}': {self!r} scores rows from weights [rows, dim] of at least "
                             f"{key_map.high_water} rows, got {weights.shape[0]}")

    def _raised(self, key_map, exc):
        return RowFunctionError(f"table '{key_map.name}': {self!r} raised {type(exc).__name__} while scoring "
                                f"rows for eviction: {exc}; nothing was changed")

    def _refuse_nan(self, key_map, scores, rows):
        nan = np.flatnonzero(np.isnan(scores))
        if nan.size:
            key = int(key_map.row_keys[rows[nan[0]]].view(np.int64))
            raise ValueError(f"table '{key_map.name}': {self!r} scored key {key} (row {int(rows[nan[0]])}) NaN; "
                             f"scores must be numbers")

    def scores(self, key_map, rows, step, weights=None):
        self._check_weights(key_map, weights)
        rows = np.ascontiguousarray(rows, np.int64)
        out = np.empty(rows.shape[0], np.float64)
        fn = self.compiled()
        try:
            _score_rows(fn, rows, weights, key_map.last_seen, key_map.counts, np.int64(step), out)
        except Exception as exc:  # raised by fn on some row
            raise self._raised(key_map, exc) from exc
        self._refuse_nan(key_map, out, rows)
        return out

    def scan(self, key_map, protected_rows, step, weights) -> tuple:
        """``(scores, keys, rows)`` of every live row of ``key_map`` not in ``protected_rows``, increasing by
        row: one pass over the row slots (on Numba's threads from ``PARALLEL_MIN`` slots), scoring each
        candidate once. ``ValueError`` naming the table and key for the first NaN (by row); what ``fn``
        raises, a ``RowFunctionError`` naming the table (the row found by a serial rescan, as Numba's threads
        do not carry a raised exception's type or message). Changes nothing."""
        self._check_weights(key_map, weights)
        fn = self.compiled()
        high = key_map.high_water
        mask = _protected_mask(np.ascontiguousarray(protected_rows, np.int64).ravel(), high)
        chunks = -(-high // _SCAN_CHUNK)
        starts = np.empty(chunks + 1, np.int64)
        parallel = high >= PARALLEL_MIN
        (_count_candidates_parallel if parallel else _count_candidates_serial)(key_map.counts, mask, _SCAN_CHUNK,
                                                                                starts)
        m = int(starts[chunks])
        scores, keys, rows = np.empty(m, np.float64), np.empty(m, np.uint64), np.empty(m, np.int64)
        nan_at = np.empty(chunks, np.int64)
        args = (weights, key_map.row_keys, key_map.last_seen, key_map.counts, mask, np.int64(step), _SCAN_CHUNK,
                starts, scores, keys, rows, nan_at)
        try:
            (_score_chunks_parallel if parallel else _score_chunks_serial)(fn, *args)
        except Exception as exc:  # raised by fn on some row
            if not parallel:
                raise self._raised(key_map, exc) from exc
            try:  # again on one thread, for the first row's own exception and message
                _score_chunks_serial(fn, *args)
            except Exception as serial_exc:
                raise self._raised(key_map, serial_exc) from serial_exc
            raise self._raised(key_map, exc) from exc
        nan = nan_at[nan_at >= 0]
        if nan.size:
            self._refuse_nan(key_map, scores[nan.min():nan.min() + 1], rows[nan.min():nan.min() + 1])
        return scores, keys, rows


# A score function's dispatcher, shared by every policy built on it while what it reads is unchanged (its
# fingerprint, :func:`embedcore.compile_cache.fingerprint`): the scans are specialised for the dispatcher, so a
# dispatcher per policy would compile them again for each (a test building policies in a loop spent a minute).
_SCORE_DISPATCHERS: dict = {}  # function -> (fingerprint, dispatcher)


def _fingerprint(fn) -> str | None:
    try:
        return fingerprint(fn)
    except Uncacheable:
        return None


def _reserve(value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"EvictByScore: reserve must be a real number in [0, 1) (a share of the table's "
                         f"capacity freed at each eviction), got {value!r}")
    return float(value)


_SCAN_CHUNK = 1 << 12  # row slots a thread scans at a time


@njit(cache=True)
def _protected_mask(protected, high):
    """Whether each row slot below ``high`` is among ``protected`` (entries out of range ignored)."""
    mask = np.zeros(high, np.bool_)
    for i in range(protected.shape[0]):
        p = protected[i]
        if 0 <= p < high:
            mask[p] = True
    return mask


def _count_candidates(counts, mask, chunk, starts):
    """``starts[c]``: the candidates (live, unprotected rows) before chunk ``c`` of ``chunk`` row slots;
    ``starts[-1]`` all of them."""
    high = mask.shape[0]
    chunks = starts.shape[0] - 1
    for c in prange(chunks):
        k = 0
        for r in range(c * chunk, min(high, (c + 1) * chunk)):
            if counts[r] >= 0 and not mask[r]:
                k += 1
        starts[c + 1] = k
    starts[0] = 0
    for c in range(chunks):
        starts[c + 1] += starts[c]


_count_candidates_parallel = njit(cache=True, parallel=True)(_count_candidates)
_count_candidates_serial = njit(cache=True)(_count_candidates)


def _score_chunks(fn, weights, row_keys, last_seen, counts, mask, step, chunk, starts, scores, keys, rows, nan_at):
    """Score the candidates of each chunk into ``scores``, ``keys``, ``rows`` from ``starts[c]`` on, by row;
    ``nan_at[c]``: the position of the chunk's first NaN score, or -1."""
    high = mask.shape[0]
    for c in prange(starts.shape[0] - 1):
        j = starts[c]
        first_nan = -1
        for r in range(c * chunk, min(high, (c + 1) * chunk)):
            if counts[r] < 0 or mask[r]:
                continue
            s = np.float64(fn(weights[r], np.int64(last_seen[r]), np.int64(counts[r]), step))
            if first_nan < 0 and np.isnan(s):
                first_nan = j
            scores[j] = s
            keys[j] = row_keys[r]
            rows[j] = r
            j += 1
        nan_at[c] = first_nan


# Specialised for each score function (a first-class function argument), so not cached on disk.
_score_chunks_parallel = njit(parallel=True)(_score_chunks)
_score_chunks_serial = njit(_score_chunks)


@njit
def _score_rows(fn, rows, weights, last_seen, counts, step, out):
    for i in range(rows.shape[0]):
        r = rows[i]
        out[i] = fn(weights[r], np.int64(last_seen[r]), np.int64(counts[r]), step)


_NARROW_MIN = 1 << 15  # entries from which _lowest first narrows them down with a sample
_SAMPLE = 1 << 12      # entries of that sample


@njit(cache=True)
def _narrowed(scores, keys, n):
    """Positions of a subset of ``(scores, keys)`` that holds the ``n`` lowest ``(score, key)``: every entry at
    most a bound read off an evenly strided sample, when at least ``n`` entries are (so ties at a score narrow
    too), increasing; none (an empty array) when the sample misjudged (fewer than ``n`` at most the bound) or
    the subset would not be smaller."""
    m = scores.shape[0]
    stride = m // _SAMPLE
    sample_scores = np.empty(_SAMPLE, np.float64)
    sample_keys = np.empty(_SAMPLE, np.uint64)
    for i in range(_SAMPLE):
        sample_scores[i] = scores[i * stride]
        sample_keys[i] = keys[i * stride]
    by_key = np.argsort(sample_keys, kind="mergesort")
    order = by_key[np.argsort(sample_scores[by_key], kind="mergesort")]
    expected = n * _SAMPLE / m  # the n-th lowest's rank in the sample, on average
    rank = int(expected + 4.0 * np.sqrt(expected) + 8.0)
    if rank >= _SAMPLE:
        return np.empty(0, np.int64)
    bound, bound_key = sample_scores[order[rank]], sample_keys[order[rank]]
    out = np.empty(m, np.int64)  # its pages are touched only as far as it is written
    c = 0
    for i in range(m):  # without a branch: at random scores one would be mispredicted often
        out[c] = i
        c += (scores[i] < bound) | ((scores[i] == bound) & (keys[i] <= bound_key))
    if c < n or c >= m:
        return np.empty(0, np.int64)
    return out[:c]


@njit(cache=True)
def _lowest(scores, keys, n):
    m = scores.shape[0]
    if n >= m:
        chosen = np.arange(m)
    else:
        among = _narrowed(scores, keys, n) if m >= _NARROW_MIN else np.empty(0, np.int64)
        narrowed = among.shape[0] > 0
        vals = scores[among] if narrowed else scores
        ks = keys[among] if narrowed else keys
        threshold, last_key = value_key_at_rank(vals, ks, vals.shape[0], n - 1)
        chosen = np.empty(n, np.int64)
        c = 0
        for j in range(vals.shape[0]):
            if vals[j] < threshold or (vals[j] == threshold and ks[j] <= last_key):
                chosen[c] = among[j] if narrowed else j
                c += 1
    by_key = chosen[np.argsort(keys[chosen], kind="mergesort")]
    return by_key[np.argsort(scores[by_key], kind="mergesort")]


def lowest_scores(scores, keys, n: int) -> np.ndarray:
    """Positions of the ``n`` entries with the lowest ``(score, key)`` (keys distinct, compared as uint64), in
    increasing ``(score, key)`` order; all of them when ``n >= len(scores)``. ``O(len + n log n)``: a
    selection of the threshold score, then a sort of the chosen. ``scores`` hold no NaN. From 2**15 entries the
    selection runs on the entries at most a ``(score, key)`` bound read off an evenly strided sample of 4,096 (a
    few more than ``n``, as a rule), or on all of them when fewer than ``n`` are: the answer is the same."""
    scores = np.ascontiguousarray(scores, np.float64)
    keys = as_keys(keys)
    if scores.shape != keys.shape:
        raise ValueError(f"lowest_scores: {scores.shape[0]} scores for {keys.shape[0]} keys")
    if n <= 0:
        return np.empty(0, np.int64)
    return _lowest(scores, keys, int(n))


def _metric_of(policy) -> str | None:
    """Which metadata ``policy``'s score is (``"last_seen"``, ``"counts"``), for the order index; None for a
    score of anything else (a user's function, a subclass's own score)."""
    if type(policy) in (LRU, TTL):
        return "last_seen"
    if type(policy) is LFU:
        return "counts"
    return None


def order_index(key_map: KeyRowMap, metric: str) -> OrderIndex:
    """``key_map``'s :class:`~embedcore.tables.order_index.OrderIndex` of ``metric``, built (one scan of the
    rows used) the first time it is asked for and kept up to date from then on."""
    index = _kept_index(key_map, metric)
    return index if index is not None else OrderIndex(key_map, metric)


def _kept_index(key_map: KeyRowMap, metric: str) -> OrderIndex | None:
    return next((w for w in key_map.watchers if isinstance(w, OrderIndex) and w.metric == metric), None)


def keep_order_index(policy, key_map: KeyRowMap) -> None:
    """Build ``key_map``'s order index of ``policy``'s metric (LRU, LFU, TTL) ahead of its first read, a share at
    each call (one a step): started once the map is half full, it scans ``MIN_BLOCKS`` blocks of rows a call
    plus two rows for each row slot newly used since the last call, so it is built by the time the map is full
    (and an eviction first reads it) without the one scan of every row that building it then would take. An
    earlier read (a TTL expiry) finishes the build at once."""
    metric = _metric_of(policy)
    if metric is None:
        return
    index = _kept_index(key_map, metric)
    if index is None:
        if 2 * len(key_map) < key_map.capacity:
            return
        index = OrderIndex(key_map, metric, build_now=False)
    if index.building:
        grown = key_map.high_water - index.high_water_seen
        index.build_ahead(key_map, MIN_BLOCKS + -(-2 * grown // FLOOR_BLOCK))
        index.high_water_seen = key_map.high_water


def eviction_bytes(policy, capacity: int) -> int:
    """The most bytes ``policy`` adds to a key map of ``capacity`` rows: the floor and order index of its
    metric (none for :class:`EvictByScore` or no policy)."""
    if _metric_of(policy) is None:
        return 0
    return 4 * -(-capacity // FLOOR_BLOCK) + index_bytes(capacity)


def pick_victims(policy: EvictionPolicy, key_map: KeyRowMap, n: int, protected_rows=(), step: int = 0,
                 weights=None) -> np.ndarray:
    """The live rows of ``key_map`` to evict under ``policy`` when the batch needs ``n`` rows more than are free:
    the lowest ``(score, key)`` among the rows not in ``protected_rows`` (the current batch's rows; negative
    entries, absent keys, are ignored), in that order: ``n`` of them, or for an :class:`EvictByScore` the
    ``max(n, policy.reserve_rows(capacity))`` lowest (as many as there are, if fewer, but at least ``n``).
    Changes nothing (it may tighten the key map's floors and reorder its order index).

    Cost: for :class:`LRU`, :class:`LFU` and :class:`TTL` (scores that are ``last_seen`` or ``counts``), the key
    map's order index (:func:`order_index`) reads the rows in ``(score, key)`` order from the lowest: the
    victims, the protected rows among them and the entries gone stale since the last call, plus a share of a
    background refill in proportion to what it used up (amortized ``O(n)``; a first call on a map whose index
    was not built ahead, :func:`keep_order_index`, builds it in one pass over the rows used). For
    :class:`EvictByScore`, whose score may change with ``step`` alone (so no index can be kept): one pass over
    the row slots, on Numba's threads, that scores each live unprotected row once (:meth:`EvictByScore.scan`),
    then a selection of the threshold ``(score, key)`` and a sort of the victims (``O(rows + victims log
    victims)``); its ``reserve`` frees many rows per pass, so that a table scans about once per ``reserve *
    capacity`` new keys.

    Raises:
        TableFullError: fewer than ``n`` live rows are unprotected.
        ValueError: an :class:`EvictByScore` scored a row NaN (naming the table and the key).
        RowFunctionError: an :class:`EvictByScore`'s function raised (naming the table).
    """
    n = int(n)
    if n <= 0:
        return np.empty(0, np.int64)
    protected = np.ascontiguousarray(protected_rows, np.int64).ravel()
    metric = _metric_of(policy)
    if metric is not None:
        victims = order_index(key_map, metric).lowest(key_map, n, protected)
        found = victims.shape[0]
    elif isinstance(policy, EvictByScore):
        scores, keys, rows = policy.scan(key_map, protected, step, weights)
        found = rows.shape[0]
    else:
        protected = protected[(protected >= 0) & (protected < key_map.high_water)]
        mask = np.zeros(key_map.high_water, np.bool_)
        mask[protected] = True
        live = key_map.live_rows()
        rows = live[~mask[live]]
        found = rows.shape[0]
    if found < n:
        raise TableFullError(
            f"table '{key_map.name}': cannot free {n} rows for the batch's new keys: only {found} of "
            f"its {len(key_map)} keys are not used by the batch (capacity {key_map.capacity}); nothing was changed")
    if metric is not None:
        return victims
    if isinstance(policy, EvictByScore):
        return rows[_lowest(scores, keys, max(n, policy.reserve_rows(key_map.capacity)))]
    scores = policy.scores(key_map, rows, step, weights)  # a subclass's own score
    return rows[_lowest(np.ascontiguousarray(scores, np.float64), key_map.row_keys[rows], n)]


def expired_rows(key_map: KeyRowMap, step: int, steps: int) -> np.ndarray:
    """The live rows unseen for more than ``steps`` steps at ``step`` (``step - last_seen > steps``),
    increasing. Changes nothing (it may tighten the key map's ``last_seen`` floors and reorder its order
    index). Cost: the ``last_seen`` order index (:func:`order_index`) reads the rows from the least recently
    seen: the expired ones and the entries gone stale since the last call, plus a share of a background refill
    in proportion to what it used up (amortized ``O(expired)``; a sort of the expired rows by slot)."""
    limit = int(step) - int(steps)
    if limit <= 0:
        return np.empty(0, np.int64)
    return np.sort(order_index(key_map, "last_seen").below(key_map, limit))
