"""A DLRM-style dense model (Naumov et al., 2019) on top of embedcore's embedding activations.

Notation: ``B`` batch size, ``d`` the embedding width ``dim``, ``F`` the number of features.

* Bottom MLP (only if ``n_dense > 0``): ``z = relu-MLP(x)``, ``x`` ``[B, n_dense]`` -> ``z`` ``[B, d]``
  (ReLU after every layer, the last included).
* Interaction: stack ``T = [z, e_1, ..., e_F]`` ``[B, n, d]`` (``z`` left out if ``n_dense == 0``;
  ``e_f`` the activation of the f-th name of ``feature_names``), form the Gram matrices
  ``G = T T^T`` ``[B, n, n]`` (one batched matmul) and keep the strict upper triangle in row-major order,
  ``p = (G_ij)_{i<j}`` ``[B, n(n-1)/2]``.
* Top MLP: ``logit = MLP([z, p])`` (``[p]`` without dense features), ReLU between layers, identity last.

Backward: with ``dp`` the gradient of the top MLP input's pair part, ``S`` the symmetric ``[B, n, n]``
matrix holding ``dp`` at ``(i, j)`` and ``(j, i)`` (zero diagonal), ``dT = S T`` (because
``dG_ij = dT_i . T_j + T_i . dT_j``); ``dz`` adds the direct part of the top MLP's input gradient.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence

import numpy as np

from ...memory_budget import check_fits
from .dense_optimizers import Adam, DenseOptimizer
from .layers import MLP, _check_float_dtype


class ForwardCache(NamedTuple):
    """What ``DLRM.backward`` needs from ``DLRM.forward``."""
    batch_size: int
    stacked: np.ndarray            # T, [B, n, d]
    bottom: Optional[list]         # bottom MLP cache (None without dense features)
    top: list                      # top MLP cache


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` without overflow: ``exp(-|x|)`` is at most 1."""
    x = np.asarray(x)
    x = x.astype(np.result_type(x.dtype, np.float32), copy=False)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def bce_with_logits(logits: np.ndarray, labels: np.ndarray):
    """Mean binary cross-entropy of ``sigmoid(logits)`` against ``labels`` in [0, 1], and its gradient.

    ``loss_b = -y log s(x) - (1 - y) log(1 - s(x)) = max(x, 0) - x y + log(1 + exp(-|x|))``, exact and
    free of overflow for any finite ``x``; ``loss = mean_b loss_b`` (accumulated in float64, returned as a
    Python float); ``d loss / d x_b = (s(x_b) - y_b) / B``, in the logits' float dtype (float32 for
    integer input).
    """
    logits = np.asarray(logits)
    dtype = np.result_type(logits.dtype, np.float32)
    x = logits.astype(dtype, copy=False)
    y = np.asarray(labels).astype(dtype, copy=False)
    if x.ndim != 1 or y.shape != x.shape:
        raise ValueError(f"bce_with_logits: expected logits [B] and labels [B], got {x.shape} and {y.shape}")
    if x.shape[0] == 0:
        raise ValueError("bce_with_logits: empty batch")
    per_sample = np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))
    loss = float(np.mean(per_sample, dtype=np.float64))
    d = (sigmoid(x) - y) / dtype.type(x.shape[0])
    return loss, d.astype(dtype, copy=False)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"DLRM: {name} must be a positive int, got {value!r}")
    return int(value)


class DLRM:
    """DLRM dense part: bottom MLP, pairwise dot-product interaction, top MLP to one logit per sample.

    ``DLRM(n_dense, feature_names, dim, bottom=(64,), top=(64, 32), seed=0, dense_optimizer=None)``:
    ``bottom`` and ``top`` are the hidden sizes (the bottom MLP is ``n_dense -> *bottom -> dim``, ignored
    when ``n_dense == 0``; the top MLP ``(dim if n_dense else 0) + n(n-1)/2 -> *top -> 1``). Weights come
    from ``numpy.random.default_rng(seed)``, bottom first. ``dense_optimizer`` defaults to
    ``Adam(0.001)``; it is bound to this model's parameters. ``dtype`` (float32; float64 for gradient
    checks) is the dtype of every parameter, activation and gradient. Layers that could not fit in memory
    with their gradients and optimizer slots are refused with ``ValueError`` (naming the largest) before
    anything is allocated.

    Parameters are named ``"bottom.{k}.weight"``, ``"bottom.{k}.bias"``, ``"top.{k}.weight"``, ...
    """

    def __init__(self, n_dense: int, feature_names: Sequence[str], dim: int, bottom: Sequence[int] = (64,),
                 top: Sequence[int] = (64, 32), seed: int = 0, dense_optimizer: Optional[DenseOptimizer] = None,
                 *, dtype=np.float32):
        if isinstance(n_dense, bool) or not isinstance(n_dense, (int, np.integer)) or n_dense < 0:
            raise ValueError(f"DLRM: n_dense must be a non-negative int, got {n_dense!r}")
        if isinstance(feature_names, str):
            raise ValueError("DLRM: feature_names must be a sequence of names, not one string")
        names = tuple(feature_names)
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise ValueError(f"DLRM: feature_names must be distinct strings, got {names!r}")
        self.n_dense, self.feature_names, self.dim = int(n_dense), names, _positive_int("dim", dim)
        self.bottom_sizes = tuple(_positive_int("bottom size", s) for s in bottom)
        self.top_sizes = tuple(_positive_int("top size", s) for s in top)
        self.seed, self.dtype = seed, _check_float_dtype(dtype)

        self.n_vectors = len(names) + (1 if self.n_dense else 0)
        self.n_pairs = self.n_vectors * (self.n_vectors - 1) // 2
        top_in = (self.dim if self.n_dense else 0) + self.n_pairs
        if top_in == 0:
            raise ValueError("DLRM: without dense features at least two embedding features are needed "
                             f"(got feature_names={names!r})")
        self.optimizer = Adam(0.001) if dense_optimizer is None else dense_optimizer
        if not isinstance(self.optimizer, DenseOptimizer):
            raise TypeError(f"DLRM: dense_optimizer must be an embedcore.app.models DenseOptimizer, got "
                            f"{type(self.optimizer).__name__}")
        self._check_fits(top_in)
        rng = np.random.default_rng(seed)
        self.bottom = (MLP((self.n_dense, *self.bottom_sizes, self.dim), "relu", rng=rng, dtype=self.dtype)
                       if self.n_dense else None)
        self.top = MLP((top_in, *self.top_sizes, 1), None, rng=rng, dtype=self.dtype)
        rows, cols = np.triu_indices(self.n_vectors, k=1)
        self._upper = rows * self.n_vectors + cols           # flat indices of G_ij, i < j, row-major
        self._lower = cols * self.n_vectors + rows           # their mirror images
        self.optimizer.initialize(self.parameters())
        self._has_gradients = False
        self._scratch: dict[str, np.ndarray] = {}

    def _check_fits(self, top_in: int) -> None:
        """Refuse (``ValueError`` naming the largest layer) dense layers that could not fit in memory with
        their gradients and the optimizer's slots, before any is allocated."""
        layers = [("top", k, a, b) for k, (a, b) in enumerate(zip((top_in, *self.top_sizes),
                                                                   (*self.top_sizes, 1)))]
        if self.n_dense:
            sizes = (self.n_dense, *self.bottom_sizes, self.dim)
            layers = [("bottom", k, a, b) for k, (a, b) in enumerate(zip(sizes, sizes[1:]))] + layers
        values = sum(a * b + b for _, _, a, b in layers)
        copies = 2 + len(self.optimizer.slot_names)           # parameters, gradients, slots
        part, k, a, b = max(layers, key=lambda layer: layer[2] * layer[3])
        check_fits(values * self.dtype.itemsize * copies + 8 * a * b,  # + the float64 draws of one layer
                   f"DLRM: the dense layers ({values:,} {self.dtype.name} parameters with their gradients and "
                   f"{len(self.optimizer.slot_names)} optimizer slots; largest: {part} layer {k}, {a:,} x {b:,})")

    def _buffer(self, name: str, batch: int) -> np.ndarray:
        """A reused ``[batch, n * n]`` work array (the Gram matrices, their gradient): allocating it anew on
        every call costs page faults. ``"sym"`` is created zeroed; only its off-diagonal entries are ever
        written, so its diagonal stays zero."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] != batch:
            buf = self._scratch[name] = np.zeros((batch, self.n_vectors ** 2), self.dtype)
        return buf

    # -- parameters -----------------------------------------------------------------------------------------
    def _modules(self):
        return (("bottom", self.bottom), ("top", self.top)) if self.bottom is not None else (("top", self.top),)

    def parameters(self) -> dict[str, np.ndarray]:
        """Name -> live parameter array, bottom then top, layer by layer."""
        return {f"{m}.{k}": a for m, mlp in self._modules() for k, a in mlp.parameters().items()}

    def gradients(self) -> dict[str, np.ndarray]:
        """Name -> gradient of the last ``backward`` (same keys as ``parameters()``; live arrays)."""
        return {f"{m}.{k}": a for m, mlp in self._modules() for k, a in mlp.gradients().items()}

    def config(self) -> dict:
        """The constructor arguments (JSON-serialisable, without the optimizer) to rebuild this model."""
        return {"n_dense": self.n_dense, "feature_names": list(self.feature_names), "dim": self.dim,
                "bottom": list(self.bottom_sizes), "top": list(self.top_sizes), "seed": self.seed,
                "dtype": self.dtype.name}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the parameters and of the optimizer state (keys prefixed ``"optimizer."``); arrays only."""
        out = {name: a.copy() for name, a in self.parameters().items()}
        out.update({f"optimizer.{k}": a for k, a in self.optimizer.state_dict().items()})
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Copy ``state`` (as from ``state_dict``) into this model in place; keys and shapes must match."""
        params = self.parameters()
        opt_keys = {k for k in state if k.startswith("optimizer.")}
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params) - opt_keys)
        if missing or unexpected:
            raise ValueError(f"DLRM.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, dst in params.items():
            src = np.asarray(state[name])
            if src.shape != dst.shape or not np.issubdtype(src.dtype, np.floating):
                raise ValueError(f"DLRM.load_state_dict: {name!r} is {src.dtype}{list(src.shape)}, "
                                 f"expected a float array of shape {list(dst.shape)}")
        # validates the optimizer part before any parameter changes
        optimizer_state = {k[len("optimizer."):]: state[k] for k in opt_keys}
        backup = self.optimizer.state_dict()
        self.optimizer.load_state_dict(optimizer_state)
        try:
            for name, dst in params.items():
                np.copyto(dst, state[name], casting="same_kind")
        except Exception:
            self.optimizer.load_state_dict(backup)
            raise
        self._has_gradients = False

    # -- computation ----------------------------------------------------------------------------------------
    def _check_inputs(self, dense, embeddings: Mapping[str, np.ndarray]):
        if not isinstance(embeddings, Mapping):
            raise TypeError(f"DLRM: embeddings must be a dict name -> [B, {self.dim}] array")
        missing = [n for n in self.feature_names if n not in embeddings]
        unexpected = sorted(set(embeddings) - set(self.feature_names), key=str)
        if missing or unexpected:
            raise ValueError(f"DLRM: embeddings: missing features {missing}, unexpected features {unexpected}")
        batch = None
        arrays = []
        for name in self.feature_names:
            e = np.asarray(embeddings[name])
            if e.ndim != 2 or e.shape[1] != self.dim or (batch is not None and e.shape[0] != batch):
                raise ValueError(f"DLRM: embedding {name!r} has shape {e.shape}, expected "
                                 f"[{batch if batch is not None else 'B'}, {self.dim}]")
            batch = e.shape[0]
            arrays.append(e)
        if self.n_dense:
            if dense is None:
                raise ValueError(f"DLRM: dense features [B, {self.n_dense}] are required")
            dense = np.asarray(dense, dtype=self.dtype)
            if dense.ndim != 2 or dense.shape[1] != self.n_dense or (batch is not None and dense.shape[0] != batch):
                raise ValueError(f"DLRM: dense has shape {dense.shape}, expected "
                                 f"[{batch if batch is not None else 'B'}, {self.n_dense}]")
            batch = dense.shape[0]
        elif dense is not None and np.asarray(dense).size != 0:
            raise ValueError(f"DLRM: the model has no dense features, got dense of shape {np.shape(dense)}")
        return dense, arrays, batch

    def forward(self, dense: Optional[np.ndarray], embeddings: Mapping[str, np.ndarray]):
        """``(logits [B], cache)``. ``dense`` is ``[B, n_dense]`` (None or empty if ``n_dense == 0``);
        ``embeddings`` maps every feature name to its ``[B, dim]`` activation."""
        dense, arrays, batch = self._check_inputs(dense, embeddings)
        n, d = self.n_vectors, self.dim
        stacked = np.empty((batch, n, d), self.dtype)
        offset = 0
        bottom_out, bottom_cache = None, None
        if self.bottom is not None:
            bottom_out, bottom_cache = self.bottom.forward(dense)
            stacked[:, 0] = bottom_out
            offset = 1
        for f, e in enumerate(arrays):
            stacked[:, offset + f] = e
        gram = self._buffer("gram", batch)
        np.matmul(stacked, stacked.transpose(0, 2, 1), out=gram.reshape(batch, n, n))
        pairs = np.take(gram, self._upper, axis=1)
        top_in = pairs if bottom_out is None else np.concatenate([bottom_out, pairs], axis=1)
        out, top_cache = self.top.forward(top_in)
        return out.reshape(batch), ForwardCache(batch, stacked, bottom_cache, top_cache)

    def backward(self, cache: ForwardCache, d_logits: np.ndarray) -> dict[str, np.ndarray]:
        """Given ``d loss / d logits`` ``[B]``, store the parameters' gradients (``gradients()``) and return
        ``d loss / d embedding`` per feature name, each a contiguous ``[B, dim]`` array."""
        batch, stacked = cache.batch_size, cache.stacked
        d_logits = np.asarray(d_logits, dtype=self.dtype)
        if d_logits.shape != (batch,):
            raise ValueError(f"DLRM.backward: d_logits has shape {d_logits.shape}, expected ({batch},)")
        d_top_in = self.top.backward(cache.top, d_logits.reshape(batch, 1))
        n, d = self.n_vectors, self.dim
        offset = 1 if self.bottom is not None else 0
        d_pairs = d_top_in[:, d * offset:]
        sym = self._buffer("sym", batch)
        sym[:, self._upper] = d_pairs
        sym[:, self._lower] = d_pairs
        # dT = S T, written vector-major ([n, B, d]) so that each feature's gradient is a contiguous block
        d_stacked = np.empty((n, batch, d), self.dtype)
        np.matmul(sym.reshape(batch, n, n), stacked, out=d_stacked.transpose(1, 0, 2))
        if self.bottom is not None:
            d_bottom = d_stacked[0] + d_top_in[:, :d]
            self.bottom.backward(cache.bottom, d_bottom, need_input_grad=False)
        self._has_gradients = True
        return {name: d_stacked[offset + f] for f, name in enumerate(self.feature_names)}

    def step(self) -> None:
        """Apply the dense optimizer with the gradients of the last ``backward`` (once per backward)."""
        if not self._has_gradients:
            raise RuntimeError("DLRM.step: call backward first (each backward allows one step)")
        self.optimizer.step(self.parameters(), self.gradients())
        self._has_gradients = False

    def predict(self, dense: Optional[np.ndarray], embeddings: Mapping[str, np.ndarray]) -> np.ndarray:
        """Probabilities ``sigmoid(logits)`` ``[B]``."""
        logits, _ = self.forward(dense, embeddings)
        return sigmoid(logits)
