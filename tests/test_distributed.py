"""Sharded tables over MPI ranks equal one process fed the concatenated batches (mpiexec -n 1..4)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
from embedcore.checkpoint import open_snapshot

pytest.importorskip("mpi4py", reason="needs the mpi extra: pip install 'embedcore[mpi]' (.ci/run installs it)")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import mpi_train  # noqa: E402

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
STEPS = 4


def mpirun(n, script, *args, timeout=240):
    if MPIEXEC is None:
        pytest.fail("mpi4py is installed but no mpiexec was found (pip install 'embedcore[mpi]' brings one)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                      os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, os.path.join(WORKERS, script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def one_process():
    """Single-process Embedding trained on the global batches, samples ordered as the ranks concatenate them."""
    results = {}

    def run(world):
        if world not in results:
            features, optimizer = mpi_train.config()
            emb = ec.Embedding(features, optimizer, seed=3)
            order = np.concatenate([np.arange(k, mpi_train.GLOBAL, world) for k in range(world)])
            for t in range(STEPS):
                f, w, seed = mpi_train.take(mpi_train.global_batch(t, mpi_train.GLOBAL), order)
                weights = {"user": None, "items": w["items"], "recent": None, "tags": None}
                acts, ctx = emb.lookup(f, weights)
                emb.apply_gradients(mpi_train.gradients(acts, seed, order), ctx)
            results[world] = emb
        return results[world]
    return run


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_training_equals_one_process(tmp_path, one_process, world):
    out = tmp_path / "tables.npz"
    proc = mpirun(world, "mpi_train.py", out, STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["world"] == world and facts["step"] == STEPS
    # Rows per rank: about 1/world of each table (memory per rank ~ 1/N).
    assert facts["rows"]["items"] == len(range(0, 257, world)) or facts["rows"]["items"] == 257 // world
    emb = one_process(world)
    got = np.load(out)
    for name, table in emb.embedding_tables.items():
        tolerance = {"rtol": 0, "atol": 0} if world == 1 else {"rtol": 1e-5, "atol": 1e-6}
        np.testing.assert_allclose(got[f"{name}/weights"], table, err_msg=name, **tolerance)
        for slot, value in emb.slot_variables[name].items():
            np.testing.assert_allclose(got[f"{name}/{slot}"], value, err_msg=f"{name}/{slot}", **tolerance)


def rank_reports(out_dir):
    reports = {}
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            facts = json.load(f)
        reports[facts["rank"]] = facts
    return reports


def test_a_config_that_differs_between_ranks_is_refused_everywhere(tmp_path):
    proc = mpirun(3, "mpi_failures.py", "config", tmp_path, timeout=180)
    reports = rank_reports(tmp_path)
    assert sorted(reports) == [0, 1, 2], proc.stdout + proc.stderr[-2000:]
    for r in reports.values():
        assert r["stage"] == "construct"
        assert "configuration" in r["error"] and "ranks [1] disagree with rank 0" in r["error"]


@pytest.mark.parametrize("mode, match", [("bad_ids", "rank 1: .*feature 'f'.*40"),
                                         ("nan", "rank 1: .*NaN")])
def test_bad_input_on_one_rank_is_refused_on_every_rank_and_changes_nothing(tmp_path, mode, match):
    proc = mpirun(2, "mpi_failures.py", mode, tmp_path, timeout=180)
    reports = rank_reports(tmp_path)
    assert sorted(reports) == [0, 1], proc.stdout + proc.stderr[-2000:]
    import re
    for r in reports.values():
        assert r["stage"] == "step" and r["step"] == 0 and r["unchanged"], r
        assert re.search(match, r["error"]), r["error"]


def test_a_stuck_rank_makes_the_others_fail_within_the_timeout(tmp_path):
    import time
    start = time.monotonic()
    proc = mpirun(3, "mpi_failures.py", "stuck", tmp_path, timeout=180)
    reports = rank_reports(tmp_path)
    for rank in (0, 2):
        assert reports[rank]["type"] == "DistributedError", reports
        assert "did not complete within 5 s" in reports[rank]["error"]
    assert time.monotonic() - start < 170


def test_a_dead_rank_ends_the_job_with_an_error_not_a_hang(tmp_path):
    proc = mpirun(3, "mpi_failures.py", "die", tmp_path, timeout=180)  # raises TimeoutExpired on a hang
    assert proc.returncode != 0
    assert 1 not in rank_reports(tmp_path)


def reference_run(orders):
    """One process, step t fed the global batch in the sample order ``orders[t]`` (the world size then)."""
    features, optimizer = mpi_train.config()
    emb = ec.Embedding(features, optimizer, seed=3)
    for t, world in enumerate(orders):
        order = np.concatenate([np.arange(k, mpi_train.GLOBAL, world) for k in range(world)])
        f, w, seed = mpi_train.take(mpi_train.global_batch(t, mpi_train.GLOBAL), order)
        acts, ctx = emb.lookup(f, {"user": None, "items": w["items"], "recent": None, "tags": None})
        emb.apply_gradients(mpi_train.gradients(acts, seed, order), ctx)
    return emb


def assert_tables(npz, emb, exact):
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for name, table in emb.embedding_tables.items():
        np.testing.assert_allclose(npz[f"{name}/weights"], table, err_msg=name, **tolerance)
        for slot, value in emb.slot_variables[name].items():
            np.testing.assert_allclose(npz[f"{name}/{slot}"], value, err_msg=f"{name}/{slot}", **tolerance)


@pytest.mark.parametrize("written, read", [(4, 2), (2, 3), (1, 4), (3, 1)])
def test_checkpoints_move_between_world_sizes(tmp_path, written, read):
    ckpt = tmp_path / "ckpt"
    proc = mpirun(written, "mpi_train.py", tmp_path / "saved.npz", 2, "--save", ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = np.load(tmp_path / "saved.npz")
    # One process without MPI reads the sharded checkpoint whole.
    alone = ec.Embedding.restore(ckpt)
    assert alone.step == 2
    assert_tables(saved, alone, exact=True)
    names = sorted(os.listdir(open_snapshot(ckpt).dir))
    assert sum(n.startswith("table-0000-shard-") for n in names) == written
    # Another world size loads exactly those tables and trains on.
    out = str(tmp_path / "resumed.npz")
    proc = mpirun(read, "mpi_train.py", out, 4, "--resume", ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_tables(np.load(out + ".loaded.npz"), alone, exact=True)
    assert_tables(np.load(out), reference_run([written] * 2 + [read] * 2), exact=(written == read == 1))
