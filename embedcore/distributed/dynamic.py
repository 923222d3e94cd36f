"""Dynamic tables in a ``ShardedEmbedding``: keys placed on ranks by a hash, each rank a dynamic table.

Placement
    Key ``k`` (its 64-bit pattern; the int64 and uint64 views of the same bits are the same key) lives on rank
    ``owner(k) = mix64(k XOR PLACEMENT_SALT) mod K`` (:func:`key_owners`; ``mix64`` the SplitMix64 finaliser of
    :mod:`embedcore.kernels.random`, ``K`` the world size). It is a pure function of the key: stable across
    processes, runs and versions, the same for every table. The salt keeps it independent of the hash the
    key map itself buckets by (``mix64(k)``), so a rank's keys still spread over all of its buckets.
Capacity
    Each rank holds one :class:`~embedcore.tables.dynamic.DynamicTable` per dynamic table, with the
    table's admission and eviction, of ``capacity // K`` rows, one more on the first ``capacity mod K`` ranks
    (:func:`rank_capacity`: ``ceil(capacity / K)`` or ``floor``, so that the ranks together hold exactly
    ``capacity`` rows and the merged table fits a single-process checkpoint; a table of fewer rows than
    ranks is refused). Its admission sketch counts only the keys it owns (the same hashes on every rank:
    seed and table name).

One lookup (:class:`DynamicShards`), per dynamic table, after the engine's first agreement (bad input on any
rank, e.g. keys of a float dtype, is refused there on every rank):

1. requester: dedup the occurrences the lookup reads (positions a sequence feature drops excluded) into
   unique keys and their occurrence counts; one all-to-all of how many keys each rank sends each peer per
   table, one all-to-all-v of ``(key, count)`` pairs to the owners;
2. owner: run the table's own plan (TTL expiry, admission, eviction, the refusal of a batch with too many
   new keys) on the keys received, each repeated ``count`` times: exactly the occurrences of those keys in
   the ranks' batches together. The ranks agree on the outcome: if any rank refuses, every rank undoes its
   plan (admission counts restored) and raises the same :class:`~.exchange.Refused`, naming the rank and its
   message, and no table changed on any rank (rows TTL expired aside: they were gone already);
3. owner: commit the plan and answer each key's row (an unadmitted key's initial value); requester: combine
   its activations from the rows received with the single-process kernel.

A read-only lookup (``training=False``) routes alike; in step 2 each owner only reads (:meth:`DynamicShards.
read_only`: no TTL removal, admission count, new row, touch or eviction; a key without a live row reads its
initial value), so nothing can be refused there and no table changes on any rank.

``apply_gradients`` sends each unique key's gradient sum back the way its key went; the owner updates the
admitted keys' rows, summing one key's sums in rank order, and drops the unadmitted keys' sums. A context is
refused on every rank (nothing updated) once a later lookup evicted or expired rows of a table on any rank.

K ranks and one process fed the concatenated batches: the initial values (a function of the seed, the
table and the key) and the keys seen are the same, so **while no table evicts to make room** (TTL expiry
is the same either way: it depends only on a key's last-seen step), and while the admission sketches count
exactly (wide enough that every key seen has a counter no other key seen shares; a rank's sketch sees only
its own keys, so its estimate is at most the one process's, and both are exact then), the tables hold the
same keys with the same rows, slots, last-seen steps and counts, and the activations agree: bit for bit
on one rank; with several, up to float32 summation order (one key's gradient sums are summed per rank,
then in rank order), and an activation that mixes admitted and unadmitted keys of one bag is summed in one
pass here (the one process adds the unadmitted part after).
With eviction the per-rank capacity is not the global one, so the keys evicted differ from one process's;
what holds: every rank's table holds at most its :func:`rank_capacity` of keys, all of them its own; a new key
evicts only keys of its own rank (never a key the batch uses); a batch with more new keys than some rank can
take is refused on every rank with nothing changed.

Checkpoints (:mod:`embedcore.distributed.checkpoint`) store a dynamic table as one process does, the ranks'
keys merged, and reshard them K -> M by :func:`key_owners` on load; ``sketch_bases`` keeps the sketches
additive across such moves.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from .. import inputs
from ..engine import UpdateReport, gradient_rows
from ..kernels.aligned import aligned_zeros
from ..kernels.dedup import unique_rows
from ..kernels.random import mix64
from ..kernels.rows import gather_combine, sum_gradients
from ..kernels.workspace import Workspace
from .exchange import displacements
from .kernels import flat_to_rows, occurrence_unique

__all__ = ["PLACEMENT_SALT", "key_owners", "rank_capacity", "rank_config", "DynamicShards", "DynamicRoute"]

PLACEMENT_SALT = np.uint64(0x5DEECE66D1CE4E5B)  # fixed forever: changing it moves every key to another rank


@njit(cache=True)
def _owners(keys, salt, world, out):
    w = np.uint64(world)
    for i in range(keys.shape[0]):
        out[i] = np.int64(mix64(keys[i] ^ salt) % w)


def key_owners(keys, world: int) -> np.ndarray:
    """The rank owning each key (int64 ``[n]``): ``mix64(key XOR PLACEMENT_SALT) mod world``."""
    keys = np.ascontiguousarray(np.asarray(keys).reshape(-1)).view(np.uint64)
    out = np.empty(keys.shape[0], np.int64)
    _owners(keys, PLACEMENT_SALT, int(world), out)
    return out


def rank_capacity(capacity: int, world: int, rank: int) -> int:
    """The rows ``rank`` holds of a dynamic table of ``capacity`` rows: ``capacity // world``, plus one on
    the first ``capacity % world`` ranks (together exactly ``capacity``)."""
    return int(capacity) // int(world) + (int(rank) < int(capacity) % int(world))


def rank_config(config, world: int, rank: int):
    """A copy of the :class:`~embedcore.config.DynamicTableConfig` ``config`` with ``rank``'s capacity;
    ``ValueError`` naming the table when it has fewer rows than there are ranks."""
    if config.capacity < world:
        raise ValueError(f"dynamic table '{config.name}' has capacity {config.capacity}, fewer rows than the "
                         f"{world} ranks it is sharded over (each rank holds capacity // ranks rows of its own keys)")
    mine = copy.copy(config)
    mine.capacity = mine.vocabulary_size = rank_capacity(config.capacity, world, rank)
    return mine


@dataclass
class _Request:
    """Requester side of one dynamic table in one lookup: the table batch ``tb`` (its rows index the batch's
    distinct keys), the unique keys it reads with their occurrences ``order[ptr[u]:ptr[u + 1]]``,
    and where each unique key travels: ``key_at[u]`` in the flat key message, ``float_at[u]`` in the flat
    row message (and gradient message)."""

    tb: object
    keys: np.ndarray       # uint64 [u], increasing
    ptr: np.ndarray
    order: np.ndarray
    owners: np.ndarray
    key_at: np.ndarray = None
    float_at: np.ndarray = None


@dataclass
class _Owned:
    """Owner side of one dynamic table in one lookup: the keys received (peer order), their rows here (the
    storage row, or -1 for a key not admitted), where each one's row starts in the flat answer
    (``float_at``) and in the flat per-key messages (``key_at``), and the table's removal count after the
    commit (a later eviction makes the context stale)."""

    keys: np.ndarray
    counts: np.ndarray
    key_at: np.ndarray
    float_at: np.ndarray
    rows: np.ndarray = None
    removals: int = 0
    plan: object = None


@dataclass
class _Read:
    """A read-only lookup's answer on the owner: rows as a plan's commit gives them, and the initial values
    of the keys it holds no live row of."""

    rows: np.ndarray
    pending_values: np.ndarray


@dataclass
class DynamicRoute:
    """One lookup's routing of the dynamic tables: per peer and table, the keys sent (``to[k, d]``) and
    received (``from_[k, d]``); per table the requester's :class:`_Request` and the owner's :class:`_Owned`."""

    requests: list
    to: np.ndarray
    from_: np.ndarray = None
    owned: list = field(default_factory=list)

    def floats(self, counts, dims) -> np.ndarray:
        return (counts * dims[None, :]).sum(axis=1)


def _bases(counts: np.ndarray, width) -> np.ndarray:
    """Where the part of (peer ``k``, table ``d``) starts in a peer-major, table-major flat message whose
    part holds ``counts[k, d] * width[d]`` elements."""
    sizes = (counts * np.asarray(width, np.int64)[None, :]).ravel()
    return displacements(sizes).reshape(counts.shape) if sizes.size else np.zeros(counts.shape, np.int64)


class DynamicShards:
    """This rank's dynamic tables and the exchanges of their lookups and updates (see the module docstring).

    Args:
        spaces: the engine's id spaces of the dynamic tables (one table each), in the engine's order.
        tables: this rank's :class:`~embedcore.tables.dynamic.DynamicTable` of each, same order.
        first_space: the index of ``spaces[0]`` among the engine's id spaces (feature slots' ``group``).
        world, rank: the communicator's size and this rank.
        tuning: the engine's :class:`~embedcore.tuning.Tuning` (how requests' table batches are laid out).
    """

    def __init__(self, spaces, tables, first_space: int, world: int, rank: int, tuning):
        self.spaces, self.tables = list(spaces), list(tables)
        self.first_space, self.world, self.rank, self.tuning = first_space, world, rank, tuning
        self.dims = np.array([t.dim for t in self.tables], np.int64)
        # Per table, the admission sketch's counters as last loaded (the same on every rank; None: zeros), so
        # that a save can add up what each rank counted since (see distributed/checkpoint.py).
        self.sketch_bases = [None] * len(self.tables)

    def set_sketch_base(self, d: int, counters) -> None:
        self.sketch_bases[d] = None if counters is None else np.array(counters, np.uint32)

    def __len__(self):
        return len(self.tables)

    # -- lookup ------------------------------------------------------------------------------------------
    def request(self, parts) -> tuple:
        """``(route, send)``: the requester side of a lookup of ``parts`` (per dynamic table, its parts as
        ``TableLookup._prepare`` makes them) and the ``(key, count)`` pairs to send, int64 ``[n, 2]``.
        Changes nothing; raises :class:`~embedcore.inputs.InputError` for a malformed batch."""
        world, n_tables = self.world, len(self.tables)
        to = np.zeros((world, n_tables), np.int64)
        requests = []
        for d, table_parts in enumerate(parts):
            ids = [p[0].ids for p in table_parts]
            all_ids = np.ascontiguousarray(np.concatenate(ids) if ids else np.zeros(0, np.int64))
            distinct, inverse = np.unique(all_ids.view(np.uint64), return_inverse=True)
            inverse = inverse.reshape(-1).astype(np.int64)
            mapped, at = [], 0
            for batch, combiner, seq_len, _, out_offset, _ in table_parts:
                n = batch.ids.shape[0]
                local = dataclasses.replace(batch, ids=inverse[at:at + n], given_ids=None)  # distinct keys' indices
                mapped.append((local, combiner, seq_len, 0, out_offset, max(distinct.shape[0], 1)))
                at += n
            tb = inputs.build_table_batch(mapped, None, self.tuning)
            uniq, ptr, order = (a.copy() for a in unique_rows(tb.rows, max(distinct.shape[0], 1), Workspace()))
            keys = distinct[uniq]
            owners = key_owners(keys, world)
            to[:, d] = np.bincount(owners, minlength=world)
            requests.append(_Request(tb, keys, ptr, order, owners))
        route = DynamicRoute(requests, to)
        key_base, float_base = _bases(to, np.ones(n_tables, np.int64)), _bases(to, self.dims)
        send = np.empty((int(to.sum()), 2), np.int64)
        for d, r in enumerate(requests):
            position = _position_in_part(r.owners, world)
            r.key_at = key_base[r.owners, d] + position
            r.float_at = float_base[r.owners, d] + position * self.dims[d]
            send[r.key_at, 0] = r.keys.view(np.int64)
            send[r.key_at, 1] = np.diff(r.ptr)
        return route, send

    def sizes(self, route: DynamicRoute) -> int:
        """The most elements one of this rank's messages of the route will hold (for ``check_sizes``)."""
        return max(2 * int(route.to.sum()), int(route.floats(route.to, self.dims).sum()))

    def exchange_keys(self, ex, route: DynamicRoute, send) -> None:
        """Send the requests to their owners and fill the owner side of ``route`` (keys and counts received)."""
        world, n_tables = self.world, len(self.tables)
        route.from_ = np.empty((world, n_tables), np.int64)
        per_peer = np.full(world, n_tables, np.int64)
        ex.alltoallv(np.ascontiguousarray(route.to).reshape(-1), per_peer, route.from_.reshape(-1), per_peer,
                     "lookup (dynamic key counts)")
        received = np.empty((int(route.from_.sum()), 2), np.int64)
        ex.alltoallv(send.reshape(-1), 2 * route.to.sum(axis=1), received.reshape(-1), 2 * route.from_.sum(axis=1),
                     "lookup (dynamic keys)")
        key_base = _bases(route.from_, np.ones(n_tables, np.int64))
        float_base = _bases(route.from_, self.dims)
        route.owned = []
        for d in range(n_tables):
            key_at = np.concatenate([key_base[k, d] + np.arange(route.from_[k, d]) for k in range(world)])
            float_at = np.concatenate([float_base[k, d] + self.dims[d] * np.arange(route.from_[k, d])
                                       for k in range(world)])
            route.owned.append(_Owned(received[key_at, 0].copy(), received[key_at, 1].copy(), key_at, float_at))

    def plan(self, route: DynamicRoute, step: int) -> None:
        """Plan every table's lookup of the keys it received (see the module docstring); on a refusal,
        undo the plans made and raise (the caller agrees on it with the other ranks)."""
        try:
            for table, owned in zip(self.tables, route.owned):
                occurrences = np.repeat(owned.keys, owned.counts)
                batch = inputs.to_feature_batch(occurrences, None, table.name, table.key_map.capacity,
                                                check_range=False)
                owned.plan = table.plan([(batch, "sum", 0, 0, 0, table.key_map.capacity)], step)
        except BaseException:
            self.cancel(route)
            raise

    def read_only(self, route: DynamicRoute, step: int) -> None:
        """As :meth:`plan` for a read-only lookup (``training=False``): each table reads the keys it received
        (:meth:`~embedcore.tables.dynamic.DynamicTable.read_only_rows`), changing nothing, and
        :meth:`commit_and_answer` answers what they read."""
        for table, owned in zip(self.tables, route.owned):
            occurrences = np.repeat(owned.keys, owned.counts)
            batch = inputs.to_feature_batch(occurrences, None, table.name, table.key_map.capacity, check_range=False)
            _, _, rows, pending_values = table.read_only_rows([(batch, "sum", 0, 0, 0, table.key_map.capacity)], step)
            owned.plan = _Read(rows, pending_values)

    def cancel(self, route: DynamicRoute) -> None:
        """Undo the plans of ``route`` not committed yet (their admission counts)."""
        for table, owned in zip(self.tables, route.owned):
            if owned.plan is not None:
                if not isinstance(owned.plan, _Read):
                    table.cancel(owned.plan)
                owned.plan = None

    def commit_and_answer(self, ex, route: DynamicRoute) -> list:
        """Commit the plans, answer every request with its row, and combine this rank's activations (one
        ``[n_out, dim]`` array per table)."""
        answer = np.empty(int(route.floats(route.from_, self.dims).sum()), np.float32)
        for table, owned in zip(self.tables, route.owned):
            plan, owned.plan = owned.plan, None
            rows = plan.rows if isinstance(plan, _Read) else table.commit(plan)
            rows = rows[displacements(owned.counts)]  # each received key's first occurrence
            capacity = table.key_map.capacity
            values = np.empty((rows.shape[0], table.dim), np.float32)
            admitted = rows < capacity
            values[admitted] = table.storage.weights[rows[admitted]].astype(np.float32)
            values[~admitted] = plan.pending_values.reshape(-1, table.dim)[rows[~admitted] - capacity].astype(
                np.float32)
            owned.rows = np.where(admitted, rows, -1)
            owned.removals = table.removals
            for j in range(table.dim):
                answer[owned.float_at + j] = values[:, j]
        received = np.empty(int(route.floats(route.to, self.dims).sum()), np.float32)
        ex.alltoallv(answer, route.floats(route.from_, self.dims), received, route.floats(route.to, self.dims),
                     "lookup (dynamic rows)")
        acts = []
        for table, r in zip(self.tables, route.requests):
            rows_u = np.empty((r.keys.shape[0], table.dim), np.float32)
            flat_to_rows(received, r.float_at, rows_u)
            occurrence = np.empty(r.tb.rows.shape[0], np.int64)
            occurrence_unique(r.ptr, r.order, occurrence)
            act = aligned_zeros((r.tb.n_out, table.dim), np.float32)
            if r.tb.n_out:
                gather_combine(rows_u, occurrence, r.tb.gains, r.tb.out_ptr, act)
            acts.append(act)
        return acts

    # -- update ------------------------------------------------------------------------------------------
    def stale(self, route: DynamicRoute) -> str | None:
        """Why ``route``'s gradients can no longer be applied on this rank (a later lookup evicted or expired
        rows of one of its tables here), or None."""
        for table, owned in zip(self.tables, route.owned):
            if owned.removals != table.removals:
                return (f"table '{table.name}': a later lookup evicted or expired rows of this dynamic table on "
                        f"rank {self.rank}, so the rows this context's lookup used may hold other keys now; look up "
                        f"again (nothing was updated)")
        return None

    def update(self, ex, route: DynamicRoute, checked, features, step, values, report: UpdateReport) -> set:
        """Send each unique key's gradient sum to its owner and update the admitted keys' rows (see the module
        docstring). ``checked``: the features' gradients (None for a feature without one, not all None).
        Returns the names of the row functions that failed here."""
        n_to = route.floats(route.to, self.dims)
        n_from = route.floats(route.from_, self.dims)
        sums_out = np.empty(int(n_to.sum()), np.float32)
        some_none = any(grad is None for grad in checked)
        has_out = np.zeros(int(route.to.sum()), np.uint8) if some_none else None
        for d, (table, space, r) in enumerate(zip(self.tables, self.spaces, route.requests)):
            k = self.first_space + d
            d_act = gradient_rows(k, r.tb.n_out, table.dim, space.workspace, checked, features)
            sums = np.empty((r.keys.shape[0], table.dim), np.float32)
            if sums.shape[0]:
                sum_gradients(sums, r.ptr, r.order, r.tb.out_row, r.tb.gains, d_act)
            for j in range(table.dim):
                sums_out[r.float_at + j] = sums[:, j]
            if some_none:
                active = np.ones(r.tb.n_out, bool)
                for grad, s in zip(checked, features):
                    if s.group == k and grad is None:
                        active[s.out_offset:s.out_offset + s.n_rows] = False
                if r.keys.shape[0]:
                    occurrence_has = active[r.tb.out_row][r.order]
                    has_out[r.key_at] = np.maximum.reduceat(occurrence_has, r.ptr[:-1])
        sums_in = np.empty(int(n_from.sum()), np.float32)
        ex.alltoallv(sums_out, n_to, sums_in, n_from, "apply_gradients (dynamic gradient sums)")
        has_in = None
        if some_none:
            has_in = np.empty(int(route.from_.sum()), np.uint8)
            ex.alltoallv(has_out, route.to.sum(axis=1), has_in, route.from_.sum(axis=1),
                         "apply_gradients (which dynamic keys have a gradient)")
        failing = set()
        for table, owned in zip(self.tables, route.owned):
            keep = owned.rows >= 0
            if has_in is not None:
                keep &= has_in[owned.key_at].astype(bool)
            rows, offsets = owned.rows[keep], owned.float_at[keep]
            n = rows.shape[0]
            if n == 0:
                continue
            lr, hyper = values[id(table.optimizer)]
            d_act = np.empty((n, table.dim), np.float32)
            flat_to_rows(sums_in, offsets, d_act)
            batch = inputs.TableBatch(rows, None, np.arange(n + 1, dtype=np.int64), n)
            result = table.update(batch, d_act, lr, hyper, step)
            report.add(result)
            if result.function is not None:
                failing.add(result.function)
        return failing


def _position_in_part(owners: np.ndarray, world: int) -> np.ndarray:
    """Each element's index among the elements of equal owner before it (keys increase within a part)."""
    order = np.argsort(owners, kind="stable")
    sorted_owners = owners[order]
    start = np.searchsorted(sorted_owners, sorted_owners, side="left")
    position = np.empty(owners.shape[0], np.int64)
    position[order] = np.arange(owners.shape[0]) - start
    return position
