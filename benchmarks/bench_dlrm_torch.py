"""End-to-end DLRM training in PyTorch with three sparse parts: embedcore's ``EmbeddingModule``,
``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.Adagrad``, and FBGEMM's CPU table-batched embeddings (TBE);
and embedcore sharded over ``torch.distributed`` (gloo) against MPI.

Same model, data and batches for every contender: a DLRM (bottom MLP on 13 dense features, one embedding per
categorical feature, all concatenated, top MLP; torch.optim.Adam for the dense part, the same seed), 8 tables
of Zipf-distributed ids from a planted logistic teacher, the same initial table values, and the same
embedding optimizer, FBGEMM's ``EXACT_ADAGRAD`` (``a += g^2; w -= lr g / (sqrt(a) + eps)``, ``a`` from 0):
``embedcore.optimizers.ExactAdagrad``, ``torch.optim.Adagrad(initial_accumulator_value=0, eps)`` and
``OptimType.EXACT_ADAGRAD``. Each contender runs in its own process (peak RSS is per process), in
alternating rounds (contender order rotated every round); reported per contender: median samples/s over
the timed steps (after warm-up), median phase times per step (forward = embeddings + dense forward + loss;
backward = ``loss.backward()``, where embedcore and FBGEMM update the tables; optimizer = the torch
optimizers' ``step()``, where torch's sparse Adagrad updates them), peak RSS, and the eval AUC on held-out
batches after training.

``--distributed`` instead times embedcore sharded over K = 1 and 2 ranks: ``EmbeddingModule(...,
process_group=dist.group.WORLD)`` on gloo against ``EmbeddingModule(ShardedEmbedding(comm=MPI.COMM_WORLD))``
under ``mpiexec``: the same global batches split over the ranks, the dense part local to each rank (no DDP,
so only the embedding transport differs), global samples/s from rank 0's step times.

Run (short; the machine is shared)::

    python benchmarks/bench_dlrm_torch.py --rounds 2 --steps 60
    python benchmarks/bench_dlrm_torch.py --distributed --rounds 2 --steps 40

FBGEMM needs ``pip install fbgemm-gpu-cpu==1.8.0`` (skipped, and said so, when it is not importable).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = (200_000, 100_000, 50_000, 20_000, 10_000, 5_000, 1_000, 100)
N_DENSE, DIM = 13, 16
LR, EPS, DENSE_LR = 0.05, 1e-8, 1e-3
CONTENDERS = ("embedcore", "torch", "fbgemm")


# -- data and model (the same for every contender) -------------------------------------------------------
def make_batches(n, batch, seed):
    """``n`` batches of (ids [T, B] int64, dense [B, 13] float32, clicks [B] float32) from a planted teacher."""
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(12345)
    bias = [teacher.normal(0, 0.7, v) for v in VOCAB]
    dense_w = teacher.normal(0, 0.5, N_DENSE)
    out = []
    for _ in range(n):
        ids = np.stack([(rng.zipf(1.15, batch) - 1) % v for v in VOCAB]).astype(np.int64)
        dense = rng.normal(size=(batch, N_DENSE)).astype(np.float32)
        logit = sum(bias[t][ids[t]] for t in range(len(VOCAB))) + dense @ dense_w - 0.5
        clicks = (rng.random(batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        out.append((ids, dense, clicks))
    return out


def initial_tables():
    rng = np.random.default_rng(7)
    return [rng.uniform(-0.05, 0.05, (v, DIM)).astype(np.float32) for v in VOCAB]


def dense_model(torch):
    torch.manual_seed(0)
    bottom = torch.nn.Sequential(torch.nn.Linear(N_DENSE, 64), torch.nn.ReLU(), torch.nn.Linear(64, DIM),
                                 torch.nn.ReLU())
    top = torch.nn.Sequential(torch.nn.Linear(DIM * (len(VOCAB) + 1), 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return bottom, top


# -- the three sparse parts: forward(ids) -> [B, T * DIM], and their optimizers --------------------------
def sparse_embedcore(torch, tables, process_group=None, comm=None):
    import embedcore as ec
    from embedcore.optimizers import ExactAdagrad
    from embedcore.torch import EmbeddingModule
    config = {f"f{t}": ec.FeatureConfig(ec.TableConfig(v, DIM, name=f"t{t}", combiner="sum"))
              for t, v in enumerate(VOCAB)}
    if comm is not None:
        from embedcore.distributed import ShardedEmbedding
        module = EmbeddingModule(ShardedEmbedding(config, ExactAdagrad(LR, eps=EPS), comm=comm))
    else:
        module = EmbeddingModule(config, ExactAdagrad(LR, eps=EPS), process_group=process_group)
    emb = module.embedding
    if hasattr(emb, "set_state"):
        emb.set_state(tables={f"t{t}": tables[t] for t in range(len(VOCAB))})
    else:  # sharded: each rank copies its own rows
        for t in range(len(VOCAB)):
            shard = emb.shards[f"t{t}"]
            emb.embedding_tables[f"t{t}"][...] = tables[t][shard.global_rows()]

    def forward(ids):
        acts = module({f"f{t}": torch.from_numpy(ids[t]) for t in range(len(VOCAB))})
        return torch.cat([acts[f"f{t}"] for t in range(len(VOCAB))], 1)
    return forward, [], module


def sparse_torch(torch, tables):
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(v, DIM, mode="sum", sparse=True) for v in VOCAB)
    with torch.no_grad():
        for bag, table in zip(bags, tables):
            bag.weight.copy_(torch.from_numpy(table))
    offsets = {}

    def forward(ids):
        b = ids.shape[1]
        if b not in offsets:
            offsets[b] = torch.arange(b, dtype=torch.int64)
        return torch.cat([bag(torch.from_numpy(ids[t]), offsets[b]) for t, bag in enumerate(bags)], 1)
    optimizer = torch.optim.Adagrad(bags.parameters(), lr=LR, eps=EPS, initial_accumulator_value=0.0)
    return forward, [optimizer], bags


def sparse_fbgemm(torch, tables):
    import fbgemm_gpu  # noqa: F401
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice, OptimType,
                                                                        SplitTableBatchedEmbeddingBagsCodegen)
    specs = [(v, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for v in VOCAB]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=OptimType.EXACT_ADAGRAD, learning_rate=LR,
                                                eps=EPS, pooling_mode=PoolingMode.SUM)
    for weights, table in zip(tbe.split_embedding_weights(), tables):
        weights.copy_(torch.from_numpy(table))
    for states in tbe.split_optimizer_states():
        states[0].fill_(0.0)
    T = len(VOCAB)

    def forward(ids):
        b = ids.shape[1]
        return tbe(torch.from_numpy(ids.reshape(-1)), torch.arange(T * b + 1, dtype=torch.int64))
    return forward, [], tbe


# -- one contender's process ------------------------------------------------------------------------------
def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(torch, forward, sparse_optimizers, batches, warmup, eval_batches, rows=None):
    """Train on ``batches`` (each rank its ``rows`` of every batch), time the steps after ``warmup``; eval AUC."""
    bottom, top = dense_model(torch)
    dense_opt = torch.optim.Adam(list(bottom.parameters()) + list(top.parameters()), lr=DENSE_LR)
    optimizers = [dense_opt] + sparse_optimizers
    steps = []
    for k, (ids, dense, clicks) in enumerate(batches):
        if rows is not None:
            ids, dense, clicks = ids[:, rows], dense[rows], clicks[rows]
        t0 = time.perf_counter()
        x = torch.cat([bottom(torch.from_numpy(dense)), forward(ids)], 1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(top(x).squeeze(1), torch.from_numpy(clicks),
                                                                    reduction="sum") / len(clicks)
        t1 = time.perf_counter()
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        for o in optimizers:
            o.step()
        t3 = time.perf_counter()
        if k >= warmup:
            steps.append((t1 - t0, t2 - t1, t3 - t2, len(clicks)))
    scores, labels = [], []
    with torch.no_grad():
        for ids, dense, clicks in eval_batches:
            if rows is not None:
                ids, dense, clicks = ids[:, rows], dense[rows], clicks[rows]
            x = torch.cat([bottom(torch.from_numpy(dense)), forward(ids)], 1)
            scores.append(top(x).squeeze(1).numpy())
            labels.append(clicks)
    return steps, np.concatenate(scores) if scores else np.zeros(0), np.concatenate(labels) if labels else np.zeros(0)


def summarize(steps, scores, labels):
    from embedcore.app.metrics import auc
    f, b, o, n = (np.array(x) for x in zip(*steps))
    total = f + b + o
    return {"samples_per_s": float(np.median(n / total)), "forward_ms": float(np.median(f) * 1e3),
            "backward_ms": float(np.median(b) * 1e3), "optimizer_ms": float(np.median(o) * 1e3),
            "step_ms": float(np.median(total) * 1e3), "auc": float(auc(labels, scores)) if len(labels) else None,
            "peak_rss_mb": peak_rss_mb(), "timed_steps": len(steps)}


def worker(args):
    import torch
    torch.set_num_threads(args.threads)
    batches = make_batches(args.steps, args.batch, seed=1)
    eval_batches = make_batches(args.eval_batches, args.batch, seed=2)
    tables = initial_tables()
    rss_data = peak_rss_mb()
    build = {"embedcore": sparse_embedcore, "torch": sparse_torch, "fbgemm": sparse_fbgemm}[args.worker]
    t0 = time.perf_counter()
    forward, sparse_opts, _ = build(torch, tables)
    build_s = time.perf_counter() - t0
    del tables
    result = summarize(*train(torch, forward, sparse_opts, batches, args.warmup, eval_batches))
    result.update(contender=args.worker, build_s=build_s, rss_before_model_mb=rss_data,
                  threads=torch.get_num_threads())
    print(json.dumps(result))


def dist_worker(args):
    """One rank of the --distributed comparison (gloo: --rank/--world/--init; mpi: under mpiexec)."""
    import torch
    torch.set_num_threads(1)
    if args.transport == "gloo":
        import datetime
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + args.init, rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=300))
        rank, world = dist.get_rank(), dist.get_world_size()
        kwargs = {"process_group": dist.group.WORLD}
    else:
        from mpi4py import MPI
        rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        kwargs = {"comm": MPI.COMM_WORLD}
    batches = make_batches(args.steps, args.batch, seed=1)
    forward, _, _ = sparse_embedcore(torch, initial_tables(), **kwargs)
    rows = np.arange(rank, args.batch, world)
    steps, scores, labels = train(torch, forward, [], batches, args.warmup, [], rows=rows)
    result = summarize([(f, b, o, args.batch) for f, b, o, _ in steps], scores, labels)  # global samples
    result.update(transport=args.transport, world=world, rank=rank)
    if rank == 0:
        print(json.dumps(result))


# -- the driver: alternating rounds -----------------------------------------------------------------------
def run_json(cmd, env, timeout=900):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1])


def common_args(args):
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--eval-batches", str(args.eval_batches), "--threads", str(args.threads)]


def table(rows, columns):
    widths = [max(len(c), *(len(r.get(c, "")) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(r.get(c, "").ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def fmt(results, key, scale="{:.1f}"):
    values = [r[key] for r in results if key in r and r[key] is not None]
    if not values:
        return "-"
    lo, hi, mid = min(values), max(values), float(np.median(values))
    return scale.format(mid) + (f" ({scale.format(lo)}-{scale.format(hi)})" if len(values) > 1 else "")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="training steps per run (the first --warmup untimed)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="torch threads (embedcore's Numba threads: default)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--distributed", action="store_true")
    p.add_argument("--worker", choices=CONTENDERS)
    p.add_argument("--dist-worker", action="store_true")
    p.add_argument("--transport", choices=("gloo", "mpi"))
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--init")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.dist_worker:
        return dist_worker(args)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    me = [sys.executable, os.path.abspath(__file__)]
    results = {}
    if not args.distributed:
        contenders = args.contenders.split(",")
        for r in range(args.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c in order:
                res = run_json(me + ["--worker", c] + common_args(args), env)
                results.setdefault(c, []).append(res)
                print(f"round {r + 1} {c}: " + (f"{res['samples_per_s']:.0f} samples/s, AUC {res['auc']:.4f}"
                                                 if "error" not in res else "failed: " + res["error"][-300:]),
                      file=sys.stderr)
        columns = ["contender", "samples/s", "step ms", "forward ms", "backward ms", "optimizer ms",
                   "peak RSS MB", "eval AUC", "build s"]
    else:
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
        configs = [("gloo", 1), ("mpi", 1), ("gloo", 2), ("mpi", 2)]
        for r in range(args.rounds):
            order = configs[r % 2:] + configs[:r % 2]
            for transport, k in order:
                cmd = common_args(args) + ["--dist-worker", "--transport", transport]
                if transport == "mpi":
                    res = run_json([mpiexec, "-n", str(k)] + me + cmd, env)
                else:
                    with tempfile.TemporaryDirectory() as d:
                        procs = [subprocess.Popen(me + cmd + ["--rank", str(i), "--world", str(k), "--init",
                                                              os.path.join(d, "rdv")],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                                 for i in range(k)]
                        outs = [pr.communicate(timeout=900) for pr in procs]
                    lines = [line for line in outs[0][0].splitlines() if line.startswith("{")]
                    res = json.loads(lines[-1]) if lines else {"error": outs[0][1][-1500:]}
                name = f"{transport} x{k}"
                results.setdefault(name, []).append(res)
                print(f"round {r + 1} {name}: " + (f"{res['samples_per_s']:.0f} samples/s"
                                                    if "error" not in res else "failed: " + res["error"][-300:]),
                      file=sys.stderr)
        columns = ["contender", "samples/s", "step ms", "forward ms", "backward ms", "peak RSS MB"]
    rows = []
    for name, runs in results.items():
        ok = [x for x in runs if "error" not in x]
        if not ok:
            rows.append({"contender": name, "samples/s": "failed"})
            continue
        rows.append({"contender": name, "samples/s": fmt(ok, "samples_per_s", "{:.0f}"),
                     "step ms": fmt(ok, "step_ms"), "forward ms": fmt(ok, "forward_ms"),
                     "backward ms": fmt(ok, "backward_ms"), "optimizer ms": fmt(ok, "optimizer_ms"),
                     "peak RSS MB": fmt(ok, "peak_rss_mb", "{:.0f}"), "eval AUC": fmt(ok, "auc", "{:.4f}"),
                     "build s": fmt(ok, "build_s")})
    print(f"# {time.strftime('%Y-%m-%d')}  rounds {args.rounds}, steps {args.steps} ({args.warmup} warm-up), "
          f"batch {args.batch}, tables {VOCAB} x {DIM}, torch threads {args.threads}; medians (range over rounds)")
    print(table(rows, columns))
    for name, runs in results.items():
        for x in runs:
            if "error" in x:
                print(f"{name} failed: {x['error'][-800:]}")


if __name__ == "__main__":
    main()
