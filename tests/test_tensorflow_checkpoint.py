"""Checkpoints move between TensorFlow's TPU embedding engines and embedcore, both ways.

TensorFlow is the oracle: its own engines (``TPUEmbeddingForServing``, and ``TPUEmbedding`` on CPU, also
with the variable creator it shards tables with on TPU) write the checkpoints read here and restore the
ones written here, and every value is compared with the variables TensorFlow holds. The SparseCore
(``TPUEmbeddingV2``) layout is checked against TensorFlow's own serving reader of that layout. The
drop-ins of ``embedcore.tensorflow`` are checked as trackables: TensorFlow's documented checkpoint examples
with only the class swapped, ``tf.train.Checkpoint`` round trips with TensorFlow's engines both ways, and
refusals that leave the engine unchanged.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="needs the tensorflow extra: pip install 'embedcore[tensorflow]'")

import embedcore as ec  # noqa: E402
from embedcore.tensorflow import engines  # noqa: E402
from embedcore.tensorflow.checkpoint import (as_trackable, load_tf_checkpoint, save_tf_checkpoint,  # noqa: E402
                                             tf_table_names)

E = tf.tpu.experimental.embedding
from hypothesis import given, settings, strategies as st  # noqa: E402


# -- the same model in TensorFlow and in embedcore ---------------------------------------------------------
# name -> (vocabulary_size, dim, optimizer kind); "video" is shared by two features
TABLES = {"video": (7, 3, "adagrad"), "user": (5, 4, "adam"), "bias": (4, 2, "sgd")}
FEATURES = {"watched": "video", "liked": "video", "who": "user", "b": "bias"}


def tf_optimizer(kind):
    return {"adagrad": E.Adagrad(0.1), "adam": E.Adam(0.1), "sgd": E.SGD(0.1), "ftrl": E.FTRL(0.1),
            None: None}[kind]


def ec_optimizer(kind):
    return {"adagrad": ec.Adagrad(0.1), "adam": ec.Adam(0.1), "sgd": ec.SGD(0.1), "ftrl": ec.FTRL(0.1),
            None: None}[kind]


def tf_features(tables=TABLES, features=FEATURES, named=True, kinds=None):
    configs = {name: E.TableConfig(vocabulary_size=v, dim=d, name=name if named else None,
                                   optimizer=tf_optimizer(kinds.get(name, k) if kinds else k),
                                   initializer=tf.random_uniform_initializer(-1, 1, seed=i))
               for i, (name, (v, d, k)) in enumerate(tables.items())}
    return {f: E.FeatureConfig(table=configs[t], name=f) for f, t in features.items()}


def ec_features(tables=TABLES, features=FEATURES, names=None, kinds=None, **table_options):
    configs = {name: ec.TableConfig(v, d, name=(names or {}).get(name, name),
                                    optimizer=ec_optimizer(kinds.get(name, k) if kinds else k), **table_options)
               for name, (v, d, k) in tables.items()}
    return {f: ec.FeatureConfig(configs[t], name=f) for f, t in features.items()}


def randomize(tf_engine, seed=0):
    """Give every TensorFlow table and slot distinct random values (slots positive, as accumulators are)."""
    rng = np.random.default_rng(seed)
    for table in tf_engine._variables.values():
        for name, variable in table.items():
            values = rng.standard_normal(variable.shape).astype(np.float32)
            variable.assign(values if name == "parameters" else np.abs(values) + 0.5)


def tf_values(tf_engine):
    """Table name -> {"parameters" or slot: array} of a TensorFlow engine (sharded variables assembled)."""
    def value(v):
        return np.concatenate([s.numpy() for s in v.variables]) if hasattr(v, "variables") else v.numpy()
    return {t: {k: value(v) for k, v in d.items()} for t, d in tf_engine._variables.items()}


def ec_values(emb):
    return {t: {"parameters": emb.embedding_tables[t], **emb.slot_variables[t]} for t in emb.tables}


def assert_same(tf_side, ec_side, names=None):
    names = names or {t: t for t in ec_side}
    assert sorted(tf_side) == sorted(names[t] for t in ec_side)
    for own, theirs in names.items():
        assert sorted(tf_side[theirs]) == sorted(ec_side[own]), own
        for key in ec_side[own]:
            np.testing.assert_array_equal(ec_side[own][key], tf_side[theirs][key], err_msg=f"{own} {key}")


def tf_written(tmp_path, engine_class=E.TPUEmbeddingForServing, hosts=None, seed=0, **features):
    """A TensorFlow engine, built (sharded over ``hosts`` CPU devices as on TPU if given), randomized and
    checkpointed: ``(engine, prefix)``."""
    engine = engine_class(tf_features(**features), E.SGD(0.1))
    if hosts:
        from tensorflow.python.ops import variable_scope
        from tensorflow.python.tpu import tpu_embedding_v2
        with variable_scope.variable_creator_scope(tpu_embedding_v2.make_sharded_variable_creator(
                ["/cpu:0"] * hosts)):
            engine.build()
    else:
        engine.build()
    randomize(engine, seed)
    return engine, tf.train.Checkpoint(embedding=engine).write(str(tmp_path / "tf" / "ckpt"))


def snapshot(emb):
    return {t: {k: v.copy() for k, v in d.items()} for t, d in ec_values(emb).items()}, emb.step


def assert_unchanged(emb, before):
    values, step = before
    assert emb.step == step
    assert_same(values, ec_values(emb))


# -- TensorFlow -> embedcore -------------------------------------------------------------------------------
@pytest.mark.parametrize("engine_class", [E.TPUEmbeddingForServing, E.TPUEmbedding])
def test_reads_every_table_and_slot_tensorflow_wrote(tmp_path, engine_class):
    tf_engine, prefix = tf_written(tmp_path, engine_class)
    emb = ec.Embedding(ec_features())
    emb.step = 3
    assert load_tf_checkpoint(emb, prefix) == prefix
    assert_same(tf_values(tf_engine), ec_values(emb))
    assert set(emb.slot_variables["user"]) == {"momenta", "velocities"}
    assert emb.step == 3  # TensorFlow does not store it
    load_tf_checkpoint(emb, prefix, step=11)
    assert emb.step == 11


@pytest.mark.parametrize("hosts", [2, 3, 9])
def test_reads_tables_sharded_over_hosts_as_on_tpu(tmp_path, hosts):
    """On TPU, TPUEmbedding shards every variable into row blocks over the hosts (9 hosts: more than some
    tables' rows, so some blocks are absent); the checkpoint holds them as slices."""
    tf_engine, prefix = tf_written(tmp_path, E.TPUEmbedding, hosts=hosts)
    assert len(tf_engine._variables["video"]["parameters"].variables) == min(hosts, 7)
    emb = ec.Embedding(ec_features())
    load_tf_checkpoint(emb, tmp_path / "tf" / "ckpt")
    assert_same(tf_values(tf_engine), ec_values(emb))


def test_a_directory_with_a_checkpoint_file_reads_the_latest(tmp_path):
    tf_engine = E.TPUEmbeddingForServing(tf_features(), E.SGD(0.1))
    tf_engine.build()
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(embedding=tf_engine), str(tmp_path), max_to_keep=2)
    randomize(tf_engine, 1)
    manager.save()
    randomize(tf_engine, 2)
    latest = manager.save()
    emb = ec.Embedding(ec_features())
    assert load_tf_checkpoint(emb, tmp_path) == latest
    assert_same(tf_values(tf_engine), ec_values(emb))


def test_unnamed_tensorflow_tables_map_through_the_feature_config(tmp_path):
    tf_config = tf_features(named=False)
    assert tf_table_names(tf_config) == ["table_0", "table_1", "table_2"]  # "b" (bias) sorts first, then liked
    tf_engine = E.TPUEmbeddingForServing(tf_features(named=False), E.SGD(0.1))
    tf_engine.build()
    randomize(tf_engine)
    prefix = tf.train.Checkpoint(embedding=tf_engine).write(str(tmp_path / "ckpt"))
    emb = ec.Embedding(ec_features())
    with pytest.raises(ec.CheckpointError, match=r"no table \['bias', 'user', 'video'\]"):
        load_tf_checkpoint(emb, prefix)
    load_tf_checkpoint(emb, prefix, feature_config=tf_config)
    assert_same(tf_values(tf_engine), ec_values(emb), {"bias": "table_0", "video": "table_1", "user": "table_2"})


def test_the_embedding_is_found_beside_a_model_and_chosen_by_path(tmp_path):
    tf_engine, _ = tf_written(tmp_path)
    other, _ = tf_written(tmp_path, seed=5)
    dense = tf.Variable(np.ones((3, 2), np.float32))
    prefix = tf.train.Checkpoint(model=tf.train.Checkpoint(kernel=dense, tower=other),
                                 embedding=tf_engine).write(str(tmp_path / "both"))
    emb = ec.Embedding(ec_features())
    with pytest.raises(ec.CheckpointError, match=r"2 TPU embedding objects, \['embedding', 'model/tower'\]"):
        load_tf_checkpoint(emb, prefix)
    load_tf_checkpoint(emb, prefix, object_path="model/tower")
    assert_same(tf_values(other), ec_values(emb))
    load_tf_checkpoint(emb, prefix, object_path="embedding")
    assert_same(tf_values(tf_engine), ec_values(emb))


def test_16_bit_tables_take_rounded_values_only_when_asked(tmp_path):
    tf_engine, prefix = tf_written(tmp_path)
    emb = ec.Embedding(ec_features(weights_dtype="bfloat16"))
    before = snapshot(emb)
    with pytest.raises(ec.CheckpointError, match="table 'video' is stored as float32, the engine's is bfloat16"):
        load_tf_checkpoint(emb, prefix)
    assert_unchanged(emb, before)
    load_tf_checkpoint(emb, prefix, convert_dtypes=True)
    expected = tf_values(tf_engine)
    for name in TABLES:
        np.testing.assert_array_equal(emb.embedding_tables[name],
                                      expected[name]["parameters"].astype(emb.embedding_tables[name].dtype))
        np.testing.assert_array_equal(emb.slot_variables[name].get("accumulators", 0),
                                      expected[name].get("accumulators", 0))
    # written back as float32, exactly the 16-bit values
    back = E.TPUEmbeddingForServing(tf_features(), E.SGD(0.1))
    back.build()
    tf.train.Checkpoint(embedding=back).read(save_tf_checkpoint(emb, tmp_path / "ec")).assert_consumed()
    for name in TABLES:
        np.testing.assert_array_equal(back.variables[name]["parameters"].numpy(),
                                      emb.embedding_tables[name].astype(np.float32))


# -- embedcore -> TensorFlow -------------------------------------------------------------------------------
def trained_engine(seed=0, **options):
    """An embedcore engine after some training steps (every table and slot away from its initial value)."""
    emb = ec.Embedding(ec_features(**options), seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        batch = {f: rng.integers(0, TABLES[t][0], size=(6, 2)) for f, t in FEATURES.items()}
        acts, ctx = emb(batch)
        emb.apply_gradients({f: rng.standard_normal(a.shape).astype(np.float32) for f, a in acts.items()}, ctx)
    return emb


@pytest.mark.parametrize("engine_class", [E.TPUEmbeddingForServing, E.TPUEmbedding])
@pytest.mark.parametrize("restore_first", [True, False])
def test_tensorflow_restores_what_embedcore_wrote(tmp_path, engine_class, restore_first):
    """TensorFlow restores both before building (its deferred restore at variable creation) and after."""
    emb = trained_engine()
    prefix = save_tf_checkpoint(emb, tmp_path / "ec")
    tf_engine = engine_class(tf_features(), E.SGD(0.1))
    checkpoint = tf.train.Checkpoint(embedding=tf_engine)
    if restore_first:
        status = checkpoint.read(prefix)
        tf_engine.build()
    else:
        tf_engine.build()
        status = checkpoint.read(prefix)
    status.assert_consumed()
    assert_same(tf_values(tf_engine), ec_values(emb))
    # TensorFlow's serving lookup of the restored tables (one id per example) is embedcore's
    ids = np.array([0, 6, 2, 2, 5])
    if engine_class is E.TPUEmbeddingForServing:
        features = {f: tf.constant(ids % TABLES[t][0]) for f, t in FEATURES.items()}
        tf_acts = tf_engine(features)
        ec_acts, _ = emb({f: ids % TABLES[t][0] for f, t in FEATURES.items()})
        for f in FEATURES:
            np.testing.assert_allclose(tf_acts[f].numpy(), ec_acts[f], rtol=1e-6, atol=1e-6)


def test_round_trip_tensorflow_embedcore_tensorflow_is_exact(tmp_path):
    tf_engine, prefix = tf_written(tmp_path, E.TPUEmbedding, hosts=3)
    emb = ec.Embedding(ec_features())
    load_tf_checkpoint(emb, prefix)
    back = save_tf_checkpoint(emb, tmp_path / "back" / "ckpt")
    again = E.TPUEmbeddingForServing(tf_features(), E.SGD(0.1))
    status = tf.train.Checkpoint(embedding=again).read(back)
    again.build()
    status.assert_consumed()
    assert_same(tf_values(tf_engine), tf_values(again))
    # and back into embedcore, bit for bit
    twice = ec.Embedding(ec_features(), seed=9)
    load_tf_checkpoint(twice, back)
    assert_same(ec_values(emb), ec_values(twice))


def test_tables_saved_beside_a_model_and_under_tensorflow_names(tmp_path):
    emb = trained_engine(1)
    dense = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2))
    tf_config = tf_features(named=False)
    prefix = tf.train.Checkpoint(model=dense, embedding=as_trackable(emb, tf_config)).write(str(tmp_path / "m"))
    tf_engine = E.TPUEmbeddingForServing(tf_config, E.SGD(0.1))
    restored_dense = tf.Variable(np.zeros((3, 2), np.float32))
    tf.train.Checkpoint(model=restored_dense, embedding=tf_engine).restore(prefix)
    tf_engine.build()
    np.testing.assert_array_equal(restored_dense.numpy(), dense.numpy())
    assert_same(tf_values(tf_engine), ec_values(emb), {"bias": "table_0", "video": "table_1", "user": "table_2"})


def test_serving_tables_alone(tmp_path):
    emb = trained_engine(2)
    prefix = save_tf_checkpoint(emb, tmp_path / "serve", include_slots=False)
    tf_engine = E.TPUEmbeddingForServing(tf_features(kinds={"video": None, "user": None, "bias": None}), None)
    status = tf.train.Checkpoint(embedding=tf_engine).read(prefix)
    tf_engine.build()
    status.assert_consumed()
    for name in TABLES:
        np.testing.assert_array_equal(tf_engine.variables[name]["parameters"].numpy(), emb.embedding_tables[name])
    # a serving checkpoint has no slots: a training engine reads its tables alone
    fresh = ec.Embedding(ec_features())
    with pytest.raises(ec.CheckpointError, match="table 'video' has no slot 'accumulators'"):
        load_tf_checkpoint(fresh, prefix)
    slots_before = {t: {k: v.copy() for k, v in d.items()} for t, d in fresh.slot_variables.items()}
    load_tf_checkpoint(fresh, prefix, tables_only=True)
    for name in TABLES:
        np.testing.assert_array_equal(fresh.embedding_tables[name], emb.embedding_tables[name])
        for slot, rows in slots_before[name].items():
            np.testing.assert_array_equal(fresh.slot_variables[name][slot], rows)


def test_row_wise_slots_have_no_tensorflow_form(tmp_path):
    table = ec.TableConfig(6, 4, name="rw", optimizer=ec.RowwiseAdagrad(0.1))
    emb = ec.Embedding({"f": ec.FeatureConfig(table)})
    with pytest.raises(ec.CheckpointError, match=r"table 'rw' slot 'accumulators' has shape \[6\]"):
        save_tf_checkpoint(emb, tmp_path / "rw")
    assert not any(tmp_path.iterdir())
    prefix = save_tf_checkpoint(emb, tmp_path / "rw", include_slots=False)
    assert tf.train.load_checkpoint(prefix).get_tensor("embedding/rw/.ATTRIBUTES/VARIABLE_VALUE").shape == (6, 4)


@settings(max_examples=12, deadline=None)
@given(vocabulary=st.integers(1, 9), dim=st.integers(1, 5), hosts=st.integers(1, 4), seed=st.integers(0, 99),
       kind=st.sampled_from(["adagrad", "adam", "ftrl", "sgd"]))
def test_property_any_shape_and_sharding_round_trips(tmp_path_factory, vocabulary, dim, hosts, seed, kind):
    tmp_path = tmp_path_factory.mktemp("prop")
    tables, features = {"t": (vocabulary, dim, kind)}, {"f": "t"}
    tf_engine, prefix = tf_written(tmp_path, E.TPUEmbedding, hosts=hosts, seed=seed, tables=tables,
                                   features=features)
    emb = ec.Embedding(ec_features(tables, features))
    load_tf_checkpoint(emb, prefix)
    assert_same(tf_values(tf_engine), ec_values(emb))
    again = E.TPUEmbedding(tf_features(tables, features), E.SGD(0.1))
    again.build()
    tf.train.Checkpoint(embedding=again).read(save_tf_checkpoint(emb, tmp_path / "ec")).assert_consumed()
    assert_same(tf_values(tf_engine), tf_values(again))


# -- refusals: named, and nothing changes ------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (dict(tables={**TABLES, "video": (8, 3, "adagrad")}),
     r"table 'video' has shape \[8, 3\], the engine's has \[7, 3\]; table 'video' slot 'accumulators' has shape"),
    (dict(kinds={"user": "adagrad"}),
     r"table 'user' has no slot 'momenta'.*table 'user' has a slot 'accumulators' that the engine's optimizer"),
    (dict(tables={k: v for k, v in TABLES.items() if k != "bias"},
          features={k: v for k, v in FEATURES.items() if k != "b"}), r"no table \['bias'\]"),
    (dict(tables={**TABLES, "extra": (3, 3, "sgd")}, features={**FEATURES, "x": "extra"}),
     r"tables \['extra'\] that the engine does not have"),
])
def test_a_mismatched_checkpoint_is_refused_naming_table_and_slot(tmp_path, change, message):
    _, prefix = tf_written(tmp_path, **change)
    emb = trained_engine()
    before = snapshot(emb)
    with pytest.raises(ec.CheckpointError, match=message) as raised:
        load_tf_checkpoint(emb, prefix)
    assert "nothing was changed" in str(raised.value)
    assert_unchanged(emb, before)


def test_a_corrupt_or_missing_checkpoint_is_refused(tmp_path):
    _, prefix = tf_written(tmp_path)
    emb = trained_engine()
    before = snapshot(emb)
    with pytest.raises(ec.CheckpointError, match="cannot read a TensorFlow checkpoint"):
        load_tf_checkpoint(emb, tmp_path / "nothing" / "here")
    with pytest.raises(ec.CheckpointError, match="no TensorFlow checkpoint in the directory"):
        load_tf_checkpoint(emb, tmp_path)
    data = prefix + ".data-00000-of-00001"
    raw = bytearray(open(data, "rb").read())
    raw[0] ^= 0xFF  # one flipped byte of the first table or slot (the object graph comes last)
    open(data, "wb").write(bytes(raw))
    with pytest.raises(ec.CheckpointError, match=r"table '\w+'( slot '\w+')? \(embedding/.*\) cannot be read"):
        load_tf_checkpoint(emb, prefix)
    open(data, "wb").write(bytes(raw[:len(raw) // 3]))  # truncated
    with pytest.raises(ec.CheckpointError, match="cannot be read|cannot read"):
        load_tf_checkpoint(emb, prefix)
    open(prefix + ".index", "wb").write(b"not an index")
    with pytest.raises(ec.CheckpointError, match="cannot read a TensorFlow checkpoint"):
        load_tf_checkpoint(emb, prefix)
    assert_unchanged(emb, before)


def test_non_finite_values_and_unrelated_checkpoints_are_refused(tmp_path):
    tf_engine, _ = tf_written(tmp_path)
    tf_engine._variables["user"]["velocities"].assign(np.full((5, 4), np.inf, np.float32))
    prefix = tf.train.Checkpoint(embedding=tf_engine).write(str(tmp_path / "inf"))
    emb = trained_engine()
    before = snapshot(emb)
    with pytest.raises(ec.CheckpointError, match="table 'user' slot 'velocities' holds NaN or Inf"):
        load_tf_checkpoint(emb, prefix)
    plain = tf.train.Checkpoint(w=tf.Variable([1.0])).write(str(tmp_path / "plain"))
    with pytest.raises(ec.CheckpointError, match="holds no tables of a TensorFlow TPU embedding engine"):
        load_tf_checkpoint(emb, plain)
    with pytest.raises(ec.CheckpointError, match="no TPU embedding object at 'model'"):
        load_tf_checkpoint(emb, prefix, object_path="model")
    with pytest.raises(ec.CheckpointError, match="is 7 x 3, but the engine's table in its place, 'bias', is 4 x 2"):
        load_tf_checkpoint(emb, prefix, feature_config=tf_features(tables={"v": (7, 3, "sgd"), "u": (5, 4, "sgd"),
                                                                            "a": (4, 2, "sgd")},
                                                                    features={"a": "v", "b": "u", "c": "a"}))
    with pytest.raises(TypeError, match="engine must be an embedcore.Embedding"):
        load_tf_checkpoint(object(), prefix)
    assert_unchanged(emb, before)


# -- SparseCore (TPUEmbeddingV2) stacked tables ------------------------------------------------------------
def sparse_core_checkpoint(tmp_path, tables, cores, seed=0):
    """A checkpoint laid out as TPUEmbeddingV2 writes one (TensorFlow cannot build that engine off TPU):
    ``tables`` (name -> (vocabulary, dim)) stacked into one variable of the widest dim padded to 8 columns,
    each table's rows padded to a multiple of ``cores`` and dealt round-robin over the cores, rotated by
    its position; with an Adagrad slot of the same layout. Returns the prefix and the tables' rows."""
    from tensorflow.core.tpu.kernels import sparse_core_layout_pb2
    rng = np.random.default_rng(seed)
    width = 8
    layouts, per_core, offset = sparse_core_layout_pb2.SparseCoreTableLayouts(), 0, 0
    rows = {}
    for rotation, (name, (vocabulary, dim)) in enumerate(tables.items()):
        padded = -(-vocabulary // cores) * cores
        layout = layouts.tables.add(table_name=name, stacked_table_name="stacked", num_sparse_cores=cores,
                                    unsharded_shape=[vocabulary, dim], unsharded_padded_shape=[padded, width],
                                    sparse_core_shard_row_offset=offset, sparse_core_shard_rotation=rotation % cores)
        offset += padded // cores
        rows[name] = {"parameters": rng.standard_normal((vocabulary, dim)).astype(np.float32),
                      "accumulators": rng.random((vocabulary, dim)).astype(np.float32) + 0.1}
        del layout
    per_core = offset
    stacked = {k: np.full((cores, per_core, width), -99, np.float32) for k in ("parameters", "accumulators")}
    for layout in layouts.tables:
        for r in range(layout.unsharded_shape[0]):  # the layout's rule, one row at a time
            core = (r % cores + layout.sparse_core_shard_rotation) % cores
            for k in stacked:
                stacked[k][core, layout.sparse_core_shard_row_offset + r // cores, :layout.unsharded_shape[1]] = \
                    rows[layout.table_name][k][r]
    holder = tf.__internal__.tracking.AutoTrackable()
    holder.stacked = tf.Variable(stacked["parameters"].reshape(cores * per_core, width))
    setattr(holder, "stacked/accumulators", tf.Variable(stacked["accumulators"].reshape(cores * per_core, width)))
    holder._variables = {"stacked": {"parameters": holder.stacked,
                                     "accumulators": getattr(holder, "stacked/accumulators")}}
    holder._sparse_core_table_layouts = tf.Variable(layouts.SerializeToString())
    return tf.train.Checkpoint(embedding=holder).write(str(tmp_path / "sc")), rows


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_reads_sparse_core_stacked_tables_as_tensorflow_serving_does(tmp_path, cores):
    tables = {"a": (7, 3), "b": (5, 8), "c": (2, 3)}
    prefix, rows = sparse_core_checkpoint(tmp_path, tables, cores)
    emb = ec.Embedding({n: ec.FeatureConfig(ec.TableConfig(v, d, name=n, optimizer=ec.Adagrad(0.1)))
                        for n, (v, d) in tables.items()})
    load_tf_checkpoint(emb, prefix)
    assert_same(rows, ec_values(emb))
    # TensorFlow's serving engine reads the same tables out of that checkpoint
    serving = E.TPUEmbeddingForServing({n: E.FeatureConfig(E.TableConfig(vocabulary_size=v, dim=d, name=n))
                                        for n, (v, d) in tables.items()}, E.Adagrad(0.1))
    tf.train.Checkpoint(embedding=serving).restore(prefix)
    serving.build()
    for name in tables:
        np.testing.assert_array_equal(serving.embedding_tables[serving._table_config[list(tables).index(name)]]
                                      .numpy(), emb.embedding_tables[name])


# -- through embedcore's drop-ins for TensorFlow's classes -------------------------------------------------
@pytest.mark.parametrize("class_name", ["TPUEmbedding", "TPUEmbeddingV2", "TPUEmbeddingForServing"])
def test_a_tensorflow_program_moves_by_swapping_the_class(tmp_path, class_name):
    """TensorFlow's config objects (unnamed tables included), a drop-in engine: the checkpoint loads without
    a feature_config, and TensorFlow restores what the drop-in saves."""
    tf_engine = E.TPUEmbedding(tf_features(named=False), E.SGD(0.1))
    tf_engine.build()
    randomize(tf_engine, 4)
    prefix = tf.train.Checkpoint(embedding=tf_engine).write(str(tmp_path / "tf"))
    ours = getattr(engines, class_name)(tf_features(named=False), E.SGD(0.1))
    ours.build()
    load_tf_checkpoint(ours, prefix)
    assert_same(tf_values(tf_engine), ec_values(ours.engine))
    back = E.TPUEmbedding(tf_features(named=False), E.SGD(0.1))
    back.build()
    tf.train.Checkpoint(embedding=back).read(save_tf_checkpoint(ours, tmp_path / "ec")).assert_consumed()
    assert_same(tf_values(tf_engine), tf_values(back))


def test_sparse_core_tables_resaved_by_tensorflow_serving(tmp_path):
    """TensorFlow's serving class, having read a SparseCore checkpoint, saves its tables one by one beside
    the layouts: those per-table variables are read (the stacked one is only a placeholder there)."""
    tables = {"a": (7, 3), "b": (5, 8)}
    prefix, rows = sparse_core_checkpoint(tmp_path, tables, 4)
    serving = E.TPUEmbeddingForServing({n: E.FeatureConfig(E.TableConfig(vocabulary_size=v, dim=d, name=n))
                                        for n, (v, d) in tables.items()}, None)
    tf.train.Checkpoint(embedding=serving).restore(prefix)
    serving.build()
    resaved = tf.train.Checkpoint(embedding=serving).write(str(tmp_path / "resaved"))
    emb = ec.Embedding({n: ec.FeatureConfig(ec.TableConfig(v, d, name=n)) for n, (v, d) in tables.items()})
    load_tf_checkpoint(emb, resaved)
    for name in tables:
        np.testing.assert_array_equal(emb.embedding_tables[name], rows[name]["parameters"])


def test_a_load_that_would_not_fit_in_memory_is_refused_before_reading(tmp_path, monkeypatch):
    import embedcore.memory_budget as memory_budget
    _, prefix = tf_written(tmp_path)
    emb = trained_engine()
    before = snapshot(emb)
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 100)
    with pytest.raises(ec.CheckpointError, match="the tables and slots read from .* more than the 100 bytes of memory"):
        load_tf_checkpoint(emb, prefix)
    assert_unchanged(emb, before)


# -- the drop-ins are TensorFlow trackables: tf.train.Checkpoint(embedding=drop_in) ------------------------
DROP_INS = ["TPUEmbedding", "TPUEmbeddingV2", "TPUEmbeddingForServing"]


class Model(tf.Module):
    """``model_fn(...)`` of TensorFlow's examples: one variable beside the embedding."""

    def __init__(self, value=1.0):
        super().__init__()
        self.scale = tf.Variable(np.full(4, value, np.float32))


def batch(seed, size=6):
    rng = np.random.default_rng(seed)
    return {f: tf.constant(rng.integers(0, TABLES[t][0], size=size)) for f, t in FEATURES.items()}


def loss_of(activations, model):
    return tf.add_n([tf.reduce_sum(a * model.scale[:a.shape[-1]]) for a in activations.values()])


def train(embedding, model, steps=2):
    """A few steps of TensorFlow's training loop for the class (the v2 API's enqueue/dequeue, or v3's)."""
    for step in range(steps):
        features = batch(step)
        if isinstance(embedding, engines.TPUEmbedding):
            embedding.enqueue(features, training=True)
            with tf.GradientTape() as tape:
                activations = embedding.dequeue()
                tape.watch(activations)
                loss = loss_of(activations, model)
            embedding.apply_gradients(tape.gradient(loss, activations))
        else:
            with tf.GradientTape() as tape:
                activations, preserved = embedding(features)
                tape.watch(activations)
                loss = loss_of(activations, model)
            embedding.apply_gradients(tape.gradient(loss, activations), preserved)


def drop_in(class_name, **features):
    return getattr(engines, class_name)(tf_features(**features), E.SGD(0.1))


def test_tensorflows_documented_checkpoint_example_runs_verbatim(tmp_path):
    """``tpu_embedding_v2.py``'s class docstring, the class swapped: save the model and the embedding, then
    restore into a new pair and read ``embedding.embedding_tables``."""
    feature_config = tf_features()
    model = Model(2.0)
    embedding = engines.TPUEmbedding(feature_config=feature_config,
                                     optimizer=tf.tpu.experimental.embedding.SGD(0.1))
    train(embedding, model)
    saved = {k: v.copy() for k, v in embedding.engine.embedding_tables.items()}
    saved_slots = snapshot(embedding.engine)[0]

    checkpoint = tf.train.Checkpoint(model=model, embedding=embedding)
    path = checkpoint.save(str(tmp_path / "ckpt"))

    model = Model(0.0)
    embedding = engines.TPUEmbedding(feature_config=feature_config,
                                     optimizer=tf.tpu.experimental.embedding.SGD(0.1))
    checkpoint = tf.train.Checkpoint(model=model, embedding=embedding)
    checkpoint.restore(path).assert_consumed()

    tables = embedding.embedding_tables
    for table, rows in tables.items():
        np.testing.assert_array_equal(rows.numpy(), saved[table.name])
    assert_same(saved_slots, ec_values(embedding.engine))
    np.testing.assert_array_equal(model.scale.numpy(), np.full(4, 2.0, np.float32))
    # the restored pair trains on (its lookup contexts are fresh)
    train(embedding, model, steps=1)


def test_tensorflows_serving_example_runs_verbatim(tmp_path):
    """``tpu_embedding_for_serving.py``'s docstring: train with TensorFlow's TPUEmbedding (on CPU), save;
    restore into the drop-in for serving and look up: equal to a NumPy gather of TensorFlow's tables."""
    feature_config = tf_features()
    model = Model(3.0)
    embedding = tf.tpu.experimental.embedding.TPUEmbedding(
        feature_config=feature_config, optimizer=tf.tpu.experimental.embedding.SGD(0.1))
    embedding.build()
    randomize(embedding, 5)
    trained = tf_values(embedding)
    checkpoint = tf.train.Checkpoint(model=model, embedding=embedding)
    path = checkpoint.save(str(tmp_path / "ckpt"))

    model = Model(0.0)
    embedding = engines.TPUEmbeddingForServing(
        feature_config=feature_config, optimizer=tf.tpu.experimental.embedding.SGD(0.1))
    checkpoint = tf.train.Checkpoint(model=model, embedding=embedding)
    checkpoint.restore(path).assert_consumed()

    features = batch(7)
    result = embedding(features)
    for name, ids in features.items():
        np.testing.assert_array_equal(result[name].numpy(), trained[FEATURES[name]]["parameters"][ids.numpy()])
    np.testing.assert_array_equal(model.scale.numpy(), np.full(4, 3.0, np.float32))


@pytest.mark.parametrize("class_name", DROP_INS)
@pytest.mark.parametrize("tf_class", [E.TPUEmbedding, E.TPUEmbeddingForServing])
def test_tensorflow_checkpoints_restore_into_the_drop_ins(tmp_path, class_name, tf_class):
    """Adagrad and Adam slots, a table shared by two features, sharded as on TPU: every value lands in the
    engine, after build and (TensorFlow's deferred order) before it."""
    tf_engine, prefix = tf_written(tmp_path, tf_class, hosts=2 if tf_class is E.TPUEmbedding else None, seed=1)
    for restore_first in (True, False):
        ours = drop_in(class_name)
        if not restore_first:
            ours.build()
        status = tf.train.Checkpoint(embedding=ours).read(prefix)  # written by write(): no save_counter
        status.assert_consumed()
        assert_same(tf_values(tf_engine), ec_values(ours.engine))
        assert sorted(ours.engine.slot_variables["user"]) == ["momenta", "velocities"]


@pytest.mark.parametrize("class_name", DROP_INS)
@pytest.mark.parametrize("tf_class", [E.TPUEmbedding, E.TPUEmbeddingForServing])
def test_tensorflow_restores_what_the_drop_ins_save(tmp_path, class_name, tf_class):
    ours = drop_in(class_name)
    if class_name == "TPUEmbeddingForServing":
        ours.engine.set_state(slots={t: {s: rows + 0.25 for s, rows in d.items()}
                                     for t, d in ours.engine.slot_variables.items()})
        ours.engine.set_state(tables={t: rows * 2 for t, rows in ours.engine.embedding_tables.items()})
    else:
        train(ours, Model())
    prefix = tf.train.Checkpoint(embedding=ours).write(str(tmp_path / "ours"))
    for restore_first in (True, False):
        theirs = tf_class(tf_features(), E.SGD(0.1))
        if not restore_first:
            theirs.build()
        status = tf.train.Checkpoint(embedding=theirs).read(prefix)
        theirs.build()
        status.assert_consumed()
        assert_same(tf_values(theirs), ec_values(ours.engine))
    # the keys are TensorFlow's own
    keys = set(tf.train.load_checkpoint(prefix).get_variable_to_shape_map())
    assert keys == set(tf.train.load_checkpoint(tf_written(tmp_path)[1]).get_variable_to_shape_map())


def test_round_trip_between_drop_ins_saves_the_rows_of_the_moment(tmp_path):
    """Saving writes the rows as they are when saved (not when the checkpoint object was made), and a
    save -> restore -> save cycle is exact."""
    ours = drop_in("TPUEmbeddingV2")
    checkpoint = tf.train.Checkpoint(embedding=ours)
    first = checkpoint.write(str(tmp_path / "a"))
    train(ours, Model())
    trained = snapshot(ours.engine)[0]
    second = checkpoint.write(str(tmp_path / "b"))
    other = drop_in("TPUEmbedding")
    tf.train.Checkpoint(embedding=other).read(second).assert_consumed()
    assert_same(trained, ec_values(other.engine))
    tf.train.Checkpoint(embedding=other).read(first).assert_consumed()
    assert not np.array_equal(other.engine.embedding_tables["video"], trained["video"]["parameters"])
    tf.train.Checkpoint(embedding=other).read(second)
    third = tf.train.Checkpoint(embedding=other).write(str(tmp_path / "c"))
    reader_b, reader_c = tf.train.load_checkpoint(second), tf.train.load_checkpoint(third)
    for key in reader_b.get_variable_to_shape_map():
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            np.testing.assert_array_equal(reader_b.get_tensor(key), reader_c.get_tensor(key))


def test_a_serving_checkpoint_sets_the_tables_of_a_training_drop_in_before_its_next_step(tmp_path):
    """TensorFlow restores what the checkpoint holds: a tables-only checkpoint sets the tables (before the
    next lookup) and leaves the slots."""
    source = trained_engine(3)
    prefix = save_tf_checkpoint(source, tmp_path / "serve", include_slots=False)
    ours = drop_in("TPUEmbedding")
    slots = snapshot(ours.engine)[0]
    tf.train.Checkpoint(embedding=ours).restore(prefix)
    ours.enqueue(batch(0), training=False)
    for name in TABLES:
        np.testing.assert_array_equal(ours.engine.embedding_tables[name], source.embedding_tables[name])
        for slot in ours.engine.slot_variables[name]:
            np.testing.assert_array_equal(ours.engine.slot_variables[name][slot], slots[name][slot])


@pytest.mark.parametrize("class_name", DROP_INS)
def test_mismatched_or_non_finite_checkpoints_are_refused_and_change_nothing(tmp_path, class_name):
    ours = drop_in(class_name)
    ours.engine.set_state(tables={t: rows + 1 for t, rows in ours.engine.embedding_tables.items()})
    before = snapshot(ours.engine)
    _, wrong_shape = tf_written(tmp_path / "shape", tables={**TABLES, "video": (8, 3, "adagrad")})
    with pytest.raises(ec.CheckpointError, match=r"table 'video' must be a float32 array of shape \(7, 3\), got "
                                                 r"float32 of shape \(8, 3\).*table 'video' slot 'accumulators'"):
        tf.train.Checkpoint(embedding=ours).restore(wrong_shape)
    assert_unchanged(ours.engine, before)
    tf_engine, _ = tf_written(tmp_path / "inf")
    tf_engine._variables["user"]["velocities"].assign(np.full((5, 4), np.nan, np.float32))
    non_finite = tf.train.Checkpoint(embedding=tf_engine).write(str(tmp_path / "inf" / "nan"))
    with pytest.raises(ec.CheckpointError, match=rf"{class_name}: .*table 'user' slot 'velocities' holds NaN or "
                                                 rf"Inf in 5 row\(s\).*nothing was changed"):
        tf.train.Checkpoint(embedding=ours).restore(non_finite)
    assert_unchanged(ours.engine, before)
    # a refused restore leaves nothing staged: the next lookup sees the rows as they were
    ours.engine  # noqa: B018
    assert_unchanged(ours.engine, before)


def test_a_refused_deferred_restore_leaves_the_fresh_tables(tmp_path):
    """Restore before build (TensorFlow's deferred order): the drop-in builds, then refuses the checkpoint."""
    _, wrong_shape = tf_written(tmp_path, tables={**TABLES, "user": (6, 4, "adam")})
    ours = drop_in("TPUEmbeddingV2")
    with pytest.raises(ec.CheckpointError, match=r"table 'user' must be a float32 array of shape \(5, 4\)"):
        tf.train.Checkpoint(embedding=ours).restore(wrong_shape)
    fresh = drop_in("TPUEmbeddingV2")
    assert_same(ec_values(fresh.engine), ec_values(ours.engine))


def test_a_checkpoint_of_another_dtype_is_refused_by_tensorflow_naming_the_table(tmp_path):
    """TensorFlow's reader refuses a value stored as float64 for a float32 variable (its own engines' error,
    naming the checkpoint key of the table); the engine is unchanged."""
    holder = tf.__internal__.tracking.AutoTrackable()
    holder.video = tf.Variable(np.zeros((7, 3), np.float64))
    holder._variables = {"video": {"parameters": holder.video}}
    prefix = tf.train.Checkpoint(embedding=holder).write(str(tmp_path / "f64"))
    ours = drop_in("TPUEmbedding")
    before = snapshot(ours.engine)
    with pytest.raises(tf.errors.InvalidArgumentError, match="embedding/video/.ATTRIBUTES/VARIABLE_VALUE.*double"):
        tf.train.Checkpoint(embedding=ours).read(prefix)
    assert_unchanged(ours.engine, before)


def test_a_restored_drop_in_trains_inside_tf_function_and_saves_through_a_checkpoint_manager(tmp_path):
    tf_engine, prefix = tf_written(tmp_path, E.TPUEmbedding, seed=2)
    ours = drop_in("TPUEmbedding")
    tf.train.Checkpoint(embedding=ours).read(prefix).assert_consumed()
    model = Model()

    @tf.function
    def step(features):
        ours.enqueue(features, training=True)
        with tf.GradientTape() as tape:
            activations = ours.dequeue()
            tape.watch(activations)
            loss = loss_of(activations, model)
        ours.apply_gradients(tape.gradient(loss, activations))

    features = batch(0)
    step(features)
    # SGD on the "bias" table: each looked-up row moves by -0.1 * (its count) * the loss's weights
    expected = tf_values(tf_engine)["bias"]["parameters"].copy()
    np.add.at(expected, features["b"].numpy(), -0.1 * np.ones(2, np.float32))
    np.testing.assert_allclose(ours.engine.embedding_tables["bias"], expected, rtol=1e-6, atol=1e-6)
    saved = tf.train.CheckpointManager(tf.train.Checkpoint(embedding=ours), str(tmp_path / "managed"), 2).save()
    again = drop_in("TPUEmbedding")
    tf.train.Checkpoint(embedding=again).restore(saved).assert_existing_objects_matched()
    assert_same(ec_values(ours.engine), ec_values(again.engine))


def test_as_trackable_restores_into_the_engine(tmp_path):
    """The layout :func:`as_trackable` gives a plain embedcore engine is the drop-ins': live both ways."""
    tf_engine, prefix = tf_written(tmp_path, E.TPUEmbedding, seed=6)
    emb = trained_engine()
    tf.train.Checkpoint(embedding=as_trackable(emb)).read(prefix).assert_consumed()
    assert_same(tf_values(tf_engine), ec_values(emb))


@settings(max_examples=10, deadline=None)
@given(vocabulary=st.integers(1, 9), dim=st.integers(1, 5), shared=st.booleans(), seed=st.integers(0, 99),
       kind=st.sampled_from(["adagrad", "adam", "ftrl", "sgd"]), class_name=st.sampled_from(DROP_INS))
def test_property_drop_in_round_trips_through_tensorflow(tmp_path_factory, vocabulary, dim, shared, seed, kind,
                                                         class_name):
    """TensorFlow -> drop-in -> TensorFlow through tf.train.Checkpoint alone, any shape (tiny vocabularies
    included), optimizer, and a table used by one feature or two."""
    tmp_path = tmp_path_factory.mktemp("drop")
    tables = {"t": (vocabulary, dim, kind), "u": (3, 2, "adagrad")}
    features = {"f": "t", "g": "t" if shared else "u", "h": "u"}
    tf_engine, prefix = tf_written(tmp_path, E.TPUEmbedding, seed=seed, tables=tables, features=features)
    ours = drop_in(class_name, tables=tables, features=features)
    tf.train.Checkpoint(embedding=ours).read(prefix).assert_consumed()
    assert_same(tf_values(tf_engine), ec_values(ours.engine))
    again = E.TPUEmbedding(tf_features(tables, features), E.SGD(0.1))
    tf.train.Checkpoint(embedding=again).read(tf.train.Checkpoint(embedding=ours).write(str(tmp_path / "o")))
    again.build()
    assert_same(tf_values(tf_engine), tf_values(again))


def test_16_bit_rows_restore_rounded_only_when_asked_and_always_in_the_drop_ins(tmp_path):
    tf_engine, prefix = tf_written(tmp_path, seed=8)
    expected = tf_values(tf_engine)
    emb = ec.Embedding(ec_features(weights_dtype="bfloat16"))
    before = snapshot(emb)
    with pytest.raises(ec.CheckpointError, match=r"table 'video' must be a bfloat16 array.*convert_dtypes=True"):
        tf.train.Checkpoint(embedding=as_trackable(emb)).read(prefix)
    assert_unchanged(emb, before)
    tf.train.Checkpoint(embedding=as_trackable(emb, convert_dtypes=True)).read(prefix).assert_consumed()
    ours = engines.TPUEmbeddingForServing(ec_features(weights_dtype="bfloat16"), None)
    tf.train.Checkpoint(embedding=ours).read(prefix)
    for engine in (emb, ours.engine):
        for name in TABLES:
            np.testing.assert_array_equal(engine.embedding_tables[name],
                                          expected[name]["parameters"].astype(engine.embedding_tables[name].dtype))


@pytest.mark.parametrize("class_name", DROP_INS)
def test_unnamed_tables_keep_tensorflows_names_both_ways(tmp_path, class_name):
    """TensorFlow names unnamed tables ``table_<i>``; the drop-ins (built from the same configs) use those
    names, so no feature_config is needed in either direction."""
    tf_engine = E.TPUEmbedding(tf_features(named=False), E.SGD(0.1))
    tf_engine.build()
    randomize(tf_engine, 9)
    prefix = tf.train.Checkpoint(embedding=tf_engine).write(str(tmp_path / "tf"))
    ours = getattr(engines, class_name)(tf_features(named=False), E.SGD(0.1))
    assert isinstance(ours, tf.__internal__.tracking.Trackable)
    tf.train.Checkpoint(embedding=ours).read(prefix).assert_consumed()
    assert_same(tf_values(tf_engine), ec_values(ours.engine))
    back = E.TPUEmbeddingForServing(tf_features(named=False), E.SGD(0.1))
    status = tf.train.Checkpoint(embedding=back).read(tf.train.Checkpoint(embedding=ours).write(str(tmp_path / "o")))
    back.build()
    status.assert_consumed()
    assert_same(tf_values(tf_engine), tf_values(back))
