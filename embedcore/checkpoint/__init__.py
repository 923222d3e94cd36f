"""Checkpoints: tables, slots, step and configuration in a directory of safetensors files, no pickle.

The layout does not depend on stacking or partitioning: each table is stored on its own, rows in id order
(``weights`` ``[vocabulary_size, dim]`` and one ``slot/<name>`` tensor per slot). Writes are atomic and
every tensor is checksummed (:mod:`.store`); the configuration is JSON that names functions by import path
and is imported only when the caller allows it (:mod:`.config_codec`).

Use it through the engine: ``emb.save(path)``, ``emb.load(path)``, ``Embedding.restore(path)``; serving
reads the same files (:mod:`embedcore.serving`).
"""

from __future__ import annotations

import json

import numpy as np

from .config_codec import FunctionResolver, decode_engine_config, encode_engine_config
from .errors import CheckpointError
from .store import Snapshot, SnapshotWriter, open_snapshot
from .tensor_file import STORABLE_DTYPES

__all__ = ["CheckpointError", "save", "load_into", "restore", "read_extra", "open_snapshot", "engine_config",
           "table_tensors", "table_rows", "write_table_shards", "check_save_inputs", "manifest_of",
           "check_compatible"]

_EXTRA = "extra.safetensors"


def engine_config(emb) -> dict:
    config = encode_engine_config(emb._feature_config, list(emb._table_configs.values()), emb._optimizer, emb.seed)
    config["non_finite"] = emb.non_finite
    return config


def check_save_inputs(extra, metadata) -> dict:
    """``extra`` as a dict, after checking it and ``metadata`` can be stored (before anything is written)."""
    extra = dict(extra or {})
    for name, value in extra.items():
        if not isinstance(name, str) or not name or name == "__metadata__" or not isinstance(value, np.ndarray) \
                or value.dtype.newbyteorder("<") not in STORABLE_DTYPES:
            raise CheckpointError(f"extra entry {name!r} ({type(value).__name__}"
                                  f"{', dtype ' + str(value.dtype) if isinstance(value, np.ndarray) else ''}) cannot "
                                  f"be stored: extra maps non-empty names (not '__metadata__') to NumPy arrays of "
                                  f"numbers or booleans")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"metadata must be JSON (dicts, lists, str, int, finite float, bool, None): {e}") from None
    return extra


def write_table_shards(writer, configs: dict, tables: dict, slots: dict, shards: dict, suffix: str = "") -> dict:
    """Write each table's rows (``shards[name] = (first_row, stride, rows)``) and slots as one file each.

    Returns the manifest's ``tables`` entries of this writer's shards.
    """
    entries = {}
    for k, (name, config) in enumerate(configs.items()):
        first, stride, rows = shards[name]
        tensors = {"weights": tables[name][:rows]}
        tensors.update({f"slot/{s}": v[:rows] for s, v in slots[name].items()})
        file_name = f"table-{k:04d}{suffix}.safetensors"
        writer.add(file_name, tensors, {"table": name})
        entries[name] = {"slots": list(slots[name]), "vocabulary_size": config.vocabulary_size, "dim": config.dim,
                         "shards": [{"file": file_name, "first_row": first, "stride": stride, "rows": rows}]}
    return entries


def manifest_of(step: int, config: dict, entries: dict, extra_file, metadata) -> dict:
    from .. import __version__
    return {"step": int(step), "config": config, "tables": entries, "metadata": metadata, "extra": extra_file,
            "embedcore_version": __version__}


def save(emb, path, extra=None, metadata=None) -> str:
    """Write ``emb`` to the checkpoint directory ``path`` (see :meth:`embedcore.Embedding.save`)."""
    config = engine_config(emb)
    extra = check_save_inputs(extra, metadata)
    writer = SnapshotWriter(path, emb.step)
    try:
        whole = {name: (0, 1, t.vocabulary_size) for name, t in emb._table_configs.items()}
        entries = write_table_shards(writer, emb._table_configs, emb.embedding_tables, emb.slot_variables, whole)
        if extra:
            writer.add(_EXTRA, extra)
        return writer.commit(manifest_of(emb.step, config, entries, _EXTRA if extra else None, metadata))
    except BaseException:
        writer.abort()
        raise


def _differences(saved, current, where="config"):
    if isinstance(saved, dict) and isinstance(current, dict):
        for kind in ("optimizer", "initializer"):
            if isinstance(saved.get(kind), str) and isinstance(current.get(kind), str) and saved[kind] != current[kind]:
                return [f"{where}: checkpoint has {saved[kind]}, the engine has {current[kind]}"]
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            if key not in saved or key not in current:
                out.append(f"{where}.{key}: {'missing in the checkpoint' if key not in saved else 'not in the engine'}")
            else:
                out += _differences(saved[key], current[key], f"{where}.{key}")
        return out
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        return [d for i, (a, b) in enumerate(zip(saved, current)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if saved == current else [f"{where}: checkpoint has {saved!r}, the engine has {current!r}"]


def check_compatible(snap: Snapshot, config: dict, slots: dict, strict: bool) -> None:
    """Refuse a checkpoint whose configuration differs from ``config`` (when ``strict``) or whose tables and
    slot names differ from ``slots`` (table name -> slot names)."""
    where = snap.dir
    if strict:
        saved = snap.manifest["config"]
        diffs = _differences({k: v for k, v in saved.items() if k != "seed"},
                             {k: v for k, v in config.items() if k != "seed"})
        if diffs:
            shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
            raise CheckpointError(f"{where} was written by an engine configured differently: {shown}. "
                                  f"Use load(path, strict=False) to load tables and slots of equal shapes anyway")
    entries = snap.manifest["tables"]
    if set(entries) != set(slots):
        raise CheckpointError(f"{where} holds tables {sorted(entries)}, the engine has {sorted(slots)}")
    for name, entry in entries.items():
        if list(entry.get("slots", [])) != list(slots[name]):
            raise CheckpointError(f"{where}: table '{name}' has slots {entry.get('slots')}, the engine's optimizer "
                                  f"has {list(slots[name])}")


def load_into(emb, path_or_snapshot, strict: bool = True) -> None:
    """Copy a checkpoint's tables, slots and step into ``emb`` after verifying all of it."""
    snap = path_or_snapshot if isinstance(path_or_snapshot, Snapshot) else open_snapshot(path_or_snapshot)
    tables, slots = emb.embedding_tables, emb.slot_variables
    check_compatible(snap, engine_config(emb) if strict else {}, {n: list(v) for n, v in slots.items()}, strict)
    staged = []
    for name in snap.manifest["tables"]:
        targets = {"weights": tables[name]}
        targets.update({f"slot/{s}": v for s, v in slots[name].items()})
        arrays = table_tensors(snap, name, {key: t.shape for key, t in targets.items()})
        staged += [(targets[key], arrays[key]) for key in targets]
    # Everything is verified; from here on the engine changes.
    for target, source in staged:
        target[...] = source
    emb.step = snap.step


def _shards(snap: Snapshot, table: str, keys) -> list:
    """The table's shards, checked to partition its rows exactly and to hold ``keys`` as float32."""
    entry = snap.manifest["tables"].get(table)
    if entry is None:
        raise CheckpointError(f"{snap.dir} holds no table '{table}' (it holds {sorted(snap.manifest['tables'])})")
    try:
        vocabulary, dim, shards = int(entry["vocabulary_size"]), int(entry["dim"]), list(entry["shards"])
        stride = int(shards[0]["stride"])
        firsts = sorted(int(sh["first_row"]) for sh in shards)
        ok = stride >= 1 and all(int(sh["stride"]) == stride for sh in shards) and \
            firsts == list(range(stride)) and \
            all(int(sh["rows"]) == len(range(int(sh["first_row"]), vocabulary, stride)) for sh in shards)
    except (KeyError, TypeError, ValueError, IndexError):
        ok = False
    if not ok:
        raise CheckpointError(f"corrupt checkpoint: {snap.dir}: the shards of table '{table}' do not partition "
                              f"its rows")
    for shard in shards:
        stored = snap.manifest["files"].get(shard["file"], {})
        for key in keys:
            if key not in stored:
                raise CheckpointError(f"{snap.dir}: table '{table}' has no tensor '{key}' (its optimizer's slots "
                                      f"are {entry.get('slots')}); the engine needs it")
            shape = tuple(stored[key]["shape"])
            if stored[key]["dtype"] != "float32" or shape[:1] != (shard["rows"],) or \
                    (key == "weights" and shape != (shard["rows"], dim)):
                raise CheckpointError(f"corrupt checkpoint: {snap.dir}: table '{table}' tensor '{key}' in "
                                      f"{shard['file']} is {stored[key]['dtype']} of shape {shape}")
    return shards


def table_rows(snap: Snapshot, table: str, key: str, first: int, stride: int, n: int, verify: bool = True):
    """Rows ``first + i * stride`` (``i < n``) of tensor ``key`` of ``table``, gathered from its shards."""
    shards = _shards(snap, table, [key])
    wanted = first + stride * np.arange(n, dtype=np.int64)
    out = None
    k = int(shards[0]["stride"])
    for shard in shards:
        array = snap.tensors(shard["file"], [key], verify=verify)[key]
        if out is None:
            out = np.empty((n,) + array.shape[1:], np.float32)
        mine = (wanted % k) == int(shard["first_row"])
        out[mine] = array[(wanted[mine] - int(shard["first_row"])) // k]
    return out


def table_tensors(snap: Snapshot, table: str, shapes: dict, verify: bool = True) -> dict:
    """The whole tensors of ``table`` named in ``shapes`` (``{"weights": (V, dim), "slot/<name>": ...}``),
    each checked to be float32 of exactly that shape and, if ``verify``, to match its SHA-256. A table stored
    whole is memory-mapped; one stored in shards (by several processes) is assembled in memory."""
    shards = _shards(snap, table, list(shapes))
    entry = snap.manifest["tables"][table]
    for key, shape in shapes.items():
        stored = snap.manifest["files"][shards[0]["file"]][key]["shape"]
        if (int(entry["vocabulary_size"]),) + tuple(stored[1:]) != tuple(shape):
            raise CheckpointError(f"{snap.dir}: table '{table}' tensor '{key}' is float32 of shape "
                                  f"{(int(entry['vocabulary_size']),) + tuple(stored[1:])}; the engine needs float32 "
                                  f"of shape {tuple(shape)}")
    if len(shards) == 1:
        return snap.tensors(shards[0]["file"], list(shapes), verify=verify)
    vocabulary = int(entry["vocabulary_size"])
    return {key: table_rows(snap, table, key, 0, 1, vocabulary, verify) for key in shapes}


def restore(cls, path, functions=None, allow_import: bool = False, stack_tables: bool = True):
    """A new ``cls`` engine from a checkpoint (see :meth:`embedcore.Embedding.restore`)."""
    snap = open_snapshot(path)
    features, optimizer, seed = decode_engine_config(snap.manifest["config"],
                                                     FunctionResolver(functions, allow_import))
    emb = cls.__new__(cls)
    emb._setup(features, optimizer, seed, stack_tables, fill=False,
               non_finite=snap.manifest["config"].get("non_finite", "raise"))
    # The configuration is the checkpoint's own (functions possibly replaced by the caller's): only the
    # tables, slots and shapes need checking.
    load_into(emb, snap, strict=False)
    return emb


def read_extra(path_or_snapshot) -> tuple[dict, object]:
    """``(arrays, metadata)`` stored with ``save(extra=..., metadata=...)``; arrays are verified in-memory copies."""
    snap = path_or_snapshot if isinstance(path_or_snapshot, Snapshot) else open_snapshot(path_or_snapshot)
    name = snap.manifest.get("extra")
    arrays = {k: np.array(v) for k, v in snap.tensors(name).items()} if name else {}
    return arrays, snap.manifest.get("metadata")
