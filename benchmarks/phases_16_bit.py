"""Where the 16-bit table's step goes: each phase of the update shape's step (``Tuning.phase_timer``: layout,
gather, gradient check, grouping, update kernel), float32 against bfloat16 tables rounded stochastically and
to nearest.

Run from the repository root::

    python benchmarks/phases_16_bit.py [--rows 2000000] [--rounds 6] [--threads 2]

The workload and optimizer are ``bench_16_bit.py``'s (row-wise Adagrad, 262,144 bounded-Zipf ids a step);
the contenders alternate, their order reversed every other round; medians over all steps of all rounds. A
table of few rows (``--rows 200000``: a bfloat16 table fits the L3 cache) separates the rows' misses from
the per-row work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

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

CONTENDERS = ("float32", "bfloat16", "bfloat16-nearest")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    w = update_workload(E=args.rows, D=64, ids=262144, n_batches=3)
    inputs = [(b.ids[0][:, None], np.ascontiguousarray(b.grad[0], np.float32)) for b in make_batches(w)]
    phases: dict = {}
    current = ["warm-up"]

    def timer(phase, seconds):
        phases.setdefault((current[0], phase), []).append(seconds)

    engines = {}
    for name in CONTENDERS:
        table = ec.TableConfig(args.rows, 64, name="t", combiner="sum", initializer=ec.RandomUniform(-0.05, 0.05),
                               weights_dtype=name.removesuffix("-nearest"),
                               stochastic_rounding=not name.endswith("-nearest"))
        engines[name] = ec.Embedding({"f": ec.FeatureConfig(table)},
                                     ec.RowwiseAdagrad(0.01, initial_accumulator_value=0.0, epsilon=1e-8), seed=1,
                                     tuning=ec.Tuning(phase_timer=timer))
        current[0] = "warm-up"
        for ids, grad in inputs[:2]:
            acts, ctx = engines[name]({"f": ids})
            engines[name].apply_gradients({"f": grad}, ctx)
    for r in range(args.rounds):
        for name in (CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]):
            current[0] = name
            for ids, grad in inputs:
                acts, ctx = engines[name]({"f": ids})
                engines[name].apply_gradients({"f": grad}, ctx)
    print(f"# {args.rows:,} x 64 table, 262,144 ids a step, row-wise Adagrad, {args.rounds} rounds x 3 steps, "
          f"Numba {args.threads} threads, allocator {allocator_name()}; median ms")
    print(f"{'phase':<16}" + "".join(f"{name:>18}" for name in CONTENDERS))
    for phase in sorted({p for (n, p) in phases if n != "warm-up"}):
        print(f"{phase:<16}" + "".join(f"{statistics.median(phases[name, phase]) * 1e3:>18.2f}"
                                       for name in CONTENDERS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
