"""Dynamic tables stacked into one physical table: one layout, one gather and one update for all of them.

A :class:`DynamicPhysicalTable` is a :class:`~embedcore.tables.physical.PhysicalTable` whose places are
dynamic tables (:class:`~embedcore.tables.dynamic.DynamicTable`: equal optimizer, ``dim`` and storage formats;
the factory's stacking rule), table ``k`` at row offset ``offset_k`` with its ``capacity_k`` row slots. Each
table keeps its own keys, admission, eviction and removals; what the stack shares is the storage and the
kernels, so a lookup lays out, gathers and an update groups and updates the occurrences of every table at
once, as for stacked static tables.

A lookup plans every table's keys (:meth:`DynamicTable.plan <embedcore.tables.dynamic.DynamicTable.plan>`,
each table's parts alone; a refusal cancels the plans made and changes nothing), commits them, and lays the
occurrences out over physical rows: table ``k``'s row slot ``r`` is row ``offset_k + r``; the unadmitted keys'
occurrences (the stack's ``P`` distinct ones, table by table) read row ``n_rows + j`` of a scratch of their
initial values (``pending_values``, ``[P, dim]``), split off into ``pending`` after the layout. The admitted
occurrences keep one block per run of a table's features (disjoint, increasing row ranges), so the update sums
them block by block as for static tables.

Results are those of each table alone: the gradient of a row is summed in occurrence order either way, and
stochastic rounding keys its bits by the table and its row slot (:class:`PhysicalTable` keys them by place).
"""

from __future__ import annotations

import dataclasses
import threading
from time import perf_counter

import numpy as np

from .. import inputs
from ..inputs import TableBatch
from .dynamic import DynamicTable, DynamicTableBatch, DynamicTableView, commit_plans, plan_tables
from .physical import NOTHING_FLAGGED, PhysicalTable, TableUpdate

__all__ = ["DynamicPhysicalTable"]


class _StackPlan:
    """A planned lookup of a stack: the parts, and per table looked up ``(table, part indices, plan)``."""

    def __init__(self, parts, tables):
        self.parts, self.tables = parts, tables


class DynamicPhysicalTable(PhysicalTable):
    """Dynamic tables stacked over one storage; see the module docstring.

    Args:
        places: each table's :class:`~embedcore.tables.physical.TablePlace` (its config a
            :class:`~embedcore.config.DynamicTableConfig`, ``rows`` its capacity), offsets increasing.
        storage, optimizer, tuning, seed: as for :class:`~embedcore.tables.physical.PhysicalTable`.

    ``members`` are the tables (:class:`~embedcore.tables.dynamic.DynamicTable`), in place order.
    """

    dynamic = True

    def __init__(self, places, storage, optimizer=None, tuning=None, seed: int = 0):
        super().__init__(places, storage, optimizer, tuning, seed)
        self.members = tuple(DynamicTable(p.config, self, p.offset, seed) for p in self.places)
        self._member = {t.name: t for t in self.members}
        self._at_offset = {t.offset: k for k, t in enumerate(self.members)}
        self.clock = lambda: 0  # the engine's current step, for views of TTL tables (set by the engine)
        self._lock = threading.Lock()

    def member(self, name: str) -> DynamicTable:
        """Table ``name``'s :class:`~embedcore.tables.dynamic.DynamicTable`."""
        return self._member[name]

    # -- lookup: plan every table, then commit them and lay the stack out ------------------------------------
    def plan(self, parts, step: int) -> _StackPlan:
        """Plan the lookup of ``parts`` (the stack's parts of a batch, each at its table's row offset) at
        ``step`` for every table they name; a refusal (:class:`~embedcore.inputs.InputError` naming the table)
        cancels the plans made, so nothing changed (expired rows aside). Hold the result for
        :meth:`lay_out_planned` or :meth:`cancel`."""
        timer = self.tuning.phase_timer
        t0 = perf_counter() if timer is not None else 0.0
        groups = [(self.members[k], at) for k, at in self._by_table(parts)]
        plans = plan_tables([(table, [parts[i] for i in at]) for table, at in groups], step)
        if timer is not None:
            timer("plan keys", perf_counter() - t0)
        return _StackPlan(parts, [(table, at, plan) for (table, at), plan in zip(groups, plans)])

    def cancel(self, plan: _StackPlan) -> None:
        """Undo a :meth:`plan` that will not be laid out (its admission counts)."""
        for table, _, table_plan in plan.tables:
            table.cancel(table_plan)

    def lay_out(self, parts, step: int = 0):
        """Plan, commit and lay out a lookup of ``parts`` at ``step`` (see :mod:`embedcore.tables.dynamic`)."""
        return self.lay_out_planned(self.plan(parts, step))

    def lay_out_planned(self, plan: _StackPlan):
        """Commit ``plan`` and lay out its occurrences: ``(DynamicTableBatch, lease)`` as :meth:`lay_out`."""
        timer = self.tuning.phase_timer
        t0 = perf_counter() if timer is not None else 0.0
        with self._held("look up"):
            rows = commit_plans([(table, p) for table, _, p in plan.tables])
        if timer is not None:
            timer("commit keys", perf_counter() - t0)
        looked_up = [(table, at, p.used, r, p.pending_values) for (table, at, p), r in zip(plan.tables, rows)]
        return self._lay_out_rows(plan.parts, looked_up)

    def lay_out_read_only(self, parts, step: int = 0):
        """Lay out a read-only lookup of ``parts`` at ``step`` (each table's
        :meth:`~embedcore.tables.dynamic.DynamicTable.read_only_rows`): ``(DynamicTableBatch, lease)`` as
        :meth:`lay_out`, no table changed."""
        looked_up = []
        for k, at in self._by_table(parts):
            table = self.members[k]
            used, _, rows, pending_values = table.read_only_rows([parts[i] for i in at], step)
            looked_up.append((table, at, used, rows, pending_values))
        return self._lay_out_rows(parts, looked_up)

    def _by_table(self, parts) -> list:
        """``[(table index, [part indices])]``: the parts of each table, tables in order of first part."""
        groups = {}
        for i, part in enumerate(parts):
            groups.setdefault(self._at_offset[part[3]], []).append(i)
        return list(groups.items())

    def _lay_out_rows(self, parts, looked_up):
        """Lay out ``parts`` over the row slots each table's lookup gave (``looked_up``: per table ``(table,
        part indices, used masks, row slots, pending values)``, as :meth:`DynamicTable.commit
        <embedcore.tables.dynamic.DynamicTable.commit>` returns them): ``(DynamicTableBatch, lease)``."""
        n_rows = self.n_rows
        n_pending = sum(values.shape[0] for *_, values in looked_up)
        mapped = [None] * len(parts)
        base = 0
        for table, at, used, rows, pending_values in looked_up:
            capacity = table.key_map.capacity
            if pending_values.shape[0]:  # row slot capacity + j -> stack row n_rows + base + j
                rows[rows >= capacity] += n_rows - table.offset - capacity + base
                base += pending_values.shape[0]
            vocabulary = n_rows - table.offset + n_pending if n_pending else capacity
            start = 0
            for i, mask in zip(at, used):
                batch, combiner, seq_len, _, out_offset, _ = parts[i]
                n = batch.ids.shape[0] if mask is None else int(np.count_nonzero(mask))
                part_rows = rows[start:start + n]
                start += n
                if mask is not None:  # positions a sequence drops: any row in range (never read)
                    full = np.zeros(batch.ids.shape[0], np.int64)
                    full[mask] = part_rows
                    part_rows = full
                mapped[i] = (dataclasses.replace(batch, ids=part_rows, given_ids=None), combiner, seq_len,
                             table.offset, out_offset, vocabulary)
        tb, lease = super().lay_out(mapped)
        pending = pending_values = None
        if n_pending:
            pending_values = np.concatenate([values for *_, values in looked_up])
            is_pending = tb.rows >= n_rows
            pending = inputs.select_occurrences(tb, is_pending, tb.rows[is_pending] - n_rows)
            tb = inputs.select_occurrences(tb, ~is_pending)
            tb.blocks = _table_blocks(mapped, tb.out_ptr)
        fields = {f.name: getattr(tb, f.name) for f in dataclasses.fields(TableBatch)}
        removals = {table.name: table.removals for table, *_ in looked_up}
        return DynamicTableBatch(**fields, pending=pending, pending_values=pending_values, removals=removals), lease

    # -- update ---------------------------------------------------------------------------------------------
    def stale(self, table_batch) -> str | None:
        """Why ``table_batch`` (of an earlier lookup) can no longer be applied, or None: a later lookup evicted
        or expired rows of a table it looked up."""
        removals = getattr(table_batch, "removals", None) or {}
        for name, count in removals.items():
            if self._member[name].removals != count:
                return (f"table '{name}': a later lookup evicted or expired rows of this dynamic table, so the rows "
                        f"this context's lookup used may hold other keys now; look up again (nothing was updated)")
        return None

    def update(self, table_batch, d_act, learning_rate, hyperparameters, step: int = 0) -> TableUpdate:
        """As :meth:`PhysicalTable.update`; the rows the result names are keys (int64 bit patterns)."""
        with self._held("apply gradients to"):
            result = super().update(table_batch, d_act, learning_rate, hyperparameters, step)
        if result is NOTHING_FLAGGED:
            return result

        def by_key(named):
            return {name: {why: self._member[name].key_map.row_keys[ids].view(np.int64) for why, ids in by_why.items()}
                    for name, by_why in named.items()}
        return TableUpdate(by_key(result.skipped), by_key(result.failed), result.function)

    def _held(self, what: str):
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"cannot {what} dynamic table(s) {self.table_names}: another thread is changing them")
        return _Release(self._lock)

    # -- state ----------------------------------------------------------------------------------------------
    def fill(self, name: str, seed: int) -> None:
        """Nothing: a dynamic table's rows are filled as their keys arrive."""

    def table_rows(self, name: str) -> DynamicTableView:
        return self._member[name].table_rows()

    def slot_rows(self, name: str) -> dict:
        return self._member[name].slot_rows()

    def __repr__(self):
        kind = type(self.optimizer).__name__ if self.optimizer is not None else "read-only"
        held = ", ".join(f"{t.name}: {len(t.key_map)} of {t.key_map.capacity} keys" for t in self.members)
        return f"DynamicPhysicalTable({held}; dim {self.dim}, {kind})"


def _table_blocks(mapped, out_ptr) -> np.ndarray | None:
    """The blocks of a laid-out batch of ``mapped`` parts once its pending occurrences are gone: one per run of
    parts of one table (its rows ``[offset, offset + capacity)``), starting at the run's first activation row;
    None unless the runs' tables come in increasing offsets (as ``inputs.build_table_batch`` decides)."""
    starts, offsets = [], []
    for _, _, _, offset, out_offset, _ in mapped:
        if not offsets or offsets[-1] != offset:
            if offsets and offset < offsets[-1]:
                return None
            starts.append(out_ptr[out_offset])
            offsets.append(offset)
    return np.array(starts + [out_ptr[-1]], np.int64) if starts else None


class _Release:
    def __init__(self, lock):
        self._lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._lock.release()
