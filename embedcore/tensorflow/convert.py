"""TensorFlow's ``tf.tpu.experimental.embedding`` config objects as embedcore's, argument for argument.

* :func:`features`: a nest of ``FeatureConfig``\\ s (TensorFlow's or embedcore's, mixed) -> :class:`Converted`.
* :func:`table`: one ``tf.tpu.experimental.embedding.TableConfig`` -> :class:`embedcore.TableConfig`.
* :func:`optimizer`: ``SGD``, ``Adagrad``, ``AdagradMomentum``, ``Adam``, ``FTRL``, ``CustomOptimizer`` ->
  the embedcore optimizer of the same name, every argument carried over with TensorFlow's meaning.
* :func:`initializer`: TensorFlow and Keras initializers -> embedcore initializers, or exact callables
  ``(shape, dtype) -> np.ndarray``.

TensorFlow's meanings, as its source (``tpu_embedding_v2_utils.py``, ``tpu_embedding_base.py``) and
``optimization_parameters.proto`` define them:

* Tables are the distinct ``TableConfig`` *objects* of ``tf.nest.flatten(feature_config)``, in first-seen
  order; an unnamed one at position ``i`` of that order is named ``"table_<i>"``; names must be unique.
* Learning rates and ``CustomOptimizer`` hyperparameters are floats or zero-argument callables called once a
  step (a callable may return a float, a NumPy scalar, a ``tf.Tensor`` or read a ``tf.Variable``: assigning
  the variable changes the next step's rate). A ``tf.Variable`` given itself is read every step.
* TensorFlow's ``Adam`` has no bias correction (its users fold it into a learning-rate callable), so the
  embedcore ``Adam`` is built with ``bias_correction=False``.
* ``clipvalue`` is stored by TensorFlow as ``clip_gradient_min`` / ``clip_gradient_max``; it is carried over
  as that ``(min, max)`` pair.
* A table's initializer is never ``None`` in TensorFlow (``TableConfig`` puts
  ``TruncatedNormal(0, 1/sqrt(dim))`` there); ``initializer(None)`` is ``None``, embedcore's name for the
  same default.

What embedcore cannot honour is refused with ``ValueError`` naming the table (or the optimizer):
``slot_variable_creation_fn`` (it creates TensorFlow variables; embedcore's engine owns the slots), a
``CustomCombiner``, a ``quantization_config`` (simulated quantization of lookups), a ``dtype`` other than
float32. ``layout`` (a SparseCore placement) does not change results and is ignored.

A feature's ``max_sequence_length`` and ``output_shape`` are carried over as given. TensorFlow uses
``max_sequence_length`` only when ``output_shape`` is unset and the input is rank 2 (a rank-2 sparse or
ragged input), and serving refuses it for dense inputs: which applies depends on the input, so
:mod:`embedcore.tensorflow.tensors` and the engines apply that rule with the original configs at hand.

Only this module and its siblings import TensorFlow; Keras is imported only to recognise a Keras
initializer that was passed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import sys
import threading
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import init_ops_v2  # TensorFlow's own initializer classes (TableConfig's default)

import embedcore as ec

from .. import inputs
from ..initializers import Initializer, finite_float32, stream_key
from ..kernels import random as _random

__all__ = ["Converted", "features", "table", "optimizer", "initializer", "RandomNormal", "ConstantValues",
           "TensorInitializer", "TensorCallable",
           "tensor_callables", "given_values"]

_tpu = tf.tpu.experimental.embedding


class Converted(NamedTuple):
    """What :func:`features` returns.

    Attributes:
        features: the given nest with every leaf an :class:`embedcore.FeatureConfig` (an embedcore one
            is the same object).
        tables: ``[(given_table_config, embedcore_table_config), ...]``, one pair per distinct given table
            object, in first-seen order (an embedcore table is paired with itself).
    """

    features: object
    tables: list


# ----------------------------------------------------------------------------------------------------------
# Feature nests and tables.

def features(feature_config) -> Converted:
    """Convert a nest (dict / list / tuple / one config) of TensorFlow or embedcore ``FeatureConfig``\\ s.

    Every feature reading one TensorFlow ``TableConfig`` object reads one embedcore ``TableConfig``;
    unnamed TensorFlow tables get TensorFlow's names (``"table_<i>"``, ``i`` the table's position in
    first-seen order over the flattened nest, dict keys sorted, counting embedcore tables too). An optimizer
    object shared by several tables becomes one embedcore optimizer.

    Raises:
        TypeError: a leaf is not a ``FeatureConfig`` (naming its path).
        ValueError: two tables share a name, or a table or feature cannot be converted (naming it).
    """
    leaves = inputs.flatten(feature_config)
    for path, leaf in leaves:
        if not isinstance(leaf, (_tpu.FeatureConfig, ec.FeatureConfig)):
            raise TypeError(f"feature_config at '{path}' must be a tf.tpu.experimental.embedding.FeatureConfig or "
                            f"an embedcore FeatureConfig, got {type(leaf).__name__}: {leaf!r:.120}")
    given_tables = []
    for _, leaf in leaves:
        if not any(leaf.table is seen for seen in given_tables):
            given_tables.append(leaf.table)
    names = [t.name if t.name is not None else (f"table_{i}" if isinstance(t, _tpu.TableConfig) else None)
             for i, t in enumerate(given_tables)]
    taken = set()
    for name in names:
        if name is not None and name in taken:
            raise ValueError(f"Tables must have a unique name. Multiple tables with name {name} found.")
        taken.add(name)
    converted_optimizers = {}
    pairs = []
    for given, name in zip(given_tables, names):
        pairs.append((given, given if isinstance(given, ec.TableConfig)
                      else _table(given, name, converted_optimizers)))
    ec_table_of = {id(given): converted for given, converted in pairs}
    converted_features = [leaf if isinstance(leaf, ec.FeatureConfig) else
                          _feature(leaf, ec_table_of[id(leaf.table)], path) for path, leaf in leaves]
    return Converted(inputs.unflatten(feature_config, converted_features), pairs)


def _feature(given, ec_table, path) -> ec.FeatureConfig:
    name = given.name or path
    shape = given.output_shape
    if shape is None or isinstance(shape, tf.TensorShape) and shape.rank is None:
        output_shape = None
    else:
        shape = tf.TensorShape(shape)
        if not shape.is_fully_defined():
            raise ValueError(f"feature '{name}': output_shape {shape} is not fully defined; give every dimension "
                             f"(or leave output_shape unset)")
        output_shape = tuple(shape.as_list())
    try:
        return ec.FeatureConfig(ec_table, max_sequence_length=given.max_sequence_length,
                                validate_weights_and_indices=given.validate_weights_and_indices,
                                output_shape=output_shape, name=given.name)
    except (TypeError, ValueError) as exc:
        raise _named(exc, f"feature '{name}'") from exc


def table(tf_table_config, *, name=None) -> ec.TableConfig:
    """One ``tf.tpu.experimental.embedding.TableConfig`` as an :class:`embedcore.TableConfig`.

    ``vocabulary_size``, ``dim``, ``combiner`` and ``name`` are carried over; the initializer by
    :func:`initializer`, the optimizer by :func:`optimizer` (``None`` stays ``None``: the engine's optimizer
    applies). ``name`` overrides the table's own (``None``: keep it), as :func:`features` does for unnamed
    tables. An embedcore ``TableConfig`` is returned as it is.

    Raises:
        ValueError (or TypeError, as TensorFlow raises it) naming the table: anything embedcore cannot
        honour (see the module docstring), an unsupported optimizer or initializer, bad values.
    """
    if isinstance(tf_table_config, ec.TableConfig):
        return tf_table_config
    if not isinstance(tf_table_config, _tpu.TableConfig):
        raise TypeError(f"Expected a tf.tpu.experimental.embedding.TableConfig, got "
                        f"{type(tf_table_config).__name__}: {tf_table_config!r:.120}")
    return _table(tf_table_config, tf_table_config.name if name is None else name, {})


def _table(given, name, converted_optimizers) -> ec.TableConfig:
    where = f"TableConfig '{name}'" if name else "TableConfig"
    combiner = given.combiner
    if not isinstance(combiner, str):
        raise ValueError(f"{where}: combiner {combiner} (a {type(combiner).__name__}) is not supported by "
                         f"embedcore; use 'mean', 'sum' or 'sqrtn'")
    if getattr(given, "quantization_config", None) is not None:
        raise ValueError(f"{where}: quantization_config {given.quantization_config!r} (simulated quantization of "
                         f"lookups) is not supported by embedcore; leave it None")
    dtype = getattr(given, "dtype", tf.float32)
    if dtype is not None and tf.as_dtype(dtype) != tf.float32:
        raise ValueError(f"{where}: dtype {tf.as_dtype(dtype).name} is not supported: embedcore tables hold "
                         f"floats (float32; TableConfig(weights_dtype=...) for 16-bit storage)")
    try:
        ec_optimizer = _memo_optimizer(given.optimizer, converted_optimizers)
        ec_initializer = _table_initializer(given.initializer, given.vocabulary_size, given.dim)
        return ec.TableConfig(given.vocabulary_size, given.dim, initializer=ec_initializer, optimizer=ec_optimizer,
                              combiner=combiner, name=name)
    except (TypeError, ValueError) as exc:
        raise _named(exc, where) from exc


def _memo_optimizer(given, converted_optimizers):
    if given is None:
        return None
    key = id(given)
    if key not in converted_optimizers:
        converted_optimizers[key] = (given, optimizer(given))  # holding ``given`` keeps its id unique
    return converted_optimizers[key][1]


def _table_initializer(given, vocabulary_size, dim):
    converted = initializer(given)
    if isinstance(converted, ConstantValues):
        converted.check_shape((vocabulary_size, dim))
    return converted


def _named(exc, where):
    """``exc`` again, its message prefixed with ``where`` (the same class where it can be built so)."""
    message = str(exc)
    if message.startswith(where):
        return exc
    try:
        return type(exc)(f"{where}: {message}")
    except Exception:  # an exception class with another constructor: keep it as it is
        return exc


# ----------------------------------------------------------------------------------------------------------
# Learning rates and hyperparameters.

_GIVEN = threading.local()  # .values: {id(TensorCallable): value} while an update op runs (given_values)


class TensorCallable:
    """A zero-argument callable whose result (float, NumPy scalar, ``tf.Tensor``, ``tf.Variable``) is returned as
    a NumPy scalar, called once a step as TensorFlow calls a dynamic learning rate.

    Inside ``tf.function`` TensorFlow evaluates such a callable in the graph, where the update is built, so a
    ``tf.Variable`` it reads is read in program order (after an ``assign`` written before the update, before
    one written after it). embedcore's update op does the same: :meth:`in_graph` builds the value as a graph
    tensor that feeds the op, and while the op runs :func:`given_values` makes the callable return it.

    Equal to another wrapping the same function (so optimizers sharing a callable compare equal and share a
    stacked table); ``inspect.signature`` sees the wrapped function's (``__wrapped__``).
    """

    def __init__(self, function, what="learning_rate"):
        self.__wrapped__ = function
        self.what = what

    def __call__(self):
        given = getattr(_GIVEN, "values", None)
        if given is not None and id(self) in given:
            return given[id(self)]
        return _scalar(self.__wrapped__(), f"{self.what} callable {self.__wrapped__!r:.80}")

    def in_graph(self) -> tf.Tensor:
        """The wrapped function's value as a float32 scalar tensor of the graph being built (called once, as
        TensorFlow calls a learning-rate callable once per trace)."""
        where = f"{self.what} callable {self.__wrapped__!r:.80}"
        value = tf.cast(tf.convert_to_tensor(self.__wrapped__()), tf.float32)
        if value.shape.rank not in (None, 0):
            raise ValueError(f"{where} must return a scalar, got a tensor of shape {value.shape}")
        return tf.reshape(value, [])

    def __eq__(self, other):
        return type(other) is TensorCallable and other.__wrapped__ is self.__wrapped__

    def __hash__(self):
        return hash((TensorCallable, id(self.__wrapped__)))

    def __repr__(self):
        return f"TensorCallable({self.__wrapped__!r})"


def tensor_callables(optimizers) -> list:
    """The distinct :class:`TensorCallable` s among ``optimizers``' learning rates and hyperparameters (None
    entries skipped), in a fixed order."""
    found = {}
    for optimizer in optimizers:
        if optimizer is None:
            continue
        for value in (optimizer.learning_rate, *getattr(optimizer, "hyperparameters", ())):
            if isinstance(value, TensorCallable):
                found.setdefault(id(value), value)
    return list(found.values())


@contextlib.contextmanager
def given_values(callables, values):
    """While the block runs, on this thread, each of ``callables`` returns its entry of ``values`` (evaluated
    in a graph by :meth:`TensorCallable.in_graph`) instead of calling its function."""
    previous = getattr(_GIVEN, "values", None)
    _GIVEN.values = {**(previous or {}), **{id(c): np.float32(v) for c, v in zip(callables, values)}}
    try:
        yield
    finally:
        _GIVEN.values = previous


class _VariableReader:
    """Reads a ``tf.Variable`` given as a learning rate, each step."""

    def __init__(self, variable):
        self.variable = variable

    def __call__(self):
        return self.variable

    def __eq__(self, other):
        return type(other) is _VariableReader and other.variable is self.variable

    def __hash__(self):
        return hash((_VariableReader, id(self.variable)))

    def __repr__(self):
        return f"<reads {self.variable.name}>"


def _scalar(value, what):
    if isinstance(value, (tf.Tensor, tf.Variable)):
        try:
            value = value.numpy()
        except (AttributeError, NotImplementedError, TypeError):
            raise ValueError(f"{what} returned a symbolic tensor {value!r:.80}: embedcore calls it eagerly (inside "
                             f"tf.function, through embedcore.tensorflow's engines); it must return a value there"
                             ) from None
    array = np.asarray(value)
    if array.shape != ():
        raise ValueError(f"{what} must return a scalar, got an array of shape {array.shape}")
    return array[()]


def _rate(value, what="learning_rate"):
    """A learning rate or hyperparameter as embedcore takes it: a float, or a zero-argument callable."""
    if isinstance(value, tf.Variable):
        return TensorCallable(_VariableReader(value), what)
    if isinstance(value, tf.Tensor):
        return float(_scalar(value, what))
    if callable(value):
        return value if isinstance(value, TensorCallable) else TensorCallable(value, what)
    return value


# ----------------------------------------------------------------------------------------------------------
# Optimizers.

def _common(given) -> dict:
    """TensorFlow's ``_Optimizer`` options (its attributes after construction) as embedcore's arguments."""
    if getattr(given, "slot_variable_creation_fn", None) is not None:
        raise ValueError(f"{type(given).__name__}: slot_variable_creation_fn {given.slot_variable_creation_fn!r:.80} "
                         f"creates TensorFlow variables for the slots and cannot be honoured: embedcore's engine "
                         f"creates and owns the slots (their initial values come from the optimizer); leave it None")
    low, high = given.clip_gradient_min, given.clip_gradient_max
    return {"use_gradient_accumulation": given.use_gradient_accumulation,
            "clip_weight_min": given.clip_weight_min, "clip_weight_max": given.clip_weight_max,
            "weight_decay_factor": given.weight_decay_factor,
            "multiply_weight_decay_factor_by_learning_rate": given.multiply_weight_decay_factor_by_learning_rate,
            "clipvalue": None if low is None and high is None else (low, high),
            "low_dimensional_packing_status": given.low_dimensional_packing_status}


def _sgd(given):
    return ec.SGD(_rate(given.learning_rate), **_common(given))


def _adagrad(given):
    return ec.Adagrad(_rate(given.learning_rate), initial_accumulator_value=given.initial_accumulator_value,
                      **_common(given))


def _adagrad_momentum(given):
    return ec.AdagradMomentum(_rate(given.learning_rate), momentum=given.momentum, use_nesterov=given.use_nesterov,
                              exponent=given.exponent, beta2=given.beta2, epsilon=given.epsilon, **_common(given))


def _adam(given):
    options = {}
    if "bias_correction" in inspect.signature(ec.Adam).parameters:
        options["bias_correction"] = False  # TensorFlow's TPU Adam: none (optimization_parameters.proto)
    return ec.Adam(_rate(given.learning_rate), beta_1=given.beta_1, beta_2=given.beta_2, epsilon=given.epsilon,
                   lazy_adam=given.lazy_adam, sum_inside_sqrt=given.sum_inside_sqrt, **options, **_common(given))


def _ftrl(given):
    return ec.FTRL(_rate(given.learning_rate), learning_rate_power=given.learning_rate_power,
                   l1_regularization_strength=given.l1_regularization_strength,
                   l2_regularization_strength=given.l2_regularization_strength, beta=given.beta,
                   initial_accumulator_value=given.initial_accumulator_value,
                   multiply_linear_by_learning_rate=given.multiply_linear_by_learning_rate,
                   allow_zero_accumulator=given.allow_zero_accumulator, **_common(given))


def _custom(given):
    # TensorFlow's CustomOptimizer fixes the common options (no accumulation flag, clipping or decay).
    names = list(given._slot_names())  # the documented way TF's optimizers list their slots
    slot_initializers = [initializer(i) for i in given._slot_initializers()]
    return ec.CustomOptimizer(given.custom_computation, learning_rate=_rate(given.learning_rate),
                              slot_names=names, slot_initializers=slot_initializers,
                              hyperparameters=[_rate(h, f"hyperparameters[{k}]")
                                               for k, h in enumerate(given.hyperparameters)],
                              slot_dims=list(given.slot_dims) or None)


_OPTIMIZERS = ((_tpu.CustomOptimizer, _custom), (_tpu.SGD, _sgd), (_tpu.Adagrad, _adagrad),
               (_tpu.AdagradMomentum, _adagrad_momentum), (_tpu.Adam, _adam), (_tpu.FTRL, _ftrl))


def optimizer(opt):
    """A TensorFlow TPU embedding optimizer as the embedcore optimizer of the same name.

    Every argument is carried over with TensorFlow's meaning (callable learning rates wrapped by
    :class:`TensorCallable`, ``Adam`` without bias correction, ``clipvalue`` as its ``(min, max)`` pair). An
    embedcore optimizer is returned as it is; ``None`` gives ``None``.

    Raises:
        ValueError: ``opt`` is of another class (TensorFlow's message), or uses ``slot_variable_creation_fn``,
            or a value embedcore's optimizer refuses (its message, naming the optimizer).
    """
    if opt is None or isinstance(opt, ec.Optimizer):
        return opt
    for kind, convert in _OPTIMIZERS:
        if isinstance(opt, kind):
            return convert(opt)
    raise ValueError(f"{type(opt)} is an unsupported optimizer class. Please pass an instance of one of the optimizer "
                     f"classes under tf.tpu.experimental.embedding (SGD, Adagrad, AdagradMomentum, Adam, FTRL, "
                     f"CustomOptimizer) or an embedcore optimizer.")


# ----------------------------------------------------------------------------------------------------------
# Initializers.

class RandomNormal(Initializer):
    """Normal(mean, stddev), not truncated (``tf.random_normal_initializer``, Keras ``RandomNormal``).

    Partition-independent like every embedcore initializer: each value is Box-Muller of two uniforms that
    depend only on ``(key, row, column)``.
    """

    _CHUNK_ROWS = 1 << 14  # the float64 uniforms are made this many rows at a time

    def __init__(self, mean=0.0, stddev=0.05, seed=None):
        mean = finite_float32(mean, "RandomNormal: mean")
        if not (isinstance(stddev, numbers.Real) and not isinstance(stddev, bool) and stddev >= 0):
            raise ValueError(f"RandomNormal: stddev must be >= 0, got {stddev!r}")
        stddev = finite_float32(stddev, "RandomNormal: stddev")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise ValueError(f"RandomNormal: seed must be an int or None, got {seed!r}")
        self.mean, self.stddev, self.seed = mean, stddev, None if seed is None else int(seed)

    def fill(self, out, first_row, key, stride=1):
        second_key = stream_key(key, "RandomNormal: second uniform")
        for start in range(0, out.shape[0], self._CHUNK_ROWS):
            rows = out[start:start + self._CHUNK_ROWS]
            u1 = np.empty(rows.shape, np.float64)
            u2 = np.empty(rows.shape, np.float64)
            row = first_row + start * stride
            _random.fill_uniform(u1, row, np.uint64(key), 0.0, 1.0, stride)
            _random.fill_uniform(u2, row, np.uint64(second_key), 0.0, 1.0, stride)
            # 1 - u1 lies in (0, 1]: its log is finite
            rows[:] = self.mean + self.stddev * (np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2))


class ConstantValues:
    """``tf.constant_initializer(values)`` with a list or array: the values in row-major order, reshaped to
    the requested shape, whose size must equal theirs (``TypeError`` otherwise, as TensorFlow's); or, for
    Keras ``Constant`` (``broadcast=True``), broadcast to it."""

    def __init__(self, values, broadcast=False):
        self.values = np.array(values, dtype=np.float32)
        self.broadcast = bool(broadcast)

    def check_shape(self, shape):
        shape = tuple(int(s) for s in shape)
        if self.broadcast:
            try:
                np.broadcast_shapes(self.values.shape, shape)
            except ValueError:
                raise ValueError(f"the constant initializer's values of shape {self.values.shape} do not broadcast "
                                 f"to shape {shape}") from None
        elif self.values.size != math.prod(shape):
            raise TypeError(f"the constant initializer's value has {self.values.size} elements, shape is {shape} "
                            f"with {math.prod(shape)} elements")

    def __call__(self, shape, dtype=np.float32):
        self.check_shape(shape)
        shape = tuple(int(s) for s in shape)
        values = np.broadcast_to(self.values, shape) if self.broadcast else self.values.reshape(shape)
        return values.astype(dtype, copy=True)

    def __eq__(self, other):
        return (type(other) is ConstantValues and self.broadcast == other.broadcast
                and self.values.shape == other.values.shape and np.array_equal(self.values, other.values))

    def __hash__(self):
        return hash((ConstantValues, self.values.shape, self.values.tobytes(), self.broadcast))

    def __repr__(self):
        return f"ConstantValues(shape={self.values.shape}{', broadcast' if self.broadcast else ''})"


class TensorInitializer:
    """Any other TensorFlow-style initializer ``init(shape, dtype=tf.float32) -> tf.Tensor``, returning NumPy."""

    def __init__(self, function):
        self.__wrapped__ = function

    def __call__(self, shape, dtype=np.float32):
        shape = tuple(int(s) for s in shape)
        value = self.__wrapped__(shape, dtype=tf.float32)
        if isinstance(value, (tf.Tensor, tf.Variable)):
            value = value.numpy()
        return np.asarray(value).astype(dtype, copy=False)

    def __eq__(self, other):
        return type(other) is TensorInitializer and other.__wrapped__ is self.__wrapped__

    def __hash__(self):
        return hash((TensorInitializer, id(self.__wrapped__)))

    def __repr__(self):
        return f"TensorInitializer({self.__wrapped__!r:.100})"


def _number(value, what):
    """A TensorFlow or NumPy scalar as a Python number (embedcore's initializers check the value)."""
    if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic)):
        value = _scalar(value, what)
        return value.item() if isinstance(value, np.generic) else value
    return value


def _constant(value, broadcast):
    """A constant initializer's value: a scalar as :class:`embedcore.Constant`, else :class:`ConstantValues`."""
    if np.ndim(value) == 0:
        return ec.Constant(_number(value, "constant initializer: value"))
    return ConstantValues(np.asarray(value), broadcast=broadcast)


def _seed(value):
    return value if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def _keras_seed(init):
    # Keras 3 draws a seed when none is given and keeps the user's in ``_init_seed``; a SeedGenerator is
    # stateful: the engine's seed is used instead (the distribution is the same).
    return _seed(getattr(init, "_init_seed", getattr(init, "seed", None)))


def _keras_initializer(init):
    """The embedcore form of a Keras (3 or 2) built-in initializer, or None if it is another one."""
    kind = type(init).__name__
    module = type(init).__module__
    if not (module.startswith("keras.") or module.startswith("tf_keras.")):
        return None
    if kind == "Zeros":
        return ec.Zeros()
    if kind == "Ones":
        return ec.Constant(1.0)
    if kind == "Constant":
        return _constant(init.value, broadcast=True)
    if kind == "RandomUniform":
        return ec.RandomUniform(_number(init.minval, "minval"), _number(init.maxval, "maxval"), _keras_seed(init))
    if kind == "RandomNormal":
        return RandomNormal(_number(init.mean, "mean"), _number(init.stddev, "stddev"), _keras_seed(init))
    if kind == "TruncatedNormal":
        return ec.TruncatedNormal(_number(init.mean, "mean"), _number(init.stddev, "stddev"), _keras_seed(init))
    return None


def initializer(init):
    """A TensorFlow or Keras initializer as an embedcore one, or as an exact callable ``(shape, dtype)``.

    * ``tf.constant_initializer(v)`` (``support_partition`` either way), Keras ``Constant``: a scalar becomes
      :class:`embedcore.Constant` (exact in float32); a list or array :class:`ConstantValues`;
    * ``tf.zeros_initializer()`` / ``tf.ones_initializer()`` and Keras ``Zeros`` / ``Ones``: ``Zeros()`` /
      ``Constant(1.0)``;
    * ``tf.random_uniform_initializer``, Keras ``RandomUniform``: :class:`embedcore.RandomUniform`;
    * ``tf.random_normal_initializer``, Keras ``RandomNormal``: :class:`RandomNormal`;
    * ``tf.keras.initializers.TruncatedNormal`` / ``tf.initializers.TruncatedNormal`` and TensorFlow's own
      ``TruncatedNormal`` (``TableConfig``'s default): :class:`embedcore.TruncatedNormal` (both: a normal with
      the values beyond two standard deviations redrawn);
    * ``tf.tpu.experimental.embedding.RowIdInitializer(offset)``: :class:`embedcore.RowId`;
    * ``None``: ``None`` (a table's default, ``TruncatedNormal(0, 1/sqrt(dim))``, TensorFlow's too); embedcore
      initializers are returned as they are;
    * any other callable (Glorot, orthogonal, a user's function returning a ``tf.Tensor``):
      :class:`TensorInitializer`, which calls it with ``(shape, dtype=tf.float32)`` as TensorFlow's engines do.

    Random values follow TensorFlow's distribution with the initializer's seed (or, unseeded, the engine's);
    they are embedcore's partition-independent streams, not TensorFlow's Philox numbers.

    Raises:
        ValueError: ``init`` is not callable (TensorFlow's ``TableConfig`` message), or its parameters are
            refused by the embedcore initializer (naming it).
    """
    if init is None or isinstance(init, Initializer):
        return init
    if isinstance(init, tf.constant_initializer):
        return _constant(init.value, broadcast=False)
    if isinstance(init, tf.zeros_initializer):
        return ec.Zeros()
    if isinstance(init, tf.ones_initializer):
        return ec.Constant(1.0)
    if isinstance(init, tf.random_uniform_initializer):
        return ec.RandomUniform(_number(init.minval, "minval"), _number(init.maxval, "maxval"), _seed(init.seed))
    if isinstance(init, tf.random_normal_initializer):
        return RandomNormal(_number(init.mean, "mean"), _number(init.stddev, "stddev"), _seed(init.seed))
    if isinstance(init, init_ops_v2.TruncatedNormal):
        return ec.TruncatedNormal(_number(init.mean, "mean"), _number(init.stddev, "stddev"), _seed(init.seed))
    if isinstance(init, _tpu.RowIdInitializer):
        return ec.RowId(_number(init.offset, "RowIdInitializer: offset"))
    if "keras" in sys.modules or "tf_keras" in sys.modules:  # a Keras initializer implies Keras is imported
        converted = _keras_initializer(init)
        if converted is not None:
            return converted
    if not callable(init):
        raise ValueError(f"Argument `initializer` must be a callable (or None). Received: {init!r:.120}")
    return init if isinstance(init, (ConstantValues, TensorInitializer)) else TensorInitializer(init)

