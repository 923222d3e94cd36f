"""keras-rs's ``keras_rs.layers.FeatureConfig`` / ``TableConfig`` as embedcore's configs.

keras-rs is optional: its configs are recognised by their class's module (:func:`is_keras_rs_feature`), so
nothing imports keras-rs. A nest of them (mixed with TensorFlow's or embedcore's) is converted to TensorFlow's
``tf.tpu.experimental.embedding`` configs, field by field, and then by :mod:`.convert` as those are, so a
keras-rs table means what keras-rs's TensorFlow path makes of it:

* ``TableConfig``: ``name``, ``vocabulary_size``, ``embedding_dim`` (``dim``), ``combiner`` as given;
  ``initializer`` a Keras initializer or its name (keras-rs's default ``VarianceScaling(mode="fan_out")``
  included); ``optimizer`` (default ``"adam"``) a name (``"sgd"``, ``"adagrad"``, ``"adam"``, ``"ftrl"``:
  TensorFlow's TPU optimizer of that name with its defaults), a ``tf.tpu.experimental.embedding`` optimizer,
  or a Keras ``SGD`` / ``Adagrad`` / ``Adam`` / ``Ftrl`` whose learning rate (a float or a zero-argument
  callable), ``weight_decay`` and ``clipvalue`` and the TPU optimizer's own arguments are carried over (Adam
  keeps TensorFlow's TPU formula: no bias correction). ``placement`` (``"auto"``, ``"sparsecore"``,
  ``"default_device"``) and ``max_ids_per_partition`` / ``max_unique_ids_per_partition`` (SparseCore
  compiler buffer sizes) do not change results and are checked, then ignored: embedcore is the SparseCore.
* ``FeatureConfig``: ``name``; ``output_shape`` is keras-rs's, the embedding width last: that width must be
  the table's, and the leading dimensions become the feature's ``output_shape``, except a ``[batch, dim]``
  shape (a pooled feature), which needs none, so any batch size is served. ``input_shape`` is not used
  (keras-rs's TensorFlow path does not use it either).

Fields embedcore cannot honour (a Keras learning-rate schedule, whose step counter nothing would advance;
``clipnorm``, ``global_clipnorm``, ``use_ema``, ``loss_scale_factor``, gradient accumulation; Adam's
``amsgrad``, SGD's momentum, Ftrl's ``l2_shrinkage_regularization_strength``, Adagrad's ``epsilon`` other
than Keras's default, which TensorFlow's TPU Adagrad does not have) raise ``ValueError`` naming the feature,
the table and the field.
"""

from __future__ import annotations

import tensorflow as tf

from .. import inputs

__all__ = ["is_keras_rs_feature", "to_tensorflow"]

_tpu = tf.tpu.experimental.embedding
_PLACEMENTS = ("auto", "sparsecore", "default_device")
_OPTIMIZER_NAMES = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam", "ftrl": "FTRL"}
# Keras optimizer class -> (TPU optimizer class name, its arguments read from the Keras optimizer,
# {Keras argument: the only value embedcore can honour})
_KERAS_OPTIMIZERS = {
    "SGD": ("SGD", (), {"momentum": 0.0, "nesterov": False}),
    "Adagrad": ("Adagrad", ("initial_accumulator_value",), {"epsilon": 1e-7}),
    "Adam": ("Adam", ("beta_1", "beta_2", "epsilon"), {"amsgrad": False}),
    "Ftrl": ("FTRL", ("learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
                      "l2_regularization_strength", "beta"), {"l2_shrinkage_regularization_strength": 0.0}),
}


def _is_keras_rs(obj, class_name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == class_name and cls.__module__.split(".")[0] == "keras_rs"


def is_keras_rs_feature(obj) -> bool:
    """Whether ``obj`` is a ``keras_rs.layers.FeatureConfig`` (recognised without importing keras-rs)."""
    return _is_keras_rs(obj, "FeatureConfig")


def to_tensorflow(feature_configs):
    """The nest with every keras-rs ``FeatureConfig`` replaced by a ``tf.tpu.experimental.embedding`` one;
    other leaves unchanged. Features reading one keras-rs ``TableConfig`` object read one TensorFlow table.

    Raises:
        ValueError: a field embedcore cannot honour, or a bad value, naming the feature, table and field.
        TypeError: a keras-rs feature's ``table`` is not a keras-rs ``TableConfig``.
    """
    tables = []  # [(keras-rs table, TensorFlow table)], by identity
    converted = []
    for path, leaf in inputs.flatten(feature_configs):
        converted.append(_feature(leaf, path, tables) if is_keras_rs_feature(leaf) else leaf)
    return tf.nest.pack_sequence_as(feature_configs, converted)


def _feature(given, path, tables):
    where = f"keras-rs FeatureConfig '{given.name}' (at '{path}')"
    table = given.table
    if not _is_keras_rs(table, "TableConfig"):
        raise TypeError(f"{where}: table must be a keras_rs.layers.TableConfig, got {type(table).__name__}")
    tf_table = next((t for k, t in tables if k is table), None)
    if tf_table is None:
        tf_table = _table(table, where)
        tables.append((table, tf_table))
    output_shape = given.output_shape
    try:
        output_shape = [None if d is None else int(d) for d in output_shape]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: output_shape must be a sequence of ints (the embedding width last), got "
                         f"{given.output_shape!r}") from None
    if len(output_shape) < 2 or output_shape[-1] != table.embedding_dim:
        raise ValueError(f"{where}: output_shape {tuple(given.output_shape)} must be the activations' shape, a "
                         f"batch dimension first and the table's embedding_dim {table.embedding_dim} last")
    leading = output_shape[:-1]
    if len(leading) == 1:
        leading = None  # [batch, dim]: what a pooled feature gives for any batch size
    elif any(d is None for d in leading):
        raise ValueError(f"{where}: output_shape {tuple(given.output_shape)} has an unknown dimension; embedcore "
                         f"needs every dimension but the batch's (of a [batch, dim] shape) known")
    return _tpu.FeatureConfig(table=tf_table, output_shape=leading, name=given.name)


def _table(table, feature_where):
    where = f"{feature_where}, table '{table.name}'"
    if table.placement not in _PLACEMENTS:
        raise ValueError(f"{where}: placement must be one of {list(_PLACEMENTS)}, got {table.placement!r}")
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
        value = getattr(table, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} must be a positive int, got {value!r}")
    initializer = table.initializer
    if isinstance(initializer, str):
        import keras
        initializer = keras.initializers.get(initializer)
    try:
        return _tpu.TableConfig(vocabulary_size=table.vocabulary_size, dim=table.embedding_dim,
                                initializer=initializer, optimizer=_optimizer(table.optimizer, where),
                                combiner=table.combiner, name=table.name)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith(where):
            raise
        raise type(exc)(f"{where}: {exc}") from None


def _optimizer(opt, where):
    if opt is None or isinstance(opt, (_tpu.SGD, _tpu.Adagrad, _tpu.AdagradMomentum, _tpu.Adam, _tpu.FTRL,
                                       _tpu.CustomOptimizer)):
        return opt
    if isinstance(opt, str):
        if opt not in _OPTIMIZER_NAMES:
            raise ValueError(f"{where}: optimizer must be one of {list(_OPTIMIZER_NAMES)} (or an optimizer object), "
                             f"got {opt!r}")
        return getattr(_tpu, _OPTIMIZER_NAMES[opt])()
    import keras
    if not isinstance(opt, keras.optimizers.Optimizer):
        raise ValueError(f"{where}: optimizer must be a name, a Keras optimizer or a tf.tpu.experimental.embedding "
                         f"optimizer, got {type(opt).__name__}")
    kind = next((name for name in _KERAS_OPTIMIZERS if isinstance(opt, getattr(keras.optimizers, name))), None)
    if kind is None:
        raise ValueError(f"{where}: optimizer {type(opt).__name__} has no embedcore equivalent; use one of Keras's "
                         f"{list(_KERAS_OPTIMIZERS)}")
    tpu_name, carried, fixed = _KERAS_OPTIMIZERS[kind]
    for field in ("clipnorm", "global_clipnorm", "loss_scale_factor", "gradient_accumulation_steps"):
        if getattr(opt, field, None) is not None:
            raise ValueError(f"{where}: optimizer field {field}={getattr(opt, field)!r} is not supported")
    if getattr(opt, "use_ema", False):
        raise ValueError(f"{where}: optimizer field use_ema=True is not supported")
    for field, only in fixed.items():
        if getattr(opt, field) != only:
            raise ValueError(f"{where}: optimizer field {field}={getattr(opt, field)!r} is not supported (only "
                             f"{only!r})")
    rate = opt._learning_rate  # the schedule, callable or variable the optimizer was given
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError(f"{where}: optimizer field learning_rate is a LearningRateSchedule, whose step counter "
                         f"nothing advances for an embedding table; pass a float or a zero-argument callable")
    kwargs = {"learning_rate": rate if callable(rate) else float(opt.get_config()["learning_rate"])}
    kwargs.update({field: getattr(opt, field) for field in carried})
    if opt.weight_decay is not None:
        kwargs["weight_decay_factor"] = float(opt.weight_decay)
    if opt.clipvalue is not None:
        kwargs["clipvalue"] = float(opt.clipvalue)
    return getattr(_tpu, tpu_name)(**kwargs)
