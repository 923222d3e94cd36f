"""Run an embedcore engine's lookup and update from TensorFlow, eagerly and inside ``tf.function``.

Two operations, each one ``tf.numpy_function`` in a graph (a plain Python call when eager):

* :func:`lookup` ``(engine, features, weights=None, training=True) -> (activations, handle)``: the engine's
  lookup; ``activations`` mirror ``engine.feature_config`` as float32 ``tf.Tensor`` s whose static shapes
  follow from the feature config and the batch's static shape (:func:`activation_shape`), so the dense
  model's layers build inside a ``tf.function``; ``handle`` is an int64 scalar tensor naming the lookup's
  :class:`~embedcore.LookupContext` in a registry (0 for ``training=False``: nothing to update; a training
  engine's lookup is then read-only, ``Embedding.lookup(..., training=False)``: dynamic tables unchanged).
* :func:`apply_gradients` ``(engine, gradients, handle) -> step``: the engine's fused update with the
  activations' gradients (a nest like the activations; ``None`` for a feature = no update for it), for the
  lookup named by ``handle``; returns the engine's step after it, an int64 scalar tensor.

Semantics.

* One update per lookup: a handle is applied at most once; a second apply, or the apply of a handle that
  was released, raises. Updates happen in the order the apply ops run, each against the tables as they are
  then (the lookups themselves read the tables of their moment).
* Ordering: the apply op reads the handle, which the lookup op produces, so it runs after its lookup. Both
  ops are stateful: inside ``tf.function`` TensorFlow runs every stateful op, and runs those that touch no
  resource in program order among themselves (automatic control dependencies), so an update is never
  pruned from a function that returns nothing from it, and a lookup written after an update in the same
  function sees the updated tables. They are *not* ordered against variable reads and assigns, so the
  update op does not read learning rates itself: callable learning rates and hyperparameters given as
  TensorFlow values (:class:`~.convert.TensorCallable`) are evaluated in the graph where the update is
  built, as TensorFlow's engines evaluate them, and feed the op; a ``tf.Variable`` they read is read after
  an ``assign`` written before the update and before one written after it.
* Release: a context is released (its workspaces go back to the engine) when it is applied; when an eager
  handle tensor is garbage-collected unapplied; and, since the lifetime of a handle made inside a graph is
  invisible to Python, whenever an engine holds more than :data:`MAX_PENDING` unapplied contexts (eager or
  not): the oldest is released and its apply refused. Lookups with ``training=False`` register nothing.
* Lost gradients: a lookup made with an :class:`Owner` (the Keras layer passes itself) whose context was
  released unapplied, or skipped while a later one was applied, makes the owner's next lookup raise
  :class:`GradientNeverCameError` naming it: a lookup whose gradient never came is never taken for training.
* Retracing: tracing runs no lookup and no update (``tf.numpy_function`` calls Python only when the graph
  runs); each trace makes new ops over the same engine, each run of them a new handle. Nothing is cached per
  trace, so retracing for a new batch shape changes no state.
* Autograph: :func:`lookup` and :func:`apply_gradients` are not converted (``do_not_convert``), as
  TensorFlow's own engines are not: they branch on Python structure only, and converted code would route
  every call the ops make, each step, through autograph (0.37 ms of CPU a step on the TBE shape).
* Errors: eagerly, the engine's own exceptions (:class:`embedcore.InputError`, a ``ValueError``, naming the
  feature). Inside a graph, TensorFlow wraps a Python exception raised in ``tf.numpy_function`` in a
  ``tf.errors.OpError`` (``InvalidArgumentError`` or ``UnknownError``) whose message holds the engine's;
  either way nothing was changed. Check what can be checked statically (structure, types, shapes) before
  building the ops, as :mod:`embedcore.tensorflow.engines` does.

Dense ids follow TensorFlow's engines, not embedcore's ``[B, k]`` multi-hot form: every id of a dense tensor
of shape ``S`` is its own activation row, the activations are ``S + [dim]`` (``keep_dense_last_dim``, the
serving lookup's ``tf.nn.embedding_lookup``) or ``S[:-1] + [dim]`` for rank >= 2 (the TPU engines, which
reduce a last dimension of 1), unless the feature's ``output_shape`` is set.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from ..inputs import InputError
from ..lookup import LookupContext, TrainingEngine
from . import convert, tensors

__all__ = ["lookup", "apply_gradients", "activation_shape", "MAX_PENDING", "pending_count", "feature_paths",
           "Owner", "GradientNeverCameError"]

MAX_PENDING = 16  # unapplied training lookups an engine may hold before the oldest is released


# ----------------------------------------------------------------------------------------------------------
# The registry of pending lookups.

@dataclass
class _Pending:
    engine: weakref.ref
    ctx: LookupContext
    shapes: list          # the activations' shapes as TensorFlow saw them, one per feature (tf.nest order)
    engine_shapes: list   # the same activations as the engine returned them
    owner: "Owner | None" = None


class GradientNeverCameError(RuntimeError):
    """A training lookup of an :class:`Owner` was never applied: its gradient did not come."""


class Owner:
    """Who makes training lookups (a Keras layer), checked so that a lookup whose gradient never comes is
    never taken for training.

    A training lookup of an owner is *lost* when its context is released unapplied (an eager handle
    garbage-collected, or pushed out by :data:`MAX_PENDING` newer ones) or *skipped* when a later lookup of
    the same owner was applied while it was not (gradients of one step come before the next step's lookups,
    in any order among themselves). The next lookup of the owner (training or not) then raises
    :class:`GradientNeverCameError` naming the owner, before it reads or changes anything; skipped contexts
    are released. Counting stops there: the error is raised once per loss.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._pending = {}      # handle -> order of its lookup
        self._last_applied = 0  # order of the latest applied lookup
        self._lost = 0

    def _looked_up(self, handle: int) -> None:
        with self._lock:
            self._pending[handle] = next(self._seq)

    def _done(self, handle: int, applied: bool) -> None:
        with self._lock:
            order = self._pending.pop(handle, None)
            if order is None:
                return
            if applied:
                self._last_applied = max(self._last_applied, order)
            else:
                self._lost += 1

    def check(self) -> None:
        """Raise :class:`GradientNeverCameError` if a training lookup of this owner was lost or skipped."""
        with self._lock:
            skipped = [h for h, order in self._pending.items() if order < self._last_applied]
            for h in skipped:
                del self._pending[h]
            lost, self._lost = self._lost + len(skipped), 0
        for h in skipped:
            _REGISTRY.drop(h)
        if lost:
            raise GradientNeverCameError(
                f"{self.name}: {lost} training lookup(s) never received their gradient, so the tables were not "
                f"updated for them. A training lookup must be differentiated once (Keras's fit does it; in a custom "
                f"loop, tape.gradient of a loss that uses the activations, with respect to variables that include "
                f"the layer's update_trigger); look up with training=False where no gradient follows "
                f"(evaluation, inference). Nothing was changed by this call")


class _Registry:
    """Handle (an int > 0) -> pending lookup, in the order they were made; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries = OrderedDict()
        self._ids = itertools.count(1)

    def add(self, engine, entry: _Pending) -> int:
        with self._lock:
            handle = next(self._ids)
            self._entries[handle] = entry
            mine = [h for h, e in self._entries.items() if e.engine() is engine]
            dropped = [(h, self._entries.pop(h)) for h in mine[:max(len(mine) - MAX_PENDING, 0)]]
        for handle_dropped, old in dropped:
            old.ctx.release()
            if old.owner is not None:
                old.owner._done(handle_dropped, applied=False)
        if entry.owner is not None:
            entry.owner._looked_up(handle)
        return handle

    def get(self, handle: int, engine) -> _Pending:
        with self._lock:
            entry = self._entries.get(handle)
        if handle == 0:
            raise InputError("these activations were looked up with training=False: there is nothing to update "
                             "(nothing was updated)")
        if entry is None:
            raise InputError(f"lookup handle {handle} names no pending lookup: its gradients were applied already, "
                             f"or it was released (dropped, or more than {MAX_PENDING} newer lookups of this engine "
                             f"were left unapplied); look up again (nothing was updated)")
        if entry.engine() is not engine:
            raise InputError(f"lookup handle {handle} names a lookup of another engine (nothing was updated)")
        return entry

    def drop(self, handle: int, applied: bool = False) -> None:
        with self._lock:
            entry = self._entries.pop(handle, None)
        if entry is not None:
            entry.ctx.release()
            if entry.owner is not None:
                entry.owner._done(handle, applied)

    def count(self, engine) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.engine() is engine)


_REGISTRY = _Registry()


def pending_count(engine) -> int:
    """How many training lookups of ``engine`` hold a context that was neither applied nor released."""
    return _REGISTRY.count(engine)


# ----------------------------------------------------------------------------------------------------------
# Shapes.

def feature_paths(feature_config) -> list:
    """``[(path, feature), ...]`` in ``tf.nest`` order, paths joined with ``/`` as TensorFlow names them."""
    from tensorflow.python.util import nest
    return nest.flatten_with_joined_string_paths(feature_config)


_PATHS = weakref.WeakKeyDictionary()  # engine -> feature_paths(engine.feature_config): read once per engine


def _engine_paths(engine) -> list:
    paths = _PATHS.get(engine)
    if paths is None:
        paths = _PATHS[engine] = feature_paths(engine.feature_config)
    return paths


def activation_shape(feature, leaf: tensors.Leaf, keep_dense_last_dim: bool = False) -> tf.TensorShape:
    """The static shape of one feature's activations (``None`` where unknown) for a batch whose ids are
    ``leaf``: ``output_shape + [dim]`` when the feature sets one; dense ids ``S + [dim]`` or
    ``S[:-1] + [dim]`` (see the module docstring); ragged and rank-2 sparse ids ``[B, dim]``, or
    ``[B, max_sequence_length, dim]`` for a sequence feature; sparse ids of rank > 2 ``S[:-1] + [dim]``."""
    dim = feature.table.dim
    if feature.output_shape:
        return tf.TensorShape(list(feature.output_shape) + [dim])
    if leaf.shape is None:
        return tf.TensorShape(None)
    shape = list(leaf.shape)
    if leaf.kind == tensors.DENSE:
        rows = shape if keep_dense_last_dim or len(shape) <= 1 else shape[:-1]
        return tf.TensorShape(rows + [dim])
    if leaf.kind == tensors.SPARSE and len(shape) > 2:
        return tf.TensorShape(shape[:-1] + [dim])
    if feature.max_sequence_length:
        return tf.TensorShape([shape[0], feature.max_sequence_length, dim])
    return tf.TensorShape([shape[0], dim])


def _dense_rows(shape, keep_dense_last_dim):
    shape = list(shape)
    return shape if keep_dense_last_dim or len(shape) <= 1 else shape[:-1]


# ----------------------------------------------------------------------------------------------------------
# Lookup.

@tf.autograph.experimental.do_not_convert
def lookup(engine, features, weights=None, *, training: bool = True, keep_dense_last_dim: bool = False,
           name: str | None = None, owner: Owner | None = None):
    """The engine's lookup of ``features`` (and ``weights``), nests mirroring ``engine.feature_config`` (in
    ``tf.nest``'s sense) of ``tf.Tensor`` / ``tf.RaggedTensor`` / ``tf.SparseTensor`` / NumPy leaves.

    Returns ``(activations, handle)``: activations mirroring ``engine.feature_config`` (float32
    ``tf.Tensor`` s with static shapes, :func:`activation_shape`) and an int64 scalar ``tf.Tensor`` to pass
    to :func:`apply_gradients` (0 when ``training`` is False). Structure and type errors are raised while
    building (``TypeError``/``ValueError``); value errors (ids out of range, ...) when the lookup runs.
    With an ``owner``, the lookup first runs :meth:`Owner.check` (raising :class:`GradientNeverCameError` if
    an earlier training lookup of that owner never got its gradient) and a training lookup is counted as
    the owner's.
    """
    config = engine.feature_config
    paths = _engine_paths(engine)
    tf.nest.assert_same_structure(config, features)
    id_leaves = [tensors.leaf(x, path) for (path, _), x in zip(paths, tf.nest.flatten(features))]
    if weights is None:
        weight_leaves = [None] * len(paths)
    else:
        tf.nest.assert_same_structure(config, weights)
        weight_leaves = [None if w is None else tensors.leaf(w, path, "weights")
                         for (path, _), w in zip(paths, tf.nest.flatten(weights))]
    for (path, feature), ids in zip(paths, id_leaves):
        if ids.kind == tensors.DENSE and feature.max_sequence_length:
            raise ValueError(f"Feature {path} is a sequence feature but a dense tensor was passed.")
    static = [activation_shape(f, ids, keep_dense_last_dim) for (_, f), ids in zip(paths, id_leaves)]
    kinds = [(ids.kind, ids.n_parts, None if w is None else (w.kind, w.n_parts))
             for ids, w in zip(id_leaves, weight_leaves)]
    parts = [p for ids, w in zip(id_leaves, weight_leaves) for p in ids.parts + (w.parts if w is not None else ())]

    def run(*arrays):
        if owner is not None:
            owner.check()
        acts, handle = _lookup_arrays(engine, config, kinds, arrays, training, keep_dense_last_dim, owner)
        return acts + [np.asarray(handle, np.int64)]

    if tf.executing_eagerly():
        flat = run(*[tensors.to_numpy(p) for p in parts])
        activations = [tensors.to_tensor(a) for a in flat[:-1]]
        handle = tf.constant(flat[-1], tf.int64)
        if int(flat[-1]):
            weakref.finalize(handle, _REGISTRY.drop, int(flat[-1]))
    else:
        outputs = tf.numpy_function(run, parts, [tf.float32] * len(paths) + [tf.int64], stateful=True,
                                    name=name or "embedcore_lookup")
        activations, handle = list(outputs[:-1]), outputs[-1]
        for a, shape in zip(activations, static):
            a.set_shape(shape)
        handle.set_shape([])
    return tf.nest.pack_sequence_as(config, activations), handle


def _lookup_arrays(engine, config, kinds, arrays, training, keep_dense_last_dim, owner=None):
    """The lookup itself, over NumPy parts: returns (activations in tf.nest order, handle)."""
    it = iter(arrays)
    ids, weights, dense_rows = [], [], []
    for kind, n, weight_kind in kinds:
        value = tensors.compose(kind, [next(it) for _ in range(n)])
        w = None if weight_kind is None else tensors.compose(weight_kind[0], [next(it) for _ in range(weight_kind[1])])
        if kind == tensors.DENSE:
            dense_rows.append(_dense_rows(value.shape, keep_dense_last_dim))
            value = value.reshape(-1)
            if isinstance(w, np.ndarray):
                w = w.reshape(-1) if w.size == value.size else w
        else:
            dense_rows.append(None)
        ids.append(value)
        weights.append(w)
    any_weights = any(w is not None for w in weights)
    # training=False: a read-only lookup of a training engine (dynamic tables unchanged); serving engines
    # only read anyway
    read_only = {"training": False} if not training and isinstance(engine, TrainingEngine) else {}
    result = engine.lookup(tf.nest.pack_sequence_as(config, ids),
                           tf.nest.pack_sequence_as(config, weights) if any_weights else None, **read_only)
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], LookupContext):
        activations, ctx = result
    else:  # a lookup-only engine (ServingEmbedding)
        activations, ctx = result, None
    flat = tf.nest.flatten(activations)
    engine_shapes = [a.shape for a in flat]
    features = [f for _, f in _engine_paths(engine)]
    shaped = []
    for a, rows, feature in zip(flat, dense_rows, features):
        if rows is not None and not feature.output_shape:
            a = a.reshape(rows + [a.shape[-1]])
        shaped.append(a)
    if not training or ctx is None:
        if ctx is not None:
            ctx.release()
        return shaped, 0
    handle = _REGISTRY.add(engine, _Pending(weakref.ref(engine), ctx, [a.shape for a in shaped], engine_shapes,
                                                owner))
    return shaped, handle


# ----------------------------------------------------------------------------------------------------------
# Update.

@tf.autograph.experimental.do_not_convert
def apply_gradients(engine, gradients, handle, *, name: str | None = None) -> tf.Tensor:
    """Apply ``gradients`` (a nest mirroring ``engine.feature_config``: ``tf.Tensor``, ``tf.IndexedSlices``,
    NumPy or ``None`` leaves) to the lookup named by ``handle`` (from :func:`lookup`), with each table's
    fused optimizer. ``None`` for a feature means no update for that feature. Returns the engine's step
    after the update (int64 scalar tensor). Eagerly it runs now; in a graph it is a stateful op after the
    lookup (see the module docstring)."""
    config = engine.feature_config
    paths = _engine_paths(engine)
    tf.nest.assert_same_structure(config, gradients)
    flat = tf.nest.flatten(gradients)
    present = [g is not None for g in flat]

    if tf.executing_eagerly():
        arrays = [tensors.gradient_to_numpy(g, path) for (path, _), g in zip(paths, flat)]
        step = _apply_arrays(engine, paths, int(tensors.to_numpy(handle)), arrays)
        return tf.constant(step, tf.int64)

    grads = [tensors.dense_gradient(g) for g in flat if g is not None]
    # TensorFlow evaluates callable learning rates (and CustomOptimizer hyperparameters) in the graph, where
    # the update is built: a tf.Variable they read is then read in program order. So are ours, feeding the op.
    callables = convert.tensor_callables(_optimizers(engine))
    rates = [c.in_graph() for c in callables]

    def run(h, *given):
        with convert.given_values(callables, given[:len(rates)]):
            it = iter(given[len(rates):])
            arrays = [next(it) if p else None for p in present]
            return np.asarray(_apply_arrays(engine, paths, int(h), arrays), np.int64)

    step = tf.numpy_function(run, [handle] + rates + grads, tf.int64, stateful=True,
                             name=name or "embedcore_apply_gradients")
    step.set_shape([])
    return step


def _optimizers(engine) -> list:
    """The engine's default optimizer and its tables' own (None where unset)."""
    return [getattr(engine, "optimizer", None)] + [t.optimizer for t in engine.tables.values()]


def _apply_arrays(engine, paths, handle: int, gradients) -> int:
    entry = _REGISTRY.get(handle, engine)
    shaped = []
    for (path, feature), grad, shape, engine_shape in zip(paths, gradients, entry.shapes, entry.engine_shapes):
        if grad is None:
            shaped.append(None)
            continue
        grad = np.asarray(grad)
        name = feature.name or path
        if tuple(grad.shape) != tuple(shape):
            raise InputError(f"gradient of feature '{name}' has shape {tuple(grad.shape)}, its activations have "
                             f"{tuple(shape)} (nothing was updated)")
        shaped.append(grad.reshape(engine_shape) if math.prod(engine_shape) == grad.size else grad)
    try:
        engine.apply_gradients(tf.nest.pack_sequence_as(engine.feature_config, shaped), entry.ctx)
    finally:
        if entry.ctx.consumed:
            _REGISTRY.drop(handle, applied=True)
    return int(engine.step)
