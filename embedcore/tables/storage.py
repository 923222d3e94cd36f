"""Where a physical table keeps its values: the rows and the optimizer's slots.

A :class:`Storage` is a ``[n_rows, dim]`` array of rows plus one array per slot (``[n_rows, dim]`` for a slot
of ``slot_dims`` entry 2, ``[n_rows]`` for entry 1). The update kernel reads and writes them in place, the
lookup gathers from ``weights``. :class:`DenseStorage` is the one kind today: float32, every array starting on
a cache line. Other kinds (16-bit rows, hash-keyed rows that appear as ids arrive) implement the same
interface.
"""

from __future__ import annotations

import numpy as np

from ..kernels.aligned import aligned_empty

__all__ = ["Storage", "DenseStorage"]


class Storage:
    """The interface: ``weights`` and ``slots`` arrays of ``n_rows`` rows of ``dim`` values, and views of
    row ranges of them."""

    weights: np.ndarray
    slots: tuple
    writable: bool

    @property
    def n_rows(self) -> int:
        return self.weights.shape[0]

    @property
    def dim(self) -> int:
        return self.weights.shape[1]

    def rows(self, start: int, n: int) -> np.ndarray:
        """The rows ``start .. start + n - 1`` (a view)."""
        return self.weights[start:start + n]

    def slot_rows(self, start: int, n: int) -> tuple:
        """Each slot's rows ``start .. start + n - 1`` (views), in slot order."""
        return tuple(slot[start:start + n] for slot in self.slots)

    @staticmethod
    def bytes_needed(n_rows: int, dim: int, slot_dims) -> int:
        """Bytes the arrays of a storage of this shape take (checked against memory before allocating)."""
        raise NotImplementedError


class DenseStorage(Storage):
    """float32 rows and slots, each array aligned to a cache line (:mod:`embedcore.kernels.aligned`).

    ``DenseStorage(n_rows, dim, slot_dims)`` allocates them (values uninitialised: the factory fills them);
    :meth:`over` wraps existing arrays (a checkpoint's memory-mapped tables, read-only).
    """

    def __init__(self, n_rows: int, dim: int, slot_dims=()):
        self.weights = aligned_empty((n_rows, dim), np.float32)
        self.slots = tuple(aligned_empty((n_rows, dim) if d == 2 else (n_rows,), np.float32) for d in slot_dims)
        self.writable = True

    @classmethod
    def over(cls, weights: np.ndarray, slots=()) -> "DenseStorage":
        """A storage over the given float32 arrays, without copying them."""
        storage = cls.__new__(cls)
        storage.weights, storage.slots = weights, tuple(slots)
        storage.writable = bool(weights.flags.writeable)
        return storage

    @staticmethod
    def bytes_needed(n_rows: int, dim: int, slot_dims) -> int:
        return 4 * (n_rows * dim + sum(n_rows * dim if d == 2 else n_rows for d in slot_dims))
