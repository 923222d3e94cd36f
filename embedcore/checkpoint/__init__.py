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

__all__ = ["CheckpointError", "save", "load_into", "restore", "read_extra", "open_snapshot", "engine_config"]

_EXTRA = "extra.safetensors"


def engine_config(emb) -> dict:
    config = encode_engine_config(emb._feature_config, list(emb._table_configs.values()), emb._optimizer, emb.seed)
    config["non_finite"] = emb.non_finite
    return config


def _table_file(k: int) -> str:
    return f"table-{k:04d}.safetensors"


def save(emb, path, extra=None, metadata=None) -> str:
    """Write ``emb`` to the checkpoint directory ``path`` (see :meth:`embedcore.Embedding.save`)."""
    from .. import __version__
    # Everything that could make the save fail halfway is checked before anything is written.
    config = engine_config(emb)
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
    writer = SnapshotWriter(path, emb.step)
    try:
        tables, slots = emb.embedding_tables, emb.slot_variables
        entries = {}
        for k, name in enumerate(emb._table_configs):
            tensors = {"weights": tables[name]}
            tensors.update({f"slot/{s}": v for s, v in slots[name].items()})
            writer.add(_table_file(k), tensors, {"table": name})
            entries[name] = {"file": _table_file(k), "slots": list(slots[name])}
        if extra:
            writer.add(_EXTRA, extra)
        manifest = {"step": int(emb.step), "config": config, "tables": entries, "metadata": metadata,
                    "extra": _EXTRA if extra else None, "embedcore_version": __version__}
        return writer.commit(manifest)
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


def load_into(emb, path_or_snapshot, strict: bool = True) -> None:
    """Copy a checkpoint's tables, slots and step into ``emb`` after verifying all of it."""
    snap = path_or_snapshot if isinstance(path_or_snapshot, Snapshot) else open_snapshot(path_or_snapshot)
    where = snap.dir
    saved = snap.manifest["config"]
    if strict:
        current = engine_config(emb)
        diffs = _differences({k: v for k, v in saved.items() if k != "seed"},
                             {k: v for k, v in current.items() if k != "seed"})
        if diffs:
            shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
            raise CheckpointError(f"{where} was written by an engine configured differently: {shown}. "
                                  f"Use load(path, strict=False) to load tables and slots of equal shapes anyway")
    entries = snap.manifest["tables"]
    if set(entries) != set(emb._table_configs):
        raise CheckpointError(f"{where} holds tables {sorted(entries)}, the engine has {sorted(emb._table_configs)}")
    tables, slots = emb.embedding_tables, emb.slot_variables
    staged = []
    for name, entry in entries.items():
        if list(entry.get("slots", [])) != list(slots[name]):
            raise CheckpointError(f"{where}: table '{name}' has slots {entry.get('slots')}, the engine's optimizer "
                                  f"has {list(slots[name])}")
        targets = {"weights": tables[name]}
        targets.update({f"slot/{s}": v for s, v in slots[name].items()})
        arrays = table_tensors(snap, name, {key: t.shape for key, t in targets.items()})
        staged += [(targets[key], arrays[key]) for key in targets]
    # Everything is verified; from here on the engine changes.
    for target, source in staged:
        target[...] = source
    emb.step = snap.step


def table_tensors(snap: Snapshot, table: str, shapes: dict, verify: bool = True) -> dict:
    """The tensors of ``table`` named in ``shapes`` (``{"weights": (V, dim), "slot/<name>": ...}``), each
    checked to be float32 of exactly that shape and, if ``verify``, to match its SHA-256."""
    entry = snap.manifest["tables"].get(table)
    if entry is None:
        raise CheckpointError(f"{snap.dir} holds no table '{table}' (it holds {sorted(snap.manifest['tables'])})")
    stored = snap.manifest["files"].get(entry["file"], {})
    for key, shape in shapes.items():
        if key not in stored:
            raise CheckpointError(f"{snap.dir}: table '{table}' has no tensor '{key}' (its optimizer's slots are "
                                  f"{entry.get('slots')}); the engine needs it")
        if tuple(stored[key]["shape"]) != tuple(shape) or stored[key]["dtype"] != "float32":
            raise CheckpointError(f"{snap.dir}: table '{table}' tensor '{key}' is {stored[key]['dtype']} of shape "
                                  f"{tuple(stored[key]['shape'])}; the engine needs float32 of shape {tuple(shape)}")
    return snap.tensors(entry["file"], list(shapes), verify=verify)


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
