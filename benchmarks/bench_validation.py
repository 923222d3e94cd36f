"""Per-feature cost of checking a batch: ``inputs.to_feature_batch`` on one Ragged feature.

Run from the repository root::

    python benchmarks/bench_validation.py [--sizes 200,4000,40960]

Every lookup checks each feature's ids and row_splits before anything reads the table, so a model with
hundreds of features pays this once per feature and step. Times: best of 5 repeats of 2,000 calls, one
thread, the row_splits checked by the one-pass jitted ``kernels.occurrences.splits_are_valid``.
Dropped, as it is no longer an option (results in git history): the comparison with NumPy's separate checks.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numpy as np

from embedcore import inputs


def per_call_us(feature, vocabulary_size):
    def call():
        inputs.to_feature_batch(feature, None, "f", vocabulary_size)
    call()
    return min(timeit.repeat(call, number=2000, repeat=5)) / 2000 * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200,4000,40960", help="ids per feature, bags of 20 (multiples of 20)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    for n in (int(x) for x in args.sizes.split(",")):
        feature = inputs.Ragged(rng.integers(0, 250_000, n), np.arange(0, n + 1, 20))
        print(f"{n:>7,} ids: to_feature_batch {per_call_us(feature, 250_000):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
