"""Training steps on float32, bfloat16 and float16 tables of the update shape, alternating in one process.

Run from the repository root::

    python benchmarks/bench_16_bit.py [--rows 2000000] [--dim 64] [--ids 262144] [--rounds 12] [--steps 3]
        [--threads 2] [--optimizer rowwise_adagrad|adagrad|sgd] [--dtypes float32,bfloat16,float16]

Workload: the update shape (:func:`embedcore.bench.workloads.update_workload`): one ``rows x dim`` table,
``ids`` ids a step from the bounded Zipf distribution calibrated to ~150,000 distinct ids (one id per
sample, sum combiner), so most rows a step reads are not in any cache: the lookup is a cold gather and the
update a random read-modify-write of ~150,000 rows. Each contender is an ``Embedding`` whose table has
``weights_dtype`` of its name (slots float32, stochastic rounding on), all with the same optimizer
(row-wise Adagrad by default, FBGEMM's conventions: accumulators from 0, eps 1e-8) and the same batches.
Each round runs ``steps`` steps per contender (lookup, then ``apply_gradients`` of the given gradient), the
contenders' order reversed every other round; medians are over all steps of all rounds. Every contender
runs with the same Numba thread count (``--threads``) and the process's allocator.

Bytes a step (the model, not a measurement): ``n_unique * (2 * dim * itemsize + 2 * slot bytes)`` for the
update's rows and slots read and written, plus ``ids * dim * 4`` for the gradient rows it reads.
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
from embedcore.bench.machine import allocator_name
from embedcore.bench.workloads import make_batches, update_workload

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _optimizer(name):
    if name == "rowwise_adagrad":
        return ec.RowwiseAdagrad(0.01, initial_accumulator_value=0.0, epsilon=1e-8)
    if name == "adagrad":
        return ec.Adagrad(0.01)
    return ec.SGD(0.01)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=262_144)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizer", default="rowwise_adagrad", choices=("rowwise_adagrad", "adagrad", "sgd"))
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")

    w = update_workload(E=args.rows, D=args.dim, ids=args.ids, n_batches=args.steps)
    batches = make_batches(w)
    inputs = [(b.ids[0][:, None], np.ascontiguousarray(b.grad[0], np.float32)) for b in batches]
    n_unique = [len(np.unique(ids)) for ids, _ in inputs]

    engines = {}
    for dtype in dtypes:
        table = ec.TableConfig(args.rows, args.dim, name="t", combiner="sum", initializer=ec.RandomUniform(-0.05, 0.05),
                               weights_dtype=dtype)
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, _optimizer(args.optimizer), seed=1)
        for ids, grad in inputs[:2]:  # compile, and touch every page the batches map
            acts, ctx = emb({"f": ids})
            emb.apply_gradients({"f": grad}, ctx)
        engines[dtype] = emb

    times = {d: {"lookup": [], "update": []} for d in dtypes}
    for r in range(args.rounds):
        for dtype in (dtypes if r % 2 == 0 else dtypes[::-1]):
            emb = engines[dtype]
            for ids, grad in inputs:
                t0 = time.perf_counter()
                acts, ctx = emb({"f": ids})
                t1 = time.perf_counter()
                emb.apply_gradients({"f": grad}, ctx)
                t2 = time.perf_counter()
                times[dtype]["lookup"].append(t1 - t0)
                times[dtype]["update"].append(t2 - t1)

    slot_bytes = 4 if args.optimizer == "rowwise_adagrad" else (4 * args.dim if args.optimizer == "adagrad" else 0)
    print(f"# {args.rows:,} x {args.dim} table, {args.ids:,} ids a step ({min(n_unique):,}-{max(n_unique):,} "
          f"distinct), {args.optimizer}, {args.rounds} rounds x {args.steps} steps, Numba {args.threads} threads, "
          f"allocator {allocator_name()}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    base = {phase: statistics.median(times[dtypes[0]][phase]) for phase in ("lookup", "update")}
    print(f"{'table':<10} {'lookup ms':>10} {'vs ' + dtypes[0]:>12} {'update ms':>10} {'vs ' + dtypes[0]:>12} "
          f"{'step ms':>9} {'MB a step':>10}")
    for dtype in dtypes:
        lookup = statistics.median(times[dtype]["lookup"])
        update = statistics.median(times[dtype]["update"])
        step = statistics.median(a + b for a, b in zip(times[dtype]["lookup"], times[dtype]["update"]))
        mb = (statistics.median(n_unique) * (2 * args.dim * ITEMSIZE[dtype] + 2 * slot_bytes)
              + args.ids * args.dim * 4) / 1e6
        print(f"{dtype:<10} {lookup * 1e3:>10.2f} {lookup / base['lookup']:>11.2f}x {update * 1e3:>10.2f} "
              f"{update / base['update']:>11.2f}x {step * 1e3:>9.2f} {mb:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
