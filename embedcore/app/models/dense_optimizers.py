"""Optimizers for the dense (non-embedding) parameters: :class:`SGD`, :class:`Adagrad`, :class:`Adam`.

Unlike the embedding optimizers (per-row functions compiled with Numba, applied to touched rows only),
these update whole NumPy arrays in place. An optimizer is bound to a set of named parameters by
``initialize(params)`` (done by ``step`` on first use), which creates its slots: one array per slot and
parameter, named ``"{slot}.{parameter}"``. ``state_dict()`` returns copies of the slots plus ``"step"``
(int64 ``[1]``, the number of updates made); ``load_state_dict`` copies such a dict back. Arithmetic is
done in each parameter's dtype, with the scalar coefficients computed in float64 first.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping

import numpy as np


def _positive(owner: str, name: str, value, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{owner}: {name} must be a {'non-negative' if allow_zero else 'positive'} finite "
                         f"number, got {value!r}")
    return float(value)


def _unit_interval(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return float(value)


class DenseOptimizer:
    """Base class: slot bookkeeping, step counting and (de)serialisation.

    Subclasses set ``slot_names`` and ``slot_initial_values`` and implement ``_update(param, grad, slots,
    t)``, which changes ``param`` and the ``slots`` (a tuple, in ``slot_names`` order) in place; ``t`` is
    the 1-based index of the update being made.
    """

    slot_names: tuple[str, ...] = ()
    slot_initial_values: tuple[float, ...] = ()

    def __init__(self, learning_rate: float):
        self.learning_rate = _positive(type(self).__name__, "learning_rate", learning_rate)
        self.iterations = 0
        self._shapes: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._slots: dict[str, np.ndarray] = {}

    # -- binding -------------------------------------------------------------------------------------------
    def initialize(self, params: Mapping[str, np.ndarray]) -> None:
        """Create the slots for ``params`` (name -> array). Calling it again with the same names, shapes
        and dtypes does nothing; different ones raise ``ValueError`` (one optimizer per model)."""
        shapes = {name: (tuple(a.shape), a.dtype) for name, a in params.items()}
        if self._shapes is not None:
            if shapes != self._shapes:
                raise ValueError(f"{type(self).__name__} is already bound to other parameters; "
                                 "use one optimizer instance per model")
            return
        self._shapes = shapes
        for slot, initial in zip(self.slot_names, self.slot_initial_values):
            for name, (shape, dtype) in shapes.items():
                self._slots[f"{slot}.{name}"] = np.full(shape, initial, dtype)

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The live slot arrays, ``"{slot}.{parameter}" -> array``."""
        return dict(self._slots)

    # -- update ----------------------------------------------------------------------------------------------
    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """One update of every parameter in place, from the gradient of the same name."""
        self.initialize(params)
        if set(grads) != set(params):
            raise ValueError(f"{type(self).__name__}: gradients for {sorted(grads)} do not match parameters "
                             f"{sorted(params)}")
        t = self.iterations + 1
        for name, param in params.items():
            grad = np.asarray(grads[name], dtype=param.dtype)
            if grad.shape != param.shape:
                raise ValueError(f"{type(self).__name__}: gradient {name!r} has shape {grad.shape}, "
                                 f"parameter {param.shape}")
            slots = tuple(self._slots[f"{slot}.{name}"] for slot in self.slot_names)
            self._update(param, grad, slots, t)
        self.iterations = t

    def _update(self, param: np.ndarray, grad: np.ndarray, slots: tuple, t: int) -> None:
        raise NotImplementedError

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the slots, plus ``"step"``: int64 array ``[1]``, the number of updates made."""
        out = {"step": np.array([self.iterations], np.int64)}
        out.update({name: a.copy() for name, a in self._slots.items()})
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Copy ``state`` (as from ``state_dict``) into this optimizer. It must be bound already (or bind
        it first with ``initialize``); the keys and shapes must match exactly."""
        if self._shapes is None and self.slot_names:
            raise RuntimeError(f"{type(self).__name__}: initialize(params) before load_state_dict")
        expected = {"step", *self._slots}
        if set(state) != expected:
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing keys {missing}, "
                             f"unexpected keys {unexpected}")
        step = np.asarray(state["step"])
        if step.size != 1 or not np.issubdtype(step.dtype, np.integer) or int(step.reshape(())) < 0:
            raise ValueError(f"{type(self).__name__}.load_state_dict: 'step' must be one non-negative "
                             f"integer, got {state['step']!r}")
        for name, dst in self._slots.items():
            src = np.asarray(state[name])
            if src.shape != dst.shape:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {name!r} has shape {src.shape}, "
                                 f"expected {dst.shape}")
        for name, dst in self._slots.items():
            np.copyto(dst, state[name], casting="same_kind")
        self.iterations = int(step.reshape(()))


class SGD(DenseOptimizer):
    """Plain gradient descent: ``w <- w - lr * g``. No slots."""

    def __init__(self, learning_rate: float = 0.01):
        super().__init__(learning_rate)

    def _update(self, param, grad, slots, t):
        param -= param.dtype.type(self.learning_rate) * grad


class Adagrad(DenseOptimizer):
    """Adagrad: ``a <- a + g^2;  w <- w - lr * g / (sqrt(a) + epsilon)``, ``a`` starting at
    ``initial_accumulator_value``. Slot ``accumulators``."""

    slot_names = ("accumulators",)

    def __init__(self, learning_rate: float = 0.01, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7):
        super().__init__(learning_rate)
        self.initial_accumulator_value = _positive("Adagrad", "initial_accumulator_value",
                                                   initial_accumulator_value, allow_zero=True)
        self.epsilon = _positive("Adagrad", "epsilon", epsilon)
        self.slot_initial_values = (self.initial_accumulator_value,)

    def _update(self, param, grad, slots, t):
        (acc,) = slots
        f = param.dtype.type
        acc += grad * grad
        param -= f(self.learning_rate) * grad / (np.sqrt(acc) + f(self.epsilon))


class Adam(DenseOptimizer):
    """Adam with the bias correction folded into the step size (Kingma & Ba, section 2; Keras' form):

        m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
        lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)
        w <- w - lr_t * m / (sqrt(v) + epsilon)

    ``t`` counts updates from 1. Equivalently ``w <- w - lr * m_hat / (sqrt(v_hat) + epsilon / sqrt(1 - b2^t))``
    with ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)``. Slots ``momenta`` (m) and ``velocities`` (v)
    start at 0.
    """

    slot_names = ("momenta", "velocities")
    slot_initial_values = (0.0, 0.0)

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7):
        super().__init__(learning_rate)
        self.beta_1 = _unit_interval("Adam", "beta_1", beta_1)
        self.beta_2 = _unit_interval("Adam", "beta_2", beta_2)
        self.epsilon = _positive("Adam", "epsilon", epsilon)

    def _update(self, param, grad, slots, t):
        m, v = slots
        f = param.dtype.type
        b1, b2 = self.beta_1, self.beta_2
        lr_t = self.learning_rate * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
        m *= f(b1)
        m += f(1.0 - b1) * grad
        v *= f(b2)
        v += f(1.0 - b2) * (grad * grad)
        param -= f(lr_t) * m / (np.sqrt(v) + f(self.epsilon))
