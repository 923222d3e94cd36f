"""Settings for the whole test session."""

import os

# The compilation progress lines (embedcore/compile_progress.py) would interleave with pytest's output and with
# the stderr that tests read from processes they start; the reporter's own tests turn them on.
os.environ.setdefault("EMBEDCORE_PROGRESS", "0")
# OpenMP workers (Numba's, torch's) sleep as soon as a parallel region ends instead of spinning for it: the suite
# runs in several worker processes (pytest-xdist, `-n auto`), and one process's spinning threads took the cores
# that the other's needed (a third of the machine's time went to the kernel's scheduler). Tests check results,
# not speed; the benchmarks set their own policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the suite's default, pyproject.toml): one worker per core, at most four. Most of a fresh
    run's time is Numba compiling on one thread, so the workers divide it; each worker imports TensorFlow,
    torch and JAX (~1-2 GB), and the MPI tests start up to four ranks of their own, so more workers than four
    would mostly wait on memory and on each other."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))
