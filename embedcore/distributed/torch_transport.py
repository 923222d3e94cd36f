"""The ``torch.distributed`` transport of :class:`~embedcore.distributed.exchange.Exchanger` (gloo on CPU).

A :class:`ShardedEmbedding` built with ``comm=process_group`` (a ``torch.distributed`` ``ProcessGroup``, e.g.
``torch.distributed.group.WORLD`` after ``init_process_group("gloo")`` under ``torchrun``) runs exactly as
over MPI: same sharding rule, routing, kernels, agreement on errors and checkpoints; only the five raw
collectives below go through torch. Each starts an asynchronous torch collective (``async_op=True``) and
returns a request that :class:`Exchanger` polls until its own deadline, so a stuck peer makes the others
raise after ``timeout`` seconds whatever the group's own timeout (a peer that dies closes its connections,
which fails the collective at once). Everything travels as bytes over ``all_to_all_single`` (any dtype,
sizes per peer) and ``all_reduce(MAX)``: the operations gloo supports for every size pattern.

torch is imported only when this module is: :func:`~embedcore.distributed.exchange.transport_for` imports
it only for an object that is a ``torch.distributed.ProcessGroup`` already.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["TorchTransport"]


class _Request:
    """One asynchronous torch collective; ``Test()`` is true once it completed (raising if it failed)."""

    def __init__(self, work, keep):
        self.work, self.keep = work, keep  # keep: the tensors the collective reads and writes

    def Test(self) -> bool:  # noqa: N802 - the name MPI requests have
        if self.work is None:
            return True
        if not self.work.is_completed():
            return False
        work, self.work = self.work, None
        work.wait()  # raises if the collective failed
        self.keep = None
        return True


def _bytes_in(array: np.ndarray) -> torch.Tensor:
    """``array``'s bytes as a uint8 tensor to send (the same memory when it is writable and contiguous)."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if not flat.flags.writeable:
        flat = flat.copy()
    return torch.from_numpy(flat)


def _bytes_out(array: np.ndarray) -> torch.Tensor:
    """The memory of the contiguous ``array`` as a uint8 tensor to receive into."""
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError("a receive buffer must be a writable contiguous array")
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


class TorchTransport:
    """The raw collectives of one ``torch.distributed`` process group (see the module docstring)."""

    name = "torch.distributed"
    large_counts = True
    max_elements = 2 ** 62

    def __init__(self, group):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                               "('gloo') first (torchrun sets the environment it reads)")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process group it was given")
        self.backend = str(dist.get_backend(group))
        if "gloo" not in self.backend:  # "gloo", or "cpu:gloo,cuda:nccl"
            raise ValueError(f"embedcore exchanges CPU tensors: its process group needs the gloo backend, this one "
                             f"is '{self.backend}'; pass dist.new_group(backend='gloo') (every rank calls it)")

    def _alltoall_bytes(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits):
        work = dist.all_to_all_single(out, inp, [int(x) for x in out_splits], [int(x) for x in in_splits],
                                      group=self.group, async_op=True)
        return _Request(work, (out, inp))

    def allreduce_max(self, send: np.ndarray, recv: np.ndarray):
        recv[...] = send
        tensor = torch.from_numpy(recv)
        return _Request(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True), tensor)

    def alltoallv(self, send, send_counts, recv, recv_counts):
        size = send.dtype.itemsize
        return self._alltoall_bytes(_bytes_out(recv), _bytes_in(send), np.asarray(recv_counts) * size,
                                    np.asarray(send_counts) * size)

    def allgatherv(self, send, recv, counts):
        size = send.dtype.itemsize
        data = np.ascontiguousarray(send).reshape(-1).view(np.uint8)
        return self._alltoall_bytes(_bytes_out(recv), torch.from_numpy(np.tile(data, self.world)),
                                    np.asarray(counts) * size, [data.shape[0]] * self.world)

    def gatherv(self, send, recv, counts, root):
        size = send.dtype.itemsize
        nbytes = send.size * size
        to = [nbytes if k == root else 0 for k in range(self.world)]
        if self.rank != root:  # receives nothing (what ``recv`` holds there is not touched)
            return self._alltoall_bytes(torch.zeros(0, dtype=torch.uint8), _bytes_in(send), [0] * self.world, to)
        return self._alltoall_bytes(_bytes_out(recv), _bytes_in(send), np.asarray(counts) * size, to)

    def bcast(self, buf, root):
        data = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        n = data.shape[0]
        frm = [n if k == root else 0 for k in range(self.world)]
        if self.rank == root:
            out = np.empty(n, np.uint8)
            request = self._alltoall_bytes(torch.from_numpy(out), torch.from_numpy(np.tile(data, self.world)),
                                           frm, [n] * self.world)
            return request  # the root's own buffer already holds the data
        return self._alltoall_bytes(_bytes_out(buf), torch.zeros(0, dtype=torch.uint8), frm, [0] * self.world)
