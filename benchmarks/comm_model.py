"""A model of what ``ShardedEmbedding`` moves over the network per host and step, from 2 to 1,024 hosts.

Run from the repository root (no MPI needed; about 10 s)::

    python benchmarks/comm_model.py [--json /tmp/comm_model.json] [--bench-json /tmp/dist_k1.json]

The exchange (``embedcore/distributed``), per step for all tables at once, on every one of ``N`` hosts (one
rank each):

1. lookup: one all-to-all of counts, 8 B to every other rank (it also carries the agreement on input errors);
2. one all-to-all-v of the unique ids of the local batch (all tables), each to its owner: 8 B per id;
3. one all-to-all-v of the rows back: ``dim * 4`` B per id;
4. apply_gradients: one 24-byte all-reduce agreeing that every rank's gradients are valid;
5. one all-to-all-v of each unique id's summed gradient to its owner: ``dim * 4`` B per id;
6. one 24-byte all-reduce agreeing on the update's outcome (rows left unchanged).

A host dedups only its own batch, so the unique ids per host per step ``U`` do not depend on ``N``; an id is
remote with probability ``(N - 1) / N`` (row ``r`` lives on rank ``(r + rotation) % N``; hot ids are scattered
over the table, so owners are uniform). By symmetry a host receives as much as it sends, so per host and step

    sent = received = (N - 1)/N * U * (8 + 2 * dim * 4)  +  8 * (N - 1)  +  2 * 24 * ceil(log2 N)     [bytes]

(ids it asks for + rows it returns to the hosts that asked it + its gradient sums; then the count exchange
and the two all-reduces, recursive doubling). Communication would take as long as computation at the link
bandwidth

    break-even bandwidth = sent / compute time per step        (full duplex: each direction)

below which communication dominates a step (more if it does not overlap with compute, which it does not
today: every exchange is waited for in the step's critical path). Messages: each all-to-all-v sends to the
peers that own at least one of the ids, ``(N - 1)(1 - (1 - 1/N)^U)``; the count all-to-all of 8 B and each
all-reduce take ~log2 N rounds of one message. The 6 collectives per step are synchronisation points: a step
waits for the slowest host 6 times. The latency floor is messages x an assumed per-message cost
(``--latency-us``, default 2 us). The "per table" figures are those of the engine before the exchange was
fused (one count all-to-all and three all-to-all-v per table, 8 B per table per peer of counts, three 8-byte
all-gathers: ``4 T + 3`` collectives per step), for comparison.

Workloads:

(a) the demo (``embedcore demo``): the 26 features of ``SyntheticClickLog`` (22 one-hot, 4 bags of 1-5 ids),
    1,024 samples per host per step, dim 16; ``U`` sampled from the data set itself (64 batches) at the
    demo's vocabulary scale (0.01: 10 .. 10^4 rows) and at full scale (1: 10^2 .. 10^6 rows, 3.3M in all).
    Compute time per step: the demo's measured training step (1,024 samples at ~40,000 samples/s on the
    2-core machine, idle: 25.6 ms, BENCHMARKS.md) and the embedding part alone (lookup + apply of a
    single-process ``Embedding`` on the same workload, measured by ``bench_distributed.py --baseline``).
(b) a production-sized workload (assumptions, all options): T = 100 tables of V rows each, V = 10^6 or 10^7
    (10^8 or 10^9 rows in all), dim 128, 65,536 samples per host per step, one id per table and sample,
    ids from the same bounded power law as the synthetic data with exponent 1.1, Adagrad (one full-row
    slot). ``U`` is the exact expectation ``sum_r 1 - (1 - p_r)^B`` (checked against sampling). Compute
    time per step is modelled from the bytes the embedding path touches per step,
    ``dim * 4 * (7 U + 2 n + B T)`` (lookup: gather U rows, read n occurrences, write B T activations;
    backward: read n gradient rows, write U sums; update: row and slot read + write and the gradient, 5 U),
    divided by an effective rate: the rate this formula gives for the demo-like run measured on this
    2-core machine, and 100 GB/s (an assumption for a large many-core server, ~1/3 of its DRAM bandwidth).
    The dense model's time is not included (it would lower the break-even bandwidth).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib

import numpy as np

try:
    import embedcore  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

ID_BYTES = 8
FLOAT_BYTES = 4
HOSTS = [2 ** k for k in range(1, 11)]

# Measured on the 2-core development machine (see docs/distributed.md for the runs):
DEMO_STEP_MS = 1024 / 40_000 * 1e3        # embedcore demo, whole training step, idle machine (BENCHMARKS.md)
EMBEDDING_MS = {0.01: 2.8, 1.0: 3.3}      # single-process Embedding lookup + apply: the fastest --baseline run on
                                          # the idle machine (2026-12-01, docs/distributed.md)
LATENCY_US = 2.0                          # assumed cost of one small MPI message (fast datacenter network)
AGREEMENT_BYTES = 24                      # one all-reduce of the agreement: error flag and a tag (max, -min)


# ----------------------------------------------------------------------------------------------------------
# Unique ids per host per step

def sample_demo(scale, batch=1024, n_batches=64, seed=0):
    """Unique ids and occurrences per table per batch of the demo's data at a vocabulary scale."""
    from embedcore.app.data.synthetic import DEFAULT_VOCABULARY_SIZES, SyntheticClickLog
    from embedcore.inputs import Ragged
    vocab = [max(10, round(v * scale)) for v in DEFAULT_VOCABULARY_SIZES]
    ds = SyntheticClickLog(n_train=1, n_eval=1, seed=seed, vocabulary_sizes=vocab)
    data = ds.samples(0, batch * n_batches)
    tables = []
    for f in ds.features:
        ids = data.ids[f.name]
        values, splits = (ids.values, ids.row_splits) if isinstance(ids, Ragged) else \
            (ids, np.arange(ids.shape[0] + 1))
        uniques, occ, remote = [], [], {n: [] for n in HOSTS}
        rot = {n: zlib.crc32(f.name.encode("utf-8")) % n for n in HOSTS}
        for b in range(n_batches):
            v = np.asarray(values[splits[b * batch]:splits[(b + 1) * batch]])
            u = np.unique(v)
            uniques.append(u.shape[0])
            occ.append(v.shape[0])
            for n in HOSTS:  # the real owner rule, for the host b % n
                remote[n].append(int(np.count_nonzero((u + rot[n]) % n != b % n)))
        tables.append({"name": f.name, "vocabulary_size": f.vocabulary_size, "unique": float(np.mean(uniques)),
                       "occurrences": float(np.mean(occ)),
                       "remote": {n: float(np.mean(r)) for n, r in remote.items()}})
    return tables


def expected_unique(v, s, n):
    """E[#distinct] of ``n`` draws from the data set's bounded power law over ``v`` rows with exponent ``s``:
    ``P(r) = ((r + 1)^(1-s) - (r + 2)^(1-s)) / (1 - (v + 1)^(1-s))``; exact sum for the first 2M ranks, then
    a trapezoid rule on a log grid (the summand is smooth and tiny there)."""
    w = (v + 1.0) ** (1.0 - s)
    head = min(v, 2_000_000)
    r = np.arange(head, dtype=np.float64)
    p = ((r + 1.0) ** (1.0 - s) - (r + 2.0) ** (1.0 - s)) / (1.0 - w)
    total = float(np.sum(-np.expm1(n * np.log1p(-p))))
    if v > head:
        x = np.unique(np.round(np.geomspace(head, v - 1, 20_000)))
        px = ((x + 1.0) ** (1.0 - s) - (x + 2.0) ** (1.0 - s)) / (1.0 - w)
        fx = -np.expm1(n * np.log1p(-px))
        total += float(np.sum(0.5 * (fx[1:] + fx[:-1]) * np.diff(x)))
    return total


def sampled_unique(v, s, n, seed=0):
    """One sample of the number of distinct ids (the synthetic data's inverse-CDF draw), as a check."""
    u = np.random.default_rng(seed).random(n)
    m = (v + 1.0) ** (1.0 - s) - 1.0
    r = np.floor(np.exp(np.log1p(u * m) / (1.0 - s)) - 1.0).clip(0, v - 1)
    return int(np.unique(r).shape[0])


# ----------------------------------------------------------------------------------------------------------
# Bytes, messages, break-even

def per_step(tables_unique, n_hosts, dim, remote_measured=None):
    """Bytes sent (= received) and messages per host per step on ``n_hosts`` hosts; ``tables_unique``: U per table."""
    t = len(tables_unique)
    u = float(sum(tables_unique))
    f = (n_hosts - 1) / n_hosts
    row = dim * FLOAT_BYTES
    ids = f * u * ID_BYTES
    rows = f * u * row
    grads = f * u * row
    rounds = math.ceil(math.log2(n_hosts))
    counts = ID_BYTES * (n_hosts - 1)
    agreements = 2 * AGREEMENT_BYTES * rounds
    # peers owning at least one of the host's ids: (N - 1) * (1 - (1 - 1/N)^U)
    peers = (n_hosts - 1) * (1.0 - (1.0 - 1.0 / n_hosts) ** u)
    messages = 3 * peers + 3 * rounds
    # the engine before the exchange was fused: per table a count all-to-all and three all-to-all-v
    peers_per_table = sum((n_hosts - 1) * (1.0 - (1.0 - 1.0 / n_hosts) ** ut) for ut in tables_unique)
    out = {"N": n_hosts, "remote_fraction": f, "unique_per_host": u, "ids_bytes": ids, "rows_bytes": rows,
           "grad_bytes": grads, "counts_bytes": counts, "agreement_bytes": agreements,
           "sent_bytes": ids + rows + grads + counts + agreements,
           "ids_per_peer": u / n_hosts, "messages": messages, "collectives": 6,
           "per_table": {"counts_bytes": ID_BYTES * t * (n_hosts - 1),
                         "sent_bytes": ids + rows + grads + ID_BYTES * t * (n_hosts - 1),
                         "messages": 3 * peers_per_table + (t + 3) * rounds, "collectives": 4 * t + 3}}
    if remote_measured is not None:
        out["remote_fraction_sampled"] = remote_measured / u
    return out


def touched_bytes(unique, occurrences, activations, dim):
    """Bytes the embedding path reads and writes per step (see the module docstring)."""
    return dim * FLOAT_BYTES * (7 * unique + 2 * occurrences + activations)


def break_even(sent_bytes, compute_s):
    """Link bandwidth (bytes/s per direction) at which sending takes as long as computing."""
    return sent_bytes / compute_s


def with_latency(row, compute_s):
    """Break-even bandwidth when the messages' latency is paid too: sent / (compute - latency floor); None
    when the latency floor alone exceeds the compute time (no bandwidth is enough)."""
    spare = compute_s - row["latency_floor_ms"] / 1e3
    return row["sent_bytes"] / spare if spare > 0 else None


def gbit(bps):
    return bps * 8 / 1e9


# ----------------------------------------------------------------------------------------------------------

def model(args):
    out = {"assumptions": {}, "workloads": {}}
    measured = dict(EMBEDDING_MS)
    if args.bench_json:
        with open(args.bench_json) as f:
            bench = json.load(f)
        base = bench["ranks"][0].get("baseline")
        if base:
            measured[bench["config"]["vocabulary_scale"]] = base["step_ms"]
    demo_step_s = args.demo_step_ms / 1e3
    rate_measured = None

    # (a) the demo
    for scale in (0.01, 1.0):
        tables = sample_demo(scale)
        unique = [t["unique"] for t in tables]
        occ = sum(t["occurrences"] for t in tables)
        emb_s = measured[scale] / 1e3
        touched = touched_bytes(sum(unique), occ, 1024 * len(tables), 16)
        rate = touched / emb_s
        if scale == 1.0:
            rate_measured = rate
        rows = []
        for n in HOSTS:
            r = per_step(unique, n, 16, sum(t["remote"][n] for t in tables))
            r["break_even_Bps_full_step"] = break_even(r["sent_bytes"], demo_step_s)
            r["break_even_Bps_embedding_only"] = break_even(r["sent_bytes"], emb_s)
            r["latency_floor_ms"] = r["messages"] * args.latency_us / 1e3
            r["per_table"]["latency_floor_ms"] = r["per_table"]["messages"] * args.latency_us / 1e3
            r["break_even_Bps_full_step_with_latency"] = with_latency(r, demo_step_s)
            rows.append(r)
        out["workloads"][f"demo_scale_{scale:g}"] = {
            "description": f"embedcore demo: 26 features, 1,024 samples/host/step, dim 16, vocabulary scale "
                           f"{scale:g} ({sum(t['vocabulary_size'] for t in tables):,} rows)",
            "tables": tables, "unique_per_host": sum(unique), "occurrences_per_host": occ,
            "compute_ms": {"full_training_step": args.demo_step_ms, "embedding_only": measured[scale]},
            "touched_bytes_per_step": touched, "effective_rate_Bps": rate,
            "memory_per_host_bytes": {n: sum(t["vocabulary_size"] for t in tables) * 16 * 4 * 2 / n for n in HOSTS},
            "rows": rows}

    # (b) production
    for v in (10 ** 6, 10 ** 7):
        t, dim, b, s = 100, 128, 65_536, 1.1
        u_table = expected_unique(v, s, b)
        check = sampled_unique(v, s, b)
        unique = [u_table] * t
        occ = b * t
        touched = touched_bytes(u_table * t, occ, b * t, dim)
        compute = {"this_machine_rate": touched / rate_measured, "100GBps": touched / args.server_rate}
        rows = []
        for n in HOSTS:
            r = per_step(unique, n, dim)
            r["break_even_Bps_this_machine_rate"] = break_even(r["sent_bytes"], compute["this_machine_rate"])
            r["break_even_Bps_100GBps"] = break_even(r["sent_bytes"], compute["100GBps"])
            r["latency_floor_ms"] = r["messages"] * args.latency_us / 1e3
            r["per_table"]["latency_floor_ms"] = r["per_table"]["messages"] * args.latency_us / 1e3
            r["break_even_Bps_100GBps_with_latency"] = with_latency(r, compute["100GBps"])
            rows.append(r)
        out["workloads"][f"production_V{v:.0e}"] = {
            "description": f"production: {t} tables x {v:,} rows ({t * v:.0e} rows), dim {dim}, {b:,} samples/host/"
                           f"step, 1 id per table and sample, power law s={s}, Adagrad (1 full-row slot)",
            "unique_per_table": u_table, "unique_per_table_sampled": check, "unique_per_host": u_table * t,
            "occurrences_per_host": occ, "touched_bytes_per_step": touched,
            "compute_ms": {k: 1e3 * x for k, x in compute.items()},
            "memory_per_host_bytes": {n: t * v * dim * 4 * 2 / n for n in HOSTS}, "rows": rows}
    # how U depends on V for the production batch (one table)
    out["production_unique_vs_vocabulary"] = {f"{v:.0e}": expected_unique(v, 1.1, 65_536)
                                              for v in (10 ** 5, 10 ** 6, 10 ** 7, 10 ** 8, 10 ** 9)}
    out["assumptions"] = {
        "remote_fraction": "(N-1)/N of each host's unique ids (owner = (row + rotation) % N, hot ids scattered)",
        "bytes": "ids 8 B, rows and gradient sums dim*4 B; count exchange 8 B per peer; two 24-byte "
                 "all-reduces (agreements) of ceil(log2 N) rounds",
        "symmetry": "a host receives as many bytes as it sends (expectation)",
        "demo_full_step_ms": args.demo_step_ms, "embedding_only_ms": measured,
        "effective_rate_this_machine_GBps": rate_measured / 1e9, "server_rate_GBps": args.server_rate / 1e9,
        "latency_us_per_message": args.latency_us,
        "production": "100 tables, V = 1e6 or 1e7 rows each, dim 128, 65,536 samples/host/step, 1 id per table "
                      "and sample, power law exponent 1.1, compute = touched bytes / effective rate, dense model "
                      "not counted",
    }
    return out


def fmt_bytes(x):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f} B"


def fmt_bw(bps):
    if bps is None:
        return "none (latency > compute)"
    return f"{bps / 1e9:,.3f} GB/s ({gbit(bps):,.2f} Gb/s)"


def print_tables(out):
    a = out["assumptions"]
    for key, w in out["workloads"].items():
        print(f"\n## {w['description']}")
        print(f"unique ids per host per step: {w['unique_per_host']:,.0f} (occurrences {w['occurrences_per_host']:,.0f}); "
              f"compute per step: " + ", ".join(f"{k} {v:,.1f} ms" for k, v in w["compute_ms"].items()))
        be = [k for k in w["rows"][0] if k.startswith("break_even")]
        names = [k.replace("break_even_Bps_", "break-even vs ").replace("_with_latency", " + latency")
                 for k in be]
        print("| N | remote | ids | rows | grad sums | counts + agreements | sent = recv per host | ids/peer | messages | "
              + " | ".join(names) + f" | latency floor ({a['latency_us_per_message']:g} us/msg) | "
              "per table (before): sent, messages, floor | memory/host |")
        print("| ---: " * (12 + len(be)) + "|")
        for r in w["rows"]:
            p = r["per_table"]
            print(f"| {r['N']} | {r['remote_fraction']:.3f} | {fmt_bytes(r['ids_bytes'])} | {fmt_bytes(r['rows_bytes'])} | "
                  f"{fmt_bytes(r['grad_bytes'])} | {fmt_bytes(r['counts_bytes'] + r['agreement_bytes'])} | "
                  f"{fmt_bytes(r['sent_bytes'])} | {r['ids_per_peer']:,.1f} | {r['messages']:,.0f} | "
                  + " | ".join(fmt_bw(r[k]) for k in be) + f" | {r['latency_floor_ms']:,.2f} ms | "
                  f"{fmt_bytes(p['sent_bytes'])}, {p['messages']:,.0f}, {p['latency_floor_ms']:,.2f} ms | "
                  f"{fmt_bytes(w['memory_per_host_bytes'][r['N']])} |")
        if "unique_per_table_sampled" in w:
            print(f"unique ids per table: expected {w['unique_per_table']:,.0f}, one sampled batch "
                  f"{w['unique_per_table_sampled']:,}")
        if "remote_fraction_sampled" in w["rows"][0]:
            print("remote fraction from the sampled ids and the real owner rule: " +
                  ", ".join(f"N={r['N']}: {r['remote_fraction_sampled']:.3f}" for r in w["rows"]))
    print("\nproduction: expected unique ids of 65,536 draws (s = 1.1) per table of V rows: " +
          ", ".join(f"V={k}: {v:,.0f}" for k, v in out["production_unique_vs_vocabulary"].items()))
    print("\nkey numbers (sent = received per host per step; break-even bandwidth per direction):")
    for key, w in out["workloads"].items():
        first, last = w["rows"][0], w["rows"][-1]
        be = [k for k in first if k.startswith("break_even") and "latency" not in k]
        print(f"  {key}: N=2 {fmt_bytes(first['sent_bytes'])}, N=1024 {fmt_bytes(last['sent_bytes'])}; break-even "
              + "; ".join(f"{k.replace('break_even_Bps_', '')}: N=2 {fmt_bw(first[k])}, N=1024 {fmt_bw(last[k])}"
                          for k in be))
    print(f"effective embedding rate measured on this machine (demo workload, scale 1): "
          f"{a['effective_rate_this_machine_GBps']:.2f} GB/s; assumed server rate {a['server_rate_GBps']:.0f} GB/s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--bench-json", default=None,
                   help="a bench_distributed.py --baseline JSON (K=1): use its measured embedding-only time")
    p.add_argument("--demo-step-ms", type=float, default=DEMO_STEP_MS)
    p.add_argument("--server-rate", type=float, default=100e9, help="bytes/s (default 100e9)")
    p.add_argument("--latency-us", type=float, default=LATENCY_US)
    args = p.parse_args(argv)
    out = model(args)
    print_tables(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=float)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
