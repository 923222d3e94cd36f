"""Run under ``mpiexec -n K``: ranks misbehave in the ways a job ``MODE`` names, one scenario after another;
every rank writes what it saw to ``OUT/rank-<k>.json`` (files, not stdout: the ranks' lines interleave).

``python mpi_failures.py MODE OUT [CKPT]``. Modes, each one job:

``refusals``    configurations that differ, or fail on one rank, are refused on every rank; then one bad call
                after another on a good engine, each refused on every rank with nothing changed (the engine
                stays usable); then the same engine saves, fails a save on one rank, saves again.
``stuck``       rank 1 stops taking part in the middle of a step for much longer than the timeout; the others
                raise (and, run with ``python -m mpi4py``, end the job).
``die``         rank 1 exits mid-step without a word.
``save_stuck``  rank 1 stalls after writing its shards, before reporting them: no commit.
``save_killed`` rank 1 is killed while writing its shards (after a first, good save to CKPT).
``resave``      a healthy job restores CKPT, trains a step and saves there.
``mid_step``    (one rank) a failure after the ranks agreed to go ahead makes the engine unusable.
"""

import json
import os
import sys
import time

import numpy as np

import embedcore as ec
from embedcore.distributed import DistributedError, ShardedEmbedding
from embedcore.checkpoint import open_snapshot
from embedcore.distributed import checkpoint as sharded_checkpoint
from misuse import attempt, same, state  # noqa: E402  (tests/workers/misuse.py, beside this file)

OUT = sys.argv[2]
_facts = {}


def report(rank, **facts):
    _facts.update(facts, rank=rank)
    with open(os.path.join(OUT, f"rank-{rank}.json"), "w") as f:
        json.dump(_facts, f)


def table():
    return ec.TableConfig(40, 4, name="t", combiner="sum", initializer=ec.RowId())


def build(lr=0.1, timeout=120.0, optimizer=None):
    # A short timeout only where a peer is meant to stall: elsewhere, compile times differ between ranks.
    return ShardedEmbedding({"f": ec.FeatureConfig(table())}, optimizer or ec.Adagrad(lr), timeout=timeout)








def step(emb, ids, grads=None):
    acts, ctx = emb.lookup({"f": ids})
    emb.apply_gradients({"f": grads if grads is not None else np.ones_like(acts["f"])}, ctx)


IDS = np.array([[1, 2], [3, 39]])


def refusals(rank, world, ckpt):
    """Each scenario on the same engine; rank 1 misbehaves unless said otherwise."""
    emb = build()
    mine = lambda good, bad: bad if rank == 1 else good  # noqa: E731
    out = {}
    out["bad_ids"] = attempt(emb, lambda: emb.lookup({"f": mine(IDS, np.array([[1, 2], [3, 40]]))}))

    def out_of_memory(*args):
        raise MemoryError("cannot allocate 64.0 GiB")
    if rank == 1:
        emb._prepare = out_of_memory  # not an InputError: a failure nobody planned for
    out["out_of_memory"] = attempt(emb, lambda: emb.lookup({"f": IDS}))
    if rank == 1:
        del emb._prepare

    def nan_gradient():
        acts, ctx = emb.lookup({"f": IDS})
        grads = np.ones_like(acts["f"])
        grads[1, 2] = np.nan if rank == 1 else 1.0
        emb.apply_gradients({"f": grads}, ctx)
    out["nan_gradient"] = attempt(emb, nan_gradient)

    other = build()

    def foreign_context():
        acts, ctx = emb.lookup({"f": IDS})
        _, ctx_other = other.lookup({"f": IDS})
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, mine(ctx, ctx_other))
    out["foreign_context"] = attempt(emb, foreign_context)

    def consumed_context():
        acts, ctx = emb.lookup({"f": IDS})
        if rank == 1:
            ctx.consumed = True
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
    out["consumed_context"] = attempt(emb, consumed_context)

    pending = []

    def different_lookups():
        pending.extend([emb.lookup({"f": IDS}), emb.lookup({"f": IDS[::-1]})])
        acts, ctx = pending[rank % 2]
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
    out["different_lookups"] = attempt(emb, different_lookups)
    # Both contexts stay valid (the first was copied when the second lookup reused the buffers).
    out["then_both_apply"] = attempt(emb, lambda: [emb.apply_gradients({"f": np.ones_like(a["f"])}, c)
                                                   for a, c in pending])

    ex = emb._exchange
    # As if the MPI lacked large counts and one message could hold 60 values: rank 1's 40 ids (160 row values)
    # do not fit, the others' 4 (at most 4 per rank received, 16 values each) do.
    ex.large_counts, ex.max_elements = False, 60
    many = np.arange(40).reshape(20, 2)
    out["message_too_large"] = attempt(emb, lambda: emb.lookup({"f": mine(IDS, many)}))
    out["message_fits"] = attempt(emb, lambda: emb.lookup({"f": IDS}))
    ex.large_counts, ex.max_elements = True, 2 ** 31 - 1

    def held_lock():
        emb._lock.acquire()
        try:
            emb.lookup({"f": IDS})
        finally:
            emb._lock.release()
    out["second_thread"] = attempt(emb, held_lock)

    def overflow():  # two ranks' sums of row 5 add up to inf at its owner
        acts, ctx = emb.lookup({"f": np.array([[5, 6]])})
        grads = np.full_like(acts["f"], 3e38 if rank < 2 else 1.0)
        emb.apply_gradients({"f": grads}, ctx)
    out["overflow"] = attempt(emb, overflow)

    calls = []

    def counted_lr():
        calls.append(1)
        return 0.1
    scheduled = build(optimizer=ec.SGD(counted_lr))
    step(scheduled, np.array([[1, 2]]))  # two ids: some rank owns neither, and still calls the schedule
    out["learning_rate_calls"] = len(calls)
    bad = build(optimizer=ec.SGD(lambda: float("nan") if rank == 1 else 0.1))
    out["nan_learning_rate"] = attempt(bad, lambda: step(bad, IDS))

    wrong = build(optimizer=ec.CustomOptimizer(short_when_large, 0.1))
    out["wrong_length"] = attempt(wrong, lambda: step(wrong, IDS, mine(None, np.full((2, 4), 100.0, np.float32))))

    a, b = os.path.join(ckpt, "a"), os.path.join(ckpt, "b")
    emb.save(a)
    out["first_save_step"] = emb.step
    step(emb, IDS)
    emb.save(b)
    out["load_different_checkpoints"] = attempt(emb, lambda: emb.load(mine(a, b)))
    out["bad_metadata"] = attempt(emb, lambda: emb.save(a, metadata=mine({"ok": 1}, {"bad": float("nan")})))

    # A shard write that fails half-way on rank 1: nothing is committed, the half-written snapshot goes.
    real = sharded_checkpoint.write_table_shards

    def disk_full(writer, *args, **kwargs):
        entries = real(writer, *args, **kwargs)
        raise OSError(28, "No space left on device")
    step(emb, IDS)
    if rank == 1:
        sharded_checkpoint.write_table_shards = disk_full
    out["save_fails_on_one_rank"] = attempt(emb, lambda: emb.save(a))
    if rank == 0:  # rank 0 removes the half-written snapshot after the others have seen the error
        out["save_fails_on_one_rank"].update(snapshots=snapshots(a), current_step=open_snapshot(a).step)
    sharded_checkpoint.write_table_shards = real
    out["save_again"] = attempt(emb, lambda: emb.save(a))
    out["save_again"]["snapshots"] = snapshots(a)
    tables = emb.gather_tables()
    if rank == 0:
        np.save(os.path.join(OUT, "tables.npy"), tables["t"][0])
    report(rank, scenarios=out)


def snapshots(path):
    return sorted(n for n in os.listdir(path) if n.startswith("snapshot-"))


def short_when_large(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """SGD, but returns half a row when the gradient is large (compiles: both branches are rows)."""
    if gradient[0] > 50.0:
        return embedding_table[:2]
    return embedding_table - learning_rate * gradient


def construct(rank):
    for name, make in (("differing", lambda: build(lr=0.2 if rank == 1 else 0.1)),
                       ("invalid_on_one", lambda: ShardedEmbedding(
                           {"f": ec.FeatureConfig(table())} if rank != 1 else {"f": "not a feature"},
                           ec.Adagrad(0.1))),
                       ("good", build)):
        try:
            make()
            report(rank, **{name: None})
        except DistributedError as e:
            report(rank, **{name: str(e)})


def save_stuck(rank, ckpt):
    emb = build()
    step(emb, IDS)
    emb.save(ckpt)
    step(emb, IDS)
    emb.exchange.timeout = 5.0  # short only now: compile times differ between ranks
    if rank == 1:
        real = emb._exchange.gather_bytes

        def stall(*args, **kwargs):
            time.sleep(8)
            return real(*args, **kwargs)
        emb._exchange.gather_bytes = stall
    report(rank, save=attempt(emb, lambda: emb.save(ckpt)))


def save_killed(rank, ckpt):
    emb = build()
    step(emb, IDS)
    emb.save(ckpt)
    report(rank, first_save=emb.step)
    step(emb, IDS)
    if rank == 1:
        real = sharded_checkpoint.write_table_shards

        def killed(writer, configs, tables, *args, **kwargs):
            with open(os.path.join(writer.dir, "table-0000-shard-00001-partial.safetensors"), "wb") as f:
                f.write(b"\0" * 100)
            os._exit(9)
        sharded_checkpoint.write_table_shards = killed
    emb.save(ckpt)
    report(rank, second_save="returned")


def mid_step(rank):
    """A failure after the ranks agreed to go ahead (here: memory, in the lookup's row copies) leaves the
    engine unusable: the peers wait in an exchange this rank will not enter."""
    from embedcore.distributed import engine as sharded_engine
    emb = build()
    step(emb, IDS)
    real = sharded_engine.rows_to_flat

    def out_of_memory(*args):
        raise MemoryError("cannot allocate the answer")
    sharded_engine.rows_to_flat = out_of_memory
    first = attempt(emb, lambda: emb.lookup({"f": IDS}))
    sharded_engine.rows_to_flat = real
    report(rank, first=first, then=attempt(emb, lambda: emb.lookup({"f": IDS})))


def resave(rank, ckpt):
    emb = ShardedEmbedding.restore(ckpt)
    report(rank, restored_step=emb.step)
    step(emb, IDS)
    emb.save(ckpt)
    report(rank, saved_step=emb.step)


if __name__ == "__main__":
    mode = sys.argv[1]
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    from mpi4py import MPI
    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if mode == "refusals":
        construct(rank)
        refusals(rank, world, ckpt)
    elif mode == "save_stuck":
        save_stuck(rank, ckpt)
    elif mode == "save_killed":
        save_killed(rank, ckpt)
    elif mode == "resave":
        resave(rank, ckpt)
    elif mode == "mid_step":
        mid_step(rank)
    else:
        emb = build()
        step(emb, IDS)  # compiles (times differ between ranks); only then a short timeout
        emb.exchange.timeout = 5.0
        try:
            acts, ctx = emb.lookup({"f": IDS})
            if mode == "stuck" and rank == 1:
                time.sleep(90)
                report(rank, stage="woke up")
                sys.exit(0)
            if mode == "die" and rank == 1:
                os._exit(3)
            emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
            report(rank, stage="done", step=emb.step)
        except DistributedError as e:
            report(rank, stage="step", error=str(e), type=type(e).__name__, step=emb.step)
            raise  # under ``python -m mpi4py`` an unhandled exception aborts the whole job
