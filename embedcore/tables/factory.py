"""The one place that turns tables into physical tables: the stacking rule, the memory check, storage,
kernels and initial values.

Lookup-only engines (TensorFlow's ``TPUEmbedding(optimizer=None)``): when no table has an optimizer and the
engine passes none, every physical table has no optimizer: no slots, no update kernel. Some
tables with an optimizer and some without is refused: a table either trains or it does not, engine-wide.

Stacking rule: with ``stack_tables``, tables of equal optimizers (``__eq__``: by value), equal ``dim`` and
equal storage (``weights_dtype``, ``slot_dtype``, ``stochastic_rounding``) share one physical table, in the
order the features first name them, each at the row offset after the previous one; without it every table has
its own. Dynamic tables (:class:`~embedcore.config.DynamicTableConfig`, ``capacity`` rows each) stack by the
same rule among themselves, never with static ones, into a
:class:`~embedcore.tables.dynamic_physical.DynamicPhysicalTable`. ``Embedding``, each rank of
``ShardedEmbedding`` (over its shards), ``restore`` and ``ServingEmbedding`` (read-only, over a checkpoint's
arrays) all build their tables here.
"""

from __future__ import annotations

import numpy as np

from ..config import DynamicTableConfig
from ..initializers import Initializer
from ..memory_budget import check_fits
from ..tuning import Tuning
from .dynamic import map_bytes
from .dynamic_physical import DynamicPhysicalTable
from .physical import PhysicalTable, TablePlace
from .storage import DenseStorage, FusedInt8Storage

__all__ = ["physical_tables", "read_only_tables", "stack", "optimizer_of", "lookup_only"]


def lookup_only(tables, default_optimizer) -> bool:
    """Whether ``tables`` make a lookup-only engine: no default optimizer and no table with its own.

    Raises ``ValueError`` naming the tables when some have an optimizer (their own or the default) and some
    have none."""
    if default_optimizer is not None:
        return False
    without = [t.name for t in tables if t.optimizer is None]
    if len(without) == len(tables):
        return True
    if without:
        with_one = [t.name for t in tables if t.optimizer is not None]
        which = f"table '{without[0]}' has" if len(without) == 1 else f"tables {without} have"
        raise ValueError(f"{which} no optimizer while table(s) {with_one} have one: set TableConfig(optimizer=...) "
                         f"or pass one to Embedding(optimizer=...); an engine whose tables all have no optimizer "
                         f"(and optimizer=None) is lookup-only")
    return False


def optimizer_of(table, default_optimizer):
    """The optimizer that updates ``table``: its own, else the engine's; ``ValueError`` when neither is set."""
    opt = table.optimizer if table.optimizer is not None else default_optimizer
    if opt is None:
        raise ValueError(f"table '{table.name}' has no optimizer: set TableConfig(optimizer=...) or pass "
                         f"one to Embedding(optimizer=...)")
    return opt


def stack(tables, default_optimizer, stack_tables: bool = True) -> list:
    """``[(optimizer, dim, [tables])]``: the physical tables the stacking rule makes of ``tables`` (the
    optimizer None for every group of a lookup-only engine, see :func:`lookup_only`)."""
    groups, by_key = [], {}
    frozen = lookup_only(tables, default_optimizer)
    for table in tables:
        opt = None if frozen else optimizer_of(table, default_optimizer)
        dynamic = isinstance(table, DynamicTableConfig)
        key = (dynamic, opt, table.dim, table.stored_formats) if stack_tables else id(table)
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = (opt, table.dim, [])
            groups.append(group)
        group[2].append(table)
    return groups


def _places(members, shards):
    """Each member's place: whole tables, or ``shards[name] = (first, stride, rows)`` (a shard of no rows
    keeps one placeholder row)."""
    places, offset = [], 0
    for t in members:
        first, stride, rows = (0, 1, t.vocabulary_size) if shards is None else shards[t.name]
        places.append(TablePlace(t, offset, rows, first, stride))
        offset += max(rows, 1)
    return places, offset


def _check_fits(plans) -> None:
    """Refuse (``ValueError``) physical tables whose rows and slots (and, for a non-lazy optimizer, the
    update's status byte per row) cannot fit in memory, each and all together, naming the tables and the
    bytes, before anything is allocated."""
    total, names = 0, []
    for opt, dim, places, n_rows in plans:
        formats = places[0].config.stored_formats
        slot_dims = () if opt is None else opt.slot_dims
        nbytes = DenseStorage.bytes_needed(n_rows, dim, slot_dims, formats) + (0 if opt is None or opt.lazy else n_rows)
        nbytes += sum(map_bytes(p.config) for p in places if isinstance(p.config, DynamicTableConfig))
        n_slots = len(slot_dims)
        slot_kind = "" if formats.slots == "float32" else f"{formats.slots} "
        tables = [p.config.name for p in places]
        what = (f"table(s) {tables} ({n_rows:,} rows x {dim:,} {formats.weights} values"
                f"{f', plus {n_slots} {slot_kind}slot(s)' if n_slots else ''})")
        check_fits(nbytes, what)
        total += nbytes
        names += tables
    if len(plans) > 1:
        check_fits(total, f"the tables {names} and their slots together")


def physical_tables(tables, default_optimizer, *, stack_tables: bool = True, seed: int = 0,
                    tuning: Tuning | None = None, fill: bool = True, unit_gains=None, shards=None) -> tuple:
    """The physical tables of ``tables`` (``TableConfig``, named), stacked by the rule above.

    Args:
        default_optimizer: the optimizer of tables that set none.
        seed: the engine's seed of initial values (a table's initializer's own seed wins).
        tuning: passed on to every physical table.
        fill: write initial values (``False``: the caller writes every row, e.g. from a checkpoint).
        unit_gains: ``unit_gains(physical_table) -> bool``, whether its batches without weights have every
            gain 1 (its kernel is compiled first for the payload its updates will mostly bring); default: no.
        shards: table name -> ``(first, stride, rows)``: hold only those rows of each table (a rank's shards).

    Without any optimizer (:func:`lookup_only`) each has no slots and no update kernel.

    Raises ``ValueError`` (no optimizer for some tables only; not enough memory, before anything is
    allocated) and :class:`~embedcore.compiler.RowFunctionError` (an update kernel that cannot compile).
    """
    plans = []
    for opt, dim, members in stack(tables, default_optimizer, stack_tables):
        for table in members:
            if isinstance(table, DynamicTableConfig):
                _check_dynamic(table, opt, shards)
        places, n_rows = _places(members, shards)
        plans.append((opt, dim, places, n_rows))
    _check_fits(plans)
    out = []
    for opt, dim, places, n_rows in plans:
        storage = DenseStorage(n_rows, dim, () if opt is None else opt.slot_dims, places[0].config.stored_formats)
        kind = DynamicPhysicalTable if isinstance(places[0].config, DynamicTableConfig) else PhysicalTable
        table = kind(places, storage, opt, tuning, seed)
        if opt is not None:
            table.compile(table.payload_is_activation_rows(bool(unit_gains(table)) if unit_gains is not None
                                                           else False))
        if fill:
            for p in places:
                table.fill(p.config.name, seed)
        out.append(table)
    return tuple(out)


def _check_dynamic(table, opt, shards) -> None:
    """Refuse (``ValueError`` naming the table) what a dynamic table cannot do: row shards (a
    ``ShardedEmbedding`` places a dynamic table's keys by their hash, :mod:`embedcore.distributed.dynamic`, never
    by row ranges), a non-lazy optimizer (it would update free row slots), slot initializers that are plain callables (they
    make tables of row ids; a key has none)."""
    if shards is not None:
        raise ValueError(f"table '{table.name}' is dynamic: its keys are placed by hash, not in row shards")
    if opt is None:
        return
    if not opt.lazy:
        raise ValueError(f"table '{table.name}' is dynamic: its optimizer {type(opt).__name__} is not lazy (it "
                         f"would update every row slot each step, free ones included); use a lazy one")
    for slot, init in zip(opt.slot_names, opt.slot_initializers):
        if not isinstance(init, (int, float, Initializer)):
            raise ValueError(f"table '{table.name}' is dynamic: the initializer of slot '{slot}' must be a float or "
                             f"an embedcore initializer (its values are functions of the key), got {init!r:.80}")


def read_only_tables(tables, weights: dict, tuning: Tuning | None = None) -> tuple:
    """One read-only physical table per table, over ``weights[name]`` (not copied; e.g. a checkpoint's
    memory-mapped arrays): ``[vocabulary_size, dim]`` of float32, float16 or bfloat16, or a serving export's
    int8 rows, ``uint8 [vocabulary_size, dim + 8]`` (:class:`~embedcore.tables.storage.FusedInt8Storage`,
    dequantized as lookups gather them): lookups only."""
    out = []
    for t in tables:
        if isinstance(t, DynamicTableConfig):
            raise ValueError(f"table '{t.name}' is dynamic: read-only (serving) tables of dynamic tables are not "
                             f"supported yet")
        array = weights[t.name]
        if array.dtype == np.uint8:
            storage = FusedInt8Storage(array)
        else:
            storage = DenseStorage.over(array)
        if (storage.n_rows, storage.dim) != (t.vocabulary_size, t.dim):
            raise ValueError(f"table '{t.name}' [{t.vocabulary_size} x {t.dim}] given rows of shape {array.shape}")
        out.append(PhysicalTable([TablePlace(t, 0, t.vocabulary_size)], storage, None, tuning))
    return tuple(out)


