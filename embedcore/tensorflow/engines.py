"""Drop-ins for TensorFlow's TPU embedding classes, running on an :class:`embedcore.Embedding`.

A program written for ``tf.tpu.experimental.embedding`` runs by swapping one class:

* :class:`TPUEmbeddingV2` (``tpu_embedding_v3.py``): ``embedding_lookup(features, weights=None)`` (also
  ``__call__``) -> ``(activations, preserved_outputs)``; ``apply_gradients(gradients, preserved_outputs)``.
* :class:`TPUEmbedding` (the v2 API, ``tpu_embedding_v2.py``): ``enqueue(features, weights=None,
  training=True)``, ``dequeue()``, ``apply_gradients(gradients)``.
* :class:`TPUEmbeddingForServing` (``tpu_embedding_for_serving.py``): ``embedding_lookup(features,
  weights=None)`` (also ``__call__``) -> activations, TensorFlow's CPU serving lookup.

They take TensorFlow's own config objects (``TableConfig``, ``FeatureConfig``, the optimizers; converted by
:mod:`embedcore.tensorflow.convert`) or embedcore's, and features as ``tf.Tensor`` / ``tf.RaggedTensor`` /
``tf.SparseTensor`` nests like the feature config; activations are float32 ``tf.Tensor`` s with static
shapes; gradients come from ``tf.GradientTape``. Everything works eagerly and inside ``tf.function`` (through
:mod:`embedcore.tensorflow.graph`: one stateful op per lookup and per update; see there for ordering,
retracing and errors). No ``TPUStrategy`` is needed (or looked at): under any strategy these classes train
on the host.

Behaviour kept from TensorFlow: the error classes and messages its engines raise for structure (``TypeError``
/ ``ValueError`` of ``tf.nest.assert_same_structure``), input types and ranks, weights of the wrong kind,
gradients that are not tensors or of the wrong shape (``ValueError``), and the order of calls
(``RuntimeError``). Differences: ``apply_gradients`` with ``None`` for a feature applies no update to it
(TensorFlow sends a zero gradient, which differs for optimizers that decay); the tables are not
``tf.Variable`` s (see ``embedding_tables``); ``TPUEmbedding``'s queue holds one batch (a second ``enqueue``
before its ``dequeue`` raises ``RuntimeError``), and ``enqueue`` / ``dequeue`` / ``apply_gradients`` of one
step must be called in the same ``tf.function`` (or all eagerly), as TensorFlow's examples do; a dense id
tensor for a sequence feature is refused (``ValueError``, as TensorFlow's serving lookup refuses it: give the
sequence as ragged or sparse ids). A ``tf.function`` that looks up cannot be exported with
``tf.saved_model.save`` and loaded elsewhere (``tf.numpy_function`` runs Python, which a SavedModel does not
carry): serve from Python.

Checkpoints: the three classes are TensorFlow trackables laid out as TensorFlow's ``TPUEmbedding`` and
``TPUEmbeddingForServing`` track their variables (per table ``<table>``, per slot ``<table>/<slot>``, and
``_variables``; :func:`embedcore.tensorflow.checkpoint.engine_trackable`), so TensorFlow's documented
``tf.train.Checkpoint(embedding=embedding, model=model)`` with ``save`` / ``write`` / ``restore`` / ``read``
runs as written, and checkpoints move both ways between these classes and TensorFlow's. Saving writes the
engine's rows as they are then (float32); restoring sets them through ``engine.set_state`` once every table
and slot has arrived, all checked first (a wrong shape or NaN/Inf raises
:class:`~embedcore.CheckpointError` naming the table and slot, and nothing changes; a checkpoint holding
only some, such as a serving checkpoint's tables, is set before the next lookup or update; 16-bit tables of
embedcore configs are written as float32 and take TensorFlow's values rounded to nearest). Checkpointing
builds the engine: a restore before ``build()`` (TensorFlow's deferred restoration) builds it and restores
into it (for ``TPUEmbedding`` as ``build()`` without shapes would: call ``build(per_replica_input_shapes)``
before restoring to fix the output shapes). ``TPUEmbeddingV2``
writes the per-table layout too (TensorFlow's SparseCore stacked checkpoints are read with
:func:`embedcore.tensorflow.checkpoint.load_tf_checkpoint`).

Dynamic tables: an embedcore :class:`~embedcore.DynamicTableConfig` in the feature config works as any
embedcore table in lookups and updates: its ids are 64-bit keys, any ``tf.int64`` (negative values too: the
bit pattern is the key) or ``tf.uint64`` value, dense, ragged or sparse. ``embedding_tables`` and
``variables`` give such a table (and its slots) as a live :class:`~embedcore.tables.dynamic.DynamicTableView`
(rows by key) instead of a tensor snapshot, and TensorFlow checkpoints of an engine holding one are refused
(:class:`~embedcore.CheckpointError` naming the tables: TensorFlow's layout is one dense variable a table);
checkpoint it with ``engine.save(path)``. A training lookup (``enqueue(..., training=True)``, ``TPUEmbeddingV0``'s
``embedding_lookup``) counts keys for admission, gives admitted keys rows at their initial values and may
evict; ``enqueue(..., training=False)`` and ``TPUEmbeddingForServing`` are read-only lookups
(``Embedding.lookup(..., training=False)``): no table changes, held keys read their rows, any other key its
initial value.

``embedding_tables``: each table as a ``tf.Tensor`` snapshot: a copy of the rows, in the table's dtype,
taken when the property is read (TensorFlow returns ``tf.Variable`` s; embedcore's rows live in NumPy and are
updated in place, which a ``tf.Tensor`` -- immutable to TensorFlow, and aliased only when 64-byte aligned --
must not see). Read it again after training for the new values; it costs one copy of every table. Zero-copy
NumPy views are ``engine.embedding_tables`` (``engine``: the :class:`embedcore.Embedding` underneath); to
write rows, use ``engine.set_state``.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.util import nest

from tensorflow.python.trackable import base as trackable

import embedcore as ec
from embedcore.tables.dynamic import DynamicTableView

from . import checkpoint, convert, graph

__all__ = ["TPUEmbeddingV2", "TPUEmbedding", "TPUEmbeddingForServing"]

# Autograph never converts TensorFlow's own engines; these branch on Python structure only (see graph.py).
_not_converted = tf.autograph.experimental.do_not_convert


def _convert(feature_config, optimizer):
    """``(embedcore features nest, [(given table, embedcore table)], embedcore optimizer or None)``."""
    converted = convert.features(feature_config)
    return converted.features, list(converted.tables), convert.optimizer(optimizer)


def _table_tensor(array):
    """A snapshot of a table's (or slot's) rows as a ``tf.Tensor`` of the same dtype (a copy); a dynamic
    table's :class:`~embedcore.tables.dynamic.DynamicTableView` as it is (its rows are read by key)."""
    if isinstance(array, DynamicTableView):
        return array
    return tf.constant(array)


def _physical_rows(table):
    """``(rows, {slot: rows})`` of a physical table: its arrays, or a dynamic table's views."""
    if getattr(table, "dynamic", False):
        (name,) = table.table_names
        return table.table_rows(name), table.slot_rows(name)
    names = list(table.optimizer.slot_names) if table.optimizer is not None else []
    return table.weights, dict(zip(names, table.slots))


class _Front(trackable.Trackable):
    """What the three classes share: configs, the engine (built lazily), tables, structure checks, and the
    checkpoint layout (TensorFlow's; see the module docstring)."""

    _what = "TPUEmbedding"
    _keep_dense_last_dim = False

    def __init__(self, feature_config, optimizer):
        self._feature_config = feature_config
        self._optimizer_given = optimizer
        self._ec_features, self._table_pairs, self._ec_optimizer = _convert(feature_config, optimizer)
        self._paths = graph.feature_paths(feature_config)
        self._engine = None
        self._built = False
        self._layout = None

    # -- building ----------------------------------------------------------------------------------------
    def _engine_features(self):
        return self._ec_features

    def build(self):
        """Create the tables (and slots): an :class:`embedcore.Embedding` of the converted configs."""
        if self._built:
            return
        with tf.init_scope():  # may be called while tracing: the tables are made once, eagerly
            self._engine = ec.Embedding(self._engine_features(), self._ec_optimizer)
        self._built = True

    def _maybe_build(self):
        if not self._built:
            self.build()
        self._flush_restored()

    # -- checkpoints (TensorFlow's layout) ---------------------------------------------------------------
    def _checkpoint_layout(self):
        """The live layout of the engine's tables and slots, under the engine's table names (TensorFlow's:
        :mod:`convert` names unnamed tables as TensorFlow does)."""
        if self._layout is None:
            if not self._built:
                self.build()
            emb = self._engine
            dynamic = sorted(name for name, t in emb.tables.items() if isinstance(t, ec.DynamicTableConfig))
            if dynamic:
                raise ec.CheckpointError(
                    f"{type(self).__name__}: tables {dynamic} are dynamic: a TensorFlow checkpoint holds one dense "
                    f"variable a table, and a dynamic table is keys, rows, slots and its policies' counters; "
                    f"checkpoint the engine with {type(self).__name__}.engine.save(path) instead")
            names = {name: name for name in emb.tables}
            slots = {name: list(emb.slot_variables[name]) for name in names}
            # 16-bit tables (embedcore configs) take TensorFlow's float32 values rounded to nearest
            self._layout = checkpoint.engine_trackable(lambda: self._engine, names, slots, type(self).__name__,
                                                       convert_dtypes=True)
        return self._layout

    def _flush_restored(self):
        """Set the values of a restore that held only some of the tables and slots (before the next use)."""
        if self._layout is not None:
            self._layout.flush()

    def _trackable_children(self, save_type=trackable.SaveType.CHECKPOINT, **kwargs):
        return self._checkpoint_layout()._trackable_children(save_type, **kwargs)

    def _lookup_dependency(self, name, cached_dependencies=None):
        return self._checkpoint_layout()._lookup_dependency(name)

    @property
    def engine(self) -> ec.Embedding:
        """The :class:`embedcore.Embedding` holding the tables (built on first use)."""
        self._maybe_build()
        return self._engine

    @property
    def embedding_tables(self) -> dict:
        """``{TableConfig as given: tf.Tensor}``: a snapshot of each table's rows (see the module docstring)."""
        self._maybe_build()
        rows = self._engine.embedding_tables
        return {given: _table_tensor(rows[ec_table.name]) for given, ec_table in self._table_pairs}

    @property
    def variables(self) -> dict:
        """``{TableConfig as given: {"parameters": rows, slot name: slot rows}}``, snapshots."""
        self._maybe_build()
        rows, slots = self._engine.embedding_tables, self._engine.slot_variables
        return {given: {"parameters": _table_tensor(rows[t.name]),
                        **{slot: _table_tensor(v) for slot, v in slots.get(t.name, {}).items()}}
                for given, t in self._table_pairs}

    def __repr__(self):
        state = repr(self._engine) if self._built else "not built"
        return f"{type(self).__name__}({len(self._paths)} features; {state})"

    # -- checks (TensorFlow's errors) --------------------------------------------------------------------
    def _check_structure(self, value):
        nest.assert_same_structure(self._feature_config, value)

    def _check_gradients(self, gradients, shapes):
        """TensorFlow's checks of ``gradients`` against the activations' static ``shapes``."""
        self._check_structure(gradients)
        for (path, _), gradient, shape in zip(self._paths, nest.flatten(gradients), shapes):
            if gradient is None:
                continue
            if isinstance(gradient, tf.IndexedSlices):
                continue
            if not isinstance(gradient, tf.Tensor):
                raise ValueError(f"found non-tensor type: {type(gradient)} at path {path}.")
            if not gradient.shape.is_compatible_with(shape):
                raise ValueError(f"Found gradient of shape {gradient.shape} at path {path}. Expected shape "
                                 f"{shape}.")

    def _ec_nest(self, flat):
        return tf.nest.pack_sequence_as(self._ec_features, flat)

    def _lookup(self, features, weights, training, name=None):
        """``(activations mirroring the given config, handle, static shapes)``."""
        acts, handle = graph.lookup(self._engine, self._ec_nest(nest.flatten(features)),
                                    None if weights is None else self._ec_nest(nest.flatten(weights)),
                                    training=training, keep_dense_last_dim=self._keep_dense_last_dim, name=name)
        flat = tf.nest.flatten(acts)
        return nest.pack_sequence_as(self._feature_config, flat), handle, [a.shape for a in flat]

    def _apply(self, gradients, handle, name=None):
        return graph.apply_gradients(self._engine, self._ec_nest(nest.flatten(gradients)), handle, name=name)


def _leaf_types(paths, flat_ids, flat_weights, dense_weights: str):
    """TensorFlow's checks of each feature's input type and its weights' type (flat lists in ``paths``
    order; ``flat_weights`` may be None).

    ``dense_weights``: ``"refuse"`` (the v2 API), ``"tensor"`` (v3: dense weights must be tensors) or
    ``"serving"`` (TensorFlow's serving lookup's messages)."""
    flat_weights = [None] * len(paths) if flat_weights is None else flat_weights
    for (path, feature), inp, w in zip(paths, flat_ids, flat_weights):
        if isinstance(inp, (tf.SparseTensor, tf.RaggedTensor)):
            kind = type(inp)
            if w is not None and not isinstance(w, kind):
                if dense_weights == "serving":
                    raise ValueError(f"Weight for {path} is of type {type(w)} but it does not match type of the "
                                     f"input which is {type(inp)}.")
                if dense_weights == "tensor":
                    raise ValueError(f"Expect weight to be {kind.__name__} type but got {type(w)}")
                raise ValueError(f"Weight for {path} is type {type(w)} which does not match type input which is "
                                 f"{kind.__name__}.")
        elif isinstance(inp, (tf.Tensor, np.ndarray)):
            if dense_weights == "serving" and _max_sequence_length(feature) > 0:
                raise ValueError(f"Feature {path} is a sequence feature but a dense tensor was passed.")
            if w is not None:
                if dense_weights == "refuse":
                    raise ValueError(f"Weight specified for dense input {path}, which is not allowed. Weight will "
                                     f"always be 1 in this case.")
                if dense_weights == "serving":
                    raise ValueError(f"Weight specified for {path}, but input is dense.")
                if not isinstance(w, (tf.Tensor, np.ndarray)):
                    raise ValueError(f"Expect weight to be Tensor type but got {type(w)}")
        else:
            raise ValueError(f"Input {path} is of unknown type {type(inp)}. Please only pass Tensor, SparseTensor or "
                             f"RaggedTensor as input.")
        if dense_weights == "serving" and w is not None and _max_sequence_length(feature) > 0:
            raise ValueError(f"Weight specified for {path}, but this is a sequence feature.")


def _max_sequence_length(feature) -> int:
    return int(getattr(feature, "max_sequence_length", 0) or 0)


def _output_shape(feature):
    shape = getattr(feature, "output_shape", None)
    return tf.TensorShape(list(shape)) if shape else None


# ----------------------------------------------------------------------------------------------------------

class TPUEmbeddingV2(_Front):
    """``tf.tpu.experimental.embedding.TPUEmbeddingV2`` on embedcore.

    ``embedding_lookup(features, weights=None)`` (and ``__call__``) returns ``(activations,
    preserved_outputs)``; pass ``preserved_outputs`` back to ``apply_gradients(gradients,
    preserved_outputs)``, which updates the tables the lookup read with each table's fused optimizer (once per
    lookup; ``None`` for a feature: no update for it). ``embedding_tables`` is keyed as TensorFlow keys it,
    by stacked table name: the names of the tables stacked into one physical table (equal optimizer, ``dim``
    and storage; embedcore's stacking rule) joined with ``"_"``, each a snapshot of the stacked rows in
    embedcore's order (features' first-seen order). ``embedding_table_shards`` is not provided (no devices);
    ``pipeline_execution_with_tensor_core`` and ``sparse_core_embedding_config`` change nothing here.
    """

    _what = "TPUEmbeddingV2"

    def __init__(self, feature_config, optimizer=None, pipeline_execution_with_tensor_core: bool = False,
                 sparse_core_embedding_config=None):
        super().__init__(feature_config, optimizer)
        self._pipelining = pipeline_execution_with_tensor_core
        self._last_shapes = [tf.TensorShape(None)] * len(self._paths)

    @property
    def embedding_tables(self) -> dict:
        """``{stacked table name: tf.Tensor}`` (see the class docstring)."""
        self._maybe_build()
        return {"_".join(t.table_names): _table_tensor(_physical_rows(t)[0]) for t in self._engine.physical_tables}

    @property
    def variables(self) -> dict:
        """``{stacked table name: {"parameters": rows, slot name: slot rows}}``, snapshots."""
        self._maybe_build()
        out = {}
        for t in self._engine.physical_tables:
            rows, slots = _physical_rows(t)
            out["_".join(t.table_names)] = {"parameters": _table_tensor(rows),
                                            **{n: _table_tensor(s) for n, s in slots.items()}}
        return out

    @_not_converted
    def __call__(self, features, weights=None):
        """Call the mid level api to do embedding lookup (see :meth:`embedding_lookup`)."""
        return self.embedding_lookup(features, weights)

    @_not_converted
    def embedding_lookup(self, features, weights=None):
        """Look ``features`` (and ``weights``) up; returns ``(activations, preserved_outputs)``.

        Raises:
            TypeError / ValueError: ``features`` or ``weights`` do not have the feature config's structure.
            ValueError: an input of another type than Tensor, SparseTensor or RaggedTensor, weights of another
                kind than their input.
            embedcore.InputError: bad values (ids out of range, ...), eagerly; inside a graph, in a
                ``tf.errors.OpError`` when it runs.
        """
        self._maybe_build()
        self._check_structure(features)
        if weights is not None:
            self._check_structure(weights)
        _leaf_types(self._paths, nest.flatten(features), None if weights is None else nest.flatten(weights),
                    "tensor")
        activations, handle, shapes = self._lookup(features, weights, training=True)
        self._last_shapes = shapes
        return activations, {"embedcore_lookup": handle}

    @_not_converted
    def apply_gradients(self, gradients, preserved_outputs):
        """Apply ``gradients`` (mirroring the feature config; ``None`` entries update nothing) to the lookup
        that returned ``preserved_outputs``.

        Raises:
            RuntimeError: not built.
            TypeError / ValueError: ``gradients`` do not have the feature config's structure.
            ValueError: a gradient that is not a tensor, or of another shape than its activations, or
                ``preserved_outputs`` that no ``embedding_lookup`` of this object returned.
        """
        if not self._built:
            raise RuntimeError("apply_gradients called on unbuilt TPUEmbeddingV2 object. Please either call the "
                               "embedding lookup method first or manually call the build method.")
        if not isinstance(preserved_outputs, dict) or "embedcore_lookup" not in preserved_outputs:
            raise ValueError(f"preserved_outputs must be the second output of this object's embedding_lookup, got "
                             f"{type(preserved_outputs).__name__}")
        # Statically, against the shapes of the latest lookup (TensorFlow checks its configured output shapes);
        # when the update runs, against the shapes of the very lookup it applies to.
        self._check_gradients(gradients, self._last_shapes)
        self._flush_restored()
        return self._apply(gradients, preserved_outputs["embedcore_lookup"])


# ----------------------------------------------------------------------------------------------------------

class _StepState:
    """``TPUEmbedding``'s queue in one graph (or eagerly): the batch enqueued, then the batch dequeued."""

    def __init__(self):
        self.enqueued = None   # (activations, handle, shapes, training)
        self.dequeued = None   # (handle, shapes, training, applied)


class TPUEmbedding(_Front):
    """``tf.tpu.experimental.embedding.TPUEmbedding`` (the v2 API) on embedcore.

    ``enqueue(features, weights=None, training=True)`` looks the batch up, ``dequeue()`` returns its
    activations, ``apply_gradients(gradients)`` updates the tables with the gradients of the activations
    last dequeued (once; ``None`` for a feature: no update for it). Under any strategy (TensorFlow needs a
    ``TPUStrategy`` for these three; here none is needed). ``embedding_tables`` is keyed by the
    ``TableConfig`` objects given.

    Order of calls, per graph (a ``tf.function``, or the body of a ``tf.range`` loop in one; or eagerly):
    ``enqueue`` -> ``dequeue`` -> ``apply_gradients``, all three in the same graph; a
    second ``enqueue`` before ``dequeue``, a ``dequeue`` without ``enqueue``, an ``apply_gradients`` without a
    dequeued batch (or twice for one batch, or for a batch enqueued with ``training=False``) raise
    ``RuntimeError``.

    Output shapes follow TensorFlow's rules: ``FeatureConfig.output_shape`` first, then the shapes given to
    :meth:`build`, then those detected from the first enqueued batch; a later batch of another shape raises
    ``ValueError``.
    """

    def __init__(self, feature_config, optimizer, pipeline_execution_with_tensor_core: bool = False):
        super().__init__(feature_config, optimizer)
        self._pipelining = pipeline_execution_with_tensor_core
        self._output_shapes = [_output_shape(f) for _, f in self._paths]
        self._states = weakref.WeakKeyDictionary()
        self._eager_state = _StepState()

    def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
        """Create the tables and slots; record output shapes from ``per_replica_input_shapes`` (a nest like
        the feature config, or an int batch size) or ``per_replica_batch_size``.

        Raises:
            ValueError: the shapes disagree with the feature config's output shapes, or are of rank < 1.
        """
        if self._built:
            return
        incoming = None
        if per_replica_batch_size is not None and per_replica_input_shapes is None:
            per_replica_input_shapes = int(per_replica_batch_size)
        if isinstance(per_replica_input_shapes, int):
            incoming = [tf.TensorShape([per_replica_input_shapes, _max_sequence_length(f)])
                        if not _output_shape(f) and _max_sequence_length(f) > 0
                        else tf.TensorShape([per_replica_input_shapes]) for _, f in self._paths]
        elif per_replica_input_shapes is not None:
            nest.assert_same_structure(nest.flatten(per_replica_input_shapes), nest.flatten(self._feature_config))
            incoming = self._outputs_from_inputs([tf.TensorShape(s) for s in nest.flatten(per_replica_input_shapes)])
        if incoming is not None:
            self._check_output_shapes(incoming)
            self._update_output_shapes(incoming)
        super().build()

    # -- output shapes (TensorFlow's rules) -------------------------------------------------------------
    def _outputs_from_inputs(self, input_shapes):
        out = []
        for shape, (_, feature) in zip(input_shapes, self._paths):
            if shape.rank is None or shape.rank < 1:
                raise ValueError(f"Received input tensor of shape {shape}. Rank must be 1 and above")
            if len(shape) == 2 and shape[-1] != 1 and not _output_shape(feature) and \
                    _max_sequence_length(feature) > 0:
                dims = shape.as_list()
                shape = tf.TensorShape(dims[:-1] + [_max_sequence_length(feature), dims[-1]])
            out.append(shape if shape.rank == 1 else shape[:-1])
        return out

    def _input_shapes(self, features):
        shapes = []
        for (path, feature), inp in zip(self._paths, nest.flatten(features)):
            if isinstance(inp, tf.SparseTensor):
                dims = inp.shape.as_list()
                if len(dims) < 2:
                    raise ValueError(f"Only rank 2 and above sparse tensor is supported, find rank {len(dims)} "
                                     f"sparse tensor for input {path}")
                if not _output_shape(feature) and _max_sequence_length(feature) > 0 and len(dims) == 2:
                    dims.insert(len(dims) - 1, _max_sequence_length(feature))
            elif isinstance(inp, tf.RaggedTensor):
                dims = inp.shape.as_list()
                if len(dims) != 2:
                    raise ValueError(f"Only rank 2 ragged tensor is supported, find rank {len(dims)} ragged tensor "
                                     f"for input {path}")
                if not _output_shape(feature) and _max_sequence_length(feature) > 0:
                    dims.insert(len(dims) - 1, _max_sequence_length(feature))
            else:
                dims = tf.convert_to_tensor(inp).shape.as_list()
                if len(dims) < 1:
                    raise ValueError(f"Only rank 1 and above dense tensor is supported, find rank {len(dims)} "
                                     f"sparse tensor for input {path}")
                if len(dims) > 1 and dims[-1] != 1:
                    raise ValueError(f"Rank 2 or above dense tensor should have last dimension as 1 as the last "
                                     f"dimension will always be reduced. Instead got dense tensor as shape {dims}")
            shapes.append(tf.TensorShape(dims))
        return shapes

    def _check_output_shapes(self, incoming):
        for (path, _), old, new in zip(self._paths, self._output_shapes, incoming):
            if old and new:
                if len(new) in (1, 2) and len(old) > len(new):
                    continue
                if len(old) != len(new) or not old.is_compatible_with(new):
                    raise ValueError(f"Inconsistent shape founded for input feature {path}, Output shape is set to be "
                                     f"{old}, But got incoming output shape {new}")

    def _update_output_shapes(self, incoming):
        self._output_shapes = [old if old else new for old, new in zip(self._output_shapes, incoming)]

    # -- the step ----------------------------------------------------------------------------------------
    def _state(self) -> _StepState:
        if tf.executing_eagerly():
            return self._eager_state
        g = tf.compat.v1.get_default_graph()
        state = self._states.get(g)
        if state is None:
            state = self._states[g] = _StepState()
        return state

    @_not_converted
    def enqueue(self, features, weights=None, training: bool = True, name=None, device=None):
        """Look up ``features`` (and ``weights``: ragged/sparse only, mirroring the ids) for the next
        :meth:`dequeue`. ``device`` is accepted and ignored (there is one host).

        Raises:
            TypeError / ValueError: structure unlike the feature config; ValueError: input types, ranks,
                weights for dense inputs, output shapes unlike earlier ones.
            RuntimeError: a batch is already enqueued and not dequeued.
        """
        del device
        self._check_structure(features)
        if weights is not None:
            self._check_structure(weights)
        _leaf_types(self._paths, nest.flatten(features), None if weights is None else nest.flatten(weights),
                    "refuse")
        incoming = self._outputs_from_inputs(self._input_shapes(features))
        if not self._built:
            self._check_output_shapes(incoming)
            self._update_output_shapes(incoming)
            self.build()
        else:
            self._check_output_shapes(incoming)
        self._flush_restored()
        state = self._state()
        if state.enqueued is not None:
            raise RuntimeError("enqueue called twice without a dequeue in between: this TPUEmbedding holds one "
                               "enqueued batch at a time; call dequeue() first")
        activations, handle, shapes = self._lookup(features, weights, bool(training), name=name)
        state.enqueued = (activations, handle, shapes, bool(training))

    @_not_converted
    def dequeue(self, name=None):
        """The activations of the batch last enqueued, a nest like the feature config.

        Raises:
            RuntimeError: not built, or no batch enqueued since the last dequeue.
        """
        del name
        if not self._built:
            raise RuntimeError("dequeue called on unbuilt TPUEmbedding object. Please either call enqueue first or "
                               "manually call the build method.")
        state = self._state()
        if state.enqueued is None:
            raise RuntimeError("dequeue called without a batch enqueued: call enqueue(features) first (in the same "
                               "tf.function)")
        activations, handle, shapes, training = state.enqueued
        state.enqueued = None
        state.dequeued = [handle, shapes, training, False]
        return activations

    @_not_converted
    def apply_gradients(self, gradients, name=None):
        """Update the tables with ``gradients`` of the activations last dequeued (``None`` entries: no update
        for that feature).

        Raises:
            RuntimeError: not built; no batch dequeued; the batch was enqueued with ``training=False``; its
                gradients were applied already.
            TypeError / ValueError: structure unlike the feature config; ValueError: a gradient that is not a
                tensor, or of another shape than its activations.
        """
        if not self._built:
            raise RuntimeError("apply_gradients called on unbuilt TPUEmbedding object. Please either call enqueue "
                               "first or manually call the build method.")
        state = self._state()
        if state.dequeued is None:
            raise RuntimeError("apply_gradients called without a dequeued batch: call enqueue(...) and dequeue() "
                               "first (in the same tf.function)")
        handle, shapes, training, applied = state.dequeued
        if not training:
            raise RuntimeError("apply_gradients called for a batch enqueued with training=False: enqueue it with "
                               "training=True to update the tables")
        if applied:
            raise RuntimeError("apply_gradients called twice for one dequeued batch: its gradients were applied "
                               "already")
        self._check_gradients(gradients, shapes)
        self._flush_restored()
        state.dequeued[3] = True
        return self._apply(gradients, handle, name=name)


# ----------------------------------------------------------------------------------------------------------

class TPUEmbeddingForServing(_Front):
    """``tf.tpu.experimental.embedding.TPUEmbeddingForServing`` on embedcore: TensorFlow's CPU serving lookup.

    ``embedding_lookup(features, weights=None)`` (and ``__call__``) returns activations mirroring
    ``features`` (all of the feature config's features, or some) at any batch size, shaped as TensorFlow's
    ``serving_embedding_lookup`` shapes them:

    * a dense id tensor of shape ``S``: ``S + [dim]`` (one row per id, ``tf.nn.embedding_lookup``);
    * a rank-2 sparse or ragged tensor: ``[B, dim]``, combined with the table's combiner
      (``[B, max_sequence_length, dim]`` for a sequence feature with no ``output_shape``);
    * a sparse tensor of higher rank: ``S[:-1] + [dim]``;
    * a ragged tensor with an ``output_shape`` of ``B`` rows: combined and reshaped to it; of ``L x B`` rows:
      a sequence of ``L`` ids a sample (not combined, zero padded, truncated), reshaped to it.

    A feature's training ``output_shape`` is otherwise not used (and where it is set, ``max_sequence_length``
    is not). As TensorFlow's ``safe_embedding_lookup_sparse`` (its path for sparse inputs unless
    ``validate_weights_and_indices=False`` at rank 2, or a rank-2 sequence feature), sparse entries with
    negative ids are dropped, and so are entries of weight <= 0 for the ``mean`` and ``sqrtn`` combiners. The
    optimizer may be ``None`` (no slots). A dynamic table's negative ids are keys, never dropped.
    ``embedding_tables`` is keyed by the given ``TableConfig`` s.
    """

    _what = "TPUEmbeddingForServing"
    _keep_dense_last_dim = True

    def __init__(self, feature_config, optimizer, experimental_sparsecore_restore_info=None):
        del experimental_sparsecore_restore_info
        super().__init__(feature_config, optimizer)

    def _engine_features(self):
        # Serving shapes activations from the batch (above), so the engine looks up without output shapes.
        # A sequence feature with an output_shape is no sequence to TensorFlow's serving lookup.
        plain = [f if f.output_shape is None else
                 ec.FeatureConfig(f.table, 0, f.validate_weights_and_indices, None, f.name)
                 for f in tf.nest.flatten(self._ec_features)]
        self._ec_features = tf.nest.pack_sequence_as(self._ec_features, plain)
        return self._ec_features

    @_not_converted
    def __call__(self, features, weights=None):
        return self.embedding_lookup(features, weights)

    @_not_converted
    def embedding_lookup(self, features, weights=None):
        """Apply the serving lookup (see the class docstring) to ``features``: a nest of some or all of the
        feature config's features (matched by path, as TensorFlow's ``serving_embedding_lookup`` matches
        them); the activations mirror ``features``. ``weights``, if not None, mirrors ``features`` (entries
        may be None).

        Raises:
            ValueError: ``features`` holds a path the feature config lacks, or ``weights`` another structure;
                TensorFlow's serving errors (weights for a dense input or of another kind than the input or
                for a sequence feature, a dense input for a sequence feature, an unknown input type, a ragged
                tensor of rank other than 2, an ``output_shape`` that does not fit a ragged batch).
        """
        self._maybe_build()
        given = nest.flatten_with_joined_string_paths(features)
        config = dict(self._paths)
        keys = {path for path, _ in given}
        if not keys.issubset(config):
            raise ValueError(f"Inputs are not a subset of feature_config. Inputs keys are {keys}, but feature_config "
                             f"keys are {config.keys()}")
        given_w = [None] * len(given)
        if weights is not None:
            nest.assert_same_structure(features, weights)
            given_w = nest.flatten(weights)
        by_path = {path: (inp, w) for (path, inp), w in zip(given, given_w)}
        # A feature the caller left out is looked up as an empty batch (no rows read) and its output dropped.
        flat_ids = [by_path[path][0] if path in by_path else _empty_batch() for path, _ in self._paths]
        flat_w = [by_path[path][1] if path in by_path else None for path, _ in self._paths]
        _leaf_types(self._paths, flat_ids, flat_w, "serving")
        shapers = []
        for k, ((path, feature), inp, w) in enumerate(zip(self._paths, flat_ids, flat_w)):
            if isinstance(inp, tf.SparseTensor):
                flat_ids[k], flat_w[k] = _serving_prune(inp, w, feature)
            shaper = None
            if isinstance(inp, tf.RaggedTensor) and _output_shape(feature) and path in by_path:
                shaper = _RaggedOutputShape(inp, feature, path)
                if shaper.sequence:  # every id its own row, then padded or truncated per sample
                    flat_ids[k] = tf.RaggedTensor.from_row_splits(
                        inp.values, tf.range(tf.size(inp.values, out_type=inp.row_splits.dtype) + 1))
                    flat_w[k] = None
            shapers.append(shaper)
        any_weights = any(w is not None for w in flat_w)
        activations, _, _ = self._lookup(nest.pack_sequence_as(self._feature_config, flat_ids),
                                         nest.pack_sequence_as(self._feature_config, flat_w) if any_weights else None,
                                         training=False)
        flat = nest.flatten(activations)
        flat = [a if shaper is None else shaper(a) for a, shaper in zip(flat, shapers)]
        out = dict(zip([path for path, _ in self._paths], flat))
        return nest.pack_sequence_as(features, [out[path] for path, _ in given])


class _RaggedOutputShape:
    """TensorFlow's serving rule for a rank-2 ragged batch of ``B`` samples and an ``output_shape`` of ``R``
    rows: ``R == B``: the combined rows reshaped to ``output_shape``; ``R`` a multiple of ``B``: a sequence
    of ``R / B`` ids a sample (weights and combiner ignored; padded with zeros, truncated), reshaped; else
    ``ValueError``."""

    def __init__(self, ragged, feature, path):
        self.target = [int(d) for d in feature.output_shape]
        rows = int(np.prod(self.target))
        batch = ragged.shape[0]
        if batch is None:
            raise ValueError(f"Feature {path} sets output_shape {self.target}: serving its ragged input needs the "
                             f"batch size in the input's static shape")
        self.sequence = rows != batch
        if self.sequence and (rows < batch or rows % batch):
            raise ValueError(f"Output shape set in the FeatureConfig should be the factor of the input data batch "
                             f"size. But instead got output shape {self.target}, input data batch size {batch}")
        self.batch, self.length, self.row_splits = batch, rows // batch, ragged.row_splits

    def __call__(self, activations):
        dim = activations.shape[-1]
        if self.sequence:
            per_sample = tf.RaggedTensor.from_row_splits(activations, self.row_splits)
            activations = per_sample.to_tensor(shape=[self.batch, self.length, dim])
        return tf.reshape(activations, self.target + [dim])


def _empty_batch():
    """A batch of no samples, standing in for a feature the serving caller did not pass."""
    return tf.RaggedTensor.from_row_splits(tf.zeros([0], tf.int64), tf.zeros([1], tf.int64))


def _serving_prune(ids: tf.SparseTensor, weights, feature):
    """TensorFlow's serving lookup of sparse ids drops ids < 0 and, unless the combiner is ``sum``, entries
    whose weight is <= 0 (``safe_embedding_lookup_sparse``), except where it takes another path: a rank-2
    sequence feature without ``output_shape``, or ``validate_weights_and_indices=False`` at rank <= 2."""
    rank = ids.shape.rank
    if not _output_shape(feature) and _max_sequence_length(feature) > 0 and rank in (None, 2):
        return ids, weights
    if not feature.validate_weights_and_indices and rank is not None and rank <= 2:
        return ids, weights
    # A dynamic table's negative ids are keys like any other (their bit patterns), not invalid rows.
    keep = tf.ones_like(ids.values, tf.bool) if isinstance(feature.table, ec.DynamicTableConfig) else ids.values >= 0
    if weights is not None and feature.table.combiner != "sum":
        keep = tf.logical_and(keep, weights.values > 0)
    ids = tf.sparse.retain(ids, keep)
    return ids, None if weights is None else tf.sparse.retain(weights, keep)
