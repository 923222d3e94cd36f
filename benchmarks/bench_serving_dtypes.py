"""Serving lookups from float32, bfloat16, float16 and int8 exports of one table, alternating in one process.

Run from the repository root::

    python benchmarks/bench_serving_dtypes.py [--rows 2000000] [--dim 64] [--ids 262144] [--bag 32]
        [--rounds 20] [--steps 3] [--threads 2] [--dir /tmp/serving_dtypes] [--keep]

One table (``rows`` x ``dim``, truncated-normal values) is saved by an ``Embedding`` and exported with
``embedcore.export_for_serving`` as each dtype; a ``ServingEmbedding`` opens each export (memory-mapped,
verified). The batches are ``ids`` ids in bags of ``bag`` (a dense ``[ids / bag, bag]`` feature, sum
combiner), drawn from the bounded Zipf distribution calibrated to ~150,000 distinct ids per batch that the
update workload uses (:func:`embedcore.bench.workloads.update_workload`), the same batches for every export.
After a warm-up (every batch looked up twice by every server, so every page a batch touches is mapped), each
round times ``steps`` lookups per server, the servers' order reversed every other round; it prints each
server's median lookup and median gather (the lookup's dtype-dependent phase, timed by
``Tuning(phase_timer=...)``; the layout before it is the same for every dtype), their ratios to float32's,
and each export's file size. Every server runs with the
same Numba thread count (``--threads``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # the harness's default OpenMP waiting

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numba
import numpy as np

import embedcore as ec
from embedcore.bench.machine import allocator_name
from embedcore.bench.workloads import Workload, make_batches, make_optim

DTYPES = ("float32", "bfloat16", "float16", "int8")


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if f.endswith(".safetensors"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=262_144)
    parser.add_argument("--bag", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the checkpoint and exports go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and exports")
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    root = args.dir or tempfile.mkdtemp(prefix="serving_dtypes_")
    try:
        w = Workload("serving", "lookup", 1, args.rows, args.dim, args.ids // args.bag, args.bag, make_optim("sgd"),
                     "bounded", None, False, 3)
        batches = [{"ids": b.ids[0].reshape(w.B, w.L)} for b in make_batches(w)]
        n_unique = [len(np.unique(b["ids"])) for b in batches]
        t0 = time.perf_counter()
        table = ec.TableConfig(args.rows, args.dim, name="table", combiner="sum")
        emb = ec.Embedding({"ids": ec.FeatureConfig(table)}, ec.SGD(0.01), seed=0)
        checkpoint = os.path.join(root, "checkpoint")
        emb.save(checkpoint)
        del emb
        print(f"table {args.rows:,} x {args.dim} float32 made and saved in {time.perf_counter() - t0:.1f} s")
        servers, sizes = {}, {}
        gathers = {dtype: [] for dtype in DTYPES}
        timing = [None]  # the dtype whose lookup is being timed

        def phase_timer(phase, seconds):
            if phase == "gather" and timing[0] is not None:
                gathers[timing[0]].append(seconds)

        for dtype in DTYPES:
            out = os.path.join(root, dtype)
            t0 = time.perf_counter()
            ec.export_for_serving(checkpoint, out, dtype)
            t1 = time.perf_counter()
            servers[dtype] = ec.ServingEmbedding(out, tuning=ec.Tuning(phase_timer=phase_timer))
            sizes[dtype] = _size(out)
            print(f"  export {dtype:8s} {t1 - t0:5.1f} s, opened (verified) in {time.perf_counter() - t1:4.1f} s, "
                  f"{sizes[dtype] / 2 ** 20:7.1f} MiB ({sizes[dtype] / args.rows:.1f} bytes a row)")
        for server in servers.values():  # compile, map every page the batches touch
            for _ in range(2):
                for batch in batches:
                    server.lookup(batch)
        times = {dtype: [] for dtype in DTYPES}
        for r in range(args.rounds):
            for dtype in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
                server = servers[dtype]
                for s in range(args.steps):
                    batch = batches[(r + s) % len(batches)]
                    timing[0] = dtype
                    t0 = time.perf_counter()
                    server.lookup(batch)
                    times[dtype].append(time.perf_counter() - t0)
                    timing[0] = None
        print(f"{w.E:,} x {w.D} table, {w.B:,} bags of {w.L} ids ({w.n_ids:,} ids, {min(n_unique):,}-"
              f"{max(n_unique):,} distinct, bounded Zipf alpha={w.alpha:.3f}), sum combiner; {args.rounds} rounds x "
              f"{args.steps} lookups per export, alternating; Numba {numba.get_num_threads()} threads, "
              f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, allocator {allocator_name()[0]}")
        base, base_gather = statistics.median(times["float32"]), statistics.median(gathers["float32"])
        for dtype in DTYPES:
            median, gather = statistics.median(times[dtype]), statistics.median(gathers[dtype])
            q1, _, q3 = statistics.quantiles(times[dtype], n=4)
            print(f"  {dtype:8s} lookup median {1e3 * median:7.3f} ms (quartiles {1e3 * q1:.3f}-{1e3 * q3:.3f}), "
                  f"{median / base:5.2f}x float32; its gather {1e3 * gather:7.3f} ms, {gather / base_gather:5.2f}x "
                  f"float32's; export {sizes[dtype] / 2 ** 20:7.1f} MiB ({sizes[dtype] / sizes['float32']:.3f} "
                  f"of float32)")
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
