"""Numba's threads sized to this process's share of the cores, and the OpenMP setting Numba must not change.

Two facts about Numba's parallel kernels that matter when several processes share a machine:

* Numba starts ``NUMBA_NUM_THREADS`` threads per process, by default one per core this process may use
  (``os.sched_getaffinity``). ``K`` ranks on ``C`` cores (``torchrun --nproc-per-node K``, ``mpiexec -n K``)
  then run ``K * C`` busy threads on ``C`` cores; every parallel region ends in a join that waits for the
  slowest thread, which may be waiting for a core: measured 30x slower steps with 2 ranks on 2 cores.
  :func:`share_cores` sets the calling thread's Numba thread count to ``max(1, C // K)``, where ``K`` is the
  number of processes of the job on this machine: MPI's shared-memory communicator's size
  (``COMM_TYPE_SHARED``) for an MPI engine, else ``LOCAL_WORLD_SIZE`` (``torchrun``), ``MPI_LOCALNRANKS``
  (MPICH) or ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI) from the environment. It says what it chose, once per
  process, on stderr. A user's choice wins: ``NUMBA_NUM_THREADS`` in the environment, or a thread count set
  with ``numba.set_num_threads`` on this thread before the engine is built, leaves the count as it is.
  ``numba.set_num_threads`` is per calling thread: the count holds for the kernels this thread runs (an
  engine's lookups and updates, and, with torch, the backward of CPU tensors, which runs on the caller).

* Numba's OpenMP threading layer, when it starts, calls ``omp_set_num_threads(NUMBA_NUM_THREADS)`` on the
  starting thread. With torch imported first that is torch's own libgomp, so ``torch.get_num_threads()``
  changed from ``OMP_NUM_THREADS`` (``torchrun`` sets 1) to the core count, making torch's intra-op pool
  compete with Numba's. Numba's regions never rely on that setting (each names its thread count), so
  :func:`start_numba_threads` starts the layer and puts every loaded OpenMP runtime's setting back as it was.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numba

__all__ = ["ThreadChoice", "share_cores", "start_numba_threads", "local_processes_from_env", "mpi_local_processes"]

_ENV_SOURCES = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")
_lock = threading.Lock()
_started = False
_said = False
_ours = threading.local()  # .threads: the count share_cores set on this thread


class ThreadChoice(tuple):
    """``(threads, reason)``: the Numba thread count :func:`share_cores` left on the calling thread, and why."""

    __slots__ = ()

    def __new__(cls, threads: int, reason: str):
        return super().__new__(cls, (threads, reason))

    threads = property(lambda self: self[0])
    reason = property(lambda self: self[1])


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def local_processes_from_env(environ=None) -> tuple[int, str] | None:
    """``(K, variable)``: the number of this job's processes on this machine, as the launcher tells it
    (``LOCAL_WORLD_SIZE`` from ``torchrun``, ``MPI_LOCALNRANKS`` from MPICH, ``OMPI_COMM_WORLD_LOCAL_SIZE``
    from Open MPI); None when no launcher says so (or says something that is not a positive integer)."""
    environ = os.environ if environ is None else environ
    for name in _ENV_SOURCES:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), name
    return None


def mpi_local_processes(comm) -> tuple[int, str] | None:
    """``(K, "MPI COMM_TYPE_SHARED")`` for an mpi4py communicator: how many of its ranks share this machine's
    memory (a collective: every rank of ``comm`` calls it). None for anything else (a torch process group)."""
    split = getattr(comm, "Split_type", None)
    if split is None:
        return None
    from mpi4py import MPI
    local = split(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size(), "MPI COMM_TYPE_SHARED"
    finally:
        local.Free()


def _openmp_runtimes() -> list:
    """The OpenMP runtimes loaded in this process (handles; none is loaded by this call)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    except OSError:  # not Linux: nothing to put back
        return []
    runtimes = []
    for path in sorted(paths):
        if os.path.basename(path).startswith(_OPENMP_NAMES) and ".so" in path:
            try:
                lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LOCAL)
                get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
            except (OSError, AttributeError):
                continue
            get.restype, get.argtypes, put.argtypes = ctypes.c_int, [], [ctypes.c_int]
            runtimes.append((path, get, put))
    return runtimes


def start_numba_threads() -> None:
    """Start Numba's threading layer now, leaving every loaded OpenMP runtime's thread count (on this thread)
    as it was before (see the module docstring). Does nothing after the first call."""
    global _started
    with _lock:
        if _started:
            return
        runtimes = [(get, put, get()) for _, get, put in _openmp_runtimes()]
        numba.get_num_threads()  # starts the layer (a no-op if something started it already)
        for get, put, before in runtimes:
            if get() != before:
                put(before)
        _started = True


def share_cores(local: tuple[int, str] | None = None, *, say=None) -> ThreadChoice:
    """Size the calling thread's Numba threads to this process's share of the cores (module docstring).

    Args:
        local: ``(K, source)``, the processes of this job on this machine and where that came from (e.g.
            :func:`mpi_local_processes`); None reads the launcher's environment (:func:`local_processes_from_env`).
        say: where the one line about the choice goes (default: stderr, once per process).

    Returns:
        :class:`ThreadChoice`: the thread count now in force on this thread and the reason.
    """
    global _said
    start_numba_threads()
    current = numba.get_num_threads()
    if local is None:
        local = local_processes_from_env()
    if local is None or local[0] <= 1:
        return ThreadChoice(current, "one process on this machine")
    processes, source = local
    if "NUMBA_NUM_THREADS" in os.environ:
        return ThreadChoice(current, f"NUMBA_NUM_THREADS={os.environ['NUMBA_NUM_THREADS']} (the user's choice)")
    if current not in (numba.config.NUMBA_NUM_THREADS, getattr(_ours, "threads", None)):
        return ThreadChoice(current, "numba.set_num_threads on this thread (the user's choice)")
    cores = _cores()
    threads = max(1, min(cores // processes, numba.config.NUMBA_NUM_THREADS))
    if threads != current:
        numba.set_num_threads(threads)
    _ours.threads = threads
    reason = (f"{processes} processes share this machine's {cores} cores ({source}={processes}): "
              f"{threads} Numba thread{'s' if threads > 1 else ''} each")
    if not _said:
        _said = True
        line = (f"embedcore: {reason}; set NUMBA_NUM_THREADS (or call numba.set_num_threads before building "
                f"the engine) to choose")
        (say or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
    return ThreadChoice(threads, reason)
