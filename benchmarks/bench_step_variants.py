"""Whole training steps under two variants of one engine choice, alternating in one process.

Run from the repository root::

    python benchmarks/bench_step_variants.py --variant row-type|payload|hash-types|block-sums|layout-threads
        [--workload tbe|update] [--optimizer rowwise_adagrad] [--rounds 30] [--steps 4] [--evict-mb 64] [--weighted]

On this machine runs minutes apart differ by 30% or more, so a change is measured by running the shipped
choice and the one it replaced in the same process, round by round (the order flipped every round), on the
same batches. Each round first runs one untimed step (it lets a choice that depends on the previous step
settle), then times ``steps`` steps as
the harness does (lookup + ``apply_gradients``). It prints the medians of the step and of its lookup and
``apply_gradients`` per variant. The tables' values do not depend on the variant; only time does.

Each variant is an engine built with its own :class:`embedcore.Tuning` (the shipped choice first, the one it
replaced second); both engines start from the same zero tables and see the same batches.

* ``row-type``: a table batch's physical rows as int32 (``Tuning.row_type_limit``), against int64;
* ``payload``: a batch whose gains are all 1 is laid out without payloads, and grouped with the activation
  rows its ``out_ptr`` gives (``Tuning.unit_gain_payloads``), against int64 words packing each occurrence's
  activation row and gain;
* ``hash-types``: the hash grouping's keys in the rows' type and distinct-row ids as uint16
  (``Tuning.narrow_hash_types``), against int64 keys and int32 ids;
* ``block-sums``: stacked tables' gradients summed block by block as the occurrences are walked
  (``Tuning.sum_by_blocks``), against occurrences grouped by row and summed by the update kernel (the same
  sums, bit for bit);
* ``layout-threads``: pooled features laid out by all threads from ``Tuning.parallel_layout_min`` ids
  (262,144), against from 32,768 (every TBE feature in parallel, one parallel region each).

Dropped, as their alternatives are no longer options of the engine (results in git history): ``prefetch``
(prefetch always), ``range-check`` (a separate range-check pass), ``row-sums`` (in-memory row sums).
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

from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
from embedcore.bench.workloads import make_batches, make_optim, tbe_workload, update_workload
from embedcore.tuning import DEFAULT_TUNING

VARIANTS = {
    "row-type": {"int32": DEFAULT_TUNING, "int64": DEFAULT_TUNING.replace(row_type_limit=0)},
    "payload": {"no payload": DEFAULT_TUNING, "int64 packed": DEFAULT_TUNING.replace(unit_gain_payloads=False)},
    "hash-types": {"narrow": DEFAULT_TUNING, "int64 keys, int32 ids": DEFAULT_TUNING.replace(narrow_hash_types=False)},
    "block-sums": {"summed by blocks": DEFAULT_TUNING, "grouped": DEFAULT_TUNING.replace(sum_by_blocks=False)},
    "layout-threads": {f"from {DEFAULT_TUNING.parallel_layout_min:,} ids": DEFAULT_TUNING,
                       "from 32,768 ids": DEFAULT_TUNING.replace(parallel_layout_min=1 << 15)},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", required=True, choices=list(VARIANTS))
    parser.add_argument("--workload", default="tbe", choices=("tbe", "update"))
    parser.add_argument("--optimizer", default="rowwise_adagrad", choices=("sgd", "adagrad", "rowwise_adagrad"))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weighted", action="store_true", help="TBE with per-id weights (packed gains)")
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="MB of other memory written before each timed step, as a model's dense layers would "
                             "(0: steps back to back, their rows and workspaces warm in the caches)")
    args = parser.parse_args(argv)
    tunings = VARIANTS[args.variant]
    other_memory = np.zeros(args.evict_mb << 20, np.uint8)

    if args.workload == "tbe":
        w = tbe_workload(optim=make_optim(args.optimizer), weighted=args.weighted, n_batches=3)
    else:
        w = update_workload(optim=make_optim(args.optimizer), n_batches=3)
    batches = make_batches(w)
    variants = {name: EmbedcoreContender.on_workload(w, args.threads, tuning) for name, tuning in tunings.items()}
    for contender in variants.values():  # compile every kernel either variant takes, and warm up
        for batch in batches:
            contender.run(contender.prepare(batch))
    names = list(variants)
    times = {name: {"step": [], "lookup": [], "apply_gradients": []} for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 else names[::-1]):
            contender = variants[name]
            contender.run(contender.prepare(batches[0]))
            for s in range(args.steps):
                prepared = contender.prepare(batches[(s + 1) % len(batches)])
                other_memory += 1
                t0 = time.perf_counter()
                phases = contender.run(prepared)
                times[name]["step"].append(time.perf_counter() - t0)
                for phase in ("lookup", "apply_gradients"):
                    times[name][phase].append(phases.get(phase, 0.0))
    print(f"{w.label}: {args.variant}, {args.rounds} rounds x {args.steps} steps per variant, alternating, "
          f"Numba {numba.get_num_threads()} threads, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, "
          f"{args.evict_mb} MB written before each step")
    for name in names:
        medians = {phase: 1e3 * statistics.median(values) for phase, values in times[name].items()}
        print(f"  {name:17s} step median {medians['step']:.3f} ms, lookup {medians['lookup']:.3f} ms, "
              f"apply_gradients {medians['apply_gradients']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
