"""Model quality with 16-bit tables against float32 ones: the same seed, data and steps, only the storage differs.

Two workloads, each trained once per storage and printed side by side:

* the demo (``embedcore demo``'s configuration: the DLRM on the synthetic Criteo-like click log, TensorFlow's
  custom Adagrad for all 26 tables): eval AUC and log loss after the last epoch, beside the planted teacher's;
* biased matrix factorisation (``embedcore.app.models.BiasedMF``: ``mu + b_u + b_i + <p_u, q_i>``, factors of
  ``--dim`` values and one-value bias tables, Adagrad, L2 per rating) on MovieLens-100K's ``u.data``
  (``--movielens PATH``, the file or its folder; 90/10 split by row hash): eval RMSE after each epoch, the
  last one compared. Without ``--movielens``, a synthetic explicit-rating set of the same shape (943 users,
  1,682 items, 100,000 ratings 1..5 from a planted rank-8 biased model plus noise, rounded) stands in, and
  the output says so.

ML-100K cannot be redistributed here; a copy of its ratings ships inside the ``recbole`` wheel as
``recbole/dataset_example/ml-100k/ml-100k.inter`` (u.data's 100,000 lines under a one-line header)::

    pip download --no-deps recbole==1.2.1 -d /tmp/rb && cd /tmp/rb && unzip -q recbole-*.whl \\
        'recbole/dataset_example/ml-100k/ml-100k.inter' && mkdir -p /tmp/ml-100k && \\
        tail -n +2 recbole/dataset_example/ml-100k/ml-100k.inter > /tmp/ml-100k/u.data
    python benchmarks/quality_16_bit.py --movielens /tmp/ml-100k

Tolerances (issue 28): demo AUC within 0.002 of float32, MovieLens RMSE within 0.005.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import embedcore as ec  # noqa: E402
from embedcore.app.blas_threads import blas_threads  # noqa: E402
from embedcore.app.cli import demo_config  # noqa: E402
from embedcore.app.data import MovieLens  # noqa: E402
from embedcore.app.models import BiasedMF, mf_features, rmse, squared_error  # noqa: E402
from embedcore.app.trainer import run as train_run  # noqa: E402

AUC_TOLERANCE, RMSE_TOLERANCE = 0.002, 0.005


def storages(names):
    """``"float32"``, ``"bfloat16"`` (rows; float32 slots) or ``"bfloat16/bfloat16"`` (rows/slots)."""
    out = {}
    for name in names:
        rows, _, slots = name.partition("/")
        out[name] = {"weights_dtype": rows, "slot_dtype": slots or "float32", "stochastic_rounding": True}
    return out


def demo(storage, workdir):
    config = demo_config(output=os.path.join(workdir, f"demo-{storage['weights_dtype']}-{storage['slot_dtype']}"),
                         storage=storage)
    start = time.perf_counter()
    with open(os.devnull, "w") as devnull:
        metrics = train_run(config, out=lambda line: None, progress_stream=devnull)
    return {"auc": metrics["final"]["auc"], "log_loss": metrics["final"]["log_loss"],
            "optimum_auc": metrics["optimum"]["auc"], "optimum_log_loss": metrics["optimum"]["log_loss"],
            "bytes": metrics["storage"]["table_bytes"] + metrics["storage"]["slot_bytes"],
            "seconds": time.perf_counter() - start, "steps": metrics["steps"]}


def synthetic_ratings(path, seed=0, n_users=943, n_items=1682, n=100_000, rank=8):
    """A u.data file of ``n`` ratings 1..5 from ``round(3.5 + b_u + b_i + <p_u, q_i> + noise)``, clipped;
    pairs drawn without repeats, item popularity Zipf-like."""
    rng = np.random.default_rng(seed)
    b_u, b_i = rng.normal(0, 0.4, n_users), rng.normal(0, 0.5, n_items)
    p, q = rng.normal(0, 0.45, (n_users, rank)), rng.normal(0, 0.45, (n_items, rank))
    popularity = 1.0 / np.arange(1, n_items + 1) ** 0.8
    pairs = set()
    while len(pairs) < n:
        users = rng.integers(0, n_users, n)
        items = rng.choice(n_items, n, p=popularity / popularity.sum())
        pairs.update(zip(users.tolist(), items.tolist()))
    users, items = np.array(sorted(pairs)[:n]).T
    order = rng.permutation(n)
    users, items = users[order], items[order]
    score = 3.5 + b_u[users] + b_i[items] + np.einsum("bd,bd->b", p[users], q[items]) + rng.normal(0, 0.8, n)
    ratings = np.clip(np.rint(score), 1, 5).astype(int)
    with open(path, "w") as f:
        f.writelines(f"{u + 1}\t{i + 1}\t{r}\t{880000000 + k}\n" for k, (u, i, r) in enumerate(zip(users, items,
                                                                                                  ratings)))
    return path


def matrix_factorisation(dataset, storage, epochs, dim, batch_size, learning_rate, l2, l2_bias, seed=0):
    n_users, n_items = (f.vocabulary_size for f in dataset.features)
    optimizer = ec.Adagrad(learning_rate, initial_accumulator_value=0.1)
    start = time.perf_counter()
    emb = ec.Embedding(mf_features(n_users, n_items, dim, storage=storage), optimizer, seed=seed)
    model = BiasedMF(dataset.mean_rating("train"), dim, l2, l2_bias)
    curve = []
    for epoch in range(epochs):
        for batch in dataset.batches(batch_size, "train", epoch=epoch, ratings=True):
            acts, ctx = emb.lookup(BiasedMF.ids(batch.ids))
            prediction, cache = model.forward(acts)
            _, d_prediction = squared_error(prediction, batch.labels)
            emb.apply_gradients(model.backward(cache, d_prediction), ctx)
        predictions, targets = [], []
        for batch in dataset.batches(8192, "eval", ratings=True):
            acts, _ = emb.lookup(BiasedMF.ids(batch.ids))
            predictions.append(model.forward(acts)[0])
            targets.append(batch.labels)
        curve.append(rmse(np.concatenate(predictions), np.concatenate(targets)))
    nbytes = sum(t.weights.nbytes + sum(s.nbytes for s in t.slots) for t in emb.physical_tables)
    return {"rmse": curve[-1], "curve": curve, "bytes": nbytes, "seconds": time.perf_counter() - start,
            "steps": emb.step}


def side_by_side(title, rows, names):
    print(f"\n{title}")
    width = max(14, *(len(n) + 2 for n in names))
    print(f"  {'':<26}" + "".join(f"{n:>{width}}" for n in names))
    for label, values in rows:
        print(f"  {label:<26}" + "".join(f"{v:>{width}}" for v in values))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--movielens", help="ML-100K's u.data (or its folder); default: a synthetic stand-in")
    parser.add_argument("--storages", default="float32,bfloat16",
                        help="comma-separated: float32, bfloat16, float16, or rows/slots such as bfloat16/bfloat16 "
                             "(the first is the reference)")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-mf", action="store_true")
    parser.add_argument("--epochs", type=int, default=12, help="matrix factorisation epochs (default 12)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--l2", type=float, default=0.1)
    parser.add_argument("--l2-bias", type=float, default=0.01)
    args = parser.parse_args(argv)
    names = args.storages.split(",")
    kinds = storages(names)
    import numba
    print(f"embedcore {ec.__version__}, numpy {np.__version__}, numba {numba.__version__} on "
          f"{numba.get_num_threads()} threads; storages {names} (16-bit: stochastic rounding)")
    ok = True
    with blas_threads(1), tempfile.TemporaryDirectory() as workdir:
        if not args.skip_demo:
            results = [demo(kinds[n], workdir) for n in names]
            ref = results[0]
            side_by_side("demo (embedcore demo's configuration: 300,000 samples x 3 epochs, 50,000 eval, seed 0)", [
                ("eval AUC", [f"{r['auc']:.4f}" for r in results]),
                ("  - reference", [f"{r['auc'] - ref['auc']:+.4f}" for r in results]),
                ("eval log loss", [f"{r['log_loss']:.4f}" for r in results]),
                ("  - reference", [f"{r['log_loss'] - ref['log_loss']:+.4f}" for r in results]),
                ("teacher optimum AUC", [f"{r['optimum_auc']:.4f}" for r in results]),
                ("teacher optimum log loss", [f"{r['optimum_log_loss']:.4f}" for r in results]),
                ("table + slot bytes", [f"{r['bytes']:,}" for r in results]),
                ("seconds (build included)", [f"{r['seconds']:.1f}" for r in results])], names)
            worst = max(abs(r["auc"] - ref["auc"]) for r in results)
            ok &= worst <= AUC_TOLERANCE
            print(f"  largest AUC difference {worst:.4f} (tolerance {AUC_TOLERANCE}): "
                  f"{'within' if worst <= AUC_TOLERANCE else 'OUTSIDE'}")
        if not args.skip_mf:
            if args.movielens:
                dataset, source = MovieLens(args.movielens, eval_fraction=0.1, seed=0), "MovieLens-100K u.data"
            else:
                path = synthetic_ratings(os.path.join(workdir, "u.data"))
                dataset = MovieLens(path, eval_fraction=0.1, seed=0)
                source = "SYNTHETIC stand-in for MovieLens-100K (planted rank-8 biased model; no --movielens given)"
            results = [matrix_factorisation(dataset, kinds[n], args.epochs, args.dim, args.batch_size,
                                            args.learning_rate, args.l2, args.l2_bias) for n in names]
            ref = results[0]
            side_by_side(f"biased MF on {source}: {dataset.n_samples('train'):,} train / "
                         f"{dataset.n_samples('eval'):,} eval ratings, dim {args.dim} + biases, Adagrad "
                         f"{args.learning_rate}, l2 {args.l2} (biases {args.l2_bias}), batch {args.batch_size}, "
                         f"{args.epochs} epochs, seed 0", [
                             ("eval RMSE", [f"{r['rmse']:.4f}" for r in results]),
                             ("  - reference", [f"{r['rmse'] - ref['rmse']:+.4f}" for r in results]),
                             ("best epoch's RMSE", [f"{min(r['curve']):.4f}" for r in results]),
                             ("table + slot bytes", [f"{r['bytes']:,}" for r in results]),
                             ("seconds (build included)", [f"{r['seconds']:.1f}" for r in results])], names)
            for name, r in zip(names, results):
                print(f"  {name} RMSE per epoch: " + " ".join(f"{x:.4f}" for x in r["curve"]))
            worst = max(abs(r["rmse"] - ref["rmse"]) for r in results)
            ok &= worst <= RMSE_TOLERANCE
            print(f"  largest RMSE difference {worst:.4f} (tolerance {RMSE_TOLERANCE}): "
                  f"{'within' if worst <= RMSE_TOLERANCE else 'OUTSIDE'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
