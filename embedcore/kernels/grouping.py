"""One owner for how a physical table's batch is grouped by row before its update.

A batch's occurrences reach the update kernel grouped by physical row (CSR ``uniq``, ``ptr`` and the
payloads in grouped order, :func:`embedcore.kernels.dedup.group_rows`), or, for a stacked table's batch
of blocks with disjoint row ranges, already summed (:func:`embedcore.kernels.dedup.sum_blocks`: one
"occurrence" per distinct row, gain 1, pointing at its row of sums). Both give the update bit-identical
gradient sums; which one runs is speed only, and is decided here:

1. stacked tables (and ``Tuning.sum_by_blocks``), several threads, blocks even enough to share out:
   sum block by block, hashing each block's rows;
2. else (or when a block had more distinct rows than its hash table takes): group, block by block where
   the blocks allow, else by the global radix sort.

After a call in which some block had to be sorted instead of hashed, the next ``RETRY_AFTER`` calls sort
outright (a training loop's batches are alike, so the next ones would likely fail the same way); the
:class:`Grouper` keeps that count, one per physical table.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from ..tuning import DEFAULT_TUNING, Tuning
from . import dedup

__all__ = ["Grouper", "Grouped", "RETRY_AFTER"]

RETRY_AFTER = dedup.RETRY_AFTER


class Grouped(NamedTuple):
    """A batch as the update kernel takes it: the gradient of ``uniq[u]`` is the sum, over
    ``k in ptr[u]:ptr[u + 1]``, of each payload ``packed[k]``'s gain times its row of ``d_act``."""

    uniq: np.ndarray    # int64 distinct physical rows, ascending
    ptr: np.ndarray     # int64 CSR offsets into ``packed``, len(uniq) + 1
    packed: np.ndarray  # payloads in grouped order: int64 packed words, or int32 rows of ``d_act`` (gain 1)
    d_act: np.ndarray   # [rows, dim] gradient rows the payloads refer to: float32 or 16-bit as given, float32
                        # sums when summed


class Grouper:
    """The block-or-sort policy of one physical table, and its retry counter.

    Args:
        tuning: the engine's :class:`~embedcore.tuning.Tuning` (``sum_by_blocks``, ``narrow_hash_types``).
        stacked: whether the physical table stacks several tables (only then do its batches come in
            several blocks of disjoint row ranges).
    """

    def __init__(self, tuning: Tuning = DEFAULT_TUNING, stacked: bool = False):
        self.tuning = tuning
        self.stacked = bool(stacked)
        self._sorts_left = 0  # calls that sort outright before blocks are tried again

    @property
    def sums_by_blocks(self) -> bool:
        """Whether batches are likely summed block by block, which hands the update kernel int32
        activation rows (gain 1) whatever the batch's gains: pass it on to ``compile_for(unit_gains=...)``."""
        return self.stacked and self.tuning.sum_by_blocks and numba.get_num_threads() > 1

    def payload_is_activation_rows(self, gains_are_one: bool) -> bool:
        """Whether the update kernel will mostly see int32 activation rows (else packed int64 words), for a
        table whose batches without weights have every gain 1 when ``gains_are_one``."""
        return (gains_are_one and self.tuning.unit_gain_payloads) or self.sums_by_blocks

    @property
    def sorts_left(self) -> int:
        """How many calls will still sort outright after a block could not be hashed (0: blocks are tried)."""
        return self._sorts_left

    def group(self, table_batch, n_rows: int, workspace, d_act: np.ndarray) -> Grouped:
        """``table_batch`` (an :class:`embedcore.inputs.TableBatch` of a table of ``n_rows`` rows) grouped
        for the update, with scratch from ``workspace``; ``d_act`` the ``[n_out, dim]`` gradients of its
        activation rows (float32, float16 or bfloat16). Raises ValueError for a malformed batch, before
        anything is summed."""
        tb = table_batch
        if self.tuning.sum_by_blocks and self.stacked and self._sorts_left == 0:
            summed = dedup.sum_blocks(tb.rows, n_rows, tb.packed, workspace, tb.blocks, tb.out_ptr, d_act,
                                      self.tuning.narrow_hash_types)
            if summed is not None:  # one occurrence per distinct row, gain 1, pointing at its sums
                uniq, ptr, index, sums = summed
                return Grouped(uniq, ptr, index, sums)
        rows, packed, blocks, out_ptr = dedup.checked_batch(tb.rows, tb.packed, tb.blocks, tb.out_ptr)
        if blocks is not None and self._sorts_left > 0:
            self._sorts_left -= 1
        elif dedup.blocks_worth_it(blocks, rows.shape[0], numba.get_num_threads()):
            uniq, ptr, grouped, n_sorted = dedup.group_by_blocks(rows, n_rows, packed, blocks, workspace, out_ptr,
                                                                 self.tuning.narrow_hash_types)
            self._sorts_left = RETRY_AFTER if n_sorted else 0
            return Grouped(uniq, ptr, grouped, d_act)
        uniq, ptr, grouped = dedup.group_sorted(rows, n_rows, packed, workspace, out_ptr)
        return Grouped(uniq, ptr, grouped, d_act)
