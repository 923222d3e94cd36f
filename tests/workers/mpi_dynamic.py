"""Run under ``mpiexec -n K``: dynamic tables in a ShardedEmbedding, each rank fed its slice of fixed global
batches (``tests/test_distributed_dynamic.py`` checks what it writes against one process).

``python mpi_dynamic.py MODE OUT`` with MODE:

``equal``
    :func:`config` without eviction (admission by a count-min sketch wide enough to count exactly), STEPS
    steps; writes ``OUT.rank<r>.npz`` (the rank's activations of every step, its keys, and the sketch's
    estimates of the keys it owns) and, on rank 0, ``OUT`` (:func:`save_tables` of the gathered tables).
``evict``
    tiny capacities under LRU and TTL; writes per rank and step the keys held and the keys the batch used,
    and the tables' capacities (JSON ``OUT.rank<r>.json``).
``reshard STOP CKPT [RESUME]``
    from :func:`config` (or ``ShardedEmbedding.restore(RESUME)``, then ``OUT.loaded.npz``: the tables as
    loaded) train up to step STOP, save CKPT and write ``OUT``: the tables as saved.
``errors``
    a batch with too many new keys for one rank, keys of a float dtype on one rank, a context made stale by a
    later eviction: each must raise the same error on every rank with nothing changed (checked here, on every
    rank); prints ``ok`` on rank 0.
"""

import json
import sys

import numpy as np

import embedcore as ec

GLOBAL = 12
STEPS = 4
SEED = 5
POOL = np.array([0, -1, 2 ** 62 + 7, -2 ** 63, 12345678901, 77, 78, 79, 2 ** 40, -5, 31337, 999, 4242, 8, 9, 10],
                np.int64)  # keys drawn from here repeat across steps and ranks (int64 bit patterns)


def config(mode="equal"):
    """Two dynamic tables (one of them read by a pooled and a sequence feature) and a static table of the
    same dim as one of them (own id space each). ``equal``: room for every key, admission by a sketch wide
    enough to count exactly, TTL expiry; else tiny capacities under LRU and TTL."""
    if mode == "equal":
        users = ec.DynamicTableConfig(8, 100, name="users", combiner="sum",
                                      admission=ec.CountAdmission(2, sketch_width=2 ** 16))
        items = ec.DynamicTableConfig(4, 200, name="items", optimizer=ec.Adam(0.01, lazy_adam=True),
                                      eviction=ec.TTL(1))  # keys expire, none is evicted for room
    else:
        users = ec.DynamicTableConfig(8, 16, name="users", combiner="sum", eviction=ec.LRU())
        items = ec.DynamicTableConfig(4, 48, name="items", eviction=ec.TTL(1),
                                      optimizer=ec.Adam(0.01, lazy_adam=True))
    tags = ec.TableConfig(5, 4, name="tags", combiner="sqrtn")
    return {"user": ec.FeatureConfig(users), "items": ec.FeatureConfig(items),
            "recent": ec.FeatureConfig(items, max_sequence_length=3), "tags": ec.FeatureConfig(tags)}, ec.Adagrad(0.1)


def global_batch(t):
    """Step ``t``'s batch: keys from :data:`POOL` (repeats) and fresh random 64-bit keys; empty bags."""
    rng = np.random.default_rng(700 + t)

    def key():
        return int(POOL[rng.integers(POOL.size)]) if rng.random() < 0.7 else int(rng.integers(-2 ** 63, 2 ** 63))
    items = [[key() for _ in range(rng.integers(0, 4))] for _ in range(GLOBAL)]
    features = {"user": np.array([key() for _ in range(GLOBAL)], np.int64), "items": items,
                "recent": [[key() for _ in range(rng.integers(0, 5))] for _ in range(GLOBAL)],
                "tags": rng.integers(0, 5, (GLOBAL, 2))}
    weights = {"user": None, "items": [list(rng.uniform(0.5, 2.0, len(b))) for b in items], "recent": None,
               "tags": None}
    return features, weights


def assignment(t, world):
    """Step ``t``'s samples per rank (round robin; in a multi-rank run rank ``t % world`` takes none)."""
    if world == 1:
        return [np.arange(GLOBAL)]
    active = [k for k in range(world) if k != t % world]
    out = [np.zeros(0, np.int64)] * world
    for j, k in enumerate(active):
        out[k] = np.arange(j, GLOBAL, len(active))
    return out


def take(batch, rows):
    def pick(x):
        return None if x is None else x[rows] if isinstance(x, np.ndarray) else [x[r] for r in rows]
    features, weights = batch
    return {k: pick(v) for k, v in features.items()}, {k: pick(v) for k, v in weights.items()}


def gradients(acts, t, rows):
    """Gradients of the global batch's samples ``rows``; at step 2 the sequence feature has none (None)."""
    out = {}
    for k, (name, a) in enumerate(sorted(acts.items())):
        full = np.random.default_rng(900 + 10 * t + k).standard_normal((GLOBAL,) + a.shape[1:]).astype(np.float32)
        out[name] = np.ascontiguousarray(full[rows])
    if t == 2:
        out["recent"] = None
    return out


def step(emb, t, rows):
    """Look up step ``t``'s samples ``rows`` and apply their gradients; returns the activations."""
    acts, ctx = emb.lookup(*take(global_batch(t), rows))
    emb.apply_gradients(gradients(acts, t, rows), ctx)
    return acts


def reference(worlds, mode="equal", stop=STEPS):
    """One process fed the concatenated batches of a job of ``worlds`` ranks (an int, or one per step) up to
    step ``stop``: ``(engine, activations)``, the activations of step ``t`` in the order of the ranks'
    samples."""
    worlds = [worlds] * stop if isinstance(worlds, int) else list(worlds)
    emb = ec.Embedding(*config(mode), seed=SEED)
    acts = [step(emb, t, np.concatenate(assignment(t, worlds[t]))) for t in range(stop)]
    return emb, acts


def policy_metadata(emb, name):
    """``[n, 3]`` int64: each key held (increasing as int64; TTL expired ones are not), its last-seen step and
    its count."""
    table = emb.dynamic_tables[name]
    keys, rows = table.key_map.items()
    held = table.held_rows(rows)
    keys, rows = keys[held], rows[held]
    keys = np.asarray(keys).view(np.int64)
    order = np.argsort(keys)
    return np.stack([keys[order], table.key_map.last_seen[rows[order]].astype(np.int64),
                     table.key_map.counts[rows[order]].astype(np.int64)], axis=1)


def save_tables(emb, path):
    tables = emb.gather_tables()
    if emb.rank == 0:
        arrays = {}
        for name, entry in tables.items():
            if len(entry) == 3:
                arrays[f"{name}/keys"], weights, slots = entry
            else:
                weights, slots = entry
            arrays[f"{name}/weights"] = weights
            arrays.update({f"{name}/{s}": v for s, v in slots.items()})
        np.savez(path, **arrays)


def run_equal(emb, rank, world, out):
    arrays = {}
    for t in range(STEPS):
        for name, a in step(emb, t, assignment(t, world)[rank]).items():
            arrays[f"s{t}/{name}"] = a
    seen = np.unique(np.concatenate([np.concatenate([np.asarray(v, np.int64).reshape(-1) if isinstance(v, np.ndarray)
                                                     else np.array(sum(v, []), np.int64)
                                                     for k, v in global_batch(t)[0].items() if k != "tags"])
                                     for t in range(STEPS)]))
    owned = seen[ec.distributed.dynamic.key_owners(seen, world) == rank]
    users = emb.dynamic_tables["users"]
    arrays["sketch/keys"], arrays["sketch/estimates"] = owned, users.sketch.estimate(owned)
    for name in ("users", "items"):
        arrays[f"held/{name}"] = emb.embedding_tables[name].keys()
        arrays[f"policy/{name}"] = policy_metadata(emb, name)
    np.savez(f"{out}.rank{rank}.npz", **arrays)
    save_tables(emb, out)


def run_evict(emb, rank, world, out, comm):
    """Steps under eviction; a step refused (more new keys than a rank's table can take) must be refused on
    every rank alike, with nothing changed."""
    from embedcore.distributed.exchange import Refused
    record = {"capacity": {n: emb.embedding_tables[n].capacity for n in ("users", "items")}, "steps": []}
    for t in range(STEPS + 2):
        rows = assignment(t, world)[rank]
        features, _ = take(global_batch(t), rows)
        before = state(emb)
        try:
            step(emb, t, rows)
            refused = None
        except Refused as e:
            refused = str(e)
            assert same_state(before, state(emb)), "a refused step changed a table"
        assert len(set(comm.allgather(refused))) == 1, "the ranks disagree on a refusal"
        used = {"users": features["user"].tolist(), "items": sum(features["items"], []) +
                sum([b[:3] for b in features["recent"]], [])}
        record["steps"].append({"used": used, "refused": refused,
                                "held": {n: emb.embedding_tables[n].keys().tolist() for n in ("users", "items")}})
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(record, f)


def state(emb):
    """This rank's tables as they are: rows, slots, the keys held with their rows and policy metadata, the
    sketch counters."""
    out = []
    for t in emb.physical_tables:
        out.append([t.weights.copy()] + [s.copy() for s in t.slots])
    for t in emb.dynamic_tables.values():
        keys, rows = t.key_map.items()
        held = t.held_rows(rows)  # rows TTL expired are gone already (a refused lookup may drop them)
        keys, rows = keys[held], rows[held]
        out.append([keys, rows, t.key_map.last_seen[rows].copy(), t.key_map.counts[rows].copy()] +
                   ([] if t.sketch is None else [t.sketch.counters.copy()]))
    return out


def same_state(a, b):
    return len(a) == len(b) and all(len(x) == len(y) and all(np.array_equal(u, v, equal_nan=True)
                                                              for u, v in zip(x, y)) for x, y in zip(a, b))


def expect_refused(comm, emb, call, *needles):
    """``call()`` raises the same ``Refused`` on every rank, naming ``needles``, and changes nothing."""
    from embedcore.distributed.exchange import Refused
    before = state(emb)
    try:
        call()
    except Refused as e:
        message = str(e)
    else:
        raise AssertionError("not refused")
    messages = comm.allgather(message)
    assert all(m == messages[0] for m in messages), messages
    for needle in needles:
        assert needle in message, (needle, message)
    assert same_state(before, state(emb)), "a refused call changed a table"
    return message


def run_errors(emb, rank, world, comm):
    users, items = (emb.dynamic_tables[n] for n in ("users", "items"))
    assert users.key_map.capacity == 100 // world + (rank < 100 % world)
    assert items.key_map.capacity == 200 // world + (rank < 200 % world)
    step(emb, 0, assignment(0, world)[rank])
    # Too many new keys for rank 0's table of ceil(200 / K) rows: its first sample of step 1 brings 250 keys
    # that rank 0 owns (rank 0 has samples at step 1 in every world size).
    rng = np.random.default_rng(1)
    candidates = rng.integers(-2 ** 63, 2 ** 63, 4000)
    flood_keys = candidates[ec.distributed.dynamic.key_owners(candidates, world) == 0][:250].tolist()
    features, weights = take(global_batch(1), assignment(1, world)[rank])
    flood, flood_weights = features, weights
    if rank == 0:
        flood = dict(features, items=[flood_keys] + features["items"][1:])
        flood_weights = dict(weights, items=[[1.0] * len(flood_keys)] + weights["items"][1:])
    expect_refused(comm, emb, lambda: emb.lookup(flood, flood_weights), "rank 0", "table 'items'", "free")
    # Keys of a float dtype on the last rank only.
    bad = dict(features, user=features["user"].astype(np.float64)) if rank == world - 1 else features
    expect_refused(comm, emb, lambda: emb.lookup(bad, weights), f"rank {world - 1}", "user")
    # The engine works on after refusals, and agrees with itself.
    step(emb, 1, assignment(1, world)[rank])


def too_small(comm, world):
    """A dynamic table of fewer rows than ranks is refused on every rank."""
    from embedcore.distributed import DistributedError, ShardedEmbedding
    table = ec.DynamicTableConfig(4, world - 1, name="small")
    try:
        ShardedEmbedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1))
    except DistributedError as e:
        assert "table 'small' has capacity" in str(e) and "fewer rows than" in str(e), str(e)
    else:
        raise AssertionError("not refused")


def stale_context(comm, rank, world):
    """A context whose rows a later lookup evicted (on some rank) is refused on every rank."""
    from embedcore.distributed import ShardedEmbedding
    table = ec.DynamicTableConfig(4, world, name="tiny", eviction=ec.LRU(), combiner="sum")  # a row a rank
    emb = ShardedEmbedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.1), seed=SEED)
    rng = np.random.default_rng(2)
    candidates = rng.integers(-2 ** 63, 2 ** 63, 400)
    owned = candidates[ec.distributed.dynamic.key_owners(candidates, world) == 0][:2]
    first = np.array([owned[0]] if rank == 0 else [], np.int64)
    second = np.array([owned[1]] if rank == 0 else [], np.int64)  # evicts owned[0] on rank 0 (capacity 1 there)
    acts, ctx = emb.lookup({"f": first})
    emb.lookup({"f": second})
    expect_refused(comm, emb, lambda: emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx),
                   "rank 0", "evicted or expired")


if __name__ == "__main__":
    from embedcore.distributed import ShardedEmbedding
    from mpi4py import MPI
    mode, out = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    emb = ShardedEmbedding(*config("evict" if mode == "evict" else "equal"), seed=SEED)
    if mode == "equal":
        run_equal(emb, rank, world, out)
    elif mode == "evict":
        run_evict(emb, rank, world, out, comm)
    elif mode == "reshard":
        stop, ckpt = int(sys.argv[3]), sys.argv[4]
        if len(sys.argv) > 5:
            emb = ShardedEmbedding.restore(sys.argv[5])
            save_tables(emb, out + ".loaded.npz")
        while emb.step < stop:
            step(emb, emb.step, assignment(emb.step, world)[rank])
        emb.save(ckpt)
        save_tables(emb, out)
    else:
        run_errors(emb, rank, world, comm)
        stale_context(comm, rank, world)
        if world > 1:
            too_small(comm, world)
    if rank == 0:
        print("ok")
