"""Where every id of a step goes: the tables' static layout, and what one lookup leaves for its update.

A rank plays two roles in every step: *requester* of the unique ids of its own batch, and *owner* of its
shards, answering the requests of every rank (itself included). :class:`Layout` holds what never changes
(exchange id bases, rotations, where each table lives in this rank's stacked shards); :class:`Route` holds
one lookup's routing, which its ``apply_gradients`` reuses: the gradient sums travel exactly the way the ids
did, so no sizes need exchanging again.

A route's arrays are views of workspaces that the next lookup overwrites. A lookup therefore first calls
:meth:`Route.detach` on the previous route if its gradients were not applied yet (a copy, paid only then),
so every context stays valid until its ``apply_gradients``, however many lookups come in between.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels.dedup import unique_rows
from .kernels import count_owners, place_ids, resolve_requests
from .exchange import displacements

__all__ = ["Layout", "Route", "route_requests", "resolve"]


class Layout:
    """Static routing facts of a sharded engine.

    Args:
        groups: the lookup's id spaces (tables of equal ``dim`` stacked in one id space each).
        tables: every table, in the engine's order (exchange ids number their rows in this order).
        rotation: table name -> its rotation.
        local: the rank's physical tables over its shards (:class:`~embedcore.tables.PhysicalTable`).
    """

    def __init__(self, groups, tables, rotation, local, world):
        self.world = world
        index = {t.name: i for i, t in enumerate(tables)}
        sizes = np.array([t.vocabulary_size for t in tables], np.int64)
        self.xbase = np.zeros(len(tables) + 1, np.int64)
        np.cumsum(sizes, out=self.xbase[1:])
        self.groups = []
        for group in groups:
            self.groups.append({
                "off": np.array(group.offsets, np.int64),
                "rot": np.array([rotation[t.name] for t in group.tables], np.int64),
                "xbase": np.array([self.xbase[index[t.name]] for t in group.tables], np.int64),
                "dim": group.dim})
        holder = {name: (k, table.place(name).offset) for k, table in enumerate(local) for name in table.table_names}
        self.table_group = np.empty(len(tables), np.int64)
        self.table_offset = np.empty(len(tables), np.int64)
        self.table_dim = np.array([t.dim for t in tables], np.int64)
        for i, t in enumerate(tables):
            self.table_group[i], self.table_offset[i] = holder[t.name]
        self.n_local = len(local)
        self.max_dim = int(self.table_dim.max()) if len(tables) else 0  # an engine of dynamic tables only


class Route:
    """One lookup's routing on this rank.

    Requester side, per id space: the table batch ``tb`` (occurrences), its unique rows ``uniq`` with occurrences
    ``order[ptr[u]:ptr[u + 1]]``, and ``row_offset[u]``: where unique row ``u``'s values start in the flat
    buffer of rows received (and of gradient sums sent). Per peer ``k``: ``ids_to[k]`` ids asked of it,
    ``floats_from[k]`` row values received from it (= gradient values sent to it).

    Owner side: ``ids_from[k]`` ids peer ``k`` asked here, ``floats_to[k]`` row values answered (= gradient
    values received); ``own_rows`` / ``own_offset`` the physical row and flat offset of every request,
    grouped by local physical table (``group_ptr``), in rank order within each.
    """

    _VIEWS = ("uniq", "ptr", "order", "row_offset")

    def __init__(self, seq: int):
        self.seq = seq
        self.groups = []
        self.ids_to = self.ids_from = self.floats_from = self.floats_to = None
        self.own_rows = self.own_offset = self.group_ptr = None
        self.detached = False

    def detach(self) -> None:
        """Copy the arrays that live in workspaces, so later lookups cannot overwrite them."""
        if self.detached:
            return
        for g in self.groups:
            for key in self._VIEWS:
                g[key] = g[key].copy()
            tb = g["tb"]
            packed = None if tb.packed is None else tb.packed.copy()  # None: every gain 1
            g["tb"] = dataclasses.replace(tb, rows=tb.rows.copy(), packed=packed, out_ptr=tb.out_ptr.copy())
        self.own_rows, self.own_offset = self.own_rows.copy(), self.own_offset.copy()
        self.detached = True

    def bytes_moved(self, rank: int) -> dict:
        """Bytes this rank sends and receives in the lookup and update of this route, to / from other ranks
        (``remote``) and including itself (``all``): ids 8 B, row values and gradient values 4 B each."""
        def split(x):
            return int(x.sum() - x[rank]), int(x.sum())
        out = {}
        for scope, i in (("remote", 0), ("all", 1)):
            out[scope] = {"ids_sent": 8 * split(self.ids_to)[i], "ids_received": 8 * split(self.ids_from)[i],
                          "rows_sent": 4 * split(self.floats_to)[i], "rows_received": 4 * split(self.floats_from)[i],
                          "grads_sent": 4 * split(self.floats_from)[i], "grads_received": 4 * split(self.floats_to)[i]}
        return out


def route_requests(layout: Layout, groups, batches, workspace, seq: int) -> tuple:
    """Dedup each id space's batch and lay out this rank's requests, peer by peer.

    Returns ``(route, send_ids)``: the route's requester side and the exchange ids to send (peer-major).
    """
    world = layout.world
    route = Route(seq)
    ids_to = np.zeros(world, np.int64)
    for group, facts, tb in zip(groups, layout.groups, batches):
        uniq, ptr, order = unique_rows(tb.rows, group.n_rows, group.workspace)
        seg = np.searchsorted(uniq, np.append(facts["off"], group.n_rows))
        per_peer = np.zeros(world, np.int64)
        count_owners(uniq, seg, facts["off"], facts["rot"], world, per_peer)
        route.groups.append({"tb": tb, "uniq": uniq, "ptr": ptr, "order": order, "seg": seg, "per_peer": per_peer})
        ids_to += per_peer
    route.ids_to = ids_to
    floats = np.zeros(world, np.int64)
    for g, facts in zip(route.groups, layout.groups):
        floats += g["per_peer"] * facts["dim"]
    route.floats_from = floats
    id_cursor, float_cursor = displacements(ids_to), displacements(floats)
    send_ids = workspace.array("send_ids", int(ids_to.sum()), np.int64)
    for k, (g, facts) in enumerate(zip(route.groups, layout.groups)):
        g["row_offset"] = workspace.array(f"row_offset_{k}", g["uniq"].shape[0], np.int64)
        place_ids(g["uniq"], g.pop("seg"), facts["off"], facts["rot"], facts["xbase"], world, facts["dim"],
                  id_cursor, float_cursor, send_ids, g["row_offset"])
        del g["per_peer"]
    return route, send_ids


def resolve(layout: Layout, route: Route, recv_ids, workspace) -> None:
    """Fill the owner side of ``route`` from the exchange ids received (``route.ids_from`` per peer)."""
    n = recv_ids.shape[0]
    route.own_rows = workspace.array("own_rows", n, np.int64)
    route.own_offset = workspace.array("own_offset", n, np.int64)
    route.group_ptr = np.empty(layout.n_local + 1, np.int64)
    route.floats_to = np.empty(layout.world, np.int64)
    recv_ptr = np.append(displacements(route.ids_from), n)
    resolve_requests(recv_ids, recv_ptr, layout.xbase, layout.table_group, layout.table_offset, layout.table_dim,
                     layout.world, route.group_ptr, route.own_rows, route.own_offset, route.floats_to)
