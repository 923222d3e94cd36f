"""The embedding engine: owns the tables, looks up activations, applies fused sparse updates.

Like TensorFlow's TPU embedding engine, it exchanges two arrays per feature with the dense model:
activations out (``emb(features)``), activation gradients in (``emb.apply_gradients(grads, ctx)``).
Tables with equal optimizers and equal ``dim`` are stacked into one physical array and updated by one
kernel pass; ``stack_tables=False`` keeps one array per table (results are identical).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from . import inputs
from .compiler import RowFunctionError, describe
from .config import FeatureConfig, TableConfig
from .initializers import TruncatedNormal, fill_rows
from .inputs import InputError
from .kernels.dedup import unique_rows
from .kernels.rows import count_non_finite, gather_combine
from .kernels.update import update_kernel
from .kernels.workspace import Workspace
from .optimizers import Optimizer

__all__ = ["Embedding", "LookupContext"]


@dataclass
class _PhysicalTable:
    """One array holding the rows of one or more stacked tables, plus their slots."""

    tables: list            # TableConfig, in stacking order
    offsets: list           # first physical row of each table
    dim: int
    optimizer: Optimizer
    weights: np.ndarray = None
    slots: tuple = ()
    row_function: object = None
    workspace: Workspace = field(default_factory=Workspace)

    @property
    def n_rows(self) -> int:
        return self.offsets[-1] + self.tables[-1].vocabulary_size


@dataclass
class _FeatureSlot:
    """Where a feature's activations live: physical table, activation rows and shape."""

    path: str
    config: FeatureConfig
    group: int
    out_offset: int
    n_rows: int
    shape: tuple


@dataclass
class LookupContext:
    """What :meth:`Embedding.apply_gradients` needs from the lookup that produced the activations."""

    engine_id: int
    table_batches: list
    features: list
    consumed: bool = False


class Embedding:
    """Embedding tables with fused, sparse, per-row optimizers.

    Args:
        feature_config: a :class:`FeatureConfig`, or any nest of dicts/lists/tuples of them.
        optimizer: the optimizer of every table that does not set its own.
        seed: seed of the tables' initial values (a table's own initializer seed wins).
        stack_tables: stack tables with equal optimizers and ``dim`` into one physical array.
    """

    def __init__(self, feature_config, optimizer=None, *, seed=0, stack_tables=True):
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(f"optimizer must be an embedcore optimizer or None, got {optimizer!r}")
        self._feature_config = feature_config
        self._features = inputs.flatten(feature_config)
        if not self._features:
            raise ValueError("feature_config holds no FeatureConfig")
        for path, feature in self._features:
            if not isinstance(feature, FeatureConfig):
                raise ValueError(f"feature_config entry '{path}' must be a FeatureConfig, got {feature!r}")
        self.seed = int(seed)
        self.step = 0
        self._lock = threading.Lock()
        tables = self._collect_tables()
        self._table_configs = {t.name: t for t in tables}
        self._groups = self._stack(tables, optimizer, stack_tables)
        self._group_of = {}
        for g, group in enumerate(self._groups):
            for table, offset in zip(group.tables, group.offsets):
                self._group_of[id(table)] = (g, offset)
        for group in self._groups:
            self._build(group)

    # -- construction ------------------------------------------------------------------------------------
    def _collect_tables(self):
        tables, seen = [], set()
        for _, feature in self._features:
            if id(feature.table) not in seen:
                seen.add(id(feature.table))
                tables.append(feature.table)
        names = {}
        for table in tables:
            if table.name is not None:
                if table.name in names:
                    raise ValueError(f"two different tables are named '{table.name}': {names[table.name]!r} and "
                                     f"{table!r}")
                names[table.name] = table
        k = 0
        for table in tables:
            if table.name is None:
                while f"table_{k}" in names:
                    k += 1
                table.name = f"table_{k}"
                names[table.name] = table
        return tables

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

    def _build(self, group: _PhysicalTable):
        opt = group.optimizer
        group.row_function = opt.compiled(group.dim)
        group.weights = np.empty((group.n_rows, group.dim), np.float32)
        group.slots = tuple(np.empty((group.n_rows, group.dim) if d == 2 else (group.n_rows,), np.float32)
                            for d in opt.slot_dims)
        for table, offset in zip(group.tables, group.offsets):
            rows = slice(offset, offset + table.vocabulary_size)
            init = table.initializer or TruncatedNormal(0.0, 1.0 / np.sqrt(table.dim))
            fill_rows(init, group.weights[rows], 0, table.vocabulary_size, self.seed, table.name)
            for name, slot_init, slot in zip(opt.slot_names, opt.slot_initializers, group.slots):
                view = slot[rows] if slot.ndim == 2 else slot[rows][:, None]
                fill_rows(slot_init, view, 0, table.vocabulary_size, self.seed, table.name, name)

    # -- state -------------------------------------------------------------------------------------------
    @property
    def embedding_tables(self) -> dict:
        """Table name -> its ``[vocabulary_size, dim]`` float32 array (a view of the engine's storage)."""
        out = {}
        for group in self._groups:
            for table, offset in zip(group.tables, group.offsets):
                out[table.name] = group.weights[offset:offset + table.vocabulary_size]
        return out

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
    def tables(self) -> dict:
        """Table name -> :class:`TableConfig`."""
        return dict(self._table_configs)

    @property
    def num_physical_tables(self) -> int:
        return len(self._groups)

    def __repr__(self):
        groups = "; ".join("+".join(t.name for t in g.tables) + f" [{g.n_rows} x {g.dim}, "
                           f"{type(g.optimizer).__name__}]" for g in self._groups)
        return f"Embedding({len(self._features)} features; {groups}; step={self.step})"

    # -- lookup ------------------------------------------------------------------------------------------
    def __call__(self, features, weights=None):
        """Look up activations: returns ``(activations, ctx)``, activations mirroring ``features``."""
        return self.lookup(features, weights)

    def lookup(self, features, weights=None):
        id_leaves = inputs.flatten_like(self._feature_config, features, "features")
        weight_leaves = ([None] * len(id_leaves) if weights is None
                         else inputs.flatten_like(self._feature_config, weights, "weights"))
        parts = [[] for _ in self._groups]
        out_rows = [0] * len(self._groups)
        slots = []
        for (path, feature), ids, w in zip(self._features, id_leaves, weight_leaves):
            name = feature.name or path
            g, row_offset = self._group_of[id(feature.table)]
            batch = inputs.to_feature_batch(ids, w, name, feature.table.vocabulary_size,
                                            feature.validate_weights_and_indices)
            seq_len = feature.max_sequence_length
            n = batch.batch_size * max(seq_len, 1)
            shape = (batch.batch_size, seq_len, feature.table.dim) if seq_len else \
                (batch.batch_size, feature.table.dim)
            if feature.output_shape is not None:
                if int(np.prod(feature.output_shape)) != n:
                    raise InputError(f"feature '{name}': output_shape {feature.output_shape} holds "
                                     f"{int(np.prod(feature.output_shape))} activation rows, the batch gives {n}")
                shape = feature.output_shape + (feature.table.dim,)
            parts[g].append((batch, feature.table.combiner, seq_len, row_offset, out_rows[g]))
            slots.append(_FeatureSlot(path, feature, g, out_rows[g], n, shape))
            out_rows[g] += n
        table_batches, acts = [], []
        for group, group_parts in zip(self._groups, parts):
            tb = inputs.build_table_batch(group_parts) if group_parts else None
            act = np.zeros((tb.n_out if tb else 0, group.dim), np.float32)
            if tb is not None and tb.n_out:
                gather_combine(group.weights, tb.rows, tb.gains, tb.out_ptr, act)
            table_batches.append(tb)
            acts.append(act)
        activations = [acts[s.group][s.out_offset:s.out_offset + s.n_rows].reshape(s.shape) for s in slots]
        ctx = LookupContext(id(self), table_batches, slots)
        return inputs.unflatten(self._feature_config, activations), ctx

    # -- update ------------------------------------------------------------------------------------------
    def apply_gradients(self, gradients, ctx: LookupContext):
        """Apply ``d loss / d activations`` (mirroring the activations) with each table's fused optimizer.

        Everything is validated before anything changes: a bad gradient raises :class:`InputError` naming
        the feature, with tables, slots and ``step`` unchanged.
        """
        if not isinstance(ctx, LookupContext) or ctx.engine_id != id(self):
            raise InputError("ctx must be the context returned by this engine's lookup")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("apply_gradients is already running on this Embedding in another thread")
        try:
            self._apply(gradients, ctx)
        finally:
            self._lock.release()

    def _apply(self, gradients, ctx):
        if ctx.consumed:
            raise InputError("these activations' gradients were already applied; look up again")
        leaves = inputs.flatten_like(self._feature_config, gradients, "gradients")
        checked = [_check_gradient(grad, s) for grad, s in zip(leaves, ctx.features)]
        step = self.step + 1
        values = {}
        for group in self._groups:
            if id(group.optimizer) not in values:
                values[id(group.optimizer)] = group.optimizer.step_values(step)
        # Validation is over; from here on the tables change.
        for g, group in enumerate(self._groups):
            tb = ctx.table_batches[g]
            if tb is None and group.optimizer.lazy:
                continue
            ws = group.workspace
            if tb is None:
                tb = inputs.build_table_batch([])
            d_act = self._gradient_rows(g, group, tb, checked, ctx.features)
            uniq, ptr, order = unique_rows(tb.rows, group.n_rows, ws)
            lr, hyper = values[id(group.optimizer)]
            errors = np.zeros(1, np.int64)
            kernel = update_kernel(group.row_function, lazy=group.optimizer.lazy)
            kernel(group.weights, group.slots, uniq, ptr, order, tb.out_row, tb.gains, d_act, lr, hyper, errors)
            if errors[0]:
                raise RowFunctionError(f"{describe(group.row_function.python_function)} returned rows of the wrong "
                                       f"length for some row(s) of table(s) {[t.name for t in group.tables]}")
        self.step = step
        ctx.consumed = True


    @staticmethod
    def _gradient_rows(g, group, tb, gradients, features):
        """The activation gradients of physical table ``g`` as one ``[n_out, dim]`` float32 array.

        A table fed by one feature whose gradient is already float32 and contiguous is used as it is;
        otherwise the features' gradients are copied into a reused workspace.
        """
        mine = [(grad, s) for grad, s in zip(gradients, features) if s.group == g]
        if len(mine) == 1 and mine[0][0].dtype == np.float32 and mine[0][0].flags.c_contiguous:
            return mine[0][0].reshape(tb.n_out, group.dim)
        d_act = group.workspace.array("d_act", (tb.n_out, group.dim), np.float32)
        for grad, s in mine:
            d_act[s.out_offset:s.out_offset + s.n_rows] = grad.reshape(s.n_rows, group.dim)
        return d_act


def _check_gradient(grad, s: _FeatureSlot) -> np.ndarray:
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
    if count_non_finite(flat if flat.dtype in (np.float32, np.float64) else flat.astype(np.float32)):
        bad = np.unravel_index(int(np.flatnonzero(~np.isfinite(flat))[0]), grad.shape)
        raise InputError(f"gradient of feature '{name}' holds {grad[bad]} at index {tuple(int(i) for i in bad)}; "
                         f"NaN/Inf gradients are refused (nothing was updated)")
    return grad
