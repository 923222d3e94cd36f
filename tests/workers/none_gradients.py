"""An MPI job for tests/test_tensorflow_behaviour.py: ``None`` gradients and lookup-only engines, sharded.

``python none_gradients.py OUT`` under ``mpiexec -n K``: every rank trains a ShardedEmbedding on its share of
fixed batches, with ``None`` for some features' gradients, and rank 0 writes the gathered tables and slots
(``OUT`` .npz) and prints a JSON line of facts; the test compares them with one process fed the whole batches.
"""

import json
import sys
import tempfile

import numpy as np

import embedcore as ec
from embedcore.distributed import DistributedError, ShardedEmbedding

BATCH, STEPS = 6, 3
# Per step: the features whose gradient is None (the same on every rank).
WITHOUT = [("a",), ("c", "d"), ("a", "b", "c", "d")]


def features():
    """Two tables stacked (equal optimizer and dim) plus one alone; a lazy Adam with every row it touches
    visibly changed by a zero gradient too (moments decay), so a touched row cannot pass for untouched."""
    adam = ec.Adam(0.1, beta_1=0.5, beta_2=0.6)
    big = ec.TableConfig(23, 3, name="big", combiner="sum", optimizer=adam)
    small = ec.TableConfig(7, 3, name="small", combiner="mean", optimizer=adam)
    other = ec.TableConfig(11, 2, name="other", combiner="sqrtn", optimizer=ec.Adam(0.05, lazy_adam=False))
    return {"a": ec.FeatureConfig(big), "b": ec.FeatureConfig(big), "c": ec.FeatureConfig(small),
            "d": ec.FeatureConfig(other)}


def batches(world):
    """Per step: the whole batch (``world * BATCH`` samples per feature), ids and activation gradients."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        ids = {name: rng.integers(0, vocab, (world * BATCH, 2)) for name, vocab in
               (("a", 23), ("b", 23), ("c", 7), ("d", 11))}
        grads = {name: rng.normal(size=(world * BATCH, 3 if name != "d" else 2)).astype(np.float32)
                 for name in ids}
        out.append((ids, grads))
    return out


def share(batch, rank):
    return {k: v[rank * BATCH:(rank + 1) * BATCH] for k, v in batch.items()}


def train(emb, world, rank):
    for (ids, grads), without in zip(batches(world), WITHOUT):
        _, ctx = emb.lookup(share(ids, rank))
        local = share(grads, rank)
        emb.apply_gradients({k: None if k in without else v for k, v in local.items()}, ctx)


def main(out):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    emb = ShardedEmbedding(features(), comm=comm, seed=3)
    train(emb, world, rank)
    facts = {"step": emb.step}
    if world > 1:  # None for other features on the last rank: refused on every rank, nothing changed
        ids, grads = batches(world)[0]
        _, ctx = emb.lookup(share(ids, rank))
        before = emb.gather_tables()
        local = share(grads, rank)
        if rank == world - 1:
            local["b"] = None
        try:
            emb.apply_gradients(local, ctx)
            facts["mismatch"] = "applied"
        except DistributedError as e:
            facts["mismatch"] = "refused" if "None" in str(e) else str(e)
        after = emb.gather_tables()
        if rank == 0:
            facts["unchanged"] = all(np.array_equal(before[n][0], after[n][0]) and
                                     all(np.array_equal(before[n][1][s], after[n][1][s]) for s in before[n][1])
                                     for n in before)
        facts["step_after_refusal"] = emb.step
    tables = emb.gather_tables()
    # Lookup-only: RuntimeError on every rank, lookups and a checkpoint round trip work.
    frozen = ShardedEmbedding({"a": ec.FeatureConfig(ec.TableConfig(9, 2, name="t"))}, None, comm=comm)
    acts, ctx = frozen.lookup({"a": np.arange(BATCH) % 9})
    try:
        frozen.apply_gradients(acts, ctx)
        facts["lookup_only"] = "applied"
    except RuntimeError as e:
        facts["lookup_only"] = type(e).__name__ + ": " + str(e)
    path = comm.bcast(tempfile.mkdtemp() if rank == 0 else None)
    frozen.save(path)
    again = ShardedEmbedding.restore(path, comm=comm)
    facts["restored_lookup_only"] = bool(again.lookup_only)
    acts2, _ = again.lookup({"a": np.arange(BATCH) % 9})
    facts["restored_equal"] = bool(np.array_equal(acts["a"], acts2["a"]))
    facts["restored_equal"] = bool(comm.allreduce(int(facts["restored_equal"]), op=MPI.MIN))
    if rank == 0:
        np.savez(out, **{f"{n}/weights": w for n, (w, _) in tables.items()},
                 **{f"{n}/{s}": v for n, (_, slots) in tables.items() for s, v in slots.items()})
        print(json.dumps(facts))


if __name__ == "__main__":
    main(sys.argv[1])
