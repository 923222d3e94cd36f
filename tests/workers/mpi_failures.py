"""Run under ``mpiexec -n K``: one rank misbehaves (``MODE``); every rank writes what it saw to ``OUT/rank-<k>.json``
(files, not stdout: the ranks' output lines can interleave).

Modes: ``config`` (rank 1 has another learning rate), ``bad_ids`` (rank 1 looks up an id out of range),
``nan`` (rank 1 sends a NaN gradient), ``stuck`` (rank 1 stops taking part for longer than the timeout),
``die`` (rank 1 exits mid-step without a word).
"""

import json
import os
import sys
import time

import numpy as np

import embedcore as ec
from embedcore.distributed import DistributedError, ShardedEmbedding


def report(**facts):
    with open(os.path.join(sys.argv[2], f"rank-{facts['rank']}.json"), "w") as f:
        json.dump(facts, f)


if __name__ == "__main__":
    mode = sys.argv[1]
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    table = ec.TableConfig(40, 4, name="t", combiner="sum", initializer=ec.RowId())
    lr = 0.2 if (mode == "config" and rank == 1) else 0.1
    try:
        # A short timeout only where a peer is meant to stall: elsewhere, compile times differ between ranks.
        emb = ShardedEmbedding({"f": ec.FeatureConfig(table)}, ec.Adagrad(lr), timeout=5.0 if mode == "stuck" else 120.0)
    except DistributedError as e:
        report(rank=rank, stage="construct", error=str(e))
        sys.exit(0)
    ids = np.array([[1, 2], [3, 39]])
    if mode == "bad_ids" and rank == 1:
        ids = np.array([[1, 2], [3, 40]])
    before = emb.embedding_tables["t"].copy()
    try:
        acts, ctx = emb.lookup({"f": ids})
        grads = {"f": np.ones_like(acts["f"])}
        if mode == "nan" and rank == 1:
            grads["f"][1, 2] = np.nan
        if mode == "stuck" and rank == 1:
            time.sleep(12)
            report(rank=rank, stage="woke up")
            sys.exit(0)
        if mode == "die" and rank == 1:
            os._exit(3)
        emb.apply_gradients(grads, ctx)
        report(rank=rank, stage="done", step=emb.step)
    except (DistributedError, ec.InputError) as e:
        report(rank=rank, stage="step", error=str(e), type=type(e).__name__, step=emb.step,
               unchanged=bool(np.array_equal(before, emb.embedding_tables["t"])))
