"""torch.compile(model, fullgraph=True) with an EmbeddingModule inside: the module is a registered custom op
(embedcore::lookup, its backward embedcore::apply_gradients), so the whole model compiles into one graph and
the tables are still updated during backward, exactly as in eager mode."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]'")

import embedcore as ec  # noqa: E402
from embedcore.torch import EmbeddingModule  # noqa: E402

B = 6


def _config():
    users = ec.TableConfig(13, 4, name="users", combiner="mean")
    items = ec.TableConfig(17, 4, name="items", combiner="sum")
    return {"user": ec.FeatureConfig(users), "items": ec.FeatureConfig(items),
            "recent": ec.FeatureConfig(items, max_sequence_length=2)}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = EmbeddingModule(_config(), ec.Adagrad(0.2), seed=5)
        self.dense = torch.nn.Linear(16, 1)

    def forward(self, features, weights, labels):
        acts = self.embeddings(features, weights)
        x = torch.cat([acts["user"], acts["items"], acts["recent"].reshape(labels.shape[0], -1)], 1)
        return torch.nn.functional.binary_cross_entropy_with_logits(self.dense(x).squeeze(1), labels)


def _batch(t):
    rng = np.random.default_rng(t)
    lengths = rng.integers(0, 4, B)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)[:-1]]), dtype=torch.int64)
    values = torch.tensor(rng.integers(0, 17, int(lengths.sum())), dtype=torch.int64)
    features = {"user": torch.tensor(rng.integers(0, 13, B)), "items": (values, offsets),
                "recent": torch.tensor(rng.integers(0, 17, (B, 2)))}
    weights = {"items": torch.tensor(rng.uniform(0.5, 2.0, values.shape[0]), dtype=torch.float32), "user": None,
               "recent": None}
    return features, weights, torch.tensor(rng.integers(0, 2, B), dtype=torch.float32)


def _train(model, step_fn, steps):
    opt = torch.optim.SGD(model.dense.parameters(), lr=0.1)
    losses = []
    for t in range(steps):
        opt.zero_grad()
        loss = step_fn(*_batch(t))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_fullgraph_compile_trains_as_eager():
    torch.manual_seed(0)
    eager = Model()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    losses_eager = _train(eager, eager, 3)
    losses_compiled = _train(compiled_model, compiled, 3)
    np.testing.assert_allclose(losses_compiled, losses_eager, rtol=1e-6)
    assert compiled_model.embeddings.embedding.step == eager.embeddings.embedding.step == 3
    for name, table in eager.embeddings.embedding_tables.items():
        np.testing.assert_allclose(compiled_model.embeddings.embedding_tables[name], table, rtol=1e-6, atol=1e-7,
                                   err_msg=name)
        for slot, value in eager.embeddings.slot_variables[name].items():
            np.testing.assert_allclose(compiled_model.embeddings.slot_variables[name][slot], value, rtol=1e-6)
    # eval under the compiled model: lookups only, nothing changes
    compiled_model.eval()
    before = {n: t.copy() for n, t in compiled_model.embeddings.embedding_tables.items()}
    with torch.no_grad():
        compiled(*_batch(9))
    assert compiled_model.embeddings.embedding.step == 3
    for name, table in before.items():
        np.testing.assert_array_equal(compiled_model.embeddings.embedding_tables[name], table)
