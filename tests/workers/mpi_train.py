"""Run under ``mpiexec -n K``: train a ShardedEmbedding on each rank's slice of fixed global batches.

``python mpi_train.py OUT STEPS [--save CKPT] [--resume CKPT]`` trains up to step STEPS and writes, on rank 0,
``OUT`` (an .npz of every table and slot, gathered whole) and prints one JSON line of facts. ``--resume``
starts from a checkpoint (written by any number of ranks) and also writes ``OUT.loaded.npz``, the tables as
loaded; ``--save`` writes a checkpoint at the end. The global batch of step t depends only on t; rank k
takes samples ``k, k + K, k + 2K, ...`` of it, so the concatenation over ranks is the global batch
reordered, which is what ``tests/test_distributed.py`` feeds one process.
"""

import json
import sys

import numpy as np

import embedcore as ec
from embedcore.distributed import ShardedEmbedding


def config():
    users = ec.TableConfig(101, 8, name="users", combiner="sum")
    items = ec.TableConfig(257, 8, name="items", optimizer=ec.Adam(0.01, lazy_adam=False))
    tags = ec.TableConfig(3, 4, name="tags", optimizer=ec.FTRL(0.1), combiner="sqrtn")
    return {"user": ec.FeatureConfig(users), "items": ec.FeatureConfig(items),
            "recent": ec.FeatureConfig(items, max_sequence_length=3), "tags": ec.FeatureConfig(tags)}, \
        ec.Adagrad(0.1)


def global_batch(t, size):
    rng = np.random.default_rng(500 + t)
    lengths = rng.integers(0, 4, size)
    items = [list(rng.zipf(1.4, n) % 257) for n in lengths]
    weights = [list(rng.uniform(0.5, 2.0, n)) for n in lengths]
    features = {"user": rng.integers(0, 101, size), "items": items,
                "recent": [list(rng.integers(0, 257, rng.integers(0, 5))) for _ in range(size)],
                "tags": rng.integers(0, 3, (size, 2))}
    grads_seed = 900 + t
    return features, {"items": weights}, grads_seed


def take(batch, rows):
    features, weights, seed = batch
    pick = lambda x: x[rows] if isinstance(x, np.ndarray) else [x[r] for r in rows]  # noqa: E731
    return ({k: pick(v) for k, v in features.items()},
            {k: (pick(v) if v is not None else None) for k, v in weights.items()}, seed)


def gradients(acts, seed, rows):
    """Gradients of the global batch's samples ``rows`` (drawn for the whole batch, then sliced)."""
    out = {}
    for k, (name, a) in enumerate(sorted(acts.items())):
        rng = np.random.default_rng(seed * 10 + k)
        full = rng.standard_normal((GLOBAL,) + a.shape[1:]).astype(np.float32)
        out[name] = np.ascontiguousarray(full[rows])
    return out


GLOBAL = 24

def save_tables(emb, path):
    tables = emb.gather_tables()
    if emb.rank == 0:
        arrays = {}
        for name, (weights, slots) in tables.items():
            arrays[f"{name}/weights"] = weights
            arrays.update({f"{name}/{s}": v for s, v in slots.items()})
        np.savez(path, **arrays)


if __name__ == "__main__":
    out_path, steps = sys.argv[1], int(sys.argv[2])
    options = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if "--resume" in options:
        emb = ShardedEmbedding.restore(options["--resume"])
        save_tables(emb, out_path + ".loaded.npz")
    else:
        features, optimizer = config()
        emb = ShardedEmbedding(features, optimizer, seed=3)
    rows = np.arange(rank, GLOBAL, world)
    while emb.step < steps:
        f, w, seed = take(global_batch(emb.step, GLOBAL), rows)
        weights = {"user": None, "items": w["items"], "recent": None, "tags": None}
        acts, ctx = emb.lookup(f, weights)
        emb.apply_gradients(gradients(acts, seed, rows), ctx)
    if "--save" in options:
        emb.save(options["--save"])
    save_tables(emb, out_path)
    if rank == 0:
        print(json.dumps({"world": world, "step": emb.step, "rows": {n: s.rows for n, s in emb.shards.items()}}))
