"""Serving: lookups from a checkpoint's tables, memory-mapped read-only, with no optimizer state read.

``ServingEmbedding(path)`` reads only the configuration and each table's ``weights`` tensor from a
checkpoint written by :meth:`embedcore.Embedding.save`, or from a serving export of one
(:func:`embedcore.export_for_serving`: rows as float32, float16, bfloat16 or int8). The tables stay on disk
and enter memory as lookups touch them (the operating system's page cache is shared between serving
processes); slots are never read and no code named by the checkpoint is imported. Lookups of a checkpoint
run the training engine's own code, so they return bit-identical activations; an export's 16-bit rows are
summed as float32 (as the training engine sums 16-bit tables), its int8 rows dequantized inside the gather
(``scale * code + bias``, :mod:`embedcore.kernels.quantized`), never copied to float32, each activation
within half a quantization step per occurrence (``sum of |gain| * scale / 2``) of the float32 one.

Batches of any size are served, as TensorFlow's serving lookup (``TPUEmbeddingForServing``,
``tf.tpu.experimental.embedding.serving_embedding_lookup``) serves them: a feature's ``output_shape``, fixed
for training, shapes the activations only where it fits the batch (see :class:`ServingEmbedding`).

Opening checks the manifest whole (:func:`embedcore.checkpoint.store.check_manifest`), each table's SHA-256
and that it holds no NaN or Inf (unless ``verify=False``, which reads no table data at all). A server
opening a checkpoint while another process saves to it opens the new checkpoint instead of reporting the
old one, pruned under it, as corrupt (:func:`embedcore.checkpoint.read_current`); what it serves is always
one committed snapshot, whole.

Dynamic tables are served from their stored keys (:mod:`embedcore.serving_dynamic`: a key map built from
them at open); a key the checkpoint does not hold reads its initial value, as in
training (``unknown_keys="initial"``, the default), or zeros (``unknown_keys="zeros"``).
"""

from __future__ import annotations

from .checkpoint import CheckpointError, check_finite, read_current, table_tensors
from .checkpoint.config_codec import decode_engine_config, decode_initializer
from .checkpoint.dynamic import check_keys
from .config import DynamicTableConfig
from .export import serving_rows
from .lookup import TableLookup
from .serving_dynamic import UNKNOWN_KEYS, ServingDynamicTable, unknown_rows
from .tables import read_only_tables

__all__ = ["ServingEmbedding"]


class ServingEmbedding(TableLookup):
    """Lookup-only embedding tables loaded from a checkpoint directory.

    Args:
        path: a checkpoint directory written by ``Embedding.save``, or a serving export of one
            (:func:`embedcore.export_for_serving`).
        verify: check each table's SHA-256 and that it is finite (int8: its scales and biases) while loading
            (reads every table once).
        tuning: an :class:`embedcore.Tuning` for the lookups (e.g. ``Tuning(phase_timer=...)`` to time the
            layout and the gather apart); default ``DEFAULT_TUNING``.
        unknown_keys: what a key a dynamic table does not hold reads: ``"initial"`` (its initial value, the
            value training gives a key it has never seen: a function of the seed, the table and the key,
            rounded to the table's trained ``weights_dtype``; a custom initializer class is never imported:
            use ``"zeros"`` then) or ``"zeros"``.

    Attributes:
        dtype: how the served rows are stored: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"int8"``
            (``"mixed"``: a training checkpoint whose tables are stored in different dtypes).
        embedding_tables: each table's rows as stored; for int8, the fused rows ``uint8 [V, dim + 8]``; for a
            dynamic table, the rows of its keys, in the order of ``table_keys[name]``.
        table_keys: dynamic table name -> its keys (uint64, increasing; memory-mapped).

    Shapes. Features take every input form the training engine takes, at any batch size, and a batch that
    training accepts is served exactly as training looks it up (same activations, same shape). As in
    TensorFlow, a dict of features may hold any subset of the config's keys (a list or tuple is given
    whole); the activations mirror the features given. A feature's
    ``output_shape`` is handled as TensorFlow's serving lookup handles it (``cpu_embedding_lookup``):

    * it shapes the activations, ``output_shape + (dim,)``, when it holds the activation rows the batch gives
      (``B``, ``B * L`` for a sequence feature, ``d1 * ... * dn`` for high-dimensional ids), as in training;
    * otherwise, for a pooled feature given ragged ids (a :class:`~embedcore.Ragged` or lists of samples)
      of ``B`` samples, it is read as ``[B, sequence length]``: when its size is ``B * k`` the ids are looked
      up as a sequence of length ``k`` (one activation row per position, truncated or zero padded; weights,
      if given, scale the rows as for any sequence feature) shaped ``output_shape + (dim,)``; a size that is
      not a multiple of ``B`` raises :class:`~embedcore.InputError` (TensorFlow: "Output shape set in the
      FeatureConfig should be the factor of the input data batch size");
    * otherwise (dense and sparse ids, sequence features) it is ignored: ``(B, dim)``, ``(B, L, dim)``,
      ``(d1, ..., dn, dim)`` as without ``output_shape``.

    Dense ids of rank 3 or more need no ``output_shape`` here (training takes them when ``output_shape`` is
    their leading shape). Where this differs from TensorFlow: TensorFlow's serving lookup ignores
    ``output_shape`` for dense and sparse ids even when it fits (embedcore keeps the training shape), looks
    dense ``[B, k]`` ids up one per id (``[B, k, dim]``; embedcore combines the ``k`` ids as training does),
    refuses weights for dense ids and for sequence features (embedcore applies them as training does), and
    pools a sparse sequence feature that has an ``output_shape`` (embedcore keeps it a sequence).

    Raises:
        CheckpointError: the checkpoint is missing, corrupt, malformed, holds NaN/Inf or does not fit.
    """

    serving = True

    def __init__(self, path, verify: bool = True, tuning=None, unknown_keys: str = "initial"):
        if unknown_keys not in UNKNOWN_KEYS:
            raise ValueError(f"unknown_keys must be one of {list(UNKNOWN_KEYS)}, got {unknown_keys!r:.80}")

        def read(snap):
            config = snap.manifest["config"]
            features, _, seed = decode_engine_config(config, with_optimizers=False)
            try:
                tables = self._init_features(features)
            except ValueError as e:
                raise CheckpointError(f"{snap.dir}: the checkpoint's features do not configure lookups: {e}") from None
            entries = snap.manifest["tables"]
            dynamic = {t.name: t for t in tables if isinstance(t, DynamicTableConfig)}
            shapes = {t.name: (entries[t.name]["n"] if t.name in dynamic else t.vocabulary_size, t.dim) for t in tables}
            if snap.serving_dtype is not None:
                weights = serving_rows(snap, shapes, verify)
            else:
                weights = {name: _training_rows(snap, name, shape, verify) for name, shape in shapes.items()}
            keys, unknown = {}, {}
            for name, t in dynamic.items():
                keys[name] = snap.tensors(entries[name]["shards"][0]["file"], ["keys"], verify=verify)["keys"]
                if verify:
                    check_keys(keys[name], f"{snap.dir}: dynamic table '{name}'")
                init = None
                if unknown_keys == "initial":
                    try:
                        init = decode_initializer(config, name)
                    except CheckpointError as e:
                        raise CheckpointError(f"{e}. Serving imports no code: ServingEmbedding(path, unknown_keys="
                                              f"'zeros') serves the keys table '{name}' does not hold as zeros") \
                            from None
                unknown[name] = unknown_rows(t, seed, unknown_keys, init)
            return snap, tables, weights, keys, unknown

        snap, tables, weights, keys, unknown = read_current(path, read, serving=True)
        try:
            self._physical = tuple(ServingDynamicTable(t, keys[t.name], weights[t.name], unknown[t.name], tuning)
                                   if t.name in keys else read_only_tables([t], weights, tuning)[0] for t in tables)
        except ValueError as e:  # a key stored twice, seen here when verify=False skipped the keys' check
            raise CheckpointError(f"corrupt checkpoint: {snap.dir}: {e}") from None
        self.table_keys = keys
        self._index_tables(self._physical)
        self.step = snap.step
        self.path = snap.dir
        stored = {str(w.dtype) for w in weights.values()}
        self.dtype = snap.serving_dtype or (stored.pop() if len(stored) == 1 else "mixed")

    def lookup(self, features, weights=None):
        """Activations mirroring ``features`` (no context: serving has nothing to update). ``InputError`` for a
        bad batch; ``ValueError`` naming the table and key for an unknown key whose initial value its
        ``weights_dtype`` cannot hold."""
        activations, _ = super().lookup(features, weights)
        return activations

    def __repr__(self):
        tables = ", ".join(f"{t.name} [{t.vocabulary_size} x {t.dim}]" if t.name not in self.table_keys else
                           f"{t.name} [{self.table_keys[t.name].shape[0]} keys x {t.dim}]"
                           for t in self._table_configs.values())
        return (f"ServingEmbedding({len(self._features)} features; {tables}; {self.dtype}; step={self.step}; "
                f"from {self.path})")


def _training_rows(snap, name: str, shape: tuple, verify: bool):
    """The ``weights`` of table ``name`` of a training checkpoint (a dynamic table's: its keys' rows)."""
    entry = snap.manifest["tables"][name]
    if not entry.get("dynamic"):
        return table_tensors(snap, name, {"weights": shape}, verify=verify)["weights"]
    rows = snap.tensors(entry["shards"][0]["file"], ["weights"], verify=verify)["weights"]
    if verify:
        check_finite(rows, f"{snap.dir}: dynamic table '{name}' weights")
    return rows
