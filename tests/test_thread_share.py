"""Numba's threads sized to a process's share of the cores; Numba leaving torch's OpenMP setting alone.

Each case runs in a fresh process: ``NUMBA_NUM_THREADS`` is read when Numba is imported, and Numba's
threading layer starts once per process.
"""

import json
import os
import subprocess
import sys

import pytest

from embedcore.thread_share import local_processes_from_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import json, os, sys
import numba, numpy as np
torch = None
if os.environ.get("PROBE_TORCH") == "1":
    import torch
from embedcore.thread_share import share_cores, start_numba_threads
said = []
choice = share_cores(say=said.append)
again = share_cores(say=said.append)

@numba.njit(parallel=True)
def thread_ids(n):
    out = np.empty(n, np.int64)
    for i in numba.prange(n):
        out[i] = numba.get_thread_id()
    return out

print(json.dumps({"threads": choice.threads, "reason": choice.reason, "again": list(again), "said": said,
                  "numba": numba.get_num_threads(), "used": len(np.unique(thread_ids(1 << 16))),
                  "torch": None if torch is None else torch.get_num_threads(),
                  "cores": len(os.sched_getaffinity(0))}))
"""


def probe(**env):
    full = {k: v for k, v in os.environ.items()
            if k not in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "NUMBA_NUM_THREADS")}
    full.update({k: v for k, v in env.items() if v is not None})
    full.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def cores():
    return len(os.sched_getaffinity(0))


def test_ranks_sharing_the_machine_get_their_share_and_say_so():
    result = probe(LOCAL_WORLD_SIZE="2", NUMBA_NUM_THREADS=str(max(2, cores())))
    # NUMBA_NUM_THREADS given: the user's choice wins, nothing is said
    assert result["threads"] == max(2, cores()) and "user's choice" in result["reason"] and result["said"] == []
    result = probe(LOCAL_WORLD_SIZE="2")
    share = max(1, result["cores"] // 2)
    assert result["threads"] == result["numba"] == share == result["used"]
    assert "LOCAL_WORLD_SIZE=2" in result["reason"]
    assert len(result["said"]) == 1 and f"{share} Numba thread" in result["said"][0]  # said once per process
    assert result["again"][0] == share


def test_one_process_keeps_numbas_default():
    result = probe()
    assert result["threads"] == result["numba"] == result["cores"] and result["said"] == []


@pytest.mark.skipif(cores() < 2, reason="needs 2 cores to tell 1 thread from many")
def test_numba_leaves_torchs_openmp_threads_alone():
    pytest.importorskip("torch")
    # torchrun sets OMP_NUM_THREADS=1 for every rank; Numba's OpenMP layer used to reset it to all cores
    result = probe(OMP_NUM_THREADS="1", PROBE_TORCH="1")
    assert result["torch"] == 1
    assert result["used"] == result["numba"] == result["cores"]  # Numba's own regions still use every core


def test_launcher_environment_is_read_in_order_and_checked():
    assert local_processes_from_env({}) is None
    assert local_processes_from_env({"LOCAL_WORLD_SIZE": "4", "MPI_LOCALNRANKS": "2"}) == (4, "LOCAL_WORLD_SIZE")
    assert local_processes_from_env({"MPI_LOCALNRANKS": "3"}) == (3, "MPI_LOCALNRANKS")
    assert local_processes_from_env({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == (2, "OMPI_COMM_WORLD_LOCAL_SIZE")
    assert local_processes_from_env({"LOCAL_WORLD_SIZE": "zero", "MPI_LOCALNRANKS": "0"}) is None


def test_mpi_shared_memory_communicator_counts_this_machines_ranks():
    mpi = pytest.importorskip("mpi4py.MPI")
    from embedcore.thread_share import mpi_local_processes
    assert mpi_local_processes(mpi.COMM_SELF) == (1, "MPI COMM_TYPE_SHARED")
    assert mpi_local_processes(object()) is None
