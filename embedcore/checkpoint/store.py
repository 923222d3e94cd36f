"""A checkpoint directory: immutable snapshots and an atomically replaced ``CURRENT`` pointer.

    path/
      CURRENT                         {"snapshot": "snapshot-<step>-<random>", "manifest_sha256": "..."}
      snapshot-00000042-1f2e3d4c/
        manifest.json                 format, step, configuration, every file's tensors and their SHA-256
        table-0000.safetensors ...    one file per table: "weights" and "slot/<name>", rows in id order

A save writes a new snapshot directory and fsyncs it (files, the directory, its entry in ``path``), then
replaces ``CURRENT`` with ``os.replace`` (atomic on POSIX), fsyncs ``path``, and only then deletes every
other snapshot, including leftovers of crashed saves. A crash at any point leaves ``CURRENT`` naming a
snapshot that is whole: the previous one or the new one. Readers trust nothing: ``CURRENT`` carries the
manifest's hash, the manifest carries each tensor's shape and hash, every tensor file's header is checked
against it, and file names must be plain names inside the snapshot. Two processes saving to one path at the
same time are not supported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil

from .errors import CheckpointError
from .tensor_file import TensorFileError, read_header, sha256_of, open_tensors, write_tensors

__all__ = ["FORMAT", "SnapshotWriter", "Snapshot", "open_snapshot"]

FORMAT = "embedcore-checkpoint"
VERSION = 1
_CURRENT = "CURRENT"
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors")
_SNAPSHOT_NAME = re.compile(r"snapshot-[0-9]+-[0-9a-f]+")


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

    @classmethod
    def attach(cls, path: str, name: str) -> "SnapshotWriter":
        """A writer adding files to the snapshot ``name`` another process created (it alone commits)."""
        writer = cls.__new__(cls)
        writer.path, writer.name = os.fspath(path), name
        writer.dir = os.path.join(writer.path, name)
        writer.files, writer.committed = {}, False
        if not os.path.isdir(writer.dir):
            raise CheckpointError(f"{writer.dir}: the snapshot directory is not visible here (checkpoints of "
                                  f"several processes need a file system they all share)")
        return writer

    def add(self, file_name: str, tensors: dict, metadata: dict | None = None) -> None:
        assert _FILE_NAME.fullmatch(file_name), file_name
        digests = write_tensors(os.path.join(self.dir, file_name), tensors, metadata)
        self.files[file_name] = {name: {"shape": list(a.shape), "dtype": str(a.dtype), "sha256": digests[name]}
                                 for name, a in tensors.items()}

    def commit(self, manifest: dict) -> str:
        manifest = dict(manifest, format=FORMAT, version=VERSION, files=self.files)
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
        _fsync_dir(self.path)
        self._prune()
        return self.dir

    def abort(self) -> None:
        """Delete the snapshot being written, unless it was already committed."""
        if not self.committed:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _prune(self) -> None:
        """Delete every other snapshot and leftovers of crashed saves (best effort: failures are ignored)."""
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            if name.startswith("snapshot-") and name != self.name:
                shutil.rmtree(full, ignore_errors=True)
            elif name.startswith(f"{_CURRENT}.") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.remove(full)


class Snapshot:
    """A verified view of the current snapshot of a checkpoint directory."""

    def __init__(self, path: str, name: str, manifest: dict):
        self.path, self.name, self.manifest = path, name, manifest
        self.dir = os.path.join(path, name)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def tensors(self, file_name: str, names=None, verify: bool = True) -> dict:
        """Memory-mapped, read-only tensors of one file, checked against the manifest (and hashed if ``verify``)."""
        expected = self.manifest["files"].get(file_name)
        if expected is None:
            raise CheckpointError(f"{self.dir}: the manifest lists no file '{file_name}'")
        names = list(expected) if names is None else list(names)
        file_path = os.path.join(self.dir, file_name)
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


def open_snapshot(path) -> Snapshot:
    """The snapshot ``path/CURRENT`` names, with its manifest verified against the hash in ``CURRENT``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    try:
        with open(os.path.join(path, _CURRENT)) as f:
            pointer = json.loads(f.read())
        if not isinstance(pointer, dict):
            raise ValueError("not a JSON object")
        name, digest = pointer.get("snapshot"), pointer.get("manifest_sha256")
        if not isinstance(name, str) or not _SNAPSHOT_NAME.fullmatch(name):
            raise ValueError(f"bad snapshot name {name!r}")
        if not isinstance(digest, str):
            raise ValueError("no manifest_sha256")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a checkpoint (no {_CURRENT} file)") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint: {path}/{_CURRENT} is unreadable ({e})") from None
    manifest_path = os.path.join(path, name, "manifest.json")
    try:
        with open(manifest_path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path}: {e.strerror}") from None
    if hashlib.sha256(text).hexdigest() != digest:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} does not match its SHA-256 in {_CURRENT}")
    manifest = json.loads(text)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an embedcore checkpoint (format {manifest.get('format')!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {manifest.get('version')!r}; this embedcore "
                              f"reads version {VERSION}")
    try:
        names = list(manifest.get("files", {})) + [shard.get("file") for t in manifest.get("tables", {}).values()
                                                   for shard in t.get("shards", [])]
    except AttributeError:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} has a malformed table list") from None
    names += [manifest["extra"]] if manifest.get("extra") is not None else []
    for file_name in names:
        if not isinstance(file_name, str) or not _FILE_NAME.fullmatch(file_name):
            raise CheckpointError(f"corrupt checkpoint: {manifest_path} names the file {file_name!r}; files must be "
                                  f"plain *.safetensors names inside the snapshot")
    return Snapshot(path, name, manifest)
