"""Run under ``mpiexec -n 2 python -m mpi4py reliability_sharded.py OUT``: a ShardedEmbedding's contexts and
row functions under misuse (issue 24). Every rank writes what it saw to ``OUT/rank-<k>.json``.

Scenarios, in order: a context looked up before ``load`` (refused everywhere, nothing changed, a new lookup
works); a context of an engine since freed; a row function raising on the rows of one rank's large gradients
(every other row updated once, ``step`` advanced, ``RowFunctionError`` on every rank, compared with one
process fed both ranks' batches); the retry of that context (refused); a table of 10^12 rows (refused at
construction, before allocating).
"""

import gc
import json
import os
import sys

import numpy as np

import embedcore as ec
from embedcore.distributed import ShardedEmbedding
from misuse import attempt, same, state  # noqa: E402  (tests/workers/misuse.py, beside this file)

OUT = sys.argv[1]


def sgd_unless_large(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    if gradient[0] > 50.0:
        raise ValueError("gradient too large")
    return embedding_table - learning_rate * gradient


def features():
    return {"f": ec.FeatureConfig(ec.TableConfig(40, 4, name="t", combiner="sum", initializer=ec.RowId()))}


def build(optimizer=None):
    return ShardedEmbedding(features(), optimizer or ec.Adagrad(0.1))








def batch(rank):
    """Rank 0: ids 1..6 with small gradients; rank 1: ids 5..10, its first sample (ids 5, 6) large."""
    ids = np.array([[1, 2], [3, 4], [5, 6]]) if rank == 0 else np.array([[5, 6], [7, 8], [9, 10]])
    grads = np.full((3, 4), 0.5, np.float32)
    if rank == 1:
        grads[0, 0] = 1000.0
    return {"f": ids}, {"f": grads}


def main():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    out = {}
    ckpt = os.path.join(OUT, "ckpt")

    emb = build()
    ids, grads = batch(rank)
    emb.save(ckpt)
    _, stale = emb.lookup(ids)
    emb.load(ckpt)
    out["stale_after_load"] = attempt(emb, lambda: emb.apply_gradients(grads, stale))
    out["fresh_after_load"] = attempt(emb, lambda: emb.apply_gradients(grads, emb.lookup(ids)[1]))

    old = build()
    _, orphan = old.lookup(ids)
    del old
    gc.collect()
    new = build()
    out["freed_engines_context"] = attempt(new, lambda: new.apply_gradients(grads, orphan))

    opt = ec.CustomOptimizer(sgd_unless_large, learning_rate=0.1)
    emb = build(opt)
    _, ctx = emb.lookup(ids)
    out["raising_row_function"] = attempt(emb, lambda: emb.apply_gradients(grads, ctx))
    out["retry"] = attempt(emb, lambda: emb.apply_gradients(grads, ctx))
    gathered = emb.gather_tables(0)
    if rank == 0:  # one process fed both ranks' batches, with the same row function
        one = ec.Embedding(features(), ec.CustomOptimizer(sgd_unless_large, learning_rate=0.1))
        both = [batch(k) for k in range(2)]
        acts, one_ctx = one({"f": np.concatenate([b[0]["f"] for b in both])})
        try:
            one.apply_gradients({"f": np.concatenate([b[1]["f"] for b in both])}, one_ctx)
            out["one_process_error"] = None
        except ec.RowFunctionError as e:
            out["one_process_error"] = str(e)
            out["one_process_failed"] = e.report.failed["t"]["raised"].tolist()
        out["tables_match_one_process"] = bool(np.allclose(gathered["t"][0], one.embedding_tables["t"],
                                                           rtol=1e-6))
        out["rows_changed"] = np.flatnonzero((gathered["t"][0] != ec.Embedding(
            features(), ec.SGD(0.1)).embedding_tables["t"]).any(axis=1)).tolist()

    def huge():
        ShardedEmbedding({"f": ec.FeatureConfig(ec.TableConfig(10 ** 12, 16, name="huge"))}, ec.Adagrad(0.1))
    try:
        huge()
        out["huge"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        out["huge"] = {"error": str(e), "types": [c.__name__ for c in type(e).__mro__]}

    with open(os.path.join(OUT, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
