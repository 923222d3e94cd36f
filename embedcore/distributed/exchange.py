"""Collective exchanges with deadlines: sizes first, then the data, never a fixed capacity.

Every exchange is an MPI all-to-all-v: a process sends ``counts[k]`` rows of its (destination-sorted)
buffer to rank ``k``. The counts are exchanged first, so receive buffers are sized exactly and no id is
ever dropped. Each collective is non-blocking and polled until a deadline: when a peer has died or is stuck,
the others raise :class:`DistributedError` within ``timeout`` seconds instead of hanging forever.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["DistributedError", "Exchanger"]


class DistributedError(RuntimeError):
    """A collective step failed on some rank, or a peer did not answer in time; the engine is unusable."""


def _exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    out = np.zeros_like(counts)
    np.cumsum(counts[:-1], out=out[1:])
    return out


class Exchanger:
    """All-to-all exchanges and agreement on errors over one communicator."""

    def __init__(self, comm, timeout: float):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self.broken = None

    def _wait(self, request, what: str) -> None:
        # MPI progresses an exchange only while some rank is inside an MPI call: poll without sleeping (only
        # yielding the core) for the first 50 ms, then back off to at most 1 ms between polls.
        start = time.monotonic()
        deadline = start + self.timeout
        pause = 0.0
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                self.broken = (f"rank {self.rank}: {what} did not complete within {self.timeout:g} s; a peer "
                               f"process has died or stopped taking part")
                raise DistributedError(self.broken)
            if now - start > 0.05:
                pause = min(max(pause * 2, 1e-5), 1e-3)
            time.sleep(pause)

    def check_usable(self) -> None:
        if self.broken:
            raise DistributedError(f"this engine is unusable after an earlier failure: {self.broken}")

    def counts(self, send_counts: np.ndarray, what: str) -> np.ndarray:
        """Exchange per-destination counts: returns how many rows each rank will send here."""
        send = np.ascontiguousarray(send_counts, np.int64)
        recv = np.empty(self.world, np.int64)
        self._wait(self.comm.Ialltoall([send, self.MPI.INT64_T], [recv, self.MPI.INT64_T]), what)
        return recv

    def rows(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, what: str) -> np.ndarray:
        """Send ``send_counts[k]`` rows of ``send`` (destination-sorted) to each rank ``k``; receive theirs."""
        send = np.ascontiguousarray(send)
        row_bytes = send.dtype.itemsize * int(np.prod(send.shape[1:], dtype=np.int64))
        recv = np.empty((int(recv_counts.sum()),) + send.shape[1:], send.dtype)
        s_bytes, r_bytes = send_counts * row_bytes, recv_counts * row_bytes
        if max(int(s_bytes.sum()), int(r_bytes.sum())) >= 2 ** 31:
            raise DistributedError(f"{what}: a message of 2 GiB or more; use smaller batches")
        byte = self.MPI.BYTE
        request = self.comm.Ialltoallv(
            [send.reshape(-1).view(np.uint8), (s_bytes, _exclusive_cumsum(s_bytes)), byte],
            [recv.reshape(-1).view(np.uint8), (r_bytes, _exclusive_cumsum(r_bytes)), byte])
        self._wait(request, what)
        return recv

    def agree(self, error: str | None, what: str) -> None:
        """Raise on every rank if ``error`` is set on any, naming the ranks and their messages."""
        flags = np.empty(self.world, np.int64)
        mine = np.array([0 if error is None else len(error.encode("utf-8")) + 1], np.int64)
        self._wait(self.comm.Iallgather([mine, self.MPI.INT64_T], [flags, self.MPI.INT64_T]), what)
        if not flags.any():
            return
        size = int(flags.max())
        text = np.zeros(size, np.uint8)
        if error is not None:
            encoded = np.frombuffer(error.encode("utf-8"), np.uint8)
            text[:encoded.size] = encoded
        everyone = np.empty((self.world, size), np.uint8)
        self._wait(self.comm.Iallgather([text, self.MPI.BYTE], [everyone, self.MPI.BYTE]), what)
        nul = b"\x00"
        messages = [f"rank {k}: " + bytes(everyone[k]).rstrip(nul).decode("utf-8")
                    for k in range(self.world) if flags[k]]
        raise DistributedError(f"{what} was refused on {len(messages)} of {self.world} ranks (nothing changed "
                               f"on any rank): " + "; ".join(messages))

    def same_everywhere(self, text: str, what: str) -> None:
        """Raise on every rank unless ``text`` is identical on all of them, naming the ranks that differ."""
        import hashlib
        digest = np.frombuffer(hashlib.sha256(text.encode("utf-8")).digest(), np.uint8).copy()
        everyone = np.empty((self.world, digest.size), np.uint8)
        self._wait(self.comm.Iallgather([digest, self.MPI.BYTE], [everyone, self.MPI.BYTE]), what)
        differ = [k for k in range(self.world) if not np.array_equal(everyone[k], everyone[0])]
        if differ:
            raise DistributedError(f"{what} differs between ranks: ranks {differ} disagree with rank 0")
