"""Where a physical table keeps its values: the rows and the optimizer's slots.

A :class:`Storage` is a ``[n_rows, dim]`` array of rows plus one array per slot (``[n_rows, dim]`` for a slot
of ``slot_dims`` entry 2, ``[n_rows]`` for entry 1). The update kernel reads and writes them in place, the
lookup gathers from ``weights``. :class:`DenseStorage` holds every row, each array starting on a cache line,
in the table's :class:`~embedcore.kernels.half.StoredFormats`: float32, or float16 / bfloat16 for the rows,
the slots or both (2 bytes a value; jitted code reads and writes them through ``uint16`` views,
``kernel_weights`` and ``kernel_slots``). :class:`FusedInt8Storage` holds read-only rows of a serving export
in FBGEMM's fused 8-bit row-wise layout, which its own :meth:`~FusedInt8Storage.gather` dequantizes. Other
kinds (hash-keyed rows that appear as ids arrive) implement the same interface.
"""

from __future__ import annotations

import numpy as np

from ..kernels.aligned import aligned_empty
from ..kernels.half import FLOAT32, StoredFormats, bits_of, format_of, stored_dtype
from ..kernels.rows import gather_combine

__all__ = ["Storage", "DenseStorage", "FusedInt8Storage", "round_into"]


def round_into(out: np.ndarray, sums: np.ndarray) -> None:
    """``out[...] = sums``: float32 activations rounded to ``out``'s format (float16 or bfloat16) to nearest,
    ties to even, as NumPy's and ml_dtypes' casts round (a magnitude beyond float16's range becomes
    infinity, as the cast makes it; no warning). For the lookups that sum in float32 scratch first."""
    with np.errstate(over="ignore"):
        out[...] = sums


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

    def gather(self, rows, gains, out_ptr, act, prefetch: bool = True, stream: bool = False) -> None:
        """The lookup: ``act[a] = round(sum over o in out_ptr[a]:out_ptr[a + 1] of gains[o] * row rows[o])``,
        the sum in float32 (``gains`` None: every gain 1), as :func:`~embedcore.kernels.rows.gather_combine`
        sums, ``round`` to ``act``'s format (float32: none; float16 or bfloat16: once, to nearest, ties to
        even); ``prefetch`` as there; ``stream``: the activations may be written past the caches (same
        sums)."""
        gather_combine(self.kernel_weights, rows, gains, out_ptr, bits_of(act), prefetch, self.formats.weights,
                       stream, format_of(act.dtype))

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


class FusedInt8Storage(Storage):
    """Read-only rows quantized to 8 bits row by row, FBGEMM's fused layout: ``weights`` is ``uint8 [n_rows,
    dim + 8]``, each row its ``dim`` codes, then its float32 scale and float32 bias (value ``scale * code +
    bias``; written by :func:`embedcore.export.quantize_int8_rows`). No slots. ``rows`` gives fused rows;
    :meth:`gather` sums dequantized rows into activations (:mod:`embedcore.kernels.quantized`), reading the
    codes where they lie (no float32 copy of the table).
    """

    formats = StoredFormats("int8", "float32", False)

    def __init__(self, fused: np.ndarray):
        from ..kernels.quantized import FUSED_EXTRA_BYTES
        if fused.dtype != np.uint8 or fused.ndim != 2 or fused.shape[1] <= FUSED_EXTRA_BYTES or \
                not fused.flags.c_contiguous:
            raise ValueError(f"fused int8 rows are a C-contiguous uint8 array [n_rows, dim + {FUSED_EXTRA_BYTES}], "
                             f"got {fused.dtype} {fused.shape}")
        self.weights, self.slots, self.writable = fused, (), False
        self._extra = FUSED_EXTRA_BYTES

    @property
    def dim(self) -> int:
        return self.weights.shape[1] - self._extra

    @property
    def kernel_weights(self) -> np.ndarray:
        return self.weights

    @property
    def kernel_slots(self) -> tuple:
        return ()

    def gather(self, rows, gains, out_ptr, act, prefetch: bool = True, stream: bool = False) -> None:
        """``act[a] = sum over o in out_ptr[a]:out_ptr[a + 1] of gains[o] * dequantized row rows[o]`` (``gains``
        None: every gain 1), summed as :func:`embedcore.kernels.quantized.gather_fused8` sums, in the
        activation rows themselves: they are read as they are summed, so they are always written through the
        caches (``stream`` has no effect). 16-bit ``act`` is summed in float32 scratch, then rounded
        (:func:`round_into`)."""
        from ..kernels.quantized import gather_fused8
        sums = act if act.dtype == np.float32 else np.empty(act.shape, np.float32)
        gather_fused8(self.weights, rows, gains, out_ptr, sums, prefetch)
        if sums is not act:
            round_into(act, sums)

    @staticmethod
    def bytes_needed(n_rows: int, dim: int, slot_dims=(), formats: StoredFormats = FLOAT32) -> int:
        if len(slot_dims):
            raise ValueError("fused int8 rows are read-only: they hold no slots")
        return n_rows * (dim + 8)
