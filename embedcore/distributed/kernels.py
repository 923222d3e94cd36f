"""Numba kernels of the sharded exchange: who owns each unique id, where its bytes go, and row copies.

All tables travel in one message per peer and phase. A rank's message to peer ``k`` holds, in the order of
its virtual groups (tables of equal ``dim`` stacked in one id space) and ascending ids within a group, every
unique id it needs from ``k``; the rows and gradient sums of those ids travel in the same order, each row
``dim`` float32 values long, so a message of rows is a flat float32 array with rows of mixed widths.

An id travels as an *exchange id*: ``xbase[t] + r`` for row ``r`` of table ``t`` (tables numbered in the
engine's order, ``xbase`` their cumulative vocabulary sizes), so the owner recovers the table by a binary
search in ``xbase``. Row ``r`` of table ``t`` lives on rank ``(r + rot[t]) % world`` at local index
``r // world`` (see :mod:`.sharding`).
"""

import numpy as np
from numba import njit, prange

from ..kernels.rows import value_of

__all__ = ["count_owners", "place_ids", "resolve_requests", "rows_to_flat", "flat_to_rows",
           "occurrence_unique"]


@njit(cache=True)
def count_owners(uniq, seg, off, rot, world, counts):
    """``counts[k] +=`` the number of ids in ``uniq`` owned by rank ``k``.

    ``uniq``: sorted unique rows of one virtual group; table ``i`` of the group holds group rows
    ``off[i] ..`` and its ids are ``uniq[seg[i]:seg[i + 1]]``; ``rot[i]`` is its rotation.
    """
    for i in range(seg.shape[0] - 1):
        for u in range(seg[i], seg[i + 1]):
            counts[(uniq[u] - off[i] + rot[i]) % world] += 1


@njit(cache=True)
def place_ids(uniq, seg, off, rot, xbase, world, dim, id_cursor, float_cursor, send_ids, row_offset):
    """Write each id of ``uniq`` (as in :func:`count_owners`) as an exchange id into ``send_ids`` at its owner's
    cursor, and record in ``row_offset[u]`` where its row will start in the flat buffer of received rows.

    ``id_cursor[k]`` / ``float_cursor[k]``: the next free id / float position of peer ``k``'s part; both
    advance. ``xbase[i]``: the exchange id of row 0 of table ``i`` of the group.
    """
    for i in range(seg.shape[0] - 1):
        for u in range(seg[i], seg[i + 1]):
            r = uniq[u] - off[i]
            k = (r + rot[i]) % world
            send_ids[id_cursor[k]] = xbase[i] + r
            id_cursor[k] += 1
            row_offset[u] = float_cursor[k]
            float_cursor[k] += dim


@njit(cache=True)
def _table_of(xbase, xid):
    lo, hi = 0, xbase.shape[0] - 1  # xbase[lo] <= xid < xbase[hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if xbase[mid] <= xid:
            lo = mid
        else:
            hi = mid
    return lo


@njit(cache=True)
def resolve_requests(recv_ids, recv_ptr, xbase, group, local_offset, dim, world, group_ptr, own_rows, own_offset,
                     floats_to):
    """The owner's side of a lookup: what each received exchange id means here.

    ``recv_ids[recv_ptr[k]:recv_ptr[k + 1]]`` came from peer ``k``. Table ``t`` lives in local physical
    table ``group[t]`` from row ``local_offset[t]``, rows of ``dim[t]`` values. Outputs, with requests grouped
    by local physical table (in arrival order within one; ``group_ptr`` delimits them, ``len = groups + 1``):
    ``own_rows`` the physical row, ``own_offset`` where the row starts in the flat answer (the answer holds
    the rows in arrival order); ``floats_to[k]`` the floats answered to peer ``k``.
    """
    n_groups = group_ptr.shape[0] - 1
    counts = np.zeros(n_groups, np.int64)
    for k in range(recv_ptr.shape[0] - 1):
        floats = 0
        for j in range(recv_ptr[k], recv_ptr[k + 1]):
            t = _table_of(xbase, recv_ids[j])
            counts[group[t]] += 1
            floats += dim[t]
        floats_to[k] = floats
    group_ptr[0] = 0
    for g in range(n_groups):
        group_ptr[g + 1] = group_ptr[g] + counts[g]
    cursor = group_ptr[:-1].copy()
    offset = 0
    for j in range(recv_ids.shape[0]):
        xid = recv_ids[j]
        t = _table_of(xbase, xid)
        g = group[t]
        p = cursor[g]
        cursor[g] += 1
        own_rows[p] = local_offset[t] + (xid - xbase[t]) // world
        own_offset[p] = offset
        offset += dim[t]


@njit(cache=True, parallel=True)
def rows_to_flat(src, rows, offsets, flat, decode=None):
    """``flat[offsets[i]:offsets[i] + dim] = src[rows[i]]`` for every ``i`` (``decode``: the float32 of a
    16-bit table's bits, see :func:`embedcore.kernels.rows.value_of`)."""
    dim = src.shape[1]
    for i in prange(rows.shape[0]):
        o, r = offsets[i], rows[i]
        for j in range(dim):
            flat[o + j] = value_of(decode, src[r, j])


@njit(cache=True, parallel=True)
def flat_to_rows(flat, offsets, dst):
    """``dst[i] = flat[offsets[i]:offsets[i] + dim]`` for every row ``i`` of ``dst``."""
    dim = dst.shape[1]
    for i in prange(dst.shape[0]):
        o = offsets[i]
        for j in range(dim):
            dst[i, j] = flat[o + j]


@njit(cache=True)
def occurrence_unique(ptr, order, out):
    """``out[o]`` = the unique index of occurrence ``o`` (``order[ptr[u]:ptr[u + 1]]`` are those of ``u``)."""
    for u in range(ptr.shape[0] - 1):
        for p in range(ptr[u], ptr[u + 1]):
            out[order[p]] = u
