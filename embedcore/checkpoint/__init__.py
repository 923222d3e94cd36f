"""Checkpoints: tables, slots, step and configuration in a directory of safetensors files, no pickle.

The layout does not depend on stacking or partitioning: each table is stored on its own, rows in id order
(``weights`` ``[vocabulary_size, dim]`` and one ``slot/<name>`` tensor per slot). Writes are atomic and
every tensor is checksummed (:mod:`.store`); the configuration is JSON that names functions by import path
and is imported only when the caller allows it (:mod:`.config_codec`).

Use it through the engine: ``emb.save(path)``, ``emb.load(path)``, ``Embedding.restore(path)``; serving
reads the same files (:mod:`embedcore.serving`).
"""

from __future__ import annotations

import numpy as np

from .config_codec import FunctionResolver, decode_engine_config, encode_engine_config
from .errors import CheckpointError
from .store import Snapshot, SnapshotWriter, open_snapshot

__all__ = ["CheckpointError", "save", "load_into", "restore", "read_extra", "open_snapshot", "engine_config"]

_EXTRA = "extra.safetensors"


def engine_config(emb) -> dict:
    return encode_engine_config(emb._feature_config, list(emb._table_configs.values()), emb._optimizer, emb.seed)


def _table_file(k: int) -> str:
    return f"table-{k:04d}.safetensors"


def save(emb, path, extra=None, metadata=None, keep: int = 1) -> str:
    """Write ``emb`` to the checkpoint directory ``path`` (see :meth:`embedcore.Embedding.save`)."""
    from .. import __version__
    config = engine_config(emb)  # fails before anything is written if the config cannot be stored
    extra = dict(extra or {})
    for name, value in extra.items():
        if not isinstance(name, str) or not isinstance(value, np.ndarray):
            raise CheckpointError(f"extra must map names to NumPy arrays; got {name!r}: {type(value).__name__}")
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
        return writer.commit(manifest, keep=keep)
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
        if list(entry["slots"]) != list(slots[name]):
            raise CheckpointError(f"{where}: table '{name}' has slots {entry['slots']}, the engine's optimizer "
                                  f"has {list(slots[name])}")
        arrays = snap.tensors(entry["file"])
        targets = {"weights": tables[name]}
        targets.update({f"slot/{s}": v for s, v in slots[name].items()})
        for key, target in targets.items():
            if key not in arrays or arrays[key].shape != target.shape:
                got = arrays[key].shape if key in arrays else "nothing"
                raise CheckpointError(f"{where}: table '{name}' tensor '{key}' has shape {got}, the engine "
                                      f"needs {target.shape}")
            staged.append((target, arrays[key]))
    # Everything is verified; from here on the engine changes.
    for target, source in staged:
        target[...] = source
    emb.step = snap.step


def restore(cls, path, functions=None, allow_import: bool = False, stack_tables: bool = True):
    """A new ``cls`` engine from a checkpoint (see :meth:`embedcore.Embedding.restore`)."""
    snap = open_snapshot(path)
    features, optimizer, seed = decode_engine_config(snap.manifest["config"],
                                                     FunctionResolver(functions, allow_import))
    emb = cls.__new__(cls)
    emb._setup(features, optimizer, seed, stack_tables, fill=False)
    load_into(emb, snap, strict=True)
    return emb


def read_extra(path) -> tuple[dict, object]:
    """``(arrays, metadata)`` stored with ``save(extra=..., metadata=...)``; arrays are verified in-memory copies."""
    snap = open_snapshot(path)
    name = snap.manifest.get("extra")
    arrays = {k: np.array(v) for k, v in snap.tensors(name).items()} if name else {}
    return arrays, snap.manifest.get("metadata")
