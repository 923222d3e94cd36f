"""Table and feature configuration, mirroring ``tf.tpu.experimental.embedding``.

A :class:`TableConfig` describes one embedding table (rows, width, initializer, optimizer, combiner); a
:class:`FeatureConfig` describes one input feature that looks up rows of a table. Validation follows
TensorFlow's rules, so code written against ``tf.tpu.experimental.embedding`` ports by changing imports.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["TableConfig", "DynamicTableConfig", "FeatureConfig", "COMBINERS"]

COMBINERS = ("mean", "sum", "sqrtn")

MAX_SEQUENCE_LENGTH = 2 ** 31 - 1  # an activation row is an int32 (kernels/occurrences.py)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


DTYPES = ("float32", "float16", "bfloat16")


class TableConfig:
    """One embedding table: ``vocabulary_size`` rows of ``dim`` values, stored as float32 or in 16 bits.

    Args:
        vocabulary_size: number of rows, an int >= 1.
        dim: embedding width, an int >= 1. Whether the table fits in memory is checked by the engine that
            allocates it, not here.
        initializer: a callable ``(shape, dtype) -> array`` or an :mod:`embedcore.initializers` object;
            ``None`` means ``TruncatedNormal(mean=0, stddev=1/sqrt(dim))``.
        optimizer: an optimizer for this table; overrides the one given to :class:`~embedcore.Embedding`.
        combiner: how the rows of one sample are reduced: ``"mean"`` (sum of w_i x_i / sum of w_i),
            ``"sum"`` or ``"sqrtn"`` (sum of w_i x_i / sqrt(sum of w_i^2)).
        name: unique name of the table; unnamed tables are named ``table_<k>`` by the engine.
        weights_dtype: how the rows are stored: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (2 bytes a
            value: ``np.float16``, ``ml_dtypes.bfloat16``). Optimizers and lookups compute in float32 either
            way; each new value is rounded to the table's dtype when stored.
        slot_dtype: how the optimizer's slots (accumulators, moments) are stored; the same choices.
        stochastic_rounding: round to a 16-bit dtype stochastically (unbiased: up with probability equal to
            the distance from the value below, in units of the gap; the random bits are a function of the
            seed, table, row, column and step), else to nearest (ties to even). Initial values are always
            rounded to nearest.
    """

    def __init__(self, vocabulary_size, dim, initializer=None, optimizer=None, combiner="mean", name=None, *,
                 weights_dtype="float32", slot_dtype="float32", stochastic_rounding=True):
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"Argument `name` must be a non-empty string or None. Received: {name!r:.80}")
        kind = type(self).__name__
        table = f"{kind} '{name}'" if name else kind
        if not _is_int(vocabulary_size) or vocabulary_size < 1:
            raise ValueError(f"{table}: Argument `vocabulary_size` must be an int and must be >= 1. Received: "
                             f"{vocabulary_size!r:.80}")
        if not _is_int(dim) or dim < 1:
            raise ValueError(f"{table}: Argument `dim` (embedding dimension) must be an int and must be >= 1. "
                             f"Received: {dim!r:.80}")
        if initializer is not None and not callable(initializer):
            raise ValueError(
                f"{table}: Argument `initializer` must be a callable (or None). Received: {initializer!r:.80}")
        if combiner not in COMBINERS:
            raise ValueError(f"{table}: Argument `combiner` must be one of {list(COMBINERS)}. Received: "
                             f"{combiner!r:.80}")
        if optimizer is not None:
            from .optimizers import Optimizer
            if not isinstance(optimizer, Optimizer):
                raise ValueError(
                    f"{table}: Argument `optimizer` must be an embedcore optimizer (SGD, Adagrad, ..., CustomOptimizer) "
                    f"or None. Received: {optimizer!r}")
        for argument, value in (("weights_dtype", weights_dtype), ("slot_dtype", slot_dtype)):
            if not isinstance(value, str) or value not in DTYPES:
                raise ValueError(f"{table}: Argument `{argument}` must be one of {list(DTYPES)}. Received: "
                                 f"{value!r:.80}")
        if not isinstance(stochastic_rounding, bool):
            raise ValueError(f"{table}: Argument `stochastic_rounding` must be a boolean. Received: "
                             f"{stochastic_rounding!r:.80}")
        self.vocabulary_size = int(vocabulary_size)
        self.dim = int(dim)
        self.initializer = initializer
        self.optimizer = optimizer
        self.combiner = combiner
        self.name = name
        self.weights_dtype = weights_dtype
        self.slot_dtype = slot_dtype
        self.stochastic_rounding = stochastic_rounding

    @property
    def stored_formats(self):
        """The table's :class:`~embedcore.kernels.half.StoredFormats` (rows, slots, rounding)."""
        from .kernels.half import StoredFormats
        return StoredFormats(self.weights_dtype, self.slot_dtype, self.stochastic_rounding)

    def _stored_repr(self) -> str:
        return "" if (self.weights_dtype, self.slot_dtype) == ("float32", "float32") else (
            f", weights_dtype={self.weights_dtype!r}, slot_dtype={self.slot_dtype!r}, "
            f"stochastic_rounding={self.stochastic_rounding!r}")

    def __repr__(self):
        return (f"TableConfig(vocabulary_size={self.vocabulary_size!r}, dim={self.dim!r}, "
                f"initializer={self.initializer!r}, optimizer={self.optimizer!r}, "
                f"combiner={self.combiner!r}, name={self.name!r}{self._stored_repr()})")


class DynamicTableConfig(TableConfig):
    """A dynamic (hash-keyed) table: up to ``capacity`` rows of ``dim`` values, one per 64-bit key seen.

    A feature of a dynamic table gives keys, not row ids: any int64 or uint64 value (all ``2**64`` bit
    patterns; the int64 and uint64 views of the same bits are the same key; strings through
    :func:`embedcore.hash_keys`), never range-checked. A key's row appears when the key is admitted and
    disappears when it is evicted; see :mod:`embedcore.tables.dynamic` for the lookup's rules.

    Args:
        dim: embedding width, an int >= 1.
        capacity: the most keys (rows) the table holds, an int in ``1 .. 2**31 - 1``. ``vocabulary_size``
            equals it (the row slots, for code that sizes tables).
        name, optimizer, combiner, weights_dtype, slot_dtype, stochastic_rounding: as for
            :class:`TableConfig`. The optimizer must be lazy (only touched rows change).
        initializer: an :mod:`embedcore.initializers` object (or None: ``TruncatedNormal(0, 1/sqrt(dim))``).
            A key's initial value depends only on the seed, the table and the key
            (:meth:`~embedcore.initializers.Initializer.fill_keys`); a plain callable ``(shape, dtype)``,
            which makes a whole table of row ids, has no meaning for keys and is refused.
        admission: None (admit every new key at once) or :class:`~embedcore.tables.policies.CountAdmission`.
        eviction: None (never evict: a batch with more admitted new keys than free rows is refused) or an
            :class:`~embedcore.tables.policies.EvictionPolicy`: ``LRU()``, ``LFU()``, ``TTL(steps)``,
            ``EvictByScore(fn, reserve=0.01)`` (which scores float32 rows: ``weights_dtype="float32"`` only).
    """

    def __init__(self, dim, capacity, name=None, optimizer=None, initializer=None, combiner="mean", admission=None,
                 eviction=None, *, weights_dtype="float32", slot_dtype="float32", stochastic_rounding=True):
        from .initializers import Initializer
        from .kernels.hash_map import MAX_CAPACITY
        from .tables.policies import CountAdmission, EvictByScore, EvictionPolicy
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"Argument `name` must be a non-empty string or None. Received: {name!r:.80}")
        table = f"DynamicTableConfig '{name}'" if name else "DynamicTableConfig"
        if not _is_int(capacity) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"{table}: Argument `capacity` must be an int in 1 .. {MAX_CAPACITY}. Received: "
                             f"{capacity!r:.80}")
        if initializer is not None and not isinstance(initializer, Initializer):
            raise ValueError(f"{table}: Argument `initializer` must be an embedcore initializer (Constant, Zeros, "
                             f"TruncatedNormal, RandomUniform, RowId, or an Initializer subclass) or None: a dynamic "
                             f"table's initial values are functions of the key, not of a row id. Received: "
                             f"{initializer!r:.80}")
        if admission is not None and not isinstance(admission, CountAdmission):
            raise ValueError(f"{table}: Argument `admission` must be an embedcore.CountAdmission or None. Received: "
                             f"{admission!r:.80}")
        if eviction is not None and not isinstance(eviction, EvictionPolicy):
            raise ValueError(f"{table}: Argument `eviction` must be an eviction policy (embedcore.LRU(), LFU(), "
                             f"TTL(steps), EvictByScore(fn)) or None. Received: {eviction!r:.80}")
        super().__init__(int(capacity), dim, initializer, optimizer, combiner, name, weights_dtype=weights_dtype,
                         slot_dtype=slot_dtype, stochastic_rounding=stochastic_rounding)
        if isinstance(eviction, EvictByScore) and weights_dtype != "float32":
            raise ValueError(f"{table}: {eviction!r} scores float32 rows; weights_dtype {weights_dtype!r} is not "
                             f"supported with it")
        if optimizer is not None and not optimizer.lazy:
            raise ValueError(f"{table}: the optimizer {type(optimizer).__name__} is not lazy (it would update every "
                             f"row each step, free row slots included); a dynamic table updates only the rows a "
                             f"batch touches (e.g. Adam(lazy_adam=True))")
        self.capacity = int(capacity)
        self.admission = admission
        self.eviction = eviction

    def __repr__(self):
        return (f"DynamicTableConfig(dim={self.dim!r}, capacity={self.capacity!r}, name={self.name!r}, "
                f"optimizer={self.optimizer!r}, initializer={self.initializer!r}, combiner={self.combiner!r}, "
                f"admission={self.admission!r}, eviction={self.eviction!r}{self._stored_repr()})")


class FeatureConfig:
    """One input feature, looking up rows of ``table``.

    Args:
        table: the :class:`TableConfig` (or :class:`DynamicTableConfig`) this feature reads; several features
            may share one table.
        max_sequence_length: 0 for a pooled feature (activations ``[B, dim]``, ids of a sample combined with
            the table's combiner); ``L > 0`` for a sequence feature (activations ``[B, L, dim]``, one row per
            position, truncated to ``L`` and zero padded; each row scaled by its weight, never combined).
        validate_weights_and_indices: check ids against the vocabulary and weights against the ids.
        output_shape: leading shape of the activations (the embedding width is appended); its size must
            equal the number of activation rows (``B``, or ``B * L`` for a sequence feature). Ids of higher
            rank, ``[d1, ..., dn, k]`` (an ``ec.Sparse`` of that ``dense_shape``, or a dense array, which in
            training needs ``output_shape = (d1, ..., dn)``), combine their last dimension into
            ``[d1, ..., dn, dim]``, as TensorFlow's engines do. ``()`` means unset. Serving applies it only
            when it fits the batch (see :class:`~embedcore.ServingEmbedding`).
        name: a name used in error messages; defaults to the feature's path in the feature structure.
    """

    def __init__(self, table, max_sequence_length=0, validate_weights_and_indices=True, output_shape=None,
                 name=None):
        if not isinstance(table, TableConfig):
            raise ValueError(f"Argument `table` has invalid type {type(table)}. TableConfig expected.")
        if not _is_int(max_sequence_length) or not 0 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"Argument `max_sequence_length` must be an int and must be >= 0 (and at most 2**31 - 1). "
                f"Received: {max_sequence_length!r:.80}")
        if not isinstance(validate_weights_and_indices, bool):
            raise ValueError(
                f"Argument `validate_weights_and_indices` must be a boolean. Received: "
                f"{validate_weights_and_indices!r}")
        if output_shape is not None:
            if isinstance(output_shape, (str, bytes)) or not hasattr(output_shape, "__iter__"):
                raise ValueError(
                    f"Argument `output_shape` must be a sequence of ints or None. Received: {output_shape!r}")
            given, output_shape = output_shape, tuple(output_shape)  # an iterator is read once
            if not all(_is_int(d) for d in output_shape):
                raise ValueError(f"Argument `output_shape` must be a sequence of ints or None. Received: {given!r}")
            output_shape = tuple(int(d) for d in output_shape)
            if any(d < 1 for d in output_shape):
                raise ValueError(f"Argument `output_shape` must hold positive ints. Received: {output_shape!r}")
            if math.prod(output_shape) >= 2 ** 48:
                raise ValueError(f"Argument `output_shape` {output_shape} describes {math.prod(output_shape)} "
                                 f"activation rows, more than any batch can hold")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"Argument `name` must be a string or None. Received: {name!r}")
        self.table = table
        self.max_sequence_length = int(max_sequence_length)
        self.validate_weights_and_indices = validate_weights_and_indices
        self.output_shape = output_shape
        self.name = name

    def __repr__(self):
        return (f"FeatureConfig(table={self.table.name or '<unnamed table>'!r}, "
                f"max_sequence_length={self.max_sequence_length!r}, "
                f"validate_weights_and_indices={self.validate_weights_and_indices!r}, "
                f"output_shape={self.output_shape!r}, name={self.name!r})")
