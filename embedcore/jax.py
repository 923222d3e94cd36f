"""JAX adapter: embedcore's tables on the host, the dense model as a jitted JAX function.

The split is the one of TPU embedding engines (jax-tpu-embedding, keras-rs): the embedding engine owns the
tables and their optimizers; the dense model only ever sees activations and returns ``d loss / d
activations``. One training step::

    import embedcore as ec
    from embedcore import jax as ecj

    emb = ec.Embedding(feature_config, ec.Adagrad(0.05))       # tables + fused sparse optimizer
    dense_opt = ecj.adam(1e-3)                                  # or any optax GradientTransformation
    params = init_dense_params(...)                             # any pytree of jax arrays
    opt_state = dense_opt.init(params)
    train_step = ecj.make_train_step(loss_fn, dense_opt)        # loss_fn(params, activations, batch)

    for features, weights, batch in data:
        acts, ctx = ecj.lookup(emb, features, weights)          # 1. host lookup -> pytree of jax.Array
        loss, params, opt_state, d_acts = train_step(params, opt_state, acts, batch)   # 2. jitted dense step
        ecj.apply_gradients(emb, d_acts, ctx)                   # 3. fused sparse update of touched rows

Semantics: step 3 applies the gradients of the activations that step 1 read, so lookup ``t + 1`` sees the
tables updated by step ``t``; each ``ctx`` is applied at most once. ``train_step`` is traced once per
distinct shape of its arguments: keep the batch size (and ``max_sequence_length``) fixed, padding the last
batch, or each new shape compiles again. Errors in step 3 (NaN/Inf or wrongly shaped gradients, wrong
structure, a ``ctx`` of another engine or of a lookup made before ``emb.load()``) raise
:class:`embedcore.InputError` and leave tables, slots and ``emb.step`` unchanged.

Copies (measured with jax 0.10.2 on CPU):

* ``lookup`` hands each activation array to :func:`jax.device_put`. On the CPU backend XLA aliases a NumPy
  buffer that is C-contiguous and 64-byte aligned (no copy), and copies it otherwise (``jnp.asarray`` always
  copies; ``jax.dlpack.from_dlpack`` behaves like ``device_put``). Whether an activation is aligned depends
  on where NumPy placed the engine's activation buffer and on the feature's offset in it, so expect a mix
(30 to 45% of the activations were aliased in a measurement over batch sizes 1 to 4096);
  a copy costs ``B x dim`` floats per feature, small next to the dense step. Aliasing is safe: the engine
  allocates a fresh activation buffer per lookup and never touches it again. On an accelerator,
  ``device_put`` is the host-to-device transfer.
* ``apply_gradients`` converts each gradient with :func:`numpy.asarray`, which on CPU is a zero-copy,
  read-only view of the jax buffer. The engine reads a float32, C-contiguous gradient in place when its
  feature is the only one of its physical table, and copies the others into a reused workspace; it never
  writes into a gradient (its Numba kernels are compiled for read-only input and would refuse a write).
  On an accelerator, ``numpy.asarray`` is the device-to-host transfer. Floating gradients of other dtypes
  (bfloat16, float16) are cast to float32 first.

Threads: embedcore's parallel Numba kernels use OpenMP, whose idle threads by default spin for a while after
each kernel, competing for the cores that XLA and NumPy use between two embedcore calls. On a small or busy
machine this made the lookup/step/apply loop of ``examples/jax_dlrm.py`` 3 to 8 times slower and
``apply_gradients`` 15 to 40 times (2 shared cores, jax 0.10.2); the environment variable
``OMP_WAIT_POLICY=PASSIVE``, set before the first embedcore call, removes the effect.

Dynamic tables (:class:`embedcore.DynamicTableConfig`) need nothing more: ids go to the engine as given, and
a dynamic table's ids are 64-bit keys. Give them as NumPy ``int64`` or ``uint64`` arrays (or ``Ragged`` /
``Sparse`` of them): they are read as they are. JAX arrays are 32-bit unless ``jax_enable_x64`` is on
(``jax.config.update("jax_enable_x64", True)`` before creating them): without it ``jnp.asarray`` of a 64-bit
key array truncates every key to its low 32 bits (with a warning) before embedcore sees it, so keep keys in
NumPy, or enable x64. The dense step never sees keys (only activations), so x64 is not needed there. A
training lookup of a dynamic table changes it (admission counts, new rows at their initial values, evictions);
evaluate with ``lookup(emb, features, training=False)``, which changes no table (held keys read their rows, any
other key its initial value). Checkpoint dynamic tables with ``emb.save(path)``.

Requires JAX (``pip install embedcore[jax]``); importing this module without it raises ImportError.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as error:  # pragma: no cover - exercised by a test that hides jax
    raise ImportError("embedcore.jax needs JAX, an optional extra: pip install embedcore[jax] "
                      "(or pip install jax)") from error

from .inputs import InputError

__all__ = ["lookup", "apply_gradients", "make_train_step", "DenseOptimizer", "AdamState", "sgd", "adam"]


def _map(fn, tree):
    """``fn`` applied to the leaves of a nest of dicts/lists/tuples (namedtuples too), keeping its exact form."""
    if isinstance(tree, dict):
        return {key: _map(fn, value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_map(fn, item) for item in tree]
    if isinstance(tree, tuple):
        items = [_map(fn, item) for item in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return fn(tree)


def lookup(emb, features, weights=None, *, device=None, training: bool = True):
    """Look up activations as jax arrays: returns ``(activations, ctx)``.

    Same inputs and result structure as :meth:`embedcore.Embedding.lookup`; each activation (of the engine's
    ``output_dtype``: float32, or bfloat16 / float16; ``[B, dim]``, ``[B, L, dim]`` or the feature's
    ``output_shape``) is put on ``device`` (default: JAX's
    default device) with :func:`jax.device_put`, without a copy when the backend can alias it (see the
    module docstring). Pass ``ctx`` to :func:`apply_gradients` with the gradients of these activations.
    Ids and weights may be jax arrays (read as NumPy, without a copy on CPU) as well as NumPy arrays,
    ``Ragged`` or ``Sparse``. ``training=False`` (evaluation): a read-only lookup, as the engine's (no table
    changes; ``ctx`` cannot be applied).
    """
    activations, ctx = emb.lookup(_map(_host_input, features), None if weights is None else _map(_host_input, weights),
                                  training=training)
    return _map(lambda a: jax.device_put(a, device), activations), ctx


def _host_input(value):
    """A jax array of ids or weights as NumPy (the engine reads host arrays); anything else as it is."""
    if isinstance(value, jax.core.Tracer):
        raise InputError("ids and weights must be concrete arrays, got a JAX tracer: call embedcore.jax.lookup "
                         "outside jax.jit / jax.grad")
    if isinstance(value, jax.Array):
        return np.asarray(value)
    return value


_ENGINE_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)  # gradients the engine reads as they are


def _to_numpy(grad):
    if isinstance(grad, jax.core.Tracer):
        raise InputError("gradients must be concrete arrays, got a JAX tracer: call embedcore.jax.apply_gradients "
                         "outside jax.jit / jax.grad, on the d_activations that the jitted step returned")
    if isinstance(grad, jax.Array):
        if jnp.issubdtype(grad.dtype, jnp.floating) and grad.dtype not in _ENGINE_FLOATS:
            grad = grad.astype(jnp.float32)  # float8 and the like: exact in float32
        return np.asarray(grad)
    return grad


def apply_gradients(emb, gradients, ctx) -> None:
    """Apply ``d loss / d activations`` (a nest of jax or NumPy arrays mirroring the activations).

    Each jax array becomes a NumPy view (no copy on CPU, read-only, never written to), then
    :meth:`embedcore.Embedding.apply_gradients` validates everything and runs each table's fused optimizer
    on the rows of the lookup that produced ``ctx``. A bad gradient raises :class:`embedcore.InputError`
    with tables, slots and ``emb.step`` unchanged (``ctx`` may then be applied with good gradients).
    """
    emb.apply_gradients(_map(_to_numpy, gradients), ctx)


# ----------------------------------------------------------------------------------------------------------
# Dense optimizers: (init, update) pairs with optax's GradientTransformation interface.

class DenseOptimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params=None) -> (updates, new_state)``.

    The new parameters are ``params + updates`` (leaf by leaf), as with ``optax.apply_updates``; an optax
    ``GradientTransformation`` is such a pair too and may be passed wherever a DenseOptimizer is accepted.
    """

    init: Callable
    update: Callable


def sgd(learning_rate: float) -> DenseOptimizer:
    """Plain SGD: ``p <- p - learning_rate * g``; the state is ``()``."""

    def init(params):
        del params
        return ()

    def update(grads, state, params=None):
        del params
        return jax.tree_util.tree_map(lambda g: -learning_rate * g, grads), state

    return DenseOptimizer(init, update)


class AdamState(NamedTuple):
    count: Any   # int32 scalar, updates applied so far
    mu: Any      # first moments, like params
    nu: Any      # second moments, like params


def adam(learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> DenseOptimizer:
    """Adam (Kingma & Ba), as ``optax.adam``: with ``t`` the update count from 1,
    ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``,
    ``p <- p - learning_rate * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``."""

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return AdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state, params=None):
        del params
        count = state.count + 1
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        t = count.astype(jnp.float32)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        updates = jax.tree_util.tree_map(lambda m, v: -learning_rate * (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return updates, AdamState(count, mu, nu)

    return DenseOptimizer(init, update)


# ----------------------------------------------------------------------------------------------------------

def make_train_step(loss_fn: Callable, dense_optimizer=None, *, jit: bool = True) -> Callable:
    """The dense half of a training step, jitted.

    ``loss_fn(dense_params, activations, batch) -> scalar loss``, where ``activations`` mirrors what
    :func:`lookup` returns and ``batch`` is any pytree (labels, dense features...). Returns
    ``step(dense_params, opt_state, activations, batch) -> (loss, new_dense_params, new_opt_state,
    d_activations)``: loss and gradients by one :func:`jax.value_and_grad` over ``(dense_params,
    activations)``; ``dense_optimizer`` (an ``(init, update)`` pair such as :func:`sgd`, :func:`adam` or an
    optax ``GradientTransformation``) turns the parameter gradients into ``dense_params + updates`` and
    ``opt_state`` (from ``dense_optimizer.init``) into the new state. Without one, ``dense_params`` and
    ``opt_state`` come back unchanged (frozen dense model) and only ``d_activations`` are computed. Feed
    ``d_activations`` to :func:`apply_gradients`. ``jit=False`` returns the plain function (for debugging).
    """
    if dense_optimizer is not None:
        update = getattr(dense_optimizer, "update", None)
        if update is None:
            try:
                _, update = dense_optimizer
            except (TypeError, ValueError):
                update = None
        if not callable(update):
            raise TypeError(f"dense_optimizer must be an (init, update) pair such as embedcore.jax.sgd(...) or an "
                            f"optax GradientTransformation, got {dense_optimizer!r}")

    def step(dense_params, opt_state, activations, batch):
        if dense_optimizer is None:
            loss, d_activations = jax.value_and_grad(
                lambda acts: loss_fn(dense_params, acts, batch))(activations)
            return loss, dense_params, opt_state, d_activations
        loss, (d_params, d_activations) = jax.value_and_grad(
            lambda params, acts: loss_fn(params, acts, batch), argnums=(0, 1))(dense_params, activations)
        updates, new_state = update(d_params, opt_state, dense_params)
        new_params = jax.tree_util.tree_map(lambda p, u: (p + u).astype(p.dtype), dense_params, updates)
        return loss, new_params, new_state, d_activations

    return jax.jit(step) if jit else step
