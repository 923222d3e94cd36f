"""The engine's performance choices, in one explicit, frozen object.

Every choice here changes speed only, never a result: tables, slots and activations are bit-identical
whatever the tuning. ``Embedding(..., tuning=Tuning(...))`` (and ``ShardedEmbedding``) take one; the default is
what embedcore ships. Benchmarks compare variants by passing different tunings, never by patching modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

__all__ = ["Tuning", "DEFAULT_TUNING", "PhaseTimer"]

PhaseTimer = Callable[[str, float], None]
"""``timer(phase, seconds)``: called after each timed phase of a lookup or update (see :class:`Tuning`)."""


@dataclass(frozen=True)
class Tuning:
    """How the engine lays out, groups and updates a batch.

    Attributes:
        row_type_limit: physical tables with fewer rows than this carry their rows as int32 (half the bytes
            to write, sort and gather by), else int64.
        unit_gain_payloads: batches whose gains are all 1 (no weights, ``sum`` tables, sequence features)
            carry activation rows alone instead of (activation row, gain) words.
        narrow_hash_types: the hash grouping keys in the rows' type and numbers distinct rows as uint16 where
            a block allows, instead of int64 keys and int32 ids.
        sum_by_blocks: stacked tables' gradients are summed block by block as the batch is walked (hashing
            each block's rows), instead of grouping occurrences by row with a sort.
        parallel_layout_min: pooled features of at least this many ids are laid out by all threads.
        stream_activations_min_bytes: a lookup whose activations take at least this many bytes writes them
            past the caches (non-temporal stores, rows of whole cache lines): they would leave the caches
            before the model reads them, and a normal store first reads every line it writes. ``None``:
            never.
        phase_timer: called as ``phase_timer(phase, seconds)`` after each phase of a step (layout, gather,
            gradient check, grouping, update; for dynamic tables also their keys' plan and commit), for
            profiling; ``None`` times nothing.
    """

    row_type_limit: int = 2 ** 31
    unit_gain_payloads: bool = True
    narrow_hash_types: bool = True
    sum_by_blocks: bool = True
    parallel_layout_min: int = 1 << 18
    stream_activations_min_bytes: int | None = 32 << 20
    phase_timer: PhaseTimer | None = field(default=None, compare=False)

    def streams(self, activation_bytes: int) -> bool:
        """Whether a lookup writing ``activation_bytes`` of activations writes them past the caches."""
        limit = self.stream_activations_min_bytes
        return limit is not None and activation_bytes >= limit

    def replace(self, **changes) -> "Tuning":
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


DEFAULT_TUNING = Tuning()
