"""A training run for the resume tests: ``python resume_worker.py CKPT STEPS`` saves after every step.

The batch of step t depends only on t, so a run resumed from any checkpoint sees the same data as one that
never stopped.
"""

import sys

import numpy as np

import embedcore as ec
from embedcore.app.quickstart import custom_adagrad


def make_engine():
    users = ec.TableConfig(300, 8, name="users", combiner="sum")
    items = ec.TableConfig(500, 8, name="items", optimizer=ec.CustomOptimizer(custom_adagrad, 0.2, ["acc"], [0.1]))
    tags = ec.TableConfig(40, 4, name="tags", optimizer=ec.Adam(0.01), combiner="sqrtn")
    ages = ec.TableConfig(30, 8, name="ages")  # stacked with users: same optimizer and dim
    features = {"user": ec.FeatureConfig(users), "items": ec.FeatureConfig(items),
                "recent": ec.FeatureConfig(items, max_sequence_length=3), "tags": ec.FeatureConfig(tags),
                "age": ec.FeatureConfig(ages)}
    return ec.Embedding(features, ec.FTRL(0.05), seed=7)


def batch(t):
    rng = np.random.default_rng(1000 + t)
    b = 32
    features = {"user": rng.integers(0, 300, b), "items": rng.zipf(1.3, (b, 4)) % 500,
                "recent": rng.integers(0, 500, (b, 5)), "tags": rng.integers(0, 40, (b, 2)),
                "age": rng.integers(0, 30, b)}
    return features


def train_step(emb, t):
    acts, ctx = emb(batch(t))
    rng = np.random.default_rng(2000 + t)
    emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}, ctx)


def train(emb, until):
    while emb.step < until:
        train_step(emb, emb.step)


if __name__ == "__main__":
    path, steps = sys.argv[1], int(sys.argv[2])
    emb = make_engine()
    while emb.step < steps:
        train_step(emb, emb.step)
        emb.save(path)
        print(f"saved {emb.step}", flush=True)
