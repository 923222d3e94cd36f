"""Looking up activations: the part of an engine that training and serving share.

A :class:`TableLookup` holds the feature structure and the tables (stacked into physical tables,
:class:`embedcore.tables.PhysicalTable`, each table at a row offset) and turns a batch of features into
activations. :class:`~embedcore.Embedding` adds the
optimizers and ``apply_gradients``; :class:`~embedcore.serving.ServingEmbedding` adds read-only tables
memory-mapped from a checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np

from . import inputs
from .config import FeatureConfig
from .inputs import InputError, InputTypeError
from .kernels.half import stored_dtype
from .memory_budget import check_fits

__all__ = ["TableLookup", "LookupContext", "activation_layout", "OUTPUT_DTYPES", "check_output_dtype"]

OUTPUT_DTYPES = ("float32", "float16", "bfloat16")  # what lookups may return (an engine's ``output_dtype``)

_CHECKED_ACTIVATION_BYTES = 1 << 26  # activations larger than this are checked against the machine's memory
_MAX_ACTIVATION_ROWS = 2 ** 31  # an occurrence carries its activation row in 32 bits (kernels/occurrences.py)
_GENERATIONS = itertools.count(1)  # table generations, never repeated within a process


class _EngineToken:
    """The identity of one engine, held by the engine and by every context its lookups return.

    A context keeps its token alive, so no other engine can ever hold the same one (unlike ``id()``, which
    CPython reuses once an object is freed); the weak reference only tells a message whose engine it was.
    """

    __slots__ = ("engine", "__weakref__")

    def __init__(self, engine):
        self.engine = weakref.ref(engine)


@dataclass
class _FeatureSlot:
    """Where a feature's activations live: physical table (index), activation rows and shape."""

    path: str
    config: FeatureConfig
    group: int
    out_offset: int
    n_rows: int
    shape: tuple


@dataclass
class LookupContext:
    """What :meth:`Embedding.apply_gradients` needs from the lookup that produced the activations.

    It is bound to its engine by an unforgeable token and to the generation of that engine's tables (which
    changes whenever they are replaced, e.g. by ``load``): an engine refuses the context of another engine,
    one looked up before its tables were replaced, and one already applied or released.

    Its table batches live in workspaces leased from the engine's pools; :meth:`release` (called once the
    gradients are applied, or when the context is garbage-collected) returns them for the next lookup.
    ``training`` is the lookup's: the context of a read-only lookup (``training=False``) cannot be applied.
    """

    engine_token: _EngineToken
    generation: int
    table_batches: list
    features: list
    consumed: bool = False
    leases: list = field(default_factory=list)   # (WorkspacePool, Workspace) pairs
    training: bool = True

    def release(self) -> None:
        """Give the leased workspaces back; the table batches must not be used afterwards."""
        self.table_batches = None
        _return_leases(self.leases)

    def __del__(self):
        # Not weakref.finalize: its registry is a global dict that one entry per step would churn.
        leases = getattr(self, "leases", None)   # (absent if __init__ failed)
        if leases:
            _return_leases(leases)


def _return_leases(leases):
    for pool, workspace in leases:
        pool.release(workspace)
    leases.clear()


class TableLookup:
    """Features, tables and lookups.

    Subclasses call :meth:`_index_tables` with what lookups lay batches out over: physical tables (anything
    with ``tables``, ``offsets`` and ``dim``: each table's rows at an offset in one id space).

    ``serving`` chooses the lookup's rules. False (training engines): every feature of the config is given
    and a batch that does not fit a feature's ``output_shape`` is refused. True: TensorFlow's serving lookup
    (``TPUEmbeddingForServing``): any batch size (``output_shape`` as :func:`activation_layout` says), and a
    dict of features may hold a subset of the config's keys (the activations mirror the features given).
    """

    serving = False
    output_dtype = "float32"  # the activations' format (``Embedding(output_dtype=...)``, see check_output_dtype)

    def _init_features(self, feature_config):
        self._feature_config = feature_config
        self._features = inputs.flatten(feature_config)
        if not self._features:
            raise ValueError("feature_config holds no FeatureConfig")
        for path, feature in self._features:
            if not isinstance(feature, FeatureConfig):
                raise ValueError(f"feature_config entry '{path}' must be a FeatureConfig, got {feature!r}")
        tables = self._collect_tables()
        self._table_configs = {t.name: t for t in tables}
        return tables

    def _index_tables(self, spaces):
        """Take ``spaces`` as the id spaces lookups lay batches out over: a new layout, so every earlier
        context is refused."""
        self._token = _EngineToken(self)
        self._generation = next(_GENERATIONS)
        self._spaces = tuple(spaces)
        self._space_of = {}
        engine = weakref.ref(self)
        for k, space in enumerate(self._spaces):
            for table, offset in zip(space.tables, space.offsets):
                self._space_of[id(table)] = (k, offset)
            if getattr(space, "dynamic", False):  # its views hide rows expired at the engine's current step
                space.clock = lambda: getattr(engine(), "step", 0)

    def _tables_replaced(self) -> None:
        """Record that the tables' contents were replaced as a whole (``load``): contexts looked up before
        refer to other values and are refused from now on."""
        self._generation = next(_GENERATIONS)

    def _check_context(self, ctx, kind=None) -> None:
        """Refuse (:class:`InputError`) a ``ctx`` that is not a context of ``kind`` returned by this engine's
        lookup against its current tables, or that was applied (or released) already; nothing changes."""
        kind = LookupContext if kind is None else kind
        if not isinstance(ctx, kind):
            raise InputTypeError(f"ctx must be the context returned by this engine's lookup, got "
                             f"{type(ctx).__name__} (nothing was updated)")
        if ctx.engine_token is not self._token:
            owner = ctx.engine_token.engine() if isinstance(ctx.engine_token, _EngineToken) else None
            whose = "another engine, since freed" if owner is None else f"another engine, {type(owner).__name__}"
            raise InputError(f"ctx must be the context returned by this engine's lookup; this one was returned by "
                             f"{whose} (nothing was updated)")
        if not ctx.training:
            raise InputError("ctx was returned by a lookup with training=False, which reads the tables without "
                             "changing them (dynamic tables count, admit, touch and evict nothing): its gradients "
                             "cannot be applied; look up with training=True to train (nothing was updated)")
        if ctx.consumed or ctx.table_batches is None:
            raise InputError("these activations' gradients were already applied (or their context released); "
                             "look up again (nothing was updated)")
        if ctx.generation != self._generation:
            raise InputError("ctx was returned by a lookup made before this engine's tables were replaced (load): "
                             "its activations are of the old tables; look up again (nothing was updated)")

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

    # -- state -------------------------------------------------------------------------------------------
    @property
    def physical_tables(self) -> tuple:
        """The :class:`~embedcore.tables.PhysicalTable` objects holding this engine's rows (for tests,
        benchmarks and tools; their storage is the engine's own)."""
        return self._physical

    @property
    def dynamic_tables(self) -> dict:
        """Dynamic table name -> its :class:`~embedcore.tables.dynamic.DynamicTable` (keys, admission, eviction
        and rows of one table; for tests, checkpoints and tools), in the order of :attr:`physical_tables`."""
        return {t.name: t for space in self._physical if getattr(space, "dynamic", False) for t in space.members}

    @property
    def embedding_tables(self) -> dict:
        """Table name -> its ``[vocabulary_size, dim]`` array in the table's ``weights_dtype`` (float32,
        ``np.float16`` or ``ml_dtypes.bfloat16``; a view of the engine's storage); for a dynamic table, a
        :class:`~embedcore.tables.dynamic.DynamicTableView` (its rows by key)."""
        return {name: table.table_rows(name) for table in self._physical for name in table.table_names}

    @property
    def feature_config(self):
        """The feature structure this engine was built with (inputs and outputs mirror it)."""
        return self._feature_config

    @property
    def tables(self) -> dict:
        """Table name -> :class:`TableConfig`."""
        return dict(self._table_configs)

    # -- lookup ------------------------------------------------------------------------------------------
    def __call__(self, features, weights=None, *, training: bool = True):
        """Look up activations: returns ``(activations, ctx)``, activations mirroring ``features``
        (``training``: see :meth:`lookup`)."""
        if training is True:  # as given: engines whose lookup takes no ``training`` (serving) are called alike
            return self.lookup(features, weights)
        return self.lookup(features, weights, training=training)

    def _structure_of(self, features):
        """The part of the feature config that ``features`` looks up: all of it, or (``serving``) the dict
        keys that ``features`` holds."""
        return inputs.restrict(self._feature_config, features) if self.serving else self._feature_config

    def _prepare(self, features, weights, structure=None):
        """Validate the batch; returns the features' activation slots and, per physical table, its parts (their
        ids are range-checked when the parts are laid out, by ``inputs.build_table_batch``). ``structure``: the
        part of the feature config looked up (:meth:`_structure_of`; default: all of it)."""
        structure = self._feature_config if structure is None else structure
        id_leaves = inputs.flatten_like(structure, features, "features")
        weight_leaves = ([None] * len(id_leaves) if weights is None
                         else inputs.flatten_like(structure, weights, "weights"))
        looked_up = self._features if structure is self._feature_config else inputs.flatten(structure)
        parts = [[] for _ in self._spaces]
        out_rows = [0] * len(self._spaces)
        slots = []
        for (path, feature), ids, w in zip(looked_up, id_leaves, weight_leaves):
            name = feature.name or path
            g, row_offset = self._space_of[id(feature.table)]
            batch = inputs.to_feature_batch(ids, w, name, feature.table.vocabulary_size,
                                            feature.validate_weights_and_indices, check_range=False)
            seq_len, n, shape = activation_layout(feature, batch, name, self.serving)
            parts[g].append((batch, feature.table.combiner, seq_len, row_offset, out_rows[g],
                             feature.table.vocabulary_size))
            slots.append(_FeatureSlot(path, feature, g, out_rows[g], n, shape))
            out_rows[g] += n
            if out_rows[g] >= _MAX_ACTIVATION_ROWS:
                raise InputError(f"feature '{name}': the batch gives {out_rows[g]:,} activation rows for one "
                                 f"physical table, more than {_MAX_ACTIVATION_ROWS - 1:,}")
        value_bytes = stored_dtype(self.output_dtype).itemsize
        activation_bytes = sum(value_bytes * n * space.dim for n, space in zip(out_rows, self._spaces))
        if activation_bytes > _CHECKED_ACTIVATION_BYTES:  # below it, reading the machine's memory would cost more
            check_fits(activation_bytes, f"the activations of this batch ({sum(out_rows):,} rows)", InputError)
        return slots, parts

    def lookup(self, features, weights=None, *, training: bool = True):
        """Look up activations: returns ``(activations, ctx)``, activations mirroring ``features``, ``ctx``
        what ``apply_gradients`` takes.

        ``training`` (as TensorFlow's ``TPUEmbedding.enqueue(..., training=False)``): True, a training lookup:
        a dynamic table counts its keys for admission, gives admitted keys rows, touches the rows used and may
        evict (see :mod:`embedcore.tables.dynamic`). False, a read-only lookup (evaluation, serving-style
        reads): no table changes at all; a dynamic table's held keys read their rows, every other key (absent,
        not admitted yet, or expired by TTL at the engine's ``step``) its initial value, and the context
        cannot be applied (``apply_gradients`` refuses it). Static tables read alike either way.
        """
        if not isinstance(training, (bool, np.bool_)):
            raise InputTypeError(f"training must be True or False, got {training!r}")
        token, generation = self._token, self._generation  # before the tables are read: a load meanwhile
        structure = self._structure_of(features)          # makes this context stale, never current
        slots, parts = self._prepare(features, weights, structure)
        dynamic = [k for k, (table, table_parts) in enumerate(zip(self._spaces, parts))
                   if table_parts and getattr(table, "dynamic", False)]
        exclusive = getattr(self, "_exclusive", None)
        # A lookup of a dynamic table changes it (admission, eviction), and a read-only one reads what they
        # change: one at a time, as apply_gradients.
        with exclusive("look up dynamic tables") if dynamic and exclusive is not None else contextlib.nullcontext():
            table_batches, leases = self._lay_out(parts, dynamic) if training else self._lay_out_read_only(parts)
            dtype = stored_dtype(self.output_dtype)
            acts = [table.lookup(tb, dtype=dtype) for table, tb in zip(self._spaces, table_batches)]
        activations = [acts[s.group][s.out_offset:s.out_offset + s.n_rows].reshape(s.shape) for s in slots]
        ctx = LookupContext(token, generation, table_batches, slots, leases=leases, training=bool(training))
        return inputs.unflatten(structure, activations), ctx

    def _lay_out_read_only(self, parts):
        """As :meth:`_lay_out`, changing no table: dynamic tables lay out their read-only lookup
        (``lay_out_read_only``) at the engine's ``step``."""
        batches, leases = [None] * len(parts), []
        step = getattr(self, "step", 0)
        try:
            for k, (table, table_parts) in enumerate(zip(self._spaces, parts)):
                if table_parts:
                    dynamic = getattr(table, "dynamic", False)
                    batches[k], lease = (table.lay_out_read_only(table_parts, step) if dynamic
                                         else table.lay_out(table_parts))
                    leases.append(lease)
        except BaseException:
            _return_leases(leases)
            raise
        return batches, leases

    def _lay_out(self, parts, dynamic):
        """Each physical table's batch of ``parts`` (None where it has none) and the workspaces leased. The
        dynamic tables (indices ``dynamic``) are planned first and changed last, once every table's batch was
        accepted: a batch refused anywhere changes no table (nothing was gathered, the workspaces go back)."""
        batches, leases, plans = [None] * len(parts), [], {}
        step = getattr(self, "step", 0)
        try:
            for k in dynamic:
                plans[k] = self._spaces[k].plan(parts[k], step)
            for k, (table, table_parts) in enumerate(zip(self._spaces, parts)):
                if table_parts and k not in plans:
                    batches[k], lease = table.lay_out(table_parts)
                    leases.append(lease)
        except BaseException:  # an id out of range, a full dynamic table, say
            for k, plan in plans.items():
                self._spaces[k].cancel(plan)
            _return_leases(leases)
            raise
        try:
            for k, plan in plans.items():
                batches[k], lease = self._spaces[k].lay_out_planned(plan)
                leases.append(lease)
        except BaseException:
            _return_leases(leases)
            raise
        return batches, leases


def check_output_dtype(output_dtype) -> str:
    """``output_dtype`` if it names a format lookups can return (:data:`OUTPUT_DTYPES`), else ``ValueError``
    naming it.

    The activations are summed in float32 whatever the tables' and the output's formats; a 16-bit output
    rounds each float32 activation once, to nearest, ties to even: exactly ``float32_activations.astype(X)``
    (``np.float16``, or ``ml_dtypes.bfloat16``). A float32 activation of magnitude 65520 or more becomes
    float16 infinity, as that cast makes it (bfloat16 has float32's range: only float32 infinities stay
    infinite)."""
    if not isinstance(output_dtype, str) or output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {list(OUTPUT_DTYPES)}, got {output_dtype!r:.80}")
    return output_dtype


def activation_layout(feature: FeatureConfig, batch, name: str, serving: bool = False):
    """``(sequence length, activation rows, activation shape)`` of ``feature``'s activations for ``batch``
    (an :class:`embedcore.inputs.FeatureBatch`), or :class:`InputError` naming the feature.

    The batch's samples have the shape ``S = batch.samples_shape`` (``(B,)``, or ``(d1, ..., dn)`` for
    high-dimensional ids). Without ``output_shape`` (None or empty, which TensorFlow treats alike) the
    activations are ``S + (dim,)``, or ``(B, L, dim)`` for a sequence feature (``max_sequence_length = L``)
    given rank-2 ids; for ids of higher rank ``L`` is ignored with a warning, as TensorFlow does.

    Training (``serving`` False): ``output_shape`` must hold exactly the activation rows the batch gives
    (``prod(output_shape) == prod(S) * max(L, 1)``); the activations are ``output_shape + (dim,)``. Dense
    ids of rank 3 or more are taken only when ``output_shape`` is their leading shape ``S`` (a stray axis,
    as in ``[1, B, k]``, is refused, not read as a batch of one row of ``B`` samples).

    Serving (``serving`` True, TensorFlow's ``cpu_embedding_lookup``, at any batch size): ``output_shape``
    shapes the activations when it fits the batch (as in training); otherwise a pooled ragged batch of ``B``
    samples reads it as ``[B, sequence length]`` when its size is a multiple ``B * k`` of ``B`` (looked up as
    a sequence of length ``k``, truncated or zero padded, shaped ``output_shape + (dim,)``) and is refused
    when it is not; dense, sparse and sequence features ignore it (activations as without ``output_shape``).
    """
    dim = feature.table.dim
    samples = batch.samples_shape
    wanted = feature.output_shape or None
    if batch.kind == "dense" and len(samples) > 1 and not serving and wanted != samples:
        raise InputError(f"dense ids of feature '{name}' must have rank 1 ([B]) or 2 ([B, k]); ids of rank 3 or "
                         f"more ([d1, ..., dn, k]) need the feature's output_shape to be their leading shape "
                         f"(d1, ..., dn); got shape {tuple(np.shape(batch.given_ids))} with output_shape "
                         f"{feature.output_shape}")
    seq_len = feature.max_sequence_length
    if seq_len and len(samples) > 1:
        warnings.warn(f"feature '{name}': max_sequence_length {seq_len} is ignored for ids of rank "
                      f"{len(samples) + 1}, whose last dimension is combined (as TensorFlow's TPU embedding does)",
                      stacklevel=4)
        seq_len = 0
    natural = samples + ((seq_len,) if seq_len else ())
    n = math.prod(natural)
    if wanted is None:
        return seq_len, n, natural + (dim,)
    size = math.prod(wanted)
    if size == n:
        return seq_len, n, wanted + (dim,)
    if not serving:
        raise InputError(f"feature '{name}': output_shape {feature.output_shape} holds {size} activation rows, "
                         f"the batch gives {n}")
    b = batch.batch_size
    if batch.kind == "ragged" and not seq_len and b:
        if size % b:
            raise InputError(f"feature '{name}': output_shape {feature.output_shape} ({size} activation rows) is "
                             f"neither the batch size {b} nor a multiple of it, so it cannot shape a ragged batch "
                             f"(served as [batch, sequence length])")
        return size // b, size, wanted + (dim,)
    return seq_len, n, natural + (dim,)


class TrainingEngine(TableLookup):
    """What the training engines (:class:`~embedcore.Embedding`, ``ShardedEmbedding``) add to lookups: slots,
    the default optimizer, and state changes (``apply_gradients``, ``save``, ``load``) one at a time.

    Subclasses set ``_lock`` (a ``threading.Lock``), ``_optimizer`` and ``_busy`` (why a second caller is
    refused)."""

    _busy = "another thread is using this engine's state"

    @property
    def slot_variables(self) -> dict:
        """Table name -> {slot name: the slot's rows this engine holds, ``[rows, dim]`` or ``[rows]``, in the
        table's ``slot_dtype``}; for a dynamic table, :class:`~embedcore.tables.dynamic.DynamicTableView` s (the
        slots' values by key)."""
        return {name: table.slot_rows(name) for table in self._physical for name in table.table_names}

    @property
    def optimizer(self):
        """The optimizer of every table that does not set its own (as passed; may be None)."""
        return self._optimizer

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Hold the engine's lock for ``what``; a second thread gets a ``RuntimeError`` instead of waiting."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"cannot {what}: {self._busy}")
        try:
            yield
        finally:
            self._lock.release()
