"""Quality at a memory budget (issue 27): dynamic tables with admission and eviction against hashed buckets.

Run from the repository root::

    PYTHONPATH=. python benchmarks/quality_dynamic.py --full --min-vocab 100000 --init-std 0.01 --min-count 3
                                                        # full vocabulary (minutes; BENCHMARKS.md's figures)
    PYTHONPATH=. python benchmarks/quality_dynamic.py --tiny          # smoke run (seconds)

Data: :class:`embedcore.app.data.synthetic.SyntheticClickLog` (the demo's click log, 26 categorical features
with vocabularies up to 10^6 rows, a planted teacher) at its full vocabulary (``--vocab-scale 1``). Every
feature with at least ``--min-vocab`` ids gets room for only ``--fraction`` (a tenth) of them:
``rows = ceil(fraction x vocabulary)``; the smaller features keep a full static table in every model.

Models (each the demo's :class:`~embedcore.app.models.DLRM` over an :class:`embedcore.Embedding` of dim
``--dim``, Adagrad ``--lr``, the same seed, batches and number of steps):

* ``dynamic-lru`` / ``dynamic-lfu`` (``--evictions``): a ``DynamicTableConfig(capacity=rows,
  admission=CountAdmission(--min-count), eviction=LRU() or LFU())`` per budgeted feature, fed the ids as keys.
  The key map adds about 21 bytes a row and the admission sketch ``16 x --sketch-width`` bytes a table (by
  default 16 bytes a row) beyond its rows and slots.
* ``hashed``: a static ``TableConfig(buckets)`` per budgeted feature; id ``i`` reads bucket ``mix64(i) mod
  buckets`` (SplitMix64, :func:`embedcore.kernels.random.mix64`): colliding ids share a row. With the default
  ``--same-memory`` a feature's buckets take the bytes its dynamic table takes in all (rows, slots, key map and
  sketch), so ``buckets > rows``; ``--no-same-memory`` gives it ``rows`` buckets (the dynamic tables then hold
  more memory).
* ``full`` (``--full``): static tables of the whole vocabulary, the unconstrained reference.

Evaluation reads the tables without changing them: each feature's rows by id (a dynamic table's view gives
an id it does not hold its initial value, as a lookup would), pooled with the feature's combiner and
weights, fed to the model; the eval AUC and log loss are printed beside the teacher's own (the optimum).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numpy as np
from numba import njit

import embedcore as ec
from embedcore.app.blas_threads import set_blas_threads
from embedcore.app.data.synthetic import DEFAULT_VOCABULARY_SIZES, SyntheticClickLog
from embedcore.app.metrics import BinaryMetrics
from embedcore.app.models import DLRM, bce_with_logits, sigmoid
from embedcore.kernels.random import mix64
from embedcore.tables.dynamic import map_bytes

TINY = {"vocab_scale": 100, "n_train": 8192, "n_eval": 4096, "batch_size": 64, "min_vocab": 1000,
        "fraction": 0.2, "dim": 4}


@njit  # not cached: a script's cache entry breaks when the file is loaded under another module name
def _buckets(ids, n, out):
    for i in range(ids.shape[0]):
        out[i] = np.int64(mix64(np.uint64(ids[i])) % np.uint64(n))


def hashed_ids(ids: np.ndarray, n: int) -> np.ndarray:
    """Bucket ``mix64(id) mod n`` of each id (int64)."""
    ids = np.ascontiguousarray(ids, np.int64)
    out = np.empty(ids.shape[0], np.int64)
    _buckets(ids, n, out)
    return out


def budget_rows(spec, args) -> int | None:
    """The rows a feature may hold under the budget, or None for a feature kept whole."""
    if spec.vocabulary_size < args.min_vocab:
        return None
    return max(1, math.ceil(args.fraction * spec.vocabulary_size))


def row_bytes(dim: int) -> int:
    """Bytes of one float32 row and its Adagrad accumulator."""
    return 2 * 4 * dim


def dynamic_table(spec, rows, eviction, init, args) -> ec.DynamicTableConfig:
    admission = ec.CountAdmission(args.min_count, sketch_width=max(64, args.sketch_width or rows))
    return ec.DynamicTableConfig(args.dim, rows, name=spec.name, combiner=spec.combiner, initializer=init,
                                 admission=admission, eviction={"lru": ec.LRU(), "lfu": ec.LFU()}[eviction])


def hashed_buckets(spec, rows, args) -> int:
    """Buckets of a feature's hashed table: ``rows``, or with ``--same-memory`` as many as the bytes of its
    dynamic table (rows, slots, key map and admission sketch) hold."""
    if not args.same_memory:
        return rows
    dynamic = dynamic_table(spec, rows, "lru", None, args)
    return rows + map_bytes(dynamic) // row_bytes(args.dim)


class Model:
    """One engine + DLRM; ``kind`` is ``hashed``, ``dynamic-lru``, ``dynamic-lfu`` or ``full``."""

    def __init__(self, kind, dataset, args):
        self.kind, self.budget = kind, {}
        features = {}
        init = None if args.init_std is None else ec.TruncatedNormal(0.0, args.init_std)
        for spec in dataset.features:
            rows = budget_rows(spec, args) if kind != "full" else None
            if rows is None:
                table = ec.TableConfig(spec.vocabulary_size, args.dim, combiner=spec.combiner, name=spec.name,
                                       initializer=init)
            elif kind == "hashed":
                rows = hashed_buckets(spec, rows, args)
                table = ec.TableConfig(rows, args.dim, combiner=spec.combiner, name=spec.name, initializer=init)
            else:
                table = dynamic_table(spec, rows, kind[len("dynamic-"):], init, args)
            if rows is not None:
                self.budget[spec.name] = rows
            features[spec.name] = ec.FeatureConfig(table)
        self.configs = {name: f.table for name, f in features.items()}
        self.emb = ec.Embedding(features, ec.Adagrad(args.lr), seed=args.seed)
        self.model = DLRM(dataset.n_dense, [f.name for f in dataset.features], args.dim, seed=args.seed)
        self.specs = {f.name: f for f in dataset.features}

    def inputs(self, ids: dict) -> dict:
        """The batch's ids as this model's tables take them (hashed buckets for the hashed model)."""
        if self.kind != "hashed":
            return ids
        out = dict(ids)
        for name, rows in self.budget.items():
            x = ids[name]
            out[name] = ec.Ragged(hashed_ids(x.values, rows), x.row_splits) if isinstance(x, ec.Ragged) else \
                hashed_ids(x, rows)
        return out

    def train_step(self, batch) -> float:
        acts, ctx = self.emb.lookup(self.inputs(batch.ids), batch.weights)
        logits, cache = self.model.forward(batch.dense, acts)
        loss, d_logits = bce_with_logits(logits, batch.labels)
        self.emb.apply_gradients(self.model.backward(cache, d_logits), ctx)
        self.model.step()
        return float(loss)

    def activations(self, batch) -> dict:
        """Every feature's pooled rows, read without changing any table."""
        ids = self.inputs(batch.ids)
        return {name: pooled(self.emb.embedding_tables[name], ids[name], batch.weights.get(name),
                             self.specs[name].combiner) for name in self.specs}

    def table_bytes(self) -> tuple:
        """``(rows and slots, key maps and sketches)``: bytes of the budgeted features' tables (float32 rows and
        one Adagrad accumulator a value), and what their dynamic tables add (:func:`map_bytes`)."""
        rows = sum(row_bytes(self.configs[name].dim) * n for name, n in self.budget.items())
        extra = sum(map_bytes(self.configs[name]) for name in self.budget
                    if isinstance(self.configs[name], ec.DynamicTableConfig))
        return rows, extra


def pooled(table, ids, weights, combiner) -> np.ndarray:
    """``table``'s rows of ``ids`` (an int64 ``[B]`` or a Ragged of bags), pooled per sample with
    ``combiner`` (``sum``: ``sum w x``; ``mean``: divided by ``sum w``; ``sqrtn``: by ``sqrt(sum w^2)``; 0 for
    an empty bag), float32 ``[B, dim]``."""
    if not isinstance(ids, ec.Ragged):
        return np.asarray(table[np.asarray(ids, np.int64)], np.float32)
    values = np.asarray(ids.values, np.int64)
    splits = np.asarray(ids.row_splits, np.int64)
    w = np.ones(values.shape[0], np.float32) if weights is None else np.asarray(weights.values, np.float32)
    rows = np.asarray(table[values], np.float32) * w[:, None]
    n, dim = splits.shape[0] - 1, rows.shape[1]
    out = np.zeros((n, dim), np.float32)
    bag = np.repeat(np.arange(n), np.diff(splits))
    np.add.at(out, bag, rows)
    if combiner == "mean":
        norm = np.bincount(bag, w, n)
    elif combiner == "sqrtn":
        norm = np.sqrt(np.bincount(bag, w * w, n))
    else:
        return out
    nonempty = norm > 0
    out[nonempty] /= norm[nonempty, None].astype(np.float32)
    return out


def evaluate(model, dataset, batch_size) -> dict:
    metrics = BinaryMetrics()
    for batch in dataset.batches(batch_size, "eval"):
        logits, _ = model.model.forward(batch.dense, model.activations(batch))
        metrics.update(batch.labels, sigmoid(logits))
    return metrics.result(allow_undefined=True)


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run in seconds); explicit options win")
    p.add_argument("--vocab-scale", type=int, default=1, help="divide the default vocabularies by this")
    p.add_argument("--n-train", type=int, default=2_000_000)
    p.add_argument("--n-eval", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate of the tables")
    p.add_argument("--fraction", type=float, default=0.1, help="rows a budgeted feature may hold / its vocabulary")
    p.add_argument("--min-vocab", type=int, default=10_000, help="features with at least this many ids are budgeted")
    p.add_argument("--min-count", type=int, default=2, help="CountAdmission(min_count)")
    p.add_argument("--sketch-width", type=int, default=0,
                   help="CountAdmission(sketch_width); 0: the table's rows (4 x 4 bytes a row for the sketch)")
    p.add_argument("--evictions", default="lru,lfu", help="dynamic models: comma list of lru, lfu")
    p.add_argument("--full", action="store_true", help="also train full-vocabulary static tables")
    p.add_argument("--same-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="hashed tables get the bytes the dynamic tables take in all (key maps and sketches too)")
    p.add_argument("--init-std", type=float, default=None,
                   help="every table's initializer: TruncatedNormal(0, this) (default: 1/sqrt(dim), the tables' default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.tiny:
        given = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
        for key, value in TINY.items():
            if key not in given:
                setattr(args, key, value)
    set_blas_threads(1)
    vocab = [max(2, v // args.vocab_scale) for v in DEFAULT_VOCABULARY_SIZES]
    dataset = SyntheticClickLog(args.n_train, args.n_eval, args.seed, vocabulary_sizes=vocab)
    optimum = dataset.optimum("eval")
    kinds = ["hashed"] + [f"dynamic-{e.strip()}" for e in args.evictions.split(",") if e.strip()] + \
        (["full"] if args.full else [])
    for kind in kinds:
        if kind not in ("hashed", "dynamic-lru", "dynamic-lfu", "full"):
            raise SystemExit(f"unknown eviction in --evictions: {kind[len('dynamic-'):]!r} (lru, lfu)")
    budgeted = {f.name: (f.vocabulary_size, budget_rows(f, args)) for f in dataset.features
                if budget_rows(f, args) is not None}
    print(f"data: {dataset!r}")
    print(f"budgeted features (vocabulary -> rows): " +
          ", ".join(f"{n} {v:,}->{r:,}" for n, (v, r) in budgeted.items()))
    print(f"teacher optimum on eval: AUC {optimum['auc']:.4f}, log loss {optimum['log_loss']:.4f}")
    results = {"args": vars(args), "optimum": optimum, "budgeted": budgeted, "models": {}}
    for kind in kinds:
        model = Model(kind, dataset, args)
        t0 = time.perf_counter()
        losses = []
        for _ in range(args.epochs):
            for batch in dataset.batches(args.batch_size, "train"):
                losses.append(model.train_step(batch))
        seconds = time.perf_counter() - t0
        result = evaluate(model, dataset, args.batch_size)
        held = {name: len(model.emb.embedding_tables[name]) for name in model.budget} if kind.startswith(
            "dynamic") else {}
        entry = {"eval_auc": result["auc"], "eval_log_loss": result["log_loss"], "train_seconds": seconds,
                 "steps": len(losses), "final_train_loss": float(np.mean(losses[-10:])) if losses else None,
                 "budgeted_bytes": model.table_bytes(), "keys_held": held}
        results["models"][kind] = entry
        print(f"{kind:12s} eval AUC {result['auc']:.4f} (optimum {optimum['auc']:.4f}), log loss "
              f"{result['log_loss']:.4f}; {len(losses)} steps in {seconds:.1f} s; budgeted features: rows+slots "
              f"{entry['budgeted_bytes'][0]:,} B, key maps+sketches {entry['budgeted_bytes'][1]:,} B"
              + (f"; keys held {sum(held.values()):,}" if held else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
