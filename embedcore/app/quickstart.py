"""Quickstart: TensorFlow's CustomOptimizer example, ported, training a tiny model on built-in data.

The data: each sample has a ``user`` id and a bag of ``item`` ids; its target is the planted user bias
plus the mean planted item value. The model predicts ``sum(user activation) + sum(item activation)``
(each table has dim 4, so the sum over the width is the learned value). The embeddings train with the
two custom computations of TensorFlow's ``CustomOptimizer`` documentation: plain SGD for users and
Adagrad (slot ``accumulators`` initialised to 0.1; learning rate 0.1 here) for items. ``weights_dtype``,
``slot_dtype`` and ``stochastic_rounding`` store both tables in 16 bits (``embedcore quickstart
--weights-dtype bfloat16``); the model reads the tables' values in float32 either way.
"""

from __future__ import annotations

import time

import numpy as np

import embedcore as ec


def custom_sgd(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del slot_variables, hyperparameters
    return embedding_table - gradient * learning_rate


def custom_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    del hyperparameters
    accumulator = slot_variables[0]
    new_accumulator = accumulator + gradient * gradient
    updated_embedding_table = embedding_table - learning_rate * gradient / np.sqrt(new_accumulator)
    return (updated_embedding_table, new_accumulator)


def make_batch(rng, planted_users, planted_items, batch_size, max_items):
    users = rng.integers(0, planted_users.shape[0], batch_size)
    lengths = rng.integers(1, max_items + 1, batch_size)
    items = [rng.integers(0, planted_items.shape[0], n) for n in lengths]
    target = planted_users[users] + np.array([planted_items[x].mean() for x in items], np.float32)
    return {"user": users, "items": ec.Ragged.from_lists(items)}, target.astype(np.float32)


def run(steps: int = 300, batch_size: int = 256, seed: int = 0, log_every: int = 50, out=print,
        weights_dtype: str = "float32", slot_dtype: str = "float32", stochastic_rounding: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    n_users, n_items, dim = 1000, 200, 4
    planted_users = rng.normal(0, 1, n_users).astype(np.float32)
    planted_items = rng.normal(0, 1, n_items).astype(np.float32)

    stored = {"weights_dtype": weights_dtype, "slot_dtype": slot_dtype, "stochastic_rounding": stochastic_rounding}
    users = ec.TableConfig(n_users, dim, initializer=ec.Zeros(), combiner="sum", name="users",
                           optimizer=ec.CustomOptimizer(custom_sgd, learning_rate=0.1), **stored)
    items = ec.TableConfig(n_items, dim, initializer=ec.Zeros(), combiner="mean", name="items", **stored)
    adagrad = ec.CustomOptimizer(custom_adagrad, learning_rate=0.1, slot_names=["accumulators"],
                                 slot_initializers=[0.1])
    features = {"user": ec.FeatureConfig(users), "items": ec.FeatureConfig(items)}
    start = time.perf_counter()
    emb = ec.Embedding(features, optimizer=adagrad, seed=seed)
    rounding = "stochastic" if stochastic_rounding else "to nearest"
    out(f"built {emb!r} in {time.perf_counter() - start:.1f} s (Numba compilation included)" +
        ("" if (weights_dtype, slot_dtype) == ("float32", "float32") else
         f"; rows {weights_dtype}, slots {slot_dtype}, rounding {rounding}"))
    out(f"  users: {ec.CustomOptimizer(custom_sgd).explain(dim)}")
    out(f"  items: {adagrad.explain(dim)}")

    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch, target = make_batch(rng, planted_users, planted_items, batch_size, 5)
        acts, ctx = emb(batch)
        prediction = acts["user"].sum(axis=1) + acts["items"].sum(axis=1)
        error = prediction - target
        losses.append(float(np.mean(error ** 2)))
        d_pred = error[:, None]  # gradient of the per-sample loss error^2 / 2, summed over the batch
        emb.apply_gradients({"user": np.repeat(d_pred, dim, axis=1), "items": np.repeat(d_pred, dim, axis=1)},
                            ctx)
        if step == 1:
            start = time.perf_counter()  # step 1 compiled the lookup and update kernels: not timed
        if step % log_every == 0 or step == 1:
            out(f"step {step:4d}  mse {np.mean(losses[-log_every:]):.4f}")
    elapsed = time.perf_counter() - start
    # Summed in float32 whatever the tables' dtype (a 16-bit sum would round every partial sum).
    learned_users = emb.embedding_tables["users"].astype(np.float32).sum(axis=1)
    learned_items = emb.embedding_tables["items"].astype(np.float32).sum(axis=1)
    # Only the sum of user bias and item values is identifiable: compare after removing the means.
    user_corr = float(np.corrcoef(learned_users, planted_users)[0, 1])
    item_corr = float(np.corrcoef(learned_items, planted_items)[0, 1])
    out(f"steps 2-{steps} in {elapsed:.2f} s ({(steps - 1) * batch_size / max(elapsed, 1e-9):,.0f} samples/s)")
    out(f"final mse {np.mean(losses[-log_every:]):.4f} (start {losses[0]:.4f})")
    out(f"learned vs planted values: correlation users {user_corr:.3f}, items {item_corr:.3f}")
    offset = float(np.mean(learned_users - planted_users))  # only user + item sums are identifiable
    out("first users  planted:          " + " ".join(f"{v:+.2f}" for v in planted_users[:6]))
    out(f"first users  learned {-offset:+.2f}:    " + " ".join(f"{v:+.2f}" for v in learned_users[:6] - offset))
    return {"losses": losses, "user_corr": user_corr, "item_corr": item_corr, "step": emb.step}


if __name__ == "__main__":
    run()
