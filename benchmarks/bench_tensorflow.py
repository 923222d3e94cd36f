"""A training step through ``embedcore.tensorflow`` against the NumPy API and TensorFlow's own CPU path.

The real run (TBE shape, on an idle machine), from the repository root::

    PYTHONPATH=. python benchmarks/bench_tensorflow.py --rounds 12 --steps 5 --threads 2

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
  ``embedcore`` contender of ``benchmarks/bench_step.py``; its ``G`` are views of one array, which the
  engine reads in place).
* ``numpy-sep``: the same fed each feature's gradient as its own array, as TensorFlow hands them over: the
  engine copies them into one (``numpy`` 's are views of one array, read in place), which a TensorFlow
  front pays too.
* ``tf-empty``: TensorFlow's own cost of such a step: the ``tf.function`` below, fed as the others, with no
  work (it takes the batch and does nothing with it). Every TensorFlow training step with these inputs
  pays it, whatever its embedding.
* ``tf-floor``: the NumPy API called from two bare ``tf.numpy_function`` ops in a ``tf.function`` (the
  lookup, then the update; no checks, no static shapes, no handle registry): what TensorFlow charges to call
  into Python with these tensors, the least any bridge built on ``tf.numpy_function`` can cost. Its ops time
  the engine's calls, which splits its step into the engine and the rest.
* ``v2``: ``embedcore.tensorflow.TPUEmbeddingV2`` built from TensorFlow's own config objects, in a
  ``tf.function``: ``acts, preserved = emb(features)`` (``tf.RaggedTensor`` bags), then
  ``emb.apply_gradients(G, preserved)`` (``G`` as ``tf.Tensor`` s; no dense model, so the difference from
  ``numpy`` is what the TensorFlow layer adds).
* ``keras``: ``embedcore.tensorflow.keras.EmbeddingLayer`` in a ``tf.function``: the layer called with
  ``training=True`` under a ``GradientTape``, the loss above, ``tape.gradient(loss, [update_trigger])``
  (which runs the fused update): the custom gradient's plumbing and the loss's ops are included.
* ``tf-keras``: TensorFlow's own CPU path for the same model: one ``tf.Variable`` per table,
  ``tf.nn.embedding_lookup_sparse(..., combiner="sum")`` on ``tf.SparseTensor`` bags, ``GradientTape``,
  ``keras.optimizers.Adagrad(epsilon=0)`` (Keras 3 turns the sparse gradient dense: every row is read and
  written each step), in a ``tf.function``.
* ``tf-sparse``: the same with ``tf.compat.v1.train.AdagradOptimizer`` (TensorFlow's fused sparse kernel,
  ``ResourceSparseApplyAdagrad``): TensorFlow's fastest CPU Adagrad.

Feeding (``--feed``): ``iterator`` (the default) gives each TensorFlow contender's ``tf.function`` a
``tf.data`` iterator over the batches and takes the batch with ``next`` inside it, as Keras's ``model.fit``
and TensorFlow's TPU embedding examples feed a step; ``arguments`` passes the batch's tensors to the
``tf.function`` at every call, where TensorFlow's Python binds the 24 tensors of a TBE batch each call.

Method (the house conventions of :mod:`embedcore.bench`, one process per contender): each contender runs in
its own worker process (``multiprocessing`` spawn), so each is what a program holding only it gets: Numba's
OpenMP workers belong to the thread that starts a parallel region, and TensorFlow runs the front's ops on its
own threads, so contenders sharing a process would have several thread teams spinning on the same cores
(alternating with TensorFlow steps in one process made the NumPy API's own step 1.4x slower). The parent
builds nothing; workers are started one after another. Inputs are built before the clock starts; ``--check-
steps`` untimed steps, after which every contender's rows (all rows the batches touch and 1,024 others per
table) are compared with ``numpy``'s (max |diff| / max |reference| <= ``--tolerance``, else FAILED); then
``--rounds`` rounds of ``--steps`` timed steps per contender, one worker at a time (the others wait on a
pipe), the order rotated each round; medians over all timed steps; rows compared again at the end. Numba
and TensorFlow's intra-op pool get ``--threads`` threads (the pool ``--tf-intra-op`` where given), TensorFlow's
inter-op pool ``--tf-inter-op`` (0: TensorFlow's default); the allocator (``LD_PRELOAD``) and the CPU share
other processes used during the timed rounds are printed. Ratios are of medians measured in this one run; the target is ``v2`` and ``keras``
within 1.10x of ``numpy``.
"""

from __future__ import annotations

import argparse
import multiprocessing
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
from embedcore.bench.machine import allocator_name, cpu_snapshot
from embedcore.bench.workloads import initial_tables, make_batches, make_optim, tbe_workload

CONTENDERS = ("numpy", "numpy-sep", "tf-empty", "tf-floor", "v2", "keras", "tf-keras", "tf-sparse")
FEEDS = ("iterator", "arguments")
TARGET = 1.10
SAMPLED_ROWS = 1024  # untouched rows per table compared besides every touched one


def _tf():
    import tensorflow as tf
    return tf


class NumpyAPI(EmbedcoreContender):
    name, label = "numpy", "embedcore NumPy API"


class NumpyAPISeparateGradients(NumpyAPI):
    """The NumPy API fed each feature's gradient as its own array, as a TensorFlow program hands them over
    (``numpy`` 's are views of one ``[T, B, D]`` array, which the engine reads in place when the tables share
    one physical table; separate arrays it copies into one first)."""

    name, label = "numpy-sep", "embedcore NumPy API, separate gradient arrays"

    def _inputs(self, batch):
        features, weights, grads = super()._inputs(batch)
        # one array per feature, apart in memory (64 floats between them), so never one view's rows
        apart = np.zeros((len(grads), batch.grad[0].size + 64), np.float32)
        for i, name in enumerate(grads):
            apart[i, 64:] = grads[name].reshape(-1)
            grads[name] = apart[i, 64:].reshape(grads[name].shape)
        return features, weights, grads


class _TensorflowStep(Contender):
    """A contender whose step is a ``tf.function`` ``self._step(*prepared)``: fed the prepared batch as
    arguments (``run``), or from a ``tf.data`` iterator over the prepared batches (``iterator_step``)."""

    def run(self, prepared):
        self._step(*prepared)
        return None

    def iterator_step(self, batches):
        """A zero-argument callable running the step on the next of ``batches`` (cycling), taken with
        ``next`` inside a ``tf.function`` from a ``tf.data`` iterator."""
        tf = _tf()
        prepared = [self.prepare(b) for b in batches]
        dataset = tf.data.Dataset.from_tensors(prepared[0])
        for p in prepared[1:]:
            dataset = dataset.concatenate(tf.data.Dataset.from_tensors(p))
        iterator = iter(dataset.repeat())
        inner = self._step

        @tf.function
        def step(iterator):
            inner(*next(iterator))

        return lambda: step(iterator)


class _TensorflowFront(_TensorflowStep):
    """What the ``embedcore.tensorflow`` contenders share: TensorFlow's configs, ragged inputs."""

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

    def table(self, t):
        return self.engine.embedding_tables[f"t{t}"]

    def _start(self, w, init):
        self.w = w
        if init is not None:
            self.engine.set_state(tables={f"t{t}": init[t] for t in range(w.T)})


class TensorflowEmpty(_TensorflowFront):
    """TensorFlow's own cost of a step fed this batch: a ``tf.function`` that takes it and does nothing."""

    name, label = "tf-empty", "TensorFlow's own: the tf.function, no work"

    def setup(self, w, init):
        self.w = w
        self._step = _tf().function(lambda features, grads: None)

    def table(self, t):
        raise NotImplementedError("tf-empty trains nothing")

    def close(self):
        self._step = None


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
    in a ``tf.function`` (lookup; update), with no checks, shapes or handle registry. ``engine_seconds``
    accumulates the time of the engine's own calls inside the ops."""

    name, label = "tf-floor", "NumPy API in two bare tf.numpy_function ops"

    def setup(self, w, init):
        import embedcore as ec
        from embedcore.tensorflow import convert
        tf = _tf()
        self.engine = ec.Embedding(convert.features(self._tf_features(w)).features,
                                   convert.optimizer(self._tf_optimizer(w)))
        self._start(w, init)
        self.engine_seconds = 0.0
        names, pending = [f"f{t}" for t in range(w.T)], {}

        def lookup(*parts):
            t0 = time.perf_counter()
            acts, ctx = self.engine.lookup({f: ec.Ragged(parts[2 * i], parts[2 * i + 1]) for i, f in enumerate(names)})
            self.engine_seconds += time.perf_counter() - t0
            pending[id(ctx)] = ctx
            return [acts[f] for f in names] + [np.int64(id(ctx))]

        def apply(handle, *grads):
            t0 = time.perf_counter()
            self.engine.apply_gradients(dict(zip(names, grads)), pending.pop(int(handle)))
            self.engine_seconds += time.perf_counter() - t0
            return np.int64(self.engine.step)

        @tf.function
        def step(features, grads):
            parts = [x for f in names for x in (features[f].values, features[f].row_splits)]
            out = tf.numpy_function(lookup, parts, [tf.float32] * w.T + [tf.int64], stateful=True)
            tf.numpy_function(apply, [out[-1]] + [grads[f] for f in names], tf.int64, stateful=True)

        self._step = step

    def close(self):
        self.engine = self._step = None


class TensorflowOwn(_TensorflowStep):
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
        # tuples: tf.data would read a list as one tensor to stack
        return tuple(sparse), tuple(tf.constant(batch.grad[t]) for t in range(w.T))

    def table(self, t):
        return self.vars[t].numpy()

    def close(self):
        self.vars = self.opt = self._step = None


class TensorflowSparse(TensorflowOwn):
    name, label = "tf-sparse", "TensorFlow lookup_sparse + v1 sparse Adagrad"

    def _optimizer(self, w):
        return _tf().compat.v1.train.AdagradOptimizer(w.optim.lr, initial_accumulator_value=w.optim.initial_accumulator)


CLASSES = {c.name: c for c in (NumpyAPI, NumpyAPISeparateGradients, TensorflowEmpty, NumpyFunctionFloor, DropInV2, KerasLayer, TensorflowOwn,
                               TensorflowSparse)}
TRAINS = tuple(name for name in CONTENDERS if name != "tf-empty")  # contenders whose rows are compared


# ----------------------------------------------------------------------------------------------------------
# One contender's process.

def _workload(args):
    return tbe_workload(T=args.tables, E=args.rows, D=args.dim, B=args.batch, L=args.bag, alpha=args.alpha,
                        optim=make_optim("adagrad", "tf"), n_batches=args.n_batches)


def _compared_rows(w, batches):
    """Per table, the row indices compared across contenders: every row a batch touches, and
    ``SAMPLED_ROWS`` others (fixed), which must keep their initial values."""
    rng = np.random.default_rng(99)
    out = []
    for t in range(w.T):
        touched = np.unique(np.concatenate([b.ids[t] for b in batches]))
        out.append(np.union1d(touched, rng.choice(w.E, min(SAMPLED_ROWS, w.E), replace=False)))
    return out


def _worker(conn, name, args):
    """Build contender ``name``, then answer the parent: ``("steps", n)`` -> ``(seconds, engine seconds,
    CPU seconds)`` of the next ``n`` steps; ``("rows",)`` -> the compared rows; ``("stop",)``."""
    tf = _tf()
    tf.config.threading.set_intra_op_parallelism_threads(args.tf_intra_op or args.threads)
    if args.tf_inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(args.tf_inter_op)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    w = _workload(args)
    batches = make_batches(w)
    c = CLASSES[name](args.threads)
    c.load()
    t0 = time.perf_counter()
    c.setup(w, initial_tables(w))
    setup_s = time.perf_counter() - t0
    if args.feed == "iterator" and isinstance(c, _TensorflowStep):
        step = c.iterator_step(batches)  # takes the batches in order, as k does

        def one(k):
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0
    else:
        def one(k):
            prepared = c.prepare(batches[k % len(batches)])
            t0 = time.perf_counter()
            c.run(prepared)
            return time.perf_counter() - t0
    rows = _compared_rows(w, batches) if name in TRAINS else None
    conn.send({"setup_s": setup_s, "threads": (numba.get_num_threads(),
                                               tf.config.threading.get_intra_op_parallelism_threads(),
                                               tf.config.threading.get_inter_op_parallelism_threads()),
               "versions": (tf.__version__, numba.__version__)})
    k = 0
    while True:
        command = conn.recv()
        if command[0] == "steps":
            seconds, engine, cpu0 = [], [], os.times()
            for _ in range(command[1]):
                c.engine_seconds = 0.0
                seconds.append(one(k))
                engine.append(c.engine_seconds)
                k += 1
            cpu1 = os.times()
            conn.send((seconds, engine if isinstance(c, NumpyFunctionFloor) else None,
                       (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)))
        elif command[0] == "rows":
            conn.send([np.asarray(c.table(t))[idx] for t, idx in enumerate(rows)])
        else:
            c.close()
            conn.send("stopped")
            return


# ----------------------------------------------------------------------------------------------------------
# The parent: starts the workers, runs the rounds, reports.

class _Worker:
    """A contender's process and its pipe."""

    def __init__(self, context, name, args):
        self.name = name
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, name, args), name=f"bench-{name}", daemon=True)
        self.process.start()
        child.close()
        self.info = self.conn.recv()

    def ask(self, *command):
        self.conn.send(command)
        return self.conn.recv()

    def stop(self):
        try:
            self.ask("stop")
        finally:
            self.process.join(timeout=60)


def _disagreement(rows, reference):
    """Name -> max over tables of max |rows - reference's| / max |reference's|."""
    out = {}
    for name, mine in rows.items():
        worst = 0.0
        for a, ref in zip(mine, reference):
            ref = np.asarray(ref, np.float64)
            worst = max(worst, float(np.max(np.abs(np.asarray(a, np.float64) - ref), initial=0.0)) /
                        max(float(np.max(np.abs(ref), initial=0.0)), 1e-30))
        out[name] = worst
    return out


def _rows(workers):
    rows = {name: wk.ask("rows") for name, wk in workers.items() if name in TRAINS}
    return _disagreement(rows, rows["numpy"])


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
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender per round")
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--n-batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tf-intra-op", type=int, default=0, help="TensorFlow's intra-op threads (0: --threads)")
    p.add_argument("--tf-inter-op", type=int, default=1, help="TensorFlow's inter-op threads (0: its default)")
    p.add_argument("--feed", choices=FEEDS, default="iterator",
                   help="how TensorFlow steps get their batch: next(tf.data iterator) inside the tf.function, "
                        "or the tensors as the tf.function's arguments")
    p.add_argument("--gap-ms", type=float, default=30.0,
                   help="idle time before each contender's turn, so the previous one's spinning threads sleep")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLASSES]
    if unknown or "numpy" not in names:
        p.error(f"--contenders: unknown {unknown}" if unknown else "--contenders must include numpy (the reference)")
    names = [n for n in CONTENDERS if n in names]

    context = multiprocessing.get_context("spawn")
    workers = {}
    try:
        for name in names:  # one at a time: each builds its tables and compiles alone
            workers[name] = _Worker(context, name, args)
        first = {name: wk.ask("steps", args.check_steps)[0][0] if args.check_steps else float("nan")
                 for name, wk in workers.items()}
        checked = _rows(workers)

        times = {name: [] for name in workers}
        engine_times, others = [], []
        order = list(workers)
        for r in range(args.rounds):
            turn = order[r % len(order):] + order[:r % len(order)]
            snap, own = cpu_snapshot(), 0.0
            for name in turn:
                time.sleep(args.gap_ms / 1e3)
                seconds, engine, cpu = workers[name].ask("steps", args.steps)
                times[name] += seconds
                own += cpu
                if engine is not None:
                    engine_times += engine
            after = cpu_snapshot()
            if snap is not None and after is not None and after[1] > snap[1]:
                # machine busy time less the workers' and this process's own
                others.append(max(0.0, (after[0] - snap[0]) - own - (after[2] - snap[2])) / (after[1] - snap[1]))
        final = _rows(workers)
    finally:
        for wk in workers.values():
            wk.stop()

    w = _workload(args)
    info = workers["numpy"].info
    print(f"# {w.T} tables x {w.E:,} rows x {w.D}, {w.B:,} bags of {w.L} ids (FBGEMM Zipf, alpha {w.alpha}), "
          f"{w.optim.describe()}; {args.rounds} rounds x {args.steps} steps, order rotated each round; "
          f"one process per contender; TensorFlow steps fed: {args.feed}")
    print(f"# threads: Numba {info['threads'][0]}, TensorFlow intra-op {info['threads'][1]} / inter-op "
          f"{info['threads'][2]}{' (its default)' if not args.tf_inter_op else ''}; allocator {allocator_name()[0]}; "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}; tensorflow {info['versions'][0]}, numba "
          f"{info['versions'][1]}; other processes used "
          + (f"{100 * statistics.median(others):.0f}% of the CPUs (median round; max {100 * max(others):.0f}%)"
             if others else "an unknown share of the CPUs"))
    base = statistics.median(times["numpy"])
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{'contender':<46} {'median ms':>10} {'min':>8} {'max':>8} {'vs numpy':>9} {'first step s':>13} "
          f"{'setup s':>8} {'agreement':>22}")
    for name, wk in workers.items():
        if name in TRAINS:
            worst = max(checked[name], final[name])
            agreement = f"{worst:.1e}" + ("" if worst <= args.tolerance else " FAILED")
        else:
            agreement = "(trains nothing)"
        print(f"{CLASSES[name].label:<46} {med[name] * 1e3:>10.2f} {min(times[name]) * 1e3:>8.2f} "
              f"{max(times[name]) * 1e3:>8.2f} {med[name] / base:>8.2f}x {first[name]:>13.2f} "
              f"{wk.info['setup_s']:>8.1f} {agreement:>22}")
    own = med.get("tf-empty")
    for name in ("v2", "keras"):
        if name in med:
            ratio = med[name] / base
            line = (f"# {CLASSES[name].label}: adds {100 * (ratio - 1):+.1f}% to the NumPy API's step (target <= "
                    f"{100 * (TARGET - 1):.0f}%: {'met' if ratio <= TARGET else 'NOT met'})")
            if own is not None:
                layer = (med[name] - own) / base
                # information only: a user's program pays tf-empty too, so the target stays the line above
                line += (f"; beyond TensorFlow's own cost of the step (tf-empty, {own * 1e3:.2f} ms): "
                         f"{100 * (layer - 1):+.1f}%")
            print(line)
    if "tf-floor" in med and engine_times:
        engine = statistics.median(engine_times)
        parts = [f"the engine's calls {engine * 1e3:.2f} ms"]
        if own is not None:
            parts += [f"TensorFlow's own step {own * 1e3:.2f} ms",
                      f"the two tf.numpy_function ops around them {(med['tf-floor'] - engine - own) * 1e3:.2f} ms"]
        else:
            parts += [f"the rest {(med['tf-floor'] - engine) * 1e3:.2f} ms"]
        print(f"# {CLASSES['tf-floor'].label} ({med['tf-floor'] * 1e3:.2f} ms): " + ", ".join(parts)
              + "; " + "; ".join(f"{CLASSES[n].label} beyond it: {(med[n] - med['tf-floor']) * 1e3:+.2f} ms"
                                 for n in ("v2", "keras") if n in med))
    for tf_own in ("tf-keras", "tf-sparse"):
        for front in ("v2", "keras"):
            if tf_own in med and front in med:
                print(f"# {CLASSES[tf_own].label} / {CLASSES[front].label}: {med[tf_own] / med[front]:.2f}x")
    return 0 if all(max(checked[n], final[n]) <= args.tolerance for n in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
