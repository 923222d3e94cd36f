"""Where a physical table keeps its values: the rows and the optimizer's slots.

A :class:`Storage` is a ``[n_rows, dim]`` array of rows plus one array per slot (``[n_rows, dim]`` for a slot
of ``slot_dims`` entry 2, ``[n_rows]`` for entry 1). The update kernel reads and writes them in place, the
lookup gathers from ``weights``. :class:`DenseStorage` holds every row, each array starting on a cache line,
in the table's :class:`~embedcore.kernels.half.StoredFormats`: float32, or float16 / bfloat16 for the rows,
the slots or both (2 bytes a value; jitted code reads and writes them through ``uint16`` views,
``kernel_weights`` and ``kernel_slots``). Other kinds (hash-keyed rows that appear as ids arrive) implement
the same interface.
"""

from __future__ import annotations

import numpy as np

from ..kernels.aligned import aligned_empty
from ..kernels.half import FLOAT32, StoredFormats, bits_of, format_of, stored_dtype

__all__ = ["Storage", "DenseStorage"]


class Storage:
    """The interface: ``weights`` and ``slots`` arrays of ``n_rows`` rows of ``dim`` values, and views of
    row ranges of them."""

    weights: np.ndarray
    slots: tuple
    writable: bool
    formats: StoredFormats = FLOAT32

    @property
    def kernel_weights(self) -> np.ndarray:
        """``weights`` as jitted code takes them (a ``uint16`` view of 16-bit values)."""
        return bits_of(self.weights)

    @property
    def kernel_slots(self) -> tuple:
        """``slots`` as jitted code takes them."""
        return tuple(bits_of(slot) for slot in self.slots)

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
    def bytes_needed(n_rows: int, dim: int, slot_dims, formats: StoredFormats = FLOAT32) -> int:
        """Bytes the arrays of a storage of this shape take (checked against memory before allocating)."""
        raise NotImplementedError


class DenseStorage(Storage):
    """Rows and slots of every row, each array aligned to a cache line (:mod:`embedcore.kernels.aligned`).

    ``DenseStorage(n_rows, dim, slot_dims, formats)`` allocates them (values uninitialised: the factory fills
    them); :meth:`over` wraps existing arrays (a checkpoint's memory-mapped tables, read-only).
    """

    def __init__(self, n_rows: int, dim: int, slot_dims=(), formats: StoredFormats = FLOAT32):
        self.formats = formats
        self.weights = aligned_empty((n_rows, dim), stored_dtype(formats.weights))
        slot_dtype = stored_dtype(formats.slots)
        self.slots = tuple(aligned_empty((n_rows, dim) if d == 2 else (n_rows,), slot_dtype) for d in slot_dims)
        self.writable = True

    @classmethod
    def over(cls, weights: np.ndarray, slots=()) -> "DenseStorage":
        """A storage over the given arrays (float32, float16 or bfloat16), without copying them."""
        storage = cls.__new__(cls)
        storage.weights, storage.slots = weights, tuple(slots)
        storage.formats = StoredFormats(format_of(weights.dtype),
                                        format_of(slots[0].dtype) if slots else "float32")
        storage.writable = bool(weights.flags.writeable)
        return storage

    @staticmethod
    def bytes_needed(n_rows: int, dim: int, slot_dims, formats: StoredFormats = FLOAT32) -> int:
        values = stored_dtype(formats.weights).itemsize * n_rows * dim
        slot_size = stored_dtype(formats.slots).itemsize
        return values + slot_size * sum(n_rows * dim if d == 2 else n_rows for d in slot_dims)
