"""Memory measurements for ``tests/test_memory.py``; prints one JSON line per phase.

``python memory.py PHASE ...`` with phases:

* ``rss``: 10,000 training steps (lookup + apply_gradients) of a small fixed-shape workload with fresh ids
  every step, after a warm-up; resident memory (``VmRSS``) every 500 steps, Numba's allocation counters
  (run with ``NUMBA_NRT_STATS=1``), the number of Python objects the garbage collector tracks, and then
  500 more steps under ``tracemalloc`` (NumPy arrays are invisible to the garbage collector).
* ``peak``: the extra memory one step allocates at its peak, traced by ``tracemalloc`` (which sees NumPy's
  allocations and those Numba makes inside jitted code), for the same batch with a vocabulary of 10**4 and
  of 10**6 rows, with lazy optimizers only and with a non-lazy one; lookup and apply_gradients measured
  separately, the engine's first step (which allocates the grow-only workspaces) and later ones; and the
  ``VmHWM`` rise of a step without tracing. Kind ``"lazy16"`` is ``"lazy"`` with bfloat16 rows and slots.
* ``storage``: the resident memory and the resident high-water mark that building a table with its slots
  (allocated, initialised) and training it a few steps add to the process, for a float32 table of
  :data:`STORAGE_ROWS` rows and bfloat16 tables (rows and slots) of the same rows and of twice as many;
  measured from ``VmRSS`` and ``VmHWM`` (reset through ``/proc/self/clear_refs``), the kernels compiled first.
"""

import ctypes
import gc
import json
import sys
import time
import tracemalloc

import numba
import numpy as np

import embedcore as ec


def rowwise_momentum(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """Not element-wise (a reduction): called once per row, allocating row temporaries inside Numba."""
    del hyperparameters
    scale = np.float32(1.0) / np.sqrt(np.mean(gradient * gradient) + np.float32(1e-6))
    momentum = np.float32(0.9) * slot_variables[0] + gradient * scale
    return embedding_table - learning_rate * momentum, momentum


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def nrt_live():
    from numba.core.runtime import rtsys
    stats = rtsys.get_allocation_stats()
    return stats.alloc - stats.free, stats.mi_alloc - stats.mi_free


# -- rss -----------------------------------------------------------------------------------------------------

RSS_BATCH, RSS_WARMUP, RSS_STEPS, RSS_EVERY, RSS_TRACED = 64, 500, 10_000, 500, 500


def rss_engine():
    """Two physical tables: Adagrad (element-wise, inlined) fed by a weighted pooled feature and a sequence
    feature, and a custom function that runs once per row (so allocates row temporaries inside Numba)."""
    items = ec.TableConfig(20_000, 16, name="items")
    users = ec.TableConfig(10_000, 16, name="users", combiner="sum",
                           optimizer=ec.CustomOptimizer(rowwise_momentum, 0.05, ["momentum"], [0.0]))
    features = {"hist": ec.FeatureConfig(items), "seq": ec.FeatureConfig(items, max_sequence_length=3),
                "user": ec.FeatureConfig(users)}
    return ec.Embedding(features, ec.Adagrad(0.05), seed=3)


def rss_phase():
    emb = rss_engine()
    rng = np.random.default_rng(0)
    b = RSS_BATCH
    weights = {"hist": rng.uniform(0.5, 1.5, (b, 5)).astype(np.float32), "seq": None, "user": None}
    grad_sets = [{"hist": rng.standard_normal((b, 16)).astype(np.float32),
                  "seq": rng.standard_normal((b, 3, 16)).astype(np.float32),
                  "user": rng.standard_normal((b, 16)).astype(np.float32)} for _ in range(4)]

    def step(t):  # fresh ids every step (so a different number of unique rows), fixed shapes
        ids = {"hist": rng.integers(0, 20_000, (b, 5)), "seq": rng.integers(0, 20_000, (b, 4)),
               "user": rng.integers(0, 10_000, b)}
        _, ctx = emb.lookup(ids, weights)
        emb.apply_gradients(grad_sets[t % 4], ctx)

    t = 0
    for t in range(RSS_WARMUP):
        step(t)
    gc.collect()
    rss, nrt, objects = [status("VmRSS")], [nrt_live()], [len(gc.get_objects())]
    start = time.perf_counter()
    for t in range(RSS_WARMUP, RSS_WARMUP + RSS_STEPS):
        step(t)
        if (t + 1 - RSS_WARMUP) % RSS_EVERY == 0:
            rss.append(status("VmRSS"))
            nrt.append(nrt_live())
    seconds = time.perf_counter() - start
    gc.collect()
    objects.append(len(gc.get_objects()))
    # NumPy arrays are not tracked by the garbage collector: a leak of them shows in tracemalloc's count.
    tracemalloc.start()
    traced = [tracemalloc.get_traced_memory()[0]]
    for t in range(t + 1, t + 1 + RSS_TRACED):
        step(t)
    gc.collect()
    traced.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    return {"phase": "rss", "steps": RSS_STEPS, "warmup": RSS_WARMUP, "every": RSS_EVERY, "rss": rss,
            "nrt_live": nrt, "gc_objects": objects, "traced_steps": RSS_TRACED, "traced": traced,
            "step_ms": 1000 * seconds / RSS_STEPS, "final_step": emb.step, "threads": numba.get_num_threads()}


# -- peak ----------------------------------------------------------------------------------------------------

PEAK_BATCH = 1024
PEAK_KINDS = ("lazy", "dense", "lazy16")
PEAK_VOCABS = (10_000, 1_000_000)
PEAK_ID_RANGE = 10_000  # the same ids (and so the same duplicates) for every vocabulary


def peak_engine(vocab, kind):
    """Two physical tables: "items" (Adagrad, dim 16) fed by three features, "users" (dim 8) by one; "users"
    has a per-row custom function (row temporaries in Numba) for ``kind="lazy"`` (and ``"lazy16"``, every
    table's rows and slots in bfloat16) and non-lazy Adam (every row updated every step) for ``"dense"``."""
    stored = {"weights_dtype": "bfloat16", "slot_dtype": "bfloat16"} if kind == "lazy16" else {}
    items = ec.TableConfig(vocab, 16, name="items", combiner="mean", **stored)
    users_opt = (ec.CustomOptimizer(rowwise_momentum, 0.05, ["momentum"], [0.0]) if kind.startswith("lazy")
                 else ec.Adam(0.01, lazy_adam=False))
    users = ec.TableConfig(vocab, 8, name="users", combiner="sqrtn", optimizer=users_opt, **stored)
    features = {"hist": ec.FeatureConfig(items), "item": ec.FeatureConfig(items),
                "seq": ec.FeatureConfig(items, max_sequence_length=5), "tags": ec.FeatureConfig(users)}
    return ec.Embedding(features, ec.Adagrad(0.05), seed=4)


# The batch as test_memory.py's formula sees it: per feature its physical table, samples, ids per sample (k)
# and sequence length; per physical table (in the engine's order) its dim, combiner, row slots, lazy, and
# the row temporaries of a per-row function.
PEAK_SHAPE = {
    "features": [
        {"name": "hist", "group": 0, "batch": PEAK_BATCH, "k": 8, "seq": 0, "weighted": True},
        {"name": "item", "group": 0, "batch": PEAK_BATCH, "k": 1, "seq": 0, "weighted": False},
        {"name": "seq", "group": 0, "batch": PEAK_BATCH, "k": 8, "seq": 5, "weighted": False},
        {"name": "tags", "group": 1, "batch": PEAK_BATCH, "k": 4, "seq": 0, "weighted": False},
    ],
    "groups": {"lazy": [{"dim": 16, "combiner": "mean", "row_slots": 1, "lazy": True},
                        # rowwise_momentum: up to 6 row temporaries alive at once (g*g, 0.9*m, g*scale, m,
                        # lr*m, the new row)
                        {"dim": 8, "combiner": "sqrtn", "row_slots": 1, "lazy": True, "row_temporaries": 6}],
               "lazy16": [{"dim": 16, "combiner": "mean", "row_slots": 1, "lazy": True},
                          {"dim": 8, "combiner": "sqrtn", "row_slots": 1, "lazy": True, "row_temporaries": 6}],
               "dense": [{"dim": 16, "combiner": "mean", "row_slots": 1, "lazy": True},
                         {"dim": 8, "combiner": "sqrtn", "row_slots": 2, "lazy": False}]},
}


def peak_batch(t):
    rng = np.random.default_rng([5, t])
    b = PEAK_BATCH
    ids = {"hist": rng.integers(0, PEAK_ID_RANGE, (b, 8)), "item": rng.integers(0, PEAK_ID_RANGE, b),
           "seq": rng.integers(0, PEAK_ID_RANGE, (b, 8)), "tags": rng.integers(0, PEAK_ID_RANGE, (b, 4))}
    weights = {"hist": rng.uniform(0.5, 1.5, (b, 8)).astype(np.float32), "item": None, "seq": None, "tags": None}
    grads = {"hist": rng.standard_normal((b, 16)).astype(np.float32),
             "item": rng.standard_normal((b, 16)).astype(np.float32),
             "seq": rng.standard_normal((b, 5, 16)).astype(np.float32),
             "tags": rng.standard_normal((b, 8)).astype(np.float32)}
    return ids, weights, grads


def traced_step(emb, ids, weights, grads):
    """Peak traced bytes above the step's starting point, in lookup and in apply_gradients; bytes held
    between the two (activations and context); bytes still held after the step (workspaces, leaks)."""
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    acts, ctx = emb.lookup(ids, weights)
    after_lookup, lookup_peak = tracemalloc.get_traced_memory()
    batch = [{"n_occurrences": int(tb.rows.shape[0]), "n_unique": int(np.unique(tb.rows).shape[0]),
              "n_activation_rows": int(tb.n_out)} for tb in ctx.table_batches]  # before apply releases them
    tracemalloc.reset_peak()
    emb.apply_gradients(grads, ctx)
    _, apply_peak = tracemalloc.get_traced_memory()
    del acts, ctx
    gc.collect()
    return {"lookup": lookup_peak - base, "apply": apply_peak - base, "held_after_lookup": after_lookup - base,
            "kept": tracemalloc.get_traced_memory()[0] - base, "batch": batch}


def hwm_step(emb, ids, weights, grads):
    """Rise of the resident high-water mark over one untraced step (reset through /proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss = status("VmRSS")
    acts, ctx = emb.lookup(ids, weights)
    emb.apply_gradients(grads, ctx)
    del acts, ctx
    return status("VmHWM") - rss


@numba.njit(parallel=True)
def _scratch_per_iteration(n, dim):
    total = 0.0
    for i in numba.prange(n):
        row = np.empty(dim, np.float32)
        row[:] = i
        total += row.sum()
    return total


def numba_allocations_traced():
    """Bytes tracemalloc sees at the peak of jitted code allocating only inside worker threads: the peak
    measurements rely on Numba's allocations (NRT, through PyMem_RawMalloc) being traced."""
    _scratch_per_iteration(4, 16)
    tracemalloc.start()
    tracemalloc.reset_peak()
    _scratch_per_iteration(10_000, 4096)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def peak_phase():
    batches = [peak_batch(t) for t in range(4)]
    out = {"phase": "peak", "threads": numba.get_num_threads(), "shape": PEAK_SHAPE, "runs": {},
           "numba_traced_peak": numba_allocations_traced()}
    for kind in PEAK_KINDS:
        # Compile the kernels (and warm NumPy) on a small engine first: compilation is not a step's memory.
        warm = peak_engine(PEAK_ID_RANGE, kind)
        for t in range(2):
            acts, ctx = warm.lookup(*batches[t][:2])
            warm.apply_gradients(batches[t][2], ctx)
        del warm, acts, ctx
        for vocab in PEAK_VOCABS:
            emb = peak_engine(vocab, kind)  # tables allocated and written (initialised) before measuring
            assert [g.dim for g in emb.physical_tables] == [g["dim"] for g in PEAK_SHAPE["groups"][kind]]
            table_bytes = sum(g.weights.nbytes + sum(s.nbytes for s in g.slots) for g in emb.physical_tables)
            tracemalloc.start()
            first = traced_step(emb, *batches[0])
            later = [traced_step(emb, *batches[t]) for t in (1, 2)]
            tracemalloc.stop()
            hwm = [hwm_step(emb, *batches[3]) for _ in range(3)]
            out["runs"][f"{kind}:{vocab}"] = {
                "kind": kind, "vocab": vocab, "table_bytes": table_bytes, "first": first, "later": later,
                "hwm_rise": hwm, "workspace_bytes": [g.workspace.nbytes for g in emb.physical_tables],
                "pooled_workspaces": [g.batch_pool.idle for g in emb.physical_tables]}
            del emb
            gc.collect()
    return out


# -- storage -------------------------------------------------------------------------------------------------

STORAGE_ROWS, STORAGE_DIM, STORAGE_STEPS = 1_000_000, 16, 3
BF16 = {"weights_dtype": "bfloat16", "slot_dtype": "bfloat16"}
#: (name, rows, TableConfig storage arguments, slot initializer): a float32 table of V rows, bfloat16 ones
#: (rows and slots) of V and 2V rows; the accumulators start at Adagrad's plain float 0.1, or at the
#: initializer object Constant(0.1) (filled chunk by chunk into a 16-bit slot).
STORAGE_CASES = (("float32", STORAGE_ROWS, {}, "float"),
                 ("bfloat16", STORAGE_ROWS, BF16, "float"),
                 ("bfloat16 x2", 2 * STORAGE_ROWS, BF16, "float"),
                 ("bfloat16 x2, Constant slot initializer", 2 * STORAGE_ROWS, BF16, "Constant"))


def adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    accumulator = slot_variables[0] + gradient * gradient
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator


def storage_engine(rows, stored, slot_init):
    """One Adagrad table (a full-row accumulator slot) of ``rows`` x 16, fed by a bag feature."""
    table = ec.TableConfig(rows, STORAGE_DIM, name="items", combiner="sum", **stored)
    optimizer = (ec.Adagrad(0.05, initial_accumulator_value=0.1) if slot_init == "float" else
                 ec.CustomOptimizer(adagrad, 0.05, ["accumulators"], [ec.Constant(0.1)]))
    return ec.Embedding({"items": ec.FeatureConfig(table)}, optimizer, seed=6)


def trim():
    """Hand the allocator's free heap memory back to the system (glibc), so that VmRSS counts live memory."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def storage_steps(emb, rows, steps):
    rng = np.random.default_rng(7)
    grads = {"items": rng.standard_normal((PEAK_BATCH, STORAGE_DIM)).astype(np.float32)}
    for _ in range(steps):
        _, ctx = emb.lookup({"items": rng.integers(0, rows, (PEAK_BATCH, 8))})
        emb.apply_gradients(grads, ctx)


def storage_phase():
    out = {"phase": "storage", "rows": STORAGE_ROWS, "dim": STORAGE_DIM, "steps": STORAGE_STEPS, "cases": {}}
    for name, rows, stored, slot_init in STORAGE_CASES:  # compile the kernels (and warm NumPy) first
        warm = storage_engine(1000, stored, slot_init)
        storage_steps(warm, 1000, 2)
        del warm
    for name, rows, stored, slot_init in STORAGE_CASES:
        trim()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = status("VmRSS")
        emb = storage_engine(rows, stored, slot_init)
        trim()
        built = status("VmRSS")
        storage_steps(emb, rows, STORAGE_STEPS)
        trim()
        after, high = status("VmRSS"), status("VmHWM")
        table = emb.physical_tables[0]
        out["cases"][name] = {
            "rows": rows, "dtype": str(table.weights.dtype), "slot_dtype": str(table.slots[0].dtype),
            "nbytes": int(table.weights.nbytes + sum(s.nbytes for s in table.slots)),
            "resident_built": built - before, "resident": after - before, "peak": high - before}
        del emb, table
        gc.collect()
    return out


if __name__ == "__main__":
    for phase in sys.argv[1:]:
        # The long rss phase runs Numba on one thread: on a machine shared with other busy processes, every
        # parallel region waits for a descheduled worker thread (35 ms a step instead of 3 ms on a loaded
        # 2-core machine). The peak phase runs on all threads: per-thread scratch is part of its formula.
        numba.set_num_threads(1 if phase == "rss" else numba.config.NUMBA_NUM_THREADS)
        result = {"rss": rss_phase, "peak": peak_phase, "storage": storage_phase}[phase]()
        print(json.dumps(result), flush=True)
