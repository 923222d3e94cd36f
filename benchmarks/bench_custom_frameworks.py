"""A ``CustomOptimizer`` written in NumPy, TensorFlow or JAX against the built-in it reimplements (issue 25).

Run from the repository root::

    .venv/bin/python benchmarks/bench_custom_frameworks.py [--rounds 5] [--steps 10] [--threads 2]
        [--optimizers adagrad,rowwise_adagrad]

What it measures: whole training steps (``Embedding.lookup`` + ``apply_gradients``) on the TBE shape of
``embedcore/bench/workloads.py`` (8 tables of 250,000 x 64, 2,048 bags of 20 Zipf ids, unweighted), for
four engines per optimizer that differ only in the optimizer:

* ``adagrad``: the built-in ``ec.Adagrad`` (TensorFlow style: initial accumulator 0.1, no epsilon); the
  same math as a NumPy ``CustomOptimizer`` (``embedcore.app.quickstart.custom_adagrad``, as the
  ``embedcore-custom`` contender builds it); TensorFlow's documented ``@def_function.function`` example
  (``math_ops.sqrt``); and a ``jax.numpy`` function (``jnp.sqrt``).
* ``rowwise_adagrad``: the built-in ``ec.RowwiseAdagrad`` (FBGEMM's EXACT_ROWWISE_ADAGRAD, eps 1e-8);
  ``np.mean`` (``custom_rowwise_adagrad`` of the ``embedcore-custom`` contender), ``tf.reduce_mean`` (a
  ``@tf.function``) and ``jnp.mean`` versions, each with one scalar accumulator per row (``slot_dims=[1]``).

TensorFlow and JAX functions are translated to NumPy row functions when the optimizer is built
(``embedcore/translate/``) and compiled like any NumPy function; every engine is built and runs one pass over
the batches (compiling every kernel) before the clock starts. Then ``--rounds`` rounds: in each, every
variant runs one untimed step and ``--steps`` timed steps on the same batches, the order of the variants
rotated by one each round. Printed: per variant the median ms per step over all rounds, its ratio to the
built-in round by round (median of this round's steps / the built-in's), and the median of those ratios.
At the end every variant's tables and slots are compared with the built-in's (all saw the same batches in
the same order): bit for bit, or max |diff| / max |built-in| where the built-in's arithmetic differs.

Every contender runs in this one process, so with the same Numba threads (``--threads``, default 2), the same
OpenMP waiting (``GOMP_SPINCOUNT=100000`` unless set) and the same allocator (glibc malloc: the script says
which allocator ``LD_PRELOAD`` gives, and the recorded figures use none). The engine is configured only
through its public API.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # the harness's default OpenMP waiting

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numba
import numpy as np

import embedcore as ec
from embedcore.bench.contenders.embedcore_custom import custom_optimizer
from embedcore.bench.contenders.embedcore_engine import embedcore_optimizer
from embedcore.bench.machine import allocator_name
from embedcore.bench.workloads import make_batches, make_optim, tbe_workload

TOLERANCE = 1e-6  # max |diff| / max |built-in| accepted where the arithmetic is not the built-in's


# ----------------------------------------------------------------------------------------------------------
# The custom computations, written as each framework's users write them

def tensorflow_functions():
    import tensorflow as tf
    from tensorflow.python.eager import def_function
    from tensorflow.python.ops import math_ops

    @def_function.function
    def adagrad_optimizer_computation(gradient, embedding_table, slot_variables, learning_rate,
                                      hyperparameters):
        # TensorFlow's documented example (tf.tpu.experimental.embedding.CustomOptimizer), its lines joined
        del hyperparameters
        new_accumulator = slot_variables[0] + gradient * gradient
        return embedding_table - learning_rate * gradient / math_ops.sqrt(new_accumulator), new_accumulator

    @tf.function
    def rowwise_adagrad_computation(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        accumulator = slot_variables[0] + tf.reduce_mean(gradient * gradient)
        return (embedding_table - learning_rate * gradient / (tf.sqrt(accumulator) + hyperparameters[0]),
                accumulator)

    return {"adagrad": adagrad_optimizer_computation, "rowwise_adagrad": rowwise_adagrad_computation}


def jax_functions():
    import jax.numpy as jnp

    def jax_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        del hyperparameters
        accumulator = slot_variables[0] + gradient * gradient
        return embedding_table - learning_rate * gradient / jnp.sqrt(accumulator), accumulator

    def jax_rowwise_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        accumulator = slot_variables[0] + jnp.mean(gradient * gradient)
        return embedding_table - learning_rate * gradient / (jnp.sqrt(accumulator) + hyperparameters[0]), \
            accumulator

    return {"adagrad": jax_adagrad, "rowwise_adagrad": jax_rowwise_adagrad}


def optimizers(o, frameworks):
    """{variant name: (optimizer, slot names)} for ``OptimSpec`` ``o``, the built-in first."""
    builtin, slots = embedcore_optimizer(o)
    numpy_custom, _ = custom_optimizer(o, [0])
    out = {"built-in": (builtin, slots), "NumPy": (numpy_custom, slots)}
    for name, functions in frameworks.items():
        fn = functions[o.name]
        if o.name == "adagrad":
            opt = ec.CustomOptimizer(fn, o.lr, slot_names=["accumulators"], slot_initializers=[o.initial_accumulator])
        else:
            opt = ec.CustomOptimizer(fn, o.lr, slot_names=["accumulators"], slot_initializers=[o.initial_accumulator],
                                     slot_dims=[1], hyperparameters=[o.eps])
        out[name] = (opt, slots)
    return out


# ----------------------------------------------------------------------------------------------------------
# One engine through the public API

class Engine:
    def __init__(self, w, optimizer, slot_names):
        self.w, self.slot_names = w, slot_names
        features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(w.E, w.D, initializer=ec.Zeros(), combiner="sum",
                                                             name=f"t{t}"))
                    for t in range(w.T)}
        t0 = time.perf_counter()
        self.emb = ec.Embedding(features, optimizer)
        self.build_s = time.perf_counter() - t0

    def inputs(self, batch):
        features = {f"f{t}": ec.Ragged(batch.ids[t], batch.offsets[t]) for t in range(self.w.T)}
        grads = {f"f{t}": batch.grad[t] for t in range(self.w.T)}
        return features, grads

    def step(self, prepared):
        """One timed training step: lookup + apply_gradients; returns its seconds."""
        features, grads = prepared
        t0 = time.perf_counter()
        acts, ctx = self.emb.lookup(features)
        del acts
        self.emb.apply_gradients(grads, ctx)
        return time.perf_counter() - t0

    def state(self):
        return [self.emb.embedding_tables[f"t{t}"] for t in range(self.w.T)] + \
            [self.emb.slot_variables[f"t{t}"][s] for t in range(self.w.T) for s in self.slot_names]


def compare(ref, other):
    """(bit for bit?, max |diff| / max |ref|) over the tables and slots."""
    equal = all(np.array_equal(a, b) for a, b in zip(ref, other, strict=True))
    scale = max(float(np.max(np.abs(a))) for a in ref) or 1.0
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(ref, other, strict=True))
    return equal, diff / scale


def run_optimizer(name, args, frameworks):
    w = tbe_workload(optim=make_optim(name), n_batches=3)
    batches = make_batches(w)
    engines = {}
    for variant, (opt, slots) in optimizers(w.optim, frameworks).items():
        engines[variant] = Engine(w, opt, slots)
    first_s = {}
    for variant, engine in engines.items():  # compile every kernel, warm up: excluded from the figures
        first_s[variant] = engine.step(engine.inputs(batches[0]))
        for batch in batches[1:]:
            engine.step(engine.inputs(batch))
    names = list(engines)
    times = {v: [] for v in names}
    ratios = {v: [] for v in names}
    for r in range(args.rounds):
        k = r % len(names)
        this_round = {}
        for variant in names[k:] + names[:k]:
            engine = engines[variant]
            engine.step(engine.inputs(batches[0]))  # untimed: lets the previous variant's caches go
            ts = []
            for s in range(args.steps):
                prepared = engine.inputs(batches[(s + 1) % len(batches)])
                ts.append(engine.step(prepared))
            times[variant] += ts
            this_round[variant] = statistics.median(ts)
        for variant in names:
            ratios[variant].append(this_round[variant] / this_round["built-in"])
    print(f"{w.label}: {w.optim.describe()}; {args.rounds} rounds x {args.steps} steps per variant, order "
          f"rotated each round", flush=True)
    ref = engines["built-in"].state()
    for variant in names:
        engine = engines[variant]
        med = 1e3 * statistics.median(times[variant])
        rr = " ".join(f"{x:.2f}" for x in ratios[variant])
        if variant == "built-in":
            check = "reference"
        else:
            equal, rel = compare(ref, engine.state())
            check = "bit for bit" if equal else \
                f"max|diff|/max|ref| {rel:.1e} ({'<=' if rel <= TOLERANCE else 'ABOVE'} {TOLERANCE:.0e})"
        print(f"  {variant:9s} step median {med:7.3f} ms  ratio median {statistics.median(ratios[variant]):.3f}  "
              f"per round [{rr}]  build {engine.build_s:5.2f} s, first step {first_s[variant]:5.2f} s  "
              f"tables+slots vs built-in: {check}", flush=True)
    return engines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="Numba threads (every variant)")
    parser.add_argument("--optimizers", default="adagrad,rowwise_adagrad")
    args = parser.parse_args(argv)
    names = [n for n in args.optimizers.split(",") if n]
    for n in names:
        if n not in ("adagrad", "rowwise_adagrad"):
            parser.error(f"--optimizers: {n!r} is not adagrad or rowwise_adagrad")
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    alloc, preload = allocator_name()
    frameworks = {}
    t0 = time.perf_counter()
    frameworks["TF"] = tensorflow_functions()
    frameworks["JAX"] = jax_functions()
    import jax
    import tensorflow as tf
    print(f"embedcore custom optimizers by framework: Numba {numba.get_num_threads()} threads, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT')}, allocator {alloc} (LD_PRELOAD={preload or '(empty)'}), "
          f"{os.cpu_count()} CPUs; numpy {np.__version__}, numba {numba.__version__}, tensorflow {tf.__version__}, "
          f"jax {jax.__version__} (imports {time.perf_counter() - t0:.1f} s); "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    for name in names:
        run_optimizer(name, args, frameworks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
