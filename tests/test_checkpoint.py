"""Checkpoints: exact resume, layout independence, atomic writes, corruption refused, no code executed."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
from embedcore.checkpoint import CheckpointError, open_snapshot, read_extra
from embedcore.app.quickstart import custom_adagrad, custom_sgd

from .harness import rewrite_manifest

sys.path.insert(0, os.path.dirname(__file__))
import resume_worker  # noqa: E402

HERE = os.path.dirname(__file__)


def assert_same_state(a, b):
    assert a.step == b.step
    for name, table in a.embedding_tables.items():
        np.testing.assert_array_equal(table, b.embedding_tables[name], err_msg=name)
        for slot, value in a.slot_variables[name].items():
            np.testing.assert_array_equal(value, b.slot_variables[name][slot], err_msg=f"{name}/{slot}")


def snapshot_dir(path):
    return open_snapshot(path).dir


@pytest.fixture(scope="module")
def reference_run():
    emb = resume_worker.make_engine()
    resume_worker.train(emb, 8)
    return emb


@pytest.mark.parametrize("stop_at", [0, 3])
@pytest.mark.parametrize("stack_tables", [True, False])
def test_resume_is_bit_identical(tmp_path, reference_run, stop_at, stack_tables):
    emb = resume_worker.make_engine()
    resume_worker.train(emb, stop_at)
    emb.save(tmp_path / "ckpt")
    resumed = ec.Embedding.restore(tmp_path / "ckpt", functions=[custom_adagrad], stack_tables=stack_tables)
    assert resumed.step == stop_at
    assert resumed.num_physical_tables == (3 if stack_tables else 4)
    resume_worker.train(resumed, 8)
    assert_same_state(resumed, reference_run)


def test_load_into_a_fresh_engine_and_unstacked_layout(tmp_path, reference_run):
    emb = resume_worker.make_engine()
    resume_worker.train(emb, 5)
    emb.save(tmp_path / "ckpt")
    fresh = resume_worker.make_engine()
    fresh.load(tmp_path / "ckpt")
    resume_worker.train(fresh, 8)
    assert_same_state(fresh, reference_run)


def test_save_kill_resume(tmp_path, reference_run):
    """A process saving after every step is SIGKILLed; resuming from what it left matches a run that never stopped."""
    path = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "resume_worker.py"), path, "1000"],
                            stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "saved 4":
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    resumed = ec.Embedding.restore(path, functions=[custom_adagrad])
    assert resumed.step >= 4
    if resumed.step > 8:  # the kill landed late: compare against a longer uninterrupted run
        reference_run = resume_worker.make_engine()
        resume_worker.train(reference_run, resumed.step + 2)
    resume_worker.train(resumed, reference_run.step)
    assert_same_state(resumed, reference_run)
    resumed.save(path)  # the next save removes whatever the killed save left behind
    assert sorted(os.listdir(path)) == ["CURRENT", os.path.basename(snapshot_dir(path))]


def test_every_builtin_round_trips(tmp_path):
    optimizers = [ec.SGD(0.1, clipvalue=0.5), ec.Adagrad(0.1, weight_decay_factor=0.01),
                  ec.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True), ec.Adam(0.01, lazy_adam=False),
                  ec.FTRL(0.1, l1_regularization_strength=0.01), ec.RowwiseAdagrad(0.1),
                  ec.CustomOptimizer(custom_sgd, 0.5),
                  ec.CustomOptimizer(custom_adagrad, 0.1, ["acc"], [ec.Constant(0.2)], hyperparameters=[1.5])]
    for k, opt in enumerate(optimizers):
        table = ec.TableConfig(20, 3, name="t", initializer=ec.RandomUniform(-1, 1, seed=3))
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, opt)
        acts, ctx = emb({"f": np.array([1, 2, 2, 19])})
        emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
        emb.save(tmp_path / f"c{k}")
        back = ec.Embedding.restore(tmp_path / f"c{k}", allow_import=True)
        assert back.tables["t"].optimizer is None
        assert back.optimizer == opt
        assert back.tables["t"].initializer == ec.RandomUniform(-1, 1, seed=3)
        assert_same_state(back, emb)


def test_extra_arrays_and_metadata(tmp_path):
    emb = resume_worker.make_engine()
    extra = {"dense/w": np.arange(6, dtype=np.float32).reshape(2, 3), "position": np.array([12], np.int64)}
    emb.save(tmp_path / "c", extra=extra, metadata={"epoch": 2, "note": "x"})
    arrays, metadata = read_extra(tmp_path / "c")
    assert metadata == {"epoch": 2, "note": "x"}
    assert set(arrays) == set(extra)
    for name in extra:
        np.testing.assert_array_equal(arrays[name], extra[name])
        assert arrays[name].dtype == extra[name].dtype


def test_file_layout_is_plain_safetensors(tmp_path):
    """Read a table file with nothing but struct and json: the documented layout, 64-byte aligned data."""
    emb = resume_worker.make_engine()
    emb.save(tmp_path / "c")
    d = snapshot_dir(tmp_path / "c")
    names = sorted(os.listdir(d))
    assert all(n == "manifest.json" or n.endswith(".safetensors") for n in names), names
    manifest = json.load(open(os.path.join(d, "manifest.json")))
    entry = manifest["tables"]["tags"]
    raw = open(os.path.join(d, entry["shards"][0]["file"]), "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % 64 == 0
    begin, end = header["weights"]["data_offsets"]
    weights = np.frombuffer(raw[8 + n + begin:8 + n + end], "<f4").reshape(header["weights"]["shape"])
    np.testing.assert_array_equal(weights, emb.embedding_tables["tags"])
    assert set(header) - {"__metadata__"} == {"weights", "slot/momenta", "slot/velocities"}


def test_save_replaces_atomically_and_prunes(tmp_path):
    emb = resume_worker.make_engine()
    path = tmp_path / "c"
    emb.save(path)
    first = snapshot_dir(path)
    os.mkdir(path / "snapshot-000000000099-deadbeef")  # what a crashed save leaves
    (path / "CURRENT.1234.tmp").write_text("{")
    resume_worker.train(emb, 1)
    emb.save(path)
    assert not os.path.exists(first)
    assert open_snapshot(path).step == 1
    assert sorted(os.listdir(path)) == ["CURRENT", os.path.basename(snapshot_dir(path))]


def test_an_interrupt_after_commit_keeps_the_new_checkpoint(tmp_path, monkeypatch):
    emb = resume_worker.make_engine()
    path = tmp_path / "c"
    emb.save(path)
    resume_worker.train(emb, 1)
    from embedcore.checkpoint import store

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.SnapshotWriter, "_prune", interrupted)
    with pytest.raises(KeyboardInterrupt):
        emb.save(path)
    back = ec.Embedding.restore(path, functions=[custom_adagrad])
    assert back.step == 1
    assert_same_state(back, emb)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    emb = resume_worker.make_engine()
    path = tmp_path / "c"
    emb.save(path)
    before = snapshot_dir(path)
    resume_worker.train(emb, 1)
    for extra, metadata in (({"bad": np.array(["text"])}, None), ({"__metadata__": np.zeros(2)}, None),
                            ({"": np.zeros(2)}, None), ({"x": [1.0]}, None), (None, {"n": np.int64(3)}),
                            (None, {"x": float("nan")})):
        with pytest.raises(CheckpointError, match="cannot be stored|metadata must be JSON"):
            emb.save(path, extra=extra, metadata=metadata)
        assert snapshot_dir(path) == before
    real_replace = os.replace

    def crash(src, dst):
        raise OSError("simulated crash before CURRENT moves")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        emb.save(path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert snapshot_dir(path) == before
    assert sorted(n for n in os.listdir(path) if n.startswith("snapshot-")) == [os.path.basename(before)]
    back = ec.Embedding.restore(path, functions=[custom_adagrad])
    assert back.step == 0


# -- corruption and mismatch ---------------------------------------------------------------------------

@pytest.fixture()
def saved(tmp_path):
    emb = resume_worker.make_engine()
    resume_worker.train(emb, 2)
    emb.save(tmp_path / "c")
    return emb, tmp_path / "c"


def table_file(path, table="items"):
    snap = open_snapshot(path)
    return os.path.join(snap.dir, snap.manifest["tables"][table]["shards"][0]["file"])


def refused_and_unchanged(path, match):
    target = resume_worker.make_engine()
    before = {k: v.copy() for k, v in target.embedding_tables.items()}
    with pytest.raises(CheckpointError, match=match):
        target.load(path)
    for k, v in target.embedding_tables.items():
        np.testing.assert_array_equal(v, before[k])
    assert target.step == 0
    with pytest.raises(CheckpointError, match=match):
        ec.Embedding.restore(path, functions=[custom_adagrad])


def test_flipped_byte_in_table_data_is_refused(saved):
    _, path = saved
    f = table_file(path)
    raw = bytearray(open(f, "rb").read())
    raw[-5] ^= 0x40
    open(f, "wb").write(raw)
    refused_and_unchanged(path, "does not match its SHA-256")


@pytest.mark.parametrize("keep", [0, 7, 100, -4])
def test_truncated_table_file_is_refused(saved, keep):
    _, path = saved
    f = table_file(path)
    raw = open(f, "rb").read()
    open(f, "wb").write(raw[:keep] if keep >= 0 else raw[:keep])
    refused_and_unchanged(path, "corrupt checkpoint|truncated")


def test_garbage_header_is_refused(saved):
    _, path = saved
    f = table_file(path)
    raw = bytearray(open(f, "rb").read())
    raw[10:14] = b"\xff\xfe{{"
    open(f, "wb").write(raw)
    refused_and_unchanged(path, "not valid JSON")


def test_edited_manifest_is_refused(saved):
    _, path = saved
    m = os.path.join(snapshot_dir(path), "manifest.json")
    text = open(m).read().replace('"step": 2', '"step": 3')
    open(m, "w").write(text)
    refused_and_unchanged(path, "manifest.json does not match")


@pytest.mark.parametrize("content", ["", "not json", "[1]", '{"snapshot": "snapshot-1-ab"}',
                                     '{"snapshot": "../../etc", "manifest_sha256": "00"}',
                                     '{"snapshot": "snapshot-1/../../x", "manifest_sha256": "00"}',
                                     '{"snapshot": 3, "manifest_sha256": "00"}'])
def test_bad_current_pointer_is_refused(saved, content):
    _, path = saved
    open(os.path.join(path, "CURRENT"), "w").write(content)
    refused_and_unchanged(path, "CURRENT is unreadable")


def test_missing_checkpoint_and_missing_snapshot(tmp_path, saved):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ec.Embedding.restore(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no CURRENT file"):
        ec.Embedding.restore(tmp_path / "empty")
    _, path = saved
    shutil.rmtree(snapshot_dir(path))
    refused_and_unchanged(path, "manifest.json")


def test_mismatched_engine_is_refused_and_non_strict_loads(saved):
    emb, path = saved
    other = ec.Embedding({"user": ec.FeatureConfig(ec.TableConfig(300, 8, name="users"))}, ec.SGD(0.1))
    with pytest.raises(CheckpointError, match="configured differently"):
        other.load(path)
    with pytest.raises(CheckpointError, match="holds tables"):
        other.load(path, strict=False)
    # Same tables and slots, another learning rate: strict refuses, non-strict loads.
    changed = resume_worker.make_engine()
    changed.optimizer.learning_rate = 0.5
    with pytest.raises(CheckpointError, match=r"learning_rate: checkpoint has 0.05, the engine has 0.5"):
        changed.load(path)
    changed.load(path, strict=False)
    assert_same_state(changed, emb)


def test_resized_table_is_refused_even_when_not_strict(tmp_path):
    small = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 4, name="t"))}, ec.Adagrad(0.1))
    small.save(tmp_path / "c")
    big = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(11, 4, name="t"))}, ec.Adagrad(0.1))
    with pytest.raises(CheckpointError, match=r"table 't' tensor 'weights' has shape \(10, 4\); the engine needs shape \(11, 4\)"):
        big.load(tmp_path / "c", strict=False)


# -- functions named by a checkpoint ---------------------------------------------------------------------

def test_functions_are_imported_only_when_allowed(saved):
    _, path = saved
    with pytest.raises(CheckpointError, match=r"never imports code.*functions=\{'embedcore.app.quickstart:custom_adagrad'"):
        ec.Embedding.restore(path)
    assert ec.Embedding.restore(path, allow_import=True).step == 2
    assert ec.Embedding.restore(path, functions={"embedcore.app.quickstart:custom_adagrad": custom_adagrad}).step == 2


def test_a_checkpoint_naming_an_application_module_at_its_old_place_still_restores(saved):
    engine, path = saved  # embedcore.quickstart moved to embedcore.app.quickstart; old checkpoints name the former
    rewrite_manifest(path, lambda t: t.replace("embedcore.app.quickstart:", "embedcore.quickstart:"))
    back = ec.Embedding.restore(path, allow_import=True)
    assert back.tables["items"].optimizer.custom_computation is custom_adagrad and back.step == engine.step


def test_unimportable_functions_need_the_callers_engine(tmp_path):
    opt = ec.CustomOptimizer(lambda g, w, s, lr, h: w - lr * g, learning_rate=lambda: 0.1)
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 2, name="t"))}, opt)
    emb.save(tmp_path / "c")
    with pytest.raises(CheckpointError, match="has no import path.*emb.load"):
        ec.Embedding.restore(tmp_path / "c", allow_import=True)
    emb.load(tmp_path / "c")


def test_a_module_path_that_does_not_import_is_a_clear_error(saved):
    _, path = saved
    rewrite_manifest(path, lambda t: t.replace("embedcore.app.quickstart:custom_adagrad", "no_such_module_xyz:f"))
    with pytest.raises(CheckpointError, match="cannot import 'no_such_module_xyz:f'"):
        ec.Embedding.restore(path, allow_import=True)


@pytest.mark.parametrize("name", ["../../outside.safetensors", "/tmp/outside.safetensors", "a/b.safetensors",
                                  "manifest.json", ".hidden.safetensors"])
def test_manifest_file_names_cannot_leave_the_snapshot(saved, tmp_path, name):
    _, path = saved
    file_name = json.loads(open(os.path.join(snapshot_dir(path), "manifest.json")).read())["tables"]["items"]["shards"][0]["file"]
    rewrite_manifest(path, lambda t: t.replace(f'"{file_name}"', json.dumps(name)))
    refused_and_unchanged(path, "plain \\*.safetensors names")


def test_restore_accepts_a_replacement_function(saved):
    emb, path = saved

    def my_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        accumulator = slot_variables[0] + gradient * gradient
        return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator

    back = ec.Embedding.restore(path, functions={"embedcore.app.quickstart:custom_adagrad": my_adagrad})
    assert back.tables["items"].optimizer.custom_computation is my_adagrad
    assert_same_state(back, emb)
    with pytest.raises(CheckpointError, match="has no import path"):
        ec.Embedding.restore(path, functions=[lambda *a: a])


@pytest.mark.parametrize("shape", [[2, 8], [10 ** 12, 10 ** 12], [-1, 8]])
def test_impossible_tensor_shapes_are_refused(saved, shape):
    _, path = saved
    f = table_file(path, "users")
    from embedcore.checkpoint.tensor_file import read_header
    header, _, start = read_header(f)
    raw = open(f, "rb").read()
    text = raw[8:start].decode().rstrip()
    entry = json.loads(text)
    entry["weights"]["shape"] = shape
    new = json.dumps(entry).encode()
    new += b" " * (start - 8 - len(new))
    assert len(new) == start - 8
    open(f, "wb").write(raw[:8] + new + raw[start:])
    refused_and_unchanged(path, "corrupt checkpoint|malformed|does not fit")
