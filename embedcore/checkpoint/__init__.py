"""Checkpoints: tables, slots, step and configuration in a directory of safetensors files, no pickle.

The layout does not depend on stacking or partitioning: each table is stored on its own, rows in id order
(``weights`` ``[vocabulary_size, dim]`` and one ``slot/<name>`` tensor per slot). A dynamic table is stored
as its state, one file of per-key tensors in increasing key order (``keys``, ``weights``, ``slot/<name>``,
``last_seen``, ``counts``, the row slots ``rows`` and ``free``, and ``admission/counters`` with admission;
:mod:`.dynamic` describes the file and its manifest entry), from which a loaded engine continues
bit-identically: every later lookup's activations, admissions, evictions (ties included) and TTL expiries,
and every update, are those the saved engine would have made. Saving a TTL table first removes the rows
expired at the current step (as its next lookup would; no view shows them). Loading a dynamic table needs
the saving engine's seed (admission hashes and new keys' initial values depend on it) and a capacity of at
least its keys (a smaller one than the saver's compacts the row slots: then only 16-bit stochastic rounding,
keyed by the slot, can differ). Writes are atomic and
every tensor is checksummed (:mod:`.store`); the configuration is JSON that names functions by import path
and is imported only when the caller allows it (:mod:`.config_codec`).

Use it through the engine: ``emb.save(path)``, ``emb.load(path)``, ``Embedding.restore(path)``; serving
reads the same files (:mod:`embedcore.serving`). ``emb.save(path, incremental=True)`` writes only the rows
changed since the engine's previous save, on top of it (:mod:`.delta`); every reader here composes them.

Reading trusts nothing in the directory: the manifest is checked whole against its schema and the files'
sizes (:func:`.store.check_manifest`) before anything is allocated or changed, every size that memory is
allocated for is checked against the machine (:func:`embedcore.memory_budget.check_fits`), every tensor
against its SHA-256, and tables and slots holding NaN or Inf are refused. Every refusal is a
:class:`CheckpointError` and leaves the engine as it was.
"""

from __future__ import annotations

import json
import math

import numpy as np

from ..memory_budget import check_fits
from .config_codec import FunctionResolver, decode_engine_config, encode_engine_config
from .dynamic import dynamic_file_name, is_dynamic_entry, read_state, write_dynamic_table
from .errors import CheckpointError
from . import delta as _delta
from .store import Snapshot, SnapshotWriter, open_snapshot, read_current
from .tensor_file import storable

__all__ = ["CheckpointError", "save", "load_into", "restore", "read_extra", "open_snapshot", "read_current",
           "engine_config", "table_tensors", "table_rows", "table_changes", "write_table_shards", "check_save_inputs",
           "manifest_of", "check_compatible", "check_finite", "stored_shapes", "as_stored", "dynamic_tables",
           "write_dynamic_tables", "stage_dynamic"]

_EXTRA = "extra.safetensors"


def engine_config(emb) -> dict:
    config = encode_engine_config(emb.feature_config, list(emb.tables.values()), emb.optimizer, emb.seed)
    config["non_finite"] = emb.non_finite
    return config


def check_save_inputs(extra, metadata, step=0) -> dict:
    """``extra`` as a dict, after checking it, ``metadata`` and ``step`` can be stored (before anything is
    written): a step that a reader would refuse (negative, fractional, beyond 2^63-1) is refused here."""
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or \
            not 0 <= int(step) <= 2 ** 63 - 1:
        raise CheckpointError(f"step {step!r:.80} cannot be stored: a checkpoint's step is an integer from 0 to "
                              f"2**63-1")
    extra = dict(extra or {})
    for name, value in extra.items():
        if not isinstance(name, str) or not name or name == "__metadata__" or not isinstance(value, np.ndarray) \
                or not storable(value.dtype):
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


def dynamic_tables(emb) -> dict:
    """Table name -> the :class:`~embedcore.tables.dynamic.DynamicTable` of each dynamic table of ``emb``."""
    return emb.dynamic_tables


def write_dynamic_tables(writer, configs: dict, tables: dict, step: int, suffix: str = "") -> dict:
    """Write each dynamic table's state (``tables``: name -> its :class:`~embedcore.tables.dynamic.DynamicTable`)
    as one file; TTL tables first remove the rows expired at ``step`` (as the next lookup would; views hide them
    already). Returns their manifest entries."""
    entries = {}
    for k, (name, table) in enumerate(tables.items()):
        table.remove_expired(step)
        entries[name] = write_dynamic_table(writer, dynamic_file_name(k, suffix), configs[name], table.state())
    return entries


def manifest_of(step: int, config: dict, entries: dict, extra_file, metadata) -> dict:
    from .. import __version__
    return {"step": int(step), "config": config, "tables": entries, "metadata": metadata, "extra": extra_file,
            "embedcore_version": __version__}


def save(emb, path, extra=None, metadata=None, incremental: bool = False) -> str:
    """Write ``emb`` to the checkpoint directory ``path`` (see :meth:`embedcore.Embedding.save`); with
    ``incremental``, only the rows changed since its last save when it can (:func:`.delta.chain_to_extend`)."""
    config = engine_config(emb)
    extra = check_save_inputs(extra, metadata, emb.step)
    chain = _delta.chain_to_extend(emb, path, incremental)
    writer = SnapshotWriter(path, emb.step)
    try:
        if chain is None:
            dynamic = dynamic_tables(emb)
            configs = {name: t for name, t in emb.tables.items() if name not in dynamic}
            whole = {name: (0, 1, t.vocabulary_size) for name, t in configs.items()}
            entries = write_table_shards(writer, configs, emb.embedding_tables, emb.slot_variables, whole)
            entries.update(write_dynamic_tables(writer, emb.tables, dynamic, emb.step))
        else:
            entries = _delta.write_changed_rows(writer, emb, chain)
        if extra:
            writer.add(_EXTRA, extra)
        manifest = manifest_of(emb.step, config, entries, _EXTRA if extra else None, metadata)
        if chain is None:
            return writer.commit(manifest)
        return writer.commit(dict(manifest, delta=_delta.delta_fields(chain)),
                             keep={link["snapshot"] for link in chain.links})
    except BaseException:
        writer.abort()
        raise
    finally:
        if writer.committed:  # CURRENT names the new snapshot (even if a step after the commit failed)
            _delta.after_commit(emb, path, writer, chain, incremental)


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


_STORAGE_KEYS = ("weights_dtype", "slot_dtype", "stochastic_rounding")


def _without_storage(config: dict) -> dict:
    """``config`` without the tables' storage settings (compared as dtypes of the arrays instead)."""
    tables = [{k: v for k, v in t.items() if k not in _STORAGE_KEYS} for t in config.get("tables", [])]
    return {**config, "tables": tables}


def check_compatible(snap: Snapshot, config: dict, slots: dict, strict: bool, convert_dtypes: bool = False) -> None:
    """Refuse a checkpoint whose configuration differs from ``config`` (when ``strict``; with
    ``convert_dtypes``, tables may differ in how they are stored) or whose tables and slot names differ from
    ``slots`` (table name -> slot names)."""
    where = snap.dir
    if strict:
        saved = snap.manifest["config"]
        if convert_dtypes:
            saved, config = _without_storage(saved), _without_storage(config)
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


def as_stored(target: np.ndarray, source: np.ndarray, where: str, convert_dtypes: bool) -> np.ndarray:
    """``source`` (a checkpoint's rows) as it will be copied into ``target`` (an engine's): itself when the
    dtypes agree; converted (rounded to nearest) when they differ and ``convert_dtypes``, refused
    (``CheckpointError`` naming ``where``) when they differ otherwise or a converted value leaves the range of
    ``target``'s dtype."""
    if source.dtype == target.dtype:
        return source
    if not convert_dtypes:
        raise CheckpointError(f"{where} is stored as {source.dtype}; the engine's is {target.dtype}. Converting is "
                              f"explicit: load(path, convert_dtypes=True) converts the values to {target.dtype} (rounding to nearest)")
    with np.errstate(over="ignore"):
        converted = source.astype(target.dtype)
    check_finite(converted, f"{where} converted to {target.dtype} (a value beyond its range?)")
    return converted


def load_into(emb, path_or_snapshot, strict: bool = True, convert_dtypes: bool = False) -> None:
    """Copy a checkpoint's tables, slots and step into ``emb`` after verifying all of it.

    Nothing in ``emb`` changes unless every check passed; a save by another process while this reads
    makes it read the new checkpoint instead (:func:`.store.read_current`). Tables stored in another dtype
    than the engine's are refused unless ``convert_dtypes`` (see :func:`as_stored`).
    """
    def stage(snap):
        tables, slots = emb.embedding_tables, emb.slot_variables
        check_compatible(snap, engine_config(emb) if strict else {}, {n: list(v) for n, v in slots.items()}, strict,
                         convert_dtypes)
        dynamic = dynamic_tables(emb)
        check_dynamic_kinds(snap, dynamic, emb.seed)
        staged, applies = [], []
        for name in snap.manifest["tables"]:
            if name in dynamic:
                applies.append(stage_dynamic(read_state(snap, name), f"{snap.dir}: table '{name}'", dynamic[name],
                                             convert_dtypes))
                continue
            targets = {"weights": tables[name]}
            targets.update({f"slot/{s}": v for s, v in slots[name].items()})
            staged += _staged_parts(snap, name, targets, convert_dtypes)
        return staged, applies, snap.step

    if isinstance(path_or_snapshot, Snapshot):
        staged, applies, step = stage(path_or_snapshot)
    else:
        staged, applies, step = read_current(path_or_snapshot, stage)
    # Everything is verified; from here on the engine changes.
    for target, rows, source in staged:
        target[rows] = source
    for apply in applies:
        apply()
    emb.step = step


def _staged_parts(snap: Snapshot, table: str, targets: dict, convert_dtypes: bool) -> list:
    """``(target, rows, values)`` that write ``table``'s tensors of ``snap`` into ``targets`` (key -> the
    engine's array), in order: the base's whole tensors (``rows`` = ``...``), then each delta's changed rows;
    everything read and verified (shapes, SHA-256, NaN/Inf, dtypes as :func:`as_stored` allows)."""
    arrays = _base_tensors(snap, table, {key: t.shape for key, t in targets.items()})
    staged = [(targets[key], ..., as_stored(targets[key], arrays[key], f"{snap.dir}: table '{table}' {_what(key)}",
                                            convert_dtypes)) for key in targets]
    for rows, values in table_changes(snap, table, list(targets)):
        staged += [(targets[key], rows, as_stored(targets[key], values[key], f"{snap.dir}: table '{table}' "
                                                  f"{_what(key)}", convert_dtypes)) for key in targets]
    return staged


def check_dynamic_kinds(snap: Snapshot, dynamic: dict, seed: int) -> None:
    """Refuse a checkpoint whose tables are dynamic where the engine's are static or the other way round, or,
    with dynamic tables, written by an engine of another seed (their admission hashes and the initial values
    of keys to come depend on it)."""
    for name, entry in snap.manifest["tables"].items():
        if is_dynamic_entry(entry) != (name in dynamic):
            kind = "a dynamic" if is_dynamic_entry(entry) else "a static"
            raise CheckpointError(f"{snap.dir}: table '{name}' is {kind} table there, the engine's is not")
    if dynamic and int(snap.manifest["config"]["seed"]) != int(seed):
        raise CheckpointError(f"{snap.dir} was written by an engine of seed {snap.manifest['config']['seed']}, this "
                              f"one has seed {seed}: the dynamic tables {sorted(dynamic)} hash admissions and give "
                              f"new keys initial values by the seed, so they would not continue as saved; build the "
                              f"engine with the checkpoint's seed (or use Embedding.restore)")


def stage_dynamic(state, where: str, table, convert_dtypes: bool = False):
    """Check ``state`` (a dynamic table's, read by :func:`.dynamic.read_state` from ``where``) against ``table``
    (its :class:`~embedcore.tables.dynamic.DynamicTable`); returns the function of no arguments that loads it
    (:meth:`~embedcore.tables.dynamic.DynamicTable.prepare_state`). Refusals are
    :class:`CheckpointError` and change nothing."""
    storage = table.storage
    state.weights = as_stored(storage.weights, state.weights, f"{where} weights", convert_dtypes)
    names = list(table.optimizer.slot_names) if table.optimizer is not None else []
    state.slots = {s: as_stored(target, state.slots[s], f"{where} slot '{s}'", convert_dtypes)
                   for s, target in zip(names, storage.slots) if s in state.slots}
    try:
        return table.prepare_state(state)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}; nothing was loaded") from None


def _shards(snap: Snapshot, table: str, keys) -> list:
    """The table's shards (checked by :func:`.store.check_manifest` to partition its rows exactly and to
    hold ``weights`` and every slot as float32), once ``keys`` are known to be among its tensors."""
    entry = snap.manifest["tables"].get(table)
    if entry is None:
        raise CheckpointError(f"{snap.dir} holds no table '{table}' (it holds {sorted(snap.manifest['tables'])})")
    for key in keys:
        if key != "weights" and key[len("slot/"):] not in entry["slots"]:
            raise CheckpointError(f"{snap.dir}: table '{table}' has no tensor '{key}' (its optimizer's slots "
                                  f"are {entry['slots']}); the engine needs it")
    return entry["shards"]


def _what(key: str) -> str:
    return "weights" if key == "weights" else f"slot '{key[len('slot/'):]}'"


def check_finite(array: np.ndarray, where: str, rows=None) -> None:
    """Refuse (``CheckpointError`` naming ``where`` and the first rows) an array holding NaN or Inf.

    ``rows`` maps the array's row positions to the table's row ids (default: the positions). One pass
    over the data and no allocation when all is finite (a float32 sum is finite only if every term is).
    """
    if array.size == 0:
        return
    flat = array.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(flat, dtype=np.float32)):
            return
    matrix = array.reshape(array.shape[0], -1)
    bad = []
    for begin in range(0, matrix.shape[0], 1 << 16):
        chunk = matrix[begin:begin + (1 << 16)]
        bad.extend((begin + np.flatnonzero(~np.isfinite(chunk).all(axis=1))).tolist())
    if not bad:
        return  # the sum overflowed, every value is finite
    ids = bad if rows is None else np.asarray(rows)[bad].tolist()
    raise CheckpointError(f"{where} holds NaN or Inf in {len(ids)} row(s), e.g. rows {ids[:5]}; tables and slots "
                          f"must be finite, so the checkpoint is not loaded")


def table_rows(snap: Snapshot, table: str, key: str, first: int, stride: int, n: int, verify: bool = True):
    """Rows ``first + i * stride`` (``i < n``) of tensor ``key`` of ``table``, gathered from its shards (and
    a delta snapshot's changed rows, :func:`table_changes`).

    With ``verify`` each shard's tensor is checked against its SHA-256 and the rows for being finite.
    """
    out = _base_rows(snap, table, key, first, stride, n, verify)
    for rows, values in table_changes(snap, table, [key], verify):
        offset = rows - first
        mine = (offset >= 0) & (offset % stride == 0) & (offset // stride < n)
        out[offset[mine] // stride] = values[key][mine]
    return out


def _base_rows(snap: Snapshot, table: str, key: str, first: int, stride: int, n: int, verify: bool = True):
    """:func:`table_rows` of a full snapshot, or of a delta snapshot's base."""
    shards = _shards(snap, table, [key])
    entry = snap.manifest["tables"][table]
    declared = snap.manifest["files"][shards[0]["file"]][key]
    stored, dtype = declared["shape"], np.dtype(declared["dtype"])
    check_fits(dtype.itemsize * int(n) * (entry["dim"] if len(stored) == 2 else 1),
               f"{snap.dir}: table '{table}' {_what(key)} ({n} rows)", error=CheckpointError)
    wanted = first + stride * np.arange(n, dtype=np.int64)
    out = np.empty((n,) + tuple(stored[1:]), dtype)
    k = int(shards[0]["stride"])
    for shard in shards:
        array = snap.tensors(shard["file"], [key], verify=verify)[key]
        mine = (wanted % k) == int(shard["first_row"])
        out[mine] = array[(wanted[mine] - int(shard["first_row"])) // k]
    if verify:
        check_finite(out, f"{snap.dir}: table '{table}' {_what(key)}", wanted)
    return out


def table_tensors(snap: Snapshot, table: str, shapes: dict, verify: bool = True) -> dict:
    """The whole tensors of ``table`` named in ``shapes`` (``{"weights": (V, dim), "slot/<name>": ...}``),
    each checked to be of exactly that shape (float32, float16 or bfloat16, as stored) and, if ``verify``, to match its SHA-256 and to be
    finite. A table stored whole is memory-mapped; one stored in shards (by several processes), or changed
    by a delta snapshot's rows (:func:`table_changes`), is assembled in memory."""
    arrays = _base_tensors(snap, table, shapes, verify)
    changes = table_changes(snap, table, list(shapes), verify)
    if changes:
        check_fits(sum(a.nbytes for a in arrays.values()), f"{snap.dir}: table '{table}' with its changed rows",
                   error=CheckpointError)
        arrays = {key: np.array(a) for key, a in arrays.items()}
        for rows, values in changes:
            for key, array in arrays.items():
                array[rows] = values[key]
    return arrays


def table_changes(snap: Snapshot, table: str, keys, verify: bool = True) -> list:
    """The rows a delta snapshot's chain changed in ``table``: ``[(rows, {key: values})]`` per delta, oldest
    first (empty for a full snapshot): write them over the base's rows in this order. ``rows`` are checked
    to be increasing ids of the table; with ``verify`` the tensors match their SHA-256 and are finite."""
    out = []
    vocabulary = snap.manifest["tables"][table]["vocabulary_size"] if snap.deltas else 0
    for delta in snap.deltas:
        entry = delta.manifest["tables"][table]
        if entry["rows"] == 0:
            continue
        arrays = delta.tensors(entry["file"], ["rows"] + list(keys), verify=verify)
        rows = np.asarray(arrays.pop("rows"))
        if rows[0] < 0 or rows[-1] >= vocabulary or np.any(rows[1:] <= rows[:-1]):
            raise CheckpointError(f"corrupt checkpoint: {delta.dir}: table '{table}' rows must be increasing ids "
                                  f"from 0 to {vocabulary - 1}, got {rows[:5].tolist()}...")
        if verify:
            for key, values in arrays.items():
                check_finite(values, f"{delta.dir}: table '{table}' {_what(key)}", rows)
        out.append((rows, arrays))
    return out


def _base_tensors(snap: Snapshot, table: str, shapes: dict, verify: bool = True) -> dict:
    """:func:`table_tensors` of a full snapshot, or of a delta snapshot's base."""
    shards = _shards(snap, table, list(shapes))
    entry = snap.manifest["tables"][table]
    for key, shape in shapes.items():
        stored = snap.manifest["files"][shards[0]["file"]][key]["shape"]
        if (entry["vocabulary_size"],) + tuple(stored[1:]) != tuple(shape):
            raise CheckpointError(f"{snap.dir}: table '{table}' tensor '{key}' has shape "
                                  f"{(entry['vocabulary_size'],) + tuple(stored[1:])}; the engine needs shape "
                                  f"{tuple(shape)}")
    if len(shards) > 1:
        return {key: _base_rows(snap, table, key, 0, 1, entry["vocabulary_size"], verify) for key in shapes}
    arrays = snap.tensors(shards[0]["file"], list(shapes), verify=verify)
    if verify:
        for key, array in arrays.items():
            check_finite(array, f"{snap.dir}: table '{table}' {_what(key)}")
    return arrays


def stored_shapes(snap: Snapshot) -> dict:
    """Static table name -> {tensor key: its whole shape ``(vocabulary_size, ...)``} as the manifest declares
    them (dynamic tables are read by :func:`.dynamic.read_state`)."""
    out = {}
    for name, entry in snap.manifest["tables"].items():
        if is_dynamic_entry(entry):
            continue
        stored = snap.manifest["files"][entry["shards"][0]["file"]]
        out[name] = {key: (entry["vocabulary_size"],) + tuple(stored[key]["shape"][1:])
                     for key in ["weights"] + [f"slot/{s}" for s in entry["slots"]]}
    return out


def _itemsize(snap: Snapshot, table: str, key: str) -> int:
    """Bytes per value of tensor ``key`` of ``table`` as stored."""
    first_file = snap.manifest["tables"][table]["shards"][0]["file"]
    return np.dtype(snap.manifest["files"][first_file][key]["dtype"]).itemsize


def check_restore_fits(snap: Snapshot, shapes: dict) -> None:
    """Refuse, before anything is allocated, a checkpoint whose tables and slots (``shapes``, as from
    :func:`stored_shapes`) would not fit in this machine's memory, counting the copies that tables stored
    in several shards need while they are assembled."""
    total = 0
    for name, tensors in shapes.items():
        copies = 2 if len(snap.manifest["tables"][name]["shards"]) > 1 else 1
        total += copies * sum(_itemsize(snap, name, key) * math.prod(shape) for key, shape in tensors.items())
    tables = ", ".join(f"'{n}' {t['weights'][0]} x {t['weights'][1]}" for n, t in list(shapes.items())[:5])
    check_fits(total, f"restoring {snap.dir} (tables {tables}{', ...' if len(shapes) > 5 else ''} with their "
               f"slots)", error=CheckpointError)


def restore(cls, path, functions=None, allow_import: bool = False, stack_tables: bool = True, tuning=None,
            output_dtype: str = "float32"):
    """A new ``cls`` engine from a checkpoint (see :meth:`embedcore.Embedding.restore`), its lookups returning
    ``output_dtype`` activations (a choice of the reader, like ``tuning``: not stored).

    The manifest is checked whole, the memory the engine needs is checked against the machine, the
    configuration is decoded (importing only what is allowed, calling only embedcore classes) and every
    tensor is verified before the engine is built.
    """
    resolver = FunctionResolver(functions, allow_import)

    def read(snap):
        shapes = stored_shapes(snap)
        check_restore_fits(snap, shapes)
        features, optimizer, seed = decode_engine_config(snap.manifest["config"], resolver)
        arrays = {name: _base_tensors(snap, name, tensors) for name, tensors in shapes.items()}
        changes = {name: table_changes(snap, name, list(tensors)) for name, tensors in shapes.items()}
        states = {name: read_state(snap, name) for name, entry in snap.manifest["tables"].items()
                  if is_dynamic_entry(entry)}
        return snap, features, optimizer, seed, arrays, changes, states

    snap, features, optimizer, seed, arrays, changes, states = read_current(path, read)
    try:
        emb = cls(features, optimizer, seed=seed, stack_tables=stack_tables, fill=False, tuning=tuning,
                  non_finite=snap.manifest["config"].get("non_finite", "raise"), output_dtype=output_dtype)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{snap.dir}: the checkpoint's configuration does not build an engine: "
                              f"{type(e).__name__}: {e}") from None
    # The configuration is the checkpoint's own (functions possibly replaced by the caller's): only the
    # tables, slots and shapes need checking.
    slots = emb.slot_variables
    check_compatible(snap, {}, {n: list(v) for n, v in slots.items()}, strict=False)
    dynamic = dynamic_tables(emb)
    applies = [stage_dynamic(states[name], f"{snap.dir}: table '{name}'", table) for name, table in dynamic.items()]
    staged = []
    for name, table in emb.embedding_tables.items():
        if name in dynamic:
            continue
        for key, target in [("weights", table)] + [(f"slot/{s}", v) for s, v in slots[name].items()]:
            if target.shape != arrays[name][key].shape:
                raise CheckpointError(f"{snap.dir}: table '{name}' tensor '{key}' has shape "
                                      f"{arrays[name][key].shape}; the engine needs shape {target.shape}")
            staged.append((target, ..., as_stored(target, arrays[name][key], f"{snap.dir}: table '{name}' "
                                                  f"{_what(key)}", False)))
            staged += [(target, rows, as_stored(target, values[key], f"{snap.dir}: table '{name}' {_what(key)}", False))
                       for rows, values in changes[name]]
    for target, rows, source in staged:
        target[rows] = source
    for apply in applies:
        apply()
    emb.step = snap.step
    return emb


def read_extra(path_or_snapshot) -> tuple[dict, object]:
    """``(arrays, metadata)`` stored with ``save(extra=..., metadata=...)``; arrays are verified in-memory copies."""
    def read(snap):
        name = snap.manifest["extra"]
        if name:
            tensors = snap.manifest["files"][name]
            check_fits(sum(math.prod(t["shape"]) * np.dtype(t["dtype"]).itemsize
                           for t in tensors.values()), f"{snap.dir}: the extra arrays", error=CheckpointError)
        arrays = {k: np.array(v) for k, v in snap.tensors(name).items()} if name else {}
        return arrays, snap.manifest.get("metadata")

    if isinstance(path_or_snapshot, Snapshot):
        return read(path_or_snapshot)
    return read_current(path_or_snapshot, read)
