"""Collectives with deadlines: sizes first, then the data, never a fixed capacity; errors agreed everywhere.

One communication layer, two transports: :class:`MPITransport` (an ``mpi4py`` communicator) and
:class:`~embedcore.distributed.torch_transport.TorchTransport` (a ``torch.distributed`` process group, gloo
on CPU). A transport only starts five non-blocking collectives (max all-reduce, all-to-all-v, all-gather-v,
gather-v, broadcast) and hands back a request; :class:`Exchanger` does everything else the same way over
either: deadlines, sizes, agreement on errors.

Every collective here is non-blocking and polled until a deadline, so when a peer has died or is stuck the
others raise :class:`DistributedError` within ``timeout`` seconds instead of hanging forever; after that the
exchanger is unusable (the communicator holds an unfinished collective). Every data exchange is an
all-to-all-v whose per-peer sizes are known to both sides beforehand (a count exchange, or the sizes of the
lookup a gradient belongs to), so receive buffers are sized exactly and nothing is ever dropped.

Agreement: a rank that cannot take part in a step (bad input, a failed write) still enters the same
collectives as the others, carrying its error; then every rank raises, naming each failing rank and its
message, and no rank is left waiting inside an exchange.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time

import numpy as np

__all__ = ["DistributedError", "Refused", "Exchanger", "MPITransport", "transport_for", "describe_error"]


class DistributedError(RuntimeError):
    """A collective step failed on some rank, or a peer did not answer in time."""


class Refused(DistributedError):
    """Some rank reported an error in an agreement (every rank raises this, naming the ranks and errors)."""


def describe_error(e: BaseException) -> str:
    """The text another rank sees for an exception raised here."""
    from ..inputs import InputError
    from ..checkpoint import CheckpointError
    return str(e) if isinstance(e, (InputError, CheckpointError)) else f"{type(e).__name__}: {e}"


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def displacements(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums: where each peer's part starts."""
    out = np.zeros(counts.shape[0], np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


class MPITransport:
    """The MPI transport: non-blocking collectives of an ``mpi4py`` communicator.

    Every method starts one collective and returns its request (``Test()`` is true once it has completed);
    :class:`Exchanger` polls it until its deadline. ``large_counts``: the MPI library is MPI-4 (mpi4py then
    passes counts of 2^31 elements or more through the ``MPI_*_c`` routines); without it one message may
    hold at most ``max_elements`` elements.
    """

    name = "MPI"

    def __init__(self, comm):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.large_counts = MPI.Get_version() >= (4, 0)
        self.max_elements = 2 ** 31 - 1

    def _type(self, array: np.ndarray):
        return {np.dtype(np.int64): self.MPI.INT64_T, np.dtype(np.float32): self.MPI.FLOAT,
                np.dtype(np.uint8): self.MPI.BYTE, np.dtype(np.uint16): self.MPI.UINT16_T}[array.dtype]

    def allreduce_max(self, send: np.ndarray, recv: np.ndarray):
        return self.comm.Iallreduce(send, recv, op=self.MPI.MAX)

    def alltoallv(self, send, send_counts, recv, recv_counts):
        t = self._type(send)
        return self.comm.Ialltoallv([send, (send_counts, displacements(send_counts)), t],
                                    [recv, (recv_counts, displacements(recv_counts)), t])

    def allgatherv(self, send, recv, counts):
        t = self._type(send)
        return self.comm.Iallgatherv([send, t], [recv, (counts, displacements(counts)), t])

    def gatherv(self, send, recv, counts, root):
        t = self._type(send)
        spec = [recv, (counts, displacements(np.asarray(counts, np.int64))), t] if self.rank == root else None
        return self.comm.Igatherv([send, t], spec, root=root)

    def bcast(self, buf, root):
        return self.comm.Ibcast([buf, self._type(buf)], root=root)


def transport_for(comm):
    """The transport over ``comm``: an ``mpi4py`` communicator, a ``torch.distributed`` process group, or a
    transport already (anything with the methods of :class:`MPITransport`)."""
    if hasattr(comm, "alltoallv") and hasattr(comm, "allreduce_max"):
        return comm
    if callable(getattr(comm, "Get_rank", None)) and callable(getattr(comm, "Ialltoallv", None)):
        return MPITransport(comm)
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and isinstance(comm, torch_dist.ProcessGroup):
        from .torch_transport import TorchTransport
        return TorchTransport(comm)
    raise TypeError(f"a ShardedEmbedding communicates over an mpi4py communicator or a torch.distributed "
                    f"ProcessGroup, got {type(comm).__name__}")


class Exchanger:
    """All-to-all exchanges, small gathers and agreement on errors over one transport.

    ``comm``: an ``mpi4py`` communicator (:class:`MPITransport`), a ``torch.distributed`` process group
    (:class:`~embedcore.distributed.torch_transport.TorchTransport`), or a transport. Whatever the transport,
    every collective is polled here until ``timeout``, and errors are agreed here, in the same collectives.
    Without large counts (MPI before MPI-4) one message may hold at most ``max_elements`` elements, which
    :meth:`check_sizes` verifies collectively before the data move.
    """

    def __init__(self, comm, timeout: float):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or \
                timeout <= 0:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.transport = t = transport_for(comm)
        self.comm = comm
        self.rank, self.world = t.rank, t.world
        self.timeout = float(timeout)
        self.broken = None
        self.large_counts = t.large_counts
        self.max_elements = t.max_elements

    # -- waiting -----------------------------------------------------------------------------------------
    def _wait(self, request, what: str) -> None:
        # MPI progresses an exchange only while some rank is inside an MPI call: poll, only yielding the core
        # between polls, for the first 50 ms, then back off to sleeps of at most 1 ms. Not time.sleep(0):
        # it sleeps for the timer slack (~50 us on Linux), which made a 350 KB all-to-all-v 40x slower.
        # (torch.distributed's gloo progresses on its own threads; polling it the same way costs nothing.)
        start = time.monotonic()
        deadline = start + self.timeout
        pause = 0.0
        while True:
            try:
                if request.Test():
                    return
            except Exception as e:  # the transport's own failure (MPI error, gloo connection closed, ...)
                self.broken = f"rank {self.rank}: {what} failed in the transport: {type(e).__name__}: {e}"
                raise DistributedError(self.broken) from e
            now = time.monotonic()
            if now > deadline:
                self.broken = (f"rank {self.rank}: {what} did not complete within {self.timeout:g} s; a peer "
                               f"process has died or stopped taking part")
                raise DistributedError(self.broken)
            if now - start > 0.05:
                pause = min(max(pause * 2, 1e-5), 1e-3)
                time.sleep(pause)
            else:
                _yield()

    def check_usable(self) -> None:
        if self.broken:
            raise DistributedError(f"this engine is unusable after an earlier failure: {self.broken}")

    # -- agreement ---------------------------------------------------------------------------------------
    def agree(self, error: str | None, what: str, tag: int = 0, tag_text=None, outcome: str | None = None) -> None:
        """Raise on every rank if ``error`` is set on any, or if ``tag`` (>= 0) differs between ranks.

        One 24-byte all-reduce when all is well. When the tags differ, every rank's message is
        ``tag_text()`` (what its tag stands for). ``outcome``: what the error means, if not that ``what`` was
        refused with nothing changed.
        """
        mine = np.array([0 if error is None else 1, tag, -tag], np.int64)
        out = np.empty(3, np.int64)
        self._wait(self.transport.allreduce_max(mine, out), what)
        if out[0]:
            self._refuse(error, what, outcome)
        if out[1] != -out[2]:
            texts = self.allgather_bytes(str(tag_text() if tag_text else tag).encode("utf-8"), what)
            raise DistributedError(f"{what} was refused on every rank (nothing changed on any rank): the ranks "
                                   f"disagree: " + "; ".join(f"rank {k}: {t.decode('utf-8')}"
                                                             for k, t in enumerate(texts)))

    def _refuse(self, error: str | None, what: str, outcome: str | None = None):
        """Every rank calls this once it knows some rank failed: raises, naming each failing rank."""
        texts = self.allgather_bytes(b"" if error is None else b"\x01" + error.encode("utf-8"), what)
        messages = [f"rank {k}: " + t[1:].decode("utf-8") for k, t in enumerate(texts) if t]
        raise Refused(f"{what} {outcome or 'was refused'} on {len(messages)} of {self.world} ranks" +
                               ("" if outcome else " (nothing changed on any rank)") + ": " + "; ".join(messages))

    def counts(self, send_counts: np.ndarray | None, error: str | None, what: str) -> np.ndarray:
        """Exchange per-peer counts, and agree on errors in the same collective.

        Returns how many elements each rank will send here. A rank with an ``error`` sends -1 to every
        peer instead of counts; then every rank raises (see :meth:`agree`).
        """
        send = np.full(self.world, -1, np.int64)
        if error is None:
            send[:] = send_counts
        recv = np.empty(self.world, np.int64)
        ones = np.ones(self.world, np.int64)
        self._wait(self.transport.alltoallv(send, ones, recv, ones), what)
        if (recv < 0).any():
            self._refuse(error, what)
        return recv

    def check_sizes(self, elements: int, what: str) -> None:
        """Without MPI-4 large counts: raise on every rank if any rank's message would exceed ``max_elements``."""
        if self.large_counts:
            return
        mine = np.array([elements], np.int64)
        out = np.empty(1, np.int64)
        self._wait(self.transport.allreduce_max(mine, out), what)
        if out[0] > self.max_elements:
            raise DistributedError(f"{what}: some rank's message would hold {int(out[0]):,} elements, more than "
                                   f"this MPI library can address ({self.max_elements:,}; it lacks MPI-4 large "
                                   f"counts); nothing changed on any rank: use smaller batches")

    def same_everywhere(self, text: str, what: str) -> None:
        """Raise on every rank unless ``text`` is identical on all of them, naming the ranks that differ."""
        digest = np.frombuffer(hashlib.sha256(text.encode("utf-8")).digest(), np.uint8).copy()
        everyone = np.empty((self.world, digest.size), np.uint8)
        counts = np.full(self.world, digest.size, np.int64)
        self._wait(self.transport.allgatherv(digest, everyone.reshape(-1), counts), what)
        differ = [k for k in range(self.world) if not np.array_equal(everyone[k], everyone[0])]
        if differ:
            raise DistributedError(f"{what} differs between ranks: ranks {differ} disagree with rank 0")

    # -- data --------------------------------------------------------------------------------------------
    def alltoallv(self, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts, what: str) -> None:
        """Send ``send_counts[k]`` elements of the flat ``send`` (peer ``k``'s part after peer ``k - 1``'s)
        to every rank ``k``, and receive ``recv_counts[k]`` elements from each into ``recv`` likewise."""
        self._wait(self.transport.alltoallv(send, send_counts, recv, recv_counts), what)

    def allgather_bytes(self, data: bytes, what: str) -> list:
        """Every rank's ``data``, in rank order, on every rank (sizes first)."""
        sizes = np.empty(self.world, np.int64)
        self._wait(self.transport.allgatherv(np.array([len(data)], np.int64), sizes,
                                             np.ones(self.world, np.int64)), what)
        out = np.empty(int(sizes.sum()), np.uint8)
        self._wait(self.transport.allgatherv(np.frombuffer(data, np.uint8), out, sizes), what)
        starts = displacements(sizes)
        return [out[s:s + n].tobytes() for s, n in zip(starts, sizes)]

    def gather_bytes(self, data: bytes, root: int, what: str):
        """Every rank's ``data`` in rank order on ``root`` (``None`` elsewhere)."""
        sizes = np.zeros(self.world, np.int64)
        self._wait(self.transport.gatherv(np.array([len(data)], np.int64), sizes, np.ones(self.world, np.int64),
                                          root), what)
        out = np.empty(int(sizes.sum()) if self.rank == root else 0, np.uint8)
        self.gatherv(np.frombuffer(data, np.uint8), out, sizes, root, what)
        if self.rank != root:
            return None
        return [out[s:s + n].tobytes() for s, n in zip(displacements(sizes), sizes)]

    def gatherv(self, send: np.ndarray, recv: np.ndarray, counts, root: int, what: str) -> None:
        """``counts[k]`` elements from every rank ``k`` into ``recv`` on ``root``, in rank order (``counts``
        is read on ``root`` only)."""
        self._wait(self.transport.gatherv(send.reshape(-1), recv, np.asarray(counts, np.int64), root), what)

    def bcast_bytes(self, data: bytes | None, root: int, what: str) -> bytes:
        """``root``'s ``data`` on every rank."""
        size = np.array([len(data) if self.rank == root else 0], np.int64)
        self._wait(self.transport.bcast(size, root), what)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root else np.empty(int(size[0]), np.uint8)
        self._wait(self.transport.bcast(buf, root), what)
        return buf.tobytes()
