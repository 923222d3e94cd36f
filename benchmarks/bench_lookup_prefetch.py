"""Whole TBE training steps with the lookup's row prefetch chosen per table against prefetch always.

Run from the repository root::

    python benchmarks/bench_lookup_prefetch.py [--optimizer rowwise_adagrad] [--rounds 30] [--steps 4]

The engine's lookup skips the prefetch of table rows when the table's last ``apply_gradients`` judged
that its rows stay cached (``embedcore.kernels.prefetch.rows_stay_cached``). This script runs one
``Embedding`` on the harness's TBE workload and alternates, round by round, between that choice and a
rule that always answers "prefetch" (it replaces the rule the engine calls). Each round first runs one
untimed step so the flag reflects the round's policy, then times ``steps`` steps as the harness does
(lookup + ``apply_gradients``). It prints the medians of the step and of the lookup per policy. The
tables' values do not depend on the policy; only time does.
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

from embedcore import engine
from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
from embedcore.bench.workloads import make_batches, make_optim, tbe_workload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", default="rowwise_adagrad", choices=("sgd", "adagrad", "rowwise_adagrad"))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    chosen_rule = engine.rows_stay_cached
    policy = {"rule": chosen_rule}
    engine.rows_stay_cached = lambda *a: policy["rule"](*a)
    rules = {"chosen per table": chosen_rule, "always": lambda *a: False}

    w = tbe_workload(optim=make_optim(args.optimizer), n_batches=3)
    batches = make_batches(w)
    contender = EmbedcoreContender.on_workload(w, args.threads)
    for rule in rules.values():  # compile both gathers and warm up
        policy["rule"] = rule
        for batch in batches:
            contender.run(contender.prepare(batch))
    steps = {name: [] for name in rules}
    lookups = {name: [] for name in rules}
    names = list(rules)
    for r in range(args.rounds):
        for name in (names if r % 2 else names[::-1]):
            policy["rule"] = rules[name]
            contender.run(contender.prepare(batches[0]))
            for s in range(args.steps):
                prepared = contender.prepare(batches[(s + 1) % len(batches)])
                t0 = time.perf_counter()
                phases = contender.run(prepared)
                steps[name].append(time.perf_counter() - t0)
                lookups[name].append(phases["lookup"])
    print(f"{w.label}: {args.rounds} rounds x {args.steps} steps per policy, alternating, Numba "
          f"{numba.get_num_threads()} threads, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    for name in names:
        print(f"  prefetch {name:17s} step median {1e3 * statistics.median(steps[name]):.3f} ms, "
              f"lookup median {1e3 * statistics.median(lookups[name]):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
