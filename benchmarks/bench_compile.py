"""First-call cost of embedcore: compilation in a fresh process, then the same process start with warm caches.

Run from the repository root::

    python benchmarks/bench_compile.py [--runs 2] [--json out.json]

Each measurement is a new Python process that builds an ``Embedding`` (8 stacked tables of 250,000 x 64,
one pooled feature each), looks up one batch and applies its gradients, for three optimizers: the built-in
``Adagrad``, TensorFlow's documented custom Adagrad as a ``CustomOptimizer`` (element-wise, inlined), and a
row-wise Adagrad ``CustomOptimizer`` written with ``np.mean`` (split into loops by the compiler). It reports
the seconds of ``Embedding(...)`` (table fill + row-function compilation and checks), the first lookup
(loading or compiling the lookup kernels) and the first ``apply_gradients`` (the update kernel), and the
update kernel's Numba cache hits.

* **cold**: ``NUMBA_CACHE_DIR`` and ``EMBEDCORE_CACHE_DIR`` point to new empty folders, so every kernel
  (embedcore's fixed ones included) is compiled;
* **warm**: the same folders again, as a second training process, another MPI rank or a restart sees them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

WORKER = textwrap.dedent('''
    import json, sys, time
    t_import = time.perf_counter()
    import numpy as np
    import embedcore as ec
    from embedcore.bench.contenders.embedcore_custom import custom_rowwise_adagrad
    from embedcore.app.quickstart import custom_adagrad
    from embedcore.kernels.update import fused_update_kernel
    import_s = time.perf_counter() - t_import
    optimizers = {
        "Adagrad (built-in)": ec.Adagrad(0.01),
        "CustomOptimizer: TensorFlow's custom Adagrad": ec.CustomOptimizer(
            custom_adagrad, 0.01, slot_names=["accumulators"], slot_initializers=[0.1]),
        "CustomOptimizer: row-wise Adagrad with np.mean": ec.CustomOptimizer(
            custom_rowwise_adagrad, 0.01, slot_names=["accumulators"], slot_initializers=[0.0], slot_dims=[1],
            hyperparameters=[1e-8]),
    }
    opt = optimizers[sys.argv[1]]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    features = {f"f{t}": ec.FeatureConfig(ec.TableConfig(250_000, 64, name=f"t{t}", combiner="sum",
                                                         initializer=ec.Zeros())) for t in range(8)}
    emb = ec.Embedding(features, opt)
    t1 = time.perf_counter()
    batch = {f"f{t}": rng.integers(0, 250_000, (2048, 20)) for t in range(8)}
    acts, ctx = emb(batch)
    t2 = time.perf_counter()
    emb.apply_gradients({k: np.ones_like(v) for k, v in acts.items()}, ctx)
    t3 = time.perf_counter()
    kernel = fused_update_kernel(opt.compiled(64), dim=64)
    print(json.dumps({"import_s": import_s, "build_s": t1 - t0, "first_lookup_s": t2 - t1,
                      "first_apply_s": t3 - t2, "kernel_cache_hits": sum(kernel.stats.cache_hits.values()),
                      "path": opt.explain(64).split(" runs ", 1)[1].split(":")[0]}))
''')

OPTIMIZERS = ("Adagrad (built-in)", "CustomOptimizer: TensorFlow's custom Adagrad",
              "CustomOptimizer: row-wise Adagrad with np.mean")


def measure(optimizer: str, cache_root: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache_root, "numba"),
               EMBEDCORE_CACHE_DIR=os.path.join(cache_root, "embedcore"))
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", WORKER, optimizer], env=env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="cold + warm pairs per optimizer (medians reported)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = {}
    print(f"{'optimizer':50s} {'run':5s} {'build s':>8s} {'lookup s':>9s} {'apply s':>8s} {'total s':>8s}  path")
    for optimizer in OPTIMIZERS:
        rows = {"cold": [], "warm": []}
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as root:
                rows["cold"].append(measure(optimizer, root))
                rows["warm"].append(measure(optimizer, root))
        results[optimizer] = rows
        for kind, runs in rows.items():
            med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in ("build_s", "first_lookup_s",
                                                                           "first_apply_s")}
            total = sum(med.values())
            print(f"{optimizer:50s} {kind:5s} {med['build_s']:8.2f} {med['first_lookup_s']:9.2f} "
                  f"{med['first_apply_s']:8.2f} {total:8.2f}  {runs[0]['path']}; update kernel cache hits "
                  f"{[r['kernel_cache_hits'] for r in runs]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
