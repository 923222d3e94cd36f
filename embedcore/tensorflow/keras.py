"""A Keras layer holding an embedcore engine: ``model.fit`` trains the tables with their fused sparse optimizers.

Keras 3 with the TensorFlow backend (what ``tf.keras`` is in TensorFlow 2.21). The layer follows keras-rs's
``DistributedEmbedding`` (whose name it also answers to): built from a nest of feature configs, called as
``layer(inputs, weights=None, training=None)``, returning activations mirroring ``inputs``.

How it trains, step by step (the optimizer runs in the layer's gradient, as the PyTorch adapter runs it in
``backward``):

* ``acts = layer(features, weights, training=True)`` looks the batch up through :func:`.graph.lookup` (the
  engine called directly when eager, one stateful ``tf.numpy_function`` inside ``tf.function``) and returns
  float32 ``tf.Tensor`` activations shaped as :func:`.graph.activation_shape` says: ``[B, dim]`` for ``[B]``
  ids, ragged ``[B, None]`` or sparse ``[B, k]`` bags; ``[B, L, dim]`` for a sequence feature
  (``max_sequence_length = L``); ``output_shape + [dim]`` when the feature sets one.
* The activations are differentiable with respect to one variable of the layer, ``update_trigger``: a
  trainable Keras variable of shape ``[0]`` (no values, no parameters in ``model.summary()``), which puts
  the lookup on the tape. When the tape computes the gradient of a loss that depends on the activations
  (Keras's ``train_step`` does, once per batch), the layer's gradient function calls
  :func:`.graph.apply_gradients`, that is :meth:`embedcore.Embedding.apply_gradients` with
  ``d loss / d activations``: the rows the batch touched (and their slots) are updated in place by their
  tables' own optimizers and ``layer.embedding.step`` advances by one. The trigger's gradient is empty (the
  Keras optimizer has nothing to do for it) and is produced after the update. The tables are not Keras
  variables: the Keras optimizer of ``model.compile`` trains the dense model only.
* Training mode: ``training`` as given, or as Keras passes it down from an outer layer's ``call``; when
  neither (keras-rs's examples write ``call(self, features)``, and Keras's ``train_step`` then calls the model
  without ``training``), the lookup trains exactly when a gradient tape records the layer's
  ``update_trigger``: ``fit``'s step does, ``evaluate``'s and ``predict``'s do not. So the layer trains
  under ``fit`` however the outer ``call`` is written.
* Hence ``model.fit`` makes exactly one update per training batch (one per call of the layer in the model);
  ``model.evaluate`` and ``model.predict`` (``training=False``) only look up, and so does a layer made
  non-trainable (``layer.trainable = False``). A custom loop differentiates with respect to
  ``model.trainable_variables`` (which hold the trigger). Differentiating with respect to other variables
  only is not a way to skip the update: eagerly TensorFlow's tape runs every gradient function back from
  the loss, so the tables are updated all the same, and inside ``tf.function`` whether the update runs is
  up to TensorFlow's pruning. A lookup is applied at most once (a second gradient of a persistent tape
  raises). A training lookup whose gradient never runs updates nothing, and is never taken for training:
  the layer's next call raises :class:`~.graph.GradientNeverCameError` (a ``RuntimeError``; inside
  ``tf.function`` carried by a ``tf.errors.OpError``) naming the layer, before it reads or changes anything,
  once the lookup is known lost (eagerly: its activations dropped without a gradient; in a graph: a later
  lookup of the layer was applied, or :data:`.graph.MAX_PENDING` newer ones were made). An output the loss
  does not use, of a lookup whose other outputs it does use, counts as a zero gradient.
* Errors: eagerly (``run_eagerly=True``, or a direct call outside ``tf.function``) a bad batch raises the
  engine's :class:`embedcore.InputError` naming the feature; inside ``tf.function`` (``model.fit``'s
  default) the same message arrives in a ``tf.errors.OpError``, as TensorFlow reports Python errors raised
  in a ``tf.numpy_function``; structure and type errors (missing features, float ids, ragged tensors of
  rank 3) are raised while tracing (``TypeError``/``ValueError`` naming the feature). Either way tables,
  slots and ``step`` are unchanged.
* XLA cannot compile the lookup: the layer sets ``supports_jit = False``, so ``compile(jit_compile="auto")``
  (the default) resolves to no XLA; ``jit_compile=True`` is not supported.

Inputs, per feature, as :mod:`.tensors` reads them: a dense integer ``tf.Tensor`` (or NumPy array), a
``tf.RaggedTensor`` ``[B, None]`` or a ``tf.SparseTensor``; dense ids follow TensorFlow's engines (each id its
own activation row: use ragged or sparse ids for bags, or ``output_shape``). Weights, when given, mirror the
ids (same class, same row splits or indices); ``None`` for a feature means no weights.

Configs: :class:`embedcore.FeatureConfig` nests with embedcore optimizers, or TensorFlow's own
``tf.tpu.experimental.embedding`` configs and optimizers (converted by :mod:`embedcore.tensorflow.convert`).

Saving: ``model.save_weights(path)`` (``.weights.h5``) and ``model.load_weights(path)`` store and restore the
layer's tables, slots and ``step`` beside the dense weights (:meth:`EmbeddingLayer.save_own_variables`), and so
does ``tf.train.Checkpoint(model=model)`` (``write``/``read``/``save``/``restore``; the tables are copied into
tensors while it writes). Loading checks every table and slot (shape, dtype, finite) before anything changes.
Dynamic tables (:class:`embedcore.DynamicTableConfig`) train as any other (ids: 64-bit keys, any ``tf.int64`` or
``tf.uint64`` value); their state (keys, rows, slots, the policies' counters) has no fixed-shape weight, so
``save_weights`` and ``tf.train.Checkpoint`` of a layer holding one are refused (``ValueError`` naming the tables)
in favour of ``layer.embedding.save(path)``, and ``get_embedding_tables`` gives such a table as its live
:class:`~embedcore.tables.dynamic.DynamicTableView` (rows by key). A training call counts a dynamic table's keys
for admission, gives admitted keys rows at their initial values and may evict; a call with ``training=False``
(``model.evaluate``, ``model.predict``) or of a layer with ``trainable=False`` is a read-only lookup
(``Embedding.lookup(..., training=False)``): no table changes, held keys read their rows, any other key its
initial value.
A whole-model ``model.save("model.keras")`` would also need the layer's configuration as JSON, which feature
configs and optimizers with Python callables do not have: ``get_config`` refuses it, naming the way out
(rebuild the model in code and ``load_weights``). For large tables use the engine's own atomic, checksummed
checkpoints, ``layer.embedding.save(path)`` / ``layer.embedding.load(path)``.
"""

from __future__ import annotations

import numpy as np

try:
    import keras
    import tensorflow as tf
    from tensorflow.python.eager import record as _record  # which tapes record a tensor: no public API
except ImportError as exc:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError("embedcore.tensorflow needs TensorFlow, an optional extra of embedcore: install it with "
                      "`pip install embedcore[tensorflow]` (or `pip install tensorflow-cpu==2.21.0`)") from exc

from .. import inputs as ec_inputs
from ..config import DynamicTableConfig, FeatureConfig
from ..engine import Embedding
from ..optimizers import Optimizer
from ..tables.dynamic import DynamicTableView
from . import graph, tensors

__all__ = ["EmbeddingLayer", "DistributedEmbedding"]

_TABLE_STACKING = ("auto", None)


# -- configs -------------------------------------------------------------------------------------------------

def _embedcore_configs(feature_configs, optimizer):
    """``feature_configs`` and ``optimizer`` as embedcore's: passed through when they are already, else
    converted from keras-rs's configs (:mod:`.keras_rs_configs`) and TensorFlow's
    ``tf.tpu.experimental.embedding`` classes (:mod:`.convert`)."""
    leaves = ec_inputs.flatten(feature_configs)
    if not leaves:
        raise ValueError("feature_configs holds no feature config")
    if any(type(f).__module__.split(".")[0] == "keras_rs" for _, f in leaves):
        from . import keras_rs_configs  # keras-rs's configs: recognised without importing keras-rs
        feature_configs = keras_rs_configs.to_tensorflow(feature_configs)
        leaves = ec_inputs.flatten(feature_configs)
    if not all(isinstance(f, FeatureConfig) for _, f in leaves):
        from . import convert  # TensorFlow's configs: imported only when they are given
        feature_configs = convert.features(feature_configs).features
    if optimizer is not None and not isinstance(optimizer, Optimizer):
        from . import convert
        optimizer = convert.optimizer(optimizer)
    return feature_configs, optimizer


# -- the layer -------------------------------------------------------------------------------------------------

class EmbeddingLayer(keras.layers.Layer):
    """Embedding tables of an :class:`embedcore.Embedding` as a Keras layer (see the module docstring).

    Args:
        feature_configs: a nest (dicts, lists, tuples) of :class:`embedcore.FeatureConfig`, or of TensorFlow's
            ``tf.tpu.experimental.embedding.FeatureConfig``; inputs and outputs mirror it. Ignored (pass None)
            when ``embedding`` is given.
        optimizer: the optimizer of every table that does not set its own: an embedcore optimizer or
            TensorFlow's (``tf.tpu.experimental.embedding.Adagrad``, ...). Not the Keras optimizer of
            ``model.compile``, which trains the dense model.
        table_stacking: ``"auto"`` (keras-rs's default) stacks tables with equal optimizers and ``dim`` into
            one physical table, ``None`` keeps one per table; results are identical.
        seed: seed of the tables' initial values.
        embedding: an existing :class:`embedcore.Embedding` to hold instead of building one.
        **kwargs: Keras layer arguments (``name``, ...).

    Attributes:
        embedding: the engine (its ``step`` counts the updates; ``save``/``load`` checkpoint it).
        update_trigger: the empty trainable variable whose gradient applies the update.
    """

    def __init__(self, feature_configs=None, optimizer=None, *, table_stacking="auto", seed=0, embedding=None,
                 **kwargs):
        super().__init__(**kwargs)
        if embedding is not None:
            if not isinstance(embedding, Embedding):
                raise TypeError(f"embedding must be an embedcore.Embedding, got {type(embedding).__name__}")
            if embedding.output_dtype != "float32":
                raise ValueError(f"embedding returns {embedding.output_dtype} activations (output_dtype), and the "
                                 f"layer gives Keras float32 ones; build the Embedding with output_dtype='float32'")
            if feature_configs is not None or optimizer is not None:
                raise ValueError("pass either embedding or feature_configs (and optimizer), not both")
        else:
            if table_stacking not in _TABLE_STACKING:
                raise ValueError(f"table_stacking must be 'auto' or None, got {table_stacking!r}")
            features, optimizer = _embedcore_configs(feature_configs, optimizer)
            embedding = Embedding(features, optimizer, seed=seed, stack_tables=table_stacking == "auto")
        self._engine = embedding
        self.supports_jit = False  # a tf.numpy_function: XLA cannot compile the lookup
        self._owner = graph.Owner(f"embedcore layer '{self.name}'")
        self.update_trigger = self.add_weight(name="update_trigger", shape=(0,), initializer="zeros",
                                              trainable=True)
        self.built = True

    @property
    def embedding(self) -> Embedding:
        return self._engine

    def get_embedding_tables(self) -> dict:
        """Table name -> a copy of its ``[vocabulary_size, dim]`` rows as NumPy (keras-rs's accessor; the
        engine's own arrays are ``layer.embedding.embedding_tables``)."""
        return {name: rows if isinstance(rows, DynamicTableView) else np.array(rows)
                for name, rows in self._engine.embedding_tables.items()}

    # -- call ----------------------------------------------------------------------------------------------
    def call(self, inputs, weights=None, training=None):
        """Activations of ``inputs`` (and ``weights``), nests mirroring the feature configs; in training mode
        (and when the layer is trainable) the gradient with respect to ``update_trigger`` applies the update.

        ``training``: True or False as given (or as Keras passes it down from an outer layer's call); when
        None (neither given nor inherited: an outer ``call(self, features)`` that does not take or forward
        ``training``), training mode is on exactly when a gradient tape is recording the layer's
        ``update_trigger``, as Keras's ``train_step`` does and ``test_step``/``predict_step`` do not.
        A training lookup whose gradient never comes makes the layer's next call raise
        :class:`~.graph.GradientNeverCameError` (see the module docstring).
        """
        engine = self._engine
        trigger = tf.convert_to_tensor(self.update_trigger)  # under a tape, a recorded read of the trigger
        if training is None:
            training = _tape_records(trigger)
        if not (training and self.trainable):
            activations, _ = graph.lookup(engine, inputs, weights, training=False, owner=self._owner)
            return activations

        @tf.custom_gradient
        def looked_up(trigger):
            activations, handle = graph.lookup(engine, inputs, weights, training=True, owner=self._owner)
            flat = tf.nest.flatten(activations)

            def gradient(*grads):  # an output the loss does not use: a zero gradient, as PyTorch's adapter
                grads = [tf.zeros_like(a) if g is None else g for g, a in zip(grads, flat)]
                step = graph.apply_gradients(engine, tf.nest.pack_sequence_as(engine.feature_config, grads),
                                             handle)
                # The trigger's empty gradient is computed from the update's result (a data dependency: a
                # control dependency alone does not keep the update in every Keras optimizer's graph).
                return tf.zeros((0,), tf.float32) * tf.cast(step, tf.float32)

            return flat, gradient

        flat = looked_up(trigger)
        return tf.nest.pack_sequence_as(engine.feature_config, list(flat))

    def compute_output_spec(self, inputs, weights=None, training=None):
        """Symbolic outputs for Keras's functional API: float32, shaped as :meth:`call` returns them."""
        config = self._engine.feature_config
        specs = []
        for (path, feature), x in zip(graph.feature_paths(config), tf.nest.flatten(inputs)):
            kind = (tensors.SPARSE if getattr(x, "sparse", False) else
                    tensors.RAGGED if getattr(x, "ragged", False) else tensors.DENSE)
            shape = graph.activation_shape(feature, tensors.Leaf(kind, tuple(x.shape), ()))
            specs.append(keras.KerasTensor(shape.as_list() if shape.rank is not None else None, dtype="float32"))
        return tf.nest.pack_sequence_as(config, specs)

    # -- saving ----------------------------------------------------------------------------------------------
    def get_config(self):
        """Not available: the feature configs and optimizers (with their Python callables) have no JSON form,
        so ``model.save("model.keras")`` is refused with this explanation."""
        raise NotImplementedError(f"layer '{self.name}' (embedcore EmbeddingLayer) has no Keras config: its feature "
                                  f"configs and optimizers are Python objects. Rebuild the model in code and use "
                                  f"model.save_weights(path) / model.load_weights(path), which carry the tables, "
                                  f"or checkpoint the engine with layer.embedding.save(path)")

    def _state_entries(self):
        """``(key, rows)`` of the engine's state: ``step``, ``table:<table>``, ``slot:<table>:<slot>``."""
        engine = self._engine
        dynamic = sorted(name for name, t in engine.tables.items() if isinstance(t, DynamicTableConfig))
        if dynamic:
            raise ValueError(f"layer '{self.name}': tables {dynamic} are dynamic: their state (keys, rows, slots, the "
                             f"policies' counters) is no fixed-shape weight that Keras weights files or TensorFlow "
                             f"checkpoints hold; checkpoint the engine with layer.embedding.save(path) and "
                             f"layer.embedding.load(path) instead")
        yield "step", np.array(engine.step, np.int64)
        for name, rows in engine.embedding_tables.items():
            yield f"table:{name}", rows
        for name, slots in engine.slot_variables.items():
            for slot, rows in slots.items():
                yield f"slot:{name}:{slot}", rows

    def _set_state_from(self, read, where: str) -> None:
        """Tables, slots and ``step`` from ``read(key, like)`` (None for a missing key), through
        :meth:`embedcore.Embedding.set_state`: everything is checked first (a missing entry, a wrong shape or
        dtype, a NaN/Inf), and on a problem nothing changes."""
        engine = self._engine
        next(self._state_entries())  # refuses dynamic tables before anything is read

        def entry(key, like):
            value = read(key, like)
            if value is None:
                raise ValueError(f"layer '{self.name}': {where} has no '{key}' (saved from another embedding "
                                 f"layer, or before its tables were saved); nothing was loaded")
            return value

        tables = {name: entry(f"table:{name}", rows) for name, rows in engine.embedding_tables.items()}
        slots = {name: {slot: entry(f"slot:{name}:{slot}", rows) for slot, rows in table_slots.items()}
                 for name, table_slots in engine.slot_variables.items()}
        step = int(np.asarray(entry("step", None)))
        engine.set_state(tables=tables, slots=slots, step=step)

    def save_own_variables(self, store):
        """Keras weights saving (``model.save_weights``): the trigger as Keras stores it (``"0"``), then the
        engine's state (:meth:`_state_entries`; bfloat16 rows as their uint16 bits, which HDF5 can hold)."""
        super().save_own_variables(store)
        for key, rows in self._state_entries():
            store[key] = _storable(rows)

    def load_own_variables(self, store):
        """Keras weights loading (``model.load_weights``): the engine's state, all checked before any of it
        is set."""
        keys = set(store.keys())
        self._set_state_from(lambda key, like: _restored(store[key], like) if key in keys else None,
                             "the weights file")

    # TensorFlow's checkpoints: ``tf.train.Checkpoint(model=model)`` saves and restores the engine's state
    # with the layer (as copies of the rows: a table is held twice while it is written).
    def _serialize_to_tensors(self):
        return {key: tf.constant(np.array(rows)) for key, rows in self._state_entries()}

    def _restore_from_tensors(self, restored_tensors):
        self._set_state_from(lambda key, like: (restored_tensors[key].numpy() if key in restored_tensors
                                                else None), "the checkpoint")
        return tf.no_op()


def _tape_records(tensor) -> bool:
    """Whether a gradient tape (eager, or traced inside the current ``tf.function``) records ``tensor``."""
    return bool(_record.should_record_backprop([tensor]))


def _storable(rows) -> np.ndarray:
    array = np.asarray(rows)
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else np.array(array)


def _restored(value, like) -> np.ndarray:
    array = np.asarray(value)
    if like is not None and np.asarray(like).dtype.name == "bfloat16" and array.dtype == np.uint16:
        return array.view(np.asarray(like).dtype)
    return array


DistributedEmbedding = EmbeddingLayer  # keras-rs's name for such a layer
