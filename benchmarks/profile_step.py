"""Where one embedcore training step spends its time, phase by phase, inside the real step loop.

Run from the repository root::

    python benchmarks/profile_step.py [--workload tbe|update] [--optimizer adagrad] [--steps 40] [--evict-mb 64]

The benchmark harness times whole steps; this script gives the engine a ``Tuning(phase_timer=...)`` that
records each phase the engine times (layout, gather, gradient checks, grouping, the fused update), runs the
harness's workloads (``embedcore.bench.workloads``) through the public API, and prints the median and the
per-step total of each phase. ``--evict-mb N`` writes
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

from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
from embedcore.bench.workloads import make_batches, make_optim, tbe_workload, update_workload
from embedcore.tuning import Tuning

TIMES = collections.defaultdict(list)


def record(phase: str, seconds: float) -> None:
    """The engine's phase timer (``Tuning.phase_timer``)."""
    TIMES[phase].append(seconds)


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
    contender = EmbedcoreContender.on_workload(w, args.threads, tuning=Tuning(phase_timer=record))
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
