"""Grow-only scratch arrays reused across steps, so a step allocates nothing large.

Fresh arrays of a few megabytes cost page faults on first touch (about as much as the work done in them,
for a training step's index arrays), so every per-step array of the engine lives in a :class:`Workspace`.
Arrays that must outlive the call that fills them (a lookup's occurrences, kept until its
``apply_gradients``) come from a :class:`WorkspacePool`: each lookup leases a workspace and gives it back
when its context is used up or dropped.
"""

import threading

import numpy as np

__all__ = ["Workspace", "WorkspacePool"]


class Workspace:
    """Named arrays whose first dimension grows by doubling and is viewed at the size asked for."""

    def __init__(self):
        self._buffers = {}

    def array(self, name: str, shape, dtype) -> np.ndarray:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < shape[0] or buf.shape[1:] != shape[1:] or buf.dtype != dtype:
            grown = max(shape[0], 16, 2 * buf.shape[0] if buf is not None and buf.shape[1:] == shape[1:] else 0)
            buf = np.empty((grown,) + shape[1:], dtype)
            self._buffers[name] = buf
        return buf[:shape[0]]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class WorkspacePool:
    """Workspaces handed out one per holder and returned for reuse; safe to use from several threads."""

    def __init__(self):
        self._free = []
        self._lock = threading.Lock()

    def acquire(self) -> Workspace:
        with self._lock:
            return self._free.pop() if self._free else Workspace()

    def release(self, workspace: Workspace) -> None:
        with self._lock:
            self._free.append(workspace)

    @property
    def idle(self) -> int:
        """Workspaces waiting to be reused."""
        return len(self._free)
