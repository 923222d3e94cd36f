"""A tiny DLRM: embedcore holds the sparse tables (Adagrad, fused sparse updates), JAX the dense model (Adam).

Synthetic clicks: the label depends on a hidden per-user and per-item bias and on one dense feature, so the
model must learn the user and item embeddings. Run ``python examples/jax_dlrm.py``: the held-out loss falls
from about 0.9 to about 0.5 in 300 steps (most of the run time is Numba and XLA compiling the first step).
"""

import os
import time

# Idle OpenMP threads of Numba's parallel kernels must sleep, not spin and steal JAX's cores between two calls.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore import jax as ecj  # noqa: E402

B, DIM, USERS, ITEMS, CATEGORIES = 256, 8, 300, 100, 30
rng = np.random.default_rng(0)
user_bias, item_bias = rng.normal(0, 1.5, USERS), rng.normal(0, 1.5, ITEMS)
emb = ec.Embedding({"user": ec.FeatureConfig(ec.TableConfig(USERS, DIM, name="user")),
                    "item": ec.FeatureConfig(ec.TableConfig(ITEMS, DIM, name="item")),
                    "category": ec.FeatureConfig(ec.TableConfig(CATEGORIES, DIM, name="category"))},
                   ec.Adagrad(0.05, initial_accumulator_value=1e-3))


def make_batch():
    """Sparse features ([B] ids, [B] ids, multi-hot lists) and the dense batch (dense features, labels)."""
    users, items = rng.integers(0, USERS, B), rng.integers(0, ITEMS, B)
    categories = [rng.integers(0, CATEGORIES, rng.integers(1, 4)).tolist() for _ in range(B)]
    dense = rng.normal(0, 1, (B, 4)).astype(np.float32)
    p = 1 / (1 + np.exp(-(user_bias[users] + item_bias[items] + dense[:, 0])))
    labels = (rng.random(B) < p).astype(np.float32)
    return {"user": users, "item": items, "category": categories}, {"dense": dense, "label": labels}


def mlp(layers, x):
    for w, b in layers[:-1]:
        x = jax.nn.relu(x @ w + b)
    return x @ layers[-1][0] + layers[-1][1]


def loss_fn(params, acts, batch):
    bottom = mlp(params["bottom"], batch["dense"])                                  # [B, DIM]
    vectors = jnp.stack([bottom, acts["user"], acts["item"], acts["category"]], 1)  # [B, 4, DIM]
    i, j = jnp.triu_indices(4, k=1)
    pairs = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, i, j]                  # dot interactions
    logits = mlp(params["top"], jnp.concatenate([vectors.reshape(B, -1), pairs], 1))[:, 0]
    return jnp.mean(jax.nn.softplus(logits) - batch["label"] * logits)


keys = iter(jax.random.split(jax.random.key(0), 4))
params = {name: [(jax.random.normal(next(keys), (m, n)) * jnp.sqrt(2 / m), jnp.zeros(n)) for m, n in shapes]
          for name, shapes in (("bottom", [(4, 16), (16, DIM)]), ("top", [(4 * DIM + 6, 16), (16, 1)]))}
dense_opt = ecj.adam(3e-3)
opt_state = dense_opt.init(params)
train_step = ecj.make_train_step(loss_fn, dense_opt)
eval_loss = jax.jit(loss_fn)
held_out = [make_batch() for _ in range(4)]
start = time.perf_counter()
for step in range(301):
    if step % 50 == 0:  # evaluation looks up without applying: its contexts are simply dropped
        loss = np.mean([eval_loss(params, ecj.lookup(emb, f)[0], b) for f, b in held_out])
        print(f"step {step:3d}  held-out loss {loss:.4f}  ({time.perf_counter() - start:.1f} s)")
    features, batch = make_batch()
    acts, ctx = ecj.lookup(emb, features)                                      # 1. host lookup -> jax arrays
    _, params, opt_state, d_acts = train_step(params, opt_state, acts, batch)  # 2. jitted dense step
    ecj.apply_gradients(emb, d_acts, ctx)                                      # 3. fused sparse update
