"""A checkpoint directory: immutable snapshots and an atomically replaced ``CURRENT`` pointer.

    path/
      CURRENT                         {"snapshot": "snapshot-<step>-<random>", "manifest_sha256": "..."}
      snapshot-00000042-1f2e3d4c/
        manifest.json                 format, step, configuration, every file's tensors and their SHA-256
        table-0000.safetensors ...    one file per table: "weights" and "slot/<name>", rows in id order

A save writes a new snapshot directory and fsyncs it (files, the directory, its entry in ``path``), then
replaces ``CURRENT`` with ``os.replace`` (atomic on POSIX), fsyncs ``path``, and only then deletes every
other snapshot, including leftovers of crashed saves (but, for a delta snapshot, the base and earlier
deltas it builds on: :mod:`.delta`). A crash at any point leaves ``CURRENT`` naming a
snapshot that is whole: the previous one or the new one. Readers trust nothing: ``CURRENT`` carries the
manifest's hash, the manifest carries each tensor's shape and hash, every tensor file's header is checked
against it, and file names must be plain names inside the snapshot. Two processes saving to one path at the
same time are not supported.

A *serving export* (:func:`embedcore.export.export_for_serving`) is the same layout with another ``format``,
``embedcore-serving``: a manifest whose ``serving.dtype`` says how the rows are stored (float32, float16,
bfloat16, or int8 in FBGEMM's fused 8-bit row-wise layout, ``uint8 [rows, dim + 8]``), every table whole in
one file holding ``weights`` only (no slots, no extra arrays). Readers accept it only when they ask for it
(``serving=True``: :class:`embedcore.ServingEmbedding`); every training reader (``load``, ``restore``, the
sharded engine, the trainer) refuses it with a :class:`CheckpointError` saying what it is, so quantized rows
can never be mistaken for a training state.

Readers also trust no file to be what its name says: only regular files are opened (never through a
symbolic link, never blocking on a FIFO), ``CURRENT`` is read up to 4 KiB and a manifest up to 64 MiB, and
the whole manifest is checked against its schema (:func:`check_manifest`) and the files' real sizes before
any caller sees it. A reader racing a save in another process (which prunes the snapshot being read)
starts again on the new ``CURRENT`` (:func:`read_current`), a bounded number of times; an error is reported
as corruption only if ``CURRENT`` still names the snapshot that failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat

from .config_codec import check_config, need_int
from .dynamic import check_dynamic_config, check_dynamic_entry, is_dynamic_entry
from .errors import CheckpointError
from .tensor_file import (STORABLE_DTYPE_SIZES, TensorFileError, read_capped, read_header, sha256_of, open_tensors,
                          write_tensors)

__all__ = ["FORMAT", "SERVING_FORMAT", "SERVING_DTYPES", "FUSED_INT8_EXTRA_BYTES", "SnapshotWriter", "Snapshot",
           "open_snapshot", "check_manifest", "read_current"]

FORMAT = "embedcore-checkpoint"
SERVING_FORMAT = "embedcore-serving"
SERVING_DTYPES = ("float32", "float16", "bfloat16", "int8")  # how a serving export stores its rows
FUSED_INT8_EXTRA_BYTES = 8  # an int8 row's float32 scale and float32 bias, after its dim codes
VERSION = 1
_CURRENT = "CURRENT"
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors")
_SNAPSHOT_NAME = re.compile(r"snapshot-[0-9]{1,20}-[0-9a-f]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_CURRENT = 4096
_MAX_MANIFEST = 64 * 2 ** 20
_MAX_STEP = 2 ** 63 - 1
_MAX_ROWS = 2 ** 62
_DTYPE_SIZES = STORABLE_DTYPE_SIZES
TABLE_DTYPES = ("float32", "float16", "bfloat16")  # how tables and slots may be stored
_RETRIES = 8


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotWriter:
    """Writes one snapshot into ``path``; :meth:`commit` makes it the current one."""

    def __init__(self, path: str, step: int):
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path} exists and is not a checkpoint directory")
        if not os.path.isdir(self.path):
            os.makedirs(self.path)
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        self.name = f"snapshot-{int(step):012d}-{secrets.token_hex(4)}"
        self.dir = os.path.join(self.path, self.name)
        os.mkdir(self.dir)
        self.files = {}
        self.committed = False
        self.manifest_sha256 = None  # of the committed manifest: what CURRENT (and a later delta) names
        self.keep = frozenset()  # other snapshots the commit keeps (a delta's chain)

    @classmethod
    def attach(cls, path: str, name: str) -> "SnapshotWriter":
        """A writer adding files to the snapshot ``name`` another process created (it alone commits)."""
        writer = cls.__new__(cls)
        writer.path, writer.name = os.fspath(path), name
        writer.dir = os.path.join(writer.path, name)
        writer.files, writer.committed, writer.manifest_sha256, writer.keep = {}, False, None, frozenset()
        if not os.path.isdir(writer.dir):
            raise CheckpointError(f"{writer.dir}: the snapshot directory is not visible here (checkpoints of "
                                  f"several processes need a file system they all share)")
        return writer

    def add(self, file_name: str, tensors: dict, metadata: dict | None = None) -> None:
        assert _FILE_NAME.fullmatch(file_name), file_name
        digests = write_tensors(os.path.join(self.dir, file_name), tensors, metadata)
        self.files[file_name] = {name: {"shape": list(a.shape), "dtype": str(a.dtype), "sha256": digests[name]}
                                 for name, a in tensors.items()}

    def commit(self, manifest: dict, file_format: str = FORMAT, keep=()) -> str:
        """Write ``manifest`` (``format`` = ``file_format``: :data:`FORMAT`, or :data:`SERVING_FORMAT` for a
        serving export) and make this snapshot the current one; returns its directory. Every other snapshot
        is then deleted but those named in ``keep`` (the base and earlier deltas a delta snapshot needs)."""
        assert file_format in (FORMAT, SERVING_FORMAT), file_format
        manifest = dict(manifest, format=file_format, version=VERSION, files=self.files)
        text = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
        with open(os.path.join(self.dir, "manifest.json"), "wb") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.dir)
        _fsync_dir(self.path)  # the snapshot's entry is durable before CURRENT names it
        pointer = json.dumps({"snapshot": self.name, "manifest_sha256": hashlib.sha256(text).hexdigest()})
        tmp = os.path.join(self.path, f"{_CURRENT}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "w") as f:
            f.write(pointer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, _CURRENT))
        self.committed = True  # from here on the new snapshot is the checkpoint: never delete it
        self.manifest_sha256 = hashlib.sha256(text).hexdigest()
        _fsync_dir(self.path)
        self.keep = frozenset(keep)
        self._prune()
        return self.dir

    def abort(self) -> None:
        """Delete the snapshot being written, unless it was already committed."""
        if not self.committed:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _prune(self) -> None:
        """Delete every other snapshot but those the commit keeps and leftovers of crashed saves (best effort:
        failures are ignored)."""
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            if name.startswith("snapshot-") and name != self.name and name not in self.keep:
                shutil.rmtree(full, ignore_errors=True)
            elif name.startswith(f"{_CURRENT}.") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.remove(full)


class Snapshot:
    """A verified view of the current snapshot of a checkpoint directory.

    A delta snapshot (:mod:`.delta`) is seen composed: ``manifest`` is its base's (tables, shards, files)
    with the delta's step, configuration, metadata and extra; ``file_dirs`` says where the base's files lie
    and ``deltas`` are the delta snapshots whose changed rows apply on top, oldest first.
    """

    def __init__(self, path: str, name: str, manifest: dict, file_dirs=None, deltas=(), virtual=None):
        self.path, self.name, self.manifest = path, name, manifest
        self.dir = os.path.join(path, name)
        self.file_dirs = dict(file_dirs or {})
        self.deltas = tuple(deltas)
        self.virtual = dict(virtual or {})  # file name -> function making its tensors (a composed dynamic table)

    def file_path(self, file_name: str) -> str:
        """Where the file ``file_name`` of the manifest lies."""
        return os.path.join(self.file_dirs.get(file_name, self.dir), file_name)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def serving_dtype(self) -> str | None:
        """How a serving export stores its rows (one of :data:`SERVING_DTYPES`); None for a training checkpoint."""
        if self.manifest.get("format") != SERVING_FORMAT:
            return None
        return self.manifest["serving"]["dtype"]

    def tensors(self, file_name: str, names=None, verify: bool = True) -> dict:
        """Memory-mapped, read-only tensors of one file, checked against the manifest (and hashed if ``verify``)."""
        expected = self.manifest["files"].get(file_name)
        if expected is None:
            raise CheckpointError(f"{self.dir}: the manifest lists no file '{file_name}'")
        names = list(expected) if names is None else list(names)
        if file_name in self.virtual:  # made from verified files, as declared
            made = self.virtual[file_name]()
            return {name: made[name] for name in names}
        file_path = self.file_path(file_name)
        try:
            parsed = read_header(file_path)
            header = parsed[0]
            if set(header) != set(expected):
                raise CheckpointError(f"{file_path}: holds tensors {sorted(header)}, the manifest lists "
                                      f"{sorted(expected)}")
            for name in names:
                entry, want = header[name], expected[name]
                if list(entry["shape"]) != want["shape"] or entry["dtype"] != want["dtype"]:
                    raise CheckpointError(f"{file_path}: tensor '{name}' is {entry['dtype']}{list(entry['shape'])}, "
                                          f"the manifest says {want['dtype']}{want['shape']}")
            arrays = open_tensors(file_path, names, header=parsed)
        except TensorFileError as e:
            raise CheckpointError(f"corrupt checkpoint: {e}") from None
        if verify:
            for name in names:
                if sha256_of(arrays[name]) != expected[name]["sha256"]:
                    raise CheckpointError(f"corrupt checkpoint: {file_path}: tensor '{name}' does not match its "
                                          f"SHA-256 in the manifest")
        return arrays


def _current_name(path: str) -> str:
    """The snapshot name ``path/CURRENT`` holds; CheckpointError if unreadable."""
    return _read_pointer(path)[0]


def _read_pointer(path: str) -> tuple[str, str]:
    """``(snapshot name, manifest SHA-256)`` from ``path/CURRENT``, a regular file of at most 4 KiB."""
    current = os.path.join(path, _CURRENT)
    try:
        pointer = json.loads(read_capped(current, _MAX_CURRENT).decode("utf-8"))
        if not isinstance(pointer, dict):
            raise ValueError("not a JSON object")
        name, digest = pointer.get("snapshot"), pointer.get("manifest_sha256")
        if not isinstance(name, str) or not _SNAPSHOT_NAME.fullmatch(name):
            raise ValueError(f"bad snapshot name {name!r:.100}")
        if not isinstance(digest, str):
            raise ValueError("no manifest_sha256")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a checkpoint (no {_CURRENT} file)") from None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise CheckpointError(f"corrupt checkpoint: {path}/{_CURRENT} is unreadable ({reason})") from None
    return name, digest


def _moved_on(path: str, name: str) -> bool:
    """Whether ``path/CURRENT`` now names another snapshot than ``name`` (a save committed meanwhile)."""
    try:
        return _current_name(path) != name
    except CheckpointError:
        return False


def read_current(path, use, attempts: int = _RETRIES, serving: bool = False):
    """``use(snapshot)`` on the current snapshot of ``path``, consistently although other processes may save.

    A save in another process deletes the previous snapshot once its new ``CURRENT`` is in place, so a
    reader can find files vanishing under it. When ``use`` (or opening the snapshot) fails and ``CURRENT``
    meanwhile names another snapshot, the read starts again on that one, up to ``attempts`` times; the
    failure is reported only if ``CURRENT`` still names the snapshot it happened on (then it is real).
    ``use`` must not change anything until it has read all it needs: a retried call starts from scratch.
    Files already opened stay valid (a deleted file's data lives while it is mapped), so data from one
    attempt is never mixed with another's. ``serving``: a serving export is accepted too (else refused).
    """
    path = os.fspath(path)
    for attempt in range(attempts):
        name = None
        try:
            snap = open_snapshot(path, _retry=False, serving=serving)
            name = snap.name
            return use(snap)
        except (CheckpointError, OSError) as e:
            if name is None:
                name = getattr(e, "_snapshot", None)
            if name is None or attempt == attempts - 1 or not _moved_on(path, name):
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(f"corrupt checkpoint: {path}: {type(e).__name__}: {e}") from None
    raise AssertionError("unreachable")  # pragma: no cover


def open_snapshot(path, _retry: bool = True, serving: bool = False) -> Snapshot:
    """The snapshot ``path/CURRENT`` names, with its manifest verified against the hash in ``CURRENT`` and
    checked by :func:`check_manifest` (every field, and every file it names against the file's real size).
    A serving export is refused unless ``serving``."""
    path = os.fspath(path)
    if _retry:
        return read_current(path, lambda snap: snap, serving=serving)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    name, digest = _read_pointer(path)
    try:
        manifest = read_manifest(path, name, digest, serving)
        if "delta" in manifest:
            from .delta import compose
            return compose(path, name, manifest)
        snap = Snapshot(path, name, manifest)
        check_file_sizes(snap)
        return snap
    except CheckpointError as e:
        e._snapshot = name  # for read_current: the snapshot this failure happened on
        raise


def read_manifest(path: str, name: str, digest: str, serving: bool = False, named_by: str = _CURRENT) -> dict:
    """The manifest of snapshot ``name`` of ``path``, verified against ``digest`` (its SHA-256, as
    ``named_by`` records it) and checked by :func:`check_manifest`."""
    manifest_path = os.path.join(path, name, "manifest.json")
    try:
        text = read_capped(manifest_path, _MAX_MANIFEST)
    except TensorFileError as e:
        raise CheckpointError(f"corrupt checkpoint: {e}") from None
    except OSError as e:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path}: {e.strerror}") from None
    if hashlib.sha256(text).hexdigest() != digest:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} does not match its SHA-256 in {named_by}")
    try:
        manifest = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} is not JSON ({e})") from None
    return check_manifest(manifest, path, manifest_path, serving)


def _bad(where: str, what: str, value) -> CheckpointError:
    return CheckpointError(f"corrupt checkpoint: {where} must be {what}, got {value!r:.120}")


def _need(value, kind, where: str, what: str):
    if not isinstance(value, kind):
        raise _bad(where, what, value)
    return value


def check_manifest(manifest, path: str, manifest_path: str, serving: bool = False) -> dict:
    """``manifest`` if it is a whole, consistent checkpoint manifest, else :class:`CheckpointError` naming the
    field and its value. The schema, all of which is checked before any caller uses a field:

    - ``format`` and ``version``: this format; ``step``: an integer from 0 to 2^63-1 (not a bool);
      ``embedcore_version``: a string; ``metadata``: any JSON; ``extra``: null or a file named in ``files``;
    - ``config``: :func:`~embedcore.checkpoint.config_codec.check_config`; its tables are exactly ``tables``,
      with the same ``vocabulary_size`` and ``dim``;
    - ``files``: plain ``*.safetensors`` names -> tensor name -> ``shape`` (integers >= 0), a storable
      ``dtype`` and a hex ``sha256``;
    - ``tables``: a dynamic table (``"dynamic": true``) as :func:`embedcore.checkpoint.dynamic.check_dynamic_entry`
      says (and :func:`~embedcore.checkpoint.dynamic.check_dynamic_config`, against its configuration); any
      other: name -> ``vocabulary_size`` (>= 1), ``dim`` (>= 1), ``slots`` (distinct non-empty names) and
      ``shards`` that partition the rows exactly (``first_row`` 0..stride-1, one stride, ``rows`` as the
      stride implies), each in a listed file holding exactly ``weights`` (float32, float16 or bfloat16
      ``[rows, dim]``, as the configuration's ``weights_dtype`` says) and ``slot/<name>`` per slot (``[rows]``
      or ``[rows, dim]``, of the configuration's ``slot_dtype``, the same in every shard).

    A delta snapshot (a ``delta`` field) has the same fields but ``tables``, checked by
    :func:`.delta.check_delta_fields` (its chain is checked when it is opened: :func:`.delta.compose`).

    A serving export (``format`` :data:`SERVING_FORMAT`, accepted only with ``serving``; else refused saying
    what it is) has the same fields and ``serving``: ``{"dtype": one of SERVING_DTYPES, "source_snapshot":
    str (optional)}``; ``extra`` is null; each table has no slots and one shard, whole (``first_row`` 0,
    ``stride`` 1), its file holding exactly ``weights``: ``uint8 [rows, dim + 8]`` for int8 (codes, float32
    scale, float32 bias), else of ``serving.dtype`` ``[rows, dim]``; the configuration's storage settings are
    the training tables' and are not compared with it.
    """
    if isinstance(manifest, dict) and manifest.get("format") == SERVING_FORMAT and not serving:
        shown = manifest.get("serving", {}).get("dtype") if isinstance(manifest.get("serving"), dict) else None
        raise CheckpointError(f"{path} is a serving export (rows stored as {shown!r:.40}, written by "
                              f"embedcore.export_for_serving), not a training checkpoint: it holds no optimizer "
                              f"slots and its rows may be quantized, so it cannot be loaded or restored for "
                              f"training. Serve it with embedcore.ServingEmbedding({path!r}), or load the "
                              f"training checkpoint it was exported from")
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, SERVING_FORMAT):
        shown = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: not an embedcore checkpoint (format {shown!r:.100})")
    serving_dtype = _check_serving(manifest, manifest_path) if manifest["format"] == SERVING_FORMAT else None
    if type(manifest.get("version")) is not int or manifest["version"] != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {manifest.get('version')!r:.100}; this embedcore "
                              f"reads version {VERSION}")
    where = manifest_path
    for key in ("step", "config", "tables", "files", "extra"):
        if key not in manifest:
            raise CheckpointError(f"corrupt checkpoint: {where} has no '{key}'")
    need_int(manifest["step"], f"{where}: step", 0, _MAX_STEP,
             fail=lambda w, what, v: _bad(w, f"a step count ({what})", v))
    if "embedcore_version" in manifest:
        _need(manifest["embedcore_version"], str, f"{where}: embedcore_version", "a string")
    files = _need(manifest["files"], dict, f"{where}: files", "an object of files")
    for file_name, tensors in files.items():
        _check_file_name(file_name, manifest_path)
        _need(tensors, dict, f"{where}: files.{file_name}", "an object of tensors")
        for tensor, entry in tensors.items():
            w = f"{where}: files.{file_name}.{tensor}"
            if not tensor or tensor == "__metadata__":
                raise _bad(f"{where}: files.{file_name}", "tensor names other than '' and '__metadata__'", tensor)
            _need(entry, dict, w, "an object with shape, dtype and sha256")
            shape = _need(entry.get("shape"), list, f"{w}.shape", "a list of integers")
            for d in shape:
                need_int(d, f"{w}.shape", 0, _MAX_ROWS, fail=lambda w_, what, v: _bad(w_, f"made of {what}", shape))
            if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in _DTYPE_SIZES:
                raise _bad(f"{w}.dtype", f"one of {sorted(_DTYPE_SIZES)}", entry.get("dtype"))
            if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
                raise _bad(f"{w}.sha256", "64 hex digits", entry.get("sha256"))
    extra = manifest["extra"]
    if extra is not None:
        _check_file_name(extra, manifest_path)
        if extra not in files:
            raise _bad(f"{where}: extra", f"null or one of the files {sorted(files)}", extra)
    tables = _need(manifest["tables"], dict, f"{where}: tables", "an object of tables")
    if "delta" in manifest:  # an incremental snapshot: changed rows, checked by .delta
        from .delta import check_delta_fields
        check_delta_fields(manifest, files, where, manifest_path, serving_dtype)
    else:
        for name, entry in tables.items():
            if is_dynamic_entry(entry):
                check_dynamic_entry(name, entry, files, manifest_path, serving_dtype)
            else:
                _check_table(name, entry, files, where, manifest_path, serving_dtype)
    try:
        config = check_config(manifest["config"])
    except CheckpointError as e:
        raise CheckpointError(f"corrupt checkpoint: {where}: {e}") from None
    configured = {t["name"]: t for t in config["tables"]}
    for name, t in configured.items():
        if name not in tables:
            raise CheckpointError(f"corrupt checkpoint: {path} holds no table '{name}' (it holds "
                                  f"{sorted(tables)}), which its configuration lists")
        stored = (tables[name]["vocabulary_size"], tables[name]["dim"])
        if stored != (t["vocabulary_size"], t["dim"]):
            raise CheckpointError(f"corrupt checkpoint: {path}: table '{name}' tensor 'weights' has shape "
                                  f"{stored}; its configuration needs shape {(t['vocabulary_size'], t['dim'])}")
        if is_dynamic_entry(tables[name]):
            check_dynamic_config(name, tables[name], files, t, manifest_path, serving_dtype is not None)
        elif "dynamic" in t:
            raise CheckpointError(f"corrupt checkpoint: {path}: table '{name}' is dynamic in its configuration but "
                                  f"stored as a static table")
        if serving_dtype is not None:
            continue  # stored as the export's dtype (checked by _check_table), whatever training stored
        entry = tables[name]
        tensors = files[entry["file"] if "delta" in manifest and "file" in entry else entry["shards"][0]["file"]]
        for what, dtype_key in (("weights", "weights_dtype"), ("slots", "slot_dtype")):
            held = [entry["dtype"] for key, entry in tensors.items()
                    if (key == "weights" if what == "weights" else key.startswith("slot/"))]  # slots share one dtype
            want = t.get(dtype_key, "float32")
            if held and held[0] != want:
                raise CheckpointError(f"corrupt checkpoint: {path}: table '{name}' stores its {what} as {held[0]}; "
                                      f"its configuration says {dtype_key}={want!r}")
    if set(tables) != set(configured):
        raise CheckpointError(f"corrupt checkpoint: {where}: tables {sorted(set(tables) - set(configured))} are "
                              f"not in its configuration")
    return manifest


def _check_file_name(file_name, manifest_path: str) -> None:
    if not isinstance(file_name, str) or not _FILE_NAME.fullmatch(file_name):
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} names the file {file_name!r:.100}; files must "
                              f"be plain *.safetensors names inside the snapshot")


def _check_serving(manifest: dict, manifest_path: str) -> str:
    """The ``serving.dtype`` of a serving export's manifest, after checking its serving fields."""
    where = manifest_path
    serving = _need(manifest.get("serving"), dict, f"{where}: serving", "an object with the export's dtype")
    if set(serving) - {"dtype", "source_snapshot"}:
        raise _bad(f"{where}: serving", "an object of dtype and source_snapshot", serving)
    dtype = serving.get("dtype")
    if not isinstance(dtype, str) or dtype not in SERVING_DTYPES:
        raise _bad(f"{where}: serving.dtype", f"one of {list(SERVING_DTYPES)}", dtype)
    if "source_snapshot" in serving:
        _need(serving["source_snapshot"], str, f"{where}: serving.source_snapshot", "a string")
    if manifest.get("extra") is not None:
        raise _bad(f"{where}: extra", "null (a serving export holds no extra arrays)", manifest.get("extra"))
    return dtype


def _check_serving_table(name, entry, files: dict, manifest_path: str, dtype: str) -> None:
    """A serving export's table: no slots, one whole shard whose file holds exactly its ``weights``."""
    w = f"corrupt checkpoint: {manifest_path}: table '{name}' of a serving export"
    if entry["slots"]:
        raise CheckpointError(f"{w} lists slots {entry['slots']!r:.100}; a serving export holds none")
    shards = entry["shards"]
    if len(shards) != 1 or shards[0]["stride"] != 1:
        raise CheckpointError(f"{w} has {len(shards)} shards; a serving export holds each table whole, in one file")
    stored = files[shards[0]["file"]]
    if set(stored) != {"weights"}:
        raise CheckpointError(f"{w} needs exactly the tensor 'weights' in {shards[0]['file']}, which holds "
                              f"{sorted(stored)}")
    rows, dim = shards[0]["rows"], entry["dim"]
    want = ("uint8", (rows, dim + FUSED_INT8_EXTRA_BYTES)) if dtype == "int8" else (dtype, (rows, dim))
    got = (stored["weights"]["dtype"], tuple(stored["weights"]["shape"]))
    if got != want:
        raise CheckpointError(f"{w}: tensor 'weights' in {shards[0]['file']} is {got[0]} of shape {got[1]}; an "
                              f"export of dtype {dtype!r} stores {want[0]} of shape {want[1]}")


def _check_table(name, entry, files: dict, where: str, manifest_path: str, serving_dtype: str | None = None) -> None:
    w = f"{where}: table '{name}'"
    _need(entry, dict, w, "an object")
    vocabulary = need_int(entry.get("vocabulary_size"), f"{w}.vocabulary_size", 1, _MAX_ROWS, fail=_bad)
    dim = need_int(entry.get("dim"), f"{w}.dim", 1, 2 ** 31 - 1, fail=_bad)
    slots = _need(entry.get("slots"), list, f"{w}.slots", "a list of slot names")
    if not all(isinstance(s, str) and s for s in slots) or len(set(slots)) != len(slots):
        raise _bad(f"{w}.slots", "distinct non-empty names", slots)
    shards = _need(entry.get("shards"), list, f"{w}.shards", "a list of shards")
    if not shards:
        raise _bad(f"{w}.shards", "a non-empty list of shards", shards)
    partition = f"corrupt checkpoint: {manifest_path}: the shards of table '{name}' do not partition its rows"
    for shard in shards:
        if not isinstance(shard, dict) or set(shard) != {"file", "first_row", "stride", "rows"}:
            raise CheckpointError(partition)
    stride = shards[0]["stride"]
    if type(stride) is not int or not 1 <= stride <= len(shards) or \
            any(type(sh["stride"]) is not int or sh["stride"] != stride for sh in shards) or \
            any(type(sh["first_row"]) is not int for sh in shards) or \
            sorted(sh["first_row"] for sh in shards) != list(range(stride)) or \
            any(type(sh["rows"]) is not int or sh["rows"] != len(range(sh["first_row"], vocabulary, stride))
                for sh in shards):
        raise CheckpointError(partition)
    for shard in shards:
        _check_file_name(shard["file"], manifest_path)
        if shard["file"] not in files:
            raise _bad(f"{w}.shards.file", f"one of the files {sorted(files)}", shard["file"])
    if serving_dtype is not None:
        _check_serving_table(name, entry, files, manifest_path, serving_dtype)
        return
    slot_shapes = None
    for shard in shards:
        stored = files[shard["file"]]
        wanted = {"weights"} | {f"slot/{s}" for s in slots}
        if set(stored) != wanted:
            raise CheckpointError(f"corrupt checkpoint: {manifest_path}: table '{name}' (slots {slots}) needs the "
                                  f"tensors {sorted(wanted)} in {shard['file']}, which holds {sorted(stored)}")
        rows = shard["rows"]
        for key in sorted(wanted):
            shape = tuple(stored[key]["shape"])
            ok = shape == (rows, dim) if key == "weights" else shape in ((rows,), (rows, dim))
            if stored[key]["dtype"] not in TABLE_DTYPES or not ok:
                raise CheckpointError(f"corrupt checkpoint: {manifest_path}: table '{name}' tensor '{key}' in "
                                      f"{shard['file']} is {stored[key]['dtype']} of shape {shape}")
        shapes = {key: (len(stored[key]["shape"]), stored[key]["dtype"]) for key in wanted}
        if len({dtype for key, (_, dtype) in shapes.items() if key != "weights"}) > 1:
            raise CheckpointError(f"corrupt checkpoint: {manifest_path}: table '{name}' has slots of different "
                                  f"dtypes in {shard['file']}")
        if slot_shapes is not None and shapes != slot_shapes:
            raise CheckpointError(f"corrupt checkpoint: {manifest_path}: table '{name}' has slots of different "
                                  f"ranks or dtypes in different shards")
        slot_shapes = shapes


def check_file_sizes(snap: Snapshot) -> None:
    """Every file the manifest lists is a regular file at least as large as the tensors it declares.

    Declared shapes are thus bounded by bytes that exist before anyone allocates memory for them.
    """
    for file_name, tensors in snap.manifest["files"].items():
        file_path = snap.file_path(file_name)
        declared = 8 + sum(math.prod(t["shape"]) * _DTYPE_SIZES[t["dtype"]] for t in tensors.values())
        try:
            info = os.stat(file_path, follow_symlinks=False)
        except OSError as e:
            raise CheckpointError(f"corrupt checkpoint: {file_path}: {e.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"corrupt checkpoint: {file_path} is not a regular file")
        if info.st_size < declared:
            raise CheckpointError(f"corrupt checkpoint: {file_path} is {info.st_size:,} bytes; the manifest declares "
                                  f"tensors of {declared - 8:,} bytes in it")
