"""Delta saves (``emb.save(path, incremental=True)``) against an oracle of full tables.

The oracle is a plain dict: at every save, a copy of every table and slot, and (independently of the
engine's tracking) the set of row ids the batches since the previous save looked up with a gradient. Every
reader of the composed chain (``restore``, ``load``, serving, exports, sharded row reads) must give back
exactly the oracle of the newest save; each delta file must hold exactly the rows the oracle says changed;
crashes and corrupt links must leave the previous state readable, the engine unchanged.
"""

import json
import os

import numpy as np
import pytest

import embedcore as ec
from embedcore.checkpoint import CheckpointError, open_snapshot, read_extra, table_rows
from embedcore.checkpoint import store
from embedcore.checkpoint.tensor_file import read_header, write_tensors

from .harness import assert_unchanged, rewrite_manifest, snapshot

VOCAB = {"a": 40, "b": 25, "c": 12}
DIMS = {"a": 4, "b": 4, "c": 3}


def make_engine(seed=3, stack_tables=True, weights_dtype="float32", optimizer=None):
    a = ec.TableConfig(VOCAB["a"], DIMS["a"], name="a", combiner="sum", weights_dtype=weights_dtype)
    b = ec.TableConfig(VOCAB["b"], DIMS["b"], name="b", weights_dtype=weights_dtype)  # stacked with a
    c = ec.TableConfig(VOCAB["c"], DIMS["c"], name="c", weights_dtype=weights_dtype)
    features = {"fa": ec.FeatureConfig(a), "fb": ec.FeatureConfig(b), "fc": ec.FeatureConfig(c)}
    return ec.Embedding(features, optimizer or ec.Adagrad(0.1), seed=seed, stack_tables=stack_tables)


FEATURE_TABLE = {"fa": "a", "fb": "b", "fc": "c"}


class Oracle:
    """What the engine's state must be at each save, and which rows changed since the previous one."""

    def __init__(self, emb):
        self.emb = emb
        self.touched = {name: set() for name in VOCAB}
        self.saved = []  # (tables, slots, step) copies, one per save

    def train(self, rng, steps):
        for _ in range(steps):
            ids = {"fa": rng.integers(0, VOCAB["a"], (rng.integers(0, 4), 3)),   # duplicates, empty batches
                   "fb": rng.integers(0, VOCAB["b"], rng.integers(0, 3)),
                   "fc": rng.integers(0, VOCAB["c"], rng.integers(1, 3))}
            acts, ctx = self.emb(ids)
            grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}
            if rng.random() < 0.3:
                grads["fb"] = None  # no gradient: its rows are not touched
            self.emb.apply_gradients(grads, ctx)
            for feature, g in grads.items():
                if g is not None:
                    self.touched[FEATURE_TABLE[feature]].update(int(i) for i in np.asarray(ids[feature]).ravel())

    def save(self, path, **kwargs):
        out = self.emb.save(path, **kwargs)
        self.saved.append(snapshot(self.emb))
        changed = {name: np.array(sorted(rows), np.int64) for name, rows in self.touched.items()}
        self.touched = {name: set() for name in VOCAB}
        return out, changed


def assert_holds(emb, state, what):
    tables, slots, step = state
    assert emb.step == step, what
    for name, table in tables.items():
        assert emb.embedding_tables[name].tobytes() == table.tobytes(), f"{what}: table {name}"
        for slot, value in slots[name].items():
            assert emb.slot_variables[name][slot].tobytes() == value.tobytes(), f"{what}: {name}/{slot}"


def manifest_at(snapshot_dir):
    with open(os.path.join(snapshot_dir, "manifest.json")) as f:
        return json.load(f)


def snapshots(path):
    return sorted(n for n in os.listdir(path) if n.startswith("snapshot-"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_of_deltas_restores_the_oracle_exactly(tmp_path, seed):
    rng = np.random.default_rng(seed)
    emb = make_engine(stack_tables=seed != 1)
    oracle = Oracle(emb)
    path = tmp_path / "ckpt"
    oracle.train(rng, 2)
    base, _ = oracle.save(path, incremental=True)  # no chain yet: a full snapshot, which starts one
    assert "delta" not in manifest_at(base)
    dirs = [base]
    for k in range(3):
        oracle.train(rng, int(rng.integers(0, 4)))  # zero steps too: a delta of no rows
        delta, changed = oracle.save(path, incremental=True, metadata={"k": k}, extra={"x": np.arange(k + 1)})
        manifest = manifest_at(delta)
        assert manifest["delta"]["base"]["snapshot"] == os.path.basename(base)
        assert manifest["delta"]["previous"]["snapshot"] == os.path.basename(dirs[-1])
        dirs.append(delta)
        assert snapshots(path) == sorted(os.path.basename(d) for d in dirs)  # the chain is kept
        for name, entry in manifest["tables"].items():
            # exactly the rows looked up with a gradient since the previous save (a lazy optimizer)
            rows = open_snapshot(path).deltas[-1].tensors(entry["file"], ["rows"])["rows"]
            np.testing.assert_array_equal(rows, changed[name], err_msg=name)
            assert entry["rows"] == changed[name].size
        restored = ec.Embedding.restore(path)
        assert_holds(restored, oracle.saved[-1], f"restore after delta {k}")
        arrays, metadata = read_extra(path)
        assert metadata == {"k": k} and np.array_equal(arrays["x"], np.arange(k + 1))
    other = make_engine(seed=99, stack_tables=seed == 1)
    other.load(path)
    assert_holds(other, oracle.saved[-1], "load")
    # rows no delta names still hold the base's values
    base_tables = oracle.saved[0][0]
    for name in VOCAB:
        named = set()
        for d in open_snapshot(path).deltas:
            named |= set(d.tensors(d.manifest["tables"][name]["file"], ["rows"])["rows"].tolist())
        untouched = sorted(set(range(VOCAB[name])) - named)
        np.testing.assert_array_equal(restored.embedding_tables[name][untouched], base_tables[name][untouched])


def test_delta_files_hold_only_the_changed_rows(tmp_path):
    emb = make_engine()
    path = tmp_path / "ckpt"
    base = emb.save(path, incremental=True)
    acts, ctx = emb({"fa": np.array([[3, 3, 7]]), "fb": np.array([1]), "fc": np.array([0])})
    emb.apply_gradients({k: np.ones(v.shape, np.float32) for k, v in acts.items()}, ctx)
    delta = emb.save(path, incremental=True)
    manifest = manifest_at(delta)
    expected = {"a": [3, 7], "b": [1], "c": [0]}
    for name, entry in manifest["tables"].items():
        n, dim = len(expected[name]), DIMS[name]
        declared = n * (8 + 4 * dim + 4 * dim)  # ids, weights, Adagrad's accumulator
        assert entry["rows"] == n
        size = os.path.getsize(os.path.join(delta, entry["file"]))
        assert declared < size <= declared + 1024, name  # the data and a small header, nothing else
        full = manifest_at(base)["tables"][name]["shards"][0]["file"]
        assert os.path.getsize(os.path.join(base, full)) >= VOCAB[name] * 8 * dim


def test_a_non_lazy_optimizer_changes_every_row(tmp_path):
    emb = make_engine(optimizer=ec.Adam(0.01, lazy_adam=False, use_gradient_accumulation=True))
    oracle = Oracle(emb)
    path = tmp_path / "ckpt"
    oracle.save(path, incremental=True)
    oracle.train(np.random.default_rng(5), 2)
    delta, _ = oracle.save(path, incremental=True)
    for name, entry in manifest_at(delta)["tables"].items():
        assert entry["rows"] == VOCAB[name]
    assert_holds(ec.Embedding.restore(path), oracle.saved[-1], "restore")


def test_16_bit_tables(tmp_path):
    emb = make_engine(weights_dtype="bfloat16")
    oracle = Oracle(emb)
    rng = np.random.default_rng(7)
    path = tmp_path / "ckpt"
    oracle.save(path, incremental=True)
    for _ in range(2):
        oracle.train(rng, 2)
        oracle.save(path, incremental=True)
    assert_holds(ec.Embedding.restore(path), oracle.saved[-1], "restore")
    float32 = make_engine()
    with pytest.raises(CheckpointError, match="convert_dtypes"):
        float32.load(path, strict=False)
    float32.load(path, convert_dtypes=True)
    for name, table in oracle.saved[-1][0].items():
        np.testing.assert_array_equal(float32.embedding_tables[name], table.astype(np.float32))


def test_serving_exports_and_sharded_reads_compose_the_chain(tmp_path):
    emb = make_engine()
    oracle = Oracle(emb)
    rng = np.random.default_rng(11)
    path = tmp_path / "ckpt"
    oracle.save(path, incremental=True)
    for _ in range(2):
        oracle.train(rng, 3)
        oracle.save(path, incremental=True)
    tables = oracle.saved[-1][0]
    probe = {"fa": np.array([[0, 1, 2]]), "fb": np.arange(VOCAB["b"]), "fc": np.arange(VOCAB["c"])}
    served = ec.ServingEmbedding(path).lookup(probe)
    np.testing.assert_array_equal(served["fb"], tables["b"])
    np.testing.assert_array_equal(served["fc"], tables["c"])
    ec.export_for_serving(path, tmp_path / "export", dtype="float32")
    exported = ec.ServingEmbedding(tmp_path / "export").lookup(probe)
    np.testing.assert_array_equal(exported["fb"], tables["b"])
    snap = open_snapshot(path)
    for name in VOCAB:  # the rows one rank of a sharded engine reads: first + i * stride
        for first, stride in ((0, 1), (1, 3), (2, 3)):
            n = len(range(first, VOCAB[name], stride))
            np.testing.assert_array_equal(table_rows(snap, name, "weights", first, stride, n),
                                          tables[name][first::stride])
            np.testing.assert_array_equal(table_rows(snap, name, "slot/accumulators", first, stride, n),
                                          oracle.saved[-1][1][name]["accumulators"][first::stride])


def test_full_save_compacts_and_the_chain_goes_on_from_it(tmp_path):
    emb = make_engine()
    oracle = Oracle(emb)
    rng = np.random.default_rng(13)
    path = tmp_path / "ckpt"
    oracle.save(path, incremental=True)
    for _ in range(2):
        oracle.train(rng, 2)
        oracle.save(path, incremental=True)
    assert len(snapshots(path)) == 3
    oracle.train(rng, 2)
    full, _ = oracle.save(path)  # compacts: the old chain is deleted
    assert snapshots(path) == [os.path.basename(full)] and "delta" not in manifest_at(full)
    oracle.train(rng, 2)
    delta, changed = oracle.save(path, incremental=True)  # a delta on the new base
    assert manifest_at(delta)["delta"]["base"]["snapshot"] == os.path.basename(full)
    assert snapshots(path) == sorted([os.path.basename(full), os.path.basename(delta)])
    assert {n: e["rows"] for n, e in manifest_at(delta)["tables"].items()} == {n: v.size for n, v in changed.items()}
    assert_holds(ec.Embedding.restore(path), oracle.saved[-1], "restore")


def test_which_saves_are_deltas_and_which_are_refused(tmp_path):
    emb = make_engine()
    rng = np.random.default_rng(17)
    oracle = Oracle(emb)
    path = tmp_path / "ckpt"
    oracle.save(path)  # a full save of an engine that never saved incrementally tracks nothing
    assert not any(t.tracks_changes for t in emb.physical_tables)
    oracle.train(rng, 1)
    first, _ = oracle.save(path, incremental=True)  # so its first incremental save is full
    assert "delta" not in manifest_at(first)
    oracle.train(rng, 1)
    assert "delta" in manifest_at(oracle.save(path, incremental=True)[0])
    # another directory: refused, nothing written there
    with pytest.raises(CheckpointError, match="last save went to"):
        emb.save(tmp_path / "elsewhere", incremental=True)
    assert not os.path.exists(tmp_path / "elsewhere")
    # another engine replaced the current snapshot: refused, nothing written
    make_engine(seed=8).save(path)
    before = snapshots(path)
    with pytest.raises(CheckpointError, match="another save replaced it"):
        emb.save(path, incremental=True)
    assert snapshots(path) == before
    # load and set_state end the chain: the next save is full
    emb.load(path)
    assert "delta" not in manifest_at(emb.save(path, incremental=True))
    emb.set_state(step=emb.step)
    assert "delta" not in manifest_at(emb.save(path, incremental=True))
    assert "delta" in manifest_at(emb.save(path, incremental=True))


def test_crash_before_the_commit_leaves_the_previous_state(tmp_path, monkeypatch):
    emb = make_engine()
    oracle = Oracle(emb)
    rng = np.random.default_rng(19)
    path = tmp_path / "ckpt"
    oracle.save(path, incremental=True)
    oracle.train(rng, 2)
    oracle.save(path, incremental=True)
    oracle.train(rng, 2)
    real_replace = os.replace

    def crash(src, dst):  # the process dies with every file written, CURRENT not yet replaced
        if os.path.basename(dst) == "CURRENT":
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)
    monkeypatch.setattr(store.os, "replace", crash)
    monkeypatch.setattr(store.SnapshotWriter, "abort", lambda self: None)  # a killed process cleans nothing
    with pytest.raises(KeyboardInterrupt):
        emb.save(path, incremental=True)
    monkeypatch.undo()
    assert len(snapshots(path)) == 3  # base, delta, the uncommitted leftover
    assert_holds(ec.Embedding.restore(path), oracle.saved[-1], "restore after the crash")
    # the engine still builds on the last committed delta; its next delta holds the rows of both trainings
    touched = oracle.touched
    oracle.train(rng, 1)
    delta, changed = oracle.save(path, incremental=True)
    for name, entry in manifest_at(delta)["tables"].items():
        assert entry["rows"] == len(touched[name] | set(changed[name].tolist()))
    assert len(snapshots(path)) == 3  # the leftover was pruned
    assert_holds(ec.Embedding.restore(path), oracle.saved[-1], "restore")


def test_a_failure_after_the_commit_keeps_the_new_chain(tmp_path, monkeypatch):
    emb = make_engine()
    oracle = Oracle(emb)
    rng = np.random.default_rng(23)
    path = tmp_path / "ckpt"
    oracle.save(path, incremental=True)
    oracle.train(rng, 1)

    def fail(self):
        raise OSError("pruning failed")
    monkeypatch.setattr(store.SnapshotWriter, "_prune", fail)
    with pytest.raises(OSError):
        oracle.save(path, incremental=True)  # CURRENT names the new delta
    monkeypatch.undo()
    oracle.saved.append(snapshot(emb))
    assert_holds(ec.Embedding.restore(path), oracle.saved[-1], "restore")
    oracle.touched = {name: set() for name in VOCAB}
    oracle.train(rng, 1)
    delta, changed = oracle.save(path, incremental=True)
    assert {n: e["rows"] for n, e in manifest_at(delta)["tables"].items()} == {n: v.size for n, v in changed.items()}
    assert_holds(ec.Embedding.restore(path), oracle.saved[-1], "restore")


@pytest.fixture
def chain(tmp_path):
    """A checkpoint of a base and two deltas, the oracle, and an engine to load into."""
    emb = make_engine()
    oracle = Oracle(emb)
    rng = np.random.default_rng(29)
    path = tmp_path / "ckpt"
    dirs = [oracle.save(path, incremental=True)[0]]
    for _ in range(2):
        oracle.train(rng, 2)
        dirs.append(oracle.save(path, incremental=True)[0])
    target = make_engine(seed=5)
    return path, dirs, oracle, target


def assert_refused(path, target, match):
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=match):
        target.load(path)
    assert_unchanged(target, before)
    with pytest.raises(CheckpointError, match=match):
        ec.Embedding.restore(path)
    with pytest.raises(CheckpointError, match=match):
        ec.ServingEmbedding(path)


def test_missing_base_is_refused(chain):
    path, dirs, _, target = chain
    os.rename(dirs[0], dirs[0] + "-gone")
    assert_refused(path, target, f"on top of {os.path.basename(dirs[0])}, which is missing")


def test_edited_link_manifest_is_refused(chain):
    path, dirs, _, target = chain
    with open(os.path.join(dirs[1], "manifest.json"), "a") as f:
        f.write(" ")
    assert_refused(path, target, "does not match its SHA-256")


def test_corrupt_rows_of_an_earlier_delta_are_refused(chain):
    path, dirs, _, target = chain
    entry = manifest_at(dirs[1])["tables"]["a"]
    file_path = os.path.join(dirs[1], entry["file"])
    tensors, _, data_start = read_header(file_path)
    at = data_start + tensors["weights"]["begin"]  # the first weight: serving reads it too
    with open(file_path, "r+b") as f:
        f.seek(at)
        first = f.read(1)
        f.seek(at)
        f.write(bytes([first[0] ^ 1]))
    assert_refused(path, target, "does not match its SHA-256")


def test_a_broken_link_field_is_refused(chain):
    path, _, _, target = chain
    rewrite_manifest(path, lambda text: text.replace('"previous": {', '"previous": {"extra": 1, ', 1))
    assert_refused(path, target, "delta.previous must be a link")


def test_a_chain_on_another_base_is_refused(chain):
    path, _, _, target = chain

    def edit(text):
        manifest = json.loads(text)
        manifest["delta"]["base"] = manifest["delta"]["previous"]  # delta 1 named as the base: not a full one
        return json.dumps(manifest)
    rewrite_manifest(path, edit)
    assert_refused(path, target, "is on base|names .* as its base")


def _rewrite_delta_rows(snapshot_dir, table, rows_of):
    """Rewrite a delta's rows of ``table`` (ids replaced by ``rows_of(ids)``) with valid hashes, as someone
    who controls the directory could."""
    manifest = manifest_at(snapshot_dir)
    entry = manifest["tables"][table]
    file_path = os.path.join(snapshot_dir, entry["file"])
    snap = store.Snapshot(os.path.dirname(snapshot_dir), os.path.basename(snapshot_dir), manifest)
    tensors = {k: np.array(v) for k, v in snap.tensors(entry["file"]).items()}
    tensors["rows"] = rows_of(tensors["rows"])
    digests = write_tensors(file_path, tensors)
    for key, digest in digests.items():
        manifest["files"][entry["file"]][key]["sha256"] = digest
    return json.dumps(manifest)


@pytest.mark.parametrize("rows_of", [lambda r: r[::-1].copy(), lambda r: r + 100, lambda r: r - r.max() - 1],
                         ids=["decreasing", "beyond", "negative"])
def test_bad_row_ids_are_refused(chain, rows_of):
    path, dirs, _, target = chain
    assert manifest_at(dirs[2])["tables"]["a"]["rows"] >= 2
    text = _rewrite_delta_rows(dirs[2], "a", rows_of)
    rewrite_manifest(path, lambda _: text)
    assert_refused(path, target, "rows must be increasing ids")


def test_a_sharded_engine_reads_a_chain_and_refuses_to_write_one(tmp_path):
    from embedcore.distributed import ShardedEmbedding
    from embedcore.distributed import checkpoint as sharded_checkpoint
    emb = make_engine()
    oracle = Oracle(emb)
    rng = np.random.default_rng(31)
    path = tmp_path / "ckpt"
    oracle.save(path, incremental=True)
    for _ in range(2):
        oracle.train(rng, 2)
        oracle.save(path, incremental=True)
    restored = ShardedEmbedding.restore(path)  # one rank of one: its shard is every row
    assert_holds(restored, oracle.saved[-1], "sharded restore")
    with pytest.raises(CheckpointError, match="incremental saves of a ShardedEmbedding are not supported"):
        sharded_checkpoint.save(restored, tmp_path / "sharded", None, None, incremental=True)
    assert not os.path.exists(tmp_path / "sharded")


# -- dynamic tables --------------------------------------------------------------------------------------
from .test_dynamic_checkpoint import assert_same_state, batch, full_state  # noqa: E402
from .test_dynamic_checkpoint import make_engine as make_dynamic_engine  # noqa: E402
from .test_dynamic_checkpoint import train as train_dynamic  # noqa: E402


def held_keys(emb):
    return set(np.asarray(emb.embedding_tables["dyn"].keys()).view(np.uint64).tolist())


@pytest.mark.parametrize("eviction, capacity, min_count", [
    (ec.LRU(), 8, 2), (ec.LFU(), 10, None), (ec.TTL(2), 12, 2), (None, 40, None)],
    ids=["lru", "lfu", "ttl", "none"])
def test_dynamic_deltas_restore_the_whole_state_and_continue_alike(tmp_path, eviction, capacity, min_count):
    rng = np.random.default_rng(37)
    emb = make_dynamic_engine(eviction=eviction, capacity=capacity, min_count=min_count)
    path = tmp_path / "ckpt"
    train_dynamic(emb, [batch(rng)])  # loading a table of no keys fails (tables/dynamic.py prepare_state)
    emb.save(path, incremental=True)
    before = held_keys(emb)
    for k in range(4):
        train_dynamic(emb, [batch(rng) for _ in range(int(rng.integers(0, 4)))])
        delta = emb.save(path, incremental=True)
        after = held_keys(emb)  # after the save: a TTL table's expired keys are gone
        manifest = manifest_at(delta)
        assert "delta" in manifest
        snap = open_snapshot(path)
        d = snap.deltas[-1]
        tensors = d.tensors(manifest["tables"]["dyn"]["shards"][0]["file"])
        assert set(tensors["removed_keys"].tolist()) == before - after  # exactly the keys gone since
        assert set(tensors["keys"].tolist()) <= after
        assert manifest["tables"]["dyn"]["n"] == len(after)
        before = after
        for other in (ec.Embedding.restore(path), make_dynamic_engine(eviction=eviction, capacity=capacity,
                                                                      min_count=min_count)):
            if other.step != emb.step:
                other.load(path)
            assert_same_state(full_state(emb), full_state(other))
    # serving and exports read the composed state as they read a full save of it
    restored = ec.Embedding.restore(path)
    restored.save(tmp_path / "full")
    probe = batch(np.random.default_rng(1), n=4)
    ec.export_for_serving(path, tmp_path / "export", dtype="float32")
    expected = ec.ServingEmbedding(tmp_path / "full").lookup(probe)
    for served in (ec.ServingEmbedding(path).lookup(probe), ec.ServingEmbedding(tmp_path / "export").lookup(probe)):
        for name in expected:
            np.testing.assert_array_equal(served[name], expected[name])
    # the composed engine goes on exactly as the one that saved
    batches = [batch(rng) for _ in range(3)]
    for mine, theirs in zip(train_dynamic(emb, batches), train_dynamic(restored, batches)):
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name])
    assert_same_state(full_state(emb), full_state(restored))


def test_dynamic_deltas_write_only_the_keys_that_changed(tmp_path):
    emb = make_dynamic_engine(eviction=None, capacity=40, min_count=None)
    path = tmp_path / "ckpt"
    rng = np.random.default_rng(41)
    train_dynamic(emb, [batch(rng, n=8) for _ in range(3)])
    emb.save(path, incremental=True)
    held = held_keys(emb)
    step = emb.step
    ids = {"d": np.array([[1, 1]]), "s": np.array([[0, 0]]), "q": np.array([[2, 2]])}
    train_dynamic(emb, [ids])  # keys 1 and 2 (held or new), nothing else looked up
    delta = emb.save(path, incremental=True)
    entry = manifest_at(delta)["tables"]["dyn"]
    written = set(open_snapshot(path).deltas[-1].tensors(entry["shards"][0]["file"])["keys"].tolist())
    assert {1, 2} <= written
    # only keys looked up since the save, or at the latest step the save had seen, are written
    last = full_state(emb)
    latest_before = step - 1
    allowed = {1, 2} | {int(k) for k, s in zip(last["keys"].tolist(), last["last_seen"].tolist()) if s >= latest_before}
    assert written <= allowed and len(written) < len(held | {1, 2}), written
    assert_same_state(full_state(emb), full_state(ec.Embedding.restore(path)))


def test_a_corrupt_dynamic_delta_is_refused(tmp_path):
    emb = make_dynamic_engine()
    path = tmp_path / "ckpt"
    rng = np.random.default_rng(43)
    train_dynamic(emb, [batch(rng)])
    emb.save(path, incremental=True)
    train_dynamic(emb, [batch(rng) for _ in range(3)])
    delta = emb.save(path, incremental=True)
    entry = manifest_at(delta)["tables"]["dyn"]
    file_path = os.path.join(delta, entry["shards"][0]["file"])
    tensors, _, data_start = read_header(file_path)
    with open(file_path, "r+b") as f:  # flip a bit of the first changed key's weights
        f.seek(data_start + tensors["weights"]["begin"])
        first = f.read(1)
        f.seek(data_start + tensors["weights"]["begin"])
        f.write(bytes([first[0] ^ 1]))
    target = make_dynamic_engine()
    before = full_state(target)
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        target.load(path)
    assert_same_state(before, full_state(target))
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        ec.Embedding.restore(path)


def test_a_one_process_delta_chain_restores_on_two_ranks(tmp_path):
    from .test_distributed import SAVED_AT, STEPS, assert_same_bits, mpi_train, mpirun
    emb = ec.Embedding(*mpi_train.config(), seed=3)
    path = tmp_path / "ckpt"
    one_process = lambda t: np.concatenate(mpi_train.assignment(t, 1))  # noqa: E731
    emb.save(path, incremental=True)
    for stop in range(1, SAVED_AT + 1):
        mpi_train.train(emb, stop, one_process)
        emb.save(path, incremental=True)
    assert "delta" in open_snapshot(path).deltas[-1].manifest  # a chain of SAVED_AT deltas
    out = str(tmp_path / "resumed.npz")
    proc = mpirun(2, "mpi_train.py", out, STEPS, "--resume", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_bits(mpi_train.load_tables(out + ".loaded.npz"), emb, "restored on 2 ranks")


def test_processes_killed_while_saving_incrementally_leave_a_whole_state(tmp_path):
    """SIGKILL a process (forked by ``workers/delta_loop.py``) at random moments while it trains and saves
    incrementally after every step: the checkpoint restores exactly the state of its step (replayed here),
    and the next process goes on from it; some kills leave a delta current."""
    import importlib.util
    import signal
    import subprocess
    import sys
    import time
    from .test_crash_safety import Lines
    worker = os.path.join(os.path.dirname(__file__), "workers", "delta_loop.py")
    spec = importlib.util.spec_from_file_location("embedcore_test_delta_loop", worker)
    delta_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(delta_loop)
    path = tmp_path / "ckpt"
    rng = np.random.default_rng(int(os.environ.get("EMBEDCORE_CRASH_SEED", "5")))
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")  # children train after fork: no OpenMP there
    proc = subprocess.Popen([sys.executable, worker, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env)
    lines = Lines(proc.stdout)
    twin = delta_loop.make_engine()  # replays the steps here
    on_delta = 0
    try:
        assert lines.next(timeout=300) == "ready"
        for _ in range(10):
            proc.stdin.write(b"fork\n")
            proc.stdin.flush()
            word, pid = lines.next(timeout=120).split()
            assert word == "started"
            time.sleep(float(rng.uniform(0.05, 1.0)))
            os.kill(int(pid), signal.SIGKILL)
            while True:
                parts = lines.next().split()
                if parts[0] == "reaped":
                    break
                assert parts[0] == "saved", parts
            if not os.path.exists(path / "CURRENT"):
                continue  # killed before its first commit
            restored = ec.Embedding.restore(path)
            assert read_extra(path)[1] == {"step": restored.step}
            while twin.step < restored.step:
                delta_loop.train_one_step(twin)
            assert_holds(restored, snapshot(twin), f"after a kill at step {restored.step}")
            on_delta += bool(open_snapshot(path).deltas)
        assert on_delta, "no kill left a delta current: the delays are too short to test deltas"
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["delta", "delta", "full"])), min_size=1,
                     max_size=6),
       seed=st.integers(0, 2 ** 16))
def test_any_sequence_of_full_and_delta_saves_restores_the_last(tmp_path_factory, plan, seed):
    """Train some steps, then save in full or incrementally, in any order: every save restores exactly the
    oracle of that save, the directory holds exactly the newest full save and the deltas after it."""
    rng = np.random.default_rng(seed)
    emb = make_engine()
    oracle = Oracle(emb)
    path = tmp_path_factory.mktemp("plan") / "ckpt"
    chain = []
    for steps, kind in plan:
        oracle.train(rng, steps)
        written, _ = oracle.save(path, incremental=kind == "delta")
        chain = chain + [written] if "delta" in manifest_at(written) else [written]
        assert snapshots(path) == sorted(os.path.basename(d) for d in chain)
        assert_holds(ec.Embedding.restore(path), oracle.saved[-1], f"after {kind} save {len(oracle.saved)}")
