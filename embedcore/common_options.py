"""The options every built-in optimizer shares, composed around its per-row recipe only where enabled.

TensorFlow's TPU embedding optimizers take the same four options; they act in this order around the
optimizer's own update (its *recipe*, a per-row function of the contract in :mod:`embedcore.optimizers`):

1. gradient clipping: ``g <- clip(g, clip_gradient_min, clip_gradient_max)``;
2. decoupled weight decay of the touched rows: ``w <- w - weight_decay * w``;
3. the recipe: ``(w', slots') = recipe(g, w, slots, lr, hyperparameters)``;
4. weight clipping: ``w' <- clip(w', clip_weight_min, clip_weight_max)``.

Their values are the first five hyperparameters ``(clip_gradient_min, clip_gradient_max, weight_decay,
clip_weight_min, clip_weight_max)``; a recipe's own start at index 5. :func:`with_common_options` builds the
row function with only the enabled steps, so an optimizer without clipping or decay computes none of it
(each step costs as much arithmetic as a cheap optimizer's whole update).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

__all__ = ["N_COMMON", "clip", "with_common_options"]

N_COMMON = 5


@njit(inline="always")
def clip(x, low, high):
    return np.minimum(np.maximum(x, low), high)


@njit(inline="always")
def _unchanged(value, hyperparameters):
    return value


@njit(inline="always")
def _clip_gradient(gradient, hyperparameters):
    return clip(gradient, hyperparameters[0], hyperparameters[1])


@njit(inline="always")
def _decay_weights(embedding_table, hyperparameters):
    return embedding_table - hyperparameters[2] * embedding_table


def _clip_new_row(out, hyperparameters):
    """A recipe's result with its new row (the result, or the first entry of a tuple) clipped."""
    raise NotImplementedError("only callable from jitted code")


@overload(_clip_new_row, inline="always")
def _clip_new_row_impl(out, hyperparameters):
    if not isinstance(out, types.BaseTuple):
        def impl_row(out, hyperparameters):
            return clip(out, hyperparameters[3], hyperparameters[4])
        return impl_row
    if len(out) == 2:
        def impl_one_slot(out, hyperparameters):
            return clip(out[0], hyperparameters[3], hyperparameters[4]), out[1]
        return impl_one_slot
    if len(out) == 3:
        def impl_two_slots(out, hyperparameters):
            return clip(out[0], hyperparameters[3], hyperparameters[4]), out[1], out[2]
        return impl_two_slots
    return None


@njit(inline="always")
def _clip_weights(out, hyperparameters):
    return _clip_new_row(out, hyperparameters)


_COMPOSED: dict = {}


def with_common_options(recipe, clip_gradient: bool, decay: bool, clip_weights: bool):
    """The per-row function that runs ``recipe`` with the enabled common options (the same object for
    the same arguments, so equal optimizers share one compilation)."""
    key = (recipe, bool(clip_gradient), bool(decay), bool(clip_weights))
    row = _COMPOSED.get(key)
    if row is not None:
        return row
    core = njit(inline="always", error_model="numpy")(recipe)
    prepare_gradient = _clip_gradient if clip_gradient else _unchanged
    prepare_weights = _decay_weights if decay else _unchanged
    finish = _clip_weights if clip_weights else _unchanged

    def row(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return finish(core(prepare_gradient(gradient, hyperparameters),
                           prepare_weights(embedding_table, hyperparameters),
                           slot_variables, learning_rate, hyperparameters), hyperparameters)

    enabled = [name for name, on in (("clip_gradient", clip_gradient), ("weight_decay", decay),
                                     ("clip_weights", clip_weights)) if on]
    row.__name__ = recipe.__name__
    row.__qualname__ = recipe.__qualname__ + (f"[{', '.join(enabled)}]" if enabled else "")
    row.__module__ = recipe.__module__
    row.__doc__ = recipe.__doc__
    _COMPOSED[key] = row
    return row
