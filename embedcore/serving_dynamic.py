"""Serving a dynamic table: its keys' rows, read-only, found through a key map built when it is opened.

A checkpoint (or serving export) stores a dynamic table's ``n`` keys increasing (as uint64) and their rows
in that order (:mod:`embedcore.checkpoint.dynamic`). Opening builds a
:class:`~embedcore.kernels.hash_map.KeyRowMap` of them (key ``i`` -> row ``i``, :meth:`~embedcore.kernels.
hash_map.KeyRowMap.load`: one pass, about 21 bytes a key beside the memory-mapped rows); a lookup then finds
each key in ``O(1)``, in parallel. Measured against a binary search of the memory-mapped keys
(``np.searchsorted``, no build, no memory): 65 536 keys (3/4 held) in a table of 2 million took 39 ms with the
map and 227 ms with the binary search (single-threaded map: 48 ms), the map's build 2.4 s, on a shared,
heavily loaded 2-core machine (absolute figures are unreliable there; the ratio is the binary search's ~21
dependent cache misses a key against the map's one or two). Lookups are what a server does all day, so the
map it is.

A key the table does not hold reads, per :class:`UnknownKeys`:

* ``"initial"`` (the default): its initial value, as the training engine gives a key it has never seen
  (:func:`~embedcore.initializers.fill_key_rows` of the table's initializer, the engine's seed and the
  table's name, rounded to the table's trained ``weights_dtype``): a function of the key alone;
* ``"zeros"``: zeros (such keys then add nothing to a sum; a mean still counts them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .initializers import TruncatedNormal, fill_key_rows
from .inputs import TableBatch, select_occurrences
from .kernels.half import stored_dtype
from .kernels.hash_map import KeyRowMap, as_keys
from .tables.dynamic import DynamicTableBatch
from .tables.physical import PhysicalTable, TablePlace
from .tables.storage import DenseStorage, FusedInt8Storage

__all__ = ["ServingDynamicTable", "UNKNOWN_KEYS", "unknown_rows"]

UNKNOWN_KEYS = ("initial", "zeros")


def unknown_rows(config, seed: int, unknown_keys: str, initializer=None):
    """The function ``keys (uint64 [u]) -> rows [u, dim]`` that gives the keys a table does not hold their
    values under ``unknown_keys`` (module docstring), in the table's ``weights_dtype``."""
    dim, name = config.dim, config.name
    stored = stored_dtype(config.weights_dtype)
    if unknown_keys == "zeros":
        return lambda keys: np.zeros((keys.shape[0], dim), stored)
    init = initializer or TruncatedNormal(0.0, 1.0 / np.sqrt(dim))

    def initial(keys):
        values = np.empty((keys.shape[0], dim), np.float32)
        fill_key_rows(init, values, keys, seed, name)
        if stored == np.float32:
            return values
        with np.errstate(over="ignore"):
            rounded = values.astype(stored)
        bad = np.flatnonzero(~np.isfinite(rounded.astype(np.float32)).all(axis=1))
        if bad.size:
            raise ValueError(f"table '{name}': the initial value of key {int(keys[bad[:1]].view(np.int64)[0])} is "
                             f"beyond the range of {stored}")
        return rounded
    return initial


class ServingDynamicTable(PhysicalTable):
    """One dynamic table, read-only: ``keys`` (uint64 ``[n]``, distinct; ``ValueError`` naming a repeated one)
    and their ``rows`` (``[n, dim]`` of
    float32, float16 or bfloat16, or fused int8 ``uint8 [n, dim + 8]``), neither copied; keys not held read
    ``unknown(keys)`` (:func:`unknown_rows`)."""

    def __init__(self, config, keys: np.ndarray, rows: np.ndarray, unknown, tuning=None):
        storage = FusedInt8Storage(rows) if rows.dtype == np.uint8 else DenseStorage.over(rows)
        super().__init__([TablePlace(config, 0, int(keys.shape[0]))], storage, None, tuning)
        self.name = config.name
        self.keys = keys
        self._unknown = unknown
        n = int(keys.shape[0])
        self.key_map = KeyRowMap(max(n, 1), config.name)
        self.key_map.load(keys, np.zeros(n, np.int32), np.zeros(n, np.int32))  # key i at row i

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key (uint64 ``[m]``), -1 where the table does not hold it."""
        return self.key_map.find(keys)

    def lay_out(self, parts):
        """As :meth:`PhysicalTable.lay_out` over the rows of the parts' keys; the keys not held are laid out
        as ``pending`` occurrences of a :class:`~embedcore.tables.dynamic.DynamicTableBatch` (read from its
        ``pending_values``)."""
        keys = [as_keys(batch.ids, f"table '{self.name}': keys") for batch, *_ in parts]
        rows = [self.find(k) for k in keys]
        absent = np.concatenate([k[r < 0] for k, r in zip(keys, rows)]) if parts else np.zeros(0, np.uint64)
        pending_keys, inverse = np.unique(absent, return_inverse=True)
        n, n_pending = int(self.keys.shape[0]), int(pending_keys.shape[0])
        mapped, at = [], 0
        for (batch, combiner, seq_len, _, out_offset, _), part_rows in zip(parts, rows):
            missing = part_rows < 0
            part_rows[missing] = n + inverse.ravel()[at:at + int(np.count_nonzero(missing))]
            at += int(np.count_nonzero(missing))
            mapped.append((dataclasses.replace(batch, ids=part_rows, given_ids=None), combiner, seq_len, 0,
                           out_offset, n + n_pending))
        tb, lease = super().lay_out(mapped)
        pending = None
        if n_pending:
            is_pending = tb.rows >= n
            pending = select_occurrences(tb, is_pending, tb.rows[is_pending] - n)
            tb = select_occurrences(tb, ~is_pending)
        fields = {f.name: getattr(tb, f.name) for f in dataclasses.fields(TableBatch)}
        return DynamicTableBatch(**fields, pending=pending,
                                 pending_values=self._unknown(pending_keys) if n_pending else None), lease

    def table_rows(self, name: str) -> np.ndarray:
        """The rows as stored, in increasing key order (:attr:`keys`)."""
        return self.storage.weights

    def __repr__(self):
        return f"ServingDynamicTable({self.name} [{self.keys.shape[0]} keys x {self.dim}, read-only])"
