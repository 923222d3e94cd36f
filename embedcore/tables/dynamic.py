"""Dynamic (hash-keyed) tables: rows that appear as 64-bit keys arrive, under admission and eviction.

A :class:`DynamicTable` is one table's ``capacity`` row slots (values and slots) and a
:class:`~embedcore.kernels.hash_map.KeyRowMap` from keys to those row slots, with its admission and eviction.
Its rows live in the storage of a :class:`~embedcore.tables.dynamic_physical.DynamicPhysicalTable`, which
stacks the dynamic tables of equal optimizer, ``dim`` and storage formats (never with static tables), each at a
row offset; the keys, admission counts, eviction and removals of each table stay its own.

A lookup of step ``t`` (the engine's ``step``: how many ``apply_gradients`` ran before it) maps the batch's
keys to rows *before* its occurrences are laid out, so grouping, gathering and the update kernel are the
static ones:

1. TTL: the rows unseen for more than ``steps`` steps (``t - last_seen > steps``) are removed (they were gone
   already: views hide them as soon as they expire);
2. the keys without a row go through admission (:class:`~embedcore.tables.policies.CountAdmission`: counted,
   admitted once seen ``min_count`` times; without admission every key is admitted at once);
3. when the distinct admitted new keys outnumber the free rows, the eviction policy picks victims among the
   rows the batch does not use (:func:`~embedcore.tables.policies.pick_victims`: as many as needed, or for
   an ``EvictByScore`` with a reserve, up to its share of the capacity, the rows beyond the batch's needs
   left free); without eviction, or with too few rows the batch does not use, the batch is refused with
   :class:`~embedcore.inputs.InputError` naming the table, and nothing changed (admission counts included);
4. every admitted new key gets a row (the most recently freed first, then never used ones), filled with its
   initial value and fresh slots: functions of the seed, the table and the key only
   (:func:`~embedcore.initializers.fill_key_rows`), so a key starts the same whatever its row slot, its
   arrival order, or whether it was evicted before;
5. the rows used are touched (``last_seen = t``, ``count +=`` their occurrences): what LRU, LFU and TTL read.
   Lookups count, not only updates: a lookup of a key is a sighting of it, and touching the rows at once
   protects them from eviction by later lookups before the update;
6. an unadmitted key's occurrences read its initial value (in the table's stored dtype) from a scratch array
   of the batch, not from a row; its update is dropped.

``apply_gradients`` then updates the admitted keys' rows as a static table's rows. A context is refused
(:class:`~embedcore.inputs.InputError`) once a later lookup evicted or expired rows of its table: its rows may
hold other keys by then. The rows an :class:`~embedcore.tables.physical.TableUpdate` names are keys
(int64 bit patterns) for a dynamic table.

Stochastic rounding of 16-bit rows keys its bits by the table and the row slot (deterministic: slots are
assigned in batch order), not by the key: the same stacked or not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..initializers import TruncatedNormal, fill_key_rows
from ..inputs import InputError, TableBatch
from ..kernels.hash_map import (MAX_STEP, KeyRowMap, TableFullError, as_keys, find_in_maps, first_occurrences,
                                 touch_in_maps)
from .policies import TTL, EvictByScore, eviction_bytes, expired_rows, keep_order_index, pick_victims
from .storage import DenseStorage

__all__ = ["DynamicTable", "DynamicTableBatch", "DynamicTableState", "DynamicTableView", "map_bytes", "plan_tables",
           "commit_plans"]


def map_bytes(config) -> int:
    """Bytes a dynamic table needs beyond its rows and slots: the key map at its final size (with the floor and
    order index its eviction policy reads, if any) and the admission sketch (for the engine's memory check)."""
    capacity = config.capacity
    sketch = 0
    if config.admission is not None and config.admission.min_count > 1:
        sketch = 4 * config.admission.sketch_width * config.admission.sketch_depth
    return 16 * capacity + 4 * (int(capacity / 0.75) + 1) + eviction_bytes(config.eviction, capacity) + sketch


@dataclass
class DynamicTableBatch(TableBatch):
    """A dynamic table's :class:`~embedcore.inputs.TableBatch`: its own fields are the admitted keys'
    occurrences (rows of the storage, what the update reads); ``pending`` the unadmitted keys' occurrences
    (rows of ``pending_values``, their initial values; looked up, never updated); ``removals`` the removal
    count of each table it looked up (name -> count) when it was laid out (a later eviction makes it stale)."""

    pending: TableBatch | None = None
    pending_values: np.ndarray | None = None
    removals: dict | None = None


@dataclass
class _Plan:
    """What a lookup will change in a dynamic table, decided (and checked) before anything changes but the
    admission counts, which :meth:`DynamicTable.cancel` restores."""

    parts: list
    step: int
    keys: np.ndarray          # uint64, every occurrence looked up (positions a sequence drops excluded)
    used: list                # per part: bool mask of its occurrences looked up, or None (all)
    found: np.ndarray         # int64 row of each key, -1 where absent
    absent_at: np.ndarray     # positions in ``keys`` of the absent keys
    admitted: np.ndarray      # bool, per absent key: admitted now
    victims: np.ndarray       # rows to evict
    new_keys: np.ndarray      # uint64 distinct admitted new keys, in order of first occurrence
    new_values: tuple         # (weights, *slots) of the new keys, stored dtypes
    pending_inverse: np.ndarray  # per unadmitted occurrence: its distinct key's index in pending_values
    pending_values: np.ndarray   # initial rows of the distinct unadmitted keys, stored dtype
    undo: tuple | None        # admission counters to restore on cancel


_NO_ROWS = np.zeros(0, np.int64)
_NO_FLAGS = np.zeros(0, np.bool_)
_NO_KEYS = np.zeros(0, np.uint64)
for _empty in (_NO_ROWS, _NO_FLAGS, _NO_KEYS):
    _empty.flags.writeable = False  # shared by every plan whose keys are all held


@dataclass
class DynamicTableState:
    """A dynamic table's whole state as plain arrays (what checkpoints store; see :mod:`embedcore.checkpoint`),
    row ``i`` of every per-key array belonging to ``keys[i]``:

    * ``keys`` uint64 ``[n]``: the keys held, increasing (as uint64);
    * ``weights`` ``[n, dim]`` and ``slots`` (slot name -> ``[n]`` or ``[n, dim]``), in the stored dtypes;
    * ``last_seen``, ``counts`` int32 ``[n]``: what LRU, LFU and TTL read;
    * ``rows`` int64 ``[n]``: each key's row slot, and ``free`` int64: the free row slots in the order they
      will be reused. Row slots are internal, but 16-bit stochastic rounding is keyed by them and they decide
      which slots later keys take, so a table loaded with them continues bit-identically;
    * ``sketch``: the admission sketch's counters (uint32 ``[depth, width]``), or None without one.
    """

    keys: np.ndarray
    weights: np.ndarray
    slots: dict
    last_seen: np.ndarray
    counts: np.ndarray
    rows: np.ndarray
    free: np.ndarray
    sketch: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(self.keys.shape[0])


class DynamicTable:
    """One dynamic table (a :class:`~embedcore.config.DynamicTableConfig`): ``capacity`` row slots of the
    storage of ``physical`` from row ``offset`` on, and a key map; see the module docstring.

    Args:
        config: the table.
        physical: the :class:`~embedcore.tables.dynamic_physical.DynamicPhysicalTable` whose storage holds its
            rows (its optimizer updates them; its ``clock`` tells views of a TTL table the engine's step).
        offset: the table's first row in that storage.
        seed: the engine's seed (initial values, admission sketch).

    ``storage`` is the table's own rows and slots (views of the physical table's): row slot ``r`` of the key
    map is ``storage.weights[r]``, physical row ``offset + r``.
    """

    def __init__(self, config, physical, offset: int, seed: int = 0):
        self.config = config
        self.name = config.name
        self.seed = int(seed)
        self.offset = int(offset)
        self.physical = physical
        self.optimizer = physical.optimizer
        self.dim = physical.dim
        rows = slice(self.offset, self.offset + config.capacity)
        self.storage = DenseStorage.over(physical.storage.weights[rows], [s[rows] for s in physical.storage.slots])
        self.key_map = KeyRowMap(config.capacity, config.name)
        admission = config.admission
        self.sketch = admission.sketch(seed, config.name) if admission is not None and admission.min_count > 1 \
            else None
        self.eviction = config.eviction
        self.initializer = config.initializer or TruncatedNormal(0.0, 1.0 / np.sqrt(config.dim))
        self.removals = 0
        self._no_values = tuple(np.empty((0,) + a.shape[1:], a.dtype)
                                for a in (self.storage.weights,) + self.storage.slots)

    def clock(self) -> int:
        """The engine's current step (what views of a TTL table hide expired rows at)."""
        return self.physical.clock()

    # -- initial values -----------------------------------------------------------------------------------
    def initial_rows(self, keys, slot: int | None = None) -> np.ndarray:
        """The initial values of ``keys`` (uint64 ``[n]``): rows (``slot`` None) or slot ``slot``'s values, in
        the stored dtype, ``[n, dim]`` (``[n]`` for a slot of one value a row)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        if slot is None:
            target, init, names = self.storage.weights, self.initializer, (self.name,)
        else:
            target = self.storage.slots[slot]
            init = self.optimizer.slot_initializers[slot]
            names = (self.name, self.optimizer.slot_names[slot])
        values = np.empty((keys.shape[0], self.dim), np.float32)
        fill_key_rows(init, values, keys, self.seed, *names)
        if target.ndim == 1:
            values = values[:, 0]
        if target.dtype == np.float32:
            return values
        with np.errstate(over="ignore"):
            stored = values.astype(target.dtype)
        finite = np.isfinite(stored.astype(np.float32))
        bad = np.flatnonzero(~(finite.all(axis=1) if finite.ndim == 2 else finite))
        if bad.size:
            where = f"slot '{names[1]}' of table '{self.name}'" if slot is not None else f"table '{self.name}'"
            raise ValueError(f"initializer {init!r} for {where} gives key {int(keys[bad[:1]].view(np.int64)[0])} "
                             f"values beyond the range of {target.dtype}")
        return stored

    # -- lookup: plan, then commit ------------------------------------------------------------------------
    def plan(self, parts, step: int) -> _Plan:
        """Decide what the lookup of ``parts`` (this table's parts of a batch, as ``inputs.build_table_batch``
        takes them; their row offsets are not read) at ``step`` changes; refuse it (:class:`InputError` naming
        the table) before anything changed, expired rows and (until :meth:`cancel`) admission counts aside.
        Hold the result for :meth:`commit` or :meth:`cancel`."""
        step, used, keys = self.keys_of(parts, step)
        return self.plan_found(parts, step, used, keys, *self.key_map.find_counted(keys))

    def keys_of(self, parts, step: int) -> tuple:
        """The first half of :meth:`plan`: ``(step, used, keys)``, ``parts`` and ``step`` checked, the rows
        expired at ``step`` removed (TTL), ``used`` and ``keys`` as :func:`_keys_looked_up` gives them."""
        step = self._checked_parts(parts, step)
        keep_order_index(self.eviction, self.key_map)
        self.remove_expired(step)
        return (step,) + _keys_looked_up(parts)

    def plan_found(self, parts, step: int, used, keys, found, absent: int) -> _Plan:
        """The second half of :meth:`plan`, given :meth:`keys_of` and the key map's ``find_counted`` of
        ``keys``."""
        if not absent:  # every key held: nothing to admit, evict or fill
            return _Plan(parts, step, keys, used, found, _NO_ROWS, _NO_FLAGS, _NO_ROWS, _NO_KEYS, self._no_values,
                         _NO_ROWS, self._no_values[0], None)
        absent_at = np.flatnonzero(found < 0)
        absent_keys = keys[absent_at]
        undo = None
        if self.sketch is not None and absent_keys.size:
            undo = self.sketch.snapshot(absent_keys)
            admitted = self.sketch.observe(absent_keys)
        else:
            admitted = np.ones(absent_keys.shape[0], np.bool_)
        try:
            new_keys = _first_occurrences(absent_keys[admitted])
            victims = self._victims(new_keys.shape[0], found, step)
            pending_keys, pending_inverse = np.unique(absent_keys[~admitted], return_inverse=True)
            new_values = (self._initial_or_none(new_keys),) + tuple(
                self._initial_or_none(new_keys, s) for s in range(len(self.storage.slots)))
            pending_values = self._initial_or_none(pending_keys)
        except BaseException as exc:
            if undo is not None:
                self.sketch.restore(undo)
            if isinstance(exc, TableFullError):
                raise InputError(str(exc)) from None
            raise
        return _Plan(parts, step, keys, used, found, absent_at, admitted, victims, new_keys, new_values,
                     pending_inverse.astype(np.int64).ravel(), pending_values, undo)

    def _initial_or_none(self, keys, slot: int | None = None) -> np.ndarray:
        """:meth:`initial_rows`, without its work for no keys (most steps of a table that holds its keys)."""
        if keys.shape[0]:
            return self.initial_rows(keys, slot)
        return self._no_values[0 if slot is None else 1 + slot]

    def _checked_parts(self, parts, step) -> int:
        """``step`` as an int, once ``parts`` and ``step`` are found fit for a lookup (else :class:`InputError`)."""
        for batch, combiner, seq_len, *_ in parts:
            if seq_len and batch.repeated is not None:
                sample, position, first, second = batch.repeated
                raise InputError(f"feature '{batch.name}': sparse index ({sample}, {position}) is given twice (ids "
                                 f"{first} and {second}); a position of a sequence feature holds one id")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= MAX_STEP:
            raise InputError(f"table '{self.name}': a dynamic table counts steps up to {MAX_STEP}; the engine is at "
                             f"step {step!r}")
        return int(step)

    def _victims(self, n_new: int, found, step: int) -> np.ndarray:
        need = n_new - self.key_map.free_rows
        if need <= 0:
            return np.zeros(0, np.int64)
        if self.eviction is None:
            raise TableFullError(
                f"table '{self.name}': the batch brings {n_new} new keys but only {self.key_map.free_rows} rows are "
                f"free (capacity {self.key_map.capacity}, {len(self.key_map)} keys held) and the table evicts "
                f"nothing (eviction=None); nothing was changed")
        weights = self.storage.weights if isinstance(self.eviction, EvictByScore) else None
        return pick_victims(self.eviction, self.key_map, need, protected_rows=found, step=step, weights=weights)

    def cancel(self, plan: _Plan) -> None:
        """Undo a :meth:`plan` that will not be committed (its admission counts)."""
        if plan.undo is not None:
            self.sketch.restore(plan.undo)
            plan.undo = None

    def commit(self, plan: _Plan) -> np.ndarray:
        """Make ``plan``'s changes; returns the row slot of each key of ``plan.keys`` (``capacity + j`` for an
        unadmitted key, ``j`` its row in ``plan.pending_values``). The plan is used up (its rows are these)."""
        return commit_plans([(self, plan)])[0]

    def _commit_absent(self, plan: _Plan) -> np.ndarray:
        """:meth:`commit` of a plan with keys absent from the key map."""
        key_map = self.key_map
        rows = plan.found
        if plan.victims.size:
            key_map.remove_rows(plan.victims)
            self.removals += 1
        at = plan.absent_at[plan.admitted]
        if at.size:
            given, inserted = key_map.find_or_insert(plan.keys[at], plan.step)
            rows[at] = given
            new_rows = given[inserted]
            assert np.array_equal(key_map.row_keys[new_rows], plan.new_keys), "rows assigned out of key order"
            for array, values in zip((self.storage.weights,) + self.storage.slots, plan.new_values):
                array[new_rows] = values
        held = rows >= 0
        if held.any():
            key_map.touch_found(rows[held], plan.step)  # one count per occurrence
        rows[plan.absent_at[~plan.admitted]] = key_map.capacity + plan.pending_inverse
        plan.undo = None
        return rows

    # -- read-only lookup -----------------------------------------------------------------------------
    def read_only_rows(self, parts, step: int):
        """What a lookup of ``parts`` at ``step`` reads, changing nothing (no TTL removal, no admission
        count, no new row, no touch, no eviction): ``(used, keys, rows, pending_values)`` with ``used`` and
        ``keys`` as a plan's and ``rows`` as :meth:`commit` returns them. A key held (and, under TTL, not
        expired at ``step``: ``step - last_seen <= steps``) reads its row; any other key (absent, not admitted
        yet, expired) reads its initial value from ``pending_values``, as an unadmitted key does in
        training. Bad input is refused (:class:`InputError`) as by :meth:`plan`."""
        step = self._checked_parts(parts, step)
        used, keys = _keys_looked_up(parts)
        rows = self.key_map.find(keys)
        if isinstance(self.eviction, TTL):
            held = np.flatnonzero(rows >= 0)
            age = step - self.key_map.last_seen[rows[held]].astype(np.int64)
            rows[held[age > self.eviction.steps]] = -1
        absent = np.flatnonzero(rows < 0)
        pending_keys, inverse = np.unique(keys[absent], return_inverse=True)
        rows[absent] = self.key_map.capacity + inverse.astype(np.int64).ravel()
        return used, keys, rows, self.initial_rows(pending_keys)

    # -- update (of this table's rows alone) -------------------------------------------------------------
    def update(self, table_batch, d_act, learning_rate, hyperparameters, step: int = 0):
        """:meth:`DynamicPhysicalTable.update <embedcore.tables.dynamic_physical.DynamicPhysicalTable.update>` of
        ``table_batch``, whose rows are this table's row slots (the rows the result names are keys)."""
        if self.offset:
            table_batch = dataclasses.replace(table_batch, rows=table_batch.rows + self.offset, blocks=None)
        return self.physical.update(table_batch, d_act, learning_rate, hyperparameters, step)

    def rows_changed(self, rows) -> np.ndarray:
        """Whether an update touched each of this table's row slots ``rows`` since the physical table's
        ``track_changes`` (bool array)."""
        return self.physical.rows_changed(np.asarray(rows, np.int64) + self.offset)

    # -- state: what checkpoints store (plain arrays) -----------------------------------------------------
    def remove_expired(self, step: int) -> None:
        """TTL: remove the rows expired at ``step``, as the lookup of ``step`` would first (views hide them
        already). A save does it, so what it stores is what a lookup would see and the saved table and the
        table loaded from it continue alike."""
        if isinstance(self.eviction, TTL):
            expired = expired_rows(self.key_map, int(step), self.eviction.steps)
            if expired.size:
                self.key_map.remove_rows(expired)
                self.removals += 1

    def state(self) -> DynamicTableState:
        """The table's :class:`DynamicTableState` (copies; rows of expired keys included until
        :meth:`remove_expired`)."""
        keys, rows, last_seen, counts, free = self.key_map.state()
        names = self.optimizer.slot_names if self.optimizer is not None else []
        slots = {name: values[rows] for name, values in zip(names, self.storage.slots)}
        sketch = None if self.sketch is None else self.sketch.counters.copy()
        return DynamicTableState(keys, self.storage.weights[rows], slots, last_seen, counts, rows, free, sketch)

    def prepare_state(self, state: DynamicTableState):
        """Check ``state`` against this table (``ValueError`` naming the table and what differs; nothing
        changes) and return a function of no arguments that makes it the table's state. The row slots and
        free list are kept when they fit the capacity; else (a smaller capacity, still >= the keys held) the
        keys take rows ``0 .. n - 1`` in key order, and only 16-bit stochastic rounding can then tell."""
        where = f"table '{self.name}'"
        n = state.n
        if n > self.key_map.capacity:
            raise ValueError(f"{where}: the state holds {n} keys; the table's capacity is {self.key_map.capacity}")
        rows, free = state.rows, state.free
        if n + np.shape(free)[0] > self.key_map.capacity:
            rows, free = np.arange(n, dtype=np.int64), np.zeros(0, np.int64)
        keys = as_keys(state.keys, f"{where}: keys")
        if n > 1 and not (keys[1:] > keys[:-1]).all():
            raise ValueError(f"{where}: keys must be distinct and increasing (as uint64)")
        fresh = KeyRowMap(self.key_map.capacity, self.name)
        fresh.load(keys, state.last_seen, state.counts, rows, free)
        names = list(self.optimizer.slot_names) if self.optimizer is not None else []
        if sorted(state.slots) != sorted(names):
            raise ValueError(f"{where}: the state has slots {sorted(state.slots)}, the table's optimizer has {names}")
        targets = [(self.storage.weights, state.weights, "weights")] + \
            [(target, state.slots[name], f"slot '{name}'") for name, target in zip(names, self.storage.slots)]
        for target, source, what in targets:
            source = np.asarray(source)
            if source.dtype != target.dtype or source.shape != (n,) + target.shape[1:]:
                raise ValueError(f"{where}: {what} must be {target.dtype} of shape {(n,) + target.shape[1:]}, got "
                                 f"{source.dtype} of shape {source.shape}")
            flat = source.reshape(n, int(np.prod(source.shape[1:], dtype=np.int64))).astype(np.float32)
            bad = np.flatnonzero(~np.isfinite(flat).all(axis=1))
            if bad.size:
                raise ValueError(f"{where}: {what} of key {int(keys[bad[:1]].view(np.int64)[0])} holds NaN or Inf")
        sketch = state.sketch
        have = None if self.sketch is None else self.sketch.counters
        if (sketch is None) != (have is None) or (have is not None and (
                np.asarray(sketch).dtype != np.uint32 or np.shape(sketch) != have.shape)):
            described = "none" if sketch is None else f"{np.asarray(sketch).dtype} {np.shape(sketch)}"
            raise ValueError(f"{where}: the state's admission sketch is {described}; the table's is "
                             f"{'none' if have is None else f'uint32 {have.shape}'}")
        new_rows = np.asarray(rows, np.int64)

        def apply():
            for target, source, _ in targets:
                target[new_rows] = source
            if have is not None:
                have[...] = sketch
            self.key_map = fresh
            self.removals += 1  # lookups laid out before refer to the old rows
        return apply

    # -- views --------------------------------------------------------------------------------------
    def table_rows(self) -> "DynamicTableView":
        return DynamicTableView(self)

    def slot_rows(self) -> dict:
        if self.optimizer is None:
            return {}
        return {slot: DynamicTableView(self, k) for k, slot in enumerate(self.optimizer.slot_names)}

    def held_rows(self, rows) -> np.ndarray:
        """Which of live ``rows`` still hold their key at the engine's current step (TTL: not expired)."""
        rows = np.asarray(rows, np.int64)
        if not isinstance(self.eviction, TTL):
            return np.ones(rows.shape, np.bool_)
        return np.int64(self.clock()) - self.key_map.last_seen[rows].astype(np.int64) <= self.eviction.steps

    def __repr__(self):
        kind = type(self.optimizer).__name__ if self.optimizer is not None else "read-only"
        return (f"DynamicTable({self.name} [{len(self.key_map)} of {self.key_map.capacity} keys x {self.dim}, "
                f"{kind}])")


def plan_tables(table_parts, step: int) -> list:
    """:meth:`DynamicTable.plan` of ``parts`` for each ``(table, parts)`` of ``table_parts``, their keys looked
    up in one pass (:func:`~embedcore.kernels.hash_map.find_in_maps`). A refusal cancels the plans made and
    raises (nothing changed, expired rows aside)."""
    tables = [table for table, _ in table_parts]
    looked_up = [table.keys_of(parts, step) for table, parts in table_parts]
    found = find_in_maps([table.key_map for table in tables], [keys for _, _, keys in looked_up])
    plans = []
    try:
        for (table, parts), (step, used, keys), (rows, absent) in zip(table_parts, looked_up, found):
            plans.append(table.plan_found(parts, step, used, keys, rows, absent))
    except BaseException:
        for table, plan in zip(tables, plans):
            table.cancel(plan)
        raise
    return plans


def commit_plans(table_plans) -> list:
    """:meth:`DynamicTable.commit` of each ``(table, plan)`` of ``table_plans``; returns their rows. The plans
    whose keys were all held (the usual step once a table holds its keys) only touch their rows: all of them in
    one pass (:func:`~embedcore.kernels.hash_map.touch_in_maps`)."""
    held = [(table, plan) for table, plan in table_plans if not plan.absent_at.size]
    if held:
        touch_in_maps([table.key_map for table, _ in held], [plan.found for _, plan in held],
                      held[0][1].step)
    return [plan.found if not plan.absent_at.size else table._commit_absent(plan) for table, plan in table_plans]


def _keys_looked_up(parts) -> tuple:
    """``(used, keys)``: per part the mask of its occurrences a lookup reads (None: all, see
    :func:`_looked_up`), and those occurrences' keys, concatenated, as uint64."""
    used = [_looked_up(batch, seq_len) for batch, _, seq_len, *_ in parts]
    keys = [batch.ids if mask is None else batch.ids[mask] for (batch, *_), mask in zip(parts, used)]
    keys = keys[0] if len(keys) == 1 else np.concatenate(keys) if keys else np.zeros(0, np.int64)
    return used, np.ascontiguousarray(keys).view(np.uint64)


def _looked_up(batch, seq_len):
    """The occurrences of ``batch`` a lookup reads (bool mask), or None for all: a sequence feature drops
    positions at or beyond its length."""
    if not seq_len or batch.ids.shape[0] == 0:
        return None
    if batch.positions is not None:
        positions = batch.positions
    else:
        splits = batch.row_splits
        positions = np.arange(batch.ids.shape[0]) - np.repeat(splits[:-1], np.diff(splits))
    mask = positions < seq_len
    return None if mask.all() else mask


def _first_occurrences(keys: np.ndarray) -> np.ndarray:
    """The distinct values of ``keys`` in the order of their first occurrence."""
    return keys[first_occurrences(keys)]


class DynamicTableView:
    """A dynamic table's rows (or one slot's values) by key: what ``emb.embedding_tables[name]`` (and
    ``emb.slot_variables[name][slot]``) give for a dynamic table.

    * ``len(view)``: the keys held (rows expired under TTL at the engine's current step are not);
    * ``view.keys()``: those keys, int64 (their bit patterns: a uint64 key ``k >= 2**63`` reads
      ``k - 2**64``), increasing;
    * ``key in view``: whether a key (an int, signed or unsigned) is held;
    * ``view[keys]``: the values of ``keys`` (an int or an integer array-like), shaped ``keys.shape + (dim,)``
      (``keys.shape`` for a slot of one value a row), in the stored dtype, a copy. A key not held reads its
      initial value: the value it would get if it were admitted now (for a key never seen, or evicted,
      or expired, or not admitted yet).

    The view reads the table as it is when used (it is not a snapshot).
    """

    def __init__(self, table: DynamicTable, slot: int | None = None):
        self._table, self._slot = table, slot

    @property
    def _array(self) -> np.ndarray:
        t = self._table
        return t.storage.weights if self._slot is None else t.storage.slots[self._slot]

    @property
    def dtype(self):
        return self._array.dtype

    @property
    def dim(self) -> int:
        return self._table.dim

    @property
    def capacity(self) -> int:
        return self._table.key_map.capacity

    def _held(self):
        keys, rows = self._table.key_map.items()
        keep = self._table.held_rows(rows)
        return keys[keep], rows[keep]

    def __len__(self) -> int:
        if not isinstance(self._table.eviction, TTL):
            return len(self._table.key_map)
        return int(self._held()[0].shape[0])

    def keys(self) -> np.ndarray:
        return np.sort(self._held()[0])

    def __iter__(self):
        return iter(self.keys().tolist())

    def __contains__(self, key) -> bool:
        if np.ndim(key) != 0:
            return False
        try:
            rows = self._table.key_map.find([key])
        except ValueError:
            return False
        return bool(rows[0] >= 0 and self._table.held_rows(rows)[0])

    def __getitem__(self, keys) -> np.ndarray:
        shape = np.shape(keys)
        k = as_keys(keys, f"table '{self._table.name}': keys")
        rows = self._table.key_map.find(k)
        held = rows >= 0
        held[held] = self._table.held_rows(rows[held])
        array = self._array
        out = np.empty((k.shape[0],) + array.shape[1:], array.dtype)
        out[held] = array[rows[held]]
        if not held.all():
            out[~held] = self._table.initial_rows(k[~held], self._slot)
        return out.reshape(shape + array.shape[1:])

    def __array__(self, *args, **kwargs):
        raise TypeError(f"dynamic table '{self._table.name}' has no dense array: read rows by key, view[keys] "
                        f"(view.keys() lists the keys held)")

    def __repr__(self):
        what = "" if self._slot is None else f" slot '{self._table.optimizer.slot_names[self._slot]}'"
        return (f"DynamicTableView(table '{self._table.name}'{what}: {len(self)} keys of {self.capacity}, "
                f"dim {self.dim}, {self.dtype})")
