"""Serving: lookups from a checkpoint's tables, memory-mapped read-only, with no optimizer state read.

``ServingEmbedding(path)`` reads only the configuration and each table's ``weights`` tensor from a
checkpoint written by :meth:`embedcore.Embedding.save`. The tables stay on disk and enter memory as
lookups touch them (the operating system's page cache is shared between serving processes); slots are never
read and no code named by the checkpoint is imported. Lookups run the training engine's own code, so they
return bit-identical activations.
"""

from __future__ import annotations

from .checkpoint import open_snapshot, table_tensors
from .checkpoint.config_codec import decode_engine_config
from .lookup import TableLookup, _PhysicalTable

__all__ = ["ServingEmbedding"]


class ServingEmbedding(TableLookup):
    """Lookup-only embedding tables loaded from a checkpoint directory.

    Args:
        path: a checkpoint directory written by ``Embedding.save``.
        verify: check each table's SHA-256 while loading (reads every table once).
    """

    def __init__(self, path, verify: bool = True):
        snap = open_snapshot(path)
        features, _, _ = decode_engine_config(snap.manifest["config"], with_optimizers=False)
        groups = []
        for table in self._init_features(features):
            group = _PhysicalTable([table], [0], table.dim, None)
            shape = (table.vocabulary_size, table.dim)
            group.weights = table_tensors(snap, table.name, {"weights": shape}, verify=verify)["weights"]
            groups.append(group)
        self._index_groups(groups)
        self.step = snap.step
        self.path = snap.dir

    def lookup(self, features, weights=None):
        """Activations mirroring ``features`` (no context: serving has nothing to update)."""
        activations, _ = super().lookup(features, weights)
        return activations

    def __repr__(self):
        tables = ", ".join(f"{t.name} [{t.vocabulary_size} x {t.dim}]" for t in self._table_configs.values())
        return f"ServingEmbedding({len(self._features)} features; {tables}; step={self.step}; from {self.path})"
