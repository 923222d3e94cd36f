"""Dense layers with manual backpropagation: :class:`Linear` and :class:`MLP` (ReLU between layers).

Shapes are row-major batches: an input ``x`` is ``[B, in_features]``. Every layer computes in the dtype of
its parameters (float32 by default) and casts its input to it. ``forward`` returns ``(output, cache)``;
``backward(cache, d_output)`` returns ``d loss / d input`` and overwrites the layer's parameter gradients,
which ``gradients()`` exposes under the same names as ``parameters()``. Both dicts hold the live arrays:
an optimizer that updates ``parameters()`` in place updates the layer.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ...memory_budget import check_fits

_INITS = ("he", "glorot")
_ACTIVATIONS = (None, "relu")


def as_generator(rng) -> np.random.Generator:
    """``rng`` as a NumPy Generator: a Generator is used as is, an int (or None, meaning 0) seeds a new one."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None:
        return np.random.default_rng(0)
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy.random.Generator or an int seed, got {type(rng).__name__}")


def _check_float_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


class Linear:
    """Affine layer ``y = x W + b`` with ``W`` ``[in_features, out_features]`` and ``b`` ``[out_features]``.

    Initialisation (``b = 0``):
      * ``"he"``:     ``W_ij ~ Normal(0, 2 / in_features)``  (for layers followed by a ReLU);
      * ``"glorot"``: ``W_ij ~ Uniform(-a, a)``, ``a = sqrt(6 / (in_features + out_features))``.
    Draws are made in float64 from ``rng`` and rounded to ``dtype``. A layer that could not fit in memory
    is refused with ``ValueError`` before anything is allocated.

    Backward, given ``dy = d loss / d y``:
      ``dW = x^T dy``,  ``db = sum over the batch of dy``,  ``dx = dy W^T``.
    """

    def __init__(self, in_features: int, out_features: int, *, rng=None, init: str = "he",
                 dtype=np.float32):
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Linear: {name} must be a positive int, got {value!r}")
        if init not in _INITS:
            raise ValueError(f"Linear: init must be one of {_INITS}, got {init!r}")
        self.dtype = _check_float_dtype(dtype)
        self.in_features, self.out_features = int(in_features), int(out_features)
        check_fits(self.in_features * self.out_features * (8 + 2 * self.dtype.itemsize),
                   f"Linear layer {self.in_features:,} x {self.out_features:,} ({self.dtype.name} weights, their "
                   f"gradient and float64 draws)")
        rng = as_generator(rng)
        if init == "he":
            w = rng.standard_normal((self.in_features, self.out_features)) * math.sqrt(2.0 / self.in_features)
        else:
            limit = math.sqrt(6.0 / (self.in_features + self.out_features))
            w = rng.uniform(-limit, limit, (self.in_features, self.out_features))
        self.weight = np.ascontiguousarray(w, dtype=self.dtype)
        self.bias = np.zeros(self.out_features, self.dtype)
        self._grads = {"weight": np.zeros_like(self.weight), "bias": np.zeros_like(self.bias)}

    def parameters(self) -> dict[str, np.ndarray]:
        """``{"weight": W, "bias": b}`` (live arrays)."""
        return {"weight": self.weight, "bias": self.bias}

    def gradients(self) -> dict[str, np.ndarray]:
        """``{"weight": dW, "bias": db}`` from the last ``backward`` (zeros before; live arrays)."""
        return dict(self._grads)

    def forward(self, x: np.ndarray):
        """``(x W + b, cache)``; ``x`` is ``[B, in_features]``, cast to the layer's dtype."""
        x = np.asarray(x, dtype=self.dtype)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear: expected input [B, {self.in_features}], got shape {x.shape}")
        y = x @ self.weight
        y += self.bias
        return y, x

    def backward(self, cache, dy: np.ndarray, need_input_grad: bool = True) -> Optional[np.ndarray]:
        """Store ``dW = x^T dy``, ``db = sum_b dy``; return ``dx = dy W^T`` (None if not needed)."""
        x = cache
        np.matmul(x.T, dy, out=self._grads["weight"])
        np.sum(dy, axis=0, out=self._grads["bias"])
        return dy @ self.weight.T if need_input_grad else None


class MLP:
    """A stack of :class:`Linear` layers ``sizes[0] -> sizes[1] -> ... -> sizes[-1]``.

    ``h_0 = x``, ``h_{k+1} = relu(h_k W_k + b_k)`` for every layer but the last, whose activation is
    ``final_activation`` (None: identity, ``"relu"``). Layers followed by a ReLU use He initialisation, a
    final identity layer Glorot. Backward through a ReLU: ``d pre = d post * [post > 0]``.
    Parameters are named ``"{k}.weight"``, ``"{k}.bias"`` for layer ``k``.
    """

    def __init__(self, sizes: Sequence[int], final_activation: Optional[str] = None, *, rng=None,
                 dtype=np.float32):
        sizes = tuple(sizes)
        if len(sizes) < 2:
            raise ValueError(f"MLP: sizes needs at least an input and an output size, got {sizes!r}")
        if final_activation not in _ACTIVATIONS:
            raise ValueError(f"MLP: final_activation must be one of {_ACTIVATIONS}, got {final_activation!r}")
        rng = as_generator(rng)
        self.sizes, self.final_activation = sizes, final_activation
        self.dtype = _check_float_dtype(dtype)
        n = len(sizes) - 1
        self._relu = [k < n - 1 or final_activation == "relu" for k in range(n)]
        self.layers = [Linear(sizes[k], sizes[k + 1], rng=rng, init="he" if self._relu[k] else "glorot",
                              dtype=self.dtype) for k in range(n)]

    def parameters(self) -> dict[str, np.ndarray]:
        return {f"{k}.{name}": a for k, layer in enumerate(self.layers) for name, a in layer.parameters().items()}

    def gradients(self) -> dict[str, np.ndarray]:
        return {f"{k}.{name}": a for k, layer in enumerate(self.layers) for name, a in layer.gradients().items()}

    def forward(self, x: np.ndarray):
        """``(output [B, sizes[-1]], cache)``."""
        cache = []
        h = x
        for layer, relu in zip(self.layers, self._relu):
            h, layer_cache = layer.forward(h)
            if relu:
                np.maximum(h, 0, out=h)
            cache.append((layer_cache, h if relu else None))
        return h, cache

    def backward(self, cache, d_output: np.ndarray, need_input_grad: bool = True) -> Optional[np.ndarray]:
        """Store every layer's gradients; return ``d loss / d x`` (None if ``need_input_grad`` is False)."""
        d = np.asarray(d_output, dtype=self.dtype)
        if d.shape != (cache[-1][0].shape[0], self.sizes[-1]):
            raise ValueError(f"MLP: expected d_output of shape {(cache[-1][0].shape[0], self.sizes[-1])}, "
                             f"got {d.shape}")
        for k in range(len(self.layers) - 1, -1, -1):
            layer_cache, post = cache[k]
            if post is not None:
                d = np.where(post > 0, d, 0).astype(self.dtype, copy=False)
            d = self.layers[k].backward(layer_cache, d, need_input_grad=need_input_grad or k > 0)
        return d
