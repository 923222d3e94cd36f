"""Small parallel regions on the calling thread alone.

A parallel region wakes Numba's thread team and waits for all of it at the join. For a few hundred values
that costs more than the work (tens of microseconds on an idle machine), and on a loaded one a woken thread
may wait for a core for a whole scheduler slice: measured 8 ms for filling 10 rows with 2 threads, 15 us with
one. :func:`one_thread_below` runs the kernels called inside it on one thread when their work is small.
Results never depend on it: every kernel that uses it computes each element independently.
"""

from __future__ import annotations

import contextlib

import numba

__all__ = ["SMALL_WORK", "one_thread_below"]

SMALL_WORK = 1 << 14   # elements below which a parallel region is not worth waking the team


@contextlib.contextmanager
def one_thread_below(work: int, minimum: int = SMALL_WORK):
    """Within the block, Numba's parallel kernels called by this thread run on it alone if ``work <
    minimum`` (``numba.set_num_threads`` is per calling thread); otherwise nothing changes."""
    if work >= minimum:
        yield
        return
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(threads)
