"""Setting the thread count of NumPy's BLAS (OpenBLAS) at run time, for the dense model's small matmuls.

OpenBLAS's worker threads spin for a while after each call. In a training step they then compete for the
cores with Numba's threads running the embedding kernels: on a 2-core machine ``embedcore demo``'s DLRM
(batch 1024) ran its forward and backward passes several times slower with the default two BLAS threads
than with one. The trainer therefore runs BLAS on one thread. This finds the OpenBLAS library NumPy loaded (Linux:
``/proc/self/maps``) and calls its ``*_set_num_threads``; elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import re

__all__ = ["blas_threads", "set_blas_threads"]

_SYMBOLS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
            "openblas_get_num_threads")


def _libraries():
    import numpy  # noqa: F401  (NumPy loads its BLAS)
    try:
        with open("/proc/self/maps") as f:
            paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
    except OSError:
        return []
    libs = []
    for path in paths:
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            pass
    return libs


def _call(lib, names, *args):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn(*args)
    return None


def set_blas_threads(n: int) -> int | None:
    """Set OpenBLAS's thread count; returns the previous count, or None if no OpenBLAS was found."""
    previous = None
    for lib in _libraries():
        got = _call(lib, _GETTERS)
        if got is None:
            continue
        _call(lib, _SYMBOLS, ctypes.c_int(int(n)))
        previous = got if previous is None else previous
    return previous


@contextlib.contextmanager
def blas_threads(n: int):
    """Run the block with OpenBLAS on ``n`` threads, then restore the previous count."""
    previous = set_blas_threads(n)
    try:
        yield previous
    finally:
        if previous is not None:
            set_blas_threads(previous)
