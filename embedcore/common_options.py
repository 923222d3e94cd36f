"""The options every built-in optimizer shares, as composable rewrites of its per-row recipe.

TensorFlow's TPU embedding optimizers take the same options; they act in this order around the
optimizer's own update (its *recipe*, see :mod:`embedcore.optimizers`):

1. gradient clipping: ``g <- clip(g, clip_gradient_min, clip_gradient_max)``;
2. decoupled weight decay of the touched rows: ``w <- w - weight_decay * w``;
3. the recipe: ``(w', slots') = recipe(g, w, slots, lr, <its named hyperparameters>)``;
4. weight clipping: ``w' <- clip(w', clip_weight_min, clip_weight_max)``.

Their values are the first five hyperparameters, named :data:`COMMON_NAMES`; a recipe's own follow. Each
option is a :class:`~embedcore.compiler.Rewrite` of one value of the recipe, and :func:`with_common_options`
binds a recipe with only the enabled ones, so an optimizer without clipping or decay computes none of it
(each step costs as much arithmetic as a cheap optimizer's whole update). The rewrites are NumPy
expressions, so the element-wise proof and the reduction split see them like the recipe's own code.
:func:`check_common_options` validates the constructor arguments, once for every built-in.
"""

from __future__ import annotations

import numbers

import numpy as np
from numba import njit

from .compiler import Rewrite, bind_recipe
from .initializers import finite_float32

__all__ = ["N_COMMON", "COMMON_NAMES", "CLIP_GRADIENT", "DECAY_WEIGHTS", "CLIP_WEIGHTS", "clip", "enabled_options",
           "with_common_options", "check_common_options", "common_values"]

COMMON_NAMES = ("clip_gradient_min", "clip_gradient_max", "weight_decay", "clip_weight_min", "clip_weight_max")
N_COMMON = len(COMMON_NAMES)

CLIP_GRADIENT = Rewrite("gradient", "np.minimum(np.maximum(x, clip_gradient_min), clip_gradient_max)")
DECAY_WEIGHTS = Rewrite("embedding_table", "x - weight_decay * x")
CLIP_WEIGHTS = Rewrite("new_row", "np.minimum(np.maximum(x, clip_weight_min), clip_weight_max)")


@njit(inline="always")
def clip(x, low, high):
    """``min(max(x, low), high)`` element by element (for recipes; NumPy's definition of clip)."""
    return np.minimum(np.maximum(x, low), high)


_COMPOSED: dict = {}


def with_common_options(recipe, own_names, clip_gradient: bool, decay: bool, clip_weights: bool):
    """The contract's per-row function running ``recipe`` (hyperparameters ``COMMON_NAMES + own_names``) with
    the enabled common options; the same object for the same arguments, so equal optimizers share one
    compilation."""
    key = (recipe, tuple(own_names), bool(clip_gradient), bool(decay), bool(clip_weights))
    row = _COMPOSED.get(key)
    if row is None:
        enabled = [(name, rewrite) for name, rewrite, on in (("clip_gradient", CLIP_GRADIENT, clip_gradient),
                                                             ("weight_decay", DECAY_WEIGHTS, decay),
                                                             ("clip_weights", CLIP_WEIGHTS, clip_weights)) if on]
        row = _COMPOSED[key] = bind_recipe(recipe, COMMON_NAMES + tuple(own_names), [r for _, r in enabled],
                                           label=", ".join(name for name, _ in enabled))
    return row


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_common_options(name, use_gradient_accumulation=True, clip_weight_min=None, clip_weight_max=None,
                         weight_decay_factor=None, multiply_weight_decay_factor_by_learning_rate=None,
                         clipvalue=None, slot_variable_creation_fn=None, low_dimensional_packing_status=False):
    """The common options' attributes for the optimizer called ``name``, validated as TensorFlow does
    (``ValueError`` naming ``name`` otherwise). ``clipvalue`` (a float c for [-c, c], or a ``(min, max)``
    tuple whose entries may be None) becomes ``clip_gradient_min`` / ``clip_gradient_max``."""
    if not use_gradient_accumulation and clipvalue is not None:
        raise ValueError(f"{name}: when `use_gradient_accumulation` is False, gradient clipping cannot be "
                         f"used and `clipvalue` should be left as None. Received: {clipvalue!r}")
    if slot_variable_creation_fn is not None:
        raise ValueError(f"{name}: slot_variable_creation_fn creates TensorFlow variables and is not "
                         f"supported; slots are created by the engine")
    if clipvalue is None:
        bounds = (None, None)
    elif isinstance(clipvalue, tuple):
        if len(clipvalue) != 2:
            raise ValueError(f"{name}: clipvalue must be a float or a (min, max) tuple. Received: {clipvalue!r}")
        bounds = clipvalue
    else:
        if not _is_number(clipvalue) or clipvalue < 0:
            raise ValueError(f"{name}: a scalar clipvalue must be a float >= 0. Received: {clipvalue!r}")
        bounds = (-clipvalue, clipvalue)
    for what, value in (("clipvalue", bounds[0]), ("clipvalue", bounds[1]), ("clip_weight_min", clip_weight_min),
                        ("clip_weight_max", clip_weight_max)):
        if value is not None and not _is_number(value):
            raise ValueError(f"{name}: {what} must be a float or None. Received: {value!r}")
    if None not in bounds and bounds[0] > bounds[1]:
        raise ValueError(f"{name}: clipvalue minimum {bounds[0]} is greater than its maximum {bounds[1]}")
    if clip_weight_min is not None and clip_weight_max is not None and clip_weight_min > clip_weight_max:
        raise ValueError(f"{name}: clip_weight_min ({clip_weight_min}) is greater than clip_weight_max "
                         f"({clip_weight_max})")
    if weight_decay_factor is not None and (not _is_number(weight_decay_factor) or weight_decay_factor < 0):
        raise ValueError(f"{name}: weight_decay_factor must be a float >= 0 or None. "
                         f"Received: {weight_decay_factor!r}")
    # A bound of +-inf means none: say None (the value reaches the row function as a float32).
    for what, value in (("clipvalue_min", bounds[0]), ("clipvalue_max", bounds[1]),
                        ("clip_weight_min", clip_weight_min), ("clip_weight_max", clip_weight_max),
                        ("weight_decay_factor", weight_decay_factor)):
        if value is not None:
            finite_float32(value, f"{name}: {what}")
    return {"use_gradient_accumulation": bool(use_gradient_accumulation),
            "clip_gradient_min": bounds[0], "clip_gradient_max": bounds[1],
            "clip_weight_min": clip_weight_min, "clip_weight_max": clip_weight_max,
            "weight_decay_factor": weight_decay_factor,
            "multiply_weight_decay_factor_by_learning_rate": bool(multiply_weight_decay_factor_by_learning_rate),
            "low_dimensional_packing_status": low_dimensional_packing_status}


def enabled_options(optimizer) -> dict:
    """Which rewrites an optimizer with these attributes needs (the keywords of :func:`with_common_options`)."""
    return {"clip_gradient": optimizer.clip_gradient_min is not None or optimizer.clip_gradient_max is not None,
            "decay": bool(optimizer.weight_decay_factor),
            "clip_weights": optimizer.clip_weight_min is not None or optimizer.clip_weight_max is not None}


def common_values(optimizer, learning_rate) -> dict:
    """This step's values of :data:`COMMON_NAMES` for an optimizer with these attributes (a missing bound
    is +-inf; the decay factor times ``learning_rate`` if asked)."""
    decay = optimizer.weight_decay_factor or 0.0
    if optimizer.multiply_weight_decay_factor_by_learning_rate:
        decay *= float(learning_rate)
    inf = float("inf")
    return {"clip_gradient_min": -inf if optimizer.clip_gradient_min is None else optimizer.clip_gradient_min,
            "clip_gradient_max": inf if optimizer.clip_gradient_max is None else optimizer.clip_gradient_max,
            "weight_decay": decay,
            "clip_weight_min": -inf if optimizer.clip_weight_min is None else optimizer.clip_weight_min,
            "clip_weight_max": inf if optimizer.clip_weight_max is None else optimizer.clip_weight_max}
