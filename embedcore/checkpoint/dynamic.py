"""Dynamic tables in checkpoints: one file per table holding its :class:`~embedcore.tables.dynamic.DynamicTableState`.

A dynamic table's file (``dynamic-<k>.safetensors``) holds, for its ``n`` keys in increasing order (as uint64,
so two tables of equal state write identical files):

=========================  ==========================  =================================================
tensor                     dtype, shape                what
=========================  ==========================  =================================================
``keys``                   uint64 ``[n]``              the keys held, strictly increasing
``weights``                weights dtype ``[n, dim]``  their rows
``slot/<name>``            slot dtype ``[n]``/``[n, dim]``  their optimizer slots
``last_seen``              int32 ``[n]``               the last step each was seen, ``0 .. step``
``counts``                 int32 ``[n]``               occurrences counted, ``>= 0``
``rows``                   int64 ``[n]``               each key's row slot
``free``                   int64 ``[f]``               the free row slots, in the order they are reused
``admission/counters``     uint32 ``[depth, width]``   the admission sketch (only with ``min_count > 1``)
=========================  ==========================  =================================================

``rows`` and ``free`` together are exactly ``0 .. n + f - 1`` (``n + f <= capacity``): with them a loaded
table assigns the same row slots to later keys, which 16-bit stochastic rounding is keyed by. Its manifest
entry is ``{"dynamic": true, "capacity": C, "n": n, "vocabulary_size": C, "dim": d, "slots": [...],
"shards": [{"file": ..., "first_row": 0, "stride": 1, "rows": n}]}`` (one whole shard; ``rows`` counts keys).

A serving export of a dynamic table holds only ``keys`` and ``weights`` (of the export's dtype; int8: the
fused ``uint8 [n, dim + 8]`` rows).

:func:`check_dynamic_entry` checks the manifest entry (every size, dtype and shape, against the configuration
too) before anything is read; :func:`read_state` then checks the contents (keys increasing, counts >= 0,
last_seen <= step, rows and free a partition, values finite). :func:`state_tensors` and :func:`read_state`
turn a state into tensors and back, for any writer of these files (sharded checkpoints, delta saves).
"""

from __future__ import annotations

import numpy as np

from ..kernels.hash_map import is_partition
from ..tables.dynamic import DynamicTableState
from .errors import CheckpointError

__all__ = ["state_tensors", "state_from_tensors", "write_dynamic_table", "check_dynamic_entry",
           "check_dynamic_config", "read_state", "check_keys",
           "check_state_contents", "dynamic_file_name", "is_dynamic_entry"]

_ENTRY_KEYS = {"dynamic", "capacity", "n", "vocabulary_size", "dim", "slots", "shards"}
_MAX_CAPACITY = 2 ** 31 - 1
_MAX_STEP = 2 ** 31 - 1
_SKETCH = "admission/counters"
_TABLE_DTYPES = ("float32", "float16", "bfloat16")


def dynamic_file_name(k: int, suffix: str = "") -> str:
    return f"dynamic-{k:04d}{suffix}.safetensors"


def is_dynamic_entry(entry) -> bool:
    return isinstance(entry, dict) and entry.get("dynamic") is True


def state_tensors(state: DynamicTableState) -> dict:
    """The file's tensors of ``state`` (module docstring)."""
    tensors = {"keys": np.ascontiguousarray(state.keys, np.uint64), "weights": state.weights}
    tensors.update({f"slot/{name}": values for name, values in state.slots.items()})
    tensors.update({"last_seen": np.ascontiguousarray(state.last_seen, np.int32),
                    "counts": np.ascontiguousarray(state.counts, np.int32),
                    "rows": np.ascontiguousarray(state.rows, np.int64),
                    "free": np.ascontiguousarray(state.free, np.int64)})
    if state.sketch is not None:
        tensors[_SKETCH] = np.ascontiguousarray(state.sketch, np.uint32)
    return tensors


def state_from_tensors(tensors: dict, slot_names) -> DynamicTableState:
    """The :class:`DynamicTableState` of a file's tensors (arrays not copied)."""
    return DynamicTableState(tensors["keys"], tensors["weights"], {s: tensors[f"slot/{s}"] for s in slot_names},
                             tensors["last_seen"], tensors["counts"], tensors["rows"], tensors["free"],
                             tensors.get(_SKETCH))


def write_dynamic_table(writer, file_name: str, config, state: DynamicTableState) -> dict:
    """Write ``state`` of the dynamic table ``config`` as ``file_name``; returns its manifest entry."""
    writer.add(file_name, state_tensors(state), {"table": config.name})
    n = state.n
    return {"dynamic": True, "capacity": config.capacity, "n": n, "vocabulary_size": config.capacity,
            "dim": config.dim, "slots": list(state.slots),
            "shards": [{"file": file_name, "first_row": 0, "stride": 1, "rows": n}]}


def _refuse(manifest_path: str, name: str, what: str) -> CheckpointError:
    return CheckpointError(f"corrupt checkpoint: {manifest_path}: dynamic table '{name}' {what}")


def check_dynamic_entry(name, entry, files: dict, manifest_path: str, serving_dtype: str | None = None) -> None:
    """A dynamic table's manifest entry and the tensors its file declares (module docstring): sizes, dtypes,
    shapes, ``n <= capacity``; ``CheckpointError`` naming the table and the field."""
    def fail(what):
        return _refuse(manifest_path, name, what)

    if set(entry) != _ENTRY_KEYS:
        raise fail(f"needs exactly the fields {sorted(_ENTRY_KEYS)}, it has {sorted(entry)}")
    capacity, n, dim = entry["capacity"], entry["n"], entry["dim"]
    for what, value, high in (("capacity", capacity, _MAX_CAPACITY), ("n", n, capacity), ("dim", dim, 2 ** 31 - 1)):
        low = 0 if what == "n" else 1
        if type(value) is not int or type(high) is not int or not low <= value <= high:
            raise fail(f"has {what} {value!r:.40}; it must be an integer from {low} to {high!r:.20}"
                       + (" (the capacity: a table holds at most that many keys)" if what == "n" else ""))
    if entry["vocabulary_size"] != capacity or type(entry["vocabulary_size"]) is not int:
        raise fail(f"has vocabulary_size {entry['vocabulary_size']!r:.40}; it must be its capacity {capacity}")
    slots = entry["slots"]
    if not isinstance(slots, list) or not all(isinstance(s, str) and s for s in slots) or len(set(slots)) != len(slots):
        raise fail(f"has slots {slots!r:.100}; they must be distinct non-empty names")
    shards = entry["shards"]
    whole = {"first_row": 0, "stride": 1, "rows": n}
    if not isinstance(shards, list) or len(shards) != 1 or not isinstance(shards[0], dict) or \
            set(shards[0]) != {"file", *whole} or any(type(shards[0][k]) is not int or shards[0][k] != v
                                                     for k, v in whole.items()):
        raise fail(f"must be stored whole, in one shard {{'file', 'first_row': 0, 'stride': 1, 'rows': {n}}}; "
                   f"it has {shards!r:.160}")
    file_name = shards[0]["file"]
    if not isinstance(file_name, str) or file_name not in files:
        raise fail(f"names the file {file_name!r:.80}, which the manifest does not list")
    stored = files[file_name]
    if serving_dtype is not None and slots:
        raise fail(f"of a serving export lists slots {slots}; an export holds none")
    names = {"keys", "weights"} if serving_dtype is not None else \
        {"keys", "weights", "last_seen", "counts", "rows", "free"} | {f"slot/{s}" for s in slots}
    if set(stored) - {_SKETCH} != names or (serving_dtype is not None and _SKETCH in stored):
        optional = "" if serving_dtype else f" (and {_SKETCH} with admission)"
        raise fail(f"needs the tensors {sorted(names)}{optional} in {file_name}, which holds {sorted(stored)}")
    if serving_dtype is not None:
        width = dim + 8 if serving_dtype == "int8" else dim
        want = {"keys": ("uint64", [n]), "weights": ("uint8" if serving_dtype == "int8" else serving_dtype, [n, width])}
    else:
        free = stored["free"]["shape"]
        if not (len(free) == 1 and n + free[0] <= capacity):
            raise fail(f"declares free rows of shape {free}; with its {n} keys they must fit its capacity {capacity}")
        weights = stored["weights"]["dtype"]
        want = {"keys": ("uint64", [n]), "weights": (weights if weights in _TABLE_DTYPES else "float32", [n, dim]),
                "last_seen": ("int32", [n]), "counts": ("int32", [n]), "rows": ("int64", [n]), "free": ("int64", free)}
        slot_dtypes = sorted({stored[f"slot/{s}"]["dtype"] for s in slots})
        if len(slot_dtypes) > 1 or (slot_dtypes and slot_dtypes[0] not in _TABLE_DTYPES):
            raise fail(f"stores its slots as {slot_dtypes}; they must share one of {list(_TABLE_DTYPES)}")
        for s in slots:
            shape = stored[f"slot/{s}"]["shape"]
            want[f"slot/{s}"] = (slot_dtypes[0], shape if shape in ([n], [n, dim]) else [n, dim])
        if _SKETCH in stored:
            sketch = stored[_SKETCH]["shape"]
            want[_SKETCH] = ("uint32", sketch if len(sketch) == 2 and min(sketch) >= 1 else [1, 1])
    for key, (dtype, shape) in want.items():
        got = (stored[key]["dtype"], list(stored[key]["shape"]))
        if got != (dtype, shape):
            raise fail(f"tensor '{key}' in {file_name} is {got[0]} of shape {got[1]}; it must be {dtype} of shape "
                       f"{shape}")


def check_dynamic_config(name, entry, files: dict, table_config: dict, manifest_path: str,
                         serving: bool = False) -> None:
    """The entry agrees with the table's configuration: dynamic, the same capacity, an admission sketch
    exactly when it counts (``min_count > 1``), of its shape."""
    def fail(what):
        return _refuse(manifest_path, name, what)

    dynamic = table_config.get("dynamic")
    if dynamic is None:
        raise fail("is stored as a dynamic table; its configuration is a static table")
    if dynamic["capacity"] != entry["capacity"]:
        raise fail(f"has capacity {entry['capacity']}; its configuration says {dynamic['capacity']}")
    stored = files[entry["shards"][0]["file"]]
    admission = dynamic["admission"]
    counting = admission is not None and admission["min_count"] > 1
    if serving:
        return  # an export holds no sketch
    want = [admission["sketch_depth"], admission["sketch_width"]] if counting else None
    got = stored[_SKETCH]["shape"] if _SKETCH in stored else None
    if got != want:
        raise fail(f"stores an admission sketch of shape {got}; its configuration's admission ({admission}) needs "
                   f"{'none' if want is None else want}")


def check_keys(keys: np.ndarray, where: str) -> None:
    """Refuse stored keys that are not strictly increasing (as uint64), so distinct."""
    if keys.shape[0] > 1:
        bad = np.flatnonzero(keys[1:] <= keys[:-1])
        if bad.size:
            key = int(keys[bad[0] + 1:bad[0] + 2].view(np.int64)[0])
            raise CheckpointError(f"corrupt checkpoint: {where}: key {key} is out of order or given twice (keys are "
                                  f"stored distinct and increasing)")


def check_state_contents(state: DynamicTableState, where: str, step: int) -> None:
    """What the manifest cannot say about a state read from a file: keys strictly increasing (so distinct),
    ``counts >= 0``, ``0 <= last_seen <= step``, ``rows`` and ``free`` exactly ``0 .. n + f - 1``."""
    check_keys(np.asarray(state.keys), where)
    counts = np.asarray(state.counts)
    if counts.size and counts.min() < 0:
        raise CheckpointError(f"corrupt checkpoint: {where}: counts hold {int(counts.min())}; counts are >= 0")
    last_seen = np.asarray(state.last_seen)
    if last_seen.size and (last_seen.min() < 0 or last_seen.max() > min(step, _MAX_STEP)):
        value = int(last_seen.min() if last_seen.min() < 0 else last_seen.max())
        raise CheckpointError(f"corrupt checkpoint: {where}: last_seen holds {value}; it must be a step from 0 to "
                              f"the checkpoint's step {step}")
    slots = np.concatenate([np.asarray(state.rows), np.asarray(state.free)])
    high = slots.shape[0]
    if not is_partition(slots):
        raise CheckpointError(f"corrupt checkpoint: {where}: rows and free must together be the row slots 0 .. "
                              f"{high - 1}, each once")


def read_state(snap, name: str, verify: bool = True) -> DynamicTableState:
    """The state of dynamic table ``name`` of ``snap`` (a training checkpoint), memory-mapped, verified: each
    tensor against its SHA-256 and (``verify``) the contents (:func:`check_state_contents`) and finite
    values."""
    from . import check_finite
    entry = snap.manifest["tables"][name]
    tensors = snap.tensors(entry["shards"][0]["file"], verify=verify)
    state = state_from_tensors(tensors, entry["slots"])
    where = f"{snap.dir}: dynamic table '{name}'"
    check_state_contents(state, where, snap.step)
    if verify:
        check_finite(state.weights, f"{where} weights")
        for slot, values in state.slots.items():
            check_finite(values, f"{where} slot '{slot}'")
    return state
