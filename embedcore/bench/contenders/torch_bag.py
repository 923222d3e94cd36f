"""PyTorch: one ``nn.EmbeddingBag(E, D, mode="sum", sparse=True, include_last_offset=True)`` per table and a
``torch.optim`` optimizer over their weights: ``SGD``, ``Adagrad`` or ``SparseAdam`` (all take sparse
gradients; there is no rowwise Adagrad in ``torch.optim``).

Timed: every table's forward (with per-sample weights when weighted), ``torch.autograd.backward(outputs,
grads)`` (sparse COO weight gradients), ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``;
update-only: the same without the forward. ``Adagrad`` keeps a dense ``[E, D]`` sum per table; TensorFlow
style uses ``initial_accumulator_value=0.1, eps=0``; FBGEMM style ``0, eps=1e-8``. ``SparseAdam`` computes
``lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)`` on the touched rows (its state is dense too).
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from . import Contender, Skip, configure_torch

try:
    import torch
except Exception as exc:
    raise Skip(f"torch not importable: {type(exc).__name__}: {exc}") from None


class TorchBagContender(Contender):
    name = "torch"
    label = "PyTorch EmbeddingBag(sparse)"
    measures = ("nn.EmbeddingBag(sum, sparse=True) forward per table + autograd backward (sparse grads) + "
                "torch.optim SGD/Adagrad/SparseAdam step + zero_grad (update-only: no forward)")
    optimizers = ("sgd", "adagrad", "adam")

    def load(self):
        self.info.update(configure_torch(self.threads))
        # torch.optim.Adagrad builds sparse tensors without invariant checks and says so on every first call
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

    def setup(self, w, init):
        self.w = w
        o = w.optim
        self.bags = []
        for t in range(w.T):
            weight = torch.from_numpy(init[t].copy()) if init is not None else torch.zeros(w.E, w.D)
            if init is None:
                weight.fill_(0.0)
            self.bags.append(torch.nn.EmbeddingBag(w.E, w.D, mode="sum", sparse=True, include_last_offset=True,
                                                   _weight=weight))
        params = [b.weight for b in self.bags]
        if o.name == "sgd":
            self.opt = torch.optim.SGD(params, lr=o.lr)
        elif o.name == "adagrad":
            self.opt = torch.optim.Adagrad(params, lr=o.lr, initial_accumulator_value=o.initial_accumulator,
                                           eps=o.eps)
        elif o.name == "adam":
            self.opt = torch.optim.SparseAdam(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        else:
            raise ValueError(o.name)

    def _inputs(self, batch):
        T = self.w.T
        ids = [torch.from_numpy(batch.ids[t]) for t in range(T)]
        offsets = [torch.from_numpy(batch.offsets[t]) for t in range(T)]
        weights = [None] * T if batch.weights is None else [torch.from_numpy(batch.weights[t]) for t in range(T)]
        return ids, offsets, weights

    def _forward(self, ids, offsets, weights):
        return [bag(i, o, per_sample_weights=w) for bag, i, o, w in zip(self.bags, ids, offsets, weights)]

    def prepare(self, batch):
        ids, offsets, weights = self._inputs(batch)
        grads = [torch.from_numpy(batch.grad[t]) for t in range(self.w.T)]
        outs = self._forward(ids, offsets, weights) if self.w.kind == "update" else None
        return ids, offsets, weights, grads, outs

    def run(self, prepared):
        ids, offsets, weights, grads, outs = prepared
        if self.w.kind == "lookup":
            t0 = time.perf_counter()
            with torch.no_grad():
                self._forward(ids, offsets, weights)
            return {"forward": time.perf_counter() - t0}
        t0 = time.perf_counter()
        if outs is None:
            outs = self._forward(ids, offsets, weights)
        t1 = time.perf_counter()
        torch.autograd.backward(outs, grads)
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        phases = {"backward": t2 - t1, "optimizer.step": t3 - t2}
        if self.w.kind == "train":
            phases = {"forward": t1 - t0, **phases}
        return phases

    def forward(self, batch):
        with torch.no_grad():
            return np.stack([o.numpy() for o in self._forward(*self._inputs(batch))])

    def table(self, t):
        return self.bags[t].weight.detach().numpy()

    def slots(self, t):
        state = self.opt.state.get(self.bags[t].weight, {})
        names = {"sgd": [], "adagrad": ["sum"], "adam": ["exp_avg", "exp_avg_sq"]}[self.w.optim.name]
        return [state[n].numpy() for n in names]

    def close(self):
        self.bags = self.opt = None
