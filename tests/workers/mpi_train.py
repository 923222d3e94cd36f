"""Run under ``mpiexec -n K``: train a ShardedEmbedding on each rank's slice of fixed global batches.

``python mpi_train.py OUT STEPS [--save-at STEP CKPT] [--resume CKPT] [--poison 1] [--tables half]`` trains up
to step STEPS
and writes, on rank 0, ``OUT`` (an .npz of every table and slot, gathered whole) and prints one JSON line of
facts. ``--save-at`` saves a checkpoint once the engine reaches that step and writes ``OUT.saved.npz``, the
tables as saved; ``--resume`` starts from a checkpoint (written by any number of ranks) and also writes
``OUT.loaded.npz``, the tables as loaded. ``--poison 1`` fills the placeholder row that stands in for a shard
of no rows with NaN, which must never show. ``--tables half`` trains :func:`config`'s 16-bit variant
(bfloat16 rows rounded stochastically, float16 slots) on batches whose every float32 sum is exact (see
:func:`global_batch`), so that any world size must give one process's tables bit for bit.

The global batch of step t depends only on t; :func:`assignment` splits it over the ranks (one rank gets no
samples at all in every step of a multi-rank run), and :func:`train` is the schedule, shared with the
single-process reference in ``tests/test_distributed.py``: steps 2 and 3 are looked up together before
either's gradients are applied.
"""

import json
import sys

import numpy as np

import embedcore as ec

GLOBAL = 24
PAIRED = (2, 3)  # looked up back to back, then applied in order


def config(kind="float32"):
    """Two dims in one exchange; non-lazy Adam tables (stacked on each rank), one of fewer rows than ranks;
    a lazy Adagrad table. Two optimizers only: each costs every rank seconds of compilation.

    ``kind="half"``: the same layout in 16 bits: bfloat16 rows rounded stochastically (the Adam tables with
    float16 slots), a float32 table of float16 slots, and only ``sum`` combiners (and ``mean`` over two ids)
    so that every gain is a power of two."""
    adam = ec.Adam(0.01, lazy_adam=False)
    if kind == "half":
        bf16 = dict(weights_dtype="bfloat16", stochastic_rounding=True)
        users = ec.TableConfig(101, 8, name="users", combiner="sum", **bf16)
        items = ec.TableConfig(257, 8, name="items", combiner="sum", optimizer=adam, slot_dtype="float16", **bf16)
        tiny = ec.TableConfig(2, 8, name="tiny", combiner="sum", optimizer=adam, slot_dtype="float16", **bf16)
        tags = ec.TableConfig(3, 4, name="tags", combiner="mean", slot_dtype="float16")
        return {"user": ec.FeatureConfig(users), "items": ec.FeatureConfig(items),
                "recent": ec.FeatureConfig(items, max_sequence_length=3), "tags": ec.FeatureConfig(tags),
                "tiny": ec.FeatureConfig(tiny)}, ec.Adagrad(0.1)
    users = ec.TableConfig(101, 8, name="users", combiner="sum", optimizer=adam)
    items = ec.TableConfig(257, 8, name="items", optimizer=adam)
    tiny = ec.TableConfig(2, 8, name="tiny", optimizer=adam)
    tags = ec.TableConfig(3, 4, name="tags", combiner="sqrtn")
    return {"user": ec.FeatureConfig(users), "items": ec.FeatureConfig(items),
            "recent": ec.FeatureConfig(items, max_sequence_length=3), "tags": ec.FeatureConfig(tags),
            "tiny": ec.FeatureConfig(tiny)}, ec.Adagrad(0.1)


def global_batch(t, size, kind="float32"):
    """Step ``t``'s batch. ``kind="half"``: weights 0.5, 1 or 2 (with :func:`gradients`' multiples of 2**-6,
    every product and sum is exact in float32, so the order ranks sum in cannot show)."""
    rng = np.random.default_rng(500 + t)
    lengths = rng.integers(0, 4, size)
    items = [list(rng.zipf(1.4, n) % 257) for n in lengths]
    if kind == "half":
        weights = [list(rng.choice([0.5, 1.0, 2.0], n)) for n in lengths]
    else:
        weights = [list(rng.uniform(0.5, 2.0, n)) for n in lengths]
    features = {"user": rng.integers(0, 101, size), "items": items,
                "recent": [list(rng.integers(0, 257, rng.integers(0, 5))) for _ in range(size)],
                "tags": rng.integers(0, 3, (size, 2)), "tiny": rng.integers(0, 2, size)}
    grads_seed = 900 + t
    return features, {"items": weights}, grads_seed


def assignment(t, world):
    """The global batch's samples each rank takes at step ``t``; in a multi-rank run rank ``t % world``
    takes none."""
    if world == 1:
        return [np.arange(GLOBAL)]
    active = [k for k in range(world) if k != t % world]
    out = [np.zeros(0, np.int64)] * world
    for j, k in enumerate(active):
        out[k] = np.arange(j, GLOBAL, len(active))
    return out


def take(batch, rows):
    features, weights, seed = batch
    pick = lambda x: x[rows] if isinstance(x, np.ndarray) else [x[r] for r in rows]  # noqa: E731
    return ({k: pick(v) for k, v in features.items()},
            {k: (pick(v) if v is not None else None) for k, v in weights.items()}, seed)


def gradients(acts, seed, rows, kind="float32"):
    """Gradients of the global batch's samples ``rows`` (drawn for the whole batch, then sliced);
    ``kind="half"``: rounded to multiples of 2**-6."""
    out = {}
    for k, (name, a) in enumerate(sorted(acts.items())):
        rng = np.random.default_rng(seed * 10 + k)
        full = rng.standard_normal((GLOBAL,) + a.shape[1:])
        full = (np.round(full * 64) / 64 if kind == "half" else full).astype(np.float32)
        out[name] = np.ascontiguousarray(full[rows])
    return out


def lookup(emb, t, rows, kind="float32"):
    f, w, seed = take(global_batch(t, GLOBAL, kind), rows)
    acts, ctx = emb.lookup(f, {"user": None, "items": w["items"], "recent": None, "tags": None, "tiny": None})
    return gradients(acts, seed, rows, kind), ctx


def train(emb, stop, rows_of, on_step=None, kind="float32"):
    """Train ``emb`` from its step to ``stop``; ``rows_of(t)``: the samples it takes at step ``t``.
    ``on_step(emb)`` runs after every update."""
    while emb.step < stop:
        t = emb.step
        steps = PAIRED if t == PAIRED[0] and stop > PAIRED[0] + 1 else (t,)
        pending = [lookup(emb, s, rows_of(s), kind) for s in steps]
        for grads, ctx in pending:
            emb.apply_gradients(grads, ctx)
            if on_step:
                on_step(emb)


def reference(worlds, kind="float32"):
    """One process trained on the global batches, step t's samples in the order the ranks of a job of
    ``worlds[t]`` ranks hold them (their concatenation), with the workers' schedule (``kind``: the
    workers' ``--tables``)."""
    emb = ec.Embedding(*config(kind), seed=3)
    train(emb, len(worlds), lambda t: np.concatenate(assignment(t, worlds[t])), kind=kind)
    return emb


def assert_tables(npz, emb, exact):
    """The tables and slots a job saved (``save_tables``) equal ``emb``'s: bit for bit, or to float32
    summation order."""
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for name, table in emb.embedding_tables.items():
        np.testing.assert_allclose(npz[f"{name}/weights"], table, err_msg=name, **tolerance)
        for slot, value in emb.slot_variables[name].items():
            np.testing.assert_allclose(npz[f"{name}/{slot}"], value, err_msg=f"{name}/{slot}", **tolerance)


def save_tables(emb, path):
    tables = emb.gather_tables()
    if emb.rank == 0:
        arrays = {}
        for name, (weights, slots) in tables.items():
            arrays[f"{name}/weights"] = weights
            arrays.update({f"{name}/{s}": v for s, v in slots.items()})
        np.savez(path, **{k: v.view(np.uint16) if v.dtype.itemsize == 2 else v for k, v in arrays.items()},
                 **{f"{k}@dtype": np.array(str(v.dtype)) for k, v in arrays.items()})


def load_tables(path):
    """What :func:`save_tables` wrote: ``{"name/weights" or "name/slot": array}`` in the stored dtypes
    (npz keeps no bfloat16: 16-bit arrays travel as their bits)."""
    import ml_dtypes
    z = np.load(path)
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    return {k: z[k].view(dtypes.get(str(z[k + "@dtype"]), z[k].dtype)) for k in z.files if not k.endswith("@dtype")}


def poison_placeholders(emb):
    """NaN in the placeholder row of every shard of no rows; returns whether they all were zero before."""
    zero = True
    for table in emb.physical_tables:
        for place in table.places:
            if place.rows == 0:
                for array in (table.weights,) + table.slots:
                    zero &= bool(np.all(array[place.offset] == 0))
                    array[place.offset] = np.nan
    return zero


if __name__ == "__main__":
    from embedcore.distributed import ShardedEmbedding
    from mpi4py import MPI
    out_path, steps = sys.argv[1], int(sys.argv[2])
    args = sys.argv[3:]
    options = {}
    while args:
        key = args.pop(0)
        options[key] = [args.pop(0), args.pop(0)] if key == "--save-at" else args.pop(0)
    kind = options.get("--tables", "float32")
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if "--resume" in options:
        emb = ShardedEmbedding.restore(options["--resume"])
        save_tables(emb, out_path + ".loaded.npz")
    else:
        features, optimizer = config(kind)
        emb = ShardedEmbedding(features, optimizer, seed=3)
    zero = poison_placeholders(emb) if options.get("--poison") == "1" else None
    save_at = options.get("--save-at")

    def checkpoint(emb):
        if save_at and emb.step == int(save_at[0]):
            emb.save(save_at[1])
            save_tables(emb, out_path + ".saved.npz")
    train(emb, steps, lambda t: assignment(t, world)[rank], checkpoint, kind)
    save_tables(emb, out_path)
    zeros = comm.gather(zero, root=0)
    if rank == 0:
        print(json.dumps({"world": world, "step": emb.step, "rows": {n: s.rows for n, s in emb.shards.items()},
                          "placeholders_were_zero": zeros}))
