"""The engines' state machine under misuse (issue 24): contexts bound to their engine and table generation,
row functions that raise at run time, and table sizes that cannot fit.

* A lookup context is accepted only by the engine whose lookup returned it, against the tables it read: the
  context of another (live or freed) engine, one looked up before a ``load``, and one already applied are
  refused with ``InputError`` and change nothing. CPython reuses a freed engine's address, so matching by
  ``id()`` let a new engine accept an old engine's context and write out of bounds (a segfault).
* A row function that raises on some rows: every other row is updated exactly once, those rows keep their
  values, ``step`` advances, the context is used up (a retry is refused), and ``RowFunctionError`` names the
  table and the rows; under one or several Numba threads.
* Tables whose weights and slots cannot fit in memory are refused at construction, before any allocation.
"""

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
import warnings

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore import compiler
from embedcore.kernels.occurrences import pack_occurrences
from embedcore.kernels.update import STATUS_RAISED, fused_update_kernel, kernel_source, update_kernel

from .harness import assert_unchanged, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))






def small_engine(vocab=20, optimizer=None):
    t = ec.TableConfig(vocab, 4, name="t", combiner="sum", initializer=ec.RowId())
    return ec.Embedding({"f": ec.FeatureConfig(t)}, optimizer or ec.Adagrad(0.1))


IDS = {"f": np.array([[1, 2], [3, 3]])}


def ones_like(acts):
    return {"f": np.ones_like(acts["f"])}


# ---------------------------------------------------------------------------------------------------------
# 1. Contexts: bound to their engine by a token, and to the generation of its tables.

def test_a_freed_engines_context_is_refused_by_a_new_engine_at_its_address():
    """The loop that crashed: a new engine often lands at the freed one's address; its old context (rows up
    to 10^6) must not be applied to the new engine's 4-row table. Run in a subprocess: a crash fails the
    test rather than pytest."""
    script = textwrap.dedent("""
        import numpy as np, embedcore as ec
        def config(rows):
            t = ec.TableConfig(rows, 8, name="t", initializer=ec.Constant(0.5))
            return {"f": ec.FeatureConfig(t)}
        ids = np.arange(10**6 - 1, 0, -9973).reshape(-1, 1)
        grads = {"f": np.ones((ids.shape[0], 8), np.float32)}
        reused = refused = 0
        for k in range(20):
            old = ec.Embedding(config(10**6), ec.SGD(0.1))
            _, ctx = old({"f": ids})
            old_id = id(old)
            cfg, opt = config(4), ec.SGD(0.1)
            old = None                     # freed here: the next engine may take its address
            new = ec.Embedding(cfg, opt)
            reused += id(new) == old_id
            try:
                new.apply_gradients(grads, ctx)
            except ec.InputError as e:
                refused += "another engine, since freed" in str(e)
            assert new.step == 0 and (new.embedding_tables["t"] == 0.5).all()
        print(reused, refused)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    reused, refused = map(int, proc.stdout.split())
    assert refused == 20
    assert reused > 0  # the hazard was there: an address was reused (16 of 20 times when measured)


def test_a_context_of_another_live_engine_is_refused_and_changes_neither():
    a, b = small_engine(), small_engine()
    acts, ctx_a = a(IDS)
    _, ctx_b = b(IDS)
    before_a, before_b = snapshot(a), snapshot(b)
    with pytest.raises(ec.InputError, match=r"ctx must be the context returned by this engine's lookup; this one "
                                            r"was returned by another engine, Embedding"):
        a.apply_gradients(ones_like(acts), ctx_b)
    assert_unchanged(a, before_a)
    assert_unchanged(b, before_b)
    # Neither context was used up by the refusal.
    a.apply_gradients(ones_like(acts), ctx_a)
    b.apply_gradients(ones_like(acts), ctx_b)
    assert a.step == b.step == 1


@pytest.mark.parametrize("what", ["not a context", "a copy with another token"])
def test_something_else_than_a_context_is_refused(what):
    emb = small_engine()
    acts, ctx = emb(IDS)
    before = snapshot(emb)
    if what == "not a context":
        bad = {"engine_token": ctx.engine_token}
    else:
        other = small_engine()
        _, bad = other(IDS)
        bad.table_batches, bad.features = ctx.table_batches, ctx.features  # every field but the token
    with pytest.raises(ec.InputError, match="ctx must be the context returned by this engine's lookup"):
        emb.apply_gradients(ones_like(acts), bad)
    assert_unchanged(emb, before)


def test_a_context_looked_up_before_load_is_refused_after_it(tmp_path):
    emb = small_engine()
    acts, ctx = emb(IDS)
    emb.apply_gradients(ones_like(acts), ctx)
    emb.save(tmp_path / "ckpt")
    acts, stale = emb(IDS)
    acts2, stale2 = emb(IDS)
    emb.load(tmp_path / "ckpt")
    loaded = snapshot(emb)
    for c in (stale, stale2):
        with pytest.raises(ec.InputError, match=r"before this engine's tables were replaced \(load\)"):
            emb.apply_gradients(ones_like(acts), c)
        assert_unchanged(emb, loaded)
    acts, fresh = emb(IDS)  # a lookup after the load works
    emb.apply_gradients(ones_like(acts), fresh)
    assert emb.step == 2


def test_a_failed_load_leaves_contexts_valid(tmp_path):
    emb = small_engine()
    other = small_engine(vocab=21)
    other.save(tmp_path / "other")
    acts, ctx = emb(IDS)
    with pytest.raises(ec.CheckpointError):
        emb.load(tmp_path / "other")
    emb.apply_gradients(ones_like(acts), ctx)
    assert emb.step == 1


def test_a_consumed_or_released_context_is_refused():
    emb = small_engine()
    acts, ctx = emb(IDS)
    emb.apply_gradients(ones_like(acts), ctx)
    after = snapshot(emb)
    with pytest.raises(ec.InputError, match="already applied"):
        emb.apply_gradients(ones_like(acts), ctx)
    assert_unchanged(emb, after)
    acts, released = emb(IDS)
    released.release()
    with pytest.raises(ec.InputError, match="already applied .or their context released"):
        emb.apply_gradients(ones_like(acts), released)
    assert_unchanged(emb, after)


def test_restore_makes_a_new_engine_that_refuses_the_old_ones_contexts(tmp_path):
    emb = small_engine()
    emb.save(tmp_path / "ckpt")
    acts, ctx = emb(IDS)
    restored = ec.Embedding.restore(tmp_path / "ckpt")
    before = snapshot(restored)
    with pytest.raises(ec.InputError, match="another engine, Embedding"):
        restored.apply_gradients(ones_like(acts), ctx)
    assert_unchanged(restored, before)


def test_the_torch_adapter_refuses_a_stale_context_in_backward(tmp_path):
    torch = pytest.importorskip("torch")
    from embedcore.torch import EmbeddingModule
    module = EmbeddingModule(small_engine())
    module.embedding.save(tmp_path / "ckpt")
    acts = module({"f": torch.as_tensor(IDS["f"])})
    module.embedding.load(tmp_path / "ckpt")
    loaded = snapshot(module.embedding)
    with pytest.raises(ec.InputError, match="tables were replaced"):
        acts["f"].sum().backward()
    assert_unchanged(module.embedding, loaded)
    acts = module({"f": torch.as_tensor(IDS["f"])})
    acts["f"].sum().backward()
    assert module.embedding.step == 1


def test_the_jax_adapter_refuses_a_foreign_or_stale_context(tmp_path):
    pytest.importorskip("jax")
    from embedcore import jax as ecj
    emb, other = small_engine(), small_engine()
    acts, ctx = ecj.lookup(emb, IDS)
    _, foreign = ecj.lookup(other, IDS)
    before = snapshot(emb)
    with pytest.raises(ec.InputError, match="another engine"):
        ecj.apply_gradients(emb, {"f": np.ones(acts["f"].shape, np.float32)}, foreign)
    emb.save(tmp_path / "ckpt")
    emb.load(tmp_path / "ckpt")
    with pytest.raises(ec.InputError, match="tables were replaced"):
        ecj.apply_gradients(emb, {"f": np.ones(acts["f"].shape, np.float32)}, ctx)
    assert_unchanged(emb, before)


# ---------------------------------------------------------------------------------------------------------
# 2. Row functions that raise at run time.

LIMIT = 50.0


def sgd_unless_large(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Per row (it indexes the row); raises on rows whose summed gradient starts above LIMIT."""
    if gradient[0] > 50.0:
        raise ValueError("gradient too large")
    return embedding_table - learning_rate * gradient


def adagrad_unless_large(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Per row, with a slot; computes the new accumulator before it raises."""
    accumulator = slot_variables[0] + gradient * gradient
    if gradient[0] > 50.0:
        raise ValueError("gradient too large")
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator


def unless_fast(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Raises on every row when the learning rate exceeds 1 (it compiles on scalars too)."""
    if learning_rate > 1.0:
        raise ValueError("learning rate too large")
    return embedding_table - learning_rate * gradient


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    saved = numba.get_num_threads()
    numba.set_num_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield request.param
    numba.set_num_threads(saved)


def raising_engine(function, slots):
    if slots:
        opt = ec.CustomOptimizer(function, learning_rate=0.1, slot_names=("acc",), slot_initializers=(0.5,))
    else:
        opt = ec.CustomOptimizer(function, learning_rate=0.1)
    a = ec.TableConfig(300, 4, name="a", combiner="sum", initializer=ec.RowId())
    b = ec.TableConfig(200, 4, name="b", combiner="sum", initializer=ec.RowId(0.5))
    return ec.Embedding({"fa": ec.FeatureConfig(a), "fb": ec.FeatureConfig(b)}, opt)  # a and b stacked


def oracle(before, ids, grads, slots):
    """Per table: the rows the batch touches, their new values and slots (float64 NumPy), and the rows whose
    summed gradient makes the row function raise (kept as they were)."""
    out = {}
    for f, name in (("fa", "a"), ("fb", "b")):
        table = before[0][name].astype(np.float64)
        acc = before[1][name]["acc"].astype(np.float64) if slots else None
        g = np.zeros_like(table)
        for k in range(ids[f].shape[1]):  # "sum": each id of a sample gets the sample's gradient
            np.add.at(g, ids[f][:, k], grads[f].astype(np.float64))
        touched = np.unique(ids[f])
        failing = touched[g[touched, 0] > LIMIT]
        ok = np.setdiff1d(touched, failing)
        new_table, new_acc = table.copy(), None if acc is None else acc.copy()
        if slots:
            new_acc[ok] = acc[ok] + g[ok] ** 2
            new_table[ok] = table[ok] - 0.1 * g[ok] / np.sqrt(new_acc[ok])
        else:
            new_table[ok] = table[ok] - 0.1 * g[ok]
        out[name] = (new_table, new_acc, failing)
    return out


def check_partial_update(emb, before, expected, slots):
    for name, (table, acc, failing) in expected.items():
        got = emb.embedding_tables[name]
        np.testing.assert_allclose(got, table, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(got[failing], before[0][name][failing])  # untouched, bit for bit
        changed = np.flatnonzero((got != before[0][name]).any(axis=1))
        assert not np.isin(failing, changed).any()
        if slots:
            np.testing.assert_allclose(emb.slot_variables[name]["acc"], acc, rtol=1e-5, err_msg=name)
            np.testing.assert_array_equal(emb.slot_variables[name]["acc"][failing],
                                          before[1][name]["acc"][failing])


@st.composite
def raising_batches(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    n = draw(st.integers(1, 64))
    ids = {"fa": rng.integers(0, 300, (n, 2)), "fb": rng.integers(0, 200, (n, 3))}
    grads = {f: rng.uniform(-1, 1, (n, 4)).astype(np.float32) for f in ids}
    for f in ids:  # some samples push their rows' summed gradient far above the limit
        big = rng.random(n) < draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
        grads[f][big, 0] = 1000.0
    return ids, grads


@pytest.mark.parametrize("function, slots", [(sgd_unless_large, False), (adagrad_unless_large, True)],
                         ids=["no slot", "a slot"])
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=raising_batches())
def test_a_row_function_raising_on_some_rows_updates_every_other_row_exactly_once(threads, function, slots, batch):
    ids, grads = batch
    emb = raising_engine(function, slots)
    before = snapshot(emb)
    acts, ctx = emb(ids)
    expected = oracle(before, ids, grads, slots)
    failing = {name: rows for name, (_, _, rows) in expected.items() if rows.size}
    if not failing:
        emb.apply_gradients(grads, ctx)
    else:
        with pytest.raises(ec.RowFunctionError, match=r"raised an exception on them.*step is now 1") as info:
            emb.apply_gradients(grads, ctx)
        report = info.value.report
        assert {n: sorted(r["raised"].tolist()) for n, r in report.failed.items()} == \
            {n: sorted(r.tolist()) for n, r in failing.items()}
        for name, rows in failing.items():
            assert f"table '{name}': {rows.size} row(s) left unchanged because " in str(info.value)
    assert emb.step == 1
    check_partial_update(emb, before, expected, slots)
    applied = snapshot(emb)
    with pytest.raises(ec.InputError, match="already applied"):  # a retry never applies rows twice
        emb.apply_gradients(grads, ctx)
    assert_unchanged(emb, applied)


def test_a_row_function_raising_on_every_row_leaves_the_table_and_advances_step(threads):
    rate = [0.01]
    opt = ec.CustomOptimizer(unless_fast, learning_rate=lambda: rate[0])
    t = ec.TableConfig(1000, 4, name="t", combiner="sum", initializer=ec.RowId())
    emb = ec.Embedding({"f": ec.FeatureConfig(t)}, opt)
    ids = {"f": np.arange(1000).reshape(-1, 1)}
    acts, ctx = emb(ids)
    emb.apply_gradients(ones_like(acts), ctx)
    before = snapshot(emb)
    rate[0] = 5.0
    acts, ctx = emb(ids)
    with pytest.raises(ec.RowFunctionError, match=r"table 't': 1000 row\(s\) left unchanged because "
                                                  r".*unless_fast raised an exception on them: rows 0, "
                                                  r"1, 2, 3, 4, \.\.\..*step is now 2"):
        emb.apply_gradients(ones_like(acts), ctx)
    assert emb.step == 2
    np.testing.assert_array_equal(emb.embedding_tables["t"], before[0]["t"])


def kernel_inputs(n_rows, touched, big):
    """A table, the sorted unique rows ``touched`` (one occurrence each, gradient 1; ``big`` of them with a
    first gradient value of 1000) and a zeroed status, as ``update_kernel`` takes them."""
    table = np.arange(n_rows * 4, dtype=np.float32).reshape(n_rows, 4)
    uniq = np.array(touched, np.int64)
    d_act = np.ones((uniq.size, 4), np.float32)
    d_act[np.isin(uniq, big), 0] = 1000.0
    n = uniq.size
    occurrences = (uniq, np.arange(n + 1, dtype=np.int64), np.arange(n, dtype=np.int64),
                   np.arange(n, dtype=np.int64), np.ones(n, np.float32), d_act)
    return table, occurrences


def test_the_non_lazy_kernel_flags_raising_rows_and_updates_the_others(threads):
    """Every table row is visited (zero gradient for rows the batch misses); rows that raise are flagged."""
    rf = compiler.compile_cached(sgd_unless_large, (), 0, 4)
    table, occurrences = kernel_inputs(1000, [3, 10, 500, 501, 999], [10, 501])
    before = table.copy()
    status = np.zeros(1000, np.uint8)
    flagged = update_kernel(rf, lazy=False)(table, (), *occurrences, np.float32(0.1), (), status)
    assert flagged == 2 and np.flatnonzero(status).tolist() == [10, 501]
    assert (status[[10, 501]] == STATUS_RAISED).all()
    expected = before.copy()
    expected[[3, 500, 999]] -= np.float32(0.1)
    np.testing.assert_array_equal(table, expected)


def test_the_elementwise_kernel_flags_raising_rows(threads):
    """A function that raises is never judged element-wise (the raise is a call), but the element-wise
    kernel is guarded too: forced here on a function that compiles on scalars."""
    rf = dataclasses.replace(compiler.compile_cached(unless_fast, (), 0, 4), elementwise=True)
    for rate, flagged_rows in ((0.1, []), (5.0, list(range(600)))):
        table, occurrences = kernel_inputs(1000, list(range(600)), [])
        before = table.copy()
        status = np.zeros(600, np.uint8)
        flagged = update_kernel(rf, lazy=True)(table, (), *occurrences, np.float32(rate), (), status)
        assert flagged == len(flagged_rows) and np.flatnonzero(status).tolist() == flagged_rows
        expected = before.copy()
        if not flagged_rows:
            expected[:600] -= np.float32(rate)
        np.testing.assert_array_equal(table, expected)


def test_a_row_function_that_may_raise_still_runs_in_parallel():
    """A raise that reaches Numba's prange makes Numba run the loop on one thread (it warns); the guard
    around each chunk catches it inside the chunk function, which the parallel loop calls through a
    pointer, so the loop stays parallel and the other rows are updated."""
    rf = compiler.compile_cached(sgd_unless_large, (), 0, 4)
    assert "prange" not in kernel_source(rf, lazy=True)  # the generated part is serial: no raise reaches prange
    kernel = fused_update_kernel(rf, lazy=True)
    table, (uniq, ptr, _, out_row, gains, d_act) = kernel_inputs(10, [1, 2], [2])
    packed = pack_occurrences(out_row, gains)
    status = np.zeros(2, np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", numba.NumbaPerformanceWarning)
        assert kernel(table, (), uniq, ptr, packed, d_act, np.float32(0.1), (), status) == 1
    assert status.tolist() == [0, STATUS_RAISED]


# ---------------------------------------------------------------------------------------------------------
# 12. Sizes that cannot fit are refused before anything is allocated.

def test_a_table_of_10_to_the_12_rows_is_refused_at_construction():
    t = ec.TableConfig(10 ** 12, 16, name="huge")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"table\(s\) \['huge'\] \(1,000,000,000,000 rows x 16 float32 values, "
                                         r"plus 1 slot\(s\)\) would take .*TiB \(128,000,000,000,000 bytes\)"):
        ec.Embedding({"f": ec.FeatureConfig(t)}, ec.Adagrad(0.1))
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("vocab, dim, optimizer, nbytes", [
    (2 ** 31 - 1, 64, ec.SGD(0.1), (2 ** 31 - 1) * 64 * 4),
    (1000, 10 ** 6, ec.Adam(0.1), 1000 * 10 ** 6 * 4 * 3),
    # A non-lazy table also needs the update's status byte per row.
    (10 ** 8, 4, ec.Adam(0.1, lazy_adam=False, use_gradient_accumulation=True), 10 ** 8 * (4 * 4 * 3 + 1)),
    (100, 10 ** 9, ec.SGD(0.1), 100 * 10 ** 9 * 4),
])
def test_huge_vocabularies_and_dims_are_refused_naming_the_bytes(monkeypatch, vocab, dim, optimizer, nbytes):
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(64 << 20))
    t = ec.TableConfig(vocab, dim, name="big")
    with pytest.raises(ValueError, match=rf"table\(s\) \['big'\] .* would take .*\({nbytes:,} bytes\), more than "
                                         rf"the 64.0 MiB"):
        ec.Embedding({"f": ec.FeatureConfig(t)}, optimizer)


def test_stacked_tables_are_summed_and_all_tables_together_checked(monkeypatch):
    # 3 tables of 30,000 x 8 float32 + an Adagrad slot: 1.92 MB each.
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(5 * 10 ** 6))
    tables = [ec.TableConfig(30_000, 8, name=f"t{k}") for k in range(3)]
    features = {f"f{k}": ec.FeatureConfig(t) for k, t in enumerate(tables)}
    with pytest.raises(ValueError, match=r"table\(s\) \['t0', 't1', 't2'\] \(90,000 rows x 8 float32 values, "
                                         r"plus 1 slot\(s\)\) would take .*\(5,760,000 bytes\)"):
        ec.Embedding(features, ec.Adagrad(0.1))
    tables = [ec.TableConfig(30_000, 8, name=f"t{k}") for k in range(3)]
    features = {f"f{k}": ec.FeatureConfig(t) for k, t in enumerate(tables)}
    with pytest.raises(ValueError, match=r"the tables \['t0', 't1', 't2'\] and their slots together would take "
                                         r".*\(5,760,000 bytes\)"):
        ec.Embedding(features, ec.Adagrad(0.1), stack_tables=False)
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(6 * 10 ** 6))
    tables = [ec.TableConfig(30_000, 8, name=f"t{k}") for k in range(3)]
    ec.Embedding({f"f{k}": ec.FeatureConfig(t) for k, t in enumerate(tables)}, ec.Adagrad(0.1))


# ---------------------------------------------------------------------------------------------------------
# The same for ShardedEmbedding, over two MPI ranks.

def test_sharded_contexts_row_functions_and_sizes(tmp_path):
    pytest.importorskip("mpi4py", reason="needs the mpi extra: pip install 'embedcore[mpi]'")
    import json
    import shutil
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpi4py is installed but no mpiexec was found (pip install 'embedcore[mpi]' brings one)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    worker = os.path.join(ROOT, "tests", "workers", "reliability_sharded.py")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", worker, str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{k}.json").read_text()) for k in range(2)]
    for r in ranks:
        stale = r["stale_after_load"]
        assert stale["unchanged"] and "DistributedError" in stale["types"], stale
        assert "refused on 2 of 2 ranks" in stale["error"] and "tables were replaced (load)" in stale["error"]
        assert r["fresh_after_load"]["error"] is None and r["fresh_after_load"]["step"] == 1
        freed = r["freed_engines_context"]
        assert freed["unchanged"] and "another engine, since freed" in freed["error"], freed
        raised = r["raising_row_function"]
        assert "RowFunctionError" in raised["types"] and raised["step"] == 1 and not raised["unchanged"], raised
        assert "sgd_unless_large raised an exception on them: rows" in raised["error"]
        assert "step is now 1 on every rank" in raised["error"]
        retry = r["retry"]
        assert retry["unchanged"] and "already applied" in retry["error"], retry
        huge = r["huge"]
        assert "DistributedError" in huge["types"] and "table(s) ['huge']" in huge["error"], huge
        assert "would take" in huge["error"] and "nothing was allocated" in huge["error"]
    zero = ranks[0]
    assert "raised an exception on them: rows 5, 6" in zero["one_process_error"]
    assert zero["one_process_failed"] == [5, 6]
    assert zero["rows_changed"] == [1, 2, 3, 4, 7, 8, 9, 10]
    assert zero["tables_match_one_process"]

def test_a_batch_whose_activations_cannot_fit_is_refused_before_anything_is_leased(monkeypatch):
    # 300,000 samples of a 64-wide table: 76.8 MB of activations, against a 70 MB budget.
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 64, name="t"))}, ec.SGD(0.1))
    before = emb.embedding_tables["t"].copy()
    ids = np.zeros(300_000, np.int64)
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(70 * 10 ** 6))
    with pytest.raises(ec.InputError, match=r"activations of this batch \(300,000 rows\) would take .*"
                                            r"\(76,800,000 bytes\)"):
        emb({"f": ids})
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(80 * 10 ** 6))
    acts, ctx = emb({"f": ids})
    np.testing.assert_array_equal(acts["f"], np.broadcast_to(before[0], (300_000, 64)))
    assert np.array_equal(emb.embedding_tables["t"], before)
