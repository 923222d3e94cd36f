"""What a translated function receives and returns: its *contract*.

A contract lists the function's parameters in order. Each parameter is one value -- a *row* (rank 1,
``[n]``, the table row's width) or a *scalar* (rank 0) of one dtype -- or a tuple of such values, all of
one dtype (the optimizer's slot variables and hyperparameters). Flattened in order, the values are the
*leaves* of the contract: what the translators trace with (one ``tf.TensorSpec`` / ``jax.ShapeDtypeStruct``
each, nested as the parameters nest), the inputs of the traced graph or jaxpr in that order, and what the
emitted function reads (``gradient``, ``slot_variables[0]``) from the signature the contract gives it.

Two contracts are used:

* :func:`optimizer_contract` ``(slot_dims, n_hyperparameters)``:
  ``f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)``, all float32: the
  gradient and the row ``[n]``, each slot ``[n]`` (``slot_dims`` 2) or ``[]`` (1), the learning rate ``[]``
  and the hyperparameters ``[]``; it returns the new row, or ``(new_row, new_slot_0, ...)``.
* :data:`SCORE`: ``f(embedding_table, last_seen, count, step)``, the row float32 ``[n]`` and three int64
  scalars; it returns one real number (``EvictByScore``: the rows scoring lowest are evicted first).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Parameter", "Leaf", "Contract", "optimizer_contract", "SCORE", "RETURNS"]

RETURNS = {"row_and_slots": "the new row, or a tuple (new row, new slots...)", "scalar": "one real number"}


def _shape(rank: int) -> str:
    return "[n]" if rank == 1 else "[]"


@dataclass(frozen=True)
class Parameter:
    """One parameter: a value of ``rank`` 1 (a row) or 0 (a scalar), or, when ``items`` is given, a tuple
    of values whose ranks ``items`` lists (each entry called ``item`` in messages and argument nodes)."""

    name: str
    rank: int = 1
    dtype: str = "float32"
    items: tuple | None = None
    item: str = ""

    def describe(self) -> str:
        if self.items is None:
            return f"{self.name} {self.dtype} {_shape(self.rank)}"
        entries = ", ".join(f"{self.dtype} {_shape(r)}" for r in self.items)
        return f"{self.name} ({entries}{',' if len(self.items) == 1 else ''})"


@dataclass(frozen=True)
class Leaf:
    """One value the function receives: ``which`` (the parameter's name, or its ``item`` name for a tuple
    entry), ``index`` (the entry's position, else None), its rank and dtype, and ``source``, how the
    emitted function reads it."""

    which: str
    index: int | None
    rank: int
    dtype: str
    source: str


@dataclass(frozen=True)
class Contract:
    """A translated function's arguments and result.

    Args:
        role: how errors name the function (``"custom computation"``).
        kind: what the emitted function is called in its docstring (``"row function"``).
        parameters: the :class:`Parameter`\\ s, in signature order.
        returns: a key of :data:`RETURNS`: ``"row_and_slots"`` (one or more values, rows or scalars) or
            ``"scalar"`` (exactly one number, not a row and not a boolean).
    """

    role: str
    kind: str
    parameters: tuple
    returns: str

    def __post_init__(self):
        if self.returns not in RETURNS:
            raise ValueError(f"returns must be one of {sorted(RETURNS)}, got {self.returns!r}")

    @property
    def signature(self) -> str:
        """The emitted function's parameter list, such as ``"embedding_table, last_seen, count, step"``."""
        return ", ".join(p.name for p in self.parameters)

    def leaves(self) -> tuple:
        """Every value the function receives, flattened in parameter order (as TensorFlow's and JAX's
        tracing flatten nested arguments)."""
        out = []
        for p in self.parameters:
            if p.items is None:
                out.append(Leaf(p.name, None, p.rank, p.dtype, p.name))
            else:
                out += [Leaf(p.item, k, r, p.dtype, f"{p.name}[{k}]") for k, r in enumerate(p.items)]
        return tuple(out)

    def describe(self) -> str:
        """``f(name dtype shape, ...) -> result``, for messages."""
        return f"f({', '.join(p.describe() for p in self.parameters)}) -> {RETURNS[self.returns]}"

    def __str__(self) -> str:
        return self.describe()


def optimizer_contract(slot_dims=(), n_hyperparameters: int = 0) -> Contract:
    """The optimizer contract for slots of ``slot_dims`` (2: a row, 1: a scalar) and ``n_hyperparameters``
    float32 hyperparameters (see the module docstring)."""
    slot_ranks = tuple(1 if int(d) == 2 else 0 for d in slot_dims)
    return Contract(
        role="custom computation", kind="row function", returns="row_and_slots",
        parameters=(Parameter("gradient"), Parameter("embedding_table"),
                    Parameter("slot_variables", items=slot_ranks, item="slot"),
                    Parameter("learning_rate", rank=0),
                    Parameter("hyperparameters", items=(0,) * int(n_hyperparameters), item="hyperparameter")))


SCORE = Contract(
    role="EvictByScore: score function", kind="score function", returns="scalar",
    parameters=(Parameter("embedding_table"), Parameter("last_seen", rank=0, dtype="int64"),
                Parameter("count", rank=0, dtype="int64"), Parameter("step", rank=0, dtype="int64")))
