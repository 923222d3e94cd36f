"""One rank of a ``torch.distributed`` (gloo) job training ``EmbeddingModule(..., process_group=pg)``.

``python torch_train.py MODE OUT [options]``, started once per rank with ``--rank K --world N --init FILE``
(a ``file://`` rendezvous) or under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment). Every rank
writes ``OUT/rank-K.json`` (its facts); rank 0 also writes ``OUT/tables.npz`` (every table and slot,
gathered whole). Modes:

``train``
    the schedule of ``mpi_train.py`` (its config, global batches, split over the ranks, and its ``train``),
    run through the module's forward and ``loss.backward()``-style autograd; ``--bad 1`` first makes one
    forward in which rank 1's ids are out of range (refused on every rank, nothing changed);
    ``--save-at STEP CKPT`` saves a collective checkpoint there (and ``OUT/saved.npz``); ``--resume CKPT``
    starts from a checkpoint written by any number of ranks or one process.
``stuck``
    rank 1 sleeps instead of taking part in a lookup (``--die 1``: exits instead); the others must raise
    within ``--timeout`` seconds.
``ddp``
    a dense layer and the sharded module under ``DistributedDataParallel``, two steps; then an unsharded
    module under DDP, which must be refused.
"""

import datetime
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import mpi_train  # noqa: E402

from embedcore.torch import EmbeddingModule  # noqa: E402


class ModuleSteps:
    """What ``mpi_train.train`` drives (``step``, ``lookup``, ``apply_gradients``), through the module:
    forward for the lookup, autograd's backward with the schedule's gradients for the update."""

    def __init__(self, module):
        self.module = module

    @property
    def step(self):
        return self.module.embedding.step

    def lookup(self, features, weights=None):
        acts = self.module(features, weights)
        return {k: v.detach() for k, v in acts.items()}, acts

    def apply_gradients(self, grads, acts):
        names = sorted(acts)
        torch.autograd.backward([acts[k] for k in names], [torch.from_numpy(grads[k]) for k in names])


def options(argv):
    opts = {"--timeout": "60"}
    while argv:
        key = argv.pop(0)
        opts[key] = [argv.pop(0), argv.pop(0)] if key == "--save-at" else argv.pop(0)
    return opts


def init(opts):
    timeout = datetime.timedelta(seconds=60)
    if "--init" in opts:
        dist.init_process_group("gloo", init_method="file://" + opts["--init"], rank=int(opts["--rank"]),
                                world_size=int(opts["--world"]), timeout=timeout)
    else:  # torchrun
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def report(out, rank, facts):
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(dict(facts, rank=rank), f)


def train(out, opts, rank, world):
    group = dist.group.WORLD
    timeout = float(opts["--timeout"])
    if "--resume" in opts:
        module = EmbeddingModule.restore(opts["--resume"], process_group=group, timeout=timeout)
    else:
        features, optimizer = mpi_train.config()
        module = EmbeddingModule(features, optimizer, seed=3, process_group=group, timeout=timeout)
    engine = module.embedding
    facts = {"world": world, "rows": {n: s.rows for n, s in engine.shards.items()}}
    if "--resume" in opts:
        mpi_train.save_tables(engine, os.path.join(out, "loaded.npz"))
    if opts.get("--bad") == "1":
        f, w, _ = mpi_train.take(mpi_train.global_batch(0, mpi_train.GLOBAL), mpi_train.assignment(0, world)[rank])
        if rank == 1:
            f = dict(f, user=np.full(len(f["user"]), 101))  # one past the table's last row
        before = engine.embedding_tables["users"].copy()
        try:
            module(f, {"items": w["items"]} | {k: None for k in f if k != "items"})
            facts["bad"] = None
        except Exception as e:
            facts["bad"] = {"type": type(e).__name__, "message": str(e)}
        unchanged = np.array_equal(before, engine.embedding_tables["users"])
        facts["bad_changed_nothing"] = bool(engine.step == 0 and unchanged)
    save_at = opts.get("--save-at")

    def checkpoint(_):
        if save_at and engine.step == int(save_at[0]):
            module.save(save_at[1])
            mpi_train.save_tables(engine, os.path.join(out, "saved.npz"))
    mpi_train.train(ModuleSteps(module), int(opts["--steps"]), lambda t: mpi_train.assignment(t, world)[rank],
                    checkpoint)
    mpi_train.save_tables(engine, os.path.join(out, "tables.npz"))
    facts["step"] = engine.step
    report(out, rank, facts)


def stuck(out, opts, rank, world):
    features, optimizer = mpi_train.config()
    module = EmbeddingModule(features, optimizer, seed=3, process_group=dist.group.WORLD,
                             timeout=float(opts["--timeout"]))
    f, w, _ = mpi_train.take(mpi_train.global_batch(0, mpi_train.GLOBAL), mpi_train.assignment(0, world)[rank])
    weights = {"items": w["items"]} | {k: None for k in f if k != "items"}
    module(f, weights)  # everyone takes part once (compiled, warm)
    if rank == 1:
        report(out, rank, {"slept": True})
        if opts.get("--die") == "1":
            os._exit(3)  # dies without a word: its connections close
        time.sleep(float(opts["--timeout"]) * 3)
        return
    start = time.monotonic()
    try:
        module(f, weights)
        facts = {"error": None}
    except Exception as e:
        facts = {"error": {"type": type(e).__name__, "message": str(e)}}
    facts["elapsed"] = time.monotonic() - start
    report(out, rank, facts)


def ddp(out, opts, rank, world):
    features, optimizer = mpi_train.config()
    group = dist.group.WORLD

    class Model(torch.nn.Module):
        def __init__(self, embeddings):
            super().__init__()
            self.embeddings = embeddings
            self.dense = torch.nn.Linear(8, 1)

        def forward(self, f, w):
            acts = self.embeddings(f, w)
            return self.dense(acts["user"] + acts["items"]).sum()

    torch.manual_seed(rank)  # DDP makes the dense parameters equal (rank 0's) at wrapping
    model = torch.nn.parallel.DistributedDataParallel(
        Model(EmbeddingModule(features, optimizer, seed=3, process_group=group)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(2):
        f, w, _ = mpi_train.take(mpi_train.global_batch(t, mpi_train.GLOBAL), mpi_train.assignment(t, world)[rank])
        weights = {"items": w["items"]} | {k: None for k in f if k != "items"}
        opt.zero_grad()
        model(f, weights).backward()
        opt.step()
    facts = {"dense": [float(x) for x in model.module.dense.weight.detach().reshape(-1)],
             "step": model.module.embeddings.embedding.step}
    replicated = torch.nn.parallel.DistributedDataParallel(Model(EmbeddingModule(features, optimizer, seed=3)))
    try:
        replicated(f, weights)
        facts["replicated"] = None
    except RuntimeError as e:
        facts["replicated"] = str(e)
    report(out, rank, facts)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    opts = options(sys.argv[3:])
    rank, world = init(opts)
    {"train": train, "stuck": stuck, "ddp": ddp}[mode](out, opts, rank, world)
    if mode != "stuck":
        dist.destroy_process_group()
