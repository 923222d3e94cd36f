"""The embedding engine: owns the tables, looks up activations, applies fused sparse updates.

Like TensorFlow's TPU embedding engine, it exchanges two arrays per feature with the dense model:
activations out (``emb(features)``), activation gradients in (``emb.apply_gradients(grads, ctx)``).
Tables with equal optimizers and equal ``dim`` are stacked into one physical array and updated by one
kernel pass; ``stack_tables=False`` keeps one array per table (results are identical).
"""

from __future__ import annotations

import contextlib
import threading

import numba
import numpy as np

from . import inputs
from .compiler import RowFunctionError, describe
from .initializers import TruncatedNormal, fill_rows
from .inputs import InputError
from .kernels.aligned import aligned_empty
from .kernels.dedup import group_rows, sum_by_blocks
from .kernels.prefetch import rows_stay_cached
from .kernels.rows import count_non_finite
from .kernels.update import (STATUS_GRADIENT, STATUS_LENGTH, STATUS_OUTPUT, STATUS_RAISED, compile_for,
                             fused_update_kernel)
from .lookup import LookupContext, TableLookup, _FeatureSlot, _PhysicalTable
from .memory_budget import check_fits
from .optimizers import Optimizer

__all__ = ["Embedding", "LookupContext", "UpdateReport", "NonFiniteError", "NON_FINITE_POLICIES"]

NON_FINITE_POLICIES = ("raise", "skip")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class NonFiniteError(ValueError):
    """Some rows were not updated because their gradient sum or their new values were NaN/Inf."""


class UpdateReport:
    """What one ``apply_gradients`` did.

    Attributes:
        step: the engine's step after the update.
        skipped: table name -> {"gradient": ids, "output": ids} (int64 arrays of table-local row ids) for
            the rows left unchanged because their summed gradient, or the optimizer's result, was NaN/Inf.
            Empty when every touched row was updated.
        failed: table name -> {"raised": ids, "length": ids} for the rows left unchanged because the row
            function raised an exception on them or returned rows of the wrong length (then
            ``apply_gradients`` raises :class:`RowFunctionError`, which carries this report as ``.report``).
    """

    def __init__(self, step: int):
        self.step = step
        self.skipped = {}
        self.failed = {}

    def _record(self, group, uniq, status, lazy):
        flagged = np.flatnonzero(status)  # no full-size temporary: a non-lazy status has a byte per table row
        codes = status[flagged]
        rows_of = uniq[flagged] if lazy else flagged
        offsets = np.asarray(group.offsets)
        which = np.searchsorted(offsets, rows_of, side="right") - 1
        for into, kinds in ((self.skipped, (("gradient", STATUS_GRADIENT), ("output", STATUS_OUTPUT))),
                            (self.failed, (("raised", STATUS_RAISED), ("length", STATUS_LENGTH)))):
            keep = np.isin(codes, [code for _, code in kinds])
            for k, table in enumerate(group.tables):
                mine = keep & (which == k)
                if mine.any():
                    local = rows_of[mine] - offsets[k]
                    into[table.name] = {key: local[codes[mine] == code].astype(np.int64) for key, code in kinds}

    def describe_failed(self, function) -> str:
        """The rows a row function failed on, table by table, for an error message."""
        parts = []
        for table, rows in self.failed.items():
            for reason, what in (("raised", "raised an exception"), ("length", "returned rows of the wrong length")):
                ids = rows[reason]
                if ids.size:
                    shown = ", ".join(str(int(i)) for i in ids[:5]) + (", ..." if ids.size > 5 else "")
                    parts.append(f"table '{table}': {ids.size} row(s) left unchanged because {function} {what} "
                                 f"on them: rows {shown}")
        return "; ".join(parts)

    def describe(self) -> str:
        parts = []
        for table, rows in self.skipped.items():
            for reason, what in (("gradient", "its summed gradient is NaN/Inf (float32 overflow?)"),
                                 ("output", "the optimizer returned NaN/Inf")):
                ids = rows[reason]
                if ids.size:
                    shown = ", ".join(str(int(i)) for i in ids[:5]) + (", ..." if ids.size > 5 else "")
                    parts.append(f"table '{table}': {ids.size} row(s) left unchanged because {what}: rows {shown}")
        return "; ".join(parts)

    def __repr__(self):
        return f"UpdateReport(step={self.step}, skipped={self.describe() or 'none'})"



class Embedding(TableLookup):
    """Embedding tables with fused, sparse, per-row optimizers.

    Args:
        feature_config: a :class:`FeatureConfig`, or any nest of dicts/lists/tuples of them.
        optimizer: the optimizer of every table that does not set its own.
        seed: seed of the tables' initial values (a table's own initializer seed wins).
        stack_tables: stack tables with equal optimizers and ``dim`` into one physical array.
        non_finite: ``"raise"`` or ``"skip"``: what :meth:`apply_gradients` does about NaN/Inf (see there).

    Thread safety: lookups may run from any number of threads at once (they only read the tables), but a
    lookup running while ``apply_gradients`` updates the same rows may read rows partway through their
    update: order lookups and updates yourself, as a training loop does. ``apply_gradients``,
    ``save`` and ``load`` take the engine's lock without waiting: a second thread calling one of them
    while another runs gets a ``RuntimeError`` and changes nothing. Serialize them yourself if several
    threads train one engine.
    """

    def __init__(self, feature_config, optimizer=None, *, seed=0, stack_tables=True, non_finite="raise"):
        self._setup(feature_config, optimizer, seed, stack_tables, fill=True, non_finite=non_finite)

    def _setup(self, feature_config, optimizer, seed, stack_tables, fill, non_finite="raise"):
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(f"optimizer must be an embedcore optimizer or None, got {optimizer!r}")
        if non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}")
        self.non_finite = non_finite
        self.skipped_rows = {}
        tables = self._init_features(feature_config)
        self._optimizer = optimizer
        self.seed = int(seed)
        self.step = 0
        self._lock = threading.Lock()
        groups = self._stack(tables, optimizer, stack_tables)
        _check_storage_fits(groups)
        self._index_groups(groups)
        for group in self._groups:
            self._build(group, fill)

    # -- construction ------------------------------------------------------------------------------------
    @staticmethod
    def _stack(tables, optimizer, stack_tables):
        groups, by_key = [], {}
        for table in tables:
            opt = table.optimizer if table.optimizer is not None else optimizer
            if opt is None:
                raise ValueError(f"table '{table.name}' has no optimizer: set TableConfig(optimizer=...) or pass "
                                 f"one to Embedding(optimizer=...)")
            key = (opt, table.dim) if stack_tables else id(table)
            group = by_key.get(key)
            if group is None:
                group = by_key[key] = _PhysicalTable([], [], table.dim, opt)
                groups.append(group)
            group.offsets.append(group.n_rows if group.tables else 0)
            group.tables.append(table)
        return groups

    def _build(self, group: _PhysicalTable, fill: bool):
        opt = group.optimizer
        group.row_function = opt.compiled(group.dim)
        group.weights = aligned_empty((group.n_rows, group.dim), np.float32)
        group.slots = tuple(aligned_empty((group.n_rows, group.dim) if d == 2 else (group.n_rows,), np.float32)
                            for d in opt.slot_dims)
        try:
            compile_for(group.row_function, opt.lazy, group.weights, group.slots, opt.n_hyperparameters,
                        unit_gains=self._sums_rows(group) or self._summed_by_blocks(group))
        except Exception as exc:  # numba raises many error types; each becomes one clear message
            cause = "\n".join(str(exc).strip().splitlines()[:12])
            raise RowFunctionError(f"the update kernel of {describe(group.row_function.python_function)} for "
                                   f"table(s) {[t.name for t in group.tables]} could not be compiled:\n"
                                   f"{cause}") from None
        if fill:
            for table in group.tables:
                self._fill_table(table, 0, 1, table.vocabulary_size)

    def _sums_rows(self, group: _PhysicalTable) -> bool:
        """Whether a batch without weights gives every occurrence of ``group`` a gain of 1 (its features'
        tables sum, or the features are sequences), so that its occurrences carry activation rows alone."""
        tables = {id(t) for t in group.tables}
        return all(inputs.gains_are_weights(f.table.combiner, f.max_sequence_length) for _, f in self._features
                   if id(f.table) in tables)

    @staticmethod
    def _summed_by_blocks(group: _PhysicalTable) -> bool:
        """Whether ``group``'s batches are likely summed block by block (``dedup.sum_by_blocks``: stacked
        tables, several threads), which hands the update activation rows alone, whatever the gains."""
        return len(group.tables) > 1 and numba.get_num_threads() > 1

    def _fill_table(self, table, first_row: int, stride: int, vocabulary_size: int, n_rows: int | None = None):
        """Initial values of ``table`` and its slots: the rows ``first_row + i * stride`` of a table of
        ``vocabulary_size`` rows (a shard, when the table is split over processes)."""
        g, offset = self._group_of[id(table)]
        group = self._groups[g]
        rows = slice(offset, offset + (table.vocabulary_size if n_rows is None else n_rows))
        init = table.initializer or TruncatedNormal(0.0, 1.0 / np.sqrt(table.dim))
        fill_rows(init, group.weights[rows], first_row, vocabulary_size, self.seed, table.name, stride=stride)
        opt = group.optimizer
        for name, slot_init, slot in zip(opt.slot_names, opt.slot_initializers, group.slots):
            view = slot[rows] if slot.ndim == 2 else slot[rows][:, None]
            fill_rows(slot_init, view, first_row, vocabulary_size, self.seed, table.name, name, stride=stride)

    @property
    def slot_variables(self) -> dict:
        """Table name -> {slot name: ``[vocabulary_size, dim]`` (or ``[vocabulary_size]``) float32 array}."""
        out = {}
        for group in self._groups:
            for table, offset in zip(group.tables, group.offsets):
                out[table.name] = {name: slot[offset:offset + table.vocabulary_size]
                                   for name, slot in zip(group.optimizer.slot_names, group.slots)}
        return out

    @property
    def num_physical_tables(self) -> int:
        return len(self._groups)

    def __repr__(self):
        groups = "; ".join("+".join(t.name for t in g.tables) + f" [{g.n_rows} x {g.dim}, "
                           f"{type(g.optimizer).__name__}]" for g in self._groups)
        return f"Embedding({len(self._features)} features; {groups}; step={self.step})"

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, path, extra=None, metadata=None) -> str:
        """Write a checkpoint of tables, slots, ``step`` and the configuration to the directory ``path``.

        The write is atomic (a crash leaves the previous checkpoint in place) and every tensor is
        checksummed; see :mod:`embedcore.checkpoint`. ``extra`` (name -> array) and ``metadata`` (a JSON
        value) are stored alongside, e.g. a dense model's parameters and a data position. The previous
        snapshot in ``path`` is deleted once the new one is in place.
        """
        from .checkpoint import save
        with self._exclusive("save"):
            return save(self, path, extra=extra, metadata=metadata)

    def load(self, path, strict: bool = True) -> None:
        """Replace tables, slots and ``step`` with a checkpoint's; verified in full before anything changes.

        ``strict`` requires the checkpoint's configuration to equal this engine's (optimizers and
        hyperparameters included); ``strict=False`` only requires the same tables, shapes and slots.
        Contexts of lookups made before a successful ``load`` are refused by :meth:`apply_gradients` (their
        activations came from the replaced tables).
        """
        from .checkpoint import load_into
        with self._exclusive("load"):
            load_into(self, path, strict=strict)
            self._tables_replaced()

    @classmethod
    def restore(cls, path, *, functions=None, allow_import: bool = False, stack_tables: bool = True):
        """A new engine built from a checkpoint's configuration, holding its tables, slots and ``step``.

        A function named by the checkpoint (a custom computation, a callable learning rate) is imported
        only if ``allow_import`` or found in ``functions`` (``{"module:name": f}`` or a list of functions).
        """
        from .checkpoint import restore
        return restore(cls, path, functions=functions, allow_import=allow_import, stack_tables=stack_tables)

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Hold the engine's lock for ``what``; a second thread gets an error instead of waiting."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"cannot {what}: another thread is using this Embedding's state "
                               f"(apply_gradients, save or load)")
        try:
            yield
        finally:
            self._lock.release()

    # -- update ------------------------------------------------------------------------------------------
    def apply_gradients(self, gradients, ctx: LookupContext):
        """Apply ``d loss / d activations`` (mirroring the activations) with each table's fused optimizer.

        Everything is validated before anything changes: a bad gradient raises :class:`InputError` naming
        the feature, with tables, slots and ``step`` unchanged; so does a ``ctx`` that is not a context of
        this engine's lookup against its current tables (another engine's, one looked up before a
        ``load``), or one already applied. Returns an :class:`UpdateReport`.

        No NaN/Inf is ever written to a table or slot. With ``non_finite="raise"`` (the default) a NaN/Inf
        gradient is refused up front; a row whose summed gradient overflows float32, or for which the
        optimizer returns NaN/Inf, keeps its old values while the rest of the batch is applied, and then
        :class:`NonFiniteError` names the table and rows. With ``non_finite="skip"`` NaN/Inf gradients are
        accepted: every affected row is skipped, counted in ``skipped_rows`` and listed in the report.

        A row function that raises an exception on some rows (or returns rows of the wrong length) is
        handled the same way, whatever the policy and the number of threads: every other row is updated
        exactly once, those rows keep their old values, ``step`` advances and the context is used up (a
        retry is refused, so nothing is applied twice); then :class:`RowFunctionError` names the table and
        the rows, and carries the report as ``.report``.
        """
        with self._exclusive("apply_gradients"):
            self._check_context(ctx)
            return self._apply(gradients, ctx)

    def _apply(self, gradients, ctx):
        leaves = inputs.flatten_like(self._feature_config, gradients, "gradients")
        refuse = self.non_finite == "raise"
        # NaN/Inf are looked for once per physical table, in the gradient rows its update reads (the
        # features' gradients in place or copied), after every feature's type and shape are checked: a bad
        # shape anywhere is reported before a NaN, and NaNs table by table.
        checked = [_check_gradient(grad, s, refuse, values_checked_later=True) for grad, s in zip(leaves, ctx.features)]
        work = []
        for g, group in enumerate(self._groups):
            tb = ctx.table_batches[g]
            if tb is None and group.optimizer.lazy:
                continue
            if tb is None:
                tb = inputs.build_table_batch([])
            d_act = self._gradient_rows(g, group, tb, checked, ctx.features)
            if refuse:
                _refuse_non_finite(d_act, g, checked, ctx.features)
            work.append((group, tb, d_act))
        step = self.step + 1
        values = {}
        for group in self._groups:
            if id(group.optimizer) not in values:
                values[id(group.optimizer)] = group.optimizer.step_values(step)
        # Validation is over; from here on the tables change.
        report = UpdateReport(step)
        failing = []
        for group, tb, d_act in work:
            ws = group.workspace
            summed = sum_by_blocks(tb.rows, group.n_rows, tb.packed, ws, tb.blocks, tb.out_ptr, d_act)
            if summed is not None:  # the gradients summed already: one occurrence per row, gain 1
                uniq, ptr, packed, d_act = summed
            else:
                uniq, ptr, packed = group_rows(tb.rows, group.n_rows, tb.packed, ws, tb.blocks, tb.out_ptr)
            group.prefetch_rows = not rows_stay_cached(tb.rows.shape[0], uniq.shape[0],
                                                     group.weights.itemsize * group.dim)
            lr, hyper = values[id(group.optimizer)]
            lazy = group.optimizer.lazy
            status = ws.array("status", (uniq.shape[0] if lazy else group.n_rows,), np.uint8)
            status[:] = 0
            kernel = fused_update_kernel(group.row_function, lazy=lazy, dim=group.dim)
            if kernel(group.weights, group.slots, uniq, ptr, packed, d_act, lr, hyper, status):
                report._record(group, uniq, status, lazy)
                if np.isin(status[np.flatnonzero(status)], (STATUS_RAISED, STATUS_LENGTH)).any():
                    failing.append(group)
        self.step = step
        ctx.consumed = True
        ctx.release()
        for table, rows in report.skipped.items():
            self.skipped_rows[table] = self.skipped_rows.get(table, 0) + sum(len(v) for v in rows.values())
        if failing:
            functions = sorted({describe(group.row_function.python_function) for group in failing})
            skipped = f"; also {report.describe()}" if report.skipped else ""
            error = RowFunctionError(f"{report.describe_failed(' and '.join(functions))}{skipped}. The other rows "
                                     f"were updated and step is now {step}; these gradients cannot be applied "
                                     f"again (look up again)")
            error.report = report
            raise error
        if report.skipped and self.non_finite == "raise":
            raise NonFiniteError(report.describe() + f". The other rows were updated and step is now {step}; "
                                 f"Embedding(non_finite='skip') skips such rows and reports them instead")
        return report

    @staticmethod
    def _gradient_rows(g, group, tb, gradients, features):
        """The activation gradients of physical table ``g`` as one ``[n_out, dim]`` float32 array.

        Used in place, without a copy: a table fed by one feature whose gradient is float32 and contiguous,
        and features whose float32 contiguous gradients lie one after the other in memory, in the order of
        their activation rows (views of one ``[features, batch, dim]`` array, as FBGEMM takes one gradient
        for all its tables). Otherwise the features' gradients are copied into a reused workspace.
        """
        mine = [(grad, s) for grad, s in zip(gradients, features) if s.group == g]
        if all(grad.dtype == np.float32 and grad.flags.c_contiguous for grad, _ in mine):
            if len(mine) == 1:
                return mine[0][0].reshape(tb.n_out, group.dim)
            consecutive = _consecutive(mine, tb.n_out, group.dim)
            if consecutive is not None:
                return consecutive
        d_act = group.workspace.array("d_act", (tb.n_out, group.dim), np.float32)
        for grad, s in mine:
            d_act[s.out_offset:s.out_offset + s.n_rows] = grad.reshape(s.n_rows, group.dim)
        return d_act


def _check_storage_fits(groups) -> None:
    """Refuse (``ValueError``) physical tables whose weights and slots (and, for a non-lazy optimizer, the
    update's status byte per row) cannot fit in memory, each and all together, naming the tables and the
    bytes, before anything is allocated."""
    total, names = 0, []
    for group in groups:
        n_rows, dim = group.n_rows, group.dim
        values = n_rows * dim + sum(n_rows * dim if d == 2 else n_rows for d in group.optimizer.slot_dims)
        nbytes = 4 * values + (0 if group.optimizer.lazy else n_rows)
        n_slots = len(group.optimizer.slot_dims)
        tables = [t.name for t in group.tables]
        what = (f"table(s) {tables} ({n_rows:,} rows x {dim:,} float32 values"
                f"{f', plus {n_slots} slot(s)' if n_slots else ''})")
        check_fits(nbytes, what)
        total += nbytes
        names += tables
    if len(groups) > 1:
        check_fits(total, f"the tables {names} and their slots together")


def _consecutive(gradients, n_rows, dim):
    """One ``[n_rows, dim]`` view over float32 C-contiguous gradients ``(array, slot)`` whose data follow
    each other in memory in the slots' ``out_offset`` order, or None. The view spans exactly their data, so
    it reads only memory those arrays own (the caller keeps them alive); the update never writes it."""
    row_bytes = dim * 4
    first = start = None
    for grad, s in gradients:
        if grad.size == 0:  # no activation rows, no memory
            continue
        address = grad.__array_interface__["data"][0]
        if first is None:
            first, start = grad, address - s.out_offset * row_bytes
        if address != start + s.out_offset * row_bytes:
            return None
    if first is None or start != first.__array_interface__["data"][0]:
        return None
    return np.lib.stride_tricks.as_strided(first, shape=(n_rows, dim), strides=(row_bytes, 4))


def _refuse_non_finite(d_act, g, gradients, features):
    """Raise :class:`InputError` naming the feature, and the index in its gradient, of the first NaN/Inf
    in physical table ``g``'s gradient rows ``d_act``."""
    flat = d_act.reshape(-1)
    if not count_non_finite(flat):
        return
    at = int(np.flatnonzero(~np.isfinite(flat))[0])
    dim = d_act.shape[1]
    row = at // dim
    for grad, s in zip(gradients, features):
        if s.group == g and s.out_offset <= row < s.out_offset + s.n_rows:
            bad = np.unravel_index(at - s.out_offset * dim, grad.shape)
            raise InputError(f"gradient of feature '{s.config.name or s.path}' holds {grad[bad]} at index "
                             f"{tuple(int(i) for i in bad)}; NaN/Inf gradients are refused (nothing was updated)")
    raise AssertionError("a non-finite gradient row outside every feature")


def _check_gradient(grad, s: _FeatureSlot, refuse_non_finite: bool = True,
                    values_checked_later: bool = False) -> np.ndarray:
    """``grad`` as an array of the feature's activation shape, refused (:class:`InputError`) for a wrong
    type, dtype or shape, a NaN/Inf when ``refuse_non_finite`` (unless ``values_checked_later``: the
    caller looks for them in the rows it reads, with :func:`_refuse_non_finite`), or a finite value beyond
    float32 range."""
    name = s.config.name or s.path
    if not isinstance(grad, np.ndarray):
        if hasattr(grad, "__array__"):
            grad = np.asarray(grad)
        else:
            raise InputError(f"gradient of feature '{name}' must be an array, got {type(grad).__name__}")
    if grad.dtype.kind != "f":
        raise InputError(f"gradient of feature '{name}' must hold floats, got dtype {grad.dtype}")
    if grad.shape != s.shape:
        raise InputError(f"gradient of feature '{name}' has shape {grad.shape}, its activations have {s.shape}")
    flat = grad.reshape(-1)
    native = flat if flat.dtype in (np.float32, np.float64) else flat.astype(np.float64)
    if refuse_non_finite and not values_checked_later and count_non_finite(native):
        bad = np.unravel_index(int(np.flatnonzero(~np.isfinite(native))[0]), grad.shape)
        raise InputError(f"gradient of feature '{name}' holds {grad[bad]} at index {tuple(int(i) for i in bad)}; "
                         f"NaN/Inf gradients are refused (nothing was updated)")
    if native.dtype.itemsize > 4 and native.size:
        with np.errstate(invalid="ignore"):
            too_big = np.abs(native) > _FLOAT32_MAX
            if not refuse_non_finite or values_checked_later:  # Inf: skipped or refused as a float32 Inf
                too_big &= np.isfinite(native)
        if too_big.any():
            bad = np.unravel_index(int(np.flatnonzero(too_big)[0]), grad.shape)
            raise InputError(f"gradient of feature '{name}' holds {grad[bad]} at index "
                             f"{tuple(int(i) for i in bad)}, beyond float32 range (nothing was updated)")
    return grad
