"""``ShardedEmbedding``: every table split by rows over the processes of an MPI communicator.

Each rank feeds its own local batch (data parallel) and gets its own activations back. One step, for all
tables at once (tables of equal ``dim`` are stacked into one id space, as one process stacks them):

lookup
    dedup the batch's ids locally; one all-to-all of counts (which also agrees on input errors), one
    all-to-all-v sending every unique id to its owner, one all-to-all-v bringing all their rows back (rows
    of different widths packed end to end); each rank combines its activations from the received rows with
    the same kernel and order as a single-process lookup (so activations are bit-identical to one process's).
apply_gradients
    one all-reduce agreeing that every rank's gradients are valid (and belong to the same lookup, with None
    for the same features); sum each unique id's gradient locally (fixed order); one all-to-all-v of all the
    sums to their owners (when some feature's gradient is None, one more of a byte per id: whether it has
    a gradient); each owner runs the fused optimizer on its shards, summing the sums of one row in rank
    order; one all-reduce agreeing on rows left unchanged (NaN/Inf) or a row function's wrong-length result.

N ranks with local batches b_1..b_N give the tables of one process fed the concatenated batch, up to float32
summation order: one process sums a row's occurrences left to right, the sharded engine sums each rank's
occurrences first and then the ranks' sums in rank order. With one rank the results are bit-identical;
otherwise they agree to float32 rounding (tested at rtol 1e-5). Everything else is exact: initial values
(counter-based), the rows each update touches, and the optimizer's step count.

Dynamic tables (:class:`~embedcore.DynamicTableConfig`) are placed by a hash of the key, not by rows: each
rank holds a dynamic table of about ``capacity / K`` rows of the keys it owns, and a lookup sends every
unique key (with its occurrence count) to its owner, which applies the table's admission and eviction; see
:mod:`.dynamic` for the exchanges and for what K ranks share with one process.

Errors are collective: bad input on any rank is refused on every rank before anything changes, so no rank
is left waiting inside an exchange; a peer that dies or stops answering makes the others raise
:class:`~embedcore.distributed.exchange.DistributedError` within ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import json
import threading
import weakref
import zlib
from dataclasses import dataclass

import numpy as np

from .. import inputs
from ..checkpoint.config_codec import encode_engine_config
from ..compiler import RowFunctionError
from ..config import DynamicTableConfig
from ..engine import (NON_FINITE_POLICIES, NonFiniteError, UpdateReport, check_gradient, gradient_rows,
                      refuse_lookup_only)
from ..kernels.aligned import aligned_zeros
from ..kernels.rows import gather_combine, sum_gradients
from ..kernels.workspace import Workspace
from ..lookup import LookupContext, TrainingEngine
from ..optimizers import Optimizer
from ..tables import physical_tables
from ..tables.factory import lookup_only
from ..thread_share import mpi_local_processes, share_cores
from ..tuning import DEFAULT_TUNING, Tuning
from . import checkpoint as _checkpoint
from .dynamic import DynamicShards, rank_config
from .exchange import DistributedError, Exchanger, Refused, describe_error
from .kernels import flat_to_rows, occurrence_unique, rows_to_flat
from .routing import Layout, Route, resolve, route_requests
from .sharding import rotation, shard_of

__all__ = ["ShardedEmbedding", "ShardedLookupContext", "DistributedError"]

_ROW_FUNCTION = "[row function] "  # marks an agreed message about a failing row function


def _world_comm(comm):
    if comm is not None:
        return comm
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError("ShardedEmbedding needs mpi4py and an MPI library: pip install 'embedcore[mpi]' "
                          "(mpi4py and the mpich wheel), or mpi4py built against your cluster's MPI") from None
    return MPI.COMM_WORLD


@dataclass
class ShardedLookupContext(LookupContext):
    """A :class:`~embedcore.LookupContext` that also holds the lookup's :class:`~.routing.Route`."""

    route: Route = None
    dynamic_route: object = None  # the dynamic tables' :class:`~.dynamic.DynamicRoute`, if any


@dataclass
class IdSpace:
    """Tables of one ``dim`` stacked into one id space, as a lookup lays a batch out (their rows live with
    their owners); ``workspace`` holds the dedup of each lookup's batch."""

    tables: list
    offsets: list
    dim: int
    n_rows: int
    workspace: Workspace


class _Constants:
    """Grow-only ``arange`` and ``ones`` (the owner's update sees each received sum as one occurrence)."""

    def __init__(self):
        self._arange, self._ones = np.zeros(0, np.int64), np.zeros(0, np.float32)

    def get(self, n: int):
        if self._arange.shape[0] < n:
            size = max(n, 2 * self._arange.shape[0], 16)
            self._arange, self._ones = np.arange(size, dtype=np.int64), np.ones(size, np.float32)
        return self._arange[:n], self._ones[:n]


def _gradients_tag(seq: int, without: list, n_features: int) -> int:
    """What the ranks must agree on before applying gradients, as one integer >= 0: the lookup's number and
    the features whose gradient is None (19 bits of their names' CRC-32, and two exact bits that decide
    which exchanges follow: whether some gradient is None, whether all are)."""
    if not without:
        return seq << 21
    digest = zlib.crc32("\x00".join(without).encode("utf-8")) & 0x7FFFF
    return (seq << 21) | (digest << 2) | (int(len(without) == n_features) << 1) | 1


def _attempt(fn):
    """``(fn(), None, None)``, or ``(None, message, exception)`` if it raised."""
    try:
        return fn(), None, None
    except Exception as e:  # any failure on one rank must reach the agreement, or the others would wait
        return None, describe_error(e), e


class ShardedEmbedding(TrainingEngine):
    """Embedding tables sharded by rows over MPI processes; the API of :class:`~embedcore.Embedding`.

    Args:
        feature_config, optimizer, seed, non_finite: as for :class:`~embedcore.Embedding`; must be equal
            on every rank (checked at construction). ``optimizer=None`` with no table setting one makes a
            lookup-only engine, as for :class:`~embedcore.Embedding`.
        tuning: an :class:`~embedcore.tuning.Tuning` for this rank's shards (speed only).
        comm: an ``mpi4py`` communicator, or a ``torch.distributed`` ``ProcessGroup`` (gloo; the same
            engine over :mod:`~embedcore.distributed.torch_transport`); ``None`` means ``MPI.COMM_WORLD``. ``lookup``,
            ``apply_gradients``, ``save``, ``load`` and ``gather_tables`` are collectives on it: call them in
            the same order on every rank (pass ``comm.Dup()`` to keep them apart from your own collectives).
        timeout: seconds any exchange may wait for the other ranks before raising ``DistributedError``.

    Thread safety: one call at a time per engine (lookups too, unlike ``Embedding``: each is a collective);
    a second thread gets a ``RuntimeError`` and changes nothing.
    """

    _busy = "another thread is using this ShardedEmbedding (its calls are collectives: one at a time)"

    def __init__(self, feature_config, optimizer=None, *, comm=None, seed=0, non_finite="raise",
                 timeout: float = 120.0, tuning: Tuning | None = None):
        self.comm = _world_comm(comm)
        self._exchange = ex = Exchanger(self.comm, timeout)
        self.rank, self.world_size = ex.rank, ex.world

        def describe_config():
            tables = self._init_features(feature_config)
            config = encode_engine_config(feature_config, tables, optimizer, seed)
            config["non_finite"] = non_finite
            return tables, config, json.dumps(config, sort_keys=True)
        result, error, exc = _attempt(describe_config)
        self._agreed(error, exc, "building the embedding configuration")
        tables, self._config, text = result
        ex.same_everywhere(text, "the embedding configuration (feature_config, tables, optimizers, seed, non_finite)")
        self.threads = share_cores(mpi_local_processes(self.comm))  # a collective over MPI
        _, error, exc = _attempt(lambda: self._build(tables, optimizer, seed, non_finite, tuning))
        self._agreed(error, exc, "building this rank's shards")

    def _build(self, tables, optimizer, seed, non_finite, tuning):
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise ValueError(f"optimizer must be an embedcore optimizer or None (SGD, Adagrad, ..., CustomOptimizer): "
                             f"{type(optimizer)} is an unsupported optimizer class. Received: {optimizer!r:.80}")
        if non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}")
        self._optimizer, self.seed, self.non_finite = optimizer, int(seed), non_finite
        self.tuning = DEFAULT_TUNING if tuning is None else tuning
        self.step = 0
        self.skipped_rows = {}
        self._lock = threading.Lock()
        self.lookup_only = lookup_only(tables, optimizer)
        static = [t for t in tables if not isinstance(t, DynamicTableConfig)]
        dynamic = [t for t in tables if isinstance(t, DynamicTableConfig)]
        by_dim = {}
        for t in static:
            by_dim.setdefault(t.dim, []).append(t)
        spaces = []
        for dim, members in by_dim.items():
            offsets = np.cumsum([0] + [t.vocabulary_size for t in members[:-1]]).tolist()
            spaces.append(IdSpace(members, offsets, dim, offsets[-1] + members[-1].vocabulary_size, Workspace()))
        self._n_static = len(spaces)
        # Each dynamic table is an id space of its own, after the static ones; its keys live by a hash.
        spaces += [IdSpace([t], [0], t.dim, t.vocabulary_size, Workspace()) for t in dynamic]
        # Lookups stack the tables of equal dim into one id space each, their rows held by their owners.
        self._index_tables(spaces)
        self._rotation = {t.name: rotation(t.name, self.world_size) for t in static}
        self.shards = {t.name: shard_of(t.vocabulary_size, self.world_size, self.rank, self._rotation[t.name])
                       for t in static}
        # This rank's rows: physical tables over the shards (stacked as usual), filled with the values the
        # whole tables would hold. The owner's update sees each received sum as one occurrence of gain 1.
        unit = lambda table: True  # noqa: E731
        self._shard_tables = physical_tables(
            static, optimizer, seed=self.seed, tuning=self.tuning, unit_gains=unit,
            shards={name: (s.first, s.stride, s.rows) for name, s in self.shards.items()}) if static else ()
        # One physical table per dynamic table: each one's exchanges and update are its own.
        owned = physical_tables([rank_config(t, self.world_size, self.rank) for t in dynamic], optimizer,
                                stack_tables=False, seed=self.seed, tuning=self.tuning,
                                unit_gains=unit) if dynamic else ()
        engine = weakref.ref(self)
        for table in owned:  # views of TTL tables hide the rows expired at the engine's current step
            table.clock = lambda: getattr(engine(), "step", 0)
        self._physical = self._shard_tables + owned
        self._dynamic = DynamicShards(spaces[self._n_static:], [table.members[0] for table in owned],
                                      self._n_static, self.world_size, self.rank, self.tuning)
        self._layout = Layout(self._spaces[:self._n_static], static, self._rotation, self._shard_tables,
                              self.world_size)
        self._workspace = Workspace()
        self._batch_workspaces = [Workspace() for _ in spaces[:self._n_static]]  # a lookup's table batches
        self._constants = _Constants()
        self._lookups = 0
        self._pending = None  # weak reference to the last lookup's route while its gradients are not applied

    def _agreed(self, error, exc, what, **tag):
        """:meth:`Exchanger.agree`, chaining this rank's own exception to the ``DistributedError``."""
        try:
            self._exchange.agree(error, what, **tag)
        except DistributedError as e:
            raise e from exc

    @contextlib.contextmanager
    def _going_ahead(self, what: str):
        """The part of a step after the ranks agreed to go ahead: should it fail here (a bug, memory), the
        others wait in an exchange this rank will not enter, so the engine is unusable from then on."""
        try:
            yield
        except DistributedError:
            raise
        except BaseException as e:
            self._exchange.broken = (f"rank {self.rank}: {what} failed after the ranks agreed to go ahead "
                                     f"({describe_error(e)}); its peers are left waiting in an exchange")
            raise

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        self._exchange.check_usable()
        with super()._exclusive(what):
            yield

    # -- state -------------------------------------------------------------------------------------------
    @property
    def embedding_tables(self) -> dict:
        """Table name -> this rank's rows of the table (global rows ``shards[name].global_rows()``); for a
        dynamic table, a :class:`~embedcore.tables.dynamic.DynamicTableView` of the keys this rank owns
        (:func:`~embedcore.distributed.dynamic.key_owners`): ``len``, ``keys()`` and ``in`` count only those;
        ``view[k]`` of a key held elsewhere reads its initial value. :meth:`gather_tables` merges them."""
        return super().embedding_tables

    @property
    def exchange(self) -> Exchanger:
        """The communication layer the ranks talk through (collective checkpoints use it too)."""
        return self._exchange

    @property
    def config(self) -> dict:
        """The engine's configuration as a checkpoint's manifest records it (the same on every rank)."""
        return self._config

    def rotation(self, table: str) -> int:
        """The table's rotation in the sharding rule (a stable hash of its name, modulo the world size)."""
        return self._rotation[table]

    def gather_tables(self, root: int = 0):
        """The whole tables and slots on ``root`` (``None`` elsewhere): ``{name: (weights, {slot: array})}``;
        for a dynamic table ``{name: (keys, weights, {slot: array})}``: the keys every rank holds (int64 bit
        patterns, increasing) and their rows and slots' values, row ``i`` of key ``keys[i]``.

        For tests and small tables: it holds everything on ``root``.
        """
        with self._exclusive("gather_tables"):
            return _checkpoint.gather_tables(self, root)

    def __repr__(self):
        return (f"ShardedEmbedding(rank {self.rank} of {self.world_size}; " +
                ", ".join([f"{n}: {s.rows} of {s.vocabulary_size} rows" for n, s in self.shards.items()] +
                          [f"{t.name}: {len(t.key_map)} keys of {t.key_map.capacity} (dynamic)"
                           for t in self._dynamic.tables]) +
                f"; step={self.step})")

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, path, extra=None, metadata=None, incremental: bool = False) -> str:
        """Every rank writes its own rows into one snapshot; rank 0 makes it current once all have succeeded.

        ``path`` must be on a file system every rank sees. ``extra`` (e.g. the dense model, replicated in
        data-parallel training) is taken from rank 0. The layout is the one single-process checkpoints use,
        with each table in one shard per rank: it restores on any number of ranks, or on one process. A dynamic
        table is stored whole, as one process stores it, merged on rank 0 (see
        :mod:`embedcore.distributed.checkpoint`). If any rank fails (or stops answering) before every rank has
        written its part, nothing is committed and the previous checkpoint stays current. ``incremental=True``
        (delta saves, :meth:`embedcore.Embedding.save`) is refused on every rank alike: sharded engines write
        full snapshots, and read delta chains written by one process.
        """
        with self._exclusive("save"):
            return _checkpoint.save(self, path, extra, metadata, incremental)

    def load(self, path, strict: bool = True, convert_dtypes: bool = False) -> None:
        """Load this rank's rows of a checkpoint written by any number of ranks (or one process); of a dynamic
        table, the keys this rank owns (refused on every rank if some rank owns more than its capacity).

        Verified on every rank before anything changes; refused on every rank if any rank finds it corrupt
        or incompatible, or if the ranks read different checkpoints. Contexts of lookups made before a
        successful ``load`` are refused by :meth:`apply_gradients`. ``convert_dtypes``: as
        :meth:`embedcore.Embedding.load`.
        """
        with self._exclusive("load"):
            _checkpoint.load(self, path, strict, convert_dtypes)
            self._tables_replaced()

    @classmethod
    def restore(cls, path, *, comm=None, functions=None, allow_import: bool = False, timeout: float = 120.0):
        """A sharded engine built from a checkpoint's configuration (see ``Embedding.restore``)."""
        return _checkpoint.restore(cls, path, _world_comm(comm), functions, allow_import, timeout)

    # -- lookup ------------------------------------------------------------------------------------------
    def lookup(self, features, weights=None, *, training: bool = True):
        """This rank's activations for its local batch, and the context for :meth:`apply_gradients`.

        A context stays valid until its gradients are applied, whatever lookups come in between (a lookup
        made while an earlier one's gradients are pending copies the earlier one's routing first).
        ``training=False``: a read-only lookup, as :meth:`embedcore.Embedding.lookup`'s (no table changes on
        any rank; its context cannot be applied). Every rank must pass the same ``training``, as it must look
        up the same features.
        """
        if not isinstance(training, (bool, np.bool_)):
            raise inputs.InputTypeError(f"training must be True or False, got {training!r}")
        with self._exclusive("lookup"):
            return self._lookup(features, weights, bool(training))

    def _lookup(self, features, weights, training=True):
        ex, layout, ws = self._exchange, self._layout, self._workspace
        pending = self._pending() if self._pending is not None else None
        if pending is not None:
            pending.detach()
        self._pending = None

        n_static = self._n_static

        def requests():
            slots, parts = self._prepare(features, weights)
            batches = [inputs.build_table_batch(p, w, self.tuning)
                       for p, w in zip(parts[:n_static], self._batch_workspaces)]
            dynamic = self._dynamic.request(parts[n_static:]) if self._dynamic else (None, None)
            return slots, *route_requests(layout, self._spaces[:n_static], batches, ws, self._lookups + 1), *dynamic
        result, error, exc = _attempt(requests)
        try:
            route = result[1] if result else None
            route_ids_from = ex.counts(route.ids_to if route else None, error, "lookup")
            elements = max(int(route.ids_to.sum()), int(route_ids_from.sum())) * layout.max_dim
            if self._dynamic:
                elements = max(elements, self._dynamic.sizes(result[3]))
            ex.check_sizes(elements, "lookup")
        except DistributedError as e:
            raise e from exc
        slots, route, send_ids, dynamic_route, send_keys = result
        route.ids_from = route_ids_from
        acts = []
        if self._dynamic:
            acts = self._lookup_dynamic(dynamic_route, send_keys, training)
        with self._going_ahead("lookup"):
            acts = self._fetch(route, send_ids) + acts
        self._lookups = route.seq
        self._pending = weakref.ref(route)
        activations = [acts[s.group][s.out_offset:s.out_offset + s.n_rows].reshape(s.shape) for s in slots]
        table_batches = [g["tb"] for g in route.groups] + (
            [r.tb for r in dynamic_route.requests] if dynamic_route else [])
        ctx = ShardedLookupContext(self._token, self._generation, table_batches, slots, route=route,
                                   dynamic_route=dynamic_route, training=training)
        return inputs.unflatten(self._feature_config, activations), ctx

    def _lookup_dynamic(self, route, send_keys, training=True) -> list:
        """The dynamic tables' part of a lookup (see :mod:`.dynamic`): keys to their owners, the owners' plans
        (or, ``training`` False, reads) agreed on by every rank (a refusal anywhere undoes them all), then rows
        back; the activations."""
        dyn = self._dynamic
        with self._going_ahead("lookup (dynamic keys)"):
            dyn.exchange_keys(self._exchange, route, send_keys)
        read = dyn.plan if training else dyn.read_only
        _, error, exc = _attempt(lambda: read(route, self.step))
        try:
            self._agreed(error, exc, "lookup")
        except DistributedError:
            dyn.cancel(route)
            raise
        with self._going_ahead("lookup (dynamic rows)"):
            return dyn.commit_and_answer(self._exchange, route)

    def _fetch(self, route, send_ids):
        """Send the requests, answer the peers' and combine the activations from the rows that come back."""
        ex, layout, ws = self._exchange, self._layout, self._workspace
        recv_ids = ws.array("recv_ids", int(route.ids_from.sum()), np.int64)
        ex.alltoallv(send_ids, route.ids_to, recv_ids, route.ids_from, "lookup (ids)")
        resolve(layout, route, recv_ids, ws)
        answer = ws.array("answer", int(route.floats_to.sum()), np.float32)
        for k, table in enumerate(self._shard_tables):
            lo, hi = route.group_ptr[k], route.group_ptr[k + 1]
            rows_to_flat(table.kernel_weights, route.own_rows[lo:hi], route.own_offset[lo:hi], answer, table.decode)
        received = ws.array("rows_in", int(route.floats_from.sum()), np.float32)
        ex.alltoallv(answer, route.floats_to, received, route.floats_from, "lookup (rows)")
        acts = []
        for k, (space, g) in enumerate(zip(self._spaces[:self._n_static], route.groups)):
            tb = g["tb"]
            rows_u = ws.array(f"rows_{k}", (g["uniq"].shape[0], space.dim), np.float32)
            flat_to_rows(received, g["row_offset"], rows_u)
            occurrence = ws.array(f"occurrence_{k}", tb.rows.shape[0], np.int64)
            occurrence_unique(g["ptr"], g["order"], occurrence)
            act = aligned_zeros((tb.n_out, space.dim), np.float32)
            if tb.n_out:
                gather_combine(rows_u, occurrence, tb.gains, tb.out_ptr, act)
            acts.append(act)
        return acts

    # -- update ------------------------------------------------------------------------------------------
    def apply_gradients(self, gradients, ctx: LookupContext):
        """Apply this rank's activation gradients; every rank must call it for the same lookup.

        A feature's gradient may be None, as for :meth:`embedcore.Embedding.apply_gradients` (its
        occurrences on this rank are left out; a row is updated when some rank's occurrence of it has a
        gradient), for the same features on every rank (else refused on every rank, nothing changed).
        A lookup-only engine raises ``RuntimeError`` on every rank, entering no collective.
        """
        if self.lookup_only:
            raise refuse_lookup_only(self)
        with self._exclusive("apply_gradients"):
            return self._apply(gradients, ctx)

    def _checked_gradients(self, gradients, ctx):
        """The checked gradients (None for a feature without one) and every local optimizer's learning rate
        and hyperparameters for the next step: all evaluated before the ranks agree (callables once per step
        on every rank, whether or not this rank owns rows of the batch, and a failing one refused everywhere
        with nothing changed)."""
        self._check_context(ctx, ShardedLookupContext)
        if ctx.dynamic_route is not None:
            stale = self._dynamic.stale(ctx.dynamic_route)
            if stale:
                raise inputs.InputError(stale)
        leaves = inputs.flatten_like(self._feature_config, gradients, "gradients")
        refuse = self.non_finite == "raise"
        checked = [None if grad is None else check_gradient(grad, s, refuse) for grad, s in zip(leaves, ctx.features)]
        values = {}
        for table in self._physical:
            if id(table.optimizer) not in values:
                values[id(table.optimizer)] = table.optimizer.step_values(self.step + 1)
        return checked, values

    def _apply(self, gradients, ctx):
        result, error, exc = _attempt(lambda: self._checked_gradients(gradients, ctx))
        checked, values = result if result is not None else (None, None)
        without = [] if error is not None else [s.config.name or s.path for grad, s in zip(checked, ctx.features)
                                                if grad is None]
        seq = ctx.route.seq if error is None else -1
        tag = -1 if error is not None else _gradients_tag(seq, without, len(ctx.features))
        self._agreed(error, exc, "apply_gradients", tag=tag,
                     tag_text=lambda: f"applies the gradients of this engine's lookup number {seq}" +
                     (f" with no gradient (None) for feature(s) {without}" if without else ""))
        route = ctx.route
        step = self.step + 1
        with self._going_ahead("apply_gradients"):
            report, failing = self._exchange_and_update(route, checked, ctx.features, step, values)
            if self._dynamic and not all(grad is None for grad in checked):
                failing |= self._dynamic.update(self._exchange, ctx.dynamic_route, checked, ctx.features, step,
                                                values, report)
            failing = " and ".join(sorted(failing))
        self.step = step
        ctx.consumed = True
        if self._pending is not None and self._pending() is route:
            self._pending = None
        report.tally(self.skipped_rows)
        message = "; ".join(([_ROW_FUNCTION + report.describe_failed(failing)] if failing else []) +
                            ([report.describe()] if report.skipped and self.non_finite == "raise" else [])) or None
        try:
            self._exchange.agree(message, "the update",
                                 outcome="reported rows left unchanged or a failing row function")
        except Refused as e:  # a timeout or a failed exchange stays a DistributedError
            kind = RowFunctionError if _ROW_FUNCTION in str(e) else NonFiniteError
            error = kind(f"{e}. The other rows were updated and step is now {step} on every rank" +
                         ("; non_finite='skip' skips NaN/Inf rows and reports them instead"
                          if kind is NonFiniteError else "; these gradients cannot be applied again"))
            error.report = report  # this rank's rows
            raise error from None
        return report

    def _exchange_and_update(self, route: Route, checked, features, step, values):
        """Sum this rank's gradients per unique id, send the sums to the owners, update this rank's shards.

        When some feature's gradient is None (the same ones on every rank: agreed), each id also travels with
        whether any of its occurrences here has a gradient, and owners update only the rows some rank says
        so of; when every one is None (on every rank, then), nothing travels and nothing is updated."""
        if all(grad is None for grad in checked):
            return UpdateReport(step), set()
        ws = self._workspace
        sums_out = ws.array("grads_out", int(route.floats_from.sum()), np.float32)
        for k, (space, g) in enumerate(zip(self._spaces[:self._n_static], route.groups)):
            tb = g["tb"]
            d_act = gradient_rows(k, tb.n_out, space.dim, space.workspace, checked, features)
            sums = ws.array(f"sums_{k}", (g["uniq"].shape[0], space.dim), np.float32)
            if sums.shape[0]:
                sum_gradients(sums, g["ptr"], g["order"], tb.out_row, tb.gains, d_act)
            rows_to_flat(sums, self._constants.get(sums.shape[0])[0], g["row_offset"], sums_out)
        sums_in = ws.array("grads_in", int(route.floats_to.sum()), np.float32)
        self._exchange.alltoallv(sums_out, route.floats_from, sums_in, route.floats_to,
                                 "apply_gradients (gradient sums)")
        with_gradient = None
        if any(grad is None for grad in checked):
            with_gradient = self._requests_with_gradient(route, checked, features)
        return self._update_shards(route, sums_in, step, values, with_gradient)

    def _requests_with_gradient(self, route: Route, checked, features) -> np.ndarray:
        """Owner side, per request of ``route`` (in ``own_rows`` order): whether the requesting rank had an
        occurrence of the id in a feature whose gradient is not None. One all-to-all-v of a byte per id."""
        offsets, has = [], []
        for k, g in enumerate(route.groups):
            tb, uniq = g["tb"], g["uniq"]
            if uniq.shape[0] == 0:
                continue
            active = np.ones(tb.n_out, bool)
            for grad, s in zip(checked, features):
                if s.group == k and grad is None:
                    active[s.out_offset:s.out_offset + s.n_rows] = False
            occurrence_has = active[tb.out_row][g["order"]]  # in unique-row order: order[ptr[u]:ptr[u + 1]]
            has.append(np.maximum.reduceat(occurrence_has, g["ptr"][:-1]))
            offsets.append(g["row_offset"])
        # Ids leave for each peer in the order of their rows' offsets in the flat buffer (routing.place_ids),
        # and arrive likewise: sorting by offset gives the id order on both sides.
        send = np.zeros(int(route.ids_to.sum()), np.uint8)
        if offsets:
            send[:] = np.concatenate(has)[np.argsort(np.concatenate(offsets), kind="stable")]
        received = np.empty(int(route.ids_from.sum()), np.uint8)
        self._exchange.alltoallv(send, route.ids_to, received, route.ids_from,
                                 "apply_gradients (which ids have a gradient)")
        own = np.empty(received.shape[0], bool)
        own[np.argsort(route.own_offset, kind="stable")] = received.astype(bool)
        return own

    def _update_shards(self, route: Route, sums_in, step, values, with_gradient=None):
        """Update each of this rank's physical tables with the gradient sums it received (each a batch of one
        occurrence per sum, of gain 1, in rank order: a row's sums are summed in rank order).

        ``with_gradient`` (per request, None: all) leaves out the sums of ids whose requester had no
        gradient for them (a non-lazy table still updates all its rows).

        Returns the report (global row ids) and the set of names of the row functions that failed on some rows
        of this rank's shards (raised, or returned rows of the wrong length: ``report.failed``), if any.
        """
        report = UpdateReport(step)
        failing = set()
        for k, table in enumerate(self._shard_tables):
            lo, hi = int(route.group_ptr[k]), int(route.group_ptr[k + 1])
            rows, offsets = route.own_rows[lo:hi], route.own_offset[lo:hi]
            if with_gradient is not None:
                keep = with_gradient[lo:hi]
                rows, offsets = rows[keep], offsets[keep]
            n = rows.shape[0]
            if n == 0 and table.optimizer.lazy:
                continue
            lr, hyper = values[id(table.optimizer)]
            d_act = self._workspace.array(f"owner_sums_{k}", (n, table.dim), np.float32)
            flat_to_rows(sums_in, offsets, d_act)
            sums = inputs.TableBatch(rows, None, self._constants.get(n + 1)[0], n)
            update = table.update(sums, d_act, lr, hyper, step)
            report.add(update)
            if update.function is not None:
                failing.add(update.function)
        return report, failing
