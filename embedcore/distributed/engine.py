"""``ShardedEmbedding``: every table split by rows over the processes of an MPI communicator.

Each rank feeds its own local batch (data parallel) and gets its own activations back. Per table and step:

lookup
    dedup the batch's ids locally; send each unique id to its owner (all-to-all-v, counts first); owners
    gather the rows from their shard and send them back; each rank combines its activations from the
    received rows, with the same kernel and order as a single-process lookup (so activations are
    bit-identical to one process's).
apply_gradients
    sum each unique id's gradient locally (fixed order); send the sums to the owners; each owner runs the
    fused optimizer on its shard, summing the received sums of one row in rank order.

N ranks with local batches b_1..b_N give the tables of one process fed the concatenated batch, up to float32
summation order: one process sums a row's occurrences left to right, the sharded engine sums each rank's
occurrences first and then the ranks' sums in rank order. With one rank the results are bit-identical;
otherwise they agree to float32 rounding (tested at rtol 1e-5). Everything else is exact: initial values
(counter-based), the rows each update touches, and the optimizer's step count.

Errors are collective: bad input on any rank is refused on every rank before anything changes, so no rank
is left waiting inside an exchange; a peer that dies or stops answering makes the others raise
:class:`~embedcore.distributed.exchange.DistributedError` within ``timeout`` seconds.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from .. import inputs
from ..checkpoint import (CheckpointError, check_compatible, check_save_inputs, manifest_of, open_snapshot,
                          table_rows, write_table_shards)
from ..checkpoint import _EXTRA
from ..checkpoint.config_codec import FunctionResolver, decode_engine_config, encode_engine_config
from ..checkpoint.store import SnapshotWriter
from ..engine import Embedding, NonFiniteError, UpdateReport, _check_gradient
from ..inputs import InputError
from ..kernels.dedup import unique_rows
from ..kernels.rows import gather_combine, sum_gradients
from ..kernels.update import update_kernel
from ..kernels.workspace import Workspace
from ..config import FeatureConfig, TableConfig
from ..lookup import LookupContext, TableLookup, _PhysicalTable
from .exchange import DistributedError, Exchanger
from .sharding import local_index, owners, rotation, shard_of

__all__ = ["ShardedEmbedding", "DistributedError"]


def _world_comm(comm):
    if comm is not None:
        return comm
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError("ShardedEmbedding needs mpi4py and an MPI library: pip install 'embedcore[mpi]' "
                          "(mpi4py and the mpich wheel), or mpi4py built against your cluster's MPI") from None
    return MPI.COMM_WORLD


class _Route:
    """One table's lookup routing on this rank: unique ids, who owns them, what peers asked us for."""

    def __init__(self, tb, uniq, ptr, order, perm, send_counts, recv_counts, asked_local):
        self.tb, self.uniq, self.ptr, self.order = tb, uniq, ptr, order
        self.perm, self.send_counts, self.recv_counts, self.asked_local = perm, send_counts, recv_counts, asked_local


class ShardedEmbedding(TableLookup):
    """Embedding tables sharded by rows over MPI processes; the API of :class:`~embedcore.Embedding`.

    Args:
        feature_config, optimizer, seed, non_finite: as for :class:`~embedcore.Embedding`; must be equal
            on every rank (checked at construction).
        comm: an ``mpi4py`` communicator; ``None`` means ``MPI.COMM_WORLD``.
        timeout: seconds any exchange may wait for the other ranks before raising ``DistributedError``.
    """

    def __init__(self, feature_config, optimizer=None, *, comm=None, seed=0, non_finite="raise",
                 timeout: float = 120.0):
        self.comm = _world_comm(comm)
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self._exchange = Exchanger(self.comm, timeout)
        tables = self._init_features(feature_config)
        config = encode_engine_config(feature_config, tables, optimizer, seed)
        config["non_finite"] = non_finite
        self._config = config
        self._exchange.same_everywhere(json.dumps(config, sort_keys=True), "the embedding configuration "
                                       "(feature_config, tables, optimizers, seed, non_finite)")
        self._optimizer, self.seed, self.non_finite = optimizer, int(seed), non_finite
        self.step = 0
        self.skipped_rows = {}
        self._lock = threading.Lock()
        # Lookups route by global table: one virtual group per table, its rows held by their owners.
        self._index_groups([_PhysicalTable([t], [0], t.dim, None) for t in tables])
        self._rotation = {t.name: rotation(t.name, self.world_size) for t in tables}
        self.shards = {t.name: shard_of(t.vocabulary_size, self.world_size, self.rank, self._rotation[t.name])
                       for t in tables}
        # This rank's rows: an ordinary engine over the shards (stacked as usual), filled with the values the
        # whole tables would hold.
        local_tables = {t.name: TableConfig(max(self.shards[t.name].rows, 1), t.dim, initializer=t.initializer,
                                            optimizer=t.optimizer, combiner=t.combiner, name=t.name) for t in tables}
        self.local = Embedding.__new__(Embedding)
        self.local._setup({name: FeatureConfig(t) for name, t in local_tables.items()}, optimizer, seed,
                          True, fill=False, non_finite=non_finite)
        for t in tables:
            shard = self.shards[t.name]
            self.local._fill_table(self.local._table_configs[t.name], shard.first, shard.stride,
                                   t.vocabulary_size, n_rows=shard.rows)
        self._workspaces = {t.name: Workspace() for t in tables}

    # -- state -------------------------------------------------------------------------------------------
    @property
    def embedding_tables(self) -> dict:
        """Table name -> this rank's rows of the table (global rows ``shards[name].global_rows()``)."""
        return {name: table[:self.shards[name].rows] for name, table in self.local.embedding_tables.items()}

    @property
    def slot_variables(self) -> dict:
        return {name: {s: v[:self.shards[name].rows] for s, v in slots.items()}
                for name, slots in self.local.slot_variables.items()}

    def gather_tables(self, root: int = 0):
        """The whole tables and slots on ``root`` (``None`` elsewhere): ``{name: (weights, {slot: array})}``."""
        out = {}
        for name, table in self._table_configs.items():
            shard = self.shards[name]
            parts = [self.embedding_tables[name]] + list(self.slot_variables[name].values())
            gathered = self.comm.gather((shard.global_rows(), [np.array(p) for p in parts]), root=root)
            if self.rank == root:
                whole = [np.empty((table.vocabulary_size,) + p.shape[1:], np.float32) for p in parts]
                for rows, pieces in gathered:
                    for w, piece in zip(whole, pieces):
                        w[rows] = piece
                out[name] = (whole[0], dict(zip(self.slot_variables[name], whole[1:])))
        return out if self.rank == root else None

    def __repr__(self):
        return (f"ShardedEmbedding(rank {self.rank} of {self.world_size}; " +
                ", ".join(f"{n}: {s.rows} of {s.vocabulary_size} rows" for n, s in self.shards.items()) +
                f"; step={self.step})")

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, path, extra=None, metadata=None) -> str:
        """Every rank writes its own rows into one snapshot; rank 0 makes it current once all have succeeded.

        ``path`` must be on a file system every rank sees. ``extra`` (e.g. the dense model, replicated in
        data-parallel training) is taken from rank 0. The layout is the one single-process checkpoints use,
        with each table in one shard per rank: it restores on any number of ranks, or on one process.
        """
        ex = self._exchange
        ex.check_usable()
        error, writer, name = None, None, None
        try:
            extra = check_save_inputs(extra if self.rank == 0 else None, metadata)
            if self.rank == 0:
                writer = SnapshotWriter(path, self.step)
                name = writer.name
        except (CheckpointError, OSError) as e:
            error = str(e)
        ex.agree(error, "save")
        name = self.comm.bcast(name, root=0)
        try:
            if writer is None:
                writer = SnapshotWriter.attach(path, name)
            shards = {n: (s.first, s.stride, s.rows) for n, s in self.shards.items()}
            entries = write_table_shards(writer, self._table_configs, self.embedding_tables, self.slot_variables,
                                         shards, suffix=f"-shard-{self.rank:05d}-of-{self.world_size:05d}")
            if self.rank == 0 and extra:
                writer.add(_EXTRA, extra)
            error = None
        except (CheckpointError, OSError) as e:
            error = str(e)
        try:
            ex.agree(error, "save (writing shards)")
        except DistributedError:
            if self.rank == 0:
                writer.abort()
            raise
        parts = self.comm.gather((entries, writer.files), root=0)
        error = None
        if self.rank == 0:
            try:
                merged = {}
                for part_entries, files in parts:
                    writer.files.update(files)
                    for table, entry in part_entries.items():
                        merged.setdefault(table, dict(entry, shards=[]))["shards"] += entry["shards"]
                writer.commit(manifest_of(self.step, self._config, merged, _EXTRA if extra else None, metadata))
            except BaseException as e:
                writer.abort()
                error = f"{type(e).__name__}: {e}"
        ex.agree(error, "save (commit)")
        return writer.dir

    def load(self, path, strict: bool = True) -> None:
        """Load this rank's rows of a checkpoint written by any number of ranks (or one process)."""
        ex = self._exchange
        ex.check_usable()
        staged, error = [], None
        try:
            snap = open_snapshot(path)
            slots = self.slot_variables
            check_compatible(snap, self._config, {n: list(v) for n, v in slots.items()}, strict)
            for name, table in self.embedding_tables.items():
                shard = self.shards[name]
                targets = {"weights": table}
                targets.update({f"slot/{s}": v for s, v in slots[name].items()})
                for key, target in targets.items():
                    rows = table_rows(snap, name, key, shard.first, shard.stride, shard.rows)
                    if rows.shape != target.shape:
                        raise CheckpointError(f"{snap.dir}: table '{name}' tensor '{key}' rows have shape "
                                              f"{rows.shape[1:]}, the engine needs {target.shape[1:]}")
                    staged.append((target, rows))
        except CheckpointError as e:
            error = str(e)
        ex.agree(error, "load")
        for target, rows in staged:
            target[...] = rows
        self.step = snap.step

    @classmethod
    def restore(cls, path, *, comm=None, functions=None, allow_import: bool = False, timeout: float = 120.0):
        """A sharded engine built from a checkpoint's configuration (see ``Embedding.restore``)."""
        snap = open_snapshot(path)
        features, optimizer, seed = decode_engine_config(snap.manifest["config"],
                                                         FunctionResolver(functions, allow_import))
        emb = cls(features, optimizer, comm=comm, seed=seed, timeout=timeout,
                  non_finite=snap.manifest["config"].get("non_finite", "raise"))
        emb.load(path, strict=False)
        return emb

    # -- lookup ------------------------------------------------------------------------------------------
    def lookup(self, features, weights=None):
        """This rank's activations for its local batch, and the context for :meth:`apply_gradients`."""
        self._exchange.check_usable()
        try:
            slots, parts = self._prepare(features, weights)
            error = None
        except InputError as e:
            error = str(e)
        self._exchange.agree(error, "lookup")
        routes, acts = [], []
        for group, group_parts in zip(self._groups, parts):
            table = group.tables[0]
            tb = inputs.build_table_batch(group_parts) if group_parts else inputs.build_table_batch([])
            route = self._route(table, tb)
            rows_u = self._fetch_rows(table, route)
            occurrence_unique = np.empty(tb.rows.shape[0], np.int64)
            occurrence_unique[route.order] = np.repeat(np.arange(route.uniq.shape[0]), np.diff(route.ptr))
            act = np.zeros((tb.n_out, group.dim), np.float32)
            if tb.n_out:
                gather_combine(rows_u, occurrence_unique, tb.gains, tb.out_ptr, act)
            routes.append(route)
            acts.append(act)
        activations = [acts[s.group][s.out_offset:s.out_offset + s.n_rows].reshape(s.shape) for s in slots]
        ctx = LookupContext(id(self), routes, slots)
        return inputs.unflatten(self._feature_config, activations), ctx

    def _route(self, table, tb) -> _Route:
        rot = self._rotation[table.name]
        uniq, ptr, order = unique_rows(tb.rows, table.vocabulary_size, self._workspaces[table.name])
        uniq, ptr, order = uniq.copy(), ptr.copy(), order.copy()  # the workspace is reused by apply
        owner = owners(uniq, self.world_size, rot)
        perm = np.argsort(owner, kind="stable")
        send_counts = np.bincount(owner, minlength=self.world_size).astype(np.int64)
        what = f"lookup of table '{table.name}'"
        recv_counts = self._exchange.counts(send_counts, what)
        asked = self._exchange.rows(uniq[perm], send_counts, recv_counts, what)
        return _Route(tb, uniq, ptr, order, perm, send_counts, recv_counts,
                      local_index(asked, self.world_size, rot))

    def _fetch_rows(self, table, route: _Route) -> np.ndarray:
        mine = self.local.embedding_tables[table.name]
        answer = mine[route.asked_local]
        received = self._exchange.rows(answer, route.recv_counts, route.send_counts,
                                       f"lookup of table '{table.name}' (rows)")
        rows_u = np.empty_like(received)
        rows_u[route.perm] = received
        return rows_u

    # -- update ------------------------------------------------------------------------------------------
    def apply_gradients(self, gradients, ctx: LookupContext):
        """Apply this rank's activation gradients; every rank must call it for the same step."""
        if not isinstance(ctx, LookupContext) or ctx.engine_id != id(self):
            raise InputError("ctx must be the context returned by this engine's lookup")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("cannot apply_gradients: another thread is using this ShardedEmbedding")
        try:
            return self._apply(gradients, ctx)
        finally:
            self._lock.release()

    def _apply(self, gradients, ctx):
        self._exchange.check_usable()
        try:
            if ctx.consumed:
                raise InputError("these activations' gradients were already applied; look up again")
            leaves = inputs.flatten_like(self._feature_config, gradients, "gradients")
            refuse = self.non_finite == "raise"
            checked = [_check_gradient(grad, s, refuse) for grad, s in zip(leaves, ctx.features)]
            error = None
        except InputError as e:
            error = str(e)
        self._exchange.agree(error, "apply_gradients")
        step = self.step + 1
        incoming = {}
        for g, (group, route) in enumerate(zip(self._groups, ctx.table_batches)):
            table = group.tables[0]
            d_act = Embedding._gradient_rows(g, group, route.tb, checked, ctx.features)
            sums = np.empty((route.uniq.shape[0], group.dim), np.float32)
            if sums.shape[0]:
                sum_gradients(sums, route.ptr, route.order, route.tb.out_row, route.tb.gains, d_act)
            received = self._exchange.rows(sums[route.perm], route.send_counts, route.recv_counts,
                                           f"apply_gradients of table '{table.name}'")
            incoming[table.name] = (route.asked_local, received)
        report = self._update_shards(incoming, step)
        self.step = step
        ctx.consumed = True
        for name, rows in report.skipped.items():
            self.skipped_rows[name] = self.skipped_rows.get(name, 0) + sum(len(v) for v in rows.values())
        message = report.describe() if (report.skipped and self.non_finite == "raise") else None
        try:
            self._exchange.agree(message, "the update (rows left unchanged)")
        except DistributedError as e:
            raise NonFiniteError(f"{e}. The other rows were updated and step is now {step} on every rank; "
                                 f"non_finite='skip' skips such rows and reports them instead") from None
        return report

    def _update_shards(self, incoming, step) -> UpdateReport:
        """Run each local physical table's fused kernel on the gradient sums this rank received."""
        local = self.local
        values = {}
        report = UpdateReport(step)
        for group in local._groups:
            rows, grads = [], []
            for table, offset in zip(group.tables, group.offsets):
                local_rows, received = incoming[table.name]
                rows.append(local_rows + offset)
                grads.append(received)
            rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
            d_act = np.concatenate(grads) if grads else np.zeros((0, group.dim), np.float32)
            lazy = group.optimizer.lazy
            if rows.shape[0] == 0 and lazy:
                continue
            if id(group.optimizer) not in values:
                values[id(group.optimizer)] = group.optimizer.step_values(step)
            lr, hyper = values[id(group.optimizer)]
            ws = group.workspace
            uniq, ptr, order = unique_rows(rows, group.n_rows, ws)
            status = ws.array("status", (uniq.shape[0] if lazy else group.n_rows,), np.uint8)
            status[:] = 0
            n = rows.shape[0]
            kernel = update_kernel(group.row_function, lazy=lazy)
            kernel(group.weights, group.slots, uniq, ptr, order, np.arange(n, dtype=np.int64),
                   np.ones(n, np.float32), np.ascontiguousarray(d_act, np.float32), lr, hyper, status)
            self._record_skips(report, group, uniq, status, lazy)
        return report

    def _record_skips(self, report, group, uniq, status, lazy):
        """Like ``UpdateReport._record``, but with global row ids."""
        local = UpdateReport(report.step)
        local._record(group, uniq, status, lazy)
        for name, rows in local.skipped.items():
            shard = self.shards[name]
            report.skipped[name] = {k: shard.first + shard.stride * v for k, v in rows.items()}
