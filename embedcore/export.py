"""Serving exports: a training checkpoint's tables, without slots, as float32, 16-bit or int8 rows.

``export_for_serving(checkpoint, out, dtype)`` reads the tables of a checkpoint written by
``Embedding.save`` (or a ``ShardedEmbedding``'s collective save), verified as every reader verifies them
(SHA-256, finite values), and writes them to the directory ``out`` as a *serving export*: the checkpoint
layout (:mod:`embedcore.checkpoint.store`) with the format ``embedcore-serving``, each table whole in one
file holding only its ``weights``, written and committed atomically like a save. ``ServingEmbedding(out)``
serves it, memory-mapped; ``Embedding.load`` / ``restore`` refuse it (:class:`CheckpointError`).

How the rows are stored (``dtype``):

* ``"float32"``: as trained (16-bit tables widened exactly): the same lookups as the training checkpoint;
* ``"float16"`` / ``"bfloat16"``: each value rounded to nearest (ties to even), half the bytes; a value
  beyond float16's range (65504) is refused naming the table and row;
* ``"int8"``: FBGEMM's fused 8-bit row-wise quantization, ``uint8 [rows, dim + 8]``: each row its ``dim``
  codes, then its float32 ``scale`` and float32 ``bias`` (little endian), value ``scale * code + bias``.
  Per row: ``bias = min(row)``, ``scale = float32((max(row) - min(row)) / 255)`` (the span computed in
  float64), and ``code = round_half_to_even((x - bias) / scale)`` computed in float64 with the float32
  ``scale`` as stored, clipped to 0..255. So every value comes back within half a step, ``|x -
  (scale * code + bias)| <= scale / 2`` (plus float32 rounding of the dequantization). A constant row
  (``max == min``) gets ``scale = 0``, every code 0, ``bias`` = its value: exact. (FBGEMM's reference
  rounds ``(x - min) * 255 / (range + 1e-8)`` in float32 instead; the codes may differ by one where a
  value lies near half a step, the bound is the same.) A row whose values span more than float32's range
  (its ``scale * 255 + bias`` would overflow) is refused. About a quarter of float32's bytes for rows of
  64 values (72 bytes instead of 256).

A dynamic table is exported as its keys (``keys``, uint64, increasing) and their rows (``weights``, stored as
above, in key order; no slots, no metadata): ``ServingEmbedding`` maps keys to rows with them.

int4 is not offered: rows of 64 values would take 40 bytes instead of 72, at 17 times the error of int8.
"""

from __future__ import annotations

import os

import numpy as np

from .checkpoint import CheckpointError, check_finite, read_current, table_tensors
from .checkpoint.dynamic import dynamic_file_name, is_dynamic_entry, read_state
from .checkpoint.store import (FUSED_INT8_EXTRA_BYTES, SERVING_DTYPES, SERVING_FORMAT, Snapshot, SnapshotWriter,
                               open_snapshot)
from .kernels.half import stored_dtype
from .memory_budget import check_fits

__all__ = ["export_for_serving", "quantize_int8_rows", "dequantize_int8_rows", "serving_weights", "serving_rows",
           "SERVING_DTYPES"]

_CHUNK_ROWS = 1 << 14  # rows converted per pass (a few MB of float64 scratch for rows of 64 values)
_F32_MAX = np.float32(np.finfo(np.float32).max)


def quantize_int8_rows(values: np.ndarray, out: np.ndarray | None = None, first_row: int = 0) -> np.ndarray:
    """``values`` (``[n, dim]`` float32, float16 or bfloat16, finite) as fused 8-bit row-wise rows, ``uint8
    [n, dim + 8]`` (written into ``out`` if given): codes, float32 scale, float32 bias, as the module
    docstring defines them. ``ValueError`` (naming the row, counted from ``first_row``) for a row whose span
    float32 cannot hold."""
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] == 0:
        raise ValueError(f"int8 rows are quantized from [n, dim] values with dim >= 1, got shape {values.shape}")
    n, dim = values.shape
    if out is None:
        out = np.empty((n, dim + FUSED_INT8_EXTRA_BYTES), np.uint8)
    for lo in range(0, n, _CHUNK_ROWS):
        x = values[lo:lo + _CHUNK_ROWS].astype(np.float32)  # exact for 16-bit values
        low, high = x.min(axis=1), x.max(axis=1)
        span = high.astype(np.float64) - low.astype(np.float64)
        scale = (span / 255.0).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            top = scale * np.float32(255) + low
        bad = np.flatnonzero(~np.isfinite(top) | ~np.isfinite(span))
        if bad.size:
            row = first_row + lo + int(bad[0])
            raise ValueError(f"row {row} spans {low[bad[0]]:g} .. {high[bad[0]]:g}, more than float32 holds: it "
                             f"cannot be quantized to int8 (scale * 255 + bias would overflow)")
        step = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)  # constant rows: x - low is 0
        codes = np.rint((x.astype(np.float64) - low.astype(np.float64)[:, None]) / step[:, None])
        np.clip(codes, 0, 255, out=codes)
        part = out[lo:lo + x.shape[0]]
        part[:, :dim] = codes.astype(np.uint8)
        part[:, dim:dim + 4] = scale.astype("<f4").view(np.uint8).reshape(-1, 4)
        part[:, dim + 4:dim + 8] = low.astype("<f4").view(np.uint8).reshape(-1, 4)
    return out


def _scales_biases(fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, bias)`` float32 ``[n]`` of fused int8 rows (copies)."""
    dim = fused.shape[1] - FUSED_INT8_EXTRA_BYTES
    tail = np.ascontiguousarray(fused[:, dim:]).view("<f4").astype(np.float32)
    return tail[:, 0], tail[:, 1]


def dequantize_int8_rows(fused: np.ndarray) -> np.ndarray:
    """Fused int8 rows (``uint8 [n, dim + 8]``) back to float32 ``[n, dim]``: ``scale * code + bias`` (for
    tests and tools; serving dequantizes inside the gather and never makes this copy)."""
    fused = np.asarray(fused)
    if fused.dtype != np.uint8 or fused.ndim != 2 or fused.shape[1] <= FUSED_INT8_EXTRA_BYTES:
        raise ValueError(f"fused int8 rows are uint8 [n, dim + 8], got {fused.dtype} {fused.shape}")
    scale, bias = _scales_biases(fused)
    codes = fused[:, :fused.shape[1] - FUSED_INT8_EXTRA_BYTES].astype(np.float32)
    return codes * scale[:, None] + bias[:, None]


def _convert(array: np.ndarray, dtype: str, where: str) -> np.ndarray:
    """A table's rows as the export stores them (module docstring); ``CheckpointError`` naming ``where`` for a
    value or row the dtype cannot hold."""
    n, dim = array.shape
    if dtype == "float32" and array.dtype == np.float32:
        return array  # the verified memory map itself: written without a copy
    width = dim + FUSED_INT8_EXTRA_BYTES if dtype == "int8" else dim
    target = np.dtype(np.uint8) if dtype == "int8" else stored_dtype(dtype)
    check_fits(n * width * target.itemsize, f"{where} as {dtype}", error=CheckpointError)
    out = np.empty((n, width), target)
    if dtype == "int8":
        try:
            return quantize_int8_rows(array, out)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
    for lo in range(0, n, _CHUNK_ROWS):
        part = array[lo:lo + _CHUNK_ROWS].astype(np.float32)
        with np.errstate(over="ignore"):
            out[lo:lo + part.shape[0]] = part.astype(target)  # to nearest, ties to even
        bad = np.flatnonzero(~np.isfinite(out[lo:lo + part.shape[0]].astype(np.float32)).all(axis=1))
        if bad.size:
            row = lo + int(bad[0])
            value = part[bad[0]][~np.isfinite(out[row].astype(np.float32))][0]
            raise CheckpointError(f"{where} holds {value:g} in row {row} (and {bad.size - 1} more row(s) in rows "
                                  f"{lo}..{lo + part.shape[0] - 1}), beyond the range of {dtype}: export it as "
                                  f"float32, bfloat16 or int8 instead")
    return out


def _check_out(out: str, checkpoint: str) -> None:
    """Refuse an ``out`` that would replace a training checkpoint (or the source itself)."""
    if os.path.realpath(out) == os.path.realpath(checkpoint):
        raise CheckpointError(f"{out}: a serving export cannot replace the checkpoint it is exported from; "
                              f"choose another directory")
    if not os.path.lexists(os.path.join(out, "CURRENT")):
        return
    try:
        snap = open_snapshot(out, serving=True)
    except CheckpointError as e:
        raise CheckpointError(f"{out} holds something that is not a readable serving export ({e}); exporting there "
                              f"would replace it: choose another directory") from None
    if snap.serving_dtype is None:
        raise CheckpointError(f"{out} holds a training checkpoint (step {snap.step}); exporting there would replace "
                              f"it: choose another directory")


def export_for_serving(checkpoint, out, dtype: str = "int8", metadata=None) -> str:
    """Write the tables of ``checkpoint`` to ``out`` as a serving export stored as ``dtype`` (module docstring:
    ``"int8"``, ``"float16"``, ``"bfloat16"`` or ``"float32"``); returns the export's snapshot directory.

    ``checkpoint`` is a directory written by ``Embedding.save`` or a ``ShardedEmbedding``'s collective save,
    read whole and verified first (a save meanwhile makes it read the new one). ``out`` gets a new snapshot,
    committed atomically (a crash leaves the previous export or the new one); an ``out`` holding a training
    checkpoint is refused, never replaced. The export keeps the checkpoint's configuration, step and
    ``metadata`` (unless given). Serve it with ``ServingEmbedding(out)``.

    Raises:
        ValueError: ``dtype`` is not one of those.
        CheckpointError: the checkpoint is missing, corrupt or a serving export itself; ``out`` holds a
            training checkpoint; a value does not fit ``dtype`` (beyond float16's range; an int8 row
            spanning more than float32 holds); not enough memory.
    """
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype must be one of {list(SERVING_DTYPES)}, got {dtype!r:.80}")
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    _check_out(out, checkpoint)

    def read(snap: Snapshot):
        tables, keys = {}, {}
        for name, entry in snap.manifest["tables"].items():
            if is_dynamic_entry(entry):
                state = read_state(snap, name)
                tables[name], keys[name] = state.weights, state.keys
            else:
                shape = (entry["vocabulary_size"], entry["dim"])
                tables[name] = table_tensors(snap, name, {"weights": shape})["weights"]
        return snap, tables, keys

    snap, tables, keys = read_current(checkpoint, read)
    manifest = snap.manifest
    writer = SnapshotWriter(out, snap.step)
    try:
        entries = {}
        for k, (name, rows) in enumerate(tables.items()):
            stored = _convert(rows, dtype, f"{snap.dir}: table '{name}' weights")
            if name in keys:
                entries[name] = _write_dynamic(writer, dynamic_file_name(k), name, manifest["tables"][name],
                                               keys[name], stored, dtype)
                continue
            file_name = f"table-{k:04d}.safetensors"
            writer.add(file_name, {"weights": stored}, {"table": name, "serving_dtype": dtype})
            del stored
            entries[name] = {"slots": [], "vocabulary_size": rows.shape[0], "dim": rows.shape[1],
                             "shards": [{"file": file_name, "first_row": 0, "stride": 1, "rows": rows.shape[0]}]}
        from . import __version__
        return writer.commit({"step": snap.step, "config": manifest["config"], "tables": entries,
                              "metadata": manifest.get("metadata") if metadata is None else metadata,
                              "extra": None, "embedcore_version": __version__,
                              "serving": {"dtype": dtype, "source_snapshot": snap.name}}, SERVING_FORMAT)
    except BaseException:
        writer.abort()
        raise


def _write_dynamic(writer, file_name: str, name: str, entry: dict, keys, stored, dtype: str) -> dict:
    """Write a dynamic table's keys and exported rows; its manifest entry (the checkpoint's, without slots)."""
    writer.add(file_name, {"keys": keys, "weights": stored}, {"table": name, "serving_dtype": dtype})
    n = int(keys.shape[0])
    return {**entry, "slots": [], "n": n, "shards": [{"file": file_name, "first_row": 0, "stride": 1, "rows": n}]}


def _check_fused(fused: np.ndarray, where: str) -> None:
    """Refuse fused int8 rows whose scale or bias is NaN/Inf, whose scale is negative, or whose largest
    value (``scale * 255 + bias``) overflows float32."""
    for lo in range(0, fused.shape[0], 1 << 16):
        scale, bias = _scales_biases(fused[lo:lo + (1 << 16)])
        with np.errstate(over="ignore", invalid="ignore"):
            ok = np.isfinite(scale) & np.isfinite(bias) & (scale >= 0) & np.isfinite(scale * np.float32(255) + bias)
        if not ok.all():
            bad = (lo + np.flatnonzero(~ok)).tolist()
            raise CheckpointError(f"{where} has a NaN, Inf or negative scale or bias in {len(bad)} row(s) of rows "
                                  f"{lo}.., e.g. rows {bad[:5]}; the export is not served")


def serving_weights(snap: Snapshot, tables, verify: bool = True) -> dict:
    """As :func:`serving_rows`, for static tables only (``TableConfig`` s)."""
    return serving_rows(snap, {t.name: (t.vocabulary_size, t.dim) for t in tables}, verify)


def serving_rows(snap: Snapshot, shapes: dict, verify: bool = True) -> dict:
    """Table name -> the memory-mapped, read-only rows of a serving export (``snap.serving_dtype`` not None)
    for the tables of ``shapes`` (name -> ``(rows, dim)``; a dynamic table's rows are its keys'):
    ``uint8 [rows, dim + 8]`` fused rows for int8, else ``[rows, dim]`` of the export's dtype. With ``verify``,
    each is checked against its SHA-256, 16/32-bit rows for NaN/Inf and int8 scales and biases for being finite
    (and scales for being >= 0)."""
    dtype = snap.serving_dtype
    out = {}
    for name, (n, dim) in shapes.items():
        entry = snap.manifest["tables"].get(name)
        if entry is None:
            raise CheckpointError(f"{snap.dir} holds no table '{name}' (it holds {sorted(snap.manifest['tables'])})")
        if dtype != "int8" and not is_dynamic_entry(entry):
            out[name] = table_tensors(snap, name, {"weights": (n, dim)}, verify=verify)["weights"]
            continue
        rows = snap.tensors(entry["shards"][0]["file"], ["weights"], verify=verify)["weights"]
        width = dim + FUSED_INT8_EXTRA_BYTES if dtype == "int8" else dim
        if rows.shape != (n, width):  # check_manifest made sure of it
            raise CheckpointError(f"{snap.dir}: table '{name}' has {dtype} rows of shape {rows.shape}; its "
                                  f"configuration needs ({n}, {width})")
        if verify:
            if dtype == "int8":
                _check_fused(rows, f"{snap.dir}: table '{name}'")
            else:
                check_finite(rows, f"{snap.dir}: table '{name}' weights")
        out[name] = rows
    return out
