"""EmbeddingModule's state: state_dict / load_state_dict, torch.save, pickle, copy.deepcopy, DCP (issue 29, item 1)."""

import copy
import inspect
import io
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]' (.ci/run installs it)")

import embedcore as ec  # noqa: E402
from embedcore.torch import EmbeddingModule  # noqa: E402

DIM, SEQ = 4, 3


def module_level_sgd(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """A custom row function with an import path (picklable by reference)."""
    return embedding_table - learning_rate * gradient


def _features():
    items = ec.TableConfig(13, DIM, combiner="sum", name="items")
    users = ec.TableConfig(9, DIM, combiner="mean", name="users", optimizer=ec.Adam(0.05))
    pages = ec.TableConfig(7, DIM, combiner="sum", name="pages")
    return {"watched": ec.FeatureConfig(items), "user": ec.FeatureConfig(users),
            "history": ec.FeatureConfig(pages, max_sequence_length=SEQ)}


def _module(seed=5, **kwargs):
    return EmbeddingModule(_features(), ec.Adagrad(0.3, initial_accumulator_value=0.1), seed=seed, **kwargs)


class Model(torch.nn.Module):
    """A dense head over the embeddings, the module nested one level down (keys "tower.emb.*")."""

    def __init__(self, seed=5):
        super().__init__()
        torch.manual_seed(seed)
        self.tower = torch.nn.ModuleDict({"emb": _module(seed)})
        self.head = torch.nn.Linear(DIM + DIM + SEQ * DIM, 1)

    @property
    def emb(self):
        return self.tower["emb"]

    def forward(self, features):
        acts = self.emb(features)
        return self.head(torch.cat([acts["watched"], acts["user"], acts["history"].reshape(-1, SEQ * DIM)], 1))


def _batch(rng, batch_size=6):
    def samples(vocab, longest):
        return [[int(i) for i in rng.integers(0, vocab, rng.integers(0, longest + 1))] for _ in range(batch_size)]
    return ({"watched": samples(13, 4), "user": samples(9, 3), "history": samples(7, 5)},
            torch.from_numpy(rng.normal(size=(batch_size, 1)).astype(np.float32)))


def _train(model, opt, rng, steps):
    losses = []
    for _ in range(steps):
        features, y = _batch(rng)
        loss = torch.nn.functional.mse_loss(model(features), y)
        opt.zero_grad()
        loss.backward()  # the tables are updated here
        opt.step()
        losses.append(loss.item())
    return losses


def _snapshot(module):
    return ({n: t.copy() for n, t in module.embedding_tables.items()},
            {n: {s: v.copy() for s, v in slots.items()} for n, slots in module.slot_variables.items()},
            module.embedding.step)


def _assert_state(module, state):
    tables, slots, step = state
    assert module.embedding.step == step
    for name, table in tables.items():
        np.testing.assert_array_equal(module.embedding_tables[name], table)
        for slot, values in slots[name].items():
            np.testing.assert_array_equal(module.slot_variables[name][slot], values)


def _address(x):
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]


def _trained(seed=5, steps=3):
    model = Model(seed)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), np.random.default_rng(seed), steps)
    return model


def test_state_dict_holds_tables_slots_and_step_sharing_memory():
    model = _trained()
    sd = model.state_dict()
    expected = ["tower.emb.tables.pages.weights", "tower.emb.tables.pages.slot.accumulators",
                "tower.emb.tables.users.weights", "tower.emb.tables.users.slot.momenta",
                "tower.emb.tables.users.slot.velocities", "tower.emb.tables.items.weights",
                "tower.emb.tables.items.slot.accumulators", "tower.emb.step", "head.weight", "head.bias"]
    slot_names = {n: list(s) for n, s in model.emb.slot_variables.items()}
    assert slot_names == {"items": ["accumulators"], "users": ["momenta", "velocities"], "pages": ["accumulators"]}
    assert list(model.emb.embedding.tables) == ["pages", "users", "items"]  # the features' (sorted) order
    assert list(sd) == expected
    step = sd["tower.emb.step"]
    assert step.dtype == torch.int64 and step.shape == () and int(step) == 3
    for name, table in model.emb.embedding_tables.items():
        weights = sd[f"tower.emb.tables.{name}.weights"]
        assert weights.dtype == torch.float32 and tuple(weights.shape) == table.shape
        assert _address(weights) == _address(table)  # zero-copy: the engine's own rows
        np.testing.assert_array_equal(weights.numpy(), table)
        for slot, values in model.emb.slot_variables[name].items():
            assert _address(sd[f"tower.emb.tables.{name}.slot.{slot}"]) == _address(values)
    assert list(model.emb.state_dict()) == [k[len("tower.emb."):] for k in expected[:8]]  # the module alone
    assert list(model.emb.parameters()) == []  # still no parameters


def test_load_state_dict_round_trip_into_a_fresh_model():
    model = _trained()
    fresh = Model(seed=11)  # other initial tables and head
    state = _snapshot(model.emb)
    assert not np.array_equal(fresh.emb.embedding_tables["items"], state[0]["items"])
    result = fresh.load_state_dict(model.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_state(fresh.emb, state)
    for name in state[0]:  # copied in, not adopted: the two stay independent
        assert _address(fresh.emb.embedding_tables[name]) != _address(model.emb.embedding_tables[name])
    for p, q in zip(fresh.head.parameters(), model.head.parameters()):
        assert torch.equal(p, q)
    # the module alone, and a state dict saved from the module alone
    alone = _module(seed=12)
    alone.load_state_dict(model.emb.state_dict())
    _assert_state(alone, state)


def test_nested_prefixes_and_a_module_inside_a_bigger_model():
    inner = _trained()
    outer = torch.nn.Sequential(torch.nn.Identity(), torch.nn.ModuleDict({"model": _trained(seed=6)}))
    sd = outer.state_dict()
    assert "1.model.tower.emb.tables.items.weights" in sd and "1.model.tower.emb.step" in sd
    inner.load_state_dict({k[len("1.model."):]: v for k, v in sd.items()})
    _assert_state(inner.emb, _snapshot(outer[1]["model"].emb))


def test_strict_refuses_a_state_dict_without_the_tables():
    model = _trained()
    fresh = Model(seed=11)
    before = _snapshot(fresh.emb)
    legacy = {k: v for k, v in model.state_dict().items() if k.startswith("head.")}  # what state_dict held before
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "tower.emb.tables.pages.weights", '
                                           r'"tower.emb.tables.pages.slot.accumulators", "tower.emb.tables.users'):
        fresh.load_state_dict(legacy)
    _assert_state(fresh.emb, before)
    result = fresh.load_state_dict(legacy, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == [k for k in model.state_dict() if k.startswith("tower.emb.")]
    _assert_state(fresh.emb, before)
    # a table of another name: unexpected (and the table it replaces missing)
    renamed = {k.replace("tables.items.", "tables.itemz."): v for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "tower.emb.tables.itemz.weights"'):
        fresh.load_state_dict(renamed)
    result = Model(seed=11).load_state_dict(renamed, strict=False)
    assert result.unexpected_keys == ["tower.emb.tables.itemz.weights", "tower.emb.tables.itemz.slot.accumulators"]
    assert result.missing_keys == ["tower.emb.tables.items.weights", "tower.emb.tables.items.slot.accumulators"]
    # strict=False loads what is there: the other tables and step
    partial = Model(seed=11)
    partial.load_state_dict(renamed, strict=False)
    np.testing.assert_array_equal(partial.emb.embedding_tables["users"], model.emb.embedding_tables["users"])
    assert partial.emb.embedding.step == 3


def _bad(sd, key, value):
    out = {k: (v.clone() + 1 if "tables" in k else v) for k, v in sd.items()}  # every table would change...
    out[key] = value(sd[key].clone())  # ...but this one entry is bad
    return out


def _nan_at(t, i=0):
    t.view(-1)[i] = float("nan")
    return t


@pytest.mark.parametrize("key,value,message", [
    ("tower.emb.tables.items.weights", lambda t: t[:-1], r"shape \(13, 4\)"),
    ("tower.emb.tables.items.weights", lambda t: t.double(), "torch.float32"),
    ("tower.emb.tables.items.weights", lambda t: t.to(torch.int32), "torch.float32"),
    ("tower.emb.tables.users.slot.velocities", lambda t: t.T.contiguous(), r"shape \(9, 4\)"),
    ("tower.emb.tables.pages.weights", lambda t: _nan_at(t, 9),
     r"table 'pages' holds NaN or Inf in 1 row\(s\), e.g. rows \[2\]"),
    ("tower.emb.tables.items.slot.accumulators", lambda t: t.fill_(float("inf")), "NaN or Inf in 13 row"),
    ("tower.emb.tables.items.weights", lambda t: t.numpy(), "the state dict holds ndarray"),
    ("tower.emb.step", lambda t: t.double(), "must be one integer"),
    ("tower.emb.step", lambda t: torch.tensor([1, 2]), "must be one integer"),
    ("tower.emb.step", lambda t: torch.tensor(-1), "step must be an int from 0"),
    ("tower.emb.step", lambda t: torch.tensor(True), "must be one integer"),
])
def test_bad_entries_are_refused_and_change_nothing(key, value, message):
    model = _trained()
    fresh = Model(seed=11)
    before = _snapshot(fresh.emb)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=message):
            fresh.load_state_dict(_bad(model.state_dict(), key, value), strict=strict)
        _assert_state(fresh.emb, before)  # all or nothing: no table took the good entries either


def test_a_forward_made_before_load_state_dict_is_not_applied():
    model = _trained()
    fresh = Model(seed=11)
    features, _ = _batch(np.random.default_rng(0))
    loss = fresh.emb(features)["watched"].sum()
    fresh.load_state_dict(model.state_dict())
    state = _snapshot(fresh.emb)
    with pytest.raises(ec.InputError, match="before this engine's tables were replaced"):
        loss.backward()
    _assert_state(fresh.emb, state)


def _continued_losses(model, opt, seed, steps=4):
    return _train(model, opt, np.random.default_rng(seed), steps)


def test_training_continues_identically_after_a_reload():
    """The loss sequence of a reloaded model (state_dict, torch.save, deepcopy) equals the original's."""
    model = _trained(steps=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, np.random.default_rng(2), 2)  # the dense optimizer has state too
    sd = copy.deepcopy(model.state_dict())  # a snapshot: state_dict() shares the tables' memory
    opt_sd = copy.deepcopy(opt.state_dict())
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    whole = io.BytesIO()
    torch.save(model, whole)
    copied, copied_opt = copy.deepcopy((model, opt))
    expected = _continued_losses(model, opt, seed=9)

    restored = Model(seed=11)
    restored.load_state_dict(sd)
    restored_opt = torch.optim.Adam(restored.parameters(), lr=0.01)
    restored_opt.load_state_dict(copy.deepcopy(opt_sd))  # Adam's load keeps the tensors given, and steps them
    assert _continued_losses(restored, restored_opt, seed=9) == expected

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # tensors only: loads with the safe unpickler
    loaded = Model(seed=12)
    loaded.load_state_dict(saved["model"])
    loaded_opt = torch.optim.Adam(loaded.parameters(), lr=0.01)
    loaded_opt.load_state_dict(saved["opt"])
    assert _continued_losses(loaded, loaded_opt, seed=9) == expected

    whole.seek(0)
    unpickled = torch.load(whole, weights_only=False)
    unpickled_opt = torch.optim.Adam(unpickled.parameters(), lr=0.01)
    unpickled_opt.load_state_dict(copy.deepcopy(opt_sd))
    assert _continued_losses(unpickled, unpickled_opt, seed=9) == expected

    assert copied_opt.param_groups[0]["params"][0] is copied.head.weight
    assert _continued_losses(copied, copied_opt, seed=9) == expected
    _assert_state(copied.emb, _snapshot(model.emb))


def test_torch_save_of_the_whole_model_round_trips():
    model = _trained()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_state(loaded.emb, _snapshot(model.emb))
    engine, original = loaded.emb.embedding, model.emb.embedding
    assert engine.seed == original.seed and engine.optimizer == original.optimizer
    assert engine.tables["users"].optimizer == ec.Adam(0.05)
    assert engine.num_physical_tables == original.num_physical_tables
    assert repr(engine) == repr(original)
    assert loaded.emb.updates_enabled and loaded.emb.include_last_offset is False


def test_deepcopy_is_independent():
    model = _trained()
    copied = copy.deepcopy(model)
    state = _snapshot(model.emb)
    _assert_state(copied.emb, state)
    assert copied.emb.embedding is not model.emb.embedding
    assert copied.emb.embedding.feature_config is not model.emb.embedding.feature_config
    for name, table in model.emb.embedding_tables.items():
        assert _address(copied.emb.embedding_tables[name]) != _address(table)
    _train(copied, torch.optim.SGD(copied.parameters(), lr=0.1), np.random.default_rng(4), 2)  # train the copy
    _assert_state(model.emb, state)  # the original did not move
    assert copied.emb.embedding.step == 5 and model.emb.embedding.step == 3
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), np.random.default_rng(4), 2)  # the same steps
    _assert_state(model.emb, _snapshot(copied.emb))


def test_custom_optimizers_pickle_by_reference_and_lambdas_say_so():
    table = ec.TableConfig(6, DIM, name="t")
    named = EmbeddingModule({"f": ec.FeatureConfig(table)}, ec.CustomOptimizer(module_level_sgd, 0.2), seed=1)
    named({"f": np.array([1, 2])})["f"].sum().backward()
    back = pickle.loads(pickle.dumps(named))
    assert back.embedding.optimizer.custom_computation is module_level_sgd and back.embedding.step == 1
    np.testing.assert_array_equal(back.embedding_tables["t"], named.embedding_tables["t"])

    anonymous = EmbeddingModule({"f": ec.FeatureConfig(ec.TableConfig(6, DIM, name="t"))},
                                ec.CustomOptimizer(lambda g, w, s, lr, h: w - lr * g, 0.2))
    with pytest.raises(pickle.PicklingError, match=r"the engine's optimizer.custom_computation is "
                                                   r"test_custom.*<lambda>, which has no import path"):
        pickle.dumps(anonymous)
    with pytest.raises(pickle.PicklingError, match="<lambda>"):
        torch.save(anonymous, io.BytesIO())
    assert copy.deepcopy(anonymous).embedding.optimizer.custom_computation is \
        anonymous.embedding.optimizer.custom_computation  # deepcopy shares functions, as copy.deepcopy does

    per_table = ec.TableConfig(6, DIM, name="u", optimizer=ec.SGD(lambda: 0.1))
    with pytest.raises(pickle.PicklingError, match=r"table 'u'.optimizer.learning_rate is test_custom.*<lambda>"):
        pickle.dumps(EmbeddingModule({"f": ec.FeatureConfig(per_table)}, ec.SGD(0.1)))


def test_embedding_set_state_checks_everything_first():
    emb = _module().embedding
    before = {n: t.copy() for n, t in emb.embedding_tables.items()}
    good = np.ones((13, DIM), np.float32)
    with pytest.raises(ValueError, match=r"no table 'nope'.*step must be an int") as e:
        emb.set_state({"items": good, "nope": good}, step=-3)
    assert "nothing was changed" in str(e.value)
    for name, table in before.items():
        np.testing.assert_array_equal(emb.embedding_tables[name], table)
    emb.set_state({"items": good}, {"users": {"momenta": np.full((9, DIM), 0.5, np.float32)}}, step=4)
    np.testing.assert_array_equal(emb.embedding_tables["items"], good)
    np.testing.assert_array_equal(emb.embedding_tables["pages"], before["pages"])
    assert emb.step == 4 and float(emb.slot_variables["users"]["momenta"][3, 1]) == 0.5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_checkpoint_in_one_process(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    model = _trained()
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path))
    fresh = Model(seed=11)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))  # in place, into the tensors given
    fresh.load_state_dict(sd)
    _assert_state(fresh.emb, _snapshot(model.emb))


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_16_bit_tables_keep_their_dtype(dtype, torch_dtype):
    if "weights_dtype" not in inspect.signature(ec.TableConfig).parameters:
        pytest.skip("this embedcore has no 16-bit tables")
    table = ec.TableConfig(8, DIM, name="t", combiner="sum", weights_dtype=dtype)
    module = EmbeddingModule({"f": ec.FeatureConfig(table)}, ec.SGD(0.1), seed=3)
    array = module.embedding_tables["t"]
    sd = module.state_dict()
    assert sd["tables.t.weights"].dtype == torch_dtype and _address(sd["tables.t.weights"]) == _address(array)
    np.testing.assert_array_equal(sd["tables.t.weights"].float().numpy(), array.astype(np.float32))
    other = EmbeddingModule({"f": ec.FeatureConfig(ec.TableConfig(8, DIM, name="t", combiner="sum",
                                                                  weights_dtype=dtype))}, ec.SGD(0.1), seed=4)
    with pytest.raises(RuntimeError, match=str(torch_dtype)):
        other.load_state_dict({"tables.t.weights": sd["tables.t.weights"].float(), "step": sd["step"]})
    other.load_state_dict(sd)
    np.testing.assert_array_equal(other.embedding_tables["t"].view(np.uint16), array.view(np.uint16))
    back = pickle.loads(pickle.dumps(module))
    assert back.embedding_tables["t"].dtype == array.dtype
    np.testing.assert_array_equal(back.embedding_tables["t"].view(np.uint16), array.view(np.uint16))
