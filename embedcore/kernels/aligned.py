"""Arrays whose data starts on a cache-line boundary, and large ones on a huge-page boundary.

NumPy takes memory from ``malloc``, which aligns it to 16 bytes: an array of 256-byte rows (64 float32)
that starts 16 bytes into a cache line has every row spanning five lines instead of four, so every row read
or written at random moves 25% more lines than it needs to. The engine's tables, optimizer slots, scratch
arrays and activations therefore come from :func:`aligned_empty`, which starts them on a 64-byte line.

Arrays of ``HUGE_MIN`` bytes and more start on a 2 MiB boundary instead: NumPy asks Linux for transparent
huge pages for its large allocations (``madvise``), and a huge page can only back an aligned 2 MiB range,
so the whole of such an array, not all but its first partial range, can be backed by them. The cost is at
most one alignment's worth of untouched address space per array.
"""

import numpy as np

__all__ = ["aligned_empty", "aligned_zeros", "aligned_view", "is_aligned", "CACHE_LINE", "HUGE_PAGE", "HUGE_MIN"]

CACHE_LINE = 64
HUGE_PAGE = 2 << 20
HUGE_MIN = 8 << 20


def _alignment(nbytes: int) -> int:
    return HUGE_PAGE if nbytes >= HUGE_MIN else CACHE_LINE


def aligned_empty(shape, dtype) -> np.ndarray:
    """Like ``np.empty(shape, dtype)`` (C order), with the data starting at a multiple of 64 bytes (2 MiB
    for arrays of ``HUGE_MIN`` bytes and more). The array owns nothing itself: its ``base`` keeps the
    memory alive."""
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    alignment = _alignment(nbytes)
    return aligned_view(np.empty(nbytes + alignment, np.uint8), shape, dtype, alignment)


def aligned_view(raw: np.ndarray, shape, dtype, alignment: int = CACHE_LINE) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` over the bytes ``raw`` (uint8, at least ``alignment - 1`` bytes
    longer than the array), starting at its first multiple of ``alignment``; its ``base`` is ``raw``."""
    start = -address(raw) % alignment
    return np.ndarray(shape, dtype, buffer=raw, offset=start)  # (a slice of no bytes would not move)


def aligned_zeros(shape, dtype) -> np.ndarray:
    """:func:`aligned_empty`, filled with zeros."""
    out = aligned_empty(shape, dtype)
    out.fill(0)
    return out


def address(array: np.ndarray) -> int:
    """Where ``array``'s data starts (not ``array.ctypes.data``: that fills a cache inside ctypes, which
    shows as memory growing step by step in the leak checks of ``tests/test_memory.py``)."""
    return array.__array_interface__["data"][0]


def is_aligned(array: np.ndarray, alignment: int = CACHE_LINE) -> bool:
    """Whether ``array``'s data starts at a multiple of ``alignment`` bytes."""
    return address(array) % alignment == 0
