"""Whole training steps under two variants of one engine choice, alternating in one process.

Run from the repository root::

    python benchmarks/bench_step_variants.py --variant prefetch|range-check|row-type|payload|hash-types|row-sums|block-sums|
        layout-threads
        [--workload tbe|update] [--optimizer rowwise_adagrad] [--rounds 30] [--steps 4] [--evict-mb 64] [--weighted]

On this machine runs minutes apart differ by 30% or more, so a change is measured by running the shipped
choice and the one it replaced in the same process, round by round (the order flipped every round), on the
same batches. Each round first runs one untimed step (it lets a choice that depends on the previous step
settle, and takes the reallocation of workspace arrays whose dtype changed), then times ``steps`` steps as
the harness does (lookup + ``apply_gradients``). It prints the medians of the step and of its lookup and
``apply_gradients`` per variant. The tables' values do not depend on the variant; only time does.

Variants (the shipped one first):

* ``prefetch``: the lookup's row prefetch chosen per table from the last update
  (``kernels.prefetch.rows_stay_cached``), against prefetch always;
* ``range-check``: ids range-checked in the layout pass (``inputs.build_table_batch``), against a separate
  check of every feature's ids before it (``to_feature_batch(check_range=True)``; the layout's check then
  runs too, on ids already known good);
* ``row-type``: a table batch's physical rows as int32 (``inputs.ROW_TYPE_LIMIT``), against int64;
* ``payload``: a batch whose gains are all 1 is laid out without payloads, and grouped with the activation
  rows its ``out_ptr`` gives (``inputs.unit_gains``), against int64 words packing each occurrence's
  activation row and gain;
* ``hash-types``: the hash grouping's keys in the rows' type and distinct-row ids as uint16
  (``kernels.dedup.hash_types``), against int64 keys and int32 ids;
* ``row-sums``: the kernels compiled for a row length sum rows in vector registers
  (``kernels/row_vector.py``), against the in-memory sums of ``rows.weighted_sum`` (lookup) and
  ``rows.sequential_sum`` (update); both sets of kernels are compiled in this process (the on-disk kernel
  cache is turned off: their sources are the same text);
* ``block-sums``: stacked tables' gradients summed block by block as the occurrences are walked
  (``kernels.dedup.sum_by_blocks``), against occurrences grouped by row and summed by the update kernel
  (``group_rows``; the same sums, bit for bit);
* ``layout-threads``: pooled features laid out by all threads from ``kernels.occurrences.PARALLEL_MIN``
  ids (262,144), against from 32,768 (every TBE feature in parallel, one parallel region each).
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

from embedcore import engine, inputs
from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
from embedcore.bench.workloads import make_batches, make_optim, tbe_workload, update_workload


def _prefetch():
    chosen = engine.rows_stay_cached
    rule = {"now": chosen}
    engine.rows_stay_cached = lambda *a: rule["now"](*a)
    return {"chosen per table": lambda: rule.update(now=chosen),
            "always": lambda: rule.update(now=lambda *a: False)}


def _range_check():
    build = inputs.to_feature_batch
    separate = {"now": False}

    def to_feature_batch(*args, check_range=True, **kwargs):
        return build(*args, check_range=check_range or separate["now"], **kwargs)
    inputs.to_feature_batch = to_feature_batch
    return {"in the layout": lambda: separate.update(now=False),
            "separate pass": lambda: separate.update(now=True)}


def _row_type():
    limit = inputs.ROW_TYPE_LIMIT
    return {"int32": lambda: setattr(inputs, "ROW_TYPE_LIMIT", limit),
            "int64": lambda: setattr(inputs, "ROW_TYPE_LIMIT", 0)}


def _row_sums():
    from numba import njit

    from embedcore.kernels import rows, update

    @njit(inline="always")
    def in_memory(dst, d, lo, hi, index, gain, src, ahead, dim, width):
        rows.weighted_sum(dst, d, lo, hi, index, gain, src, ahead, dim)

    @njit(inline="always")
    def sequential_in_memory(dst, d, lo, hi, index, gain, src, ahead, dim, width):
        rows.sequential_sum(dst, d, lo, hi, index, gain, src, ahead, dim)

    os.environ["EMBEDCORE_CACHE_DIR"] = "off"
    kernels = {"registers": ({}, {}, rows.weighted_sum_fixed, rows.sequential_sum_fixed),
               "in memory": ({}, {}, in_memory, sequential_in_memory)}

    def use(name):
        rows._GATHERS, update._KERNELS, rows.weighted_sum_fixed, update.sequential_sum_fixed = kernels[name]
    return {name: (lambda name=name: use(name)) for name in kernels}


def _payload():
    rule = inputs.unit_gains
    return {"no payload": lambda: setattr(inputs, "unit_gains", rule),
            "int64 packed": lambda: setattr(inputs, "unit_gains", lambda parts: False)}


def _hash_types():
    from embedcore.kernels import dedup
    rule = dedup.hash_types
    return {"narrow": lambda: setattr(dedup, "hash_types", rule),
            "int64 keys, int32 ids": lambda: setattr(dedup, "hash_types", lambda *a: (np.int64, np.int32))}


def _block_sums():
    from embedcore import engine
    summed = engine.sum_by_blocks
    return {"summed by blocks": lambda: setattr(engine, "sum_by_blocks", summed),
            "grouped": lambda: setattr(engine, "sum_by_blocks", lambda *args: None)}


def _layout_threads():
    from embedcore.kernels import occurrences
    shipped = occurrences.PARALLEL_MIN
    return {f"from {shipped:,} ids": lambda: setattr(occurrences, "PARALLEL_MIN", shipped),
            "from 32,768 ids": lambda: setattr(occurrences, "PARALLEL_MIN", 1 << 15)}


VARIANTS = {"prefetch": _prefetch, "range-check": _range_check, "row-type": _row_type, "payload": _payload,
            "hash-types": _hash_types, "row-sums": _row_sums, "block-sums": _block_sums,
            "layout-threads": _layout_threads}


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
    variants = VARIANTS[args.variant]()
    other_memory = np.zeros(args.evict_mb << 20, np.uint8)

    if args.workload == "tbe":
        w = tbe_workload(optim=make_optim(args.optimizer), weighted=args.weighted, n_batches=3)
    else:
        w = update_workload(optim=make_optim(args.optimizer), n_batches=3)
    batches = make_batches(w)
    contender = EmbedcoreContender.on_workload(w, args.threads)
    for switch in variants.values():  # compile every kernel either variant takes, and warm up
        switch()
        for batch in batches:
            contender.run(contender.prepare(batch))
    names = list(variants)
    times = {name: {"step": [], "lookup": [], "apply_gradients": []} for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 else names[::-1]):
            variants[name]()
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
