"""TensorFlow (only if ``import tensorflow`` works; it is not a dependency and is not installed by the
benchmark): one ``tf.Variable`` per table, a ``tf.function`` step with ``tf.gather`` (times the weights) +
``tf.math.segment_sum`` pooling under a ``GradientTape`` (``IndexedSlices`` gradients), applied by TF's
sparse optimizer kernels: ``tf.compat.v1.train.GradientDescentOptimizer`` (``ResourceScatterAdd``) or
``AdagradOptimizer`` (``ResourceSparseApplyAdagrad``: ``a += g^2; w -= lr g / sqrt(a)``, TensorFlow-style
Adagrad only). Intra-op threads are set to the benchmark's thread count, inter-op to 1.

Measured with tensorflow-cpu 2.21.0 (``pip install 'embedcore[peers]'``) beside torch 2.13.0, FBGEMM 1.8.0
and JAX 0.10.2 in one process; it agreed with the NumPy reference to 1e-5 (BENCHMARKS.md). The agreement
check vets it like every contender before its timings are reported.
"""

from __future__ import annotations


import numpy as np

from . import Contender, Skip

try:
    import tensorflow as tf
except Exception as exc:
    raise Skip(f"tensorflow not importable: {type(exc).__name__}: {exc}") from None


class TensorflowContender(Contender):
    name = "tensorflow"
    label = "TensorFlow (tf.function, sparse apply)"
    measures = ("tf.function: gather + segment_sum pooling, GradientTape (IndexedSlices), tf.compat.v1 "
                "GradientDescent/Adagrad sparse apply (update-only not supported)")
    optimizers = ("sgd", "adagrad")
    kinds = ("train",)

    def load(self):
        try:
            tf.config.threading.set_intra_op_parallelism_threads(self.threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError as exc:  # already initialized
            self.info["threads_note"] = str(exc)
        self.info["tensorflow"] = tf.__version__
        self.info["tensorflow_threads"] = (f"intra-op {tf.config.threading.get_intra_op_parallelism_threads()} / "
                                           f"inter-op {tf.config.threading.get_inter_op_parallelism_threads()}")

    def unsupported(self, w):
        why = super().unsupported(w)
        if why is None and w.optim.name == "adagrad" and w.optim.eps != 0.0:
            return "tf.compat.v1 Adagrad has no epsilon (TensorFlow-style Adagrad only)"
        return why

    def setup(self, w, init):
        self.w = w
        o = w.optim
        self.vars = [tf.Variable(init[t] if init is not None else tf.zeros((w.E, w.D), tf.float32))
                     for t in range(w.T)]
        if o.name == "sgd":
            self.opt = tf.compat.v1.train.GradientDescentOptimizer(o.lr)
        else:
            self.opt = tf.compat.v1.train.AdagradOptimizer(o.lr, initial_accumulator_value=o.initial_accumulator)
        B = w.B

        def pool(ids, segs, weights):
            outs = []
            for t, var in enumerate(self.vars):
                rows = tf.gather(var, ids[t])
                if weights is not None:
                    rows = rows * weights[t][:, None]
                outs.append(tf.math.unsorted_segment_sum(rows, segs[t], B))
            return outs

        def step(ids, segs, weights, grads):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(out * g) for out, g in zip(pool(ids, segs, weights), grads)])
            gv = tape.gradient(loss, self.vars)
            self.opt.apply_gradients(zip(gv, self.vars))

        self._pool = tf.function(pool)
        self._step = tf.function(step)

    def _inputs(self, batch):
        T = self.w.T
        ids = [tf.constant(batch.ids[t]) for t in range(T)]
        segs = [tf.constant(batch.segments[t]) for t in range(T)]
        weights = None if batch.weights is None else [tf.constant(batch.weights[t]) for t in range(T)]
        return ids, segs, weights

    def prepare(self, batch):
        ids, segs, weights = self._inputs(batch)
        return ids, segs, weights, [tf.constant(batch.grad[t]) for t in range(self.w.T)]

    def run(self, prepared):
        self._step(*prepared)
        return None

    def forward(self, batch):
        return np.stack([o.numpy() for o in self._pool(*self._inputs(batch))])

    def table(self, t):
        return self.vars[t].numpy()

    def slots(self, t):
        if self.w.optim.name == "sgd":
            return []
        return [self.opt.get_slot(self.vars[t], "accumulator").numpy()]

    def close(self):
        self.vars = self.opt = self._pool = self._step = None
