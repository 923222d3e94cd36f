"""embedcore.tensorflow's tensors, graph bridge and drop-in engines (TPUEmbeddingV2, TPUEmbedding,
TPUEmbeddingForServing), against plain NumPy oracles and TensorFlow's own CPU serving lookup.

Every example runs TensorFlow's documented usage with only the class swapped, eagerly and inside
``tf.function``, with dense, ragged and (weighted) sparse features and ``tf.GradientTape`` gradients.
"""

import copy
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="needs the tensorflow extra: pip install 'embedcore[tensorflow]'")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore.tensorflow import TPUEmbedding, TPUEmbeddingForServing, TPUEmbeddingV2, graph, tensors  # noqa: E402

E = tf.tpu.experimental.embedding
DIM = 4
V_VIDEO, V_USER = 11, 7


# ----------------------------------------------------------------------------------------------------------
# Oracles, in plain NumPy.

def bag_oracle(rows, samples, weights, combiner):
    """Activations ``[B, dim]``: sample b combines rows[ids] with weights w as ``combiner`` says."""
    out = np.zeros((len(samples), rows.shape[1]), np.float64)
    for b, ids in enumerate(samples):
        w = np.ones(len(ids)) if weights is None else np.asarray(weights[b], np.float64)
        if not len(ids):
            continue
        total = (w[:, None] * rows[ids].astype(np.float64)).sum(0)
        if combiner == "mean":
            total = total / w.sum() if w.sum() else total * 0
        elif combiner == "sqrtn":
            total = total / np.sqrt((w * w).sum()) if (w * w).sum() else total * 0
        out[b] = total
    return out


def sgd_oracle(rows, samples, weights, combiner, d_act, lr):
    """One SGD step: every row minus ``lr`` times the sum, over its occurrences, of gain x activation gradient."""
    grad = np.zeros(rows.shape, np.float64)
    for b, ids in enumerate(samples):
        w = np.ones(len(ids)) if weights is None else np.asarray(weights[b], np.float64)
        scale = {"sum": 1.0, "mean": 1.0 / w.sum() if w.sum() else 0.0,
                 "sqrtn": 1.0 / np.sqrt((w * w).sum()) if (w * w).sum() else 0.0}[combiner]
        for i, w_i in zip(ids, w):
            grad[i] += w_i * scale * d_act[b]
    return rows - lr * grad


def sparse_from_samples(samples, width, weights=None, dtype=tf.int64):
    indices = [[b, k] for b, ids in enumerate(samples) for k in range(len(ids))]
    values = [i for ids in samples for i in ids]
    ids = tf.SparseTensor(np.asarray(indices, np.int64).reshape(-1, 2), tf.constant(values, dtype),
                          [len(samples), width])
    if weights is None:
        return ids, None
    w = tf.SparseTensor(ids.indices, tf.constant([x for ws in weights for x in ws], tf.float32), ids.dense_shape)
    return ids, w


# ----------------------------------------------------------------------------------------------------------
# The data: three features over two tables, as TensorFlow's TPUEmbedding docstring lays them out.

VIDEO_IDS = [3, 0, 10, 3]                                   # dense [B]: one id per sample
USER_BAGS = [[1, 2, 2], [], [6], [0, 5]]                    # ragged, with an empty row and a duplicate
FRIEND_BAGS = [[4, 4, 1], [3], [], [6, 2]]                  # sparse [B, 3], weighted
FRIEND_WEIGHTS = [[0.5, 1.5, 2.0], [3.0], [], [1.0, -0.25]]
B = len(VIDEO_IDS)


def tf_feature_config(combiner="sum"):
    initial = np.linspace(-1, 1, V_VIDEO * DIM).reshape(V_VIDEO, DIM)
    table_video = E.TableConfig(vocabulary_size=V_VIDEO, dim=DIM, name="video",
                                initializer=tf.constant_initializer(initial, support_partition=True))
    table_user = E.TableConfig(vocabulary_size=V_USER, dim=DIM, name="user", combiner=combiner)
    feature_config = {
        "watched": E.FeatureConfig(table=table_video, name="watched"),
        "favorited": E.FeatureConfig(table=table_user, name="favorited"),
        "friends": E.FeatureConfig(table=table_user, name="friends"),
    }
    return feature_config, table_video, table_user


def tf_features():
    friends, friend_weights = sparse_from_samples(FRIEND_BAGS, 3, FRIEND_WEIGHTS)
    features = {"watched": tf.constant(VIDEO_IDS, tf.int32),
                "favorited": tf.ragged.constant(USER_BAGS, dtype=tf.int64, row_splits_dtype=tf.int64),
                "friends": friends}
    weights = {"watched": None, "favorited": None, "friends": friend_weights}
    return features, weights


def numpy_features():
    """The same batch as embedcore's NumPy inputs (the ec.Embedding oracle's)."""
    friends = ec.Sparse(np.asarray([[b, k] for b, ids in enumerate(FRIEND_BAGS) for k in range(len(ids))]),
                        np.asarray([i for ids in FRIEND_BAGS for i in ids]), (B, 3))
    friend_weights = ec.Sparse(friends.indices, np.asarray([x for w in FRIEND_WEIGHTS for x in w], np.float32),
                               (B, 3))
    features = {"watched": np.asarray(VIDEO_IDS), "favorited": ec.Ragged.from_lists(USER_BAGS), "friends": friends}
    return features, {"watched": None, "favorited": None, "friends": friend_weights}


RNG = np.random.default_rng(7)
D_ACT = {name: RNG.standard_normal((B, DIM)).astype(np.float32) for name in ("watched", "favorited", "friends")}


def model_loss(activations):
    """A dense 'model': loss = sum of activations x fixed coefficients, so d loss / d activations = D_ACT."""
    return tf.add_n([tf.reduce_sum(activations[k] * tf.constant(D_ACT[k])) for k in sorted(D_ACT)])


def expected_after_one_step(before_video, before_user, combiner, lr):
    video = sgd_oracle(before_video, [[i] for i in VIDEO_IDS], None, "mean", D_ACT["watched"], lr)
    user = sgd_oracle(before_user, USER_BAGS, None, combiner, D_ACT["favorited"], lr)
    user = user - (before_user - sgd_oracle(before_user, FRIEND_BAGS, FRIEND_WEIGHTS, combiner, D_ACT["friends"], lr))
    return video, user


def numpy_tables(front, *tables):
    return [front.embedding_tables[t].numpy().copy() for t in tables]


def check_activations(acts, video, user, combiner):
    np.testing.assert_allclose(acts["watched"], bag_oracle(video, [[i] for i in VIDEO_IDS], None, "sum"),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(acts["favorited"], bag_oracle(user, USER_BAGS, None, combiner), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(acts["friends"], bag_oracle(user, FRIEND_BAGS, FRIEND_WEIGHTS, combiner),
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# tensors.py

def test_tensors_dense_ids_are_read_without_a_copy():
    ids = tf.constant(np.arange(12, dtype=np.int64).reshape(3, 4))
    leaf = tensors.leaf(ids, "f")
    assert leaf.kind == tensors.DENSE and leaf.shape == (3, 4)
    array = tensors.compose(leaf.kind, [tensors.to_numpy(p) for p in leaf.parts])
    assert np.shares_memory(array, np.asarray(ids))
    np.testing.assert_array_equal(array, np.arange(12).reshape(3, 4))


def test_tensors_ragged_and_sparse_become_embedcore_inputs():
    ragged = tensors.leaf(tf.ragged.constant([[1, 2], [], [3]]), "r")
    r = tensors.compose(ragged.kind, [tensors.to_numpy(p) for p in ragged.parts])
    assert isinstance(r, ec.Ragged) and r.values.tolist() == [1, 2, 3] and r.row_splits.tolist() == [0, 2, 2, 3]
    sparse = tensors.leaf(tf.SparseTensor([[0, 1], [2, 0]], tf.constant([5, 6], tf.int64), [3, 2]), "s")
    s = tensors.compose(sparse.kind, [tensors.to_numpy(p) for p in sparse.parts])
    assert isinstance(s, ec.Sparse) and s.dense_shape == (3, 2) and s.values.tolist() == [5, 6]
    weights = tensors.leaf(tf.ragged.constant([[1.0, 2.0]], dtype=tf.float64), "r", "weights")
    assert weights.parts[0].dtype == tf.float32  # downcast, as TensorFlow's engines do


@pytest.mark.parametrize("value, message", [
    (tf.ragged.constant([[[1]], [[2, 3]]]), "Only rank 2 ragged tensor is supported.*feature bad"),
    (tf.SparseTensor([[0]], tf.constant([1], tf.int64), [3]), "Only rank 2 and above sparse tensor.*feature bad"),
    ("ids", "Input bad is of unknown type"),
    (tf.constant([1.5]), "Input bad has dtype float32; ids must be integers"),
])
def test_tensors_refuse_what_tensorflow_refuses(value, message):
    with pytest.raises(ValueError, match=message):
        tensors.leaf(value, "bad")


def test_tensors_to_tensor_shares_aligned_float32_and_copies_the_rest():
    base = np.zeros(64 + 16, np.float32)
    aligned = base[(-base.ctypes.data % 64) // 4:][:32].reshape(8, 4)
    assert aligned.ctypes.data % 64 == 0
    t = tensors.to_tensor(aligned)
    aligned[0, 0] = 5.0
    assert float(t[0, 0]) == 5.0  # the same memory
    unaligned = aligned.reshape(-1)[1:29].reshape(7, 4)
    u = tensors.to_tensor(unaligned)
    unaligned[0, 0] = 9.0
    assert float(u[0, 0]) != 9.0 and float(tf.reduce_sum(u)) == float(np.sum(unaligned) - 9.0)


def test_tensors_gradients_to_numpy():
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([2]), tf.constant([3, 2]))
    np.testing.assert_array_equal(tensors.gradient_to_numpy(slices, "f"), [[0, 0], [0, 0], [1, 2]])
    assert tensors.gradient_to_numpy(None, "f") is None
    with pytest.raises(ValueError, match="found non-tensor type: <class 'str'> at path f"):
        tensors.gradient_to_numpy("x", "f")


# ----------------------------------------------------------------------------------------------------------
# graph.py

@pytest.fixture(scope="module")
def ec_engine():
    table = ec.TableConfig(V_USER, DIM, name="bags", combiner="mean")
    features = {"dense": ec.FeatureConfig(ec.TableConfig(V_VIDEO, DIM, name="ids")), "bag": ec.FeatureConfig(table),
                "seq": ec.FeatureConfig(table, max_sequence_length=3)}
    return ec.Embedding(features, ec.SGD(0.5), seed=3)


def graph_batch(batch=4, seed=0):
    rng = np.random.default_rng(seed)
    bags = [list(rng.integers(0, V_USER, rng.integers(0, 4))) for _ in range(batch)]
    dense = rng.integers(0, V_VIDEO, batch)
    tf_batch = {"dense": tf.constant(dense), "bag": tf.ragged.constant(bags, dtype=tf.int64),
                "seq": tf.ragged.constant(bags, dtype=tf.int64)}
    np_batch = {"dense": dense, "bag": ec.Ragged.from_lists(bags), "seq": ec.Ragged.from_lists(bags)}
    return tf_batch, np_batch


def test_graph_lookup_equals_the_engine_eagerly_and_in_tf_function(ec_engine):
    tf_batch, np_batch = graph_batch()
    expected, ctx = ec_engine.lookup(np_batch)
    ctx.release()
    eager, handle = graph.lookup(ec_engine, tf_batch, training=False)
    assert int(handle) == 0

    @tf.function
    def look(batch):
        return graph.lookup(ec_engine, batch, training=False)[0]

    traced = look(tf_batch)
    for k in expected:
        np.testing.assert_array_equal(eager[k].numpy(), expected[k])
        np.testing.assert_array_equal(traced[k].numpy(), expected[k])


def test_graph_static_shapes_come_from_the_config_and_the_batch(ec_engine):
    @tf.function
    def look(batch):
        return graph.lookup(ec_engine, batch, training=False)[0]

    spec = {"dense": tf.TensorSpec([None], tf.int64), "bag": tf.RaggedTensorSpec([None, None], tf.int64),
            "seq": tf.RaggedTensorSpec([5, None], tf.int64)}
    shapes = {k: v.shape.as_list() for k, v in look.get_concrete_function(spec).structured_outputs.items()}
    assert shapes == {"dense": [None, DIM], "bag": [None, DIM], "seq": [5, 3, DIM]}


def test_graph_update_is_not_pruned_and_runs_in_order(ec_engine):
    engine = copy.deepcopy(ec_engine)
    oracle = copy.deepcopy(ec_engine)
    tf_batch, np_batch = graph_batch(seed=1)
    d_act = {"dense": np.ones((4, DIM), np.float32), "bag": np.full((4, DIM), 2, np.float32),
             "seq": np.full((4, 3, DIM), 0.5, np.float32)}

    @tf.function
    def step(batch):  # returns nothing: the update must still run, once, after its lookup
        with tf.GradientTape() as tape:
            acts, handle = graph.lookup(engine, batch)
            tape.watch(acts)
            loss = tf.add_n([tf.reduce_sum(acts[k] * d_act[k]) for k in sorted(acts)])
        graph.apply_gradients(engine, tape.gradient(loss, acts), handle)

    for _ in range(2):
        step(tf_batch)
        acts, ctx = oracle.lookup(np_batch)
        oracle.apply_gradients(d_act, ctx)
    assert engine.step == oracle.step == ec_engine.step + 2
    for name in oracle.embedding_tables:
        np.testing.assert_allclose(engine.embedding_tables[name], oracle.embedding_tables[name], rtol=1e-6, atol=1e-7)
    assert graph.pending_count(engine) == 0


def test_graph_a_lookup_after_an_update_in_one_function_sees_the_new_rows(ec_engine):
    engine = copy.deepcopy(ec_engine)
    tf_batch, np_batch = graph_batch(seed=5)

    @tf.function
    def update_then_look(batch):
        acts, handle = graph.lookup(engine, batch)
        graph.apply_gradients(engine, tf.nest.map_structure(tf.ones_like, acts), handle)
        return graph.lookup(engine, batch, training=False)[0]  # no data dependency on the update: ordered anyway

    after = update_then_look(tf_batch)
    expected, ctx = engine.lookup(np_batch)
    ctx.release()
    assert engine.step == ec_engine.step + 1
    for k in expected:
        np.testing.assert_array_equal(after[k].numpy(), expected[k])


def test_graph_tracing_changes_nothing_and_retracing_is_harmless(ec_engine):
    engine = copy.deepcopy(ec_engine)
    before = {k: v.copy() for k, v in engine.embedding_tables.items()}

    @tf.function
    def step(batch):
        acts, handle = graph.lookup(engine, batch)
        return graph.apply_gradients(engine, tf.nest.map_structure(tf.ones_like, acts), handle)

    for batch in (3, 5):  # a new static batch size: a new trace
        step.get_concrete_function(graph_batch(batch)[0])
    assert engine.step == ec_engine.step and graph.pending_count(engine) == 0
    assert all(np.array_equal(before[k], v) for k, v in engine.embedding_tables.items())
    assert int(step(graph_batch(3)[0])) == ec_engine.step + 1
    assert int(step(graph_batch(5)[0])) == ec_engine.step + 2


def test_graph_one_update_per_lookup(ec_engine):
    engine = copy.deepcopy(ec_engine)
    tf_batch, _ = graph_batch(seed=2)
    acts, handle = graph.lookup(engine, tf_batch)
    grads = tf.nest.map_structure(tf.ones_like, acts)
    graph.apply_gradients(engine, grads, handle)
    with pytest.raises(ec.InputError, match="names no pending lookup: its gradients were applied already"):
        graph.apply_gradients(engine, grads, handle)
    _, frozen = graph.lookup(engine, tf_batch, training=False)
    with pytest.raises(ec.InputError, match="training=False"):
        graph.apply_gradients(engine, grads, frozen)
    assert engine.step == ec_engine.step + 1


def test_graph_releases_dropped_and_surplus_lookups(ec_engine):
    engine = copy.deepcopy(ec_engine)
    tf_batch, _ = graph_batch(seed=3)
    _, handle = graph.lookup(engine, tf_batch)
    assert graph.pending_count(engine) == 1
    del handle  # an eager handle garbage-collected unapplied
    assert graph.pending_count(engine) == 0

    @tf.function
    def look(batch):
        return graph.lookup(engine, batch)[1]

    handles = [look(tf_batch) for _ in range(graph.MAX_PENDING + 2)]  # graph handles: kept up to MAX_PENDING
    assert graph.pending_count(engine) == graph.MAX_PENDING
    acts, _ = graph.lookup(engine, tf_batch, training=False)
    with pytest.raises(ec.InputError, match="released"):
        graph.apply_gradients(engine, tf.nest.map_structure(tf.ones_like, acts), handles[0])
    graph.apply_gradients(engine, tf.nest.map_structure(tf.ones_like, acts), handles[-1])
    assert graph.pending_count(engine) == graph.MAX_PENDING - 1


def test_graph_value_errors_name_the_feature_and_change_nothing(ec_engine):
    engine = copy.deepcopy(ec_engine)
    before = {k: v.copy() for k, v in engine.embedding_tables.items()}
    tf_batch, _ = graph_batch(seed=4)
    bad = dict(tf_batch, dense=tf.constant([0, 1, V_VIDEO + 5, 2], tf.int64))
    with pytest.raises(ec.InputError, match="dense"):
        graph.lookup(engine, bad)

    @tf.function
    def look(batch):
        return graph.lookup(engine, batch)[0]

    with pytest.raises(tf.errors.OpError, match="dense"):
        look(bad)
    acts, handle = graph.lookup(engine, tf_batch)
    grads = tf.nest.map_structure(tf.ones_like, acts)
    grads["bag"] = tf.fill(acts["bag"].shape, np.nan)
    with pytest.raises(ec.InputError, match="bag"):
        graph.apply_gradients(engine, grads, handle)
    grads["bag"] = tf.ones([7, DIM])
    with pytest.raises(ec.InputError, match="gradient of feature 'bag' has shape"):
        graph.apply_gradients(engine, grads, handle)
    assert engine.step == ec_engine.step
    assert all(np.array_equal(before[k], v) for k, v in engine.embedding_tables.items())


# ----------------------------------------------------------------------------------------------------------
# TPUEmbedding (the v2 API): its docstring's training loop, with only the class swapped.

@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_tpu_embedding_one_step_equals_the_sgd_formula(combiner):
    feature_config, table_video, table_user = tf_feature_config(combiner)
    embedding = TPUEmbedding(feature_config=feature_config, optimizer=E.SGD(0.1))
    video, user = numpy_tables(embedding, table_video, table_user)
    features, weights = tf_features()

    embedding.enqueue(features, weights=weights, training=True)
    with tf.GradientTape() as tape:
        activations = embedding.dequeue()
        tape.watch(activations)
        loss = model_loss(activations)
    embedding_gradients = tape.gradient(loss, activations)
    embedding.apply_gradients(embedding_gradients)

    check_activations({k: v.numpy() for k, v in activations.items()}, video, user, combiner)
    new_video, new_user = expected_after_one_step(video, user, combiner, 0.1)
    got_video, got_user = numpy_tables(embedding, table_video, table_user)
    np.testing.assert_allclose(got_video, new_video, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_user, new_user, rtol=1e-5, atol=1e-6)


def _graph_ancestors(op):
    """Every op that must run before ``op`` (data and control inputs, transitively)."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


@pytest.mark.parametrize("where", ["learning_rate", "hyperparameter"])
def test_variable_read_by_a_callable_follows_program_order_inside_tf_function(where):
    """TensorFlow evaluates callable learning rates (and CustomOptimizer hyperparameters) in the graph where
    the update is built, so a variable they read is read after an ``assign`` written before the update and
    before one written after it. Checked in the traced graph (TensorFlow orders a variable's reads and
    writes, not a Python op against them, so a value read inside the update op would race) and in the
    tables over steps."""
    rate = tf.Variable(0.1)

    def sgd(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        del slot_variables
        return embedding_table - hyperparameters[0] * learning_rate * gradient

    if where == "learning_rate":
        optimizer = E.SGD(lambda: rate * 2.0)
    else:
        optimizer = E.CustomOptimizer(sgd, learning_rate=2.0, hyperparameters=(lambda: rate,))
    table = E.TableConfig(5, 2, initializer=tf.zeros_initializer(), optimizer=optimizer, name="t")
    embedding = TPUEmbedding({"f": E.FeatureConfig(table)}, None)

    @tf.function
    def step(value, ids):
        rate.assign(value)
        embedding.enqueue({"f": ids}, training=True)
        activations = embedding.dequeue()
        embedding.apply_gradients({"f": tf.ones_like(activations["f"])})
        rate.assign(100.0)  # after the update: it must not see this

    graph_ = step.get_concrete_function(tf.TensorSpec([], tf.float32), tf.TensorSpec([None], tf.int32)).graph
    apply_op = next(op for op in graph_.get_operations() if op.type == "PyFunc" and "apply_gradients" in op.name)
    assigns = [op for op in graph_.get_operations() if op.type == "AssignVariableOp"]
    before = _graph_ancestors(apply_op)
    assert assigns[0] in before and assigns[1] not in before
    assert any(op.type == "ReadVariableOp" for op in before)

    expected = np.zeros((5, 2), np.float32)
    for value, ids in ((0.25, [1, 3]), (0.75, [1]), (0.5, [4, 4])):
        step(tf.constant(value), tf.constant(ids, tf.int32))
        for i in ids:
            expected[i] -= np.float32(2.0 * value)
        np.testing.assert_allclose(embedding.embedding_tables[table], expected, rtol=1e-6)


def test_tpu_embedding_docstring_training_loop_in_tf_function():
    feature_config, table_video, table_user = tf_feature_config("mean")
    strategy = tf.distribute.get_strategy()  # TensorFlow's example: tf.distribute.TPUStrategy(...)
    with strategy.scope():
        embedding = TPUEmbedding(feature_config=feature_config, optimizer=E.Adagrad(0.1))
    oracle = copy.deepcopy(embedding.engine)
    features, weights = tf_features()

    def dataset_fn(input_context):
        del input_context
        return tf.data.Dataset.from_tensors(((features, weights), tf.zeros([B]))).repeat()

    distributed_dataset = strategy.distribute_datasets_from_function(
        dataset_fn=dataset_fn, options=tf.distribute.InputOptions(experimental_fetch_to_device=False))
    dataset_iterator = iter(distributed_dataset)

    @tf.function
    def training_step(dataset_iterator, num_steps):
        def tpu_step(tpu_features):
            with tf.GradientTape() as tape:
                activations = embedding.dequeue()
                tape.watch(activations)
                loss = model_loss(activations) + tf.reduce_sum(tpu_features)
            embedding_gradients = tape.gradient(loss, activations)
            embedding.apply_gradients(embedding_gradients)

        for _ in tf.range(num_steps):
            (embedding_features, embedding_weights), tpu_features = next(dataset_iterator)
            embedding.enqueue(embedding_features, weights=embedding_weights, training=True)
            strategy.run(tpu_step, args=(tpu_features,))

    @tf.function
    def evaluation_step(dataset_iterator, num_steps):
        def tpu_step(tpu_features):
            activations = embedding.dequeue()
            return model_loss(activations)

        total = tf.constant(0.0)
        for _ in tf.range(num_steps):
            (embedding_features, embedding_weights), tpu_features = next(dataset_iterator)
            embedding.enqueue(embedding_features, weights=embedding_weights, training=False)
            total += strategy.run(tpu_step, args=(tpu_features,))
        return total

    training_step(dataset_iterator, tf.constant(3))
    np_features, np_weights = numpy_features()
    for _ in range(3):
        _, ctx = oracle.lookup(np_features, np_weights)
        oracle.apply_gradients({k: D_ACT[k] for k in D_ACT}, ctx)
    assert embedding.engine.step == 3
    for table, name in ((table_video, "video"), (table_user, "user")):
        np.testing.assert_allclose(embedding.embedding_tables[table].numpy(), oracle.embedding_tables[name],
                                   rtol=1e-6, atol=1e-7)
    loss = evaluation_step(dataset_iterator, tf.constant(2))
    acts, ctx = oracle.lookup(np_features, np_weights)
    ctx.release()
    expected = sum(float(np.sum(acts[k] * D_ACT[k], dtype=np.float64)) for k in D_ACT)
    assert float(loss) == pytest.approx(2 * expected, rel=1e-5)
    assert embedding.engine.step == 3  # evaluation updates nothing


def test_tpu_embedding_order_of_calls_is_tensorflows():
    feature_config, _, _ = tf_feature_config()
    embedding = TPUEmbedding(feature_config, E.SGD(0.1))
    features, weights = tf_features()
    with pytest.raises(RuntimeError, match="dequeue called on unbuilt TPUEmbedding object"):
        embedding.dequeue()
    with pytest.raises(RuntimeError, match="apply_gradients called on unbuilt TPUEmbedding object"):
        embedding.apply_gradients({k: None for k in feature_config})
    embedding.build(per_replica_batch_size=B)
    with pytest.raises(RuntimeError, match="dequeue called without a batch enqueued"):
        embedding.dequeue()
    with pytest.raises(RuntimeError, match="apply_gradients called without a dequeued batch"):
        embedding.apply_gradients({k: None for k in feature_config})
    embedding.enqueue(features, weights)
    with pytest.raises(RuntimeError, match="enqueue called twice without a dequeue"):
        embedding.enqueue(features, weights)
    acts = embedding.dequeue()
    grads = {k: tf.ones_like(v) for k, v in acts.items()}
    embedding.apply_gradients(grads)
    with pytest.raises(RuntimeError, match="apply_gradients called twice"):
        embedding.apply_gradients(grads)
    embedding.enqueue(features, weights, training=False)
    embedding.dequeue()
    with pytest.raises(RuntimeError, match="training=False"):
        embedding.apply_gradients(grads)
    assert embedding.engine.step == 1


def test_tpu_embedding_input_and_gradient_errors_are_tensorflows():
    feature_config, table_video, _ = tf_feature_config()
    embedding = TPUEmbedding(feature_config, E.SGD(0.1))
    features, weights = tf_features()
    with pytest.raises(ValueError):  # tf.nest: a missing key
        embedding.enqueue({"watched": features["watched"]})
    with pytest.raises(TypeError):  # tf.nest: a list where the config has a dict
        embedding.enqueue([features["watched"], features["favorited"], features["friends"]])
    with pytest.raises(ValueError, match="Weight specified for dense input watched, which is not allowed"):
        embedding.enqueue(features, dict(weights, watched=tf.ones([B])))
    with pytest.raises(ValueError, match="Weight for friends is type .* which does not match type input which is "
                                         "SparseTensor"):
        embedding.enqueue(features, dict(weights, friends=tf.ones([B, 3])))
    with pytest.raises(ValueError, match="Rank 2 or above dense tensor should have last dimension as 1"):
        embedding.enqueue(dict(features, watched=tf.zeros([B, 2], tf.int32)), weights)
    with pytest.raises(ValueError, match="Input watched is of unknown type"):
        embedding.enqueue(dict(features, watched="ids"), weights)
    embedding.enqueue(dict(features, watched=tf.reshape(features["watched"], [B, 1])), weights)  # [B, 1]: fine
    acts = embedding.dequeue()
    assert acts["watched"].shape == [B, DIM]
    with pytest.raises(ValueError, match="Inconsistent shape founded for input feature watched"):
        embedding.enqueue(dict(features, watched=tf.zeros([B + 1], tf.int32)), weights)
    grads = {k: tf.ones_like(v) for k, v in acts.items()}
    with pytest.raises(ValueError, match="found non-tensor type: <class 'str'> at path favorited"):
        embedding.apply_gradients(dict(grads, favorited="no"))
    with pytest.raises(ValueError, match=r"Found gradient of shape \(4, 3\) at path friends. Expected shape"):
        embedding.apply_gradients(dict(grads, friends=tf.ones([B, 3])))
    before = embedding.embedding_tables[table_video].numpy()
    bad = dict(features, watched=tf.constant([0, 1, 99, 2], tf.int32))
    with pytest.raises(ec.InputError, match="watched"):
        embedding.enqueue(bad, weights)
    np.testing.assert_array_equal(embedding.embedding_tables[table_video].numpy(), before)
    assert embedding.engine.step == 0


def test_tpu_embedding_none_gradient_updates_nothing_for_that_feature():
    feature_config, table_video, table_user = tf_feature_config()
    embedding = TPUEmbedding(feature_config, E.SGD(0.1))
    video, user = numpy_tables(embedding, table_video, table_user)
    features, weights = tf_features()
    embedding.enqueue(features, weights)
    with tf.GradientTape() as tape:
        acts = embedding.dequeue()
        tape.watch(acts)
        loss = tf.reduce_sum(acts["watched"] * D_ACT["watched"])  # the user table's features are unused
    grads = tape.gradient(loss, acts)
    assert grads["favorited"] is None and grads["friends"] is None
    embedding.apply_gradients(grads)
    got_video, got_user = numpy_tables(embedding, table_video, table_user)
    np.testing.assert_array_equal(got_user, user)
    np.testing.assert_allclose(got_video, sgd_oracle(video, [[i] for i in VIDEO_IDS], None, "sum",
                                                     D_ACT["watched"], 0.1), rtol=1e-6, atol=1e-7)


def test_tpu_embedding_tables_are_snapshots_keyed_by_table_config():
    feature_config, table_video, table_user = tf_feature_config()
    embedding = TPUEmbedding(feature_config, E.SGD(0.1))
    tables = embedding.embedding_tables
    assert set(tables) == {table_video, table_user}
    assert tables[table_video].shape == [V_VIDEO, DIM] and tables[table_video].dtype == tf.float32
    np.testing.assert_array_equal(tables[table_user].numpy(), embedding.engine.embedding_tables["user"])
    features, weights = tf_features()
    embedding.enqueue(features, weights)
    acts = embedding.dequeue()
    embedding.apply_gradients({k: tf.ones_like(v) for k, v in acts.items()})
    after = embedding.embedding_tables[table_user].numpy()
    assert not np.array_equal(after, tables[table_user].numpy())  # the old snapshot kept its values
    np.testing.assert_array_equal(after, embedding.engine.embedding_tables["user"])
    ids = tf.constant([[0, 6]])
    np.testing.assert_array_equal(tf.nn.embedding_lookup(embedding.embedding_tables[table_user], ids).numpy(),
                                  after[[[0, 6]]])


def test_tpu_embedding_lookup_only_without_an_optimizer():
    feature_config, table_video, _ = tf_feature_config()
    embedding = TPUEmbedding(feature_config, optimizer=None)
    features, weights = tf_features()
    embedding.enqueue(features, weights, training=False)
    acts = embedding.dequeue()
    video = embedding.embedding_tables[table_video].numpy()
    np.testing.assert_allclose(acts["watched"].numpy(), video[VIDEO_IDS], rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# TPUEmbeddingV2

def test_tpu_embedding_v2_equals_an_embedcore_engine_eagerly_and_in_tf_function():
    feature_config, _, _ = tf_feature_config("sqrtn")
    embedding = TPUEmbeddingV2(feature_config, E.Adagrad(0.2, initial_accumulator_value=0.1))
    oracle = copy.deepcopy(embedding.engine)
    features, weights = tf_features()
    np_features, np_weights = numpy_features()

    def step(features, weights):
        with tf.GradientTape() as tape:
            activations, preserved_outputs = embedding(features, weights)
            tape.watch(activations)
            loss = model_loss(activations)
        gradients = tape.gradient(loss, activations)
        embedding.apply_gradients(gradients, preserved_outputs)
        return activations

    traced = tf.function(step)
    for run in (step, traced, traced):
        activations = run(features, weights)
        expected, ctx = oracle.lookup(np_features, np_weights)
        for k in expected:
            np.testing.assert_allclose(activations[k].numpy(), expected[k], rtol=1e-6, atol=1e-7)
        oracle.apply_gradients({k: D_ACT[k] for k in D_ACT}, ctx)
    assert embedding.engine.step == oracle.step == 3
    (stacked, rows), = embedding.embedding_tables.items()  # equal optimizer and dim: one stacked table
    # embedcore stacks in the features' first-seen order (dict keys sorted: favorited, friends, watched)
    assert stacked == "user_video" and rows.shape == [V_VIDEO + V_USER, DIM]
    np.testing.assert_allclose(rows.numpy(), np.concatenate([oracle.embedding_tables["user"],
                                                             oracle.embedding_tables["video"]]), rtol=1e-6)
    assert set(embedding.variables[stacked]) == {"parameters", *oracle.physical_tables[0].optimizer.slot_names}


def test_tpu_embedding_v2_lookup_and_update_in_separate_tf_functions_trace_once():
    feature_config, _, _ = tf_feature_config()
    embedding = TPUEmbeddingV2(feature_config, E.SGD(0.3))
    oracle = copy.deepcopy(embedding.engine)
    features, weights = tf_features()

    @tf.function
    def forward(features, weights):
        with tf.GradientTape() as tape:
            activations, preserved_outputs = embedding(features, weights)
            tape.watch(activations)
            loss = model_loss(activations)
        return tape.gradient(loss, activations), preserved_outputs

    @tf.function
    def backward(gradients, preserved_outputs):
        embedding.apply_gradients(gradients, preserved_outputs)

    for _ in range(3):
        backward(*forward(features, weights))
    assert forward.experimental_get_tracing_count() == backward.experimental_get_tracing_count() == 1
    np_features, np_weights = numpy_features()
    for _ in range(3):
        _, ctx = oracle.lookup(np_features, np_weights)
        oracle.apply_gradients({k: D_ACT[k] for k in D_ACT}, ctx)
    for name in oracle.embedding_tables:
        np.testing.assert_allclose(embedding.engine.embedding_tables[name], oracle.embedding_tables[name],
                                   rtol=1e-6, atol=1e-7)


def test_tpu_embedding_v2_dense_weights_and_errors():
    feature_config, table_video, _ = tf_feature_config()
    embedding = TPUEmbeddingV2(feature_config, E.SGD(0.1))
    with pytest.raises(RuntimeError, match="apply_gradients called on unbuilt TPUEmbeddingV2 object"):
        embedding.apply_gradients({k: None for k in feature_config}, {})
    features, weights = tf_features()
    acts, preserved = embedding.embedding_lookup(features, dict(weights, watched=tf.fill([B], 2.0)))
    video = embedding.engine.embedding_tables["video"]
    np.testing.assert_allclose(acts["watched"].numpy(), video[VIDEO_IDS], rtol=1e-6)  # one id a row: weight cancels
    with pytest.raises(ValueError, match="Expect weight to be SparseTensor type"):
        embedding.embedding_lookup(features, dict(weights, friends=tf.ones([B, 3])))
    grads = {k: tf.ones_like(v) for k, v in acts.items()}
    with pytest.raises(ValueError, match="Found gradient of shape .* at path favorited"):
        embedding.apply_gradients(dict(grads, favorited=tf.ones([B + 1, DIM])), preserved)
    with pytest.raises(ValueError, match="preserved_outputs must be"):
        embedding.apply_gradients(grads, None)
    embedding.apply_gradients(grads, preserved)
    with pytest.raises(ec.InputError, match="applied already"):
        embedding.apply_gradients(grads, preserved)
    assert embedding.engine.step == 1


# ----------------------------------------------------------------------------------------------------------
# TPUEmbeddingForServing, against TensorFlow's own CPU serving lookup

def tf_serving_reference(features, weights, embedding, feature_config):
    tables = {t: tf.Variable(v) for t, v in embedding.embedding_tables.items()}
    return E.serving_embedding_lookup(features, weights, tables, feature_config)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_serving_equals_tensorflows_serving_lookup(combiner):
    feature_config, _, _ = tf_feature_config(combiner)
    embedding = TPUEmbeddingForServing(feature_config=feature_config, optimizer=E.SGD(0.1))
    features, weights = tf_features()
    expected = tf_serving_reference(features, weights, embedding, feature_config)
    served = embedding(features, weights)
    traced = tf.function(embedding.embedding_lookup)(features, weights)
    for k in expected:
        np.testing.assert_allclose(served[k].numpy(), expected[k].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(traced[k].numpy(), expected[k].numpy(), rtol=1e-5, atol=1e-6)
    dense = dict(features, watched=tf.constant([[1, 2], [3, 4], [5, 6], [7, 8]]))  # serving: S + [dim]
    assert embedding(dense, weights)["watched"].shape == [B, 2, DIM]
    assert embedding.engine.step == 0


def test_serving_any_batch_size_and_sequence_features():
    table = E.TableConfig(vocabulary_size=V_USER, dim=DIM, name="user")
    feature_config = {"bag": E.FeatureConfig(table=table, output_shape=[B]),
                      "seq": E.FeatureConfig(table=table, max_sequence_length=2)}
    embedding = TPUEmbeddingForServing(feature_config, optimizer=None)
    for batch in (1, 3):  # not the training output shape's batch
        bags = [list(range(k % 3)) for k in range(batch)]
        features = {"bag": sparse_from_samples(bags, 3)[0], "seq": tf.ragged.constant(bags, dtype=tf.int64)}
        expected = tf_serving_reference(features, None, embedding, feature_config)
        got = embedding(features)
        for k in expected:
            assert got[k].shape == expected[k].shape
            np.testing.assert_allclose(got[k].numpy(), expected[k].numpy(), rtol=1e-5, atol=1e-6)


def test_serving_shapes_ragged_batches_to_an_output_shape_as_tensorflow_does():
    table = E.TableConfig(vocabulary_size=V_USER, dim=DIM, name="user")
    feature_config = {"bag": E.FeatureConfig(table=table, output_shape=[2, 2])}
    embedding = TPUEmbeddingForServing(feature_config, E.SGD(0.1))
    features = {"bag": tf.ragged.constant([[1, 2], [3], [], [4, 5, 6]], dtype=tf.int64)}
    expected = tf_serving_reference(features, None, embedding, feature_config)
    got = embedding(features)
    assert got["bag"].shape == expected["bag"].shape == [2, 2, DIM]
    np.testing.assert_allclose(got["bag"].numpy(), expected["bag"].numpy(), rtol=1e-5, atol=1e-6)
    sequences = {"bag": tf.ragged.constant([[1, 2, 3], [], [6]], dtype=tf.int64)}  # 4 rows = no multiple of 3
    with pytest.raises(ValueError, match="Output shape set in the FeatureConfig should be the factor"):
        embedding(sequences)
    sequences = {"bag": tf.ragged.constant([[1, 2, 3], [6]], dtype=tf.int64)}  # 4 rows of 2 samples: sequences of 2
    expected = tf_serving_reference(sequences, None, embedding, feature_config)
    got = tf.function(embedding.embedding_lookup)(sequences)
    assert got["bag"].shape == [2, 2, DIM]
    np.testing.assert_allclose(got["bag"].numpy(), expected["bag"].numpy(), rtol=1e-6)


def test_serving_function_with_an_input_signature_serves_any_batch_size():
    feature_config, _, _ = tf_feature_config("sqrtn")
    embedding = TPUEmbeddingForServing(feature_config, E.SGD(0.1))
    signature = {"watched": tf.TensorSpec([None], tf.int32),
                 "favorited": tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64),
                 "friends": tf.SparseTensorSpec([None, 3], tf.int64)}

    @tf.function(input_signature=[signature])
    def serve_tensors(embedding_features):  # TensorFlow's serving example, with the class swapped
        return embedding(embedding_features)

    assert {k: v.shape.as_list() for k, v in serve_tensors.get_concrete_function().structured_outputs.items()} == \
        {k: [None, DIM] for k in signature}
    features, _ = tf_features()
    for batch in (1, B):
        part = {"watched": features["watched"][:batch], "favorited": features["favorited"][:batch],
                "friends": tf.sparse.slice(features["friends"], [0, 0], [batch, 3])}
        part["friends"] = tf.SparseTensor(part["friends"].indices, part["friends"].values, [batch, 3])
        expected = tf_serving_reference(part, None, embedding, feature_config)
        got = serve_tensors(part)
        for k in expected:
            np.testing.assert_allclose(got[k].numpy(), expected[k].numpy(), rtol=1e-5, atol=1e-6)


def test_serving_looks_up_a_subset_of_the_features_by_path():
    feature_config, _, _ = tf_feature_config("mean")
    embedding = TPUEmbeddingForServing(feature_config, E.SGD(0.1))
    features, weights = tf_features()
    subset = {"friends": features["friends"], "watched": features["watched"]}
    subset_weights = {"friends": weights["friends"], "watched": None}
    expected = tf_serving_reference(subset, subset_weights, embedding, feature_config)
    got = tf.function(embedding.embedding_lookup)(subset, subset_weights)
    assert set(got) == {"friends", "watched"}
    for k in expected:
        np.testing.assert_allclose(got[k].numpy(), expected[k].numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Inputs are not a subset of feature_config"):
        embedding({"elsewhere": features["watched"]})


def test_serving_errors_are_tensorflows():
    feature_config, _, _ = tf_feature_config()
    feature_config["seq"] = E.FeatureConfig(table=feature_config["favorited"].table, max_sequence_length=2)
    embedding = TPUEmbeddingForServing(feature_config, E.SGD(0.1))
    features, weights = tf_features()
    features["seq"] = tf.ragged.constant([[1], [2], [], [3, 4, 5]], dtype=tf.int64)
    weights["seq"] = None
    with pytest.raises(ValueError, match="Weight specified for watched, but input is dense"):
        embedding(features, dict(weights, watched=tf.ones([B])))
    with pytest.raises(ValueError, match="Weight for friends is of type .* but it does not match type of the input"):
        embedding(features, dict(weights, friends=tf.ones([B, 3])))
    with pytest.raises(ValueError, match="Weight specified for seq, but this is a sequence feature"):
        embedding(features, dict(weights, seq=tf.ragged.constant([[1.0], [1.0], [], [1.0, 1.0, 1.0]])))
    with pytest.raises(ValueError, match="Feature seq is a sequence feature but a dense tensor was passed"):
        embedding(dict(features, seq=tf.constant([1, 2, 3, 4])), weights)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bags=st.lists(st.lists(st.integers(0, 2), max_size=4), min_size=1, max_size=6),
       data=st.data(), combiner=st.sampled_from(["sum", "mean", "sqrtn"]))
def test_serving_ragged_and_sparse_bags_match_the_oracle(bags, data, combiner):
    embedding = _tiny_serving_engines()[combiner]
    weights = [[data.draw(st.floats(0.25, 4.0)) for _ in ids] for ids in bags]
    width = max(1, max(len(ids) for ids in bags))
    ragged = tf.ragged.constant(bags, dtype=tf.int64, ragged_rank=1) if any(bags) else \
        tf.RaggedTensor.from_row_lengths(tf.zeros([0], tf.int64), [0] * len(bags))
    ragged_w = tf.RaggedTensor.from_row_splits(tf.constant([x for w in weights for x in w], tf.float32),
                                               ragged.row_splits)
    sparse, sparse_w = sparse_from_samples(bags, width, weights)
    got = embedding({"r": ragged, "s": sparse}, {"r": ragged_w, "s": sparse_w})
    rows = embedding.engine.embedding_tables["tiny"]
    expected = bag_oracle(rows, bags, weights, combiner)
    np.testing.assert_allclose(got["r"].numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["s"].numpy(), expected, rtol=1e-5, atol=1e-6)


_TINY = {}


def _tiny_serving_engines():
    """A 3-row vocabulary per combiner (built once: engines compile their kernels)."""
    if not _TINY:
        for combiner in ("sum", "mean", "sqrtn"):
            table = E.TableConfig(vocabulary_size=3, dim=2, name="tiny", combiner=combiner)
            _TINY[combiner] = TPUEmbeddingForServing({"r": E.FeatureConfig(table=table),
                                                      "s": E.FeatureConfig(table=table)}, E.SGD(0.1))
    return _TINY


def test_embedcore_configs_pass_through():
    table = ec.TableConfig(V_USER, DIM, name="own", combiner="sum")
    embedding = TPUEmbedding({"f": ec.FeatureConfig(table)}, ec.SGD(0.5))
    assert set(embedding.embedding_tables) == {table}
    before = embedding.embedding_tables[table].numpy()
    embedding.enqueue({"f": tf.ragged.constant([[1, 1], [2]], dtype=tf.int64)})
    acts = embedding.dequeue()
    embedding.apply_gradients({"f": tf.ones_like(acts["f"])})
    expected = sgd_oracle(before, [[1, 1], [2]], None, "sum", np.ones((2, DIM)), 0.5)
    np.testing.assert_allclose(embedding.embedding_tables[table].numpy(), expected, rtol=1e-6)


def test_high_rank_ids_dense_and_sparse_in_tf_function():
    table = E.TableConfig(vocabulary_size=V_USER, dim=DIM, name="user", combiner="sum")
    feature_config = {"dense": E.FeatureConfig(table=table), "sparse": E.FeatureConfig(table=table)}
    embedding = TPUEmbedding(feature_config, E.SGD(0.25))
    rows = embedding.engine.embedding_tables["user"].copy()
    dense = np.asarray([[[1], [2], [6]], [[0], [0], [3]]])          # [B=2, L=3, 1]: TPU reduces the last 1
    bags = {(0, 0): [1, 5], (0, 2): [4], (1, 1): [2, 2, 3]}         # sparse [2, 3, 3]
    indices = [[b, l, k] for (b, l), ids in sorted(bags.items()) for k in range(len(ids))]
    values = [i for _, ids in sorted(bags.items()) for i in ids]
    sparse = tf.SparseTensor(indices, tf.constant(values, tf.int64), [2, 3, 3])
    d_act = RNG.standard_normal((2, 3, DIM)).astype(np.float32)

    @tf.function
    def step(features):
        embedding.enqueue(features, training=True)
        with tf.GradientTape() as tape:
            acts = embedding.dequeue()
            tape.watch(acts)
            loss = tf.reduce_sum(acts["dense"] * d_act) + tf.reduce_sum(acts["sparse"] * d_act)
        embedding.apply_gradients(tape.gradient(loss, acts))
        return acts

    acts = step({"dense": tf.constant(dense), "sparse": sparse})
    assert acts["dense"].shape == [2, 3, DIM] and acts["sparse"].shape == [2, 3, DIM]
    np.testing.assert_allclose(acts["dense"].numpy(), rows[dense[..., 0]], rtol=1e-6)
    samples = [bags.get((b, l), []) for b in range(2) for l in range(3)]
    np.testing.assert_allclose(acts["sparse"].numpy().reshape(6, DIM), bag_oracle(rows, samples, None, "sum"),
                               rtol=1e-5, atol=1e-6)
    flat_d = d_act.reshape(6, DIM)
    expected = sgd_oracle(rows, [[i] for i in dense.reshape(-1)], None, "sum", flat_d, 0.25)
    expected = expected - (rows - sgd_oracle(rows, samples, None, "sum", flat_d, 0.25))
    np.testing.assert_allclose(embedding.embedding_tables[table].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_tpu_embedding_v2_indexed_slices_gradients_and_sequence_features():
    table = E.TableConfig(vocabulary_size=V_USER, dim=DIM, name="user", combiner="mean")
    feature_config = {"bag": E.FeatureConfig(table=table), "seq": E.FeatureConfig(table=table, max_sequence_length=2)}
    embedding = TPUEmbeddingV2(feature_config, E.SGD(0.5))
    oracle = copy.deepcopy(embedding.engine)
    bags = [[1, 2, 3], [4], [], [5, 5]]
    features = {"bag": tf.ragged.constant(bags, dtype=tf.int64), "seq": sparse_from_samples(bags, 3)[0]}

    @tf.function
    def step(features):
        with tf.GradientTape() as tape:
            activations, preserved_outputs = embedding(features)
            tape.watch(activations)
            # a gather makes the bag's gradient tf.IndexedSlices
            loss = tf.reduce_sum(tf.gather(activations["bag"], [0, 3, 3])) + tf.reduce_sum(activations["seq"] * 2.0)
        gradients = tape.gradient(loss, activations)
        embedding.apply_gradients(gradients, preserved_outputs)
        return activations

    acts = step(features)
    assert acts["seq"].shape == [B, 2, DIM]
    d_bag = np.zeros((B, DIM), np.float32)
    d_bag[0], d_bag[3] = 1, 2
    expected, ctx = oracle.lookup({"bag": ec.Ragged.from_lists(bags), "seq": ec.Ragged.from_lists(bags)})
    np.testing.assert_allclose(acts["seq"].numpy(), expected["seq"], rtol=1e-6)
    oracle.apply_gradients({"bag": d_bag, "seq": np.full((B, 2, DIM), 2.0, np.float32)}, ctx)
    np.testing.assert_allclose(embedding.engine.embedding_tables["user"], oracle.embedding_tables["user"], rtol=1e-6)


def test_tpu_embedding_build_shapes_are_checked():
    feature_config, _, _ = tf_feature_config()
    embedding = TPUEmbedding(feature_config, E.SGD(0.1))
    embedding.build(per_replica_input_shapes={"watched": tf.TensorShape([B]), "favorited": tf.TensorShape([B, None]),
                                              "friends": tf.TensorShape([B, 3])})
    features, weights = tf_features()
    embedding.enqueue(features, weights)
    embedding.dequeue()
    short = {"watched": features["watched"][:2], "favorited": features["favorited"][:2],
             "friends": tf.sparse.slice(features["friends"], [0, 0], [2, 3])}
    with pytest.raises(ValueError, match="Inconsistent shape founded for input feature"):
        embedding.enqueue(short)


_TRAINING = {}


def _tiny_training_engine(combiner):
    """One TPUEmbedding per combiner over a 3-row table (built once; each example checks one step's change)."""
    if combiner not in _TRAINING:
        table = E.TableConfig(vocabulary_size=3, dim=2, name="tiny", combiner=combiner)
        _TRAINING[combiner] = TPUEmbedding({"s": E.FeatureConfig(table=table), "r": E.FeatureConfig(table=table)},
                                           E.SGD(0.5))
    return _TRAINING[combiner]


@settings(max_examples=25, deadline=None)
@given(bags=st.lists(st.lists(st.integers(0, 2), max_size=4), min_size=1, max_size=5),
       data=st.data(), combiner=st.sampled_from(["sum", "mean", "sqrtn"]))
def test_tpu_embedding_one_sgd_step_on_random_bags(bags, data, combiner):
    embedding = _tiny_training_engine(combiner)
    weights = [[data.draw(st.floats(0.25, 4.0)) for _ in ids] for ids in bags]
    d_s = np.asarray(data.draw(st.lists(st.floats(-2, 2), min_size=2 * len(bags), max_size=2 * len(bags))),
                     np.float32).reshape(-1, 2)
    d_r = -0.5 * d_s[::-1].copy()
    width = max(1, max(len(ids) for ids in bags))
    sparse, sparse_w = sparse_from_samples(bags, width, weights)
    ragged = tf.RaggedTensor.from_row_lengths(tf.constant([i for ids in bags for i in ids], tf.int64),
                                              [len(ids) for ids in bags])
    rows = embedding.engine.embedding_tables["tiny"].copy()
    embedding.enqueue({"s": sparse, "r": ragged}, {"s": sparse_w, "r": None})
    acts = embedding.dequeue()
    np.testing.assert_allclose(acts["s"].numpy(), bag_oracle(rows, bags, weights, combiner), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acts["r"].numpy(), bag_oracle(rows, bags, None, combiner), rtol=1e-5, atol=1e-6)
    embedding.apply_gradients({"s": tf.constant(d_s), "r": tf.constant(d_r)})
    expected = sgd_oracle(rows, bags, weights, combiner, d_s, 0.5)
    expected = expected - (rows - sgd_oracle(rows, bags, None, combiner, d_r, 0.5))
    np.testing.assert_allclose(embedding.embedding_tables[embedding_table(embedding)].numpy(), expected,
                               rtol=1e-4, atol=1e-5)


def embedding_table(embedding):
    (table,) = embedding.embedding_tables
    return table


@pytest.mark.parametrize("front", ["v2", "tpu_embedding", "keras"])
def test_ops_run_plain_python_not_autograph_converted_code(front, monkeypatch):
    """The Python the lookup and update ops call each step is the module's own, not autograph's conversion
    of it (converted code routes every call through autograph at run time): traced under autograph (the
    tf.function default), each front's ops hold functions from embedcore's source files."""
    from embedcore.tensorflow.keras import EmbeddingLayer
    feature_config, _, _ = tf_feature_config()
    features, weights = tf_features()
    called = []
    numpy_function = tf.numpy_function

    def recording(func, inp, Tout, stateful=True, name=None):
        called.append(func)
        return numpy_function(func, inp, Tout, stateful=stateful, name=name)

    monkeypatch.setattr(tf, "numpy_function", recording)
    if front == "v2":
        embedding = TPUEmbeddingV2(feature_config, E.SGD(0.1))

        def step():
            with tf.GradientTape() as tape:
                activations, preserved = embedding(features, weights)
                tape.watch(activations)
                loss = model_loss(activations)
            embedding.apply_gradients(tape.gradient(loss, activations), preserved)
    elif front == "tpu_embedding":
        embedding = TPUEmbedding(feature_config, E.SGD(0.1))

        def step():
            embedding.enqueue(features, weights=weights, training=True)
            with tf.GradientTape() as tape:
                activations = embedding.dequeue()
                tape.watch(activations)
                loss = model_loss(activations)
            embedding.apply_gradients(tape.gradient(loss, activations))
    else:
        layer = EmbeddingLayer(feature_config, E.SGD(0.1))

        def step():
            with tf.GradientTape() as tape:
                loss = model_loss(layer(features, weights, training=True))
            tape.gradient(loss, layer.trainable_variables)

    tf.function(step, autograph=True)()
    assert len(called) == 2  # the lookup and the update
    for func in called:
        assert func.__code__.co_filename.endswith(os.path.join("embedcore", "tensorflow", "graph.py")), \
            f"{func.__qualname__} runs code from {func.__code__.co_filename}"
