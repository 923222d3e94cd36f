"""embedcore with every optimizer written by hand as a ``CustomOptimizer``: the price of programmability.

The same engine and inputs as the ``embedcore`` contender; only the optimizer differs: TensorFlow's two
documented custom computations (SGD and Adagrad, from :mod:`embedcore.quickstart`) and the functions
below, written the way a user ports them (NumPy expressions on rows, no loops), against the built-in
optimizers the ``embedcore`` contender uses. Each computes the
built-in's math, so the two must agree (the harness checks it) and the ratio between them is the cost of a
user-written function.
"""

from __future__ import annotations

import numpy as np

import embedcore as ec
from embedcore.app.quickstart import custom_adagrad, custom_sgd  # TensorFlow's two documented examples

from .embedcore_engine import EmbedcoreContender, fbgemm_adagrad_row


def custom_rowwise_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row (``slot_dims=[1]``), eps = hyperparameters[0]."""
    accumulator = slot_variables[0] + np.mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + hyperparameters[0]), accumulator


def custom_adam(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Lazy Adam, eps outside the square root; the bias correction is in the learning rate (callable)."""
    beta1, beta2, epsilon = hyperparameters
    m = beta1 * slot_variables[0] + (1.0 - beta1) * gradient
    v = beta2 * slot_variables[1] + (1.0 - beta2) * gradient * gradient
    return embedding_table - learning_rate * m / (np.sqrt(v) + epsilon), m, v


def custom_optimizer(o, steps):
    """The ``CustomOptimizer`` with ``OptimSpec`` ``o``'s math; returns (optimizer, slot names).
    ``steps`` is a one-element list holding the engine's step count, for Adam's bias correction."""
    if o.name == "sgd":
        return ec.CustomOptimizer(custom_sgd, o.lr), []
    if o.name == "adagrad":
        if o.eps == 0.0:
            return ec.CustomOptimizer(custom_adagrad, o.lr, slot_names=["accumulators"],
                                      slot_initializers=[o.initial_accumulator]), ["accumulators"]
        return ec.CustomOptimizer(fbgemm_adagrad_row, o.lr, slot_names=["accumulators"],
                                  slot_initializers=[o.initial_accumulator], hyperparameters=[o.eps]), \
            ["accumulators"]
    if o.name == "rowwise_adagrad":
        return ec.CustomOptimizer(custom_rowwise_adagrad, o.lr, slot_names=["accumulators"],
                                  slot_initializers=[o.initial_accumulator], slot_dims=[1],
                                  hyperparameters=[o.eps]), ["accumulators"]
    if o.name == "adam":
        def learning_rate():
            steps[0] += 1
            return o.adam_lr(steps[0])
        return ec.CustomOptimizer(custom_adam, learning_rate, slot_names=["momenta", "velocities"],
                                  slot_initializers=[0.0, 0.0], hyperparameters=[o.beta1, o.beta2, o.eps]), \
            ["momenta", "velocities"]
    raise ValueError(o.name)


class EmbedcoreCustomContender(EmbedcoreContender):
    kinds = ("train", "update")  # a lookup does not involve the optimizer
    name = "embedcore-custom"
    label = "embedcore CustomOptimizer"
    measures = ("as embedcore, with the optimizer a hand-written CustomOptimizer (TensorFlow's documented "
                "custom Adagrad; NumPy-expression SGD, row-wise Adagrad with np.mean, Adam)")

    def _build(self, w):
        self._steps = [0]
        opt, self.slot_names = custom_optimizer(w.optim, self._steps)
        return ec.Embedding(self._features(w), opt, non_finite=self.non_finite, **self._tuning())
