"""A physical table: one storage holding the rows of one or more stacked tables, and everything that reads or
updates them.

Tables with equal optimizers and equal ``dim`` share one :class:`PhysicalTable` (see
:mod:`embedcore.tables.factory`), each at a row offset. A :class:`PhysicalTable` owns

* its :class:`~embedcore.tables.storage.Storage` (rows and slots),
* its scratch: ``workspace`` (the update's arrays), ``batch_pool`` (lookups' table batches, leased until their
  update) and ``activation_pool`` (lookups' activations),
* its optimizer's compiled row function and update kernel,
* its grouping policy (hash block by block, or sort) and its prefetch policy: whether a lookup prefetches
  rows, judged by the last update from how often its batch re-read each row.

The storage keeps float32 values or 16-bit ones (the tables' ``weights_dtype`` / ``slot_dtype``, which
stacked tables share): lookups gather and sum them in float32, updates compute in float32 and round what they
store (:mod:`embedcore.kernels.half`), stochastically with random bits keyed by the engine's seed, the table,
its row, the column and the step.

A table may be a *shard*: ``rows`` of its ``vocabulary_size`` rows, table row ``first + i * stride`` at
physical row ``offset + i`` (a sharded engine's rank holds such shards; a shard of no rows keeps one zero
placeholder row, never reported). Row ids in :class:`TableUpdate` are the table's own row ids.

:meth:`PhysicalTable.update` is the one update every engine runs: group the batch's occurrences by row (summing
their gradients), run the fused kernel, and name the rows it left unchanged.
"""

from __future__ import annotations

from time import perf_counter
from typing import NamedTuple

import numpy as np

from .. import inputs
from ..compiler import RowFunctionError, describe
from ..initializers import TruncatedNormal, fill_rows, stream_key
from ..kernels.half import FORMAT_RANGE, bits_of, decoder, format_of, step_key
from ..kernels.grouping import Grouper
from ..kernels.prefetch import rows_stay_cached
from ..kernels.update import (STATUS_GRADIENT, STATUS_LENGTH, STATUS_OUTPUT, STATUS_RAISED, compile_for,
                               fused_update_kernel)
from ..kernels.workspace import ArrayPool, Workspace, WorkspacePool
from ..tuning import DEFAULT_TUNING, Tuning
from .storage import DenseStorage, Storage, round_into

__all__ = ["PhysicalTable", "TablePlace", "TableUpdate", "NOTHING_FLAGGED"]

_SKIPPED = (("gradient", STATUS_GRADIENT), ("output", STATUS_OUTPUT))
_FAILED = (("raised", STATUS_RAISED), ("length", STATUS_LENGTH))


class TablePlace(NamedTuple):
    """Where one table's rows live in a physical table: table row ``first + i * stride`` (``i < rows``) at
    physical row ``offset + i``."""

    config: object   # TableConfig
    offset: int
    rows: int
    first: int = 0
    stride: int = 1


class TableUpdate(NamedTuple):
    """The rows one :meth:`PhysicalTable.update` left unchanged, by table name (int64 table row ids).

    ``skipped[name]`` = ``{"gradient": ids, "output": ids}``: NaN/Inf summed gradient, or NaN/Inf result;
    ``failed[name]`` = ``{"raised": ids, "length": ids}``: the row function raised, or returned rows of the
    wrong length; ``function`` describes the row function when ``failed`` is not empty (else None).
    """

    skipped: dict
    failed: dict
    function: str | None


NOTHING_FLAGGED = TableUpdate({}, {}, None)  # every row updated (shared: never modified)


class PhysicalTable:
    """Stacked tables over one storage; see the module docstring.

    Args:
        places: each table's :class:`TablePlace`, in stacking order (offsets increasing).
        storage: the rows and slots (``storage.n_rows`` = the places' rows, a shard of none counting one).
        optimizer: the tables' optimizer, or None (read-only: lookups only).
        tuning: the engine's :class:`~embedcore.tuning.Tuning` (default ``DEFAULT_TUNING``).
        seed: the engine's seed, which keys the stochastic rounding of 16-bit values.
    """

    dynamic = False  # a dynamic (hash-keyed) table maps keys to rows first (embedcore.tables.dynamic)

    def __init__(self, places, storage: Storage, optimizer=None, tuning: Tuning | None = None, seed: int = 0):
        self.places = tuple(places)
        self.tables = [p.config for p in self.places]
        self.offsets = [p.offset for p in self.places]
        self._place = {p.config.name: p for p in self.places}
        self.storage = storage
        self.dim = storage.dim
        self.n_rows = storage.n_rows
        self.optimizer = optimizer
        self.tuning = DEFAULT_TUNING if tuning is None else tuning
        self.workspace = Workspace()
        self.batch_pool = WorkspacePool()
        self.activation_pool = ArrayPool()
        self.row_function = None if optimizer is None else optimizer.compiled(self.dim)
        self._kernel = None
        self._lazy = True if optimizer is None else optimizer.lazy
        self._row_bytes = storage.weights.itemsize * self.dim
        self._prefetch_rows = True  # set by each update for the next lookup (kernels/prefetch.py)
        self._grouper = Grouper(self.tuning, stacked=len(self.places) > 1)
        self.formats = storage.formats
        self._kernel_arrays = (storage.kernel_weights, storage.kernel_slots)
        # Per stacked table: (offset, first, stride, rounding key), the key mixed with the step at each update.
        self._rounding = np.array([(p.offset, p.first, p.stride, 0) for p in self.places], np.int64)
        self._rounding_keys = [stream_key(seed, p.config.name, "stochastic rounding") for p in self.places]
        self._changed = None  # one flag per physical row while changes are tracked (track_changes)

    # -- views -------------------------------------------------------------------------------------------
    @property
    def weights(self) -> np.ndarray:
        """All physical rows, ``[n_rows, dim]``."""
        return self.storage.weights

    @property
    def slots(self) -> tuple:
        """All physical rows of each slot, in the optimizer's slot order."""
        return self.storage.slots

    @property
    def kernel_weights(self) -> np.ndarray:
        """``weights`` as jitted code reads them (``uint16`` bits for a 16-bit table), with :attr:`decode`."""
        return self._kernel_arrays[0]

    @property
    def decode(self):
        """The jitted ``bits -> float32`` of a 16-bit table's rows (None for float32 rows)."""
        return decoder(self.formats.weights) if self.formats.weights_16 else None

    @property
    def table_names(self) -> list:
        return [t.name for t in self.tables]

    def place(self, name: str) -> TablePlace:
        """Where table ``name`` lives here."""
        return self._place[name]

    def table_rows(self, name: str) -> np.ndarray:
        """Table ``name``'s rows held here, ``[rows, dim]`` (a view; rows of a shard: see ``place``)."""
        p = self._place[name]
        return self.storage.rows(p.offset, p.rows)

    def slot_rows(self, name: str) -> dict:
        """Slot name -> table ``name``'s rows of that slot held here (views); none without an optimizer."""
        p = self._place[name]
        if self.optimizer is None:
            return {}
        return dict(zip(self.optimizer.slot_names, self.storage.slot_rows(p.offset, p.rows)))

    @property
    def prefetches_rows(self) -> bool:
        """Whether the next lookup prefetches the rows it gathers (judged by the last update)."""
        return self._prefetch_rows

    def __repr__(self):
        kind = type(self.optimizer).__name__ if self.optimizer is not None else "read-only"
        return f"PhysicalTable({'+'.join(self.table_names)} [{self.n_rows} x {self.dim}, {kind}])"

    # -- construction ------------------------------------------------------------------------------------
    def payload_is_activation_rows(self, gains_are_one: bool) -> bool:
        """Whether updates will mostly bring int32 activation rows (else packed words), for a table whose
        batches without weights have every gain 1 when ``gains_are_one`` (the grouping policy decides)."""
        return self._grouper.payload_is_activation_rows(gains_are_one)

    def compile(self, unit_gains: bool) -> None:
        """Compile the update kernel now for the payload the updates will mostly bring (int32 activation rows
        when ``unit_gains``, else packed words), so a row function whose kernel cannot compile is refused
        (:class:`RowFunctionError`) when the engine is built, not halfway through an update."""
        try:
            self._kernel = compile_for(self.row_function, self._lazy, *self._kernel_arrays,
                                       self.optimizer.n_hyperparameters, unit_gains=unit_gains,
                                       formats=self.formats)
        except Exception as exc:  # numba raises many error types; each becomes one clear message
            cause = "\n".join(str(exc).strip().splitlines()[:12])
            raise RowFunctionError(f"the update kernel of {describe(self.row_function.python_function)} for "
                                   f"table(s) {self.table_names} could not be compiled:\n{cause}") from None

    def fill(self, name: str, seed: int) -> None:
        """Initial values of table ``name``'s rows held here and of their slots (each value a function of the
        seed, the table and the row id, so a shard holds what the whole table would); a placeholder row is
        zero."""
        p = self._place[name]
        table = p.config
        if p.rows == 0:
            for array in (self.weights,) + self.slots:
                array[p.offset] = 0
        rows = slice(p.offset, p.offset + p.rows)
        init = table.initializer or TruncatedNormal(0.0, 1.0 / np.sqrt(table.dim))
        _fill_stored(init, self.weights[rows], p, seed, table.name)
        opt = self.optimizer
        if opt is None:  # a lookup-only or read-only table: no slots
            return
        for slot_name, slot_init, slot in zip(opt.slot_names, opt.slot_initializers, self.slots):
            view = slot[rows] if slot.ndim == 2 else slot[rows][:, None]
            _fill_stored(slot_init, view, p, seed, table.name, slot_name)

    # -- lookup ------------------------------------------------------------------------------------------
    def lay_out(self, parts):
        """The :class:`~embedcore.inputs.TableBatch` of ``parts`` (see ``inputs.build_table_batch``), in a
        workspace leased from ``batch_pool``; returns ``(table_batch, lease)``, ``lease`` being what to give
        back (``batch_pool.release``) once the batch's update is done. Nothing stays leased if it raises."""
        timer = self.tuning.phase_timer
        t0 = perf_counter() if timer is not None else 0.0
        workspace = self.batch_pool.acquire()
        try:
            tb = inputs.build_table_batch(parts, workspace, self.tuning)
        except BaseException:  # an id out of range, say
            self.batch_pool.release(workspace)
            raise
        if timer is not None:
            timer("layout", perf_counter() - t0)
        return tb, (self.batch_pool, workspace)

    def lookup(self, table_batch, out: np.ndarray | None = None, dtype=np.float32) -> np.ndarray:
        """``out[a] = round(sum over the occurrences o of activation row a of gain[o] * row[o])``: the sum in
        float32, ``round`` the identity for float32 activations, else to the nearest value of ``out``'s
        16-bit format, ties to even (so the activations are exactly the float32 ones cast to it). ``out``
        (``[n_out, dim]`` of ``dtype``: float32, ``np.float16`` or ``ml_dtypes.bfloat16``; every row
        written) defaults to an array from ``activation_pool``. A batch with ``pending`` occurrences (a
        dynamic table's keys without a row, :mod:`embedcore.tables.dynamic`) adds their values'
        sum, read from ``pending_values``, to the float32 sum before it is rounded."""
        tb = table_batch
        if out is None:
            out = self.activation_pool.empty((tb.n_out if tb is not None else 0, self.dim), dtype)
        if tb is None or not tb.n_out:
            return out
        timer = self.tuning.phase_timer
        t0 = perf_counter() if timer is not None else 0.0
        pending = getattr(tb, "pending", None)
        sums = out if pending is None or out.dtype == np.float32 else np.empty(out.shape, np.float32)
        self.storage.gather(tb.rows, tb.gains, tb.out_ptr, sums, self._prefetch_rows,
                            self.tuning.streams(sums.nbytes))
        if pending is not None:
            extra = np.empty_like(sums)
            DenseStorage.over(tb.pending_values).gather(pending.rows, pending.gains, pending.out_ptr, extra, True)
            sums += extra
            if sums is not out:
                round_into(out, sums)
        if timer is not None:
            timer("gather", perf_counter() - t0)
        return out

    # -- changed rows (incremental checkpoints) ---------------------------------------------------------
    def track_changes(self) -> None:
        """Record from now on which rows updates change (forgetting what was recorded before): afterwards
        :meth:`changed_rows` names every row an update touched since this call. One byte per physical row;
        each update marks the unique rows it already computed (every row for a non-lazy optimizer)."""
        self._changed = np.zeros(self.n_rows, np.bool_)

    def stop_tracking(self) -> None:
        """Stop recording changed rows (and free the record)."""
        self._changed = None

    @property
    def tracks_changes(self) -> bool:
        return self._changed is not None

    def changed_rows(self, name: str) -> np.ndarray:
        """Table ``name``'s row ids (int64, increasing; the table's own ids, a shard's included) that an
        update touched since :meth:`track_changes`: a superset of the rows whose values changed (a row an
        update left unchanged, say for a NaN gradient, may be named)."""
        if self._changed is None:
            raise RuntimeError(f"{self!r} does not track changed rows (track_changes was not called)")
        p = self._place[name]
        local = np.flatnonzero(self._changed[p.offset:p.offset + p.rows]).astype(np.int64)
        return p.first + p.stride * local if (p.first, p.stride) != (0, 1) else local

    def rows_changed(self, rows) -> np.ndarray:
        """Whether an update touched each of the physical ``rows`` since :meth:`track_changes` (bool array)."""
        if self._changed is None:
            raise RuntimeError(f"{self!r} does not track changed rows (track_changes was not called)")
        return self._changed[rows]

    def _mark_changed(self, uniq) -> None:
        if self._changed is not None:
            if self._lazy:
                self._changed[uniq] = True
            else:
                self._changed[:] = True

    # -- update ------------------------------------------------------------------------------------------
    def stale(self, table_batch) -> str | None:
        """Why ``table_batch`` (of an earlier lookup) can no longer be applied, or None (a static table's can
        always be; a dynamic table's not once a later lookup evicted rows)."""
        return None

    def update(self, table_batch, d_act: np.ndarray, learning_rate, hyperparameters, step: int = 0) -> TableUpdate:
        """Apply one step of the optimizer to the rows ``table_batch`` touched (every row when the optimizer
        is not lazy), in place: each row's gradient is the sum of its occurrences' ``gain * d_act[activation
        row]`` (``d_act`` ``[n_out, dim]``, checked by the caller), in occurrence order, in float32. ``d_act``
        may be float32, or float16 or bfloat16: 16-bit rows are read in place, each value converted exactly
        to float32 as it is summed, so the update is bit-identical to that of ``d_act.astype(np.float32)``.

        Every row is updated exactly once or left unchanged and named in the result (NaN/Inf gradient sum or
        result, a row function that raised or returned rows of the wrong length, a result beyond a 16-bit
        table's range); no NaN/Inf is ever written. ``step`` (the engine's step being applied) keys the
        stochastic rounding of 16-bit values.
        """
        if self._kernel is None:
            raise TypeError(f"{self!r} has no optimizer: it is read-only")
        tb = table_batch
        timer = self.tuning.phase_timer
        t0 = perf_counter() if timer is not None else 0.0
        ws = self.workspace
        uniq, ptr, packed, d_act = self._grouper.group(tb, self.n_rows, ws, d_act)  # summed, or grouped by row
        self._prefetch_rows = not rows_stay_cached(tb.rows.shape[0], uniq.shape[0], self._row_bytes)
        if timer is not None:
            t1 = perf_counter()
            timer("group", t1 - t0)
            t0 = t1
        self._mark_changed(uniq)  # before the kernel writes: a row is never changed unrecorded
        lazy = self._lazy
        status = ws.array("status", (uniq.shape[0] if lazy else self.n_rows,), np.uint8)
        status[:] = 0
        rounding = ()
        if self.formats.any_16:
            self._rounding[:, 3] = [step_key(key, step) for key in self._rounding_keys]
            rounding = (self._rounding,)
        flagged = self._kernel_for(d_act.dtype)(*self._kernel_arrays, uniq, ptr, packed, bits_of(d_act),
                                                learning_rate, hyperparameters, status, *rounding)
        if timer is not None:
            timer("update", perf_counter() - t0)
        return self._flagged(uniq, status) if flagged else NOTHING_FLAGGED

    def _kernel_for(self, gradient_dtype):
        """The update kernel for gradient rows of ``gradient_dtype``: the one compiled when the engine was built
        for float32, else the variant that reads 16-bit gradient rows (compiled, or loaded from the cache, on
        first use, as a new payload type is)."""
        if gradient_dtype == np.float32:
            return self._kernel
        return fused_update_kernel(self.row_function, self._lazy, self.dim, self.formats, format_of(gradient_dtype))

    def _flagged(self, uniq, status) -> TableUpdate:
        """The rows ``status`` flags (per unique row when lazy, per physical row when not), by table."""
        flagged = np.flatnonzero(status)  # no full-size temporary: a non-lazy status has a byte per table row
        codes = status[flagged]
        rows_of = uniq[flagged] if self._lazy else flagged
        offsets = np.asarray(self.offsets)
        which = np.searchsorted(offsets, rows_of, side="right") - 1
        skipped, failed = {}, {}
        for into, kinds in ((skipped, _SKIPPED), (failed, _FAILED)):
            keep = np.isin(codes, [code for _, code in kinds])
            for k, p in enumerate(self.places):
                if p.rows == 0:  # a placeholder row stands for no table row
                    continue
                mine = keep & (which == k)
                if mine.any():
                    local = rows_of[mine] - offsets[k]
                    ids = {key: local[codes[mine] == code].astype(np.int64) for key, code in kinds}
                    if p.first != 0 or p.stride != 1:
                        ids = {key: p.first + p.stride * v for key, v in ids.items()}
                    into[p.config.name] = ids
        if not skipped and not failed:
            return NOTHING_FLAGGED
        return TableUpdate(skipped, failed, describe(self.row_function.python_function) if failed else None)


_FILL_CHUNK_VALUES = 1 << 22  # values rounded into a 16-bit table per pass (a 16 MB float32 scratch)


def _fill_stored(initializer, out, place, seed, *names) -> None:
    """``fill_rows`` into ``out`` (rows of ``place``); a 16-bit ``out`` is filled in float32 and rounded to
    nearest: a constant once, an :class:`~embedcore.initializers.Initializer` chunk by chunk, a plain
    callable (which makes the whole table) in one pass. A value beyond the 16-bit range is refused naming
    the table (``ValueError``)."""
    from ..initializers import Initializer
    vocabulary = place.config.vocabulary_size
    if out.dtype == np.float32:
        fill_rows(initializer, out, place.first, vocabulary, seed, *names, stride=place.stride)
        return
    n, width = out.shape
    if n == 0:
        return
    if isinstance(initializer, (int, float, np.integer, np.floating)) and not isinstance(initializer, bool):
        row = np.empty((1, width), np.float32)
        fill_rows(initializer, row, 0, 1, seed, *names)
        _check_rounded(row, row.astype(out.dtype), place.first, 1, initializer, names)
        out[...] = row.astype(out.dtype)
        return
    step = max(1, _FILL_CHUNK_VALUES // width) if isinstance(initializer, Initializer) else n
    scratch = np.empty((min(step, n), width), np.float32)
    for lo in range(0, n, step):
        part = scratch[:min(step, n - lo)]
        first = place.first + lo * place.stride
        fill_rows(initializer, part, first, vocabulary, seed, *names, stride=place.stride)
        with np.errstate(over="ignore"):
            out[lo:lo + part.shape[0]] = part
        _check_rounded(part, out[lo:lo + part.shape[0]], first, place.stride, initializer, names)


def _check_rounded(values, rounded, first_row, stride, initializer, names) -> None:
    """Refuse float32 ``values`` whose 16-bit ``rounded`` values overflowed, naming the first such row."""
    bad = np.flatnonzero(~np.isfinite(rounded).all(axis=1))
    if bad.size:
        k = int(bad[0])
        value = values[k][~np.isfinite(rounded[k].astype(np.float32))][0]
        name = format_of(rounded.dtype)
        raise ValueError(f"initializer {initializer!r} for {'/'.join(names)} wrote {value} to row "
                         f"{first_row + k * stride}, beyond the range of {name} (magnitudes up to "
                         f"{FORMAT_RANGE[name]:g})")
