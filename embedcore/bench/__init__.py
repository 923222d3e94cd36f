"""Benchmarks of embedcore's training step against its peers (``embedcore bench``).

:mod:`embedcore.bench.harness` runs every available contender (:mod:`embedcore.bench.contenders`) on the
workloads of :mod:`embedcore.bench.workloads`, in one process and alternating rounds, beside the machine
probes of :mod:`embedcore.bench.machine`, and reports with :mod:`embedcore.bench.report`.

This package is what users run (``embedcore bench``); developers' experiments on single engine choices live
in the repository's ``benchmarks/`` scripts (see its README), which configure the engine through
:class:`embedcore.Tuning`, never by patching modules.
"""

from .harness import main

__all__ = ["main"]
