"""Which process owns which rows: row ``r`` of a table lives on rank ``(r + rotation) % world_size``.

Each table has its own ``rotation`` (a hash of its name), so the hot low ids of many tables do not all land
on rank 0. The rows a rank owns form an arithmetic progression: ``first, first + world, first + 2 world,
...`` with ``first = (rank - rotation) mod world``; a rank stores them in that order, so global row ``r``
sits at local index ``(r - first) // world`` on its owner. Checkpoints record exactly this (first row,
stride, count) per shard, which is all a reader needs to reassemble a table on any number of ranks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Shard", "rotation", "shard_of", "owners", "local_index"]


def rotation(table_name: str, world_size: int) -> int:
    """The table's rotation: a stable hash of its name, modulo the world size."""
    return zlib.crc32(table_name.encode("utf-8")) % world_size


@dataclass(frozen=True)
class Shard:
    """Rows ``first + i * stride`` for ``i < rows`` of a table of ``vocabulary_size`` rows."""

    first: int
    stride: int
    rows: int
    vocabulary_size: int

    def global_rows(self) -> np.ndarray:
        return self.first + self.stride * np.arange(self.rows, dtype=np.int64)


def shard_of(vocabulary_size: int, world_size: int, rank: int, rot: int) -> Shard:
    """The rows ``rank`` owns of a table of ``vocabulary_size`` rows split over ``world_size`` ranks."""
    first = (rank - rot) % world_size
    rows = 0 if first >= vocabulary_size else (vocabulary_size - first + world_size - 1) // world_size
    return Shard(first, world_size, rows, vocabulary_size)


def owners(ids: np.ndarray, world_size: int, rot: int) -> np.ndarray:
    """The owning rank of each global row id."""
    return (ids + rot) % world_size


def local_index(ids: np.ndarray, world_size: int, rot: int) -> np.ndarray:
    """Each global row id's index in its owner's local storage."""
    first = (owners(ids, world_size, rot) - rot) % world_size
    return (ids - first) // world_size
