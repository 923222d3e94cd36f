"""Serving: lookups from a checkpoint equal training lookups; tables read-only; slots and code never read."""

import json
import os
import sys

import numpy as np
import pytest

import embedcore as ec
from embedcore.checkpoint import CheckpointError, open_snapshot
from embedcore.serving import ServingEmbedding

from .harness import rewrite_manifest

sys.path.insert(0, os.path.dirname(__file__))
import resume_worker  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    emb = resume_worker.make_engine()
    resume_worker.train(emb, 3)
    path = tmp_path_factory.mktemp("serving") / "ckpt"
    emb.save(path)
    return emb, path


def lookups_equal(emb, server, features, weights=None):
    expected, _ = emb.lookup(features, weights)
    got = server.lookup(features, weights)
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].shape == expected[name].shape
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize("t", [0, 5, 11])
def test_serving_equals_training_lookups(trained, t):
    emb, path = trained
    server = ServingEmbedding(path)
    assert server.step == 3
    lookups_equal(emb, server, resume_worker.batch(t))


def test_weighted_ragged_and_sparse_inputs(trained):
    emb, path = trained
    server = ServingEmbedding(path, verify=False)
    features = {"user": ec.Ragged([3, 3, 7, 299], [0, 2, 2, 4]), "items": [[1, 1, 2], [], [499]],
                "recent": ec.Sparse([[0, 0], [2, 1]], [5, 6], (3, 2)), "tags": np.array([[0, 39], [1, 1], [2, 3]]),
                "age": np.array([0, 29, 3])}
    weights = {"user": ec.Ragged([0.5, 2.0, 1.0, -1.0], [0, 2, 2, 4]), "items": [[1.0, 2.0, 0.5], [], [3.0]],
               "recent": None, "tags": np.array([[1.0, 2.0], [0.0, 0.0], [1.0, 1.0]], np.float32), "age": None}
    lookups_equal(emb, server, features, weights)


def test_tables_are_read_only_memory_maps(trained):
    _, path = trained
    server = ServingEmbedding(path)
    table = server.embedding_tables["items"]
    assert not table.flags.writeable
    assert isinstance(table.base, np.memmap) or isinstance(getattr(table.base, "base", None), np.memmap)
    with pytest.raises(ValueError):
        table[0, 0] = 1.0
    assert not hasattr(server, "apply_gradients")
    assert "step=3" in repr(server)


def test_bad_ids_are_refused(trained):
    _, path = trained
    server = ServingEmbedding(path)
    features = resume_worker.batch(0)
    features["user"] = features["user"].copy()
    features["user"][3] = 300
    with pytest.raises(ec.InputError, match="user.*300"):
        server.lookup(features)


def test_serving_reads_no_slots_and_imports_nothing(tmp_path):
    emb = resume_worker.make_engine()
    resume_worker.train(emb, 1)
    path = tmp_path / "c"
    emb.save(path)
    # Point the custom computation at a module that cannot exist and corrupt every slot tensor's bytes:
    # serving neither imports the one nor reads the other; training restore refuses both.
    rewrite_manifest(path, lambda t: t.replace("embedcore.app.quickstart:custom_adagrad", "not_a_module_abc:f"))
    snap = open_snapshot(path)
    from embedcore.checkpoint.tensor_file import read_header
    for entry in snap.manifest["tables"].values():
        f = os.path.join(snap.dir, entry["shards"][0]["file"])
        header, _, start = read_header(f)
        raw = bytearray(open(f, "rb").read())
        for name, h in header.items():
            if name.startswith("slot/"):
                raw[start + h["begin"]] ^= 0xFF
        open(f, "wb").write(raw)
    server = ServingEmbedding(path)
    lookups_equal(emb, server, resume_worker.batch(4))
    with pytest.raises(CheckpointError, match="cannot import 'not_a_module_abc:f'"):
        ec.Embedding.restore(path, allow_import=True)
    with pytest.raises(CheckpointError, match="'slot/.*' does not match its SHA-256"):
        ec.Embedding.restore(path, functions={"not_a_module_abc:f": resume_worker.custom_adagrad})


def test_corrupt_weights_are_refused(tmp_path):
    emb = resume_worker.make_engine()
    emb.save(tmp_path / "c")
    snap = open_snapshot(tmp_path / "c")
    f = os.path.join(snap.dir, snap.manifest["tables"]["users"]["shards"][0]["file"])
    from embedcore.checkpoint.tensor_file import read_header
    header, _, start = read_header(f)
    raw = bytearray(open(f, "rb").read())
    raw[start + header["weights"]["begin"] + 17] ^= 1
    open(f, "wb").write(raw)
    with pytest.raises(CheckpointError, match="'weights' does not match its SHA-256"):
        ServingEmbedding(tmp_path / "c")


@pytest.mark.parametrize("edit, match", [
    (lambda m: [t.update(vocabulary_size=10 ** 6) for t in m["config"]["tables"] if t["name"] == "users"],
     r"needs shape \(1000000, 8\)"),
    (lambda m: m["tables"].pop("users"), "holds no table 'users'"),
])
def test_a_table_that_does_not_match_its_config_is_refused(tmp_path, edit, match):
    """A table smaller than its configured vocabulary would let lookups read past its end: refused."""
    emb = resume_worker.make_engine()
    path = tmp_path / "c"
    emb.save(path)

    def rewrite(text):
        manifest = json.loads(text)
        edit(manifest)
        return json.dumps(manifest)

    rewrite_manifest(path, rewrite)
    with pytest.raises(CheckpointError, match=match):
        ServingEmbedding(path)
