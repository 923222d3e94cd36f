"""A tiny DLRM-style click model: embedcore tables (updated inside loss.backward()) + a torch dense part.
Run: ``python examples/torch_dlrm.py`` (needs ``pip install embedcore[torch]``)."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import embedcore as ec  # noqa: E402
from embedcore.torch import EmbeddingModule  # noqa: E402

N_USERS, N_ITEMS, DIM, N_DENSE, BATCH = 200, 100, 8, 4, 256
rng = np.random.default_rng(0)
torch.set_num_threads(1)  # a tiny dense model: one thread, leaving the cores to the embedding kernels
user_bias, item_bias = rng.normal(0, 1.5, N_USERS), rng.normal(0, 1.5, N_ITEMS)  # the planted signal


def batch():
    """Random users, a history of 0-5 items each (a ragged bag), a candidate item, dense features, clicks."""
    users = rng.integers(0, N_USERS, BATCH)
    lengths = rng.integers(0, 6, BATCH)
    history = ec.Ragged(rng.integers(0, N_ITEMS, lengths.sum()), np.concatenate([[0], np.cumsum(lengths)]))
    items = rng.integers(0, N_ITEMS, BATCH)
    dense = rng.normal(size=(BATCH, N_DENSE)).astype(np.float32)
    logit = user_bias[users] + item_bias[items] + dense[:, 0]
    clicks = (rng.random(BATCH) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"user": users, "history": history, "item": items}, torch.from_numpy(dense), torch.from_numpy(clicks)


items = ec.TableConfig(N_ITEMS, DIM, name="items", combiner="mean")  # shared by "history" and "item"
features = {"user": ec.FeatureConfig(ec.TableConfig(N_USERS, DIM, name="users")),
            "history": ec.FeatureConfig(items), "item": ec.FeatureConfig(items)}
embedding = EmbeddingModule(features, ec.Adagrad(0.3))  # the tables' own optimizer, fused and sparse
bottom = torch.nn.Sequential(torch.nn.Linear(N_DENSE, DIM), torch.nn.ReLU())
top = torch.nn.Sequential(torch.nn.Linear(4 * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model = torch.nn.ModuleDict({"embedding": embedding, "bottom": bottom, "top": top})
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)  # sees only the dense parameters


def logits(sparse, dense):
    acts = embedding(sparse)  # {"user", "history", "item"}: [BATCH, DIM] float32 tensors
    return top(torch.cat([bottom(dense), acts["user"], acts["history"], acts["item"]], dim=1)).squeeze(1)


losses = []
for step in range(1, 201):
    sparse, dense, clicks = batch()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(sparse, dense), clicks)
    optimizer.zero_grad()
    loss.backward()   # also applies Adagrad to the embedding rows this batch touched
    optimizer.step()  # the dense parameters only
    losses.append(loss.item())
    if step % 50 == 0:
        print(f"step {step}  mean loss {np.mean(losses[-50:]):.4f}  embedding updates {embedding.embedding.step}")

model.eval()
with torch.no_grad():  # eval / no_grad: lookup only, nothing is updated
    sparse, dense, clicks = batch()
    print(f"held-out accuracy {((logits(sparse, dense) > 0).float() == clicks).float().mean().item():.3f}")
