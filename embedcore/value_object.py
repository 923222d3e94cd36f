"""Objects compared by value: initializers and dynamic-table policies are configuration, like optimizers.

:class:`ValueObject`: equal when of the same type with equal attributes (``vars``), hashed alike (so equal
configurations stack and cache together), and shown as ``Type(name=value, ...)`` in attribute order. A
callable attribute compares by identity, as Python compares functions.
"""

from __future__ import annotations

__all__ = ["ValueObject"]


class ValueObject:
    def _params(self) -> tuple:
        return tuple(vars(self).items())

    def __eq__(self, other):
        return type(self) is type(other) and self._params() == other._params()

    def __hash__(self):
        return hash((type(self), self._params()))

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._params())})"
