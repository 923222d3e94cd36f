"""EmbeddingModule(..., process_group=pg) over torch.distributed (gloo): the ShardedEmbedding of the MPI tests
on the torch transport. K ranks equal one process fed the concatenated batch; bad input on one rank is
refused on all; a stuck rank makes the others fail within the timeout; collective checkpoints move between
world sizes and one process; under DDP the dense part is synchronized and an unsharded module refused."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]'")

import embedcore as ec  # noqa: E402
from embedcore.checkpoint import open_snapshot  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import mpi_train  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "workers", "torch_train.py")
STEPS, SAVED_AT = 4, 2


def launch(world, mode, out, *args, timeout=180):
    """Start ``world`` ranks of torch_train.py (a file:// rendezvous); their reports by rank."""
    os.makedirs(out, exist_ok=True)
    rendezvous = os.path.join(out, "rendezvous")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                      os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(out), "--rank", str(k), "--world", str(world),
                               "--init", rendezvous, *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for k in range(world)]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = {}
    for k in range(world):
        path = os.path.join(out, f"rank-{k}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[k] = json.load(f)
    return [p.returncode for p in procs], reports, "\n".join(logs)[-4000:]


reference, assert_tables = mpi_train.reference, mpi_train.assert_tables


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A 2-rank gloo job: one refused forward (rank 1's ids out of range), then 4 steps, a checkpoint at 2."""
    out = tmp_path_factory.mktemp("gloo2")
    codes, reports, log = launch(2, "train", out, "--steps", STEPS, "--save-at", SAVED_AT, out / "ckpt", "--bad", 1)
    assert codes == [0, 0] and sorted(reports) == [0, 1], log
    return out, reports


def test_two_gloo_ranks_equal_one_process_fed_the_concatenated_batch(two_ranks):
    out, reports = two_ranks
    assert all(r["step"] == STEPS and r["world"] == 2 for r in reports.values())
    assert sorted(reports[0]["rows"]["items"] + reports[1]["rows"]["items"] for _ in [0]) == [257]
    assert_tables(np.load(out / "tables.npz"), reference((2,) * STEPS), exact=False)


def test_one_gloo_rank_is_bit_identical_to_one_process(tmp_path):
    codes, reports, log = launch(1, "train", tmp_path, "--steps", STEPS)
    assert codes == [0] and reports[0]["step"] == STEPS, log
    assert_tables(np.load(tmp_path / "tables.npz"), reference((1,) * STEPS), exact=True)


def test_bad_input_on_one_rank_is_refused_on_every_rank_and_changes_nothing(two_ranks):
    _, reports = two_ranks
    for rank, r in reports.items():
        assert r["bad"] is not None, rank
        assert r["bad"]["type"] == "Refused", r["bad"]
        assert "lookup was refused on 1 of 2 ranks (nothing changed on any rank): rank 1:" in r["bad"]["message"]
        assert "101" in r["bad"]["message"]
        assert r["bad_changed_nothing"]


def test_a_collective_save_restores_in_one_process_and_one_process_checkpoint_on_two_ranks(two_ranks, tmp_path):
    out, _ = two_ranks
    ckpt = out / "ckpt"
    saved = np.load(out / "saved.npz")
    alone = ec.Embedding.restore(ckpt)
    assert alone.step == SAVED_AT
    assert_tables(saved, alone, exact=True)
    assert sum(n.startswith("table-0000-shard-") for n in os.listdir(open_snapshot(ckpt).dir)) == 2
    # One process's checkpoint, resumed by two gloo ranks, trains on as one process would.
    single = reference((1,) * SAVED_AT)
    single.save(tmp_path / "single")
    codes, reports, log = launch(2, "train", tmp_path / "run", "--steps", STEPS, "--resume", tmp_path / "single")
    assert codes == [0, 0], log
    assert_tables(np.load(tmp_path / "run" / "loaded.npz"), single, exact=True)
    assert_tables(np.load(tmp_path / "run" / "tables.npz"), reference((1,) * SAVED_AT + (2,) * (STEPS - SAVED_AT)),
                  exact=False)


def test_a_stuck_rank_makes_the_other_fail_within_the_timeout(tmp_path):
    codes, reports, log = launch(2, "stuck", tmp_path, "--timeout", 4, timeout=120)
    assert 0 in reports, log
    error = reports[0]["error"]
    assert error is not None and error["type"] == "DistributedError", log
    assert "did not complete within 4 s" in error["message"]
    assert 4 <= reports[0]["elapsed"] < 8
    assert codes[0] == 0, log


def test_a_dead_rank_makes_the_other_fail_not_hang(tmp_path):
    codes, reports, log = launch(2, "stuck", tmp_path, "--timeout", 20, "--die", 1, timeout=120)
    assert codes[1] == 3 and 0 in reports, log
    error = reports[0]["error"]
    assert error is not None and error["type"] == "DistributedError", log
    assert reports[0]["elapsed"] < 21  # the closed connection fails the collective, or the timeout does
    assert codes[0] == 0, log


def test_under_ddp_the_dense_part_syncs_and_an_unsharded_module_is_refused(tmp_path):
    codes, reports, log = launch(2, "ddp", tmp_path)
    assert codes == [0, 0], log
    assert reports[0]["dense"] == reports[1]["dense"]
    assert reports[0]["step"] == reports[1]["step"] == 2
    for r in reports.values():
        assert r["replicated"] is not None and "drift apart" in r["replicated"]
        assert "process_group=" in r["replicated"]
