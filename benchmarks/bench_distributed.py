"""Weak-scaling benchmark of ``ShardedEmbedding`` (tables sharded by rows over MPI ranks).

Run from the repository root under ``mpiexec`` (``pip install 'embedcore[mpi]'`` brings the ``mpich`` wheel,
whose ``mpiexec`` lands in the venv's ``bin``); the runs recorded in ``docs/distributed.md``::

    NUMBA_NUM_THREADS=2 .venv/bin/mpiexec -n 1 .venv/bin/python benchmarks/bench_distributed.py --baseline --json k1_t2.json
    NUMBA_NUM_THREADS=1 .venv/bin/mpiexec -n 1 .venv/bin/python benchmarks/bench_distributed.py --baseline --json k1_t1.json
    NUMBA_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_distributed.py --json k2.json
    NUMBA_NUM_THREADS=1 .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/bench_distributed.py --json k4.json
    .venv/bin/python benchmarks/bench_distributed.py --summarize k1_t2.json k1_t1.json k2.json k4.json

Give each rank as many Numba threads as it has cores (ranks x threads <= cores); with more ranks than cores
the machine is oversubscribed and the report says so. ``--vocabulary-scale 0.01`` is the other variant
recorded there. Dropped, as it is no longer an option of the engine (results in git history): ``--wait yield``. Hydra's ``mpiexec`` passes the environment on to every rank; the script
puts the checkout on ``sys.path`` when embedcore is not installed. Each run takes 10 - 100 s on 2 cores.

Workload (the demo's, at a chosen vocabulary scale): the 26 features ``C1..C26`` of
:class:`embedcore.data.SyntheticClickLog` (22 one-hot, 4 bags of 1-5 ids; ~32.5 ids per sample), one table
per feature with the Criteo-like vocabularies ``DEFAULT_VOCABULARY_SIZES`` times ``--vocabulary-scale``
(default 1: 10^2 .. 10^6 rows, 3.3M rows in all; the demo itself uses 0.01), dim 16, built-in
``Adagrad(0.05)``, the feature's combiner (sum, or mean with the bag weights). Ids follow the data set's
power laws (exponents 1.05 - 1.2, hot ids scattered over the table). Weak scaling: every rank feeds its own
``--batch`` samples per step (default 1,024, the demo's batch), samples ``(t K + k) B .. (t K + k + 1) B``
of the training stream for rank ``k`` at step ``t``, so no two ranks or steps share samples. Activation
gradients are fixed N(0, 1e-3^2) arrays (the scale of a mean loss over 1,024 samples); batches and gradients
are made before the timed loop.

Per step every rank waits at a barrier (not timed), then times ``lookup`` and ``apply_gradients`` with
``time.perf_counter`` (wall) and ``time.process_time`` (its own CPU). Reported:

* per rank: median lookup, apply and step (= lookup + apply) ms over the timed steps, and the CPU time the
  rank itself used in them (its wall time minus that is waiting: for peers, or for a core); samples/s per
  rank = ``B / median step``.
* job: per step the slowest rank's step time; job samples/s = ``K B / median of that``.
* bytes per rank per step, counted from the route of each step's lookup context (not measured on a wire):
  lookup request ids (8 B per unique id sent to its owner), returned rows (``dim * 4`` B per id), gradient
  sums (``dim * 4`` B per unique id), each sent and received, "remote" excluding what a rank sends to itself
  (MPI copies that in memory) and "all" including it; plus the lookup's count all-to-all (8 B to every rank;
  the agreements' all-reduces are not counted).
* memory per rank: bytes of this rank's tables and slots (``emb.embedding_tables`` / ``slot_variables``
  nbytes) and the process's VmRSS (after imports, after making the batches, after building the engine, at the
  end of the timed loop) and VmHWM (peak; both before any ``--baseline`` engine is built).
* the machine: load average before and after, and the share of CPU time used by processes other than this
  job's ranks during the timed loop (from ``/proc/stat``).

``--baseline`` (with one rank): also time a plain single-process ``embedcore.Embedding`` on the same
batches, to show what the sharded path costs on one rank.
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

from embedcore.bench.machine import cpu_snapshot, status_kb

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

ID_BYTES = 8
FLOAT_BYTES = 4


def _mb(kb):
    return None if kb is None else kb * 1024 / 1e6


def _cpu_snapshot():
    """(machine busy CPU-s, machine total CPU-s) from /proc/stat."""
    snapshot = cpu_snapshot()
    return None if snapshot is None else snapshot[:2]


def _loadavg():
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return None


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1024, help="samples per rank per step (default 1024)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--vocabulary-scale", type=float, default=1.0,
                   help="scale of the Criteo-like vocabularies (1: 100 .. 10^6 rows; the demo uses 0.01)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation; default 3)")
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true",
                   help="with one rank: also time a single-process embedcore.Embedding on the same batches")
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    p.add_argument("--summarize", nargs="+", metavar="JSON", default=None,
                   help="no MPI: print one markdown table from the JSON files of several runs")
    return p


# ----------------------------------------------------------------------------------------------------------
# Workload

def make_dataset(scale, seed):
    from embedcore.app.data.synthetic import DEFAULT_VOCABULARY_SIZES, SyntheticClickLog
    vocab = [max(10, round(v * scale)) for v in DEFAULT_VOCABULARY_SIZES]
    return SyntheticClickLog(n_train=1, n_eval=1, seed=seed, vocabulary_sizes=vocab)


def make_batches(ds, rank, world, batch, n_steps, dim, seed):
    """This rank's (ids, weights, gradients) for steps 0..n_steps-1 (made up front, not timed)."""
    out = []
    for t in range(n_steps):
        start = (t * world + rank) * batch
        b = ds.samples(start, start + batch)
        rng = np.random.default_rng([seed, 77, rank, t])
        grads = {f.name: (1e-3 * rng.standard_normal((batch, dim))).astype(np.float32) for f in ds.features}
        out.append((b.ids, b.weights, grads))
    return out


def route_bytes(ctx, rank):
    """Bytes this rank sends and receives in one step, from the lookup context's route."""
    route = ctx.route
    moved = route.bytes_moved(rank)
    world = route.ids_to.shape[0]
    for scope, peers in (("remote", world - 1), ("all", world)):
        b = moved[scope]
        b["counts_sent"] = b["counts_received"] = ID_BYTES * peers  # the one count all-to-all of the lookup
        b["sent"] = sum(v for k, v in b.items() if k.endswith("_sent"))
        b["received"] = sum(v for k, v in b.items() if k.endswith("_received"))
    return {"remote": moved["remote"], "all": moved["all"],
            "unique_ids": int(sum(g["uniq"].shape[0] for g in route.groups)),
            "remote_unique_ids": int(route.ids_to.sum() - route.ids_to[rank]),
            "occurrences": int(sum(g["tb"].rows.shape[0] for g in route.groups))}


def timed_loop(emb, batches, warmup, barrier=None, rank=None):
    """Run every step; time those after ``warmup``. Returns one record per timed step (with the bytes of its
    route, counted after the step, untimed, when ``rank`` is given)."""
    records = []
    for t, (ids, weights, grads) in enumerate(batches):
        if barrier is not None:
            barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        acts, ctx = emb.lookup(ids, weights)
        w1, c1 = time.perf_counter(), time.process_time()
        emb.apply_gradients(grads, ctx)
        w2, c2 = time.perf_counter(), time.process_time()
        if t >= warmup:
            records.append({"lookup_s": w1 - w0, "apply_s": w2 - w1, "step_s": w2 - w0,
                            "lookup_cpu_s": c1 - c0, "apply_cpu_s": c2 - c1,
                            "bytes": route_bytes(ctx, rank) if rank is not None else None})
    return records


def median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------------------------------------
# The run

def run(args):
    from mpi4py import MPI
    import numba
    import embedcore as ec
    from embedcore.app.data.batch import feature_configs
    from embedcore.distributed import ShardedEmbedding

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    load_before = _loadavg()
    rss_imports = _mb(status_kb("VmRSS:"))

    ds = make_dataset(args.vocabulary_scale, args.seed)
    n_steps = args.warmup + args.steps
    t0 = time.perf_counter()
    batches = make_batches(ds, rank, world, args.batch, n_steps, args.dim, args.seed)
    data_s = time.perf_counter() - t0
    rss_data = _mb(status_kb("VmRSS:"))

    features = feature_configs(ds.features, args.dim)
    optimizer = ec.Adagrad(args.learning_rate)
    comm.Barrier()
    t0 = time.perf_counter()
    emb = ShardedEmbedding(features, optimizer, seed=args.seed)
    build_s = time.perf_counter() - t0
    rss_engine = _mb(status_kb("VmRSS:"))
    table_bytes = int(sum(t.nbytes for t in emb.embedding_tables.values()))
    slot_bytes = int(sum(v.nbytes for slots in emb.slot_variables.values() for v in slots.values()))
    local_rows = int(sum(s.rows for s in emb.shards.values()))
    total_rows = int(sum(s.vocabulary_size for s in emb.shards.values()))

    comm.Barrier()
    snap0 = _cpu_snapshot()
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    records = timed_loop(emb, batches, args.warmup, barrier=comm.Barrier, rank=rank)
    wall = time.perf_counter() - wall0
    my_cpu = time.process_time() - cpu0
    comm.Barrier()
    snap1 = _cpu_snapshot()
    load_after = _loadavg()

    per_step = records
    remote_keys = list(per_step[0]["bytes"]["remote"]) if per_step else []
    mine = {
        "rank": rank,
        "numba_threads": numba.get_num_threads(),
        "threading_layer": _threading_layer(numba),
        "lookup_ms": 1e3 * median([r["lookup_s"] for r in per_step]),
        "apply_ms": 1e3 * median([r["apply_s"] for r in per_step]),
        "step_ms": 1e3 * median([r["step_s"] for r in per_step]),
        "lookup_cpu_ms": 1e3 * median([r["lookup_cpu_s"] for r in per_step]),
        "apply_cpu_ms": 1e3 * median([r["apply_cpu_s"] for r in per_step]),
        "step_s_each": [r["step_s"] for r in per_step],
        "bytes_remote": {k: median([r["bytes"]["remote"][k] for r in per_step]) for k in remote_keys},
        "bytes_all": {k: median([r["bytes"]["all"][k] for r in per_step]) for k in ("sent", "received")},
        "unique_ids": median([r["bytes"]["unique_ids"] for r in per_step]),
        "remote_unique_ids": median([r["bytes"]["remote_unique_ids"] for r in per_step]),
        "occurrences": median([r["bytes"]["occurrences"] for r in per_step]),
        "local_rows": local_rows, "table_bytes": table_bytes, "slot_bytes": slot_bytes,
        "rss_after_imports_mb": rss_imports, "rss_after_data_mb": rss_data, "rss_after_engine_mb": rss_engine,
        "rss_end_mb": _mb(status_kb("VmRSS:")), "peak_rss_mb": _mb(status_kb("VmHWM:")),
        "build_s": build_s, "data_s": data_s, "loop_wall_s": wall, "loop_cpu_s": my_cpu,
    }
    if args.baseline and world == 1:
        mine["baseline"] = baseline(ec, features, optimizer, args, batches)
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return 0
    others = None
    if snap0 and snap1 and snap1[1] > snap0[1]:
        job_cpu = sum(g["loop_cpu_s"] for g in gathered)
        others = max(0.0, ((snap1[0] - snap0[0]) - job_cpu) / (snap1[1] - snap0[1]))
    slowest = [max(g["step_s_each"][t] for g in gathered) for t in range(len(per_step))]
    result = {
        "world_size": world,
        "config": {"batch_per_rank": args.batch, "dim": args.dim, "vocabulary_scale": args.vocabulary_scale,
                   "tables": len(features), "total_rows": total_rows, "steps": args.steps, "warmup": args.warmup,
                   "optimizer": f"Adagrad({args.learning_rate})", "seed": args.seed, "wait": "engine"},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "numba": numba.__version__, "mpi": MPI.Get_library_version().strip().splitlines()[0],
                    "loadavg_before": load_before, "loadavg_after": load_after,
                    "others_cpu_share": others, "oversubscribed": world * gathered[0]["numba_threads"] >
                    (os.cpu_count() or 1),
                    "env": {k: os.environ.get(k) for k in ("NUMBA_NUM_THREADS", "OMP_WAIT_POLICY")}},
        "job": {"step_ms": 1e3 * median(slowest), "samples_per_s": world * args.batch / median(slowest),
                "samples_per_s_per_rank": args.batch / median(slowest)},
        "ranks": [{k: v for k, v in g.items() if k != "step_s_each"} for g in gathered],
    }
    result["summary"] = summary_row(result)
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _threading_layer(numba):
    try:
        return numba.threading_layer()
    except ValueError:
        return "not initialised"


def baseline(ec, features, optimizer, args, batches):
    emb = ec.Embedding(features, optimizer, seed=args.seed)
    records = timed_loop(emb, batches, args.warmup)
    return {"lookup_ms": 1e3 * median([r["lookup_s"] for r in records]),
            "apply_ms": 1e3 * median([r["apply_s"] for r in records]),
            "step_ms": 1e3 * median([r["step_s"] for r in records])}


# ----------------------------------------------------------------------------------------------------------
# Reports

def summary_row(result):
    ranks = result["ranks"]
    mean = lambda key: float(np.mean([r[key] for r in ranks]))  # noqa: E731
    br = lambda key: float(np.mean([r["bytes_remote"][key] for r in ranks]))  # noqa: E731
    return {
        "K": result["world_size"], "numba_threads": ranks[0]["numba_threads"],
        "wait": result["config"].get("wait", "engine"), "vocabulary_scale": result["config"]["vocabulary_scale"],
        "oversubscribed": result["machine"]["oversubscribed"],
        "lookup_ms": mean("lookup_ms"), "apply_ms": mean("apply_ms"), "step_ms": mean("step_ms"),
        "cpu_ms": mean("lookup_cpu_ms") + mean("apply_cpu_ms"),
        "lookup_ms_max": max(r["lookup_ms"] for r in ranks), "apply_ms_max": max(r["apply_ms"] for r in ranks),
        "job_step_ms": result["job"]["step_ms"],
        "samples_per_s_per_rank": result["job"]["samples_per_s_per_rank"],
        "samples_per_s_job": result["job"]["samples_per_s"],
        "unique_ids": mean("unique_ids"), "remote_unique_ids": mean("remote_unique_ids"),
        "sent_remote_kb": br("sent") / 1e3, "received_remote_kb": br("received") / 1e3,
        "lookup_ids_sent_kb": br("ids_sent") / 1e3, "lookup_rows_received_kb": br("rows_received") / 1e3,
        "grad_sums_sent_kb": br("grads_sent") / 1e3,
        "sent_all_kb": float(np.mean([r["bytes_all"]["sent"] for r in ranks])) / 1e3,
        "tables_slots_mb": mean("table_bytes") / 1e6 + mean("slot_bytes") / 1e6,
        "rss_end_mb": mean("rss_end_mb"), "peak_rss_mb": mean("peak_rss_mb"),
        "rss_engine_delta_mb": mean("rss_after_engine_mb") - mean("rss_after_data_mb"),
        "loadavg": result["machine"]["loadavg_before"], "others_cpu_share": result["machine"]["others_cpu_share"],
        "baseline_step_ms": ranks[0].get("baseline", {}).get("step_ms"),
    }


def _percent(x):
    return "?" if x is None else f"{100 * x:.0f}%"


def print_report(result):
    c, m = result["config"], result["machine"]
    print(f"ShardedEmbedding weak scaling: K={result['world_size']} ranks, {c['tables']} tables "
          f"({c['total_rows']:,} rows, vocabulary scale {c['vocabulary_scale']}), dim {c['dim']}, "
          f"{c['batch_per_rank']} samples per rank per step, {c['optimizer']}, {c['steps']} timed steps "
          f"after {c['warmup']}")
    print(f"machine: {m['cpus']} CPUs, {m['mpi']}; Numba threads per rank "
          f"{result['ranks'][0]['numba_threads']} ({result['ranks'][0]['threading_layer']}); load average "
          f"{m['loadavg_before']} -> {m['loadavg_after']}; other processes used "
          f"{_percent(m['others_cpu_share'])} of the CPUs"
          + ("; OVERSUBSCRIBED (ranks x threads > CPUs)" if m["oversubscribed"] else ""))
    print("| rank | lookup ms | apply ms | step ms | lookup CPU ms | apply CPU ms | unique ids | remote | "
          "sent KB (remote) | recv KB (remote) | tables+slots MB | RSS MB (end / peak) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in result["ranks"]:
        print(f"| {r['rank']} | {r['lookup_ms']:.1f} | {r['apply_ms']:.1f} | {r['step_ms']:.1f} | "
              f"{r['lookup_cpu_ms']:.1f} | {r['apply_cpu_ms']:.1f} | {r['unique_ids']:,.0f} | "
              f"{r['remote_unique_ids']:,.0f} | {r['bytes_remote']['sent'] / 1e3:,.1f} | "
              f"{r['bytes_remote']['received'] / 1e3:,.1f} | {(r['table_bytes'] + r['slot_bytes']) / 1e6:,.1f} | "
              f"{r['rss_end_mb']:,.0f} / {r['peak_rss_mb']:,.0f} |")
    j = result["job"]
    print(f"job: slowest rank's step median {j['step_ms']:.1f} ms; {j['samples_per_s']:,.0f} samples/s "
          f"({j['samples_per_s_per_rank']:,.0f} per rank)")
    b = result["ranks"][0].get("baseline")
    if b:
        print(f"single-process Embedding on the same batches: lookup {b['lookup_ms']:.1f} ms, apply "
              f"{b['apply_ms']:.1f} ms, step {b['step_ms']:.1f} ms")


def summarize(paths):
    """One markdown row per configuration (K, vocabulary scale, threads, wait policy): with several runs of
    one configuration, the median of the runs' medians and, for the step, the range over runs."""
    groups = {}
    for p in paths:
        r = json.load(open(p))["summary"]
        key = (r["K"], r.get("vocabulary_scale"), r["numba_threads"], r.get("wait", "engine"))
        groups.setdefault(key, []).append(r)
    print("| K | vocab scale | Numba threads/rank | wait | runs | lookup ms | apply ms | step ms (job; runs' range) | "
          "CPU ms/rank | samples/s per rank | samples/s job | unique ids/rank | remote ids/rank | "
          "sent KB/rank (remote) | recv KB/rank (remote) | tables+slots MB/rank | RSS MB/rank (end / peak) | "
          "load avg (1 min) | others' CPU | 1-process Embedding step ms |")
    print("| ---: " * 20 + "|")
    for (k, scale, threads, wait), runs in groups.items():
        m = lambda key: median([r[key] for r in runs if r.get(key) is not None])  # noqa: E731
        steps = [r["job_step_ms"] for r in runs]
        spread = f" ({min(steps):.0f} - {max(steps):.0f})" if len(runs) > 1 else ""
        shares = [r["others_cpu_share"] for r in runs if r["others_cpu_share"] is not None]
        others = " / ".join(_percent(x) for x in shares) if shares else "?"
        loads = " / ".join(f"{r['loadavg'][0]:.1f}" for r in runs if r.get("loadavg"))
        base = [r["baseline_step_ms"] for r in runs if r.get("baseline_step_ms") is not None]
        base = f"{median(base):.1f}" if base else ""
        print(f"| {k}{' (over)' if runs[0]['oversubscribed'] else ''} | {scale if scale is not None else ''} | "
              f"{threads} | {wait} | {len(runs)} | {m('lookup_ms'):.1f} | {m('apply_ms'):.1f} | "
              f"{m('job_step_ms'):.1f}{spread} | {m('cpu_ms'):.1f} | {m('samples_per_s_per_rank'):,.0f} | "
              f"{m('samples_per_s_job'):,.0f} | {m('unique_ids'):,.0f} | {m('remote_unique_ids'):,.0f} | "
              f"{m('sent_remote_kb'):,.1f} | {m('received_remote_kb'):,.1f} | {m('tables_slots_mb'):,.1f} | "
              f"{m('rss_end_mb'):,.0f} / {m('peak_rss_mb'):,.0f} | {loads} | {others} | {base} |")
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
