"""Table initialisation speed: embedcore's random initializers against torch's and NumPy's generators.

Run from the repository root::

    NUMBA_NUM_THREADS=2 python benchmarks/bench_init.py [--values 102000000 --dim 64 --rounds 5 --threads 2]

Every contender fills the same shape, one float32 array ``[values // dim, dim]`` allocated (and its pages
touched) once before the first round, so page faults are not timed. Rounds alternate over the contenders
(each round runs each once); the first round is a warm-up (Numba loading or compiling the kernels) and is
not counted. The figures are the median seconds of the other rounds, and the values filled per second.

* ``embedcore TruncatedNormal``: ``TruncatedNormal(0, 0.05).fill(out, 0, key)``, the call the engine makes
  for every table (the default initializer), ``--threads`` Numba threads;
* ``embedcore RandomUniform``: ``RandomUniform(-0.05, 0.05).fill(out, 0, key)``;
* ``torch normal_`` / ``torch uniform_``: ``t.normal_()`` / ``t.uniform_()`` on a float32 tensor of the same
  shape, ``torch.set_num_threads(--threads)`` (skipped, with a message, when torch is not importable);
* ``numpy standard_normal``: ``Generator.standard_normal(out=..., dtype=np.float32)`` of ``default_rng`` (one
  thread always: for reference).

The engine's ``fill_rows`` also scans the table once for non-finite values after the fill; that scan is not
part of these figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", type=int, default=102_000_000, help="float32 values per fill")
    parser.add_argument("--dim", type=int, default=64, help="columns of the array filled")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=2, help="Numba and torch threads")
    args = parser.parse_args(argv)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))

    import numba
    import numpy as np

    import embedcore as ec
    from embedcore.initializers import stream_key

    numba.set_num_threads(args.threads)
    rows = args.values // args.dim
    out = np.ones((rows, args.dim), np.float32)  # pages touched once, reused by every embedcore/numpy fill
    key = stream_key(0, "bench")
    normal, uniform = ec.TruncatedNormal(0.0, 0.05), ec.RandomUniform(-0.05, 0.05)
    rng = np.random.default_rng(0)
    contenders = {
        "embedcore TruncatedNormal": lambda: normal.fill(out, 0, key),
        "embedcore RandomUniform": lambda: uniform.fill(out, 0, key),
    }
    try:
        import torch
    except ImportError as error:
        print(f"torch not importable ({error}): its contenders are skipped")
    else:
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        tensor = torch.ones(rows, args.dim, dtype=torch.float32)
        contenders["torch normal_"] = lambda: tensor.normal_()
        contenders["torch uniform_"] = lambda: tensor.uniform_()
    contenders["numpy standard_normal (1 thread)"] = lambda: rng.standard_normal(out=out, dtype=np.float32)

    times = {name: [] for name in contenders}
    for round_ in range(args.rounds + 1):
        for name, fill in contenders.items():
            start = time.perf_counter()
            fill()
            elapsed = time.perf_counter() - start
            if round_:
                times[name].append(elapsed)

    print(f"{rows * args.dim:,} float32 values ([{rows:,}, {args.dim}]), {args.threads} threads "
          f"(Numba: {numba.get_num_threads()}), median of {args.rounds} rounds after a warm-up round")
    print(f"{'contender':36s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'Mvalues/s':>10s}")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:36s} {median:9.3f} {min(ts):7.3f} {max(ts):7.3f} {rows * args.dim / median / 1e6:10.0f}")


if __name__ == "__main__":
    main()
