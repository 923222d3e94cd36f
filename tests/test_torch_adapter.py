"""The PyTorch adapter (embedcore.torch) against torch.nn.EmbeddingBag trained with NumPy optimizers."""

import copy
import importlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]' (.ci/run installs it)")

import embedcore as ec  # noqa: E402
from embedcore.torch import EmbeddingModule  # noqa: E402

from . import reference as ref  # noqa: E402

DIM, SEQ = 4, 3
VOCAB = {"items": 11, "users": 9, "pages": 7}


def _config(optimizer=None):
    items = ec.TableConfig(VOCAB["items"], DIM, combiner="sum", name="items", optimizer=optimizer)
    users = ec.TableConfig(VOCAB["users"], DIM, combiner="mean", name="users", optimizer=optimizer)
    pages = ec.TableConfig(VOCAB["pages"], DIM, combiner="sum", name="pages", optimizer=optimizer)
    return {"watched": ec.FeatureConfig(items),            # weighted sum
            "liked": ec.FeatureConfig(items),              # shares the table "items"
            "user": ec.FeatureConfig(users),               # mean
            "history": ec.FeatureConfig(pages, max_sequence_length=SEQ)}  # sequence [B, SEQ, DIM]


def _samples(rng, batch_size, vocab, max_len):
    out = [[int(x) for x in rng.integers(0, vocab, rng.integers(0, max_len + 1))] for _ in range(batch_size)]
    out[0] = []                  # an empty bag
    out[1] = [2, 2, 5, 2][:max_len + 1]  # duplicates inside a bag
    return out


def _batch(rng, batch_size=6):
    s = {"watched": _samples(rng, batch_size, VOCAB["items"], 4), "liked": _samples(rng, batch_size, VOCAB["items"], 3),
         "user": _samples(rng, batch_size, VOCAB["users"], 3), "history": _samples(rng, batch_size, VOCAB["pages"], 5)}
    w = [[float(x) for x in rng.uniform(0.2, 2.0, len(b))] for b in s["watched"]]
    return s, w


def _embedcore_inputs(s, w):
    """The same batch in several input forms, torch tensors included."""
    features = {"watched": s["watched"],
                "liked": ec.Ragged.from_lists(s["liked"], np.int64),
                "user": [torch.tensor(b, dtype=torch.int32) for b in s["user"]],
                "history": s["history"]}
    weights = {"watched": w, "liked": None, "user": None, "history": None}
    return features, weights


def _bag(module, samples, weights=None):
    flat = torch.tensor([i for b in samples for i in b], dtype=torch.long)
    offsets = torch.tensor(np.cumsum([0] + [len(b) for b in samples])[:-1], dtype=torch.long)
    psw = None if weights is None else torch.tensor([x for b in weights for x in b], dtype=torch.float32)
    return module(flat, offsets, per_sample_weights=psw)


def _sequence(module, samples):
    """A sequence feature as EmbeddingBag(sum) over one-id bags per position, padding = empty bags."""
    bags = [[b[p]] if p < len(b) else [] for b in samples for p in range(SEQ)]
    return _bag(module, bags).reshape(len(samples), SEQ, DIM)


class TorchReference:
    """EmbeddingBags (dense grads) updated with explicit NumPy SGD / TF-style Adagrad, in float64."""

    def __init__(self, emb, kind, lr, init_acc=0.1):
        self.kind, self.lr = kind, lr
        self.bags = {name: torch.nn.EmbeddingBag(VOCAB[name], DIM, mode=emb.tables[name].combiner)
                     for name in VOCAB}
        self.tables = {name: emb.embedding_tables[name].astype(np.float64) for name in VOCAB}
        self.acc = {name: np.full((VOCAB[name], DIM), init_acc) for name in VOCAB}
        self._load()

    def _load(self):
        with torch.no_grad():
            for name, bag in self.bags.items():
                bag.weight.copy_(torch.from_numpy(self.tables[name].astype(np.float32)))
                bag.weight.grad = None

    def forward(self, s, w):
        b = self.bags
        return {"watched": _bag(b["items"], s["watched"], w), "liked": _bag(b["items"], s["liked"]),
                "user": _bag(b["users"], s["user"]), "history": _sequence(b["pages"], s["history"])}

    def update(self):
        for name, bag in self.bags.items():
            g = np.zeros((VOCAB[name], DIM)) if bag.weight.grad is None else bag.weight.grad.double().numpy()
            if self.kind == "sgd":
                self.tables[name] = self.tables[name] - self.lr * g
            else:  # acc += g^2; w -= lr * g / sqrt(acc)   (untouched rows: g = 0, nothing changes)
                self.acc[name] = self.acc[name] + g * g
                self.tables[name] = self.tables[name] - self.lr * g / np.sqrt(self.acc[name])
        self._load()


def _flat(acts, batch_size):
    return torch.cat([acts["watched"], acts["liked"], acts["user"], acts["history"].reshape(batch_size, -1)], 1)


@pytest.mark.parametrize("kind,dense", [("sgd", "sgd"), ("adagrad", "adam"), ("adagrad", "sgd"), ("sgd", "adam")])
def test_training_matches_embedding_bag_with_numpy_optimizer(kind, dense):
    lr = 0.3
    optimizer = ec.SGD(lr) if kind == "sgd" else ec.Adagrad(lr, initial_accumulator_value=0.1)
    module = EmbeddingModule(_config(), optimizer, seed=5)
    reference = TorchReference(module.embedding, kind, lr)
    torch.manual_seed(0)
    head = torch.nn.Linear(2 * DIM + DIM + SEQ * DIM, 1)
    ref_head = copy.deepcopy(head)
    make = (lambda p: torch.optim.SGD(p, lr=0.1)) if dense == "sgd" else (lambda p: torch.optim.Adam(p, lr=0.01))
    model = torch.nn.ModuleDict({"emb": module, "head": head})
    opt, ref_opt = make(model.parameters()), make(ref_head.parameters())
    assert [p for p in model.parameters()] == [head.weight, head.bias]  # the embedding registers none
    rng = np.random.default_rng(1)
    for step in range(1, 5):
        s, w = _batch(rng)
        y = torch.from_numpy(rng.normal(size=(6, 1)).astype(np.float32))

        acts = module(*_embedcore_inputs(s, w))
        loss = torch.nn.functional.mse_loss(head(_flat(acts, 6)), y)
        opt.zero_grad()
        loss.backward()  # the tables are updated here
        opt.step()

        ref_acts = reference.forward(s, w)
        ref_loss = torch.nn.functional.mse_loss(ref_head(_flat(ref_acts, 6)), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        reference.update()

        for name in acts:
            assert acts[name].dtype == torch.float32 and acts[name].shape == ref_acts[name].shape
            np.testing.assert_allclose(acts[name].detach().numpy(), ref_acts[name].detach().numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{name} at step {step}")
        assert module.embedding.step == step
        for name in VOCAB:
            np.testing.assert_allclose(module.embedding_tables[name], reference.tables[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"table {name} at step {step}")
            if kind == "adagrad":
                np.testing.assert_allclose(module.slot_variables[name]["accumulators"], reference.acc[name],
                                           rtol=1e-5, atol=1e-6)
        for p, q in zip(head.parameters(), ref_head.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_module_equals_the_engine_driven_directly_and_the_oracle():
    """Same activation gradients into a plain Embedding: identical tables; both follow tests/reference.py."""
    module = EmbeddingModule(_config(), ec.Adagrad(0.2, initial_accumulator_value=0.3), seed=2)
    plain = ec.Embedding(_config(), ec.Adagrad(0.2, initial_accumulator_value=0.3), seed=2)
    oracle = {n: (t.astype(np.float64), [np.full((VOCAB[n], DIM), 0.3)]) for n, t in plain.embedding_tables.items()}
    seq = {"watched": 0, "liked": 0, "user": 0, "history": SEQ}
    table_of = {"watched": "items", "liked": "items", "user": "users", "history": "pages"}
    rng = np.random.default_rng(7)
    for _ in range(3):
        s, w = _batch(rng, 5)
        weights = {"watched": w, "liked": None, "user": None, "history": None}
        acts = module(s, weights)
        plain_acts, ctx = plain(s, weights)
        grads = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in plain_acts.items()}
        dense = {n: np.zeros((VOCAB[n], DIM)) for n in VOCAB}
        touched = {n: np.zeros(VOCAB[n], bool) for n in VOCAB}
        for name, a in acts.items():
            t = table_of[name]
            unit = w if name == "watched" else [[1.0] * len(x) for x in s[name]]
            expected = ref.lookup(oracle[t][0], s[name], unit, plain.tables[t].combiner, seq[name])
            np.testing.assert_allclose(a.detach().numpy(), expected, rtol=1e-5, atol=1e-6)
            ref.dense_gradient(VOCAB[t], DIM, s[name], unit, plain.tables[t].combiner, seq[name],
                               grads[name].astype(np.float64), dense[t])
            ref.touched_rows(VOCAB[t], s[name], seq[name], touched[t])
        torch.autograd.backward([acts[n] for n in sorted(acts)], [torch.from_numpy(grads[n]) for n in sorted(acts)])
        plain.apply_gradients(grads, ctx)
        for n in VOCAB:
            oracle[n] = ref.apply(ref.adagrad, dense[n], oracle[n][0], oracle[n][1], touched[n], 0.2, {}, plain.step)
            np.testing.assert_array_equal(module.embedding_tables[n], plain.embedding_tables[n])
            np.testing.assert_allclose(module.embedding_tables[n], oracle[n][0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(module.slot_variables[n]["accumulators"], oracle[n][1][0], rtol=1e-5)


def _small(optimizer=None):
    t = ec.TableConfig(10, DIM, combiner="sum", name="t")
    u = ec.TableConfig(8, DIM, combiner="mean", name="u")
    return EmbeddingModule({"a": ec.FeatureConfig(t), "b": ec.FeatureConfig(u)}, optimizer or ec.SGD(0.5))


def _tables(module):
    return {n: t.copy() for n, t in module.embedding_tables.items()}


def test_unused_output_is_a_zero_gradient():
    module = _small()
    before = _tables(module)
    acts = module({"a": np.array([[1, 2], [2, 3]]), "b": np.array([4, 5])})
    acts["a"].sum().backward()  # "b" does not reach the loss
    assert module.embedding.step == 1
    np.testing.assert_array_equal(module.embedding_tables["u"], before["u"])
    expected = before["t"].copy()
    expected[[1, 3]] -= 0.5
    expected[2] -= 1.0
    np.testing.assert_allclose(module.embedding_tables["t"], expected, rtol=1e-6)


def test_no_grad_eval_and_frozen_do_not_update():
    module = _small()
    head = torch.nn.Linear(DIM, 1)
    before = _tables(module)
    features = {"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])}
    with torch.no_grad():
        acts = module(features)
    assert not acts["a"].requires_grad
    module.eval()
    acts = module(features)
    assert not acts["a"].requires_grad and not module.updates_enabled
    head(acts["a"]).sum().backward()  # the dense model still trains
    assert head.weight.grad is not None
    module.train()
    module.requires_grad_(False)
    acts = module(features)
    assert not acts["a"].requires_grad
    with torch.inference_mode():
        module.requires_grad_(True)
        assert not module(features)["a"].requires_grad
    assert module.updates_enabled
    assert module.embedding.step == 0
    for name in before:
        np.testing.assert_array_equal(module.embedding_tables[name], before[name])


def test_activations_and_gradients_are_zero_copy():
    module = _small()
    engine = module.embedding
    seen = {}
    lookup, apply = engine.lookup, engine.apply_gradients

    def capture_lookup(*args, **kwargs):
        seen["acts"], ctx = lookup(*args, **kwargs)
        return seen["acts"], ctx

    def capture_apply(grads, ctx):
        seen["grads"] = grads
        return apply(grads, ctx)

    engine.lookup, engine.apply_gradients = capture_lookup, capture_apply
    for train in (False, True):
        module.train(train)
        acts = module({"a": np.array([1, 2, 3]), "b": np.array([[1], [2], [3]])})
        for name in acts:
            array = seen["acts"][name]
            assert acts[name].data_ptr() == array.__array_interface__["data"][0]
            assert acts[name].shape == array.shape and acts[name].dtype == torch.float32
    grad_a = torch.randn(3, DIM)
    torch.autograd.backward([acts["a"], acts["b"]], [grad_a, torch.randn(3, DIM).double()])
    assert seen["grads"]["a"].__array_interface__["data"][0] == grad_a.data_ptr()  # float32 contiguous: shared
    assert seen["grads"]["b"].dtype == np.float32  # float64: converted (a copy)


def test_backward_twice_raises_and_applies_once():
    module = _small()
    acts = module({"a": np.array([1, 2]), "b": np.array([3, 4])})
    loss = (acts["a"] * acts["b"]).sum()
    loss.backward(retain_graph=True)
    after_one = _tables(module)
    with pytest.raises(RuntimeError, match="already applied"):
        loss.backward()
    assert module.embedding.step == 1
    for name in after_one:
        np.testing.assert_array_equal(module.embedding_tables[name], after_one[name])


def test_bad_inputs_raise_input_error_and_change_nothing():
    module = _small()
    before = _tables(module)
    good_b = torch.tensor([1, 2])
    with pytest.raises(ec.InputError, match="outside the table's vocabulary"):
        module({"a": torch.tensor([1, 10]), "b": good_b})
    with pytest.raises(ec.InputError, match="must be integers"):
        module({"a": torch.tensor([1.0, 2.0]), "b": good_b})
    with pytest.raises(ec.InputError, match="on the CPU"):
        module({"a": torch.zeros(2, dtype=torch.long, device="meta"), "b": good_b})
    with pytest.raises(ec.InputError, match="keys"):
        module({"a": torch.tensor([1, 2])})
    with pytest.raises(ec.InputError, match="weights of feature 'a'"):
        module({"a": torch.tensor([[1, 2]]), "b": torch.tensor([1])},
               {"a": torch.tensor([[1.0, float("nan")]]), "b": None})
    acts = module({"a": torch.tensor([1, 2]), "b": good_b})
    with pytest.raises(ec.InputError, match="NaN/Inf"):
        (acts["a"].sum() * float("nan")).backward()
    assert module.embedding.step == 0
    for name in before:
        np.testing.assert_array_equal(module.embedding_tables[name], before[name])


def test_torch_tensor_inputs_match_numpy_inputs():
    module = _small()
    module.eval()
    ids = np.array([[1, 2, 2], [0, 9, 3]], np.int32)
    w = np.array([[0.5, 1.0, 2.0], [1.0, 1.0, 0.0]], np.float32)
    expected = module.embedding.lookup({"a": ids, "b": ids[:, :1]}, {"a": w, "b": None})[0]
    forms = [({"a": torch.from_numpy(ids), "b": torch.from_numpy(ids[:, :1])}, {"a": torch.from_numpy(w), "b": None}),
             ({"a": ec.Ragged(torch.from_numpy(ids.reshape(-1)), torch.tensor([0, 3, 6])), "b": list(ids[:, :1])},
              {"a": ec.Ragged(torch.from_numpy(w.reshape(-1)), torch.tensor([0, 3, 6])), "b": None}),
             ({"a": [torch.tensor(r) for r in ids], "b": torch.from_numpy(ids[:, 0]).long()},
              {"a": [torch.tensor(r).double().requires_grad_() for r in w], "b": None})]
    for features, weights in forms:
        acts = module(features, weights)
        for name in acts:
            np.testing.assert_allclose(acts[name].numpy(), expected[name], rtol=1e-6)


def test_nested_structures_and_constructors():
    t = ec.TableConfig(6, 2, combiner="sum", name="t")
    engine = ec.Embedding([ec.FeatureConfig(t), (ec.FeatureConfig(t), {"x": ec.FeatureConfig(t)})], ec.SGD(0.1))
    module = EmbeddingModule(engine)
    assert module.embedding is engine and module.embedding_tables["t"] is not None
    acts = module([np.array([1]), (np.array([2]), {"x": np.array([3])})])
    assert isinstance(acts, list) and isinstance(acts[1], tuple) and isinstance(acts[1][1]["x"], torch.Tensor)
    (acts[0] + 2 * acts[1][1]["x"]).sum().backward()
    assert engine.step == 1
    with pytest.raises(ValueError, match="only for building"):
        EmbeddingModule(engine, ec.SGD(0.1))
    built = EmbeddingModule({"f": ec.FeatureConfig(ec.TableConfig(5, 2, name="t2"))}, ec.SGD(0.1), seed=3)
    assert built.embedding.seed == 3 and list(built.parameters()) == [] and "t2" in repr(built)
    for dtype in ("bfloat16", "float16"):  # the module's activations are float32 tensors
        with pytest.raises(ValueError, match=f"{dtype} activations"):
            EmbeddingModule(ec.Embedding({"f": ec.FeatureConfig(t)}, ec.SGD(0.1), output_dtype=dtype))
        with pytest.raises(ValueError, match=f"{dtype} activations"):
            EmbeddingModule({"f": ec.FeatureConfig(t)}, ec.SGD(0.1), output_dtype=dtype)


def test_missing_torch_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    monkeypatch.delitem(sys.modules, "embedcore.torch")
    with pytest.raises(ImportError, match=r"pip install embedcore\[torch\]"):
        importlib.import_module("embedcore.torch")
