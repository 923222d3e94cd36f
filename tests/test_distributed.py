"""Sharded tables over MPI ranks equal one process fed the concatenated batches (mpiexec -n 1..4); failures
are refused on every rank, or end the job in bounded time; checkpoints commit only whole."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import embedcore as ec
from embedcore.checkpoint import open_snapshot

pytest.importorskip("mpi4py", reason="needs the mpi extra: pip install 'embedcore[mpi]' (.ci/run installs it)")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import mpi_train  # noqa: E402

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
STEPS, SAVED_AT = 4, 2


def mpirun(n, script, *args, timeout=240, python=()):
    if MPIEXEC is None:
        pytest.fail("mpi4py is installed but no mpiexec was found (pip install 'embedcore[mpi]' brings one)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                      os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *python, os.path.join(WORKERS, script),
                           *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


@functools.lru_cache(maxsize=None)
def reference(worlds, kind="float32"):
    return mpi_train.reference(worlds, kind)


assert_tables = mpi_train.assert_tables


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(K, kind)``: a K-rank job's run of mpi_train (4 steps, a checkpoint at step 2, placeholders
    poisoned; ``kind`` "half": the 16-bit tables)."""
    runs = {}

    def run(world, kind="float32"):
        if (world, kind) not in runs:
            d = tmp_path_factory.mktemp(f"world{world}-{kind}")
            proc = mpirun(world, "mpi_train.py", d / "tables.npz", STEPS, "--save-at", SAVED_AT, d / "ckpt",
                          "--poison", 1, "--tables", kind)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[world, kind] = {"dir": d, "facts": json.loads(proc.stdout.strip().splitlines()[-1])}
        return runs[world, kind]
    return run


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_training_equals_one_process(trained, world):
    # Covered on the way: tables of two dims in one exchange, a rank with no samples in every step (K > 1),
    # a non-lazy Adam table of 2 rows (ranks owning none of it for K > 2: their placeholder row holds NaN and
    # must not show), two lookups before the first one's update.
    run = trained(world)
    facts = run["facts"]
    assert facts["world"] == world and facts["step"] == STEPS
    assert facts["rows"]["items"] in (257 // world, -(-257 // world))  # memory per rank ~ 1/N
    placeholders = [z for z in facts["placeholders_were_zero"] if z is not None]  # per rank owning no rows
    assert len(placeholders) >= (world > 2) and all(placeholders)
    assert_tables(np.load(run["dir"] / "tables.npz"), reference((world,) * STEPS), exact=(world == 1))


@pytest.mark.parametrize("written, read", [(4, 2), (2, 3), (1, 4), (3, 1)])
def test_checkpoints_move_between_world_sizes(trained, tmp_path, written, read):
    run = trained(written)
    ckpt = run["dir"] / "ckpt"
    saved = np.load(run["dir"] / "tables.npz.saved.npz")
    # One process without MPI reads the sharded checkpoint whole.
    alone = ec.Embedding.restore(ckpt)
    assert alone.step == SAVED_AT
    assert_tables(saved, alone, exact=True)
    names = sorted(os.listdir(open_snapshot(ckpt).dir))
    assert sum(n.startswith("table-0000-shard-") for n in names) == written
    # Another world size loads exactly those tables and trains on.
    out = str(tmp_path / "resumed.npz")
    proc = mpirun(read, "mpi_train.py", out, STEPS, "--resume", ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_tables(np.load(out + ".loaded.npz"), alone, exact=True)
    assert_tables(np.load(out), reference((written,) * SAVED_AT + (read,) * (STEPS - SAVED_AT)),
                  exact=(written == read == 1))


# -- 16-bit tables (issue 28) --------------------------------------------------------------------------------
# The "half" runs feed batches whose every float32 product and sum is exact (weights 0.5, 1, 2; gradients
# multiples of 2**-6; gains powers of two), so the order ranks sum in cannot show: any world size must give
# one process's bits, and a difference is the engine's (a rounding keyed by a shard's own row numbers, say).

def assert_same_bits(arrays, emb, what):
    """``arrays`` (``mpi_train.load_tables``) hold ``emb``'s tables and slots: dtype, shape and every bit."""
    for name, table in emb.embedding_tables.items():
        for key, value in [("weights", table)] + list(emb.slot_variables[name].items()):
            got = arrays[f"{name}/{key}"]
            assert got.dtype == value.dtype and got.shape == value.shape, (what, name, key, got.dtype, value.dtype)
            differ = np.flatnonzero(got.reshape(-1).view(np.uint8) != value.reshape(-1).view(np.uint8))
            assert differ.size == 0, f"{what}: {name}/{key} differs in {differ.size} bytes"


def _native_dtypes(ckpt):
    from embedcore.checkpoint.tensor_file import read_header
    snap = open_snapshot(ckpt)
    out = {}
    for name, entry in snap.manifest["tables"].items():
        header, _, _ = read_header(os.path.join(snap.dir, entry["shards"][0]["file"]))
        out[name] = {k: str(v["dtype"]) for k, v in header.items()}
    return out


HALF_DTYPES = {"users": {"weights": "bfloat16", "slot/accumulators": "float32"},
               "items": {"weights": "bfloat16", "slot/momenta": "float16", "slot/velocities": "float16"},
               "tiny": {"weights": "bfloat16", "slot/momenta": "float16", "slot/velocities": "float16"},
               "tags": {"weights": "float32", "slot/accumulators": "float16"}}
@pytest.mark.parametrize("world", [1, 2, 3])
def test_16_bit_sharded_training_equals_one_process_bit_for_bit(trained, world):
    """bfloat16 rows rounded stochastically (stacked Adam tables with float16 slots; a lazy Adagrad table),
    a float32 table of float16 slots: K ranks give one process's tables and slots bit for bit (3 ranks: a
    rank holding no row of the 2-row table, its placeholder poisoned with NaN)."""
    run = trained(world, "half")
    assert run["facts"]["world"] == world and run["facts"]["step"] == STEPS
    got = mpi_train.load_tables(run["dir"] / "tables.npz")
    want = reference((world,) * STEPS, "half")
    assert_same_bits(got, want, f"{world} ranks")
    assert str(got["users/weights"].dtype) == "bfloat16" and got["items/velocities"].dtype == np.float16
    untrained = ec.Embedding(*mpi_train.config("half"), seed=3)
    assert not np.array_equal(got["users/weights"], untrained.embedding_tables["users"])  # it trained
    # The collective save wrote the native dtypes, and one process restores the same bits.
    assert _native_dtypes(run["dir"] / "ckpt") == HALF_DTYPES
    alone = ec.Embedding.restore(run["dir"] / "ckpt")
    assert alone.step == SAVED_AT
    assert_same_bits(mpi_train.load_tables(run["dir"] / "tables.npz.saved.npz"), alone, "restored in one process")
    # ... and trains on to the same bits as the job did.
    mpi_train.train(alone, STEPS, lambda t: np.concatenate(mpi_train.assignment(t, world)), kind="half")
    assert_same_bits(got, alone, "trained on in one process")


def test_a_one_process_16_bit_checkpoint_restores_on_two_ranks_bit_for_bit(tmp_path):
    emb = ec.Embedding(*mpi_train.config("half"), seed=3)
    mpi_train.train(emb, SAVED_AT, lambda t: np.concatenate(mpi_train.assignment(t, 1)), kind="half")
    emb.save(tmp_path / "ckpt")
    assert _native_dtypes(tmp_path / "ckpt") == HALF_DTYPES
    out = str(tmp_path / "resumed.npz")
    proc = mpirun(2, "mpi_train.py", out, STEPS, "--resume", tmp_path / "ckpt", "--tables", "half")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_bits(mpi_train.load_tables(out + ".loaded.npz"), emb, "restored on 2 ranks")
    assert_same_bits(mpi_train.load_tables(out), reference((1,) * SAVED_AT + (2,) * (STEPS - SAVED_AT), "half"),
                     "trained on, on 2 ranks")


def rank_reports(out_dir):
    reports = {}
    for name in os.listdir(out_dir):
        if name.startswith("rank-"):
            with open(os.path.join(out_dir, name)) as f:
                facts = json.load(f)
            reports[facts["rank"]] = facts
    return reports


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    out, ckpt = tmp_path_factory.mktemp("refusals"), tmp_path_factory.mktemp("refusals_ckpt")
    proc = mpirun(3, "mpi_failures.py", "refusals", out, ckpt, timeout=240)
    reports = rank_reports(out)
    assert sorted(reports) == [0, 1, 2], proc.stdout + proc.stderr[-3000:]
    return {"ranks": {k: r["scenarios"] for k, r in reports.items()}, "reports": reports, "dir": out, "ckpt": ckpt}


def test_configurations_that_differ_or_fail_on_one_rank_are_refused_everywhere(refusals):
    for r in refusals["reports"].values():
        assert "configuration" in r["differing"] and "ranks [1] disagree with rank 0" in r["differing"]
        # Not a timeout: the failing rank took part in the agreement.
        assert re.search(r"refused on 1 of 3 ranks.*rank 1: ValueError: feature_config entry 'f' must be a "
                         r"FeatureConfig", r["invalid_on_one"]), r["invalid_on_one"]
        assert r["good"] is None


REFUSED = {  # scenario -> (pattern every rank's error matches, the exception type)
    "bad_ids": (r"lookup was refused on 1 of 3 ranks.*rank 1: feature 'f': id 40", "DistributedError"),
    "out_of_memory": (r"lookup was refused on 1 of 3 ranks.*rank 1: MemoryError: cannot allocate", "DistributedError"),
    "nan_gradient": (r"apply_gradients was refused on 1 of 3 ranks.*rank 1: .*holds nan", "DistributedError"),
    "foreign_context": (r"refused on 1 of 3 ranks.*rank 1: ctx must be the context returned by this engine",
                        "DistributedError"),
    "consumed_context": (r"refused on 1 of 3 ranks.*rank 1: .*already applied", "DistributedError"),
    "different_lookups": (r"ranks disagree: rank 0: .*lookup number (\d+); rank 1: .*lookup number (?!\1)\d+",
                          "DistributedError"),
    "message_too_large": (r"lookup: some rank's message would hold 160 elements, more than .* \(60", "DistributedError"),
    "second_thread": (r"cannot lookup: another thread is using this ShardedEmbedding", "RuntimeError"),
    "load_different_checkpoints": (r"load was refused on every rank.*rank 0: read snapshot snapshot-0+(\d+)-.*/a; "
                                   r"rank 1: read snapshot snapshot-0+(?!\1)\d+-.*/b", "DistributedError"),
    "bad_metadata": (r"save was refused on 1 of 3 ranks.*rank 1: metadata must be JSON", "DistributedError"),
    "save_fails_on_one_rank": (r"save \(writing shards\) was refused on 1 of 3 ranks.*rank 1: OSError: .*No space "
                               r"left on device", "DistributedError"),
    # The learning rate is evaluated before the ranks agree: a bad one is refused everywhere, nothing changed.
    "nan_learning_rate": (r"apply_gradients was refused on 1 of 3 ranks.*rank 1: ValueError: .*learning_rate "
                          r"evaluated to nan", "Refused"),
}


def test_schedules_are_called_once_per_step_on_every_rank(refusals):
    """Also on a rank that owns none of the batch's rows (it used to skip the call, so stateful schedules
    drifted apart between ranks)."""
    for rank, scenarios in refusals["ranks"].items():
        assert scenarios["learning_rate_calls"] == 1, rank


@pytest.mark.parametrize("scenario", sorted(REFUSED))
def test_a_bad_call_on_one_rank_is_refused_on_every_rank_and_changes_nothing(refusals, scenario):
    pattern, kind = REFUSED[scenario]
    for rank, scenarios in refusals["ranks"].items():
        r = scenarios[scenario]
        assert kind in r["types"] and r["unchanged"], (rank, r)
        assert re.search(pattern, r["error"]), (rank, r["error"])


def test_after_refusals_the_engine_works_and_contexts_stay_valid(refusals):
    for scenarios in refusals["ranks"].values():
        # Both contexts of two back-to-back lookups applied after the refused attempt: two steps.
        assert scenarios["then_both_apply"] == {"error": None, "unchanged": False, "step": 2}
        assert scenarios["message_fits"]["error"] is None


def test_rows_left_unchanged_and_bad_row_functions_raise_on_every_rank(refusals):
    for scenarios in refusals["ranks"].values():
        r = scenarios["overflow"]  # row 5 and 6: two ranks' sums overflow to inf at their owners
        assert r["type"] == "NonFiniteError" and r["step"] == 3, r
        assert re.search(r"rows 5\b", r["error"]) and re.search(r"rows 6\b", r["error"]), r["error"]
        assert "step is now 3 on every rank" in r["error"]
        r = scenarios["wrong_length"]
        assert r["type"] == "RowFunctionError" and r["step"] == 1, r
        assert "short_when_large returned rows of the wrong length" in r["error"]


def test_a_save_that_fails_on_one_rank_leaves_the_previous_checkpoint_current(refusals):
    zero = refusals["ranks"][0]
    failed = zero["save_fails_on_one_rank"]
    assert failed["current_step"] == zero["first_save_step"]
    # Only the previous snapshot is left: the half-written one is gone.
    assert len(failed["snapshots"]) == 1 and failed["snapshots"][0].startswith(
        f"snapshot-{zero['first_save_step']:012d}-"), failed["snapshots"]
    # The next save works and is the only snapshot left.
    again = zero["save_again"]
    assert again["error"] is None and again["snapshots"] == [open_snapshot(refusals["ckpt"] / "a").name]
    alone = ec.Embedding.restore(refusals["ckpt"] / "a")
    assert alone.step == again["step"]
    np.testing.assert_array_equal(alone.embedding_tables["t"], np.load(refusals["dir"] / "tables.npy"))


def test_a_rank_stuck_during_save_means_no_commit_within_the_timeout(tmp_path):
    ckpt = tmp_path / "ckpt"
    start = time.monotonic()
    proc = mpirun(3, "mpi_failures.py", "save_stuck", tmp_path, ckpt, timeout=180)
    reports = rank_reports(tmp_path)
    assert sorted(reports) == [0, 1, 2], proc.stdout + proc.stderr[-2000:]
    for rank in (0, 2):
        r = reports[rank]["save"]
        assert r["type"] == "DistributedError" and "did not complete within 5 s" in r["error"], r
    assert ec.Embedding.restore(ckpt).step == 1
    assert time.monotonic() - start < 170


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint_and_a_new_job_saves(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = mpirun(3, "mpi_failures.py", "save_killed", tmp_path, ckpt, timeout=180)  # TimeoutExpired on a hang
    assert proc.returncode != 0
    reports = rank_reports(tmp_path)
    assert all(r["first_save"] == 1 and "second_save" not in r for r in reports.values()), reports
    assert ec.Embedding.restore(ckpt).step == 1
    again = tmp_path / "again"
    again.mkdir()
    proc = mpirun(2, "mpi_failures.py", "resave", again, ckpt, timeout=180)
    reports = rank_reports(again)
    assert sorted(reports) == [0, 1], proc.stdout + proc.stderr[-2000:]
    assert all(r["restored_step"] == 1 and r["saved_step"] == 2 for r in reports.values())
    assert ec.Embedding.restore(ckpt).step == 2
    assert [n for n in os.listdir(ckpt) if n.startswith("snapshot-")] == [open_snapshot(ckpt).name]


def test_a_stuck_rank_makes_the_others_fail_within_the_timeout_and_end_the_job(tmp_path):
    start = time.monotonic()
    proc = mpirun(3, "mpi_failures.py", "stuck", tmp_path, timeout=180, python=("-m", "mpi4py"))
    reports = rank_reports(tmp_path)
    for rank in (0, 2):
        assert reports[rank]["type"] == "DistributedError", reports
        assert "did not complete within 5 s" in reports[rank]["error"]
    # Their unhandled error aborted the job long before rank 1 would have woken up (90 s).
    assert proc.returncode != 0 and 1 not in reports
    assert time.monotonic() - start < 80


def test_a_failure_after_the_ranks_agreed_to_go_ahead_makes_the_engine_unusable(tmp_path):
    proc = mpirun(1, "mpi_failures.py", "mid_step", tmp_path, timeout=180)
    reports = rank_reports(tmp_path)
    assert sorted(reports) == [0], proc.stdout + proc.stderr[-2000:]
    assert reports[0]["first"]["type"] == "MemoryError"
    then = reports[0]["then"]
    assert then["type"] == "DistributedError" and then["unchanged"], then
    assert re.search(r"unusable after an earlier failure: rank 0: lookup failed after the ranks agreed to go "
                     r"ahead \(MemoryError: cannot allocate the answer\)", then["error"]), then["error"]


def test_a_dead_rank_ends_the_job_with_an_error_not_a_hang(tmp_path):
    proc = mpirun(3, "mpi_failures.py", "die", tmp_path, timeout=180)  # raises TimeoutExpired on a hang
    assert proc.returncode != 0
    assert 1 not in rank_reports(tmp_path)


class _Request:
    """Stands in for an MPI request: completes at the ``after``-th poll (never, if None)."""

    def __init__(self, after):
        self.after, self.polls = after, 0

    def Test(self):
        self.polls += 1
        return self.after is not None and self.polls >= self.after


def _bare_exchanger(timeout):
    from embedcore.distributed import exchange
    ex = exchange.Exchanger.__new__(exchange.Exchanger)
    ex.rank, ex.timeout, ex.broken, ex.MPI = 0, timeout, None, None
    return ex


def test_waiting_for_a_collective_yields_the_core_between_polls_and_does_not_sleep_at_first(monkeypatch):
    # time.sleep(0) sleeps for the timer slack (~50 us): between polls it made exchanges 40x slower.
    from embedcore.distributed import exchange
    sleeps, yields = [], []
    monkeypatch.setattr(exchange.time, "sleep", sleeps.append)
    monkeypatch.setattr(exchange, "_yield", lambda: yields.append(1))
    request = _Request(after=1000)
    _bare_exchanger(10.0)._wait(request, "x")
    assert request.polls == 1000 and len(yields) == 999 and sleeps == []


def test_a_wait_that_never_completes_raises_at_its_deadline_sleeping_at_most_1_ms():
    from embedcore.distributed import exchange
    ex = _bare_exchanger(0.3)
    start = time.monotonic()
    with pytest.raises(exchange.DistributedError, match=r"x did not complete within 0.3 s"):
        ex._wait(_Request(after=None), "x")
    assert 0.3 <= time.monotonic() - start < 0.35
    with pytest.raises(exchange.DistributedError, match="unusable after an earlier failure"):
        ex.check_usable()


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1.0, True, "5"])
def test_a_timeout_that_could_never_fire_is_refused(timeout):
    from embedcore.distributed import exchange
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        exchange.Exchanger(None, timeout)
