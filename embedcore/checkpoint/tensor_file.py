"""Reading and writing safetensors files: named, contiguous arrays behind a JSON header, no code.

The layout (the safetensors format, so other tools can read our checkpoints):

    8 bytes      little-endian u64 N, the header's length
    N bytes      JSON: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
                        "__metadata__": {str: str}}, padded with spaces
    the data     each tensor's bytes in C order, little endian, at data_offsets from the data's start

We pad the header so the data starts on a 64-byte boundary, which lets readers memory-map float32
tables without copying. Readers check everything a corrupt or truncated file could break: the header's
length and JSON, dtypes, shapes against byte ranges, ranges inside the file and not overlapping.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct

import numpy as np

from ..kernels.half import bfloat16, is_bfloat16

__all__ = ["TensorFileError", "write_tensors", "read_header", "open_tensors", "sha256_of", "open_regular",
           "read_capped", "storable", "STORABLE_DTYPE_NAMES", "STORABLE_DTYPE_SIZES"]

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_}  # and "BF16", bfloat16, which needs ml_dtypes: looked up when met (_dtype_named)
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
STORABLE_DTYPE_SIZES = {str(d): d.itemsize for d in _NAMES} | {"bfloat16": 2}  # by str(dtype)
STORABLE_DTYPE_NAMES = tuple(sorted(STORABLE_DTYPE_SIZES))


def _file_name(dtype):
    """The file's name of a little-endian ``dtype``, or None when it cannot be stored."""
    return "BF16" if is_bfloat16(dtype) else _NAMES.get(dtype)


def _dtype_named(name):
    return bfloat16() if name == "BF16" else np.dtype(_DTYPES[name])


def storable(dtype) -> bool:
    """Whether arrays of ``dtype`` (either byte order) can be written."""
    dtype = np.dtype(dtype)
    return dtype.byteorder in "<>=|" and _file_name(dtype.newbyteorder("<")) is not None
_ALIGN = 64
_MAX_HEADER = 100 * 2 ** 20
_MAX_DIMENSION = 2 ** 62
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class TensorFileError(ValueError):
    """A tensor file that is truncated, corrupt or not a safetensors file."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> tuple[int, int]:
    """``(fd, size)`` of ``path`` opened read-only, refused unless it is a regular file.

    Never blocks (a FIFO opens at once with ``O_NONBLOCK`` and is then refused) and never follows a symbolic
    link in the last component (a link to ``/dev/zero`` is refused). Raises :class:`TensorFileError` for
    anything but a regular file, ``FileNotFoundError`` for a missing one and ``OSError`` otherwise.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TensorFileError(f"{path} is a symbolic link; checkpoint files must be regular files") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TensorFileError(f"{path} is {_kind(info.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_capped(path: str, limit: int) -> bytes:
    """The whole regular file ``path`` (see :func:`open_regular`), refused if it holds more than ``limit`` bytes
    (also if it grows past ``limit`` while being read): nothing larger is ever read into memory."""
    fd, size = open_regular(path)
    try:
        if size > limit:
            raise TensorFileError(f"{path} is {size:,} bytes; at most {limit:,} are allowed")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(limit + 1 - total, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise TensorFileError(f"{path} grew past {limit:,} bytes while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _bytes_of(array: np.ndarray):
    """The bytes of a C-contiguous array, as a buffer (any dtype: bfloat16 has no buffer format of its own)."""
    return memoryview(array.reshape(-1).view(np.uint8)) if array.size else b""


def sha256_of(array: np.ndarray) -> str:
    """Hex SHA-256 of an array's bytes in C order."""
    return hashlib.sha256(_bytes_of(np.ascontiguousarray(array))).hexdigest()


def write_tensors(path: str, tensors: dict, metadata: dict | None = None) -> dict:
    """Write ``tensors`` (name -> array) to ``path`` and fsync it; returns name -> SHA-256 of its bytes."""
    header, offset, arrays = {}, 0, []
    for name, array in tensors.items():
        array = np.asarray(array)
        little = array.dtype.newbyteorder("<") if array.dtype.byteorder in "<>=" else array.dtype
        if not isinstance(name, str) or not name or name == "__metadata__" or _file_name(little) is None:
            raise TensorFileError(f"tensor {name!r} (dtype {array.dtype}) cannot be stored: names must be non-empty "
                                  f"strings other than '__metadata__', dtypes one of "
                                  f"{list(STORABLE_DTYPE_NAMES)}")
        array = np.ascontiguousarray(array, dtype=little)
        header[name] = {"dtype": _file_name(array.dtype), "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append((name, array))
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % _ALIGN)
    digests = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, array in arrays:
            view = _bytes_of(array)
            digests[name] = hashlib.sha256(view).hexdigest()
            f.write(view)
        f.flush()
        os.fsync(f.fileno())
    return digests


def read_header(path: str) -> tuple[dict, dict, int]:
    """``(tensors, metadata, data_start)`` of a safetensors file, every entry checked against the file.

    Only a regular file is read (:func:`open_regular`), at most 8 bytes plus the header's declared length,
    which must fit in the file and in 100 MiB.
    """
    try:
        fd, size = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise TensorFileError(f"{path}: {size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise TensorFileError(f"{path}: header length {n} does not fit in the file ({size} bytes); the "
                                      f"file is truncated or not a safetensors file")
            raw = f.read(n)
            if len(raw) < n:
                raise TensorFileError(f"{path}: the file ended inside its header")
    except OSError as e:
        raise TensorFileError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TensorFileError(f"{path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_size = 8 + n, size - 8 - n
    ranges = []
    for name, entry in header.items():
        try:
            dtype = _dtype_named(entry["dtype"]).newbyteorder("<")
            shape, (begin, end) = tuple(entry["shape"]), entry["data_offsets"]
            if not all(type(x) is int and 0 <= x <= _MAX_DIMENSION for x in shape + (begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise TensorFileError(f"{path}: tensor '{name}' has a malformed header entry {entry!r}") from None
        if end - begin != math.prod(shape) * dtype.itemsize or end > data_size:
            raise TensorFileError(f"{path}: tensor '{name}' (shape {shape}, bytes {begin}..{end}) does not fit "
                                  f"the {data_size} data bytes; the file is truncated or corrupt")
        ranges.append((begin, end, name))
        header[name] = {"dtype": dtype, "shape": shape, "begin": begin, "end": end}
    ranges.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise TensorFileError(f"{path}: tensors '{n0}' and '{n1}' overlap")
    return header, metadata, data_start


def open_tensors(path: str, names=None, header=None) -> dict:
    """Memory-map tensors of a safetensors file: name -> read-only NumPy array.

    ``header`` is :func:`read_header`'s result when the caller already read it.
    """
    header, _, data_start = header or read_header(path)
    names = list(header if names is None else names)
    for name in names:
        if name not in header:
            raise TensorFileError(f"{path}: has no tensor '{name}' (it holds {sorted(header)})")
    out = {}
    try:
        # Reopened as a regular file (never a FIFO or a link swapped in since the header was read) and
        # checked to still hold every mapped byte: touching a mapping past the end of a file is SIGBUS.
        fd, size = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            for name in names:
                entry = header[name]
                if data_start + entry["end"] > size:
                    raise TensorFileError(f"{path}: tensor '{name}' ends at byte {data_start + entry['end']}, past "
                                          f"the end of the file ({size} bytes)")
                if entry["end"] == entry["begin"]:
                    out[name] = np.zeros(entry["shape"], entry["dtype"])
                    continue
                mapped = np.memmap(f, dtype=entry["dtype"], mode="r",
                                   offset=data_start + entry["begin"], shape=entry["shape"], order="C")
                out[name] = mapped.view(np.ndarray)  # a plain array (kernels take it), still backed by the mapping
    except OSError as e:
        raise TensorFileError(f"{path}: cannot read ({e.strerror})") from None
    return out
