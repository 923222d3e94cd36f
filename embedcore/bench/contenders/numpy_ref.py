"""The NumPy reference: the textbook sparse step, single-threaded NumPy (OpenBLAS is not involved).

Forward per table: ``table[ids]`` (times the weights) and ``np.add.reduceat`` over bags. Backward per
table: the id gradients ``G[bag] * weight``, ``np.unique(ids, return_inverse=True)``, ``np.add.at`` to sum
them per distinct id, fancy-index gather of those rows (and slots), the optimizer's math, scatter back.
Update-only: the backward alone. This is also the reference the other contenders are checked against.
"""

from __future__ import annotations

import time

import numpy as np

from ..workloads import numpy_apply, numpy_pool
from . import Contender


class NumpyContender(Contender):
    name = "numpy"
    label = "NumPy reference"
    measures = ("table[ids] + np.add.reduceat pooling, then np.unique + np.add.at + gather/update/scatter of "
                "the distinct rows (update-only: the latter alone)")
    optimizers = ("sgd", "adagrad", "rowwise_adagrad", "adam")

    def setup(self, w, init):
        self.w = w
        o = w.optim
        self.tables = []
        for t in range(w.T):
            if init is None:
                table = np.empty((w.E, w.D), np.float32)
                table[...] = 0.0  # written, not calloc'd: every page is touched before the clock starts
            else:
                table = init[t].copy()
            self.tables.append(table)
        self.state = []
        for _ in range(w.T):
            mine = []
            for shape, value in zip(o.slot_shapes(w.E, w.D), o.slot_initial_values()):
                s = np.empty(shape, np.float32)
                s[...] = value
                mine.append(s)
            self.state.append(mine)
        self.step = 0

    def prepare(self, batch):
        return batch

    def run(self, batch):
        w = self.w
        if w.kind == "lookup":
            t0 = time.perf_counter()
            for t in range(w.T):
                numpy_pool(self.tables[t], batch.ids[t], batch.offsets[t],
                           None if batch.weights is None else batch.weights[t])
            return {"forward": time.perf_counter() - t0}
        self.step += 1
        t0 = time.perf_counter()
        if w.kind == "train":
            for t in range(w.T):
                numpy_pool(self.tables[t], batch.ids[t], batch.offsets[t],
                           None if batch.weights is None else batch.weights[t])
        t1 = time.perf_counter()
        segments = batch.segments
        for t in range(w.T):
            row_grads = batch.grad[t][segments[t]]
            if batch.weights is not None:
                row_grads *= batch.weights[t][:, None]
            numpy_apply(w.optim, self.tables[t], self.state[t], batch.ids[t], row_grads, self.step)
        t2 = time.perf_counter()
        phases = {"backward+update": t2 - t1}
        if w.kind == "train":
            phases = {"forward": t1 - t0, **phases}
        return phases

    def forward(self, batch):
        return np.stack([numpy_pool(self.tables[t], batch.ids[t], batch.offsets[t],
                                    None if batch.weights is None else batch.weights[t])
                         for t in range(self.w.T)])

    def table(self, t):
        return self.tables[t]

    def slots(self, t):
        return self.state[t]

    def close(self):
        self.tables = self.state = None
