"""Delta snapshots: the rows an engine changed since its previous save, on top of a full snapshot.

``emb.save(path, incremental=True)`` writes, instead of every row, only the rows updates touched since the
engine's previous successful save (each physical table records them:
:meth:`~embedcore.tables.PhysicalTable.track_changes`), as a snapshot like any other in ``path``::

    path/
      CURRENT                        names the newest snapshot, here the second delta
      snapshot-000000000100-1a2b3c4d/  the base: a full snapshot
      snapshot-000000000150-5e6f7a8b/  delta 1: "delta": {"base": link to the base, "previous": the same}
        manifest.json                step, configuration, metadata, extra and files as any snapshot's
        delta-0000.safetensors       per table: "rows" int64 [n] (increasing ids), "weights" [n, dim],
        ...                          "slot/<name>" [n] or [n, dim], rows of the table as they were at step 150
      snapshot-000000000200-9c0d1e2f/  delta 2: "previous": link to delta 1, "base": link to the base

A dynamic table's delta file holds the keys whose state changed (increasing): ``keys``, ``weights``,
``slot/<name>``, ``last_seen``, ``counts`` and ``rows`` as a full save's file (:mod:`.dynamic`) has them,
``removed_keys`` (held at the previous save, evicted or expired since), and the whole ``free`` list and
admission sketch (``admission/counters``); its manifest entry is a full one's, ``n`` the keys held after the
delta and its shard's ``rows`` the keys written. A key is written when it is new, its row slot or metadata
changed, an update touched its row, or it was seen at or after the latest step the previous save had seen
(which catches a key evicted and admitted again, its row filled anew). Readers see the composed state as a
file of the base's name (:class:`_ComposedState`), so every reader of dynamic tables reads it unchanged.

A link is ``{"snapshot": name, "manifest_sha256": the SHA-256 of its manifest.json}``, so the newest
manifest (whose own SHA-256 ``CURRENT`` holds) pins every manifest of its chain, and each manifest pins its
files' tensors. The state a delta snapshot stands for: the base's tables, then each delta's rows written over
them, oldest first; step, configuration, metadata and extra arrays are the newest delta's own.

Commits are those of full saves (:class:`~.store.SnapshotWriter`: ``CURRENT`` moves only once every file is
durable); a delta's commit prunes every snapshot but its chain, a full save's every other snapshot (it
compacts: a new base, the old chain deleted).

Reading (:func:`compose`, called by :func:`~.store.open_snapshot` for every reader: ``load``, ``restore``,
serving, exports, sharded engines) follows the links from the newest delta to the base, checks each
manifest against its link and its schema (:func:`check_delta_fields`), each delta's tables against the
base's, and returns one :class:`~.store.Snapshot` whose readers see the composed rows
(:func:`embedcore.checkpoint.table_changes`). A missing or corrupt link is a :class:`CheckpointError`
before anything changes.

Which saves are deltas (:func:`chain_to_extend`): ``incremental=True`` when this engine's last successful
save went to ``path`` and is still its current snapshot; an engine that has no chain (never saved since it
was built, loaded or ``set_state``) saves in full and starts one, so a loop calling
``save(path, incremental=True)`` works from its first call; an engine whose chain is in another directory,
or whose last snapshot in ``path`` was replaced by another save, is refused (the delta would build on rows
that directory does not hold). Once a save with ``incremental=True`` has started a chain, every save
(full ones too) restarts the tracking, until ``load`` or ``set_state`` ends it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from .config_codec import need_int
from .dynamic import check_keys, is_dynamic_entry
from .errors import CheckpointError
from .store import (_SHA256, _SNAPSHOT_NAME, TABLE_DTYPES, Snapshot, _bad, _check_file_name, _need, _read_pointer,
                    check_file_sizes, read_manifest)

__all__ = ["DeltaChain", "check_delta_fields", "compose", "chain_to_extend", "write_changed_rows", "delta_fields",
           "after_commit", "forget"]

MAX_CHAIN = 10_000  # deltas a reader follows at most (a chain is as long as the saves since the last full one)
_LINK_KEYS = {"snapshot", "manifest_sha256"}
_TABLE_KEYS = {"vocabulary_size", "dim", "slots", "file", "rows"}
_DYNAMIC_KEYS = {"dynamic", "capacity", "n", "vocabulary_size", "dim", "slots", "shards"}
_SKETCH = "admission/counters"
_PER_KEY = ("keys", "weights", "last_seen", "counts", "rows")  # and the slots: one row per changed key


class DeltaChain(NamedTuple):
    """An engine's chain: the directory (real path), the links of its base and deltas, oldest first, and per
    dynamic table the :class:`KeyMarks` of its last save."""

    path: str
    links: tuple
    marks: dict = {}


class KeyMarks(NamedTuple):
    """A dynamic table's keys (uint64, increasing) and their row slots, ``last_seen`` and ``counts`` as a save
    stored them; ``latest`` the largest ``last_seen`` then (-1 without keys)."""

    keys: np.ndarray
    rows: np.ndarray
    last_seen: np.ndarray
    counts: np.ndarray
    latest: int

    @classmethod
    def of(cls, table) -> "KeyMarks":
        keys, rows, last_seen, counts, _ = table.key_map.state()
        return cls(keys, rows, last_seen, counts, int(last_seen.max()) if last_seen.size else -1)


# -- the schema ----------------------------------------------------------------------------------------------
def _check_link(link, where: str) -> None:
    if not isinstance(link, dict) or set(link) != _LINK_KEYS or not isinstance(link["snapshot"], str) or \
            not _SNAPSHOT_NAME.fullmatch(link["snapshot"]) or not isinstance(link["manifest_sha256"], str) or \
            not _SHA256.fullmatch(link["manifest_sha256"]):
        raise _bad(where, "a link {snapshot: a snapshot name, manifest_sha256: 64 hex digits}", link)


def check_delta_fields(manifest: dict, files: dict, where: str, manifest_path: str, serving_dtype=None) -> None:
    """The fields of a delta manifest that differ from a full one's (:func:`~.store.check_manifest` checks
    the rest), else :class:`CheckpointError` naming the field and its value:

    - ``delta``: ``{"base": link, "previous": link}`` (the previous is the base for a first delta);
    - ``tables``: name -> ``vocabulary_size`` (>= 1), ``dim`` (>= 1), ``slots`` (distinct non-empty names),
      ``rows`` (0 to ``vocabulary_size``) and ``file``, a listed file of its own holding exactly ``rows``
      (int64 ``[rows]``), ``weights`` (float32, float16 or bfloat16 ``[rows, dim]``) and ``slot/<name>``
      per slot (``[rows]`` or ``[rows, dim]``, one dtype for all slots).
    """
    if serving_dtype is not None:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path}: a serving export cannot be a delta snapshot")
    delta = _need(manifest["delta"], dict, f"{where}: delta", "an object with base and previous")
    if set(delta) != {"base", "previous"}:
        raise _bad(f"{where}: delta", "an object of exactly base and previous", delta)
    for key in ("base", "previous"):
        _check_link(delta[key], f"{where}: delta.{key}")
    used = set()
    for name, entry in manifest["tables"].items():
        w = f"{where}: table '{name}'"
        _need(entry, dict, w, "an object")
        if is_dynamic_entry(entry):
            _check_dynamic_delta(name, entry, files, w, manifest_path, used, manifest["extra"])
            continue
        if set(entry) != _TABLE_KEYS:
            raise _bad(w, f"an object of exactly {sorted(_TABLE_KEYS)}", sorted(entry))
        vocabulary = need_int(entry["vocabulary_size"], f"{w}.vocabulary_size", 1, 2 ** 62, fail=_bad)
        dim = need_int(entry["dim"], f"{w}.dim", 1, 2 ** 31 - 1, fail=_bad)
        rows = need_int(entry["rows"], f"{w}.rows", 0, vocabulary, fail=_bad)
        slots = _need(entry["slots"], list, f"{w}.slots", "a list of slot names")
        if not all(isinstance(s, str) and s for s in slots) or len(set(slots)) != len(slots):
            raise _bad(f"{w}.slots", "distinct non-empty names", slots)
        _check_file_name(entry["file"], manifest_path)
        if entry["file"] not in files or entry["file"] in used or entry["file"] == manifest["extra"]:
            raise _bad(f"{w}.file", f"a file of its own among {sorted(files)}", entry["file"])
        used.add(entry["file"])
        stored = files[entry["file"]]
        wanted = {"rows", "weights"} | {f"slot/{s}" for s in slots}
        if set(stored) != wanted:
            raise CheckpointError(f"corrupt checkpoint: {manifest_path}: table '{name}' (slots {slots}) needs the "
                                  f"tensors {sorted(wanted)} in {entry['file']}, which holds {sorted(stored)}")
        for key in sorted(wanted):
            shape, dtype = tuple(stored[key]["shape"]), stored[key]["dtype"]
            if key == "rows":
                ok = dtype == "int64" and shape == (rows,)
            else:
                ok = dtype in TABLE_DTYPES and (shape == (rows, dim) if key == "weights" else
                                                shape in ((rows,), (rows, dim)))
            if not ok:
                raise CheckpointError(f"corrupt checkpoint: {manifest_path}: table '{name}' tensor '{key}' in "
                                      f"{entry['file']} is {dtype} of shape {shape}")
        if len({stored[f"slot/{s}"]["dtype"] for s in slots}) > 1:
            raise CheckpointError(f"corrupt checkpoint: {manifest_path}: table '{name}' has slots of different "
                                  f"dtypes in {entry['file']}")


def _check_dynamic_delta(name, entry, files, w, manifest_path, used, extra) -> None:
    """A dynamic table's entry in a delta manifest: the full entry's fields (``n``: the keys held after this
    delta; its one shard's ``rows``: the keys it writes) and a file of its own holding, per changed key
    (increasing), ``keys`` uint64, ``weights``, ``slot/<name>``, ``last_seen`` and ``counts`` int32 and
    ``rows`` int64; and ``removed_keys`` uint64 ``[r]`` (held before, not after), the whole ``free`` list
    int64 ``[f]`` (``n + f <= capacity``) and, with admission, the whole ``admission/counters``."""
    if set(entry) != _DYNAMIC_KEYS:
        raise _bad(w, f"a dynamic table's entry of exactly {sorted(_DYNAMIC_KEYS)}", sorted(entry))
    capacity = need_int(entry["capacity"], f"{w}.capacity", 1, 2 ** 31 - 1, fail=_bad)
    n = need_int(entry["n"], f"{w}.n", 0, capacity, fail=_bad)
    dim = need_int(entry["dim"], f"{w}.dim", 1, 2 ** 31 - 1, fail=_bad)
    if type(entry["vocabulary_size"]) is not int or entry["vocabulary_size"] != capacity:
        raise _bad(f"{w}.vocabulary_size", f"its capacity {capacity}", entry["vocabulary_size"])
    slots = _need(entry["slots"], list, f"{w}.slots", "a list of slot names")
    if not all(isinstance(x, str) and x for x in slots) or len(set(slots)) != len(slots):
        raise _bad(f"{w}.slots", "distinct non-empty names", slots)
    shards = entry["shards"]
    if not isinstance(shards, list) or len(shards) != 1 or not isinstance(shards[0], dict) or \
            set(shards[0]) != {"file", "first_row", "stride", "rows"} or shards[0]["first_row"] != 0 or \
            shards[0]["stride"] != 1 or type(shards[0]["rows"]) is not int or not 0 <= shards[0]["rows"] <= n:
        raise _bad(f"{w}.shards", f"one whole shard of at most its {n} keys", shards)
    m, file_name = shards[0]["rows"], shards[0]["file"]
    _check_file_name(file_name, manifest_path)
    if file_name not in files or file_name in used or file_name == extra:
        raise _bad(f"{w}.shards.file", f"a file of its own among {sorted(files)}", file_name)
    used.add(file_name)
    stored = files[file_name]
    wanted = {"keys", "weights", "last_seen", "counts", "rows", "removed_keys", "free"} | {f"slot/{x}" for x in slots}
    if set(stored) - {_SKETCH} != wanted:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path}: dynamic table '{name}' needs the tensors "
                              f"{sorted(wanted)} (and {_SKETCH} with admission) in {file_name}, which holds "
                              f"{sorted(stored)}")
    removed, free = stored["removed_keys"]["shape"], stored["free"]["shape"]
    ok = {"keys": ("uint64", [m]), "last_seen": ("int32", [m]), "counts": ("int32", [m]), "rows": ("int64", [m])}
    for key, (dtype, shape) in ok.items():
        if (stored[key]["dtype"], stored[key]["shape"]) != (dtype, shape):
            raise _bad(f"{w} tensor '{key}'", f"{dtype} of shape {shape}", stored[key])
    if stored["removed_keys"]["dtype"] != "uint64" or len(removed) != 1 or removed[0] > capacity:
        raise _bad(f"{w} tensor 'removed_keys'", f"uint64 of shape [r], r <= {capacity}", stored["removed_keys"])
    if stored["free"]["dtype"] != "int64" or len(free) != 1 or n + free[0] > capacity:
        raise _bad(f"{w} tensor 'free'", f"int64 of shape [f], {n} + f <= {capacity}", stored["free"])
    if stored["weights"]["dtype"] not in TABLE_DTYPES or stored["weights"]["shape"] != [m, dim]:
        raise _bad(f"{w} tensor 'weights'", f"float32, float16 or bfloat16 of shape {[m, dim]}", stored["weights"])
    slot_dtypes = {stored[f"slot/{x}"]["dtype"] for x in slots}
    if len(slot_dtypes) > 1 or not slot_dtypes <= set(TABLE_DTYPES) or \
            any(stored[f"slot/{x}"]["shape"] not in ([m], [m, dim]) for x in slots):
        raise _bad(f"{w} slots", f"of one dtype among {list(TABLE_DTYPES)}, of shape [{m}] or [{m}, {dim}]",
                   {x: stored[f"slot/{x}"] for x in slots})
    if _SKETCH in stored and (stored[_SKETCH]["dtype"] != "uint32" or len(stored[_SKETCH]["shape"]) != 2):
        raise _bad(f"{w} tensor '{_SKETCH}'", "uint32 of shape [depth, width]", stored[_SKETCH])


# -- reading -------------------------------------------------------------------------------------------------
def compose(path: str, name: str, manifest: dict) -> Snapshot:
    """The snapshot ``name`` of ``path``, a delta whose checked ``manifest`` is given, composed with its
    chain (see the module docstring); :class:`CheckpointError` if a link is missing, corrupt, loops, or a
    delta's tables disagree with the base's."""
    newest = Snapshot(path, name, manifest)
    check_file_sizes(newest)
    base_link = manifest["delta"]["base"]
    chain, link, seen = [newest], manifest["delta"]["previous"], {name}
    while True:
        child = chain[-1]
        if link["snapshot"] in seen or len(chain) > MAX_CHAIN:
            how = f"loops back to {link['snapshot']}" if link["snapshot"] in seen else f"is longer than {MAX_CHAIN}"
            raise CheckpointError(f"corrupt checkpoint: {child.dir}: its chain of delta snapshots {how}")
        seen.add(link["snapshot"])
        try:
            linked = read_manifest(path, link["snapshot"], link["manifest_sha256"],
                                   named_by=os.path.join(child.dir, "manifest.json"))
            snap = Snapshot(path, link["snapshot"], linked)
            check_file_sizes(snap)
        except CheckpointError as e:
            raise CheckpointError(f"{child.dir} is a delta snapshot on top of {link['snapshot']}, which is missing "
                                  f"or corrupt, so {name} cannot be read: {e}") from None
        if "delta" not in linked:
            break
        if linked["delta"]["base"] != base_link:
            raise CheckpointError(f"corrupt checkpoint: {snap.dir} is on base {linked['delta']['base']['snapshot']}, "
                                  f"the newest delta {name} on {base_link['snapshot']}")
        chain.append(snap)
        link = linked["delta"]["previous"]
    base = snap
    if link != base_link:
        raise CheckpointError(f"corrupt checkpoint: {newest.dir} names {base_link['snapshot']} as its base; its chain "
                              f"of deltas ends at {link['snapshot']}")
    for delta in chain:
        _check_agrees(base, delta)
    table_files = {shard["file"] for entry in base.manifest["tables"].values() for shard in entry["shards"]}
    extra = manifest["extra"]
    if extra in table_files:
        raise CheckpointError(f"corrupt checkpoint: {newest.dir}: its extra file {extra} has the name of a file "
                              f"of its base {base.name}")
    files = {f: tensors for f, tensors in base.manifest["files"].items() if f in table_files}
    if extra is not None:
        files[extra] = manifest["files"][extra]
    deltas = tuple(reversed(chain))
    tables, virtual = dict(base.manifest["tables"]), {}
    for table, entry in base.manifest["tables"].items():
        if is_dynamic_entry(entry):  # its state composed in memory when read: a file of the composed state
            newest_entry = manifest["tables"][table]
            file_name = entry["shards"][0]["file"]
            files[file_name] = _composed_declaration(base, deltas, table)
            tables[table] = dict(entry, n=newest_entry["n"],
                                 shards=[dict(entry["shards"][0], rows=newest_entry["n"])])
            virtual[file_name] = _ComposedState(base, deltas, table)
    composed = dict(base.manifest, files=files, tables=tables, **{k: manifest.get(k) for k in
                                                                  ("step", "config", "metadata", "extra",
                                                                   "embedcore_version")})
    return Snapshot(path, name, composed, {f: base.dir for f in table_files}, deltas, virtual)


def _composed_declaration(base: Snapshot, deltas, table: str) -> dict:
    """The tensors (shapes and dtypes; no SHA-256: they are made in memory from verified files) of dynamic
    ``table``'s state after ``deltas``."""
    declared = base.manifest["files"][base.manifest["tables"][table]["shards"][0]["file"]]
    newest = deltas[-1].manifest
    entry = newest["tables"][table]
    stored = newest["files"][entry["shards"][0]["file"]]
    n = entry["n"]
    out = {}
    for key, t in declared.items():
        shape = stored[key]["shape"] if key in ("free", _SKETCH) else [n] + list(t["shape"][1:])
        out[key] = {"shape": list(shape), "dtype": t["dtype"], "sha256": None}
    return out


class _ComposedState:
    """The tensors of a dynamic table's state file after a chain of deltas (module docstring), made once, when
    first read: the base's per-key rows without the keys each delta removed or rewrote, with the keys it
    wrote, in key order; ``free`` and the sketch the newest delta's. Every file read is verified (SHA-256);
    a delta that removes a key not held, or whose count of keys disagrees, is refused."""

    def __init__(self, base: Snapshot, deltas, table: str):
        self.base, self.deltas, self.table = base, deltas, table
        self._tensors = None

    def __call__(self) -> dict:
        if self._tensors is None:
            self._tensors = self._compose()
        return self._tensors

    def _compose(self) -> dict:
        entry = self.base.manifest["tables"][self.table]
        state = {k: np.asarray(v) for k, v in self.base.tensors(entry["shards"][0]["file"]).items()}
        per_key = [k for k in state if k in _PER_KEY or k.startswith("slot/")]
        for delta in self.deltas:
            where = f"{delta.dir}: dynamic table '{self.table}'"
            d_entry = delta.manifest["tables"][self.table]
            d = {k: np.asarray(v) for k, v in delta.tensors(d_entry["shards"][0]["file"]).items()}
            check_keys(d["keys"], f"{where} keys")
            check_keys(d["removed_keys"], f"{where} removed_keys")
            gone = np.isin(state["keys"], d["removed_keys"])
            if int(gone.sum()) != d["removed_keys"].shape[0]:
                raise CheckpointError(f"corrupt checkpoint: {where} removes keys the table did not hold")
            keep = ~(gone | np.isin(state["keys"], d["keys"]))
            merged = {k: np.concatenate([state[k][keep], d[k]]) for k in per_key}
            order = np.argsort(merged["keys"], kind="stable")
            state = {k: v[order] for k, v in merged.items()}
            state["free"] = d["free"]
            if _SKETCH in d:
                state[_SKETCH] = d[_SKETCH]
            if state["keys"].shape[0] != d_entry["n"]:
                raise CheckpointError(f"corrupt checkpoint: {where} declares {d_entry['n']} keys; its chain gives "
                                      f"{state['keys'].shape[0]}")
        return state


def _check_agrees(base: Snapshot, delta: Snapshot) -> None:
    """Refuse a delta whose tables (names, kinds, shapes, slots, dtypes and slot ranks, a dynamic table's
    capacity and admission sketch) differ from its base's."""
    tables, base_tables = delta.manifest["tables"], base.manifest["tables"]
    problem = None
    if set(tables) != set(base_tables):
        problem = f"tables {sorted(tables)}, its base {sorted(base_tables)}"
    for name in sorted(tables) if problem is None else ():
        problem = _disagreement(name, tables[name], base_tables[name], delta.manifest["files"], base.manifest["files"])
        if problem:
            break
    if problem:
        raise CheckpointError(f"corrupt checkpoint: the delta snapshot {delta.dir} does not fit its base "
                              f"{base.name}: it has {problem}")


def _disagreement(name: str, entry: dict, held: dict, files: dict, base_files: dict):
    """How table ``name``'s delta ``entry`` differs from its base's entry ``held``, or None."""
    dynamic = is_dynamic_entry(entry)
    if dynamic != is_dynamic_entry(held):
        return f"table '{name}' {'dynamic' if dynamic else 'static'}, its base's not"
    for key in ("vocabulary_size", "dim", "slots") + (("capacity",) if dynamic else ()):
        if entry[key] != held[key]:
            return f"table '{name}' {key} {entry[key]!r:.80}, its base {held[key]!r:.80}"
    tensors = files[entry["shards"][0]["file"] if dynamic else entry["file"]]
    base_tensors = base_files[held["shards"][0]["file"]]
    if dynamic:
        sketch, base_sketch = (t[_SKETCH]["shape"] if _SKETCH in t else None for t in (tensors, base_tensors))
        if sketch != base_sketch:
            return f"table '{name}' an admission sketch of shape {sketch}, its base {base_sketch}"
    for key in ["weights"] + [f"slot/{s}" for s in entry["slots"]]:
        got = (tensors[key]["dtype"], len(tensors[key]["shape"]))
        want = (base_tensors[key]["dtype"], len(base_tensors[key]["shape"]))
        if got != want:
            return f"table '{name}' tensor '{key}' {got[0]} of rank {got[1]}, its base {want[0]} of rank {want[1]}"
    return None


# -- writing -------------------------------------------------------------------------------------------------
def chain_to_extend(emb, path, incremental: bool):
    """The :class:`DeltaChain` a save of ``emb`` to ``path`` extends with a delta, or None for a full save.

    None unless ``incremental``; None when ``emb`` has no chain (a full save starts one). Refused
    (:class:`CheckpointError`, nothing written) for a chain in another directory, or a ``path`` whose
    current snapshot is not the one ``emb`` saved last.
    """
    if not incremental:
        return None
    chain = getattr(emb, "_delta_chain", None)
    if chain is None:
        return None
    where = os.fspath(path)
    if os.path.realpath(where) != chain.path:
        raise CheckpointError(f"cannot save incrementally to {where}: this engine's last save went to {chain.path}, "
                              f"and a delta holds only the rows changed since that save. Save to {where} with "
                              f"incremental=False first (a full snapshot, on which later deltas build)")
    last = chain.links[-1]
    try:
        current = _read_pointer(where)
    except CheckpointError as e:
        raise CheckpointError(f"cannot save incrementally to {where}: {e}") from None
    if current != (last["snapshot"], last["manifest_sha256"]):
        raise CheckpointError(f"cannot save incrementally to {where}: its current snapshot is {current[0]}, not "
                              f"{last['snapshot']}, which this engine saved last (another save replaced it), so a "
                              f"delta would build on rows this engine does not know; save with incremental=False")
    return chain


def write_changed_rows(writer, emb, chain: DeltaChain) -> dict:
    """Write each table's changes since ``chain``'s last save as one file each (a static table's changed
    rows: ids, weights, slots; a dynamic table's: :func:`_write_dynamic_delta`); the manifest's ``tables``."""
    dynamic = emb.dynamic_tables
    changed = {name: t.changed_rows(name) for t in emb._physical if not t.dynamic for name in t.table_names}
    tables, slots = emb.embedding_tables, emb.slot_variables
    entries = {}
    for k, (name, config) in enumerate(emb.tables.items()):
        if name in dynamic:
            entries[name] = _write_dynamic_delta(writer, f"delta-{k:04d}.safetensors", config, dynamic[name],
                                                 chain.marks[name], emb.step)
            continue
        rows = changed[name]
        tensors = {"rows": rows, "weights": tables[name][rows]}
        tensors.update({f"slot/{s}": v[rows] for s, v in slots[name].items()})
        file_name = f"delta-{k:04d}.safetensors"
        writer.add(file_name, tensors, {"table": name})
        entries[name] = {"vocabulary_size": config.vocabulary_size, "dim": config.dim, "slots": list(slots[name]),
                         "file": file_name, "rows": int(rows.size)}
    return entries


def _write_dynamic_delta(writer, file_name: str, config, table, marks: KeyMarks, step: int) -> dict:
    """Write what changed in dynamic ``table`` since the save ``marks`` describe; returns its entry.

    A TTL table first removes the rows expired at ``step``, as a full save does. A key is written when it is
    new, its row slot or metadata differ from ``marks``, an update touched its row, or it was seen at or after
    the latest step ``marks`` saw (so a key evicted and admitted again since, whose row was filled anew, is
    written even if its metadata came out equal). ``removed_keys``: the keys ``marks`` held that are gone.
    """
    table.remove_expired(step)
    keys, rows, last_seen, counts, free = table.key_map.state()
    held = marks.keys
    if held.size:
        at = np.minimum(np.searchsorted(held, keys), held.size - 1)
        same = (held[at] == keys) & (marks.rows[at] == rows) & (marks.last_seen[at] == last_seen) & \
            (marks.counts[at] == counts)
    else:
        same = np.zeros(keys.shape, np.bool_)
    changed = ~same | table.rows_changed(rows) | (last_seen.astype(np.int64) >= marks.latest)
    written = rows[changed]
    names = list(table.optimizer.slot_names) if table.optimizer is not None else []
    tensors = {"keys": keys[changed], "weights": table.storage.weights[written]}
    tensors.update({f"slot/{n}": s[written] for n, s in zip(names, table.storage.slots)})
    tensors.update({"last_seen": last_seen[changed], "counts": counts[changed], "rows": written,
                    "removed_keys": np.setdiff1d(held, keys, assume_unique=True), "free": free})
    if table.sketch is not None:
        tensors[_SKETCH] = table.sketch.counters.copy()
    writer.add(file_name, tensors, {"table": config.name})
    return {"dynamic": True, "capacity": config.capacity, "n": int(keys.size), "vocabulary_size": config.capacity,
            "dim": config.dim, "slots": names,
            "shards": [{"file": file_name, "first_row": 0, "stride": 1, "rows": int(written.size)}]}


def delta_fields(chain: DeltaChain) -> dict:
    """The manifest's ``delta`` field of the next delta of ``chain``."""
    return {"base": dict(chain.links[0]), "previous": dict(chain.links[-1])}


def after_commit(emb, path, writer, chain, incremental: bool) -> None:
    """After ``writer`` committed a save of ``emb`` (a delta of ``chain``, or a full one when ``chain`` is
    None): restart the tracking of changed rows and record the chain, when ``incremental`` or a chain was
    already kept; otherwise nothing (an engine that never saves incrementally tracks nothing)."""
    if not incremental and getattr(emb, "_delta_chain", None) is None:
        return
    link = {"snapshot": writer.name, "manifest_sha256": writer.manifest_sha256}
    links = (chain.links if chain is not None else ()) + (link,)
    for table in emb._physical:
        table.track_changes()
    marks = {name: KeyMarks.of(table) for name, table in emb.dynamic_tables.items()}
    emb._delta_chain = DeltaChain(os.path.realpath(os.fspath(path)), links, marks)


def forget(emb) -> None:
    """End ``emb``'s chain (its tables were replaced as a whole): its next save is full."""
    emb._delta_chain = None
    for table in emb._physical:
        table.stop_tracking()
