"""Optimizers: the per-row function contract, ``CustomOptimizer``, and the built-ins written in it.

Every optimizer is a per-row function

    f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)
        -> new_row                               (no slots)
        -> (new_row, new_slot_0, new_slot_1, ...)

applied to each row a batch touched, with ``gradient`` the row's summed gradient, ``slot_variables`` the
row's slot values in ``slot_names`` order (a full row for ``slot_dims`` entry 2, one float32 for entry 1),
and ``learning_rate`` and ``hyperparameters`` float32 values evaluated once per ``apply_gradients``. Built-in
optimizers are such functions with fixed hyperparameters, so one kernel path serves all of them.

The built-ins follow TensorFlow's TPU embedding optimizers (``tf.tpu.experimental.embedding``); their common
options act, in this order: gradient clipping (``clipvalue``), decoupled weight decay of the touched rows
(``w <- w - weight_decay * w``, the factor multiplied by the learning rate if asked), the optimizer's own
update, then weight clipping (``clip_weight_min`` / ``clip_weight_max``).
"""

from __future__ import annotations

import inspect
import math
import numbers

import numpy as np

from . import compiler, translate
from .common_options import (COMMON_NAMES, N_COMMON, check_common_options, clip, common_values, enabled_options,
                             with_common_options)
from .initializers import FLOAT32_MAX, Initializer, finite_float32

__all__ = ["Optimizer", "CustomOptimizer", "SGD", "Adagrad", "AdagradMomentum", "Adam", "FTRL",
           "RowwiseAdagrad", "ExactAdagrad", "ExactRowwiseAdagrad"]


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _evaluate(value, what: str, owner) -> np.float32:
    """A float or zero-argument callable, as a float32 that is finite (``ValueError`` naming ``owner``, ``what``
    and the value otherwise: ``1e39`` is finite in Python, ``inf`` in float32)."""
    result = value() if callable(value) else value
    try:
        result = float(result)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{owner!r}: {what} must evaluate to a float, got {result!r:.80}") from None
    return _finite_value(result, what, owner)


def _finite_value(result, what: str, owner) -> np.float32:
    """``result`` as float32, refused with ``ValueError`` naming ``owner`` and ``what`` unless finite there."""
    with np.errstate(over="ignore", invalid="ignore"):
        stored = np.float32(result)
    if not np.isfinite(stored):
        raise ValueError(f"{owner!r}: {what} evaluated to {result}, which is not finite in float32 "
                         f"(|x| <= {FLOAT32_MAX:.7g}); nothing was changed")
    return stored


def _check_float_or_callable(value, what: str):
    if not (callable(value) or _is_number(value)):
        raise ValueError(f"{what} must be a float or a zero-argument callable. Received: {value!r}")
    if not callable(value):
        finite_float32(value, what)
        return
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is, once per step
        return
    try:
        signature.bind()
    except TypeError as exc:  # e.g. ``lambda step: ...``: it would fail at the first step, not here
        raise ValueError(f"{what} must be a float or a zero-argument callable; {value!r:.80} cannot be called "
                         f"without arguments: {exc}") from None


def _check_finite(owner: str, positive=(), **values):
    """Each of ``values`` (None allowed) finite in float32, those named in ``positive`` also > 0 there (a
    positive epsilon of 1e-50 is 0 in float32 and would divide by zero); ``ValueError`` naming ``owner``."""
    for what, value in values.items():
        if value is None:
            continue
        finite_float32(value, f"{owner}: {what}")
        if what in positive and not np.float32(value) > 0:
            raise ValueError(f"{owner}: {what} must be positive in float32, got {value!r} (0 as float32)")


class Optimizer:
    """Base class: slots, a learning rate, hyperparameters and a per-row function.

    Subclasses set ``slot_names``, ``slot_initializers``, ``slot_dims``, ``learning_rate`` and implement
    :meth:`row_function` and :meth:`hyperparameter_values`. Equality and hashing are by value (callables by
    identity): equal optimizers on tables of equal ``dim`` share one stacked physical table.
    """

    slot_names: tuple = ()
    slot_initializers: tuple = ()
    slot_dims: tuple = ()
    learning_rate = 0.01
    lazy = True  # False: every row is updated each step, untouched rows with a zero gradient

    def row_function(self):
        """The per-row Python function (compiled with Numba by the engine)."""
        raise NotImplementedError

    def hyperparameter_values(self, step: int, learning_rate: np.float32) -> tuple:
        """This step's hyperparameters as float32 values; ``step`` is the engine's step being applied (it
        counts ``apply_gradients`` calls from 1, whichever rows they touch) and ``learning_rate`` is this
        step's configured learning rate (already evaluated)."""
        raise NotImplementedError

    def learning_rate_value(self, step: int, configured: np.float32) -> np.float32:
        """This step's learning rate as seen by the row function, from the ``configured`` one."""
        return configured

    def step_values(self, step: int):
        """``(learning_rate, hyperparameters)`` for ``step``, each callable called exactly once.

        Raises ``ValueError`` naming the optimizer and the value when the learning rate (as configured, or as
        the row function sees it, e.g. Adam's bias-corrected one) or a hyperparameter is not finite in
        float32; the engine evaluates these before it changes anything.
        """
        configured = _evaluate(self.learning_rate, "learning_rate", self)
        learning_rate = _finite_value(self.learning_rate_value(step, configured),
                                      f"the learning rate of step {step}", self)
        return learning_rate, self.hyperparameter_values(step, configured)

    def _check_constants(self):
        """With a constant learning rate, this step's values (derived ones too: ``-1 / exponent``, a bias
        correction, a decay times the learning rate) are checked at construction, not at the first step."""
        if not callable(self.learning_rate) and not any(callable(h) for h in getattr(self, "hyperparameters", ())):
            self.step_values(1)

    def compiled(self, dim: int) -> compiler.CompiledRowFunction:
        """The compiled row function for rows of ``dim`` values (cached per process)."""
        return compiler.compile_cached(self.row_function(), self.slot_dims, self.n_hyperparameters, dim)

    @property
    def n_hyperparameters(self) -> int:
        raise NotImplementedError

    def explain(self, dim: int = 8) -> str:
        """How the engine runs this optimizer's row function, and why."""
        c = self.compiled(dim)
        how = ("element by element, inlined" if c.elementwise else
               "once per row, its reductions first, then element by element in place" if c.split else
               "once per row, on row views")
        return f"{compiler.describe(c.python_function)} runs {how}: {c.reason}"

    def __deepcopy__(self, memo):
        """The optimizer itself: it is an immutable configuration whose functions and callable rates are shared
        by a copy anyway (a learning rate reading a ``tf.Variable`` must go on reading that variable, and a
        traced ``tf.function`` cannot be deep-copied)."""
        return self

    def _key(self):
        return (type(self), tuple(sorted(vars(self).items())))

    def __eq__(self, other):
        return isinstance(other, Optimizer) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def _check_slot_initializer(value, where):
    if _is_number(value):
        return finite_float32(value, where)
    if isinstance(value, Initializer) or callable(value):
        return value  # a callable's values are checked as they are written (initializers.fill_rows)
    raise ValueError(f"{where} must be a float, an embedcore initializer or a callable(shape, dtype). "
                     f"Received: {value!r}")


class CustomOptimizer(Optimizer):
    """An optimizer given as a per-row Python function (as ``tf.tpu.experimental.embedding.CustomOptimizer``).

    Args:
        custom_computation: ``f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)``
            written with NumPy; see the module docstring for the contract. It may start with
            ``del slot_variables, hyperparameters`` as in TensorFlow's examples. A ``tf.function``, a
            function of TensorFlow ops or one over ``jax.numpy`` is translated to a NumPy row function once
            (:mod:`embedcore.translate`, which also says how the framework is recognised).
        learning_rate: a float or a zero-argument callable, evaluated once per ``apply_gradients``.
        slot_names: names of the optimizer's slot variables.
        slot_initializers: one per slot: a float constant, an :mod:`embedcore.initializers` object, or a
            callable ``(shape, dtype)``.
        hyperparameters: floats or zero-argument callables, passed to the function as a tuple of float32.
        slot_dims: one per slot: 2 (a full row per table row, the default) or 1 (one value per row).
    """

    def __init__(self, custom_computation, learning_rate=0.01, slot_names=None, slot_initializers=None,
                 hyperparameters=None, slot_dims=None):
        if not callable(custom_computation):
            raise compiler.RowFunctionError(f"custom_computation must be callable. Received: {custom_computation!r}")
        framework = translate.framework_of(custom_computation)
        if framework == "numpy":
            compiler.check_row_function(custom_computation)
        owner = f"CustomOptimizer({compiler.describe(translate.python_function(custom_computation))})"
        _check_float_or_callable(learning_rate, f"{owner}: learning_rate")
        slot_names = tuple(slot_names or ())
        slot_initializers = tuple(slot_initializers or ())
        if len(slot_names) != len(slot_initializers):
            raise ValueError(f"The number of slot_names ({len(slot_names)}) must match the number of "
                             f"slot_initializers ({len(slot_initializers)}).")
        for name in slot_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"slot_names must be non-empty strings. Received: {name!r}")
        if len(set(slot_names)) != len(slot_names):
            raise ValueError(f"slot_names must be unique. Received: {list(slot_names)}")
        slot_dims = (2,) * len(slot_names) if slot_dims is None else tuple(slot_dims)
        if len(slot_dims) != len(slot_names):
            raise ValueError(f"The number of slot_dims ({len(slot_dims)}) must match the number of "
                             f"slot_names ({len(slot_names)}).")
        for d in slot_dims:
            if d not in (1, 2) or isinstance(d, bool):
                raise ValueError(f"slot_dims entries must be 1 (one value per row) or 2 (a full row). "
                                 f"Received: {list(slot_dims)}")
        hyperparameters = tuple(hyperparameters or ())
        for k, h in enumerate(hyperparameters):
            _check_float_or_callable(h, f"{owner}: hyperparameters[{k}]")
        self.custom_computation = custom_computation
        self.learning_rate = learning_rate
        self.slot_names = slot_names
        self.slot_initializers = tuple(_check_slot_initializer(v, f"{owner}: slot_initializers[{k}]")
                                       for k, v in enumerate(slot_initializers))
        self.slot_dims = tuple(int(d) for d in slot_dims)
        self.hyperparameters = hyperparameters
        # traced with this optimizer's slot_dims and number of hyperparameters; a NumPy function is itself
        self._row_function = translate.to_numpy_row_function(custom_computation, self.slot_dims,
                                                             len(hyperparameters), framework=framework)
        self._check_constants()

    def row_function(self):
        return self._row_function

    @property
    def n_hyperparameters(self):
        return len(self.hyperparameters)

    def hyperparameter_values(self, step, learning_rate):
        return tuple(_evaluate(h, f"hyperparameters[{k}]", self) for k, h in enumerate(self.hyperparameters))


# ----------------------------------------------------------------------------------------------------------
# Built-in optimizers: each a recipe, the optimizer's own update as a per-row function whose parameters after
# the contract's first four are hyperparameters by name. The compiler binds those names to the tuple's
# constant indices (:func:`embedcore.compiler.bind_recipe`, Numba indexes tuples only with constants), and
# :mod:`embedcore.common_options` composes TensorFlow's common options around it.


def sgd(gradient, embedding_table, slot_variables, learning_rate):
    """``w <- w - lr * g``."""
    return embedding_table - learning_rate * gradient


def adagrad(gradient, embedding_table, slot_variables, learning_rate):
    """``a <- a + g^2;  w <- w - lr * g / sqrt(a)``."""
    accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator


def adagrad_momentum(gradient, embedding_table, slot_variables, learning_rate, momentum, use_nesterov,
                     negative_inverse_exponent, accumulator_keep, accumulator_add, epsilon):
    """``a <- keep a + add g^2`` with ``(keep, add)`` = (1, 1) if beta2 == 1 else (beta2, 1 - beta2);
    ``s = (a + eps)^(-1/exponent) g``;  ``m <- momentum m + s``;
    ``w <- w - lr * (momentum m + s if use_nesterov else m)`` (``use_nesterov`` is 0 or 1)."""
    g = gradient
    accumulator = accumulator_keep * slot_variables[0] + accumulator_add * g * g
    scaled = np.power(accumulator + epsilon, negative_inverse_exponent) * g
    m = momentum * slot_variables[1] + scaled
    step = use_nesterov * (momentum * m + scaled) + (1 - use_nesterov) * m
    return embedding_table - learning_rate * step, accumulator, m


def adam(gradient, embedding_table, slot_variables, learning_rate, beta_1, beta_2, epsilon, sum_inside_sqrt):
    """``m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  w <- w - lr_t m / d`` with
    ``d = sqrt(v + eps^2)`` (``sum_inside_sqrt`` 1) or ``sqrt(v) + eps`` (0); ``lr_t`` is the learning rate
    the optimizer hands over (with its bias correction folded in, if it has one)."""
    g = gradient
    m = beta_1 * slot_variables[0] + (1.0 - beta_1) * g
    v = beta_2 * slot_variables[1] + (1.0 - beta_2) * g * g
    denominator = np.sqrt(v + sum_inside_sqrt * epsilon * epsilon) + (1.0 - sum_inside_sqrt) * epsilon
    return embedding_table - learning_rate * m / denominator, m, v


def ftrl(gradient, embedding_table, slot_variables, learning_rate, negative_learning_rate_power,
         l1_regularization_strength, l2_regularization_strength, beta, multiply_linear_by_learning_rate):
    """With ``p = -learning_rate_power``, ``a' = a + g^2``, ``delta = a'^p - a^p``:
    ``L <- L + g - delta w / lr``; ``w <- (clip(L, -l1, l1) - L) / ((a'^p + beta) / lr + 2 l2)``;
    with ``multiply_linear_by_learning_rate``: ``L <- L + lr g - delta w``;
    ``w <- (clip(L, -lr l1, lr l1) - L) / (a'^p + 2 lr l2 + beta)``."""
    g, w = gradient, embedding_table
    l1, l2 = l1_regularization_strength, l2_regularization_strength
    accumulator = slot_variables[0]
    new_accumulator = accumulator + g * g
    new_power = np.power(new_accumulator, negative_learning_rate_power)
    delta = new_power - np.power(accumulator, negative_learning_rate_power)
    if multiply_linear_by_learning_rate > 0.0:
        linear = slot_variables[1] + learning_rate * g - delta * w
        limit = learning_rate * l1
        new_w = (clip(linear, -limit, limit) - linear) / (new_power + 2.0 * learning_rate * l2 + beta)
    else:
        linear = slot_variables[1] + g - delta * w / learning_rate
        new_w = (clip(linear, -l1, l1) - linear) / ((new_power + beta) / learning_rate + 2.0 * l2)
    return new_w, new_accumulator, linear


def rowwise_adagrad(gradient, embedding_table, slot_variables, learning_rate, epsilon):
    """``a <- a + mean(g^2)`` (one value per row);  ``w <- w - (lr / (sqrt(a) + eps)) * g``.

    The squares (float32) are summed in float64, in the split rewrite's fixed eight-lane order
    (:mod:`embedcore.split_reductions`, which runs this recipe as one reduction, then one in-place loop).
    """
    mean_square = np.float32(np.sum(gradient * gradient, dtype=np.float64) / gradient.size)
    accumulator = slot_variables[0] + mean_square
    scale = learning_rate / (np.sqrt(accumulator) + epsilon)
    return embedding_table - scale * gradient, accumulator


def exact_adagrad(gradient, embedding_table, slot_variables, learning_rate, epsilon):
    """FBGEMM's ``EXACT_ADAGRAD``: ``a <- a + g^2;  w <- w - lr * g / (sqrt(a) + eps)``."""
    accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + epsilon), accumulator


def exact_rowwise_adagrad(gradient, embedding_table, slot_variables, learning_rate, epsilon, decay, l2, decoupled):
    """FBGEMM's ``EXACT_ROWWISE_ADAGRAD``: with ``g' = g + l2 * decay * w``, ``a <- a + mean(g'^2)``,
    ``m = lr / (sqrt(a) + eps)``, ``w <- (1 - l2 * m * decay - decoupled * lr * decay) * w - m * g``
    (``l2`` / ``decoupled``: 1 for FBGEMM's weight-decay mode L2 / DECOUPLE, else 0)."""
    decayed = gradient + (l2 * decay) * embedding_table
    mean_square = np.float32(np.sum(decayed * decayed, dtype=np.float64) / gradient.size)
    accumulator = slot_variables[0] + mean_square
    multiplier = learning_rate / (np.sqrt(accumulator) + epsilon)
    correction = 1.0 - l2 * multiplier * decay - decoupled * learning_rate * decay
    return correction * embedding_table - multiplier * gradient, accumulator


def _common_arguments(arguments: dict) -> dict:
    """The common options among a constructor's ``locals()``."""
    return {k: arguments[k] for k in _COMMON_ARGUMENTS if k in arguments}


_COMMON_ARGUMENTS = tuple(inspect.signature(check_common_options).parameters)[1:]


class _BuiltinOptimizer(Optimizer):
    """A recipe, its named hyperparameters, and TensorFlow's common options (the first five)."""

    _recipe = None
    _hyperparameter_names = ()  # the recipe's own, in tuple order after the common five
    _descriptions = {}          # how messages call a hyperparameter, where its name is not what users set

    def __init__(self, learning_rate, common):
        name = type(self).__name__
        _check_float_or_callable(learning_rate, f"{name}: learning_rate")
        self.learning_rate = learning_rate
        for attribute, value in check_common_options(name, **common).items():
            setattr(self, attribute, value)

    def row_function(self):
        return with_common_options(type(self)._recipe, self._hyperparameter_names, **enabled_options(self))

    @property
    def n_hyperparameters(self):
        return N_COMMON + len(self._hyperparameter_names)

    def _own_hyperparameters(self, step) -> dict:
        """This step's values of the recipe's own hyperparameters, by name."""
        return {}

    def hyperparameter_values(self, step, learning_rate):
        common = common_values(self, learning_rate)
        _finite_value(common["weight_decay"], "weight_decay_factor (times the learning rate)" if
                      self.multiply_weight_decay_factor_by_learning_rate else "weight_decay_factor", self)
        own = self._own_hyperparameters(step)
        for k, name in enumerate(self._hyperparameter_names):
            _finite_value(own[name], f"{self._descriptions.get(name, name)} (hyperparameter {N_COMMON + k} of its "
                                     f"row function)", self)
        values = [common[n] for n in COMMON_NAMES] + [own[n] for n in self._hyperparameter_names]
        return tuple(np.float32(v) for v in values)


_COMMON_DOC = """
    Common options (as TensorFlow's): ``use_gradient_accumulation`` (gradients of duplicate ids are always
    summed before the update; ``False`` only forbids ``clipvalue``, as in TensorFlow), ``clip_weight_min`` /
    ``clip_weight_max``, ``weight_decay_factor``, ``multiply_weight_decay_factor_by_learning_rate``,
    ``clipvalue`` (a float c for [-c, c], or a ``(min, max)`` tuple whose entries may be None)."""


class SGD(_BuiltinOptimizer):
    __doc__ = """Stochastic gradient descent: ``w <- w - lr * g``.""" + _COMMON_DOC
    _recipe = sgd

    def __init__(self, learning_rate=0.01, use_gradient_accumulation=True, clip_weight_min=None,
                 clip_weight_max=None, weight_decay_factor=None, multiply_weight_decay_factor_by_learning_rate=None,
                 clipvalue=None, low_dimensional_packing_status=False):
        super().__init__(learning_rate, _common_arguments(locals()))
        self._check_constants()


class Adagrad(_BuiltinOptimizer):
    __doc__ = """Adagrad: ``a <- a + g^2;  w <- w - lr * g / sqrt(a)``, ``a`` starting at
    ``initial_accumulator_value`` (> 0).""" + _COMMON_DOC
    _recipe = adagrad
    slot_names = ("accumulators",)
    slot_dims = (2,)

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, use_gradient_accumulation=True,
                 clip_weight_min=None, clip_weight_max=None, weight_decay_factor=None,
                 multiply_weight_decay_factor_by_learning_rate=None, slot_variable_creation_fn=None,
                 clipvalue=None, low_dimensional_packing_status=False):
        super().__init__(learning_rate, _common_arguments(locals()))
        if not _is_number(initial_accumulator_value) or initial_accumulator_value <= 0:
            raise ValueError(f"Adagrad initial_accumulator_value must be a positive float, got "
                             f"{initial_accumulator_value!r}.")
        _check_finite("Adagrad", positive=("initial_accumulator_value",),
                      initial_accumulator_value=initial_accumulator_value)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.slot_initializers = (self.initial_accumulator_value,)
        self._check_constants()


class AdagradMomentum(_BuiltinOptimizer):
    __doc__ = """Adagrad with momentum (TensorFlow's TPU formula):
    ``a <- a + g^2`` if beta2 == 1 else ``beta2 a + (1 - beta2) g^2``;  ``s = (a + epsilon)^(-1/exponent) g``;
    ``m <- momentum m + s``;  ``w <- w - lr * (momentum m + s)`` with Nesterov, else ``w - lr * m``.
    Slots ``accumulators`` and ``momenta`` start at 0.""" + _COMMON_DOC
    _recipe = adagrad_momentum
    _hyperparameter_names = ("momentum", "use_nesterov", "negative_inverse_exponent", "accumulator_keep",
                             "accumulator_add", "epsilon")
    _descriptions = {"negative_inverse_exponent": "-1 / exponent", "accumulator_keep": "beta2",
                     "accumulator_add": "1 - beta2"}
    slot_names = ("accumulators", "momenta")
    slot_dims = (2, 2)
    slot_initializers = (0.0, 0.0)

    def __init__(self, learning_rate=0.001, momentum=0.0, use_nesterov=False, exponent=2, beta2=1,
                 epsilon=1e-10, use_gradient_accumulation=True, clip_weight_min=None, clip_weight_max=None,
                 weight_decay_factor=None, multiply_weight_decay_factor_by_learning_rate=None,
                 slot_variable_creation_fn=None, clipvalue=None, low_dimensional_packing_status=False):
        super().__init__(learning_rate, _common_arguments(locals()))
        if not _is_number(epsilon) or epsilon <= 0:
            raise ValueError(f"Adagrad momentum: epsilon must be positive, got {epsilon!r}")
        if not _is_number(exponent) or exponent <= 0:
            raise ValueError(f"Adagrad momentum: Precondition exponent must be > 0, got {exponent!r}")
        if not _is_number(momentum) or not _is_number(beta2) or not 0 <= beta2 <= 1:
            raise ValueError(f"Adagrad momentum: momentum must be a float and beta2 a float in [0, 1]; got "
                             f"momentum={momentum!r}, beta2={beta2!r}")
        _check_finite("Adagrad momentum", positive=("epsilon", "exponent"), momentum=momentum, exponent=exponent,
                      beta2=beta2, epsilon=epsilon)
        self.momentum, self.use_nesterov = float(momentum), bool(use_nesterov)
        self.exponent, self.beta2, self.epsilon = float(exponent), float(beta2), float(epsilon)
        self._check_constants()

    def _own_hyperparameters(self, step):
        keep, add = (1.0, 1.0) if self.beta2 == 1.0 else (self.beta2, 1.0 - self.beta2)
        return {"momentum": self.momentum, "use_nesterov": float(self.use_nesterov),
                "negative_inverse_exponent": -1.0 / self.exponent, "accumulator_keep": keep,
                "accumulator_add": add, "epsilon": self.epsilon}


class Adam(_BuiltinOptimizer):
    __doc__ = """Adam as TensorFlow's TPU embeddings run it:
    ``m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  w <- w - lr_t * m / d``,
    ``d = sqrt(v + epsilon^2)`` if ``sum_inside_sqrt`` else ``sqrt(v) + epsilon``.

    ``bias_correction=False`` (the default, TensorFlow's): ``lr_t = lr``. TPU embeddings apply no bias
    correction (TensorFlow's ``optimization_parameters.proto``: the hardware does not update Adam's
    hyperparameters; "use the dynamic learning rate feature instead"), so a TensorFlow user who wants it folds
    it into a learning-rate callable, and that callable works here unchanged.
    ``bias_correction=True`` (jax-tpu-embedding's Adam, and embedcore's before this option):
    ``lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)``, ``t`` the engine's step from 1 (:attr:`Embedding.step` after
    the update; it counts ``apply_gradients`` calls, not the updates of each row).

    ``lazy_adam=True`` updates only touched rows; ``False`` updates every row, untouched ones with a zero
    gradient (their moments decay and their weights keep moving). Slots ``momenta``, ``velocities`` start
    at 0.""" + _COMMON_DOC
    _recipe = adam
    _hyperparameter_names = ("beta_1", "beta_2", "epsilon", "sum_inside_sqrt")
    slot_names = ("momenta", "velocities")
    slot_dims = (2, 2)
    slot_initializers = (0.0, 0.0)

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, lazy_adam=True,
                 sum_inside_sqrt=True, use_gradient_accumulation=True, clip_weight_min=None,
                 clip_weight_max=None, weight_decay_factor=None, multiply_weight_decay_factor_by_learning_rate=None,
                 slot_variable_creation_fn=None, clipvalue=None, low_dimensional_packing_status=False,
                 bias_correction=False):
        super().__init__(learning_rate, _common_arguments(locals()))
        if not _is_number(beta_1) or beta_1 < 0.0 or beta_1 >= 1.0:
            raise ValueError(f"Adam: beta_1 must be in [0, 1); got {beta_1!r}.")
        if not _is_number(beta_2) or beta_2 < 0.0 or beta_2 >= 1.0:
            raise ValueError(f"Adam: beta_2 must be in [0, 1); got {beta_2!r}.")
        if not _is_number(epsilon) or epsilon <= 0.0:
            raise ValueError(f"Adam: epsilon must be positive; got {epsilon!r}.")
        if not use_gradient_accumulation and not lazy_adam:
            raise ValueError("Adam: when `use_gradient_accumulation` is False, lazy_adam must be True.")
        if not isinstance(bias_correction, (bool, np.bool_)):
            raise ValueError(f"Adam: bias_correction must be True or False; got {bias_correction!r}.")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        _check_finite("Adam", positive=("epsilon",), epsilon=epsilon)
        self.lazy_adam, self.sum_inside_sqrt = bool(lazy_adam), bool(sum_inside_sqrt)
        self.bias_correction = bool(bias_correction)
        self.lazy = self.lazy_adam
        self._check_constants()

    def learning_rate_value(self, step, configured):
        if not self.bias_correction:
            return configured
        lr = float(configured)
        return np.float32(lr * math.sqrt(1.0 - self.beta_2 ** step) / (1.0 - self.beta_1 ** step))

    def _own_hyperparameters(self, step):
        return {"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                "sum_inside_sqrt": float(self.sum_inside_sqrt)}


class FTRL(_BuiltinOptimizer):
    __doc__ = """FTRL-proximal (TensorFlow's TPU formula; see :func:`ftrl`). Slots ``accumulators`` (start at
    ``initial_accumulator_value`` > 0) and ``linears`` (start at 0).""" + _COMMON_DOC
    _recipe = ftrl
    _hyperparameter_names = ("negative_learning_rate_power", "l1_regularization_strength",
                             "l2_regularization_strength", "beta", "multiply_linear_by_learning_rate")
    _descriptions = {"negative_learning_rate_power": "-learning_rate_power"}
    slot_names = ("accumulators", "linears")
    slot_dims = (2, 2)

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5, l1_regularization_strength=0.0,
                 l2_regularization_strength=0.0, beta=0.0, initial_accumulator_value=0.1,
                 use_gradient_accumulation=True, clip_weight_min=None, clip_weight_max=None,
                 weight_decay_factor=None, multiply_weight_decay_factor_by_learning_rate=None,
                 slot_variable_creation_fn=None, clipvalue=None, multiply_linear_by_learning_rate=False,
                 allow_zero_accumulator=False, low_dimensional_packing_status=False):
        super().__init__(learning_rate, _common_arguments(locals()))
        if not _is_number(initial_accumulator_value) or initial_accumulator_value <= 0:
            raise ValueError(f"FTRL: initial_accumulator_value must be a positive float, got "
                             f"{initial_accumulator_value!r}.")
        if not _is_number(learning_rate_power) or learning_rate_power > 0:
            raise ValueError(f"FTRL: learning_rate_power must be <= 0, got {learning_rate_power!r}.")
        for what, v in (("l1_regularization_strength", l1_regularization_strength),
                        ("l2_regularization_strength", l2_regularization_strength), ("beta", beta)):
            if not _is_number(v) or v < 0:
                raise ValueError(f"FTRL: {what} must be a float >= 0, got {v!r}.")
        self.learning_rate_power = float(learning_rate_power)
        self.l1_regularization_strength = float(l1_regularization_strength)
        self.l2_regularization_strength = float(l2_regularization_strength)
        self.beta = float(beta)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.multiply_linear_by_learning_rate = bool(multiply_linear_by_learning_rate)
        self.allow_zero_accumulator = bool(allow_zero_accumulator)
        _check_finite("FTRL", positive=("initial_accumulator_value",), learning_rate_power=learning_rate_power,
                      l1_regularization_strength=l1_regularization_strength,
                      l2_regularization_strength=l2_regularization_strength, beta=beta,
                      initial_accumulator_value=initial_accumulator_value)
        self.slot_initializers = (self.initial_accumulator_value, 0.0)
        self._check_constants()

    def _own_hyperparameters(self, step):
        return {"negative_learning_rate_power": -self.learning_rate_power,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength, "beta": self.beta,
                "multiply_linear_by_learning_rate": float(self.multiply_linear_by_learning_rate)}


class RowwiseAdagrad(_BuiltinOptimizer):
    __doc__ = """Row-wise Adagrad, the recommender-industry default: one accumulator per row,
    ``a <- a + mean(g^2);  w <- w - lr * g / (sqrt(a) + epsilon)``; ``a`` starts at
    ``initial_accumulator_value``. With 0 and ``epsilon > 0`` this is FBGEMM's ``EXACT_ROWWISE_ADAGRAD``.
    One of ``initial_accumulator_value`` and ``epsilon`` must be positive.""" + _COMMON_DOC
    _recipe = rowwise_adagrad
    _hyperparameter_names = ("epsilon",)
    slot_names = ("accumulators",)
    slot_dims = (1,)

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=0.0,
                 use_gradient_accumulation=True, clip_weight_min=None, clip_weight_max=None,
                 weight_decay_factor=None, multiply_weight_decay_factor_by_learning_rate=None,
                 clipvalue=None, low_dimensional_packing_status=False):
        super().__init__(learning_rate, _common_arguments(locals()))
        if not _is_number(initial_accumulator_value) or initial_accumulator_value < 0:
            raise ValueError(f"RowwiseAdagrad: initial_accumulator_value must be a float >= 0, got "
                             f"{initial_accumulator_value!r}.")
        if not _is_number(epsilon) or epsilon < 0:
            raise ValueError(f"RowwiseAdagrad: epsilon must be a float >= 0, got {epsilon!r}.")
        if initial_accumulator_value == 0 and epsilon == 0:
            raise ValueError("RowwiseAdagrad: initial_accumulator_value and epsilon cannot both be 0 "
                             "(the first update would divide by zero).")
        _check_finite("RowwiseAdagrad", initial_accumulator_value=initial_accumulator_value, epsilon=epsilon)
        if np.float32(initial_accumulator_value) == 0 and np.float32(epsilon) == 0:
            raise ValueError(f"RowwiseAdagrad: initial_accumulator_value and epsilon cannot both be 0 in float32 "
                             f"(the first update would divide by zero); got {initial_accumulator_value!r} and "
                             f"{epsilon!r}")
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.epsilon = float(epsilon)
        self.slot_initializers = (self.initial_accumulator_value,)
        self._check_constants()

    def _own_hyperparameters(self, step):
        return {"epsilon": self.epsilon}


def _check_eps(name: str, eps):
    if not _is_number(eps) or eps <= 0:
        raise ValueError(f"{name}: eps must be a positive float (the accumulators start at 0), got {eps!r}.")
    _check_finite(name, positive=("eps",), eps=eps)
    return float(eps)


class ExactAdagrad(_BuiltinOptimizer):
    """FBGEMM's ``EXACT_ADAGRAD`` (TorchRec's Adagrad): ``a <- a + g^2;  w <- w - lr * g / (sqrt(a) + eps)``,
    ``a`` starting at 0. Defaults as FBGEMM's table-batched embeddings: ``learning_rate=0.01``,
    ``eps=1e-8``. (:class:`Adagrad` is TensorFlow's: no ``eps``, ``a`` starting at 0.1.)"""
    _recipe = exact_adagrad
    _hyperparameter_names = ("epsilon",)
    slot_names = ("accumulators",)
    slot_dims = (2,)

    def __init__(self, learning_rate=0.01, eps=1.0e-8):
        super().__init__(learning_rate, {})
        self.eps = _check_eps("ExactAdagrad", eps)
        self.slot_initializers = (0.0,)
        self._check_constants()

    def _own_hyperparameters(self, step):
        return {"epsilon": self.eps}


_WEIGHT_DECAY_MODES = ("none", "l2", "decoupled")


class ExactRowwiseAdagrad(_BuiltinOptimizer):
    """FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (TorchRec's row-wise Adagrad), one accumulator per row from 0:
    ``g' = g + wd * w`` with ``weight_decay_mode="l2"`` (else ``g``); ``a <- a + mean(g'^2)``;
    ``m = lr / (sqrt(a) + eps)``; ``w <- w - m * g'`` (``"l2"``), ``w <- (1 - lr * wd) * w - m * g``
    (``"decoupled"``, FBGEMM's DECOUPLE) or ``w <- w - m * g`` (``"none"``). Defaults as FBGEMM's:
    ``learning_rate=0.01``, ``eps=1e-8``, ``weight_decay=0``, ``weight_decay_mode="none"``."""
    _recipe = exact_rowwise_adagrad
    _hyperparameter_names = ("epsilon", "decay", "l2", "decoupled")
    _descriptions = {"decay": "weight_decay"}
    slot_names = ("accumulators",)
    slot_dims = (1,)

    def __init__(self, learning_rate=0.01, eps=1.0e-8, weight_decay=0.0, weight_decay_mode="none"):
        super().__init__(learning_rate, {})
        self.eps = _check_eps("ExactRowwiseAdagrad", eps)
        if not _is_number(weight_decay) or weight_decay < 0:
            raise ValueError(f"ExactRowwiseAdagrad: weight_decay must be a float >= 0, got {weight_decay!r}.")
        _check_finite("ExactRowwiseAdagrad", weight_decay=weight_decay)
        if weight_decay_mode not in _WEIGHT_DECAY_MODES:
            raise ValueError(f"ExactRowwiseAdagrad: weight_decay_mode must be one of {_WEIGHT_DECAY_MODES}, got "
                             f"{weight_decay_mode!r}.")
        self.weight_decay, self.weight_decay_mode = float(weight_decay), weight_decay_mode
        self.slot_initializers = (0.0,)
        self._check_constants()

    def _own_hyperparameters(self, step):
        return {"epsilon": self.eps, "decay": self.weight_decay,
                "l2": float(self.weight_decay_mode == "l2"), "decoupled": float(self.weight_decay_mode == "decoupled")}
