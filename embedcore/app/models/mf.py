"""Biased matrix factorisation (Koren, Bell and Volinsky, 2009) for explicit ratings, on embedcore tables.

The prediction for user ``u`` and item ``i`` is::

    r_hat = mu + b_u + b_i + <p_u, q_i>

``mu`` is a fixed offset (the training ratings' mean), ``p_u`` / ``q_i`` rows of ``dim`` values of the user and
item tables, ``b_u`` / ``b_i`` rows of one value of two bias tables: four embedcore tables, looked up by four
features (:func:`mf_features`) from the user and item ids (:meth:`BiasedMF.ids`). The dense part has no
parameters; the loss is the batch's summed squared error with L2 regularisation of the looked-up rows, as
stochastic gradient MF trains (each rating a step of ``e q_i - l2 p_u`` on ``p_u``)::

    loss = sum_b (r_hat_b - r_b)^2 / 2 + l2 / 2 sum_b (|p_u|^2 + |q_i|^2) + l2_bias / 2 sum_b (b_u^2 + b_i^2)

    acts, ctx = emb.lookup(BiasedMF.ids(batch.ids))
    prediction, cache = model.forward(acts)
    loss, d_prediction = squared_error(prediction, batch.labels)
    emb.apply_gradients(model.backward(cache, d_prediction), ctx)

The activations are float32 whatever the tables' dtype (16-bit rows are decoded when looked up), so the
model is the same for float32, bfloat16 and float16 tables.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np

__all__ = ["BiasedMF", "mf_features", "squared_error", "rmse", "MF_FEATURES"]

#: The features of the model: the factors and the biases of users and items.
MF_FEATURES = ("user", "movie", "user_bias", "movie_bias")


def mf_features(n_users: int, n_items: int, dim: int, optimizer=None, storage=None, stddev: float = 0.1) -> dict:
    """``{feature: FeatureConfig}``: ``user`` and ``movie`` tables of ``dim`` values initialised from
    ``TruncatedNormal(0, stddev)``, ``user_bias`` and ``movie_bias`` tables of one value initialised to 0;
    ``optimizer`` for all four (None: the engine's), ``storage`` the ``TableConfig`` storage arguments
    (``weights_dtype``, ``slot_dtype``, ``stochastic_rounding``) of all four."""
    from ... import FeatureConfig, TableConfig, TruncatedNormal, Zeros
    stored = dict(storage or {})
    factors = TruncatedNormal(0.0, stddev)
    tables = {"user": TableConfig(n_users, dim, factors, optimizer, "sum", "user", **stored),
              "movie": TableConfig(n_items, dim, factors, optimizer, "sum", "movie", **stored),
              "user_bias": TableConfig(n_users, 1, Zeros(), optimizer, "sum", "user_bias", **stored),
              "movie_bias": TableConfig(n_items, 1, Zeros(), optimizer, "sum", "movie_bias", **stored)}
    return {name: FeatureConfig(table, name=name) for name, table in tables.items()}


class ForwardCache(NamedTuple):
    """What ``BiasedMF.backward`` needs from ``BiasedMF.forward``: the looked-up rows."""
    user: np.ndarray
    movie: np.ndarray
    user_bias: np.ndarray
    movie_bias: np.ndarray


def squared_error(prediction: np.ndarray, target: np.ndarray):
    """``(sum_b (p_b - t_b)^2 / 2`` as a Python float, accumulated in float64, ``d / d p = p - t`` float32)."""
    p = np.asarray(prediction, np.float32)
    t = np.asarray(target, np.float32)
    if p.ndim != 1 or t.shape != p.shape:
        raise ValueError(f"squared_error: expected predictions [B] and targets [B], got {p.shape} and {t.shape}")
    error = p - t
    return float(np.sum(np.square(error, dtype=np.float64)) / 2), error


def rmse(prediction: np.ndarray, target: np.ndarray) -> float:
    """Root mean squared error, in float64 (NaN for no ratings)."""
    p = np.asarray(prediction, np.float64)
    t = np.asarray(target, np.float64)
    if p.shape != t.shape:
        raise ValueError(f"rmse: predictions {p.shape} and targets {t.shape} differ in shape")
    return float(np.sqrt(np.mean(np.square(p - t)))) if p.size else float("nan")


class BiasedMF:
    """``r_hat = mu + b_u + b_i + <p_u, q_i>`` over the activations of :func:`mf_features`' four features.

    Args:
        global_mean: ``mu``, e.g. ``MovieLens.mean_rating("train")``.
        dim: the width of the user and item factors.
        l2: L2 regularisation of the factors, per rating (0: none).
        l2_bias: L2 regularisation of the biases, per rating.
    """

    def __init__(self, global_mean: float, dim: int, l2: float = 0.0, l2_bias: float = 0.0):
        for name, value in (("global_mean", global_mean), ("l2", l2), ("l2_bias", l2_bias)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or \
                    not np.isfinite(value):
                raise ValueError(f"BiasedMF: {name} must be a finite number, got {value!r}")
        if l2 < 0 or l2_bias < 0:
            raise ValueError(f"BiasedMF: l2 and l2_bias must be >= 0, got {l2!r} and {l2_bias!r}")
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"BiasedMF: dim must be a positive int, got {dim!r}")
        self.global_mean, self.dim = float(global_mean), int(dim)
        self.l2, self.l2_bias = float(l2), float(l2_bias)

    @staticmethod
    def ids(ids: Mapping[str, np.ndarray]) -> dict:
        """The four features' ids from a batch's ``{"user": [B], "movie": [B]}`` (the biases share them)."""
        return {"user": ids["user"], "movie": ids["movie"], "user_bias": ids["user"], "movie_bias": ids["movie"]}

    def forward(self, acts: Mapping[str, np.ndarray]):
        """``(predictions [B] float32, cache)`` from the four features' activations."""
        user, movie = np.asarray(acts["user"]), np.asarray(acts["movie"])
        user_bias, movie_bias = np.asarray(acts["user_bias"]), np.asarray(acts["movie_bias"])
        batch = user.shape[0]
        for name, a, width in (("user", user, self.dim), ("movie", movie, self.dim), ("user_bias", user_bias, 1),
                               ("movie_bias", movie_bias, 1)):
            if a.shape != (batch, width):
                raise ValueError(f"BiasedMF: activation {name!r} has shape {a.shape}, expected ({batch}, {width})")
        prediction = np.einsum("bd,bd->b", user, movie, dtype=np.float32)
        prediction += user_bias[:, 0]
        prediction += movie_bias[:, 0]
        prediction += np.float32(self.global_mean)
        return prediction, ForwardCache(user, movie, user_bias, movie_bias)

    def backward(self, cache: ForwardCache, d_prediction: np.ndarray) -> dict:
        """``d loss / d activation`` per feature (float32), the L2 terms included."""
        d = np.asarray(d_prediction, np.float32).reshape(-1, 1)
        if d.shape[0] != cache.user.shape[0]:
            raise ValueError(f"BiasedMF.backward: d_prediction has {d.shape[0]} values for a batch of "
                             f"{cache.user.shape[0]}")
        l2, l2_bias = np.float32(self.l2), np.float32(self.l2_bias)
        return {"user": d * cache.movie + l2 * cache.user, "movie": d * cache.user + l2 * cache.movie,
                "user_bias": d + l2_bias * cache.user_bias, "movie_bias": d + l2_bias * cache.movie_bias}
