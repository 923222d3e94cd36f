"""embedcore inside PyTorch: ``embedcore.torch.EmbeddingModule`` forward, then ``torch.autograd.backward``,
whose backward node calls ``apply_gradients`` (optimizer in backward, as FBGEMM's TBE). Opt-in
(``--contenders all`` or by name): it measures the adapter's overhead next to the plain engine.
"""

from __future__ import annotations

import time

import numpy as np

from . import Skip, configure_torch
from .embedcore_engine import EmbedcoreContender

try:
    import torch
except Exception as exc:  # pragma: no cover - only without torch
    raise Skip(f"torch not importable: {exc}") from None


class EmbedcoreTorchContender(EmbedcoreContender):
    name = "embedcore-torch"
    kinds = ("train", "update")
    label = "embedcore (torch EmbeddingModule)"
    measures = ("EmbeddingModule(features) forward (lookup) + torch.autograd.backward(acts, grads), whose "
                "backward runs apply_gradients (update-only: the backward alone)")

    def load(self):
        super().load()
        from embedcore.torch import EmbeddingModule
        self._module_cls = EmbeddingModule
        self.info.update(configure_torch(self.threads))

    def setup(self, w, init):
        super().setup(w, init)
        self.module = self._module_cls(self.emb)

    def prepare(self, batch):
        features, weights, grads = self._inputs(batch)
        tgrads = [torch.from_numpy(grads[f"f{t}"]) for t in range(self.w.T)]
        acts = None
        if self.w.kind == "update":
            acts = self.module(features, weights)
        return features, weights, tgrads, acts

    def run(self, prepared):
        features, weights, tgrads, acts = prepared
        t0 = time.perf_counter()
        if acts is None:
            acts = self.module(features, weights)
        t1 = time.perf_counter()
        torch.autograd.backward([acts[f"f{t}"] for t in range(self.w.T)], tgrads)
        t2 = time.perf_counter()
        phases = {"backward (apply_gradients)": t2 - t1}
        if self.w.kind == "train":
            phases = {"forward": t1 - t0, **phases}
        return phases

    def forward(self, batch):
        features, weights, _ = self._inputs(batch)
        with torch.no_grad():
            acts = self.module(features, weights)
        return np.stack([acts[f"f{t}"].numpy() for t in range(self.w.T)])

    def close(self):
        self.module = None
        super().close()
