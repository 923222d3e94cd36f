"""embedcore.tensorflow.keras: ``model.fit`` trains the tables in the layer's gradient, exactly as a plain NumPy
oracle (lookup, dense step, Adagrad on the touched rows) does; evaluate/predict never update; errors name the
feature; ``save_weights``/``load_weights`` carry the tables; and the worked example runs."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow", reason="needs the tensorflow extra: pip install 'embedcore[tensorflow]'")
keras = pytest.importorskip("keras")

import embedcore as ec  # noqa: E402
from embedcore.tensorflow import convert, graph  # noqa: E402
from embedcore.tensorflow.keras import DistributedEmbedding, EmbeddingLayer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIM, N_USERS, N_ITEMS, TAG_SLOTS = 3, 7, 5, 3
EMB_LR, DENSE_LR, ACC0 = 0.3, 0.1, 0.1


def _features():
    users = ec.TableConfig(N_USERS, DIM, name="users", combiner="sum")
    items = ec.TableConfig(N_ITEMS, DIM, name="items", combiner="mean")  # shared by "hist" and "tags"
    return {"user": ec.FeatureConfig(users), "hist": ec.FeatureConfig(items), "tags": ec.FeatureConfig(items)}


def _layer(seed=0, **kwargs):
    return EmbeddingLayer(_features(), ec.Adagrad(EMB_LR, initial_accumulator_value=ACC0), seed=seed, **kwargs)


class TinyRanker(keras.Model):
    """Three features' activations, concatenated, into one Dense unit."""

    def __init__(self, layer):
        super().__init__()
        self.embedding = layer
        self.head = keras.layers.Dense(1)

    def call(self, x, training=False):
        weights = {"user": None, "hist": x["hist_weights"], "tags": None}
        acts = self.embedding(x["ids"], weights, training=training)
        return self.head(tf.concat([acts["user"], acts["hist"], acts["tags"]], axis=1))


def _batches(seed, n_batches, batch_size=4):
    """Plain NumPy batches: one user per sample (dense), a weighted bag of items (ragged; empty bags and
    repeated ids included) and up to TAG_SLOTS tags (sparse; some slots empty), and a regression target."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        users = rng.integers(0, N_USERS, batch_size)
        users[1] = users[0]  # the same row twice in a batch
        lengths = rng.integers(0, 4, batch_size)
        lengths[0] = 0       # an empty bag
        hist = rng.integers(0, N_ITEMS, int(lengths.sum()))
        splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        hist_w = rng.uniform(0.5, 1.5, hist.shape[0]).astype(np.float32)
        present = rng.random((batch_size, TAG_SLOTS)) < 0.6
        present[2] = False   # a sample without tags
        tags = rng.integers(0, N_ITEMS, (batch_size, TAG_SLOTS))
        y = rng.normal(size=(batch_size, 1)).astype(np.float32)
        out.append(dict(users=users, hist=hist, splits=splits, hist_w=hist_w, tag_index=np.argwhere(present),
                        tag_ids=tags[present], y=y))
    return out


def _tf_batch(b):
    n = b["users"].shape[0]
    ids = {"user": tf.constant(b["users"]),
           "hist": tf.RaggedTensor.from_row_splits(b["hist"], b["splits"]),
           "tags": tf.SparseTensor(b["tag_index"].astype(np.int64), b["tag_ids"], (n, TAG_SLOTS))}
    return {"ids": ids, "hist_weights": tf.RaggedTensor.from_row_splits(b["hist_w"], b["splits"])}, b["y"]


def _dataset(batches):
    ragged = tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1, row_splits_dtype=tf.int64)
    spec = ({"ids": {"user": tf.TensorSpec([None], tf.int64), "hist": ragged,
                     "tags": tf.SparseTensorSpec([None, TAG_SLOTS], tf.int64)},
             "hist_weights": tf.RaggedTensorSpec([None, None], tf.float32, ragged_rank=1, row_splits_dtype=tf.int64)},
            tf.TensorSpec([None, 1], tf.float32))
    return tf.data.Dataset.from_generator(lambda: (_tf_batch(b) for b in batches), output_signature=spec)


def _occurrences(b):
    """(table, row, sample, gain, feature) of every id of the batch, the combiners' gains written out."""
    occ = []
    for i, u in enumerate(b["users"]):
        occ.append(("users", int(u), i, 1.0, "user"))                        # sum of one id
    for i in range(b["users"].shape[0]):
        lo, hi = b["splits"][i], b["splits"][i + 1]
        total = float(np.sum(b["hist_w"][lo:hi], dtype=np.float64))
        for j in range(lo, hi):
            occ.append(("items", int(b["hist"][j]), i, float(b["hist_w"][j]) / total, "hist"))  # weighted mean
    samples = b["tag_index"][:, 0]
    for (i, _), t in zip(b["tag_index"], b["tag_ids"]):
        occ.append(("items", int(t), int(i), 1.0 / int(np.sum(samples == i)), "tags"))           # mean
    return occ


def _oracle(tables, kernel, bias, batches):
    """Plain NumPy (float64): per batch, the lookup, the Dense unit's forward, Keras's mean squared error,
    the gradients, SGD on the dense weights and Adagrad on the touched rows of each table."""
    tables = {k: v.astype(np.float64) for k, v in tables.items()}
    accs = {k: np.full_like(v, ACC0) for k, v in tables.items()}
    kernel, bias = kernel.astype(np.float64), bias.astype(np.float64)
    order = {"user": 0, "hist": 1, "tags": 2}
    for b in batches:
        n = b["users"].shape[0]
        occ = _occurrences(b)
        acts = np.zeros((n, 3 * DIM))
        for table, row, i, gain, feature in occ:
            k = order[feature] * DIM
            acts[i, k:k + DIM] += gain * tables[table][row]
        pred = acts @ kernel + bias
        d_pred = 2.0 * (pred - b["y"]) / n
        d_acts = d_pred @ kernel.T
        grads = {k: np.zeros_like(v) for k, v in tables.items()}
        touched = {k: set() for k in tables}
        for table, row, i, gain, feature in occ:
            k = order[feature] * DIM
            grads[table][row] += gain * d_acts[i, k:k + DIM]
            touched[table].add(row)
        for table in tables:
            for row in touched[table]:
                g = grads[table][row]
                accs[table][row] += g * g
                tables[table][row] -= EMB_LR * g / np.sqrt(accs[table][row])
        kernel = kernel - DENSE_LR * (acts.T @ d_pred)
        bias = bias - DENSE_LR * d_pred.sum(axis=0)
    return tables, accs, kernel, bias


def _model(layer, run_eagerly, batches):
    model = TinyRanker(layer)
    model.compile(optimizer=keras.optimizers.SGD(DENSE_LR), loss="mse", run_eagerly=run_eagerly)
    model(_tf_batch(batches[0])[0])  # builds the Dense unit (a lookup only: training=False)
    return model


def _state(layer):
    e = layer.embedding
    return ({k: np.array(v) for k, v in e.embedding_tables.items()},
            {k: {s: np.array(a) for s, a in v.items()} for k, v in e.slot_variables.items()}, e.step)


def _assert_state_equal(a, b):
    (ta, sa, step_a), (tb, sb, step_b) = a, b
    assert step_a == step_b
    for k in ta:
        np.testing.assert_array_equal(ta[k], tb[k])
        for s in sa[k]:
            np.testing.assert_array_equal(sa[k][s], sb[k][s])


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fit_matches_numpy_oracle(run_eagerly, seed):
    batches = _batches(seed, n_batches=3)
    layer = _layer(seed)
    model = _model(layer, run_eagerly, batches)
    assert not model.jit_compile  # "auto" resolves to no XLA: the layer does not support it
    tables0 = layer.get_embedding_tables()
    kernel0, bias0 = (np.array(w) for w in model.head.get_weights())
    assert layer.embedding.step == 0

    model.fit(_dataset(batches), epochs=1, shuffle=False, verbose=0)

    tables, accs, kernel, bias = _oracle(tables0, kernel0, bias0, batches)
    assert layer.embedding.step == len(batches)  # one update per training batch
    for name in tables:
        np.testing.assert_allclose(layer.embedding.embedding_tables[name], tables[name], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(layer.embedding.slot_variables[name]["accumulators"], accs[name],
                                   rtol=2e-5, atol=2e-6)
    got_kernel, got_bias = model.head.get_weights()
    np.testing.assert_allclose(got_kernel, kernel, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got_bias, bias, rtol=2e-5, atol=2e-6)
    assert graph.pending_count(layer.embedding) == 0
    assert layer.trainable_variables == [layer.update_trigger]  # the tables are not Keras variables
    assert model.count_params() == 3 * DIM + 1


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
def test_evaluate_and_predict_do_not_update(run_eagerly):
    batches = _batches(2, n_batches=2)
    layer = _layer()
    model = _model(layer, run_eagerly, batches)
    model.fit(_dataset(batches), verbose=0)
    before = _state(layer)
    dense_before = [np.array(w) for w in model.get_weights()]
    model.evaluate(_dataset(batches), verbose=0)
    predictions = model.predict(_dataset(batches), verbose=0)
    assert predictions.shape == (8, 1)
    _assert_state_equal(_state(layer), before)
    for a, b in zip(model.get_weights(), dense_before):
        np.testing.assert_array_equal(a, b)
    assert graph.pending_count(layer.embedding) == 0


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "rmsprop", "adamw"])
def test_one_update_per_batch_whatever_the_keras_optimizer(optimizer):
    batches = _batches(9, n_batches=3)
    layer = _layer()
    model = TinyRanker(layer)
    model.compile(optimizer=optimizer, loss="mse")  # built by fit itself (symbolically), not by a first call
    model.fit(_dataset(batches), epochs=2, verbose=0)
    assert layer.embedding.step == 6


def test_predictions_are_the_lookup_through_the_dense_unit():
    batches = _batches(3, n_batches=1)
    layer = _layer()
    model = _model(layer, False, batches)
    tables = layer.get_embedding_tables()
    kernel, bias = model.head.get_weights()
    acts = np.zeros((4, 3 * DIM))
    for table, row, i, gain, feature in _occurrences(batches[0]):
        k = {"user": 0, "hist": 1, "tags": 2}[feature] * DIM
        acts[i, k:k + DIM] += gain * tables[table][row]
    np.testing.assert_allclose(model.predict(_dataset(batches), verbose=0), acts @ kernel + bias, rtol=1e-5,
                               atol=1e-6)


def test_frozen_layer_trains_the_dense_model_only():
    batches = _batches(4, n_batches=2)
    layer = _layer()
    model = _model(layer, False, batches)
    layer.trainable = False
    before = _state(layer)
    kernel_before = np.array(model.head.get_weights()[0])
    model.compile(optimizer=keras.optimizers.SGD(DENSE_LR), loss="mse")
    model.fit(_dataset(batches), verbose=0)
    _assert_state_equal(_state(layer), before)
    assert not np.array_equal(model.head.get_weights()[0], kernel_before)


def test_gradient_tape_loops_update_once_per_lookup():
    batches = _batches(5, n_batches=2)
    layer = _layer()
    model = _model(layer, False, batches)
    x, y = _tf_batch(batches[0])

    @tf.function
    def gradient(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    gradient(x, y)
    gradient(x, y)
    assert layer.embedding.step == 2
    with tf.GradientTape(persistent=True) as tape:  # eagerly, every gradient function back from the loss runs
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    tape.gradient(loss, model.head.trainable_variables)
    assert layer.embedding.step == 3
    with pytest.raises(ec.InputError, match="applied already"):  # and one lookup is applied at most once
        tape.gradient(loss, model.trainable_variables)
    assert layer.embedding.step == 3


def test_keras_rs_name_and_table_stacking():
    assert DistributedEmbedding is EmbeddingLayer
    stacked, unstacked = _layer(), _layer(table_stacking=None)
    assert stacked.embedding.num_physical_tables == 1 and unstacked.embedding.num_physical_tables == 2
    with pytest.raises(ValueError, match="table_stacking"):
        _layer(table_stacking="yes")


def test_functional_api_with_dense_ids():
    users = ec.TableConfig(N_USERS, DIM, name="users")
    layer = EmbeddingLayer({"user": ec.FeatureConfig(users)}, ec.SGD(0.5))
    ids = keras.Input(shape=(), dtype="int64", name="user")
    acts = layer({"user": ids})
    assert tuple(acts["user"].shape) == (None, DIM)
    model = keras.Model(ids, keras.layers.Dense(1)(acts["user"]))
    model.compile(optimizer="sgd", loss="mse")
    x = np.arange(12) % N_USERS
    model.fit(x, np.ones((12, 1), np.float32), batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert layer.embedding.step == 6


def test_functional_api_with_sparse_and_ragged_inputs():
    layer = _layer()
    ids = {"user": keras.Input(shape=(), dtype="int64"),
           "hist": keras.Input(shape=(None,), ragged=True, dtype="int64"),
           "tags": keras.Input(shape=(TAG_SLOTS,), sparse=True, dtype="int64")}
    hist_weights = keras.Input(shape=(None,), ragged=True, dtype="float32")
    acts = layer(ids, {"user": None, "hist": hist_weights, "tags": None})
    assert all(tuple(a.shape) == (None, DIM) for a in acts.values())
    head = keras.layers.Dense(1)
    out = head(keras.layers.Concatenate()([acts["user"], acts["hist"], acts["tags"]]))
    model = keras.Model({"ids": ids, "hist_weights": hist_weights}, out)
    model.compile(optimizer="adam", loss="mse")
    batches = _batches(10, n_batches=3)
    model.fit(_dataset(batches), verbose=0)
    assert layer.embedding.step == 3
    tables = layer.get_embedding_tables()
    kernel, bias = head.get_weights()
    expected = np.zeros((4, 3 * DIM))
    for table, row, i, gain, feature in _occurrences(batches[0]):
        k = {"user": 0, "hist": 1, "tags": 2}[feature] * DIM
        expected[i, k:k + DIM] += gain * tables[table][row]
    np.testing.assert_allclose(model.predict(_dataset(batches[:1]), verbose=0), expected @ kernel + bias,
                               rtol=1e-5, atol=1e-6)


# -- errors ------------------------------------------------------------------------------------------------

def test_out_of_range_id_names_the_feature_and_changes_nothing():
    batches = _batches(6, n_batches=1)
    layer = _layer()
    model = _model(layer, False, batches)
    before = _state(layer)
    x, _ = _tf_batch(batches[0])
    bad = dict(x, ids=dict(x["ids"], user=tf.constant([0, 1, N_USERS + 3, 2], tf.int64)))
    with pytest.raises(ec.InputError, match="feature 'user'"):  # eagerly: the engine's own error
        layer(bad["ids"], {"user": None, "hist": bad["hist_weights"], "tags": None}, training=True)
    bad_batch = dict(batches[0], users=np.array([0, 1, N_USERS + 3, 2]))
    with pytest.raises(tf.errors.OpError, match="feature 'user'"):  # in model.fit's tf.function
        model.fit(_dataset([bad_batch]), verbose=0)
    _assert_state_equal(_state(layer), before)


def test_float_ids_and_missing_features_are_refused_while_tracing():
    layer = _layer()
    with pytest.raises((TypeError, ValueError), match="user"):
        layer({"user": tf.constant([0.0, 1.0]), "hist": tf.ragged.constant([[1], []]),
               "tags": tf.ragged.constant([[2], [3]])})
    with pytest.raises((TypeError, ValueError)):
        layer({"user": tf.constant([0, 1])})
    assert layer.embedding.step == 0


def test_constructor_errors():
    with pytest.raises(ValueError, match="either"):
        EmbeddingLayer(_features(), embedding=ec.Embedding(_features(), ec.SGD(0.1)))
    with pytest.raises(TypeError, match="embedcore.Embedding"):
        EmbeddingLayer(embedding="not an engine")
    engine = ec.Embedding(_features(), ec.SGD(0.1))
    assert EmbeddingLayer(embedding=engine).embedding is engine
    with pytest.raises(ValueError, match="bfloat16 activations"):  # the layer gives Keras float32 activations
        EmbeddingLayer(embedding=ec.Embedding(_features(), ec.SGD(0.1), output_dtype="bfloat16"))


# -- saving ------------------------------------------------------------------------------------------------

def test_save_weights_round_trip(tmp_path):
    batches = _batches(7, n_batches=2)
    layer = _layer()
    model = _model(layer, False, batches)
    model.fit(_dataset(batches), verbose=0)
    path = str(tmp_path / "ranker.weights.h5")
    model.save_weights(path)
    saved, dense = _state(layer), [np.array(w) for w in model.get_weights()]

    fresh_layer = _layer(seed=99)  # other initial values
    fresh = _model(fresh_layer, False, batches)
    fresh.load_weights(path)
    _assert_state_equal(_state(fresh_layer), saved)
    for a, b in zip(fresh.get_weights(), dense):
        np.testing.assert_array_equal(a, b)
    fresh.fit(_dataset(batches), verbose=0)  # and training goes on from there
    model.fit(_dataset(batches), verbose=0)
    _assert_state_equal(_state(fresh_layer), _state(layer))


def test_tf_train_checkpoint_round_trip(tmp_path):
    batches = _batches(12, n_batches=2)
    layer = _layer()
    model = _model(layer, False, batches)
    model.fit(_dataset(batches), verbose=0)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    assert any("table:items" in name for name, _ in tf.train.list_variables(path))

    fresh_layer = _layer(seed=99)
    fresh = _model(fresh_layer, False, batches)
    tf.train.Checkpoint(model=fresh).read(path).assert_consumed()
    _assert_state_equal(_state(fresh_layer), _state(layer))
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)

    other = EmbeddingLayer({"user": ec.FeatureConfig(ec.TableConfig(N_USERS, DIM, name="users"))}, ec.SGD(0.1))
    before = _state(layer)
    path = tf.train.Checkpoint(layer=other).write(str(tmp_path / "other"))
    with pytest.raises(tf.errors.NotFoundError, match="table:items"):  # TensorFlow's own refusal
        tf.train.Checkpoint(layer=layer).read(path)
    _assert_state_equal(_state(layer), before)

    bigger = EmbeddingLayer({"user": ec.FeatureConfig(ec.TableConfig(N_USERS + 1, DIM, name="users")),
                             "hist": ec.FeatureConfig(ec.TableConfig(N_ITEMS, DIM, name="items"))},
                            ec.Adagrad(0.1))
    path = tf.train.Checkpoint(layer=bigger).write(str(tmp_path / "bigger"))
    with pytest.raises(ValueError, match="users"):  # the engine's: a table of another shape
        tf.train.Checkpoint(layer=layer).read(path)
    _assert_state_equal(_state(layer), before)


def test_whole_model_saving_is_refused_with_the_way_out(tmp_path):
    layer = EmbeddingLayer({"user": ec.FeatureConfig(ec.TableConfig(N_USERS, DIM, name="users"))}, ec.SGD(0.1))
    ids = keras.Input(shape=(), dtype="int64")
    model = keras.Model(ids, layer({"user": ids})["user"])
    with pytest.raises(NotImplementedError, match="save_weights"):
        model.save(str(tmp_path / "model.keras"))


def test_fit_with_steps_per_execution():
    batches = _batches(11, n_batches=4)
    layer = _layer()
    model = TinyRanker(layer)
    model.compile(optimizer="adam", loss="mse", steps_per_execution=2)  # two steps per tf.function call
    model.fit(_dataset(batches), verbose=0)
    assert layer.embedding.step == 4


def test_loading_other_tables_changes_nothing():
    other = EmbeddingLayer({"user": ec.FeatureConfig(ec.TableConfig(N_USERS, DIM, name="users"))}, ec.SGD(0.1))
    store = {}
    other.save_own_variables(store)  # what model.save_weights writes for the layer
    assert {"0", "step", "table:users"} <= set(store)
    layer = _layer()
    before = _state(layer)
    with pytest.raises(ValueError, match="table:items"):  # a table the store does not have
        layer.load_own_variables(store)
    _assert_state_equal(_state(layer), before)

    store = {}
    layer.save_own_variables(store)
    store["table:users"] = np.full((N_USERS, DIM), np.nan, np.float32)
    store["step"] = np.array(5)
    with pytest.raises(ValueError, match="users"):  # NaN rows are refused; nothing is loaded
        layer.load_own_variables(store)
    _assert_state_equal(_state(layer), before)


# -- TensorFlow's own config objects ------------------------------------------------------------------------

def test_tensorflow_configs_are_converted():
    table = tf.tpu.experimental.embedding.TableConfig(N_USERS, DIM, name="users", combiner="sum",
                                                      initializer=tf.constant_initializer(0.5))
    features = {"user": tf.tpu.experimental.embedding.FeatureConfig(table, name="user")}
    layer = EmbeddingLayer(features, tf.tpu.experimental.embedding.SGD(0.1))
    expected = convert.features(features).features
    assert layer.embedding.tables["users"].vocabulary_size == expected["user"].table.vocabulary_size
    np.testing.assert_array_equal(layer.get_embedding_tables()["users"], np.full((N_USERS, DIM), 0.5, np.float32))


def test_bfloat16_tables_round_trip(tmp_path):
    def layer(seed):
        table = ec.TableConfig(N_USERS, DIM, name="users", weights_dtype="bfloat16")
        return EmbeddingLayer({"user": ec.FeatureConfig(table)}, ec.Adagrad(0.1), seed=seed)

    saved, fresh, store = layer(0), layer(1), {}
    saved.save_own_variables(store)
    assert store["table:users"].dtype == np.uint16  # the bits: HDF5 has no bfloat16
    fresh.load_own_variables(store)
    _assert_state_equal(_state(fresh), _state(saved))
    restored = layer(2)
    tf.train.Checkpoint(layer=restored).read(tf.train.Checkpoint(layer=saved).write(str(tmp_path / "ckpt")))
    _assert_state_equal(_state(restored), _state(saved))


# -- the worked example ----------------------------------------------------------------------------------------

def test_keras_ranking_example_runs(tmp_path):
    plot = tmp_path / "curve.png"
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "keras_ranking.py"), str(plot), "--train", "4096",
                          "--eval", "1024", "--batch-size", "512", "--epochs", "1"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "embedding updates 8 (one per training step, 8)" in out.stdout  # 4096 samples / 512 a batch
    auc = float(out.stdout.split("eval AUC")[-1].split()[0])
    assert 0.0 <= auc <= 1.0
    assert plot.stat().st_size > 1000


class UnforwardingRanker(TinyRanker):
    """keras-rs's example form: ``call(self, x)`` neither takes nor forwards ``training``."""

    def call(self, x):
        acts = self.embedding(x["ids"], {"user": None, "hist": x["hist_weights"], "tags": None})
        return self.head(tf.concat([acts["user"], acts["hist"], acts["tags"]], axis=1))


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
@pytest.mark.parametrize("model_class", [UnforwardingRanker, TinyRanker], ids=["unforwarded", "forwarded"])
def test_fit_trains_however_the_outer_call_is_written(model_class, run_eagerly):
    batches = _batches(6, n_batches=3)
    layer = _layer()
    model = model_class(layer)
    model.compile(optimizer=keras.optimizers.SGD(DENSE_LR), loss="mse", run_eagerly=run_eagerly)
    model(_tf_batch(batches[0])[0])  # builds the Dense unit: no tape, so a lookup only
    assert layer.embedding.step == 0
    tables0 = layer.get_embedding_tables()
    kernel0, bias0 = (np.array(w) for w in model.head.get_weights())

    model.fit(_dataset(batches), epochs=2, shuffle=False, verbose=0)

    assert layer.embedding.step == 2 * len(batches)  # one update per step
    tables, accs, kernel, bias = _oracle(tables0, kernel0, bias0, batches + batches)
    for name in tables:
        assert not np.allclose(tables[name], tables0[name])
        np.testing.assert_allclose(layer.embedding.embedding_tables[name], tables[name], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(layer.embedding.slot_variables[name]["accumulators"], accs[name],
                                   rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(model.head.get_weights()[0], kernel, rtol=2e-5, atol=2e-6)

    before = _state(layer)
    model.evaluate(_dataset(batches), verbose=0)
    model.predict(_dataset(batches), verbose=0)
    _assert_state_equal(_state(layer), before)
    assert graph.pending_count(layer.embedding) == 0


def test_untaped_training_lookup_raises_at_the_next_call_naming_the_layer():
    batches = _batches(7, n_batches=1)
    layer = _layer(name="my_embeddings")
    x, _ = _tf_batch(batches[0])
    weights = {"user": None, "hist": x["hist_weights"], "tags": None}
    layer(x["ids"], weights)  # no tape, training unset: a lookup only, nothing pending
    assert graph.pending_count(layer.embedding) == 0
    before = _state(layer)
    layer(x["ids"], weights, training=True)  # training forced, but no gradient will ever come
    with pytest.raises(graph.GradientNeverCameError, match="'my_embeddings'.*1 training lookup"):
        layer(x["ids"], weights)
    _assert_state_equal(_state(layer), before)
    layer(x["ids"], weights)  # reported once; the layer works on
    assert graph.pending_count(layer.embedding) == 0


def test_skipped_gradient_inside_tf_function_raises_naming_the_layer():
    batches = _batches(8, n_batches=1)
    layer = _layer(name="twice")
    x, y = _tf_batch(batches[0])
    weights = {"user": None, "hist": x["hist_weights"], "tags": None}

    @tf.function
    def step(x, y, use_both):
        with tf.GradientTape() as tape:
            first = layer(x["ids"], weights)["user"]
            second = layer(x["ids"], weights)["user"]
            loss = tf.reduce_sum(second) + (tf.reduce_sum(first) if use_both else 0.0)
        return tape.gradient(loss, layer.trainable_variables)

    step(x, y, True)  # two lookups a step, both differentiated: legitimate
    step(x, y, True)
    assert layer.embedding.step == 4
    step(x, y, False)  # the first lookup's gradient never comes
    assert layer.embedding.step == 5
    with pytest.raises(tf.errors.OpError, match="'twice'.*never received their gradient"):
        step(x, y, True)
    assert layer.embedding.step == 5
    assert graph.pending_count(layer.embedding) == 0


def test_keras_rs_configs_are_converted():
    keras_rs = pytest.importorskip("keras_rs")
    movies = keras_rs.layers.TableConfig(name="movie_table", vocabulary_size=N_ITEMS, embedding_dim=DIM,
                                         optimizer="adam", placement="sparsecore")
    users = keras_rs.layers.TableConfig(name="user_table", vocabulary_size=N_USERS, embedding_dim=DIM,
                                        optimizer=keras.optimizers.Adagrad(0.25, initial_accumulator_value=0.5),
                                        combiner="sum")
    configs = {"movie_id": keras_rs.layers.FeatureConfig(name="movie", table=movies, input_shape=(8,),
                                                         output_shape=(8, DIM)),
               "user_id": keras_rs.layers.FeatureConfig(name="user", table=users, input_shape=(8,),
                                                        output_shape=(8, DIM)),
               "user_again": keras_rs.layers.FeatureConfig(name="user2", table=users, input_shape=(8,),
                                                           output_shape=(8, DIM))}
    layer = DistributedEmbedding(configs)
    tables = layer.embedding.tables
    assert sorted(tables) == ["movie_table", "user_table"]  # one table per keras-rs table object
    assert (tables["user_table"].vocabulary_size, tables["user_table"].dim) == (N_USERS, DIM)
    assert tables["user_table"].combiner == "sum" and tables["movie_table"].combiner == "mean"
    assert tables["movie_table"].optimizer == convert.optimizer(tf.tpu.experimental.embedding.Adam())
    assert tables["user_table"].optimizer == convert.optimizer(
        tf.tpu.experimental.embedding.Adagrad(0.25, initial_accumulator_value=0.5))
    # keras-rs's default initializer, Keras's VarianceScaling(mode="fan_out"): a truncated normal of
    # stddev sqrt(1 / dim) / 0.8796 (Keras's truncation correction), within two of those stddevs
    rows = layer.get_embedding_tables()["user_table"]
    assert np.all(np.abs(rows) <= 2 * np.sqrt(1.0 / DIM) / 0.87962566103423978 + 1e-6)
    # [batch, dim] output shapes: any batch size; one Adagrad step on the user table as a NumPy oracle
    ids = {"movie_id": tf.constant([1, 2, 2]), "user_id": tf.constant([0, 3, 0]), "user_again": tf.constant([5, 5, 5])}
    before = rows.copy()
    with tf.GradientTape() as tape:
        acts = layer(ids)
        loss = tf.reduce_sum(acts["user_id"])
    tape.gradient(loss, layer.trainable_variables)
    assert acts["movie_id"].shape == (3, DIM) and layer.embedding.step == 1
    g = np.zeros_like(before)
    g[0], g[3] = 2.0, 1.0   # row 0 twice; user_again's activations unused: a zero gradient for row 5
    touched = [0, 3, 5]
    expected = before.copy()
    expected[touched] -= 0.25 * g[touched] / np.sqrt(0.5 + g[touched] ** 2)
    np.testing.assert_allclose(layer.get_embedding_tables()["user_table"], expected, rtol=1e-6, atol=1e-7)


def test_keras_rs_fields_embedcore_cannot_honour_are_refused_by_name():
    keras_rs = pytest.importorskip("keras_rs")

    def feature(output_shape=(4, DIM), **table):
        table = keras_rs.layers.TableConfig(**{"name": "t", "vocabulary_size": 5, "embedding_dim": DIM, **table})
        return {"f": keras_rs.layers.FeatureConfig(name="feat", table=table, input_shape=(4,),
                                                   output_shape=output_shape)}

    cases = [(dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9)), "'feat'.*table 't'.*momentum=0.9"),
             (dict(optimizer=keras.optimizers.Adam(amsgrad=True)), "'feat'.*table 't'.*amsgrad"),
             (dict(optimizer=keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9))),
              "'feat'.*learning_rate is a LearningRateSchedule"),
             (dict(optimizer=keras.optimizers.RMSprop()), "'feat'.*RMSprop has no embedcore equivalent"),
             (dict(optimizer="rmsprop"), "'feat'.*optimizer must be one of"),
             (dict(placement="tpu"), "'feat'.*placement must be one of"),
             (dict(combiner="max"), "'feat'.*table 't'"),
             (dict(output_shape=(4, DIM + 1)), "'feat'.*embedding_dim 3 last")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            DistributedEmbedding(feature(**kwargs))
