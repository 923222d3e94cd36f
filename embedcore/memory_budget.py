"""Refusing allocations that cannot fit, before they are attempted.

A table of ``TableConfig(10**12, 16)``, a layer of 10^9 units or a sparse batch of ``dense_shape=(2**39, 1)``
would otherwise reach NumPy and fail with a bare ``MemoryError`` (or, worse, succeed lazily and be killed by
the kernel once its pages are touched). Every large allocation whose size comes from a user's configuration,
input or file is checked here first, so the error names what would be allocated, how many bytes it takes and
what the machine has.
"""

from __future__ import annotations

import os
import time

__all__ = ["check_fits", "available_bytes", "format_bytes"]


_REREAD_SECONDS = 1.0
_last = (None, -_REREAD_SECONDS, 0)  # (EMBEDCORE_MEMORY_LIMIT as read, when, bytes available)


def available_bytes() -> int:
    """Memory a new allocation can use: ``MemAvailable`` from ``/proc/meminfo`` where it exists (free memory
    plus reclaimable caches), else the machine's physical memory. ``EMBEDCORE_MEMORY_LIMIT`` (bytes) caps it.

    Read again at most once a second (checks run on every lookup; reading ``/proc/meminfo`` costs tens of
    microseconds and a few KB of strings), or at once when ``EMBEDCORE_MEMORY_LIMIT`` changed."""
    global _last
    cap = os.environ.get("EMBEDCORE_MEMORY_LIMIT")
    now = time.monotonic()
    if _last[0] == cap and now - _last[1] < _REREAD_SECONDS:
        return _last[2]
    limit = _read_available()
    if cap:
        try:
            limit = min(limit, int(cap))
        except ValueError:
            pass
    _last = (cap, now, limit)
    return limit


_MEMINFO = bytearray(16384)  # read into, so that a check allocates next to nothing (tests bound a step's memory)


def _read_available() -> int:
    try:
        with open("/proc/meminfo", "rb", buffering=0) as f:
            n = f.readinto(_MEMINFO)
        at = _MEMINFO.find(b"MemAvailable:", 0, n)
        if at >= 0:
            end = _MEMINFO.find(b"kB", at, n)
            return int(_MEMINFO[at + len(b"MemAvailable:"):end]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 1 << 62


def format_bytes(n: int) -> str:
    """``n`` bytes for a message: ``12.0 GiB (12,884,901,888 bytes)``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024 or unit == "EiB":
            break
        size /= 1024
    return f"{size:.1f} {unit} ({int(n):,} bytes)" if unit != "B" else f"{int(n):,} bytes"


def check_fits(nbytes: int, what: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming ``what`` when ``nbytes`` exceeds :func:`available_bytes`; nothing is allocated.

    Args:
        nbytes: the size of the allocation (an exact Python int: no overflow for absurd shapes).
        what: what would be allocated, e.g. ``"table 'user' (10^12 rows x 16 float32 values + 1 slot)"``.
        error: the exception class to raise (``InputError`` for a batch, ``ValueError`` for a configuration,
            ``CheckpointError`` for a file).
    """
    nbytes = int(nbytes)
    have = available_bytes()
    if nbytes > have:
        raise error(f"{what} would take {format_bytes(nbytes)}, more than the {format_bytes(have)} of memory "
                    f"available on this machine; nothing was allocated")
