"""Checkpoints, serving and exports of dynamic tables: round trips of engines mixing static and dynamic tables,
continuation bit-identical to the engine that saved (admission, LRU/LFU/TTL/score eviction and their ties,
16-bit stochastic rounding), refusals of corrupt or inconsistent files with nothing changed, serving of known
and unknown keys against a dict oracle, int8 exports within half a quantization step, and the key map's bulk
load against its own state."""

import hashlib
import json
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.checkpoint import CheckpointError, open_snapshot
from embedcore.checkpoint.config_codec import FunctionResolver, decode_engine_config, encode_engine_config
from embedcore.checkpoint.tensor_file import write_tensors
from embedcore.export import dequantize_int8_rows
from embedcore.initializers import fill_key_rows
from embedcore.kernels.hash_map import KeyRowMap

from .test_dynamic_tables import assert_same_state

DIM = 3
EXTREME = [0, -1, 2 ** 63 - 1, -2 ** 63, 12345678901]


def score_by_first_value(row, last_seen, count, step):
    """An EvictByScore function importable by path (a checkpoint names it)."""
    return row[0] + 0.01 * count


# -- engines and their state ---------------------------------------------------------------------------------
def make_engine(eviction=ec.LRU(), capacity=8, min_count=2, seed=5, weights_dtype="float32", optimizer=None,
                combiner="sum"):
    dyn = ec.DynamicTableConfig(DIM, capacity, name="dyn", initializer=ec.RandomUniform(-0.5, 0.5),
                                combiner=combiner, eviction=eviction, weights_dtype=weights_dtype,
                                admission=None if min_count is None else
                                ec.CountAdmission(min_count, sketch_width=32, sketch_depth=2))
    static = ec.TableConfig(7, DIM, name="static", combiner="sum")
    features = {"d": ec.FeatureConfig(dyn), "s": ec.FeatureConfig(static), "q": ec.FeatureConfig(dyn, 2)}
    return ec.Embedding(features, optimizer or ec.Adagrad(0.3), seed=seed)


def batch(rng, n=2):
    pool = np.array(list(range(-6, 10)) + EXTREME, np.int64)
    return {"d": rng.choice(pool, (n, 2)), "s": rng.integers(0, 7, (n, 2)), "q": rng.choice(pool, (n, 2))}


def train(emb, batches):
    """Look up and apply each batch; returns every activation (a list of dicts)."""
    out = []
    for b in batches:
        acts, ctx = emb(b)
        out.append({k: v.copy() for k, v in acts.items()})
        emb.apply_gradients({k: np.full(v.shape, 0.5, np.float32) * (1 + np.arange(v.size).reshape(v.shape) % 3)
                             for k, v in acts.items()}, ctx)
    return out


def dynamic_table(emb):
    (table,) = emb.dynamic_tables.values()
    return table


def full_state(emb):
    """Everything that decides what the engine does next, as plain arrays (row slots included)."""
    t = dynamic_table(emb)
    s = t.state()
    out = {"step": emb.step, "keys": s.keys, "weights": s.weights.astype(np.float32), "rows": s.rows,
           "free": s.free, "last_seen": s.last_seen, "counts": s.counts,
           "sketch": None if s.sketch is None else s.sketch.copy(),
           "static": np.array(emb.embedding_tables["static"]).copy()}
    out.update({f"slot/{k}": v.astype(np.float32) for k, v in s.slots.items()})
    out.update({f"static/{k}": np.array(v).copy() for k, v in emb.slot_variables["static"].items()})
    return out


# -- round trips ---------------------------------------------------------------------------------------------
def test_round_trip_of_a_mixed_engine_load_and_restore(tmp_path):
    rng = np.random.default_rng(1)
    emb = make_engine()
    train(emb, [batch(rng) for _ in range(6)])
    emb.save(tmp_path / "c")
    restored = ec.Embedding.restore(tmp_path / "c")
    loaded = make_engine()
    loaded.load(tmp_path / "c")
    for other in (restored, loaded):
        assert_same_state(full_state(emb), full_state(other))
        view, mine = other.embedding_tables["dyn"], emb.embedding_tables["dyn"]
        np.testing.assert_array_equal(view.keys(), mine.keys())
        np.testing.assert_array_equal(view[mine.keys()], mine[mine.keys()])
        np.testing.assert_array_equal(other.slot_variables["dyn"]["accumulators"][mine.keys()],
                                      emb.slot_variables["dyn"]["accumulators"][mine.keys()])
    # Equal states write identical files: the dynamic table's tensors hash alike.
    restored.save(tmp_path / "again")
    files = [open_snapshot(tmp_path / p).manifest["files"] for p in ("c", "again")]
    dynamic = [{k: v for k, v in f.items() if k.startswith("dynamic-")} for f in files]
    assert dynamic[0] == dynamic[1] and len(dynamic[0]) == 1


def test_a_fresh_engine_with_no_keys_round_trips(tmp_path):
    emb = make_engine()
    emb.save(tmp_path / "c")
    loaded = make_engine()
    loaded.load(tmp_path / "c")
    for other in (ec.Embedding.restore(tmp_path / "c"), loaded):
        assert_same_state(full_state(emb), full_state(other))
        assert len(other.embedding_tables["dyn"]) == 0


def test_the_manifest_entry_and_the_file(tmp_path):
    rng = np.random.default_rng(2)
    emb = make_engine()
    train(emb, [batch(rng) for _ in range(4)])
    emb.save(tmp_path / "c")
    snap = open_snapshot(tmp_path / "c")
    entry = snap.manifest["tables"]["dyn"]
    n = len(emb.embedding_tables["dyn"])
    assert entry["dynamic"] is True and entry["capacity"] == 8 and entry["n"] == n
    assert snap.manifest["config"]["tables"][0]["dynamic"]["eviction"] == {"policy": "LRU"}
    tensors = snap.tensors(entry["shards"][0]["file"])
    assert sorted(tensors) == ["admission/counters", "counts", "free", "keys", "last_seen", "rows",
                               "slot/accumulators", "weights"]
    keys = tensors["keys"]
    assert keys.dtype == np.uint64 and np.all(keys[1:] > keys[:-1])
    np.testing.assert_array_equal(np.sort(keys.view(np.int64)), emb.embedding_tables["dyn"].keys())
    np.testing.assert_array_equal(tensors["weights"], emb.embedding_tables["dyn"][keys])
    assert tensors["admission/counters"].shape == (2, 32)


CONTINUATIONS = [(ec.LRU(), "float32"), (ec.LRU(), "bfloat16"), (ec.LFU(), "float32"), (ec.LFU(), "bfloat16"),
                 (ec.TTL(2), "float32"), (ec.TTL(2), "bfloat16"), (ec.EvictByScore(score_by_first_value), "float32"),
                 (ec.EvictByScore(score_by_first_value, reserve=0.3), "float32")]


@pytest.mark.parametrize("eviction, weights_dtype", CONTINUATIONS, ids=[f"{e!r}-{d}" for e, d in CONTINUATIONS])
def test_continuing_after_a_save_is_bit_identical(tmp_path, eviction, weights_dtype):
    rng = np.random.default_rng(3)
    batches = [batch(rng) for _ in range(14)]
    emb = make_engine(eviction, weights_dtype=weights_dtype, optimizer=ec.Adam(0.1, lazy_adam=True))
    train(emb, batches[:6])
    emb.save(tmp_path / "c")
    restored = ec.Embedding.restore(tmp_path / "c", functions=[score_by_first_value])
    loaded = make_engine(eviction, weights_dtype=weights_dtype, optimizer=ec.Adam(0.1, lazy_adam=True))
    loaded.load(tmp_path / "c")
    removals = dynamic_table(emb).removals
    expected = []
    for b in batches[6:]:
        expected += train(emb, [b])
        expected.append(full_state(emb))
    for other in (restored, loaded):
        got = []
        for b in batches[6:]:
            got += train(other, [b])
            got.append(full_state(other))
        for e, g in zip(expected, got):
            if "step" in e:
                assert_same_state(e, g)
            else:
                for k in e:
                    np.testing.assert_array_equal(e[k], g[k], err_msg=k)
    assert dynamic_table(emb).removals > removals  # rows were evicted (or expired) after the save


def test_a_ttl_save_drops_expired_rows_and_both_engines_agree(tmp_path):
    emb = make_engine(ec.TTL(2), min_count=None)
    train(emb, [{"d": np.array([[1, 2]]), "s": np.array([[0, 1]]), "q": np.array([[3, 3]])}])   # step 0
    train(emb, [{"d": np.array([[4, 4]]), "s": np.array([[0, 1]]), "q": np.array([[4, 4]])}])   # step 1
    emb.set_state(step=3)
    view = emb.embedding_tables["dyn"]
    assert view.keys().tolist() == [4]                 # 1, 2, 3 expired at step 3
    assert len(dynamic_table(emb).key_map) == 4         # not removed until the next lookup (or a save)
    emb.save(tmp_path / "c")
    assert len(dynamic_table(emb).key_map) == 1
    assert open_snapshot(tmp_path / "c").manifest["tables"]["dyn"]["n"] == 1
    restored = ec.Embedding.restore(tmp_path / "c")
    assert_same_state(full_state(emb), full_state(restored))


def test_a_smaller_capacity_holding_the_keys_loads_and_a_too_small_one_is_refused(tmp_path):
    rng = np.random.default_rng(4)
    emb = make_engine(capacity=8, min_count=None)
    train(emb, [batch(rng) for _ in range(5)])
    emb.save(tmp_path / "c")
    keys = emb.embedding_tables["dyn"].keys()
    roomy = make_engine(capacity=len(keys), min_count=None)
    roomy.load(tmp_path / "c", strict=False)
    np.testing.assert_array_equal(roomy.embedding_tables["dyn"][keys], emb.embedding_tables["dyn"][keys])
    small = make_engine(capacity=len(keys) - 1, min_count=None)
    before = full_state(small)
    with pytest.raises(CheckpointError, match=f"holds {len(keys)} keys; the table's capacity is {len(keys) - 1}"):
        small.load(tmp_path / "c", strict=False)
    assert_same_state(before, full_state(small))


def test_loading_needs_the_seed_the_kind_and_the_sketch(tmp_path):
    rng = np.random.default_rng(5)
    emb = make_engine()
    train(emb, [batch(rng) for _ in range(3)])
    emb.save(tmp_path / "c")
    other = make_engine(seed=6)
    before = full_state(other)
    with pytest.raises(CheckpointError, match="seed 5, this one has seed 6"):
        other.load(tmp_path / "c")
    assert_same_state(before, full_state(other))
    no_sketch = make_engine(min_count=None)
    with pytest.raises(CheckpointError, match="admission sketch is uint32 \\(2, 32\\); the table's is none"):
        no_sketch.load(tmp_path / "c", strict=False)
    static = ec.Embedding({"d": ec.FeatureConfig(ec.TableConfig(8, DIM, name="dyn", combiner="sum")),
                           "s": ec.FeatureConfig(ec.TableConfig(7, DIM, name="static", combiner="sum"))},
                          ec.Adagrad(0.3), seed=5)
    with pytest.raises(CheckpointError, match="table 'dyn' is a dynamic table there"):
        static.load(tmp_path / "c", strict=False)


def test_set_state_refuses_dynamic_tables_and_points_at_load():
    emb = make_engine()
    with pytest.raises(ValueError, match="table 'dyn' is dynamic: set_state sets static tables only.*emb.load"):
        emb.set_state({"dyn": np.zeros((8, DIM), np.float32)})


def test_config_codec_round_trips_every_policy():
    for eviction in (None, ec.LRU(), ec.LFU(), ec.TTL(7), ec.EvictByScore(score_by_first_value),
                     ec.EvictByScore(score_by_first_value, reserve=0), ec.EvictByScore(score_by_first_value, 0.25)):
        for admission in (None, ec.CountAdmission(3, 64, 3)):
            t = ec.DynamicTableConfig(4, 50, name="t", admission=admission, eviction=eviction,
                                      initializer=ec.Constant(0.5))
            config = encode_engine_config({"f": ec.FeatureConfig(t)}, [t], ec.SGD(0.1), 1)
            json.dumps(config)
            features, _, _ = decode_engine_config(json.loads(json.dumps(config)),
                                                  FunctionResolver([score_by_first_value]))
            back = features["f"].table
            assert isinstance(back, ec.DynamicTableConfig) and repr(back) == repr(t)
    bad = encode_engine_config({"f": ec.FeatureConfig(t)}, [t], ec.SGD(0.1), 1)
    bad["tables"][0]["dynamic"]["eviction"] = {"policy": "MRU"}
    with pytest.raises(CheckpointError, match="eviction.policy must be one of"):
        decode_engine_config(bad)
    bad["tables"][0]["dynamic"] = {"capacity": 49, "admission": None, "eviction": None}
    with pytest.raises(CheckpointError, match="dynamic.capacity must be the table's vocabulary_size"):
        decode_engine_config(bad)


def test_an_evict_by_score_stored_before_its_reserve_reads_the_default_and_a_bad_reserve_is_refused(tmp_path):
    t = ec.DynamicTableConfig(4, 50, name="t", eviction=ec.EvictByScore(score_by_first_value, reserve=0.5))
    config = encode_engine_config({"f": ec.FeatureConfig(t)}, [t], ec.SGD(0.1), 1)
    stored = config["tables"][0]["dynamic"]["eviction"]
    assert stored["policy"] == "EvictByScore" and stored["reserve"] == 0.5
    del stored["reserve"]  # as an embedcore before the reserve wrote it
    resolve = FunctionResolver([score_by_first_value])
    features, _, _ = decode_engine_config(json.loads(json.dumps(config)), resolve)
    assert features["f"].table.eviction == ec.EvictByScore(score_by_first_value)  # the default reserve
    for bad in (1, 1.0, -0.01, "0.1", True, None, float("nan")):
        stored["reserve"] = bad
        with pytest.raises(CheckpointError, match=r"eviction.reserve must be a number in \[0, 1\)"):
            decode_engine_config(json.loads(json.dumps(config)), resolve)
    # an old checkpoint (no reserve in its manifest) loads into an engine built with EvictByScore(fn)
    emb = make_engine(ec.EvictByScore(score_by_first_value))
    train(emb, [batch(np.random.default_rng(1)) for _ in range(3)])
    emb.save(tmp_path / "old")
    snap = open_snapshot(tmp_path / "old")
    del snap.manifest["config"]["tables"][0]["dynamic"]["eviction"]["reserve"]
    resign_manifest(tmp_path / "old", snap)
    loaded = make_engine(ec.EvictByScore(score_by_first_value))
    loaded.load(tmp_path / "old")
    assert_same_state(full_state(loaded), full_state(emb))
    restored = ec.Embedding.restore(tmp_path / "old", functions=[score_by_first_value])
    assert dynamic_table(restored).eviction == ec.EvictByScore(score_by_first_value)


# -- refusals: corrupt or inconsistent files, nothing changed -----------------------------------------------
def rewrite_dynamic(path, edit_tensors, edit_entry=None):
    """Rewrite the dynamic table's file of the checkpoint ``path`` with ``edit_tensors(tensors)`` (a dict of
    arrays, edited in place), update its manifest entries (``edit_entry(entry)``) and re-sign the manifest,
    as someone controlling the directory could: only the checks beyond the hashes stand in the way."""
    snap = open_snapshot(path)
    manifest = snap.manifest
    entry = manifest["tables"]["dyn"]
    name = entry["shards"][0]["file"]
    tensors = {k: np.array(v) for k, v in snap.tensors(name).items()}
    edit_tensors(tensors)
    os.remove(os.path.join(snap.dir, name))
    digests = write_tensors(os.path.join(snap.dir, name), tensors)
    manifest["files"][name] = {k: {"shape": list(a.shape), "dtype": str(a.dtype), "sha256": digests[k]}
                               for k, a in tensors.items()}
    entry["n"] = entry["shards"][0]["rows"] = int(tensors["keys"].shape[0])
    if edit_entry is not None:
        edit_entry(entry)
    resign_manifest(path, snap)


def resign_manifest(path, snap):
    """Write ``snap.manifest`` (edited) back and re-sign it, as someone controlling the directory could."""
    text = json.dumps(snap.manifest, indent=1, sort_keys=True)
    with open(os.path.join(snap.dir, "manifest.json"), "w") as f:
        f.write(text)
    with open(os.path.join(path, "CURRENT"), "w") as f:
        f.write(json.dumps({"snapshot": snap.name, "manifest_sha256": hashlib.sha256(text.encode()).hexdigest()}))


def _swap_first_keys(t):
    t["keys"][[0, 1]] = t["keys"][[1, 0]]


def _duplicate_key(t):
    t["keys"][1] = t["keys"][0]


def _one_key_too_many(t):
    for k in ("keys", "rows", "last_seen", "counts", "weights", "slot/accumulators"):
        t[k] = np.concatenate([t[k], t[k][:1]])
    t["keys"][-1] = np.uint64(2 ** 64 - 7)
    t["rows"][-1] = t["rows"].shape[0] + t["free"].shape[0] - 1
    t["free"] = np.zeros(0, np.int64)


CORRUPTIONS = [
    (_swap_first_keys, "is out of order or given twice"),
    (_duplicate_key, "is out of order or given twice"),
    (lambda t: t.update(keys=t["keys"].view(np.int64)), "tensor 'keys' .* is int64 .* it must be uint64"),
    (lambda t: t.update(counts=t["counts"].astype(np.int64)), "tensor 'counts' .* must be int32"),
    (lambda t: t.update(weights=t["weights"].astype(np.float16)), "stores its weights as float16"),
    (lambda t: t["counts"].__setitem__(0, -3), "counts hold -3"),
    (lambda t: t["last_seen"].__setitem__(0, 999), "last_seen holds 999"),
    (lambda t: t["rows"].__setitem__(0, t["rows"][1]), "rows and free must together be the row slots"),
    (lambda t: t.update(**{"admission/counters": np.zeros((2, 33), np.uint32)}),
     "admission sketch of shape \\[2, 33\\]"),
    (lambda t: t.pop("admission/counters"), "admission sketch of shape None"),
    (lambda t: t.pop("last_seen"), "needs the tensors"),
    (lambda t: t["weights"].__setitem__((0, 0), np.nan), "NaN or Inf"),
    (_one_key_too_many, "n 9; it must be an integer from 0 to 8"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    rng = np.random.default_rng(7)
    emb = make_engine()
    train(emb, [batch(rng) for _ in range(12)])
    assert len(emb.embedding_tables["dyn"]) == 8  # full: one key more is beyond the capacity
    path = tmp_path_factory.mktemp("saved") / "c"
    emb.save(path)
    return path


@pytest.mark.parametrize("edit, message", CORRUPTIONS, ids=[m for _, m in CORRUPTIONS])
def test_corrupt_or_inconsistent_dynamic_tables_are_refused_and_change_nothing(saved, tmp_path, edit, message):
    import shutil
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    rewrite_dynamic(path, edit)
    emb = make_engine()
    train(emb, [batch(np.random.default_rng(8))])
    before = full_state(emb)
    with pytest.raises(CheckpointError, match=message):
        emb.load(path)
    assert_same_state(before, full_state(emb))
    with pytest.raises(CheckpointError, match=message):
        ec.Embedding.restore(path)


def test_a_truncated_file_and_a_capacity_mismatch_are_refused(saved, tmp_path):
    import shutil
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    snap = open_snapshot(path)
    name = snap.manifest["tables"]["dyn"]["shards"][0]["file"]
    full = os.path.join(snap.dir, name)
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) - 40)
    emb = make_engine()
    before = full_state(emb)
    with pytest.raises(CheckpointError, match="the file is truncated or corrupt|bytes; the manifest declares"):
        emb.load(path)
    assert_same_state(before, full_state(emb))
    shutil.rmtree(path)
    shutil.copytree(saved, path)
    rewrite_dynamic(path, lambda t: None, lambda e: e.update(capacity=9, vocabulary_size=9))
    with pytest.raises(CheckpointError, match="capacity 9; its configuration says 8|shape \\(9, 3\\)"):
        emb.load(path)
    assert_same_state(before, full_state(emb))


# -- serving -------------------------------------------------------------------------------------------------
def oracle_activations(rows, ids, initial, combiner="sum"):
    """Per sample: the sum (or mean) of its keys' rows from the dict ``rows`` (key -> float64 row), unknown
    keys reading ``initial(key)``."""
    out = []
    for sample in ids:
        values = [rows[int(k)] if int(k) in rows else initial(int(k)) for k in sample]
        total = np.sum(values, axis=0)
        out.append(total / len(values) if combiner == "mean" else total)
    return np.array(out)


def initial_of(seed, weights_dtype="float32"):
    def initial(key):
        out = np.empty((1, DIM), np.float32)
        fill_key_rows(ec.RandomUniform(-0.5, 0.5), out, np.array([key], np.int64), seed, "dyn")
        stored = ml_dtypes.bfloat16 if weights_dtype == "bfloat16" else np.float32
        return out[0].astype(stored).astype(np.float64)
    return initial


@pytest.mark.parametrize("weights_dtype, combiner", [("float32", "sum"), ("bfloat16", "mean")])
def test_serving_known_and_unknown_keys_against_a_dict(tmp_path, weights_dtype, combiner):
    rng = np.random.default_rng(9)
    emb = make_engine(weights_dtype=weights_dtype, combiner=combiner, min_count=None)
    train(emb, [batch(rng) for _ in range(5)])
    emb.save(tmp_path / "c")
    view = emb.embedding_tables["dyn"]
    rows = {int(k): view[k].astype(np.float64) for k in view.keys()}
    ids = np.array([[int(view.keys()[0]), 777], [-2 ** 63, int(view.keys()[-1])], [10 ** 15, 10 ** 15 + 1]])
    for unknown in ("initial", "zeros"):
        server = ec.ServingEmbedding(tmp_path / "c", unknown_keys=unknown)
        got = server.lookup({"d": ids})["d"]
        initial = initial_of(5, weights_dtype) if unknown == "initial" else (lambda key: np.zeros(DIM))
        np.testing.assert_allclose(got, oracle_activations(rows, ids, initial, combiner), rtol=1e-6, atol=1e-7)
    server = ec.ServingEmbedding(tmp_path / "c")
    stored = server.table_keys["dyn"]
    np.testing.assert_array_equal(stored, np.sort(view.keys().view(np.uint64)))   # increasing as uint64
    np.testing.assert_array_equal(server.embedding_tables["dyn"], view[stored])
    # The training engine looks these keys up alike (a lookup of a key the table does not hold reads its
    # initial value there too), and so does the static table.
    trained, _ = ec.Embedding.restore(tmp_path / "c")({"d": ids, "s": np.array([[1], [2], [3]]), "q": ids})
    served = server.lookup({"d": ids, "s": np.array([[1], [2], [3]]), "q": ids})
    for k in trained:
        np.testing.assert_array_equal(trained[k], served[k], err_msg=k)
    with pytest.raises(ValueError, match="unknown_keys must be one of"):
        ec.ServingEmbedding(tmp_path / "c", unknown_keys="nan")


def test_serving_a_table_holding_no_keys(tmp_path):
    emb = make_engine()
    emb.save(tmp_path / "c")
    got = ec.ServingEmbedding(tmp_path / "c").lookup({"d": np.array([[3, 4]])})["d"]
    np.testing.assert_allclose(got[0], initial_of(5)(3) + initial_of(5)(4), rtol=1e-6)


def test_int8_and_16_bit_exports_of_dynamic_tables(tmp_path):
    rng = np.random.default_rng(10)
    emb = make_engine(min_count=None)
    train(emb, [batch(rng) for _ in range(5)])
    emb.save(tmp_path / "c")
    view = emb.embedding_tables["dyn"]
    keys = np.sort(view.keys().view(np.uint64)).view(np.int64)  # the stored order: increasing as uint64
    ids = np.stack([keys, np.full(keys.shape, 424242)], axis=1)
    exact = ec.ServingEmbedding(tmp_path / "c").lookup({"d": ids})["d"]
    ec.export_for_serving(tmp_path / "c", tmp_path / "int8", dtype="int8")
    snap = open_snapshot(tmp_path / "int8", serving=True)
    entry = snap.manifest["tables"]["dyn"]
    fused = snap.tensors(entry["shards"][0]["file"])["weights"]
    assert fused.shape == (len(keys), DIM + 8) and entry["slots"] == [] and entry["n"] == len(keys)
    scale = np.ascontiguousarray(fused[:, DIM:DIM + 4]).view("<f4")[:, 0]
    assert np.all(np.abs(dequantize_int8_rows(fused) - view[keys]) <= scale[:, None] / 2 * (1 + 1e-5) + 1e-7)
    served = ec.ServingEmbedding(tmp_path / "int8").lookup({"d": ids})["d"]
    # One quantized row per sample (the other key is unknown: its initial value, exact).
    assert np.all(np.abs(served - exact) <= scale[:, None] / 2 * (1 + 1e-5) + 1e-6)
    ec.export_for_serving(tmp_path / "c", tmp_path / "bf16", dtype="bfloat16")
    bf16 = ec.ServingEmbedding(tmp_path / "bf16").lookup({"d": ids[:, :1]})["d"]
    np.testing.assert_array_equal(bf16, view[keys].astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(CheckpointError, match="serving export"):
        ec.Embedding.restore(tmp_path / "int8")


# -- the key map's bulk load ---------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(-2 ** 63, 2 ** 63 - 1) | st.integers(0, 12),
                                                    max_size=5)), max_size=12),
       st.integers(1, 10), st.lists(st.integers(0, 12), max_size=6))
def test_a_loaded_key_map_assigns_rows_as_the_map_it_was_taken_from(operations, capacity, later):
    original = KeyRowMap(capacity, "t", initial_buckets=2)
    for step, (insert, keys) in enumerate(operations):
        keys = np.array(keys, np.int64)
        if insert and np.unique(keys).shape[0] <= original.free_rows:
            rows, _ = original.find_or_insert(keys, step)
            original.touch(rows, step)
        elif not insert:
            original.remove(keys)
    keys, rows, last_seen, counts, free = original.state()
    copy = KeyRowMap(capacity + 3, "u")
    copy.load(keys, last_seen, counts, rows, free)
    for mine, theirs in zip(original.state(), copy.state()):
        np.testing.assert_array_equal(mine, theirs)
    later = np.array(later, np.int64)
    if np.unique(later).shape[0] <= original.free_rows:
        np.testing.assert_array_equal(original.find_or_insert(later, 99)[0], copy.find_or_insert(later, 99)[0])
        np.testing.assert_array_equal(original.find(keys), copy.find(keys))


def test_a_key_map_load_refuses_bad_state_and_changes_nothing():
    m = KeyRowMap(4, "t")
    m.find_or_insert([5, 6], 1)
    before = m.state()
    for args, message in [(([1, 1], [0, 0], [0, 0]), "key 1 is given twice"),
                          (([1, 2], [0, 0], [0, -1]), "counts must be in"),
                          (([1, 2], [0, -2], [0, 0]), "last_seen must be steps"),
                          (([1, 2], [0, 0], [0, 0], [0, 2]), "exactly 0 .. 1"),
                          (([1, 2], [0, 0], [0, 0], [0, 1], [2, 3, 4]), "need 5 row slots; the capacity is 4"),
                          (([1.5], [0], [0]), "keys must be integers")]:
        with pytest.raises(ValueError, match=message):
            m.load(*args)
        for a, b in zip(before, m.state()):
            np.testing.assert_array_equal(a, b)


def test_deepcopy_and_pickle_copy_the_whole_dynamic_state():
    import copy
    import pickle
    rng = np.random.default_rng(11)
    batches = [batch(rng) for _ in range(10)]
    emb = make_engine(ec.TTL(2), weights_dtype="bfloat16")
    train(emb, batches[:5])
    copies = [copy.deepcopy(emb), pickle.loads(pickle.dumps(emb))]
    for other in copies:
        assert_same_state(full_state(emb), full_state(other))
    expected = train(emb, batches[5:])
    for other in copies:
        for e, g in zip(expected, train(other, batches[5:])):
            for k in e:
                np.testing.assert_array_equal(e[k], g[k], err_msg=k)
        assert_same_state(full_state(emb), full_state(other))


def test_serving_refuses_repeated_keys_even_unverified(saved, tmp_path):
    import shutil
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    rewrite_dynamic(path, _duplicate_key)
    with pytest.raises(CheckpointError, match="out of order or given twice"):
        ec.ServingEmbedding(path)
    with pytest.raises(CheckpointError, match="is given twice"):
        ec.ServingEmbedding(path, verify=False)
