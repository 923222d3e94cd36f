"""How far ahead the fused update should prefetch table and slot rows: several distances in one process.

Run from the repository root::

    python benchmarks/bench_prefetch.py [--workload tbe|update|tables] [--optimizers sgd,adagrad]
                                        [--dim 16] [--distances 4,8,16] [--mode kernel|step] [--steps 30]

The update kernel prefetches the table and slot rows of the unique row ``ROWS_AHEAD`` places ahead of the
current one (``kernels.update``). This script builds one kernel per distance, in one process, and times
them alternating:

* ``--mode kernel``: the update kernel alone, on the arguments ``apply_gradients`` passed it for a few real
  batches (the rows it updates are the same for every contender; values drift, timings do not);
* ``--mode step``: whole steps (lookup + ``apply_gradients``) with the engine's kernel swapped per step.

Before every timed call a ``--flush-mb`` buffer is written, so that no distance finds the rows the one
before it loaded (without it, whichever ran first on a batch paid the cache misses for the others, and
the distances in the middle of the alternation looked faster).

Workloads: ``tbe`` and ``update`` are the harness's (``embedcore.bench.workloads``); ``tables`` is
``--tables`` stacked tables of ``--values // dim`` rows of ``--dim``, ``--bags`` bags of ``--ids-per-bag``
uniform ids per table (many small rows at random: where the distance matters most). Medians in ms.
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

import numpy as np
from numba import njit

import embedcore as ec
from embedcore import engine
from embedcore.kernels import update
from embedcore.kernels.rows import fixed_length


def kernel_with(row_function, lazy, distance, dim):
    """The fused update kernel of ``row_function`` for rows of ``dim`` values (as the engine compiles it),
    prefetching ``distance`` unique rows ahead."""
    namespace = update.kernel_namespace(row_function)
    namespace["ROWS_AHEAD"] = distance
    source = update.kernel_source(row_function, lazy, dim if dim is not None and fixed_length(dim) else None)
    exec(compile(source, "<update kernel>", "exec"), namespace)
    return njit(parallel=True, error_model="numpy")(namespace["kernel"])


def _tables_workload(args, optimizer):
    n_rows = args.values // args.dim
    tables = [ec.TableConfig(n_rows, args.dim, name=f"t{i}") for i in range(args.tables)]
    make = {"sgd": lambda: ec.SGD(0.1), "adagrad": lambda: ec.Adagrad(0.1),
            "rowwise_adagrad": lambda: ec.RowwiseAdagrad(0.1), "adam": lambda: ec.Adam(0.01)}[optimizer]
    emb = ec.Embedding({f"f{i}": ec.FeatureConfig(t) for i, t in enumerate(tables)}, make())
    rng = np.random.default_rng(0)
    n = args.bags * args.ids_per_bag
    splits = np.arange(0, n + 1, args.ids_per_bag)
    batches = [({f"f{i}": ec.Ragged(rng.integers(0, n_rows, n), splits) for i in range(args.tables)},
                {f"f{i}": rng.standard_normal((args.bags, args.dim)).astype(np.float32) for i in range(args.tables)})
               for _ in range(4)]

    def step(batch):
        _, ctx = emb.lookup(batch[0])
        emb.apply_gradients(batch[1], ctx)
    return f"{args.tables} tables of {n_rows:,} x {args.dim}, {args.bags} bags of {args.ids_per_bag}", step, batches


def _harness_workload(args, optimizer):
    from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
    from embedcore.bench.workloads import make_batches, make_optim, tbe_workload, update_workload
    w = (tbe_workload if args.workload == "tbe" else update_workload)(optim=make_optim(optimizer), n_batches=4)
    contender = EmbedcoreContender(2)
    contender.load()
    contender.setup(w, None)

    def step(batch):
        contender.run(contender.prepare(batch))
    return w.label, step, make_batches(w)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tables", choices=("tbe", "update", "tables"))
    parser.add_argument("--optimizers", default="sgd,adagrad")
    parser.add_argument("--distances", default="4,8,16")
    parser.add_argument("--mode", default="kernel", choices=("kernel", "step"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--values", type=int, default=1_600_000, help="floats per table")
    parser.add_argument("--bags", type=int, default=1024)
    parser.add_argument("--ids-per-bag", type=int, default=3)
    parser.add_argument("--flush-mb", type=int, default=96, help="buffer written before every timed call")
    args = parser.parse_args(argv)
    distances = [int(d) for d in args.distances.split(",")]
    real_factory = engine.fused_update_kernel
    for optimizer in args.optimizers.split(","):
        captured, kernels = [], {}

        def capturing_factory(row_function, lazy=True, dim=None):
            kernel = real_factory(row_function, lazy, dim)
            for d in distances:
                if (d, row_function, lazy) not in kernels:
                    kernels[d, row_function, lazy] = kernel_with(row_function, lazy, d, dim)

            def run(*a):
                captured.append((row_function, lazy, [x.copy() if isinstance(x, np.ndarray) else x for x in a]))
                return kernel(*a)
            return run

        engine.fused_update_kernel = capturing_factory
        label, step, batches = (_tables_workload if args.workload == "tables" else _harness_workload)(args, optimizer)
        for batch in batches:  # compiles, and captures one kernel call per batch
            step(batch)
        chosen = {}
        engine.fused_update_kernel = lambda row_function, lazy=True, dim=None: kernels[chosen["d"], row_function, lazy]
        times = {d: [] for d in distances}
        flush = np.zeros(args.flush_mb << 18, np.float32)
        for i in range(args.steps + 4):
            for d in (distances if i % 2 else distances[::-1]):
                flush += 1.0  # evicts the rows of this batch that the previous distance's run left cached
                if args.mode == "kernel":
                    row_function, lazy, call = captured[i % len(captured)]
                    call[-1][:] = 0  # status
                    t0 = time.perf_counter()
                    kernels[d, row_function, lazy](*call)
                else:
                    chosen["d"] = d
                    t0 = time.perf_counter()
                    step(batches[i % len(batches)])
                if i >= 4:  # the first rounds compile and warm up
                    times[d].append(time.perf_counter() - t0)
        engine.fused_update_kernel = real_factory
        print(f"{label}, {optimizer}, {args.mode}, distance in unique rows (engine: {update.ROWS_AHEAD}): " +
              ", ".join(f"{d} {1e3 * statistics.median(v):.3f} ms" for d, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
