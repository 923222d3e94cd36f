"""The embedding engine: owns the tables, looks up activations, applies fused sparse updates.

Like TensorFlow's TPU embedding engine, it exchanges two arrays per feature with the dense model:
activations out (``emb(features)``), activation gradients in (``emb.apply_gradients(grads, ctx)``).
Tables with equal optimizers and equal ``dim`` are stacked into one physical array and updated by one
kernel pass; ``stack_tables=False`` keeps one array per table (results are identical).
"""

from __future__ import annotations

import threading
from time import perf_counter

import numpy as np

from . import inputs
from .compiler import RowFunctionError
from .config import DynamicTableConfig
from .inputs import InputError
from .kernels.half import is_bfloat16, is_native_16_bit
from .kernels.rows import copy_counting_non_finite, count_non_finite
from .lookup import LookupContext, TrainingEngine, _FeatureSlot, check_output_dtype
from .optimizers import Optimizer
from .tables import physical_tables
from .tables.factory import lookup_only
from .thread_share import share_cores
from .tuning import DEFAULT_TUNING, Tuning

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

    def add(self, update) -> None:
        """Take in the rows one physical table's update left unchanged (a
        :class:`~embedcore.tables.TableUpdate`)."""
        self.skipped.update(update.skipped)
        self.failed.update(update.failed)

    def tally(self, counts: dict) -> None:
        """Add the number of rows skipped per table to ``counts`` (an engine's ``skipped_rows``)."""
        for table, rows in self.skipped.items():
            counts[table] = counts.get(table, 0) + sum(len(v) for v in rows.values())

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



class Embedding(TrainingEngine):
    """Embedding tables with fused, sparse, per-row optimizers.

    Args:
        feature_config: a :class:`FeatureConfig`, or any nest of dicts/lists/tuples of them.
        optimizer: the optimizer of every table that does not set its own. ``None`` with no table setting
            one makes a lookup-only engine, as TensorFlow's ``TPUEmbedding(optimizer=None)``: lookups,
            ``save``/``load`` and ``restore`` work, tables have no slots, and :meth:`apply_gradients` raises
            ``RuntimeError``. (Some tables with an optimizer and some without is a ``ValueError``.)
        seed: seed of the tables' initial values (a table's own initializer seed wins).
        stack_tables: stack tables with equal optimizers and ``dim`` into one physical array.
        non_finite: ``"raise"`` or ``"skip"``: what :meth:`apply_gradients` does about NaN/Inf (see there).
        tuning: an :class:`~embedcore.tuning.Tuning` (speed-only choices; default ``DEFAULT_TUNING``).
        fill: write the tables' and slots' initial values; ``False`` leaves them unwritten, for a caller
            that writes every row itself (as :meth:`restore` does from a checkpoint).
        output_dtype: the activations' format, as FBGEMM's ``output_dtype``: ``"float32"`` (the default),
            ``"float16"`` or ``"bfloat16"`` (``np.float16`` / ``ml_dtypes.bfloat16`` arrays, half the bytes
            to write and for the model to read). Rows are summed in float32 either way, and each sum rounded
            once, to nearest, ties to even: the activations are exactly the float32 ones cast to the format
            (float16 overflow gives infinity, as the cast does; see
            :func:`~embedcore.lookup.check_output_dtype`). Gradients are taken as before.

    The physical (stacked) tables are :attr:`physical_tables` (:class:`~embedcore.tables.PhysicalTable`).

    Thread safety: lookups may run from any number of threads at once (they only read the tables), but a
    lookup running while ``apply_gradients`` updates the same rows may read rows partway through their
    update: order lookups and updates yourself, as a training loop does. ``apply_gradients``,
    ``save`` and ``load`` take the engine's lock without waiting: a second thread calling one of them
    while another runs gets a ``RuntimeError`` and changes nothing. Serialize them yourself if several
    threads train one engine. A lookup that reads a dynamic table (:class:`~embedcore.DynamicTableConfig`)
    changes it (admission, eviction), so it takes the lock too.
    """

    _busy = "another thread is using this Embedding's state (apply_gradients, save, load, a dynamic lookup)"

    def __init__(self, feature_config, optimizer=None, *, seed=0, stack_tables=True, non_finite="raise",
                 tuning: Tuning | None = None, fill: bool = True, output_dtype: str = "float32"):
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(f"optimizer must be an embedcore optimizer or None (SGD, Adagrad, ..., CustomOptimizer): "
                             f"{type(optimizer)} is an unsupported optimizer class. Received: {optimizer!r:.80}")
        if non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise ValueError(f"tuning must be an embedcore.Tuning or None, got {tuning!r}")
        self.non_finite = non_finite
        self.output_dtype = check_output_dtype(output_dtype)
        self.tuning = DEFAULT_TUNING if tuning is None else tuning
        self.skipped_rows = {}
        self.threads = share_cores()
        tables = self._init_features(feature_config)
        self._optimizer = optimizer
        self.seed = int(seed)
        self.step = 0
        self._lock = threading.Lock()
        self.lookup_only = lookup_only(tables, optimizer)
        self._physical = physical_tables(tables, optimizer, stack_tables=stack_tables, seed=self.seed,
                                         tuning=self.tuning, fill=fill, unit_gains=self._unit_gains)
        self._index_tables(self._physical)

    # -- construction ------------------------------------------------------------------------------------
    def _unit_gains(self, table) -> bool:
        """Whether a batch without weights gives every occurrence of ``table`` a gain of 1 (its features'
        tables sum, or the features are sequences)."""
        mine = {id(t) for t in table.tables}
        return all(inputs.gains_are_weights(f.table.combiner, f.max_sequence_length) for _, f in self._features
                   if id(f.table) in mine)

    @property
    def num_physical_tables(self) -> int:
        return len(self._physical)

    def __repr__(self):
        tables = "; ".join("+".join(t.table_names) + f" [{t.n_rows} x {t.dim}, "
                           f"{'lookup-only' if t.optimizer is None else type(t.optimizer).__name__}]"
                           for t in self._physical)
        output = "" if self.output_dtype == "float32" else f"; output_dtype={self.output_dtype!r}"
        return f"Embedding({len(self._features)} features; {tables}; step={self.step}{output})"

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, path, extra=None, metadata=None, incremental: bool = False) -> str:
        """Write a checkpoint of tables, slots, ``step`` and the configuration to the directory ``path``.

        The write is atomic (a crash leaves the previous checkpoint in place) and every tensor is
        checksummed; see :mod:`embedcore.checkpoint`. ``extra`` (name -> array) and ``metadata`` (a JSON
        value) are stored alongside, e.g. a dense model's parameters and a data position. The previous
        snapshot in ``path`` is deleted once the new one is in place. Dynamic tables are stored as their keys,
        rows, slots and the policies' state (:mod:`embedcore.checkpoint.dynamic`), so an engine loaded from
        the checkpoint continues exactly as this one; a TTL table first drops the rows expired at ``step``
        (which no view or lookup shows any more).

        ``incremental=True`` writes a *delta*: only the rows updates touched since this engine's previous
        save to ``path``, on top of it (every reader composes them; :mod:`embedcore.checkpoint.delta`).
        When this engine has no such save to build on (its first save, or the first after ``load`` or
        ``set_state``) it writes a full snapshot and starts tracking changed rows from there, so the same
        call works from the first save on; a chain of this engine in another directory, or a ``path``
        another save has replaced since, is refused (``CheckpointError``, nothing written). Snapshots the
        newest delta builds on are kept; a full save compacts (deletes them). Rows written directly into
        :attr:`embedding_tables` or :attr:`slot_variables` arrays are not tracked: use ``set_state``.
        """
        from .checkpoint import save
        with self._exclusive("save"):
            return save(self, path, extra=extra, metadata=metadata, incremental=incremental)

    def load(self, path, strict: bool = True, convert_dtypes: bool = False) -> None:
        """Replace tables, slots and ``step`` with a checkpoint's; verified in full before anything changes.

        ``strict`` requires the checkpoint's configuration to equal this engine's (optimizers and
        hyperparameters included); ``strict=False`` only requires the same tables, shapes and slots.
        Tables or slots stored in another dtype than this engine's (say a float32 checkpoint into bfloat16
        tables) are refused unless ``convert_dtypes``, which rounds them to nearest.
        Contexts of lookups made before a successful ``load`` are refused by :meth:`apply_gradients` (their
        activations came from the replaced tables). A dynamic table's keys, rows, slots, metadata and
        admission counts replace the table's whole state; the engine must have the checkpoint's seed and a
        capacity of at least the keys saved (``strict=False`` lets the capacity differ), else
        :class:`~embedcore.CheckpointError`, with nothing changed.
        """
        from .checkpoint import delta, load_into
        with self._exclusive("load"):
            load_into(self, path, strict=strict, convert_dtypes=convert_dtypes)
            self._tables_replaced()
            delta.forget(self)

    @classmethod
    def restore(cls, path, *, functions=None, allow_import: bool = False, stack_tables: bool = True,
                tuning: Tuning | None = None, output_dtype: str = "float32"):
        """A new engine built from a checkpoint's configuration, holding its tables, slots and ``step``.
        ``tuning`` and ``output_dtype`` are the new engine's (a checkpoint stores neither: they change no
        table).

        A function named by the checkpoint (a custom computation, a callable learning rate) is imported
        only if ``allow_import`` or found in ``functions`` (``{"module:name": f}`` or a list of functions).
        """
        from .checkpoint import restore
        return restore(cls, path, functions=functions, allow_import=allow_import, stack_tables=stack_tables,
                       tuning=tuning, output_dtype=output_dtype)

    # -- state from arrays, copies and pickles (one block: set_state, deepcopy, pickle) ----------------
    def set_state(self, tables=None, slots=None, step=None) -> None:
        """Copy arrays into tables and slots and set ``step``: what ``load`` does, from memory.

        ``tables`` maps table names to arrays of the table's shape and dtype, ``slots`` table names to
        ``{slot name: array}``; tables and slots not named keep their values, ``step=None`` keeps ``step``.
        Everything is checked first (names, shapes, dtypes, NaN/Inf, ``step`` an int >= 0): a problem raises
        ``ValueError`` listing every one, and nothing changes. Contexts of earlier lookups are refused
        afterwards, as after :meth:`load`.

        Dynamic tables are not set here (``ValueError``): a dynamic table is more than arrays of rows (its
        keys, row slots, metadata and admission counts belong together); load it from a checkpoint with
        :meth:`load` or :meth:`restore`.
        """
        current, current_slots = self.embedding_tables, self.slot_variables
        staged, problems = [], []
        dynamic = {t.name for t in self._table_configs.values() if isinstance(t, DynamicTableConfig)}
        for name in sorted(dynamic & (set(tables or {}) | set(slots or {}))):
            problems.append(f"table '{name}' is dynamic: set_state sets static tables only (a dynamic table's keys, "
                            f"rows, metadata and admission counts belong together: load them with emb.load(path) "
                            f"or Embedding.restore(path))")
        tables = {n: v for n, v in (tables or {}).items() if n not in dynamic}
        slots = {n: v for n, v in (slots or {}).items() if n not in dynamic}

        def stage(target, source, what):
            if not isinstance(source, np.ndarray) or source.dtype != target.dtype or source.shape != target.shape:
                got = (f"{source.dtype} of shape {source.shape}" if isinstance(source, np.ndarray)
                       else type(source).__name__)
                problems.append(f"{what} must be a {target.dtype} array of shape {target.shape}, got {got}")
            else:
                with np.errstate(over="ignore", invalid="ignore"):  # float64 sums of finite 16/32-bit values
                    finite = source.size == 0 or np.isfinite(np.add.reduce(source.reshape(-1), dtype=np.float64))
                if not finite:
                    rows = np.flatnonzero(~np.isfinite(source.reshape(source.shape[0], -1).astype(np.float32)).all(1))
                    problems.append(f"{what} holds NaN or Inf in {rows.size} row(s), e.g. rows {rows[:5].tolist()}")
                staged.append((target, source))

        for name, source in (tables or {}).items():
            if name not in current:
                problems.append(f"no table '{name}' (the tables are {sorted(current)})")
            else:
                stage(current[name], source, f"table '{name}'")
        for name, named in (slots or {}).items():
            for slot, source in dict(named).items():
                if slot not in current_slots.get(name, {}):
                    problems.append(f"no slot '{slot}' of table '{name}' (its slots are "
                                    f"{list(current_slots.get(name, {}))})")
                else:
                    stage(current_slots[name][slot], source, f"table '{name}' slot '{slot}'")
        if step is not None and (isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer))
                                 or not 0 <= int(step) < 2 ** 63):
            problems.append(f"step must be an int from 0 to 2**63-1, got {step!r:.60}")
        if problems:
            raise ValueError("set_state: " + "; ".join(problems) + " (nothing was changed)")
        with self._exclusive("set_state"):
            for target, source in staged:
                target[...] = source
            if step is not None:
                self.step = int(step)
            self._tables_replaced()
            from .checkpoint import delta
            delta.forget(self)

    def _copy_arguments(self) -> dict:
        """Constructor arguments, besides the configuration, that a copy of this engine is built with."""
        return {"seed": self.seed, "stack_tables": len(self._physical) < len(self._table_configs),
                "non_finite": self.non_finite, "tuning": self.tuning, "output_dtype": self.output_dtype}

    def _static_state(self) -> tuple:
        """``(tables, slots)`` of the static tables, as :meth:`set_state` takes them."""
        dynamic = self.dynamic_tables
        return ({n: v for n, v in self.embedding_tables.items() if n not in dynamic},
                {n: v for n, v in self.slot_variables.items() if n not in dynamic})

    def _dynamic_states(self) -> dict:
        """Dynamic table name -> its :class:`~embedcore.tables.dynamic.DynamicTableState` (copies)."""
        return {name: t.state() for name, t in self.dynamic_tables.items()}

    def _set_dynamic_states(self, states: dict) -> None:
        """Make ``states`` (as :meth:`_dynamic_states` gives) the dynamic tables' states, all checked first."""
        tables = self.dynamic_tables
        if set(states) != set(tables):
            raise ValueError(f"dynamic tables {sorted(states)} given, the engine has {sorted(tables)}")
        for apply in [tables[name].prepare_state(state) for name, state in states.items()]:
            apply()

    def __deepcopy__(self, memo):
        """An independent engine: configuration deep-copied (functions shared), tables, slots, ``step`` copied
        (a dynamic table's whole state: keys, row slots, metadata, admission counts)."""
        import copy
        feature_config, optimizer = copy.deepcopy((self._feature_config, self._optimizer), memo)
        emb = type(self)(feature_config, optimizer, fill=False, **self._copy_arguments())
        emb.set_state(*self._static_state(), self.step)
        emb._set_dynamic_states(self._dynamic_states())
        emb.skipped_rows = dict(self.skipped_rows)
        memo[id(self)] = emb
        return emb

    def __reduce__(self):
        """Pickled as a checkpoint is written: the configuration encoded by :mod:`embedcore.checkpoint`
        (functions by import path, imported again on unpickling), tables, slots and ``step`` as arrays.
        A tuning's ``phase_timer`` (profiling only) is not kept."""
        import pickle
        from .checkpoint import CheckpointError, engine_config
        try:
            config = engine_config(self)
        except CheckpointError as e:
            raise pickle.PicklingError(f"cannot pickle this {type(self).__name__}: {e}") from None
        unnamed = [f"{where} is {value.get('repr') or 'a function'}"
                   for where, node in [(f"table '{t['name']}'", t) for t in config["tables"]] +
                   [("the engine's optimizer", config["optimizer"])]
                   for where, value in self._functions_without_path(node, where)]
        if unnamed:
            raise pickle.PicklingError(
                f"cannot pickle this {type(self).__name__}: {'; '.join(unnamed)}, which has no import path (a lambda, "
                f"a local function or one defined in __main__); pickling stores functions by reference: define it "
                f"at module level in an importable module (copy.deepcopy works without)")
        arguments = self._copy_arguments()
        arguments["tuning"] = self.tuning.replace(phase_timer=None)
        tables, slots = self._static_state()
        state = {"version": 1, "config": config, "arguments": arguments, "step": self.step,
                 "skipped_rows": dict(self.skipped_rows), "tables": tables, "slots": slots,
                 "dynamic": self._dynamic_states()}
        return type(self)._from_pickled, (state,)

    @staticmethod
    def _functions_without_path(node, where):
        """``(where, entry)`` for each function in an encoded configuration that has no import path."""
        if isinstance(node, dict):
            if "function" in node and node["function"] is None:
                return [(where, node)]
            return [x for k, v in node.items() if k != "name" for x in
                    Embedding._functions_without_path(v, where if k in ("args", "tuple") else f"{where}.{k}")]
        if isinstance(node, list):
            return [x for i, v in enumerate(node) for x in Embedding._functions_without_path(v, f"{where}[{i}]")]
        return []

    @classmethod
    def _from_pickled(cls, state):
        from .checkpoint.config_codec import FunctionResolver, decode_engine_config
        if state.get("version") != 1:
            raise ValueError(f"this pickled {cls.__name__} has version {state.get('version')!r}; this embedcore "
                             f"reads version 1")
        feature_config, optimizer, _ = decode_engine_config(state["config"], FunctionResolver(allow_import=True))
        emb = cls(feature_config, optimizer, fill=False, **state["arguments"])
        emb.set_state(state["tables"], state["slots"], state["step"])
        emb._set_dynamic_states(state.get("dynamic", {}))
        emb.skipped_rows = dict(state["skipped_rows"])
        return emb

    # -- update ------------------------------------------------------------------------------------------
    def apply_gradients(self, gradients, ctx: LookupContext):
        """Apply ``d loss / d activations`` (mirroring the activations) with each table's fused optimizer.

        A feature's gradient may be ``None``: no gradient for that feature. Its occurrences are left out of
        the update, so a row only that feature looked up is not touched at all (not even by a zero gradient:
        a lazy Adam's moments stay as they are), while other features of the same table update their rows
        as usual; a non-lazy optimizer still updates every row of its tables, as it does each step. When
        every gradient is None nothing is updated, non-lazy tables included. (TensorFlow sends a zero
        gradient instead, which is the same for SGD and Adagrad and not for Adam: its docstring warns of
        exactly that.) ``step`` advances on every call, whichever gradients are None, all of them included:
        it counts ``apply_gradients`` calls, the optimizer's iterations (as TensorFlow's TPU embedding, which
        runs its optimizer once per call whatever the gradients, and as a step that touches no row of some
        table always did here); callables (learning rates, hyperparameters) are evaluated once per call as
        always.

        A gradient may be float32, float64, float16 or ``ml_dtypes.bfloat16`` (as JAX and TensorFlow hand
        out). A 16-bit gradient is applied exactly as its ``astype(np.float32)`` copy would be (every 16-bit
        value is a float32, and the sums are the same float32 sums, bit for bit), but without making that
        copy: when a table's gradients are all of one 16-bit format and contiguous (one feature's array, or
        consecutive views of one array), the update reads them in place, 2 bytes a value instead of 4, and
        its NaN/Inf check is a pass over their bits.

        Everything is validated before anything changes: a bad gradient raises :class:`InputError` naming
        the feature, with tables, slots and ``step`` unchanged; so does a ``ctx`` that is not a context of
        this engine's lookup against its current tables (another engine's, one looked up before a
        ``load``), or one already applied. Returns an :class:`UpdateReport`. A lookup-only engine (built
        without any optimizer) raises ``RuntimeError`` and changes nothing.

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
        if self.lookup_only:
            raise refuse_lookup_only(self)
        with self._exclusive("apply_gradients"):
            self._check_context(ctx)
            return self._apply(gradients, ctx)

    def _apply(self, gradients, ctx):
        timer = self.tuning.phase_timer
        t0 = perf_counter() if timer is not None else 0.0
        for table, tb in zip(self._physical, ctx.table_batches):
            why = None if tb is None else table.stale(tb)
            if why is not None:
                raise InputError(why)
        leaves = inputs.flatten_like(self._feature_config, gradients, "gradients")
        refuse = self.non_finite == "raise"
        # NaN/Inf are looked for once per physical table, in the gradient rows its update reads (the
        # features' gradients in place or copied), after every feature's type and shape are checked: a bad
        # shape anywhere is reported before a NaN, and NaNs table by table.
        checked = [None if grad is None else check_gradient(grad, s, refuse, values_checked_later=True)
                   for grad, s in zip(leaves, ctx.features)]
        work = []
        for k, table in enumerate(self._physical if any(grad is not None for grad in checked) else ()):
            tb = ctx.table_batches[k]
            without = [s for grad, s in zip(checked, ctx.features) if s.group == k and grad is None]
            every = len(without) == sum(s.group == k for s in ctx.features)
            if table.optimizer.lazy and (tb is None or every):
                continue
            if tb is None:
                tb = inputs.build_table_batch([])
            elif without:
                tb = occurrences_without(tb, without)
            d_act, bad = gradient_rows_counted(k, tb.n_out, table.dim, table.workspace, checked, ctx.features,
                                               count=refuse, keep_16_bit=True)
            if refuse and bad != 0:  # None: read in place, not counted yet; else counted as they were copied
                _refuse_non_finite(d_act, k, checked, ctx.features)
            work.append((table, tb, d_act))
        step = self.step + 1
        values = {}
        for table in self._physical:
            if id(table.optimizer) not in values:
                values[id(table.optimizer)] = table.optimizer.step_values(step)
        if timer is not None:
            timer("check gradients", perf_counter() - t0)
        # Validation is over; from here on the tables change.
        report = UpdateReport(step)
        failing = set()
        for table, tb, d_act in work:
            lr, hyper = values[id(table.optimizer)]
            update = table.update(tb, d_act, lr, hyper, step)
            report.add(update)
            if update.function is not None:
                failing.add(update.function)
        self.step = step
        ctx.consumed = True
        ctx.release()
        report.tally(self.skipped_rows)
        if failing:
            skipped = f"; also {report.describe()}" if report.skipped else ""
            error = RowFunctionError(f"{report.describe_failed(' and '.join(sorted(failing)))}{skipped}. The other "
                                     f"rows were updated and step is now {step}; these gradients cannot be applied "
                                     f"again (look up again)")
            error.report = report
            raise error
        if report.skipped and self.non_finite == "raise":
            raise NonFiniteError(report.describe() + f". The other rows were updated and step is now {step}; "
                                 f"Embedding(non_finite='skip') skips such rows and reports them instead")
        return report


def refuse_lookup_only(engine) -> RuntimeError:
    """The error of ``apply_gradients`` on a lookup-only engine (TensorFlow raises ``RuntimeError`` where its
    ``TPUEmbedding`` cannot apply gradients)."""
    return RuntimeError(f"apply_gradients is not valid on a lookup-only {type(engine).__name__}: it was built with "
                        f"optimizer=None and tables {sorted(engine.tables)} that set no optimizer, so it has "
                        f"nothing to train with (nothing was changed); pass an optimizer to train")


def occurrences_without(table_batch, features) -> inputs.TableBatch:
    """``table_batch`` without the occurrences of ``features`` (their activation slots): their activation rows
    keep their place (``n_out`` is unchanged) and feed no occurrence, so an update reads none of their
    gradient rows and touches no row only they looked up. A new batch; the original is unchanged."""
    tb = table_batch
    ptr = tb.out_ptr
    keep = np.ones(tb.rows.shape[0], bool)
    for s in features:
        keep[ptr[s.out_offset]:ptr[s.out_offset + s.n_rows]] = False
    return inputs.select_occurrences(tb, keep)


def gradient_rows(k, n_out, dim, workspace, gradients, features):
    """The activation gradients of physical table ``k`` (``n_out`` activation rows) as one ``[n_out, dim]``
    float32 array; used by every engine. A feature whose gradient is None has zero rows there (its
    occurrences are left out of the update: :func:`occurrences_without`).

    Used in place, without a copy: a table fed by one feature whose gradient is float32 and contiguous,
    and features whose float32 contiguous gradients lie one after the other in memory, in the order of
    their activation rows (views of one ``[features, batch, dim]`` array, as FBGEMM takes one gradient
    for all its tables). Otherwise the features' gradients are copied into ``workspace``.
    """
    return gradient_rows_counted(k, n_out, dim, workspace, gradients, features)[0]


def gradient_rows_counted(k, n_out, dim, workspace, gradients, features, count=False, keep_16_bit=False):
    """``(d_act, bad)``: :func:`gradient_rows`, and ``bad`` the number of NaN/Inf values among the rows when
    ``count`` and they were copied (counted by the copy, which reads each value anyway), else None (rows
    used in place: nothing has read them yet).

    With ``keep_16_bit``, when the table's gradients are all of one 16-bit format (float16 or bfloat16), the
    rows stay in that format (for :meth:`PhysicalTable.update <embedcore.tables.PhysicalTable.update>`, which
    converts each value exactly to float32 as it sums it): in place under the same conditions as float32
    ones, else copied into a workspace array of that format (``None`` gradients as zeros). Their NaN/Inf are
    then values whose exponent bits are all ones, counted without converting anything. Any other mix of
    dtypes is copied into float32 rows (16-bit values exactly)."""
    mine = [(grad, s) for grad, s in zip(gradients, features) if s.group == k]
    dtype = _rows_dtype(mine, keep_16_bit)
    if all(grad is not None and grad.dtype == dtype and grad.flags.c_contiguous for grad, _ in mine):
        if len(mine) == 1:
            return mine[0][0].reshape(n_out, dim), None
        consecutive = _consecutive(mine, n_out, dim)
        if consecutive is not None:
            return consecutive, None
    d_act = workspace.array("d_act" if dtype == np.float32 else f"d_act_{dtype}", (n_out, dim), dtype)
    bad = 0 if count else None
    for grad, s in mine:
        rows = d_act[s.out_offset:s.out_offset + s.n_rows]
        if grad is None:
            rows[...] = 0  # never read by the update; not left as stale values that a NaN check would see
        elif count and _copied_counting(grad.dtype):
            bad += copy_counting_non_finite(grad.reshape(s.n_rows, dim), rows)
        else:
            rows[...] = grad.reshape(s.n_rows, dim)
            if count:
                bad += count_non_finite(rows.reshape(-1))
    return d_act, bad




def _copied_counting(dtype) -> bool:
    """Whether gradients of ``dtype`` are counted for NaN/Inf as they are copied (native 16-bit ones are
    kept as they are; float32 and float64 converted)."""
    return is_native_16_bit(dtype) or dtype == np.float32 or dtype == np.float64


_FLOAT_DTYPES = "float16, bfloat16, float32 or float64"


def _rows_dtype(gradients, keep_16_bit):
    """The dtype of a table's gradient rows: the 16-bit dtype (float16 or bfloat16, native byte order) every
    gradient (but None ones) has, when ``keep_16_bit`` and there is one; else float32."""
    dtypes = {grad.dtype for grad, _ in gradients if grad is not None}
    if keep_16_bit and len(dtypes) == 1:
        dtype = dtypes.pop()
        if is_native_16_bit(dtype):
            return dtype
    return np.dtype(np.float32)


def _consecutive(gradients, n_rows, dim):
    """One ``[n_rows, dim]`` view over C-contiguous gradients ``(array, slot)`` of one dtype whose data
    follow each other in memory in the slots' ``out_offset`` order, or None. The view spans exactly their
    data, so it reads only memory those arrays own (the caller keeps them alive); the update never writes
    it."""
    itemsize = gradients[0][0].dtype.itemsize
    row_bytes = dim * itemsize
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
    return np.lib.stride_tricks.as_strided(first, shape=(n_rows, dim), strides=(row_bytes, itemsize))


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


def check_gradient(grad, s: _FeatureSlot, refuse_non_finite: bool = True,
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
    if grad.dtype.kind != "f" and not is_bfloat16(grad.dtype):
        raise InputError(f"gradient of feature '{name}' must hold floats ({_FLOAT_DTYPES}), got dtype "
                         f"{grad.dtype}")
    if grad.shape != s.shape:
        raise InputError(f"gradient of feature '{name}' has shape {grad.shape}, its activations have {s.shape}")
    flat = grad.reshape(-1)
    native = flat if _copied_counting(flat.dtype) else flat.astype(np.float64)
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
