"""Where one embedcore training step spends its time, phase by phase, inside the real step loop.

Run from the repository root::

    python benchmarks/profile_step.py [--workload tbe|update] [--optimizer adagrad] [--steps 40] [--evict-mb 64]

The benchmark harness times whole steps; this script wraps the engine's phases (input checks and layout,
the lookup kernel, gradient checks and copies, the grouping sort, the fused update kernel) with timers and
runs the harness's workloads (``embedcore.bench.workloads``) through the public API, printing the median
and the per-step total of each phase. Wrapping costs a few microseconds per call. ``--evict-mb N`` writes
N MB of other memory before each step (after its inputs are prepared), so that the step finds none of its
data in the caches: the harness's first step of every round follows the other contenders and the bandwidth
probes, and in a model the dense layers run between two embedding steps. For a Python-level
profile of the same loop: ``py-spy record -o profile.svg -- python benchmarks/profile_step.py``
(kernels show as their Python callers; the host has no hardware counters for ``perf``).
"""

from __future__ import annotations

import argparse
import collections
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

from embedcore import engine, lookup
from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
from embedcore.bench.workloads import make_batches, make_optim, tbe_workload, update_workload

TIMES = collections.defaultdict(list)


def _timed(name, fn):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - t0)
    return run


def instrument():
    """Wrap the engine's phases with timers (module attributes, so every call site sees them)."""
    lookup.TableLookup._prepare = _timed("lookup: validate inputs", lookup.TableLookup._prepare)
    lookup.inputs.build_table_batch = _timed("lookup: lay out occurrences", lookup.inputs.build_table_batch)
    lookup.gather_combine = _timed("lookup: gather + combine kernel", lookup.gather_combine)
    engine._check_gradient = _timed("apply: check gradients (type, shape)", engine._check_gradient)
    engine._refuse_non_finite = _timed("apply: look for NaN/Inf in gradient rows", engine._refuse_non_finite)
    engine.Embedding._gradient_rows = staticmethod(_timed("apply: gather gradients into one array",
                                                          engine.Embedding._gradient_rows))
    engine.sum_by_blocks = _timed("apply: sum gradients block by block (hash)", engine.sum_by_blocks)
    engine.group_rows = _timed("apply: group occurrences by row (sort)", engine.group_rows)
    fused = engine.fused_update_kernel

    def kernel_factory(*args, **kwargs):
        return _timed("apply: fused update kernel", fused(*args, **kwargs))
    engine.fused_update_kernel = kernel_factory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tbe", choices=("tbe", "update"))
    parser.add_argument("--optimizer", default="adagrad", choices=("sgd", "adagrad", "rowwise_adagrad", "adam"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="MB of other memory written before each step (0: steps run back to back, warm)")
    args = parser.parse_args(argv)
    other_memory = np.zeros(args.evict_mb << 20, np.uint8)
    make = tbe_workload if args.workload == "tbe" else update_workload
    w = make(optim=make_optim(args.optimizer), n_batches=3)
    batches = make_batches(w)
    contender = EmbedcoreContender.on_workload(w, args.threads)
    instrument()
    for batch in batches:  # compile and warm up
        contender.run(contender.prepare(batch))
    TIMES.clear()
    steps = []
    for s in range(args.steps):
        prepared = contender.prepare(batches[s % len(batches)])
        other_memory += 1
        t0 = time.perf_counter()
        contender.run(prepared)
        steps.append(time.perf_counter() - t0)
    print(f"{w.label}: {args.steps} steps, Numba {numba.get_num_threads()} threads, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT')}, {args.evict_mb} MB written before each step; timed part of a step "
          f"(as the harness times it): median {1e3 * statistics.median(steps):.2f} ms")
    print(f"  {'phase':42s} {'calls/step':>10s} {'median ms':>10s} {'ms/step':>8s}")
    for name, values in TIMES.items():
        print(f"  {name:42s} {len(values) / args.steps:10.0f} {1e3 * statistics.median(values):10.2f} "
              f"{1e3 * sum(values) / args.steps:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
