"""The step benchmark: every available contender, in one process, in alternating rounds.

Run ``python benchmarks/bench_step.py --help`` (or ``main(argv)``). For each case (a workload with one
optimizer), every contender that supports it builds its own copy of the same initial tables, then:

1. **check**: ``--check-steps`` steps on the same batches, untimed; before each, every contender's pooled
   forward output is compared with the reference's (NumPy, else embedcore), and after them every table and
   optimizer state. A contender that disagrees by more than ``--tolerance`` (max |diff| / max |reference|)
   is reported as FAILED (and still timed).
2. **rounds**: ``--rounds`` rounds; in each, every contender (in an order rotated every round) runs
   ``--steps`` timed steps (``prepare`` untimed, ``run`` timed), then the machine probes run
   (copy and random-row-gather bandwidth, :mod:`embedcore.bench.machine`), and the CPU time other processes
   used during the round is recorded.
3. **final check**: tables and states compared again after all timed steps (every contender applied the
   same batches in the same order).

Figures: median / min / max ms per step over all timed steps of all rounds; ratio = contender median /
embedcore median; GB/s = the step's minimal bytes (:func:`embedcore.bench.workloads.step_bytes`) / time,
median over steps; %copy and %gather = that GB/s over the run's copy and gather limits.

Threads: Numba ``--threads``, torch intra-op ``--threads`` (FBGEMM's CPU kernels use torch's pool), inter-op
1, OpenBLAS 1 (``embedcore.blas_threads``), TensorFlow intra-op ``--threads``; XLA sizes its pool by the CPU
count. OpenMP waiting (set before torch or Numba load their OpenMP runtimes): two runtimes (Numba's and
torch's) share the cores in this one process. By default idle workers spin ``GOMP_SPINCOUNT=100000`` times
(about 1 ms) and then sleep: a contender's parallel regions start at once within its step (a region costs
~2 us to start, against 60-90 us when workers sleep at once under ``OMP_WAIT_POLICY=PASSIVE``, which every
contender then pays in each region), and its workers stop competing for the cores about 1 ms after its
last step, before the next contender has done much. ``--omp-wait-policy PASSIVE`` measures the other
extreme. The allocator is whatever ``LD_PRELOAD`` says.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

__all__ = ["main"]

QUICK = {
    "tbe_T": 2, "tbe_E": 2000, "tbe_D": 8, "tbe_B": 32, "tbe_L": 4,
    "update_E": 5000, "update_ids": 2048, "update_unique_target": 1000,
    "sweep_rows": "1000,100000", "sweep_ids": "256,4096", "sweep_fixed_rows": 10000, "sweep_fixed_ids": 1024,
    "sweep_dim": 8, "sweep_L": 4,
    "rounds": 2, "steps": 2, "check_steps": 2, "sweep_rounds": 1, "sweep_steps": 2,
    "copy_mb": 8, "gather_mb": 32, "gather_rows": 1 << 16, "probe_reps": 2,
    "optimizers": "", "weighted_optimizers": "adagrad", "n_batches": 2,
}


def _csv(text):
    return [x.strip() for x in str(text).split(",") if x.strip()]


def _ints(text):
    return [int(float(x)) for x in _csv(text)]


def _parser():
    p = argparse.ArgumentParser(
        prog="embedcore bench",
        description="Training-step benchmark of embedcore against FBGEMM, PyTorch, JAX/XLA, TensorFlow and a "
                    "NumPy reference: same threads, same batches, alternating rounds; prints medians, ratios "
                    "to embedcore and fractions of the machine's measured copy and random-row-gather "
                    "bandwidth; writes bench.json and bench.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, few steps, small probes (a smoke test in seconds); explicit options win")
    p.add_argument("--out", default="runs/bench", help="folder for bench.json and bench.png")
    p.add_argument("--contenders", default="default",
                   help="comma list of embedcore, embedcore-custom, embedcore-skip, embedcore-torch, fbgemm, torch, "
                        "jax, tensorflow, numpy; 'default' = all but embedcore-torch; 'all'")
    p.add_argument("--workloads", default="tbe,update,lookup,sweep-rows,sweep-ids",
                   help="which of tbe, update, lookup, sweep-rows, sweep-ids to run (lookup: the update "
                        "workload's shape, the pooled lookup alone)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--omp-wait-policy", default="unset", choices=("PASSIVE", "ACTIVE", "unset"),
                   help="OMP_WAIT_POLICY for Numba's and torch's OpenMP workers (an existing environment "
                        "value is kept); with 'unset', idle workers spin --gomp-spincount times, then sleep")
    p.add_argument("--gomp-spincount", type=int, default=100_000,
                   help="GOMP_SPINCOUNT when OMP_WAIT_POLICY is unset (an existing environment value is kept): "
                        "about 1 ms of spinning here, so parallel regions within a step start at once while a "
                        "contender's workers stop competing for the cores about 1 ms after its last step")
    g = p.add_argument_group("timing")
    g.add_argument("--rounds", type=int, default=3)
    g.add_argument("--steps", type=int, default=2, help="timed steps per contender per round")
    g.add_argument("--check-steps", type=int, default=2, help="untimed steps whose results are compared")
    g.add_argument("--n-batches", type=int, default=3, help="distinct batches per case (steps cycle over them)")
    g.add_argument("--tolerance", type=float, default=1e-4,
                   help="agreement: max |x - reference| / max |reference| per table, state and output")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("tbe workload (FBGEMM's TBE benchmark shape: forward + backward + optimizer)")
    g.add_argument("--tbe-T", type=int, default=8, help="tables (one pooled feature each)")
    g.add_argument("--tbe-E", type=int, default=250_000, help="rows per table")
    g.add_argument("--tbe-D", type=int, default=64, help="embedding dim")
    g.add_argument("--tbe-B", type=int, default=2048, help="batch size (bags per table)")
    g.add_argument("--tbe-L", type=int, default=20, help="ids per bag")
    g.add_argument("--alpha", type=float, default=1.15, help="Zipf alpha")
    g.add_argument("--dist", default="fbgemm", choices=("fbgemm", "zipf", "uniform"),
                   help="id distribution (see embedcore.bench.workloads)")
    g.add_argument("--optimizers", default="sgd,adagrad,rowwise_adagrad,adam",
                   help="one unweighted case per optimizer: comma list of sgd, adagrad, rowwise_adagrad, adam")
    g.add_argument("--weighted-optimizers", default="adagrad",
                   help="one weighted case (per-sample weights) per optimizer listed")
    g.add_argument("--adagrad-style", default="tf", choices=("tf", "fbgemm"),
                   help="tf: accumulator from 0.1, no eps (embedcore/TF Adagrad); fbgemm: from 0, eps 1e-8 "
                        "(EXACT_ADAGRAD defaults; embedcore runs it as a CustomOptimizer)")
    g = p.add_argument_group("update workload (BENCHMARKS.md: backward + optimizer only) and lookup workload "
                             "(the same shape, forward only)")
    g.add_argument("--update-E", type=int, default=2_000_000)
    g.add_argument("--update-D", type=int, default=64)
    g.add_argument("--update-ids", type=int, default=262_144, help="ids per step, one per sample")
    g.add_argument("--update-unique-target", type=int, default=150_000,
                   help="bounded-Zipf alpha is calibrated to this expected number of distinct ids")
    g.add_argument("--update-optimizer", default="adagrad")
    g = p.add_argument_group("sweeps (one table, forward + backward + optimizer)")
    g.add_argument("--sweep-rows", default="1e4,1e5,1e6,1e7,3e7,1e8",
                   help="vocabulary sizes (ids per step fixed); points that do not fit in memory are skipped")
    g.add_argument("--sweep-ids", default="4096,16384,65536,262144,1048576",
                   help="ids per step (vocabulary fixed)")
    g.add_argument("--sweep-fixed-rows", type=float, default=1e6, help="vocabulary of the ids sweep")
    g.add_argument("--sweep-fixed-ids", type=int, default=65536, help="ids per step of the rows sweep")
    g.add_argument("--sweep-dim", type=int, default=16, help="dim (16 lets 1e8 rows fit in memory)")
    g.add_argument("--sweep-L", type=int, default=16, help="ids per bag")
    g.add_argument("--sweep-dist", default="zipf", choices=("zipf", "uniform", "fbgemm"))
    g.add_argument("--sweep-optimizer", default="sgd")
    g.add_argument("--sweep-contenders", default="embedcore,fbgemm,torch,jax,numpy")
    g.add_argument("--sweep-rounds", type=int, default=2)
    g.add_argument("--sweep-steps", type=int, default=2)
    g.add_argument("--mem-budget-gb", type=float, default=None,
                   help="memory the contenders' tables may use at once (default: 60%% of MemAvailable at start)")
    g = p.add_argument_group("machine probes")
    g.add_argument("--copy-mb", type=int, default=256, help="size of each copy buffer (MiB)")
    g.add_argument("--gather-mb", type=int, default=1024, help="size of the gather table (MiB)")
    g.add_argument("--gather-rows", type=int, default=1 << 20, help="random 256-byte rows per gather")
    g.add_argument("--probe-reps", type=int, default=3, help="runs of each probe per round")
    p.add_argument("--no-plot", action="store_true", help="skip bench.png")
    return p


def _parse(argv):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        given = set()
        for token in (argv if argv is not None else sys.argv[1:]):
            if token.startswith("--"):
                given.add(token[2:].split("=", 1)[0].replace("-", "_"))
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    return args


class Log:
    def __init__(self):
        self.lines = []

    def __call__(self, text=""):
        print(text, flush=True)
        self.lines.append(text)


# ----------------------------------------------------------------------------------------------------------
# Environment

def _environment(args, log):
    """Thread counts and allocator, set before the heavy imports where that matters; returns the facts."""
    policy_before = os.environ.get("OMP_WAIT_POLICY")
    spin_before = os.environ.get("GOMP_SPINCOUNT")
    preloaded = [m for m in ("torch", "jax", "tensorflow") if m in sys.modules]
    if args.omp_wait_policy != "unset" and policy_before is None:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    if args.omp_wait_policy == "unset" and policy_before is None and spin_before is None:
        os.environ["GOMP_SPINCOUNT"] = str(args.gomp_spincount)
    import numba
    import numpy as np

    from embedcore.app.blas_threads import set_blas_threads

    from .machine import allocator_name, mem_available_gb
    numba_threads = min(args.threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(numba_threads)
    previous_blas = set_blas_threads(1)
    alloc, preload = allocator_name()
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    env = {
        "python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
        "cpus": os.cpu_count(), "cpu_model": cpu_model, "machine": platform.machine(),
        "threads_requested": args.threads, "numba_threads": numba.get_num_threads(),
        "numba_max_threads": numba.config.NUMBA_NUM_THREADS,
        "openblas_threads": 1 if previous_blas is not None else "no OpenBLAS found",
        "allocator": alloc, "LD_PRELOAD": preload,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)") +
        (" (from the environment)" if policy_before is not None else
         " (set by the harness)" if args.omp_wait_policy != "unset" else ""),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "(unset)") +
        (" (from the environment)" if spin_before is not None else
         " (set by the harness)" if "GOMP_SPINCOUNT" in os.environ else ""),
        "mem_available_gb_at_start": mem_available_gb(),
    }
    if preloaded and policy_before is None and args.omp_wait_policy != "unset":
        env["OMP_WAIT_POLICY"] += f" -- but {preloaded} were imported before: their OpenMP may ignore it"
    if numba_threads < args.threads:
        log(f"NOTE: Numba allows only {numba_threads} threads here (NUMBA_NUM_THREADS)")
    return env


def _load_contenders(names, threads, log):
    from . import contenders as C
    loaded, skipped = {}, {}
    for name in names:
        try:
            loaded[name] = C.load(name, threads)
        except C.Skip as exc:
            skipped[name] = str(exc)
            log(f"skip {name}: {exc}")
    return loaded, skipped


# ----------------------------------------------------------------------------------------------------------
# One case

def _rel_diff(x, y, block=1 << 16):
    """max |x - y| / max |y|, blockwise (no table-sized temporaries); inf on a shape mismatch or NaN."""
    import numpy as np
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape:
        return math.inf
    worst = scale = 0.0
    for lo in range(0, max(1, x.shape[0]), block):
        a, b = x[lo:lo + block], y[lo:lo + block]
        if a.size == 0:
            continue
        d = float(np.max(np.abs(a - b)))
        if not math.isfinite(d):
            return math.inf
        worst = max(worst, d)
        scale = max(scale, float(np.max(np.abs(b))))
    return worst / scale if scale > 0 else worst


def _compare_state(c, ref, w):
    """Largest relative difference of c's tables and states from ref's."""
    tables = slots = 0.0
    for t in range(w.T):
        tables = max(tables, _rel_diff(c.table(t), ref.table(t)))
        for a, b in zip(c.slots(t), ref.slots(t)):
            slots = max(slots, _rel_diff(a, b))
    return tables, slots


def _fit_memory(contenders, w, budget, log):
    """The contenders whose tables fit in ``budget`` bytes together, in priority order (embedcore first)."""
    need_one = w.table_bytes()
    out, used = [], 0
    for c in contenders:
        need = need_one * c.memory_factor
        if used + need > budget:
            log(f"  skip {c.name}: its tables need {need / 1e9:.1f} GB, {max(0, budget - used) / 1e9:.1f} GB of the "
                f"{budget / 1e9:.1f} GB budget left")
            continue
        out.append(c)
        used += need
    return out


def _median(xs):
    return statistics.median(xs) if xs else None


_INIT_CACHE = {}  # the last initial tables: consecutive cases of one shape share them


def run_case(w, contenders, probes, args, log, rounds, steps, check_steps, budget):
    """Set up, check, time and check again every contender on workload ``w``; returns the case's record."""
    import numpy as np

    from .machine import cpu_snapshot, others_share, peak_rss_gb
    from .workloads import initial_tables, make_batches, step_bytes
    t_case = time.perf_counter()
    batches = make_batches(w)  # resolves a calibrated alpha first
    log()
    log(f"== {w.label}")
    uniq = [sum(b.n_unique) for b in batches]
    nbytes = [step_bytes(w, b) for b in batches]
    log(f"   {w.n_ids:,} ids/step, distinct ids/step (all tables) {min(uniq):,}-{max(uniq):,}; minimal bytes/step "
        f"{statistics.mean(x['random_row_bytes'] for x in nbytes) / 1e6:.1f} MB random rows + "
        f"{statistics.mean(x['sequential_bytes'] for x in nbytes) / 1e6:.1f} MB sequential; tables+state "
        f"{w.table_bytes() / 1e9:.2f} GB per contender; alpha {w.alpha:.4g} [{time.perf_counter() - t_case:.1f} s]")
    record = {"workload": w.as_dict(), "label": w.label, "distinct_ids_per_batch": uniq, "bytes_per_batch": nbytes,
              "contenders": {}, "skipped": {}, "other_cpu_per_round": [], "probes_per_round": []}
    active = []
    for c in contenders:
        why = c.unsupported(w)
        if why:
            record["skipped"][c.name] = why
            log(f"  skip {c.name}: {why}")
        else:
            active.append(c)
    active = _fit_memory(active, w, budget, log)
    for c in contenders:
        if c.name not in record["skipped"] and c not in active:
            record["skipped"][c.name] = "does not fit in the memory budget"
    key = (w.T, w.E, w.D, w.seed, w.init)
    if _INIT_CACHE.get("key") != key:
        _INIT_CACHE.clear()
        _INIT_CACHE.update(key=key, tables=initial_tables(w))
    init = _INIT_CACHE["tables"]
    ready = []
    for c in active:
        t0 = time.perf_counter()
        try:
            c.setup(w, init)
        except Exception as exc:
            record["skipped"][c.name] = f"setup failed: {type(exc).__name__}: {exc}"
            log(f"  skip {c.name}: setup failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            c.close()
            continue
        rec = record["contenders"][c.name] = {"label": c.label, "measures": c.measures,
                                              "setup_s": time.perf_counter() - t0}
        ready.append(c)
    del init
    gc.collect()
    if not ready:
        return record
    names = [c.name for c in ready]
    ref = next((c for c in ready if c.name == "numpy"), None) or next((c for c in ready if c.name == "embedcore"),
                                                                       ready[0])
    record["reference"] = ref.name

    def fail(c, where, exc):
        record["contenders"][c.name]["error"] = f"{where}: {type(exc).__name__}: {exc}"
        log(f"  {c.name} FAILED in {where}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        ready.remove(c)
        c.close()

    # ---- check phase ---------------------------------------------------------------------------------
    out_diff = {c.name: 0.0 for c in ready}
    for k in range(check_steps):
        batch = batches[k % len(batches)]
        if w.kind in ("train", "lookup"):
            try:
                ref_out = ref.forward(batch)
            except Exception as exc:
                ref_out = None
                log(f"  reference forward failed: {exc}")
        for c in list(ready):
            try:
                if w.kind in ("train", "lookup") and ref_out is not None:
                    t0 = time.perf_counter()
                    out = c.forward(batch)
                    if k == 0:
                        record["contenders"][c.name]["first_forward_s"] = time.perf_counter() - t0
                    out_diff[c.name] = max(out_diff[c.name], _rel_diff(out, ref_out))
                prepared = c.prepare(batch)
                t0 = time.perf_counter()
                c.run(prepared)
                if k == 0:
                    record["contenders"][c.name]["first_step_s"] = time.perf_counter() - t0
            except Exception as exc:
                fail(c, "check", exc)
    for c in list(ready):
        try:
            tables, slots = _compare_state(c, ref, w)
        except Exception as exc:
            fail(c, "check (state)", exc)
            continue
        ok = max(tables, slots, out_diff[c.name]) <= args.tolerance
        record["contenders"][c.name]["check"] = {
            "outputs": out_diff[c.name] if w.kind in ("train", "lookup") else None, "tables": tables,
            "state": slots,
            "steps": check_steps, "ok": ok}
    def describe(c):
        chk = record["contenders"][c.name]["check"]
        return (f"{c.name} " + (f"out {out_diff[c.name]:.1e} " if w.kind in ("train", "lookup") else "") +
                f"tables {chk['tables']:.1e} state {chk['state']:.1e}" + ("" if chk["ok"] else " FAILED"))
    log(f"   check after {check_steps} step(s) vs {ref.name} (max |diff| / max |ref|): " +
        ", ".join(describe(c) for c in ready))

    # ---- rounds --------------------------------------------------------------------------------------
    times = {c.name: [] for c in ready}
    gbps = {c.name: [] for c in ready}
    phases = {c.name: {} for c in ready}
    round_medians = {c.name: [] for c in ready}
    for r in range(rounds):
        t_round = time.perf_counter()
        snap = cpu_snapshot()
        order = ready[r % len(ready):] + ready[:r % len(ready)] if ready else []
        for c in order:
            if c not in ready:
                continue
            gc.collect()
            mine = []
            try:
                for s in range(steps):
                    batch = batches[s % len(batches)]
                    prepared = c.prepare(batch)
                    t0 = time.perf_counter()
                    ph = c.run(prepared)
                    dt = time.perf_counter() - t0
                    mine.append(dt)
                    gbps[c.name].append(nbytes[s % len(batches)]["total_bytes"] / dt / 1e9)
                    for p_name, p_s in (ph or {}).items():
                        phases[c.name].setdefault(p_name, []).append(p_s)
                    del prepared
            except Exception as exc:
                fail(c, f"round {r + 1}", exc)
                continue
            times[c.name] += mine
            round_medians[c.name].append(1e3 * statistics.median(mine))
        probe_round = probes.measure() if probes is not None else {}
        busy = others_share(snap, cpu_snapshot())
        record["other_cpu_per_round"].append(busy)
        record["probes_per_round"].append(probe_round)
        log(f"   round {r + 1}/{rounds}: " + ", ".join(f"{c.name} {round_medians[c.name][-1]:.1f} ms" for c in ready
                                                       if round_medians[c.name])
            + ("; " + ", ".join(f"{k.split(' (')[0]} {v:.1f} GB/s" for k, v in probe_round.items()) if probe_round
               else "")
            + f"  [{time.perf_counter() - t_round:.1f} s; other processes used "
            + ("?" if busy is None else f"{100 * busy:.0f}%") + " of the CPUs]")

    # ---- final check and results ---------------------------------------------------------------------
    for c in list(ready):
        rec = record["contenders"][c.name]
        try:
            tables, slots = _compare_state(c, ref, w) if c is not ref else (0.0, 0.0)
            rec["final_check"] = {"tables": tables, "state": slots, "ok": max(tables, slots) <= args.tolerance}
        except Exception as exc:
            rec["final_check"] = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
        ms = [1e3 * t for t in times[c.name]]
        if ms:
            rec.update({"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms),
                        "times_ms": ms, "round_medians_ms": round_medians[c.name],
                        "gbps_median": statistics.median(gbps[c.name]),
                        "phases_median_ms": {k: 1e3 * statistics.median(v) for k, v in phases[c.name].items()}})
        rec["info"] = dict(c.info)
    bad = [f"{c.name} (tables {record['contenders'][c.name]['final_check'].get('tables', float('nan')):.1e})"
           for c in ready if not record["contenders"][c.name]["final_check"]["ok"]]
    log(f"   final check after all steps vs {ref.name}: " + ("all agree" if not bad else "DISAGREE: " + ", ".join(bad)))
    for c in ready:
        c.close()
    for c in active:
        c.close()
    del ready
    gc.collect()
    record["wall_s"] = time.perf_counter() - t_case
    record["peak_rss_gb"] = peak_rss_gb()
    return record


# ----------------------------------------------------------------------------------------------------------
# Cases

def _cases(args):
    from .workloads import Workload, make_optim, tbe_workload, update_workload
    workloads = _csv(args.workloads)
    unknown = set(workloads) - {"tbe", "update", "lookup", "sweep-rows", "sweep-ids"}
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}")
    main_cases, sweeps = [], {"sweep-rows": [], "sweep-ids": []}
    if "tbe" in workloads:
        for weighted, opts in ((False, args.optimizers), (True, args.weighted_optimizers)):
            for opt in _csv(opts):
                main_cases.append(tbe_workload(args.tbe_T, args.tbe_E, args.tbe_D, args.tbe_B, args.tbe_L,
                                               make_optim(opt, args.adagrad_style), weighted,
                                               args.alpha, args.dist, args.n_batches, args.seed))
    for kind in ("update", "lookup"):
        if kind in workloads:
            main_cases.append(update_workload(args.update_E, args.update_D, args.update_ids,
                                              make_optim(args.update_optimizer, args.adagrad_style), None,
                                              args.update_unique_target, args.n_batches, args.seed, kind=kind))
    sweep_opt = make_optim(args.sweep_optimizer, args.adagrad_style)
    L = args.sweep_L

    def sweep(name, E, ids, point):
        B = max(1, ids // L)
        return Workload(name, "train", 1, int(E), args.sweep_dim, B, L, sweep_opt, args.sweep_dist, args.alpha,
                        False, args.n_batches, args.seed, "zeros", extra={"point": point})
    if "sweep-rows" in workloads:
        sweeps["sweep-rows"] = [sweep("sweep-rows", E, args.sweep_fixed_ids, int(E)) for E in _ints(args.sweep_rows)]
    if "sweep-ids" in workloads:
        sweeps["sweep-ids"] = [sweep("sweep-ids", args.sweep_fixed_rows, n, max(1, n // L) * L)
                               for n in _ints(args.sweep_ids)]
    return main_cases, sweeps


# ----------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """Run the benchmark; returns 0, or 1 when a contender disagreed with the reference."""
    args = _parse(argv)
    log = Log()
    t_start = time.perf_counter()
    env = _environment(args, log)
    from . import contenders as C
    from . import report
    from .machine import Probes, mem_available_gb, peak_rss_gb

    if args.contenders == "default":
        names = list(C.DEFAULT)
    elif args.contenders == "all":
        names = list(C.REGISTRY)
    else:
        names = _csv(args.contenders)
        for n in names:
            if n not in C.REGISTRY:
                raise SystemExit(f"unknown contender {n!r}; choose from {list(C.REGISTRY)}")
    sweep_names = [n for n in _csv(args.sweep_contenders) if n in C.REGISTRY]
    main_cases, sweeps = _cases(args)
    needed = list(dict.fromkeys(names + [n for n in sweep_names if any(sweeps.values())]))
    loaded, skipped = _load_contenders(needed, args.threads, log)
    for c in loaded.values():
        for key in ("torch_threads", "torch_interop_threads", "torch_parallel_backend", "torch", "jax",
                    "xla_threads", "fbgemm_gpu", "tensorflow", "tensorflow_threads"):
            if key in c.info:
                env[key] = c.info[key]
    gc.collect()
    gc.freeze()  # the frameworks' objects: later collections (before each contender's steps) stay cheap
    t0 = time.perf_counter()
    probes = Probes(args.threads, args.copy_mb, args.gather_mb, args.gather_rows, args.probe_reps, args.seed)
    import numba
    env["numba_threading_layer"] = numba.threading_layer()
    env["probe_setup_s"] = time.perf_counter() - t0
    budget = (args.mem_budget_gb * 1e9 if args.mem_budget_gb else
              0.6 * (mem_available_gb() or 8.0) * 1e9)
    env["memory_budget_gb"] = budget / 1e9
    log(report.header(env))

    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench.json")
    cases, sweep_records = [], {}

    def snapshot(final):
        """The result so far; written after every case, so a run that dies keeps what it measured."""
        result = {
            "args": vars(args), "env": env, "skipped_contenders": skipped, "machine": probes.results(),
            "cases": cases, "sweeps": sweep_records, "wall_s": time.perf_counter() - t_start,
            "peak_rss_gb": peak_rss_gb(), "complete": final,
            "contender_measures": {c.name: c.measures for c in loaded.values()},
        }
        report.add_summary(result)
        if final:
            log(report.tables(result))
            result["log"] = log.lines
        with open(json_path + ".tmp", "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(json_path + ".tmp", json_path)
        return result

    main_contenders = [loaded[n] for n in names if n in loaded]
    for w in main_cases:
        cases.append(run_case(w, main_contenders, probes, args, log, args.rounds, args.steps, args.check_steps,
                              budget))
        snapshot(False)
    sweep_contenders = [loaded[n] for n in sweep_names if n in loaded]
    for kind, points in sweeps.items():
        if not points:
            continue
        sweep_records[kind] = []
        for w in points:
            sweep_records[kind].append(run_case(w, sweep_contenders, probes, args, log, args.sweep_rounds,
                                                args.sweep_steps, 1, budget))
            snapshot(False)
    result = snapshot(True)
    probes.close()
    _INIT_CACHE.clear()
    log(f"wrote {json_path}")
    if not args.no_plot:
        png = os.path.join(args.out, "bench.png")
        if report.plot(result, png):
            log(f"wrote {png}")
        else:
            log("no bench.png: matplotlib is not installed")
    return 0 if result["summary"]["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
