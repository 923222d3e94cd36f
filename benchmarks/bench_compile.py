"""First-call cost of embedcore: whole processes, from ``python`` to the first update applied.

Run from the repository root::

    python benchmarks/bench_compile.py [--runs 3] [--json out.json]

Each measurement is a new Python process that imports embedcore, builds an ``Embedding`` (8 stacked tables of
250,000 x 64, the default ``TruncatedNormal`` initializer, one pooled feature each), looks up one batch of
2,048 bags of 20 ids and applies its gradients. Three situations a user meets, each timed as the whole
process (wall seconds, as a user waits for it) and by phase (import, build, first lookup, first apply):

* **cold**: a new machine: ``NUMBA_CACHE_DIR`` and ``EMBEDCORE_CACHE_DIR`` point to new empty folders, so every
  kernel (embedcore's fixed ones included) is compiled; built-in ``Adagrad``;
* **new optimizer** / **new dim**: the same folders after that run, then an optimizer the caches have not seen
  (TensorFlow's documented custom Adagrad as a ``CustomOptimizer``, a user editing their function), or the
  built-in one on rows of 32 values: only what is specific to it compiles;
* **cached**: the first run's process again (a restart, another MPI or ``torchrun`` rank).

The medians of ``--runs`` rounds are printed, each round with new folders.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

WORKER = textwrap.dedent('''
    import json, sys, time
    t_import = time.perf_counter()
    import numpy as np
    import embedcore as ec
    from embedcore.app.quickstart import custom_adagrad
    from embedcore.kernels.update import fused_update_kernel
    import_s = time.perf_counter() - t_import
    optimizers = {
        "adagrad": ec.Adagrad(0.01),
        "custom": ec.CustomOptimizer(custom_adagrad, 0.01, slot_names=["accumulators"], slot_initializers=[0.1]),
    }
    opt, dim = optimizers[sys.argv[1]], int(sys.argv[2])
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    rows = int(sys.argv[3])
    features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(rows, dim, name=f"t{t}", combiner="sum"))
                for t in range(8)}
    emb = ec.Embedding(features, opt)
    t1 = time.perf_counter()
    batch = {f"f{t}": rng.integers(0, features[f"f{t}"].table.vocabulary_size, (2048, 20)) for t in range(8)}
    acts, ctx = emb(batch)
    t2 = time.perf_counter()
    emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    t3 = time.perf_counter()
    kernel = fused_update_kernel(opt.compiled(dim), dim=dim)
    print(json.dumps({"import_s": import_s, "build_s": t1 - t0, "first_lookup_s": t2 - t1,
                      "first_apply_s": t3 - t2, "kernel_cache_hits": sum(kernel.stats.cache_hits.values())}))
''')

SITUATIONS = (("cold", "adagrad", 64), ("new optimizer", "custom", 64), ("new dim", "adagrad", 32),
              ("cached", "adagrad", 64))
ROWS = 250_000
PHASES = ("import_s", "build_s", "first_lookup_s", "first_apply_s", "process_s")


def measure(optimizer: str, dim: int, cache_root: str, rows: int = ROWS) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache_root, "numba"),
               EMBEDCORE_CACHE_DIR=os.path.join(cache_root, "embedcore"), EMBEDCORE_PROGRESS="0")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WORKER, optimizer, str(dim), str(rows)], env=env, capture_output=True,
                          text=True, timeout=900)
    process_s = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"process_s": process_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="rounds, each with new cache folders (medians)")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows of each of the 8 tables")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as root:
            rounds.append({name: measure(optimizer, dim, root, args.rows) for name, optimizer, dim in SITUATIONS})
    print(f"{'situation':14s} {'process s':>9s} {'import':>7s} {'build':>7s} {'lookup':>7s} {'apply':>7s}  "
          f"update kernel loaded from cache")
    results = {}
    for name, _, _ in SITUATIONS:
        runs = [r[name] for r in rounds]
        med = {k: statistics.median(r[k] for r in runs) for k in PHASES}
        results[name] = {"median": med, "runs": runs}
        print(f"{name:14s} {med['process_s']:9.2f} {med['import_s']:7.2f} {med['build_s']:7.2f} "
              f"{med['first_lookup_s']:7.2f} {med['first_apply_s']:7.2f}  "
              f"{[bool(r['kernel_cache_hits']) for r in runs]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
