"""The first evictions of a key map filled to capacity: does the first one wait for its order index?

A ``KeyRowMap`` of ``--capacity`` random 64-bit keys filled in 16 steps (a cohort of ``last_seen`` each), as a
dynamic table's lookups fill it (:func:`embedcore.tables.policies.keep_order_index` once a step, which starts
building the LRU/LFU order index a share a step from half full), then ``--steps`` steps that each choose
``--victims`` victims for as many new keys. Prints, per policy and round, the slowest of the last 8 fill steps
and the time to choose the victims of each step after: the first is the one a late index build would stall.
``--no-ahead`` skips ``keep_order_index`` (the index is then built by the first eviction, in one scan).
The first round of each policy includes Numba's compilation; compare the later rounds.

    PYTHONPATH=. NUMBA_NUM_THREADS=2 python benchmarks/first_eviction.py            # and --no-ahead
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from embedcore.kernels.hash_map import KeyRowMap
from embedcore.tables.policies import LFU, LRU, keep_order_index, pick_victims


def run(policy, capacity: int, victims: int, steps: int, ahead: bool, seed: int) -> tuple[list, list]:
    m = KeyRowMap(capacity, "t")
    keys = np.random.default_rng(seed).integers(0, 2 ** 64, capacity + victims * (steps + 1), dtype=np.uint64)
    fill = []
    for step, chunk in enumerate(np.array_split(np.arange(capacity), 16)):
        t0 = time.perf_counter()
        if ahead:
            keep_order_index(policy, m)
        rows, _ = m.find_or_insert(keys[chunk], step)
        m.touch_found(rows, step)
        fill.append(time.perf_counter() - t0)
    choose = []
    for step in range(16, 16 + steps):
        batch = keys[capacity + (step - 16) * victims:capacity + (step - 15) * victims]
        t0 = time.perf_counter()
        if ahead:
            keep_order_index(policy, m)
        chosen = pick_victims(policy, m, victims, protected_rows=m.find(batch), step=step)
        choose.append(time.perf_counter() - t0)
        m.remove_rows(chosen)
        rows, _ = m.find_or_insert(batch, step)
        m.touch_found(rows, step)
    return fill, choose


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--victims", type=int, default=143, help="victims (and new keys) a step at capacity")
    p.add_argument("--steps", type=int, default=10, help="steps at capacity")
    p.add_argument("--rounds", type=int, default=2, help="rounds per policy (the first compiles)")
    p.add_argument("--no-ahead", action="store_true", help="no keep_order_index: the first eviction builds")
    args = p.parse_args(argv)
    for policy in (LRU(), LFU()):
        for r in range(args.rounds):
            fill, choose = run(policy, args.capacity, args.victims, args.steps, not args.no_ahead, r)
            print(f"{policy!r:6} round {r}: slowest of the last 8 fill steps {1e3 * max(fill[8:]):.1f} ms; "
                  f"choosing ms {[round(1e3 * c, 2) for c in choose]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
