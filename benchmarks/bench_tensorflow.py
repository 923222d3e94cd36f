"""A training step through ``embedcore.tensorflow`` against the NumPy API and TensorFlow's own CPU path.

The real run (TBE shape, on an idle machine), from the repository root::

    PYTHONPATH=. python benchmarks/bench_tensorflow.py --rounds 12 --steps 3 --threads 2

Smoke run (seconds)::

    PYTHONPATH=. python benchmarks/bench_tensorflow.py --tables 2 --rows 2000 --dim 8 --batch 32 --bag 4 \\
        --rounds 2 --steps 1

Workload: FBGEMM's TBE benchmark shape (:func:`embedcore.bench.workloads.tbe_workload`): ``--tables`` tables
of ``--rows`` x ``--dim`` float32, one sum-pooled feature each, batches of ``--batch`` bags of ``--bag``
Zipf ids (FBGEMM's generator, alpha 1.15), TensorFlow-style Adagrad (lr 0.01, accumulators from 0.1, no
epsilon), the loss ``sum_t <pooled_t, G_t>`` with a fixed random ``G_t`` per table and batch, so the
activation gradient is ``G`` for every contender. All start from the same tables and see the same batches
in the same order. Contenders (one step each):

* ``numpy``: the NumPy API, ``Embedding.lookup(Ragged ...)`` + ``apply_gradients(G, ctx)`` (the
  ``embedcore`` contender of ``benchmarks/bench_step.py``).
* ``v2``: ``embedcore.tensorflow.TPUEmbeddingV2`` built from TensorFlow's own config objects, in a
  ``tf.function``: ``acts, preserved = emb(features)`` (``tf.RaggedTensor`` bags), then
  ``emb.apply_gradients(G, preserved)`` (``G`` as ``tf.Tensor`` s; no dense model, so the difference from
  ``numpy`` is what the TensorFlow layer adds).
* ``tf-floor``: the NumPy API called from two bare ``tf.numpy_function`` ops in a ``tf.function`` (the
  lookup, then the update; no checks, no static shapes, no handle registry): what TensorFlow itself charges
  to call into Python with these tensors, the least any bridge built on ``tf.numpy_function`` can cost.
* ``keras``: ``embedcore.tensorflow.keras.EmbeddingLayer`` in a ``tf.function``: the layer called with
  ``training=True`` under a ``GradientTape``, the loss above, ``tape.gradient(loss, [update_trigger])``
  (which runs the fused update): the custom gradient's plumbing and the loss's ops are included.
* ``tf-keras``: TensorFlow's own CPU path for the same model: one ``tf.Variable`` per table,
  ``tf.nn.embedding_lookup_sparse(..., combiner="sum")`` on ``tf.SparseTensor`` bags, ``GradientTape``,
  ``keras.optimizers.Adagrad(epsilon=0)`` (Keras 3 turns the sparse gradient dense: every row is read and
  written each step), in a ``tf.function``.
* ``tf-sparse``: the same with ``tf.compat.v1.train.AdagradOptimizer`` (TensorFlow's fused sparse kernel,
  ``ResourceSparseApplyAdagrad``): TensorFlow's fastest CPU Adagrad.

Method (the house conventions of :mod:`embedcore.bench`): inputs are built before the clock starts
(``prepare``); ``--check-steps`` untimed steps, after which every contender's tables are compared with
``numpy``'s (max |diff| / max |reference| <= ``--tolerance``, else FAILED); then ``--rounds`` rounds of
``--steps`` timed steps per contender, the contenders' order rotated each round; medians over all timed
steps; tables compared again at the end. Numba and TensorFlow's intra-op pool get ``--threads`` threads,
TensorFlow's inter-op pool 1; the allocator (``LD_PRELOAD``) is printed. Ratios are of medians measured in
this one run; the target is ``v2`` and ``keras`` within 1.10x of ``numpy``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # the harness's default OpenMP waiting
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numba
import numpy as np

from embedcore.bench.contenders import Contender
from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
from embedcore.bench.machine import allocator_name
from embedcore.bench.workloads import initial_tables, make_batches, make_optim, tbe_workload

CONTENDERS = ("numpy", "tf-floor", "v2", "keras", "tf-keras", "tf-sparse")
TARGET = 1.10


def _tf():
    import tensorflow as tf
    return tf


class NumpyAPI(EmbedcoreContender):
    name, label = "numpy", "embedcore NumPy API"


class _TensorflowFront(Contender):
    """What the two ``embedcore.tensorflow`` contenders share: TensorFlow's configs, ragged inputs."""

    def _tf_features(self, w):
        tf = _tf()
        E = tf.tpu.experimental.embedding
        return {f"f{t}": E.FeatureConfig(table=E.TableConfig(vocabulary_size=w.E, dim=w.D, combiner="sum",
                                                               initializer=tf.zeros_initializer(), name=f"t{t}"))
                for t in range(w.T)}

    def _tf_optimizer(self, w):
        E = _tf().tpu.experimental.embedding
        return E.Adagrad(w.optim.lr, initial_accumulator_value=w.optim.initial_accumulator)

    def prepare(self, batch):
        tf = _tf()
        features = {f"f{t}": tf.RaggedTensor.from_row_splits(tf.constant(batch.ids[t]), tf.constant(batch.offsets[t]))
                    for t in range(self.w.T)}
        return features, {f"f{t}": tf.constant(batch.grad[t]) for t in range(self.w.T)}

    def run(self, prepared):
        self._step(*prepared)
        return None

    def table(self, t):
        return self.engine.embedding_tables[f"t{t}"]

    def _start(self, w, init):
        self.w = w
        if init is not None:
            self.engine.set_state(tables={f"t{t}": init[t] for t in range(w.T)})


class DropInV2(_TensorflowFront):
    name, label = "v2", "embedcore.tensorflow TPUEmbeddingV2"

    def setup(self, w, init):
        from embedcore.tensorflow.engines import TPUEmbeddingV2
        tf = _tf()
        self.front = TPUEmbeddingV2(self._tf_features(w), self._tf_optimizer(w))
        self.front.build()
        self.engine = self.front.engine
        self._start(w, init)

        @tf.function
        def step(features, grads):
            _, preserved = self.front(features)
            self.front.apply_gradients(grads, preserved)

        self._step = step

    def close(self):
        self.front = self.engine = self._step = None


class KerasLayer(_TensorflowFront):
    name, label = "keras", "embedcore.tensorflow Keras layer"

    def setup(self, w, init):
        from embedcore.tensorflow.keras import EmbeddingLayer
        tf = _tf()
        self.layer = EmbeddingLayer(self._tf_features(w), self._tf_optimizer(w))
        self.engine = self.layer.embedding
        self._start(w, init)

        @tf.function
        def step(features, grads):
            with tf.GradientTape() as tape:
                acts = self.layer(features, training=True)
                loss = tf.add_n([tf.reduce_sum(acts[f] * grads[f]) for f in sorted(grads)])
            tape.gradient(loss, [self.layer.update_trigger])

        self._step = step

    def close(self):
        self.layer = self.engine = self._step = None


class NumpyFunctionFloor(_TensorflowFront):
    """The least any TensorFlow bridge can cost: the NumPy API called from two bare ``tf.numpy_function`` ops
    in a ``tf.function`` (lookup; update), with no checks, shapes or handle registry."""

    name, label = "tf-floor", "NumPy API in two bare tf.numpy_function ops"

    def setup(self, w, init):
        import embedcore as ec
        from embedcore.tensorflow import convert
        tf = _tf()
        self.engine = ec.Embedding(convert.features(self._tf_features(w)).features,
                                   convert.optimizer(self._tf_optimizer(w)))
        self._start(w, init)
        names, pending = [f"f{t}" for t in range(w.T)], {}

        def lookup(*parts):
            acts, ctx = self.engine.lookup({f: ec.Ragged(parts[2 * i], parts[2 * i + 1]) for i, f in enumerate(names)})
            pending[id(ctx)] = ctx
            return [acts[f] for f in names] + [np.int64(id(ctx))]

        def apply(handle, *grads):
            self.engine.apply_gradients(dict(zip(names, grads)), pending.pop(int(handle)))
            return np.int64(self.engine.step)

        @tf.function
        def step(features, grads):
            parts = [x for f in names for x in (features[f].values, features[f].row_splits)]
            out = tf.numpy_function(lookup, parts, [tf.float32] * w.T + [tf.int64], stateful=True)
            tf.numpy_function(apply, [out[-1]] + [grads[f] for f in names], tf.int64, stateful=True)

        self._step = step

    def close(self):
        self.engine = self._step = None


class TensorflowOwn(Contender):
    """TensorFlow's CPU path: ``embedding_lookup_sparse`` + a TensorFlow optimizer on ``tf.Variable`` s."""

    name, label = "tf-keras", "TensorFlow lookup_sparse + Keras Adagrad"

    def _optimizer(self, w):
        import keras
        return keras.optimizers.Adagrad(w.optim.lr, initial_accumulator_value=w.optim.initial_accumulator,
                                        epsilon=0.0)

    def setup(self, w, init):
        tf = _tf()
        self.w = w
        self.vars = [tf.Variable(init[t] if init is not None else tf.zeros((w.E, w.D), tf.float32), name=f"t{t}")
                     for t in range(w.T)]
        self.opt = self._optimizer(w)

        @tf.function
        def step(sparse_ids, grads):
            with tf.GradientTape() as tape:
                outs = [tf.nn.embedding_lookup_sparse(v, ids, None, combiner="sum")
                        for v, ids in zip(self.vars, sparse_ids)]
                loss = tf.add_n([tf.reduce_sum(o * g) for o, g in zip(outs, grads)])
            self.opt.apply_gradients(zip(tape.gradient(loss, self.vars), self.vars))

        self._step = step

    def prepare(self, batch):
        tf = _tf()
        w, sparse = self.w, []
        for t in range(w.T):
            lengths = np.diff(batch.offsets[t])
            rows = np.repeat(np.arange(w.B, dtype=np.int64), lengths)
            cols = np.arange(batch.ids[t].size, dtype=np.int64) - np.repeat(batch.offsets[t][:-1], lengths)
            sparse.append(tf.SparseTensor(np.stack([rows, cols], 1), batch.ids[t], [w.B, int(lengths.max(initial=1))]))
        return sparse, [tf.constant(batch.grad[t]) for t in range(w.T)]

    def run(self, prepared):
        self._step(*prepared)
        return None

    def table(self, t):
        return self.vars[t].numpy()

    def close(self):
        self.vars = self.opt = self._step = None


class TensorflowSparse(TensorflowOwn):
    name, label = "tf-sparse", "TensorFlow lookup_sparse + v1 sparse Adagrad"

    def _optimizer(self, w):
        return _tf().compat.v1.train.AdagradOptimizer(w.optim.lr, initial_accumulator_value=w.optim.initial_accumulator)


CLASSES = {c.name: c for c in (NumpyAPI, NumpyFunctionFloor, DropInV2, KerasLayer, TensorflowOwn, TensorflowSparse)}


def _disagreement(contenders, reference, T):
    """Name -> max over tables of max |table - reference's| / max |reference's|."""
    out = {}
    for name, c in contenders.items():
        worst = 0.0
        for t in range(T):
            ref = np.asarray(reference.table(t), np.float64)
            worst = max(worst, float(np.max(np.abs(np.asarray(c.table(t), np.float64) - ref)) /
                                     max(float(np.max(np.abs(ref))), 1e-30)))
        out[name] = worst
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048, help="bags per table")
    p.add_argument("--bag", type=int, default=20, help="ids per bag")
    p.add_argument("--alpha", type=float, default=1.15, help="Zipf alpha (FBGEMM's generator)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender per round")
    p.add_argument("--check-steps", type=int, default=2)
    p.add_argument("--n-batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLASSES]
    if unknown or "numpy" not in names:
        p.error(f"--contenders: unknown {unknown}" if unknown else "--contenders must include numpy (the reference)")

    tf = _tf()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    w = tbe_workload(T=args.tables, E=args.rows, D=args.dim, B=args.batch, L=args.bag, alpha=args.alpha,
                     optim=make_optim("adagrad", "tf"), n_batches=args.n_batches)
    batches = make_batches(w)
    init = initial_tables(w)

    contenders = {}
    for name in names:
        c = CLASSES[name](args.threads)
        c.load()
        t0 = time.perf_counter()
        c.setup(w, init)
        c.info["setup_s"] = time.perf_counter() - t0
        contenders[name] = c
    del init

    def step(c, k):
        prepared = c.prepare(batches[k % len(batches)])
        t0 = time.perf_counter()
        c.run(prepared)
        return time.perf_counter() - t0

    first = {name: [step(c, k) for k in range(args.check_steps)][0] if args.check_steps else float("nan")
             for name, c in contenders.items()}
    checked = _disagreement(contenders, contenders["numpy"], w.T)

    times = {name: [] for name in contenders}
    k = args.check_steps
    order = list(contenders)
    for r in range(args.rounds):
        turn = order[r % len(order):] + order[:r % len(order)]
        for name in turn:
            for s in range(args.steps):
                times[name].append(step(contenders[name], k + s))
        k += args.steps
    final = _disagreement(contenders, contenders["numpy"], w.T)

    print(f"# {w.T} tables x {w.E:,} rows x {w.D}, {w.B:,} bags of {w.L} ids (FBGEMM Zipf, alpha {w.alpha}), "
          f"{w.optim.describe()}; {args.rounds} rounds x {args.steps} steps, order rotated each round")
    print(f"# threads: Numba {numba.get_num_threads()}, TensorFlow intra-op "
          f"{tf.config.threading.get_intra_op_parallelism_threads()} / inter-op "
          f"{tf.config.threading.get_inter_op_parallelism_threads()}; allocator {allocator_name()[0]}; "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}; tensorflow {tf.__version__}, numba {numba.__version__}")
    base = statistics.median(times["numpy"])
    print(f"{'contender':<46} {'median ms':>10} {'min':>8} {'max':>8} {'vs numpy':>9} {'first step s':>13} "
          f"{'agreement':>22}")
    for name, c in contenders.items():
        med = statistics.median(times[name])
        worst = max(checked[name], final[name])
        agreement = f"{worst:.1e}" + ("" if worst <= args.tolerance else " FAILED")
        print(f"{c.label:<46} {med * 1e3:>10.2f} {min(times[name]) * 1e3:>8.2f} {max(times[name]) * 1e3:>8.2f} "
              f"{med / base:>8.2f}x {first[name]:>13.2f} {agreement:>22}")
    for name in ("v2", "keras"):
        if name in times:
            ratio = statistics.median(times[name]) / base
            print(f"# {CLASSES[name].label}: adds {100 * (ratio - 1):+.1f}% to the NumPy API's step "
                  f"(target <= {100 * (TARGET - 1):.0f}%: {'met' if ratio <= TARGET else 'NOT met'})")
    if "tf-floor" in times:
        floor = statistics.median(times["tf-floor"])
        print(f"# TensorFlow's own cost of calling into Python (tf-floor - numpy): {(floor - base) * 1e3:+.2f} ms; "
              + "; ".join(f"{CLASSES[n].label} beyond it: {(statistics.median(times[n]) - floor) * 1e3:+.2f} ms"
                          for n in ("v2", "keras") if n in times))
    for own in ("tf-keras", "tf-sparse"):
        for front in ("v2", "keras"):
            if own in times and front in times:
                print(f"# {CLASSES[own].label} / {CLASSES[front].label}: "
                      f"{statistics.median(times[own]) / statistics.median(times[front]):.2f}x")
    for c in contenders.values():
        c.close()
    return 0 if all(max(checked[n], final[n]) <= args.tolerance for n in contenders) else 1


if __name__ == "__main__":
    sys.exit(main())
