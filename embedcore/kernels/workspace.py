"""Grow-only scratch arrays reused across steps, so a step allocates nothing large.

Fresh arrays of a few megabytes cost page faults on first touch (about as much as the work done in them,
for a training step's index arrays), so every per-step array of the engine lives in a :class:`Workspace`.
Arrays that must outlive the call that fills them (a lookup's occurrences, kept until its
``apply_gradients``) come from a :class:`WorkspacePool`: each lookup leases a workspace and gives it back
when its context is used up or dropped.
"""

import collections
import sys
import threading

import numpy as np

from .aligned import CACHE_LINE, aligned_empty, aligned_view

__all__ = ["Workspace", "WorkspacePool", "ArrayPool"]


class Workspace:
    """Named arrays whose first dimension grows by doubling and is viewed at the size asked for."""

    def __init__(self):
        self._buffers = {}
        self.state = {}  # small values kept from one call to the next (what a heuristic learned)

    def array(self, name: str, shape, dtype) -> np.ndarray:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        buf = self._buffers.get(name)
        same_kind = buf is not None and buf.shape[1:] == shape[1:] and buf.dtype == dtype
        if not same_kind or buf.shape[0] < shape[0]:
            # Doubling only what outgrew itself: a name asked for in another dtype or row shape (a table
            # batch's rows are int32 or int64) starts afresh at the size asked for.
            grown = max(shape[0], 16, 2 * buf.shape[0] if same_kind else 0)
            buf = aligned_empty((grown,) + shape[1:], dtype)
            self._buffers[name] = buf
        return buf[:shape[0]]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class WorkspacePool:
    """Workspaces handed out one per holder and returned for reuse; safe to use from several threads.

    Lock-free (a deque's append and pop are atomic): ``release`` runs from a garbage-collected context's
    finalizer, which can fire inside any allocation, ``acquire``'s own included, where a lock held by
    ``acquire`` would deadlock.
    """

    def __init__(self):
        self._free = collections.deque()

    def acquire(self) -> Workspace:
        try:
            return self._free.pop()
        except IndexError:
            return Workspace()

    def release(self, workspace: Workspace) -> None:
        self._free.append(workspace)

    @property
    def idle(self) -> int:
        """Workspaces waiting to be reused."""
        return len(self._free)


class ArrayPool:
    """Arrays handed to callers to keep, whose memory is reused once the caller no longer refers to them.

    A training loop takes a new activations array every step and drops the previous one; fresh arrays of
    megabytes cost page faults on their first write (milliseconds a step), on some steps and not others,
    as glibc's malloc hands memory back to the system. ``empty`` returns a view of a pooled buffer that
    nothing else refers to any more (its reference count says so: every NumPy view, and every consumer of
    the buffer protocol, such as ``torch.from_numpy``, holds a reference to it), else a new buffer. So a
    caller sees exactly what a new array would give it, but for starting on a cache line
    (:mod:`embedcore.kernels.aligned`). Small arrays come from ``aligned_empty``.
    """

    MIN_BYTES = 1 << 20
    _FREE = 2  # references of an unused buffer as sys.getrefcount sees it: the pool's list, the argument

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._buffers = []
        self._lock = threading.Lock()

    def empty(self, shape, dtype) -> np.ndarray:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return aligned_empty(shape, dtype)
        with self._lock:  # the view is made before another thread can see the buffer as free
            free = [k for k in range(len(self._buffers)) if sys.getrefcount(self._buffers[k]) == self._FREE]
            fits = [k for k in free if self._buffers[k].nbytes >= nbytes + CACHE_LINE]
            if fits:
                k = min(fits, key=lambda k: self._buffers[k].nbytes)
            elif free or len(self._buffers) < self.capacity:
                buffer = np.empty(nbytes + CACHE_LINE, np.uint8)  # views start at its first line
                if free:  # replace the largest unused buffer that is too small
                    k = max(free, key=lambda k: self._buffers[k].nbytes)
                    self._buffers[k] = buffer
                else:
                    k = len(self._buffers)
                    self._buffers.append(buffer)
            else:
                return aligned_empty(shape, dtype)
            return aligned_view(self._buffers[k], shape, dtype)  # its base is the buffer, so its count sees it

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers)
