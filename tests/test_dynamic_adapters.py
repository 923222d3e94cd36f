"""Dynamic tables through the framework adapters (PyTorch, JAX, TensorFlow engines and Keras layer): each adapter
trains the same feature config on the same 64-bit keys (negative, beyond 2**63, repeated) as the NumPy API does,
with admission and eviction active, and must give bit-identical activations at every step and identical tables
(keys held, rows, slots) after; state paths that cannot hold a dynamic table refuse, naming it.

The oracle is :class:`embedcore.Embedding` itself, driven directly with NumPy (its dynamic tables are checked
against a plain dict model in ``tests/test_dynamic_tables.py``): the adapters must add nothing and lose nothing.
"""

import numpy as np
import pytest

import embedcore as ec
from embedcore.tables.dynamic import DynamicTableView

DIM = 4
STEPS = 5
SEED = 0  # the engines' default seed: every front builds its engine with it
POOL = np.array([0, -1, 1, 2 ** 63 - 1, -2 ** 63, 7, -7, 2 ** 62 + 7, 12345678901, -3, 99, 2 ** 40 + 1, 5, -2 ** 50],
                np.int64)
ADAGRAD = ec.Adagrad(0.2, initial_accumulator_value=0.1)
SGD = ec.SGD(0.3)


def make_features():
    """user: dynamic, Adagrad, sum, admission at 2 sightings, LRU over 6 rows; item: dynamic, SGD, mean, LFU
    over 5 rows, admitted at once; country: a static table beside them."""
    user = ec.DynamicTableConfig(DIM, 6, name="user", optimizer=ADAGRAD, combiner="sum",
                                 initializer=ec.RandomUniform(-1, 1), admission=ec.CountAdmission(min_count=2),
                                 eviction=ec.LRU())
    item = ec.DynamicTableConfig(DIM, 5, name="item", optimizer=SGD, combiner="mean",
                                 initializer=ec.RandomUniform(-1, 1), eviction=ec.LFU())
    country = ec.TableConfig(4, DIM, name="country", optimizer=SGD, combiner="sum", initializer=ec.RandomUniform(-1, 1))
    return {"user": ec.FeatureConfig(user), "item": ec.FeatureConfig(item), "country": ec.FeatureConfig(country)}


def batches(seed=0, batch_size=3):
    """Per step: ``{feature: (values int64, row_splits int64)}`` and the activation gradients. At most 5
    distinct keys a batch per dynamic table (their capacities leave room to evict); empty samples included."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = {}
        for name, max_len in (("user", 2), ("item", 1)):
            chosen = rng.choice(POOL[:9] if name == "user" else POOL, 5, replace=False)
            lengths = rng.integers(0, max_len + 1, batch_size)
            lengths[0] = max_len
            values = rng.choice(chosen, int(lengths.sum()))
            ids[name] = (values.astype(np.int64), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        lengths = np.ones(batch_size, np.int64)
        ids["country"] = (rng.integers(0, 4, batch_size).astype(np.int64), np.arange(batch_size + 1, dtype=np.int64))
        grads = {name: rng.standard_normal((batch_size, DIM)).astype(np.float32) for name in ids}
        out.append((ids, grads))
    return out


def numpy_run():
    """The oracle: activations of every step, and the engine after the last."""
    emb = ec.Embedding(make_features(), seed=SEED)
    acts_per_step = []
    for ids, grads in batches():
        acts, ctx = emb.lookup({k: ec.Ragged(v, s) for k, (v, s) in ids.items()})
        acts_per_step.append({k: np.array(a) for k, a in acts.items()})
        emb.apply_gradients(grads, ctx)
    return acts_per_step, emb


@pytest.fixture(scope="module")
def oracle():
    return numpy_run()


def assert_same_tables(emb, reference):
    """Same keys held, rows and slots bit-identical, static tables too, same step."""
    assert emb.step == reference.step
    for name, table in reference.tables.items():
        got, want = emb.embedding_tables[name], reference.embedding_tables[name]
        if isinstance(table, ec.DynamicTableConfig):
            np.testing.assert_array_equal(got.keys(), want.keys(), err_msg=f"keys of {name}")
            assert len(want) > 0
            np.testing.assert_array_equal(got[want.keys()], want[want.keys()], err_msg=f"rows of {name}")
            for slot, view in reference.slot_variables[name].items():
                np.testing.assert_array_equal(emb.slot_variables[name][slot][view.keys()], view[view.keys()])
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"table {name}")


def test_the_oracle_admits_and_evicts(oracle):
    """The data exercises what the adapters must carry: admission leaves keys out, eviction bounds the tables."""
    _, emb = oracle
    seen_user = {int(k) for ids, _ in batches() for k in ids["user"][0]}
    seen_item = {int(k) for ids, _ in batches() for k in ids["item"][0]}
    user, item = emb.embedding_tables["user"], emb.embedding_tables["item"]
    assert len(user) <= 6 and len(item) <= 5
    assert len(seen_item) > 5  # more items than rows: LFU evicted some
    assert set(user.keys().tolist()) < seen_user
    assert any(k < 0 for k in item.keys().tolist() + user.keys().tolist())


# -- PyTorch -------------------------------------------------------------------------------------------------

class _Jagged:
    """A minimal torchrec ``KeyedJaggedTensor`` (duck-typed, as the adapter reads one): key-major lengths."""

    def __init__(self, keys, values, lengths):
        self._keys, self._values, self._lengths = keys, values, lengths

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return None


def test_torch_module_trains_dynamic_tables_as_numpy_does(oracle):
    torch = pytest.importorskip("torch")
    from embedcore.torch import EmbeddingModule
    want_acts, reference = oracle
    module = EmbeddingModule(make_features(), seed=SEED)
    for step, (ids, grads) in enumerate(batches()):
        if step % 2:  # a KeyedJaggedTensor
            keys = list(ids)
            kjt = _Jagged(keys, torch.from_numpy(np.concatenate([ids[k][0] for k in keys])),
                          torch.from_numpy(np.concatenate([np.diff(ids[k][1]) for k in keys])))
            acts = module(kjt)
        else:  # (values, bag starts) per feature, as nn.EmbeddingBag reads them
            acts = module({k: (torch.from_numpy(v), torch.from_numpy(s[:-1])) for k, (v, s) in ids.items()})
        for name, want in want_acts[step].items():
            np.testing.assert_array_equal(acts[name].detach().numpy(), want, err_msg=f"step {step} {name}")
        loss = sum((acts[k] * torch.from_numpy(g)).sum() for k, g in grads.items())
        loss.backward()
    assert_same_tables(module.embedding, reference)


def test_torch_compile_trains_dynamic_tables_as_numpy_does(oracle):
    """Under ``torch.compile(fullgraph=True)`` the lookup and update are embedcore's custom ops: same results."""
    torch = pytest.importorskip("torch")
    from embedcore.torch import EmbeddingModule
    want_acts, reference = oracle
    module = EmbeddingModule(make_features(), seed=SEED)

    def forward(features, grads):
        acts = module(features)
        return acts, sum((acts[k] * grads[k]).sum() for k in grads)

    compiled = torch.compile(forward, fullgraph=True)
    for step, (ids, grads) in enumerate(batches()):
        acts, loss = compiled({k: (torch.from_numpy(v), torch.from_numpy(s[:-1])) for k, (v, s) in ids.items()},
                              {k: torch.from_numpy(g) for k, g in grads.items()})
        for name, want in want_acts[step].items():
            np.testing.assert_array_equal(acts[name].detach().numpy(), want, err_msg=f"step {step} {name}")
        loss.backward()
    assert_same_tables(module.embedding, reference)


def test_torch_state_dict_refuses_dynamic_tables_naming_them_and_the_way_out():
    torch = pytest.importorskip("torch")
    from embedcore.torch import EmbeddingModule
    module = EmbeddingModule(make_features(), seed=SEED)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.add_module("emb", module)
    with pytest.raises(RuntimeError, match=r"tables \['item', 'user'\] are dynamic.*module\.save\(path\)"):
        model.state_dict()
    static = EmbeddingModule({"country": make_features()["country"]}, seed=SEED)
    ids = {"user": (torch.tensor([7, 7, -7]), torch.tensor([0, 2]))}
    module(ids | {"item": (torch.tensor([5]), torch.tensor([0, 1])), "country": torch.tensor([1, 2])})
    before = (module.embedding.step, module.embedding_tables["user"].keys())
    with pytest.raises(RuntimeError, match=r"are dynamic.*nothing was changed"):
        module.load_state_dict(static.state_dict(), strict=False)
    assert module.embedding.step == before[0]
    np.testing.assert_array_equal(module.embedding_tables["user"].keys(), before[1])


def test_torch_uint64_and_int64_views_of_a_key_are_one_key():
    torch = pytest.importorskip("torch")
    from embedcore.torch import EmbeddingModule
    table = ec.DynamicTableConfig(DIM, 4, name="t", optimizer=SGD, combiner="sum", initializer=ec.RandomUniform(-1, 1))
    module = EmbeddingModule({"f": ec.FeatureConfig(table)}, seed=SEED)
    signed = module({"f": torch.tensor([-5, 2 ** 63 - 1], dtype=torch.int64)})["f"]
    unsigned = module({"f": np.array([2 ** 64 - 5, 2 ** 63 - 1], np.uint64)})["f"]
    np.testing.assert_array_equal(signed.detach().numpy(), unsigned.detach().numpy())
    np.testing.assert_array_equal(module.embedding_tables["t"].keys(), [-5, 2 ** 63 - 1])


def test_torch_process_group_shards_dynamic_tables_as_one_process_trains_them(tmp_path, oracle):
    """A gloo group of one rank: the module's ShardedEmbedding over the torch transport, its dynamic tables placed
    by key owner, gives the one-process engine's activations at every step and its tables after."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from embedcore.distributed import ShardedEmbedding
    from embedcore.torch import EmbeddingModule
    want_acts, reference = oracle
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = EmbeddingModule(make_features(), process_group=dist.group.WORLD, seed=SEED)
        assert isinstance(module.embedding, ShardedEmbedding)
        for step, (ids, grads) in enumerate(batches()):
            acts = module({k: (torch.from_numpy(v), torch.from_numpy(s[:-1])) for k, (v, s) in ids.items()})
            for name, want in want_acts[step].items():
                np.testing.assert_array_equal(acts[name].detach().numpy(), want, err_msg=f"step {step} {name}")
            sum((acts[k] * torch.from_numpy(g)).sum() for k, g in grads.items()).backward()
        assert_same_tables(module.embedding, reference)
    finally:
        dist.destroy_process_group()


# -- JAX -----------------------------------------------------------------------------------------------------

def test_jax_adapter_trains_dynamic_tables_as_numpy_does(oracle):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    from embedcore import jax as ecj
    want_acts, reference = oracle
    emb = ec.Embedding(make_features(), seed=SEED)
    for step, (ids, grads) in enumerate(batches()):
        if step % 2:  # uint64 NumPy keys: the same bits as the int64 ones
            features = {k: ec.Ragged(v.view(np.uint64), s) for k, (v, s) in ids.items()}
        else:
            features = {k: ec.Ragged(v, s) for k, (v, s) in ids.items()}
        acts, ctx = ecj.lookup(emb, features)
        for name, want in want_acts[step].items():
            assert isinstance(acts[name], jax.Array)
            np.testing.assert_array_equal(np.asarray(acts[name]), want, err_msg=f"step {step} {name}")
        d_acts = jax.grad(lambda a: sum(jnp.sum(a[k] * grads[k]) for k in grads))(acts)
        ecj.apply_gradients(emb, d_acts, ctx)
    assert_same_tables(emb, reference)


def test_jax_int64_key_arrays_need_x64_and_then_are_the_keys():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from embedcore import jax as ecj
    table = ec.DynamicTableConfig(DIM, 4, name="t", optimizer=SGD, combiner="sum", initializer=ec.RandomUniform(-1, 1))
    keys = np.array([2 ** 62 + 7, -3], np.int64)
    with jax.enable_x64(True):
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, seed=SEED)
        acts, _ = ecj.lookup(emb, {"f": jnp.asarray(keys)})
    np.testing.assert_array_equal(np.asarray(acts["f"]), emb.embedding_tables["t"][keys])
    np.testing.assert_array_equal(emb.embedding_tables["t"].keys(), np.sort(keys))


# -- TensorFlow ----------------------------------------------------------------------------------------------

def _tf_ragged(tf, values, splits):
    return tf.RaggedTensor.from_row_splits(tf.constant(values, tf.int64), tf.constant(splits, tf.int64))


def test_tf_engine_trains_dynamic_tables_as_numpy_does(oracle, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from embedcore.tensorflow import TPUEmbeddingV2
    want_acts, reference = oracle
    engine = TPUEmbeddingV2(make_features())

    @tf.function
    def graph_step(features, grads):
        acts, preserved = engine.embedding_lookup(features)
        engine.apply_gradients(grads, preserved)
        return acts

    for step, (ids, grads) in enumerate(batches()):
        features = {k: _tf_ragged(tf, v, s) for k, (v, s) in ids.items()}
        tf_grads = {k: tf.constant(g) for k, g in grads.items()}
        if step % 2:
            acts = graph_step(features, tf_grads)
        else:
            acts, preserved = engine.embedding_lookup(features)
            engine.apply_gradients(tf_grads, preserved)
        for name, want in want_acts[step].items():
            np.testing.assert_array_equal(acts[name].numpy(), want, err_msg=f"step {step} {name}")
    assert_same_tables(engine.engine, reference)
    tables = engine.embedding_tables
    assert isinstance(tables["user"], DynamicTableView)
    np.testing.assert_array_equal(tables["user"].keys(), reference.embedding_tables["user"].keys())
    assert isinstance(engine.variables["user"]["accumulators"], DynamicTableView)
    with pytest.raises(ec.CheckpointError, match=r"tables \['item', 'user'\] are dynamic.*engine\.save\(path\)"):
        tf.train.Checkpoint(embedding=engine).write(str(tmp_path / "ckpt"))


def test_keras_layer_trains_dynamic_tables_as_numpy_does(oracle, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from embedcore.tensorflow.keras import EmbeddingLayer
    want_acts, reference = oracle
    layer = EmbeddingLayer(make_features(), seed=SEED)
    for step, (ids, grads) in enumerate(batches()):
        features = {k: _tf_ragged(tf, v, s) for k, (v, s) in ids.items()}
        with tf.GradientTape() as tape:
            acts = layer(features, training=True)
            loss = tf.add_n([tf.reduce_sum(acts[k] * grads[k]) for k in grads])
        tape.gradient(loss, layer.trainable_variables)
        for name, want in want_acts[step].items():
            np.testing.assert_array_equal(acts[name].numpy(), want, err_msg=f"step {step} {name}")
    assert_same_tables(layer.embedding, reference)
    assert isinstance(layer.get_embedding_tables()["user"], DynamicTableView)
    with pytest.raises(ValueError, match=r"tables \['item', 'user'\] are dynamic.*layer\.embedding\.save\(path\)"):
        layer.save_own_variables({})
    with pytest.raises(ValueError, match="are dynamic"):
        tf.train.Checkpoint(layer=layer).write(str(tmp_path / "ckpt"))


def test_tf_serving_lookup_keeps_negative_keys_of_dynamic_tables():
    """TensorFlow's serving lookup drops sparse ids < 0 (``safe_embedding_lookup_sparse``); a dynamic table's
    negative ids are keys and are looked up."""
    tf = pytest.importorskip("tensorflow")
    from embedcore.tensorflow import TPUEmbeddingForServing
    table = ec.DynamicTableConfig(DIM, 8, name="t", optimizer=SGD, combiner="sum", initializer=ec.RandomUniform(-1, 1))
    serving = TPUEmbeddingForServing({"f": ec.FeatureConfig(table)}, SGD)
    keys = np.array([-7, 2 ** 63 - 1, -2 ** 63, 5], np.int64)
    ids = tf.SparseTensor(indices=[[0, 0], [0, 1], [1, 0], [2, 0]], values=tf.constant(keys), dense_shape=[3, 2])
    acts = serving({"f": ids})["f"].numpy()
    rows = serving.engine.embedding_tables["t"][keys]
    np.testing.assert_array_equal(acts, np.stack([rows[0] + rows[1], rows[2], rows[3]]))


# -- evaluation paths: read-only lookups -----------------------------------------------------------------------

def eval_batch():
    """Keys held after the training batches, keys never seen, unadmitted ones (user's admission at 2)."""
    ids, _ = batches(seed=7)[0]
    ids["user"] = (np.concatenate([ids["user"][0], [123456789]]).astype(np.int64), ids["user"][1].copy())
    ids["user"][1][-1] += 1
    return ids


def assert_reads_without_change(engine, read):
    """``read()`` (a front's evaluation path over :func:`eval_batch`) changes no table of ``engine`` and gives
    the engine's own read-only lookup's activations."""
    from .test_dynamic_eval_lookups import assert_same_state, whole_state
    before = whole_state(engine)
    got = read()
    assert_same_state(before, whole_state(engine))
    want, _ = engine.lookup({k: ec.Ragged(v, s) for k, (v, s) in eval_batch().items()}, training=False)
    for name, a in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), a, err_msg=name)
    absent = [k for k in eval_batch()["user"][0] if k not in engine.embedding_tables["user"]]
    assert absent  # the batch reads keys the table does not hold: a training lookup would count or admit them


def train_numpy(emb):
    for ids, grads in batches():
        acts, ctx = emb.lookup({k: ec.Ragged(v, s) for k, (v, s) in ids.items()})
        emb.apply_gradients(grads, ctx)


def test_torch_eval_mode_reads_without_changing_dynamic_tables():
    torch = pytest.importorskip("torch")
    from embedcore.torch import EmbeddingModule
    module = EmbeddingModule(make_features(), seed=SEED)
    train_numpy(module.embedding)
    module.eval()
    torch_ids = {k: (torch.from_numpy(v), torch.from_numpy(s[:-1])) for k, (v, s) in eval_batch().items()}
    assert_reads_without_change(module.embedding, lambda: {k: t.detach().numpy() for k, t in
                                                          module(torch_ids).items()})
    module.train()
    with torch.no_grad():  # train mode under no_grad: a training lookup (documented), which admits keys
        module(torch_ids)
    assert len(module.embedding_tables["item"]) > 0


def test_jax_lookup_with_training_false_reads_without_changing_dynamic_tables():
    pytest.importorskip("jax")
    from embedcore import jax as ecj
    emb = ec.Embedding(make_features(), seed=SEED)
    train_numpy(emb)
    ids = {k: ec.Ragged(v, s) for k, (v, s) in eval_batch().items()}
    assert_reads_without_change(emb, lambda: ecj.lookup(emb, ids, training=False)[0])


def test_tf_enqueue_training_false_keras_training_false_and_serving_read_without_changing_dynamic_tables():
    tf = pytest.importorskip("tensorflow")
    from embedcore.tensorflow import TPUEmbedding, TPUEmbeddingForServing
    from embedcore.tensorflow.keras import EmbeddingLayer
    features = {k: _tf_ragged(tf, v, s) for k, (v, s) in eval_batch().items()}

    def dequeued(engine):
        engine.enqueue(features, training=False)
        return {k: a.numpy() for k, a in engine.dequeue().items()}

    mid = TPUEmbedding(make_features(), ADAGRAD)
    mid.build()
    train_numpy(mid.engine)
    assert_reads_without_change(mid.engine, lambda: dequeued(mid))
    with pytest.raises(RuntimeError, match="training=False"):
        mid.apply_gradients({k: tf.ones_like(v) for k, v in features.items()})
    layer = EmbeddingLayer(make_features(), seed=SEED)
    train_numpy(layer.embedding)
    assert_reads_without_change(layer.embedding, lambda: {k: a.numpy() for k, a in
                                                         layer(features, training=False).items()})
    serving = TPUEmbeddingForServing(make_features(), ADAGRAD)
    serving.build()
    train_numpy(serving.engine)
    assert_reads_without_change(serving.engine, lambda: {k: a.numpy() for k, a in serving(features).items()})
