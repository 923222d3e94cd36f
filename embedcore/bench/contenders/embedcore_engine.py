"""embedcore through its public API: ``emb.lookup(features, weights)`` then ``emb.apply_gradients(grads, ctx)``.

One ``Embedding`` with one pooled feature per table (``combiner="sum"``); the tables share the optimizer
and ``dim``, so the engine stacks them into one physical array (as FBGEMM's TBE does). Inputs are
``embedcore.Ragged(ids, row_splits)`` per feature (weights the same structure), gradients ``[B, D]``
float32 per feature. Timed: lookup (validation, gather + pooling) + ``apply_gradients`` (validation, dedup,
fused gradient reduction + optimizer) for ``kind="train"``; ``apply_gradients`` alone for ``"update"``;
the lookup alone for ``"lookup"``.
"""

from __future__ import annotations

import time

import numpy as np

import embedcore as ec

from . import Contender


def fbgemm_adagrad_row(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """FBGEMM's EXACT_ADAGRAD: ``a += g^2; w -= lr g / (sqrt(a) + eps)``, eps = hyperparameters[0]."""
    accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / (np.sqrt(accumulator) + hyperparameters[0]), accumulator


def embedcore_optimizer(o):
    """The embedcore optimizer with ``OptimSpec`` ``o``'s math; returns (optimizer, slot names)."""
    if o.name == "sgd":
        return ec.SGD(o.lr), []
    if o.name == "adagrad":
        if o.eps == 0.0:
            return ec.Adagrad(o.lr, initial_accumulator_value=o.initial_accumulator), ["accumulators"]
        return ec.CustomOptimizer(fbgemm_adagrad_row, o.lr, slot_names=["accumulators"],
                                  slot_initializers=[o.initial_accumulator], hyperparameters=[o.eps]), \
            ["accumulators"]
    if o.name == "rowwise_adagrad":
        return ec.RowwiseAdagrad(o.lr, initial_accumulator_value=o.initial_accumulator, epsilon=o.eps), \
            ["accumulators"]
    if o.name == "adam":
        return ec.Adam(o.lr, beta_1=o.beta1, beta_2=o.beta2, epsilon=o.eps, lazy_adam=True,
                       sum_inside_sqrt=False, bias_correction=True), ["momenta", "velocities"]
    raise ValueError(o.name)


class EmbedcoreContender(Contender):
    name = "embedcore"
    label = "embedcore"
    measures = ("Embedding.lookup(Ragged ids[, weights]) + Embedding.apply_gradients(grads, ctx): validation, "
                "gather+sum pooling, dedup, fused gradient reduction + optimizer, in place (update-only: "
                "apply_gradients alone, the lookup untimed)")
    optimizers = ("sgd", "adagrad", "rowwise_adagrad", "adam")
    non_finite = "raise"  # Embedding(non_finite=...): the engine's default
    tuning = None  # Embedding(tuning=...): None, the engine's default (DEFAULT_TUNING)

    def load(self):
        import numba
        self.info["numba"] = numba.__version__
        self.info["numba_threads"] = numba.get_num_threads()

    @classmethod
    def on_workload(cls, w, threads: int, tuning=None):
        """A contender loaded and set up on workload ``w`` (tables zero) with Numba on ``threads`` threads,
        its engine built with ``tuning`` (an :class:`embedcore.Tuning`; None: the default), for scripts that
        time embedcore's steps alone (``benchmarks/``)."""
        import numba
        contender = cls(threads)
        contender.tuning = tuning
        contender.load()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        contender.setup(w, None)
        return contender

    def _features(self, w):
        return {f"f{t}": ec.FeatureConfig(ec.TableConfig(w.E, w.D, initializer=ec.Zeros(), combiner="sum",
                                                         name=f"t{t}"))
                for t in range(w.T)}

    def _build(self, w):
        opt, self.slot_names = embedcore_optimizer(w.optim)
        return ec.Embedding(self._features(w), opt, non_finite=self.non_finite, **self._tuning())

    def _tuning(self) -> dict:
        """``Embedding``'s ``tuning`` keyword, when one was given."""
        return {} if self.tuning is None else {"tuning": self.tuning}

    def setup(self, w, init):
        self.w = w
        t0 = time.perf_counter()
        self.emb = self._build(w)
        self.info["build_s"] = time.perf_counter() - t0  # fills tables and slots, compiles the row function
        self.info["physical_tables"] = self.emb.num_physical_tables
        if init is not None:
            for t in range(w.T):
                self.emb.embedding_tables[f"t{t}"][...] = init[t]
        self._first = True

    def _inputs(self, batch):
        T = self.w.T
        features = {f"f{t}": ec.Ragged(batch.ids[t], batch.offsets[t]) for t in range(T)}
        weights = None
        if batch.weights is not None:
            weights = {f"f{t}": ec.Ragged(batch.weights[t], batch.offsets[t]) for t in range(T)}
        grads = {f"f{t}": batch.grad[t] for t in range(T)}
        return features, weights, grads

    def prepare(self, batch):
        features, weights, grads = self._inputs(batch)
        ctx = None
        if self.w.kind == "update":
            _, ctx = self.emb.lookup(features, weights)
        return features, weights, grads, ctx

    def run(self, prepared):
        features, weights, grads, ctx = prepared
        t0 = time.perf_counter()
        if ctx is None:
            acts, ctx = self.emb.lookup(features, weights)
            del acts
        t1 = time.perf_counter()
        if self.w.kind == "lookup":
            return {"lookup": t1 - t0}
        self.emb.apply_gradients(grads, ctx)
        t2 = time.perf_counter()
        if self._first:  # the first step compiles the update kernel (the lookup's kernels load from cache)
            self._first = False
            self.info.setdefault("first_lookup_s", t1 - t0)
            self.info["first_apply_gradients_s"] = t2 - t1
        phases = {"apply_gradients": t2 - t1}
        if self.w.kind == "train":
            phases = {"lookup": t1 - t0, **phases}
        return phases

    def forward(self, batch):
        features, weights, _ = self._inputs(batch)
        t0 = time.perf_counter()
        acts, _ = self.emb.lookup(features, weights)
        self.info.setdefault("first_lookup_s", time.perf_counter() - t0)
        return np.stack([acts[f"f{t}"] for t in range(self.w.T)])

    def table(self, t):
        return self.emb.embedding_tables[f"t{t}"]

    def slots(self, t):
        mine = self.emb.slot_variables[f"t{t}"]
        return [mine[name] for name in self.slot_names]

    def close(self):
        self.emb = None


class EmbedcoreSkipContender(EmbedcoreContender):
    """The ``embedcore`` contender with ``Embedding(non_finite="skip")``: the price of refusing NaN/Inf
    gradients up front, measured beside the default.

    By default ``apply_gradients`` reads every gradient value once before it changes anything, so that a
    NaN/Inf gradient is refused with tables, slots and ``step`` unchanged. With ``"skip"`` there is no such
    pass: the fused kernel finds a non-finite summed gradient as it reads the row, and leaves that row
    unchanged (no NaN is written either way). For finite gradients the results are the same, which the
    harness checks; the update shape's gradients are larger than the caches, so there the pass is a second
    read of them from memory."""

    kinds = ("train", "update")  # a lookup does not read gradients
    name = "embedcore-skip"
    label = "embedcore non_finite=skip"
    measures = ("as embedcore, with Embedding(non_finite='skip'): no pass over the gradients before the update; "
                "rows whose summed gradient is NaN/Inf are skipped in the fused kernel and reported")
    non_finite = "skip"
