"""Checkpoints of a ``ShardedEmbedding``: every rank writes its rows; one commit, only when all succeeded.

The layout is that of single-process checkpoints (:mod:`embedcore.checkpoint`) with each table in one shard
per rank (``table-XXXX-shard-RRRRR-of-KKKKK``, recording first row, stride and rows), so a checkpoint written
by K ranks loads on any number of ranks, or in one process. Every step that can fail on one rank is agreed
on by all before the next begins; rank 0 replaces ``CURRENT`` only after every rank has reported that its
shards are written (with their SHA-256), so a failure anywhere before that leaves the previous checkpoint
current and the half-written snapshot is removed (or, if rank 0 died, pruned by the next successful save).

Dynamic tables are stored as a single process stores them (:mod:`embedcore.checkpoint.dynamic`: one file per
table, keys increasing), merged from every rank's keys (:func:`merged_dynamic_states`): rank 0 gathers the
ranks' keys, rows, slots and metadata and writes the file, so it holds the whole table while saving. The row
slots are not kept (the merged keys take rows ``0 .. n - 1`` in key order: only 16-bit stochastic rounding,
keyed by the slot, can tell). On load each of M ranks keeps the keys it owns under M
(:func:`~.dynamic.key_owners`); a rank owning more keys than its capacity refuses the load on every rank.
Admission sketches: counters are sums over the keys counted, and each key is counted only by its owner, so
the sum of the ranks' counters is the one-process sketch. Every rank loads the whole merged sketch (an
over-count for its own keys only where other ranks' keys share its counters: what any count-min sketch
allows) and remembers it as its *base*; a save stores ``base + sum over ranks of (counters - base)``, so a
K -> M -> K' chain neither loses nor repeats counts (as long as no counter saturates).

Incremental saves (:mod:`embedcore.checkpoint.delta`) are not written by sharded engines (``incremental=True``
is refused on every rank alike, before anything is exchanged or written); delta chains written by one
process are read here as by every reader (:func:`~embedcore.checkpoint.table_rows` composes them).

Reading checks what single-process reading checks (the whole manifest, sizes against files and memory,
hashes, NaN/Inf, only embedcore classes called) on every rank, and the ranks agree on the outcome and on
having read the same snapshot before any of them changes.
"""

from __future__ import annotations

import functools
import json
import math
import zlib

import numpy as np

from ..checkpoint import (_EXTRA, CheckpointError, as_stored, check_compatible, check_dynamic_kinds, check_save_inputs,
                          manifest_of, read_current, stage_dynamic, stored_shapes, table_rows, write_table_shards)
from ..checkpoint.dynamic import dynamic_file_name, read_state, write_dynamic_table
from ..tables.dynamic import DynamicTableState
from ..checkpoint.config_codec import FunctionResolver, decode_engine_config
from ..checkpoint.store import SnapshotWriter
from ..memory_budget import check_fits
from .dynamic import key_owners
from .exchange import DistributedError, Exchanger, describe_error
from .sharding import shard_of

__all__ = ["save", "load", "restore", "gather_tables"]


def _agree(ex: Exchanger, error, exc, what, **tag):
    try:
        ex.agree(error, what, **tag)
    except DistributedError as e:
        raise e from exc


def _snapshot_tag(snap) -> int:
    """A number naming the snapshot (its name and manifest), equal on ranks that read the same one."""
    return zlib.crc32(json.dumps([snap.name, snap.manifest], sort_keys=True, default=str).encode("utf-8"))


def local_dynamic_states(emb) -> dict:
    """Table name -> this rank's :class:`DynamicTableState` of each dynamic table, TTL tables' rows expired
    at the engine's step removed first (as a single-process save does)."""
    out = {}
    for table in emb._dynamic.tables:
        table.remove_expired(emb.step)
        out[table.name] = table.state()
    return out


def merged_dynamic_states(emb, states: dict, root: int = 0):
    """Collective: every rank's ``states`` (:func:`local_dynamic_states`) merged on ``root`` into one state per
    table, as one process holding all the keys would store it (keys increasing, rows ``0 .. n - 1``, no free
    rows, the sketch as the module docstring says); ``None`` elsewhere."""
    ex = emb.exchange
    out = {}
    for table, base in zip(emb._dynamic.tables, emb._dynamic.sketch_bases):
        state = states[table.name]
        parts = {"keys": state.keys, "weights": state.weights, "last_seen": state.last_seen, "counts": state.counts}
        parts.update({f"slot/{s}": v for s, v in state.slots.items()})
        if state.sketch is not None:
            parts["sketch"] = state.sketch
        gathered = {key: ex.gather_bytes(np.ascontiguousarray(a).tobytes(), root,
                                         f"save (gathering dynamic table '{table.name}')")
                    for key, a in parts.items()}
        if emb.rank != root:
            continue
        whole = {key: [np.frombuffer(b, parts[key].dtype).reshape((-1,) + parts[key].shape[1:]) for b in blobs]
                 for key, blobs in gathered.items()}
        sketch = whole.pop("sketch", None)
        whole = {key: np.concatenate(arrays) for key, arrays in whole.items()}
        order = np.argsort(whole["keys"], kind="stable")
        whole = {key: a[order] for key, a in whole.items()}
        n = order.shape[0]
        out[table.name] = DynamicTableState(
            whole["keys"], whole["weights"], {s: whole[f"slot/{s}"] for s in state.slots}, whole["last_seen"],
            whole["counts"], np.arange(n, dtype=np.int64), np.zeros(0, np.int64),
            None if sketch is None else merge_sketches(sketch, base))
    return out if emb.rank == root else None


def merge_sketches(counters: list, base) -> np.ndarray:
    """``base + sum_r (counters[r] - base)`` (``base`` None: zeros), saturating in uint32: the counts every
    rank added since the sketch was ``base`` on all of them, on top of ``base``."""
    total = np.sum([c.reshape(counters[0].shape).astype(np.int64) for c in counters], axis=0)
    if base is not None:
        total -= (len(counters) - 1) * base.astype(np.int64)
    return np.clip(total, 0, np.iinfo(np.uint32).max).astype(np.uint32)


def write_merged_dynamic(writer, emb, merged: dict) -> dict:
    """Write the merged states (on the root) as a single process writes its dynamic tables; their entries."""
    return {name: write_dynamic_table(writer, dynamic_file_name(k), emb.tables[name], state)
            for k, (name, state) in enumerate(merged.items())}


def stage_owned_dynamic(emb, snap, convert_dtypes: bool) -> list:
    """Check the snapshot's dynamic tables and stage, per table, the keys this rank owns under the engine's
    world size; returns functions of no arguments that load them (and the sketch bases). Refusals are
    :class:`CheckpointError` naming the table and the rank, and change nothing."""
    dyn = emb._dynamic
    check_dynamic_kinds(snap, {t.name: t for t in dyn.tables}, emb.seed)
    applies = []
    for d, table in enumerate(dyn.tables):
        state = read_state(snap, table.name)
        mine = np.flatnonzero(key_owners(np.asarray(state.keys), emb.world_size) == emb.rank)
        where = f"{snap.dir}: table '{table.name}' (rank {emb.rank} of {emb.world_size})"
        if mine.shape[0] > table.key_map.capacity:
            raise CheckpointError(f"{where}: this rank owns {mine.shape[0]} of the checkpoint's {state.n} keys but "
                                  f"holds only {table.key_map.capacity} rows; restore on a world size that spreads "
                                  f"them thinner, or build the engine with a larger capacity and load(strict=False)")
        owned = DynamicTableState(
            np.asarray(state.keys)[mine], np.asarray(state.weights)[mine],
            {s: np.asarray(v)[mine] for s, v in state.slots.items()}, np.asarray(state.last_seen)[mine],
            np.asarray(state.counts)[mine], np.arange(mine.shape[0], dtype=np.int64), np.zeros(0, np.int64),
            None if state.sketch is None else np.array(state.sketch))
        apply = stage_dynamic(owned, where, table, convert_dtypes)
        applies.append(apply)
        applies.append(functools.partial(dyn.set_sketch_base, d, owned.sketch))
    return applies


def save(emb, path, extra, metadata, incremental: bool = False) -> str:
    """See :meth:`ShardedEmbedding.save`."""
    if incremental:  # the same argument on every rank: all refuse alike, nothing to agree on
        raise CheckpointError(f"incremental saves of a {type(emb).__name__} are not supported: save(path) writes "
                              f"every rank's rows (sharded engines do read delta chains saved by one process)")
    ex, rank, step = emb.exchange, emb.rank, emb.step
    writer, error, exc = None, None, None
    states = {}
    try:
        extra = check_save_inputs(extra if rank == 0 else None, metadata, step)
        states = local_dynamic_states(emb)
        if rank == 0:
            writer = SnapshotWriter(path, step)
    except Exception as e:
        error, exc = describe_error(e), e
    try:
        _agree(ex, error, exc, "save", tag=step, tag_text=lambda: f"saves at step {step}")
        name = ex.bcast_bytes(writer.name.encode("utf-8") if rank == 0 else None, 0, "save").decode("utf-8")
        merged = merged_dynamic_states(emb, states, 0)
        error = exc = None
        try:
            if writer is None:
                writer = SnapshotWriter.attach(path, name)
            shards = {n: (s.first, s.stride, s.rows) for n, s in emb.shards.items()}
            entries = write_table_shards(writer, {n: emb.tables[n] for n in emb.shards}, emb.embedding_tables,
                                         emb.slot_variables, shards,
                                         suffix=f"-shard-{rank:05d}-of-{emb.world_size:05d}")
            if rank == 0:
                entries.update(write_merged_dynamic(writer, emb, merged))
            if rank == 0 and extra:
                writer.add(_EXTRA, extra)
        except Exception as e:
            error, exc = describe_error(e), e
        _agree(ex, error, exc, "save (writing shards)")
        parts = ex.gather_bytes(json.dumps([entries, writer.files]).encode("utf-8"), 0, "save (collecting digests)")
    except DistributedError:
        if rank == 0 and writer is not None:
            writer.abort()
        raise
    error = exc = None
    if rank == 0:
        try:
            merged = {}
            for part in parts:
                part_entries, files = json.loads(part)
                writer.files.update(files)
                for table, entry in part_entries.items():
                    merged.setdefault(table, dict(entry, shards=[]))["shards"] += entry["shards"]
            writer.commit(manifest_of(step, emb.config, merged, _EXTRA if extra else None, metadata))
        except Exception as e:
            writer.abort()
            error, exc = describe_error(e), e
    _agree(ex, error, exc, "save (commit)")
    return writer.dir


def load(emb, path, strict: bool, convert_dtypes: bool = False) -> None:
    """See :meth:`ShardedEmbedding.load`."""
    staged, applies, snap = [], [], None

    def read(current):
        staged.clear()  # a read restarted on a newer snapshot (read_current) stages everything anew
        slots = emb.slot_variables
        check_compatible(current, emb.config, {n: list(v) for n, v in slots.items()}, strict, convert_dtypes)
        applies[:] = stage_owned_dynamic(emb, current, convert_dtypes)
        for name, table in emb.embedding_tables.items():
            if name not in emb.shards:
                continue
            shard = emb.shards[name]
            targets = {"weights": table}
            targets.update({f"slot/{s}": v for s, v in slots[name].items()})
            for key, target in targets.items():
                rows = table_rows(current, name, key, shard.first, shard.stride, shard.rows)
                if rows.shape != target.shape:
                    raise CheckpointError(f"{current.dir}: table '{name}' tensor '{key}' rows have shape "
                                          f"{rows.shape[1:]}, the engine needs {target.shape[1:]}")
                staged.append((target, as_stored(target, rows, f"{current.dir}: table '{name}' tensor '{key}'",
                                                 convert_dtypes)))
        return current

    def stage():
        nonlocal snap
        snap = read_current(path, read)
    error = exc = None
    try:
        stage()
    except Exception as e:
        error, exc = describe_error(e), e
    tag = _snapshot_tag(snap) if snap is not None else 0
    _agree(emb.exchange, error, exc, "load", tag=tag,
           tag_text=lambda: f"read snapshot {snap.name} of {snap.path}")
    for target, rows in staged:
        target[...] = rows
    for apply in applies:
        apply()
    emb.step = snap.step


def restore(cls, path, comm, functions, allow_import: bool, timeout: float):
    """See :meth:`ShardedEmbedding.restore`."""
    ex = Exchanger(comm, timeout)
    config, error, exc = None, None, None
    try:
        def read(snap):
            shapes = stored_shapes(snap)  # this rank holds at most ceil(1/world) of every table's rows and slots
            total = sum(4 * -(-shape[0] // ex.world) * math.prod(shape[1:])  # float32 at most
                        for tensors in shapes.values() for shape in tensors.values())
            check_fits(total, f"restoring {snap.dir} on rank {ex.rank} of {ex.world} (its rows of tables "
                              f"{sorted(shapes)[:5]} with their slots)", error=CheckpointError)
            return snap.manifest["config"], decode_engine_config(snap.manifest["config"],
                                                                 FunctionResolver(functions, allow_import))
        config, (features, optimizer, seed) = read_current(path, read)
    except Exception as e:
        error, exc = describe_error(e), e
    _agree(ex, error, exc, "restore")
    emb = cls(features, optimizer, comm=comm, seed=seed, timeout=timeout,
              non_finite=config.get("non_finite", "raise"))
    load(emb, path, strict=False)
    return emb


def _as_wire(array: np.ndarray) -> np.ndarray:
    """``array`` flat as the exchange sends it: float32 as is, a 16-bit format as its bytes (same memory)."""
    return array.reshape(-1) if array.dtype == np.float32 else array.reshape(-1).view(np.uint8)


def _gather_dynamic(emb, name: str, root: int):
    """A dynamic table's keys held on every rank, merged, and their rows and slots' values, on ``root``:
    ``(keys, weights, {slot: values})`` (keys increasing as int64; ``None`` elsewhere)."""
    ex = emb.exchange
    view, slot_views = emb.embedding_tables[name], emb.slot_variables[name]
    keys = view.keys()
    parts = {"keys": keys, "weights": view[keys]}
    parts.update({slot: v[keys] for slot, v in slot_views.items()})
    gathered = {key: ex.gather_bytes(np.ascontiguousarray(a).tobytes(), root, f"gather_tables ({name}, {key})")
                for key, a in parts.items()}
    if emb.rank != root:
        return None
    merged = {key: np.concatenate([np.frombuffer(b, parts[key].dtype).reshape((-1,) + parts[key].shape[1:])
                                   for b in gathered[key]]) for key in parts}
    order = np.argsort(merged["keys"], kind="stable")
    whole = {key: a[order] for key, a in merged.items()}
    return whole.pop("keys"), whole.pop("weights"), whole


def gather_tables(emb, root: int):
    """See :meth:`ShardedEmbedding.gather_tables`: one gather per tensor, sizes known from the sharding rule
    (a dynamic table's: sizes first, :func:`_gather_dynamic`)."""
    ex, world = emb.exchange, emb.world_size
    out = {}
    tables, slots = emb.embedding_tables, emb.slot_variables
    for name, config in emb.tables.items():
        if name not in emb.shards:
            out[name] = _gather_dynamic(emb, name, root)
            continue
        rot = emb.rotation(name)
        shards = [shard_of(config.vocabulary_size, world, k, rot) for k in range(world)]
        whole = {}
        for key, part in [("weights", tables[name])] + list(slots[name].items()):
            width = int(np.prod(part.shape[1:], dtype=np.int64))
            counts = np.array([s.rows * width for s in shards], np.int64)
            recv = np.empty(int(counts.sum()) if emb.rank == root else 0, part.dtype)
            # 16-bit values travel as their bytes (MPI has no bfloat16, and the exchange sends int64, float32
            # or bytes: their uint16 bits used to raise KeyError)
            wire = 1 if part.dtype == np.float32 else part.dtype.itemsize
            ex.gatherv(_as_wire(np.ascontiguousarray(part)), _as_wire(recv), counts * wire, root,
                       f"gather_tables ({name})")
            if emb.rank == root:
                array = np.empty((config.vocabulary_size,) + part.shape[1:], part.dtype)
                start = 0
                for s in shards:
                    array[s.first::s.stride] = recv[start:start + s.rows * width].reshape((s.rows,) + part.shape[1:])
                    start += s.rows * width
                whole[key] = array
        if emb.rank == root:
            out[name] = (whole.pop("weights"), whole)
    return out if emb.rank == root else None
