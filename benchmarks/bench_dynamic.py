"""Benchmarks of dynamic (hash-keyed) tables (issue 27): the TBE step against static tables, key lookups per
second, and a step at capacity with eviction.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_dynamic.py --help
    PYTHONPATH=. python benchmarks/bench_dynamic.py                       # all three parts (minutes)
    PYTHONPATH=. python benchmarks/bench_dynamic.py --parts step --threads 2
    PYTHONPATH=. python benchmarks/bench_dynamic.py --tiny                # smoke run (seconds)

Parts (``--parts``, a comma list):

* ``step``: the TBE shape of ``benchmarks/bench_step.py`` (``--T`` 8 tables of ``--E`` rows x ``--D``, ``--B``
  2,048 bags of ``--L`` 20 Zipf ids, FBGEMM's generator, Adagrad; :mod:`embedcore.bench.workloads`) run twice in
  one process: on static tables (``TableConfig(E, D)``, the ids as rows) and on dynamic tables
  (``DynamicTableConfig(D, capacity=E)``, no admission or eviction) fed each id's fixed random 64-bit key
  (a random bijection of the ids onto 64-bit keys per table, so the dynamic tables hold the same distinct
  rows). Both start at zeros; one untimed pass over the batches inserts every key and compiles, after which
  the two must agree (every row the batches touched, read by id and by key; the script fails otherwise).
  Then ``--rounds`` rounds, alternating which goes first, of ``--steps`` timed steps each: ``lookup`` +
  ``apply_gradients`` through the public API (:class:`embedcore.bench.contenders.embedcore_engine.
  EmbedcoreContender`). Printed: medians over all timed steps, per phase, and the ratio dynamic / static
  (issue 27's target: at most 1.5).
* ``find``: :func:`~embedcore.kernels.hash_map.find_in_maps` alone on the step part's keys (its ``--T`` maps
  holding every key of its ``--n-batches`` batches; each batch's ``T x B x L`` skewed keys, many repeats):
  the median time of one call over ``--rounds`` x ``--steps`` x 4 calls, cycling over the batches.
* ``lookups``: :meth:`KeyRowMap.find` on a map holding ``n`` random keys, for each ``n`` of ``--sizes``
  (10^6 and 10^7 by default): batches of ``--lookup-batch`` keys drawn uniformly among those held (hits) and
  fresh random keys (misses), keys per second (median over ``--rounds`` x ``--steps``). Also the dynamic
  plan: ``Embedding.lookup`` of one dynamic table (dim ``--lookup-dim``, SGD) holding the same ``n`` keys,
  on the same hit batches (one feature, one key per sample): keys per second of the whole lookup (plan,
  commit, grouping and gather).
* ``eviction``: ``--evict-T`` dynamic tables of ``--evict-capacity`` rows (dim ``--evict-D``), filled to
  capacity with random keys in ``--evict-fill-steps`` steps (lookup and a zero gradient), then fed the TBE
  shape's ids from a vocabulary ``--evict-vocab-factor`` times larger (mapped to random keys), so every step
  brings new keys and evicts; for each of LRU, LFU, TTL(s) for each s of ``--ttl-steps`` (a short TTL
  expires rows every step; a long one keeps the table full, so it evicts as LRU does) and
  ``EvictByScore(decayed_count, reserve=r)`` (an LFU whose counts halve every 8 steps unseen) for each r of
  ``--score-reserves`` (0: exactly the rows needed; the default 0.01): ms per step (lookup + apply_gradients)
  after ``--evict-warmup`` untimed steps, median, mean and slowest, the time spent choosing victims
  (``pick_victims``) and expired rows (``expired_rows``) per step, the calls that chose victims, the rows
  evicted or expired per step, and the most time one step spent choosing (a step that stopped the world would
  show here). LRU, LFU and TTL read their key map's order index (:mod:`embedcore.tables.order_index`); the
  score of ``EvictByScore`` may change with the step alone, so each eviction scans and scores every live row,
  and its reserve frees ``ceil(r * capacity)`` rows a scan, so it scans once per that many new keys (time
  enough ``--evict-steps`` to see one; ``--no-score`` leaves it out). ``--evict-policies`` picks among
  ``lru,lfu,ttl,score``.

Threads: Numba ``--threads`` for every part (both tables of a comparison run on the same threads, in one
process). The allocator is whatever ``LD_PRELOAD`` says (printed). Numba's OpenMP workers: as
``bench_step.py`` (``GOMP_SPINCOUNT`` 100000 unless the environment sets ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT``). ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "100000"  # as bench_step.py, before Numba loads its OpenMP runtime

import numba
import numpy as np

import embedcore as ec
from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender
from embedcore.bench.machine import allocator_name
from embedcore.bench.workloads import make_batches, make_optim, tbe_workload
from embedcore.kernels.hash_map import KeyRowMap, find_in_maps
from embedcore.tables import dynamic as dynamic_module

PARTS = ("step", "find", "lookups", "eviction")
TINY = {"T": 2, "E": 2000, "D": 8, "B": 64, "L": 4, "n_batches": 2, "rounds": 2, "steps": 2,
        "sizes": "1000,5000", "lookup_batch": 2048, "lookup_dim": 4, "evict_capacity": 100, "evict_T": 2, "evict_D": 8, "evict_fill_steps": 4,
        "evict_warmup": 2, "evict_steps": 3}


def random_keys(rng, n: int) -> np.ndarray:
    """``n`` distinct random 64-bit keys (uint64)."""
    keys = np.unique(rng.integers(0, 2 ** 64, n, dtype=np.uint64, endpoint=False))
    while keys.shape[0] < n:  # a collision (chance ~ n^2 / 2^65)
        keys = np.unique(np.concatenate([keys, rng.integers(0, 2 ** 64, n - keys.shape[0], dtype=np.uint64)]))
    return rng.permutation(keys)


class DynamicContender(EmbedcoreContender):
    """The ``embedcore`` contender on dynamic tables: id ``i`` of table ``t`` is fed as key ``keys[t][i]``."""

    name = "embedcore-dynamic"
    label = "embedcore dynamic"
    keys: list = []
    capacity: int | None = None     # default: the workload's rows
    eviction = None

    def _features(self, w):
        return {f"f{t}": ec.FeatureConfig(ec.DynamicTableConfig(
            w.D, self.capacity or w.E, name=f"t{t}", initializer=ec.Zeros(), combiner="sum",
            eviction=self.eviction)) for t in range(w.T)}

    def _inputs(self, batch):
        features, weights, grads = super()._inputs(batch)
        features = {f"f{t}": ec.Ragged(self.keys[t][batch.ids[t]].view(np.int64), batch.offsets[t])
                    for t in range(self.w.T)}
        return features, weights, grads


def dynamic_contender(w, threads: int, keys, capacity=None, eviction=None):
    cls = type("DynamicContender", (DynamicContender,), {"keys": keys, "capacity": capacity, "eviction": eviction})
    return cls.on_workload(w, threads)


def decayed_count(embedding_table, last_seen, count, step):
    """EvictByScore's benchmark score: the occurrences counted, halved every 8 steps the row goes unseen."""
    return count * 0.5 ** ((step - last_seen) / 8.0)


def _median_ms(values):
    return 1e3 * statistics.median(values) if values else float("nan")


def _run_steps(contender, batches, steps, at, record):
    for k in range(steps):
        phases = contender.run(contender.prepare(batches[(at + k) % len(batches)]))
        record.setdefault("step", []).append(sum(phases.values()))
        for name, seconds in phases.items():
            record.setdefault(name, []).append(seconds)
    return at + steps


# -- part 1: the TBE step -------------------------------------------------------------------------------
def bench_step(args, log) -> dict:
    w = tbe_workload(args.T, args.E, args.D, args.B, args.L, make_optim(args.optimizer), alpha=args.alpha,
                     dist=args.dist, n_batches=args.n_batches, seed=args.seed)
    log(f"step: {w.label}")
    batches = make_batches(w)
    rng = np.random.default_rng(args.seed + 27)
    keys = [random_keys(rng, w.E) for _ in range(w.T)]
    static = EmbedcoreContender.on_workload(w, args.threads)
    dynamic = dynamic_contender(w, args.threads, keys)
    for batch in batches:  # compiles, and inserts every key the batches hold
        for contender in (static, dynamic):
            contender.run(contender.prepare(batch))
    worst = 0.0
    for t in range(w.T):
        ids = np.unique(np.concatenate([b.ids[t] for b in batches]))
        by_id = static.table(t)[ids]
        by_key = dynamic.table(t)[keys[t][ids].view(np.int64)]
        worst = max(worst, float(np.max(np.abs(by_id - by_key))) if ids.size else 0.0)
    log(f"  agreement after {len(batches)} steps: max |static - dynamic| = {worst:.3g}")
    if worst > args.tolerance:
        raise SystemExit(f"dynamic and static tables disagree by {worst} > {args.tolerance}")
    held = [len(dynamic.table(t)) for t in range(w.T)]
    records = {"static": {}, "dynamic": {}}
    at = {"static": len(batches), "dynamic": len(batches)}
    for r in range(args.rounds):
        order = (("static", static), ("dynamic", dynamic))
        for name, contender in (order if r % 2 == 0 else order[::-1]):
            at[name] = _run_steps(contender, batches, args.steps, at[name], records[name])
    medians = {name: {phase: _median_ms(v) for phase, v in rec.items()} for name, rec in records.items()}
    ratio = medians["dynamic"]["step"] / medians["static"]["step"]
    for name in ("static", "dynamic"):
        m = medians[name]
        log(f"  {name:8s} step {m['step']:8.2f} ms  (lookup {m['lookup']:7.2f}, apply_gradients "
            f"{m['apply_gradients']:7.2f}) median of {len(records[name]['step'])} steps")
    log(f"  ratio dynamic / static: {ratio:.3f} (target <= 1.5); keys held per table: {held}")
    return {"workload": w.as_dict(), "agreement_max_abs_diff": worst, "keys_held": held, "median_ms": medians,
            "ratio": ratio, "steps_ms": {n: [1e3 * s for s in rec["step"]] for n, rec in records.items()}}


def bench_find(args, log) -> dict:
    w = tbe_workload(args.T, args.E, args.D, args.B, args.L, make_optim(args.optimizer), alpha=args.alpha,
                     dist=args.dist, n_batches=args.n_batches, seed=args.seed)
    batches = make_batches(w)
    rng = np.random.default_rng(args.seed + 27)
    keys = [random_keys(rng, w.E) for _ in range(w.T)]
    per_batch = [[np.ascontiguousarray(keys[t][b.ids[t]]).view(np.uint64) for t in range(w.T)] for b in batches]
    maps = [KeyRowMap(w.E, f"t{t}") for t in range(w.T)]
    for batch_keys in per_batch:
        for m, k in zip(maps, batch_keys):
            m.find_or_insert(k)
    find_in_maps(maps, per_batch[0])  # compiles
    seconds = []
    for k in range(4 * args.rounds * args.steps):
        t0 = time.perf_counter()
        find_in_maps(maps, per_batch[k % len(per_batch)])
        seconds.append(time.perf_counter() - t0)
    n = sum(k.shape[0] for k in per_batch[0])
    median = _median_ms(seconds)
    log(f"find: {n:,} keys of {w.T} maps ({[len(m) for m in maps]} keys held): {median:.3f} ms a call "
        f"({1e6 * median / n:.2f} ns a key), median of {len(seconds)}")
    return {"keys": n, "median_ms": median, "ms": [1e3 * s for s in seconds]}


# -- part 2: key lookups per second ---------------------------------------------------------------------
def bench_lookups(args, log) -> dict:
    out = {}
    rng = np.random.default_rng(args.seed + 7)
    for n in [int(float(x)) for x in args.sizes.split(",") if x.strip()]:
        keys = random_keys(rng, n)
        key_map = KeyRowMap(n, "bench")
        for lo in range(0, n, 1 << 20):
            key_map.find_or_insert(keys[lo:lo + (1 << 20)])
        while key_map.migrating:
            key_map.migrate(n)
        batch = args.lookup_batch
        hits = [keys[rng.integers(0, n, batch)] for _ in range(2)]
        misses = [rng.integers(0, 2 ** 64, batch, dtype=np.uint64) for _ in range(2)]
        key_map.find(hits[0])  # compiled before the clock
        figures = {}
        for what, batches in (("find hits", hits), ("find misses", misses)):
            times = []
            for k in range(args.rounds * args.steps):
                t0 = time.perf_counter()
                key_map.find(batches[k % 2])
                times.append(time.perf_counter() - t0)
            figures[what] = batch / statistics.median(times)
        del key_map
        table = ec.DynamicTableConfig(args.lookup_dim, n, name="keys", initializer=ec.Zeros(), combiner="sum")
        emb = ec.Embedding({"k": ec.FeatureConfig(table)}, ec.SGD(0.01))
        for lo in range(0, n, 1 << 20):
            emb.lookup({"k": keys[lo:lo + (1 << 20)].view(np.int64)})
        signed = [h.view(np.int64) for h in hits]
        emb.lookup({"k": signed[0]})
        times = []
        for k in range(args.rounds * args.steps):
            t0 = time.perf_counter()
            emb.lookup({"k": signed[k % 2]})
            times.append(time.perf_counter() - t0)
        figures["Embedding.lookup (plan)"] = batch / statistics.median(times)
        del emb
        log(f"lookups: {n:,} keys held, batches of {batch:,}: " +
            ", ".join(f"{what} {rate / 1e6:.1f} M keys/s" for what, rate in figures.items()))
        out[str(n)] = figures
    return out


# -- part 3: a step at capacity with eviction --------------------------------------------------------------
class _Timed:
    """A wrapper of a policy function of :mod:`embedcore.tables.dynamic` that adds up its time and rows."""

    def __init__(self, name):
        self.name, self.fn = name, getattr(dynamic_module, name)
        self.seconds, self.rows, self.calls = 0.0, 0, 0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        rows = self.fn(*a, **k)
        self.seconds += time.perf_counter() - t0
        self.rows += int(rows.shape[0])
        self.calls += 1
        return rows

    def __enter__(self):
        setattr(dynamic_module, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(dynamic_module, self.name, self.fn)


def bench_eviction(args, log) -> dict:
    capacity = args.evict_capacity
    vocab = args.evict_vocab_factor * capacity
    w = tbe_workload(args.evict_T, vocab, args.evict_D, args.B, args.L, make_optim(args.optimizer), alpha=args.alpha,
                     dist=args.dist, n_batches=args.evict_warmup + args.evict_steps, seed=args.seed + 1)
    batches = make_batches(w)
    rng = np.random.default_rng(args.seed + 31)
    keys = [random_keys(rng, vocab) for _ in range(w.T)]
    log(f"eviction: {w.T} tables of capacity {capacity:,}, ids from {vocab:,} per table; {w.B:,} bags of {w.L}")
    out = {}
    ttls = [ec.TTL(int(x)) for x in args.ttl_steps.split(",") if x.strip()]
    scored = [] if args.no_score else [ec.EvictByScore(decayed_count, reserve=float(r))
                                       for r in args.score_reserves.split(",") if r.strip()]
    kinds = {x.strip() for x in args.evict_policies.split(",") if x.strip()}
    if kinds - {"lru", "lfu", "ttl", "score"}:
        raise SystemExit(f"--evict-policies: unknown {sorted(kinds - {'lru', 'lfu', 'ttl', 'score'})}")
    policies = [p for kind, p in (("lru", ec.LRU()), ("lfu", ec.LFU())) if kind in kinds]
    policies += (ttls if "ttl" in kinds else []) + (scored if "score" in kinds else [])
    for policy in policies:
        contender = dynamic_contender(w, args.threads, keys, capacity=capacity, eviction=policy)
        fill_keys = [keys[t][rng.choice(vocab, capacity, replace=False)].view(np.int64) for t in range(w.T)]
        for chunk in np.array_split(np.arange(capacity), args.evict_fill_steps):  # one step each: a cohort
            fill = {f"f{t}": fill_keys[t][chunk] for t in range(w.T)}            # of last_seen per chunk
            acts, ctx = contender.emb.lookup(fill)
            contender.emb.apply_gradients({f: np.zeros_like(a) for f, a in acts.items()}, ctx)
        for batch in batches[:args.evict_warmup]:
            contender.run(contender.prepare(batch))
        full = [len(contender.table(t)) for t in range(w.T)]
        record, choosing = {}, []
        with _Timed("pick_victims") as victims, _Timed("expired_rows") as expired:
            for batch in batches[args.evict_warmup:]:
                before = victims.seconds + expired.seconds
                _run_steps(contender, [batch], 1, 0, record)
                choosing.append(victims.seconds + expired.seconds - before)
        n = len(record["step"])
        figures = {"step_ms": _median_ms(record["step"]), "mean_step_ms": 1e3 * statistics.fmean(record["step"]),
                   "pick_victims_ms_per_step": 1e3 * victims.seconds / n,
                   "expired_rows_ms_per_step": 1e3 * expired.seconds / n, "evicted_per_step": victims.rows / n,
                   "expired_per_step": expired.rows / n, "keys_held_before": full,
                   "pick_victims_calls": victims.calls,
                   "slowest_step_ms": 1e3 * max(record["step"]), "slowest_choice_ms": 1e3 * max(choosing)}
        log(f"  {policy!r:12.60s} step {figures['step_ms']:8.2f} ms (mean {figures['mean_step_ms']:.2f}); pick_victims "
            f"{figures['pick_victims_ms_per_step']:6.2f} ms ({figures['evicted_per_step']:.0f} rows; "
            f"{victims.calls} calls in {n} steps of {w.T} tables), expired_rows "
            f"{figures['expired_rows_ms_per_step']:6.2f} ms ({figures['expired_per_step']:.0f} rows) per step; "
            f"slowest step {figures['slowest_step_ms']:.2f} ms (choosing {figures['slowest_choice_ms']:.2f}); "
            f"held before: {full}")
        out[repr(policy)] = figures
        contender.close()
    return out


# -- main -------------------------------------------------------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run in seconds); explicit options win")
    p.add_argument("--threads", type=int, default=2, help="Numba threads, for every part")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per table kind per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every figure to this file")
    g = p.add_argument_group("the TBE shape (step and eviction parts)")
    g.add_argument("--T", type=int, default=8, help="tables, one pooled feature each")
    g.add_argument("--E", type=int, default=250_000, help="rows per table (the dynamic tables' capacity)")
    g.add_argument("--D", type=int, default=64)
    g.add_argument("--B", type=int, default=2048, help="bags per table")
    g.add_argument("--L", type=int, default=20, help="ids per bag")
    g.add_argument("--alpha", type=float, default=1.15, help="Zipf alpha")
    g.add_argument("--dist", default="fbgemm", choices=("fbgemm", "zipf", "uniform"))
    g.add_argument("--optimizer", default="adagrad", choices=("sgd", "adagrad", "rowwise_adagrad", "adam"))
    g.add_argument("--n-batches", type=int, default=3, help="distinct batches (steps cycle over them)")
    g.add_argument("--tolerance", type=float, default=1e-6, help="largest |static - dynamic| allowed")
    g = p.add_argument_group("lookups")
    g.add_argument("--sizes", default="1e6,1e7", help="keys held (comma list)")
    g.add_argument("--lookup-batch", type=int, default=1 << 20, help="keys per find / lookup")
    g.add_argument("--lookup-dim", type=int, default=8, help="dim of the Embedding.lookup table")
    g = p.add_argument_group("eviction")
    g.add_argument("--evict-capacity", type=int, default=1_000_000, help="rows per table")
    g.add_argument("--evict-T", type=int, default=2, help="tables")
    g.add_argument("--evict-fill-steps", type=int, default=16, help="steps that fill the tables to capacity")
    g.add_argument("--evict-D", type=int, default=16, help="embedding dim")
    g.add_argument("--evict-vocab-factor", type=int, default=10, help="vocabulary = factor x capacity")
    g.add_argument("--ttl-steps", default="4,1000000", help="TTL(steps) for each of these (comma list)")
    g.add_argument("--evict-warmup", type=int, default=6, help="untimed steps (fill the tables)")
    g.add_argument("--evict-steps", type=int, default=6, help="timed steps")
    g.add_argument("--score-reserves", default="0,0.01", help="EvictByScore(reserve=r) for each r (comma list)")
    g.add_argument("--no-score", action="store_true", help="leave EvictByScore out of the eviction part")
    g.add_argument("--evict-policies", default="lru,lfu,ttl,score", help="which policies (comma list)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.tiny:
        given = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
        for key, value in TINY.items():
            if key not in given:
                setattr(args, key, value)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {PARTS}")
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    lines = []

    def log(text):
        print(text, flush=True)
        lines.append(text)
    alloc, preload = allocator_name()
    log(f"embedcore {ec.__version__ if hasattr(ec, '__version__') else ''} numpy {np.__version__} numba "
        f"{numba.__version__}; Numba threads {numba.get_num_threads()}; allocator {alloc}; "
        f"GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', '(unset)')}, OMP_WAIT_POLICY "
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    results = {"threads": numba.get_num_threads(), "allocator": alloc, "ld_preload": preload,
               "args": vars(args)}
    for part in parts:
        results[part] = {"step": bench_step, "find": bench_find, "lookups": bench_lookups, "eviction": bench_eviction}[part](args, log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
