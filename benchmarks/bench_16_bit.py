"""Training steps on float32, bfloat16 and float16 tables of the update shape, alternating in one process.

Run from the repository root::

    python benchmarks/bench_16_bit.py [--rows 2000000] [--dim 64] [--ids 262144] [--rounds 12] [--steps 3]
        [--threads 2] [--optimizer rowwise_adagrad|adagrad|sgd] [--dtypes float32,bfloat16,float16]
        [--output-dtypes float32,bfloat16] [--gradient-dtypes float32,bfloat16,float16,output]
        [--tunings default,through-caches] [--read-activations] [--probes]

Workload: the update shape (:func:`embedcore.bench.workloads.update_workload`): one ``rows x dim`` table,
``ids`` ids a step from the bounded Zipf distribution calibrated to ~150,000 distinct ids (one id per
sample, sum combiner), so most rows a step reads are not in any cache: the lookup is a cold gather and the
update a random read-modify-write of ~150,000 rows. Each contender is an ``Embedding`` whose table has
``weights_dtype`` of its name (slots float32, stochastic rounding on; a name ending ``-nearest``, e.g.
``bfloat16-nearest``: rounding to nearest, to time what the random bits cost), all with the same optimizer
(row-wise Adagrad by default, FBGEMM's conventions: accumulators from 0, eps 1e-8) and the same batches,
under each of the ``--tunings``: ``default`` (:data:`embedcore.DEFAULT_TUNING`) and ``through-caches``
(``Tuning(stream_activations_min_bytes=None)``: activations written with normal stores), with each of
the ``--output-dtypes`` (the engine's ``output_dtype``: float32 activations by default) and each of the
``--gradient-dtypes`` (default ``float32``; ``output``: the output's dtype, as a framework hands back the
gradient of 16-bit activations): the dtype of the gradient given to ``apply_gradients``, made once before any
timing (a 16-bit gradient is read in place by the update, 2 bytes a value). A contender is named
``table/out-X/grad-Y`` where X or Y is not float32.
Each round runs ``steps`` steps per contender (lookup, then ``apply_gradients`` of the given gradient), the
contenders' order reversed every other round; medians are over all steps of all rounds. With
``--read-activations`` each lookup is followed by one pass reading its activations (what a model's first
layer does; activations written past the caches come back from memory), timed on its own. With
``--probes`` each round also measures the machine's streaming copy and random 256-byte-row gather
(:class:`embedcore.bench.machine.Probes`). Every contender runs with the same Numba thread count
(``--threads``) and the process's allocator.

Bytes a step (the model, not a measurement): the lookup reads ``ids * dim * itemsize`` of rows and writes
``ids * dim * output itemsize`` of activations (twice that through the caches: a store reads its line
first); the
update reads and writes ``n_unique * (dim * itemsize + slot bytes)`` of rows and slots and reads the
``ids * dim * gradient itemsize`` bytes of gradient rows twice (the engine's NaN check, then the update).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "100000")  # the harness's default OpenMP waiting

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import ml_dtypes
import numba
import numpy as np
from numba import njit, prange

import embedcore as ec
from embedcore.bench.machine import Probes, allocator_name
from embedcore.bench.workloads import make_batches, update_workload
from embedcore.kernels.half import bits_of, decoder, format_of
from embedcore.kernels.rows import value_of

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
GRADIENT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                   "float16": np.dtype(np.float16)}


def _optimizer(name):
    if name == "rowwise_adagrad":
        return ec.RowwiseAdagrad(0.01, initial_accumulator_value=0.0, epsilon=1e-8)
    if name == "adagrad":
        return ec.Adagrad(0.01)
    return ec.SGD(0.01)


TUNINGS = {"default": ec.Tuning(), "through-caches": ec.Tuning(stream_activations_min_bytes=None)}


@njit(parallel=True)
def _read_rows(act, out, decode):
    for a in prange(act.shape[0]):
        total = np.float32(0.0)
        for j in range(act.shape[1]):
            total += value_of(decode, act[a, j])
        out[a] = total


def read_rows(act, out):
    """``out[a] = sum of act[a]`` in float32: one read of every activation (float32, or float16 / bfloat16
    converted as they are read)."""
    name = format_of(act.dtype)
    _read_rows(bits_of(act), out, decoder(name) if name != "float32" else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=262_144)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizer", default="rowwise_adagrad", choices=("rowwise_adagrad", "adagrad", "sgd"))
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--output-dtypes", default="float32",
                        help="comma-separated, of float32, float16, bfloat16: the engines' output_dtype")
    parser.add_argument("--tunings", default="default", help=f"comma-separated, of {sorted(TUNINGS)}")
    parser.add_argument("--gradient-dtypes", default="float32",
                        help=f"comma-separated, of {sorted(GRADIENT_DTYPES)}: the gradients' dtype")
    parser.add_argument("--read-activations", action="store_true")
    parser.add_argument("--probes", action="store_true")
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    tunings = args.tunings.split(",")
    outputs = args.output_dtypes.split(",")
    gradient_choices = args.gradient_dtypes.split(",")
    contenders = list(dict.fromkeys((dtype, output, output if grad == "output" else grad, tuning) for tuning in tunings
                                    for dtype in dtypes for output in outputs for grad in gradient_choices))
    gradient_dtypes = sorted({c[2] for c in contenders})

    w = update_workload(E=args.rows, D=args.dim, ids=args.ids, n_batches=args.steps)
    batches = make_batches(w)
    inputs = [(b.ids[0][:, None], np.ascontiguousarray(b.grad[0], np.float32)) for b in batches]
    n_unique = [len(np.unique(ids)) for ids, _ in inputs]
    # each gradient dtype's gradients, made once, outside the timing
    gradients = {g: [grad.astype(GRADIENT_DTYPES[g]) for _, grad in inputs] for g in gradient_dtypes}

    engines = {}
    sums = np.empty(args.ids, np.float32)
    for dtype, output, grad_dtype, tuning in contenders:
        table = ec.TableConfig(args.rows, args.dim, name="t", combiner="sum", initializer=ec.RandomUniform(-0.05, 0.05),
                               weights_dtype=dtype.removesuffix("-nearest"),
                               stochastic_rounding=not dtype.endswith("-nearest"))
        emb = ec.Embedding({"f": ec.FeatureConfig(table)}, _optimizer(args.optimizer), seed=1, tuning=TUNINGS[tuning],
                           output_dtype=output)
        for (ids, _), grad in list(zip(inputs, gradients[grad_dtype]))[:2]:  # compile, touch every page
            acts, ctx = emb({"f": ids})
            read_rows(acts["f"], sums)
            emb.apply_gradients({"f": grad}, ctx)
        engines[dtype, output, grad_dtype, tuning] = emb
    probes = Probes(args.threads) if args.probes else None
    probe_rounds = []

    times = {c: {"lookup": [], "read": [], "update": []} for c in contenders}
    for r in range(args.rounds):
        if probes is not None:
            probe_rounds.append(probes.measure())
        for contender in (contenders if r % 2 == 0 else contenders[::-1]):
            emb = engines[contender]
            for (ids, _), grad in zip(inputs, gradients[contender[2]]):
                t0 = time.perf_counter()
                acts, ctx = emb({"f": ids})
                t1 = time.perf_counter()
                if args.read_activations:
                    read_rows(acts["f"], sums)
                t2 = time.perf_counter()
                emb.apply_gradients({"f": grad}, ctx)
                t3 = time.perf_counter()
                times[contender]["lookup"].append(t1 - t0)
                times[contender]["read"].append(t2 - t1)
                times[contender]["update"].append(t3 - t2)

    slot_bytes = 4 if args.optimizer == "rowwise_adagrad" else (4 * args.dim if args.optimizer == "adagrad" else 0)
    print(f"# {args.rows:,} x {args.dim} table, {args.ids:,} ids a step ({min(n_unique):,}-{max(n_unique):,} "
          f"distinct), {args.optimizer}, {args.rounds} rounds x {args.steps} steps, Numba {args.threads} threads, "
          f"allocator {allocator_name()}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    if probe_rounds:
        for name in probe_rounds[0]:
            per_round = [p[name] for p in probe_rounds]
            print(f"# probe {name}: median {statistics.median(per_round):.1f} GB/s "
                  f"({min(per_round):.1f}-{max(per_round):.1f} over rounds)")
    base = {}
    print(f"{'table':<34} {'tuning':<15} {'lookup ms':>10} {'vs f32':>7} {'read ms':>8} {'update ms':>10} "
          f"{'vs f32':>7} {'step ms':>8} {'MB a step':>10}")
    for dtype, output, grad_dtype, tuning in contenders:
        t = times[dtype, output, grad_dtype, tuning]
        med = {phase: statistics.median(t[phase]) for phase in t}
        base.setdefault(tuning, med)  # the first contender of the tuning (float32, float32 gradient by default)
        step = statistics.median(sum(parts) for parts in zip(t["lookup"], t["read"], t["update"]))
        itemsize = ITEMSIZE[dtype.removesuffix("-nearest")]
        rows_and_slots = statistics.median(n_unique) * 2 * (args.dim * itemsize + slot_bytes)
        mb = (args.ids * args.dim * (itemsize + ITEMSIZE[output]) + rows_and_slots
              + 2 * args.ids * args.dim * GRADIENT_DTYPES[grad_dtype].itemsize) / 1e6
        name = dtype + (f"/out-{output}" if output != "float32" else "") + (
            f"/grad-{grad_dtype}" if grad_dtype != "float32" else "")
        read = f"{med['read'] * 1e3:>8.2f}" if args.read_activations else f"{'-':>8}"
        print(f"{name:<34} {tuning:<15} {med['lookup'] * 1e3:>10.2f} {med['lookup'] / base[tuning]['lookup']:>6.2f}x "
              f"{read} {med['update'] * 1e3:>10.2f} {med['update'] / base[tuning]['update']:>6.2f}x {step * 1e3:>8.2f} "
              f"{mb:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
