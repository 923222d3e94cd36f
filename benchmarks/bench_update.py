"""Benchmark of embedcore's fused sparse update (issue 2), against NumPy and the machine's copy bandwidth.

Run::

    python benchmarks/bench_update.py [--rows 2000000 --dim 64 --ids 262144 --steps 10 --rounds 3 --threads 2]
                                      [--dist bounded|zipf-mod] [--alpha A] [--json results.json]

Workload: one ``rows x dim`` float32 table with one Adagrad slot (``accumulators``, a full row), and per step
``ids`` Zipf-distributed ids (one id per sample, combiner ``"sum"``) with about 150,000 unique rows.

* ``--dist bounded`` (default): ranks ``1..rows`` drawn by inverse-CDF sampling with ``p(k) ~ 1 / k^alpha``,
  mapped to row ids by a fixed random permutation (hot rows spread over the table). Without ``--alpha``,
  alpha is chosen so that the *expected* number of unique ids per step equals ``--unique-target`` (150,000).
* ``--dist zipf-mod``: ``(Generator.zipf(alpha) - 1) mod rows`` then the same permutation (alpha default 1.05,
  which gives ~150,000 unique ids for the default sizes; ~43% of draws exceed ``rows`` and wrap around).

Contenders, measured in the same run, in alternating rounds (each round runs every contender for ``--steps``
steps; medians are over all steps of all rounds):

1. ``embedcore apply_gradients``: the public API. ``Embedding(FeatureConfig(TableConfig(rows, dim,
   initializer=Zeros(), combiner="sum")), Adagrad(...))``; per step one lookup (not timed) gives ``ctx``,
   then only ``emb.apply_gradients(grads, ctx)`` is timed (validation + dedup + gradient reduction + fused
   update).
2. ``embedcore kernels``: the two steps of an engine's update, called directly on a separate copy of the
   table: ``kernels.grouping.Grouper`` (radix sort carrying each occurrence's activation row and gain) and
   the fused update kernel from ``kernels.update.fused_update_kernel`` (it sums each row's
   gradient as it updates the row). Each phase is timed too.
3. ``numpy add.at``: ``np.unique(return_inverse=True)``, ``np.add.at`` to sum gradients per unique id,
   fancy-index gather, Adagrad math, scatter back (own copy of the table).
4. ``numpy argsort+reduceat``: the same with a stable ``argsort`` and ``np.add.reduceat`` instead of
   ``np.unique`` + ``np.add.at`` (own copy of the table).
5. ``copy numpy``: ``np.copyto`` between two preallocated ~256 MB float32 arrays (one thread).
6. ``copy numba``: a ``prange`` copy kernel on the same arrays with ``--threads`` threads.

Bytes and bandwidth:

* update:  ``bytes = n_unique * (2*dim*4 + 2*dim*4 + dim*4)`` per step, i.e. for each unique row: read and
  write the row, read and write its slot row, read its summed gradient row (float32). Ids, the activation
  gradients and the sort's workspaces are *not* counted. ``GB/s = bytes / time`` (1 GB = 1e9 bytes), the
  median over steps of each step's own figure.
* copy:    ``bytes = 2 * array size`` (read + write) per copy.

All contenders start from the same table and apply the same batches in the same order, so at the end their
tables must agree; the script prints the largest difference as a sanity check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numba
from numba import njit, prange

import embedcore
from embedcore.bench.machine import allocator_name, cpu_snapshot, others_share, peak_rss_gb
from embedcore.kernels.grouping import Grouper
from embedcore.kernels.update import fused_update_kernel
from embedcore.kernels.workspace import Workspace

LEARNING_RATE = 0.01
INITIAL_ACCUMULATOR = 0.1


# ----------------------------------------------------------------------------------------------------------
# Ids

def _expected_unique(alpha, rows, n, k):
    p = k ** -alpha
    p /= p.sum()
    return float((-np.expm1(n * np.log1p(-p))).sum())


def calibrate_alpha(rows, n, target):
    """Alpha of the bounded Zipf over ``rows`` ranks whose expected unique count for ``n`` draws is ``target``."""
    k = np.arange(1, rows + 1, dtype=np.float64)
    lo, hi = 0.0, 3.0  # expected unique decreases with alpha
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if _expected_unique(mid, rows, n, k) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def make_batches(rows, n, steps, dist, alpha, seed):
    rng = np.random.default_rng(seed)
    permutation = rng.permutation(rows).astype(np.int64)
    batches = []
    if dist == "bounded":
        cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -alpha)
        cdf /= cdf[-1]
        for _ in range(steps):
            ranks = np.searchsorted(cdf, rng.random(n), side="right")
            np.minimum(ranks, rows - 1, out=ranks)
            batches.append(permutation[ranks])
    else:
        for _ in range(steps):
            batches.append(permutation[(rng.zipf(alpha, n) - 1) % rows])
    return batches


# ----------------------------------------------------------------------------------------------------------
# Contenders

@njit(parallel=True, cache=False)
def _numba_copy(dst, src):
    for i in prange(src.shape[0]):
        dst[i] = src[i]


def _adagrad_rows(table, slot, uniq, g, lr):
    """Adagrad on rows ``uniq`` with summed gradients ``g``: gather, update, scatter back."""
    w = table[uniq]
    a = slot[uniq]
    a += g * g
    w -= lr * g / np.sqrt(a)
    table[uniq] = w
    slot[uniq] = a
    return uniq.shape[0]


def numpy_update_add_at(table, slot, ids, grads, lr):
    uniq, inverse = np.unique(ids, return_inverse=True)
    g = np.zeros((uniq.shape[0], table.shape[1]), np.float32)
    np.add.at(g, inverse, grads)
    return _adagrad_rows(table, slot, uniq, g, lr)


def numpy_update_sort(table, slot, ids, grads, lr):
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    uniq = sorted_ids[starts]
    g = np.add.reduceat(grads[order], starts, axis=0)
    return _adagrad_rows(table, slot, uniq, g, lr)


class KernelPath:
    """What an engine's update does for one physical table (one table of ``optimizer``), kernel by kernel,
    on its own arrays."""

    PHASES = ("dedup", "reduce+update")

    def __init__(self, optimizer, rows, dim):
        self.optimizer = optimizer
        self.row_function = optimizer.compiled(dim)
        self.lazy = optimizer.lazy
        self.table = np.zeros((rows, dim), np.float32)
        self.table[:] = 0.0
        self.slots = tuple(np.full((rows, dim), INITIAL_ACCUMULATOR, np.float32) for _ in optimizer.slot_dims)
        self.n_rows = rows
        self.grouper = Grouper(stacked=False)
        self.ws = Workspace()
        self.step = 0

    def run(self, tb, d_act):
        """One step; returns (n_unique, {phase: seconds})."""
        self.step += 1
        lr, hyper = self.optimizer.step_values(self.step)
        t0 = time.perf_counter()
        uniq, ptr, packed, d_act = self.grouper.group(tb, self.n_rows, self.ws, d_act)
        t1 = time.perf_counter()
        status = np.zeros(uniq.shape[0] if self.lazy else self.table.shape[0], np.uint8)
        kernel = fused_update_kernel(self.row_function, lazy=self.lazy)
        flagged = kernel(self.table, self.slots, uniq, ptr, packed, d_act, lr, hyper, status)
        t2 = time.perf_counter()
        assert not flagged
        return uniq.shape[0], {"dedup": t1 - t0, "reduce+update": t2 - t1}


# ----------------------------------------------------------------------------------------------------------
# Reporting helpers

def summarize(times, extra=None):
    ms = [1e3 * t for t in times]
    out = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms),
           "times_ms": ms}
    if extra:
        out.update(extra)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=262_144, help="ids per step (one per sample)")
    ap.add_argument("--dist", choices=("bounded", "zipf-mod"), default="bounded")
    ap.add_argument("--alpha", type=float, default=None,
                    help="Zipf exponent; default: calibrated to --unique-target (bounded) or 1.05 (zipf-mod)")
    ap.add_argument("--unique-target", type=int, default=150_000)
    ap.add_argument("--steps", type=int, default=10, help="steps per contender per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copy-mb", type=int, default=256, help="size of each copy-bandwidth array (MB)")
    ap.add_argument("--copy-reps", type=int, default=10, help="copies per copy contender per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-numpy-sort", action="store_true", help="skip the argsort+reduceat NumPy variant")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)

    numba.set_num_threads(args.threads)
    rows, dim, n = args.rows, args.dim, args.ids
    bytes_per_unique = 2 * dim * 4 + 2 * dim * 4 + dim * 4
    alloc, preload = allocator_name()

    # ---- ids ------------------------------------------------------------------------------------------
    t = time.perf_counter()
    alpha = args.alpha
    if alpha is None:
        alpha = calibrate_alpha(rows, n, args.unique_target) if args.dist == "bounded" else 1.05
    batches = make_batches(rows, n, args.steps, args.dist, alpha, args.seed)
    uniques = [int(np.unique(b).size) for b in batches]
    print(f"ids: {args.dist} Zipf, alpha={alpha:.4f}, {n} ids/step over {rows} rows; unique per step: "
          f"median {int(statistics.median(uniques))} (min {min(uniques)}, max {max(uniques)}) "
          f"[{time.perf_counter() - t:.1f} s]", flush=True)
    print(f"peak RSS after ids: {peak_rss_gb():.2f} GB", flush=True)
    grads = np.random.default_rng(args.seed + 1).standard_normal((n, dim), dtype=np.float32)  # preallocated once

    # ---- embedcore through the public API ---------------------------------------------------------------
    t = time.perf_counter()
    table = embedcore.TableConfig(rows, dim, initializer=embedcore.Zeros(), combiner="sum", name="t")
    optimizer = embedcore.Adagrad(learning_rate=LEARNING_RATE, initial_accumulator_value=INITIAL_ACCUMULATOR)
    emb = embedcore.Embedding(embedcore.FeatureConfig(table), optimizer)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    _, ctx = emb(batches[0])
    first_lookup_s = time.perf_counter() - t
    t = time.perf_counter()
    emb.apply_gradients(grads, ctx)
    first_apply_s = time.perf_counter() - t
    t = time.perf_counter()
    _, ctx = emb(batches[0])
    second_lookup_s = time.perf_counter() - t
    layer = numba.threading_layer()
    print(f"embedcore: build (fill 2 x {rows * dim * 4 / 1e6:.0f} MB, compile row function) {build_s:.2f} s; "
          f"first lookup {first_lookup_s:.2f} s (then {1e3 * second_lookup_s:.1f} ms); first apply_gradients "
          f"(compiles the update kernel; dedup/reduce kernels may come from numba's on-disk cache) "
          f"{first_apply_s:.2f} s", flush=True)
    print(f"numba {numba.__version__}, threading layer {layer}, {numba.get_num_threads()} threads "
          f"(of {numba.config.NUMBA_NUM_THREADS}); numpy {np.__version__}; python {platform.python_version()}; "
          f"allocator: {alloc}; {os.cpu_count()} CPUs", flush=True)
    memory = {"after_embedcore_build": peak_rss_gb()}
    print(f"peak RSS after embedcore build and first step: {memory['after_embedcore_build']:.2f} GB", flush=True)
    emb_table = emb.embedding_tables["t"]
    emb_slot = emb.slot_variables["t"]["accumulators"]

    # ---- the other contenders' state, warmed with the same first batch ----------------------------------
    kpath = KernelPath(optimizer, rows, dim)
    tb0 = ctx.table_batches[0]
    kpath.run(tb0, grads)

    np_tables = {}
    np_fns = {"numpy add.at": numpy_update_add_at}
    if not args.no_numpy_sort:
        np_fns["numpy argsort+reduceat"] = numpy_update_sort
    for name, fn in np_fns.items():
        w = np.zeros((rows, dim), np.float32)
        w[:] = 0.0
        a = np.full((rows, dim), INITIAL_ACCUMULATOR, np.float32)
        t = time.perf_counter()
        fn(w, a, batches[0], grads, np.float32(LEARNING_RATE))
        np_tables[name] = (w, a)
        print(f"{name}: first step {1e3 * (time.perf_counter() - t):.0f} ms", flush=True)

    copy_n = args.copy_mb * (1 << 20) // 4
    src = np.random.default_rng(2).random(copy_n, dtype=np.float32)
    dst = np.empty_like(src)
    dst[:] = 1.0
    t = time.perf_counter()
    _numba_copy(dst, src)
    print(f"numba copy kernel: compile + first call {time.perf_counter() - t:.2f} s", flush=True)
    copy_bytes = 2 * src.nbytes
    memory["after_setup"] = peak_rss_gb()
    print(f"peak RSS after setting up all contenders: {memory['after_setup']:.2f} GB", flush=True)

    # ---- rounds ----------------------------------------------------------------------------------------
    names = ["embedcore apply_gradients", "embedcore kernels", *np_fns, "copy numpy", "copy numba"]
    times = {k: [] for k in names}
    gbs = {k: [] for k in names}
    round_medians = {k: [] for k in names}
    phases = {p: [] for p in KernelPath.PHASES}
    lookup_times = []
    contention = []
    for r in range(args.rounds):
        t_round = time.perf_counter()
        snap = cpu_snapshot()
        for name in names:
            mine = []
            if name == "embedcore apply_gradients":
                for ids in batches:
                    t0 = time.perf_counter()
                    _, ctx = emb(ids)
                    t1 = time.perf_counter()
                    emb.apply_gradients(grads, ctx)
                    t2 = time.perf_counter()
                    lookup_times.append(t1 - t0)
                    mine.append(t2 - t1)
            elif name == "embedcore kernels":
                for ids in batches:
                    _, ctx = emb(ids)  # only to build the TableBatch the kernels need (not timed, no update)
                    _, ph = kpath.run(ctx.table_batches[0], grads)
                    ctx.release()  # no update: give the batch's workspaces back
                    for p, s in ph.items():
                        phases[p].append(s)
                    mine.append(sum(ph.values()))
            elif name in np_fns:
                w, a = np_tables[name]
                for ids in batches:
                    t0 = time.perf_counter()
                    np_fns[name](w, a, ids, grads, np.float32(LEARNING_RATE))
                    mine.append(time.perf_counter() - t0)
            elif name == "copy numpy":
                for _ in range(args.copy_reps):
                    t0 = time.perf_counter()
                    np.copyto(dst, src)
                    mine.append(time.perf_counter() - t0)
            elif name == "copy numba":
                for _ in range(args.copy_reps):
                    t0 = time.perf_counter()
                    _numba_copy(dst, src)
                    mine.append(time.perf_counter() - t0)
            times[name] += mine
            round_medians[name].append(1e3 * statistics.median(mine))
            if name.startswith("copy"):
                gbs[name] += [copy_bytes / s / 1e9 for s in mine]
            else:
                gbs[name] += [u * bytes_per_unique / s / 1e9 for u, s in zip(uniques, mine)]
        busy = others_share(snap, cpu_snapshot())
        contention.append(busy)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {round_medians[k][-1]:.1f} ms" for k in names)
              + f"  [{time.perf_counter() - t_round:.1f} s; other processes used "
              + ("?" if busy is None else f"{100 * busy:.0f}%") + " of the CPUs]", flush=True)

    # ---- sanity check: every contender applied the same updates ------------------------------------------
    def max_diff(x, y, relative=False, block=1 << 16):
        worst = scale = 0.0
        for lo in range(0, x.shape[0], block):  # in blocks: no table-sized temporaries
            worst = max(worst, float(np.abs(x[lo:lo + block] - y[lo:lo + block]).max()))
            scale = max(scale, float(np.abs(y[lo:lo + block]).max()))
        return worst / scale if relative and scale else worst

    checks = {"embedcore kernels": max_diff(kpath.table, emb_table),
              "embedcore kernels (slot)": max_diff(kpath.slots[0], emb_slot, relative=True)}
    for name, (w, a) in np_tables.items():
        checks[name] = max_diff(w, emb_table)
        checks[name + " (slot)"] = max_diff(a, emb_slot, relative=True)
    touched = int(np.count_nonzero(emb_slot[:, 0] != np.float32(INITIAL_ACCUMULATOR)))

    # ---- report ---------------------------------------------------------------------------------------
    results = {k: summarize(times[k], {"gbps_median": statistics.median(gbs[k]),
                                       "round_medians_ms": round_medians[k]}) for k in names}
    phase_results = {p: summarize(v) for p, v in phases.items()}
    lookup = summarize(lookup_times)
    mean_bytes = statistics.mean(uniques) * bytes_per_unique
    print()
    print(f"update bytes/step = n_unique * (2*dim*4 [row r+w] + 2*dim*4 [slot r+w] + dim*4 [grad row r]) = "
          f"n_unique * {bytes_per_unique} B; mean {mean_bytes / 1e6:.1f} MB/step "
          f"(n_unique mean {statistics.mean(uniques):.0f})")
    print(f"copy bytes = 2 * {src.nbytes / 1e6:.0f} MB (read + write);  GB/s = bytes / time (1e9), median over "
          f"steps of each step's figure")
    print()
    header = f"{'contender':28s} {'median ms':>10s} {'min-max ms':>16s} {'round medians ms':>26s} {'GB/s':>7s}"
    print(header)
    print("-" * len(header))
    for k in names:
        res = results[k]
        rm = "/".join(f"{x:.1f}" for x in res["round_medians_ms"])
        print(f"{k:28s} {res['median_ms']:10.2f} {res['min_ms']:7.2f}-{res['max_ms']:<8.2f} {rm:>26s} "
              f"{res['gbps_median']:7.2f}")
    print()
    print("embedcore kernel phases (called directly, as an engine update does):")
    for p in KernelPath.PHASES:
        res = phase_results[p]
        print(f"  {p:8s} median {res['median_ms']:7.2f} ms  (min {res['min_ms']:.2f}, max {res['max_ms']:.2f})")
    overhead = results["embedcore apply_gradients"]["median_ms"] - results["embedcore kernels"]["median_ms"]
    print(f"  apply_gradients minus kernels (validation, d_act copy, Python): {overhead:.2f} ms")
    print(f"  lookup (not part of the target, not timed above): median {lookup['median_ms']:.2f} ms")
    print()
    print("sanity (max |difference| vs embedcore's table after all steps; slot rows relative): " +
          ", ".join(f"{k} {v:.3g}" for k, v in checks.items()) + f"; rows touched {touched}")

    e = results["embedcore apply_gradients"]
    np_ms = results["numpy add.at"]["median_ms"]
    copy_best = max(results["copy numpy"]["gbps_median"], results["copy numba"]["gbps_median"])
    fraction = e["gbps_median"] / copy_best
    kernels = results["embedcore kernels"]
    summary = {
        "embedcore_ms": e["median_ms"], "embedcore_kernels_ms": kernels["median_ms"], "numpy_ms": np_ms,
        "numpy_over_embedcore": np_ms / e["median_ms"], "embedcore_gbps": e["gbps_median"],
        "embedcore_kernels_gbps": kernels["gbps_median"],
        "copy_gbps_numpy": results["copy numpy"]["gbps_median"],
        "copy_gbps_numba": results["copy numba"]["gbps_median"], "copy_gbps_best": copy_best,
        "fraction_of_copy": fraction, "kernels_fraction_of_copy": kernels["gbps_median"] / copy_best,
        "target_fraction": 0.5, "meets_target": fraction >= 0.5,
    }
    print()
    print(f"SUMMARY: embedcore {e['median_ms']:.1f} ms/step (kernels only {kernels['median_ms']:.1f}), "
          f"numpy {np_ms:.1f} ms, numpy/embedcore {summary['numpy_over_embedcore']:.1f}x, "
          f"embedcore {e['gbps_median']:.1f} GB/s = {100 * fraction:.0f}% of copy bandwidth "
          f"{copy_best:.1f} GB/s (kernels only {100 * summary['kernels_fraction_of_copy']:.0f}%); "
          f"target >= 50%: {'met' if summary['meets_target'] else 'NOT met'}")
    max_rss_gb = peak_rss_gb()
    print(f"peak RSS {max_rss_gb:.2f} GB")
    known = [c for c in contention if c is not None]
    if known and max(known) > 0.1:
        print(f"WARNING: other processes used up to {100 * max(known):.0f}% of the CPUs during the rounds; "
              f"figures are pessimistic, rerun on a quiet machine")

    if args.json:
        out = {
            "args": vars(args), "alpha": alpha, "unique_per_step": uniques, "bytes_per_unique": bytes_per_unique,
            "bytes_formula": "n_unique * (2*dim*4 + 2*dim*4 + dim*4)",
            "copy_bytes": copy_bytes,
            "env": {"numba": numba.__version__, "numpy": np.__version__, "python": platform.python_version(),
                    "threading_layer": layer, "threads": numba.get_num_threads(), "cpus": os.cpu_count(),
                    "allocator": alloc, "LD_PRELOAD": preload, "machine": platform.machine(),
                    "processor": platform.processor()},
            "compile": {"build_s": build_s, "first_lookup_s": first_lookup_s, "first_apply_s": first_apply_s},
            "results": results, "phases": phase_results, "lookup": lookup, "checks": checks,
            "summary": summary, "peak_rss_gb": max_rss_gb, "memory": memory,
            "other_processes_cpu_share_per_round": contention,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return summary


if __name__ == "__main__":
    main()
