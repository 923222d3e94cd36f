"""Determinism of dynamic tables: the same seed and data give bit-identical keys, row slots, rows, slots,
eviction metadata and activations, whatever the process or the number of Numba threads, with eviction and
admission running every step and 16-bit rows rounded stochastically.

Two worker processes (``tests/workers/dynamic_determinism.py``, different ``PYTHONHASHSEED``s) train the same
workload: one with ``NUMBA_NUM_THREADS=1``, one with ``NUMBA_NUM_THREADS=2`` that also trains again on one
thread (``numba.set_num_threads(1)``). They run side by side.
"""

import os

import pytest

from .test_determinism import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "dynamic_determinism.py")
DYNAMIC = ("score", "lfu16", "ttl16")


@pytest.fixture(scope="module")
def results():
    return run_workers(WORKER, {"one": (1, "1", 3), "two": (2, "2,1", 4)}, timeout=600)


def test_the_workers_ran_what_they_claim(results):
    one, two = results["one"], results["two"]
    assert (one["numba_threads"], one["env"]) == (1, "1") and (two["numba_threads"], two["env"]) == (2, "2")
    assert one["runs"]["1"]["threads_used"] == 1 and two["runs"]["1"]["threads_used"] == 1
    assert two["runs"]["2"]["threads_used"] == 2
    run = two["runs"]["2"]
    assert run["step"] == 6
    tables = run["tables"]
    for name in DYNAMIC:  # full tables that evicted (or expired) rows at several steps
        assert tables[name]["held"] == 600 and tables[name]["removals"] >= 3, (name, tables[name])
    assert [tables[n]["dtype"] for n in DYNAMIC] == ["float32", "bfloat16", "float16"]
    assert len({tables[n]["weights"] for n in tables}) == len(tables)


def _assert_same(a, b, what):
    assert a["step"] == b["step"], what
    differing = sorted(n for n in a["tables"] if a["tables"][n] != b["tables"].get(n))
    assert not differing, f"{what}: tables differ: {differing}"
    assert a["activations"] == b["activations"], f"{what}: activations differ"


def test_two_processes_give_identical_dynamic_tables(results):
    _assert_same(results["one"]["runs"]["1"], results["two"]["runs"]["1"], "two processes, one thread")


def test_one_and_two_numba_threads_give_identical_dynamic_tables(results):
    _assert_same(results["one"]["runs"]["1"], results["two"]["runs"]["2"], "NUMBA_NUM_THREADS 1 vs 2")
    _assert_same(results["two"]["runs"]["1"], results["two"]["runs"]["2"], "set_num_threads 1 vs 2")
