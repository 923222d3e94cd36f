"""Plain NumPy oracle, written for clarity and independent of embedcore's code paths.

Features are given here as Python lists of samples (each a list of ids, and optionally weights). The oracle
computes lookups with loops over samples, the dense ``[vocabulary, dim]`` gradient of every table, and each
optimizer's whole-table update in float64, restoring rows the batch did not touch.
"""

import math

import numpy as np


def combine_gains(weights, combiner):
    w = np.asarray(weights, np.float64)
    if combiner == "sum" or len(w) == 0:
        return w
    total = w.sum() if combiner == "mean" else math.sqrt((w * w).sum())
    return w / total if total != 0 else np.zeros_like(w)


def lookup(table, samples, weights, combiner, seq_len):
    """Activations of one feature: ``[B, dim]`` pooled or ``[B, L, dim]`` sequence."""
    dim = table.shape[1]
    if seq_len:
        out = np.zeros((len(samples), seq_len, dim))
        for b, ids in enumerate(samples):
            for p, i in enumerate(ids[:seq_len]):
                out[b, p] += weights[b][p] * table[i]
        return out
    out = np.zeros((len(samples), dim))
    for b, ids in enumerate(samples):
        for g, i in zip(combine_gains(weights[b], combiner), ids):
            out[b] += g * table[i]
    return out


def dense_gradient(vocabulary_size, dim, samples, weights, combiner, seq_len, d_act, into=None):
    """Add one feature's contribution to the dense table gradient ``into`` (created if None)."""
    grad = np.zeros((vocabulary_size, dim)) if into is None else into
    for b, ids in enumerate(samples):
        if seq_len:
            for p, i in enumerate(ids[:seq_len]):
                grad[i] += weights[b][p] * d_act[b, p]
        else:
            for g, i in zip(combine_gains(weights[b], combiner), ids):
                grad[i] += g * d_act[b]
    return grad


def touched_rows(vocabulary_size, samples, seq_len, mask=None):
    mask = np.zeros(vocabulary_size, bool) if mask is None else mask
    for ids in samples:
        for i in (ids[:seq_len] if seq_len else ids):
            mask[i] = True
    return mask


# ------------------------------------------------------------------------------------------------------
# Whole-table optimizer math (TensorFlow TPU embedding formulas).

def _common(g, w, p, lr):
    lo = -np.inf if p.get("clip_min") is None else p["clip_min"]
    hi = np.inf if p.get("clip_max") is None else p["clip_max"]
    g = np.clip(g, lo, hi)
    decay = p.get("weight_decay", 0.0) or 0.0
    if p.get("decay_by_lr"):
        decay *= lr
    return g, w - decay * w


def _clip_weights(w, p):
    lo = -np.inf if p.get("w_min") is None else p["w_min"]
    hi = np.inf if p.get("w_max") is None else p["w_max"]
    return np.clip(w, lo, hi)


def sgd(g, w, slots, lr, p, step):
    g, w = _common(g, w, p, lr)
    return _clip_weights(w - lr * g, p), []


def adagrad(g, w, slots, lr, p, step):
    g, w = _common(g, w, p, lr)
    a = slots[0] + g ** 2
    return _clip_weights(w - lr * g / np.sqrt(a), p), [a]


def rowwise_adagrad(g, w, slots, lr, p, step):
    g, w = _common(g, w, p, lr)
    a = slots[0] + (g ** 2).mean(axis=1)
    return _clip_weights(w - lr * g / (np.sqrt(a)[:, None] + p.get("epsilon", 0.0)), p), [a]


def adagrad_momentum(g, w, slots, lr, p, step):
    g, w = _common(g, w, p, lr)
    beta2, momentum = p.get("beta2", 1.0), p.get("momentum", 0.0)
    a = slots[0] + g ** 2 if beta2 == 1.0 else beta2 * slots[0] + (1 - beta2) * g ** 2
    s = (a + p.get("epsilon", 1e-10)) ** (-1.0 / p.get("exponent", 2.0)) * g
    m = momentum * slots[1] + s
    update = momentum * m + s if p.get("nesterov") else m
    return _clip_weights(w - lr * update, p), [a, m]


def adam(g, w, slots, lr, p, step):
    g, w = _common(g, w, p, lr)
    b1, b2, eps = p.get("beta_1", 0.9), p.get("beta_2", 0.999), p.get("epsilon", 1e-7)
    m = b1 * slots[0] + (1 - b1) * g
    v = b2 * slots[1] + (1 - b2) * g ** 2
    # TensorFlow's TPU Adam has no bias correction; bias_correction=True is jax-tpu-embedding's form.
    lr_t = lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step) if p.get("bias_correction") else lr
    denominator = np.sqrt(v + eps ** 2) if p.get("sum_inside_sqrt", True) else np.sqrt(v) + eps
    return _clip_weights(w - lr_t * m / denominator, p), [m, v]


def ftrl(g, w, slots, lr, p, step):
    g, w = _common(g, w, p, lr)
    power = -p.get("learning_rate_power", -0.5)
    l1, l2, beta = p.get("l1", 0.0), p.get("l2", 0.0), p.get("beta", 0.0)
    a, linear = slots
    a_new = a + g ** 2
    delta = a_new ** power - a ** power
    if p.get("multiply_linear_by_lr"):
        linear = linear + lr * g - delta * w
        w_new = (np.clip(linear, -lr * l1, lr * l1) - linear) / (a_new ** power + 2 * lr * l2 + beta)
    else:
        linear = linear + g - delta * w / lr
        w_new = (np.clip(linear, -l1, l1) - linear) / ((a_new ** power + beta) / lr + 2 * l2)
    return _clip_weights(w_new, p), [a_new, linear]


def apply(update, gradient, table, slots, touched, lr, params, step, lazy=True):
    """Whole-table update, then untouched rows restored (unless ``lazy`` is False)."""
    new_table, new_slots = update(gradient.astype(np.float64), table.astype(np.float64),
                                  [s.astype(np.float64) for s in slots], lr, params, step)
    if lazy:
        new_table = np.where(touched[:, None], new_table, table)
        new_slots = [np.where(touched[:, None] if s.ndim == 2 else touched, n, s)
                     for n, s in zip(new_slots, slots)]
    return new_table, new_slots
