"""What every dataset yields: feature descriptions, batches, and helpers shared by the readers.

A dataset object has ``features: list[FeatureSpec]``, ``n_dense: int``, ``name: str``,
``n_samples(split) -> int`` and ``batches(batch_size, split="train") -> Iterator[Batch]`` with split
``"train"`` or ``"eval"`` (the last batch may be smaller). A :class:`Batch` feeds
:meth:`embedcore.Embedding.lookup` directly: ``emb.lookup(batch.ids, batch.weights)`` with the feature
configuration from :func:`feature_configs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...inputs import Ragged

__all__ = ["FeatureSpec", "Batch", "DataFormatError", "feature_configs", "rebatch", "hash_uniform",
           "eval_mask", "SPLITS", "excerpt", "EXCERPT_CHARS"]

SPLITS = ("train", "eval")
_COMBINERS = ("sum", "mean", "sqrtn")


EXCERPT_CHARS = 80


def excerpt(text, limit: int = EXCERPT_CHARS) -> str:
    """``repr(text)`` for an error message, bounded: text longer than ``limit`` characters shows its first
    ``limit`` characters and its length, so a 10 MB garbage line gives a short message."""
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


class DataFormatError(ValueError):
    """A malformed input file: the message starts with ``path:line:`` (and names the column when known)."""

    def __init__(self, path, line, message, column=None):
        self.path, self.line, self.column = str(path), line, column
        where = f"{self.path}:{line}" if line is not None else self.path
        if column is not None:
            where += f": column '{column}'"
        super().__init__(f"{where}: {message}")


@dataclass
class FeatureSpec:
    """One categorical feature of a dataset.

    Attributes:
        name: key of the feature in ``Batch.ids`` / ``Batch.weights``.
        vocabulary_size: ids lie in ``[0, vocabulary_size)``.
        max_ids: 1 for a one-hot feature, else the longest bag (number of ids of one sample).
        weighted: whether ``Batch.weights[name]`` holds a :class:`~embedcore.Ragged` of float32 weights
            (``None`` otherwise).
        combiner: how a model should pool a bag: ``"sum"``, ``"mean"`` or ``"sqrtn"`` (with the weights).
        bag: whether ``Batch.ids[name]`` is a :class:`~embedcore.Ragged` (else an int64 ``[B]`` array);
            defaults to ``max_ids > 1 or weighted``. A reader sets it for a feature whose samples hold at
            most one id but may hold none (an empty cell).
        source: where ``vocabulary_size`` comes from, for messages (e.g. ``"hash_buckets"`` or ``"its
            largest id 10 at log.csv:3"``); not compared.
    """

    name: str
    vocabulary_size: int
    max_ids: int = 1
    weighted: bool = False
    combiner: str = "sum"
    bag: bool | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FeatureSpec name must be a non-empty string, got {self.name!r}")
        if int(self.vocabulary_size) < 1:
            raise ValueError(f"feature '{self.name}': vocabulary_size must be >= 1, got {self.vocabulary_size}")
        if int(self.max_ids) < 0:
            raise ValueError(f"feature '{self.name}': max_ids must be >= 0, got {self.max_ids}")
        if self.combiner not in _COMBINERS:
            raise ValueError(f"feature '{self.name}': combiner must be one of {_COMBINERS}, got {self.combiner!r}")
        self.vocabulary_size, self.max_ids = int(self.vocabulary_size), int(self.max_ids)
        self.weighted = bool(self.weighted)
        if self.bag is None:
            self.bag = self.max_ids != 1 or self.weighted
        self.bag = bool(self.bag)
        if self.weighted and not self.bag:
            raise ValueError(f"feature '{self.name}': a weighted feature must be a bag")


def feature_configs(features, dim, optimizer=None, initializer=None, storage=None, dynamic=None) -> dict:
    """``{name: FeatureConfig}`` with one table per feature (``vocabulary_size`` rows of ``dim``, the
    feature's combiner), ready for ``Embedding(feature_configs(ds.features, dim), optimizer)``.

    ``storage`` says how the tables are stored: ``TableConfig``'s ``weights_dtype``, ``slot_dtype`` and
    ``stochastic_rounding`` as one dict for every table, or a callable ``name -> dict`` (default: float32).
    ``dynamic``: a callable ``name -> dict or None``; a dict (``capacity``, and optionally ``admission`` and
    ``eviction``: :class:`~embedcore.DynamicTableConfig`'s arguments) makes that feature's table dynamic, its
    ids 64-bit keys."""
    from ...config import DynamicTableConfig, FeatureConfig, TableConfig

    def stored(name):
        return (storage(name) if callable(storage) else storage) or {}

    def table(f):
        keyed = dynamic(f.name) if dynamic is not None else None
        if keyed is not None:
            return DynamicTableConfig(dim, name=f.name, optimizer=optimizer, initializer=initializer,
                                      combiner=f.combiner, **keyed, **stored(f.name))
        return TableConfig(f.vocabulary_size, dim, initializer=initializer, optimizer=optimizer,
                           combiner=f.combiner, name=f.name, **stored(f.name))

    return {f.name: FeatureConfig(table(f)) for f in features}


# ----------------------------------------------------------------------------------------------------------
# Ragged helpers (row_splits are int64 and start at 0).

def _ragged_slice(r: Ragged, start: int, stop: int) -> Ragged:
    s = r.row_splits
    return Ragged(r.values[s[start]:s[stop]], s[start:stop + 1] - s[start])


def _ragged_take(r: Ragged, rows: np.ndarray) -> Ragged:
    s = r.row_splits
    lengths = np.diff(s)[rows]
    splits = np.zeros(rows.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=splits[1:])
    index = np.repeat(s[:-1][rows] - splits[:-1], lengths) + np.arange(splits[-1], dtype=np.int64)
    return Ragged(r.values[index], splits)


def _ragged_concat(parts) -> Ragged:
    offsets = np.cumsum([0] + [p.row_splits[-1] for p in parts[:-1]])
    splits = np.concatenate([np.zeros(1, np.int64)] + [p.row_splits[1:] + o for p, o in zip(parts, offsets)])
    return Ragged(np.concatenate([p.values for p in parts]), splits)


def _apply(x, fn_array, fn_ragged):
    if x is None:
        return None
    return fn_ragged(x) if isinstance(x, Ragged) else fn_array(x)


@dataclass
class Batch:
    """One batch of ``B`` samples.

    Attributes:
        dense: float32 ``[B, n_dense]`` (``n_dense`` may be 0).
        ids: feature name -> int64 ``[B]`` (one-hot feature) or :class:`~embedcore.Ragged` of int64 (bag).
        weights: feature name -> :class:`~embedcore.Ragged` of float32 mirroring the ids, or ``None``
            (same keys as ``ids``).
        labels: float32 ``[B]`` of 0/1.
        teacher_prob: float64 ``[B]``, the true click probability of each sample (synthetic data only),
            or ``None``.
    """

    dense: np.ndarray
    ids: dict
    weights: dict
    labels: np.ndarray
    teacher_prob: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def size(self) -> int:
        return len(self)

    def slice(self, start: int, stop: int) -> "Batch":
        """Samples ``start:stop`` (views where possible)."""
        return Batch(self.dense[start:stop],
                     {k: _apply(v, lambda a: a[start:stop], lambda r: _ragged_slice(r, start, stop))
                      for k, v in self.ids.items()},
                     {k: _apply(v, lambda a: a[start:stop], lambda r: _ragged_slice(r, start, stop))
                      for k, v in self.weights.items()},
                     self.labels[start:stop],
                     None if self.teacher_prob is None else self.teacher_prob[start:stop])

    def take(self, rows) -> "Batch":
        """The samples at ``rows`` (a boolean mask or an int index array), in that order."""
        rows = np.asarray(rows)
        rows = np.flatnonzero(rows) if rows.dtype == np.bool_ else rows.astype(np.int64)
        return Batch(self.dense[rows],
                     {k: _apply(v, lambda a: a[rows], lambda r: _ragged_take(r, rows)) for k, v in self.ids.items()},
                     {k: _apply(v, lambda a: a[rows], lambda r: _ragged_take(r, rows))
                      for k, v in self.weights.items()},
                     self.labels[rows],
                     None if self.teacher_prob is None else self.teacher_prob[rows])

    @staticmethod
    def concat(batches) -> "Batch":
        """Samples of ``batches`` one after another (all must have the same features)."""
        batches = list(batches)
        if len(batches) == 1:
            return batches[0]
        first = batches[0]

        def join(parts):
            if parts[0] is None:
                return None
            return _ragged_concat(parts) if isinstance(parts[0], Ragged) else np.concatenate(parts)

        return Batch(np.concatenate([b.dense for b in batches]),
                     {k: join([b.ids[k] for b in batches]) for k in first.ids},
                     {k: join([b.weights[k] for b in batches]) for k in first.weights},
                     np.concatenate([b.labels for b in batches]),
                     None if first.teacher_prob is None else np.concatenate([b.teacher_prob for b in batches]))


def rebatch(blocks, batch_size: int):
    """Regroup an iterator of :class:`Batch` blocks into batches of exactly ``batch_size`` samples (the
    last one may be smaller), in order."""
    check_batch_size(batch_size)
    pending, n = [], 0
    for block in blocks:
        if len(block) == 0:
            continue
        pending.append(block)
        n += len(block)
        if n >= batch_size:
            merged = Batch.concat(pending)
            pos = 0
            while n - pos >= batch_size:
                yield merged.slice(pos, pos + batch_size)
                pos += batch_size
            pending = [merged.slice(pos, n)] if pos < n else []
            n -= pos
    if n:
        yield Batch.concat(pending)


def check_batch_size(batch_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


def check_split(split):
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


# ----------------------------------------------------------------------------------------------------------
# Stable hashing for deterministic splits (never Python's salted hash()).

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_uniform(index, seed: int) -> np.ndarray:
    """A uniform float64 in ``[0, 1)`` per index: the top 53 bits of ``splitmix64(splitmix64(seed) + index)``
    (mod 2**64). Stable across platforms and runs."""
    key = _splitmix64(np.array([int(seed) % 2**64], np.uint64))[0]
    with np.errstate(over="ignore"):
        h = _splitmix64(np.asarray(index).astype(np.uint64) + key)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def eval_mask(index, seed: int, eval_fraction: float) -> np.ndarray:
    """``True`` where the row with that index belongs to the eval split: ``hash_uniform(index, seed) <
    eval_fraction``."""
    return hash_uniform(index, seed) < eval_fraction


def check_fraction(eval_fraction):
    if not 0.0 <= float(eval_fraction) <= 1.0:
        raise ValueError(f"eval_fraction must lie in [0, 1], got {eval_fraction!r}")
    return float(eval_fraction)
