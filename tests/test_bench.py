"""The step benchmark (embedcore.bench): a quick run of every available contender through the script, and
the NumPy reference math the contenders are checked against.

The quick run is a subprocess: the harness sets thread counts and OMP_WAIT_POLICY for its whole process.
Most of its time is importing torch / FBGEMM / JAX and compiling embedcore's update kernel.
"""

import json
import math
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from embedcore.bench.harness import _rel_diff
from embedcore.bench.report import _fmt_round_ratios, _round_ratios
from embedcore.bench.workloads import Workload, make_batches, make_optim, numpy_apply, numpy_pool, step_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_step.py"), "--quick", "--workloads", "tbe,update",
           "--rounds", "1", "--update-D", "8", "--tolerance", str(TOLERANCE), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out / "bench.json") as f:
        result = json.load(f)
    return proc.stdout, result, out


def _ran(case):
    return [name for name, rec in case["contenders"].items() if "median_ms" in rec]


def test_quick_run_writes_json_and_chart(quick):
    stdout, result, out = quick
    assert [c["workload"]["name"] for c in result["cases"]] == ["tbe", "update"]
    assert result["machine"]["copy_gbps"] > 0 and result["machine"]["gather_gbps"] > 0
    assert result["env"]["numba_threads"] >= 1 and "allocator" in result["env"]
    assert result["summary"]["embedcore_first_calls_s"]["build_s"] > 0
    try:
        import matplotlib  # noqa: F401
        assert (out / "bench.png").stat().st_size > 0
    except ImportError:
        assert "no bench.png" in stdout


def test_every_contender_that_ran_is_in_the_table_and_the_json(quick):
    stdout, result, _ = quick
    table = stdout[stdout.index("RESULTS"):]
    blocks = table.split("\n\n")
    loaded = [n for n in ("embedcore", "embedcore-custom", "embedcore-skip", "fbgemm", "torch", "jax", "tensorflow",
                          "numpy") if n not in result["skipped_contenders"]]
    assert {"embedcore", "embedcore-custom", "embedcore-skip", "numpy"} <= set(loaded)
    for case in result["cases"]:
        ran = _ran(case)
        assert {"embedcore", "embedcore-skip", "numpy"} <= set(ran)
        # every loaded contender either ran or says why not
        for name in loaded:
            assert name in ran or name in case["skipped"], (case["label"], name)
        block = next(b for b in blocks if b.startswith(case["label"]))
        for name in ran:
            rec = case["contenders"][name]
            assert rec["label"] in block, (name, block)
            assert rec["min_ms"] <= rec["median_ms"] <= rec["max_ms"]
            assert rec["n"] == result["args"]["rounds"] * result["args"]["steps"]
            assert rec["ratio_to_embedcore"] > 0 and rec["fraction_of_copy"] > 0 and rec["fraction_of_gather"] > 0
            assert len(rec["round_ratios"]) == result["args"]["rounds"] and min(rec["round_ratios"]) > 0
            assert _fmt_round_ratios(rec["round_ratios"]) in block
            assert name in result["contender_measures"]
        assert math.isclose(case["contenders"]["embedcore"]["ratio_to_embedcore"], 1.0)
        assert case["contenders"]["embedcore"]["round_ratios"] == [1.0] * result["args"]["rounds"]
    for name, why in result["skipped_contenders"].items():
        assert f"contender {name} skipped" in stdout and why


def test_round_ratios_pair_each_round_with_embedcores_steps_of_that_round():
    assert _round_ratios([2.0, 6.0, 3.0], [1.0, 2.0, 3.0]) == [2.0, 3.0, 1.0]
    assert _fmt_round_ratios([2.0, 3.0, 1.0]) == "1.00-3.00x"
    assert _round_ratios([2.0], [1.0, 2.0]) is None  # a contender that failed a round: no pairing
    assert _round_ratios(None, [1.0]) is None and _round_ratios([1.0], None) is None
    assert _fmt_round_ratios(None) == "-"


def test_contenders_agree_on_tables_states_and_outputs(quick):
    _, result, _ = quick
    assert result["summary"]["all_checks_ok"], result["summary"]["failures"]
    for case in result["cases"]:
        assert case["reference"] == "numpy"
        for name in _ran(case):
            rec = case["contenders"][name]
            check, final = rec["check"], rec["final_check"]
            assert check["ok"] and final["ok"], (case["label"], name, check, final)
            values = [check["tables"], check["state"], final["tables"], final["state"]]
            if case["workload"]["kind"] == "train":
                values.append(check["outputs"])
            assert max(values) <= TOLERANCE, (case["label"], name, values)
    ran = set(_ran(result["cases"][0]))
    if "fbgemm" not in result["skipped_contenders"]:
        assert "fbgemm" in ran  # embedcore vs NumPy reference vs FBGEMM, same batches


def test_the_skip_contender_is_the_engine_without_the_gradient_pass():
    """embedcore-skip differs from embedcore only in non_finite: same optimizer, same tables, same steps."""
    from embedcore.bench.contenders.embedcore_engine import EmbedcoreContender, EmbedcoreSkipContender
    from embedcore.bench.workloads import tbe_workload
    w = tbe_workload(T=2, E=40, D=8, B=4, L=3, optim=make_optim("rowwise_adagrad"), n_batches=2)
    threads = numba.get_num_threads()  # on_workload sets Numba's thread count: keep this process's
    plain, skip = (cls.on_workload(w, threads) for cls in (EmbedcoreContender, EmbedcoreSkipContender))
    assert numba.get_num_threads() == threads
    assert (plain.emb.non_finite, skip.emb.non_finite) == ("raise", "skip")
    for batch in make_batches(w):
        for c in (plain, skip):
            c.run(c.prepare(batch))
    for t in range(w.T):
        np.testing.assert_array_equal(plain.table(t), skip.table(t))
        np.testing.assert_array_equal(plain.slots(t)[0], skip.slots(t)[0])
    assert float(np.abs(plain.table(0)).max()) > 0  # the steps changed the tables


# ----------------------------------------------------------------------------------------------------------
# The reference math, against a per-row loop written from the formulas

def _loop_step(o, table, slots, ids, row_grads, step):
    sums = {}
    for i, g in zip(ids.tolist(), row_grads.astype(np.float64)):
        sums[i] = sums.get(i, 0.0) + g
    for i, g in sums.items():
        w = table[i].astype(np.float64)
        if o.name == "sgd":
            w -= o.lr * g
        elif o.name == "adagrad":
            a = slots[0][i] + g * g
            w -= o.lr * g / (np.sqrt(a) + o.eps)
            slots[0][i] = a
        elif o.name == "rowwise_adagrad":
            a = slots[0][i] + np.mean(g * g)
            w -= o.lr * g / (np.sqrt(a) + o.eps)
            slots[0][i] = a
        else:
            m = o.beta1 * slots[0][i] + (1 - o.beta1) * g
            v = o.beta2 * slots[1][i] + (1 - o.beta2) * g * g
            lr_t = o.lr * math.sqrt(1 - o.beta2 ** step) / (1 - o.beta1 ** step)
            w -= lr_t * m / (np.sqrt(v) + o.eps)
            slots[0][i], slots[1][i] = m, v
        table[i] = w


@pytest.mark.parametrize("name,style", [("sgd", "tf"), ("adagrad", "tf"), ("adagrad", "fbgemm"),
                                        ("rowwise_adagrad", "tf"), ("adam", "tf")])
def test_numpy_reference_matches_the_formulas(name, style):
    o = make_optim(name, style)
    w = Workload("t", "train", 2, 50, 8, 6, 3, o, "fbgemm", 1.15, True, 3, 0)
    batches = make_batches(w)
    rng = np.random.default_rng(1)
    tables = [rng.standard_normal((w.E, w.D)).astype(np.float32) for _ in range(w.T)]
    ref = [t.astype(np.float64) for t in tables]

    def fresh(dtype):
        return [[np.full(shape, v, dtype) for shape, v in zip(o.slot_shapes(w.E, w.D), o.slot_initial_values())]
                for _ in range(w.T)]
    slots, ref_slots = fresh(np.float32), fresh(np.float64)
    for step, b in enumerate(batches, 1):
        assert sum(step_bytes(w, b).values()) > 0
        for t in range(w.T):
            pooled = numpy_pool(tables[t], b.ids[t], b.offsets[t], b.weights[t])
            expect = np.stack([(ref[t][b.ids[t][lo:hi]] * b.weights[t][lo:hi, None]).sum(0)
                               for lo, hi in zip(b.offsets[t][:-1], b.offsets[t][1:])])
            assert _rel_diff(pooled, expect) < 1e-5
            row_grads = b.grad[t][b.segments[t]] * b.weights[t][:, None]
            numpy_apply(o, tables[t], slots[t], b.ids[t], row_grads, step)
            _loop_step(o, ref[t], ref_slots[t], b.ids[t], row_grads, step)
    for t in range(w.T):
        assert _rel_diff(tables[t], ref[t]) < 1e-5
        for a, r in zip(slots[t], ref_slots[t]):
            assert _rel_diff(a, r) < 1e-4  # float32 constants: (1 - beta2) is 0.0010000467


def test_rel_diff_flags_disagreement():
    x = np.ones((300_000, 4), np.float32)
    y = x.copy()
    assert _rel_diff(x, y) == 0.0
    y[123_456, 2] = 1.5
    assert _rel_diff(x, y) == pytest.approx(0.5 / 1.5)  # found in a later block
    assert _rel_diff(x[:10], y) == math.inf
    y[0, 0] = np.nan
    assert _rel_diff(x, y) == math.inf
