"""Determinism: the same seed and data give bit-identical tables, slots and activations, whatever the process,
the number of Numba threads or the stacking of tables.

Two worker processes (``tests/workers/determinism.py``) train the same workload and print SHA-256 digests of
every table and slot: one with ``NUMBA_NUM_THREADS=1``, one with ``NUMBA_NUM_THREADS=2`` (which also trains
once more on one thread with ``numba.set_num_threads(1)``), with different ``PYTHONHASHSEED``s. Each trains
with ``stack_tables`` on and off. The workload: SGD, Adagrad, Adam (lazy and not), FTRL, a custom function
with a reduction over the row and a ``slot_dims=1`` slot; duplicate ids, features sharing tables, weights,
ragged and sequence features. Compiling its six update kernels takes about 35 s of CPU per process, so the
two processes run side by side.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "determinism.py")


def run_workers(worker, specs: dict, timeout: float) -> dict:
    """Run ``worker`` once per ``name: (numba_threads, runs_argument, python_hash_seed)``, all at once; each
    one's last stdout line, parsed as JSON, by name."""
    procs = {}
    for name, (threads, runs, hash_seed) in specs.items():
        env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), PYTHONHASHSEED=str(hash_seed))
        procs[name] = subprocess.Popen([sys.executable, worker, runs], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{os.path.basename(worker)} ({name}) failed:\n{stderr[-4000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(WORKER, {"one": (1, "on:1,off:1", 1), "two": (2, "on:2,off:2,on:1", 2)}, timeout=300)


def _state(run):
    """Everything that must match bit for bit: step, every table's and slot's digest, the activations."""
    return run["step"], run["activations"], {name: (t["weights"], t["slots"]) for name, t in run["tables"].items()}


def _assert_same(a, b, what):
    step_a, acts_a, tables_a = _state(a)
    step_b, acts_b, tables_b = _state(b)
    assert step_a == step_b
    differing = sorted(name for name in tables_a if tables_a[name] != tables_b.get(name))
    assert not differing, f"{what}: tables/slots differ: {differing}"
    assert set(tables_a) == set(tables_b)
    assert acts_a == acts_b, f"{what}: activations differ"


def test_the_workers_ran_what_they_claim(results):
    one, two = results["one"], results["two"]
    assert (one["numba_threads"], one["env"]) == (1, "1")
    assert (two["numba_threads"], two["env"]) == (2, "2")
    assert one["runs"]["on:1"]["threads_used"] == 1 and two["runs"]["on:1"]["threads_used"] == 1
    assert two["runs"]["on:2"]["threads_used"] == 2
    run = two["runs"]["on:2"]
    assert run["step"] == 4
    # Stacking happened (6 optimizers -> 6 physical tables of 2 tables each) and was switched off.
    assert run["physical_tables"] == 6 and two["runs"]["off:2"]["physical_tables"] == 12
    tables = run["tables"]
    assert len(tables) == 12
    # Training changed every table, and lazy tables only in rows the batches touched.
    for name, t in tables.items():
        assert t["changed_rows"] > 0, name
    assert tables["t0a"]["changed_rows"] < 3000
    # Both update paths ran: the built-ins inlined element-wise, the custom function once per row.
    assert one["elementwise"] == two["elementwise"] == [True] * 5 + [False]
    # Different optimizers give different tables (the digests are not all of one thing).
    assert len({t["weights"] for t in tables.values()}) == len(tables)
    assert {name: sorted(t["slots"]) for name, t in tables.items() if name.endswith("a")} == {
        "t0a": [], "t1a": ["accumulators"], "t2a": ["momenta", "velocities"], "t3a": ["momenta", "velocities"],
        "t4a": ["accumulators", "linears"], "t5a": ["accumulator", "momentum"]}


def test_two_processes_give_identical_tables(results):
    """(a) Separate processes (different PYTHONHASHSEED), same settings (one Numba thread)."""
    _assert_same(results["one"]["runs"]["on:1"], results["two"]["runs"]["on:1"], "two processes")


def test_one_and_two_numba_threads_give_identical_tables(results):
    """(b) NUMBA_NUM_THREADS=1 vs NUMBA_NUM_THREADS=2, stacked and unstacked; and within one process."""
    _assert_same(results["one"]["runs"]["on:1"], results["two"]["runs"]["on:2"], "1 vs 2 threads, stacked")
    _assert_same(results["one"]["runs"]["off:1"], results["two"]["runs"]["off:2"], "1 vs 2 threads, unstacked")
    _assert_same(results["two"]["runs"]["on:1"], results["two"]["runs"]["on:2"], "set_num_threads 1 vs 2")


def test_stacking_on_and_off_give_identical_tables(results):
    """(c) stack_tables=True vs False, in each process."""
    _assert_same(results["one"]["runs"]["on:1"], results["one"]["runs"]["off:1"], "stacked vs unstacked, 1 thread")
    _assert_same(results["two"]["runs"]["on:2"], results["two"]["runs"]["off:2"], "stacked vs unstacked, 2 threads")
