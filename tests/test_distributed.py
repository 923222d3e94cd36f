"""Sharded tables over MPI ranks equal one process fed the concatenated batches (mpiexec -n 1..4)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec

pytest.importorskip("mpi4py")
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
