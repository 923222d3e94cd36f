"""The machine side of the benchmark: thread settings, allocator, contention, memory, and the two probes.

Probes (the "limits" every contender's bandwidth is divided by), both measured in the benchmark's own run:

* **copy**: a streaming copy between two preallocated float32 arrays of ``copy_mb`` MiB each, with
  ``np.copyto`` (one thread) and with a Numba ``prange`` loop (``threads`` threads); bytes = 2 x size
  (read + write). The limit is the larger of the two medians.
* **gather**: random 256-byte rows (64 float32) read from a table of ``gather_mb`` MiB (far larger than the
  last-level cache), by a Numba ``prange`` loop on ``threads`` threads that reads eight rows at a time and
  sums each eight into one row of a small (cache-resident) output, as sum pooling of bags of 8 does; row ids
  uniform at random, fixed per run; bytes = rows read x 256 (the output is not counted). Eight independent
  reads in flight doubled the figure of a one-row-at-a-time copy loop on the 2-core machine this was
  written on. This is the access pattern of an embedding lookup, and of the read half of a sparse update;
  a contender whose hot rows stay in cache (Zipf ids) can exceed it.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import numpy as np
from numba import njit, prange

__all__ = ["allocator_name", "cpu_snapshot", "others_share", "peak_rss_gb", "rss_gb", "mem_available_gb",
           "Probes", "GATHER_ROW_BYTES"]

GATHER_ROW_BYTES = 256
_GATHER_DIM = GATHER_ROW_BYTES // 4


# ----------------------------------------------------------------------------------------------------------
# Process and machine facts

def allocator_name():
    """(short name, raw LD_PRELOAD); "glibc malloc" when nothing is preloaded."""
    preload = os.environ.get("LD_PRELOAD", "")
    if not preload:
        return "glibc malloc", preload
    low = preload.lower()
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in low:
            return name, preload
    return "LD_PRELOAD=" + preload, preload


def cpu_snapshot():
    """(machine busy CPU-seconds, machine total CPU-seconds, this process's CPU-seconds), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = sum(fields[:8]) - idle
    t = os.times()
    return busy / hz, (busy + idle) / hz, t.user + t.system


def others_share(before, after):
    """Fraction of the machine's CPU time used by *other* processes between two snapshots (None if unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, ((after[0] - before[0]) - (after[2] - before[2])) / (after[1] - before[1]))


def status_kb(key):
    """A ``/proc/self/status`` field (``VmRSS:``, ``VmHWM:``) in kB, or None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_gb():
    """Peak resident set size of this process so far (VmHWM), in GB."""
    kb = status_kb("VmHWM:")
    if kb is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return kb * 1024 / 1e9


def rss_gb():
    kb = status_kb("VmRSS:")
    return None if kb is None else kb * 1024 / 1e9


def mem_available_gb():
    """MemAvailable from /proc/meminfo in GB (None if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------------------------------------
# Probe kernels

@njit(parallel=True, cache=True)
def _copy_parallel(dst, src):
    n = src.shape[0]
    chunk = 1 << 16
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(lo + chunk, n)
        for i in range(lo, hi):
            dst[i] = src[i]


@njit(parallel=True, cache=True)
def _gather_rows(table, ids, out):
    """Read the rows ``table[ids[k]]`` eight at a time (eight independent random reads in flight, as a
    pooling kernel has), summing each group of eight into one row of the small ``out``."""
    n = ids.shape[0] - ids.shape[0] % 8
    m = out.shape[0]
    dim = table.shape[1]
    chunk = 4096
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(lo + chunk, n)
        for k in range(lo, hi, 8):
            o = (k // 8) % m
            r0, r1, r2, r3 = ids[k], ids[k + 1], ids[k + 2], ids[k + 3]
            r4, r5, r6, r7 = ids[k + 4], ids[k + 5], ids[k + 6], ids[k + 7]
            for j in range(dim):
                out[o, j] = (table[r0, j] + table[r1, j] + table[r2, j] + table[r3, j] + table[r4, j] +
                             table[r5, j] + table[r6, j] + table[r7, j])


class Probes:
    """The copy and random-row-gather probes: set up once, measured once per round."""

    def __init__(self, threads: int, copy_mb: int = 256, gather_mb: int = 1024, gather_rows: int = 1 << 20,
                 reps: int = 5, seed: int = 0):
        self.threads, self.reps = threads, reps
        rng = np.random.default_rng(seed)
        n = max(1, copy_mb * (1 << 20) // 4)
        self.src = rng.random(n, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        self.dst[:] = 1.0
        rows = max(1, gather_mb * (1 << 20) // GATHER_ROW_BYTES)
        self.table = np.empty((rows, _GATHER_DIM), np.float32)
        for lo in range(0, rows, 1 << 20):  # fill in blocks: no table-sized temporary
            self.table[lo:lo + (1 << 20)] = rng.random((min(1 << 20, rows - lo), _GATHER_DIM), dtype=np.float32)
        gather_rows = max(8, gather_rows - gather_rows % 8)
        self.ids = rng.integers(0, rows, gather_rows).astype(np.int64)
        self.out = np.empty((min(gather_rows, 4096), _GATHER_DIM), np.float32)  # stays in L1/L2
        self.copy_bytes = 2 * self.src.nbytes
        self.gather_bytes = gather_rows * GATHER_ROW_BYTES
        self.times = {"copy numpy (1 thread)": [], f"copy numba ({threads} threads)": [],
                      f"gather 256 B rows, 8 in flight ({threads} threads)": []}
        t = time.perf_counter()
        _copy_parallel(self.dst, self.src)
        _gather_rows(self.table, self.ids, self.out)
        self.compile_s = time.perf_counter() - t
        self.copy_mb, self.gather_mb, self.gather_rows = copy_mb, gather_mb, gather_rows

    @property
    def nbytes(self):
        return self.src.nbytes + self.dst.nbytes + self.table.nbytes + self.ids.nbytes

    def measure(self):
        """One round: ``reps`` runs of each probe; returns this round's medians in GB/s."""
        names = list(self.times)
        fns = [lambda: np.copyto(self.dst, self.src), lambda: _copy_parallel(self.dst, self.src),
               lambda: _gather_rows(self.table, self.ids, self.out)]
        out = {}
        for name, fn in zip(names, fns):
            mine = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                mine.append(time.perf_counter() - t0)
            self.times[name] += mine
            out[name] = self._gbps(name, statistics.median(mine))
        return out

    def _gbps(self, name, seconds):
        nbytes = self.gather_bytes if name.startswith("gather") else self.copy_bytes
        return nbytes / seconds / 1e9

    def results(self):
        """Per probe: median / min / max GB/s over every run; plus the two limits."""
        res = {}
        for name, ts in self.times.items():
            if not ts:
                continue
            gbps = [self._gbps(name, s) for s in ts]
            res[name] = {"median_gbps": statistics.median(gbps), "min_gbps": min(gbps), "max_gbps": max(gbps),
                         "median_ms": 1e3 * statistics.median(ts), "n": len(ts)}
        copy = [v["median_gbps"] for k, v in res.items() if k.startswith("copy")]
        gather = [v["median_gbps"] for k, v in res.items() if k.startswith("gather")]
        return {"probes": res, "copy_gbps": max(copy) if copy else None,
                "gather_gbps": max(gather) if gather else None,
                "copy_bytes": self.copy_bytes, "gather_bytes": self.gather_bytes,
                "copy_mb": self.copy_mb, "gather_table_mb": self.gather_mb, "gather_rows": self.gather_rows,
                "gather_row_bytes": GATHER_ROW_BYTES}

    def close(self):
        self.src = self.dst = self.table = self.ids = self.out = None
