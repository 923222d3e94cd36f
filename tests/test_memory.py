"""Memory: a training loop's resident memory stays flat, and one step's memory depends on the batch only.

One worker process (``tests/workers/memory.py``) measures everything, away from this process's state:

* 10,000 steps of a small fixed-shape workload with fresh ids every step: ``VmRSS`` every 500 steps, Numba's
  live allocations (``NUMBA_NRT_STATS``), objects tracked by the garbage collector, and 500 more steps
  under ``tracemalloc`` (NumPy arrays are not tracked by the garbage collector);
* the peak of one step's allocations above its start, traced by ``tracemalloc`` (which sees NumPy's
  allocations and Numba's, made through ``PyMem_RawMalloc``, worker threads included: checked), for the
  same batch with tables of 10**4 and 10**6 rows. The measured peaks must stay under :func:`step_bound`, a
  formula in the batch's sizes derived by reading ``lookup.py``, ``inputs.py``, ``engine.py`` and
  ``kernels/`` (every per-step allocation is listed there), and must not depend on the vocabulary.

A table with a non-lazy optimizer (``Adam(lazy_adam=False)``) visits every row each step; its only
per-row memory is a status workspace of one byte per table row, made on the first step and reused. Tables of
bfloat16 rows and slots step within the same formula.

A second worker run (phase ``storage``) measures what a table costs resident: bfloat16 rows and slots take
half of float32 ones, so a table of twice the vocabulary fits in a float32 table's memory (VmRSS and VmHWM of
building and training each, not ``nbytes``).
"""

import json
import os
import subprocess
import sys

import pytest

from embedcore.kernels.aligned import CACHE_LINE, HUGE_MIN, HUGE_PAGE

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "memory.py")
MB = 2 ** 20

# Python objects a step creates besides arrays (dataclasses, lists, dicts, tuples, the UpdateReport, ...):
# not derivable from sizes; measured at about 10 KB for 4 features, allowed 32 KB.
PYTHON_OBJECTS = 32 * 1024
NRT_HEADER = 64    # a Numba array allocated in jitted code: its MemInfo and allocator header
RADIX_COUNTS = 8 * 2 ** 11  # kernels/dedup.py: counts of one 11-bit digit per sorting thread, int64


def aligned(nbytes):
    """What an array of ``nbytes`` from ``kernels/aligned.py`` allocates: one alignment more."""
    return nbytes + (HUGE_PAGE if nbytes >= HUGE_MIN else CACHE_LINE)


@pytest.fixture(scope="module")
def measured():
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    proc = subprocess.run([sys.executable, WORKER, "rss", "peak"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"memory worker failed:\n{proc.stderr[-4000:]}"
    return {r["phase"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}


# -- (a) resident memory over 10,000 steps ----------------------------------------------------------------

def test_resident_memory_is_flat_over_10000_steps(measured):
    r = measured["rss"]
    rss = r["rss"]
    growth, highest = rss[-1] - rss[0], max(rss) - rss[0]
    traced_growth = r["traced"][1] - r["traced"][0]
    print(f"\nRSS over {r['steps']} steps after {r['warmup']} warm-up ({r['step_ms']:.2f} ms/step, Numba on "
          f"{r['threads']} thread): {rss[0] / MB:.1f} MB -> {rss[-1] / MB:.1f} MB (growth {growth / MB:+.2f} MB, "
          f"highest {highest / MB:+.2f} MB); samples every {r['every']} steps (MB above the first): "
          f"{[round((x - rss[0]) / MB, 2) for x in rss]}; Numba live allocations {r['nrt_live'][0]} -> "
          f"{r['nrt_live'][-1]}; GC-tracked objects {r['gc_objects'][0]} -> {r['gc_objects'][1]}; "
          f"tracemalloc over {r['traced_steps']} more steps: {traced_growth:+d} bytes")
    assert r["final_step"] == r["warmup"] + r["steps"] + r["traced_steps"]
    assert growth < 5 * MB and highest < 5 * MB
    # Exact leak checks: Numba frees every array it allocates in a step (allocations minus frees and
    # MemInfos allocated minus freed unchanged), no Python objects accumulate, and NumPy's allocations after
    # 10,500 steps grow by less than 64 bytes a step (measured: about 2 KB over the 500 steps). Two caches
    # outside embedcore used to fill here: ctypes' (read through ``array.ctypes.data``, now never called per
    # step) and weakref.finalize's registry (a dict that one finalizer a step kept resizing).
    assert all(x == r["nrt_live"][0] for x in r["nrt_live"]), r["nrt_live"]
    assert r["gc_objects"][1] - r["gc_objects"][0] <= 100
    assert traced_growth < 64 * r["traced_steps"]


# -- (b) peak memory of one step --------------------------------------------------------------------------

def batch_sizes(feature):
    """Occurrences of a feature given as dense ids ``[B, k]``: before and after sequence truncation."""
    b, k, seq = feature["batch"], feature["k"], feature["seq"]
    return b * k, b * (min(k, seq) if seq else k), b * (seq if seq else 1)


def step_bound(shape, groups, batch, threads, n_rows=None):
    """Upper bounds, in bytes, of a step's allocations above its start: ``{"lookup", "apply", "lookup_first",
    "apply_first"}``, the last two for an engine's first step, which also allocates its grow-only workspaces. Variables
    (per physical table g, in the engine's order): N_g occurrences (ids after sequence truncation), M_g ids
    before truncation, U_g unique rows, A_g activation rows, d_g dim, S_g row slots, T_g row temporaries of
    a per-row function (0 for the built-ins, inlined element-wise); per feature f: B_f samples, N_f ids.
    Covers features given as int64 ``[B, k]`` arrays (ids) and float32 arrays (weights) with float32
    gradients, as the workload does; other forms add conversions (ids of another integer type: +8 N_f;
    weights of another type: 12 N_f; Sparse: +24 N_f for positions and their order; float64 gradients: a
    9-byte-per-value range check in apply).

    Lookup (lookup.py, inputs.py, kernels/occurrences.py):
      per feature, held until lookup returns: row_splits 8 (B_f + 1) (ids are range-checked and weights
      checked in place, by jitted loops);
      per table: the activations 4 A_g d_g; the table batch (rows 8 M_g, packed activation rows and gains
      8 M_g, out_ptr 8 (A_g + 1)) is written into a workspace leased from the table's pool and kept in the context:
      new memory only on the first step (apply_gradients gives the workspace back for the next lookup).
    Apply (engine.py, kernels/):
      held: every table's context and activations (above); gradients are copied into a workspace, never
      a new array; per table, transient: radix-sort digit counts 8 * 2048 per sorting thread; the update
      kernel's per-chunk flag counts 8 (U_g / 256 + 1); per worker thread, the chunk's scratch rows
      (gradient, new row, new row slots) (2 + S_g) (4 d_g + 64) and a per-row function's temporaries
      T_g (4 d_g + 64). (UpdateReport's status masks are made only when some row was skipped.)
      Non-lazy tables: ``status`` has one byte per table row, not per unique row: U_g is the table's row
      count (``n_rows``), the only term that depends on the vocabulary.
    First step, workspaces (kernels/dedup.py, engine.py): two key and two payload sort buffers and uniq
      40 N_g, ptr 8 (N_g + 1), status U_g, and d_act 4 A_g d_g for a table fed by
      several features (or a non-float32 gradient); in lookup, the pooled table batch (above).
    Every array above but the transient ones starts on a cache line (kernels/aligned.py), which costs each
    one alignment's worth more (``aligned``). Plus PYTHON_OBJECTS for the small objects of a step.
    """
    features = shape["features"]
    live = sum(8 * (f["batch"] + 1) for f in features)
    lookup_first = lookup_later = live
    held_first = held_later = apply_transient = workspaces = 0
    for g, (group, sizes) in enumerate(zip(groups, batch)):
        mine = [f for f in features if f["group"] == g]
        n, a, d = sizes["n_occurrences"], sizes["n_activation_rows"], group["dim"]
        assert n == sum(batch_sizes(f)[1] for f in mine) and a == sum(batch_sizes(f)[2] for f in mine)
        m = sum(batch_sizes(f)[0] for f in mine)
        u = sizes["n_unique"] if group["lazy"] else n_rows
        table_batch = 2 * aligned(8 * max(m, 16)) + aligned(8 * max(a + 1, 16)) + 3 * NRT_HEADER
        acts = aligned(4 * a * d)
        lookup_first = max(lookup_first, live + held_first + table_batch + acts)
        lookup_later = max(lookup_later, live + held_later + acts)
        held_first += table_batch + acts
        held_later += acts
        per_thread = (2 + group["row_slots"] + group.get("row_temporaries", 0)) * (4 * d + NRT_HEADER)
        flags = 8 * (max(u, 1) // 256 + 1) + NRT_HEADER
        apply_transient = max(apply_transient, threads * (RADIX_COUNTS + NRT_HEADER) + flags + threads * per_thread)
        copies = len(mine) > 1
        workspaces += 5 * aligned(8 * max(n, 16)) + aligned(8 * max(n + 1, 16)) + aligned(max(u, 16)) + \
            (aligned(4 * a * d) if copies else 0)
    return {"lookup": lookup_later + PYTHON_OBJECTS, "apply": held_later + apply_transient + PYTHON_OBJECTS,
            "lookup_first": lookup_first + PYTHON_OBJECTS,
            "apply_first": held_first + apply_transient + workspaces + PYTHON_OBJECTS}


def peaks(run):
    """(lookup, apply) peaks of the first step and the largest of the later ones."""
    later = run["later"]
    return {"first": (run["first"]["lookup"], run["first"]["apply"]),
            "later": (max(s["lookup"] for s in later), max(s["apply"] for s in later))}


def check_against_bound(peak, run, kind, non_lazy_rows=None):
    groups = peak["shape"]["groups"][kind]
    rows = []
    for name, step in [("first", run["first"])] + [(f"later{i}", s) for i, s in enumerate(run["later"])]:
        bounds = step_bound(peak["shape"], groups, step["batch"], peak["threads"], n_rows=non_lazy_rows)
        first = name == "first"
        lookup_bound = bounds["lookup_first"] if first else bounds["lookup"]
        bound = apply_bound = bounds["apply_first"] if first else bounds["apply"]
        assert step["lookup"] <= lookup_bound, (kind, run["vocab"], name, step["lookup"], lookup_bound)
        assert step["apply"] <= bound, (kind, run["vocab"], name, step["apply"], bound)
        rows.append(f"{name}: lookup {step['lookup']:,} <= {lookup_bound:,} ({step['lookup'] / lookup_bound:.2f}), "
                    f"apply {step['apply']:,} <= {bound:,} ({step['apply'] / bound:.2f})")
    for hwm in run["hwm_rise"]:  # untraced: the resident high-water mark rises by no more than the bound
        assert hwm <= max(lookup_bound, apply_bound) + MB
    return rows


def test_tracemalloc_sees_numba_allocations(measured):
    # 10,000 iterations allocating a 16 KB row each, on the worker threads: the peak holds at least one.
    assert measured["peak"]["numba_traced_peak"] >= 4096 * 4


def test_peak_step_memory_is_bounded_by_the_batch_not_the_vocabulary(measured):
    peak = measured["peak"]
    small, large = peak["runs"]["lazy:10000"], peak["runs"]["lazy:1000000"]
    print(f"\npeak memory of one step (lazy optimizers: Adagrad, a per-row custom function; {peak['threads']} "
          f"Numba threads; batch: "
          f"{small['first']['batch']}):")
    for run in (small, large):
        rows = check_against_bound(peak, run, "lazy")
        print(f"  vocabulary {run['vocab']:>9,} (tables {run['table_bytes'] / MB:.1f} MB): " + "; ".join(rows)
              + f"; VmHWM rise untraced {run['hwm_rise']}")
    a, b = peaks(small), peaks(large)
    for when in ("first", "later"):
        for k, what in enumerate(("lookup", "apply")):
            # The same batch: the same allocations, up to small objects (ints, caches), whatever the table size.
            assert abs(a[when][k] - b[when][k]) <= 16 * 1024, (when, what, a[when][k], b[when][k])
    assert max(b["first"]) < 0.02 * large["table_bytes"]
    assert large["workspace_bytes"] == small["workspace_bytes"]


def test_non_lazy_step_memory_does_not_depend_on_the_vocabulary(measured):
    """A non-lazy table keeps one status byte per table row (a workspace made on the first step and reused);
    later steps allocate nothing in proportion to the table."""
    peak = measured["peak"]
    small, large = peak["runs"]["dense:10000"], peak["runs"]["dense:1000000"]
    a, b = peaks(small), peaks(large)
    print(f"\nnon-lazy Adam table: step peaks (lookup, apply) for 10**4 rows {a}, for 10**6 rows {b}; "
          f"workspaces {small['workspace_bytes']} vs {large['workspace_bytes']} bytes")
    assert b["later"][1] - a["later"][1] <= 16 * 1024


def test_non_lazy_step_memory_is_within_the_formula_with_its_row_term(measured):
    """The formula, with one status byte per table row for the non-lazy table, holds for the code as it is."""
    peak = measured["peak"]
    for vocab in (10_000, 1_000_000):
        run = peak["runs"][f"dense:{vocab}"]
        rows = check_against_bound(peak, run, "dense", non_lazy_rows=vocab)
        print(f"\nnon-lazy, vocabulary {vocab:,}: " + "; ".join(rows))


def test_16_bit_step_memory_is_within_the_same_formula(measured):
    """bfloat16 rows and slots: a step allocates what a float32 step does (activations, gradients and
    scratch rows are float32 either way), within the same formula, whatever the vocabulary."""
    peak = measured["peak"]
    for vocab in (10_000, 1_000_000):
        run, float32 = peak["runs"][f"lazy16:{vocab}"], peak["runs"][f"lazy:{vocab}"]
        rows = check_against_bound(peak, run, "lazy16")
        print(f"\nbfloat16 tables, vocabulary {vocab:,} ({run['table_bytes'] / MB:.1f} MB, float32: "
              f"{float32['table_bytes'] / MB:.1f} MB): " + "; ".join(rows))
        assert run["table_bytes"] * 2 == float32["table_bytes"]
        for when in ("first", "later"):
            for k in range(2):
                assert abs(peaks(run)[when][k] - peaks(float32)[when][k]) <= 16 * 1024


# -- (c) a 16-bit table takes half the memory: a twice larger vocabulary fits -----------------------------

# _fill_stored (tables/physical.py) rounds an initializer's values into a 16-bit table chunk by chunk: a
# float32 scratch of 2**22 values (16 MiB) and its rounded copy (8 MiB) live while a table is built.
FILL_TRANSIENT = 4 * 2 ** 22 + 2 * 2 ** 22
RSS_SLACK = 4 * MB  # page-table, allocator and interpreter noise between two VmRSS readings


@pytest.fixture(scope="module")
def storage():
    proc = subprocess.run([sys.executable, WORKER, "storage"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"memory worker failed:\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = result["cases"]
    print(f"\nan Adagrad table of {result['dim']} values a row with its accumulator row, built and trained "
          f"{result['steps']} steps (MiB above the process before it):")
    for name, c in cases.items():
        print(f"  {name:<40} {c['rows']:>9,} rows, {c['dtype']}/{c['slot_dtype']}: arrays {c['nbytes'] / MB:6.1f}, "
              f"resident {c['resident'] / MB:6.1f}, peak resident {c['peak'] / MB:6.1f}")
    return cases


def test_a_16_bit_table_is_resident_in_half_the_memory(storage):
    """Measured resident memory (VmRSS, the allocator's free memory handed back first): bfloat16 rows and
    slots of V rows take half of float32 ones; of 2V rows, what float32 ones of V rows take."""
    f32, half, double = storage["float32"], storage["bfloat16"], storage["bfloat16 x2"]
    for case in storage.values():  # what is resident is the arrays, nothing more
        assert abs(case["resident"] - case["nbytes"]) <= RSS_SLACK, case
    assert abs(half["resident"] - f32["resident"] / 2) <= RSS_SLACK, (half, f32)
    assert double["resident"] <= f32["resident"] + RSS_SLACK, (double, f32)


def test_a_twice_larger_16_bit_table_is_built_within_a_float32_tables_bound(storage):
    """The peak while building and training a bfloat16 table of 2V rows stays within the float32 table's
    of V rows plus the fill's fixed-size chunk, when the slot's initializer is an initializer object."""
    f32, double = storage["float32"], storage["bfloat16 x2, Constant slot initializer"]
    assert double["peak"] <= f32["peak"] + FILL_TRANSIENT + RSS_SLACK, (double, f32)


def test_a_twice_larger_16_bit_table_with_a_float_slot_initializer_is_built_within_the_bound(storage):
    f32, double = storage["float32"], storage["bfloat16 x2"]
    assert double["peak"] <= f32["peak"] + FILL_TRANSIENT + RSS_SLACK, (double, f32)
