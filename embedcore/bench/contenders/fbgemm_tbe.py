"""FBGEMM's CPU table-batched embeddings: ``SplitTableBatchedEmbeddingBagsCodegen`` with every table at
``EmbeddingLocation.HOST`` / ``ComputeDevice.CPU``, sum pooling, FP32 weights, and the optimizer fused into
backward (``EXACT_SGD``, ``EXACT_ADAGRAD``, ``EXACT_ROWWISE_ADAGRAD``).

Inputs: all tables' ids concatenated (int64) with ``T * B + 1`` offsets (and per-sample weights), as the TBE
op takes them; the upstream gradient as the op's ``[B, T * D]`` output layout. Timed: ``out = tbe(indices,
offsets, per_sample_weights)`` + ``out.backward(grad)`` (the backward applies the optimizer to the touched
rows in place); update-only: ``out.backward(grad)`` alone; lookup-only: the forward under ``torch.no_grad()``. Bounds checking is left at FBGEMM's default
(``BoundsCheckMode.WARNING``), as embedcore's id validation is left on.

Adagrad: ``EXACT_ADAGRAD`` computes ``a += g^2; w -= lr g / (sqrt(a) + eps)`` with ``a`` starting at 0; for
the TensorFlow-style Adagrad (a0 = 0.1, no eps) its ``momentum1`` state is filled with 0.1 and eps = 0.
"""

from __future__ import annotations

import time

import numpy as np

from ..workloads import on_a_cache_line
from . import Contender, Skip, configure_torch

try:
    import torch
    import fbgemm_gpu  # noqa: F401  (registers the torch.ops.fbgemm operators)
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice, OptimType,
                                                                        SplitTableBatchedEmbeddingBagsCodegen)
except Exception as exc:
    raise Skip(f"fbgemm_gpu not importable: {type(exc).__name__}: {exc}") from None

_OPTIM = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}


class FbgemmContender(Contender):
    name = "fbgemm"
    label = "FBGEMM TBE (CPU)"
    measures = ("SplitTableBatchedEmbeddingBagsCodegen(HOST, CPU) forward + out.backward(grad) with the fused "
                "EXACT_* optimizer (update-only: the backward alone)")
    optimizers = tuple(_OPTIM)

    def load(self):
        self.info.update(configure_torch(self.threads))
        self.info["fbgemm_gpu"] = getattr(fbgemm_gpu, "__version__", "?")

    def unsupported(self, w):
        why = super().unsupported(w)
        if why:
            return why
        if w.D % 4:
            return f"embedding dim must be a multiple of 4 (got {w.D})"
        return None

    def setup(self, w, init):
        self.w = w
        o = w.optim
        eps = o.eps
        specs = [(w.E, w.D, EmbeddingLocation.HOST, ComputeDevice.CPU) for _ in range(w.T)]
        t0 = time.perf_counter()
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=getattr(OptimType, _OPTIM[o.name]),
                                                         learning_rate=o.lr, eps=eps,
                                                         pooling_mode=PoolingMode.SUM)
        self.info["construct_s"] = time.perf_counter() - t0
        weights = self.tbe.split_embedding_weights()
        for t in range(w.T):
            if init is None:
                weights[t].fill_(0.0)
            else:
                weights[t].copy_(torch.from_numpy(init[t]))
        self.states = self.tbe.split_optimizer_states() if o.name != "sgd" else [[] for _ in range(w.T)]
        for t in range(w.T):
            for state, value in zip(self.states[t][:1], o.slot_initial_values()):
                state.fill_(value)

    def _inputs(self, batch):
        T, B, D = self.w.T, self.w.B, self.w.D
        n = batch.ids.shape[1]
        indices = torch.from_numpy(batch.ids.reshape(-1))
        offsets = np.empty(T * B + 1, np.int64)
        offsets[:-1] = (batch.offsets[:, :-1] + np.arange(T, dtype=np.int64)[:, None] * n).reshape(-1)
        offsets[-1] = T * n
        psw = None if batch.weights is None else torch.from_numpy(batch.weights.reshape(-1))
        return indices, torch.from_numpy(offsets), psw

    def prepare(self, batch):
        T, B, D = self.w.T, self.w.B, self.w.D
        indices, offsets, psw = self._inputs(batch)
        grad = torch.from_numpy(on_a_cache_line(batch.grad.transpose(1, 0, 2).reshape(B, T * D)))
        out = self.tbe(indices, offsets, per_sample_weights=psw) if self.w.kind == "update" else None
        return indices, offsets, psw, grad, out

    def run(self, prepared):
        indices, offsets, psw, grad, out = prepared
        if self.w.kind == "lookup":
            t0 = time.perf_counter()
            with torch.no_grad():
                self.tbe(indices, offsets, per_sample_weights=psw)
            return {"forward": time.perf_counter() - t0}
        t0 = time.perf_counter()
        if out is None:
            out = self.tbe(indices, offsets, per_sample_weights=psw)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        phases = {"backward+optimizer": t2 - t1}
        if self.w.kind == "train":
            phases = {"forward": t1 - t0, **phases}
        return phases

    def forward(self, batch):
        T, B, D = self.w.T, self.w.B, self.w.D
        with torch.no_grad():
            out = self.tbe(*self._inputs(batch)).numpy()
        return np.ascontiguousarray(out.reshape(B, T, D).transpose(1, 0, 2))

    def table(self, t):
        return self.tbe.split_embedding_weights()[t].numpy()

    def slots(self, t):
        return [s.numpy() for s in self.states[t][:1]]

    def close(self):
        self.tbe = None
        self.states = None
