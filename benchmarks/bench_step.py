"""Training-step benchmark of embedcore against FBGEMM, PyTorch, JAX/XLA, TensorFlow and NumPy.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_step.py --help
    PYTHONPATH=. python benchmarks/bench_step.py --out /tmp/bench_out          # full run (minutes)
    PYTHONPATH=. python benchmarks/bench_step.py --quick --out /tmp/bench_q    # smoke run (seconds)

Everything lives in :mod:`embedcore.bench` (see :mod:`embedcore.bench.harness` for the method).
"""

from __future__ import annotations

import os
import sys

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from embedcore.bench.harness import main

if __name__ == "__main__":
    sys.exit(main())
