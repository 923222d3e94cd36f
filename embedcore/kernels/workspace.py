"""Grow-only scratch arrays reused across steps, so a step allocates nothing large."""

import numpy as np

__all__ = ["Workspace"]


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
